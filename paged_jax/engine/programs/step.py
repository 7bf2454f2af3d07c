"""One decode step's block-manager work, shared by the plain, speculative
and ragged steps.

Before the model call, `append_last_tokens` appends the rows' tokens and
`copy_for_append` carries out the resulting page copies; `slots_of` maps
positions to cache slots through block tables. After the draws,
`step_automata` advances the constrained rows' automata and
`finish_step` does the bookkeeping every step ends with: free the rows
that finished and count the step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_jax import kv_cache as kv_ops
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.plans import unwritten_hit_copies
from paged_jax.block_manager.state import CopyPlan, on_every_shard
from paged_jax.engine.programs.carry import DecodeLoop, per_shard
from paged_jax.kv_cache import KVCache


def append_last_tokens(loop: DecodeLoop):
  """`append_slots` of every running row's last token, on every shard."""
  cfg = loop.state.cfg
  num_shards = loop.out_of_blocks.shape[0]
  running = loop.seq_ids >= 0
  shaped = lambda a: a.reshape(num_shards, -1, *a.shape[1:])
  return on_every_shard(BlockSpaceManager(cfg).append_slots)(
    loop.state,
    per_shard(loop.seq_ids, num_shards, cfg.max_seqs),
    shaped(loop.last_token[:, None]),
    shaped(running.astype(jnp.int32)),
  )


def slots_of(tables: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
  """The cache slot of each position `[rows, width]` (-1: none) through the
  rows' block tables."""
  blocks = jnp.take_along_axis(tables, jnp.maximum(positions, 0) // block_size, axis=1)
  return jnp.where(
    (positions >= 0) & (blocks >= 0), blocks * block_size + positions % block_size, -1
  )


def copy_for_append(kv, before, after, local, plan: CopyPlan, num_cols: int) -> KVCache:
  """The pages after an `append_slots` of up to `num_cols` tokens per row:
  its copy-on-write `plan`, then, with prefix caching, the copies that give
  the cached blocks it shared the K/V they lack (`unwritten_hit_copies`,
  over every block such a call can fill)."""
  kv = kv_ops.copy_blocks(kv, plan)
  if not before.cfg.enable_prefix_caching:
    return kv
  span = -(-(num_cols - 1) // before.cfg.block_size) + 1
  hits = functools.partial(unwritten_hit_copies, span=span)
  return kv_ops.copy_blocks(kv, on_every_shard(hits)(before, after, local, plan))
