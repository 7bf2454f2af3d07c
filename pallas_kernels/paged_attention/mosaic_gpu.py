"""Paged decode attention as a Pallas Mosaic GPU kernel (Hopper, sm90+).

Grid ``(batch, num_kv_heads, num_splits)``, one warpgroup per program. A
program holds the query heads of one KV head, padded to the 64 rows of a
wgmma, in shared memory, and walks its split of one sequence's table 64
tokens at a time (several pages, or a slice of one page of 128). The pages
of a step arrive by TMA into one of ``num_buffers`` shared-memory slots; the
copies of the next ``num_buffers - 1`` steps are in flight while a step
computes (QK on the tensor cores, online softmax in registers, PV on the
tensor cores). Only steps that overlap ``[window start, length)`` run.

Each split writes its output normalized by its own softmax sum, and the
log-sum-exp of its logits; XLA merges the splits (flash-decoding).

Bytes no query may read (slots past the length, before the window, or behind
a -1 table entry, whose copy reads block 0 instead) never reach an output:
their logits are masked to -inf, and on the steps that hold any, the V rows
are zeroed in shared memory before the PV product.

On CPU the kernel runs in Mosaic GPU interpret mode, which simulates shared
memory, barriers and TMA; there the QK product is a dot of the values loaded
from shared memory (the interpreter's wgmma takes no transposed operand) and
register layouts are not cast. Pages are bfloat16 or float16: Mosaic GPU's
wgmma transposes only 16-bit operands (float32 runs as tf32).

The kernel needs Hopper or newer (sm90+): its pages arrive by TMA and its
products run on wgmma, neither of which Ampere has. JAX 0.11+ exposes Ampere's
warp-level ``mma`` in Mosaic GPU (``plgpu.mma``), but only on register arrays
in its MMA layouts, and without TMA the pages would have to be loaded another
way: that is a second kernel, not an adaptation, so Ampere keeps the Triton
kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.paged_attention import common

try:  # JAX without Mosaic GPU: the module imports, the kernel raises.
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_ROWS = 64  # rows of a wgmma (query heads of one KV head, zero-padded)
_STEP_TOKENS = 64
_TARGET_PROGRAMS = 512  # a few waves of one-program-per-SM on an H100/H200
_SMEM_BUDGET = 200 * 1024  # of the 227 KiB an sm90 block may use
_MAX_BUFFERS = 4
BLOCK_SIZES = (16, 32, 64, 128)
# QK needs K transposed, which wgmma does for 16-bit operands only.
_DTYPES = (jnp.bfloat16, jnp.float16)


def interpret_params():
  """Mosaic GPU interpret-mode parameters (the public name where one exists)."""
  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top

    params = params.InterpretGPUParams
  return params()


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
  num_splits: int | None = None,
  num_buffers: int | None = None,
  k_scales=None,
  v_scales=None,
  interpret: bool = False,
):
  """Decode attention over a paged KV cache (one query token per sequence).

  Args:
    q: ``[batch, num_q_heads, head_dim]``, bfloat16 or float16; at most 64
      query heads per KV head.
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``, block size
      16, 32, 64 or 128, head_dim a multiple of 64 up to 256.
    v_pages: same as ``k_pages``.
    block_tables: ``int32[batch, max_blocks_per_seq]``, -1 where no block.
    lengths: ``int32[batch]``, context length including the new token.
    sm_scale: logit scale; None means ``1 / sqrt(head_dim)``.
    soft_cap: logit soft cap, or None.
    sliding_window: keys visible to the query (itself included), or None.
    num_splits: partitions of each table processed in parallel; None picks
      enough programs to fill a large GPU.
    num_buffers: shared-memory slots for pages in flight (2 to 4); None
      picks as many as fit.
    k_scales, v_scales: quantized-page scales; not supported by this kernel.
    interpret: run in Mosaic GPU interpret mode (CPU).

  Returns:
    ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; zeros where
    ``lengths`` is 0.

  Raises:
    ValueError: for inconsistent arguments, shapes or dtypes the kernel
      cannot tile, or quantized pages.
    NotImplementedError: on a JAX without Mosaic GPU.
  """
  if plgpu is None:
    raise NotImplementedError(
      "the Mosaic GPU paged-attention kernel needs a JAX with "
      "jax.experimental.pallas.mosaic_gpu; use impl='triton'"
    )
  if k_scales is not None or v_scales is not None:
    raise ValueError(
      "the Mosaic GPU paged-attention kernel does not support quantized "
      "pages (k_scales/v_scales); use impl='reference'"
    )
  common.check_attention_args(q, k_pages, v_pages, block_tables, lengths)
  common.check_attention_options(sm_scale, soft_cap, sliding_window)
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads, _, block_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  _check_shapes(q.dtype, block_size, head_dim, group)
  if num_buffers is None:
    num_buffers = _max_buffers(head_dim, q.dtype)
  if not isinstance(num_buffers, int) or not 2 <= num_buffers <= _MAX_BUFFERS:
    raise ValueError(f"num_buffers must be an int in 2..{_MAX_BUFFERS}, got {num_buffers!r}")
  smem = _smem_bytes(num_buffers, head_dim, q.dtype)
  if smem > _SMEM_BUDGET:
    raise ValueError(
      f"num_buffers={num_buffers} needs {smem} bytes of shared memory for "
      f"head_dim {head_dim} in {jnp.dtype(q.dtype).name}, more than the "
      f"{_SMEM_BUDGET} the Mosaic GPU kernel allows"
    )
  max_blocks = block_tables.shape[1]
  steps = pl.cdiv(max_blocks * block_size, _STEP_TOKENS)
  if num_splits is None:
    num_splits = max(1, min(steps, _TARGET_PROGRAMS // (batch * num_kv_heads)))
  if not isinstance(num_splits, int) or num_splits < 1:
    raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
  steps_per_split = pl.cdiv(steps, num_splits)
  padded_blocks = pl.cdiv(num_splits * steps_per_split * _STEP_TOKENS, block_size)

  grouped_q = q.reshape(batch, num_kv_heads, group, head_dim)
  grouped_q = jnp.pad(grouped_q, ((0, 0), (0, 0), (0, _ROWS - group), (0, 0)))
  padded_tables = jnp.pad(
    block_tables, ((0, 0), (0, padded_blocks - max_blocks)), constant_values=-1
  )

  body = functools.partial(
    _decode_kernel,
    sm_scale=common.default_sm_scale(head_dim, sm_scale),
    soft_cap=soft_cap,
    sliding_window=sliding_window,
    split_tokens=steps_per_split * _STEP_TOKENS,
    num_buffers=num_buffers,
    interpret=interpret,
  )
  partial_shape = (batch, num_kv_heads, num_splits, _ROWS)
  out, lse = plgpu.kernel(
    body,
    out_type=(
      jax.ShapeDtypeStruct((*partial_shape, head_dim), q.dtype),
      jax.ShapeDtypeStruct(partial_shape, jnp.float32),
    ),
    grid=(batch, num_kv_heads, num_splits),
    grid_names=("batch", "heads", "split"),
    compiler_params=plgpu.CompilerParams(approx_math=not interpret),
    interpret=interpret_params() if interpret else None,
  )(lengths, padded_tables, grouped_q, k_pages, v_pages)
  out = merge_splits(out, lse)[:, :, :group]
  return out.reshape(q.shape).astype(q.dtype)


def _decode_kernel(lengths_ref, tables_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, **options):
  """Allocates shared memory and barriers, then runs one program."""
  num_buffers = options["num_buffers"]
  head_dim, dtype = q_ref.shape[-1], q_ref.dtype
  pages = _smem((num_buffers, _STEP_TOKENS, head_dim), dtype)
  copies_per_step = _STEP_TOKENS // min(k_ref.shape[2], _STEP_TOKENS)
  pl.run_scoped(
    lambda *scratch: _decode_program(
      lengths_ref, tables_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *scratch, **options
    ),
    _smem((_ROWS, head_dim), dtype),  # q, then the output
    pages,  # k
    pages,  # v
    _smem((_ROWS, _STEP_TOKENS), dtype),  # softmax weights
    plgpu.SMEM((_ROWS,), jnp.float32),  # log-sum-exp
    plgpu.Barrier(),
    plgpu.Barrier(num_arrivals=copies_per_step, num_barriers=num_buffers),
    plgpu.Barrier(num_arrivals=copies_per_step, num_barriers=num_buffers),
  )


def _decode_program(
  lengths_ref,
  tables_ref,
  q_ref,
  k_ref,
  v_ref,
  out_ref,
  lse_ref,
  q_smem,
  k_smem,
  v_smem,
  p_smem,
  lse_smem,
  q_bar,
  k_bars,
  v_bars,
  *,
  sm_scale,
  soft_cap,
  sliding_window,
  split_tokens,
  num_buffers,
  interpret,
):
  """One (sequence, KV head, split): normalized output and log-sum-exp."""

  def with_layout(x, layout):
    # Interpret mode has no register layouts (nor a rule for layout_cast).
    return x if interpret else plgpu.layout_cast(x, layout)

  b, h, s = (lax.axis_index(name) for name in ("batch", "heads", "split"))
  block_size = k_ref.shape[2]
  chunk = min(block_size, _STEP_TOKENS)  # tokens of one TMA copy
  dtype = q_ref.dtype

  length = lengths_ref[b]
  first_visible = common.window_start(length, sliding_window)
  split_start = s * split_tokens
  first_step = jnp.maximum(first_visible - split_start, 0) // _STEP_TOKENS
  stop_step = pl.cdiv(
    jnp.clip(length, split_start, split_start + split_tokens) - split_start, _STEP_TOKENS
  )

  def step_chunks(step):
    """(offset in the step, table entry, first row in the page) per copy.

    Steps past the table read its last entries (never used).
    """
    chunks = []
    for offset in range(0, _STEP_TOKENS, chunk):
      token = split_start + step * _STEP_TOKENS + offset
      entry = jnp.minimum(token // block_size, tables_ref.shape[1] - 1)
      chunks.append((offset, tables_ref[b, entry], token % block_size))
    return chunks

  def fetch(chunks, slot):
    """Starts the TMA copies of a step's pages (block 0 for -1 entries)."""
    for offset, page, row in chunks:
      source = (h, jnp.maximum(page, 0), pl.ds(row, chunk))
      target = (slot, pl.ds(offset, chunk))
      plgpu.copy_gmem_to_smem(k_ref.at[source], k_smem.at[target], k_bars.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[source], v_smem.at[target], v_bars.at[slot])

  plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
  for i in range(num_buffers):

    @pl.when(first_step + i < stop_step)
    def _prologue():
      fetch(step_chunks(first_step + i), i)

  plgpu.barrier_wait(q_bar)

  def visible_tokens(step, chunks, shape, axis):
    """Bool mask of the step's visible tokens along ``axis`` of ``shape``."""
    token = with_layout(lax.broadcasted_iota(jnp.int32, shape, axis), plgpu.Layout.WGMMA)
    position = split_start + step * _STEP_TOKENS + token
    visible = (position < length) & (position >= first_visible)
    for offset, page, _ in chunks:
      # Hide [offset, offset + chunk) behind a -1 entry; else hide nothing.
      hidden_start = jnp.where(page < 0, offset, 0)
      hidden_stop = jnp.where(page < 0, offset + chunk, 0)
      visible &= (token < hidden_start) | (token >= hidden_stop)
    return visible

  def step_is_partial(step, chunks):
    start = split_start + step * _STEP_TOKENS
    partial = (start < first_visible) | (start + _STEP_TOKENS > length)
    for _, page, _ in chunks:
      partial |= page < 0
    return partial

  def body(step, carry):
    acc, row_max, row_sum = carry
    slot = lax.rem(step - first_step, num_buffers)
    chunks = step_chunks(step)
    # Read early, so the table reads overlap the step's compute.
    refill_chunks = step_chunks(step + num_buffers)
    plgpu.barrier_wait(k_bars.at[slot])
    logits = _logits(q_smem, k_smem.at[slot], interpret)
    logits = common.apply_soft_cap(logits * sm_scale, soft_cap)
    logits = jnp.where(visible_tokens(step, chunks, logits.shape, 1), logits, -jnp.inf)
    new_max = jnp.maximum(row_max, logits.max(axis=1))
    rescale = jnp.exp(row_max - new_max)
    weights = jnp.exp(logits - lax.broadcast_in_dim(new_max, logits.shape, [0]))
    row_sum = rescale * row_sum + weights.sum(axis=1)
    p_smem[...] = weights.astype(dtype)

    plgpu.barrier_wait(v_bars.at[slot])

    @pl.when(step_is_partial(step, chunks))
    def _zero_hidden_values():
      values = v_smem[slot]
      visible = visible_tokens(step, chunks, values.shape, 0)
      v_smem[slot] = jnp.where(visible, values, jnp.zeros_like(values))

    plgpu.commit_smem()

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
      return acc_ref[...]

    update = pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
    acc = lax.broadcast_in_dim(rescale, acc.shape, [0]) * acc + update

    @pl.when(step + num_buffers < stop_step)
    def _refill():
      fetch(refill_chunks, slot)

    return acc, new_max, row_sum

  head_dim = q_ref.shape[-1]
  reduced = plgpu.Layout.WGMMA.reduce(1)
  init = (
    with_layout(jnp.zeros((_ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA),
    with_layout(jnp.full((_ROWS,), jnp.finfo(jnp.float32).min, jnp.float32), reduced),
    with_layout(jnp.zeros((_ROWS,), jnp.float32), reduced),
  )
  acc, row_max, row_sum = lax.fori_loop(first_step, stop_step, body, init)

  seen = row_sum > 0
  safe_sum = jnp.where(seen, row_sum, 1.0)
  q_smem[...] = (acc / lax.broadcast_in_dim(safe_sum, acc.shape, [0])).astype(dtype)
  lse_smem[...] = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, out_ref.at[b, h, s])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, s])
  plgpu.wait_smem_to_gmem(0)


