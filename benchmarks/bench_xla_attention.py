"""The CPU paged decode attentions side by side: the XLA reference (every
row's whole table), the chunked XLA implementation (only the chunks the
longest context reaches) and the C++ kernel (`pallas_kernels/paged_attention/
cpu.py`, built at first use; left out, with the reason, where it cannot be).

Times `--layers` decode attentions in one jitted loop at SmolLM2's heads
(9 query, 3 KV, head_dim 64), for each context length and dtype; best of 5.
GFLOP/s counts the two products (4 * heads * head_dim per key).

Usage: python benchmarks/bench_xla_attention.py [--batch 32]
       [--max-blocks-per-seq 32] [--lengths 100,500] [--layers 30]
       [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import cpu, paged_attention_chunked, paged_attention_reference

IMPLEMENTATIONS = {"reference": paged_attention_reference, "chunked": paged_attention_chunked}


def best_ms(fn, *args, repeats: int = 5) -> float:
  fn(*args).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return 1000 * min(times)


def layers_of(attention, num_layers: int):
  """`num_layers` dependent attentions in one program (as a decode step runs them)."""

  def run(q, k, v, tables, lengths):
    step = lambda _, out: out + attention(q + 1e-3 * out, k, v, tables, lengths)
    return jax.lax.fori_loop(0, num_layers, step, jnp.zeros_like(q))

  return jax.jit(run)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--max-blocks-per-seq", type=int, default=32)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--lengths", default="100,500")
  parser.add_argument("--layers", type=int, default=30)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  args = parser.parse_args()
  batch, max_blocks, block_size = args.batch, args.max_blocks_per_seq, args.block_size
  implementations = dict(IMPLEMENTATIONS)
  reason = cpu.unavailable_reason()
  if reason is None:
    implementations["C++ kernel"] = cpu.paged_attention
  else:
    print(f"C++ kernel left out: {reason}")
  rng = np.random.default_rng(0)
  shape = (3, batch * max_blocks + 1, block_size, 64)
  tables = jnp.asarray(rng.permutation(batch * max_blocks).reshape(batch, max_blocks), jnp.int32)
  names = " | ".join(implementations)
  print(f"| dtype | context | {names} |\n| --- | --- |{' --- |' * len(implementations)}")
  for dtype in args.dtypes.split(","):
    k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 9, 64)), dtype)
    for length in (int(n) for n in args.lengths.split(",")):
      lengths = jnp.full((batch,), length, jnp.int32)
      flops = 4 * batch * 9 * 64 * length * args.layers
      cells = []
      for fn in implementations.values():
        ms = best_ms(layers_of(fn, args.layers), q, k, v, tables, lengths)
        cells.append(f"{ms:.1f} ms ({flops / ms / 1e6:.0f} GFLOP/s)")
      print(f"| {dtype} | {length} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
  main()
