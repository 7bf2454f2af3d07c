"""Paged against dense-cache generation with the tiny model, on this machine.

1. Throughput: the same batch of ragged prompts, greedy, through
   `generate` (paged cache, decode loop in one `lax.while_loop`) and
   `generate_dense` (one contiguous row per sequence). Each path runs once to
   compile, then is timed over `--repeats` runs.
2. Capacity: how many sequences of a length-skewed batch fit at once in the
   same KV memory, when dense reserves `max_seq_len` positions per sequence
   and the paged manager allocates blocks as the sequences need them.

Usage: python benchmarks/bench_generate.py [--batch 16] [--new-tokens 80]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import paged_jax as pj
from paged_jax.generate import Request, SamplingParams, generate
from paged_jax.models import load_tiny
from paged_jax.models.dense import generate_dense


def ragged_prompts(batch: int, seed: int) -> list[np.ndarray]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, rng.integers(8, 48)).astype(np.int32) for _ in range(batch)]


def time_best(run, repeats: int) -> float:
  run()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return min(times)


def paged_capacity(lengths: np.ndarray, memory_tokens: int, block_size: int, max_len: int) -> int:
  """Sequences of `lengths`, in order, that the block manager admits."""
  cfg = pj.CacheConfig(
    block_size=block_size,
    num_gpu_blocks=memory_tokens // block_size,
    num_cpu_blocks=0,
    max_seqs=len(lengths),
    max_blocks_per_seq=-(-max_len // block_size),
    watermark=0.0,
  )
  bm = pj.BlockSpaceManager(cfg)
  allocate = jax.jit(bm.allocate)
  state = bm.init()
  tokens = jnp.zeros(cfg.max_tokens_per_seq, jnp.int32)
  for seq, length in enumerate(lengths):
    state, result = allocate(state, jnp.array([seq]), tokens, int(length))
    if int(result.status) != pj.Status.OK:
      return seq
  return len(lengths)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=80)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  model = load_tiny()
  max_len = model.config.max_seq_len
  prompts = ragged_prompts(args.batch, args.seed)
  sampling = SamplingParams(max_tokens=args.new_tokens)
  key = jax.random.key(args.seed)
  cfg = pj.CacheConfig(
    block_size=args.block_size,
    num_gpu_blocks=args.batch * max_len // args.block_size,
    num_cpu_blocks=0,
    max_seqs=args.batch,
    max_blocks_per_seq=max_len // args.block_size,
  )
  tokens = args.batch * args.new_tokens
  dense_s = time_best(lambda: generate_dense(model, prompts, sampling, key), args.repeats)
  paged_s = time_best(
    lambda: generate(model, [Request(p) for p in prompts], cfg, sampling, key), args.repeats
  )
  print(f"{'path':<8}{'batch':>7}{'new tokens':>12}{'seconds':>10}{'tokens/s':>11}")
  for name, seconds in (("dense", dense_s), ("paged", paged_s)):
    print(f"{name:<8}{args.batch:>7}{tokens:>12}{seconds:>10.3f}{tokens / seconds:>11.0f}")

  rng = np.random.default_rng(args.seed)
  skewed = np.clip(rng.lognormal(np.log(24), 0.8, 256).astype(int), 1, max_len)
  memory_tokens = 16 * max_len
  dense_fit = memory_tokens // max_len
  paged_fit = paged_capacity(skewed, memory_tokens, args.block_size, max_len)
  print()
  print(f"{'KV memory (tokens)':<20}{'mean len':>9}{'dense fits':>11}{'paged fits':>11}")
  print(f"{memory_tokens:<20}{skewed.mean():>9.1f}{dense_fit:>11}{paged_fit:>11}")
  print()
  print(
    f"summary: paged/dense throughput {dense_s / paged_s:.2f}x "
    f"({tokens / paged_s:.0f} vs {tokens / dense_s:.0f} tokens/s, target >= 0.8x); "
    f"sequences in the same KV memory {paged_fit / dense_fit:.1f}x "
    f"({paged_fit} vs {dense_fit}, target >= 2x)"
  )


if __name__ == "__main__":
  main()
