"""Scatter new keys and values into their cache slots, in place.

vLLM's ``reshape_and_cache``: token ``t`` goes to slot ``slot_mapping[t]`` =
``block * block_size + offset`` of every KV head; ``-1`` skips the token. The
caches are aliased to the outputs (``input_output_aliases``), so under a jit
that donates them the write touches only the written slots. Two Pallas
flavours, one reference:

* ``backend="gpu"``: grid ``(tokens, num_kv_heads)``, one ``[head_dim]`` row
  per program (Triton lowering; ``interpret=True`` runs it on CPU).
* ``backend="tpu"``: one program, slots scalar-prefetched into SMEM (Mosaic;
  ``interpret=True`` is TPU interpret mode). 32-bit pages: one HBM-to-HBM DMA
  per token. Narrower pages (bfloat16, float16, int8, fp8) pack 2 or 4 rows
  into a 32-bit sublane, so a DMA cannot start at any one row of a block
  (Mosaic refuses the unaligned offset): their write reads the whole block
  (every KV head) into VMEM, selects the new rows in as 32-bit integers, and
  writes it back; consecutive tokens of one block share one read and write.

Slots must be distinct (the block manager never maps two tokens to one slot);
with duplicates, which token lands is unspecified.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton


def write_kv(
  k_cache, v_cache, k, v, slot_mapping, *, backend: str = "gpu", interpret: bool = False
):
  """Writes ``k``, ``v`` into the cache slots named by ``slot_mapping``.

  Args:
    k_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_cache: same as ``k_cache``.
    k: ``[tokens, num_kv_heads, head_dim]``, same dtype as the cache.
    v: same as ``k``.
    slot_mapping: ``int32[tokens]``, ``block * block_size + offset`` or -1.
    backend: ``"gpu"`` or ``"tpu"``, the kernel flavour.
    interpret: run the kernel in (TPU) interpret mode, e.g. on CPU.

  Returns:
    The updated ``(k_cache, v_cache)``.
  """
  check_write_kv_args(k_cache, v_cache, k, v, slot_mapping)
  if backend == "gpu":
    return _write_kv_gpu(k_cache, v_cache, k, v, slot_mapping, interpret)
  if backend == "tpu":
    return _write_kv_tpu(k_cache, v_cache, k, v, slot_mapping, interpret)
  raise ValueError(f"backend must be 'gpu' or 'tpu', got {backend!r}")


def write_kv_reference(k_cache, v_cache, k, v, slot_mapping):
  """The same write as one XLA scatter per cache (in place when donated).

  Args:
    k_cache: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_cache: same as ``k_cache``.
    k: ``[tokens, num_kv_heads, head_dim]``.
    v: same as ``k``.
    slot_mapping: ``int32[tokens]``, ``block * block_size + offset`` or -1.

  Returns:
    The updated ``(k_cache, v_cache)``.
  """
  check_write_kv_args(k_cache, v_cache, k, v, slot_mapping)
  return _scatter_slots((k_cache, v_cache), (k, v), slot_mapping)


def write_scales(k_scale_cache, v_scale_cache, k_scales, v_scales, slot_mapping):
  """Writes quantized tokens' scales into their slots (one XLA scatter each).

  Args:
    k_scale_cache: float32 ``[num_kv_heads, num_blocks, block_size]``.
    v_scale_cache: same as ``k_scale_cache``.
    k_scales: float32 ``[tokens, num_kv_heads]``.
    v_scales: same as ``k_scales``.
    slot_mapping: ``int32[tokens]``, ``block * block_size + offset`` or -1.

  Returns:
    The updated ``(k_scale_cache, v_scale_cache)``.
  """
  num_kv_heads = k_scale_cache.shape[0]
  for name, cache in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
    if cache.ndim != 3 or cache.shape != k_scale_cache.shape:
      raise ValueError(
        f"{name} must be [num_kv_heads, num_blocks, "
        f"block_size] like k_scale_cache, got {cache.shape}"
      )
  expected = (slot_mapping.shape[0], num_kv_heads)
  for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
    if scales.shape != expected:
      raise ValueError(f"{name} must be [tokens, num_kv_heads] = {expected}, got {scales.shape}")
  return _scatter_slots((k_scale_cache, v_scale_cache), (k_scales, v_scales), slot_mapping)


def _scatter_slots(caches, rows, slot_mapping):
  """``caches[i][:, slot]`` = ``rows[i][token]`` for each written token."""
  num_blocks, block_size = caches[0].shape[1:3]
  # An index past the end is dropped; -1 would wrap around to the last block.
  block = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)
  offset = slot_mapping % block_size
  return tuple(
    cache.at[:, block, offset].set(jnp.swapaxes(new, 0, 1), mode="drop")
    for cache, new in zip(caches, rows)
  )


def check_write_kv_args(k_cache, v_cache, k, v, slot_mapping) -> None:
  """Raises ValueError unless the arguments describe one cache write."""
  if k_cache.ndim != 4:
    raise ValueError(
      f"k_cache must be [num_kv_heads, num_blocks, block_size, head_dim], got shape {k_cache.shape}"
    )
  if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
    raise ValueError(
      f"v_cache {v_cache.dtype}{list(v_cache.shape)} differs "
      f"from k_cache {k_cache.dtype}{list(k_cache.shape)}"
    )
  num_kv_heads, _, _, head_dim = k_cache.shape
  if k.ndim != 3 or k.shape[1:] != (num_kv_heads, head_dim):
    raise ValueError(
      f"k must be [tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}], got shape {k.shape}"
    )
  if v.shape != k.shape:
    raise ValueError(f"v shape {v.shape} differs from k shape {k.shape}")
  if not k.dtype == v.dtype == k_cache.dtype:
    raise ValueError(
      f"k, v and the cache must share one dtype, got {k.dtype}, {v.dtype}, {k_cache.dtype}"
    )
  if slot_mapping.shape != k.shape[:1] or slot_mapping.dtype != jnp.int32:
    raise ValueError(
      f"slot_mapping must be int32[{k.shape[0]}], got "
      f"{slot_mapping.dtype}{list(slot_mapping.shape)}"
    )


def _write_kv_gpu(k_cache, v_cache, k, v, slot_mapping, interpret):
  tokens, num_kv_heads, head_dim = k.shape
  if head_dim & (head_dim - 1):
    raise ValueError(f"head_dim must be a power of two for the GPU kernel, got {head_dim}")
  row_spec = pl.BlockSpec((None, None, head_dim), lambda t, h: (t, h, 0))
  cache_spec = pl.BlockSpec((None, *k_cache.shape[1:]), lambda t, h: (h, 0, 0, 0))
  return pl.pallas_call(
    _write_row_kernel,
    grid=(tokens, num_kv_heads),
    in_specs=[
      pl.BlockSpec((tokens,), lambda t, h: (0,)),
      row_spec,
      row_spec,
      cache_spec,
      cache_spec,
    ],
    out_specs=[cache_spec, cache_spec],
    out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2,
    input_output_aliases={3: 0, 4: 1},
    compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
    interpret=interpret,
    name="write_kv_gpu",
  )(slot_mapping, k, v, k_cache, v_cache)


def _write_row_kernel(slots_ref, k_ref, v_ref, k_cache_in, v_cache_in, k_cache_ref, v_cache_ref):
  """Writes one token's row of one KV head."""
  del k_cache_in, v_cache_in  # aliased to the outputs
  slot = slots_ref[pl.program_id(0)]
  block_size = k_cache_ref.shape[1]

  @pl.when(slot >= 0)
  def _():
    block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
    k_cache_ref[block, offset, :] = k_ref[...]
    v_cache_ref[block, offset, :] = v_ref[...]


