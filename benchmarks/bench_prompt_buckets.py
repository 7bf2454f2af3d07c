"""Filling prompt buckets: the HTTP benchmark's 4 requests/s trace in process,
with and without `packing.filled_budget`.

The serve-default engine (`paged_jax.server.cli.engine_builder`: SmolLM2,
`--quantization none`, `--max-model-len 512`) serves `--requests` prompts of
200 random tokens, 64 tokens each (`ignore_eos`), arriving as a Poisson
process at `--rate`, on `bench_engine.serve_trace`; each round draws
arrival times that both runs of it share, and each run fresh prompts (so
the prefix cache does not hit). The engine's rounds
fill their prompt buckets on CPU; the "pad" rows clear the schedulers'
`token_buckets`, so each round plans its whole budget as before. Runs
alternate, fill first. Prints per run the output tokens/s, TTFT p50, ITL
p50 and the share of prompt positions that were padding.

Usage: python benchmarks/bench_prompt_buckets.py [--dtype bfloat16]
  [--rate 4] [--requests 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
from bench_engine import serve_trace

from paged_jax.server import cli


def build_engine(dtype: str):
  parser = argparse.ArgumentParser()
  cli.add_parser(parser.add_subparsers())
  args = parser.parse_args(
    ["serve", "--model", "smollm2-135m-instruct", "--dtype", dtype, "--quantization", "none"]
    + ["--max-model-len", "512"]
  )
  return cli.engine_builder(args)().engine


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--rate", type=float, default=4.0)
  parser.add_argument("--requests", type=int, default=48)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  engine = build_engine(args.dtype)
  buckets = engine.schedulers[0].token_buckets
  rng = np.random.default_rng(0)
  print("| rounds plan | tok/s | TTFT p50 (ms) | ITL p50 (ms) | prompt padding |")
  print("| --- | ---: | ---: | ---: | ---: |")
  for _ in range(args.rounds):
    arrivals = np.cumsum(rng.exponential(1 / args.rate, args.requests))
    for label, token_buckets in (("filled buckets", buckets), ("whole budget", None)):
      for scheduler in engine.schedulers:
        scheduler.token_buckets = token_buckets
      prompts = [rng.integers(100, 40000, 200).astype(np.int32) for _ in range(args.requests)]
      before = engine.stats
      run = serve_trace(engine, prompts, [64] * args.requests, arrivals - arrivals[0])
      after = engine.stats
      tokens = after.prefill_tokens - before.prefill_tokens
      positions = after.prefill_positions - before.prefill_positions
      print(
        f"| {label} | {run['tokens'] / run['wall']:.1f} "
        f"| {statistics.median(run['ttft']) * 1e3:,.0f} "
        f"| {statistics.median(run['itl']) * 1e3:,.0f} | {1 - tokens / positions:.1%} |"
      )


if __name__ == "__main__":
  main()
