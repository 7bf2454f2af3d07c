"""swap_out / swap_in bandwidth against one contiguous host transfer.

For each plan size, GB/s of ``swap_out`` (device -> pinned host) and
``swap_in`` (pinned host -> device) over all layers' K and V, next to one
``jax.device_put`` of a contiguous buffer of the same bytes to and from
pinned host memory (the practical limit), and their ratio. Plans name
scattered blocks (a random permutation), as after real preemptions.

On a GPU or TPU the default is Llama-3-8B's page (32 layers, 8 KV heads,
block 16, head_dim 128, bfloat16: 2 MiB per block) and 64, 1024 and 8192
blocks. On CPU the default keeps the page geometry with 4 layers and 64, 256
and 1024 blocks; ``--full`` forces the full sizes, ``--small`` the small ones.

  python benchmarks/bench_swap.py [--full | --small] [--iters N]
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.sizes import parse_size_args  # pylint: disable=g-import-not-at-top
from paged_jax import kv_cache, kv_memory, kv_swap  # pylint: disable=g-import-not-at-top
from paged_jax.config import CacheConfig  # pylint: disable=g-import-not-at-top


@dataclasses.dataclass(frozen=True)
class Sizes:
  num_layers: int
  block_counts: tuple[int, ...]
  num_kv_heads: int = 8
  block_size: int = 16
  head_dim: int = 128
  dtype: str = "bfloat16"


FULL = Sizes(32, (64, 1024, 8192))
SMALL = Sizes(4, (64, 256, 1024))


class Plan(NamedTuple):
  """The fields of a SwapPlan that the cache ops read."""

  src: jax.Array
  dst: jax.Array
  count: jax.Array


def median_seconds(step, state, iters: int):
  """Median time of ``state = step(state)`` after one warm-up call."""
  state = jax.block_until_ready(step(state))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    state = jax.block_until_ready(step(state))
    times.append(time.perf_counter() - start)
  return statistics.median(times), state


def contiguous_seconds(num_bytes: int, cache: kv_cache.KVCache, iters: int):
  """Median seconds of one device_put of num_bytes to host and back."""
  device_buffer = jnp.ones((num_bytes // 4,), jnp.uint32)
  to_host, _ = median_seconds(
    lambda _: jax.device_put(device_buffer, cache.host_sharding), None, iters
  )
  host_buffer = jax.device_put(device_buffer, cache.host_sharding)
  to_device, _ = median_seconds(
    lambda _: jax.device_put(host_buffer, cache.device_sharding), None, iters
  )
  return to_host, to_device


def scattered_plan(num_blocks: int, pool: int, seed: int) -> Plan:
  order = np.random.default_rng(seed).permutation(pool)[:num_blocks]
  other = np.random.default_rng(seed + 1).permutation(pool)[:num_blocks]
  return Plan(jnp.asarray(order, jnp.int32), jnp.asarray(other, jnp.int32), jnp.int32(num_blocks))


def main():
  full, iters, platform = parse_size_args(
    __doc__.splitlines()[0], "Llama-3-8B pages", "4 layers, fewer blocks", accelerator_iters=10
  )
  sizes = FULL if full else SMALL
  pool = max(sizes.block_counts)
  cfg = CacheConfig(
    block_size=sizes.block_size,
    num_gpu_blocks=pool,
    num_cpu_blocks=pool,
    max_seqs=1,
    max_blocks_per_seq=1,
  )
  cache = kv_cache.KVCache.create(
    cfg, sizes.num_layers, sizes.num_kv_heads, sizes.head_dim, sizes.dtype
  )
  block_bytes = kv_memory.bytes_per_block(
    block_size=sizes.block_size,
    num_layers=sizes.num_layers,
    num_kv_heads=sizes.num_kv_heads,
    head_dim=sizes.head_dim,
    dtype=sizes.dtype,
  )
  print(
    f"backend: {platform}, device: {jax.devices()[0].device_kind}, host "
    f"memory kind: {cache.host_sharding.memory_kind}"
  )
  print(
    f"{sizes.num_layers} layers, {sizes.num_kv_heads} kv heads, block "
    f"{sizes.block_size}, head_dim {sizes.head_dim}, {sizes.dtype}: "
    f"{block_bytes / 2**20:.2f} MiB per block"
  )
  print(
    f"{'blocks':>7} {'MiB':>8} {'direction':<9} {'swap GB/s':>10} {'contig GB/s':>12} {'ratio':>7}"
  )
  swap_out = jax.jit(kv_swap.swap_out, donate_argnums=0)
  swap_in = jax.jit(kv_swap.swap_in, donate_argnums=0)
  ratios = {}
  for count in sizes.block_counts:
    num_bytes = count * block_bytes
    out_plan, in_plan = scattered_plan(count, pool, 0), scattered_plan(count, pool, 2)
    out_seconds, cache = median_seconds(lambda c: swap_out(c, out_plan), cache, iters)
    in_seconds, cache = median_seconds(lambda c: swap_in(c, in_plan), cache, iters)
    to_host, to_device = contiguous_seconds(num_bytes, cache, iters)
    for direction, seconds, limit in (("out", out_seconds, to_host), ("in", in_seconds, to_device)):
      ratios[count, direction] = limit / seconds
      print(
        f"{count:>7} {num_bytes / 2**20:>8.0f} {direction:<9} "
        f"{num_bytes / seconds / 1e9:>10.2f} "
        f"{num_bytes / limit / 1e9:>12.2f} {limit / seconds:>7.0%}"
      )
  large = [r for (count, _), r in ratios.items() if count >= 1024]
  smallest = min(sizes.block_counts)
  small = [r for (count, _), r in ratios.items() if count == smallest]
  print(
    f"\nsummary: {platform}: swap at {min(large):.0%}..{max(large):.0%} "
    f"of one contiguous device_put from 1024 blocks on (target 80%), "
    f"{min(small):.0%}..{max(small):.0%} at {smallest} blocks"
  )


if __name__ == "__main__":
  main()