def _write_kv_tpu(k_cache, v_cache, k, v, slot_mapping, interpret):
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  width = k_cache.dtype.itemsize
  if width == 4:
    kernel, scratch, name = _write_tokens_dma_kernel, [], "write_kv_tpu"
  else:  # as same-width integers (a free bitcast), selected in int32
    stored = k_cache.dtype
    as_int = lambda x: lax.bitcast_convert_type(x, jnp.dtype(f"int{8 * width}"))
    k_cache, v_cache, k, v = map(as_int, (k_cache, v_cache, k, v))
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    block = pltpu.VMEM((num_kv_heads, block_size, head_dim), k_cache.dtype)
    row = pltpu.VMEM((num_kv_heads, head_dim), k_cache.dtype)
    kernel, scratch, name = _write_tokens_block_kernel, [block, block, row, row], "write_kv_tpu_rmw"
  out = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1,
      grid=(1,),
      in_specs=[any_spec] * 4,
      out_specs=[any_spec] * 2,
      scratch_shapes=[*scratch, pltpu.SemaphoreType.DMA(())],
    ),
    out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2,
    input_output_aliases={3: 0, 4: 1},
    interpret=pltpu.InterpretParams() if interpret else False,
    name=name,
  )(slot_mapping, k, v, k_cache, v_cache)
  if width == 4:
    return out
  return tuple(lax.bitcast_convert_type(x, stored) for x in out)


