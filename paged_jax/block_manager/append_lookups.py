"""Phase 1 of `append_slots`: the identities of the blocks rows fill, and their lookups.

An identity needed by several rows resolves to one block: a pool hit, or
else the first entry of the call with that identity (the others share it).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.block_manager import prefix_cache
from paged_jax.block_manager.append_window import AppendRows
from paged_jax.block_manager.pool import masked, running_count, take
from paged_jax.block_manager.state import NO_BLOCK, BlockManagerState, ContentIndex
from paged_jax.block_manager.tables import floor_div

i32 = jnp.int32


class Identities(NamedTuple):
  """Identities of the blocks the rows of an `append_slots` call fill (window entries)."""

  hash: jax.Array  # uint32[B, W, 2]
  tokens: jax.Array  # int32[B, W, block_size]: each block's own tokens
  full: jax.Array  # bool[B, W]: the entry's block becomes full in this call
  parent0: jax.Array  # int32[B]: the block before the window (-1: none)
  rolling: jax.Array  # uint32[B, 4]: each row's rolling hash state after the call
  tail: jax.Array  # int32[B, block_size]: tokens of the partial last block after it
  window_tokens: jax.Array  # int32[B, W * block_size]: the window's tokens
  live_end: jax.Array | None  # bool[B, W]: live after the call (window rules; None: all)


class AppendLookups(NamedTuple):
  """The window entries resolved by a prefix-cache hit.

  Under the window rules an entry that the call leaves dead is looked up
  (`counted` says whether it was found) but takes no hit: `hit`,
  `pool_hit` and `call_hit` hold only live entries.
  """

  hit: jax.Array  # bool[B, W]: a pool hit or an identity an earlier row takes
  pool_hit: jax.Array  # bool[B, W]
  pool_block: jax.Array  # int32[B, W]: the pool hit's block (-1: none)
  call_hit: jax.Array  # bool[B, W]: shares the block of entry `call_rep` of this call
  call_rep: jax.Array | None  # int32[B, W]: flat index of that entry (None without caching)
  ident: Identities | None
  counted: jax.Array  # bool[B, W]: lookups that count as hits (dead entries included)

  def shared_blocks(self, new: jax.Array) -> jax.Array:
    """The blocks each entry ends up with, given each entry's own block `new`."""
    if self.call_rep is None:
      return new
    rep_block = new.ravel()[self.call_rep.ravel()].reshape(new.shape)
    return jnp.where(self.pool_hit, self.pool_block, jnp.where(self.call_hit, rep_block, new))


def look_up(state: BlockManagerState, rows: AppendRows, new_token_ids: jax.Array) -> AppendLookups:
  """Looks up the blocks rows fill, in the pool and among the call's earlier rows."""
  shape = rows.cols.shape
  if not state.cfg.enable_prefix_caching:
    none = jnp.zeros(shape, bool)
    return AppendLookups(
      hit=none,
      pool_hit=none,
      pool_block=jnp.full(shape, NO_BLOCK, i32),
      call_hit=none,
      call_rep=None,
      ident=None,
      counted=none,
    )
  ident = identities(state, rows, new_token_ids)
  pool_hit, pool_block, call_rep = _resolve_identities(
    state.gpu.content, ident, state.salt[rows.safe], rows.base, shape[1]
  )
  call_hit = ident.full & ~pool_hit & (call_rep != jnp.arange(call_rep.size).reshape(shape))
  counted = pool_hit | call_hit
  if ident.live_end is not None:
    call_hit &= ident.live_end
    pool_hit &= ident.live_end
    pool_block = jnp.where(pool_hit, pool_block, NO_BLOCK)
  return AppendLookups(
    hit=pool_hit | call_hit,
    pool_hit=pool_hit,
    pool_block=pool_block,
    call_hit=call_hit,
    call_rep=call_rep,
    ident=ident,
    counted=counted,
  )


def identities(state: BlockManagerState, rows: AppendRows, new_token_ids: jax.Array) -> Identities:
  """Identities of the blocks each row fills: hashes, own tokens, level-0 parent."""
  cfg = state.cfg
  block_size, max_blocks = cfg.block_size, cfg.max_blocks_per_seq
  seq_hash = state.seq_hash
  safe, base = rows.safe, rows.base
  tokens_before, num_new = rows.tokens_before, rows.num_new
  batch, num_cols = new_token_ids.shape
  width = rows.cols.shape[1]
  span = width * block_size
  i = jnp.arange(span, dtype=i32)[None, :]
  offset = (tokens_before - base * block_size)[:, None]
  tail = seq_hash.tail_tokens[safe]
  from_new = (
    jnp.take_along_axis(new_token_ids, jnp.clip(i - offset, 0, max(num_cols - 1, 0)), axis=1)
    if num_cols
    else jnp.zeros((batch, span), i32)
  )
  window_tokens = jnp.where(i < offset, tail[:, jnp.minimum(i, block_size - 1)[0]], from_new)
  window_tokens = jnp.where(i < offset + num_new[:, None], window_tokens, 0)
  prefix, rolling = prefix_cache.rolling_hashes(seq_hash.rolling[safe], new_token_ids, num_new)
  level = jnp.arange(width, dtype=i32)[None, :]
  ends = (base[:, None] + level + 1) * block_size
  full = (
    rows.real[:, None]
    & (ends <= (tokens_before + num_new)[:, None])
    & (ends > tokens_before[:, None])
  )
  parent0 = jnp.where(base > 0, state.tables[safe, jnp.clip(base - 1, 0, max_blocks - 1)], NO_BLOCK)
  live_end = None
  if state.window_rules:
    # A row looks up only under a parent with content (or from block 0).
    parent_has = (parent0 >= 0) & take(state.gpu.content.has_content, parent0, False)
    full &= ((base == 0) | parent_has)[:, None]
    live_end = rows.live_end
  last_new = jnp.clip(ends - tokens_before[:, None] - 1, 0, max(num_cols - 1, 0))
  prefix_at_end = (
    jnp.take_along_axis(prefix, last_new[:, :, None], axis=1)
    if num_cols
    else jnp.zeros((batch, width, 2), jnp.uint32)
  )
  salt = state.salt[safe]
  hashes = prefix_cache.identity_hash(prefix_at_end, salt[:, None], ends, cfg.hash_bits)
  tokens_after = tokens_before + num_new
  tail_start = floor_div(tokens_after, block_size) * block_size - base * block_size
  new_tail = jnp.take_along_axis(
    window_tokens,
    jnp.clip(tail_start[:, None] + jnp.arange(block_size)[None, :], 0, span - 1),
    axis=1,
  )
  tail_len = tokens_after - floor_div(tokens_after, block_size) * block_size
  new_tail = jnp.where(jnp.arange(block_size)[None, :] < tail_len[:, None], new_tail, 0)
  return Identities(
    hash=hashes,
    tokens=window_tokens.reshape(batch, width, block_size),
    full=full,
    parent0=parent0,
    rolling=rolling,
    tail=new_tail,
    window_tokens=window_tokens,
    live_end=live_end,
  )


