"""The C++ bfloat16 product of a few rows of the CPU backend (`pallas_kernels/
row_product.py`) against a float64 reference, and the choice that runs it
(`paged_jax.kernel_choice.cpu_row_product`, from `layers.dot_transposed`).

Random weights and rows, never zero. The kernel writes over an output filled
with NaN first (`into`), so an element it does not write shows.
"""

import logging
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import kernel_choice
from paged_jax.models import layers
from pallas_kernels import cpu_build, row_product

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="the C++ kernel runs on the CPU backend"
)


@pytest.fixture(scope="module", autouse=True)
def built():
  """Builds the kernel (once per machine: the library is cached); skips
  where no compiler exists, fails where one exists and the build fails."""
  if row_product.cpu_build.find_compiler() is None:
    pytest.skip("no C++ compiler")
  assert row_product.unavailable_reason() is None


def random_operands(m: int, n: int, k: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.uniform(0.5, 2.0, (1, m, k)) * rng.choice([-1, 1], (1, m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((n, k)) + 0.01, jnp.bfloat16)
  return x, w


def reference(x, w) -> np.ndarray:
  return np.asarray(x, np.float64).reshape(-1, w.shape[1]) @ np.asarray(w, np.float64).T


# m: tiles of 4 rows, and a last 1, 2 or 3; n: runs of output columns shared
# out, whole tiles of weight rows and a part one; k: whole runs of 128 or
# 32 and a part one.
SHAPES = [(1, 200, 576), (1, 7, 40), (2, 130, 100), (3, 64, 1536), (4, 130, 17)]
SHAPES += [(5, 96, 576), (6, 200, 40), (7, 9, 64), (16, 576, 576), (32, 72, 200)]


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_kernel_matches_reference(m, n, k):
  x, w = random_operands(m, n, k, seed=m + n + k)
  poison = jnp.full((1, m, n), jnp.nan, jnp.float32)
  got = jax.jit(lambda x, w, p: row_product.row_product(x, w, into=p))(x, w, poison)
  assert got.shape == (1, m, n) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got).reshape(m, n), reference(x, w), rtol=1e-5, atol=1e-4)
  # The target the models call, without `into`.
  plain = jax.jit(row_product.row_product)(x, w)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(got))


def test_a_nan_weight_gives_nan_in_its_output_only():
  x, w = random_operands(6, 32, 64)
  w = w.at[5, 10].set(jnp.nan)
  got = np.asarray(row_product.row_product(x, w)).reshape(6, 32)
  assert np.isnan(got[:, 5]).all() and np.isfinite(np.delete(got, 5, axis=1)).all()


@pytest.mark.skipif(
  platform.machine() not in ("x86_64", "AMD64") or "avx512_bf16" not in cpu_build._cpu_features(),
  reason="the pairwise products run here; this checks the other path on a CPU that has them",
)
def test_the_widening_path_for_cpus_without_bfloat16_products_matches(monkeypatch):
  """The same source built without AVX-512 BF16 (as for other CPUs), under
  a target of its own."""
  monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, "-mno-avx512bf16"))
  target = "paged_jax_row_product_widening_cpu"
  library = cpu_build.Library(
    Path(row_product.__file__).with_name("row_product.cc"), ((target, "RowProductCpu"),)
  )
  assert library.unavailable_reason() is None
  for m, n, k in SHAPES:
    x, w = random_operands(m, n, k, seed=m * n * k)
    shape = jax.ShapeDtypeStruct((m, n), jnp.float32)
    got = jax.ffi.ffi_call(target, shape)(x.reshape(m, k), w)
    np.testing.assert_allclose(np.asarray(got), reference(x, w), rtol=1e-5, atol=1e-4)


ROWS = r"x must hold rows of w's \(8, 64\) inputs, "


