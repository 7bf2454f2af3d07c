"""Paged attention in XLA, one chunk of the block table at a time.

The reference gathers each sequence's whole table; this gathers
``chunk_positions`` keys of every sequence per step of a loop (an online
softmax carries the running maximum, sum and output across chunks) and runs
only the chunks the longest context reaches (from the first one a sliding
window still sees), so its cost follows the live contexts, not
``max_blocks_per_seq``. The implementation used where no Pallas kernel fits
(CPU); its masking rules and results are the reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import common, reference

_HIGHEST = jax.lax.Precision.HIGHEST
_NAME = "paged_attention_chunked"
CHUNK_POSITIONS = 128


def paged_attention_chunked(q, k_pages, v_pages, block_tables, lengths, **options):
  """Decode attention, as `reference.paged_attention_reference` (same
  arguments and result), a chunk of the table at a time."""
  common.check_attention_args(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    k_scales=options.get("k_scales"),
    v_scales=options.get("v_scales"),
    kernel=_NAME,
  )
  out = paged_prefill_attention_chunked(
    q[:, None], k_pages, v_pages, block_tables, lengths, jnp.minimum(lengths, 1), **options
  )
  return out[:, 0]


def paged_prefill_attention_chunked(
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
  chunk_positions: int = CHUNK_POSITIONS,
):
  """Causal attention of new tokens to their paged context, as
  `reference.paged_prefill_attention_reference` (same arguments and
  result), `chunk_positions` keys (rounded to whole blocks) at a time."""
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
  k_pages, v_pages, k_scales, v_scales = (
    None if a is None else jnp.asarray(a) for a in (k_pages, v_pages, k_scales, v_scales)
  )
  batch, num_queries, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  scale = common.default_sm_scale(head_dim, sm_scale)
  max_blocks = block_tables.shape[1]
  chunk_blocks = min(max(1, chunk_positions // block_size), max_blocks)
  num_chunks = -(-max_blocks // chunk_blocks)
  tables = jnp.pad(
    block_tables, ((0, 0), (0, num_chunks * chunk_blocks - max_blocks)), constant_values=-1
  )
  chunk_len = chunk_blocks * block_size

  query_pos = (lengths - query_lens)[:, None] + jnp.arange(num_queries, dtype=jnp.int32)
  is_query = jnp.arange(num_queries) < query_lens[:, None]
  grouped_q = q.reshape(batch, num_queries, num_kv_heads, group, head_dim)

  def attend_chunk(chunk, carry):
    row_max, total, out = carry
    offset = chunk * chunk_len
    columns = jax.lax.dynamic_slice_in_dim(tables, chunk * chunk_blocks, chunk_blocks, axis=1)
    keys, values, key_in_context = reference.gather_context(
      k_pages, v_pages, columns, lengths - offset, k_scales, v_scales
    )
    key_pos = offset + jnp.arange(chunk_len, dtype=jnp.int32)
    visible = key_in_context[:, None, :] & (key_pos[None, None, :] <= query_pos[..., None])
    if sliding_window is not None:
      visible &= key_pos[None, None, :] > query_pos[..., None] - sliding_window
    visible &= is_query[..., None]
    logits = jnp.einsum(
      "btkgd,kbsd->bkgts", grouped_q, keys, preferred_element_type=jnp.float32, precision=_HIGHEST
    )
    logits = common.apply_soft_cap(logits * scale, soft_cap)
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))
    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    weights = jnp.exp(logits - shift[..., None])
    rescale = jnp.exp(row_max - shift)
    total = total * rescale + jnp.sum(weights, axis=-1)
    out = out * rescale[..., None] + jnp.einsum(  # weights in the values' dtype, as on GPUs
      "bkgts,kbsd->bkgtd",
      weights.astype(values.dtype),
      values,
      preferred_element_type=jnp.float32,
      precision=_HIGHEST,
    )
    return new_max, total, out

  shape = (batch, num_kv_heads, group, num_queries)
  start = jnp.zeros((), jnp.int32)
  if sliding_window is not None:  # chunks wholly before every query's window are skipped
    first_visible = jnp.where(
      query_lens > 0, lengths - query_lens - sliding_window + 1, jnp.iinfo(jnp.int32).max
    )
    start = jnp.maximum(jnp.min(first_visible), 0) // chunk_len
  stop = jnp.minimum(-(-jnp.max(lengths, initial=0) // chunk_len), num_chunks)
  _, total, out = jax.lax.fori_loop(
    start,
    stop,
    attend_chunk,
    (
      jnp.full(shape, -jnp.inf, jnp.float32),
      jnp.zeros(shape, jnp.float32),
      jnp.zeros((*shape, head_dim), jnp.float32),
    ),
  )
  # Rows with no visible key give zeros; a NaN read inside the context stays NaN.
  out = jnp.where(total[..., None] == 0, 0.0, out / jnp.where(total == 0, 1.0, total)[..., None])
  out = jnp.moveaxis(out, 3, 1).reshape(q.shape)
  return out.astype(q.dtype)