def _resolve_identities(
  content: ContentIndex, ident: Identities, salt: jax.Array, base: jax.Array, width: int
):
  """Pool hits and within-call representatives (`_dedup_rows`) of the blocks rows fill.

  Only rows that fill a block take part. When they are at most an eighth of
  the batch (a decode step; one row of a batch of 4 to 15), they are gathered
  into a batch of that size first, so the lookups and the dedup rounds cost
  what that small batch costs.

  Returns:
    (pool_hit bool[B, W], pool_block int32[B, W], call_rep int32[B, W]).
  """

  def resolve(ident, salt, base):
    pool_hit, pool_block = prefix_cache.lookup_chains(
      content, ident.hash, ident.tokens, salt, ident.parent0, ident.full
    )
    return pool_hit, pool_block, _dedup_rows(ident, pool_hit, pool_block, salt, base, width)

  batch = salt.shape[0]
  capacity = max(1, batch // 8) if batch >= 4 else 0
  if capacity == 0:
    return resolve(ident, salt, base)
  filling = jnp.any(ident.full, axis=1)

  def compacted():
    slot = masked(running_count(filling) - 1, filling, capacity)
    rows = jnp.full(capacity, batch, i32).at[slot].set(jnp.arange(batch, dtype=i32), mode="drop")
    sub = jax.tree.map(lambda value: take(value, rows), ident)
    sub = sub._replace(full=sub.full & (rows < batch)[:, None])
    hit, block, rep = resolve(sub, take(salt, rows), take(base, rows))
    entry = rows[rep // width] * width + rep % width  # back to the batch's numbering
    return (
      jnp.zeros((batch, width), bool).at[rows].set(hit, mode="drop"),
      jnp.full((batch, width), NO_BLOCK, i32).at[rows].set(block, mode="drop"),
      jnp.arange(batch * width, dtype=i32).reshape(batch, width).at[rows].set(entry, mode="drop"),
    )

  return jax.lax.cond(jnp.sum(filling) <= capacity, compacted, lambda: resolve(ident, salt, base))


def _dedup_rows(ident, pool_hit, pool_block, salt, base, width):
  """For each (row, level) that fills a block, the first entry of the call with its identity.

  Entries resolved by a pool hit map to themselves. Two non-hit entries share
  an identity when they have the same salt, block index and anchor (the last
  pool-hit block before them, else the block before the row's first level)
  and the same tokens from the anchor through their block.
  """
  batch = salt.shape[0]
  block_size = ident.tokens.shape[-1]
  level = jnp.broadcast_to(jnp.arange(width, dtype=i32)[None, :], (batch, width))
  num_hits = jnp.sum(pool_hit, axis=1)
  last_hit = jnp.take_along_axis(pool_block, jnp.maximum(num_hits - 1, 0)[:, None], axis=1)[:, 0]
  anchor = jnp.where(num_hits > 0, last_hit, ident.parent0)
  valid = ident.full & ~pool_hit
  if ident.live_end is not None:  # a dead entry neither takes nor gives a share
    valid &= ident.live_end
  valid = valid.ravel()
  row = jnp.repeat(jnp.arange(batch, dtype=i32), width)
  entry_level = level.ravel()
  block_index = (base[:, None] + level).ravel()
  span_start = num_hits[row] * block_size  # window position after the anchor
  span_end = (entry_level + 1) * block_size
  window_tokens = ident.window_tokens
  span = window_tokens.shape[1]

  def equal(i, j):
    same = (
      (salt[row[i]] == salt[row[j]])
      & (block_index[i] == block_index[j])
      & (anchor[row[i]] == anchor[row[j]])
    )
    p = jnp.arange(span, dtype=i32)[None, :]
    tokens_i = jnp.take_along_axis(
      window_tokens[row[i]], jnp.clip(span_start[i][:, None] + p, 0, span - 1), 1
    )
    tokens_j = jnp.take_along_axis(
      window_tokens[row[j]], jnp.clip(span_start[j][:, None] + p, 0, span - 1), 1
    )
    in_span = p < (span_end[i] - span_start[i])[:, None]
    return same & jnp.all((tokens_i == tokens_j) | ~in_span, axis=1)

  rep = prefix_cache.first_equal(ident.hash.reshape(-1, 2), equal, valid)
  return rep.reshape(batch, width)
