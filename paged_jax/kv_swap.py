"""Swapping a KV cache's blocks between device and host memory.

``swap_out`` / ``swap_in`` execute a SwapPlan of the block manager on every
layer's K and V (and a quantized cache's scales): one gather, one transfer,
one scatter for all layers, jitted with the cache donated, so both sides
update in place. Host pages hold bit patterns (see `paged_jax.kv_cache`).
A sharded cache swaps a shard's plan given in the whole cache's block ids
(``sharding.shard_plan``).
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.compute_on import compute_on

from paged_jax.kernel_choice import is_concrete
from paged_jax.kv_cache import KVCache, in_shape_groups
from paged_jax.kv_plans import check_plan, plan_arrays
from pallas_kernels import bits


def swap_out(kv: KVCache, plan) -> KVCache:
  """Copies device blocks to host blocks (``src[i]`` -> ``dst[i]``, i < count).

  One jitted call for all layers' K and V, with ``kv`` donated: the planned
  blocks are gathered on the device, moved to host memory in one transfer and
  scattered into the host pages (a quantized cache's scales likewise, in a
  second transfer). The device pages are left as they are (the block manager
  has freed them).

  Args:
    kv: the cache; donated, do not use it afterwards.
    plan: a SwapPlan from ``BlockSpaceManager.swap_out``.

  Returns:
    The cache with the blocks in host memory.
  """
  src, dst, count = plan_arrays(plan)
  if is_concrete(src, dst, count):
    check_plan(
      src,
      dst,
      count,
      num_src_blocks=kv.num_gpu_blocks,
      num_dst_blocks=kv.num_cpu_blocks,
      name="swap_out plan",
    )
  return _jitted_for(kv, _swap_out)(kv, src, dst, count)


def swap_in(kv: KVCache, plan) -> KVCache:
  """Copies host blocks to device blocks (``src[i]`` -> ``dst[i]``, i < count).

  One jitted call for all layers' K and V, with ``kv`` donated: gather in
  host memory, one transfer to the device, scatter into the device pages (a
  quantized cache's scales likewise, in a second transfer).

  Args:
    kv: the cache; donated, do not use it afterwards.
    plan: a SwapPlan from ``BlockSpaceManager.swap_in``.

  Returns:
    The cache with the blocks back on the device.
  """
  src, dst, count = plan_arrays(plan)
  if is_concrete(src, dst, count):
    check_plan(
      src,
      dst,
      count,
      num_src_blocks=kv.num_cpu_blocks,
      num_dst_blocks=kv.num_gpu_blocks,
      name="swap_in plan",
    )
  return _jitted_for(kv, _swap_in)(kv, src, dst, count)


def _jitted_for(kv: KVCache, swap):
  """``swap`` jitted with the cache donated and its shardings kept."""
  return _jit_swap(
    swap,
    kv.num_layers,
    kv.device_sharding,
    kv.host_sharding,
    kv.quantized,
    kv.bits_of,
  )


@functools.cache
def _jit_swap(swap, num_layers, device_sharding, host_sharding, quantized, bits_of):
  on_device = (device_sharding,) * num_layers
  on_host = (host_sharding,) * num_layers
  scales = {}
  if quantized:
    scales = dict(k_scale=on_device, v_scale=on_device, k_scale_host=on_host, v_scale_host=on_host)
  cache_shardings = KVCache(
    on_device,
    on_device,
    on_host,
    on_host,
    device_sharding=device_sharding,
    host_sharding=host_sharding,
    **scales,
    bits_of=bits_of,
  )
  plan_shardings = (_replicated(device_sharding),) * 3
  return jax.jit(
    swap,
    donate_argnums=0,
    in_shardings=(cache_shardings, *plan_shardings),
    out_shardings=cache_shardings,
  )


def _swap_out(kv: KVCache, src, dst, count) -> KVCache:
  live = _live_pairs(src, dst, count)
  sources = jnp.where(live, src, 0)
  targets = jax.device_put(jnp.where(live, dst, kv.num_cpu_blocks), _replicated(kv.host_sharding))

  def move(device_arrays, host_arrays, to_bits):
    staged = _gather_blocks(device_arrays, sources)
    staged = jax.device_put(to_bits(staged), _staging(kv.host_sharding))
    return _on_host(kv, _set_blocks)(host_arrays, targets, staged)

  layers = kv.num_layers
  pages = in_shape_groups(
    lambda device, host: move(device, host, _bits), kv.k + kv.v, kv.k_host + kv.v_host
  )
  kv = kv.replace(k_host=pages[:layers], v_host=pages[layers:])
  if not kv.quantized:
    return kv
  scales = in_shape_groups(
    lambda device, host: move(device, host, lambda x: x),
    kv.k_scale + kv.v_scale,
    kv.k_scale_host + kv.v_scale_host,
  )
  return kv.replace(k_scale_host=scales[:layers], v_scale_host=scales[layers:])


def _swap_in(kv: KVCache, src, dst, count) -> KVCache:
  live = _live_pairs(src, dst, count)
  sources = jax.device_put(jnp.where(live, src, 0), _replicated(kv.host_sharding))
  targets = jnp.where(live, dst, kv.num_gpu_blocks)

  def move(host_arrays, device_arrays, from_bits):
    staged = _on_host(kv, _gather_blocks)(host_arrays, sources)
    staged = jax.device_put(staged, _staging(kv.device_sharding))
    staged = from_bits(staged)
    return _set_blocks(device_arrays, targets, staged)

  layers = kv.num_layers
  pages = in_shape_groups(
    lambda host, device: move(host, device, lambda x: lax.bitcast_convert_type(x, device[0].dtype)),
    kv.k_host + kv.v_host,
    kv.k + kv.v,
  )
  kv = kv.replace(k=pages[:layers], v=pages[layers:])
  if not kv.quantized:
    return kv
  scales = in_shape_groups(
    lambda host, device: move(host, device, lambda x: x),
    kv.k_scale_host + kv.v_scale_host,
    kv.k_scale + kv.v_scale,
  )
  return kv.replace(k_scale=scales[:layers], v_scale=scales[layers:])


def _gather_blocks(pages, blocks):
  """``[num_kv_heads, len(pages), len(blocks), *page]``: heads stay first, so
  a cache split over heads stages, moves and scatters only its own."""
  return jnp.stack([page[:, blocks] for page in pages], axis=1)


def _set_blocks(pages, blocks, staged):
  """Writes ``staged[:, i]`` into ``pages[i]`` at ``blocks``; past-end dropped."""
  return tuple(page.at[:, blocks].set(staged[:, i], mode="drop") for i, page in enumerate(pages))


def _staging(sharding: jax.sharding.NamedSharding):
  """Where staged blocks ``[heads, pages, blocks, ...]`` live: split over
  heads like the pages, whole along the other axes."""
  return sharding.update(spec=jax.sharding.PartitionSpec(*sharding.spec[:1]))


def _replicated(sharding: jax.sharding.NamedSharding):
  """``sharding`` with nothing split (for plans and block indices)."""
  return sharding.update(spec=jax.sharding.PartitionSpec())


def _on_host(kv: KVCache, fn):
  """Runs ``fn`` where the host pages live (host compute when offloaded),
  its outputs in host memory."""
  if kv.host_sharding.memory_kind == kv.device_sharding.memory_kind:
    return fn
  if "out_memory_spaces" in inspect.signature(compute_on).parameters:  # JAX >= 0.12
    return compute_on(
      jax.jit(fn), compute_type="device_host", out_memory_spaces=jax.memory.Space.Host
    )
  return compute_on("device_host")(jax.jit(fn))


def _live_pairs(src, dst, count):
  return (jnp.arange(src.shape[0]) < count) & (src >= 0) & (dst >= 0)


def _bits(x: jax.Array) -> jax.Array:
  return lax.bitcast_convert_type(x, bits.bits_dtype(x.dtype))
