"""The Mosaic TPU quantized product (`pallas_kernels.quantized_matmul`)
against its jnp reference: in TPU interpret mode on CPU, compiled on a TPU
(tests/kernel_modes.py); its choice in `paged_jax.models.quantized.matmul`;
and a compile for TPU v5e by libtpu on this host where libtpu is installed.

Random integers over their whole range, scales and minimums never zero.
Interpret mode fills the kernel's output and its accumulator with NaN
before it runs, so a tile it does not write or an accumulator it does not
clear shows.
"""

import importlib.util
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import kernel_choice
from paged_jax.models import quantized
from pallas_kernels.quantized_matmul import (
  common,
  quantized_matmul,
  quantized_matmul_reference,
  reference,
  sharded,
  tpu,
)
from tests.kernel_modes import interpret

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed")


def random_weight(n: int, k: int, bits: int, group_size: int, minimums: bool, seed: int = 0):
  """`(values, scales, minimums)` of a random `[n, k]` kernel."""
  rng = np.random.default_rng(seed)
  if bits == 4:
    values = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
  else:
    values = rng.integers(-128, 128, (n, k), dtype=np.int8)
  groups = (n, k // group_size)
  signs = rng.choice([-1.0, 1.0], groups)
  scales = (signs * rng.uniform(0.01, 0.1, groups)).astype(np.float16)
  mins = rng.uniform(-0.8, -0.05, groups).astype(np.float16) if minimums else None
  return tuple(None if a is None else jnp.asarray(a) for a in (values, scales, mins))


# (bits, group_size, minimums, rows, dtype); the kernel [256, 512] in tiles of
# [128, 128] stored columns: 2 output tiles, 2 steps for 4 bits and 4 for 8.
CASES = [
  pytest.param(4, 32, True, 33, "bfloat16", id="int4-g32-min-m33-bf16"),
  pytest.param(4, 64, False, 1, "float32", id="int4-g64-m1-f32"),
  pytest.param(4, 64, True, 8, "bfloat16", id="int4-g64-min-m8-bf16", marks=pytest.mark.slow),
  pytest.param(4, 32, False, 8, "float32", id="int4-g32-m8-f32", marks=pytest.mark.slow),
  pytest.param(4, 128, True, 1, "bfloat16", id="int4-g128-min-m1-bf16", marks=pytest.mark.slow),
  pytest.param(8, 32, False, 33, "bfloat16", id="int8-g32-m33-bf16"),
  pytest.param(8, 16, True, 1, "float32", id="int8-g16-min-m1-f32", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("bits,group_size,minimums,rows,dtype", CASES)
def test_kernel_matches_reference(bits, group_size, minimums, rows, dtype):
  n, k = 256, 512
  values, scales, mins = random_weight(n, k, bits, group_size, minimums)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, k)), dtype)
  got = quantized_matmul(
    x,
    values,
    scales,
    mins,
    bits=bits,
    group_size=group_size,
    block_n=128,
    block_k=128,
    interpret=interpret("tpu"),
  )
  want = quantized_matmul_reference(x, values, scales, mins, bits=bits, group_size=group_size)
  assert got.shape == (rows, n) and got.dtype == jnp.float32
  assert np.all(np.isfinite(got))
  # The same rounded weights and products; only the order of the float32 sums differs.
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(jnp.max(jnp.abs(want))))


def test_kernel_keeps_leading_axes_and_default_tiles():
  values, scales, mins = random_weight(128, 256, 4, 32, True, seed=2)
  x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, 256)), jnp.float32)
  got = quantized_matmul(x, values, scales, mins, bits=4, group_size=32, interpret=interpret("tpu"))
  want = quantized_matmul_reference(x, values, scales, mins, bits=4, group_size=32)
  assert got.shape == (2, 3, 128)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3)


def test_float16_scales_decode_from_their_bits_exactly():
  # The kernel loads float16 scales as int16 bits and decodes them itself:
  # every one of the 65,536 patterns (zeros, subnormals, infinities, NaN).
  halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
  bits = tpu._loadable(jnp.asarray(halves))
  assert bits.dtype == jnp.int16
  assert tpu._loadable(bits) is bits  # a placed weight's bits go in as they are
  got = np.asarray(tpu._float32(bits))
  want = halves.astype(np.float32)
  np.testing.assert_array_equal(
    got.view(np.uint32)[~np.isnan(want)], want.view(np.uint32)[~np.isnan(want)]
  )
  assert np.isnan(got[np.isnan(want)]).all()


def test_reference_dequantizes_as_the_models_do():
  for bits, group_size, minimums in ((4, 32, True), (4, 64, False), (8, 16, True)):
    values, scales, mins = random_weight(64, 256, bits, group_size, minimums, seed=4)
    got = reference.dequantize_reference(values, scales, mins, bits=bits, group_size=group_size)
    want = quantized.dequantize(values, scales, mins, bits, group_size)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bits,group_size,minimums", [(4, 32, True), (4, 64, False), (8, 16, True)])
