"""The Triton GPU quantized product (`pallas_kernels.quantized_matmul.gpu`)
against its jnp reference: in Pallas interpret mode on CPU, compiled on a GPU
(tests/kernel_modes.py); lowered for CUDA on this host (an abstract H100);
its choice and its run on each device of a split weight.

Random integers over their whole range, scales and minimums never zero
(`random_weight`, shared with the TPU kernel's tests). Interpret mode fills
the kernel's output with NaN before it runs, so a tile it does not write
shows.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from paged_jax import kernel_choice
from paged_jax.models import quantized
from pallas_kernels.quantized_matmul import gpu, quantized_matmul_reference, sharded
from tests.abstract_gpu import lower_for
from tests.kernel_modes import interpret
from tests.test_kernels_quantized_matmul import random_weight

# (bits, group_size, minimums, rows, dtype, block_k); the kernel [64, 256] in
# output tiles of 32: 4 bits store 128 columns a row (2 to 8 steps), 8 bits 256.
# block_k 64 over groups of 32 reads two scale columns a step; 32 over 64,
# one column for two steps; per-channel int8 (groups of 256), one for all.
CASES = [
  pytest.param(4, 32, True, 33, "bfloat16", 64, id="int4-g32-min-m33-bf16"),
  pytest.param(4, 64, False, 1, "float32", 32, id="int4-g64-m1-f32"),
  pytest.param(8, 32, True, 8, "bfloat16", 32, id="int8-g32-min-m8-bf16"),
  pytest.param(4, 128, True, 8, "float16", 64, id="int4-g128-min-m8-f16", marks=pytest.mark.slow),
  pytest.param(4, 64, True, 1, "bfloat16", 128, id="int4-g64-min-m1-bf16", marks=pytest.mark.slow),
  pytest.param(4, 32, False, 8, "float32", 16, id="int4-g32-m8-f32", marks=pytest.mark.slow),
  pytest.param(4, 128, False, 33, "bfloat16", 32, id="int4-g128-m33-bf16", marks=pytest.mark.slow),
  pytest.param(8, 16, True, 33, "float32", 64, id="int8-g16-min-m33-f32", marks=pytest.mark.slow),
  pytest.param(8, 256, False, 1, "bfloat16", 64, id="int8-channel-m1-bf16", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("bits,group_size,minimums,rows,dtype,block_k", CASES)
def test_kernel_matches_reference(bits, group_size, minimums, rows, dtype, block_k):
  n, k = 64, 256
  values, scales, mins = random_weight(n, k, bits, group_size, minimums)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, k)), dtype)
  got = gpu.quantized_matmul(
    x,
    values,
    scales,
    mins,
    bits=bits,
    group_size=group_size,
    block_n=32,
    block_k=block_k,
    interpret=interpret("gpu"),
  )
  want = quantized_matmul_reference(x, values, scales, mins, bits=bits, group_size=group_size)
  assert got.shape == (rows, n) and got.dtype == jnp.float32
  assert np.all(np.isfinite(got))
  # The same rounded weights and products; only the order of the float32 sums differs.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(jnp.max(jnp.abs(want))))


def test_kernel_keeps_leading_axes_reads_scale_bits_and_picks_tiles():
  # Scales and minimums as float16's int16 bits (the TPU layout) read as
  # the float16 they hold; default tiles.
  values, scales, mins = random_weight(64, 256, 4, 32, True, seed=2)
  bits = [jax.lax.bitcast_convert_type(a, jnp.int16) for a in (scales, mins)]
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 256)), jnp.float32)
  got = gpu.quantized_matmul(x, values, *bits, bits=4, group_size=32, interpret=interpret("gpu"))
  want = quantized_matmul_reference(x, values, scales, mins, bits=4, group_size=32)
  assert got.shape == (2, 3, 64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


def test_tiles_pad_rows_to_a_tensor_core_dot():
  tile = lambda m, **kw: gpu.tiles(m, 4096, 4096, dtype=jnp.bfloat16, **{"bits": 4, **kw})
  assert (tile(1, group_size=32).block_m, tile(1, group_size=32).padded_m) == (16, 16)
  assert (tile(33, group_size=32).block_m, tile(33, group_size=32).padded_m) == (64, 64)
  assert (tile(100, group_size=32).block_m, tile(100, group_size=32).padded_m) == (64, 128)
  assert (tile(8, group_size=32).block_n, tile(8, group_size=32).block_k) == (64, 128)
  # Q6_K's groups of 16; per-channel int8 (one group of 4096 inputs).
  assert tile(8, group_size=16, bits=8).block_k == 128
  assert tile(8, group_size=4096, bits=8).block_k == 128


@pytest.mark.parametrize(
  "n,k,bits,group_size,dtype,tiles,message",
  [
    (200, 512, 4, 32, "float32", {}, "n = 200 is not tiled by the GPU kernel: no tile of 64, 32"),
    (256, 384, 4, 24, "float32", {}, "k / 2 = 192 with groups of 24 is not tiled by the GPU"),
    (256, 384, 4, 128, "float32", {}, "group_size 128 does not divide k / 2 = 192"),
    (256, 512, 8, 32, "float32", dict(block_k=48), "tile 48 for k = 512 must be a power of two"),
    (256, 512, 8, 32, "float32", dict(block_k=8), "tile 8 for k = 512 must .* at least 16"),
    (256, 512, 4, 32, "float32", dict(block_n=512), "tile 512 for n = 256 must .* divides it"),
    (256, 768, 8, 48, "float32", dict(block_k=32), "the K tile 32 and group_size 48 must divide"),
    (256, 512, 4, 32, "float64", {}, "computes in float32, bfloat16, float16, not float64"),
  ],
)
def test_shapes_the_kernel_cannot_tile_are_named(n, k, bits, group_size, dtype, tiles, message):
  with pytest.raises(ValueError, match=message):
    gpu.tiles(4, n, k, bits=bits, group_size=group_size, dtype=dtype, **tiles)
  if not tiles:
    assert re.search(
      message, gpu.refusal(4, n, k, bits=bits, group_size=group_size, dtype=dtype) or ""
    )


def test_bad_arguments_are_named():
  values, scales, mins = random_weight(64, 256, 4, 32, True)
  x = jnp.ones((2, 256), jnp.float32)
  with pytest.raises(ValueError, match="minimums must be float or int16 .* got int32"):
    gpu.quantized_matmul(x, values, scales, mins.astype(jnp.int32), bits=4, group_size=32)
  with pytest.raises(ValueError, match=re.escape("x must be float [..., 256]")):
    gpu.quantized_matmul(x[:, :200], values, scales, mins, bits=4, group_size=32)


# Llama-3-8B's gate (4 bits, groups of 32, bfloat16) and down projections
# (int8 in Q8_0's groups of 32): Triton IR for an H100, no GPU needed.
@pytest.mark.parametrize(
  "bits,group_size,n,k",
  [
    (4, 32, 14336, 4096),
    pytest.param(8, 32, 4096, 14336, marks=pytest.mark.slow),
    pytest.param(8, 4096, 14336, 4096, marks=pytest.mark.slow),
  ],
)
def test_kernel_lowers_for_cuda(bits, group_size, n, k):
  shape = jax.ShapeDtypeStruct
  stored = (n, k // 2) if bits == 4 else (n, k)
  groups = shape((n, k // group_size), jnp.float16)
  run = jax.jit(lambda *a: gpu.quantized_matmul(*a, bits=bits, group_size=group_size))
  values = shape(stored, jnp.uint8 if bits == 4 else jnp.int8)
  lowered = lower_for("cuda", run, shape((8, k), jnp.bfloat16), values, groups, groups)
  assert "quantized_matmul_gpu" in lowered.as_text()


def test_models_take_the_kernel_on_a_gpu():
  values, scales, mins = random_weight(128, 256, 4, 32, True)
  x = jnp.ones((8, 256), jnp.bfloat16)
  product = lambda x: quantized.matmul(x, values, scales, mins, 4, 32, jnp.bfloat16)
  with kernel_choice.target_platform("cuda"):
    text = str(jax.make_jaxpr(product)(x))
  assert "quantized_matmul_gpu" in text


@pytest.mark.parametrize("spec", [P("model", None), P(None, "model")], ids=["column", "row"])
def test_split_product_runs_the_gpu_kernel_on_each_device(spec):
  # One device here (two: test_split_product_on_two_devices_equals_one).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  values, scales, mins = random_weight(64, 256, 4, 32, True, seed=9)
  x = jnp.asarray(np.random.default_rng(10).standard_normal((3, 256)), jnp.float32)
  got = sharded.quantized_matmul_sharded(
    x,
    values,
    scales,
    mins,
    bits=4,
    group_size=32,
    mesh=mesh,
    values_spec=spec,
    kernel="gpu",
    interpret=interpret("gpu"),
  )
  want = quantized_matmul_reference(x, values, scales, mins, bits=4, group_size=32)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


def test_split_product_names_an_unknown_kernel():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  values, scales, mins = random_weight(64, 256, 4, 32, True)
  with pytest.raises(ValueError, match=r"kernel must be one of \('tpu', 'gpu'\), got 'npu'"):
    sharded.quantized_matmul_sharded(
      jnp.ones((1, 256)), values, scales, mins, bits=4, group_size=32, mesh=mesh,
      values_spec=P(), kernel="npu",
    )  # fmt: skip
