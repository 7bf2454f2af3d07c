"""Prefix-cache building blocks: prompt hashing, pools without blocks."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj
from paged_jax.block_manager import prefix_cache as pc


def test_prompt_hashes_match_the_rolling_hash_at_block_ends():
  rng = np.random.default_rng(0)
  block_size, length = 16, 128
  prompt_hashes = jax.jit(pc.prompt_hashes, static_argnums=2)
  for count in (0, 1, 15, 16, 17, 100, 128):
    tokens = jnp.asarray(rng.integers(0, 50_000, length), jnp.int32)
    prefix, rolling = pc.rolling_hashes(
      jnp.array([[0, 0, 1, 1]], jnp.uint32), tokens[None], jnp.array([count])
    )
    ends, prompt_rolling = prompt_hashes(tokens, jnp.int32(count), block_size)
    chex.assert_shape([ends, prompt_rolling], [(length // block_size, 2), (4,)])
    chex.assert_type([ends, prompt_rolling], jnp.uint32)
    full = count // block_size
    np.testing.assert_array_equal(
      np.asarray(ends[:full]), np.asarray(prefix[0, block_size - 1 :: block_size][:full])
    )
    np.testing.assert_array_equal(np.asarray(prompt_rolling), np.asarray(rolling[0]))


def _cached_manager(num_gpu_blocks: int, num_cpu_blocks: int):
  cfg = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=num_gpu_blocks,
    num_cpu_blocks=num_cpu_blocks,
    max_seqs=2,
    max_blocks_per_seq=4,
    enable_prefix_caching=True,
  )
  bm = pj.BlockSpaceManager(cfg)
  return bm, bm.init()


def test_caching_without_swap_space():
  """An empty CPU pool has no content index; caching and swap failures still work."""
  bm, state = _cached_manager(num_gpu_blocks=8, num_cpu_blocks=0)
  assert state.cpu.content is None and state.gpu.content is not None
  tokens = jnp.arange(1, 9, dtype=jnp.int32)
  allocate = jax.jit(bm.allocate)
  state, res = allocate(state, jnp.array([0]), tokens, 8)
  assert res.status == pj.Status.OK and res.num_hit_blocks == 0
  state = jax.jit(bm.access_all_blocks_in_seq)(state, 0, 5)
  after, plan = jax.jit(bm.swap_out)(state, jnp.array([0]))
  assert plan.status == pj.Status.SWAP_SPACE_EXHAUSTED
  chex.assert_trees_all_equal(after, state)
  state, _ = jax.jit(bm.free)(state, jnp.array([0]))
  state, res = allocate(state, jnp.array([1]), tokens, 8)
  assert res.status == pj.Status.OK and res.num_hit_blocks == 2
  _, res = allocate(state, jnp.array([1]), tokens, 8)  # a failed call counts no hit
  assert res.status == pj.Status.ALREADY_ALLOCATED and res.num_hit_blocks == 0
  assert float(bm.prefix_cache_hit_rate(state)) == 0.5  # the second prompt hit both blocks
  pj.check_invariants(state)


def test_a_cache_without_gpu_blocks_is_refused():
  with pytest.raises(ValueError, match="num_gpu_blocks must be >= 1, got 0"):
    pj.CacheConfig(num_gpu_blocks=0)
  assert pj.CacheConfig(num_gpu_blocks=1, num_cpu_blocks=0).num_cpu_blocks == 0
