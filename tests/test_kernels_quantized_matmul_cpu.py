"""The C++ quantized product of the CPU backend (`pallas_kernels/
quantized_matmul/cpu.py`) against its jnp reference, and the choice that
runs it (`paged_jax.kernel_choice.select_quantized_matmul`).

Random integers over their whole range, scales and minimums never zero.
The kernel writes over an output filled with NaN first (`into`), so an
element it does not write shows. It multiplies the float32 weights (not
rounded to `x`'s dtype), so the reference takes `x` in float32.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import kernel_choice
from paged_jax.models import quantized
from pallas_kernels.quantized_matmul import cpu, quantized_matmul_reference
from tests.test_kernels_quantized_matmul import random_weight

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="the C++ kernel runs on the CPU backend"
)
MAX = cpu.MAX_ROWS
SLOW = pytest.mark.slow  # CI keeps one case of each path


@pytest.fixture(scope="module", autouse=True)
def built():
  """Builds the kernel (once per machine: the library is cached); skips
  where no compiler exists, fails where one exists and the build fails."""
  if cpu.cpu_build.find_compiler() is None:
    pytest.skip("no C++ compiler")
  assert cpu.unavailable_reason() is None


def product(x, values, scales, mins, bits, group_size, into=None):
  call = lambda *a: cpu.quantized_matmul(*a, bits=bits, group_size=group_size, into=into)
  return jax.jit(call)(x, values, scales, mins)


# (n, k, bits, group_size, minimums, rows, x dtype, scales dtype). SmolLM2's
# [576, 576] in groups of 32 (bfloat16 x: the bfloat16 dot products where the
# CPU has them); groups of 64 and 128 whose halves split a group (k / 2 = 288
# or 192); per-channel int8 (one group of 576); int8 in groups of 32 with
# minimums (GGUF Q5_K) and of 16 (Q6_K); odd shapes (33 outputs, k = 72 in
# groups of 12: the plain loops; k = 96: halves of 48 inputs) at one row, a
# few and the most the kernel takes.
CASES = [
  pytest.param(576, 576, 4, 32, True, 1, "bfloat16", "float16", id="int4-g32-min-m1-bf16"),
  pytest.param(576, 576, 4, 32, True, 3, "float32", "float16", id="int4-g32-min-m3-f32"),
  pytest.param(
    64, 576, 4, 64, False, MAX, "bfloat16", "float32", id="int4-g64-mmax-bf16", marks=SLOW
  ),
  pytest.param(
    48, 384, 4, 128, True, 3, "bfloat16", "float16", id="int4-g128-min-m3-bf16", marks=SLOW
  ),
  pytest.param(64, 512, 4, 128, False, 2, "float32", "float32", id="int4-g128-m2-f32", marks=SLOW),
  pytest.param(40, 576, 8, 576, False, 1, "bfloat16", "float32", id="int8-channel-m1-bf16"),
  pytest.param(
    40, 256, 8, 32, True, MAX, "float32", "float16", id="int8-g32-min-mmax-f32", marks=SLOW
  ),
  pytest.param(24, 160, 8, 16, False, 2, "bfloat16", "float16", id="int8-g16-m2-bf16", marks=SLOW),
  pytest.param(33, 96, 4, 32, True, 2, "float32", "float16", id="int4-k96-n33-m2-f32"),
  pytest.param(
    33, 72, 4, 12, True, 1, "bfloat16", "float32", id="int4-k72-g12-m1-bf16", marks=SLOW
  ),
  pytest.param(17, 72, 8, 12, True, MAX, "float32", "float16", id="int8-k72-g12-mmax-f32"),
]


@pytest.mark.parametrize("n,k,bits,group_size,minimums,rows,dtype,scales_dtype", CASES)
def test_kernel_matches_reference(n, k, bits, group_size, minimums, rows, dtype, scales_dtype):
  values, scales, mins = random_weight(n, k, bits, group_size, minimums, seed=n + k)
  scales = scales.astype(scales_dtype)
  x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k)), dtype)
  poison = jnp.full((rows, n), jnp.nan, jnp.float32)
  got = product(x, values, scales, mins, bits, group_size, into=poison)
  want = quantized_matmul_reference(
    x.astype(jnp.float32), values, scales, mins, bits=bits, group_size=group_size
  )
  assert got.shape == (rows, n) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5 * k**0.5)
  if rows == 1:  # the target the models call, without `into`
    plain = product(x, values, scales, mins, bits, group_size)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(got))


def test_leading_axes_and_scale_dtypes():
  """bfloat16 scales are read as float32; int16 ones (a TPU placement's
  float16 bits) as the float16 they hold."""
  values, scales, mins = random_weight(32, 128, 4, 32, True, seed=4)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 2, 128)), jnp.float32)
  wide = (scales.astype(jnp.bfloat16), mins.astype(jnp.bfloat16))
  got = product(x, values, *wide, 4, 32)
  want = quantized_matmul_reference(x, values, *wide, bits=4, group_size=32)
  assert got.shape == (2, 2, 32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-4)
  bits = [jax.lax.bitcast_convert_type(a, jnp.int16) for a in (scales, mins)]
  halves = product(x, values, scales, mins, 4, 32)
  np.testing.assert_array_equal(np.asarray(product(x, values, *bits, 4, 32)), np.asarray(halves))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_nan_input_gives_nan_outputs_in_its_row_only(dtype):
  values, scales, mins = random_weight(32, 128, 4, 32, True, seed=9)
  x = np.random.default_rng(10).standard_normal((2, 128))
  x[1, 70] = np.nan
  got = np.asarray(product(jnp.asarray(x, dtype), values, scales, mins, 4, 32))
  assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()


def test_float16_scales_decode_exactly_subnormals_included():
  """Every finite float16 bit pattern as the scale of a row of 32 int8 ones,
  x the first unit vector: each output is its scale, exactly."""
  patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
  scales = patterns[np.isfinite(patterns)][:, None]
  values = jnp.ones((scales.shape[0], 32), jnp.int8)
  x = jnp.zeros((1, 32), jnp.float32).at[0, 0].set(1.0)
  got = product(x, values, jnp.asarray(scales), None, 8, 32)
  np.testing.assert_array_equal(np.asarray(got)[0], scales[:, 0].astype(np.float32))


@pytest.mark.parametrize(
  "rows,dtype,change,error,message",
  [
    (MAX + 1, "float32", {}, ValueError, f"{MAX + 1} rows are more than the {MAX} it takes"),
    (1, "float16", {}, ValueError, "float32 or bfloat16 x, not float16"),
    (1, "float32", dict(group_size=48), ValueError, "group_size 48 does not divide .* 128"),
    (1, "float32", dict(bits=4), ValueError, "4-bit values must be uint8"),
  ],
)
def test_bad_arguments_are_named(rows, dtype, change, error, message):
  values, scales, _ = random_weight(16, 128, 8, 32, False)
  x = jnp.ones((rows, 128), dtype)
  args = {"bits": 8, "group_size": 32, **change}
  with pytest.raises(error, match=f"{message}"):
    cpu.quantized_matmul(x, values, scales, **args)


def test_the_kernel_checks_its_buffers():
  """Buffers that do not make one product, passed around the wrapper's
  checks: the kernel's own error."""
  values, scales, _ = random_weight(16, 128, 8, 32, False)
  call = jax.ffi.ffi_call(cpu.TARGET, jax.ShapeDtypeStruct((1, 16), jnp.float32))
  x = jnp.ones((1, 128), jnp.float32)
  attrs = dict(bits=np.int64(8), group_size=np.int64(32), with_minimums=np.int64(0))
  with pytest.raises(Exception, match="quantized matmul: inconsistent shapes"):
    jax.block_until_ready(call(x, values, scales[:, :2], scales[:, :2], **attrs))


