"""`append_slots`: room for each row's new tokens, in phases over the whole batch.

The phases (docs/semantics.md): lookups of the blocks rows fill
(`append_lookups`), copy-on-write decisions, takes, releases, registration.
`append_window` reads each row's window of table entries and checks the call.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.block_manager import prefix_cache
from paged_jax.block_manager.append_lookups import AppendLookups, look_up
from paged_jax.block_manager.append_window import AppendRows, read_rows
from paged_jax.block_manager.arguments import (
  int_array,
  seq_id_array,
  static_args,
  static_lookahead,
)
from paged_jax.block_manager.commit import commit, keeps_content, lost_by_takes, revived_hits
from paged_jax.block_manager.pool import masked, plan_takes, running_count, scatter_count, take
from paged_jax.block_manager.state import (
  NO_BLOCK,
  BlockManagerState,
  CopyPlan,
  first_failure,
)
from paged_jax.block_manager.tables import (
  ceil_div,
  first_live_block,
  set_rows,
  set_table_entries,
  table_entries,
)
from paged_jax.config import Status

i32 = jnp.int32


@static_args("num_lookahead_slots")
def append_slots(
  state: BlockManagerState, seq_ids, new_token_ids, num_new, num_lookahead_slots: int = 0
):
  """Makes room for each row's `num_new` new tokens and the lookahead slots.

  Works in phases over the whole batch (docs/semantics.md): lookups of the
  blocks rows fill, copy-on-write decisions, takes, releases, registration.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.
    new_token_ids: int32[B, K] each row's new tokens (the first `num_new[i]` count).
    num_new: int32[B] how many new tokens each row has, 0..K.
    num_lookahead_slots: static Python int >= 0, slots to reserve past the tokens.

  Returns:
    (new state, CopyPlan): `count` copy-on-write pairs `src -> dst` (capacity
    `B * (ceil(K / block_size) + 1)`, -1 after), and `status`: OK or the first
    of INVALID_ARGUMENT (bad or repeated id, `num_new` outside 0..K),
    NOT_ALLOCATED, WRONG_DEVICE (a sequence on the CPU), TABLE_FULL,
    OUT_OF_BLOCKS. A failed call returns the state unchanged and an empty plan.

  Raises:
    ValueError: `num_lookahead_slots` is not a static int >= 0, or an array
      argument has a non-integer dtype or the wrong shape (static).
  """
  cfg = state.cfg
  lookahead = static_lookahead(num_lookahead_slots)
  seq_ids = seq_id_array(seq_ids)
  batch = seq_ids.shape[0]
  new_token_ids = int_array("new_token_ids", new_token_ids, (batch, None))
  num_new = int_array("num_new", num_new, (batch,))
  num_cols = new_token_ids.shape[1]
  rows = read_rows(state, seq_ids, num_new, num_cols, lookahead)
  gpu = state.gpu

  # Phase 1: lookups; phase 2: copy-on-write decisions.
  found = look_up(state, rows, new_token_ids)
  nonhit_writer = rows.writer & ~found.hit
  copy = nonhit_writer & ~_writes_in_place(
    gpu.ref_count, rows.old, rows.refs, rows.writer, nonhit_writer, rows.shared
  )

  # Phase 3: takes, in array order and logical order within a row.
  need_take = rows.within & rows.live_end & (((rows.old < 0) & ~found.hit) | copy)
  pins = jnp.where(found.hit & (found.pool_block >= 0), found.pool_block, NO_BLOCK)
  takes = plan_takes(gpu, need_take, pins, revived_hits(gpu, pins))
  lost = lost_by_takes(state, gpu, takes)
  status = first_failure(
    (Status.INVALID_ARGUMENT, rows.invalid),
    (Status.NOT_ALLOCATED, rows.not_allocated),
    (Status.WRONG_DEVICE, rows.wrong_device),
    (Status.TABLE_FULL, rows.table_full),
    (Status.OUT_OF_BLOCKS, takes.exceed(gpu)),
  )
  ok = status == Status.OK
  new = jnp.where(
    need_take, takes.block_of(need_take), jnp.where(rows.live_end, rows.old, NO_BLOCK)
  )
  new = found.shared_blocks(new)

  # Phase 4: releases; phase 5: registration.
  released = _releases(state, rows, copy, found.hit, num_cols)
  registrations = _registrations(state, rows, found, new, lost)
  # Without caching or a window, only copy-on-write releases, and only if a block is shared.
  plain = not cfg.enable_prefix_caching and cfg.sliding_window is None
  state = commit(
    state,
    True,
    ok,
    gains=jnp.where(need_take | found.hit, new, NO_BLOCK).ravel(),
    releases=released.events,
    takes=takes,
    registrations=registrations,
    may_release=rows.shared if plain else None,
    lost=lost,
  )
  state = _write_rows(state, rows, found, ok, new, released)
  capacity = batch * (ceil_div(num_cols, cfg.block_size) + 1)
  return state, _copy_plan(copy, rows.old, new, capacity, ok, status, rows.shared)


def _writes_in_place(ref_count, old, refs, writer, nonhit_writer, shared) -> jax.Array:
  """Phase 2: which non-hit writers write their block in place instead of copying it.

  The rule of vLLM 0.6's block manager, applied in row order: a block is
  written in place by the last row that writes it, when every reference to
  it (`refs`, its ref count) comes from a row writing it in this call; the
  other writers copy. Unless some writer's block is `shared` (the common
  decode step), that is every non-hit writer, and the block-indexed counts
  are skipped.
  """
  num_blocks = ref_count.shape[0]

  def shared_blocks():
    writers_of = scatter_count(jnp.where(writer, old, NO_BLOCK), num_blocks)
    row = jnp.broadcast_to(jnp.arange(old.shape[0], dtype=i32)[:, None], old.shape)
    last_writer = (
      jnp.full(num_blocks, -1, i32)
      .at[masked(old, nonhit_writer, num_blocks).ravel()]
      .max(row.ravel(), mode="drop")
    )
    return nonhit_writer & (refs == take(writers_of, old)) & (take(last_writer, old) == row)

  return jax.lax.cond(shared, shared_blocks, lambda: nonhit_writer)


class _Releases(NamedTuple):
  """Phase 4: the references the call drops, in order."""

  events: jax.Array  # int32[E] blocks released, in order (-1 skipped)
  dead_cols: jax.Array | None  # int32[B, D]: entries that may leave the window (None: no window)
  dies: jax.Array | None  # bool[B, D]: those that do


def _releases(
  state: BlockManagerState, rows: AppendRows, copy: jax.Array, hit: jax.Array, num_cols: int
) -> _Releases:
  """Copy sources and blocks replaced by a hit, then (per row) the blocks that leave the window."""
  cfg = state.cfg
  replaced = (copy | (hit & (rows.old >= 0))) & rows.within
  window_releases = jnp.where(replaced, rows.old, NO_BLOCK)
  if cfg.sliding_window is None:
    return _Releases(events=window_releases.ravel(), dead_cols=None, dies=None)
  dead_cols = (
    first_live_block(cfg, rows.tokens_before)[:, None]
    + jnp.arange(num_cols // cfg.block_size + 1, dtype=i32)[None, :]
  )
  dead_old = jnp.where(
    dead_cols < cfg.max_blocks_per_seq, table_entries(state.tables, rows.safe, dead_cols), NO_BLOCK
  )
  dies = (
    rows.real[:, None]
    & (dead_cols < first_live_block(cfg, rows.tokens_after)[:, None])
    & (dead_old >= 0)
  )
  events = jnp.concatenate([window_releases, jnp.where(dies, dead_old, NO_BLOCK)], axis=1)
  return _Releases(events=events.ravel(), dead_cols=dead_cols, dies=dies)


def _registrations(
  state: BlockManagerState,
  rows: AppendRows,
  found: AppendLookups,
  new: jax.Array,
  lost: jax.Array | None,
) -> prefix_cache.Registrations | None:
  """Phase 5: the identities of the blocks rows fill without a hit (None without caching)."""
  ident = found.ident
  if ident is None:
    return None
  batch, width = new.shape
  prev = jnp.concatenate([ident.parent0[:, None], new[:, :-1]], axis=1)
  registered = ident.full & ~found.hit
  if lost is not None:
    registered = _under_parents_with_content(state, rows, found, lost)
  return prefix_cache.Registrations(
    blocks=jnp.where(registered, new, NO_BLOCK).ravel(),
    hash=ident.hash.reshape(-1, 2),
    parent=prev.ravel(),
    salt=jnp.broadcast_to(state.salt[rows.safe][:, None], (batch, width)).ravel(),
    tokens=ident.tokens.reshape(batch * width, -1),
    num_hashed_tokens=((rows.cols + 1) * state.cfg.block_size).ravel(),
  )


def _under_parents_with_content(
  state: BlockManagerState, rows: AppendRows, found: AppendLookups, lost: jax.Array
) -> jax.Array:
  """bool[B, W]: the filled blocks that register under the window rules.

  A row's own full, live block registers when the entry before it holds a
  block with content once the call's takes, releases and window drops are
  done: the entry before the window (live, keeping its content), a pool
  hit that keeps its content, a block an earlier row of the call shares
  and registers, or the row's own block before it, registered. Along a row
  that is the content of the last entry that is not an own candidate (or
  of the entry before the window), found with a running maximum; shares
  read their representative's answer, repeated until nothing changes (one
  round unless rows share blocks).
  """
  cfg = state.cfg
  ident = found.ident
  shape = found.hit.shape
  candidate = ident.full & rows.live_end & ~found.hit
  parent_live = rows.base - 1 >= first_live_block(cfg, rows.tokens_after)
  start = (rows.base == 0) | (parent_live & keeps_content(state.gpu, ident.parent0, lost))
  pool_kept = found.pool_hit & keeps_content(state.gpu, found.pool_block, lost)
  level = jnp.broadcast_to(jnp.arange(shape[1], dtype=i32)[None, :], shape)
  last_other = jax.lax.cummax(jnp.where(candidate, -1, level), axis=1)

  def registered(shared_kept):
    value = pool_kept | shared_kept  # dead entries and own non-candidates hold no content
    content = jnp.where(
      last_other >= 0,
      jnp.take_along_axis(value, jnp.maximum(last_other, 0), axis=1),
      start[:, None],
    )
    return candidate & content

  def step(carry):
    shared_kept, _ = carry
    rep_registered = registered(shared_kept).ravel()[found.call_rep.ravel()].reshape(shape)
    updated = found.call_hit & rep_registered
    return updated, jnp.any(updated != shared_kept)

  shared_kept, _ = jax.lax.while_loop(
    lambda carry: carry[1], step, (jnp.zeros(shape, bool), jnp.any(found.call_hit))
  )
  return registered(shared_kept)


def _write_rows(
  state: BlockManagerState,
  rows: AppendRows,
  found: AppendLookups,
  ok: jax.Array,
  new: jax.Array,
  released: _Releases,
) -> BlockManagerState:
  """Writes the rows' new table entries, token counts, hash state and hit counters (if `ok`)."""
  keep = ok & rows.real
  changed = keep[:, None] & rows.in_table & (new != rows.old)
  tables = set_table_entries(state.tables, rows.safe, rows.cols, changed, new)
  if released.dead_cols is not None:
    tables = set_table_entries(
      tables, rows.safe, released.dead_cols, keep[:, None] & released.dies, NO_BLOCK
    )
  state = state.replace(
    tables=tables, num_tokens=set_rows(state.num_tokens, rows.safe, keep, rows.tokens_after)
  )
  ident = found.ident
  if ident is None:
    return state
  seq_hash = state.seq_hash
  return state.replace(
    seq_hash=seq_hash.replace(
      rolling=set_rows(seq_hash.rolling, rows.safe, keep, ident.rolling),
      tail_tokens=set_rows(seq_hash.tail_tokens, rows.safe, keep, ident.tail),
    ),
    num_lookups=state.num_lookups + jnp.where(ok, jnp.sum(ident.full), 0),
    num_hits=state.num_hits + jnp.where(ok, jnp.sum(found.counted), 0),
  )


def _copy_plan(copy, old, new, capacity, ok, status, shared) -> CopyPlan:
  """Compacts the (old, new) pairs of copying entries, in take order.

  Only a writer of a `shared` block copies; most decode steps have none.
  """

  def compact():
    flat = copy.ravel() & ok
    pos = masked(running_count(flat) - 1, flat, capacity)
    pairs = (
      jnp.full((capacity, 2), NO_BLOCK, i32)
      .at[pos]
      .set(jnp.stack([old.ravel(), new.ravel()], axis=1), mode="drop")
    )
    return pairs, jnp.sum(flat).astype(i32)

  pairs, count = jax.lax.cond(
    shared & ok, compact, lambda: (jnp.full((capacity, 2), NO_BLOCK, i32), i32(0))
  )
  return CopyPlan(src=pairs[:, 0], dst=pairs[:, 1], count=count, status=status)
