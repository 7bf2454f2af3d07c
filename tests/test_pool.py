"""The pool layer: DOUBLE_FREE when a block is released more often than it is held."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

import paged_jax as pj
from paged_jax.block_manager.pool import count_true, release, running_count, running_count_and_total
from paged_jax.block_manager.state import init_pool


def _held_pool(caching):
  """A GPU pool after one allocation of 6 tokens (block size 4) for a group of two."""
  cfg = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=6,
    num_cpu_blocks=0,
    max_seqs=4,
    max_blocks_per_seq=4,
    enable_prefix_caching=caching,
  )
  bm = pj.BlockSpaceManager(cfg)
  state, res = jax.jit(bm.allocate)(bm.init(), jnp.array([0, 1]), jnp.arange(6, dtype=jnp.int32), 6)
  assert int(res.status) == pj.Status.OK
  return state.gpu, np.asarray(state.tables[0])[:2]


_release = jax.jit(release)


def test_release_of_an_unreferenced_block_is_double_free():
  pool = init_pool(4, pj.CacheConfig(block_size=4, num_gpu_blocks=4))
  new, status = _release(pool, jnp.array([2]))
  assert pj.Status(int(status)) == pj.Status.DOUBLE_FREE
  chex.assert_trees_all_equal(new, pool)


def test_releasing_more_than_held_is_double_free_and_changes_nothing():
  for caching in (False, True):
    pool, blocks = _held_pool(caching)
    # Each block is held twice: three releases of one block is one too many.
    events = jnp.array([blocks[0], blocks[1], blocks[0], blocks[0]], jnp.int32)
    new, status = _release(pool, events)
    assert pj.Status(int(status)) == pj.Status.DOUBLE_FREE
    chex.assert_trees_all_equal(new, pool)


def test_releasing_every_reference_frees_the_blocks():
  pool, blocks = _held_pool(False)
  before = int(pool.num_free())
  new, status = _release(pool, jnp.array([blocks[1], blocks[0], blocks[1], blocks[0]], jnp.int32))
  assert pj.Status(int(status)) == pj.Status.OK
  assert int(new.num_free()) == before + 2
  # Pushed in the order their last reference went: blocks[1] then blocks[0] (top of the stack).
  top = np.asarray(new.free_stack)[int(new.num_stacked) - 2 : int(new.num_stacked)]
  assert top.tolist() == [int(blocks[1]), int(blocks[0])]


def test_running_count_and_count_true_are_cumsum_and_sum_at_every_size():
  rng = np.random.default_rng(0)
  sizes = (0, 1, 31, 32, 33, 256, 257, 1000, 1024, 1025, 8192, 8224, 70_000)
  # One compiled function for every size (a compile per size costs more than the runs).
  counts = jax.jit(
    lambda masks: [(running_count(m), running_count_and_total(m), count_true(m)) for m in masks]
  )
  for density in (0.0, 0.4, 1.0):
    masks = [jnp.asarray(rng.random(n) < density) for n in sizes]
    for n, mask, (got, (running, total), count) in zip(sizes, masks, counts(masks)):
      got = np.asarray(got)
      assert got.dtype == np.int32
      np.testing.assert_array_equal(got, np.cumsum(mask), err_msg=f"n={n} density {density}")
      np.testing.assert_array_equal(running, got)
      assert total.dtype == np.int32 and int(total) == int(np.sum(mask))
      assert int(count) == int(np.sum(mask))


def test_eviction_order_is_the_lru_order_of_a_full_sort():
  from paged_jax.block_manager.pool import _eviction_order

  rng = np.random.default_rng(1)
  cfg = pj.CacheConfig(block_size=4, num_gpu_blocks=300, enable_prefix_caching=True)
  n = cfg.num_gpu_blocks
  order = jax.jit(_eviction_order, static_argnums=2)
  for trial in range(6):
    pool = init_pool(n, cfg)
    la_choices = np.array([-1, 0, 3, 7, 2**31 - 2, -(2**31) + 1]) if trial % 2 else np.arange(-1, 4)
    content = pool.content.replace(
      has_content=jnp.asarray(rng.random(n) < 0.8),
      last_accessed=jnp.asarray(rng.choice(la_choices, n), jnp.int32),
      num_hashed_tokens=jnp.asarray(4 * rng.integers(1, 4, n), jnp.int32),
      release_time=jnp.asarray(rng.permutation(n), jnp.int32),
    )
    pool = pool.replace(
      ref_count=jnp.asarray(rng.integers(0, 3, n) * (rng.random(n) < 0.3), jnp.int32),
      content=content,
    )
    pinned = jnp.asarray(rng.choice(np.arange(-1, n), 20), jnp.int32)
    evictable = (
      np.asarray(content.has_content)
      & (np.asarray(pool.ref_count) == 0)
      & ~np.isin(np.arange(n), np.asarray(pinned))
    )
    blocks = np.flatnonzero(evictable)
    ranked = blocks[
      np.lexsort(
        (
          np.asarray(content.release_time)[blocks],
          -np.asarray(content.num_hashed_tokens)[blocks],
          np.asarray(content.last_accessed)[blocks],
        )
      )
    ]
    for capacity in (1, 7, 64, n + 5):
      expected = np.full(capacity, -1)
      expected[: min(capacity, len(ranked))] = ranked[:capacity]
      np.testing.assert_array_equal(
        np.asarray(order(pool, pinned, capacity)),
        expected,
        err_msg=f"trial {trial} capacity {capacity}",
      )
