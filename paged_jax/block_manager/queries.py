"""Queries of a state, and the prefix-cache bookkeeping calls that return only a state.

Queries: can_*, block tables, slot mappings, token and free-block counts, the
hit rate, the common computed blocks. Bookkeeping: access times and computed
marks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.block_manager.arguments import (
  int_array,
  int_scalar,
  refuses,
  seq_id_array,
  static_args,
  static_lookahead,
)
from paged_jax.block_manager.commit import pool_of, with_pool
from paged_jax.block_manager.pool import masked, scatter_count
from paged_jax.block_manager.state import NO_BLOCK, ON_CPU, ON_GPU, BlockManagerState
from paged_jax.block_manager.tables import ceil_div, first_live_block
from paged_jax.config import AllocStatus

i32 = jnp.int32


def _alloc_status(never: jax.Array, ok: jax.Array) -> jax.Array:
  """int32 AllocStatus: NEVER if `never`, else OK if `ok`, else LATER."""
  return jnp.where(
    never, i32(AllocStatus.NEVER), jnp.where(ok, i32(AllocStatus.OK), i32(AllocStatus.LATER))
  )


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
  prompt_len = int_scalar("num_tokens", num_tokens)
  prompt_blocks = ceil_div(prompt_len, cfg.block_size)
  required = jnp.maximum(prompt_blocks - first_live_block(cfg, prompt_len), 0)
  never = (
    (prompt_len < 0)
    | (prompt_blocks > cfg.max_blocks_per_seq)
    | (cfg.num_gpu_blocks - required < cfg.watermark_blocks)
  )
  ok = state.gpu.num_free() - required >= cfg.watermark_blocks
  return _alloc_status(never, ok)


@static_args("num_lookahead_slots")
def can_append_slots(state: BlockManagerState, seq_ids, num_lookahead_slots: int = 0):
  """Whether one new token per sequence (plus lookahead) surely fits, as vLLM 0.6's check.

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
  lookahead = static_lookahead(num_lookahead_slots)
  seq_ids = seq_id_array(seq_ids)
  num_seqs = jnp.sum(seq_ids != NO_BLOCK)
  fits = state.gpu.num_free() >= num_seqs * (1 + ceil_div(lookahead, state.cfg.block_size))
  return fits & ~refuses(state, seq_ids, ON_GPU)


def _distinct_blocks(state: BlockManagerState, seq_ids: jax.Array, on_gpu: bool) -> jax.Array:
  """Distinct blocks held by the sequences of the group that live on that device."""
  max_seqs = state.cfg.max_seqs
  safe = jnp.clip(seq_ids, 0, max_seqs - 1)
  there = (
    (seq_ids >= 0) & (seq_ids < max_seqs) & (state.device[safe] == (ON_GPU if on_gpu else ON_CPU))
  )
  rows = jnp.where(there[:, None], state.tables[safe], NO_BLOCK)
  return jnp.sum(scatter_count(rows, pool_of(state, on_gpu).num_blocks) > 0)


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
  seq_ids = seq_id_array(seq_ids)
  fits = _distinct_blocks(state, seq_ids, True) <= state.cpu.num_free()
  return fits & ~refuses(state, seq_ids, ON_GPU)


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
  lookahead = static_lookahead(num_lookahead_slots)
  seq_ids = seq_id_array(seq_ids)
  num_seqs = jnp.sum(seq_ids != NO_BLOCK)
  required = _distinct_blocks(state, seq_ids, False) + num_seqs * (
    1 + ceil_div(lookahead, cfg.block_size)
  )
  never = (cfg.num_gpu_blocks < required) | refuses(state, seq_ids, ON_CPU)
  ok = state.gpu.num_free() - required >= cfg.watermark_blocks
  return _alloc_status(never, ok)


def num_free_gpu_blocks(state: BlockManagerState) -> jax.Array:
  """int32 scalar: GPU blocks free to take (never used, released, or evictable)."""
  return state.gpu.num_free()


def num_free_cpu_blocks(state: BlockManagerState) -> jax.Array:
  """int32 scalar: CPU blocks free to take (never used, released, or evictable)."""
  return state.cpu.num_free()


def get_block_tables(state: BlockManagerState, seq_ids) -> jax.Array:
  """int32[B, max_blocks_per_seq]: each sequence's block table, -1 where no block.

  Not checked: padding, an empty slot and an out-of-range id give a row of -1
  (`pj.checked(bm)` raises InvalidArgumentError for an out-of-range id).
  """
  max_seqs = state.cfg.max_seqs
  seq_ids = seq_id_array(seq_ids)
  real = (seq_ids >= 0) & (seq_ids < max_seqs)
  return jnp.where(real[:, None], state.tables[jnp.clip(seq_ids, 0, max_seqs - 1)], NO_BLOCK)


def get_block_table(state: BlockManagerState, seq_id) -> jax.Array:
  """int32[max_blocks_per_seq]: one sequence's block table (`get_block_tables` of one id)."""
  return get_block_tables(state, int_scalar("seq_id", seq_id)[None])[0]


