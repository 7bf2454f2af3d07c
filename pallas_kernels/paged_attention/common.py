"""Argument checks and masking rules shared by every paged-attention kernel.

Layout (the one of JAX's own Pallas paged-attention kernels):
  q:            [batch, num_q_heads, head_dim]
  k_pages:      [num_kv_heads, num_blocks, block_size, head_dim] (v_pages alike)
  block_tables: int32[batch, max_blocks_per_seq], -1 where a sequence has no
                block (past its end, or a block that left the sliding window)
  lengths:      int32[batch], tokens in each sequence's context, 0 allowed

A key position ``p`` of sequence ``b`` is visible to the query at position
``t`` when ``p <= t``, ``p < lengths[b]``, ``p > t - sliding_window`` (with a
window) and ``block_tables[b, p // block_size] >= 0``. A decode query sits at
position ``lengths[b] - 1``. A query that sees no key gives zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quantization


def check_attention_args(
  q,
  k_pages,
  v_pages,
  block_tables,
  lengths,
  *,
  query_rank: int = 3,
  k_scales=None,
  v_scales=None,
  kernel: str = "paged attention",
) -> None:
  """Raises ValueError unless shapes and dtypes describe one paged attention.

  Args:
    q: queries, ``[batch, num_q_heads, head_dim]`` (``query_rank=3``) or
      ``[batch, num_queries, num_q_heads, head_dim]`` (``query_rank=4``).
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_pages: same shape and dtype as ``k_pages``.
    block_tables: ``int32[batch, max_blocks_per_seq]``.
    lengths: ``int32[batch]``.
    query_rank: 3 for decode, 4 for the prefill variant.
    k_scales: None, or float32 ``[num_kv_heads, num_blocks, block_size]``
      scales of int8 / float8_e4m3fn pages (see ``quantization``).
    v_scales: same as ``k_scales``, for ``v_pages``.
    kernel: the implementation's name, for the messages.
  """
  layout = {3: "[batch, num_q_heads, head_dim]", 4: "[batch, num_queries, num_q_heads, head_dim]"}[
    query_rank
  ]
  pages = "[num_kv_heads, num_blocks, block_size, head_dim]"
  for name, value, expected in (
    ("q", q, layout),
    ("k_pages", k_pages, pages),
    ("v_pages", v_pages, pages),
    ("block_tables", block_tables, "int32[batch, max_blocks_per_seq]"),
    ("lengths", lengths, "int32[batch]"),
  ):
    require_array(name, value, expected)
  if q.ndim != query_rank:
    raise ValueError(f"q must be {layout}, got shape {q.shape}")
  if k_pages.ndim != 4:
    raise ValueError(
      f"k_pages must be [num_kv_heads, num_blocks, block_size, head_dim], got shape {k_pages.shape}"
    )
  if v_pages.shape != k_pages.shape:
    raise ValueError(f"v_pages shape {v_pages.shape} differs from k_pages shape {k_pages.shape}")
  quantization.check_scales(k_pages, v_pages, k_scales, v_scales, kernel=kernel)
  if k_scales is None and not q.dtype == k_pages.dtype == v_pages.dtype:
    bits = jnp.issubdtype(k_pages.dtype, jnp.unsignedinteger)
    raise ValueError(
      f"q, k_pages and v_pages must share one dtype, got "
      f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
      + (" (a KVCache's pages of bit patterns are read with `cache.pages(layer)`)" if bits else "")
    )
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q must be a float array, got {q.dtype}")
  batch, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
  num_kv_heads = k_pages.shape[0]
  if num_q_heads % num_kv_heads:
    raise ValueError(
      f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
    )
  if k_pages.shape[-1] != head_dim:
    raise ValueError(
      f"head_dim of q ({head_dim}) differs from head_dim of the pages ({k_pages.shape[-1]})"
    )
  if block_tables.ndim != 2 or block_tables.shape[0] != batch:
    raise ValueError(
      f"block_tables must be [batch={batch}, max_blocks_per_seq], got shape {block_tables.shape}"
    )
  if lengths.shape != (batch,):
    raise ValueError(f"lengths must be [batch={batch}], got shape {lengths.shape}")
  for name, array in (("block_tables", block_tables), ("lengths", lengths)):
    if array.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {array.dtype}")


def require_array(name: str, value, expected: str) -> None:
  """Raises ValueError unless ``value`` is an array (it has a shape and a dtype).

  Args:
    name: the argument's name, for the message.
    value: what the caller passed.
    expected: the layout the argument should have, for the message.
  """
  if hasattr(value, "shape") and hasattr(value, "dtype"):
    return
  if isinstance(value, (tuple, list)) and value and all(hasattr(item, "shape") for item in value):
    hint = (
      f"a {type(value).__name__} of {len(value)} arrays; pass one "
      "layer's pages, e.g. cache.k[layer]"
      if name.endswith("_pages")
      else f"a {type(value).__name__} of {len(value)} arrays"
    )
  else:
    hint = f"a {type(value).__name__}"
    if isinstance(value, (tuple, list)):
      hint += "; convert it with jnp.asarray(..., jnp.int32)"
  raise ValueError(f"{name} must be an array {expected}, got {hint}")


def check_query_lens(query_lens, lengths, *, kernel: str = "paged attention") -> None:
  """Raises ValueError unless ``query_lens`` is int32 shaped like ``lengths``.

  Args:
    query_lens: new tokens per sequence, ``int32[batch]``.
    lengths: ``int32[batch]``.
    kernel: the implementation's name, for the message.
  """
  require_array("query_lens", query_lens, "int32[batch]")
  if query_lens.shape != lengths.shape or query_lens.dtype != jnp.int32:
    raise ValueError(
      f"{kernel}: query_lens must be int32{list(lengths.shape)}, got "
      f"{query_lens.dtype}{list(query_lens.shape)}"
    )


def check_attention_options(sm_scale, soft_cap, sliding_window) -> None:
  """Raises ValueError for a non-positive soft cap or sliding window.

  Args:
    sm_scale: logit scale, or None for ``1 / sqrt(head_dim)``.
    soft_cap: logit soft cap (``cap * tanh(logits / cap)``), or None.
    sliding_window: visible keys per query (including itself), or None.
  """
  if sm_scale is not None and not np.isfinite(sm_scale):
    raise ValueError(f"sm_scale must be finite, got {sm_scale}")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap must be > 0, got {soft_cap}")
  if sliding_window is not None and (
    isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
  ):
    raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")


def check_block_tables(block_tables, lengths, num_blocks: int, block_size: int) -> None:
  """Host-side check of concrete tables and lengths (the checked path).

  Args:
    block_tables: concrete ``int32[batch, max_blocks_per_seq]``.
    lengths: concrete ``int32[batch]``.
    num_blocks: blocks in the cache.
    block_size: tokens per block.

  Raises:
    ValueError: naming the first sequence whose table entry lies outside
      ``-1 .. num_blocks - 1``, whose length is negative or longer than its
      table, or whose last token's block is missing (-1): its length runs
      past the blocks it holds.
  """
  tables = np.asarray(jax.device_get(block_tables))
  lengths = np.asarray(jax.device_get(lengths))
  capacity = tables.shape[1] * block_size
  for seq, length in enumerate(lengths):
    if not 0 <= length <= capacity:
      raise ValueError(
        f"sequence {seq}: length {length} is outside 0.."
        f"{capacity} (max_blocks_per_seq * block_size)"
      )
  bad = np.argwhere((tables < -1) | (tables >= num_blocks))
  if bad.size:
    seq, entry = bad[0]
    raise ValueError(
      f"sequence {seq}: block_tables[{seq}, {entry}] = {tables[seq, entry]} "
      f"is out of range for {num_blocks} blocks (-1 marks no block)"
    )
  for seq, length in enumerate(lengths):
    last = (length - 1) // block_size
    if length > 0 and tables[seq, last] < 0:
      held = tables[seq][tables[seq] >= 0].tolist()
      raise ValueError(
        f"sequence {seq}: length {length} runs past the blocks it holds: "
        f"its last token (position {length - 1}) needs "
        f"block_tables[{seq}, {last}], which is -1; the row holds blocks "
        f"{held}"
      )


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
  """Returns ``sm_scale``, or ``1 / sqrt(head_dim)`` when it is None."""
  return float(sm_scale) if sm_scale is not None else head_dim**-0.5


def apply_soft_cap(logits, soft_cap: float | None):
  """Returns ``soft_cap * tanh(logits / soft_cap)``, or logits when None."""
  if soft_cap is None:
    return logits
  return soft_cap * jnp.tanh(logits / soft_cap)


def window_start(length, sliding_window: int | None):
  """First key position a decode query at ``length - 1`` can see."""
  if sliding_window is None:
    return jnp.asarray(0, length.dtype)
  return jnp.maximum(length - sliding_window, 0)
