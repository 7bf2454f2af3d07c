"""Bad arguments to the attention entry points give a ValueError that names them."""

import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj
from paged_jax import kernel_choice

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def cache():
  cfg = pj.CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks=4, num_cpu_blocks=0)
  cache = pj.KVCache.create(cfg, num_layers=2, num_kv_heads=2, head_dim=8, dtype=jnp.float32)
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.standard_normal(cache.k[0].shape), jnp.float32)
  return cache.replace(k=(k, k), v=(k, k))


def _query(batch=1, num_queries=None):
  shape = (batch, 4, 8) if num_queries is None else (batch, num_queries, 4, 8)
  return jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("length", [17, 40])
def test_a_length_past_the_blocks_held_is_refused(cache, length):
  tables = jnp.array([[2, -1, -1]], jnp.int32)
  message = (
    rf"sequence 0: length {length} runs past the blocks it holds: .*"
    rf"block_tables\[0, {(length - 1) // BLOCK_SIZE}\], which is -1; "
    r"the row holds blocks \[2\]"
  )
  with pytest.raises(ValueError, match=message):
    pj.paged_attention(_query(), cache.k[0], cache.v[0], tables, jnp.array([length], jnp.int32))
  with pytest.raises(ValueError, match=message):
    pj.paged_prefill_attention(
      _query(num_queries=2),
      cache.k[0],
      cache.v[0],
      tables,
      jnp.array([length], jnp.int32),
      jnp.array([2], jnp.int32),
    )


def test_a_length_inside_the_blocks_held_is_served(cache):
  tables = jnp.array([[2, -1, -1]], jnp.int32)
  out = pj.paged_attention(_query(), cache.k[0], cache.v[0], tables, jnp.array([16], jnp.int32))
  assert out.shape == (1, 4, 8) and bool(jnp.all(jnp.isfinite(out)))


def test_lengths_as_a_python_list_is_refused(cache):
  with pytest.raises(
    ValueError,
    match=r"lengths must be an array int32\[batch\], "
    r"got a list; convert it with jnp.asarray",
  ):
    pj.paged_attention(_query(), cache.k[0], cache.v[0], jnp.array([[2, -1, -1]], jnp.int32), [3])


def test_the_tuple_of_layers_instead_of_one_layer_is_refused(cache):
  with pytest.raises(
    ValueError,
    match=r"k_pages must be an array \[num_kv_heads, "
    r"num_blocks, block_size, head_dim\], got a tuple of 2 arrays; "
    r"pass one layer's pages, e.g. cache.k\[layer\]",
  ):
    pj.paged_attention(
      _query(), cache.k, cache.v[0], jnp.array([[2, -1, -1]], jnp.int32), jnp.array([3], jnp.int32)
    )


def test_a_block_size_no_gpu_kernel_serves_is_refused_with_the_sizes():
  kernel_choice.check_block_size(12, "cpu")  # the XLA reference serves any
  kernel_choice.check_block_size(12, "tpu")
  kernel_choice.check_block_size(64, "gpu")
  with pytest.raises(
    ValueError,
    match=r"block_size 12 is served by no "
    r"paged-attention kernel on gpu \(triton: powers of two; "
    r"mosaic_gpu: 16, 32, 64, 128\)",
  ):
    kernel_choice.check_block_size(12, "gpu")
