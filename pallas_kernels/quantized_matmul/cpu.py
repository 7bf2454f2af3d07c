"""`x @ dequant(w).T` for a few rows on CPU, as a C++ kernel called through `jax.ffi`.

XLA:CPU computes each weight of a one-row product from the packed bytes as
it multiplies, but its loop fusions spend 1.6x to 2.1x bfloat16's time per
weight (shift, mask, conversion, scale and minimum per weight, one fusion
per nibble half); with several rows it writes the float kernel first. This
kernel (`cpu_matmul.cc`) reads each weight row's bytes once, computes 16
weights at a time in vector registers (from 16 bytes, 16 inputs of each
nibble half) and multiplies them with up to `MAX_ROWS` rows of `x`, in
float32; runs of output rows are shared with XLA's intra-op thread pool.

The weights are not rounded to `x`'s dtype: a bfloat16 `x` is widened and
multiplied with the float32 weights (as XLA's one-row product does), so the
result is `quantized_matmul_reference` of `x` in float32, to float rounding.

`pallas_kernels.cpu_build` builds it at first use (the system C++ compiler,
a cached library); `unavailable_reason` says why it cannot run here.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build
from pallas_kernels.quantized_matmul import common

TARGET = "paged_jax_quantized_matmul_cpu"
TARGET_INTO = "paged_jax_quantized_matmul_into_cpu"  # writes over a buffer passed in
LIBRARY = cpu_build.Library(
  Path(__file__).with_name("cpu_matmul.cc"),
  ((TARGET, "QuantizedMatmulCpu"), (TARGET_INTO, "QuantizedMatmulIntoCpu")),
)
# Rows of `x` the kernel takes; more go to XLA, whose several-row product
# (the float kernel written once, then a matmul) is as fast from about 8
# rows on (benchmarks/bench_quant_weights.py --smollm2-shapes --rows 1 2 4 8).
MAX_ROWS = 4
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
GROUP_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_NAME = "quantized_matmul_cpu"


def unavailable_reason() -> str | None:
  """Why the kernel cannot run here; None once it is built and registered."""
  return LIBRARY.unavailable_reason()


def refusal(rows: int, dtype) -> str | None:
  """Why the kernel does not take `rows` rows of `x` in `dtype`; None if it does."""
  if jnp.dtype(dtype) not in DTYPES:
    return f"it takes float32 or bfloat16 x, not {jnp.dtype(dtype).name}"
  if rows > MAX_ROWS:
    return f"{rows} rows are more than the {MAX_ROWS} it takes"
  return None


def quantized_matmul(
  x, values, scales, minimums=None, *, bits: int, group_size: int, into=None
) -> jax.Array:
  """Float32 `x @ w.T` by the C++ kernel.

  Args:
    x: float32 or bfloat16 `[..., in]`, at most `MAX_ROWS` rows.
    values: int8 `[out, in]` (`bits` 8) or packed uint8 `[out, in / 2]` (4).
    scales: float `[out, in / group_size]` (float16 and float32 as they
      are, int16 as the float16 bits it holds, other dtypes converted to
      float32).
    minimums: like `scales`, or None.
    bits: 8 or 4.
    group_size: inputs per scale.
    into: None, or a float32 `[..., out]` array whose buffer the kernel
      writes over (tests fill it first, to see what the kernel leaves).

  Returns:
    float32 `[..., out]`.

  Raises:
    ValueError: naming the numbers, for arrays that do not make one product
      (`common.check_args`), more than `MAX_ROWS` rows or another dtype of
      `x`; RuntimeError when the kernel cannot be built here (the reason in
      the message).
  """
  common.check_args(x, values, scales, minimums, bits=bits, group_size=group_size)
  lead, k = x.shape[:-1], x.shape[-1]
  reason = refusal(math.prod(lead), x.dtype)
  if reason:
    raise ValueError(f"{_NAME}: {reason}")
  reason = unavailable_reason()
  if reason:
    raise RuntimeError(f"{_NAME}: {reason}")
  n = values.shape[0]
  rows = x.reshape(-1, k)
  groups = [_as_served(a) for a in (scales, scales if minimums is None else minimums)]
  shape = jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32)
  operands = [rows, values, *groups]
  if into is None:
    call = jax.ffi.ffi_call(TARGET, shape, vmap_method="sequential")
  else:
    operands.append(jnp.asarray(into, jnp.float32).reshape(shape.shape))
    call = jax.ffi.ffi_call(TARGET_INTO, shape, input_output_aliases={4: 0})
  out = call(
    *operands,
    bits=np.int64(bits),
    group_size=np.int64(group_size),
    with_minimums=np.int64(minimums is not None),
  )
  return out.reshape(*lead, n)


def _as_served(per_group) -> jax.Array:
  """Scales or minimums in a dtype the kernel reads: float16 (int16 bits
  read as the float16 they hold) or float32."""
  per_group = common.float_groups(per_group)
  if per_group.dtype in GROUP_DTYPES:
    return per_group
  return per_group.astype(jnp.float32)
