"""The quantized product in plain jnp: the oracle the kernels are tested against.

Weight `(r, c)` of a quantized `[out, in]` kernel is `ints[r, c] *
scales[r, g] + minimums[r, g]` with `g = c // group_size`, in float32.
4-bit values are packed two a byte in row halves: byte `c` of a row holds
input `c` in its low nibble and input `c + in / 2` in its high one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import common


def dequantize_reference(values, scales, minimums, *, bits: int, group_size: int) -> jax.Array:
  """Float32 `[out, in]` kernel of the quantized arrays."""
  ints = jnp.concatenate([values & 0x0F, values >> 4], axis=-1) if bits == 4 else values
  out, in_features = ints.shape
  grouped = ints.reshape(out, in_features // group_size, group_size).astype(jnp.float32)
  weight = grouped * common.float_groups(scales).astype(jnp.float32)[..., None]
  if minimums is not None:
    weight = weight + common.float_groups(minimums).astype(jnp.float32)[..., None]
  return weight.reshape(out, in_features)


def quantized_matmul_reference(
  x, values, scales, minimums=None, *, bits: int, group_size: int
) -> jax.Array:
  """Float32 `x @ w.T` for `x` `[..., in]`: the kernel dequantized in
  float32, rounded to `x`'s dtype, multiplied with float32 accumulation.

  Args:
    x: float `[..., in]`.
    values: int8 `[out, in]` (`bits` 8) or packed uint8 `[out, in / 2]` (4).
    scales: float `[out, in / group_size]`, or int16 holding float16's bits.
    minimums: like `scales`, or None.
    bits: 8 or 4.
    group_size: inputs per scale.

  Returns:
    float32 `[..., out]`.
  """
  common.check_args(x, values, scales, minimums, bits=bits, group_size=group_size)
  weight = dequantize_reference(values, scales, minimums, bits=bits, group_size=group_size)
  return jnp.einsum(
    "...k,nk->...n",
    x,
    weight.astype(x.dtype),
    preferred_element_type=jnp.float32,
    precision=jax.lax.Precision.HIGHEST,
  )
