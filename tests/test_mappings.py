"""A served engine's programs stay far from the process's memory-mapping limit.

XLA:CPU maps the code of every compiled program into the process; Linux caps
a process's mappings at `vm.max_map_count` (65,530 by default), and past it
the next compile dies ("LLVM ERROR: Unable to allocate section memory").
The test warms the SmolLM2 `serve` engine up in a fresh process with an
empty compilation cache, every option of the largest configuration on (the
serve defaults' 32 sequences and 512-token budget, async scheduling), and
counts the mappings then. tests/test_server.py counts the tiny server's.
"""

import os
import subprocess
import sys

import pytest

WARM_UP = """
import sys
from paged_jax.__main__ import _parser
from paged_jax.server import cli

args = _parser().parse_args(["serve", *sys.argv[1:]])
built = cli.engine_builder(args)()
model_programs = [
  name
  for name in built.engine.compiled_programs()
  if name.startswith(("ragged step", "prefill", "decode loop", "speculating decode loop"))
]
print(len(model_programs), len(open("/proc/self/maps").readlines()))
"""


def _programs_and_mappings(*serve_args: str, cache_dir: str | None = None) -> tuple[int, int]:
  env = dict(os.environ)
  if cache_dir is not None:
    env["PAGED_JAX_CACHE_DIR"] = cache_dir
  done = subprocess.run(
    [sys.executable, "-c", WARM_UP, *serve_args],
    capture_output=True,
    text=True,
    timeout=1200,
    env=env,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  programs, mappings = done.stdout.split()[-2:]
  return int(programs), int(mappings)


def map_limit() -> int:
  with open("/proc/sys/vm/max_map_count") as limit:
    return int(limit.read())


@pytest.mark.slow
def test_the_smollm2_servers_warm_up_maps_under_half_the_limit(tmp_path):
  # An empty compilation cache: every program compiles in this process.
  programs, mappings = _programs_and_mappings(
    "--model",
    "smollm2-135m-instruct",
    "--dtype",
    "bfloat16",
    "--quantization",
    "none",
    "--async-scheduling",
    cache_dir=str(tmp_path),
  )
  assert programs <= 12
  assert mappings < map_limit() // 2
