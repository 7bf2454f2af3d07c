"""How a call's effects reach a pool: takes, new references, releases and content, if ok."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.block_manager import prefix_cache
from paged_jax.block_manager.pool import Takes, commit_pool, no_takes, push_orphans, take
from paged_jax.block_manager.state import BlockManagerState, Pool


def pool_of(state: BlockManagerState, on_gpu: bool) -> Pool:
  """The GPU pool or the CPU pool (`on_gpu` is static)."""
  return state.gpu if on_gpu else state.cpu


def with_pool(state: BlockManagerState, on_gpu: bool, pool: Pool) -> BlockManagerState:
  """`state` with its GPU pool (or its CPU pool) replaced by `pool`."""
  return state.replace(gpu=pool) if on_gpu else state.replace(cpu=pool)


def lost_by_takes(state: BlockManagerState, pool: Pool, takes: Takes) -> jax.Array | None:
  """Under the window rules, the blocks whose content a call's takes from `pool` evict
  (`prefix_cache.lost_content`); None otherwise (static)."""
  if not state.window_rules or pool.content is None:
    return None
  return prefix_cache.lost_content(pool, takes)


def keeps_content(pool: Pool, blocks: jax.Array, lost: jax.Array) -> jax.Array:
  """bool[...]: `blocks` (-1: none) had content at the start of a call and keep it (not `lost`)."""
  return (blocks >= 0) & take(pool.content.has_content, blocks, False) & ~take(lost, blocks, True)


def revived_hits(pool: Pool, pins: jax.Array, distinct: bool = False) -> jax.Array:
  """Distinct unreferenced blocks with content that `pins` revive (int32 scalar).

  Args:
    pool: the pool at the start of the call.
    pins: int32[...] blocks the call's hits reference (-1 skipped).
    distinct: whether the entries of `pins` are known to be distinct.
  """
  if pool.content is None:
    return jnp.int32(0)
  pins = pins.ravel()
  counted = pins >= 0
  if not distinct:
    keys = jnp.stack([pins.astype(jnp.uint32), jnp.zeros_like(pins, jnp.uint32)], axis=1)
    first = prefix_cache.first_equal(keys, lambda i, j: pins[i] == pins[j], counted)
    counted &= first == jnp.arange(pins.shape[0])
  return jnp.sum(
    counted & take(pool.content.has_content, pins) & (take(pool.ref_count, pins) == 0)
  ).astype(jnp.int32)


def commit(
  state: BlockManagerState,
  on_gpu: bool,
  ok: jax.Array,
  *,
  gains: jax.Array,
  releases: jax.Array,
  takes: Takes | None = None,
  registrations: prefix_cache.Registrations | None = None,
  gain_weight=1,
  may_release: jax.Array | None = None,
  lost: jax.Array | None = None,
) -> BlockManagerState:
  """Applies a call's effects on one pool, if `ok`: takes, new references, releases, content.

  Args:
    state: the state at the start of the call.
    on_gpu: which pool (static).
    ok: whether the call succeeds (bool scalar).
    gains: int32[G] blocks gaining `gain_weight` references each (-1 skipped).
    releases: int32[E] release events in order (-1 skipped).
    takes: the call's takes from this pool (default: none).
    registrations: identities of blocks that became full (cached pools; default: none).
    gain_weight: references per entry of `gains`.
    may_release: False only if `releases` is known to be all -1 (see `commit_pool`).
    lost: bool[N] blocks whose content the call's evictions take, under the
      window rules (`prefix_cache.lost_content`); None: only evicted ones.

  Returns:
    The state with that pool updated (unchanged if not `ok`).
  """
  pool = pool_of(state, on_gpu)
  takes = no_takes() if takes is None else takes
  new_pool, pushed = commit_pool(
    pool,
    ok,
    num_takes=takes.count,
    gains=gains,
    releases=releases,
    gain_weight=gain_weight,
    may_release=may_release,
    lost=lost,
  )
  num_orphans = 0
  if lost is not None:
    new_pool, num_orphans = push_orphans(pool, new_pool, lost, ok)
  if pool.content is not None:
    if registrations is None:
      registrations = prefix_cache.Registrations.none(state.cfg.block_size)
    new_pool = prefix_cache.commit_content(
      new_pool,
      ok,
      takes=takes,
      releases=releases,
      pushed=pushed,
      registrations=registrations,
      lost=lost,
      num_orphans=num_orphans,
    )
  return with_pool(state, on_gpu, new_pool)
