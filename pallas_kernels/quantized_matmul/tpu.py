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
  sublanes; the scales and minimums arrive regrouped `[halves, steps,
  block_k / group_size, n]` in float32 (Mosaic loads no float16 on v5e);
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
    scales: float `[out, in / group_size]`.
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
  per_step = t.block_k // group_size
  regroup = lambda a: _regroup(a, halves, steps, per_step)
  extras = [regroup(a) for a in (scales, minimums) if a is not None]
  x_specs = [
    pl.BlockSpec((t.block_m, t.block_k), lambda i, j, s, h=h: (i, h * steps + s))
    for h in range(halves)
  ]
  group_specs = [
    pl.BlockSpec((None, None, per_step, t.block_n), lambda i, j, s, h=h: (h, s, 0, j))
    for h in range(halves)
  ]
  kernel = functools.partial(
    _product_kernel, bits=bits, group_size=group_size, steps=steps, minimums=minimums is not None
  )
  out = pl.pallas_call(
    kernel,
    grid=(t.padded_m // t.block_m, n // t.block_n, steps),
    in_specs=[
      *x_specs,
      pl.BlockSpec((t.block_n, t.block_k), lambda i, j, s: (j, s)),
      *group_specs * len(extras),
    ],
    out_specs=pl.BlockSpec((t.block_m, t.block_n), lambda i, j, s: (i, j)),
    out_shape=jax.ShapeDtypeStruct((t.padded_m, n), jnp.float32),
    scratch_shapes=[pltpu.VMEM((t.block_m, t.block_n), jnp.float32)],
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    interpret=pltpu.InterpretParams() if interpret else False,
    name=_NAME,
  )(*[rows] * halves, values, *[a for a in extras for _ in range(halves)])
  return out[:m].reshape(*lead, n)


def _regroup(per_group, halves: int, steps: int, per_step: int) -> jax.Array:
  """float32 `[halves, steps, per_step, n]` of a `[n, groups]` array: the
  groups of half `h` and step `s` on one `[per_step, n]` tile."""
  n = per_group.shape[0]
  grouped = per_group.astype(jnp.float32).reshape(n, halves, steps, per_step)
  return jnp.transpose(grouped, (1, 2, 3, 0))


def _product_kernel(*refs, bits: int, group_size: int, steps: int, minimums: bool):
  """Adds one step's `x` tiles times its dequantized weight tiles to the accumulator."""
  halves = 2 if bits == 4 else 1
  x_refs, (values_ref,), rest = refs[:halves], refs[halves : halves + 1], refs[halves + 1 :]
  scale_refs, rest = rest[:halves], rest[halves:]
  minimum_refs, rest = (rest[:halves], rest[halves:]) if minimums else ((None,) * halves, rest)
  out_ref, acc_ref = rest
  step = pl.program_id(2)

  @pl.when(step == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  ints = values_ref[...].astype(jnp.int32).T  # [block_k, block_n]: inputs on sublanes
  parts = (ints & 0x0F, ints >> 4) if bits == 4 else (ints,)
  for x_ref, part, scale_ref, minimum_ref in zip(
    x_refs, parts, scale_refs, minimum_refs, strict=True
  ):
    weight = part.astype(jnp.float32) * _per_input(scale_ref[...], group_size)
    if minimum_ref is not None:
      weight = weight + _per_input(minimum_ref[...], group_size)
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
