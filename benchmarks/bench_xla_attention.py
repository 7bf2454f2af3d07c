"""The CPU paged decode attentions side by side: the XLA reference (every
row's whole table), the chunked XLA implementation (only the chunks the
longest context reaches) and the C++ kernel (`pallas_kernels/paged_attention/
cpu.py`, built at first use; left out, with the reason, where it cannot be).

Times `--layers` decode attentions in one jitted loop at SmolLM2's heads
(9 query, 3 KV, head_dim 64), for each context length and dtype; best of 5
wall-clock (GFLOP/s from it, counting the two products: 4 * heads * head_dim
per key) and best of 5 process CPU time (all threads).

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


def best_ms(fn, *args, repeats: int = 5) -> tuple[float, float]:
  """Least wall-clock and least process CPU milliseconds of `fn(*args)` (the
  CPU time, all threads summed, resists other jobs' load better)."""
  fn(*args).block_until_ready()
  walls, cpus = [], []
  for _ in range(repeats):
    start, cpu_start = time.perf_counter(), time.process_time()
    fn(*args).block_until_ready()
    walls.append(time.perf_counter() - start)
    cpus.append(time.process_time() - cpu_start)
  return 1000 * min(walls), 1000 * min(cpus)


def layers_of(attention, num_layers: int):
  """`num_layers` dependent attentions in one program (as a decode step runs
  them), on pages held as the CPU cache holds them (bfloat16 as its bits,
  viewed as bfloat16 inside the program, as `KVCache.pages` does)."""

  def run(q, k, v, tables, lengths):
    k, v = (jax.lax.bitcast_convert_type(x, q.dtype) for x in (k, v))
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
    if jnp.dtype(dtype).itemsize == 2:
      k, v = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k, v))
    q = jnp.asarray(rng.standard_normal((batch, 9, 64)), dtype)
    for length in (int(n) for n in args.lengths.split(",")):
      lengths = jnp.full((batch,), length, jnp.int32)
      flops = 4 * batch * 9 * 64 * length * args.layers
      cells = []
      for fn in implementations.values():
        ms, cpu_ms = best_ms(layers_of(fn, args.layers), q, k, v, tables, lengths)
        cells.append(f"{ms:.1f} ms ({flops / ms / 1e6:.0f} GFLOP/s), CPU {cpu_ms:.1f} ms")
      print(f"| {dtype} | {length} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
  main()
