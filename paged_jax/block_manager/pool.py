"""Vectorized take and release on a pool (uncached LIFO stack, or cached pool + evictor).

Both work on a whole call at once: takes are ranked 0, 1, 2, ... in the order
the call needs them, releases are a list of events in the order the call drops
them. Writes are masked by ``ok`` so that a failed call changes nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from paged_jax.block_manager.state import NO_BLOCK, Pool
from paged_jax.config import Status

_INT_MAX = jnp.iinfo(jnp.int32).max


def masked(index: jax.Array, keep: jax.Array, size: int) -> jax.Array:
  """`index` where `keep`, else `size` (out of bounds, so a 'drop' scatter skips it)."""
  return jnp.where(keep, index, size)


def take(array: jax.Array, index: jax.Array, fill=0) -> jax.Array:
  """array[index] with indices clipped into range; `fill` when the array is empty."""
  if array.shape[0] == 0:
    return jnp.full(index.shape + array.shape[1:], fill, array.dtype)
  return array[jnp.clip(index, 0, array.shape[0] - 1)]


def scatter_count(blocks: jax.Array, size: int, weights=None) -> jax.Array:
  """int32[size]: how often each block appears in `blocks` (entries < 0 skipped)."""
  weights = jnp.ones(blocks.shape, jnp.int32) if weights is None else weights
  idx = masked(blocks, blocks >= 0, size)
  return jnp.zeros(size, jnp.int32).at[idx.ravel()].add(weights.ravel(), mode="drop")


def running_count(flags: jax.Array) -> jax.Array:
  """``jnp.cumsum(flags)`` (int32) of a 1-D bool array."""
  return running_count_and_total(flags)[0]


def running_count_and_total(flags: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(``jnp.cumsum(flags)``, ``jnp.sum(flags)``), int32, of a 1-D bool array.

  XLA:CPU lowers cumsum to reduce-windows that cost several ns per entry, a
  large part of a decode step at batch 1024. Instead the flags are packed 32
  to a word: an entry's count is the popcount of its word up to itself plus
  the running total of the words before (1.1 us instead of 3.5 us for
  XLA:CPU's cumsum at 1024 entries, benchmarks/RESULTS.md).
  """
  n = flags.shape[0]
  packed = _packed(flags)
  words = packed.shape[0]
  counts = lax.population_count(packed).astype(jnp.int32)
  before = (
    jnp.cumsum(counts)
    if words <= 256
    else _running_sum(counts.astype(jnp.float32)).astype(jnp.int32)
  ) - counts
  i = jnp.arange(n, dtype=jnp.int32)
  bit = (i & 31).astype(jnp.uint32)
  up_to_i = packed[i >> 5] & ((jnp.uint32(2) << bit) - 1)  # 2 << 31 wraps to 0: all bits
  running = before[i >> 5] + lax.population_count(up_to_i).astype(jnp.int32)
  return running, jnp.sum(counts, dtype=jnp.int32)


def count_true(flags: jax.Array) -> jax.Array:
  """``jnp.sum(flags)`` (int32) of a 1-D bool array, as popcounts of packed bits.

  One fused pass: XLA:CPU's plain sum of a long mask first writes it out as
  int32, about 3x slower on a pool-sized mask.
  """
  return jnp.sum(lax.population_count(_packed(flags)).astype(jnp.int32), dtype=jnp.int32)


