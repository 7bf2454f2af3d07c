"""Prefill (multi-query) paged attention over a ragged step's tiles.

Each tile is ``width`` consecutive query tokens at the end of a context of
``context`` tokens, with its own block table; rows compare
`paged_jax.attention.paged_prefill_attention` with ``impl="pallas"`` (the
Mosaic TPU kernel; in interpret mode off TPU), the chunked XLA
implementation (``impl="auto"`` off TPU) and the XLA reference. Columns:
median time per call, attention FLOP/s (``4 * tiles * width * context *
num_q_heads * head_dim``, the causal triangle within a tile ignored) and the
K/V bytes of the tiles' contexts per second.

On TPU the default sizes are Llama-3-8B's (32 query heads, 8 KV heads,
head_dim 128, bfloat16, block 16) with 16 and 64 tiles of 32 and 128 tokens
over 1k and 4k contexts. On CPU the kernel runs in interpret mode, so the
sizes are small and the numbers only show that the script works; ``--full``
forces the full sizes, ``--small`` the small ones.

  python benchmarks/bench_prefill_kernel.py [--full | --small] [--iters N]
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.bench_kernels import try_time_call  # pylint: disable=g-import-not-at-top
from benchmarks.sizes import parse_size_args  # pylint: disable=g-import-not-at-top
from paged_jax import attention  # pylint: disable=g-import-not-at-top
from pallas_kernels.paged_attention import chunked  # pylint: disable=g-import-not-at-top

FULL = dict(heads=(32, 8), head_dim=128, block_size=16, tiles=(16, 64), widths=(32, 128))
FULL_CONTEXTS = (1024, 4096)
SMALL = dict(heads=(8, 2), head_dim=64, block_size=16, tiles=(2,), widths=(16,))
SMALL_CONTEXTS = (64,)
IMPLS = {"mosaic tpu (ours)": "pallas", "chunked xla": "chunked", "xla reference": "reference"}


def tile_inputs(num_tiles, width, context, heads, head_dim, block_size, seed=0):
  """Random q and pages; each tile's table holds its own shuffled blocks."""
  num_q_heads, num_kv_heads = heads
  blocks_per_tile = -(-context // block_size)
  num_blocks = num_tiles * blocks_per_tile
  keys = jax.random.split(jax.random.key(seed), 3)
  shape = (num_kv_heads, num_blocks, block_size, head_dim)
  k_pages = jax.random.normal(keys[0], shape, jnp.bfloat16)
  v_pages = jax.random.normal(keys[1], shape, jnp.bfloat16)
  q = jax.random.normal(keys[2], (num_tiles, width, num_q_heads, head_dim), jnp.bfloat16)
  tables = np.random.default_rng(seed).permutation(num_blocks).reshape(num_tiles, -1)
  lengths = jnp.full((num_tiles,), context, jnp.int32)
  query_lens = jnp.full((num_tiles,), width, jnp.int32)
  return q, k_pages, v_pages, jnp.asarray(tables, jnp.int32), lengths, query_lens


def run(impl):
  if impl == "chunked":  # what impl="auto" runs off TPU
    return jax.jit(chunked.paged_prefill_attention_chunked)
  return jax.jit(functools.partial(attention.paged_prefill_attention, impl=impl))


def main():
  full, iters, platform = parse_size_args(
    __doc__.splitlines()[0], "Llama-3-8B shapes", "small shapes", accelerator_iters=20
  )
  sizes, contexts = (FULL, FULL_CONTEXTS) if full else (SMALL, SMALL_CONTEXTS)
  num_q_heads, num_kv_heads = sizes["heads"]
  print(
    f"prefill paged attention on {platform}: {num_q_heads} q heads, {num_kv_heads} kv heads, "
    f"head_dim {sizes['head_dim']}, block {sizes['block_size']}, bfloat16"
  )
  print(
    f"{'tiles':>5} {'width':>5} {'context':>7} {'impl':<18} {'time us':>10} "
    f"{'TFLOP/s':>8} {'KV GB/s':>8}"
  )
  for num_tiles in sizes["tiles"]:
    for width in sizes["widths"]:
      for context in contexts:
        inputs = tile_inputs(
          num_tiles, width, context, sizes["heads"], sizes["head_dim"], sizes["block_size"]
        )
        flops = 4 * num_tiles * width * context * num_q_heads * sizes["head_dim"]
        kv_bytes = 2 * num_tiles * context * num_kv_heads * sizes["head_dim"] * 2
        for name, impl in IMPLS.items():
          seconds, error = try_time_call(run(impl), *inputs, iters=iters)
          row = f"{num_tiles:>5} {width:>5} {context:>7} {name:<18} "
          if error:
            print(row + f"failed: {error}")
          else:
            print(
              row + f"{seconds * 1e6:>10.1f} {flops / seconds / 1e12:>8.3f} "
              f"{kv_bytes / seconds / 1e9:>8.1f}"
            )


if __name__ == "__main__":
  main()
