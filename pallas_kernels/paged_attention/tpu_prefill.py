"""Paged multi-query (prefill, chunk) attention as a Mosaic TPU kernel.

Each of the ``batch`` sequences (a tile of a ragged step, a prompt chunk)
brings up to ``num_queries`` consecutive new tokens, the last
``query_lens[b]`` of its context of ``lengths[b]`` tokens, and its own block
table. A KV head's query heads are stacked head-major into
``group * num_queries`` rows; grid ``(batch, num_kv_heads, row blocks)``, all
parallel (a block holds whole heads, or consecutive queries of one head; see
`row_block`). A program walks the pages from its first query's window to its
last query, ``pages_per_step`` pages per step, with double-buffered DMAs from
HBM (block tables and lengths scalar-prefetched into SMEM) and an online
softmax per row, masked causally and by the sliding window; rows past
``query_lens[b]`` give zeros. Matmuls run in the query dtype with float32
accumulation; quantized pages (int8, float8_e4m3fn) are widened to it
exactly, and their per-token scales multiply the logits (K) and the softmax
weights (V). On CPU the kernel runs in TPU interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_attention import common
from pallas_kernels.paged_attention.tpu import page_buffers, page_loader, page_specs, unpack_refs

_TOKENS_PER_STEP = 128
_NAME = "paged_prefill_attention_tpu"
BLOCK_ROWS = 512
VMEM_BUDGET = 12 * 2**20  # of the 16 MiB Mosaic scopes by default on v5e


def row_block(rows: int, num_queries: int, block_rows: int = BLOCK_ROWS) -> int:
  """Rows per program: all ``rows`` (``group * num_queries``, head-major) when
  at most ``block_rows``, else the largest multiple of 8 up to ``block_rows``
  that divides ``rows`` and divides or is divided by ``num_queries`` (a block
  holds whole heads, or consecutive queries of one head); ``rows`` if none."""
  if rows <= block_rows:
    return rows
  for size in range(block_rows - block_rows % 8, 0, -8):
    if rows % size == 0 and (num_queries % size == 0 or size % num_queries == 0):
      return size
  return rows


def vmem_bytes(rows: int, step_tokens: int, head_dim: int, q_dtype, kv_dtype) -> int:
  """An upper estimate of the VMEM a program of ``rows`` query rows uses."""
  lane_rows = rows * 128 * 4  # a float32 [rows, 1] column takes whole lanes
  return (
    4 * rows * head_dim * jnp.dtype(q_dtype).itemsize  # q and output, double-buffered
    + rows * head_dim * 4  # accumulator
    + 2 * lane_rows  # running maximum and sum
    + 3 * rows * step_tokens * 4  # logits and weights
    + 4 * step_tokens * head_dim * jnp.dtype(kv_dtype).itemsize  # K and V, two slots
    + 4 * step_tokens * 128 * 4  # scales, two slots
  )


def refusal(
  q_dtype,
  num_queries: int,
  group: int,
  block_size: int,
  head_dim: int,
  kv_dtype=None,
  *,
  block_rows: int = BLOCK_ROWS,
  pages_per_step: int | None = None,
) -> str | None:
  """Why the kernel cannot serve these shapes; None when it can.

  Mosaic on TPU loads no float16 vectors (v5e), and a program's rows (see
  `row_block`) and step must fit ``VMEM_BUDGET`` bytes of VMEM.
  """
  if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    return f"it computes in float32 or bfloat16, not {jnp.dtype(q_dtype).name}"
  rows = row_block(num_queries * group, num_queries, block_rows)
  step_tokens = (pages_per_step or max(_TOKENS_PER_STEP // block_size, 1)) * block_size
  need = vmem_bytes(rows, step_tokens, head_dim, q_dtype, kv_dtype or q_dtype)
  if need > VMEM_BUDGET:
    return (
      f"a program of {rows} query rows (head_dim {head_dim}, {step_tokens} keys per step) "
      f"needs about {need / 2**20:.1f} MiB of VMEM, more than {VMEM_BUDGET / 2**20:.0f} MiB"
    )
  return None


def paged_prefill_attention(
  q,
  k_pages,
  v_pages,
  block_tables,
  lengths,
  query_lens,
  *,
  sm_scale: float | None = None,
  soft_cap: float | None = None,
  sliding_window: int | None = None,
  pages_per_step: int | None = None,
  block_rows: int = BLOCK_ROWS,
  k_scales=None,
  v_scales=None,
  interpret: bool = False,
):
  """Causal attention of several new tokens per sequence to their paged context.

  Args:
    q: ``[batch, num_queries, num_q_heads, head_dim]``; row ``i`` of sequence
      ``b`` is the token at position ``lengths[b] - query_lens[b] + i``.
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_pages: same as ``k_pages``.
    block_tables: ``int32[batch, max_blocks_per_seq]``, -1 where no block.
    lengths: ``int32[batch]``, context length including the new tokens.
    query_lens: ``int32[batch]``, new tokens per sequence (at most
      ``num_queries`` and ``lengths[b]``); rows past it give zeros.
    sm_scale: logit scale; None means ``1 / sqrt(head_dim)``.
    soft_cap: logit soft cap, or None.
    sliding_window: keys visible to a query (itself included), or None.
    pages_per_step: pages per DMA step; None picks ``128 // block_size``
      tokens' worth, at most the table width.
    block_rows: most query rows (``group * num_queries``) per program; see
      `row_block`.
    k_scales: float32 ``[num_kv_heads, num_blocks, block_size]`` scales of
      int8 or float8_e4m3fn pages, or None.
    v_scales: same as ``k_scales``, for ``v_pages``.
    interpret: run in TPU interpret mode (CPU).

  Returns:
    ``[batch, num_queries, num_q_heads, head_dim]`` in ``q.dtype``.

  Raises:
    ValueError: for bad shapes, dtypes or options, or a dtype or shapes the
      kernel cannot serve (see `refusal`).
  """
  common.check_attention_args(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    query_rank=4,
    k_scales=k_scales,
    v_scales=v_scales,
    kernel=_NAME,
  )
  common.check_attention_options(sm_scale, soft_cap, sliding_window)
  common.check_query_lens(query_lens, lengths, kernel=_NAME)
  batch, num_queries, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  max_blocks = block_tables.shape[1]
  if pages_per_step is None:
    pages_per_step = min(max(_TOKENS_PER_STEP // block_size, 1), max_blocks)
  for name, value in (("pages_per_step", pages_per_step), ("block_rows", block_rows)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{_NAME}: {name} must be an int >= 1, got {value!r}")
  group = num_q_heads // num_kv_heads
  reason = refusal(
    q.dtype,
    num_queries,
    group,
    block_size,
    head_dim,
    k_pages.dtype,
    block_rows=block_rows,
    pages_per_step=pages_per_step,
  )
  if reason:
    raise ValueError(f"{_NAME} cannot serve these shapes: {reason}")
  padded_blocks = pl.cdiv(max_blocks, pages_per_step) * pages_per_step
  flat_tables = jnp.pad(
    block_tables, ((0, 0), (0, padded_blocks - max_blocks)), constant_values=-1
  ).reshape(-1)

  rows = group * num_queries
  block = row_block(rows, num_queries, block_rows)
  # [batch, num_kv_heads, group * num_queries, head_dim]: row g * num_queries + i.
  kernel_q = (
    q.reshape(batch, num_queries, num_kv_heads, group, head_dim)
    .transpose(0, 2, 3, 1, 4)
    .reshape(batch, num_kv_heads, rows, head_dim)
  )
  q_spec = pl.BlockSpec((None, None, block, head_dim), lambda b, h, j, *_: (b, h, j, 0))

  buffer_shape = (2, pages_per_step, block_size, head_dim)
  quantized = k_scales is not None
  scale_args = (k_scales, v_scales) if quantized else ()
  kernel = functools.partial(
    _prefill_kernel,
    sm_scale=common.default_sm_scale(head_dim, sm_scale),
    soft_cap=soft_cap,
    sliding_window=sliding_window,
    pages_per_step=pages_per_step,
    blocks_per_seq=padded_blocks,
    num_queries=num_queries,
    whole_heads=block % num_queries == 0,
    quantized=quantized,
  )
  out = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(batch, num_kv_heads, rows // block),
      in_specs=[q_spec, *page_specs(len(scale_args))],
      out_specs=q_spec,
      scratch_shapes=page_buffers(buffer_shape, k_pages.dtype, v_pages.dtype, len(scale_args)),
    ),
    out_shape=jax.ShapeDtypeStruct(kernel_q.shape, q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",) * 3),
    interpret=pltpu.InterpretParams() if interpret else False,
    name=_NAME,
  )(lengths, query_lens, flat_tables, kernel_q, k_pages, v_pages, *scale_args)
  return (
    out.reshape(batch, num_kv_heads, group, num_queries, head_dim)
    .transpose(0, 3, 1, 2, 4)
    .reshape(q.shape)
  )


def _prefill_kernel(
  lengths_ref,
  query_lens_ref,
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
  num_queries,
  whole_heads,
  quantized,
):
  """One (sequence, KV head, row block): the normalized output of its rows."""
  o_ref, k_buffer, v_buffer, k_scale_buffer, v_scale_buffer, streams = unpack_refs(
    k_hbm, v_hbm, refs, quantized
  )
  batch_index, head, row_block_index = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_size, head_dim = k_hbm.shape[2], k_hbm.shape[3]
  step_tokens = pages_per_step * block_size
  length = lengths_ref[batch_index]
  query_len = query_lens_ref[batch_index]
  first_query = length - query_len
  rows = q_ref.shape[0]
  # The block's rows are queries first_index .. last_index of their heads.
  first_index = 0 if whole_heads else lax.rem(row_block_index * rows, num_queries)
  last_index = jnp.minimum(
    num_queries - 1 if whole_heads else first_index + rows - 1, query_len - 1
  )
  first_visible = (
    jnp.int32(0)
    if sliding_window is None
    else jnp.maximum(first_query + first_index - sliding_window + 1, 0)
  )
  # lax.div: the operands are non-negative, so no floor-division fix-up.
  first_step = lax.div(first_visible, step_tokens)
  stop = first_query + last_index + 1  # past the block's last key; <= length
  stop_step = jnp.where(
    first_index <= last_index, lax.div(stop + step_tokens - 1, step_tokens), first_step
  )

  table_entry, page_copies, start_loading = page_loader(
    tables_ref, batch_index, head, blocks_per_seq, pages_per_step, streams
  )

  @pl.when(first_step < stop_step)
  def _():
    start_loading(first_step, 0)

  q = q_ref[...]
  compute_dtype = q.dtype
  # Row r is query (block start + r) % num_queries of its head; rows past
  # query_len see nothing.
  row = row_block_index * rows + lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
  query_index = lax.rem(row, num_queries)
  query_pos = jnp.where(query_index < query_len, first_query + query_index, -1)

  def readable(index, shape, axis):
    """Step ``index``'s tokens inside the context, along ``axis`` of shape."""
    token = lax.broadcasted_iota(jnp.int32, shape, axis)
    position = index * step_tokens + token
    mask = (position < stop) & (position >= first_visible)
    for page in range(pages_per_step):
      in_page = (token >= page * block_size) & (token < (page + 1) * block_size)
      mask &= ~in_page | (table_entry(index, page) >= 0)
    return mask, position

  def step(index, carry):
    acc, row_max, row_sum = carry
    slot = lax.rem(index - first_step, 2)

    @pl.when(index + 1 < stop_step)
    def _():
      start_loading(index + 1, 1 - slot)

    for copy in page_copies(index, slot):
      copy.wait()
    keys = k_buffer[slot].reshape(step_tokens, head_dim).astype(compute_dtype)
    logits = jnp.einsum("rd,td->rt", q, keys, preferred_element_type=jnp.float32)
    logits *= sm_scale
    if quantized:
      logits *= k_scale_buffer[slot].reshape(1, step_tokens)
    logits = common.apply_soft_cap(logits, soft_cap)
    key_readable, key_pos = readable(index, (1, step_tokens), 1)
    visible = key_readable & (key_pos <= query_pos)
    if sliding_window is not None:
      visible &= key_pos > query_pos - sliding_window
    logits = jnp.where(visible, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1, keepdims=True))
    rescale = jnp.exp(row_max - new_max)
    weights = jnp.exp(logits - new_max)
    row_sum = rescale * row_sum + jnp.sum(weights, axis=1, keepdims=True)
    if quantized:  # scales outside the context may hold anything
      weights *= jnp.where(key_readable, v_scale_buffer[slot].reshape(1, step_tokens), 0.0)
    values = v_buffer[slot].reshape(step_tokens, head_dim).astype(compute_dtype)
    values = jnp.where(readable(index, (step_tokens, 1), 0)[0], values, 0)
    acc = rescale * acc + jnp.einsum(
      "rt,td->rd", weights.astype(compute_dtype), values, preferred_element_type=jnp.float32
    )
    return acc, new_max, row_sum

  init = (
    jnp.zeros((rows, head_dim), jnp.float32),
    jnp.full((rows, 1), jnp.finfo(jnp.float32).min, jnp.float32),
    jnp.zeros((rows, 1), jnp.float32),
  )
  acc, _, row_sum = lax.fori_loop(first_step, stop_step, step, init)
  out = jnp.where(row_sum > 0, acc / jnp.maximum(row_sum, 1e-30), 0.0)
  o_ref[...] = out.astype(o_ref.dtype)
