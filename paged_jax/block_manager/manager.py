"""BlockSpaceManager: vLLM's v1 block manager as pure, batched, jittable functions.

Every mutating call works in phases (docs/semantics.md: lookups, copy-on-write
decisions, takes, releases, registration) over the whole batch at once:
takes are ranked with a cumsum, releases are an ordered event list, and all
writes are scatters masked by the call's status, so a failed call returns the
state it was given.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.block_manager import prefix_cache as pc
from paged_jax.block_manager.pool import (
  Takes,
  commit_pool,
  masked,
  no_takes,
  plan_takes,
  running_count,
  scatter_count,
  take,
)
from paged_jax.block_manager.state import (
  EMPTY,
  NO_BLOCK,
  ON_CPU,
  ON_GPU,
  AllocateResult,
  BlockManagerState,
  CopyPlan,
  OpResult,
  Pool,
  SwapPlan,
  first_failure,
  init_state,
)
from paged_jax.config import AllocStatus, CacheConfig, Status

i32 = jnp.int32


def static_args(*names: str):
  """Declares an op's static arguments (`jax.jit`'s `static_argnames`) beside it."""

  def mark(op):
    op.static_argnames = names
    return op

  return mark


def jit_op(op):
  """`jax.jit` of a block-manager op, with the static arguments it declares."""
  return jax.jit(op, static_argnames=getattr(op, "static_argnames", ()))


def _int_array(name: str, value, shape: tuple) -> jax.Array:
  """`value` as an int32 array, after checking its static dtype and shape.

  Args:
    name: the argument's name, for the message.
    value: an integer array (or Python ints).
    shape: the expected shape; None for a dimension of any size.

  Raises:
    ValueError: naming the argument, when its dtype is not an integer type
      (a float would be truncated) or its shape is not `shape`.
  """
  array = jnp.asarray(value)
  if not jnp.issubdtype(array.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {array.dtype}")
  if array.ndim != len(shape) or any(
    want not in (None, got) for want, got in zip(shape, array.shape)
  ):
    raise ValueError(f"{name} must have shape {_dims(shape)}, got {_dims(array.shape)}")
  return array.astype(i32)


def _dims(shape) -> str:
  """A shape as text, `n` for any size: [4, n]."""
  return "[" + ", ".join("n" if d is None else str(d) for d in shape) + "]"


def _seq_ids(seq_ids) -> jax.Array:
  """int32[B] sequence ids (-1 padding); ValueError unless a 1-D integer array."""
  return _int_array("seq_ids", seq_ids, (None,))


def _scalar(name: str, value) -> jax.Array:
  """An int32 scalar; ValueError unless an integer scalar."""
  return _int_array(name, value, ())


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
    packed = packed | (mask.astype(i32) << i)  # broadcasting: masks may differ in shape
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
  return jnp.sum(
    counted & take(pool.content.has_content, pins) & (take(pool.ref_count, pins) == 0)
  ).astype(i32)


def _commit(
  state: BlockManagerState,
  on_gpu: bool,
  ok: jax.Array,
  *,
  gains: jax.Array,
  releases: jax.Array,
  takes: Takes | None = None,
  registrations: pc.Registrations | None = None,
  gain_weight=1,
  may_release: jax.Array | None = None,
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
  """
  pool = _pool(state, on_gpu)
  takes = no_takes() if takes is None else takes
  new_pool, pushed = commit_pool(
    pool,
    ok,
    num_takes=takes.count,
    gains=gains,
    releases=releases,
    gain_weight=gain_weight,
    may_release=may_release,
  )
  if pool.content is not None:
    if registrations is None:
      registrations = pc.Registrations.none(state.cfg.block_size)
    new_pool = pc.commit_content(
      new_pool, ok, takes=takes, releases=releases, pushed=pushed, registrations=registrations
    )
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
  """Gives every sequence of a group the table of one prompt of `num_tokens` tokens.

  With prefix caching, each full block of the prompt is looked up once for the
  group: a hit shares the cached block, a miss takes a block and registers its
  content. Each block gains one reference per sequence of the group.

  Args:
    state: the manager state.
    seq_ids: int32[B] the group's slots, -1 for padding (all padding: a no-op).
    token_ids: int32[T] the prompt, padded to any length.
    num_tokens: int32 scalar, how many of `token_ids` are the prompt.
    salt: int32 scalar; blocks are shared by content only within a salt.

  Returns:
    (new state, AllocateResult): `status` is OK or the first of
    INVALID_ARGUMENT (bad or repeated id, `num_tokens` outside 0..T),
    ALREADY_ALLOCATED, TABLE_FULL, OUT_OF_BLOCKS; `num_hit_blocks` counts the
    prompt blocks found in the cache (0 without caching or on failure). A
    failed call returns the state unchanged.

  Raises:
    ValueError: an argument of a non-integer dtype or the wrong rank (static).
  """
  cfg = state.cfg
  bs, m, s = cfg.block_size, cfg.max_blocks_per_seq, cfg.max_seqs
  seq_ids = _seq_ids(seq_ids)
  token_ids = _int_array("token_ids", token_ids, (None,))
  n, salt = _scalar("num_tokens", num_tokens), _scalar("salt", salt)
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
    buf = jnp.zeros(m * bs, i32).at[: token_ids.shape[0]].set(token_ids[: m * bs])
    buf = jnp.where(jnp.arange(m * bs) < n, buf, 0)
    block_ends, rolling = pc.prompt_hashes(buf, n, bs)
    ends = (j + 1) * bs
    full = (ends <= n) & (group > 0)
    hashes = pc.identity_hash(block_ends, salt, ends, cfg.hash_bits)
    blk_tokens = buf.reshape(m, bs)
    hit, hit_block = pc.lookup_chains(
      gpu.content,
      hashes[None],
      blk_tokens[None],
      salt[None],
      jnp.array([NO_BLOCK], i32),
      full[None],
    )
    hit, hit_block = hit[0], hit_block[0]
  need_take = live & ~hit
  takes = plan_takes(
    gpu, need_take, hit_block, _revived(gpu, hit_block, distinct=True)
  )  # one chain: distinct blocks
  status = first_failure(
    (Status.INVALID_ARGUMENT, invalid),
    (Status.ALREADY_ALLOCATED, already),
    (Status.TABLE_FULL, table_full),
    (Status.OUT_OF_BLOCKS, takes.exceed(gpu)),
  )
  ok = (status == Status.OK) & (group > 0)
  num_hit_blocks = jnp.where(ok, jnp.sum(hit), 0).astype(i32)
  row = jnp.where(hit, hit_block, takes.block_of(need_take))
  registrations = None
  if cfg.enable_prefix_caching:
    registrations = pc.Registrations(
      blocks=jnp.where(need_take & full, row, NO_BLOCK),
      hash=hashes,
      parent=jnp.concatenate([jnp.array([NO_BLOCK], i32), row[:-1]]),
      salt=jnp.broadcast_to(salt, (m,)),
      tokens=blk_tokens,
      num_hashed_tokens=ends,
    )
  state = _commit(
    state,
    True,
    ok,
    gains=row,
    gain_weight=group,
    releases=jnp.zeros(0, i32),
    takes=takes,
    registrations=registrations,
  )
  keep = real & ok
  state = state.replace(
    tables=_set_rows(state.tables, safe, keep, row[None]),
    num_tokens=_set_rows(state.num_tokens, safe, keep, n),
    device=_set_rows(state.device, safe, keep, ON_GPU),
    salt=_set_rows(state.salt, safe, keep, salt),
  )
  if cfg.enable_prefix_caching:
    tail_start = (n // bs) * bs
    tail = jnp.where(
      jnp.arange(bs) < n - tail_start,
      jax.lax.dynamic_slice(jnp.pad(buf, (0, bs)), (tail_start,), (bs,)),
      0,
    )
    sh = state.seq_hash
    state = state.replace(
      seq_hash=sh.replace(
        rolling=_set_rows(sh.rolling, safe, keep, rolling),
        tail_tokens=_set_rows(sh.tail_tokens, safe, keep, tail[None]),
      ),
      num_lookups=state.num_lookups + jnp.where(ok, jnp.sum(full), 0),
      num_hits=state.num_hits + num_hit_blocks,
    )
  return state, AllocateResult(status=status, num_hit_blocks=num_hit_blocks)


def can_allocate(state: BlockManagerState, num_tokens) -> jax.Array:
  """Whether a prompt of `num_tokens` tokens fits now, later or never.

  Args:
    state: the manager state.
    num_tokens: int32 scalar.

  Returns:
    int32 scalar AllocStatus (prefix hits not counted): NEVER for a negative
    count, a prompt longer than a table, or one that would leave less than
    the watermark free in an empty pool; OK if the free GPU blocks leave the
    watermark after it; else LATER.
  """
  cfg = state.cfg
  n = _scalar("num_tokens", num_tokens)
  required = jnp.maximum(_cdiv(n, cfg.block_size) - _first_live(cfg, n), 0)
  never = (
    (n < 0)
    | (_cdiv(n, cfg.block_size) > cfg.max_blocks_per_seq)
    | (cfg.num_gpu_blocks - required < cfg.watermark_blocks)
  )
  ok = state.gpu.num_free() - required >= cfg.watermark_blocks
  return jnp.where(
    never, i32(AllocStatus.NEVER), jnp.where(ok, i32(AllocStatus.OK), i32(AllocStatus.LATER))
  )


# ---------------------------------------------------------------------------
# append_slots


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
  lookahead = _static_lookahead(num_lookahead_slots)
  seq_ids = _seq_ids(seq_ids)
  b = seq_ids.shape[0]
  new_token_ids = _int_array("new_token_ids", new_token_ids, (b, None))
  num_new = _int_array("num_new", num_new, (b,))
  rows = _append_rows(state, seq_ids, num_new, new_token_ids.shape[1], lookahead)
  gpu = state.gpu

  # Phase 1: lookups; phase 2: copy-on-write decisions.
  found = _append_lookups(state, rows, new_token_ids)
  nonhit_writer = rows.writer & ~found.hit
  copy = nonhit_writer & ~_writes_in_place(
    gpu.ref_count, rows.old, rows.refs, rows.writer, nonhit_writer, rows.shared
  )

  # Phase 3: takes, in array order and logical order within a row.
  need_take = rows.within & rows.live_end & (((rows.old < 0) & ~found.hit) | copy)
  pins = jnp.where(found.hit & (found.pool_block >= 0), found.pool_block, NO_BLOCK)
  takes = plan_takes(gpu, need_take, pins, _revived(gpu, pins))
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
  released = _append_releases(state, rows, copy, found.hit, new_token_ids.shape[1])
  registrations = _append_registrations(state, rows, found, new)
  # Without caching or a window, only copy-on-write releases, and only if a block is shared.
  plain = not cfg.enable_prefix_caching and cfg.sliding_window is None
  state = _commit(
    state,
    True,
    ok,
    gains=jnp.where(need_take | found.hit, new, NO_BLOCK).ravel(),
    releases=released.events,
    takes=takes,
    registrations=registrations,
    may_release=rows.shared if plain else None,
  )
  state = _write_appended_rows(state, rows, found, ok, new, released)
  capacity = b * (_cdiv(new_token_ids.shape[1], cfg.block_size) + 1)
  return state, _copy_plan(copy, rows.old, new, capacity, ok, status, rows.shared)


class _AppendRows(NamedTuple):
  """The rows of an `append_slots` call and the window of table entries each can touch.

  Row i's window is entries `[base[i], base[i] + W)`, which hold every
  position its new tokens and lookahead slots land in.
  """

  real: jax.Array  # bool[B]: not padding, id in range
  safe: jax.Array  # int32[B]: the id clipped into range
  n0: jax.Array  # int32[B]: tokens before the call
  k: jax.Array  # int32[B]: new tokens (0 for padding)
  base: jax.Array  # int32[B]: first entry of the window
  cols: jax.Array  # int32[B, W]: the table entry of each window column
  in_table: jax.Array  # bool[B, W]: cols < max_blocks_per_seq
  within: jax.Array  # bool[B, W]: inside the table after the call (tokens + lookahead)
  old: jax.Array  # int32[B, W]: the blocks the entries hold (-1: none)
  refs: jax.Array  # int32[B, W]: their reference counts
  live_end: jax.Array  # bool[B, W]: inside the sliding window at the end of the call
  writer: jax.Array  # bool[B, W]: a held, live block that receives new tokens
  invalid: jax.Array  # bool scalars: the call's argument and slot checks
  not_allocated: jax.Array
  wrong_device: jax.Array
  table_full: jax.Array
  shared: jax.Array  # bool scalar: some writer's block has other references

  @property
  def n1(self) -> jax.Array:
    """int32[B]: tokens after the call."""
    return self.n0 + self.k


def _append_rows(
  state: BlockManagerState, seq_ids: jax.Array, num_new: jax.Array, num_cols: int, lookahead: int
) -> _AppendRows:
  """Reads each row's window and checks the call's arguments and slots."""
  cfg = state.cfg
  bs, m = cfg.block_size, cfg.max_blocks_per_seq
  real, safe, bad_ids = _check_ids(seq_ids, cfg.max_seqs)
  device = state.device[safe]
  n0 = state.num_tokens[safe]
  bad_count = (num_new < 0) | (num_new > num_cols)
  k = jnp.where(real, jnp.clip(num_new, 0, num_cols), 0)
  n1 = n0 + k
  target_len = _cdiv(n1 + lookahead, bs)
  width = _cdiv(bs - 1 + num_cols + lookahead, bs)
  base = _div(n0, bs)
  cols = base[:, None] + jnp.arange(width, dtype=i32)[None, :]
  in_table = cols < m
  old = jnp.where(in_table & real[:, None], _table_entries(state.tables, safe, cols), NO_BLOCK)
  live_end = cols >= _first_live(cfg, n1)[:, None]
  written = (
    (cols * bs < n1[:, None]) & ((cols + 1) * bs > n0[:, None]) & (k > 0)[:, None] & real[:, None]
  )
  writer = written & live_end & (old >= 0)
  refs = take(state.gpu.ref_count, old)
  bad_count, not_allocated, wrong_device, table_full, shared = _any_each(
    (real & bad_count)[:, None],
    (real & (device == EMPTY))[:, None],
    (real & (device == ON_CPU))[:, None],
    (real & (target_len > m))[:, None],
    writer & (refs > 1),
  )
  return _AppendRows(
    real=real,
    safe=safe,
    n0=n0,
    k=k,
    base=base,
    cols=cols,
    in_table=in_table,
    within=(cols < target_len[:, None]) & in_table & real[:, None],
    old=old,
    refs=refs,
    live_end=live_end,
    writer=writer,
    invalid=bad_ids | bad_count,
    not_allocated=not_allocated,
    wrong_device=wrong_device,
    table_full=table_full,
    shared=shared,
  )


class _AppendLookups(NamedTuple):
  """Phase 1 of `append_slots`: the window entries resolved by a prefix-cache hit."""

  hit: jax.Array  # bool[B, W]: a pool hit or an identity an earlier row takes
  pool_hit: jax.Array  # bool[B, W]
  pool_block: jax.Array  # int32[B, W]: the pool hit's block (-1: none)
  call_hit: jax.Array  # bool[B, W]: shares the block of entry `call_rep` of this call
  call_rep: jax.Array | None  # int32[B, W]: flat index of that entry (None without caching)
  ident: _Identities | None

  def shared_blocks(self, new: jax.Array) -> jax.Array:
    """The blocks each entry ends up with, given each entry's own block `new`."""
    if self.call_rep is None:
      return new
    rep_block = new.ravel()[self.call_rep.ravel()].reshape(new.shape)
    return jnp.where(self.pool_hit, self.pool_block, jnp.where(self.call_hit, rep_block, new))


def _append_lookups(
  state: BlockManagerState, rows: _AppendRows, new_token_ids: jax.Array
) -> _AppendLookups:
  """Looks up the blocks rows fill, in the pool and among the call's earlier rows."""
  shape = rows.cols.shape
  if not state.cfg.enable_prefix_caching:
    none = jnp.zeros(shape, bool)
    return _AppendLookups(
      hit=none,
      pool_hit=none,
      pool_block=jnp.full(shape, NO_BLOCK, i32),
      call_hit=none,
      call_rep=None,
      ident=None,
    )
  ident = _append_identities(state, rows, new_token_ids)
  pool_hit, pool_block, call_rep = _resolve_identities(
    state.gpu.content, ident, state.salt[rows.safe], rows.base, shape[1]
  )
  call_hit = ident.full & ~pool_hit & (call_rep != jnp.arange(call_rep.size).reshape(shape))
  return _AppendLookups(
    hit=pool_hit | call_hit,
    pool_hit=pool_hit,
    pool_block=pool_block,
    call_hit=call_hit,
    call_rep=call_rep,
    ident=ident,
  )


class _AppendReleases(NamedTuple):
  """Phase 4 of `append_slots`: the references the call drops, in order."""

  events: jax.Array  # int32[E] blocks released, in order (-1 skipped)
  dead_cols: jax.Array | None  # int32[B, D]: entries that may leave the window (None: no window)
  dies: jax.Array | None  # bool[B, D]: those that do


def _append_releases(
  state: BlockManagerState, rows: _AppendRows, copy: jax.Array, hit: jax.Array, num_cols: int
) -> _AppendReleases:
  """Copy sources and blocks replaced by a hit, then (per row) the blocks that leave the window."""
  cfg = state.cfg
  replaced = (copy | (hit & (rows.old >= 0))) & rows.within
  window_releases = jnp.where(replaced, rows.old, NO_BLOCK)
  if cfg.sliding_window is None:
    return _AppendReleases(events=window_releases.ravel(), dead_cols=None, dies=None)
  dead_cols = (
    _first_live(cfg, rows.n0)[:, None]
    + jnp.arange(num_cols // cfg.block_size + 1, dtype=i32)[None, :]
  )
  dead_old = jnp.where(
    dead_cols < cfg.max_blocks_per_seq, _table_entries(state.tables, rows.safe, dead_cols), NO_BLOCK
  )
  dies = rows.real[:, None] & (dead_cols < _first_live(cfg, rows.n1)[:, None]) & (dead_old >= 0)
  events = jnp.concatenate([window_releases, jnp.where(dies, dead_old, NO_BLOCK)], axis=1)
  return _AppendReleases(events=events.ravel(), dead_cols=dead_cols, dies=dies)


def _append_registrations(
  state: BlockManagerState, rows: _AppendRows, found: _AppendLookups, new: jax.Array
) -> pc.Registrations | None:
  """Phase 5 of `append_slots`: the identities of the blocks rows fill without a hit."""
  ident = found.ident
  if ident is None:
    return None
  b, width = new.shape
  prev = jnp.concatenate([ident.parent0[:, None], new[:, :-1]], axis=1)
  return pc.Registrations(
    blocks=jnp.where(ident.full & ~found.hit, new, NO_BLOCK).ravel(),
    hash=ident.hash.reshape(-1, 2),
    parent=prev.ravel(),
    salt=jnp.broadcast_to(state.salt[rows.safe][:, None], (b, width)).ravel(),
    tokens=ident.tokens.reshape(b * width, -1),
    num_hashed_tokens=((rows.cols + 1) * state.cfg.block_size).ravel(),
  )


def _write_appended_rows(
  state: BlockManagerState,
  rows: _AppendRows,
  found: _AppendLookups,
  ok: jax.Array,
  new: jax.Array,
  released: _AppendReleases,
) -> BlockManagerState:
  """Writes the rows' new table entries, token counts, hash state and hit counters (if `ok`)."""
  keep = ok & rows.real
  changed = keep[:, None] & rows.in_table & (new != rows.old)
  tables = _set_table_entries(state.tables, rows.safe, rows.cols, changed, new)
  if released.dead_cols is not None:
    tables = _set_table_entries(
      tables, rows.safe, released.dead_cols, keep[:, None] & released.dies, NO_BLOCK
    )
  state = state.replace(
    tables=tables, num_tokens=_set_rows(state.num_tokens, rows.safe, keep, rows.n1)
  )
  ident = found.ident
  if ident is None:
    return state
  sh = state.seq_hash
  return state.replace(
    seq_hash=sh.replace(
      rolling=_set_rows(sh.rolling, rows.safe, keep, ident.rolling),
      tail_tokens=_set_rows(sh.tail_tokens, rows.safe, keep, ident.tail),
    ),
    num_lookups=state.num_lookups + jnp.where(ok, jnp.sum(ident.full), 0),
    num_hits=state.num_hits + jnp.where(ok, jnp.sum(found.hit), 0),
  )


def _writes_in_place(ref_count, old, refs, writer, nonhit_writer, shared) -> jax.Array:
  """Which non-hit writers write their block in place instead of copying it.

  vLLM's v1 rule, applied in row order: a block is written in place by the
  last row that writes it, when every reference to it (`refs`, its ref count)
  comes from a row writing it in this call; the other writers copy. Unless
  some writer's block is `shared` (the common decode step), that is every
  non-hit writer, and the block-indexed counts are skipped.
  """
  n_blocks = ref_count.shape[0]

  def shared_blocks():
    writers_of = scatter_count(jnp.where(writer, old, NO_BLOCK), n_blocks)
    row = jnp.broadcast_to(jnp.arange(old.shape[0], dtype=i32)[:, None], old.shape)
    last_writer = (
      jnp.full(n_blocks, -1, i32)
      .at[masked(old, nonhit_writer, n_blocks).ravel()]
      .max(row.ravel(), mode="drop")
    )
    return nonhit_writer & (refs == take(writers_of, old)) & (take(last_writer, old) == row)

  return jax.lax.cond(shared, shared_blocks, lambda: nonhit_writer)


def _static_lookahead(num_lookahead_slots) -> int:
  if not isinstance(num_lookahead_slots, int) or num_lookahead_slots < 0:
    raise ValueError(
      f"num_lookahead_slots must be a static Python int >= 0, got {num_lookahead_slots!r}"
    )
  return num_lookahead_slots


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


class _Identities(NamedTuple):
  """Identities of the blocks the rows of an `append_slots` call fill (window entries)."""

  hash: jax.Array  # uint32[B, W, 2]
  tokens: jax.Array  # int32[B, W, block_size]: each block's own tokens
  full: jax.Array  # bool[B, W]: the entry's block becomes full in this call
  parent0: jax.Array  # int32[B]: the block before the window (-1: none)
  rolling: jax.Array  # uint32[B, 4]: each row's rolling hash state after the call
  tail: jax.Array  # int32[B, block_size]: tokens of the partial last block after it
  buf: jax.Array  # int32[B, W * block_size]: the window's tokens


def _append_identities(
  state: BlockManagerState, rows: _AppendRows, new_token_ids: jax.Array
) -> _Identities:
  """Identities of the blocks each row fills: hashes, own tokens, level-0 parent."""
  cfg = state.cfg
  bs, m = cfg.block_size, cfg.max_blocks_per_seq
  sh = state.seq_hash
  safe, base, n0, k = rows.safe, rows.base, rows.n0, rows.k
  b, k_cols = new_token_ids.shape
  width = rows.cols.shape[1]
  span = width * bs
  i = jnp.arange(span, dtype=i32)[None, :]
  offset = (n0 - base * bs)[:, None]
  tail = sh.tail_tokens[safe]
  from_new = (
    jnp.take_along_axis(new_token_ids, jnp.clip(i - offset, 0, max(k_cols - 1, 0)), axis=1)
    if k_cols
    else jnp.zeros((b, span), i32)
  )
  buf = jnp.where(i < offset, tail[:, jnp.minimum(i, bs - 1)[0]], from_new)
  buf = jnp.where(i < offset + k[:, None], buf, 0)
  prefix, rolling = pc.rolling_hashes(sh.rolling[safe], new_token_ids, k)
  level = jnp.arange(width, dtype=i32)[None, :]
  ends = (base[:, None] + level + 1) * bs
  full = rows.real[:, None] & (ends <= (n0 + k)[:, None]) & (ends > n0[:, None])
  last_new = jnp.clip(ends - n0[:, None] - 1, 0, max(k_cols - 1, 0))
  h = (
    jnp.take_along_axis(prefix, last_new[:, :, None], axis=1)
    if k_cols
    else jnp.zeros((b, width, 2), jnp.uint32)
  )
  salt = state.salt[safe]
  hashes = pc.identity_hash(h, salt[:, None], ends, cfg.hash_bits)
  parent0 = jnp.where(base > 0, state.tables[safe, jnp.clip(base - 1, 0, m - 1)], NO_BLOCK)
  n1 = n0 + k
  tail_start = _div(n1, bs) * bs - base * bs
  new_tail = jnp.take_along_axis(
    buf, jnp.clip(tail_start[:, None] + jnp.arange(bs)[None, :], 0, span - 1), axis=1
  )
  new_tail = jnp.where(jnp.arange(bs)[None, :] < (n1 - _div(n1, bs) * bs)[:, None], new_tail, 0)
  return _Identities(
    hash=hashes,
    tokens=buf.reshape(b, width, bs),
    full=full,
    parent0=parent0,
    rolling=rolling,
    tail=new_tail,
    buf=buf,
  )


def _resolve_identities(content, ident, salt, base, width):
  """Pool hits and within-call representatives (`_dedup_rows`) of the blocks rows fill.

  Only rows that fill a block take part. When they are at most an eighth of
  the batch (a decode step; one row of a batch of 4 to 15), they are gathered
  into a batch of that size first, so the lookups and the dedup rounds cost
  what that small batch costs.
  """

  def resolve(ident, salt, base):
    pool_hit, pool_block = pc.lookup_chains(
      content, ident.hash, ident.tokens, salt, ident.parent0, ident.full
    )
    return pool_hit, pool_block, _dedup_rows(ident, pool_hit, pool_block, salt, base, width)

  b = salt.shape[0]
  capacity = max(1, b // 8) if b >= 4 else 0
  if capacity == 0:
    return resolve(ident, salt, base)
  filling = jnp.any(ident.full, axis=1)

  def compacted():
    slot = masked(running_count(filling) - 1, filling, capacity)
    rows = jnp.full(capacity, b, i32).at[slot].set(jnp.arange(b, dtype=i32), mode="drop")
    sub = jax.tree.map(lambda value: take(value, rows), ident)
    sub = sub._replace(full=sub.full & (rows < b)[:, None])
    hit, block, rep = resolve(sub, take(salt, rows), take(base, rows))
    entry = rows[rep // width] * width + rep % width  # back to the batch's numbering
    return (
      jnp.zeros((b, width), bool).at[rows].set(hit, mode="drop"),
      jnp.full((b, width), NO_BLOCK, i32).at[rows].set(block, mode="drop"),
      jnp.arange(b * width, dtype=i32).reshape(b, width).at[rows].set(entry, mode="drop"),
    )

  return jax.lax.cond(jnp.sum(filling) <= capacity, compacted, lambda: resolve(ident, salt, base))


def _dedup_rows(ident, pool_hit, pool_block, salt, base, width):
  """For each (row, level) that fills a block, the first entry of the call with its identity.

  Entries resolved by a pool hit map to themselves. Two non-hit entries share
  an identity when they have the same salt, block index and anchor (the last
  pool-hit block before them, else the block before the row's first level)
  and the same tokens from the anchor through their block.
  """
  b = salt.shape[0]
  bs = ident.tokens.shape[-1]
  level = jnp.broadcast_to(jnp.arange(width, dtype=i32)[None, :], (b, width))
  num_hits = jnp.sum(pool_hit, axis=1)
  last_hit = jnp.take_along_axis(pool_block, jnp.maximum(num_hits - 1, 0)[:, None], axis=1)[:, 0]
  anchor = jnp.where(num_hits > 0, last_hit, ident.parent0)
  valid = (ident.full & ~pool_hit).ravel()
  row = jnp.repeat(jnp.arange(b, dtype=i32), width)
  lvl = level.ravel()
  block_index = (base[:, None] + level).ravel()
  span_start = num_hits[row] * bs  # buffer position after the anchor
  span_end = (lvl + 1) * bs
  buf = ident.buf

  def equal(i, j):
    same = (
      (salt[row[i]] == salt[row[j]])
      & (block_index[i] == block_index[j])
      & (anchor[row[i]] == anchor[row[j]])
    )
    p = jnp.arange(buf.shape[1], dtype=i32)[None, :]
    ti = jnp.take_along_axis(
      buf[row[i]], jnp.clip(span_start[i][:, None] + p, 0, buf.shape[1] - 1), 1
    )
    tj = jnp.take_along_axis(
      buf[row[j]], jnp.clip(span_start[j][:, None] + p, 0, buf.shape[1] - 1), 1
    )
    in_span = p < (span_end[i] - span_start[i])[:, None]
    return same & jnp.all((ti == tj) | ~in_span, axis=1)

  rep = pc.first_equal(ident.hash.reshape(-1, 2), equal, valid)
  return rep.reshape(b, width)


@static_args("num_lookahead_slots")
def can_append_slots(state: BlockManagerState, seq_ids, num_lookahead_slots: int = 0):
  """Whether one new token per sequence (plus lookahead) surely fits, as vLLM's v1 check.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.
    num_lookahead_slots: static Python int >= 0.

  Returns:
    bool scalar: free GPU blocks >= (1 + ceil(lookahead / block_size)) per
    non-padding id; False if `append_slots` would refuse the group for an
    argument or device error (bad or repeated ids, an empty slot, a sequence
    on the CPU).

  Raises:
    ValueError: `num_lookahead_slots` is not a static int >= 0, or `seq_ids`
      is not a 1-D integer array.
  """
  lookahead = _static_lookahead(num_lookahead_slots)
  seq_ids = _seq_ids(seq_ids)
  count = jnp.sum(seq_ids != NO_BLOCK)
  fits = state.gpu.num_free() >= count * (1 + _cdiv(lookahead, state.cfg.block_size))
  return fits & ~_refuses(state, seq_ids, ON_GPU)


def _refuses(state: BlockManagerState, seq_ids: jax.Array, device: int) -> jax.Array:
  """Whether an op that needs `device` refuses the group: INVALID_ARGUMENT,
  NOT_ALLOCATED or WRONG_DEVICE (bool scalar)."""
  real, safe, invalid = _check_ids(seq_ids, state.cfg.max_seqs)
  return invalid | jnp.any(real & (state.device[safe] != device))


# ---------------------------------------------------------------------------
# fork, free, reset


def fork(state: BlockManagerState, parent_id, child_id):
  """Gives the child the parent's table, token count, salt and device.

  Each block of the table gains one reference, in the pool where it lives (a
  swapped-out parent can be forked). Never takes a block.

  Args:
    state: the manager state.
    parent_id: int32 scalar slot.
    child_id: int32 scalar slot.

  Returns:
    (new state, OpResult): status OK or the first of INVALID_ARGUMENT (an id
    out of range, parent == child), NOT_ALLOCATED (the parent),
    ALREADY_ALLOCATED (the child); a failed call changes nothing.

  Raises:
    ValueError: an id that is not an integer scalar (static).
  """
  s = state.cfg.max_seqs
  parent, child = (
    jnp.where(x < 0, s, x)[None]  # -1 is an id here, not padding
    for x in (_scalar("parent_id", parent_id), _scalar("child_id", child_id))
  )
  return fork_each(state, parent, child)


def fork_each(state: BlockManagerState, parent_ids, child_ids):
  """`fork` of every pair at once: child `i` gets parent `i`'s table.

  Parents are read before any child is written. A parent may have several
  children (beams forking); a child may not be a parent of the same call.

  Args:
    state: the manager state.
    parent_ids: int32[K] slots, -1 where the pair is padding.
    child_ids: int32[K] slots, -1 exactly where `parent_ids` is.

  Returns:
    (new state, OpResult): status OK or the first of INVALID_ARGUMENT (an id
    out of range, padding in one id of a pair only, a repeated child, a child
    that is also a parent), NOT_ALLOCATED (a parent), ALREADY_ALLOCATED (a
    child); a failed call changes nothing.

  Raises:
    ValueError: ids that are not 1-D integer arrays of one length (static).
  """
  s = state.cfg.max_seqs
  parents = _int_array("parent_ids", parent_ids, (None,))
  children = _int_array("child_ids", child_ids, parents.shape)
  pad = parents == NO_BLOCK
  out_of_range = lambda ids: ~pad & ((ids < 0) | (ids >= s))
  p, c = jnp.clip(parents, 0, s - 1), jnp.clip(children, 0, s - 1)
  child_count = scatter_count(jnp.where(pad, NO_BLOCK, children), s)
  parent_count = scatter_count(jnp.where(pad, NO_BLOCK, parents), s)
  invalid = jnp.any(
    out_of_range(parents)
    | out_of_range(children)
    | (pad != (children == NO_BLOCK))
    | (~pad & (parent_count[c] > 0))
  ) | jnp.any(child_count > 1)
  status = first_failure(
    (Status.INVALID_ARGUMENT, invalid),
    (Status.NOT_ALLOCATED, jnp.any(~pad & (state.device[p] == EMPTY))),
    (Status.ALREADY_ALLOCATED, jnp.any(~pad & (state.device[c] != EMPTY))),
  )
  keep = ~pad & (status == Status.OK)
  rows = state.tables[p]
  for on_gpu, dev in ((True, ON_GPU), (False, ON_CPU)):
    pool = _pool(state, on_gpu)
    here = keep & (state.device[p] == dev)
    gains = masked(rows, here[:, None] & (rows >= 0), pool.num_blocks)
    pool = pool.replace(ref_count=pool.ref_count.at[gains.reshape(-1)].add(1, mode="drop"))
    state = _with_pool(state, on_gpu, pool)
  copy_rows = lambda a: _set_rows(a, c, keep, a[p])
  state = state.replace(
    tables=copy_rows(state.tables),
    num_tokens=copy_rows(state.num_tokens),
    device=copy_rows(state.device),
    salt=copy_rows(state.salt),
  )
  if state.seq_hash is not None:
    sh = state.seq_hash
    state = state.replace(
      seq_hash=sh.replace(rolling=copy_rows(sh.rolling), tail_tokens=copy_rows(sh.tail_tokens))
    )
  return state, OpResult(status=status)


def free(state: BlockManagerState, seq_ids):
  """Releases every block of each sequence (last entry first); the slots become empty.

  Works on the GPU and on the CPU; a released block with content goes to the
  evictor, one without to the free stack.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.

  Returns:
    (new state, OpResult): status OK or the first of INVALID_ARGUMENT (bad or
    repeated id), NOT_ALLOCATED (an empty slot); a failed call changes nothing.

  Raises:
    ValueError: `seq_ids` is not a 1-D integer array (static).
  """
  s = state.cfg.max_seqs
  seq_ids = _seq_ids(seq_ids)
  real, safe, invalid = _check_ids(seq_ids, s)
  device = state.device[safe]
  status = first_failure(
    (Status.INVALID_ARGUMENT, invalid), (Status.NOT_ALLOCATED, jnp.any(real & (device == EMPTY)))
  )
  ok = status == Status.OK
  rows = state.tables[safe][:, ::-1]
  for on_gpu, dev in ((True, ON_GPU), (False, ON_CPU)):
    releases = jnp.where((real & (device == dev))[:, None], rows, NO_BLOCK).ravel()
    state = _commit(state, on_gpu, ok, gains=jnp.zeros(0, i32), releases=releases)
  return _clear_slots(state, safe, real & ok), OpResult(status=status)


def _clear_slots(state, safe, keep):
  state = state.replace(
    tables=_set_rows(state.tables, safe, keep, NO_BLOCK),
    num_tokens=_set_rows(state.num_tokens, safe, keep, 0),
    device=_set_rows(state.device, safe, keep, EMPTY),
    salt=_set_rows(state.salt, safe, keep, 0),
  )
  if state.seq_hash is not None:
    sh = state.seq_hash
    state = state.replace(
      seq_hash=sh.replace(
        rolling=_set_rows(sh.rolling, safe, keep, jnp.array([0, 0, 1, 1], jnp.uint32)),
        tail_tokens=_set_rows(sh.tail_tokens, safe, keep, 0),
      )
    )
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
  seq_ids = _seq_ids(seq_ids)
  b = seq_ids.shape[0]
  real, safe, invalid = _check_ids(seq_ids, s)
  device = state.device[safe]
  src_dev = ON_CPU if to_gpu else ON_GPU
  rows = jnp.where(real[:, None], state.tables[safe], NO_BLOCK)
  flat = rows.ravel()
  pos = jnp.arange(b * m, dtype=i32)
  first_pos = (
    jnp.full(src_pool.num_blocks, b * m, i32)
    .at[masked(flat, flat >= 0, src_pool.num_blocks)]
    .min(pos, mode="drop")
  )
  is_first = (flat >= 0) & (take(first_pos, flat) == pos)
  hit = jnp.zeros(b * m, bool)
  hit_block = jnp.full(b * m, NO_BLOCK, i32)
  content = src_pool.content
  if content is not None:  # (then the destination has a content index too, or no blocks)
    has = (flat >= 0) & take(content.has_content, flat)
    src = flat
    hashes = take(content.hash, src).reshape(b, m, 2)
    tokens = take(content.tokens, src).reshape(b, m, -1)
    salts = state.salt[safe]
    looked = has.reshape(b, m)
    chain_hit, chain_block = pc.lookup_chains(
      dst_pool.content, hashes, tokens, salts, jnp.full(b, NO_BLOCK, i32), _prefix_mask(looked)
    )
    hit = chain_hit.ravel() & is_first
    hit_block = jnp.where(hit, chain_block.ravel(), NO_BLOCK)
  need_take = is_first & ~hit
  takes = plan_takes(dst_pool, need_take, hit_block, _revived(dst_pool, hit_block))
  status = first_failure(
    (Status.INVALID_ARGUMENT, invalid),
    (Status.NOT_ALLOCATED, jnp.any(real & (device == EMPTY))),
    (Status.WRONG_DEVICE, jnp.any(real & (device != EMPTY) & (device != src_dev))),
    (Status.OUT_OF_BLOCKS if to_gpu else Status.SWAP_SPACE_EXHAUSTED, takes.exceed(dst_pool)),
  )
  ok = status == Status.OK
  first_dst = jnp.where(hit, hit_block, takes.block_of(need_take))
  dst_of = (
    jnp.full(src_pool.num_blocks, NO_BLOCK, i32)
    .at[masked(flat, is_first, src_pool.num_blocks)]
    .set(first_dst, mode="drop")
  )
  new_flat = jnp.where(flat >= 0, take(dst_of, flat, NO_BLOCK), NO_BLOCK)
  registrations = None
  if content is not None:
    new_rows = new_flat.reshape(b, m)
    prev = jnp.concatenate([jnp.full((b, 1), NO_BLOCK, i32), new_rows[:, :-1]], axis=1).ravel()
    registrations = pc.Registrations(
      blocks=jnp.where(need_take & has, new_flat, NO_BLOCK),
      hash=hashes.reshape(-1, 2),
      parent=prev,
      salt=take(content.salt, src),
      tokens=tokens.reshape(b * m, -1),
      num_hashed_tokens=take(content.num_hashed_tokens, src),
    )
  state = _commit(
    state,
    to_gpu,
    ok,
    gains=new_flat,
    releases=jnp.zeros(0, i32),
    takes=takes,
    registrations=registrations,
  )
  state = _commit(state, not to_gpu, ok, gains=jnp.zeros(0, i32), releases=flat)
  keep = real & ok
  state = state.replace(
    tables=_set_rows(state.tables, safe, keep, new_flat.reshape(b, m)),
    device=_set_rows(state.device, safe, keep, ON_GPU if to_gpu else ON_CPU),
  )
  if content is not None and to_gpu:
    looked_up = jnp.sum(is_first & has)
    state = state.replace(
      num_lookups=state.num_lookups + jnp.where(ok, looked_up, 0),
      num_hits=state.num_hits + jnp.where(ok, jnp.sum(hit), 0),
    )
  capacity = b * m
  plan_pos = masked(takes.rank, need_take & ok, capacity)
  plan = SwapPlan(
    src=jnp.full(capacity, NO_BLOCK, i32).at[plan_pos].set(flat, mode="drop"),
    dst=jnp.full(capacity, NO_BLOCK, i32).at[plan_pos].set(new_flat, mode="drop"),
    count=jnp.where(ok, takes.count, 0),
    status=status,
  )
  return state, plan


def _prefix_mask(mask: jax.Array) -> jax.Array:
  """Keeps each row's leading run of True."""
  return jnp.cumprod(mask.astype(i32), axis=1).astype(bool)


def _distinct_blocks(state: BlockManagerState, seq_ids, on_gpu: bool) -> jax.Array:
  """Distinct blocks held by the sequences of the group that live on that device."""
  s = state.cfg.max_seqs
  seq_ids = _seq_ids(seq_ids)
  safe = jnp.clip(seq_ids, 0, s - 1)
  there = (seq_ids >= 0) & (seq_ids < s) & (state.device[safe] == (ON_GPU if on_gpu else ON_CPU))
  rows = jnp.where(there[:, None], state.tables[safe], NO_BLOCK)
  return jnp.sum(scatter_count(rows, _pool(state, on_gpu).num_blocks) > 0)


def can_swap_out(state: BlockManagerState, seq_ids) -> jax.Array:
  """Whether the CPU pool has a free block for every distinct GPU block of the group.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.

  Returns:
    bool scalar; False if `swap_out` would refuse the group for an argument or
    device error (bad or repeated ids, an empty slot, a sequence on the CPU).

  Raises:
    ValueError: `seq_ids` is not a 1-D integer array.
  """
  seq_ids = _seq_ids(seq_ids)
  fits = _distinct_blocks(state, seq_ids, True) <= state.cpu.num_free()
  return fits & ~_refuses(state, seq_ids, ON_GPU)


@static_args("num_lookahead_slots")
def can_swap_in(state: BlockManagerState, seq_ids, num_lookahead_slots: int = 0) -> jax.Array:
  """Whether the group can come back to the GPU now, later or never.

  `required` = the group's distinct CPU blocks + (1 + ceil(lookahead /
  block_size)) per sequence.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.
    num_lookahead_slots: static Python int >= 0.

  Returns:
    int32 scalar AllocStatus: NEVER if `num_gpu_blocks < required` or if
    `swap_in` would refuse the group for an argument or device error (bad or
    repeated ids, an empty slot, a sequence on the GPU); OK if `required`
    leaves the watermark free; else LATER.

  Raises:
    ValueError: `num_lookahead_slots` is not a static int >= 0, or `seq_ids`
      is not a 1-D integer array.
  """
  cfg = state.cfg
  lookahead = _static_lookahead(num_lookahead_slots)
  seq_ids = _seq_ids(seq_ids)
  num_seqs = jnp.sum(seq_ids != NO_BLOCK)
  required = _distinct_blocks(state, seq_ids, False) + num_seqs * (
    1 + _cdiv(lookahead, cfg.block_size)
  )
  never = (cfg.num_gpu_blocks < required) | _refuses(state, seq_ids, ON_CPU)
  ok = state.gpu.num_free() - required >= cfg.watermark_blocks
  return jnp.where(
    never, i32(AllocStatus.NEVER), jnp.where(ok, i32(AllocStatus.OK), i32(AllocStatus.LATER))
  )


# ---------------------------------------------------------------------------
# queries and prefix-cache bookkeeping


def get_block_tables(state: BlockManagerState, seq_ids) -> jax.Array:
  """int32[B, max_blocks_per_seq]: each sequence's block table, -1 where no block.

  Not checked: padding, an empty slot and an out-of-range id give a row of -1
  (`pj.checked(bm)` raises InvalidArgumentError for an out-of-range id).
  """
  s = state.cfg.max_seqs
  seq_ids = _seq_ids(seq_ids)
  real = (seq_ids >= 0) & (seq_ids < s)
  return jnp.where(real[:, None], state.tables[jnp.clip(seq_ids, 0, s - 1)], NO_BLOCK)


def get_num_tokens(state: BlockManagerState, seq_ids) -> jax.Array:
  """int32[B]: each sequence's token count; 0 for padding, empty slots and out-of-range ids."""
  s = state.cfg.max_seqs
  seq_ids = _seq_ids(seq_ids)
  real = (seq_ids >= 0) & (seq_ids < s)
  return jnp.where(real, state.num_tokens[jnp.clip(seq_ids, 0, s - 1)], 0)


@static_args("width")
def get_slot_mapping(state: BlockManagerState, seq_ids, num_new, width: int) -> jax.Array:
  """int32[B, width]: cache slots of each sequence's last `num_new` tokens, -1 padding.

  A slot is `block * block_size + offset`. Row `i` lists the slots of the
  last `min(num_new[i], num_tokens)` positions in order (the first `width`),
  then -1; positions outside a sliding window, empty slots, swapped-out
  sequences and out-of-range ids give -1 (unchecked; `pj.checked(bm)` raises
  InvalidArgumentError for an out-of-range id).

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.
    num_new: int32[B] tokens per row.
    width: static Python int, the columns of the result.
  """
  cfg = state.cfg
  s, bs, m = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = _seq_ids(seq_ids)
  real = (seq_ids >= 0) & (seq_ids < s)
  safe = jnp.clip(seq_ids, 0, s - 1)
  n = jnp.where(real & (state.device[safe] == ON_GPU), state.num_tokens[safe], 0)
  count = jnp.clip(_int_array("num_new", num_new, seq_ids.shape), 0, n)
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
  seq, now = _scalar("seq_id", seq_id), _scalar("now", now)
  safe = jnp.clip(seq, 0, s - 1)
  row = state.tables[safe]
  for on_gpu, dev in ((True, ON_GPU), (False, ON_CPU)):
    pool = _pool(state, on_gpu)
    if pool.content is None:  # no blocks
      continue
    hit = (row >= 0) & (seq >= 0) & (seq < s) & (state.device[safe] == dev)
    c = pool.content
    c = c.replace(
      last_accessed=c.last_accessed.at[masked(row, hit, pool.num_blocks)].max(now, mode="drop")
    )
    state = _with_pool(state, on_gpu, pool.replace(content=c))
  return state


def mark_blocks_as_computed(state: BlockManagerState, seq_ids, num_computed_tokens):
  """Marks blocks 0 .. min(c, num_tokens) // block_size - 1 of GPU sequences computed."""
  cfg = state.cfg
  if state.gpu.content is None:
    return state
  s, bs, m = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = _seq_ids(seq_ids)
  c = jnp.asarray(num_computed_tokens)
  c = jnp.broadcast_to(
    _int_array("num_computed_tokens", c, () if c.ndim == 0 else seq_ids.shape), seq_ids.shape
  )
  real = (seq_ids >= 0) & (seq_ids < s)
  safe = jnp.clip(seq_ids, 0, s - 1)
  upto = jnp.minimum(c, state.num_tokens[safe]) // bs
  rows = state.tables[safe]
  mark = (real & (state.device[safe] == ON_GPU))[:, None] & (jnp.arange(m)[None, :] < upto[:, None])
  gpu = state.gpu
  cont = gpu.content
  cont = cont.replace(
    computed=cont.computed.at[masked(rows, mark & (rows >= 0), gpu.num_blocks)].set(
      True, mode="drop"
    )
  )
  return state.replace(gpu=gpu.replace(content=cont))


def get_common_computed_block_ids(state: BlockManagerState, seq_ids):
  """(int32[max_blocks_per_seq] ids padded with -1, count) common to all sequences."""
  cfg = state.cfg
  s, bs, m = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = _seq_ids(seq_ids)
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
  lists = (
    jnp.full_like(rows, NO_BLOCK).at[jnp.arange(rows.shape[0])[:, None], pos].set(rows, mode="drop")
  )
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
  return jnp.where(
    state.num_lookups > 0, state.num_hits / jnp.maximum(state.num_lookups, 1), 0.0
  ).astype(jnp.float32)


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
  fork_each = staticmethod(fork_each)
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
    """Moves a group from the GPU pool to the CPU pool.

    Shared blocks move once; with caching, a block whose content the CPU pool
    holds is shared there instead of copied.

    Args:
      state: the manager state.
      seq_ids: int32[B] slots, -1 for padding.

    Returns:
      (new state, SwapPlan): `count` (gpu block, cpu block) pairs to copy
      (capacity `B * max_blocks_per_seq`), and `status`: OK or the first of
      INVALID_ARGUMENT, NOT_ALLOCATED, WRONG_DEVICE (a sequence on the CPU),
      SWAP_SPACE_EXHAUSTED. A failed call changes nothing.

    Raises:
      ValueError: `seq_ids` is not a 1-D integer array (static).
    """
    return _swap(state, seq_ids, to_gpu=False)

  @staticmethod
  def swap_in(state: BlockManagerState, seq_ids):
    """Moves a group from the CPU pool to the GPU pool.

    Like `swap_out` the other way; with caching, the GPU lookups count for
    the hit rate.

    Returns:
      (new state, SwapPlan) of (cpu block, gpu block) pairs; status OK or the
      first of INVALID_ARGUMENT, NOT_ALLOCATED, WRONG_DEVICE (a sequence on
      the GPU), OUT_OF_BLOCKS.
    """
    return _swap(state, seq_ids, to_gpu=True)

  @staticmethod
  def get_block_table(state: BlockManagerState, seq_id) -> jax.Array:
    return get_block_tables(state, _scalar("seq_id", seq_id)[None])[0]

  @staticmethod
  def num_free_gpu_blocks(state: BlockManagerState) -> jax.Array:
    return state.gpu.num_free()

  @staticmethod
  def num_free_cpu_blocks(state: BlockManagerState) -> jax.Array:
    return state.cpu.num_free()
