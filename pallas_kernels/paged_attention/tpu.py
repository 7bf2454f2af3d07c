"""Paged decode attention as a Mosaic TPU kernel.

Grid ``(batch, num_kv_heads)``, both parallel. The lengths and the block
tables are scalar-prefetched into SMEM; each program walks its sequence's
pages ``pages_per_step`` at a time, copying them from HBM with async DMAs
into a double buffer (the next step's pages load while this step computes),
and keeps an online softmax for the query heads of its KV head. Only steps
that overlap ``[window start, length)`` are loaded. Quantized pages (int8,
float8_e4m3fn) arrive with their per-token scales (one more DMA per page and
array) and are dequantized to float32 in VMEM. On CPU the kernel runs in TPU
interpret mode (``interpret=True``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import common

_TOKENS_PER_STEP = 128
_SUBLANES = 8
_NAME = "paged_attention_tpu"


def paged_attention(
  q,
  k_pages,
  v_pages,
  block_tables,
  lengths,
  *,
  sm_scale: float | None = None,
  soft_cap: float | None = None,
  sliding_window: int | None = None,
  pages_per_step: int | None = None,
  k_scales=None,
  v_scales=None,
  interpret: bool = False,
):
  """Decode attention over a paged KV cache (one query token per sequence).

  Args:
    q: ``[batch, num_q_heads, head_dim]``.
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_pages: same as ``k_pages``.
    block_tables: ``int32[batch, max_blocks_per_seq]``, -1 where no block.
    lengths: ``int32[batch]``, context length including the new token.
    sm_scale: logit scale; None means ``1 / sqrt(head_dim)``.
    soft_cap: logit soft cap, or None.
    sliding_window: keys visible to the query (itself included), or None.
    pages_per_step: pages per DMA step; None picks ``128 // block_size``
      tokens' worth, at most the table width.
    k_scales: float32 ``[num_kv_heads, num_blocks, block_size]`` scales of
      int8 or float8_e4m3fn pages, or None.
    v_scales: same as ``k_scales``, for ``v_pages``.
    interpret: run in TPU interpret mode (CPU).

  Returns:
    ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; zeros where
    ``lengths`` is 0.
  """
  common.check_attention_args(
    q, k_pages, v_pages, block_tables, lengths, k_scales=k_scales, v_scales=v_scales, kernel=_NAME
  )
  common.check_attention_options(sm_scale, soft_cap, sliding_window)
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  max_blocks = block_tables.shape[1]
  if pages_per_step is None:
    pages_per_step = min(max(_TOKENS_PER_STEP // block_size, 1), max_blocks)
  if not isinstance(pages_per_step, int) or pages_per_step < 1:
    raise ValueError(f"pages_per_step must be an int >= 1, got {pages_per_step!r}")
  padded_blocks = pl.cdiv(max_blocks, pages_per_step) * pages_per_step
  flat_tables = jnp.pad(
    block_tables, ((0, 0), (0, padded_blocks - max_blocks)), constant_values=-1
  ).reshape(-1)

  group = num_q_heads // num_kv_heads
  if group % _SUBLANES:
    # A [group, 1, head_dim] block keeps Mosaic from tiling a short group dim
    # by 8 sublanes; float32 avoids packed-dtype layouts on that path.
    kernel_q = q.reshape(batch, num_q_heads, 1, head_dim).astype(jnp.float32)
    q_spec = pl.BlockSpec((None, group, None, head_dim), lambda b, h, *_: (b, h, 0, 0))
  else:
    kernel_q = q
    q_spec = pl.BlockSpec((None, group, head_dim), lambda b, h, *_: (b, h, 0))

  buffer_shape = (2, pages_per_step, block_size, head_dim)
  quantized = k_scales is not None
  scale_args = (k_scales, v_scales) if quantized else ()
  kernel = functools.partial(
    _decode_kernel,
    sm_scale=common.default_sm_scale(head_dim, sm_scale),
    soft_cap=soft_cap,
    sliding_window=sliding_window,
    pages_per_step=pages_per_step,
    blocks_per_seq=padded_blocks,
    quantized=quantized,
  )
  out = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(batch, num_kv_heads),
      in_specs=[q_spec, *page_specs(len(scale_args))],
      out_specs=q_spec,
      scratch_shapes=page_buffers(buffer_shape, k_pages.dtype, v_pages.dtype, len(scale_args)),
    ),
    out_shape=jax.ShapeDtypeStruct(kernel_q.shape, kernel_q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    interpret=pltpu.InterpretParams() if interpret else False,
    name="paged_attention_tpu",
  )(lengths, flat_tables, kernel_q, k_pages, v_pages, *scale_args)
  return out.reshape(q.shape).astype(q.dtype)


def _decode_kernel(
  lengths_ref,
  tables_ref,
  q_ref,
  k_hbm,
  v_hbm,
  *refs,
  sm_scale,
  soft_cap,
  sliding_window,
  pages_per_step,
  blocks_per_seq,
  quantized,
):
  """One (sequence, KV head): the normalized output of its query heads."""
  o_ref, k_buffer, v_buffer, k_scale_buffer, v_scale_buffer, streams = unpack_refs(
    k_hbm, v_hbm, refs, quantized
  )
  batch_index, head = pl.program_id(0), pl.program_id(1)
  block_size, head_dim = k_hbm.shape[2], k_hbm.shape[3]
  step_tokens = pages_per_step * block_size
  length = lengths_ref[batch_index]
  first_visible = common.window_start(length, sliding_window)
  # lax.div/rem: the operands are non-negative, so no floor-division fix-up.
  first_step = lax.div(first_visible, step_tokens)
  stop_step = lax.div(length + step_tokens - 1, step_tokens)

  table_entry, page_copies, start_loading = page_loader(
    tables_ref, batch_index, head, blocks_per_seq, pages_per_step, streams
  )

  @pl.when(first_step < stop_step)
  def _():
    start_loading(first_step, 0)

  q = q_ref[...].astype(jnp.float32).reshape(-1, head_dim)

  def visible(index, shape, axis):
    """Which tokens of step ``index`` a query sees, along ``axis`` of shape."""
    token = lax.broadcasted_iota(jnp.int32, shape, axis)
    position = index * step_tokens + token
    mask = (position < length) & (position >= first_visible)
    for page in range(pages_per_step):
      in_page = (token >= page * block_size) & (token < (page + 1) * block_size)
      mask &= ~in_page | (table_entry(index, page) >= 0)
    return mask

  def step(index, carry):
    acc, row_max, row_sum = carry
    slot = lax.rem(index - first_step, 2)

    @pl.when(index + 1 < stop_step)
    def _():
      start_loading(index + 1, 1 - slot)

    for copy in page_copies(index, slot):
      copy.wait()
    keys = k_buffer[slot].astype(jnp.float32).reshape(step_tokens, head_dim)
    logits = jnp.einsum("gd,td->gt", q, keys, preferred_element_type=jnp.float32) * sm_scale
    if quantized:
      logits *= k_scale_buffer[slot].reshape(1, step_tokens)
    logits = common.apply_soft_cap(logits, soft_cap)
    logits = jnp.where(visible(index, (1, step_tokens), 1), logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1, keepdims=True))
    rescale = jnp.exp(row_max - new_max)
    weights = jnp.exp(logits - new_max)
    values = v_buffer[slot].astype(jnp.float32).reshape(step_tokens, head_dim)
    if quantized:
      values *= v_scale_buffer[slot].reshape(step_tokens, 1)
    values = jnp.where(visible(index, (step_tokens, 1), 0), values, 0.0)
    acc = rescale * acc + jnp.einsum(
      "gt,td->gd", weights, values, preferred_element_type=jnp.float32
    )
    return acc, new_max, rescale * row_sum + jnp.sum(weights, axis=1, keepdims=True)

  rows = q.shape[0]
  init = (
    jnp.zeros((rows, head_dim), jnp.float32),
    jnp.full((rows, 1), jnp.finfo(jnp.float32).min, jnp.float32),
    jnp.zeros((rows, 1), jnp.float32),
  )
  acc, _, row_sum = lax.fori_loop(first_step, stop_step, step, init)
  out = jnp.where(row_sum > 0, acc / jnp.maximum(row_sum, 1e-30), 0.0)
  o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


def unpack_refs(k_hbm, v_hbm, refs, quantized: bool):
  """A paged kernel's refs after its K/V pages: `(o_ref, k_buffer,
  v_buffer, k_scale_buffer, v_scale_buffer, streams)`, the scale buffers
  None unless `quantized`; `streams` are the `(hbm, buffer, semaphores)`
  triples a step copies."""
  if quantized:
    k_scale_hbm, v_scale_hbm, o_ref, k_buffer, v_buffer, k_scales, v_scales, k_sems, v_sems = refs
    scale_streams = ((k_scale_hbm, k_scales, k_sems), (v_scale_hbm, v_scales, v_sems))
  else:
    o_ref, k_buffer, v_buffer, k_sems, v_sems = refs
    k_scales = v_scales = None
    scale_streams = ()
  streams = ((k_hbm, k_buffer, k_sems), (v_hbm, v_buffer, v_sems), *scale_streams)
  return o_ref, k_buffer, v_buffer, k_scales, v_scales, streams


def page_loader(tables_ref, row: int, head: int, blocks_per_seq: int, pages_per_step: int, streams):
  """`(table_entry, page_copies, start_loading)` of sequence `row`'s pages
  of KV head `head`, `pages_per_step` at a time into buffer slot 0 or 1:
  `table_entry(step, page)` reads its flattened block table (-1: no
  block, which loads block 0 and is masked by the caller), `page_copies(step,
  slot)` are the step's copies of every stream, `start_loading` starts
  them."""

  def table_entry(step, page):
    return tables_ref[row * blocks_per_seq + step * pages_per_step + page]

  def page_copies(step, slot):
    copies = []
    for page in range(pages_per_step):
      block = jnp.maximum(table_entry(step, page), 0)
      for hbm, buffer, sems in streams:
        copies.append(
          pltpu.make_async_copy(hbm.at[head, block], buffer.at[slot, page], sems.at[slot])
        )
    return copies

  def start_loading(step, slot):
    for copy in page_copies(step, slot):
      copy.start()

  return table_entry, page_copies, start_loading


def page_specs(num_scales: int) -> list:
  """The in-specs of a paged kernel's K and V pages and their `num_scales`
  scale arrays: left in HBM, copied by the kernel (`page_loader`)."""
  return [pl.BlockSpec(memory_space=pl.ANY)] * (2 + num_scales)


def page_buffers(buffer_shape, k_dtype, v_dtype, num_scales: int) -> list:
  """The scratch of a paged kernel: double buffers for a step's K and V
  pages (`buffer_shape`) and their scales, and one DMA semaphore pair per
  stream kind (pages, as `unpack_refs` takes them)."""
  scales = [pltpu.VMEM(buffer_shape[:3], jnp.float32)] * num_scales
  return [
    pltpu.VMEM(buffer_shape, k_dtype),
    pltpu.VMEM(buffer_shape, v_dtype),
    *scales,
    pltpu.SemaphoreType.DMA((2,)),
    pltpu.SemaphoreType.DMA((2,)),
  ]
