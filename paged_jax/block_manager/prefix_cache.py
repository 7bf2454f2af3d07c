"""Exact prefix caching: content identities, hashed lookups, within-call sharing.

A full block's identity is its salt and the whole token prefix through it.
Lookups never compare a whole prefix: a cached block stores its own tokens,
its salt and its parent block, and a chain of blocks matches a prompt when
each block's tokens match and its parent is the block matched just before.
Candidates are found through a 64-bit polynomial prefix hash (truncated to
``hash_bits``) in a chained hash table; every candidate is verified exactly,
so a hash collision costs time, never correctness.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from paged_jax.block_manager.pool import Takes, masked, running_count, take
from paged_jax.block_manager.state import NO_BLOCK, ContentIndex, Pool

# Odd bases of the two polynomial hash lanes (invertible mod 2**32).
_BASES = (0x01000193, 0x5BD1E995)
_LANE_SEEDS = (0x9E3779B9, 0x85EBCA6B)


def _fmix32(x: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finalizer: a bijective avalanche mix of uint32."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _token_mix(tokens: jax.Array, lane: int) -> jax.Array:
  """Each token's term in hash lane `lane`, before its power of the lane base."""
  return _fmix32(tokens.astype(jnp.uint32) ^ jnp.uint32(_LANE_SEEDS[lane]))


def _powers(base: int, count: int) -> jax.Array:
  """uint32[count]: base**0 .. base**(count-1) mod 2**32 (static constants)."""
  out, p = [], 1
  for _ in range(count):
    out.append(p)
    p = (p * base) % (1 << 32)
  return jnp.array(out, dtype=jnp.uint32)


