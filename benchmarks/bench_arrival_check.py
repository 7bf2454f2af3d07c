"""The arrival check's cost per decode step: offline decoding with and without it.

Two engines of one configuration, one with `stop_decode_on_arrival` (the
flag read before each decode step: a C++ one on CPU) and one without,
serve the same offline batch (`--requests` prompts x `--tokens` tokens,
greedy, all added up front, so no launch ends early), their runs
alternating. Prints, per engine, the
median over `--repeats` warm runs of the wall time per decode step (the
batch's time over its decode steps, prefill included) and the tokens/s,
then the difference per step.

Usage: python benchmarks/bench_arrival_check.py [--model tiny|smollm2]
  [--requests 8] [--tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_engine import load_model

import paged_jax as pj


def make_llm(model, requests: int, tokens: int, check: bool) -> pj.LLM:
  block_size = 16
  blocks = -(-(16 + tokens) // block_size)
  cfg = pj.CacheConfig(
    block_size=block_size,
    num_gpu_blocks=requests * blocks,
    num_cpu_blocks=0,
    max_seqs=requests,
    max_blocks_per_seq=blocks,
  )
  return pj.LLM(model, None, cfg, warmup=True, stop_decode_on_arrival=check)


def run(llm: pj.LLM, prompts, params) -> tuple[float, int]:
  """Seconds and decode steps of one offline batch."""
  steps = llm.engine.stats.decode_steps
  start = time.perf_counter()
  llm.generate(prompts, params)
  return time.perf_counter() - start, llm.engine.stats.decode_steps - steps


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
  parser.add_argument("--requests", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  model = load_model(args.model)
  prompts = [[1 + (i * 7 + j) % 50 for j in range(16)] for i in range(args.requests)]
  params = pj.SamplingParams(max_tokens=args.tokens, ignore_eos=True)
  llms = {check: make_llm(model, args.requests, args.tokens, check) for check in (True, False)}
  runs = {check: [] for check in llms}
  for index in range(args.repeats + 1):  # the first run warms up
    for check, llm in llms.items():
      seconds, steps = run(llm, prompts, params)
      if index:
        runs[check].append((seconds / steps, args.requests * args.tokens / seconds))
  medians = {
    check: [statistics.median(column) for column in zip(*kept)] for check, kept in runs.items()
  }
  print("| arrival check | wall ms per decode step | tokens/s |")
  print("| --- | ---: | ---: |")
  for check, (per_step, tokens_per_s) in medians.items():
    print(f"| {'on' if check else 'off'} | {per_step * 1e3:.3f} | {tokens_per_s:.0f} |")
  difference = medians[True][0] - medians[False][0]
  print(f"on - off: {difference * 1e6:+.0f} us per step ({difference / medians[False][0]:+.1%})")


if __name__ == "__main__":
  main()
