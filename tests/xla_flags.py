"""XLA flags for the test run, kept only where the running XLA knows them.

XLA aborts the process on a flag it does not know ("Unknown flag in
XLA_FLAGS"), and flags come and go between JAX releases: JAX 0.12's XLA
dropped `--xla_cpu_use_fusion_emitters`. Each wanted flag is tried once in a
child process that starts JAX's CPU backend; the ones it survives are kept.
"""

import os
import subprocess
import sys

# XLA:CPU's quickest compiles for every program the run compiles: compile
# time dominates the suite (small models, run briefly). LLVM's -O0 without its
# expensive passes, and (where XLA still has them) the classic elemental
# emitters in place of the fusion emitters, together halve an engine's
# backend compile time. Every comparison is made within the run.
WANTED = (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
  "--xla_cpu_use_fusion_emitters=false",
)
_START_BACKEND = "import jax; jax.devices('cpu')"
_PROBED_ENV = "PAGED_JAX_TEST_XLA_FLAGS"  # the probe's answer, for child processes


def _start_probe(flag: str) -> subprocess.Popen:
  """A child JAX process that starts its CPU backend with `flag` in XLA_FLAGS."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  return subprocess.Popen(
    [sys.executable, "-c", _START_BACKEND],
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )


def accepted_flags(wanted=WANTED) -> str:
  """The flags of `wanted` that the running XLA accepts, space-separated.

  One child process per flag, all at once (a probe is mostly JAX's import).
  The answer is kept in the environment, so the run's workers and
  subprocesses inherit it instead of probing again.
  """
  if _PROBED_ENV in os.environ:
    return os.environ[_PROBED_ENV]
  probes = [(flag, _start_probe(flag)) for flag in wanted]
  joined = " ".join(flag for flag, probe in probes if probe.wait(timeout=120) == 0)
  os.environ[_PROBED_ENV] = joined
  return joined
