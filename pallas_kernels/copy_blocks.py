"""Copy whole blocks within caches, in place: copy-on-write, swap staging.

One call executes a plan on every cache array given (all layers' K and V):
pair ``i < count`` copies block ``src[i]`` to block ``dst[i]`` in each array;
later entries (and pairs holding a -1) are ignored. A destination appears at
most once and no block is both a source and a destination, so the copies run
in parallel. The caches are aliased to the outputs, so a jit that donates
them moves only the planned blocks. Two Pallas flavours, one reference:

* ``backend="gpu"``: grid ``(pairs, num_kv_heads)``, one ``[block_size,
  head_dim]`` tile per array and program (Triton lowering).
* ``backend="tpu"``: one program, the plan scalar-prefetched into SMEM, one
  HBM-to-HBM DMA per pair and array, two pairs in flight (Mosaic).

``interpret=True`` runs either flavour on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton


def copy_blocks(
  caches: Sequence[jax.Array], src, dst, count, *, backend: str = "gpu", interpret: bool = False
):
  """Copies block ``src[i]`` to block ``dst[i]`` in every cache, ``i < count``.

  Args:
    caches: arrays ``[num_kv_heads, num_blocks, block_size, head_dim]`` of one
      shape and dtype (e.g. every layer's K and V).
    src: ``int32[pairs]``, source blocks (-1 in unused entries).
    dst: ``int32[pairs]``, destination blocks (-1 in unused entries).
    count: int32 scalar, the number of leading pairs to execute.
    backend: ``"gpu"`` or ``"tpu"``, the kernel flavour.
    interpret: run the kernel in (TPU) interpret mode, e.g. on CPU.

  Returns:
    A tuple of the updated caches, in the order given.
  """
  caches = tuple(caches)
  count = check_copy_blocks_args(caches, src, dst, count)
  if backend == "gpu":
    return _copy_blocks_gpu(caches, src, dst, count, interpret)
  if backend == "tpu":
    return _copy_blocks_tpu(caches, src, dst, count, interpret)
  raise ValueError(f"backend must be 'gpu' or 'tpu', got {backend!r}")


def copy_blocks_reference(caches: Sequence[jax.Array], src, dst, count):
  """The same copies in XLA, one live pair after another (a loop of
  dynamic slices: a plan that copies nothing, as most decode steps' plans,
  costs nothing).

  Args:
    caches: arrays ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    src: ``int32[pairs]``, source blocks.
    dst: ``int32[pairs]``, destination blocks.
    count: int32 scalar, the number of leading pairs to execute.

  Returns:
    A tuple of the updated caches.
  """
  caches = tuple(caches)
  count = check_copy_blocks_args(caches, src, dst, count)
  live = _live_pairs(src, dst, count)
  order = jnp.argsort(~live, stable=True)  # the live pairs first

  def copy_pair(i, caches):
    source, target = src[order[i]], dst[order[i]]
    return tuple(
      lax.dynamic_update_slice_in_dim(
        cache, lax.dynamic_slice_in_dim(cache, source, 1, axis=1), target, axis=1
      )
      for cache in caches
    )

  return lax.fori_loop(0, jnp.sum(live), copy_pair, caches)


def check_copy_blocks_args(caches, src, dst, count):
  """Raises ValueError for a bad plan shape or mismatched caches.

  Returns:
    ``count`` as an int32 array of shape ``[1]``.
  """
  if not caches:
    raise ValueError("copy_blocks needs at least one cache array")
  first = caches[0]
  if first.ndim != 4:
    raise ValueError(
      f"caches must be [num_kv_heads, num_blocks, block_size, head_dim], got shape {first.shape}"
    )
  for index, cache in enumerate(caches):
    if cache.shape != first.shape or cache.dtype != first.dtype:
      raise ValueError(
        f"cache {index} is {cache.dtype}{list(cache.shape)}, cache 0 is "
        f"{first.dtype}{list(first.shape)}; all must match"
      )
  for name, array in (("src", src), ("dst", dst)):
    if array.ndim != 1 or array.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32[pairs], got {array.dtype}{list(array.shape)}")
  if src.shape != dst.shape:
    raise ValueError(f"src {src.shape} and dst {dst.shape} differ in length")
  count = jnp.asarray(count)
  if count.size != 1 or count.dtype != jnp.int32:
    raise ValueError(f"count must be an int32 scalar, got {count.dtype}{list(count.shape)}")
  return count.reshape(1)


def _live_pairs(src, dst, count):
  return (jnp.arange(src.shape[0]) < count[0]) & (src >= 0) & (dst >= 0)


def _copy_blocks_gpu(caches, src, dst, count, interpret):
  num_kv_heads, _, block_size, head_dim = caches[0].shape
  for name, size in (("block_size", block_size), ("head_dim", head_dim)):
    if size & (size - 1):
      raise ValueError(f"{name} must be a power of two for the GPU kernel, got {size}")
  plan_spec = pl.BlockSpec(src.shape, lambda i, h: (0,))
  cache_spec = pl.BlockSpec((None, *caches[0].shape[1:]), lambda i, h: (h, 0, 0, 0))
  num_plan_args = 3
  return tuple(
    pl.pallas_call(
      _copy_tile_kernel,
      grid=(src.shape[0], num_kv_heads),
      in_specs=[plan_spec, plan_spec, pl.BlockSpec((1,), lambda i, h: (0,))]
      + [cache_spec] * len(caches),
      out_specs=[cache_spec] * len(caches),
      out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
      input_output_aliases={num_plan_args + i: i for i in range(len(caches))},
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="copy_blocks_gpu",
    )(src, dst, count, *caches)
  )


def _copy_tile_kernel(src_ref, dst_ref, count_ref, *cache_refs):
  """Copies one block of one KV head in every cache."""
  pair = pl.program_id(0)
  num_caches = len(cache_refs) // 2
  inputs, outputs = cache_refs[:num_caches], cache_refs[num_caches:]
  source, target = src_ref[pair], dst_ref[pair]

  @pl.when((pair < count_ref[0]) & (source >= 0) & (target >= 0))
  def _():
    for cache_in, cache_out in zip(inputs, outputs):
      cache_out[target] = cache_in[source]


def _copy_blocks_tpu(caches, src, dst, count, interpret):
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  num_plan_args = 3
  return tuple(
    pl.pallas_call(
      _copy_pairs_dma_kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=num_plan_args,
        grid=(1,),
        in_specs=[any_spec] * len(caches),
        out_specs=[any_spec] * len(caches),
        scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
      ),
      out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches],
      input_output_aliases={num_plan_args + i: i for i in range(len(caches))},
      interpret=pltpu.InterpretParams() if interpret else False,
      name="copy_blocks_tpu",
    )(src, dst, count, *caches)
  )


def _copy_pairs_dma_kernel(src_ref, dst_ref, count_ref, *refs):
  """Copies pair ``i`` while pair ``i - 1`` finishes (two semaphore slots)."""
  num_caches = (len(refs) - 1) // 2
  caches, sems = refs[num_caches : 2 * num_caches], refs[-1]
  count = jnp.minimum(count_ref[0], src_ref.shape[0])

  def for_live_pair(pair, action):
    source, target = src_ref[pair], dst_ref[pair]

    @pl.when((source >= 0) & (target >= 0))
    def _():
      for cache in caches:
        action(
          pltpu.make_async_copy(cache.at[:, source], cache.at[:, target], sems.at[lax.rem(pair, 2)])
        )

  @pl.loop(0, count)
  def _(pair):
    for_live_pair(pair, lambda copy: copy.start())

    @pl.when(pair > 0)
    def _():
      for_live_pair(pair - 1, lambda copy: copy.wait())

  @pl.when(count > 0)
  def _():
    for_live_pair(count - 1, lambda copy: copy.wait())
