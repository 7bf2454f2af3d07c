"""Prefill attention of a ragged step's tiles on CPU: the C++ kernel against
the chunked XLA path that ran before it.

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads of 64, blocks of
16) in the largest prompt bucket of the serve defaults: 48 tiles of 32
tokens (`max_num_batched_tokens` 512 in tiles of `prefill_width` 32, plus a
tile per sequence), each tile the last 32 tokens of a context of 32 to 224
tokens (prompts of 200). Rows: every tile real, and a third of them real
(the rest padding, as in a step with fewer prompt tokens). Times are the
best of 5 rounds of 10 calls of one layer, both implementations in one
process; the largest difference from the XLA reference is printed too.

  python benchmarks/bench_cpu_prefill.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import chunked, cpu, reference

TILES, WIDTH, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS, MAX_BLOCKS = (
  48,
  32,
  9,
  3,
  64,
  16,
  1024,
  32,
)


def best_time(fn, *args, rounds=5, calls=10) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / calls)
  return best


def tile_inputs(dtype, real_tiles: int, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  pages = (KV_HEADS, BLOCKS, BLOCK, HEAD_DIM)
  k, v = (jax.random.normal(key, pages, dtype) for key in keys[:2])
  q = jax.random.normal(keys[2], (TILES, WIDTH, Q_HEADS, HEAD_DIM), dtype)
  tables = np.random.default_rng(seed).integers(0, BLOCKS, (TILES, MAX_BLOCKS))
  real = np.arange(TILES) < real_tiles
  lengths = np.where(real, (np.arange(TILES) % 7 + 1) * WIDTH, 0)
  query_lens = np.where(real, WIDTH, 0)
  return q, k, v, *(jnp.asarray(x, jnp.int32) for x in (tables, lengths, query_lens))


def main():
  implementations = {
    "chunked XLA": jax.jit(chunked.paged_prefill_attention_chunked),
    "C++ kernel": jax.jit(cpu.paged_prefill_attention),
  }
  print(
    "| dtype | real tiles | chunked XLA (ms/layer) | C++ kernel (ms/layer) | ratio | max error |"
  )
  print("|---|---:|---:|---:|---:|---:|")
  for dtype in (jnp.bfloat16, jnp.float32):
    for real_tiles in (TILES, TILES // 3):
      args = tile_inputs(dtype, real_tiles)
      expected = reference.paged_prefill_attention_reference(*args).astype(jnp.float32)
      times = {name: best_time(fn, *args) for name, fn in implementations.items()}
      error = jnp.max(jnp.abs(implementations["C++ kernel"](*args).astype(jnp.float32) - expected))
      xla, kernel = times["chunked XLA"], times["C++ kernel"]
      print(
        f"| {jnp.dtype(dtype).name} | {real_tiles} of {TILES} | {xla * 1e3:.2f} | "
        f"{kernel * 1e3:.2f} | {xla / kernel:.1f}x | {float(error):.2g} |"
      )


if __name__ == "__main__":
  main()