def _write_tokens_dma_kernel(
  slots_ref, k_hbm, v_hbm, k_cache_in, v_cache_in, k_cache_hbm, v_cache_hbm, sem
):
  """Starts one DMA per token and cache, then waits for all of them."""
  del k_cache_in, v_cache_in  # aliased to the outputs
  tokens = k_hbm.shape[0]
  block_size = k_cache_hbm.shape[2]

  def copies(token):
    slot = slots_ref[token]
    block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
    return [
      pltpu.make_async_copy(new.at[token], cache.at[:, block, offset], sem)
      for new, cache in ((k_hbm, k_cache_hbm), (v_hbm, v_cache_hbm))
    ]

  def for_each_written_token(action):
    @pl.loop(0, tokens)
    def _(token):
      @pl.when(slots_ref[token] >= 0)
      def _():
        for copy in copies(token):
          action(copy)

  for_each_written_token(lambda copy: copy.start())
  for_each_written_token(lambda copy: copy.wait())


def _write_tokens_block_kernel(
  slots_ref,
  k_hbm,
  v_hbm,
  k_cache_in,
  v_cache_in,
  k_cache_hbm,
  v_cache_hbm,
  k_block,
  v_block,
  k_row,
  v_row,
  sem,
):
  """Writes each token's rows into its block in VMEM: the block is read when
  a token's block differs from the previous written token's, and written back
  (then waited for) before the next block is read and at the end."""
  del k_cache_in, v_cache_in  # aliased to the outputs
  tokens = k_hbm.shape[0]
  block_size = k_cache_hbm.shape[2]
  blocks = ((k_cache_hbm, k_block), (v_cache_hbm, v_block))

  def move(block, to_cache: bool):
    copies = [
      pltpu.make_async_copy(
        *((vmem, cache.at[:, block]) if to_cache else (cache.at[:, block], vmem)), sem
      )
      for cache, vmem in blocks
    ]
    for copy in copies:
      copy.start()
    for copy in copies:
      copy.wait()

  def body(token, current):
    slot = slots_ref[token]
    written = slot >= 0
    block = jnp.where(written, lax.div(slot, block_size), current)

    @pl.when(written & (block != current))
    def _():
      @pl.when(current >= 0)
      def _():
        move(current, to_cache=True)

      move(block, to_cache=False)

    @pl.when(written)
    def _():
      rows = ((k_hbm, k_row), (v_hbm, v_row))
      copies = [pltpu.make_async_copy(new.at[token], vmem, sem) for new, vmem in rows]
      for copy in copies:
        copy.start()
      for copy in copies:
        copy.wait()
      offset = lax.rem(slot, block_size)
      for (_, vmem), (_, row) in zip(blocks, rows):
        pages = vmem[...].astype(jnp.int32)
        at_offset = lax.broadcasted_iota(jnp.int32, pages.shape, 1) == offset
        vmem[...] = jnp.where(at_offset, row[...].astype(jnp.int32)[:, None], pages).astype(
          vmem.dtype
        )

    return block

  last = lax.fori_loop(0, tokens, body, jnp.int32(-1))

  @pl.when(last >= 0)
  def _():
    move(last, to_cache=True)