def _packed(flags: jax.Array) -> jax.Array:
  """uint32[ceil(n / 32)]: flags packed 32 to a word, entry i at bit i % 32 of word i // 32."""
  n = flags.shape[0]
  words = -(-n // 32)
  bits = jnp.pad(flags, (0, words * 32 - n)).reshape(words, 32).astype(jnp.uint32)
  return lax.reduce(bits << jnp.arange(32, dtype=jnp.uint32), jnp.uint32(0), lax.bitwise_or, (1,))


def _running_sum(x: jax.Array, width: int = 32) -> jax.Array:
  """Cumsum of a long f32 array by triangular matmuls over blocks of `width` (exact below 2**24)."""
  n = x.shape[0]
  if n <= width:
    return jnp.dot(x, jnp.triu(jnp.ones((n, n), x.dtype)), precision=lax.Precision.HIGHEST)
  rows = -(-n // width)
  blocks = jnp.pad(x, (0, rows * width - n)).reshape(rows, width)
  upper = jnp.triu(jnp.ones((width, width), x.dtype))
  within = jnp.dot(blocks, upper, precision=lax.Precision.HIGHEST)
  totals = within[:, -1]
  return (within + (_running_sum(totals) - totals)[:, None]).reshape(-1)[:n]


def taken_blocks(
  pool: Pool, num_takes: jax.Array, capacity: int, pinned: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """The blocks that takes number 0 .. capacity-1 would get, in take order.

  Never-used blocks first, then the free stack from its top, then eviction of
  unreferenced blocks with content (smallest last_accessed, then most hashed
  tokens, then released earliest), never evicting a block in `pinned`.

  Args:
    pool: the pool at the start of the call.
    num_takes: how many takes the call makes (int32 scalar).
    capacity: static upper bound of num_takes.
    pinned: int32[...] blocks this call references before taking (-1 skipped).

  Returns:
    (blocks int32[capacity], evicted bool[capacity]) for each take rank; only
    the first `num_takes` entries are meaningful.
  """
  rank = jnp.arange(capacity, dtype=jnp.int32)
  num_fresh = pool.num_blocks - pool.next_fresh
  stack_pos = pool.num_stacked - 1 - (rank - num_fresh)
  from_stack = take(pool.free_stack, stack_pos, NO_BLOCK)
  blocks = jnp.where(rank < num_fresh, pool.next_fresh + rank, from_stack)
  evicted = rank >= num_fresh + pool.num_stacked
  if pool.content is None or capacity == 0:
    return blocks, evicted
  num_evictions = num_takes - num_fresh - pool.num_stacked
  victims = lax.cond(
    num_evictions > 0,
    lambda: _eviction_order(pool, pinned, capacity),
    lambda: jnp.full(capacity, NO_BLOCK, jnp.int32),
  )
  evict_rank = jnp.clip(rank - num_fresh - pool.num_stacked, 0, capacity - 1)
  return jnp.where(evicted, victims[evict_rank], blocks), evicted


def _eviction_order(pool: Pool, pinned: jax.Array, capacity: int) -> jax.Array:
  """The first `capacity` blocks in LRU eviction order (-1 past the evictable ones).

  The order is by (last_accessed, -num_hashed_tokens, release_time); release
  times are distinct among evictable blocks, so it is total. Rather than sort
  the pool, the `capacity` smallest keys are selected by a binary search over
  counts on each key in turn (a few dozen passes over the pool), and only
  they are sorted.
  """
  content = pool.content
  num_blocks = pool.num_blocks
  evictable = content.has_content & (pool.ref_count == 0) & ~(scatter_count(pinned, num_blocks) > 0)
  keys = (content.last_accessed, -content.num_hashed_tokens, content.release_time)
  need = jnp.minimum(count_true(evictable), capacity)
  chosen = jnp.zeros(num_blocks, bool)  # blocks before the threshold key
  tied = evictable  # blocks equal to it on the keys so far
  for key in keys:
    threshold = _smallest_reaching(key, tied, need)
    before = tied & (key < threshold)
    chosen |= before
    need = need - count_true(before)
    tied &= key == threshold
  chosen |= tied & (need > 0)  # the one block at the threshold itself
  slot = masked(running_count(chosen) - 1, chosen, capacity)
  victims = (
    jnp.full(capacity, num_blocks, jnp.int32)
    .at[slot]
    .set(jnp.arange(num_blocks, dtype=jnp.int32), mode="drop")
  )
  big = jnp.int32(_INT_MAX)
  valid = victims < num_blocks
  candidates = tuple(jnp.where(valid, take(key, victims), big) for key in keys)
  *_, order = lax.sort(candidates + (jnp.where(valid, victims, big),), num_keys=3)
  return jnp.where(order < big, order, NO_BLOCK)


def _smallest_reaching(key: jax.Array, among: jax.Array, count: jax.Array) -> jax.Array:
  """The smallest v with at least `count` entries of `among` having key <= v (binary search)."""
  lo = jnp.min(jnp.where(among, key, _INT_MAX))
  hi = jnp.max(jnp.where(among, key, -_INT_MAX - 1))

  def step(bounds):
    lo, hi = bounds
    mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2), no overflow
    enough = count_true(among & (key <= mid)) >= count
    return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

  lo, _ = lax.while_loop(lambda bounds: bounds[0] < bounds[1], step, (lo, hi))
  return lo


class Takes(NamedTuple):
  """The blocks one call takes from a pool, ranked in the order the call needs them."""

  rank: jax.Array  # int32[E]: take rank of each entry of the call (meaningful where it takes)
  count: jax.Array  # int32 scalar: how many entries take
  blocks: jax.Array  # int32[E]: the block that take rank r gets (r < count)
  evicted: jax.Array  # bool[E]: whether that block is evicted from the cache
  revived: jax.Array  # int32 scalar: unreferenced cached blocks that the call's hits revive

  def block_of(self, need: jax.Array) -> jax.Array:
    """The block each entry of `need` (the call's take mask) gets, -1 where it takes none."""
    return jnp.where(need, self.blocks[self.rank].reshape(need.shape), NO_BLOCK)

  def valid(self) -> jax.Array:
    """bool[E]: the take ranks in use."""
    return jnp.arange(self.blocks.shape[0]) < self.count

  def exceed(self, pool: Pool) -> jax.Array:
    """Whether the takes exceed the free blocks left after the revived hits (bool scalar)."""
    return self.count > pool.num_free() - self.revived


def plan_takes(pool: Pool, need: jax.Array, pinned: jax.Array, revived: jax.Array = 0) -> Takes:
  """Ranks the takes of a call and finds the block of each rank.

  Args:
    pool: the pool at the start of the call.
    need: bool[...] entries that take a block, ranked in row-major order.
    pinned: int32[...] blocks the call's hits reference (never evicted; -1 skipped).
    revived: int32 scalar, distinct unreferenced blocks with content among `pinned`.
  """
  flat = need.ravel()
  capacity = flat.shape[0]
  running, count = running_count_and_total(flat)
  blocks, evicted = taken_blocks(pool, count, capacity, pinned)
  return Takes(
    rank=jnp.clip(running - 1, 0, max(capacity - 1, 0)),
    count=count,
    blocks=blocks,
    evicted=evicted,
    revived=jnp.asarray(revived, jnp.int32),
  )


def no_takes() -> Takes:
  """The Takes of a call that takes nothing (free, fork, the source pool of a swap)."""
  none = jnp.zeros(0, jnp.int32)
  return Takes(
    rank=none, count=jnp.int32(0), blocks=none, evicted=jnp.zeros(0, bool), revived=jnp.int32(0)
  )


def release_pushes(pool: Pool, events: jax.Array, final_ref: jax.Array) -> jax.Array:
  """Which release events drop their block's last reference (bool, like `events`).

  Args:
    pool: the pool.
    events: int32[E] blocks released, in release order (-1 skipped).
    final_ref: int32[N] reference counts after the whole call.
  """
  num_blocks = pool.num_blocks
  pos = jnp.arange(events.shape[0], dtype=jnp.int32)
  valid = events >= 0
  last = (
    jnp.full(num_blocks, -1, jnp.int32).at[masked(events, valid, num_blocks)].max(pos, mode="drop")
  )
  return valid & (take(last, events) == pos) & (take(final_ref, events) == 0)


def commit_pool(
  pool: Pool,
  ok: jax.Array,
  *,
  num_takes: jax.Array,
  gains: jax.Array,
  releases: jax.Array,
  gain_weight=1,
  may_release: jax.Array | None = None,
  lost: jax.Array | None = None,
) -> tuple[Pool, jax.Array]:
  """Applies one call's takes, new references and releases (if `ok`).

  Args:
    pool: the pool at the start of the call.
    ok: whether the call succeeds; if not, the pool is returned unchanged.
    num_takes: number of takes (ranks 0 .. num_takes-1 of `taken_blocks`).
    gains: int32[G] blocks gaining `gain_weight` references each (-1 skipped).
    releases: int32[E] release events in order (-1 skipped).
    gain_weight: references each entry of `gains` adds (scalar).
    may_release: False only if `releases` is known to be all -1 (bool scalar;
      default: checked here).
    lost: bool[N] blocks whose content the call takes (`lost_content`): a
      release of one goes to the free stack.

  Returns:
    (new pool, pushed bool[E]: release events that freed their block).
  """
  num_blocks = pool.num_blocks
  weight = jnp.broadcast_to(jnp.asarray(gain_weight, jnp.int32), gains.shape)
  ref = pool.ref_count.at[masked(gains, (gains >= 0) & ok, num_blocks)].add(weight, mode="drop")
  fresh_used = jnp.minimum(num_takes, num_blocks - pool.next_fresh)
  stack_used = jnp.minimum(num_takes - fresh_used, pool.num_stacked)
  base = pool.num_stacked - stack_used

  def push_released(ref):
    ref = ref.at[masked(releases, (releases >= 0) & ok, num_blocks)].add(-1, mode="drop")
    pushed = release_pushes(pool, releases, ref) & ok
    has_content = (
      take(pool.content.has_content if lost is None else pool.content.has_content & ~lost, releases)
      if pool.content is not None
      else jnp.zeros(releases.shape, bool)
    )
    to_stack = pushed & ~has_content
    stack_rank = running_count(to_stack) - 1
    stack = pool.free_stack.at[masked(base + stack_rank, to_stack, num_blocks)].set(
      releases, mode="drop"
    )
    return ref, pushed, stack, base + jnp.sum(to_stack)

  def nothing_released(ref):
    return ref, jnp.zeros(releases.shape, bool), pool.free_stack, base

  # Most decode steps release nothing: skip the releases' scatters and scratch work.
  if may_release is None:
    may_release = jnp.any(releases >= 0)
  ref, pushed, free_stack, num_stacked = lax.cond(
    may_release & ok, push_released, nothing_released, ref
  )
  new_pool = pool.replace(
    ref_count=ref,
    free_stack=free_stack,
    num_stacked=jnp.where(ok, num_stacked, pool.num_stacked),
    next_fresh=jnp.where(ok, pool.next_fresh + fresh_used, pool.next_fresh),
  )
  return new_pool, pushed


def push_orphans(start: Pool, pool: Pool, lost: jax.Array, ok: jax.Array) -> tuple[Pool, jax.Array]:
  """Moves a call's orphans from the evictor to the free stack, lowest first (window rules).

  An orphan is a block of `lost` that was unreferenced when the call began
  and still is: it kept its place in the eviction order during the call, so
  none of the call's takes found it on the stack; it goes on after the
  call's releases.

  Args:
    start: the pool at the start of the call.
    pool: the pool after `commit_pool`.
    lost: bool[N] blocks whose content the call takes.
    ok: whether the call succeeds.

  Returns:
    (the pool, how many orphans were pushed).
  """
  num_blocks = pool.num_blocks
  orphans = lost & (start.ref_count == 0) & (pool.ref_count == 0) & ok

  def push():
    rank = running_count(orphans) - 1
    stack = pool.free_stack.at[masked(pool.num_stacked + rank, orphans, num_blocks)].set(
      jnp.arange(num_blocks, dtype=jnp.int32), mode="drop"
    )
    return stack, pool.num_stacked + count_true(orphans)

  stack, num_stacked = lax.cond(jnp.any(orphans), push, lambda: (pool.free_stack, pool.num_stacked))
  return pool.replace(free_stack=stack, num_stacked=num_stacked), num_stacked - pool.num_stacked


def release(pool: Pool, blocks: jax.Array) -> tuple[Pool, jax.Array]:
  """Drops one reference per entry of `blocks` (-1 skipped), in order: the pool layer.

  Returns:
    (pool, status): DOUBLE_FREE, with the pool unchanged, when a block would
    be released more often than it is referenced.
  """
  blocks = jnp.asarray(blocks, jnp.int32).reshape(-1)
  too_many = jnp.any(scatter_count(blocks, pool.num_blocks) > pool.ref_count)
  ok = ~too_many
  new_pool, _ = commit_pool(
    pool, ok, num_takes=jnp.int32(0), gains=jnp.zeros(0, jnp.int32), releases=blocks
  )
  return new_pool, jnp.where(ok, jnp.int32(Status.OK), jnp.int32(Status.DOUBLE_FREE))
