"""Paged attention in plain XLA: gather the pages, then masked softmax.

The reference every kernel is tested against, and the implementation used
where no Pallas kernel fits (CPU). It gathers each sequence's whole table, so
its temporary memory grows with ``batch * max_blocks_per_seq``, never with the
cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import bits, quantization
from pallas_kernels.paged_attention import common

_HIGHEST = jax.lax.Precision.HIGHEST
_NAME = "paged_attention_reference"


def paged_attention_reference(
  q,
  k_pages,
  v_pages,
  block_tables,
  lengths,
  *,
  sm_scale: float | None = None,
  soft_cap: float | None = None,
  sliding_window: int | None = None,
  k_scales=None,
  v_scales=None,
):
  """Decode attention: one new query token per sequence.

  Args:
    q: ``[batch, num_q_heads, head_dim]``, the query of each sequence's last
      token (position ``lengths[b] - 1``).
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_pages: same as ``k_pages``.
    block_tables: ``int32[batch, max_blocks_per_seq]``, -1 where no block.
    lengths: ``int32[batch]``, context length including the new token.
    sm_scale: logit scale; None means ``1 / sqrt(head_dim)``.
    soft_cap: logit soft cap, or None.
    sliding_window: keys visible to a query (itself included), or None.
    k_scales: float32 ``[num_kv_heads, num_blocks, block_size]`` scales of
      int8 or float8_e4m3fn pages (dequantized as read), or None.
    v_scales: same as ``k_scales``, for ``v_pages``.

  Returns:
    ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; zeros where
    ``lengths`` is 0.
  """
  common.check_attention_args(
    q, k_pages, v_pages, block_tables, lengths, k_scales=k_scales, v_scales=v_scales, kernel=_NAME
  )
  out = paged_prefill_attention_reference(
    q[:, None],
    k_pages,
    v_pages,
    block_tables,
    lengths,
    jnp.minimum(lengths, 1),
    sm_scale=sm_scale,
    soft_cap=soft_cap,
    sliding_window=sliding_window,
    k_scales=k_scales,
    v_scales=v_scales,
  )
  return out[:, 0]


def paged_prefill_attention_reference(
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
  k_scales=None,
  v_scales=None,
):
  """Causal attention of new tokens to their paged context (prefill, chunks).

  The new tokens' K/V are already written into the pages. Row ``i`` of
  sequence ``b`` is the token at position
  ``lengths[b] - query_lens[b] + i``; rows ``i >= query_lens[b]`` are padding.

  Args:
    q: ``[batch, num_queries, num_q_heads, head_dim]``.
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_pages: same as ``k_pages``.
    block_tables: ``int32[batch, max_blocks_per_seq]``, -1 where no block.
    lengths: ``int32[batch]``, context length including the new tokens.
    query_lens: ``int32[batch]``, new tokens per sequence (``<= num_queries``
      and ``<= lengths``).
    sm_scale: logit scale; None means ``1 / sqrt(head_dim)``.
    soft_cap: logit soft cap, or None.
    sliding_window: keys visible to a query (itself included), or None.
    k_scales: float32 ``[num_kv_heads, num_blocks, block_size]`` scales of
      int8 or float8_e4m3fn pages (dequantized as read), or None.
    v_scales: same as ``k_scales``, for ``v_pages``.

  Returns:
    ``[batch, num_queries, num_q_heads, head_dim]`` in ``q.dtype``; padding
    rows are zeros.
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
  group = num_q_heads // num_kv_heads
  scale = common.default_sm_scale(head_dim, sm_scale)

  keys, values, key_in_context = gather_context(
    k_pages, v_pages, block_tables, lengths, k_scales, v_scales
  )
  key_pos = jnp.arange(keys.shape[2], dtype=jnp.int32)
  query_pos = (lengths - query_lens)[:, None] + jnp.arange(num_queries, dtype=jnp.int32)
  visible = key_in_context[:, None, :] & (key_pos[None, None, :] <= query_pos[..., None])
  if sliding_window is not None:
    visible &= key_pos[None, None, :] > query_pos[..., None] - sliding_window
  is_query = jnp.arange(num_queries) < query_lens[:, None]
  visible &= is_query[..., None]

  grouped_q = q.reshape(batch, num_queries, num_kv_heads, group, head_dim)
  logits = jnp.einsum(
    "btkgd,kbsd->bkgts", grouped_q, keys, preferred_element_type=jnp.float32, precision=_HIGHEST
  )
  logits = common.apply_soft_cap(logits * scale, soft_cap)
  logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  weights = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  denominator = jnp.sum(weights, axis=-1, keepdims=True)
  out = jnp.einsum(
    "bkgts,kbsd->bkgtd", weights, values, preferred_element_type=jnp.float32, precision=_HIGHEST
  )
  # Rows with no visible key give zeros; a NaN read inside the context stays NaN.
  out = jnp.where(denominator == 0, 0.0, out / jnp.where(denominator == 0, 1.0, denominator))
  out = jnp.moveaxis(out, 3, 1).reshape(q.shape)
  return out.astype(q.dtype)


def take_blocks(pages, tables):
  """``pages[:, tables]``; floats narrower than 32 bits are gathered as their
  bit patterns (XLA:CPU computes a narrow-float gather on a float32 copy of
  the whole page array)."""
  if not bits.is_narrow_float(pages.dtype):
    return pages[:, tables]
  patterns = lax.bitcast_convert_type(pages, bits.bits_dtype(pages.dtype))
  return lax.bitcast_convert_type(patterns[:, tables], pages.dtype)


def gather_context(k_pages, v_pages, block_tables, lengths, k_scales, v_scales):
  """Gathers each sequence's pages into contiguous keys and values.

  Quantized pages (scales not None) are dequantized to float32.

  Returns:
    keys, values: ``[num_kv_heads, batch, max_blocks * block_size, head_dim]``.
      Values outside the context are zeroed, so no stale or poisoned byte can
      reach an output through a zero weight (masked logits handle the keys).
    key_in_context: bool ``[batch, max_blocks * block_size]``, the positions
      below the length whose table entry holds a block.
  """
  num_kv_heads, _, block_size, head_dim = k_pages.shape
  batch, max_blocks = block_tables.shape
  has_block = block_tables >= 0
  safe_tables = jnp.where(has_block, block_tables, 0)
  context = max_blocks * block_size
  key_pos = jnp.arange(context, dtype=jnp.int32)
  key_in_context = jnp.repeat(has_block, block_size, axis=1) & (key_pos[None, :] < lengths[:, None])

  def gather(pages, scales):
    pages = take_blocks(pages, safe_tables).reshape(num_kv_heads, batch, context, head_dim)
    if scales is None:
      return pages
    scales = scales[:, safe_tables].reshape(num_kv_heads, batch, context)
    return quantization.dequantize(pages, scales)

  values = jnp.where(key_in_context[None, :, :, None], gather(v_pages, v_scales), 0)
  return gather(k_pages, k_scales), values, key_in_context
