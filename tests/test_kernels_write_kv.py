"""write_kv kernels (GPU and TPU flavours: interpret mode, or compiled on their
backend) and reference."""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import write_kv as write_kv_lib
from tests.abstract_gpu import lower_for
from tests.kernel_modes import interpret

needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed"
)

# (num_kv_heads, head_dim, block_size, num_blocks, tokens, dtype): every value
# of Hkv in {1, 2, 4, 8}, head_dim 64/128, block 8/16/32, both float dtypes
# and the quantized page dtypes (int8, float8_e4m3fn).
CASES = [
  (1, 64, 8, 6, 5, "float32"),
  (2, 128, 16, 4, 9, "bfloat16"),
  (4, 64, 32, 3, 7, "float32"),
  (8, 128, 8, 5, 4, "bfloat16"),
  (2, 64, 16, 4, 6, "int8"),
  (1, 128, 8, 3, 5, "float8_e4m3fn"),
]
write_kv_reference = jax.jit(write_kv_lib.write_kv_reference)
KERNELS = {
  backend: jax.jit(
    functools.partial(write_kv_lib.write_kv, backend=backend, interpret=interpret(backend))
  )
  for backend in ("gpu", "tpu")
}


def make_inputs(case, seed=0):
  """Random caches and tokens; distinct slots, the first token skipped (-1)."""
  num_kv_heads, head_dim, block_size, num_blocks, tokens, dtype = case
  rng = np.random.default_rng(seed)
  dtype = jnp.dtype(dtype)
  cache_shape = (num_kv_heads, num_blocks, block_size, head_dim)
  scale = 40.0 if jnp.issubdtype(dtype, jnp.integer) else 1.0  # int8 range
  caches = [(rng.standard_normal(cache_shape) * scale).astype(dtype) for _ in range(2)]
  new = [
    (rng.standard_normal((tokens, num_kv_heads, head_dim)) * scale).astype(dtype) for _ in range(2)
  ]
  slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
  slots[0] = -1
  return caches, new, slots


def expected_caches(caches, new, slots):
  """The NumPy model: row t of every head lands in slot slots[t]."""
  block_size = caches[0].shape[2]
  out = [cache.copy() for cache in caches]
  for cache, rows in zip(out, new):
    for token, slot in enumerate(slots):
      if slot >= 0:
        cache[:, slot // block_size, slot % block_size] = rows[token]
  return out


def assert_caches_equal(got, want):
  for cache_got, cache_want in zip(got, want):
    np.testing.assert_array_equal(np.asarray(cache_got), cache_want)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_numpy(case):
  caches, new, slots = make_inputs(case)
  got = write_kv_reference(*caches, *new, slots)
  assert_caches_equal(got, expected_caches(caches, new, slots))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_numpy(case, backend):
  caches, new, slots = make_inputs(case, seed=1)
  got = KERNELS[backend](*caches, *new, slots)
  assert_caches_equal(got, expected_caches(caches, new, slots))


# Slots that keep the TPU kernel's narrow-page path on one block for several
# tokens, leave it, skip tokens and come back (blocks of 8).
GROUPED_SLOTS = [8, 9, 10, -1, 11, 20, 21, 12, 3, -1, 13, 0, 23, 22]


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "float8_e4m3fn"])
def test_tpu_kernel_groups_the_tokens_of_a_block(dtype):
  caches, new, _ = make_inputs((2, 128, 8, 4, len(GROUPED_SLOTS), dtype), seed=2)
  slots = np.asarray(GROUPED_SLOTS, np.int32)
  got = KERNELS["tpu"](*caches, *new, slots)
  assert_caches_equal(got, expected_caches(caches, new, slots))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_kernel_writes_in_place_when_donated(backend):
  caches, new, slots = make_inputs(CASES[0])
  write = jax.jit(
    functools.partial(write_kv_lib.write_kv, backend=backend, interpret=interpret(backend)),
    donate_argnums=(0, 1),
  )
  memory = write.lower(*caches, *new, slots).compile().memory_analysis()
  cache_bytes = sum(cache.nbytes for cache in caches)
  assert memory.alias_size_in_bytes == cache_bytes


