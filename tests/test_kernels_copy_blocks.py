"""copy_blocks kernels (GPU and TPU flavours: interpret mode, or compiled on
their backend) and reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import copy_blocks as copy_blocks_lib
from tests.abstract_gpu import lower_for
from tests.kernel_modes import interpret

# (num_caches, num_kv_heads, head_dim, block_size, num_blocks, capacity,
#  count, dtype): capacities with unused -1 tails, a count of 0, every
# block size 8/16/32, head_dim 64/128, both float dtypes and the quantized
# page dtypes (int8, float8_e4m3fn).
CASES = [
  (4, 2, 64, 8, 12, 5, 3, "float32"),
  (2, 8, 128, 16, 8, 3, 3, "bfloat16"),
  (6, 1, 64, 32, 6, 2, 1, "float32"),
  (2, 4, 128, 8, 4, 2, 0, "bfloat16"),
  (2, 2, 64, 16, 6, 3, 2, "int8"),
  (2, 1, 128, 8, 6, 2, 2, "float8_e4m3fn"),
]
copy_blocks_reference = jax.jit(copy_blocks_lib.copy_blocks_reference)
KERNELS = {
  backend: jax.jit(
    functools.partial(copy_blocks_lib.copy_blocks, backend=backend, interpret=interpret(backend))
  )
  for backend in ("gpu", "tpu")
}


def make_inputs(case, seed=0):
  """Random caches and a plan: disjoint sources and destinations, -1 tail."""
  (num_caches, num_kv_heads, head_dim, block_size, num_blocks, capacity, count, dtype) = case
  rng = np.random.default_rng(seed)
  shape = (num_kv_heads, num_blocks, block_size, head_dim)
  caches = [random_pages(rng, shape, dtype) for _ in range(num_caches)]
  blocks = rng.permutation(num_blocks)
  src = np.full(capacity, -1, np.int32)
  dst = np.full(capacity, -1, np.int32)
  src[:count], dst[:count] = blocks[:count], blocks[count : 2 * count]
  if count < capacity:
    # A stale pair past count must be ignored.
    src[count], dst[count] = blocks[2 * count], blocks[2 * count + 1]
  return caches, src, dst, np.int32(count)


def random_pages(rng, shape, dtype):
  """Random pages; int8 pages spread over most of their range."""
  dtype = jnp.dtype(dtype)
  scale = 40.0 if jnp.issubdtype(dtype, jnp.integer) else 1.0
  return (rng.standard_normal(shape) * scale).astype(dtype)


def expected_caches(caches, src, dst, count):
  out = [cache.copy() for cache in caches]
  for cache in out:
    for source, target in zip(src[:count], dst[:count]):
      cache[:, target] = cache[:, source]
  return out


def assert_caches_equal(got, want):
  assert len(got) == len(want)
  for cache_got, cache_want in zip(got, want):
    np.testing.assert_array_equal(np.asarray(cache_got), cache_want)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_numpy(case):
  caches, src, dst, count = make_inputs(case)
  got = copy_blocks_reference(caches, src, dst, count)
  assert_caches_equal(got, expected_caches(caches, src, dst, count))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_numpy(case, backend):
  caches, src, dst, count = make_inputs(case, seed=1)
  got = KERNELS[backend](caches, src, dst, count)
  assert_caches_equal(got, expected_caches(caches, src, dst, count))


@pytest.mark.parametrize("backend", ["gpu", "tpu", "reference"])
def test_kernel_copies_in_place_when_donated(backend):
  # The reference too, whose plan with no live pair skips the copies (a
  # cond whose other branch passes the caches through, copying nothing).
  caches, src, dst, count = make_inputs(CASES[0])
  kernel = copy_blocks_lib.copy_blocks_reference
  if backend != "reference":
    kernel = functools.partial(
      copy_blocks_lib.copy_blocks, backend=backend, interpret=interpret(backend)
    )
  copy = jax.jit(kernel, donate_argnums=0)
  compiled = copy.lower(caches, src, dst, count).compile()
  assert compiled.memory_analysis().alias_size_in_bytes == sum(cache.nbytes for cache in caches)
  if backend == "reference":  # temporaries: the gathered blocks, no cache's copy
    gathered = src.size * caches[0][:, 0].nbytes * len(caches)
    assert compiled.memory_analysis().temp_size_in_bytes < gathered + caches[0].nbytes


@pytest.mark.parametrize("backend,platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_kernel_lowers_for_its_platform(backend, platform):
  shape = jax.ShapeDtypeStruct
  caches = [shape((8, 64, 16, 128), jnp.bfloat16)] * 4
  plan = shape((6,), jnp.int32)
  copy = jax.jit(functools.partial(copy_blocks_lib.copy_blocks, backend=backend), donate_argnums=0)
  lowered = lower_for(platform, copy, caches, plan, plan, shape((), jnp.int32))
  assert f"copy_blocks_{backend}" in lowered.as_text()


def good_args():
  return dict(
    caches=[jnp.ones((2, 4, 8, 64))] * 2,
    src=jnp.zeros((3,), jnp.int32),
    dst=jnp.ones((3,), jnp.int32),
    count=jnp.int32(1),
  )


BAD_ARGS = {
  "no caches": (dict(caches=[]), "at least one cache"),
  "cache rank": (dict(caches=[jnp.ones((4, 8, 64))]), "caches must be"),
  "mismatch": (dict(caches=[jnp.ones((2, 4, 8, 64)), jnp.ones((2, 5, 8, 64))]), "cache 1 is"),
  "src dtype": (dict(src=jnp.zeros((3,))), "src must be int32"),
  "dst rank": (dict(dst=jnp.zeros((3, 1), jnp.int32)), "dst must be int32"),
  "lengths": (dict(dst=jnp.zeros((4,), jnp.int32)), "differ in length"),
  "count": (dict(count=jnp.zeros((2,), jnp.int32)), "count must be"),
}


@pytest.mark.parametrize("impl", ["reference", "gpu", "tpu"])
@pytest.mark.parametrize("bad", BAD_ARGS, ids=str)
def test_bad_arguments_raise_value_error(impl, bad):
  overrides, message = BAD_ARGS[bad]
  args = {**good_args(), **overrides}
  with pytest.raises(ValueError, match=message):
    if impl == "reference":
      copy_blocks_lib.copy_blocks_reference(**args)
    else:
      copy_blocks_lib.copy_blocks(**args, backend=impl, interpret=True)


def test_unknown_backend_and_untileable_block_raise():
  with pytest.raises(ValueError, match="backend must be"):
    copy_blocks_lib.copy_blocks(**good_args(), backend="mps")
  args = {**good_args(), "caches": [jnp.ones((2, 4, 6, 64))]}
  with pytest.raises(ValueError, match="block_size must be a power of two"):
    copy_blocks_lib.copy_blocks(**args, backend="gpu", interpret=True)
