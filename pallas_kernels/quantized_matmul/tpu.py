"""`x @ dequant(w).T` on TPU (Mosaic), the weights dequantized tile by tile in VMEM.

XLA:TPU writes a grouped kernel's (4 bits, int8 per group) dequantized float
copy to HBM before its matmul (benchmarks/quant_matmul_tpu.py); this kernel
reads only the quantized bytes and the scales. Grid `(m / block_m, n /
block_n, steps)`, the steps innermost, a float32 accumulator in VMEM:

* each step reads a `[block_n, block_k]` tile of the stored values; for 4
  bits each byte holds two inputs, column `c` of the first half of the row
  (low nibble) and `c + k / 2` of the second (high), so a step covers inputs
  `[s * block_k, (s + 1) * block_k)` of both halves and reads the two
  matching `[block_m, block_k]` tiles of `x`;
* the integers are transposed to `[block_k, block_n]` (inputs on sublanes),
  so each scale, one per `group_size` inputs, spreads over consecutive
  sublanes; a program reads its `[block_n, groups]` scales and minimums
  once, as stored (float16 as its bits: Mosaic loads no float16 on v5e),
  decodes them to float32 in VMEM, and each step takes its groups'
  columns, transposed, by an exact 0/1 selection product on the MXU;
* the tile `ints * scale + minimum` is rounded to `x`'s dtype (the weight a
  float load of the same numbers has) and multiplied on the MXU.

Rows are padded to `block_m`, a multiple of 8 (16 for bfloat16), so a decode
step of 1 to 256 rows is one row of programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.quantized_matmul import common

_NAME = "quantized_matmul_tpu"


def quantized_matmul(
  x,
  values,
  scales,
  minimums=None,
  *,
  bits: int,
  group_size: int,
  block_n: int | None = None,
  block_k: int | None = None,
  interpret: bool = False,
) -> jax.Array:
  """Float32 `x @ w.T` with `w` dequantized in VMEM, never in HBM.

  Args:
    x: float32 or bfloat16 `[..., in]`; the weights are rounded to its dtype.
    values: int8 `[out, in]` (`bits` 8) or packed uint8 `[out, in / 2]` (4,
      row halves: byte `c` holds input `c` low and `c + in / 2` high).
    scales: float `[out, in / group_size]`, or int16 holding float16's
      bits (loaded as they are; float16 is bitcast to them first).
    minimums: like `scales`, or None.
    bits: 8 or 4.
    group_size: inputs per scale; a multiple of 8 dividing a K tile.
    block_n: outputs per program (`common.tiles` picks by default).
    block_k: stored columns per step (`common.tiles` picks by default).
    interpret: run in TPU interpret mode, e.g. on CPU.

  Returns:
    float32 `[..., out]`.

  Raises:
    ValueError: naming the numbers, for arrays that do not make one product
      (`common.check_args`) or shapes the kernel does not tile (`common.tiles`).
  """
  common.check_args(x, values, scales, minimums, bits=bits, group_size=group_size)
  n, stored = values.shape
  k = x.shape[-1]
  lead = x.shape[:-1]
  rows = x.reshape(-1, k)
  m = rows.shape[0]
  t = common.tiles(
    m, n, k, bits=bits, group_size=group_size, dtype=x.dtype, block_n=block_n, block_k=block_k
  )
  rows = jnp.pad(rows, ((0, t.padded_m - m), (0, 0)))
  halves = 2 if bits == 4 else 1
  steps = stored // t.block_k
  groups = [_loadable(a) for a in (scales, minimums) if a is not None]
  x_specs = [
    pl.BlockSpec((t.block_m, t.block_k), lambda i, j, s, h=h: (i, h * steps + s))
    for h in range(halves)
  ]
  # A program's rows of every group: read once per output tile, kept in VMEM.
  group_spec = pl.BlockSpec((t.block_n, scales.shape[1]), lambda i, j, s: (j, 0))
  kernel = functools.partial(
    _product_kernel,
    bits=bits,
    group_size=group_size,
    steps=steps,
    minimums=minimums is not None,
  )
  out = pl.pallas_call(
    kernel,
    grid=(t.padded_m // t.block_m, n // t.block_n, steps),
    in_specs=[
      *x_specs,
      pl.BlockSpec((t.block_n, t.block_k), lambda i, j, s: (j, s)),
      *[group_spec] * len(groups),
    ],
    out_specs=pl.BlockSpec((t.block_m, t.block_n), lambda i, j, s: (i, j)),
    out_shape=jax.ShapeDtypeStruct((t.padded_m, n), jnp.float32),
    scratch_shapes=[pltpu.VMEM((t.block_m, t.block_n), jnp.float32)]
    + [pltpu.VMEM((t.block_n, scales.shape[1]), jnp.float32)] * len(groups),
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=pltpu.InterpretParams() if interpret else False,
    name=_NAME,
  )(*[rows] * halves, values, *groups)
  return out[:m].reshape(*lead, n)


def _loadable(per_group) -> jax.Array:
  """`per_group` as the kernel takes it: float16's bits (int16: Mosaic takes
  no float16 argument on v5e) as they are, float16 as its bits (XLA:TPU
  writes this bitcast as a copy per call, which a weight stored as its bits
  avoids: `paged_jax.models.quantized`), float32 as it is, else float32."""
  if per_group.dtype == jnp.int16:
    return per_group
  if per_group.dtype == jnp.float16:
    return jax.lax.bitcast_convert_type(per_group, jnp.int16)
  return per_group.astype(jnp.float32)


def _float32(block) -> jax.Array:
  """float32 of a loaded block: float16 bits (int16) decoded, else converted."""
  if block.dtype != jnp.int16:
    return block.astype(jnp.float32)
  bits = block.astype(jnp.int32) & 0xFFFF
  sign, exponent, mantissa = bits >> 15, (bits >> 10) & 0x1F, bits & 0x3FF
  wide = jnp.where(exponent == 0x1F, 0xFF, exponent + 112)  # 127 - 15; inf and NaN stay
  normal = jax.lax.bitcast_convert_type((sign << 31) | (wide << 23) | (mantissa << 13), jnp.float32)
  subnormal = mantissa.astype(jnp.float32) * 2.0**-24
  return jnp.where(exponent == 0, jnp.where(sign == 1, -subnormal, subnormal), normal)


def _step_groups(groups_ref, first, count: int) -> jax.Array:
  """float32 `[count, block_n]`: groups `first .. first + count` of the
  program's `[block_n, groups]` rows, transposed, by an exact selection
  product on the MXU (Mosaic slices no lanes at a dynamic offset)."""
  total = groups_ref.shape[1]
  rows = jax.lax.broadcasted_iota(jnp.int32, (count, total), 0)
  columns = jax.lax.broadcasted_iota(jnp.int32, (count, total), 1)
  select = (columns == rows + first).astype(jnp.float32)
  return jax.lax.dot_general(
    select,
    groups_ref[...],
    (((1,), (1,)), ((), ())),
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )


def _product_kernel(*refs, bits: int, group_size: int, steps: int, minimums: bool):
  """Adds one step's `x` tiles times its dequantized weight tiles to the accumulator."""
  halves = 2 if bits == 4 else 1
  x_refs, values_ref, rest = refs[:halves], refs[halves], refs[halves + 1 :]
  count = 2 if minimums else 1
  group_refs, (out_ref, acc_ref), group_scratch = (
    rest[:count],
    rest[count : count + 2],
    rest[count + 2 :],
  )
  step = pl.program_id(2)

  @pl.when(step == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
    for ref, scratch in zip(group_refs, group_scratch, strict=True):
      scratch[...] = _float32(ref[...])

  block_k = values_ref.shape[1]
  per_step = block_k // group_size
  per_half = group_scratch[0].shape[1] // halves
  ints = values_ref[...].astype(jnp.int32).T  # [block_k, block_n]: inputs on sublanes
  parts = (ints & 0x0F, ints >> 4) if bits == 4 else (ints,)
  for half, (x_ref, part) in enumerate(zip(x_refs, parts, strict=True)):
    first = half * per_half + step * per_step
    spread = [_per_input(_step_groups(s, first, per_step), group_size) for s in group_scratch]
    weight = part.astype(jnp.float32) * spread[0]
    if minimums:
      weight = weight + spread[1]
    acc_ref[...] += jnp.dot(
      x_ref[...], weight.astype(x_ref.dtype), preferred_element_type=jnp.float32
    )

  @pl.when(step == steps - 1)
  def _():
    out_ref[...] = acc_ref[...]


def _per_input(per_group, group_size: int) -> jax.Array:
  """`[groups * group_size, n]`: each group's row repeated for its inputs."""
  groups, n = per_group.shape
  spread = jnp.broadcast_to(per_group[:, None, :], (groups, group_size, n))
  return spread.reshape(groups * group_size, n)
