"""Plans derived from two manager states, for the caller that moves pages.

`unwritten_hit_copies` finds the prefix-cache hits of an `append_slots`
whose shared block does not hold its K/V yet, and plans the copies that
fill them (the decode programs execute them with the KV cache's
`copy_blocks`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.block_manager import queries
from paged_jax.block_manager.state import BlockManagerState, CopyPlan


def unwritten_hit_copies(
  before: BlockManagerState,
  after: BlockManagerState,
  seq_ids: jax.Array,
  cow: CopyPlan,
  span: int = 1,
) -> CopyPlan:
  """Copies that give cached blocks a decode step hit the K/V they lack.

  When a decoding row fills a block, `append_slots` shares a cached block
  of the same content instead, if there is one (as vLLM 0.6's block manager
  does), and the row's own block is released. A cached block that is not
  computed may not hold that content's K/V yet: another sequence's prompt
  registered it when it was allocated and its prefill has not reached it
  (or never will: the sequence was aborted or preempted before). The row's
  own block holds the K/V of every position but the new token's, which the
  step writes into the shared block, so it is copied over first. (A computed
  block is not copied; one that a decode filled is rewritten with the same
  values.)

  Args:
    before, after: one shard's manager state before and after the step's
      `append_slots`.
    seq_ids: int32[B] the step's sequence ids, -1 where no row runs.
    cow: that call's copy-on-write plan (its destinations are new blocks,
      not hits).
    span: static; the blocks looked at per row, the last one's and those
      before it (a step that appends more tokens fills more blocks).

  Returns:
    A CopyPlan of `(row's own block, shared block)` pairs, one per shared
    block, `B * span` entries (-1 after `count`).
  """
  cfg = before.cfg
  block_size, num_blocks = cfg.block_size, cfg.num_gpu_blocks
  last = jnp.maximum(queries.get_num_tokens(after, seq_ids) - 1, 0) // block_size
  columns = last[:, None] - jnp.arange(span)[None, :]
  blocks_at = lambda state: jnp.take_along_axis(
    queries.get_block_tables(state, seq_ids), jnp.maximum(columns, 0), axis=1
  ).ravel()
  own, shared = blocks_at(before), blocks_at(after)
  real = ((seq_ids >= 0)[:, None] & (columns >= 0)).ravel()
  content = before.gpu.content
  safe = jnp.clip(shared, 0, num_blocks - 1)
  unwritten = content.has_content[safe] & ~content.computed[safe]
  new_block = jnp.any(shared[:, None] == cow.dst[None, :], axis=1)
  hit = real & (own >= 0) & (shared >= 0) & (shared != own) & ~new_block & unwritten
  entries = jnp.arange(hit.shape[0], dtype=jnp.int32)
  first_entry = (
    jnp.full(num_blocks, hit.shape[0], jnp.int32)
    .at[jnp.where(hit, shared, num_blocks)]
    .min(entries, mode="drop")
  )
  keep = hit & (first_entry[safe] == entries)
  pos = jnp.where(keep, jnp.cumsum(keep) - 1, hit.shape[0])
  no_block = jnp.full(hit.shape[0], -1, jnp.int32)
  return CopyPlan(
    src=no_block.at[pos].set(own, mode="drop"),
    dst=no_block.at[pos].set(shared, mode="drop"),
    count=jnp.sum(keep).astype(jnp.int32),
    status=cow.status,
  )