def test_row_split_shards_sum_to_the_product(bits, group_size, minimums):
  # A row-split layer on 4 devices: shard j of the stored columns, with the
  # inputs and groups `shard_inputs` picks for it, gives a partial product;
  # the partials sum to the whole product.
  n, k, shards = 64, 1024, 4
  values, scales, mins = random_weight(n, k, bits, group_size, minimums, seed=5)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((3, k)), jnp.float32)
  columns = values.shape[1] // shards
  total = 0
  for shard in range(shards):
    x_j, scales_j, mins_j = sharded.shard_inputs(
      x, scales, mins, shard, columns, bits=bits, group_size=group_size
    )
    values_j = values[:, shard * columns : (shard + 1) * columns]
    total = total + quantized_matmul_reference(
      x_j, values_j, scales_j, mins_j, bits=bits, group_size=group_size
    )
  want = quantized_matmul_reference(x, values, scales, mins, bits=bits, group_size=group_size)
  np.testing.assert_allclose(total, want, rtol=1e-5, atol=1e-4)


def test_a_shard_that_splits_groups_is_named():
  values, scales, mins = random_weight(64, 1024, 4, 128, True)
  x = jnp.ones((1, 1024), jnp.float32)
  with pytest.raises(ValueError, match="a shard of 64 stored columns splits the groups of 128"):
    sharded.shard_inputs(x, scales, mins, 0, 64, bits=4, group_size=128)


def test_tiles_pad_decode_rows():
  tile = lambda m, dtype: common.tiles(m, 4096, 4096, bits=4, group_size=32, dtype=dtype)
  assert (tile(1, jnp.bfloat16).block_m, tile(1, jnp.bfloat16).padded_m) == (16, 16)
  assert (tile(1, jnp.float32).block_m, tile(33, jnp.float32).padded_m) == (8, 40)
  assert (tile(256, jnp.bfloat16).block_m, tile(300, jnp.bfloat16).padded_m) == (256, 512)
  assert (tile(8, jnp.bfloat16).block_n, tile(8, jnp.bfloat16).block_k) == (512, 512)


@pytest.mark.parametrize(
  "change,message",
  [
    (dict(group_size=48), "group_size 48 does not divide the input dimension 512"),
    (dict(group_size=0), "group_size must be a positive int, got 0"),
    (dict(bits=3), "bits must be 4 or 8, got 3"),
    (dict(x_cols=500), re.escape("x must be float [..., 512] for values uint8[256, 256]")),
    (dict(scales_cols=8), re.escape("scales must be [out, in / group_size] = [256, 16], got")),
    (dict(values_dtype=jnp.int8), re.escape("4-bit values must be uint8[out, stored], got int8")),
  ],
)
def test_bad_arguments_are_named(change, message):
  values, scales, mins = random_weight(256, 512, 4, 32, True)
  x = jnp.ones((2, change.get("x_cols", 512)), jnp.float32)
  if "values_dtype" in change:
    values = values.astype(change["values_dtype"])
  if "scales_cols" in change:
    scales = scales[:, : change["scales_cols"]]
  kwargs = dict(bits=change.get("bits", 4), group_size=change.get("group_size", 32))
  with pytest.raises(ValueError, match=message):
    quantized_matmul(x, values, scales, mins, **kwargs, interpret=True)


@pytest.mark.parametrize(
  "n,k,bits,group_size,dtype,tiles,message",
  [
    (200, 512, 4, 32, "float32", {}, "n = 200 is not tiled by the kernel: no tile of 512, 256"),
    (256, 384, 4, 32, "float32", {}, r"k / 2 = 192 is not tiled by the kernel"),
    (256, 320, 8, 32, "float32", {}, r"k = 320 is not tiled by the kernel"),
    (256, 512, 4, 32, "float32", dict(block_k=192), "tile 192 for k / 2 = 256 must be a multiple"),
    (256, 512, 4, 32, "float32", dict(block_n=384), "tile 384 for n = 256 must be a multiple"),
    (256, 384, 4, 128, "float32", {}, "group_size 128 does not divide k / 2 = 192"),
    (
      256,
      512,
      8,
      4,
      "float32",
      {},
      "group_size 4 must be a multiple of 8 that divides the K tile",
    ),
    (256, 1024, 8, 1024, "float32", {}, "group_size 1024 must .* divides the K tile 512"),
    (256, 512, 4, 32, "float16", {}, "computes in float32 or bfloat16, not float16"),
  ],
)
def test_shapes_the_kernel_cannot_tile_are_named(n, k, bits, group_size, dtype, tiles, message):
  with pytest.raises(ValueError, match=message):
    common.tiles(4, n, k, bits=bits, group_size=group_size, dtype=dtype, **tiles)


