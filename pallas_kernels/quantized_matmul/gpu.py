"""`x @ dequant(w).T` on CUDA GPUs (Pallas, Triton lowering), the weights
dequantized in registers, never written to HBM.

Grid `(m / block_m, n / block_n)`: each program owns a `[block_m, block_n]`
output tile and walks the inputs `block_k` stored columns at a time in a
loop with a float32 accumulator (Triton programs are independent, so the
sum over inputs stays inside one program). Each step:

* loads a `[block_n, block_k]` tile of the stored values; for 4 bits each
  byte holds two inputs, column `c` of the first half of the row (low
  nibble) and `c + k / 2` of the second (high), so a step covers inputs
  `[s * block_k, (s + 1) * block_k)` of both halves and loads the two
  matching `[block_m, block_k]` tiles of `x`;
* loads the scales (and minimums) of the groups the step covers, as stored:
  `block_k / group_size` columns, each spread over its group's inputs, or,
  when a group spans several steps (per-channel int8), the group's one column;
* rounds `ints * scale + minimum`, computed in float32, to `x`'s dtype (the
  weight a float load of the same numbers has) and multiplies it on the
  tensor cores.

Rows are padded to `block_m`, at least 16 (a tensor-core dot), so a decode
step of 1 to 64 rows is one row of programs. Tiles are powers of two
(Triton's); on CPU the kernel runs with `interpret=True`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.quantized_matmul import common

try:  # JAX that no longer ships Pallas Triton: the module imports, the kernel raises.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
  pltriton = None

_NAME = "quantized_matmul_gpu"
MIN_DOT = 16  # smallest side of a tensor-core dot
MAX_BLOCK_M = 64
BLOCK_N = (64, 32, 16)
BLOCK_K = (128, 64, 32, 16)
COMPUTE_DTYPES = common.COMPUTE_DTYPES + (jnp.dtype(jnp.float16),)


@dataclasses.dataclass(frozen=True)
class Tiles:
  """How the product `[m, k] x [n, k]` is cut for the GPU kernel.

  Attributes:
    block_m: rows of `x` per program, a power of two from 16 to 64.
    padded_m: rows after padding `x` to a whole number of `block_m`.
    block_n: outputs per program, a power of two of at least 16.
    block_k: stored columns per step, a power of two of at least 16 that
      divides `group_size` or that `group_size` divides.
  """

  block_m: int
  padded_m: int
  block_n: int
  block_k: int


def tiles(
  m: int,
  n: int,
  k: int,
  *,
  bits: int,
  group_size: int,
  dtype,
  block_n: int | None = None,
  block_k: int | None = None,
) -> Tiles:
  """The GPU kernel's tiles of the product of `m` rows of `dtype` with a `[n, k]` kernel.

  `block_n` defaults to the largest of `BLOCK_N` that divides `n`;
  `block_k` to the largest of `BLOCK_K` that divides one half's stored
  columns (`k / 2` for 4 bits, `k` for 8) and divides or is divided by
  `group_size`.

  Raises:
    ValueError: naming the numbers, for a dtype the kernel does not compute
      in, a group that straddles the nibble halves, or a dimension no tile
      serves.
  """
  dtype = jnp.dtype(dtype)
  if dtype not in COMPUTE_DTYPES:
    names = ", ".join(d.name for d in COMPUTE_DTYPES)
    raise ValueError(f"the GPU kernel computes in {names}, not {dtype.name}")
  half = k // 2 if bits == 4 else k
  where = "k / 2" if bits == 4 else "k"
  if half % group_size:
    raise ValueError(
      f"group_size {group_size} does not divide {where} = {half}, the inputs of one nibble half"
    )
  fits_groups = lambda b: group_size % b == 0 or b % group_size == 0
  block_n = block_n or next((b for b in BLOCK_N if n % b == 0), None)
  block_k = block_k or next((b for b in BLOCK_K if half % b == 0 and fits_groups(b)), None)
  served = lambda sizes: ", ".join(map(str, sizes))
  if block_n is None:
    raise ValueError(f"n = {n} is not tiled by the GPU kernel: no tile of {served(BLOCK_N)}")
  if block_k is None:
    raise ValueError(
      f"{where} = {half} with groups of {group_size} is not tiled by the GPU kernel: "
      f"no tile of {served(BLOCK_K)} divides it and fits the groups"
    )
  for name, size, block in (("n", n, block_n), (where, half, block_k)):
    if not _power_of_two(block) or block < MIN_DOT or size % block:
      raise ValueError(
        f"tile {block} for {name} = {size} must be a power of two of at least "
        f"{MIN_DOT} that divides it"
      )
  if not fits_groups(block_k):
    raise ValueError(f"the K tile {block_k} and group_size {group_size} must divide one another")
  block_m = min(MAX_BLOCK_M, max(MIN_DOT, pl.next_power_of_2(m)))
  return Tiles(block_m, -(-m // block_m) * block_m, block_n, block_k)


def refusal(m: int, n: int, k: int, *, bits: int, group_size: int, dtype) -> str | None:
  """Why the GPU kernel cannot serve this product; None when it can."""
  if pltriton is None:
    return "this JAX ships no Pallas Triton"
  try:
    tiles(m, n, k, bits=bits, group_size=group_size, dtype=dtype)
  except ValueError as err:
    return str(err)
  return None


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
  """Float32 `x @ w.T` with `w` dequantized in registers, never in HBM.

  Args:
    x: float32, bfloat16 or float16 `[..., in]`; the weights are rounded to its dtype.
    values: int8 `[out, in]` (`bits` 8) or packed uint8 `[out, in / 2]` (4,
      row halves: byte `c` holds input `c` low and `c + in / 2` high).
    scales: float `[out, in / group_size]`, or int16 holding float16's bits.
    minimums: like `scales`, or None.
    bits: 8 or 4.
    group_size: inputs per scale; it and the K tile divide one another.
    block_n: outputs per program (`tiles` picks by default).
    block_k: stored columns per step (`tiles` picks by default).
    interpret: run in Pallas interpret mode, e.g. on CPU.

  Returns:
    float32 `[..., out]`.

  Raises:
    ValueError: naming the numbers, for arrays that do not make one product
      (`common.check_args`) or shapes the kernel does not tile (`tiles`).
    NotImplementedError: on a JAX without Pallas Triton.
  """
  if pltriton is None:
    raise NotImplementedError(f"{_NAME} needs a JAX with jax.experimental.pallas.triton")
  common.check_args(x, values, scales, minimums, bits=bits, group_size=group_size)
  n, stored = values.shape
  k = x.shape[-1]
  lead = x.shape[:-1]
  rows = x.reshape(-1, k)
  m = rows.shape[0]
  t = tiles(
    m, n, k, bits=bits, group_size=group_size, dtype=x.dtype, block_n=block_n, block_k=block_k
  )
  rows = jnp.pad(rows, ((0, t.padded_m - m), (0, 0)))
  groups = [common.float_groups(a) for a in (scales, minimums) if a is not None]
  group_spec = pl.BlockSpec((t.block_n, scales.shape[1]), lambda i, j: (j, 0))
  kernel = functools.partial(
    _product_kernel,
    bits=bits,
    group_size=group_size,
    block_k=t.block_k,
    minimums=minimums is not None,
  )
  out = pl.pallas_call(
    kernel,
    grid=(t.padded_m // t.block_m, n // t.block_n),
    in_specs=[
      pl.BlockSpec((t.block_m, k), lambda i, j: (i, 0)),
      pl.BlockSpec((t.block_n, stored), lambda i, j: (j, 0)),
      *[group_spec] * len(groups),
    ],
    out_specs=pl.BlockSpec((t.block_m, t.block_n), lambda i, j: (i, j)),
    out_shape=jax.ShapeDtypeStruct((t.padded_m, n), jnp.float32),
    compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    name=_NAME,
  )(rows, values, *groups)
  return out[:m].reshape(*lead, n)


def _product_kernel(x_ref, values_ref, *refs, bits, group_size, block_k, minimums):
  """One `[block_m, block_n]` output tile: the sum over the K steps."""
  group_refs, out_ref = refs[:-1], refs[-1]
  stored = values_ref.shape[1]
  columns = max(1, block_k // group_size)  # scale columns one step reads
  half_groups = stored // group_size

  def step(index, acc):
    start = index * block_k
    ints = values_ref[:, pl.ds(start, block_k)]
    parts = (ints & 0x0F, ints >> 4) if bits == 4 else (ints,)
    for half, part in enumerate(parts):
      x = x_ref[:, pl.ds(half * stored + start, block_k)]
      first = half * half_groups + start // group_size
      spread = [_spread(ref[:, pl.ds(first, columns)], group_size, block_k) for ref in group_refs]
      weight = part.astype(jnp.float32) * spread[0]
      if minimums:
        weight = weight + spread[1]
      acc += jnp.dot(x, weight.astype(x.dtype).T, preferred_element_type=jnp.float32)
    return acc

  block_m, block_n = out_ref.shape
  init = jnp.zeros((block_m, block_n), jnp.float32)
  out_ref[...] = jax.lax.fori_loop(0, stored // block_k, step, init)


def _spread(per_group, group_size: int, block_k: int) -> jax.Array:
  """float32 `[block_n, block_k]` (or `[block_n, 1]` for one group, which
  broadcasts): each of the `[block_n, groups]` columns over its inputs."""
  per_group = per_group.astype(jnp.float32)
  block_n, groups = per_group.shape
  if groups == 1:
    return per_group
  spread = jnp.broadcast_to(per_group[:, :, None], (block_n, groups, group_size))
  return spread.reshape(block_n, block_k)


def _power_of_two(size: int) -> bool:
  return size > 0 and not size & (size - 1)
