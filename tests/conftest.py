"""Shared pytest fixtures, XLA's flags and one compilation cache for the whole run."""

import gc
import os
import shutil
import tempfile

from tests.xla_flags import accepted_flags

# XLA:CPU's quickest compiles (tests/xla_flags.py), those the running XLA
# knows. Set before JAX starts a backend, so the xdist workers and every
# subprocess a test starts inherit them, and the persistent cache below
# serves all of them alike.
FAST_COMPILE = accepted_flags()
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from paged_jax import compilation_cache  # noqa: E402
from tests.jax_adapter import JaxManager  # noqa: E402
from tests.reference.block_manager import ReferenceBlockSpaceManager  # noqa: E402

_RUN_CACHE_DIR = pytest.StashKey[str]()  # set on the process that made the directory
SHARED_CACHE_ENV = "PAGED_JAX_TEST_SHARED_CACHE"  # "0": no cache for the run


def pytest_configure(config):
  """Sets the persistent compilation cache of every test process.

  The controller makes one fresh directory for the run, inherited through
  ``PAGED_JAX_CACHE_DIR`` by the xdist workers and every subprocess a test
  starts, so a program compiled once anywhere (an engine in one worker, a
  server's warm-up, a notebook) is read back everywhere else. A
  ``PAGED_JAX_CACHE_DIR`` set before the run is used as it is;
  ``PAGED_JAX_TEST_SHARED_CACHE=0`` runs without a cache.
  """
  if not hasattr(config, "workerinput") and compilation_cache.CACHE_DIR_ENV not in os.environ:
    if os.environ.get(SHARED_CACHE_ENV) == "0":
      os.environ[compilation_cache.CACHE_DIR_ENV] = ""
    else:
      run_dir = tempfile.mkdtemp(prefix="paged_jax_test_cache_")
      os.environ[compilation_cache.CACHE_DIR_ENV] = run_dir
      config.stash[_RUN_CACHE_DIR] = run_dir
  compilation_cache.enable()


# Below Linux's default `vm.max_map_count` (65,530) with room for one module.
MAX_MAPPINGS = 30_000


def _num_mappings() -> int:
  try:
    with open(f"/proc/{os.getpid()}/maps", "rb") as maps:
      return maps.read().count(b"\n")
  except OSError:  # no procfs (macOS): count as full
    return MAX_MAPPINGS


@pytest.fixture(scope="module", autouse=True)
def release_compiled_programs():
  """Drops JAX's in-memory caches after a module that leaves the process
  with many memory mappings.

  Every XLA:CPU executable keeps memory mappings of its code, and the jit
  caches keep every executable alive: a worker that has run a few hundred
  engine tests nears Linux's 65,530 mappings per process (`vm.max_map_count`),
  and XLA then crashes in its next compile. Below `MAX_MAPPINGS` the caches
  stay, so later modules reuse the programs they share without tracing them
  again; past it, a later module that needs a program reads it back from
  the run's persistent cache.
  """
  yield
  if _num_mappings() >= MAX_MAPPINGS:
    jax.clear_caches()
    gc.collect()


def pytest_unconfigure(config):
  """Removes the run's cache directory (on the controller, after the workers)."""
  run_dir = config.stash.get(_RUN_CACHE_DIR, None)
  if run_dir is not None:
    shutil.rmtree(run_dir, ignore_errors=True)
    del os.environ[compilation_cache.CACHE_DIR_ENV]


# Tests that run for tens of seconds, longest first: the 8-device sharding
# run (the session fixture `meshes`), the two-process run, SmolLM2, the TPU
# compiles, the notebooks, the engine starts in subprocesses, the demo and
# the tiny server;
# then the modules of 15 s or more (about, in CI), longest first.
LONG_TESTS = (
  "meshes",
  "tests/test_sharding.py::test_two_processes_give_the_one_device_tokens",
  "smollm2",
  "tests/test_aot.py::",
  "tests/test_notebook.py::",
  "tests/test_rl.py::",
  "tests/test_compilation_cache.py::test_a_second_start",
  "tests/test_demo.py::test_demo_json_report",
  "tests/test_server.py::",
  "tests/test_soak.py::",
  "tests/test_structured_engine.py::",
  "tests/test_speculative.py::",
  "tests/test_beam_search.py::",
  "tests/test_engine.py::",
  "tests/test_step_stream.py::",
  "tests/test_families",  # test_families.py and its test_families_*.py
  "tests/test_differential.py::",
  "tests/test_kernels_paged_attention.py::",
  "tests/test_generate.py::",
  "tests/test_prompt_logprobs.py::",
  "tests/test_quant_kv.py::",
)
# Tests that run on the worker of another module, whose engine config or
# jitted functions they share (the jit caches of one process serve both): the
# demo's JSON test builds the tiny server's engine, test_engine_random
# test_engine's; the modules a long test file was split into run together,
# as the one file did.
SHARED_SCOPES = {
  "tests/test_demo.py::test_demo_json_report": "tests/test_server.py",
  "tests/test_engine_random.py": "tests/test_engine.py",
  "tests/test_families_": "tests/test_families.py",
  "tests/test_pretrained_": "tests/test_pretrained.py",
}


def _rank(item) -> int:
  """Where `item` goes: the index of the first of LONG_TESTS it matches (a
  fixture it uses, or the start of its node id), or after them all."""
  for rank, pattern in enumerate(LONG_TESTS):
    if pattern in item.fixturenames or item.nodeid.startswith(pattern):
      return rank
  return len(LONG_TESTS)


def pytest_collection_modifyitems(items):
  """Puts the long tests first, longest first, and the rest after them.

  With `--dist loadscope --no-loadscope-reorder` pytest-xdist hands out
  whole modules in the order of their first test, so the long ones start at
  once and the short ones fill in around them, instead of one long module
  starting late and leaving a worker busy alone at the end.
  """
  items.sort(key=_rank)


def pytest_xdist_make_scheduler(config, log):
  """Scheduling by module (each module's programs compile on one worker),
  the `SHARED_SCOPES` with the module they share programs with."""
  if config.getoption("dist") != "loadscope":
    return None
  from xdist.scheduler import LoadScopeScheduling

  class SharedScopeScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      for prefix, scope in SHARED_SCOPES.items():
        if nodeid.startswith(prefix):
          return scope
      return super()._split_scope(nodeid)

  return SharedScopeScheduling(config, log)


@pytest.fixture(
  params=[
    pytest.param(ReferenceBlockSpaceManager, id="reference"),
    pytest.param(JaxManager, id="jax-jit"),
  ]
)
def manager_factory(request):
  """A callable ``cfg -> manager`` with the reference manager's interface."""
  return request.param


@pytest.fixture(scope="module")
def bpe():
  """A small byte-level BPE tokenizer (`tests.checkpoint_files.train_bpe`),
  once per module, for the checkpoints the loader's tests write."""
  from tests.checkpoint_files import train_bpe

  return train_bpe()


@pytest.fixture(scope="module")
def family_weights():
  """`{family: weights}` of `tests.family_checkpoints.FAMILIES`, once per module."""
  import numpy as np

  from tests.family_checkpoints import FAMILIES, random_weights

  rng = np.random.default_rng(10)
  return {family: random_weights(hf, rng) for family, hf in FAMILIES.items()}
