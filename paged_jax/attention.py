"""Paged attention entry points: `paged_attention` (one query per sequence)
and `paged_prefill_attention` (several), each running the kernel that
`paged_jax.kernel_choice` picks for ``impl`` on the kernel platform: a
Pallas kernel of the backend, on CPU a C++ kernel, or XLA (the chunked
implementation, which reads only the table chunks the longest context
reaches, or the reference, which gathers every sequence's whole table).
Prefill attention takes ``"auto"``, ``"pallas"`` (the Mosaic kernel; on CPU
in TPU interpret mode), ``"cpu"`` (the C++ kernel) or ``"reference"``.

Outside jit (concrete block tables and lengths) the tables are checked on the
host first, so an out-of-range block gives a ValueError that names it.
"""

from __future__ import annotations

from paged_jax.kernel_choice import is_concrete, select_attention_kernel, select_prefill_kernel
from pallas_kernels.paged_attention import (
  chunked,
  common,
  cpu,
  gpu,
  mosaic_gpu,
  reference,
  tpu,
  tpu_prefill,
)

_KERNELS = {"tpu": tpu, "triton": gpu, "mosaic_gpu": mosaic_gpu}


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
  k_scales=None,
  v_scales=None,
  impl: str = "auto",
):
  """Decode attention of one new token per sequence over a paged KV cache.

  Args:
    q: ``[batch, num_q_heads, head_dim]``; ``num_q_heads`` a multiple of
      ``num_kv_heads`` (grouped-query attention).
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``, one layer
      of ``KVCache.k``.
    v_pages: same as ``k_pages``.
    block_tables: ``int32[batch, max_blocks_per_seq]``, -1 where no block.
    lengths: ``int32[batch]``, context length including the new token (whose
      K/V is already written); 0 gives a zero output.
    sm_scale: logit scale; None means ``1 / sqrt(head_dim)``.
    soft_cap: logit soft cap ``cap * tanh(logits / cap)``, or None.
    sliding_window: keys visible to the query (itself included), or None.
    k_scales: for int8 / float8_e4m3fn pages, their float32 scales
      ``[num_kv_heads, num_blocks, block_size]`` (``KVCache.k_scale[layer]``);
      None for float pages.
    v_scales: same as ``k_scales``, for ``v_pages``.
    impl: ``"auto"``, ``"pallas"``, ``"mosaic_gpu"``, ``"triton"``,
      ``"cpu"`` or ``"reference"`` (see `paged_jax.kernel_choice`).

  Returns:
    ``[batch, num_q_heads, head_dim]`` in ``q.dtype``.

  Raises:
    ValueError: for bad shapes, dtypes or options, or a page dtype the chosen
      kernel cannot serve (the message names the kernel).
  """
  common.check_attention_args(
    q, k_pages, v_pages, block_tables, lengths, k_scales=k_scales, v_scales=v_scales
  )
  common.check_attention_options(sm_scale, soft_cap, sliding_window)
  if is_concrete(block_tables, lengths):
    common.check_block_tables(block_tables, lengths, k_pages.shape[1], k_pages.shape[2])
  options = dict(
    sm_scale=sm_scale,
    soft_cap=soft_cap,
    sliding_window=sliding_window,
    k_scales=k_scales,
    v_scales=v_scales,
  )
  kernel = select_attention_kernel(
    impl,
    dtype=q.dtype,
    block_size=k_pages.shape[2],
    head_dim=k_pages.shape[3],
    group=q.shape[1] // k_pages.shape[0],
    quantized=k_scales is not None,
    kv_dtype=k_pages.dtype,
  )
  args = (q, k_pages, v_pages, block_tables, lengths)
  if impl == "reference":
    return reference.paged_attention_reference(*args, **options)
  if kernel is None:
    return chunked.paged_attention_chunked(*args, **options)
  if kernel[0] == "cpu":
    return cpu.paged_attention(*args, **options)
  name, interpret = kernel
  return _KERNELS[name].paged_attention(*args, **options, interpret=interpret)


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
  k_scales=None,
  v_scales=None,
  impl: str = "auto",
):
  """Causal attention of several new tokens per sequence to their context.

  For prefix-cache hits, chunked prefill and a ragged step's tiles: the new
  tokens' K/V are already written, and row ``i`` of sequence ``b`` is the
  token at position ``lengths[b] - query_lens[b] + i``.

  Args:
    q: ``[batch, num_queries, num_q_heads, head_dim]``.
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_pages: same as ``k_pages``.
    block_tables: ``int32[batch, max_blocks_per_seq]``, -1 where no block.
    lengths: ``int32[batch]``, context length including the new tokens.
    query_lens: ``int32[batch]``, new tokens per sequence; rows past it are
      padding and give zeros.
    sm_scale: logit scale; None means ``1 / sqrt(head_dim)``.
    soft_cap: logit soft cap, or None.
    sliding_window: keys visible to a query (itself included), or None.
    k_scales: scales of quantized pages, as in ``paged_attention``.
    v_scales: same as ``k_scales``, for ``v_pages``.
    impl: ``"auto"``, ``"pallas"``, ``"cpu"`` or ``"reference"`` (see the
      module docstring).

  Returns:
    ``[batch, num_queries, num_q_heads, head_dim]`` in ``q.dtype``.

  Raises:
    ValueError: for bad shapes, dtypes or options, or (``"pallas"``) shapes
      the Mosaic kernel cannot serve (the message names the kernel).
  """
  common.check_attention_args(
    q, k_pages, v_pages, block_tables, lengths, query_rank=4, k_scales=k_scales, v_scales=v_scales
  )
  common.check_attention_options(sm_scale, soft_cap, sliding_window)
  common.check_query_lens(query_lens, lengths)
  if is_concrete(block_tables, lengths):
    common.check_block_tables(block_tables, lengths, k_pages.shape[1], k_pages.shape[2])
  options = dict(
    sm_scale=sm_scale,
    soft_cap=soft_cap,
    sliding_window=sliding_window,
    k_scales=k_scales,
    v_scales=v_scales,
  )
  args = (q, k_pages, v_pages, block_tables, lengths, query_lens)
  if impl == "reference":
    return reference.paged_prefill_attention_reference(*args, **options)
  kernel = select_prefill_kernel(
    impl,
    dtype=q.dtype,
    num_queries=q.shape[1],
    group=q.shape[2] // k_pages.shape[0],
    block_size=k_pages.shape[2],
    head_dim=k_pages.shape[3],
    kv_dtype=k_pages.dtype,
    quantized=k_scales is not None,
  )
  if kernel is None:
    return chunked.paged_prefill_attention_chunked(*args, **options)
  if kernel[0] == "cpu":
    return cpu.paged_prefill_attention(*args, **options)
  _, interpret = kernel
  return tpu_prefill.paged_prefill_attention(*args, **options, interpret=interpret)
