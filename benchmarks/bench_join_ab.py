"""The cost of a step with prompt work, the working tree against another
commit, alternating step by step.

Each tree gets a live process with SmolLM2's `serve`-default engine
(bfloat16, float weights) in which `--rows` requests decode. On each turn a
process takes one 200-token arrival: the ragged step that runs its prompt
beside the decoding rows (milliseconds of `ModelRunner.ragged_step`), then
one more step (decode only). The two processes take turns, in alternating
order, `--rounds` times, so both see the same machine load: this machine
swings by tens of milliseconds between runs of one process, more than the
changes to measure. Prints each tree's medians and their ratio.

  python benchmarks/bench_join_ab.py --base 9486bec [--rounds 20] [--rows 16]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from compare_commits import ROOT, checked_out  # noqa: E402

WORKER = """
import sys, time
import numpy as np
import paged_jax as pj
sys.path.insert(0, "benchmarks")
from bench_prompt_buckets import build_engine
engine = build_engine("bfloat16")
rng = np.random.default_rng(0)
prompt = lambda: rng.integers(100, 40000, 200).astype(np.int32)
runner = engine.runner
ragged_step, times = runner.ragged_step, []
def timed(*args, **kwargs):
  start = time.perf_counter()
  out = ragged_step(*args, **kwargs)
  times.append(time.perf_counter() - start)
  return out
runner.ragged_step = timed
for i in range(int(sys.argv[1])):
  engine.add_request(f"row{i}", prompt(), pj.SamplingParams(max_tokens=10**6, ignore_eos=True))
while True:  # until every row's prompt ran: a step with no prompt work
  before = len(times)
  engine.step()
  if len(times) == before:
    break
print("ready", flush=True)
for turn, _ in enumerate(sys.stdin):
  engine.add_request(f"arrival{turn}", prompt(), pj.SamplingParams(max_tokens=1, ignore_eos=True))
  engine.step()
  start = time.perf_counter()
  engine.step()
  print(times[-1] * 1e3, (time.perf_counter() - start) * 1e3, flush=True)
"""


def start_worker(tree: pathlib.Path, rows: int) -> subprocess.Popen:
  """A worker process on `tree`, once its engine is warm."""
  env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
  worker = subprocess.Popen(
    [sys.executable, "-c", WORKER, str(rows)],
    cwd=tree,
    env=env,
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
  )
  for line in worker.stdout:
    if line.strip() == "ready":
      return worker
  raise RuntimeError(f"the worker on {tree} ended before its engine was ready")


def turn(worker: subprocess.Popen) -> tuple[float, float]:
  """One arrival's ragged step and the decode step after it, in ms."""
  worker.stdin.write("go\n")
  worker.stdin.flush()
  join, decode = map(float, worker.stdout.readline().split())
  return join, decode


def compare(trees: dict, rows: int, rounds: int) -> dict:
  """Each tree's (join, decode) milliseconds per turn, turns alternating."""
  workers = {name: start_worker(tree, rows) for name, tree in trees.items()}
  try:
    times = {name: [] for name in trees}
    order = list(trees)
    for round_ in range(rounds + 1):  # the first round warms both up, unrecorded
      for name in order if round_ % 2 == 0 else order[::-1]:
        result = turn(workers[name])
        if round_ > 0:
          times[name].append(result)
    return times
  finally:
    for worker in workers.values():
      worker.stdin.close()
      worker.wait()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", required=True, help="the commit to compare against")
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--rows", type=int, default=16, help="requests decoding beside each arrival")
  args = parser.parse_args()
  with checked_out(args.base) as base_tree:
    times = compare({"base": base_tree, "tree": ROOT}, args.rows, args.rounds)
  print(f"a 200-token arrival beside {args.rows} decoding rows, {args.rounds} turns each")
  print("| tree | arrival's ragged step p50 (ms) | decode step after it p50 (ms) |")
  print("|---|---:|---:|")
  medians = {}
  for name, turns in times.items():
    medians[name] = statistics.median(join for join, _ in turns)
    decode = statistics.median(step for _, step in turns)
    print(f"| {name} | {medians[name]:.1f} | {decode:.1f} |")
  print(f"tree / base, ragged step: {medians['tree'] / medians['base']:.3f}x")


if __name__ == "__main__":
  main()
