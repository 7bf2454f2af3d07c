"""Floats as their bit patterns: unsigned ints of the same width.

XLA:CPU computes a scatter or gather of floats narrower than 32 bits on a
float32 copy of the whole operand; on their bit patterns it works in place.
"""

from __future__ import annotations

import jax.numpy as jnp


def bits_dtype(dtype) -> jnp.dtype:
  """The unsigned int type as wide as ``dtype``."""
  return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def is_narrow_float(dtype) -> bool:
  """True for floats narrower than 32 bits (bfloat16, float16, fp8)."""
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
