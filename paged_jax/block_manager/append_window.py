"""The rows of an `append_slots` call: each row's window of table entries and the checks."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.block_manager.arguments import check_ids
from paged_jax.block_manager.pool import take
from paged_jax.block_manager.state import EMPTY, NO_BLOCK, ON_CPU, BlockManagerState
from paged_jax.block_manager.tables import ceil_div, first_live_block, floor_div, table_entries

i32 = jnp.int32


class AppendRows(NamedTuple):
  """The rows of an `append_slots` call and the window of table entries each can touch.

  Row i's window is entries `[base[i], base[i] + W)`, which hold every
  position its new tokens and lookahead slots land in.
  """

  real: jax.Array  # bool[B]: not padding, id in range
  safe: jax.Array  # int32[B]: the id clipped into range
  tokens_before: jax.Array  # int32[B]: tokens before the call
  num_new: jax.Array  # int32[B]: new tokens (0 for padding)
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
  def tokens_after(self) -> jax.Array:
    """int32[B]: tokens after the call."""
    return self.tokens_before + self.num_new


def any_each(*masks: jax.Array) -> tuple[jax.Array, ...]:
  """``jnp.any`` of each mask, from one OR-reduction of bit-packed flags.

  One reduction instead of one per mask: on XLA:CPU each costs about as much
  as a scatter at batch 1024.
  """
  packed = masks[0].astype(i32)
  for bit, mask in enumerate(masks[1:], 1):
    packed = packed | (mask.astype(i32) << bit)  # broadcasting: masks may differ in shape
  bits = jax.lax.reduce(packed.ravel(), i32(0), jax.lax.bitwise_or, (0,))
  return tuple((bits >> bit) & 1 == 1 for bit in range(len(masks)))


def read_rows(
  state: BlockManagerState, seq_ids: jax.Array, num_new: jax.Array, num_cols: int, lookahead: int
) -> AppendRows:
  """Reads each row's window and checks the call's arguments and slots.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.
    num_new: int32[B] new tokens per row (checked here to be in 0..num_cols).
    num_cols: static K, the columns of the call's new tokens.
    lookahead: static lookahead slots.

  Returns:
    The rows, their windows and the call's checks.
  """
  cfg = state.cfg
  block_size, max_blocks = cfg.block_size, cfg.max_blocks_per_seq
  real, safe, bad_ids = check_ids(seq_ids, cfg.max_seqs)
  device = state.device[safe]
  tokens_before = state.num_tokens[safe]
  bad_count = (num_new < 0) | (num_new > num_cols)
  num_new = jnp.where(real, jnp.clip(num_new, 0, num_cols), 0)
  tokens_after = tokens_before + num_new
  target_len = ceil_div(tokens_after + lookahead, block_size)
  width = ceil_div(block_size - 1 + num_cols + lookahead, block_size)
  base = floor_div(tokens_before, block_size)
  cols = base[:, None] + jnp.arange(width, dtype=i32)[None, :]
  in_table = cols < max_blocks
  old = jnp.where(in_table & real[:, None], table_entries(state.tables, safe, cols), NO_BLOCK)
  live_end = cols >= first_live_block(cfg, tokens_after)[:, None]
  written = (
    (cols * block_size < tokens_after[:, None])
    & ((cols + 1) * block_size > tokens_before[:, None])
    & (num_new > 0)[:, None]
    & real[:, None]
  )
  writer = written & live_end & (old >= 0)
  refs = take(state.gpu.ref_count, old)
  bad_count, not_allocated, wrong_device, table_full, shared = any_each(
    (real & bad_count)[:, None],
    (real & (device == EMPTY))[:, None],
    (real & (device == ON_CPU))[:, None],
    (real & (target_len > max_blocks))[:, None],
    writer & (refs > 1),
  )
  return AppendRows(
    real=real,
    safe=safe,
    tokens_before=tokens_before,
    num_new=num_new,
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