SELECT = dict(out_features=14336, in_features=4096, bits=4, group_size=32, dtype=jnp.bfloat16)


@pytest.mark.parametrize(
  "platform,overrides,expected,logged",
  [
    ("tpu", {}, ("tpu", False), "Mosaic kernel"),
    ("tpu", dict(bits=8, group_size=32), ("tpu", False), "Mosaic kernel"),
    ("tpu", dict(bits=8, group_size=4096), None, "XLA, because XLA fuses per-channel int8"),
    ("tpu", dict(out_features=100), None, "XLA, because n = 100 is not tiled"),
    ("tpu", dict(dtype=jnp.float16), None, "XLA, because .* not float16"),
    ("cuda", {}, ("gpu", False), "Triton kernel"),
    ("cuda", dict(bits=8, group_size=32), ("gpu", False), "Triton kernel"),
    ("cuda", dict(bits=8, group_size=4096), None, "XLA, because XLA fuses per-channel int8"),
    ("cuda", dict(out_features=100), None, "XLA, because n = 100 is not tiled by the GPU"),
    ("cuda", dict(dtype=jnp.float16), ("gpu", False), "Triton kernel"),
  ],
)
def test_quantized_matmul_choice(caplog, platform, overrides, expected, logged):
  kernel_choice._log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="paged_jax"), kernel_choice.target_platform(platform):
    assert kernel_choice.select_quantized_matmul(**{**SELECT, **overrides}) == expected
  messages = [r.getMessage() for r in caplog.records if r.name == "paged_jax"]
  assert len(messages) == 1 and messages[0].startswith(f"quantized matmul on {platform} (")
  assert re.search(logged, messages[0]), messages[0]


def test_cpu_product_runs_no_pallas_kernel():
  values, scales, mins = random_weight(128, 256, 4, 32, True)
  x = jnp.ones((8, 256), jnp.bfloat16)
  with kernel_choice.target_platform("cpu"):
    text = str(
      jax.make_jaxpr(lambda x: quantized.matmul(x, values, scales, mins, 4, 32, jnp.bfloat16))(x)
    )
  assert "pallas_call" not in text