def rolling_hashes(
  rolling: jax.Array, tokens: jax.Array, count: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Prefix hashes after each new token, and the rolling state after `count`.

  The lane-l hash of tokens t_0 .. t_{p-1} is sum_i mix(t_i) * base_l**i mod 2**32,
  a prefix sum, so a whole row of new tokens is hashed with one cumsum.

  Args:
    rolling: uint32[R, 4] (h0, h1, base0**n, base1**n) for the n tokens so far.
    tokens: int32[R, K] new tokens.
    count: int32[R] how many of them are real.

  Returns:
    (prefix uint32[R, K, 2]: lane hashes after tokens 0..m, new rolling uint32[R, 4]).
  """
  k = tokens.shape[1]
  real = jnp.arange(k)[None, :] < count[:, None]
  lanes, powers_after = [], []
  for lane in range(2):
    steps = _powers(_BASES[lane], k)
    power = rolling[:, 2 + lane][:, None] * steps[None, :]
    terms = _token_mix(tokens, lane) * power
    terms = jnp.where(real, terms, jnp.uint32(0))
    lanes.append(rolling[:, lane][:, None] + jnp.cumsum(terms, axis=1, dtype=jnp.uint32))
    next_power = rolling[:, 2 + lane] * _powers(_BASES[lane], k + 1)[count]
    powers_after.append(next_power)
  prefix = jnp.stack(lanes, axis=-1)
  last = jnp.clip(count - 1, 0, max(k - 1, 0))
  final_h = (
    jnp.take_along_axis(prefix, last[:, None, None], axis=1)[:, 0, :] if k else rolling[:, :2]
  )
  final_h = jnp.where((count > 0)[:, None], final_h, rolling[:, :2])
  return prefix, jnp.concatenate([final_h, jnp.stack(powers_after, -1)], axis=-1)


def prompt_hashes(
  tokens: jax.Array, count: jax.Array, block_size: int
) -> tuple[jax.Array, jax.Array]:
  """A whole prompt's lane hashes after each block, and its rolling state.

  `rolling_hashes` from an empty sequence, read at block ends only: the terms
  are summed per block first, so a long prompt needs one short cumsum.

  Args:
    tokens: int32[L] with L a multiple of block_size.
    count: int32 scalar, how many tokens are real.
    block_size: tokens per block.

  Returns:
    (uint32[L // block_size, 2] hashes after each block, uint32[4] rolling state).
  """
  k = tokens.shape[0]
  real = jnp.arange(k) < count
  ends, totals, powers_after = [], [], []
  for lane in range(2):
    terms = jnp.where(real, _token_mix(tokens, lane) * _powers(_BASES[lane], k), jnp.uint32(0))
    block_sums = jnp.sum(terms.reshape(-1, block_size), axis=1, dtype=jnp.uint32)
    ends.append(jnp.cumsum(block_sums, dtype=jnp.uint32))
    totals.append(jnp.sum(block_sums, dtype=jnp.uint32))
    powers_after.append(_powers(_BASES[lane], k + 1)[count])
  return jnp.stack(ends, axis=-1), jnp.stack(totals + powers_after)


def identity_hash(
  prefix: jax.Array, salt: jax.Array, length: jax.Array, hash_bits: int
) -> jax.Array:
  """uint32[..., 2]: the indexing hash of (salt, prefix of `length` tokens), truncated."""
  salt_mix = _fmix32(salt.astype(jnp.uint32) ^ jnp.uint32(0x27D4EB2F))
  len_mix = _fmix32(length.astype(jnp.uint32) ^ jnp.uint32(0x165667B1))
  h0 = _fmix32(prefix[..., 0] ^ salt_mix ^ (len_mix * jnp.uint32(3)))
  h1 = _fmix32(prefix[..., 1] + salt_mix * jnp.uint32(5) + len_mix)
  lo_bits, hi_bits = min(hash_bits, 32), max(hash_bits - 32, 0)
  mask = lambda bits: jnp.uint32((1 << bits) - 1 if bits < 32 else 0xFFFFFFFF)
  return jnp.stack([h0 & mask(lo_bits), h1 & mask(hi_bits)], axis=-1)


def bucket_of(hashes: jax.Array, num_buckets: int) -> jax.Array:
  """Hash-table bucket of each uint32[..., 2] hash (num_buckets is a power of two)."""
  mixed = hashes[..., 0] ^ _fmix32(hashes[..., 1])
  return (mixed & jnp.uint32(num_buckets - 1)).astype(jnp.int32)


def lookup_chains(
  content: ContentIndex | None,
  hashes: jax.Array,
  tokens: jax.Array,
  salt: jax.Array,
  parent0: jax.Array,
  valid: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Finds the cached blocks of R chains of L consecutive full blocks.

  Level l of row r is the block whose identity is (salt[r], the prefix through
  it); level 0's parent is `parent0[r]` (-1 for the first block of a
  sequence). Hits form a prefix of each row's levels: a block's content can
  only be cached under a cached parent.

  Each level walks its bucket's chain to the first block with its stored
  hash (cheap reads), then every candidate is verified exactly (tokens, salt,
  parent). Only the first failing level of a row can still hit further down
  its chain (a hash collision): it walks on, and the rest is verified again.

  Args:
    content: the pool's content index (None: no hits).
    hashes: uint32[R, L, 2] identity hashes.
    tokens: int32[R, L, block_size] each block's own tokens.
    salt: int32[R].
    parent0: int32[R] the block before level 0.
    valid: bool[R, L] levels to look up (a prefix of each row).

  Returns:
    (hit bool[R, L], block int32[R, L], -1 where no hit).
  """
  num_levels = hashes.shape[1]
  if content is None:  # a pool without blocks
    return jnp.zeros(valid.shape, bool), jnp.full(valid.shape, NO_BLOCK, jnp.int32)
  level = jnp.arange(num_levels)[None, :]

  def walking(cursor):
    return valid & (cursor >= 0) & jnp.any(take(content.hash, cursor) != hashes, axis=-1)

  def step(carry):
    cursor, walk = carry
    cursor = jnp.where(walk, take(content.next_in_bucket, cursor), cursor)
    return cursor, walking(cursor)

  def seek(cursor):
    """Moves each cursor along its chain to the first block holding its level's hash."""
    return lax.while_loop(lambda carry: jnp.any(carry[1]), step, (cursor, walking(cursor)))[0]

  def verify(cursor):
    """(first level of each row that is not a verified hit, cursors to walk on)."""
    safe = jnp.maximum(cursor, 0)
    key_ok = (
      (cursor >= 0)
      & (content.salt[safe] == salt[:, None])
      & jnp.all(content.tokens[safe] == tokens, axis=-1)
    )
    expected = jnp.concatenate(
      [parent0[:, None], jnp.where(key_ok, cursor, NO_BLOCK)[:, :-1]], axis=1
    )
    bad = valid & ~(key_ok & (content.parent[safe] == expected))
    first_bad = jnp.min(jnp.where(bad, level, num_levels), axis=1, keepdims=True)
    return first_bad, (level == first_bad) & (cursor >= 0)

  def walk_on(carry):
    cursor, _, retry = carry
    cursor = seek(jnp.where(retry, take(content.next_in_bucket, cursor), cursor))
    return (cursor, *verify(cursor))

  start = seek(
    jnp.where(valid, content.buckets[bucket_of(hashes, content.buckets.shape[0])], NO_BLOCK)
  )
  cursor, first_bad, _ = lax.while_loop(
    lambda carry: jnp.any(carry[2]), walk_on, (start, *verify(start))
  )
  hit = valid & (level < first_bad)
  return hit, jnp.where(hit, cursor, NO_BLOCK)


def _round_winner(slot: jax.Array, pending: jax.Array, size: int) -> jax.Array:
  """int32[E]: for each entry, the lowest-index pending entry of its slot (E if none)."""
  num_entries = slot.shape[0]
  index = jnp.arange(num_entries, dtype=jnp.int32)
  first = (
    jnp.full(size, num_entries, jnp.int32).at[masked(slot, pending, size)].min(index, mode="drop")
  )
  return first[slot]


def _scratch_slots(hashes: jax.Array) -> tuple[jax.Array, int]:
  """A small scratch table (a power of two >= 2E) and each key's slot in it."""
  size = max(2, 1 << (2 * max(hashes.shape[0], 1) - 1).bit_length())
  return bucket_of(hashes, size), size


def first_equal(hashes: jax.Array, equal_fn, valid: jax.Array) -> jax.Array:
  """For each of E keys, the index of the first key (in index order) equal to it.

  In rounds: the lowest-index unresolved key of each hash slot resolves every
  unresolved key exactly equal to it (`equal_fn(i, j)` on index arrays). Equal
  keys share a slot, so each key meets its first equal key; only keys that
  collide in a slot cost extra rounds. No sort.

  Args:
    hashes: uint32[E, 2].
    equal_fn: (int32[E], int32[E]) -> bool[E], exact equality of keys i and j.
    valid: bool[E]; invalid keys map to themselves.

  Returns:
    int32[E] representative index.
  """
  num_entries = hashes.shape[0]
  index = jnp.arange(num_entries, dtype=jnp.int32)
  slot, size = _scratch_slots(hashes)

  def body(carry):
    rep, pending = carry
    won = _round_winner(slot, pending, size)
    cand = jnp.minimum(won, num_entries - 1)
    equal = pending & (won < num_entries) & equal_fn(cand, index)
    return jnp.where(equal, cand, rep), pending & ~equal

  rep, _ = lax.while_loop(lambda carry: jnp.any(carry[1]), body, (index, valid))
  return rep


def head_mark(bucket: jax.Array) -> jax.Array:
  """`prev_in_bucket` of a bucket's first block: -2 - bucket (-1 means in no chain)."""
  return -2 - bucket


def head_bucket(mark: jax.Array) -> jax.Array:
  """The bucket a `head_mark` names."""
  return -2 - mark


def unlink(content: ContentIndex, blocks: jax.Array) -> ContentIndex:
  """Removes blocks (with content, distinct, -1 skipped) from the hash table.

  The chains are doubly linked, so this is a few scatters over `blocks`: each
  removed run of a chain is bridged from the node before it (or the bucket
  head, which the first block's `head_mark` names) to the node after it.
  Their content and computed flags are cleared.
  """
  num_blocks = content.has_content.shape[0]
  num_buckets = content.buckets.shape[0]
  live = blocks >= 0
  has = content.has_content.at[masked(blocks, live, num_blocks)].set(False, mode="drop")
  removed = lambda ptr: (ptr >= 0) & ~take(has, ptr, True)

  def walk(links):
    def body(ptr):
      return jnp.where(removed(ptr), take(links, ptr, NO_BLOCK), ptr)

    return lambda start: lax.while_loop(lambda ptr: jnp.any(removed(ptr)), body, start)

  before = walk(content.prev_in_bucket)(take(content.prev_in_bucket, blocks, NO_BLOCK))
  after = walk(content.next_in_bucket)(take(content.next_in_bucket, blocks, NO_BLOCK))
  next_in_bucket = content.next_in_bucket.at[masked(before, live & (before >= 0), num_blocks)].set(
    after, mode="drop"
  )
  buckets = content.buckets.at[masked(head_bucket(before), live & (before < 0), num_buckets)].set(
    after, mode="drop"
  )
  prev_in_bucket = content.prev_in_bucket.at[masked(after, live & (after >= 0), num_blocks)].set(
    before, mode="drop"
  )
  return content.replace(
    has_content=has,
    next_in_bucket=next_in_bucket,
    buckets=buckets,
    prev_in_bucket=prev_in_bucket,
    computed=content.computed.at[masked(blocks, live, num_blocks)].set(False, mode="drop"),
  )


def insert(content: ContentIndex, blocks: jax.Array, hashes: jax.Array) -> ContentIndex:
  """Links blocks (-1 skipped; distinct, not in the table) at the heads of their buckets.

  As if inserted in rounds, one block per bucket at a time (the lowest index
  first): each block's successor is its bucket's head when its round comes.
  The rounds run on small per-block and scratch arrays only; the hash table
  is written once, after them. No sort.
  """
  num_buckets = content.buckets.shape[0]
  num_blocks = content.next_in_bucket.shape[0]
  bucket = bucket_of(hashes, num_buckets)
  _, size = _scratch_slots(hashes)
  slot = bucket & (size - 1)  # a bucket's blocks share a slot: one of them per round

  num_entries = blocks.shape[0]
  index = jnp.arange(num_entries, dtype=jnp.int32)

  def body(carry):
    pending, head, link, superseded = carry
    won = _round_winner(slot, pending, size)
    winner = pending & (won == index)
    link = jnp.where(winner, head, link)
    other = jnp.minimum(won, num_entries - 1)
    # Another block of my bucket won this round.
    bucket_won = ~winner & (won < num_entries) & (bucket[other] == bucket)
    return (
      pending & ~winner,
      jnp.where(bucket_won, blocks[other], head),
      link,
      superseded | (bucket_won & ~pending),
    )

  valid = blocks >= 0
  _, _, link, superseded = lax.while_loop(
    lambda carry: jnp.any(carry[0]),
    body,
    (
      valid,
      take(content.buckets, bucket, NO_BLOCK),
      jnp.full(blocks.shape, NO_BLOCK, jnp.int32),
      jnp.zeros(blocks.shape, bool),
    ),
  )
  at_blocks = masked(blocks, valid, num_blocks)
  prev_in_bucket = content.prev_in_bucket.at[at_blocks].set(head_mark(bucket), mode="drop")
  return content.replace(
    buckets=content.buckets.at[masked(bucket, valid & ~superseded, num_buckets)].set(
      blocks, mode="drop"
    ),
    next_in_bucket=content.next_in_bucket.at[at_blocks].set(link, mode="drop"),
    prev_in_bucket=prev_in_bucket.at[masked(link, valid & (link >= 0), num_blocks)].set(
      blocks, mode="drop"
    ),
  )


class Registrations(NamedTuple):
  """Content identities of the blocks a call fills, one entry per candidate block."""

  blocks: jax.Array  # int32[E]: the block to register (-1: none)
  hash: jax.Array  # uint32[E, 2]
  parent: jax.Array  # int32[E]: the block of the previous prefix (-1: none)
  salt: jax.Array  # int32[E]
  tokens: jax.Array  # int32[E, block_size]: the block's own tokens
  num_hashed_tokens: jax.Array  # int32[E]: prefix length through the block

  @classmethod
  def none(cls, block_size: int) -> Registrations:
    empty = jnp.zeros(0, jnp.int32)
    return cls(
      blocks=empty,
      hash=jnp.zeros((0, 2), jnp.uint32),
      parent=empty,
      salt=empty,
      tokens=jnp.zeros((0, block_size), jnp.int32),
      num_hashed_tokens=empty,
    )


def lost_content(pool: Pool, takes: Takes) -> jax.Array:
  """bool[N]: the blocks whose content a call's evictions take (the window rules).

  The evicted blocks, and every cached block whose identity extends one of
  theirs (its chain of parents reaches an evicted block), so no cached block
  outlives its parent. The parent chains are followed by pointer doubling:
  a few passes over the pool, and only when the call evicts.
  """
  content = pool.content
  num_blocks = pool.num_blocks
  evicted = takes.valid() & takes.evicted & (takes.blocks >= 0)
  victims = (
    jnp.zeros(num_blocks, bool).at[masked(takes.blocks, evicted, num_blocks)].set(True, mode="drop")
  )

  def extend(carry):
    marked, up = carry
    marked = marked | ((up >= 0) & take(marked, up, False))
    return marked, jnp.where(up >= 0, take(up, up, NO_BLOCK), NO_BLOCK)

  def with_extensions():
    up = jnp.where(content.has_content, content.parent, NO_BLOCK)
    marked, _ = lax.while_loop(
      lambda carry: jnp.any(~carry[0] & (carry[1] >= 0)), extend, (victims, up)
    )
    return marked

  return lax.cond(jnp.any(evicted), with_extensions, lambda: victims)


def commit_content(
  pool: Pool,
  ok: jax.Array,
  *,
  takes: Takes,
  releases: jax.Array,
  pushed: jax.Array,
  registrations: Registrations,
  lost: jax.Array | None = None,
  num_orphans: jax.Array | int = 0,
) -> Pool:
  """Applies one call's effects on a cached pool's content index (if `ok`).

  Args:
    pool: the pool after `commit_pool` (reference counts already final).
    ok: whether the call succeeds.
    takes: the call's takes from this pool (evictions, revived hits).
    releases, pushed: release events and which of them freed their block.
    registrations: identities of the blocks that became full.
    lost: bool[N], the window rules' `lost_content` (None: only the evicted
      blocks lose their content).
    num_orphans: unreferenced blocks of `lost` that left the evictor for the
      free stack (`commit_orphans`).
  """
  taken, evicted, revived = takes.blocks, takes.evicted, takes.revived
  taken_valid = takes.valid()
  reg = registrations
  content = pool.content
  num_blocks = pool.num_blocks
  num_evicted = jnp.sum(taken_valid & evicted)
  taken_ok = taken_valid & ok
  if lost is None:
    evicted_blocks = jnp.where(taken_valid & evicted & ok, taken, NO_BLOCK)
  else:
    evicted_blocks = jnp.where(lost & ok, jnp.arange(num_blocks, dtype=jnp.int32), NO_BLOCK)
  content = lax.cond(
    jnp.any(evicted_blocks >= 0), unlink, lambda content, _: content, content, evicted_blocks
  )
  take_idx = masked(taken, taken_ok, num_blocks)
  content = content.replace(
    last_accessed=content.last_accessed.at[take_idx].set(-1, mode="drop"),
    computed=content.computed.at[take_idx].set(False, mode="drop"),
  )
  to_evictor = pushed & take(content.has_content, releases) & ok
  rel_rank = running_count(to_evictor) - 1
  content = content.replace(
    release_time=content.release_time.at[masked(releases, to_evictor, num_blocks)].set(
      content.release_clock + rel_rank, mode="drop"
    )
  )
  reg_ok = (reg.blocks >= 0) & ok
  idx = masked(reg.blocks, reg_ok, num_blocks)
  content = content.replace(
    has_content=content.has_content.at[idx].set(True, mode="drop"),
    hash=content.hash.at[idx].set(reg.hash, mode="drop"),
    parent=content.parent.at[idx].set(reg.parent, mode="drop"),
    salt=content.salt.at[idx].set(reg.salt, mode="drop"),
    tokens=content.tokens.at[idx].set(reg.tokens, mode="drop"),
    num_hashed_tokens=content.num_hashed_tokens.at[idx].set(reg.num_hashed_tokens, mode="drop"),
  )
  content = insert(content, jnp.where(reg_ok, reg.blocks, NO_BLOCK), reg.hash)
  pushed_to_evictor = jnp.sum(to_evictor)
  content = content.replace(
    release_clock=content.release_clock + pushed_to_evictor,
    num_evictable=jnp.where(
      ok,
      content.num_evictable - revived - num_evicted + pushed_to_evictor - num_orphans,
      content.num_evictable,
    ),
  )
  return pool.replace(content=content)
