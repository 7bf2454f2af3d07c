"""Swaps: a group of sequences moves between the GPU pool and the CPU pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.block_manager import prefix_cache
from paged_jax.block_manager.arguments import check_ids, seq_id_array
from paged_jax.block_manager.commit import (
  commit,
  keeps_content,
  lost_by_takes,
  pool_of,
  revived_hits,
)
from paged_jax.block_manager.pool import masked, plan_takes, take
from paged_jax.block_manager.state import (
  EMPTY,
  NO_BLOCK,
  ON_CPU,
  ON_GPU,
  BlockManagerState,
  SwapPlan,
  first_failure,
)
from paged_jax.block_manager.tables import prefix_mask, set_rows
from paged_jax.config import Status

i32 = jnp.int32


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


def swap_in(state: BlockManagerState, seq_ids):
  """Moves a group from the CPU pool to the GPU pool.

  Like `swap_out` the other way; with caching, the GPU lookups count for
  the hit rate.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.

  Returns:
    (new state, SwapPlan) of (cpu block, gpu block) pairs; status OK or the
    first of INVALID_ARGUMENT, NOT_ALLOCATED, WRONG_DEVICE (a sequence on
    the GPU), OUT_OF_BLOCKS. A failed call changes nothing.

  Raises:
    ValueError: `seq_ids` is not a 1-D integer array (static).
  """
  return _swap(state, seq_ids, to_gpu=True)


def _swap(state: BlockManagerState, seq_ids, to_gpu: bool):
  """Moves a group between pools: shared blocks move once; hits in the destination are shared."""
  cfg = state.cfg
  max_blocks = cfg.max_blocks_per_seq
  src_pool, dst_pool = pool_of(state, not to_gpu), pool_of(state, to_gpu)
  seq_ids = seq_id_array(seq_ids)
  batch = seq_ids.shape[0]
  num_entries = batch * max_blocks
  real, safe, invalid = check_ids(seq_ids, cfg.max_seqs)
  device = state.device[safe]
  src_device = ON_CPU if to_gpu else ON_GPU
  rows = jnp.where(real[:, None], state.tables[safe], NO_BLOCK)
  flat = rows.ravel()
  pos = jnp.arange(num_entries, dtype=i32)
  first_pos = (
    jnp.full(src_pool.num_blocks, num_entries, i32)
    .at[masked(flat, flat >= 0, src_pool.num_blocks)]
    .min(pos, mode="drop")
  )
  is_first = (flat >= 0) & (take(first_pos, flat) == pos)
  hit = jnp.zeros(num_entries, bool)
  hit_block = jnp.full(num_entries, NO_BLOCK, i32)
  content = src_pool.content
  if content is not None:  # (then the destination has a content index too, or no blocks)
    has = (flat >= 0) & take(content.has_content, flat)
    hashes = take(content.hash, flat).reshape(batch, max_blocks, 2)
    tokens = take(content.tokens, flat).reshape(batch, max_blocks, -1)
    salts = state.salt[safe]
    looked = has.reshape(batch, max_blocks)
    chain_hit, chain_block = prefix_cache.lookup_chains(
      dst_pool.content,
      hashes,
      tokens,
      salts,
      jnp.full(batch, NO_BLOCK, i32),
      prefix_mask(looked),
    )
    if state.window_rules:
      # A block several tables hold hits if any table's walk reaches it.
      chain_hit, chain_block = _hit_anywhere(flat, chain_hit.ravel(), chain_block.ravel(), src_pool)
    hit = chain_hit.ravel() & is_first
    hit_block = jnp.where(hit, chain_block.ravel(), NO_BLOCK)
  need_take = is_first & ~hit
  takes = plan_takes(dst_pool, need_take, hit_block, revived_hits(dst_pool, hit_block))
  lost = lost_by_takes(state, dst_pool, takes)
  status = first_failure(
    (Status.INVALID_ARGUMENT, invalid),
    (Status.NOT_ALLOCATED, jnp.any(real & (device == EMPTY))),
    (Status.WRONG_DEVICE, jnp.any(real & (device != EMPTY) & (device != src_device))),
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
    new_rows = new_flat.reshape(batch, max_blocks)
    prev = jnp.concatenate([jnp.full((batch, 1), NO_BLOCK, i32), new_rows[:, :-1]], axis=1).ravel()
    registered = need_take & has
    if lost is not None:
      registered, prev = _registered_moves(
        flat, new_flat, prev, registered, hit, dst_pool, lost, src_pool.num_blocks, max_blocks
      )
    registrations = prefix_cache.Registrations(
      blocks=jnp.where(registered, new_flat, NO_BLOCK),
      hash=hashes.reshape(-1, 2),
      parent=prev,
      salt=take(content.salt, flat),
      tokens=tokens.reshape(num_entries, -1),
      num_hashed_tokens=take(content.num_hashed_tokens, flat),
    )
  state = commit(
    state,
    to_gpu,
    ok,
    gains=new_flat,
    releases=jnp.zeros(0, i32),
    takes=takes,
    registrations=registrations,
    lost=lost,
  )
  state = commit(state, not to_gpu, ok, gains=jnp.zeros(0, i32), releases=flat)
  keep = real & ok
  state = state.replace(
    tables=set_rows(state.tables, safe, keep, new_flat.reshape(batch, max_blocks)),
    device=set_rows(state.device, safe, keep, ON_GPU if to_gpu else ON_CPU),
  )
  if content is not None and to_gpu:
    looked_up = jnp.sum(is_first & has)
    state = state.replace(
      num_lookups=state.num_lookups + jnp.where(ok, looked_up, 0),
      num_hits=state.num_hits + jnp.where(ok, jnp.sum(hit), 0),
    )
  plan_pos = masked(takes.rank, need_take & ok, num_entries)
  plan = SwapPlan(
    src=jnp.full(num_entries, NO_BLOCK, i32).at[plan_pos].set(flat, mode="drop"),
    dst=jnp.full(num_entries, NO_BLOCK, i32).at[plan_pos].set(new_flat, mode="drop"),
    count=jnp.where(ok, takes.count, 0),
    status=status,
  )
  return state, plan


def _hit_anywhere(flat, chain_hit, chain_block, src_pool):
  """Each entry's lookup answer for its source block from any table that reached it.

  Args:
    flat: int32[E] source blocks of the group's tables, row-major (-1: none).
    chain_hit, chain_block: bool[E], int32[E]: each table's left-to-right hits.
    src_pool: the source pool.

  Returns:
    (bool[E], int32[E]): whether some table's walk hit the entry's block, and where.
  """
  num_blocks = src_pool.num_blocks
  where_hit = masked(flat, chain_hit, num_blocks)
  hit_of = jnp.zeros(num_blocks, bool).at[where_hit].set(True, mode="drop")
  block_of = jnp.full(num_blocks, NO_BLOCK, i32).at[where_hit].max(chain_block, mode="drop")
  hit = (flat >= 0) & take(hit_of, flat, False)
  return hit, jnp.where(hit, take(block_of, flat, NO_BLOCK), NO_BLOCK)


def _registered_moves(flat, new_flat, prev, moved, hit, dst_pool, lost, num_src, max_blocks):
  """Which moved blocks register in the destination, and under which parent (window rules).

  A moved block with content registers when, in some table of the group, it
  is block 0 or the entry before it holds a block with content in the
  destination: a hit that keeps its content, or a moved block registered in
  turn. Along a table, a moved block after a run of moved blocks registers
  if the run's first parent has content (a running maximum finds the entry
  before the run) or a block of the run registers through another table;
  the tables exchange their answers through the source block ids until
  nothing changes (one round unless they share blocks).

  Args:
    flat, new_flat: int32[E] source and destination block of each entry (-1: none).
    prev: int32[E] the destination block of the entry before (-1: none).
    moved: bool[E] first entries of moved blocks with content.
    hit: bool[E] first entries of blocks hit in the destination.
    dst_pool: the destination pool at the start of the call.
    lost: bool[N_dst] blocks whose content the call's evictions take.
    num_src: blocks of the source pool.
    max_blocks: entries per table.

  Returns:
    (registered bool[E], parent int32[E]) at the first entries of moved blocks.
  """
  shape = (flat.shape[0] // max_blocks, max_blocks)
  per_block = lambda mask: (
    jnp.zeros(num_src, bool).at[masked(flat, mask, num_src)].set(True, mode="drop")
  )
  of_entries = lambda blocks: take(blocks, flat, False) & (flat >= 0)
  own = of_entries(per_block(moved)).reshape(shape)
  kept = (of_entries(per_block(hit)) & keeps_content(dst_pool, new_flat, lost)).reshape(shape)
  col = jnp.broadcast_to(jnp.arange(max_blocks, dtype=i32)[None, :], shape)
  run_parent = jax.lax.cummax(jnp.where(own, -1, col), axis=1)  # the entry before each run
  parent_kept = jnp.where(
    run_parent >= 0, jnp.take_along_axis(kept, jnp.maximum(run_parent, 0), axis=1), True
  )

  def step(carry):
    registered, _ = carry
    elsewhere = own & of_entries(registered).reshape(shape)
    count = jnp.cumsum(elsewhere.astype(i32), axis=1)
    before_run = jnp.where(
      run_parent >= 0, jnp.take_along_axis(count, jnp.maximum(run_parent, 0), axis=1), 0
    )
    content = own & (parent_kept | (count > before_run))
    updated = per_block(content.ravel())
    return updated, jnp.any(updated != registered)

  registered, _ = jax.lax.while_loop(
    lambda carry: carry[1], step, (jnp.zeros(num_src, bool), jnp.any(moved))
  )
  value = kept | (own & of_entries(registered).reshape(shape))
  before = jnp.concatenate([jnp.ones((shape[0], 1), bool), value[:, :-1]], axis=1)
  qualified = (own & before).ravel()
  parent = (
    jnp.full(num_src, NO_BLOCK, i32).at[masked(flat, qualified, num_src)].max(prev, mode="drop")
  )
  return moved & of_entries(registered), jnp.where(moved, take(parent, flat, NO_BLOCK), NO_BLOCK)
