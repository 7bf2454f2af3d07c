"""Paged attention and copy_blocks bandwidth against a device-to-device copy.

Decode attention reads ``2 * batch * length * num_kv_heads * head_dim`` bytes
of K and V; its bandwidth is those bytes over the time of one call, shown as
a fraction of the bandwidth of an on-device copy (``(read + write) bytes /
time``) measured in the same run. Rows compare this library's kernels (on a
GPU its Mosaic GPU and Triton kernels, on TPU its Mosaic kernel), JAX's
shipped Pallas paged attention and the XLA reference; a kernel that fails to
compile or run gets a row saying so, and the others still run.
copy_blocks moves ``pairs`` blocks of every layer's K and V (read + write).
The last table compiles a donated decode step (copy_blocks, write_kv,
paged_attention) with the Pallas kernels and reports its temporary bytes as a
fraction of the cache.

On a GPU or TPU the default sizes are Llama-3-8B's (32 query heads, 8 KV
heads, head_dim 128, bfloat16, block 16; batch 1/16/64, lengths 1k/4k/16k,
1024 copy pairs over 32 layers). On CPU the Pallas kernels run in interpret
mode, so the default sizes are small and the numbers only show that the
script works; ``--full`` forces the full sizes, ``--small`` the small ones.
``--batches``, ``--lengths`` and ``--block-sizes`` replace those of the
decode table, ``--attention-only`` skips the copy_blocks and decode-step
tables.

  python benchmarks/bench_kernels.py [--full | --small] [--iters N]
      [--batches 1,64] [--lengths 4096] [--block-sizes 16,64]
      [--attention-only]
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pathlib
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.paged_attention import (
  paged_attention as shipped_tpu_paged_attention,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.sizes import (
  resolve_sizes,  # pylint: disable=g-import-not-at-top
  size_parser,  # pylint: disable=g-import-not-at-top
)
from paged_jax import (
  attention,  # pylint: disable=g-import-not-at-top
  kv_cache,  # pylint: disable=g-import-not-at-top
)
from paged_jax.config import CacheConfig  # pylint: disable=g-import-not-at-top
from pallas_kernels.paged_attention import mosaic_gpu  # pylint: disable=g-import-not-at-top

try:  # deprecated with Pallas's Triton backend; gone from some JAX releases
  shipped_gpu = importlib.import_module("jax.experimental.pallas.ops.gpu.paged_attention")
except ImportError:
  shipped_gpu = None


@dataclasses.dataclass(frozen=True)
class Sizes:
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  batches: tuple[int, ...]
  lengths: tuple[int, ...]
  copy_layers: int
  copy_pairs: int
  dtype: str = "bfloat16"


FULL = Sizes(32, 8, 128, 16, (1, 16, 64), (1024, 4096, 16384), 32, 1024)
SMALL = Sizes(32, 8, 128, 16, (1, 4), (256, 1024), 2, 64)


class Plan(NamedTuple):
  """The fields of a CopyPlan that the cache ops read."""

  src: jax.Array
  dst: jax.Array
  count: jax.Array


def time_call(fn, *args, iters: int) -> float:
  """Median seconds of ``fn(*args)`` after one warm-up (compile) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def copy_bandwidth(num_bytes: int, iters: int) -> float:
  """Bytes per second of an on-device copy (read + write) of num_bytes.

  The copy is ``x + 1`` on uint32 words: one read and one write per word, no
  float work, and nothing XLA can elide.
  """
  source = jnp.ones((num_bytes // 4,), jnp.uint32)
  seconds = time_call(jax.jit(lambda x: x + 1), source, iters=iters)
  return 2 * num_bytes / seconds


def decode_inputs(sizes: Sizes, batch: int, length: int, seed: int = 0):
  """q, pages holding exactly the batch's blocks (shuffled), tables."""
  blocks_per_seq = length // sizes.block_size
  num_blocks = batch * blocks_per_seq
  keys = jax.random.split(jax.random.key(seed), 3)
  shape = (sizes.num_kv_heads, num_blocks, sizes.block_size, sizes.head_dim)
  k_pages = jax.random.normal(keys[0], shape, sizes.dtype)
  v_pages = jax.random.normal(keys[1], shape, sizes.dtype)
  q = jax.random.normal(keys[2], (batch, sizes.num_q_heads, sizes.head_dim), sizes.dtype)
  tables = (
    np.random.default_rng(seed)
    .permutation(num_blocks)
    .reshape(batch, blocks_per_seq)
    .astype(np.int32)
  )
  lengths = jnp.full((batch,), length, jnp.int32)
  return q, k_pages, v_pages, jnp.asarray(tables), lengths


def attention_impls(platform: str, blocks_per_seq: int):
  """name -> jitted fn(q, k_pages, v_pages, tables, lengths)."""
  interpret = platform not in ("gpu", "tpu")

  def ours(impl):
    # JAX's kernels take no sm_scale; the others get 1.0 to do the same work.
    return jax.jit(functools.partial(attention.paged_attention, sm_scale=1.0, impl=impl))

  pages_per_block = min(8, blocks_per_seq)
  if platform == "tpu":

    def shipped(q, k, v, tables, lengths):
      return shipped_tpu_paged_attention(
        q, k, v, lengths, tables, pages_per_compute_block=pages_per_block
      )

    kernels = {"mosaic tpu (ours)": ours("pallas")}
  else:

    def shipped(q, k, v, tables, lengths):
      return shipped_gpu.paged_attention(
        q,
        k,
        v,
        tables,
        lengths,
        pages_per_compute_block=pages_per_block,
        k_splits=max(1, min(16, blocks_per_seq // pages_per_block)),
        interpret=interpret,
      )

    kernels = {MOSAIC: ours("mosaic_gpu"), "triton (ours)": ours("triton")}
    if not interpret:
      # The default takes 4 page slots; with 2 two programs share an SM.
      for slots in (2, 3):
        kernels[f"mosaic gpu, {slots} {SLOTS}"] = jax.jit(
          functools.partial(mosaic_gpu.paged_attention, sm_scale=1.0, num_buffers=slots)
        )
  if shipped_gpu is not None or platform == "tpu":
    kernels[SHIPPED] = jax.jit(shipped)
  return {**kernels, "xla reference": ours("reference")}


MOSAIC = "mosaic gpu (ours)"
SLOTS = "slots"  # rows of the Mosaic kernel with other num_buffers
SHIPPED = "jax shipped pallas"


def try_time_call(fn, *args, iters: int) -> tuple[float, str]:
  """(median seconds, "") or (nan, the first line of the error)."""
  try:
    return time_call(fn, *args, iters=iters), ""
  except Exception as error:  # pylint: disable=broad-except
    message = str(error).strip().splitlines() or [""]
    return float("nan"), f"{type(error).__name__}: {message[0][:120]}"


def bench_attention(sizes: Sizes, platform: str, copy_bw: float, iters: int):
  """Prints the decode table; returns {(block, batch, length, impl): frac}."""
  print(
    f"\ndecode paged attention: {sizes.num_q_heads} q heads, "
    f"{sizes.num_kv_heads} kv heads, head_dim {sizes.head_dim}, "
    f"{sizes.dtype}"
  )
  print(
    f"{'block':>5} {'batch':>5} {'length':>6} {'KV MiB':>8} "
    f"{'impl':<20} {'time us':>10} {'GB/s':>8} {'of copy':>8}"
  )
  fractions = {}
  for batch in sizes.batches:
    for length in sizes.lengths:
      inputs = decode_inputs(sizes, batch, length)
      kv_bytes = 2 * inputs[1].size * inputs[1].dtype.itemsize
      impls = attention_impls(platform, length // sizes.block_size)
      for name, fn in impls.items():
        seconds, error = try_time_call(fn, *inputs, iters=iters)
        fraction = kv_bytes / seconds / copy_bw
        fractions[sizes.block_size, batch, length, name] = fraction
        row = f"{sizes.block_size:>5} {batch:>5} {length:>6} {kv_bytes / 2**20:>8.1f} {name:<20} "
        if error:
          print(row + f"failed: {error}")
        else:
          print(row + f"{seconds * 1e6:>10.1f} {kv_bytes / seconds / 1e9:>8.1f} {fraction:>8.1%}")
  return fractions


def attention_summary(fractions) -> str:
  """Our best kernel's fraction of copy bandwidth, and where it wins."""
  impls = {name for *_, name in fractions}
  ours = MOSAIC if MOSAIC in impls else "mosaic tpu (ours)"
  points = sorted({key[:3] for key in fractions})
  others = {name for name in impls if name != ours and SLOTS not in name}
  wins = sum(
    all(
      fractions[p + (ours,)] > fractions[p + (other,)]
      for other in others
      if np.isfinite(fractions[p + (other,)])
    )
    for p in points
  )
  shapes = {p[1:] for p in points}
  shape = (64, 4096) if (64, 4096) in shapes else max(shapes)
  at_shape = ", ".join(
    f"block {p[0]} {fractions[p + (ours,)]:.0%}" for p in points if p[1:] == shape
  )
  return (
    f"decode B={shape[0]} L={shape[1]}: {ours} at {at_shape} of copy "
    f"bandwidth (target 85%), faster than every other kernel at "
    f"{wins}/{len(points)} points"
  )


def bench_copy_blocks(sizes: Sizes, copy_bw: float, iters: int):
  """Prints the copy_blocks table; returns its fraction of copy bandwidth."""
  pairs = sizes.copy_pairs
  cfg = CacheConfig(
    block_size=sizes.block_size,
    num_gpu_blocks=2 * pairs,
    num_cpu_blocks=0,
    max_seqs=1,
    max_blocks_per_seq=1,
  )
  cache = kv_cache.KVCache.create(
    cfg, sizes.copy_layers, sizes.num_kv_heads, sizes.head_dim, sizes.dtype
  )
  order = np.random.default_rng(0).permutation(2 * pairs).astype(np.int32)
  plan = Plan(jnp.asarray(order[:pairs]), jnp.asarray(order[pairs:]), jnp.int32(pairs))
  moved = 2 * pairs * cache.nbytes // cache.num_gpu_blocks  # read + write
  print(f"\ncopy_blocks: {pairs} pairs x {sizes.copy_layers} layers (K and V)")
  print(f"{'impl':<10} {'time us':>10} {'GB/s':>8} {'of copy':>8}")
  fractions = {}
  for impl in ("pallas", "reference"):
    step = jax.jit(functools.partial(kv_cache.copy_blocks, impl=impl), donate_argnums=0)
    cache = step(cache, plan)  # compile
    jax.block_until_ready(cache)
    times = []
    for _ in range(iters):
      start = time.perf_counter()
      cache = jax.block_until_ready(step(cache, plan))
      times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    fractions[impl] = moved / seconds / copy_bw
    print(
      f"{impl:<10} {seconds * 1e6:>10.1f} {moved / seconds / 1e9:>8.1f} {fractions[impl]:>8.1%}"
    )
  return fractions["pallas"]


def decode_step_temp_fraction(sizes: Sizes, impl: str, dtype: str) -> float:
  """Temp bytes / cache bytes of a donated decode step, compiled only."""
  batch, length = sizes.batches[-1], sizes.lengths[0]
  blocks_per_seq = length // sizes.block_size
  cfg = CacheConfig(
    block_size=sizes.block_size,
    num_gpu_blocks=8 * batch * blocks_per_seq,
    num_cpu_blocks=0,
    max_seqs=batch,
    max_blocks_per_seq=blocks_per_seq,
  )
  shape = jax.ShapeDtypeStruct
  cache = jax.eval_shape(
    lambda: kv_cache.KVCache.create(cfg, 2, sizes.num_kv_heads, sizes.head_dim, dtype)
  )
  int32 = jnp.int32
  plan = Plan(shape((batch,), int32), shape((batch,), int32), shape((), int32))
  rows = shape((batch, sizes.num_kv_heads, sizes.head_dim), dtype)
  q = shape((batch, sizes.num_q_heads, sizes.head_dim), dtype)

  def step(cache, plan, rows, slots, q, tables, lengths):
    cache = kv_cache.copy_blocks(cache, plan, impl=impl)
    outputs = []
    for layer in range(cache.num_layers):
      cache = kv_cache.write_kv(cache, layer, rows, rows, slots, impl=impl)
      outputs.append(attention.paged_attention(q, *cache.pages(layer), tables, lengths, impl=impl))
    return cache, outputs

  compiled = (
    jax.jit(step, donate_argnums=0)
    .lower(
      cache,
      plan,
      rows,
      shape((batch,), int32),
      q,
      shape((batch, blocks_per_seq), int32),
      shape((batch,), int32),
    )
    .compile()
  )
  cache_bytes = sum(a.size * jnp.dtype(a.dtype).itemsize for a in cache.k + cache.v)
  return compiled.memory_analysis().temp_size_in_bytes / cache_bytes


def main():
  parser = size_parser(__doc__.splitlines()[0], "Llama-3-8B sizes", "small sizes")
  parser.add_argument("--batches", type=int_list, default=None)
  parser.add_argument("--lengths", type=int_list, default=None)
  parser.add_argument("--block-sizes", type=int_list, default=None)
  parser.add_argument("--attention-only", action="store_true")
  args = parser.parse_args()
  full, iters, platform = resolve_sizes(args, accelerator_iters=20)
  accelerator = platform in ("gpu", "tpu")
  sizes = FULL if full else SMALL
  sizes = dataclasses.replace(
    sizes, batches=args.batches or sizes.batches, lengths=args.lengths or sizes.lengths
  )
  mode = "" if accelerator else " (Pallas in interpret mode)"
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", "")
  print(
    f"backend: {platform}, device: {device.device_kind} {capability}, jax {jax.__version__}{mode}"
  )

  largest = max(sizes.batches) * max(sizes.lengths)
  copy_bytes = 2 * largest * sizes.num_kv_heads * sizes.head_dim * 2
  copy_bw = copy_bandwidth(copy_bytes, iters)
  print(f"device copy of {copy_bytes / 2**20:.0f} MiB: {copy_bw / 1e9:.1f} GB/s (read + write)")
  fractions = {}
  for block_size in args.block_sizes or (sizes.block_size,):
    fractions.update(
      bench_attention(dataclasses.replace(sizes, block_size=block_size), platform, copy_bw, iters)
    )
  summary = f"summary: {platform}{mode}: {attention_summary(fractions)}"
  if args.attention_only:
    print(f"\n{summary}")
    return
  copy_blocks_fraction = bench_copy_blocks(sizes, copy_bw, iters)
  # XLA:CPU converts a bfloat16 array to float32 to scatter into it.
  step_dtype = sizes.dtype if accelerator else "float32"
  temp = {
    impl: decode_step_temp_fraction(sizes, impl, step_dtype) for impl in ("pallas", "reference")
  }
  print(
    f"\ndonated decode step (copy_blocks, write_kv, paged_attention), "
    f"{step_dtype}: temp bytes / cache bytes"
  )
  for impl, fraction in temp.items():
    print(f"{impl:<10} {fraction:>8.2%}")
  print(
    f"\n{summary}, copy_blocks at {copy_blocks_fraction:.0%} (target "
    f"80%), decode-step temp {temp['pallas']:.2%} of the cache (target "
    f"< 10%)"
  )


def int_list(text: str) -> tuple[int, ...]:
  """Parses "1,16,64"."""
  return tuple(int(part) for part in text.split(","))


if __name__ == "__main__":
  main()
