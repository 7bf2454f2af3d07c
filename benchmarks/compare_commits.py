"""Offline engine throughput of the working tree against another commit.

Checks out ``--base`` into a temporary git worktree and serves the same
prompts with ``pj.LLM`` (greedy, ``ignore_eos``) in a fresh process per run,
alternating base and working tree ``--rounds`` times, so that both see the
same machine load; reports each side's best tokens/s and their ratio, and the
first run's seconds (compiles included). Each run then times a second
identical ``generate``.

Usage: python benchmarks/compare_commits.py [--base 3ecaad2] [--rounds 2]
       [--requests 32] [--prompt-len 24] [--max-tokens 48] [--batch 32]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

RUN = """
import json, sys, time
import numpy as np
import paged_jax as pj
from paged_jax.models import load_tiny
requests, prompt_len, max_tokens, batch = (int(a) for a in sys.argv[1:5])
model = load_tiny()
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 258, prompt_len).astype(np.int32)
           for _ in range(requests)]
blocks = -(-(prompt_len + max_tokens) // 16)
cfg = pj.CacheConfig(block_size=16, num_gpu_blocks=batch * blocks + 8,
                     num_cpu_blocks=batch * blocks, max_seqs=batch,
                     max_blocks_per_seq=blocks)
llm = pj.LLM(model, None, cfg, num_decode_steps=16)
params = pj.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
start = time.perf_counter()
llm.generate(prompts, params)
first = time.perf_counter() - start
start = time.perf_counter()
outs = llm.generate(prompts, params)
seconds = time.perf_counter() - start
print(json.dumps(dict(tokens_per_s=requests * max_tokens / seconds,
                      first_run_s=first,
                      tokens=[o.outputs[0].token_ids for o in outs])))
"""


def run(tree: pathlib.Path, args) -> dict:
  env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [
      sys.executable,
      "-c",
      RUN,
      str(args.requests),
      str(args.prompt_len),
      str(args.max_tokens),
      str(args.batch),
    ],
    cwd=tree,
    env=env,
    check=True,
    capture_output=True,
    text=True,
  ).stdout
  return json.loads(out.strip().splitlines()[-1])


@contextlib.contextmanager
def checked_out(commit: str):
  """The path of a temporary git worktree of `commit`, removed on exit."""
  with tempfile.TemporaryDirectory() as tmp:
    tree = pathlib.Path(tmp) / "base"
    git = lambda *args: subprocess.run(
      ["git", "worktree", *args], cwd=ROOT, check=True, capture_output=True
    )
    git("add", "--detach", str(tree), commit)
    try:
      yield tree
    finally:
      git("remove", "--force", str(tree))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", default="3ecaad2")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--requests", type=int, default=32)
  parser.add_argument("--prompt-len", type=int, default=24)
  parser.add_argument("--max-tokens", type=int, default=48)
  parser.add_argument("--batch", type=int, default=32)
  args = parser.parse_args()
  with checked_out(args.base) as base_tree:
    speeds = {"base": [], "tree": []}
    first = {"base": [], "tree": []}
    tokens = {}
    for _ in range(args.rounds):
      for name, tree in (("base", base_tree), ("tree", ROOT)):
        result = run(tree, args)
        speeds[name].append(result["tokens_per_s"])
        first[name].append(result["first_run_s"])
        tokens[name] = result["tokens"]
  best = {name: max(values) for name, values in speeds.items()}
  print(
    f"{args.requests} requests x ({args.prompt_len} prompt + "
    f"{args.max_tokens} tokens), max_num_seqs {args.batch}, tiny model"
  )
  for name, values in speeds.items():
    print(
      f"{name:>5}: "
      + ", ".join(f"{v:.0f}" for v in values)
      + f" tok/s (best {best[name]:.0f}); first run with compiles "
      + ", ".join(f"{v:.1f}" for v in first[name])
      + " s"
    )
  print(
    f"tree / base: {best['tree'] / best['base']:.2f}x; same tokens: "
    f"{tokens['tree'] == tokens['base']}"
  )


if __name__ == "__main__":
  main()
