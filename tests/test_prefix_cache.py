"""Prefix-cache building blocks: prompt hashing agrees with the rolling hash."""

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.block_manager import prefix_cache as pc


def test_prompt_hashes_match_the_rolling_hash_at_block_ends():
  rng = np.random.default_rng(0)
  block_size, length = 16, 128
  prompt_hashes = jax.jit(pc.prompt_hashes, static_argnums=2)
  for count in (0, 1, 15, 16, 17, 100, 128):
    tokens = jnp.asarray(rng.integers(0, 50_000, length), jnp.int32)
    prefix, rolling = pc.rolling_hashes(jnp.array([[0, 0, 1, 1]], jnp.uint32), tokens[None],
                                        jnp.array([count]))
    ends, prompt_rolling = prompt_hashes(tokens, jnp.int32(count), block_size)
    full = count // block_size
    np.testing.assert_array_equal(np.asarray(ends[:full]),
                                  np.asarray(prefix[0, block_size - 1::block_size][:full]))
    np.testing.assert_array_equal(np.asarray(prompt_rolling), np.asarray(rolling[0]))