def _logits(q_smem, k_smem, interpret: bool):
  """``q @ k.T`` in float32: a wgmma on the GPU.

  Interpret mode cannot run a wgmma on a transposed operand, so there the
  product runs on the values loaded from shared memory.
  """
  if interpret:
    return lax.dot_general(
      q_smem[...], k_smem[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )

  def qk(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
    return acc_ref[...]

  return pl.run_scoped(qk, plgpu.ACC((q_smem.shape[0], k_smem.shape[0]), jnp.float32))


def merge_splits(out, lse):
  """Combines normalized split outputs by their log-sum-exp over axis 2.

  Args:
    out: ``[batch, heads, splits, rows, head_dim]``, each split's output.
    lse: ``float32[batch, heads, splits, rows]``, -inf where a split saw no
      key.

  Returns:
    ``float32[batch, heads, rows, head_dim]``; zeros where no split saw a key.
  """
  overall = jnp.max(lse, axis=2, keepdims=True)
  weights = jnp.exp(lse - jnp.where(jnp.isfinite(overall), overall, 0.0))
  total = jnp.sum(weights, axis=2)[..., None]
  merged = jnp.sum(out.astype(jnp.float32) * weights[..., None], axis=2)
  return jnp.where(total > 0, merged / jnp.where(total > 0, total, 1.0), 0.0)


def refusal(dtype, block_size: int, head_dim: int, group: int) -> str | None:
  """Why this JAX or the kernel's tiles cannot serve these shapes; None if they can.

  Args:
    dtype: dtype of the queries and pages.
    block_size: tokens per page.
    head_dim: size of a head.
    group: query heads per KV head.
  """
  if plgpu is None:
    return "this JAX has no Mosaic GPU"
  try:
    _check_shapes(dtype, block_size, head_dim, group)
  except ValueError as error:
    return str(error).removesuffix("; use impl='triton'")
  return None


def _smem(shape, dtype):
  """Shared memory tiled and swizzled for TMA and wgmma operands."""
  bits = jnp.dtype(dtype).itemsize * 8
  swizzle = plgpu.find_swizzle(shape[-1] * bits)
  return plgpu.SMEM(
    shape,
    dtype,
    transforms=(plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)),
  )


def _smem_bytes(num_buffers, head_dim, dtype) -> int:
  """Shared memory of one program: q/output, K and V slots, weights, lse."""
  itemsize = jnp.dtype(dtype).itemsize
  pages = 2 * num_buffers * _STEP_TOKENS * head_dim
  return (pages + _ROWS * (head_dim + _STEP_TOKENS)) * itemsize + 4 * _ROWS


def _max_buffers(head_dim, dtype) -> int:
  fitting = [
    n for n in range(2, _MAX_BUFFERS + 1) if _smem_bytes(n, head_dim, dtype) <= _SMEM_BUDGET
  ]
  return max(fitting, default=2)


def _check_shapes(dtype, block_size: int, head_dim: int, group: int) -> None:
  if jnp.dtype(dtype) not in map(jnp.dtype, _DTYPES):
    raise ValueError(
      f"the Mosaic GPU kernel takes bfloat16 or float16 "
      f"pages, got {jnp.dtype(dtype).name}; use impl='triton'"
    )
  if block_size not in BLOCK_SIZES:
    raise ValueError(
      f"block_size must be one of {BLOCK_SIZES} for the Mosaic GPU kernel, got {block_size}"
    )
  if head_dim % 64 or not 64 <= head_dim <= 256:
    raise ValueError(
      f"head_dim must be a multiple of 64 in 64..256 for the Mosaic GPU kernel, got {head_dim}"
    )
  if group > _ROWS:
    raise ValueError(
      f"at most {_ROWS} query heads per KV head for the Mosaic GPU kernel, got {group}"
    )