def test_without_a_kernel_the_choice_falls_back_and_logs_why(monkeypatch, caplog):
  reason = "no C++ compiler found (c++, g++ or clang++)"
  monkeypatch.setattr(cpu, "unavailable_reason", lambda: reason)
  kernel_choice._log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="paged_jax"):
    assert choose(rows=1) is None
  assert f"quantized matmul on cpu (bfloat16, up to {MAX} rows): XLA (C++ kernel: {reason})" in (
    caplog.text
  )
  values, scales, mins = random_weight(16, 128, 4, 32, True)
  x = jnp.ones((1, 128), jnp.bfloat16)
  assert not uses_kernel(x, values, scales, mins)
  with pytest.raises(RuntimeError, match="quantized_matmul_cpu: no C\\+\\+ compiler"):
    cpu.quantized_matmul(x, values, scales, mins, bits=4, group_size=32)


def choose(**overrides):
  shape = dict(out_features=576, in_features=576, bits=4, group_size=32, dtype=jnp.bfloat16)
  with kernel_choice.target_platform("cpu"):
    return kernel_choice.select_quantized_matmul(**{**shape, **overrides})


def uses_kernel(x, values, scales, mins, bits=4, group_size=32) -> bool:
  """Whether `quantized.matmul` (as the models call it) traces the C++ kernel."""
  fn = lambda x: quantized.matmul(x, values, scales, mins, bits, group_size, x.dtype)
  return cpu.TARGET in str(jax.make_jaxpr(fn)(x))


def test_a_few_rows_run_the_kernel_more_run_xla_and_match():
  values, scales, mins = random_weight(64, 256, 4, 32, True, seed=7)
  rng = np.random.default_rng(8)
  for rows, kernel in ((1, True), (MAX, True), (MAX + 1, False)):
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
    assert uses_kernel(x, values, scales, mins) == kernel
    got = quantized.matmul(x, values, scales, mins, 4, 32, jnp.float32)
    want = quantized_matmul_reference(x, values, scales, mins, bits=4, group_size=32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-4)


def test_the_switches_turn_the_kernel_off(monkeypatch):
  assert choose(rows=MAX) == ("cpu", False) and choose(rows=MAX + 1) is None
  assert choose(rows=1, split=True) is None  # weights split over devices: XLA
  with kernel_choice.use_cpu_kernel(False, "quantized_matmul"):
    assert choose(rows=1) is None
    assert kernel_choice.cpu_kernel_enabled("attention")
  with kernel_choice.use_cpu_kernel(False, "attention"):
    assert choose(rows=1) == ("cpu", False)
  with kernel_choice.use_cpu_kernel(False):
    assert choose(rows=1) is None and not kernel_choice.cpu_kernel_enabled("attention")
  monkeypatch.setenv("PAGED_JAX_CPU_KERNEL", "0")
  assert choose(rows=1) is None
  with kernel_choice.use_cpu_kernel(True, "quantized_matmul"):
    assert choose(rows=1) == ("cpu", False)
  with pytest.raises(ValueError, match="kernel must be one of .* got 'matmul'"):
    with kernel_choice.use_cpu_kernel(False, "matmul"):
      pass


def test_other_platforms_do_not_take_it():
  with kernel_choice.target_platform("tpu"):
    assert kernel_choice.select_quantized_matmul(
      out_features=512, in_features=512, bits=4, group_size=32, dtype=jnp.bfloat16
    ) == ("tpu", False)
