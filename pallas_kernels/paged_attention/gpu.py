"""Paged decode attention as a Pallas kernel for CUDA GPUs (Triton lowering).

Grid ``(batch, num_kv_heads, num_splits)``: each program holds the query heads
of one KV head (padded to at least 16 rows for the tensor cores) and walks its
share of one sequence's pages, ``pages_per_step`` pages at a time, with an
online softmax. Only steps that overlap ``[window start, length)`` run, so a
short sequence or a sliding window costs what it reads. The partial results
of the splits are merged in XLA (flash-decoding).

Quantized pages (int8, float8_e4m3fn) are converted to the query dtype
(exactly) as they are read and their per-token scales applied to the logits
(K) and to the softmax weights (V); fp8 needs compute capability 8.9 or
newer (Triton's fp8e4nv).

Block sizes, head_dim and ``pages_per_step`` must be powers of two (Triton
tiles). On CPU the kernel runs with ``interpret=True``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import common

try:  # JAX that no longer ships Pallas Triton: the module imports, the kernel raises.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

_MIN_DOT_SIZE = 16  # smallest dimension of a tensor-core dot
_TOKENS_PER_STEP = 128
_TARGET_PROGRAMS = 1024  # enough to fill the SMs of an H100/H200 several times
_NAME = "paged_attention_gpu"
_MIN_FP8_CAPABILITY = (8, 9)


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
  num_splits: int | None = None,
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
    pages_per_step: pages per inner step (power of two, at least 16 tokens);
      None picks 128 tokens' worth, fewer for short tables.
    num_splits: partitions of each table processed in parallel; None picks
      enough programs to fill a large GPU.
    k_scales: float32 ``[num_kv_heads, num_blocks, block_size]`` scales of
      int8 or float8_e4m3fn pages, or None.
    v_scales: same as ``k_scales``, for ``v_pages``.
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; zeros where
    ``lengths`` is 0.

  Raises:
    ValueError: for bad shapes or dtypes, untileable sizes, or fp8 pages on
      a GPU older than compute capability 8.9.
    NotImplementedError: on a JAX without Pallas Triton.
  """
  if pltriton is None:
    raise NotImplementedError(
      "the Triton paged-attention kernel needs a JAX with jax.experimental.pallas.triton"
    )
  common.check_attention_args(
    q, k_pages, v_pages, block_tables, lengths, k_scales=k_scales, v_scales=v_scales, kernel=_NAME
  )
  if not interpret and k_pages.dtype == jnp.float8_e4m3fn:
    check_fp8_capability(jax.devices()[0])
  common.check_attention_options(sm_scale, soft_cap, sliding_window)
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  max_blocks = block_tables.shape[1]
  _check_power_of_two("block_size", block_size)
  _check_power_of_two("head_dim", head_dim)
  if pages_per_step is None:
    pages_per_step = min(
      max(_TOKENS_PER_STEP // block_size, 1),
      max(pl.next_power_of_2(max_blocks), _MIN_DOT_SIZE // block_size),
    )
  _check_power_of_two("pages_per_step", pages_per_step)
  if pages_per_step * block_size < _MIN_DOT_SIZE:
    raise ValueError(
      f"pages_per_step * block_size must be >= {_MIN_DOT_SIZE} (a tensor-"
      f"core dot), got {pages_per_step} * {block_size}"
    )
  steps = pl.cdiv(max_blocks, pages_per_step)
  if num_splits is None:
    num_splits = max(1, min(steps, _TARGET_PROGRAMS // (batch * num_kv_heads)))
  if not isinstance(num_splits, int) or num_splits < 1:
    raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
  pages_per_split = pl.cdiv(steps, num_splits) * pages_per_step

  group = num_q_heads // num_kv_heads
  rows = max(_MIN_DOT_SIZE, pl.next_power_of_2(group))
  grouped_q = q.reshape(batch, num_kv_heads, group, head_dim)
  grouped_q = jnp.pad(grouped_q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
  split_tables = jnp.pad(
    block_tables, ((0, 0), (0, num_splits * pages_per_split - max_blocks)), constant_values=-1
  ).reshape(batch, num_splits, pages_per_split)

  quantized = k_scales is not None
  kernel = functools.partial(
    _decode_kernel,
    sm_scale=common.default_sm_scale(head_dim, sm_scale),
    soft_cap=soft_cap,
    sliding_window=sliding_window,
    pages_per_step=pages_per_step,
    quantized=quantized,
  )
  page_spec = pl.BlockSpec((None, *k_pages.shape[1:]), lambda b, h, s: (h, 0, 0, 0))
  scale_spec = pl.BlockSpec((None, *k_pages.shape[1:3]), lambda b, h, s: (h, 0, 0))
  scale_args = (k_scales, v_scales) if quantized else ()
  partial_shape = (batch, num_kv_heads, num_splits, rows)
  acc, row_max, row_sum = pl.pallas_call(
    kernel,
    grid=(batch, num_kv_heads, num_splits),
    in_specs=[
      pl.BlockSpec(lengths.shape, lambda b, h, s: (0,)),
      pl.BlockSpec((None, None, pages_per_split), lambda b, h, s: (b, s, 0)),
      pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
      page_spec,
      page_spec,
    ]
    + [scale_spec] * len(scale_args),
    out_specs=[
      pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
      pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
      pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
      jax.ShapeDtypeStruct(partial_shape, jnp.float32),
      jax.ShapeDtypeStruct(partial_shape, jnp.float32),
    ],
    compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name="paged_attention_gpu",
  )(lengths, split_tables, grouped_q, k_pages, v_pages, *scale_args)
  out = _merge_splits(acc, row_max, row_sum)[:, :, :group]
  return out.reshape(q.shape).astype(q.dtype)


def _decode_kernel(
  lengths_ref,
  tables_ref,
  q_ref,
  k_ref,
  v_ref,
  *refs,
  sm_scale,
  soft_cap,
  sliding_window,
  pages_per_step,
  quantized,
):
  """One (sequence, KV head, split): unnormalized output, row max, row sum."""
  if quantized:
    k_scale_ref, v_scale_ref, acc_ref, max_ref, sum_ref = refs
  else:
    acc_ref, max_ref, sum_ref = refs
  batch_index, split = pl.program_id(0), pl.program_id(2)
  block_size = k_ref.shape[-2]
  pages_per_split = tables_ref.shape[0]
  step_tokens = pages_per_step * block_size
  length = lengths_ref[batch_index]
  first_visible = common.window_start(length, sliding_window)
  split_start = split * pages_per_split * block_size
  split_stop = split_start + pages_per_split * block_size
  first_step = jnp.maximum(first_visible - split_start, 0) // step_tokens
  stop_step = pl.cdiv(jnp.clip(length, split_start, split_stop) - split_start, step_tokens)
  q = q_ref[...]
  token = lax.broadcasted_iota(jnp.int32, (step_tokens,), 0)

  def step(index, carry):
    acc, row_max, row_sum = carry
    pages = tables_ref[pl.ds(index * pages_per_step, pages_per_step)]
    safe_pages = jnp.where(pages >= 0, pages, 0)
    keys = k_ref[safe_pages].reshape(step_tokens, -1).astype(q.dtype)
    values = v_ref[safe_pages].reshape(step_tokens, -1).astype(q.dtype)
    page_of_token = tables_ref[index * pages_per_step + token // block_size]
    position = split_start + index * step_tokens + token
    visible = (page_of_token >= 0) & (position < length) & (position >= first_visible)
    logits = jnp.dot(q, keys.T, preferred_element_type=jnp.float32) * sm_scale
    if quantized:
      logits *= k_scale_ref[safe_pages].reshape(step_tokens)[None, :]
    logits = common.apply_soft_cap(logits, soft_cap)
    logits = jnp.where(visible[None, :], logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    rescale = jnp.exp(row_max - new_max)
    weights = jnp.exp(logits - new_max[:, None])
    values = jnp.where(visible[:, None], values, jnp.zeros_like(values))
    value_weights = weights
    if quantized:  # V's scales go into the weights; masked, as NaN * 0 = NaN
      v_scale = v_scale_ref[safe_pages].reshape(step_tokens)
      value_weights = weights * jnp.where(visible, v_scale, 0.0)[None, :]
    acc = rescale[:, None] * acc + jnp.dot(
      value_weights.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
    return acc, new_max, rescale * row_sum + jnp.sum(weights, axis=1)

  rows, head_dim = q.shape
  init = (
    jnp.zeros((rows, head_dim), jnp.float32),
    jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
  )
  acc, row_max, row_sum = lax.fori_loop(first_step, stop_step, step, init)
  acc_ref[...] = acc
  max_ref[...] = row_max
  sum_ref[...] = row_sum


def _merge_splits(acc, row_max, row_sum):
  """Combines per-split softmax partials over axis 2; empty rows give 0."""
  overall_max = jnp.max(row_max, axis=2, keepdims=True)
  rescale = jnp.exp(row_max - overall_max)
  total = jnp.sum(row_sum * rescale, axis=2)[..., None]
  out = jnp.sum(acc * rescale[..., None], axis=2)
  return jnp.where(total > 0, out / jnp.maximum(total, 1e-30), 0.0)


def check_fp8_capability(device) -> None:
  """Raises ValueError on a CUDA ``device`` older than sm 8.9 (no fp8e4nv)."""
  if getattr(device, "compute_capability", None) is None:
    return
  capability = tuple(int(part) for part in str(device.compute_capability).split("."))
  if capability < _MIN_FP8_CAPABILITY:
    raise ValueError(
      f"{_NAME} cannot serve float8_e4m3fn pages on compute capability "
      f"{device.compute_capability} (needs 8.9 or newer); use an int8 "
      "cache"
    )


def _check_power_of_two(name: str, value: int) -> None:
  if value < 1 or value & (value - 1):
    raise ValueError(f"{name} must be a power of two for the GPU kernel, got {value}")
