"""A few bfloat16 rows times a bfloat16 weight `[N, K]` on CPU, as a C++
kernel called through `jax.ffi` (the decode steps of up to
`kernel_choice.ROW_PRODUCT_MAX_ROWS` sequences).

From JAX 0.12 on, XLA:CPU runs one row's product 10x slower than before in
the fused one-row loop, and even padded to two rows its matmul takes about
1.7x the time of reading the weight once (benchmarks/bench_one_row_product.py);
at 4 to 32 rows its matmul takes 1.1x to 1.8x this kernel's time on weights
read from memory (benchmarks/bench_few_rows_product.py). This kernel (`row_product.cc`) works
in tiles of 4 rows by 4 weight rows, each weight row read from memory once
(the next tile's prefetched), with AVX-512 BF16's pairwise products where
the CPU has them and float32 multiplies of widened weights elsewhere; the
sums are float32, as XLA's with `preferred_element_type=float32`, in
another order. Runs of output columns are shared with XLA's intra-op
thread pool.

`pallas_kernels.cpu_build` builds it at first use (the system C++ compiler,
a cached library); `unavailable_reason` says why it cannot run here.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build

TARGET = "paged_jax_row_product_cpu"
TARGET_INTO = "paged_jax_row_product_into_cpu"  # writes over a buffer passed in
LIBRARY = cpu_build.Library(
  Path(__file__).with_name("row_product.cc"),
  ((TARGET, "RowProductCpu"), (TARGET_INTO, "RowProductIntoCpu")),
)


def unavailable_reason() -> str | None:
  """Why the kernel cannot run here; None once it is built and registered."""
  return LIBRARY.unavailable_reason()


def row_product(x: jax.Array, w: jax.Array, *, into=None) -> jax.Array:
  """Float32 `x @ w.T` by the C++ kernel.

  Args:
    x: bfloat16 `[..., K]`, a few rows (every leading axis counts).
    w: bfloat16 `[N, K]`.
    into: None, or a float32 `[..., N]` array whose buffer the kernel
      writes over (tests fill it first, to see what the kernel leaves).

  Returns:
    float32 `[..., N]`.

  Raises:
    ValueError: naming the shapes or dtypes, for arrays that do not make
      a bfloat16 product with rows; RuntimeError when the kernel cannot be
      built here (the reason in the message).
  """
  if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
    raise ValueError(f"row_product: x and w must be bfloat16, got {x.dtype} and {w.dtype}")
  if x.ndim == 0 or x.size == 0 or w.ndim != 2 or w.shape[1] != x.shape[-1]:
    raise ValueError(f"row_product: x must hold rows of w's {w.shape} inputs, got {x.shape}")
  reason = unavailable_reason()
  if reason:
    raise RuntimeError(f"row_product: {reason}")
  rows = x.size // x.shape[-1]
  shape = jax.ShapeDtypeStruct((rows, w.shape[0]), jnp.float32)
  operands = [x.reshape(rows, -1), w]
  if into is None:
    call = jax.ffi.ffi_call(TARGET, shape, vmap_method="sequential")
  else:
    operands.append(jnp.asarray(into, jnp.float32).reshape(shape.shape))
    call = jax.ffi.ffi_call(TARGET_INTO, shape, input_output_aliases={2: 0})
  return call(*operands).reshape(*x.shape[:-1], w.shape[0])