@pytest.mark.parametrize("backend,platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_kernel_lowers_for_its_platform(backend, platform):
  shape = jax.ShapeDtypeStruct
  cache = shape((8, 64, 16, 128), jnp.bfloat16)
  rows = shape((5, 8, 128), jnp.bfloat16)
  write = jax.jit(functools.partial(write_kv_lib.write_kv, backend=backend), donate_argnums=(0, 1))
  lowered = lower_for(platform, write, cache, cache, rows, rows, shape((5,), jnp.int32))
  assert f"write_kv_{backend}" in lowered.as_text()


@needs_libtpu
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "float8_e4m3fn"])
def test_tpu_kernel_compiles_for_tpu_in_place(dtype):
  """libtpu compiles the kernel for v5e (compile only) for 16- and 8-bit
  pages, where Mosaic refused a one-row DMA (32-bit pages: the tiny engine's
  TPU compile)."""
  from jax.sharding import NamedSharding, PartitionSpec

  from paged_jax import aot

  mesh = aot.jax_mesh(aot.topology_devices("v5e:1x1"), (1, 1))
  shape = functools.partial(jax.ShapeDtypeStruct, sharding=NamedSharding(mesh, PartitionSpec()))
  cache, rows = shape((2, 8, 16, 128), dtype), shape((5, 2, 128), dtype)
  write = jax.jit(functools.partial(write_kv_lib.write_kv, backend="tpu"), donate_argnums=(0, 1))
  compiled = write.lower(cache, cache, rows, rows, shape((5,), jnp.int32)).compile()
  assert "write_kv_tpu" in compiled.as_text()
  itemsize = jnp.dtype(dtype).itemsize
  assert compiled.memory_analysis().alias_size_in_bytes == 2 * 2 * 8 * 16 * 128 * itemsize


def good_args():
  cache = jnp.ones((2, 4, 8, 64))
  rows = jnp.ones((3, 2, 64))
  return dict(k_cache=cache, v_cache=cache, k=rows, v=rows, slot_mapping=jnp.zeros((3,), jnp.int32))


BAD_ARGS = {
  "cache rank": (
    dict(k_cache=jnp.ones((4, 8, 64)), v_cache=jnp.ones((4, 8, 64))),
    "k_cache must be",
  ),
  "v_cache": (dict(v_cache=jnp.ones((2, 5, 8, 64))), "v_cache"),
  "k heads": (dict(k=jnp.ones((3, 4, 64)), v=jnp.ones((3, 4, 64))), "num_kv_heads=2"),
  "k rank": (dict(k=jnp.ones((3, 128)), v=jnp.ones((3, 128))), "k must be"),
  "v shape": (dict(v=jnp.ones((4, 2, 64))), "v shape"),
  "dtype": (
    dict(k=jnp.ones((3, 2, 64), jnp.bfloat16), v=jnp.ones((3, 2, 64), jnp.bfloat16)),
    "one dtype",
  ),
  "slots length": (dict(slot_mapping=jnp.zeros((4,), jnp.int32)), "slot_mapping must be int32"),
  "slots dtype": (dict(slot_mapping=jnp.zeros((3,))), "slot_mapping must be int32"),
}


@pytest.mark.parametrize("impl", ["reference", "gpu", "tpu"])
@pytest.mark.parametrize("bad", BAD_ARGS, ids=str)
def test_bad_arguments_raise_value_error(impl, bad):
  overrides, message = BAD_ARGS[bad]
  args = {**good_args(), **overrides}
  with pytest.raises(ValueError, match=message):
    if impl == "reference":
      write_kv_lib.write_kv_reference(**args)
    else:
      write_kv_lib.write_kv(**args, backend=impl, interpret=True)


def test_unknown_backend_and_untileable_head_dim_raise():
  with pytest.raises(ValueError, match="backend must be"):
    write_kv_lib.write_kv(**good_args(), backend="mps")
  cache, rows = jnp.ones((2, 4, 8, 80)), jnp.ones((3, 2, 80))
  with pytest.raises(ValueError, match="head_dim must be a power of two"):
    write_kv_lib.write_kv(
      cache, cache, rows, rows, jnp.zeros((3,), jnp.int32), backend="gpu", interpret=True
    )
