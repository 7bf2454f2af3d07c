"""An online trace before and after warm-up, side by side in one run.

Requests arrive as a Poisson process with ShareGPT-like lengths
(`paged_jax.simulate`, as in bench_engine.py) at each `--rate`, and are
served by `pj.LLMEngine` step by step, twice per rate:

* before: the engine as it started before warm-up existed, with the
  persistent compilation cache off and JAX's in-memory caches cleared, so
  every program (each prefill bucket, the decode loop) compiles when the
  trace first needs it, in the middle of serving;
* after: `warmup=True` on the same config (its start time is reported), then
  the same trace.

Reports per run the compiles during the trace, throughput, TTFT and ITL
(per request, the mean gap between its tokens after the first) at p50/p99,
and the share of prefill positions that were bucket padding.

Usage: python benchmarks/bench_warmup.py [--model smollm2|tiny] [--rates 0.5 1]
       [--requests 16] [--batch 16]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from bench_engine import load_model, make_engine, serve_trace, workload

from paged_jax import compilation_cache, compile_guard


def percentile_pair(values) -> str:
  values = np.asarray(values) * 1e3
  return f"{np.percentile(values, 50):.0f} / {np.percentile(values, 99):.0f}"


def run(model, cfg, trace, args, warmup: bool) -> dict:
  """One served trace; `warmup` False starts with every cache empty."""
  jax.clear_caches()
  start = time.perf_counter()
  engine = make_engine(model, cfg, args, warmup)
  started = time.perf_counter() - start
  with compile_guard.count_compiles() as compiles:
    result = serve_trace(engine, *trace)
  return dict(result, start_s=started, compiles=len(compiles))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
  parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0], help="requests/s")
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--batch", type=int, default=16, help="max_num_seqs")
  parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
  parser.add_argument("--decode-steps", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  compilation_cache.enable("")  # "before" must compile; "after" warms up from nothing
  model = load_model(args.model)
  prompts, output_lens, cfg, _ = workload(model, args.requests, args.batch, args.seed)
  prompt_lens = np.array([p.size for p in prompts])
  print(
    f"{args.model}: {args.requests} requests, mean prompt {prompt_lens.mean():.0f}, mean "
    f"output {output_lens.mean():.0f} tokens, max_num_seqs {args.batch}, budget {args.budget}"
  )
  print(
    "| rate | run | start s | compiles in trace | out tok/s | TTFT ms p50 / p99 "
    "| ITL ms p50 / p99 | prefill padding |"
  )
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for rate in args.rates:
    arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1.0 / rate, args.requests))
    for name, warmup in (("before (no warm-up)", False), ("after (warm-up)", True)):
      result = run(model, cfg, (prompts, output_lens, arrivals), args, warmup)
      print(
        f"| {rate:g} | {name} | {result['start_s']:.1f} | {result['compiles']} "
        f"| {result['tokens'] / result['wall']:.1f} | {percentile_pair(result['ttft'])} "
        f"| {percentile_pair(result['itl'])} | {result['stats'].prefill_padding:.0%} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
