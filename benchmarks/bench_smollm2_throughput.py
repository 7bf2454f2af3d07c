"""SmolLM2-135M-Instruct throughput of `pj.LLM` on one engine shape.

Serves `--slots` prompts at once (one per sequence slot; `--slots 1 --requests
1` is a single stream on a 1-slot engine, `--requests 1` alone one stream on a
`--slots` engine), `--max-tokens` each, greedy, `ignore_eos`, after warm-up;
prints the best of `--repeats` runs in tokens/s, the first tokens of the first
outputs (to compare two trees' greedy tokens), the engine's padding, the
share of its rounds' wall time spent outside the launches (the host's), and
the share of the runs' wall time in which the device waited for the host
(`device_idle.py`). To compare two checkouts side by side, run it with
`PYTHONPATH=<checkout>` for each, back to back; to compare the host and the
device overlapped, with and without `--async-scheduling`.

Usage: python benchmarks/bench_smollm2_throughput.py [--dtype float32]
       [--slots 32] [--requests 32] [--max-tokens 64] [--max-blocks-per-seq 32]
       [--async-scheduling]
"""

from __future__ import annotations

import argparse
import time

from device_idle import watch_launches

import paged_jax as pj
from paged_jax import models


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--requests", type=int, default=None, help="default: --slots")
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--max-blocks-per-seq", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--async-scheduling", action="store_true")
  args = parser.parse_args()
  requests = args.slots if args.requests is None else args.requests
  model, tokenizer = models.load_pretrained(
    "smollm2-135m-instruct", dtype=args.dtype, max_seq_len=16 * args.max_blocks_per_seq
  )[:2]
  cfg = pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=args.slots * args.max_blocks_per_seq + 8,
    max_seqs=args.slots,
    max_blocks_per_seq=args.max_blocks_per_seq,
  )
  llm = pj.LLM(model, tokenizer, cfg, warmup=True, async_scheduling=args.async_scheduling)
  prompts = [
    f"Write a short story about a robot who learns to paint. Number {i}." for i in range(requests)
  ]
  params = pj.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
  times, idle = [], []
  for _ in range(args.repeats):
    with watch_launches() as watch:
      start = time.perf_counter()
      outputs = llm.generate(prompts, params)
      times.append(time.perf_counter() - start)
    idle.append(watch.idle_share())
  stats, timing = llm.engine.stats, llm.engine.timing
  print(
    f"{args.dtype}, {requests} requests on {args.slots} slots: "
    f"{requests * args.max_tokens / min(times):.1f} tokens/s (runs: "
    f"{', '.join(f'{t:.1f} s' for t in times)}); decode padding {stats.decode_padding:.0%}, "
    f"prefill padding {stats.prefill_padding:.0%}; host share of the rounds' wall time "
    f"{1 - timing['device_s'] / timing['wall_s']:.1%} over {timing['rounds']} rounds; "
    f"device idle {', '.join(f'{share:.1%}' for share in idle)} of the runs' wall time; "
    f"{stats.loop_launches_ahead} of {stats.loop_launches} launches ran ahead"
  )
  print("first tokens:", [o.outputs[0].token_ids[:8] for o in outputs[:2]])


if __name__ == "__main__":
  main()
