"""Argument checks and tile sizes of the quantized product."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

BLOCK_SIZES = (512, 256, 128)  # lane tiles: Mosaic's blocks are multiples of 128
MAX_BLOCK_M = 256
COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Tiles:
  """How the product `[m, k] x [n, k]` is cut into programs.

  Attributes:
    block_m: rows of `x` per program, a multiple of 8 (16 for 16-bit `x`).
    padded_m: rows after padding `x` to a whole number of `block_m`.
    block_n: outputs per program, a multiple of 128.
    block_k: stored columns of `values` per step, a multiple of 128 and of
      `group_size`: for 4 bits, bytes, each holding an input of both halves.
  """

  block_m: int
  padded_m: int
  block_n: int
  block_k: int


def check_args(x, values, scales, minimums, *, bits: int, group_size: int) -> None:
  """Raises ValueError unless the arrays make one quantized product.

  Args:
    x: float `[..., in]`.
    values: int8 `[out, in]` (`bits` 8) or packed uint8 `[out, in / 2]` (4).
    scales: float `[out, in / group_size]`, or int16 holding float16's
      bits (`float_groups`).
    minimums: like `scales`, or None.
    bits: 8 or 4.
    group_size: inputs per scale, dividing `in`.
  """
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits!r}")
  want = jnp.dtype(jnp.uint8 if bits == 4 else jnp.int8)
  if values.ndim != 2 or values.dtype != want:
    raise ValueError(
      f"{bits}-bit values must be {want.name}[out, stored], got {values.dtype}{list(values.shape)}"
    )
  out, stored = values.shape
  in_features = stored * 8 // bits
  if x.ndim < 1 or x.shape[-1] != in_features or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(
      f"x must be float [..., {in_features}] for values {values.dtype}{list(values.shape)}, "
      f"got {x.dtype}{list(x.shape)}"
    )
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  if in_features % group_size:
    raise ValueError(f"group_size {group_size} does not divide the input dimension {in_features}")
  groups = (out, in_features // group_size)
  for name, array in (("scales", scales), ("minimums", minimums)):
    if array is None:
      continue
    if tuple(array.shape) != groups:
      raise ValueError(
        f"{name} must be [out, in / group_size] = {list(groups)}, got {list(array.shape)}"
      )
    if not jnp.issubdtype(array.dtype, jnp.floating) and array.dtype != jnp.int16:
      raise ValueError(f"{name} must be float or int16 (float16's bits), got {array.dtype}")


def float_groups(per_group) -> jax.Array:
  """A scales or minimums array as float: int16 (float16's bits, the layout
  the TPU kernel loads without a copy) as the float16 it holds, float as it is."""
  if per_group.dtype == jnp.int16:
    return jax.lax.bitcast_convert_type(per_group, jnp.float16)
  return per_group


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
  """The tiles of the product of `m` rows of `dtype` with a `[n, k]` kernel.

  `block_n` and `block_k` default to the largest of `BLOCK_SIZES` that
  divides `n` and the stored columns of one half (`k / 2` for 4 bits,
  whose steps read both nibble halves at once; `k` for 8 bits).

  Raises:
    ValueError: naming the numbers, for a dtype the kernel does not compute
      in, a dimension no tile of `BLOCK_SIZES` divides, a group size that
      does not divide one half's inputs or a K tile, or one not a multiple of 8.
  """
  dtype = jnp.dtype(dtype)
  if dtype not in COMPUTE_DTYPES:
    raise ValueError(f"the kernel computes in float32 or bfloat16, not {dtype.name}")
  half = k // 2 if bits == 4 else k
  where = "k / 2 = " if bits == 4 else "k = "
  if half % group_size:
    raise ValueError(
      f"group_size {group_size} does not divide {where}{half}, the inputs of one nibble half"
    )
  block_n = block_n or _largest_tile(n)
  block_k = block_k or _largest_tile(half)
  served = ", ".join(map(str, BLOCK_SIZES))
  for name, size, block in (("n", n, block_n), (where[:-3], half, block_k)):
    if block is None:
      raise ValueError(
        f"{name} = {size} is not tiled by the kernel: no tile of {served} divides it"
      )
    if block % 128 or size % block:
      raise ValueError(
        f"tile {block} for {name} = {size} must be a multiple of 128 that divides it"
      )
  if group_size % 8 or block_k % group_size:
    raise ValueError(
      f"group_size {group_size} must be a multiple of 8 that divides the K tile {block_k}"
    )
  rows = 16 if dtype.itemsize == 2 else 8
  padded_m = -(-m // rows) * rows
  block_m = padded_m if padded_m <= MAX_BLOCK_M else MAX_BLOCK_M
  padded_m = -(-padded_m // block_m) * block_m
  return Tiles(block_m, padded_m, block_n, block_k)


def refusal(m: int, n: int, k: int, *, bits: int, group_size: int, dtype) -> str | None:
  """Why the kernel cannot serve this product; None when it can."""
  try:
    tiles(m, n, k, bits=bits, group_size=group_size, dtype=dtype)
  except ValueError as err:
    return str(err)
  return None


def _largest_tile(size: int) -> int | None:
  return next((block for block in BLOCK_SIZES if size % block == 0), None)