def get_num_tokens(state: BlockManagerState, seq_ids) -> jax.Array:
  """int32[B]: each sequence's token count; 0 for padding, empty slots and out-of-range ids."""
  max_seqs = state.cfg.max_seqs
  seq_ids = seq_id_array(seq_ids)
  real = (seq_ids >= 0) & (seq_ids < max_seqs)
  return jnp.where(real, state.num_tokens[jnp.clip(seq_ids, 0, max_seqs - 1)], 0)


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
  max_seqs, block_size, max_blocks = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = seq_id_array(seq_ids)
  real = (seq_ids >= 0) & (seq_ids < max_seqs)
  safe = jnp.clip(seq_ids, 0, max_seqs - 1)
  seq_len = jnp.where(real & (state.device[safe] == ON_GPU), state.num_tokens[safe], 0)
  count = jnp.clip(int_array("num_new", num_new, seq_ids.shape), 0, seq_len)
  col = jnp.arange(width, dtype=i32)[None, :]
  position = (seq_len - count)[:, None] + col
  block = state.tables[safe[:, None], jnp.clip(position // block_size, 0, max_blocks - 1)]
  ok = (col < count[:, None]) & (block >= 0)
  if cfg.sliding_window is not None:
    ok &= position >= (seq_len - cfg.sliding_window)[:, None]
  return jnp.where(ok, block * block_size + position % block_size, NO_BLOCK)


def prefix_cache_hit_rate(state: BlockManagerState) -> jax.Array:
  """float32 scalar: GPU prefix-cache hits per lookup (0 before any; -1 when caching is off)."""
  if not state.cfg.enable_prefix_caching:
    return jnp.float32(-1.0)
  return jnp.where(
    state.num_lookups > 0, state.num_hits / jnp.maximum(state.num_lookups, 1), 0.0
  ).astype(jnp.float32)


def access_all_blocks_in_seq(state: BlockManagerState, seq_id, now) -> BlockManagerState:
  """Sets last_accessed = max(last_accessed, now) on every block of the table."""
  if not state.cfg.enable_prefix_caching:
    return state
  max_seqs = state.cfg.max_seqs
  seq, now = int_scalar("seq_id", seq_id), int_scalar("now", now)
  safe = jnp.clip(seq, 0, max_seqs - 1)
  row = state.tables[safe]
  for on_gpu, device in ((True, ON_GPU), (False, ON_CPU)):
    pool = pool_of(state, on_gpu)
    if pool.content is None:  # no blocks
      continue
    held = (row >= 0) & (seq >= 0) & (seq < max_seqs) & (state.device[safe] == device)
    content = pool.content
    last_accessed = content.last_accessed.at[masked(row, held, pool.num_blocks)].max(
      now, mode="drop"
    )
    pool = pool.replace(content=content.replace(last_accessed=last_accessed))
    state = with_pool(state, on_gpu, pool)
  return state


def mark_blocks_as_computed(state: BlockManagerState, seq_ids, num_computed_tokens):
  """Marks blocks 0 .. min(c, num_tokens) // block_size - 1 of GPU sequences computed.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.
    num_computed_tokens: `c`, an int32 scalar for every row or int32[B] per row.

  Returns:
    The new state (unchanged without prefix caching).
  """
  cfg = state.cfg
  if state.gpu.content is None:
    return state
  max_seqs, block_size, max_blocks = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = seq_id_array(seq_ids)
  computed_tokens = jnp.asarray(num_computed_tokens)
  computed_tokens = jnp.broadcast_to(
    int_array(
      "num_computed_tokens", computed_tokens, () if computed_tokens.ndim == 0 else seq_ids.shape
    ),
    seq_ids.shape,
  )
  real = (seq_ids >= 0) & (seq_ids < max_seqs)
  safe = jnp.clip(seq_ids, 0, max_seqs - 1)
  upto = jnp.minimum(computed_tokens, state.num_tokens[safe]) // block_size
  rows = state.tables[safe]
  mark = (real & (state.device[safe] == ON_GPU))[:, None] & (
    jnp.arange(max_blocks)[None, :] < upto[:, None]
  )
  gpu = state.gpu
  content = gpu.content
  computed = content.computed.at[masked(rows, mark & (rows >= 0), gpu.num_blocks)].set(
    True, mode="drop"
  )
  return state.replace(gpu=gpu.replace(content=content.replace(computed=computed)))


def get_common_computed_block_ids(state: BlockManagerState, seq_ids):
  """The computed prompt blocks common to all sequences of a group, as vLLM 0.6 counts them.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.

  Returns:
    (int32[max_blocks_per_seq] block ids padded with -1, int32 count): the
    longest common prefix of the sequences' lists of computed blocks, each
    list taken from the blocks before the one that holds the sequence's last
    token (GPU sequences only); no blocks without prefix caching.
  """
  cfg = state.cfg
  max_seqs, block_size, max_blocks = cfg.max_seqs, cfg.block_size, cfg.max_blocks_per_seq
  seq_ids = seq_id_array(seq_ids)
  if state.gpu.content is None:
    return jnp.full(max_blocks, NO_BLOCK, i32), i32(0)
  real = (seq_ids >= 0) & (seq_ids < max_seqs)
  safe = jnp.clip(seq_ids, 0, max_seqs - 1)
  seq_len = state.num_tokens[safe]
  rows = state.tables[safe]
  j = jnp.arange(max_blocks)[None, :]
  computed = state.gpu.content.computed[jnp.maximum(rows, 0)] & (rows >= 0)
  on_gpu = (state.device[safe] == ON_GPU) & (seq_len >= 1)
  keep = computed & (j < ((seq_len - 1) // block_size)[:, None]) & on_gpu[:, None]
  pos = masked(jnp.cumsum(keep, axis=1) - 1, keep, max_blocks)
  lists = (
    jnp.full_like(rows, NO_BLOCK).at[jnp.arange(rows.shape[0])[:, None], pos].set(rows, mode="drop")
  )
  lengths = jnp.sum(keep, axis=1)
  first = jnp.argmax(real)
  agree = (lists == lists[first][None, :]) & (j < lengths[:, None])
  run = jnp.sum(jnp.cumprod(agree, axis=1), axis=1)
  count = jnp.min(jnp.where(real, run, max_blocks))
  count = jnp.where(jnp.any(real), count, 0).astype(i32)
  return jnp.where(jnp.arange(max_blocks) < count, lists[first], NO_BLOCK), count
