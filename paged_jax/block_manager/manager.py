"""BlockSpaceManager: the seed's block manager as pure, batched, jittable functions.

Every mutating call works in DESIGN's phases (lookups, copy-on-write
decisions, takes, releases, registration) over the whole batch at once:
takes are ranked with a cumsum, releases are an ordered event list, and all
writes are scatters masked by the call's status, so a failed call returns the
state it was given.
"""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp

from paged_jax.block_manager import prefix_cache as pc
from paged_jax.block_manager.pool import (
    commit_pool, masked, running_count, running_count_and_total, scatter_count, take,
    taken_blocks)
from paged_jax.block_manager.state import (
    EMPTY, NO_BLOCK, ON_CPU, ON_GPU, BlockManagerState, CopyPlan, OpResult,
    Pool, SwapPlan, first_failure, init_state)
from paged_jax.config import AllocStatus, CacheConfig, Status

i32 = jnp.int32


def _as_i32(x) -> jax.Array:
  return jnp.asarray(x, dtype=i32)


def _div(a, b: int):
  """a // b (floor). A power-of-two b is an arithmetic shift, which keeps fusions cheap."""
  if isinstance(a, int) or b & (b - 1):
    return a // b
  return jnp.right_shift(a, b.bit_length() - 1)


def _cdiv(a, b):
  return _div(a + b - 1, b)


def _first_live(cfg: CacheConfig, num_tokens: jax.Array) -> jax.Array:
  """First logical block still inside the sliding window (0 without one)."""
  if cfg.sliding_window is None:
    return jnp.zeros_like(num_tokens)
  return jnp.maximum(0, _div(num_tokens - cfg.sliding_window, cfg.block_size))


def _any_each(*masks: jax.Array) -> tuple[jax.Array, ...]:
  """``jnp.any`` of each mask, from one OR-reduction of bit-packed flags.

  One reduction instead of one per mask: on XLA:CPU each costs about as much
  as a scatter at batch 1024.
  """
  packed = masks[0].astype(i32)
  for i, mask in enumerate(masks[1:], 1):
    packed = packed | (mask.astype(i32) << i)    # broadcasting: masks may differ in shape
  bits = jax.lax.reduce(packed.ravel(), i32(0), jax.lax.bitwise_or, (0,))
  return tuple((bits >> i) & 1 == 1 for i in range(len(masks)))


def _check_ids(ids: jax.Array, num_slots: int):
  """(real bool[B], safe int32[B], invalid scalar): padding -1 is neither real nor invalid."""
  pad = ids == NO_BLOCK
  out_of_range = ~pad & ((ids < 0) | (ids >= num_slots))
  real = ~pad & ~out_of_range
  safe = jnp.clip(ids, 0, num_slots - 1)
  twice = jnp.any(scatter_count(jnp.where(real, ids, NO_BLOCK), num_slots) > 1)
  return real, safe, jnp.any(out_of_range) | twice


def _pool(state: BlockManagerState, on_gpu: bool) -> Pool:
  return state.gpu if on_gpu else state.cpu


def _with_pool(state: BlockManagerState, on_gpu: bool, pool: Pool) -> BlockManagerState:
  return state.replace(gpu=pool) if on_gpu else state.replace(cpu=pool)


def _revived(pool: Pool, pins: jax.Array, distinct: bool = False) -> jax.Array:
  """Distinct unreferenced blocks that `pins` (-1 skipped; `distinct` if known) revive."""
  if pool.content is None:
    return i32(0)
  pins = pins.ravel()
  counted = pins >= 0
  if not distinct:
    keys = jnp.stack([pins.astype(jnp.uint32), jnp.zeros_like(pins, jnp.uint32)], axis=1)
    first = pc.first_equal(keys, lambda i, j: pins[i] == pins[j], counted)
    counted &= first == jnp.arange(pins.shape[0])
  return jnp.sum(counted & take(pool.content.has_content, pins)
                 & (take(pool.ref_count, pins) == 0)).astype(i32)


def _commit(state, on_gpu, ok, *, num_takes, gains, releases, gain_weight=1, taken=None,
            taken_valid=None, evicted=None, revived=i32(0), registrations=None,
            may_release=None):
  """Applies a call's effects on one pool (reference counts, free lists, content)."""
  pool = _pool(state, on_gpu)
  new_pool, pushed = commit_pool(pool, ok, num_takes=num_takes, gains=gains, releases=releases,
                                 gain_weight=gain_weight, may_release=may_release)
  if pool.content is not None:
    if taken is None:
      taken = jnp.zeros(0, i32)
      taken_valid = evicted = jnp.zeros(0, bool)
    if registrations is None:
      bs = state.cfg.block_size
      registrations = dict(reg_blocks=jnp.zeros(0, i32), reg_hash=jnp.zeros((0, 2), jnp.uint32),
                           reg_parent=jnp.zeros(0, i32), reg_salt=jnp.zeros(0, i32),
                           reg_tokens=jnp.zeros((0, bs), i32), reg_hashed=jnp.zeros(0, i32))
    new_pool = pc.commit_content(new_pool, ok, revived=revived, taken=taken,
                                 taken_valid=taken_valid, evicted=evicted,
                                 releases=releases, pushed=pushed, **registrations)
  return _with_pool(state, on_gpu, new_pool)


def _set_rows(array: jax.Array, rows: jax.Array, keep: jax.Array, values) -> jax.Array:
  """array[rows[i]] = values[i] where keep[i] (a masked row scatter)."""
  idx = masked(rows, keep, array.shape[0])
  values = jnp.broadcast_to(values, (rows.shape[0],) + array.shape[1:])
  return array.at[idx].set(values.astype(array.dtype), mode="drop")