@pytest.mark.parametrize(
  "x_shape, x_dtype, w_shape, w_dtype, message",
  [
    ((1, 64), jnp.float32, (8, 64), jnp.bfloat16, "x and w must be bfloat16, got float32"),
    ((1, 64), jnp.bfloat16, (8, 64), jnp.float32, "x and w must be bfloat16, got bfloat16 and"),
    ((2, 32), jnp.bfloat16, (8, 64), jnp.bfloat16, ROWS + r"got \(2, 32\)"),
    ((0, 64), jnp.bfloat16, (8, 64), jnp.bfloat16, ROWS + r"got \(0, 64\)"),
    ((), jnp.bfloat16, (8, 64), jnp.bfloat16, ROWS + r"got \(\)"),
  ],
)
def test_bad_arguments_are_named(x_shape, x_dtype, w_shape, w_dtype, message):
  with pytest.raises(ValueError, match=f"row_product: {message}"):
    row_product.row_product(jnp.ones(x_shape, x_dtype), jnp.ones(w_shape, w_dtype))


def test_the_kernel_checks_its_buffers():
  """Buffers that do not make one product, passed around the wrapper's
  checks: the kernel's own error."""
  call = jax.ffi.ffi_call(row_product.TARGET, jax.ShapeDtypeStruct((1, 8), jnp.float32))
  x, w = jnp.ones((2, 64), jnp.bfloat16), jnp.ones((8, 64), jnp.bfloat16)
  with pytest.raises(
    Exception, match=r"row product: x must be \[m, k\], w \[n, k\] and out \[m, n\]"
  ):
    jax.block_until_ready(call(x, w))


def uses_kernel(x, w) -> bool:
  """Whether `layers.dot_transposed` (as the models call it) traces the C++
  kernel (a new function each time: JAX reuses a function's trace)."""
  return row_product.TARGET in str(jax.make_jaxpr(lambda x, w: layers.dot_transposed(x, w))(x, w))


@pytest.mark.parametrize("m", [1, 4, kernel_choice.ROW_PRODUCT_MAX_ROWS])
def test_the_models_few_bfloat16_rows_run_the_kernel_and_match(m):
  x, w = random_operands(m, 96, 128, seed=3)
  assert uses_kernel(x, w)
  got = jax.jit(layers.dot_transposed)(x, w)
  np.testing.assert_allclose(np.asarray(got).reshape(m, -1), reference(x, w), rtol=1e-5, atol=1e-4)


def test_more_rows_and_float32_take_xlas_matmul():
  x, w = random_operands(kernel_choice.ROW_PRODUCT_MAX_ROWS + 1, 96, 128)
  assert not uses_kernel(x, w)
  assert not uses_kernel(x[:, :1].astype(jnp.float32), w.astype(jnp.float32))
  assert not uses_kernel(x[:, :1], w.astype(jnp.float32))


def test_the_switches_and_other_platforms_turn_the_kernel_off(monkeypatch):
  x, w = random_operands(1, 16, 64)
  with kernel_choice.use_cpu_kernel(False, "row_product"):
    assert not uses_kernel(x, w)
  with kernel_choice.use_cpu_kernel(False, "attention"):
    assert uses_kernel(x, w)
  with kernel_choice.target_platform("tpu"):
    assert not uses_kernel(x, w)
  monkeypatch.setenv("PAGED_JAX_CPU_KERNEL", "0")
  assert not uses_kernel(x, w)


def test_without_a_kernel_the_choice_falls_back_and_logs_why(monkeypatch, caplog):
  reason = "no C++ compiler found (c++, g++ or clang++)"
  monkeypatch.setattr(row_product, "unavailable_reason", lambda: reason)
  kernel_choice._log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="paged_jax"):
    x, w = random_operands(1, 16, 64)
    assert not uses_kernel(x, w)
  assert f"bfloat16 products of a few rows on cpu: XLA (C++ kernel: {reason})" in caplog.text
  with pytest.raises(RuntimeError, match="row_product: no C\\+\\+ compiler"):
    row_product.row_product(x, w)