# TPU v5e compiles by libtpu (Python >= 3.12, JAX >= 0.12) at Llama-3-8B's
# gate projection: 8 decode rows through a [14336, 4096] kernel. A compile
# says that Mosaic accepts the kernel and what it keeps in HBM, not how fast it runs.
@needs_libtpu
def test_product_compiles_for_tpu_v5e_without_a_float_kernel():
  from paged_jax import aot

  device = aot.topology_devices("v5e:1x1")[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  shape = lambda dims, dt: jax.ShapeDtypeStruct(dims, dt, sharding=sharding)
  n, k = 14336, 4096
  # Scales and minimums as a placed weight holds them on TPU: float16's bits.
  groups = shape((n, k // 32), jnp.int16)

  def product(x, values, scales, minimums):
    return quantized.matmul(x, values, scales, minimums, 4, 32, jnp.bfloat16)

  with kernel_choice.target_platform("tpu"):
    lowered = jax.jit(product).lower(
      shape((8, k), jnp.bfloat16), shape((n, k // 2), jnp.uint8), groups, groups
    )
  assert "quantized_matmul_tpu" in lowered.as_text()
  compiled = lowered.compile()
  assert compiled.out_info.shape == (8, n) and compiled.out_info.dtype == jnp.float32
  assert "bitcast-convert" not in compiled.as_text()  # no copy of the scales
  # XLA's own product holds a bfloat16 copy of the kernel (117 MB); the
  # kernel's temporaries are at most the regrouped float32 scales (2 x 7.3 MB).
  assert compiled.memory_analysis().temp_size_in_bytes <= 2 * n * (k // 32) * 4


@needs_libtpu
def test_a_model_placed_on_tpu_holds_its_scales_as_bits():
  # What `aot` compiles: Llama-3-8B's int4 shapes placed on a v5e chip.
  from paged_jax import aot
  from paged_jax.engine import weights

  model = aot.ShapeOnlyModel.named("llama-3-8b", quantization="int4")
  _, params = model.abstract_params(aot.jax_mesh(aot.topology_devices("v5e:1x1"), (1, 1)))
  dtypes = {
    (path.rsplit("/", 1)[-1], str(leaf.dtype))
    for path, leaf in weights.flat_weights(params).items()
    if "/kernel/" in path
  }
  assert dtypes == {("values", "uint8"), ("scales", "int16"), ("minimums", "int16")}


@needs_libtpu
@pytest.mark.parametrize(
  "split,n,k", [("column", 14336, 4096), pytest.param("row", 4096, 14336, marks=pytest.mark.slow)]
)
def test_split_product_compiles_for_tpu_v5e_on_each_device(split, n, k):
  # Tensor parallel over 4 chips: each runs the kernel on its shard; the
  # quantized values never move (no all-gather of them), a row split sums.
  from paged_jax import aot

  mesh = jax.sharding.Mesh(
    np.array(aot.topology_devices("v5e:2x2")).reshape(1, 4), ("data", "model")
  )
  spec = jax.sharding.PartitionSpec(*(("model", None) if split == "column" else (None, "model")))
  shape = lambda dims, dt, s: jax.ShapeDtypeStruct(
    dims, dt, sharding=jax.sharding.NamedSharding(mesh, s)
  )
  groups = shape((n, k // 32), jnp.float16, spec)

  def product(x, values, scales, minimums):
    return quantized.matmul(
      x, values, scales, minimums, 4, 32, jnp.bfloat16, placement=(mesh, spec)
    )

  with kernel_choice.target_platform("tpu"):
    lowered = jax.jit(product).lower(
      shape((8, k), jnp.bfloat16, jax.sharding.PartitionSpec()),
      shape((n, k // 2), jnp.uint8, spec),
      groups,
      groups,
    )
  text = lowered.compile().as_text()
  assert "quantized_matmul_tpu" in text
  assert not re.search(r"= u8\[[\d,]+\]\S* all-gather", text)
  assert ("all-reduce" in text) == (split == "row")


SHARDED_SCRIPT = """
import itertools, jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from pallas_kernels.quantized_matmul import quantized_matmul_reference, sharded
from tests.test_kernels_quantized_matmul import random_weight
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("model",))  # Auto axes, as the engine's
for bits, group_size, k in ((4, 32, 1024), (8, 64, 512)):
  x = jax.numpy.asarray(np.random.default_rng(7).standard_normal((5, k)), jax.numpy.float32)
  values, scales, mins = random_weight(256, k, bits, group_size, True, seed=8)
  want = quantized_matmul_reference(x, values, scales, mins, bits=bits, group_size=group_size)
  for spec, kernel in itertools.product((P("model", None), P(None, "model")), ("tpu", "gpu")):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    got = sharded.quantized_matmul_sharded(
      x, put(values), put(scales), put(mins), bits=bits, group_size=group_size,
      mesh=mesh, values_spec=spec, kernel=kernel, interpret=True,
    )
    assert np.all(np.isfinite(got)), (bits, spec, kernel)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-3, err_msg=str((bits, spec, kernel)))
print("ok")
"""


@pytest.mark.slow
def test_split_product_on_two_devices_equals_one():
  # 2 CPU devices, the TPU and GPU kernels in interpret mode on each
  # device's shard (column split: its outputs; row split: its inputs,
  # summed). One TPU K step
  # per device: TPU interpret mode under shard_map on several CPU devices
  # hangs on grids of several K steps (seen on JAX 0.10.2), a limit of the
  # interpreter (one device runs such grids, test_kernel_matches_reference).
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
  result = subprocess.run(
    [sys.executable, "-c", SHARDED_SCRIPT],
    cwd=root,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


# Float16 scales stored as their int16 bits (`QuantizedWeight.place`) where
# the TPU kernel serves the weight: Mosaic loads them as they are, and XLA
# writes no copy of a bitcast per call.
@pytest.mark.parametrize(
  "platform,method,n,stored",
  [
    ("tpu", "int4", 256, "int16"),
    ("tpu", "int4", 100, "float16"),  # a shape the kernel does not tile stays on XLA
    ("tpu", "int8", 256, "float32"),  # per channel: XLA, float32 scales
    ("cuda", "int4", 256, "float16"),
    ("cpu", "int4", 256, "float16"),
  ],
)
def test_place_stores_float16_scales_as_bits_where_the_tpu_kernel_serves(
  platform, method, n, stored
):
  rng = np.random.default_rng(11)
  weight = quantized.quantize(rng.standard_normal((n, 256)).astype(np.float32), method)
  before = np.asarray(weight.dequantize())
  x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
  products = [weight.matmul(x[:rows], jnp.float32) for rows in (1, 8) if stored == "int16"]
  with kernel_choice.target_platform(platform):
    weight.place(None, jax.sharding.PartitionSpec(), jnp.bfloat16)
  assert weight.placement is None
  assert weight.scales.dtype == stored
  assert weight.minimums is None or weight.minimums.dtype == stored
  if stored == "int16":  # the XLA paths (this CPU) read the bits as the float16 they hold
    np.testing.assert_array_equal(weight.dequantize(), before)
    for rows, want in zip((1, 8), products, strict=True):
      np.testing.assert_array_equal(weight.matmul(x[:rows], jnp.float32), want)
