"""Decode steps per launch: time to first token against throughput.

For each `--steps` value, SmolLM2-135M-Instruct (float32) on `pj.LLM` with
`num_decode_steps` set to it serves bench_vs_peers.py's online workload (32
chat prompts arriving as a Poisson process at 4/s) and its offline one (32
prompts x 64 tokens, greedy). A request that arrives during a launch waits
for the launch to end before its prompt runs, so fewer steps per launch
answer sooner; more steps spread the host's work per launch over more
tokens. Prints, per value, the median over `--repeats` warm runs of the
trace's tokens/s, mean time to first token and mean inter-token latency,
and the offline tokens/s.

`--arrival-check on off` runs each value twice, with and without the
engine's arrival check (`stop_decode_on_arrival`; a thread tells the
engine of each online arrival at its time, as the server does), their runs
alternating: what the check saves in time to first token and costs per
decode step (offline tokens/s, where no request arrives mid-launch).

Usage: python benchmarks/bench_decode_steps.py [--steps 8 2] [--repeats 2]
  [--arrival-check on off]
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import numpy as np
from bench_engine import serve_trace
from bench_vs_peers import BLOCK_SIZE, MODEL, build_workloads

import paged_jax as pj
from paged_jax.models import load_pretrained

MAX_SEQ_LEN = 256


def engine(model, tokenizer, steps: int, arrival_check: bool = False) -> pj.LLM:
  blocks = -(-MAX_SEQ_LEN // BLOCK_SIZE)
  cfg = pj.CacheConfig(
    block_size=BLOCK_SIZE,
    num_gpu_blocks=32 * blocks,
    num_cpu_blocks=0,
    max_seqs=32,
    max_blocks_per_seq=blocks,
    enable_prefix_caching=True,
  )
  return pj.LLM(
    model,
    tokenizer,
    cfg,
    warmup=True,
    num_decode_steps=steps,
    stop_decode_on_arrival=arrival_check,
  )


def measure(llms: list[pj.LLM], workloads, repeats: int) -> list[dict[str, float]]:
  """The medians of each of `llms`, whose runs alternate."""
  online, offline = workloads["online"], workloads["offline"]
  prompts = [np.asarray(p, np.int32) for p in online.prompts]
  params = pj.SamplingParams(max_tokens=offline.max_tokens, ignore_eos=True)
  runs = [[] for _ in llms]
  for index in range(repeats + 1):  # the first run warms up
    for llm, kept in zip(llms, runs):
      trace = serve_trace(llm.engine, prompts, online.max_tokens, online.arrivals, True)
      start = time.perf_counter()
      llm.generate(offline.prompts, params)
      seconds = time.perf_counter() - start
      if index:
        kept.append(
          dict(
            online_tokens_per_s=trace["tokens"] / trace["wall"],
            ttft_s=float(np.mean(trace["ttft"])),
            itl_s=float(np.mean(trace["itl"])),
            offline_tokens_per_s=len(offline.prompts) * offline.max_tokens / seconds,
          )
        )
  return [{key: statistics.median(run[key] for run in kept) for key in kept[0]} for kept in runs]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, nargs="+", default=[8, 2])
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--arrival-check", choices=["on", "off"], nargs="+", default=["off"])
  args = parser.parse_args()
  model, tokenizer = load_pretrained(MODEL, dtype="float32", max_seq_len=MAX_SEQ_LEN)[:2]
  shape = types.SimpleNamespace(quick=False, requests=32, rate=4.0, seed=0)
  workloads = build_workloads(tokenizer, shape, MAX_SEQ_LEN)
  print(
    "| steps per launch | arrival check | online tokens/s | TTFT s | ITL s | offline tokens/s |"
  )
  print("| ---: | --- | ---: | ---: | ---: | ---: |")
  for steps in args.steps:
    llms = [engine(model, tokenizer, steps, check == "on") for check in args.arrival_check]
    for check, m in zip(args.arrival_check, measure(llms, workloads, args.repeats)):
      print(
        f"| {steps} | {check} | {m['online_tokens_per_s']:.1f} | {m['ttft_s']:.2f} "
        f"| {m['itl_s']:.3f} | {m['offline_tokens_per_s']:.1f} |",
        flush=True,
      )


if __name__ == "__main__":
  main()