def _table_entries(tables: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
  """tables[rows[:, None], cols] (cols clipped into range), as one flat gather."""
  m = tables.shape[1]
  return tables.reshape(-1)[rows[:, None] * m + jnp.clip(cols, 0, m - 1)]


def _set_table_entries(tables, rows, cols, keep, values) -> jax.Array:
  """tables[rows[i], cols[i, j]] = values[i, j] where keep[i, j] (cols in range), flat."""
  s, m = tables.shape
  idx = masked(rows[:, None] * m + cols, keep, s * m)
  values = jnp.broadcast_to(jnp.asarray(values, tables.dtype), idx.shape)
  return tables.reshape(-1).at[idx.ravel()].set(values.ravel(), mode="drop").reshape(s, m)


# ---------------------------------------------------------------------------
# allocate


def allocate(state: BlockManagerState, seq_ids, token_ids, num_tokens, salt=0):
  """Gives every sequence of a group the table of one prompt of `num_tokens` tokens."""
  cfg = state.cfg
  bs, m, s = cfg.block_size, cfg.max_blocks_per_seq, cfg.max_seqs
  seq_ids = _as_i32(seq_ids).reshape(-1)
  token_ids = _as_i32(token_ids).reshape(-1)
  n, salt = _as_i32(num_tokens), _as_i32(salt)
  real, safe, bad_ids = _check_ids(seq_ids, s)
  group = jnp.sum(real).astype(i32)
  invalid = bad_ids | (n < 0) | (n > token_ids.shape[0])
  already = jnp.any(real & (state.device[safe] != EMPTY))
  table_full = _cdiv(n, bs) > m
  j = jnp.arange(m, dtype=i32)
  live = (j >= _first_live(cfg, n)) & (j < _cdiv(n, bs)) & (group > 0)
  gpu = state.gpu
  hit = jnp.zeros(m, bool)
  hit_block = jnp.full(m, NO_BLOCK, i32)
  if cfg.enable_prefix_caching:
    buf = jnp.zeros(m * bs, i32).at[:token_ids.shape[0]].set(token_ids[:m * bs])
    buf = jnp.where(jnp.arange(m * bs) < n, buf, 0)
    block_ends, rolling = pc.prompt_hashes(buf, n, bs)
    ends = (j + 1) * bs
    full = (ends <= n) & (group > 0)
    hashes = pc.identity_hash(block_ends, salt, ends, cfg.hash_bits)
    blk_tokens = buf.reshape(m, bs)
    hit, hit_block = pc.lookup_chains(gpu.content, hashes[None], blk_tokens[None],
                                      salt[None], jnp.array([NO_BLOCK], i32), full[None])
    hit, hit_block = hit[0], hit_block[0]
  need_take = live & ~hit
  take_count, num_takes = running_count_and_total(need_take)
  revived = _revived(gpu, hit_block, distinct=True)   # one chain: distinct blocks
  out_of_blocks = num_takes > gpu.num_free() - revived
  status = first_failure((Status.INVALID_ARGUMENT, invalid),
                         (Status.ALREADY_ALLOCATED, already),
                         (Status.TABLE_FULL, table_full),
                         (Status.OUT_OF_BLOCKS, out_of_blocks))
  ok = (status == Status.OK) & (group > 0)
  taken, evicted = taken_blocks(gpu, num_takes, m, hit_block)
  rank = jnp.clip(take_count - 1, 0, m - 1)
  row = jnp.where(hit, hit_block, jnp.where(need_take, taken[rank], NO_BLOCK))
  registrations = None
  if cfg.enable_prefix_caching:
    registrations = dict(
        reg_blocks=jnp.where(need_take & full, row, NO_BLOCK), reg_hash=hashes,
        reg_parent=jnp.concatenate([jnp.array([NO_BLOCK], i32), row[:-1]]),
        reg_salt=jnp.broadcast_to(salt, (m,)), reg_tokens=blk_tokens, reg_hashed=ends)
  state = _commit(state, True, ok, num_takes=num_takes, gains=row, gain_weight=group,
                  releases=jnp.zeros(0, i32), taken=taken,
                  taken_valid=jnp.arange(m) < num_takes, evicted=evicted,
                  revived=revived, registrations=registrations)
  keep = real & ok
  state = state.replace(
      tables=_set_rows(state.tables, safe, keep, row[None]),
      num_tokens=_set_rows(state.num_tokens, safe, keep, n),
      device=_set_rows(state.device, safe, keep, ON_GPU),
      salt=_set_rows(state.salt, safe, keep, salt))
  if cfg.enable_prefix_caching:
    tail_start = (n // bs) * bs
    tail = jnp.where(jnp.arange(bs) < n - tail_start,
                     jax.lax.dynamic_slice(jnp.pad(buf, (0, bs)), (tail_start,), (bs,)), 0)
    sh = state.seq_hash
    state = state.replace(
        seq_hash=sh.replace(rolling=_set_rows(sh.rolling, safe, keep, rolling),
                            tail_tokens=_set_rows(sh.tail_tokens, safe, keep, tail[None])),
        num_lookups=state.num_lookups + jnp.where(ok, jnp.sum(full), 0),
        num_hits=state.num_hits + jnp.where(ok, jnp.sum(hit), 0))
  return state, OpResult(status=status)


def can_allocate(state: BlockManagerState, num_tokens) -> jax.Array:
  """AllocStatus for a prompt of `num_tokens` tokens (prefix hits not counted)."""
  cfg = state.cfg
  n = _as_i32(num_tokens)
  required = jnp.maximum(_cdiv(n, cfg.block_size) - _first_live(cfg, n), 0)
  never = ((n < 0) | (_cdiv(n, cfg.block_size) > cfg.max_blocks_per_seq)
           | (cfg.num_gpu_blocks - required < cfg.watermark_blocks))
  ok = state.gpu.num_free() - required >= cfg.watermark_blocks
  return jnp.where(never, i32(AllocStatus.NEVER),
                   jnp.where(ok, i32(AllocStatus.OK), i32(AllocStatus.LATER)))


# ---------------------------------------------------------------------------
# append_slots


def append_slots(state: BlockManagerState, seq_ids, new_token_ids, num_new,
                 num_lookahead_slots: int = 0):
  """Makes room for each row's `num_new` new tokens (+ lookahead); returns the CopyPlan."""
  cfg = state.cfg
  bs, m, s = cfg.block_size, cfg.max_blocks_per_seq, cfg.max_seqs
  lookahead = _static_lookahead(num_lookahead_slots)
  seq_ids = _as_i32(seq_ids).reshape(-1)
  b = seq_ids.shape[0]
  new_token_ids = _as_i32(new_token_ids).reshape(b, -1)
  k_cols = new_token_ids.shape[1]
  k = _as_i32(num_new).reshape(b)
  real, safe, bad_ids = _check_ids(seq_ids, s)
  device = state.device[safe]
  n0 = state.num_tokens[safe]
  bad_count = (k < 0) | (k > k_cols)
  k = jnp.where(real, jnp.clip(k, 0, k_cols), 0)
  n1 = n0 + k
  target_len = _cdiv(n1 + lookahead, bs)

  # The window of table entries a row can touch: [base, base + width).
  width = _cdiv(bs - 1 + k_cols + lookahead, bs)
  base = _div(n0, bs)
  cols = base[:, None] + jnp.arange(width, dtype=i32)[None, :]
  in_table = cols < m
  tables = state.tables
  old = jnp.where(in_table, _table_entries(tables, safe, cols), NO_BLOCK)
  old = jnp.where(real[:, None], old, NO_BLOCK)
  live_end = cols >= _first_live(cfg, n1)[:, None]
  written = ((cols * bs < n1[:, None]) & ((cols + 1) * bs > n0[:, None])
             & (k > 0)[:, None] & real[:, None])
  writer = written & live_end & (old >= 0)
  gpu = state.gpu
  refs = take(gpu.ref_count, old)
  bad_count, not_allocated, wrong_device, table_full, shared = _any_each(
      (real & bad_count)[:, None], (real & (device == EMPTY))[:, None],
      (real & (device == ON_CPU))[:, None], (real & (target_len > m))[:, None],
      writer & (refs > 1))
  invalid = bad_ids | bad_count

  hit = jnp.zeros((b, width), bool)
  hit_block = jnp.full((b, width), NO_BLOCK, i32)
  call_rep = None
  if cfg.enable_prefix_caching:
    ident = _append_identities(state, safe, real, base, n0, k, new_token_ids, width)
    pool_hit, pool_block, call_rep = _resolve_identities(gpu.content, ident, state.salt[safe],
                                                         base, width)
    call_hit = ident["full"] & ~pool_hit & (call_rep != jnp.arange(b * width).reshape(b, width))
    hit = pool_hit | call_hit
    hit_block = pool_block

  # Phase 2: copy-on-write decisions.
  nonhit_writer = writer & ~hit
  copy = nonhit_writer & ~_writes_in_place(gpu.ref_count, old, refs, writer, nonhit_writer,
                                           shared)

  # Phase 3: takes, in array order and logical order within a row.
  within = (cols < target_len[:, None]) & in_table & real[:, None]
  need_take = within & live_end & (((old < 0) & ~hit) | copy)
  capacity = b * width
  take_count, num_takes = running_count_and_total(need_take.ravel())
  pins = jnp.where(hit & (hit_block >= 0), hit_block, NO_BLOCK)
  revived = _revived(gpu, pins)
  out_of_blocks = num_takes > gpu.num_free() - revived
  status = first_failure((Status.INVALID_ARGUMENT, invalid),
                         (Status.NOT_ALLOCATED, not_allocated),
                         (Status.WRONG_DEVICE, wrong_device),
                         (Status.TABLE_FULL, table_full),
                         (Status.OUT_OF_BLOCKS, out_of_blocks))
  ok = status == Status.OK
  taken, evicted = taken_blocks(gpu, num_takes, capacity, pins)
  rank = jnp.clip(take_count - 1, 0, max(capacity - 1, 0)).reshape(b, width)
  fresh = jnp.where(need_take, taken[rank], NO_BLOCK)
  new = jnp.where(need_take, fresh, jnp.where(live_end, old, NO_BLOCK))
  if call_rep is not None:
    flat_new = new.ravel()
    rep_block = flat_new[call_rep.ravel()].reshape(b, width)
    new = jnp.where(pool_hit, pool_block, jnp.where(call_hit, rep_block, new))

  # Phase 4: releases (copy sources and replaced blocks, then dead window blocks).
  replaced = (copy | (hit & (old >= 0))) & within
  window_releases = jnp.where(replaced, old, NO_BLOCK)
  releases = window_releases.ravel()
  if cfg.sliding_window is not None:
    dead_width = k_cols // bs + 1
    dead_cols = _first_live(cfg, n0)[:, None] + jnp.arange(dead_width, dtype=i32)[None, :]
    dead_old = jnp.where(dead_cols < m, _table_entries(tables, safe, dead_cols),
                         NO_BLOCK)
    dies = real[:, None] & (dead_cols < _first_live(cfg, n1)[:, None]) & (dead_old >= 0)
    dead_releases = jnp.where(dies, dead_old, NO_BLOCK)
    releases = jnp.concatenate([window_releases, dead_releases], axis=1).ravel()
  gains = jnp.where(need_take | hit, new, NO_BLOCK).ravel()

  registrations = None
  if cfg.enable_prefix_caching:
    first_rows = ident["full"] & ~hit
    prev = jnp.concatenate([ident["parent0"][:, None], new[:, :-1]], axis=1)
    registrations = dict(
        reg_blocks=jnp.where(first_rows, new, NO_BLOCK).ravel(),
        reg_hash=ident["hash"].reshape(-1, 2), reg_parent=prev.ravel(),
        reg_salt=jnp.broadcast_to(state.salt[safe][:, None], (b, width)).ravel(),
        reg_tokens=ident["tokens"].reshape(-1, bs), reg_hashed=((cols + 1) * bs).ravel())
  # Without caching or a window, only copy-on-write releases, and only if a block is shared.
  plain = not cfg.enable_prefix_caching and cfg.sliding_window is None
  state = _commit(state, True, ok, num_takes=num_takes, gains=gains,
                  releases=releases, taken=taken, taken_valid=jnp.arange(capacity) < num_takes,
                  evicted=evicted, revived=revived, registrations=registrations,
                  may_release=shared if plain else None)

  keep = ok & real
  changed = keep[:, None] & in_table & (new != old)
  tables = _set_table_entries(state.tables, safe, cols, changed, new)
  if cfg.sliding_window is not None:
    tables = _set_table_entries(tables, safe, dead_cols, keep[:, None] & dies, NO_BLOCK)
  state = state.replace(tables=tables,
                        num_tokens=_set_rows(state.num_tokens, safe, keep, n1))
  if cfg.enable_prefix_caching:
    sh = state.seq_hash
    state = state.replace(
        seq_hash=sh.replace(rolling=_set_rows(sh.rolling, safe, keep, ident["rolling"]),
                            tail_tokens=_set_rows(sh.tail_tokens, safe, keep, ident["tail"])),
        num_lookups=state.num_lookups + jnp.where(ok, jnp.sum(ident["full"]), 0),
        num_hits=state.num_hits + jnp.where(ok, jnp.sum(hit), 0))
  plan = _copy_plan(copy, old, new, b * (_cdiv(k_cols, bs) + 1), ok, status, shared)
  return state, plan


def _writes_in_place(ref_count, old, refs, writer, nonhit_writer, shared) -> jax.Array:
  """Which non-hit writers write their block in place instead of copying it.

  The seed's rule, applied in row order: a block is written in place by the
  last row that writes it, when every reference to it (`refs`, its ref count)
  comes from a row writing it in this call; the other writers copy. Unless
  some writer's block is `shared` (the common decode step), that is every
  non-hit writer, and the block-indexed counts are skipped.
  """
  n_blocks = ref_count.shape[0]

  def shared_blocks():
    writers_of = scatter_count(jnp.where(writer, old, NO_BLOCK), n_blocks)
    row = jnp.broadcast_to(jnp.arange(old.shape[0], dtype=i32)[:, None], old.shape)
    last_writer = jnp.full(n_blocks, -1, i32).at[
        masked(old, nonhit_writer, n_blocks).ravel()].max(row.ravel(), mode="drop")
    return (nonhit_writer & (refs == take(writers_of, old))
            & (take(last_writer, old) == row))

  return jax.lax.cond(shared, shared_blocks, lambda: nonhit_writer)


def _static_lookahead(num_lookahead_slots) -> int:
  if not isinstance(num_lookahead_slots, int) or num_lookahead_slots < 0:
    raise ValueError("num_lookahead_slots must be a static Python int >= 0, "
                     f"got {num_lookahead_slots!r}")
  return num_lookahead_slots


def _copy_plan(copy, old, new, capacity, ok, status, shared) -> CopyPlan:
  """Compacts the (old, new) pairs of copying entries, in take order.

  Only a writer of a `shared` block copies; most decode steps have none.
  """
  def compact():
    flat = copy.ravel() & ok
    pos = masked(running_count(flat) - 1, flat, capacity)
    pairs = jnp.full((capacity, 2), NO_BLOCK, i32).at[pos].set(
        jnp.stack([old.ravel(), new.ravel()], axis=1), mode="drop")
    return pairs, jnp.sum(flat).astype(i32)

  pairs, count = jax.lax.cond(shared & ok, compact,
                              lambda: (jnp.full((capacity, 2), NO_BLOCK, i32), i32(0)))
  return CopyPlan(src=pairs[:, 0], dst=pairs[:, 1], count=count, status=status)


def _append_identities(state, safe, real, base, n0, k, new_token_ids, width):
  """Identities of the blocks each row fills: hashes, own tokens, level-0 parent."""
  cfg = state.cfg
  bs, m = cfg.block_size, cfg.max_blocks_per_seq
  sh = state.seq_hash
  b, k_cols = new_token_ids.shape
  span = width * bs
  i = jnp.arange(span, dtype=i32)[None, :]
  offset = (n0 - base * bs)[:, None]
  tail = sh.tail_tokens[safe]
  from_new = jnp.take_along_axis(new_token_ids, jnp.clip(i - offset, 0, max(k_cols - 1, 0)), axis=1) \
      if k_cols else jnp.zeros((b, span), i32)
  buf = jnp.where(i < offset, tail[:, jnp.minimum(i, bs - 1)[0]], from_new)
  buf = jnp.where(i < offset + k[:, None], buf, 0)
  prefix, rolling = pc.rolling_hashes(sh.rolling[safe], new_token_ids, k)
  level = jnp.arange(width, dtype=i32)[None, :]
  ends = (base[:, None] + level + 1) * bs
  full = real[:, None] & (ends <= (n0 + k)[:, None]) & (ends > n0[:, None])
  last_new = jnp.clip(ends - n0[:, None] - 1, 0, max(k_cols - 1, 0))
  h = jnp.take_along_axis(prefix, last_new[:, :, None], axis=1) if k_cols else \
      jnp.zeros((b, width, 2), jnp.uint32)
  salt = state.salt[safe]
  hashes = pc.identity_hash(h, salt[:, None], ends, cfg.hash_bits)
  parent0 = jnp.where(base > 0, state.tables[safe, jnp.clip(base - 1, 0, m - 1)], NO_BLOCK)
  n1 = n0 + k
  tail_start = _div(n1, bs) * bs - base * bs
  new_tail = jnp.take_along_axis(buf, jnp.clip(tail_start[:, None] + jnp.arange(bs)[None, :],
                                               0, span - 1), axis=1)
  new_tail = jnp.where(jnp.arange(bs)[None, :] < (n1 - _div(n1, bs) * bs)[:, None], new_tail, 0)
  return dict(hash=hashes, tokens=buf.reshape(b, width, bs), full=full, parent0=parent0,
              rolling=rolling, tail=new_tail, buf=buf)


def _resolve_identities(content, ident, salt, base, width):
  """Pool hits and within-call representatives (`_dedup_rows`) of the blocks rows fill.

  Only rows that fill a block take part. When they are at most an eighth of
  the batch (a decode step; one row of a batch of 4 to 15), they are gathered
  into a batch of that size first, so the lookups and the dedup rounds cost
  what that small batch costs.
  """
  def resolve(ident, salt, base):
    pool_hit, pool_block = pc.lookup_chains(content, ident["hash"], ident["tokens"], salt,
                                            ident["parent0"], ident["full"])
    return pool_hit, pool_block, _dedup_rows(ident, pool_hit, pool_block, salt, base, width)

  b = salt.shape[0]
  capacity = max(1, b // 8) if b >= 4 else 0
  if capacity == 0:
    return resolve(ident, salt, base)
  filling = jnp.any(ident["full"], axis=1)

  def compacted():
    slot = masked(running_count(filling) - 1, filling, capacity)
    rows = jnp.full(capacity, b, i32).at[slot].set(jnp.arange(b, dtype=i32), mode="drop")
    sub = {key: take(value, rows) for key, value in ident.items()}
    sub["full"] &= (rows < b)[:, None]
    hit, block, rep = resolve(sub, take(salt, rows), take(base, rows))
    entry = rows[rep // width] * width + rep % width        # back to the batch's numbering
    return (jnp.zeros((b, width), bool).at[rows].set(hit, mode="drop"),
            jnp.full((b, width), NO_BLOCK, i32).at[rows].set(block, mode="drop"),
            jnp.arange(b * width, dtype=i32).reshape(b, width).at[rows].set(entry, mode="drop"))

  return jax.lax.cond(jnp.sum(filling) <= capacity, compacted,
                      lambda: resolve(ident, salt, base))


def _dedup_rows(ident, pool_hit, pool_block, salt, base, width):
  """For each (row, level) that fills a block, the first entry of the call with its identity.

  Entries resolved by a pool hit map to themselves. Two non-hit entries share
  an identity when they have the same salt, block index and anchor (the last
  pool-hit block before them, else the block before the row's first level)
  and the same tokens from the anchor through their block.
  """
  b = salt.shape[0]
  bs = ident["tokens"].shape[-1]
  level = jnp.broadcast_to(jnp.arange(width, dtype=i32)[None, :], (b, width))
  num_hits = jnp.sum(pool_hit, axis=1)
  last_hit = jnp.take_along_axis(pool_block, jnp.maximum(num_hits - 1, 0)[:, None], axis=1)[:, 0]
  anchor = jnp.where(num_hits > 0, last_hit, ident["parent0"])
  valid = (ident["full"] & ~pool_hit).ravel()
  row = jnp.repeat(jnp.arange(b, dtype=i32), width)
  lvl = level.ravel()
  block_index = (base[:, None] + level).ravel()
  span_start = num_hits[row] * bs            # buffer position after the anchor
  span_end = (lvl + 1) * bs
  buf = ident["buf"]

  def equal(i, j):
    same = ((salt[row[i]] == salt[row[j]]) & (block_index[i] == block_index[j])
            & (anchor[row[i]] == anchor[row[j]]))
    p = jnp.arange(buf.shape[1], dtype=i32)[None, :]
    ti = jnp.take_along_axis(buf[row[i]], jnp.clip(span_start[i][:, None] + p, 0, buf.shape[1] - 1), 1)
    tj = jnp.take_along_axis(buf[row[j]], jnp.clip(span_start[j][:, None] + p, 0, buf.shape[1] - 1), 1)
    in_span = p < (span_end[i] - span_start[i])[:, None]
    return same & jnp.all((ti == tj) | ~in_span, axis=1)

  rep = pc.first_equal(ident["hash"].reshape(-1, 2), equal, valid)
  return rep.reshape(b, width)


def can_append_slots(state: BlockManagerState, seq_ids, num_lookahead_slots: int = 0):
  """Conservative check (as the seed): one new block (+ lookahead) per sequence."""
  lookahead = _static_lookahead(num_lookahead_slots)
  seq_ids = _as_i32(seq_ids).reshape(-1)
  count = jnp.sum(seq_ids != NO_BLOCK)
  return state.gpu.num_free() >= count * (1 + _cdiv(lookahead, state.cfg.block_size))


# ---------------------------------------------------------------------------
# fork, free, reset


def fork(state: BlockManagerState, parent_id, child_id):
  """The child shares the parent's table (one more reference per block)."""
  s = state.cfg.max_seqs
  parent, child = _as_i32(parent_id), _as_i32(child_id)
  invalid = (parent < 0) | (parent >= s) | (child < 0) | (child >= s) | (parent == child)
  p, c = jnp.clip(parent, 0, s - 1), jnp.clip(child, 0, s - 1)
  status = first_failure((Status.INVALID_ARGUMENT, invalid),
                         (Status.NOT_ALLOCATED, state.device[p] == EMPTY),
                         (Status.ALREADY_ALLOCATED, state.device[c] != EMPTY))
  ok = status == Status.OK
  row = state.tables[p]
  for on_gpu, dev in ((True, ON_GPU), (False, ON_CPU)):
    pool = _pool(state, on_gpu)
    gains = masked(row, ok & (state.device[p] == dev) & (row >= 0), pool.num_blocks)
    pool = pool.replace(ref_count=pool.ref_count.at[gains].add(1, mode="drop"))
    state = _with_pool(state, on_gpu, pool)
  cs, keep = c[None], ok[None]
  copy_row = lambda a: _set_rows(a, cs, keep, a[p][None])
  state = state.replace(tables=copy_row(state.tables), num_tokens=copy_row(state.num_tokens),
                        device=copy_row(state.device), salt=copy_row(state.salt))
  if state.seq_hash is not None:
    sh = state.seq_hash
    state = state.replace(seq_hash=sh.replace(rolling=copy_row(sh.rolling),
                                              tail_tokens=copy_row(sh.tail_tokens)))
  return state, OpResult(status=status)


def free(state: BlockManagerState, seq_ids):
  """Releases every block of each sequence (last entry first); the slots become empty."""
  s = state.cfg.max_seqs
  seq_ids = _as_i32(seq_ids).reshape(-1)
  real, safe, invalid = _check_ids(seq_ids, s)
  device = state.device[safe]
  status = first_failure((Status.INVALID_ARGUMENT, invalid),
                         (Status.NOT_ALLOCATED, jnp.any(real & (device == EMPTY))))
  ok = status == Status.OK
  rows = state.tables[safe][:, ::-1]
  for on_gpu, dev in ((True, ON_GPU), (False, ON_CPU)):
    releases = jnp.where((real & (device == dev))[:, None], rows, NO_BLOCK).ravel()
    state = _commit(state, on_gpu, ok, num_takes=i32(0),
                    gains=jnp.zeros(0, i32), releases=releases)
  return _clear_slots(state, safe, real & ok), OpResult(status=status)


def _clear_slots(state, safe, keep):
  state = state.replace(
      tables=_set_rows(state.tables, safe, keep, NO_BLOCK),
      num_tokens=_set_rows(state.num_tokens, safe, keep, 0),
      device=_set_rows(state.device, safe, keep, EMPTY),
      salt=_set_rows(state.salt, safe, keep, 0))
  if state.seq_hash is not None:
    sh = state.seq_hash
    state = state.replace(seq_hash=sh.replace(
        rolling=_set_rows(sh.rolling, safe, keep, jnp.array([0, 0, 1, 1], jnp.uint32)),
        tail_tokens=_set_rows(sh.tail_tokens, safe, keep, 0)))
  return state


def reset(state: BlockManagerState) -> BlockManagerState:
  """Frees every occupied slot in slot order; cached content and counters stay."""
  slots = jnp.arange(state.cfg.max_seqs, dtype=i32)
  state, _ = free(state, jnp.where(state.device != EMPTY, slots, NO_BLOCK))
  return state


# ---------------------------------------------------------------------------
# swaps


def _swap(state: BlockManagerState, seq_ids, to_gpu: bool):
  """Moves a group between pools: shared blocks move once; hits in the destination are shared."""
  cfg = state.cfg
  s, m = cfg.max_seqs, cfg.max_blocks_per_seq
  src_pool, dst_pool = _pool(state, not to_gpu), _pool(state, to_gpu)
  seq_ids = _as_i32(seq_ids).reshape(-1)
  b = seq_ids.shape[0]
  real, safe, invalid = _check_ids(seq_ids, s)
  device = state.device[safe]
  src_dev = ON_CPU if to_gpu else ON_GPU
  rows = jnp.where(real[:, None], state.tables[safe], NO_BLOCK)
  flat = rows.ravel()
  pos = jnp.arange(b * m, dtype=i32)
  first_pos = jnp.full(src_pool.num_blocks, b * m, i32).at[
      masked(flat, flat >= 0, src_pool.num_blocks)].min(pos, mode="drop")
  is_first = (flat >= 0) & (take(first_pos, flat) == pos)
  hit = jnp.zeros(b * m, bool)
  hit_block = jnp.full(b * m, NO_BLOCK, i32)
  content = src_pool.content
  if content is not None:   # (then the destination has a content index too, or no blocks)
    has = (flat >= 0) & take(content.has_content, flat)
    src = flat
    hashes = take(content.hash, src).reshape(b, m, 2)
    tokens = take(content.tokens, src).reshape(b, m, -1)
    salts = state.salt[safe]
    looked = has.reshape(b, m)
    chain_hit, chain_block = pc.lookup_chains(dst_pool.content, hashes, tokens, salts,
                                              jnp.full(b, NO_BLOCK, i32), _prefix_mask(looked))
    hit = chain_hit.ravel() & is_first
    hit_block = jnp.where(hit, chain_block.ravel(), NO_BLOCK)
  need_take = is_first & ~hit
  take_count, num_takes = running_count_and_total(need_take)
  revived = _revived(dst_pool, hit_block)
  short = num_takes > dst_pool.num_free() - revived
  status = first_failure(
      (Status.INVALID_ARGUMENT, invalid),
      (Status.NOT_ALLOCATED, jnp.any(real & (device == EMPTY))),
      (Status.WRONG_DEVICE, jnp.any(real & (device != EMPTY) & (device != src_dev))),
      (Status.OUT_OF_BLOCKS if to_gpu else Status.SWAP_SPACE_EXHAUSTED, short))
  ok = status == Status.OK
  capacity = b * m
  taken, evicted = taken_blocks(dst_pool, num_takes, capacity, hit_block)
  rank = jnp.clip(take_count - 1, 0, max(capacity - 1, 0))
  first_dst = jnp.where(hit, hit_block, jnp.where(need_take, taken[rank], NO_BLOCK))
  dst_of = jnp.full(src_pool.num_blocks, NO_BLOCK, i32).at[
      masked(flat, is_first, src_pool.num_blocks)].set(first_dst, mode="drop")
  new_flat = jnp.where(flat >= 0, take(dst_of, flat, NO_BLOCK), NO_BLOCK)
  registrations = None
  if content is not None:
    new_rows = new_flat.reshape(b, m)
    prev = jnp.concatenate([jnp.full((b, 1), NO_BLOCK, i32), new_rows[:, :-1]], axis=1).ravel()
    registrations = dict(
        reg_blocks=jnp.where(need_take & has, new_flat, NO_BLOCK), reg_hash=hashes.reshape(-1, 2),
        reg_parent=prev, reg_salt=take(content.salt, src), reg_tokens=tokens.reshape(b * m, -1),
        reg_hashed=take(content.num_hashed_tokens, src))
  state = _commit(state, to_gpu, ok, num_takes=num_takes,
                  gains=new_flat, releases=jnp.zeros(0, i32),
                  taken=taken, taken_valid=jnp.arange(capacity) < num_takes, evicted=evicted,
                  revived=revived, registrations=registrations)
  state = _commit(state, not to_gpu, ok, num_takes=i32(0),
                  gains=jnp.zeros(0, i32), releases=flat)
  keep = real & ok
  state = state.replace(tables=_set_rows(state.tables, safe, keep, new_flat.reshape(b, m)),
                        device=_set_rows(state.device, safe, keep, ON_GPU if to_gpu else ON_CPU))
  if content is not None and to_gpu:
    looked_up = jnp.sum(is_first & has)
    state = state.replace(num_lookups=state.num_lookups + jnp.where(ok, looked_up, 0),
                          num_hits=state.num_hits + jnp.where(ok, jnp.sum(hit), 0))
  plan_pos = masked(take_count - 1, need_take & ok, capacity)
  plan = SwapPlan(src=jnp.full(capacity, NO_BLOCK, i32).at[plan_pos].set(flat, mode="drop"),
                  dst=jnp.full(capacity, NO_BLOCK, i32).at[plan_pos].set(new_flat, mode="drop"),
                  count=jnp.where(ok, num_takes, 0), status=status)
  return state, plan


def _prefix_mask(mask: jax.Array) -> jax.Array:
  """Keeps each row's leading run of True."""
  return jnp.cumprod(mask.astype(i32), axis=1).astype(bool)


def _distinct_blocks(state: BlockManagerState, seq_ids, on_gpu: bool) -> jax.Array:
  """Distinct blocks held by the sequences of the group that live on that device."""
  s = state.cfg.max_seqs
  seq_ids = _as_i32(seq_ids).reshape(-1)
  safe = jnp.clip(seq_ids, 0, s - 1)
  there = (seq_ids >= 0) & (seq_ids < s) & (state.device[safe] == (ON_GPU if on_gpu else ON_CPU))
  rows = jnp.where(there[:, None], state.tables[safe], NO_BLOCK)
  return jnp.sum(scatter_count(rows, _pool(state, on_gpu).num_blocks) > 0)


def can_swap_out(state: BlockManagerState, seq_ids) -> jax.Array:
  """Whether the CPU pool has a free block for every distinct block of the group."""
  return _distinct_blocks(state, seq_ids, True) <= state.cpu.num_free()


def can_swap_in(state: BlockManagerState, seq_ids, num_lookahead_slots: int = 0) -> jax.Array:
  """AllocStatus of swapping the group back in (distinct blocks + growth per sequence)."""
  cfg = state.cfg
  lookahead = _static_lookahead(num_lookahead_slots)
  seq_ids = _as_i32(seq_ids).reshape(-1)
  num_seqs = jnp.sum(seq_ids != NO_BLOCK)
  required = (_distinct_blocks(state, seq_ids, False)
              + num_seqs * (1 + _cdiv(lookahead, cfg.block_size)))
  never = cfg.num_gpu_blocks < required
  ok = state.gpu.num_free() - required >= cfg.watermark_blocks
  return jnp.where(never, i32(AllocStatus.NEVER),
                   jnp.where(ok, i32(AllocStatus.OK), i32(AllocStatus.LATER)))


# ---------------------------------------------------------------------------
# queries and prefix-cache bookkeeping


def get_block_tables(state: BlockManagerState, seq_ids) -> jax.Array:
  s = state.cfg.max_seqs
  seq_ids = _as_i32(seq_ids).reshape(-1)
  real = (seq_ids >= 0) & (seq_ids < s)
  return jnp.where(real[:, None], state.tables[jnp.clip(seq_ids, 0, s - 1)], NO_BLOCK)


def get_num_tokens(state: BlockManagerState, seq_ids) -> jax.Array:
  s = state.cfg.max_seqs
  seq_ids = _as_i32(seq_ids).reshape(-1)
  real = (seq_ids >= 0) & (seq_ids < s)
  return jnp.where(real, state.num_tokens[jnp.clip(seq_ids, 0, s - 1)], 0)


def get_slot_mapping(state: BlockManagerState, seq_ids, num_new, width: int) -> jax.Array:
  """int32[B, width]: cache slots of each sequence's last `num_new` tokens, -1 padding."""
  cfg = state.cfg
  s, bs, m = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = _as_i32(seq_ids).reshape(-1)
  real = (seq_ids >= 0) & (seq_ids < s)
  safe = jnp.clip(seq_ids, 0, s - 1)
  n = jnp.where(real & (state.device[safe] == ON_GPU), state.num_tokens[safe], 0)
  count = jnp.clip(_as_i32(num_new).reshape(-1), 0, n)
  col = jnp.arange(width, dtype=i32)[None, :]
  position = (n - count)[:, None] + col
  block = state.tables[safe[:, None], jnp.clip(position // bs, 0, m - 1)]
  ok = (col < count[:, None]) & (block >= 0)
  if cfg.sliding_window is not None:
    ok &= position >= (n - cfg.sliding_window)[:, None]
  return jnp.where(ok, block * bs + position % bs, NO_BLOCK)


def access_all_blocks_in_seq(state: BlockManagerState, seq_id, now) -> BlockManagerState:
  """Sets last_accessed = max(last_accessed, now) on every block of the table."""
  if not state.cfg.enable_prefix_caching:
    return state
  s = state.cfg.max_seqs
  seq, now = _as_i32(seq_id), _as_i32(now)
  safe = jnp.clip(seq, 0, s - 1)
  row = state.tables[safe]
  for on_gpu, dev in ((True, ON_GPU), (False, ON_CPU)):
    pool = _pool(state, on_gpu)
    if pool.content is None:    # no blocks
      continue
    hit = (row >= 0) & (seq >= 0) & (seq < s) & (state.device[safe] == dev)
    c = pool.content
    c = c.replace(last_accessed=c.last_accessed.at[masked(row, hit, pool.num_blocks)].max(
        now, mode="drop"))
    state = _with_pool(state, on_gpu, pool.replace(content=c))
  return state


def mark_blocks_as_computed(state: BlockManagerState, seq_ids, num_computed_tokens):
  """Marks blocks 0 .. min(c, num_tokens) // block_size - 1 of GPU sequences computed."""
  cfg = state.cfg
  if state.gpu.content is None:
    return state
  s, bs, m = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = _as_i32(seq_ids).reshape(-1)
  c = jnp.broadcast_to(_as_i32(num_computed_tokens), seq_ids.shape)
  real = (seq_ids >= 0) & (seq_ids < s)
  safe = jnp.clip(seq_ids, 0, s - 1)
  upto = jnp.minimum(c, state.num_tokens[safe]) // bs
  rows = state.tables[safe]
  mark = (real & (state.device[safe] == ON_GPU))[:, None] & (jnp.arange(m)[None, :] < upto[:, None])
  gpu = state.gpu
  cont = gpu.content
  cont = cont.replace(computed=cont.computed.at[masked(rows, mark & (rows >= 0),
                                                       gpu.num_blocks)].set(True, mode="drop"))
  return state.replace(gpu=gpu.replace(content=cont))


def get_common_computed_block_ids(state: BlockManagerState, seq_ids):
  """(int32[max_blocks_per_seq] ids padded with -1, count) common to all sequences."""
  cfg = state.cfg
  s, bs, m = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = _as_i32(seq_ids).reshape(-1)
  if state.gpu.content is None:
    return jnp.full(m, NO_BLOCK, i32), i32(0)
  real = (seq_ids >= 0) & (seq_ids < s)
  safe = jnp.clip(seq_ids, 0, s - 1)
  n = state.num_tokens[safe]
  rows = state.tables[safe]
  j = jnp.arange(m)[None, :]
  computed = state.gpu.content.computed[jnp.maximum(rows, 0)] & (rows >= 0)
  on_gpu = (state.device[safe] == ON_GPU) & (n >= 1)
  keep = computed & (j < ((n - 1) // bs)[:, None]) & on_gpu[:, None]
  pos = masked(jnp.cumsum(keep, axis=1) - 1, keep, m)
  lists = jnp.full_like(rows, NO_BLOCK).at[jnp.arange(rows.shape[0])[:, None], pos].set(
      rows, mode="drop")
  lengths = jnp.sum(keep, axis=1)
  first = jnp.argmax(real)
  agree = (lists == lists[first][None, :]) & (j < lengths[:, None])
  run = jnp.sum(jnp.cumprod(agree, axis=1), axis=1)
  count = jnp.min(jnp.where(real, run, m))
  count = jnp.where(jnp.any(real), count, 0).astype(i32)
  return jnp.where(jnp.arange(m) < count, lists[first], NO_BLOCK), count


def prefix_cache_hit_rate(state: BlockManagerState) -> jax.Array:
  if not state.cfg.enable_prefix_caching:
    return jnp.float32(-1.0)
  return jnp.where(state.num_lookups > 0,
                   state.num_hits / jnp.maximum(state.num_lookups, 1), 0.0).astype(jnp.float32)


# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSpaceManager:
  """vLLM's block space manager as pure functions of a `BlockManagerState`.

  Hashable (its only field is the static config), so its methods can be
  closed over or passed to `jax.jit`. Every method takes the state and returns
  new values; sequence ids are int32 arrays with -1 as padding.

  Example:
    bm = BlockSpaceManager(CacheConfig(block_size=16, num_gpu_blocks=256))
    state = bm.init()
    state, res = jax.jit(bm.allocate)(state, jnp.array([0, 1]), prompt, len(prompt))
    state, cow = bm.append_slots(state, jnp.array([0, 1]), next_tokens[:, None],
                                 jnp.ones(2, jnp.int32))
  """

  cfg: CacheConfig

  def init(self) -> BlockManagerState:
    return init_state(self.cfg)

  can_allocate = staticmethod(can_allocate)
  allocate = staticmethod(allocate)
  can_append_slots = staticmethod(can_append_slots)
  append_slots = staticmethod(append_slots)
  fork = staticmethod(fork)
  free = staticmethod(free)
  reset = staticmethod(reset)
  can_swap_out = staticmethod(can_swap_out)
  can_swap_in = staticmethod(can_swap_in)
  get_block_tables = staticmethod(get_block_tables)
  get_num_tokens = staticmethod(get_num_tokens)
  get_slot_mapping = staticmethod(get_slot_mapping)
  access_all_blocks_in_seq = staticmethod(access_all_blocks_in_seq)
  mark_blocks_as_computed = staticmethod(mark_blocks_as_computed)
  get_common_computed_block_ids = staticmethod(get_common_computed_block_ids)
  prefix_cache_hit_rate = staticmethod(prefix_cache_hit_rate)

  @staticmethod
  def swap_out(state: BlockManagerState, seq_ids):
    """Moves a group from the GPU pool to the CPU pool; the SwapPlan lists (gpu, cpu) pairs."""
    return _swap(state, seq_ids, to_gpu=False)

  @staticmethod
  def swap_in(state: BlockManagerState, seq_ids):
    """Moves a group from the CPU pool to the GPU pool; the SwapPlan lists (cpu, gpu) pairs."""
    return _swap(state, seq_ids, to_gpu=True)

  @staticmethod
  def get_block_table(state: BlockManagerState, seq_id) -> jax.Array:
    return get_block_tables(state, _as_i32(seq_id)[None])[0]

  @staticmethod
  def num_free_gpu_blocks(state: BlockManagerState) -> jax.Array:
    return state.gpu.num_free()

  @staticmethod
  def num_free_cpu_blocks(state: BlockManagerState) -> jax.Array:
    return state.cpu.num_free()

