"""The C++ one-row bfloat16 product of the CPU backend (`pallas_kernels/
row_product.py`) against its jnp reference, and the choice that runs it
(`paged_jax.kernel_choice.cpu_row_product`, from `layers.dot_transposed`).

Random weights and rows, never zero. The kernel writes over an output filled
with NaN first (`into`), so an element it does not write shows.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import kernel_choice
from paged_jax.models import layers
from pallas_kernels import row_product

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


def random_operands(n: int, k: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.uniform(0.5, 2.0, (1, 1, k)) * rng.choice([-1, 1], (1, 1, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((n, k)) + 0.01, jnp.bfloat16)
  return x, w


def reference(x, w) -> np.ndarray:
  return np.asarray(x, np.float64).reshape(1, -1) @ np.asarray(w, np.float64).T


# k: four runs of 16 at a time, single runs, and a plain tail; n: a run of
# output rows shared out, and a part one.
@pytest.mark.parametrize("n, k", [(200, 576), (64, 1536), (7, 40), (130, 17)])
def test_kernel_matches_reference(n, k):
  x, w = random_operands(n, k, seed=n + k)
  poison = jnp.full((1, 1, n), jnp.nan, jnp.float32)
  got = jax.jit(lambda x, w, p: row_product.row_product(x, w, into=p))(x, w, poison)
  assert got.shape == (1, 1, n) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got).reshape(1, -1), reference(x, w), rtol=1e-5, atol=1e-4)
  # The target the models call, without `into`.
  plain = jax.jit(row_product.row_product)(x, w)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(got))


def test_a_nan_weight_gives_nan_in_its_output_only():
  x, w = random_operands(32, 64)
  w = w.at[5, 10].set(jnp.nan)
  got = np.asarray(row_product.row_product(x, w)).reshape(-1)
  assert np.isnan(got[5]) and np.isfinite(np.delete(got, 5)).all()


ONE_ROW = r"x must hold one row of w's \(8, 64\) inputs, "


@pytest.mark.parametrize(
  "x_shape, x_dtype, w_shape, w_dtype, message",
  [
    ((1, 64), jnp.float32, (8, 64), jnp.bfloat16, "x and w must be bfloat16, got float32"),
    ((1, 64), jnp.bfloat16, (8, 64), jnp.float32, "x and w must be bfloat16, got bfloat16 and"),
    (
      (2, 64),
      jnp.bfloat16,
      (8, 64),
      jnp.bfloat16,
      ONE_ROW + r"got \(2, 64\)",
    ),
    (
      (1, 32),
      jnp.bfloat16,
      (8, 64),
      jnp.bfloat16,
      ONE_ROW + r"got \(1, 32\)",
    ),
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
  with pytest.raises(Exception, match=r"row product: x must be \[1, k\] and w \[n, k\]"):
    jax.block_until_ready(call(x, w))


def uses_kernel(x, w) -> bool:
  """Whether `layers.dot_transposed` (as the models call it) traces the C++
  kernel (a new function each time: JAX reuses a function's trace)."""
  return row_product.TARGET in str(jax.make_jaxpr(lambda x, w: layers.dot_transposed(x, w))(x, w))


def test_the_models_one_bfloat16_row_runs_the_kernel_and_matches():
  x, w = random_operands(96, 128, seed=3)
  assert uses_kernel(x, w)
  got = jax.jit(layers.dot_transposed)(x, w)
  np.testing.assert_allclose(np.asarray(got).reshape(1, -1), reference(x, w), rtol=1e-5, atol=1e-4)
  two_rows = jnp.concatenate([x, x], axis=1)
  assert not uses_kernel(two_rows, w)  # several rows: XLA's matmul
  assert not uses_kernel(x.astype(jnp.float32), w.astype(jnp.float32))


def test_the_switches_and_other_platforms_turn_the_kernel_off(monkeypatch):
  x, w = random_operands(16, 64)
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
    x, w = random_operands(16, 64)
    assert not uses_kernel(x, w)
  assert f"one bfloat16 row product on cpu: XLA (C++ kernel: {reason})" in caplog.text
  with pytest.raises(RuntimeError, match="row_product: no C\\+\\+ compiler"):
    row_product.row_product(x, w)
