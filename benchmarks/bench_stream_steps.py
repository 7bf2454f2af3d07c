"""Streamed decode steps' cost: a decoding batch with and without them.

Two engines of one configuration, one with `stream_steps` (each step of a
decode launch published and taken while the launch runs, its outputs
handed to `on_decode_step` as a server's are) and one without, serve the
same batch (`--requests` prompts x `--tokens` tokens, greedy, EOS ignored,
all added up front; the SmolLM2 tokenizer detokenizes, as a server does),
their runs alternating. Prints per engine the median over `--repeats` warm
runs of the tokens/s, the median gap between two outputs of one request
(what a streaming client waits for its next tokens), and the ratio.

Usage: python benchmarks/bench_stream_steps.py [--dtype float32|bfloat16]
  [--requests 16] [--tokens 64] [--repeats 3] [--num-decode-steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import paged_jax as pj
from paged_jax import models


def make_engine(model, tokenizer, args, stream: bool) -> pj.LLMEngine:
  block_size = 16
  blocks = -(-(32 + args.tokens) // block_size)
  cfg = pj.CacheConfig(
    block_size=block_size,
    num_gpu_blocks=args.requests * blocks,
    num_cpu_blocks=0,
    max_seqs=args.requests,
    max_blocks_per_seq=blocks,
  )
  return pj.LLMEngine(
    model,
    tokenizer,
    cfg,
    num_decode_steps=args.num_decode_steps,
    stream_steps=stream,
    warmup=True,
  )


def run(engine: pj.LLMEngine, args, tag: str) -> tuple[float, float]:
  """Tokens/s of one batch and the median gap between two outputs of a request."""
  params = pj.SamplingParams(max_tokens=args.tokens, ignore_eos=True, output_kind="delta")
  for i in range(args.requests):
    prompt = [1 + (i * 7 + j) % 50 for j in range(32)]
    engine.add_request(f"{tag}-{i}", prompt, params)
  last, gaps = {}, []

  def seen(outputs):
    now = time.perf_counter()
    for out in outputs:
      if out.request_id in last:
        gaps.append(now - last[out.request_id])
      last[out.request_id] = now

  start = time.perf_counter()
  while engine.has_unfinished_requests():
    seen(engine.step(on_decode_step=seen))
  return args.requests * args.tokens / (time.perf_counter() - start), statistics.median(gaps)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--num-decode-steps", type=int, default=8)
  args = parser.parse_args()
  model, tokenizer = models.load_pretrained(
    "smollm2-135m-instruct", dtype=args.dtype, max_seq_len=256
  )
  engines = {s: make_engine(model, tokenizer, args, s) for s in (True, False)}
  runs = {stream: [] for stream in engines}
  for index in range(args.repeats + 1):  # the first run warms up
    for stream, engine in engines.items():
      result = run(engine, args, f"{index}")
      if index:
        runs[stream].append(result)
  for stream, results in runs.items():
    rate = statistics.median(r[0] for r in results)
    gap = statistics.median(r[1] for r in results)
    label = "stream_steps" if stream else "per launch"
    print(f"{label:>12}: {rate:7.1f} tokens/s, a request's next output after {1e3 * gap:.0f} ms")
  ratio = statistics.median(r[0] for r in runs[True]) / statistics.median(r[0] for r in runs[False])
  print(f"stream_steps / per launch: {ratio:.3f}x tokens/s")


if __name__ == "__main__":
  main()
