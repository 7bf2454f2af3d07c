"""One decode step's block-manager work, shared by the plain, speculative
and ragged steps.

Before the model call, `append_last_tokens` appends the rows' tokens and
`copy_for_append` carries out the resulting page copies; `slot_mapping_of` maps
positions to their `slot_mapping` through block tables. After the draws,
`step_automata` advances the constrained rows' automata and
`finish_step` does the bookkeeping every step ends with: free the rows
that finished and count the step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_jax import hybrid_kv, structured
from paged_jax import kv_cache as kv_ops
from paged_jax.block_manager import hybrid, manager
from paged_jax.block_manager.hybrid import HybridState
from paged_jax.block_manager.plans import unwritten_hit_copies
from paged_jax.block_manager.state import CopyPlan, on_every_shard
from paged_jax.config import Status
from paged_jax.engine.programs.carry import DecodeLoop, by_shard, per_shard, shard_seq_ids
from paged_jax.kv_cache import KVCache


def ops(state):
  """The block manager's functions for `state`: `hybrid`'s on a hybrid
  cache's state (one table per attention type: tables, slot mappings and
  plans come one per type), else `manager`'s."""
  return hybrid if isinstance(state, HybridState) else manager


def copy_count(plan) -> jax.Array:
  """The copies of a copy-on-write plan, or of every type's (a `HybridResult`)."""
  plans = getattr(plan, "results", (plan,))
  return sum(jnp.sum(p.count) for p in plans)


def without_copies(plan, drop: jax.Array):
  """`plan` (or every type's, of a `HybridResult`) emptied where `drop`."""
  if hasattr(plan, "results"):
    return plan.replace(results=tuple(without_copies(p, drop) for p in plan.results))
  return plan.replace(count=jnp.where(drop, 0, plan.count))


def used_blocks(state) -> jax.Array:
  """int32: the GPU blocks one shard's state holds, of every type."""
  if isinstance(state, HybridState):
    return sum(g.cfg.num_gpu_blocks - manager.num_free_gpu_blocks(g) for g in state.groups)
  return state.cfg.num_gpu_blocks - manager.num_free_gpu_blocks(state)


def append_last_tokens(loop: DecodeLoop):
  """`append_slots` of every running row's last token, on every shard."""
  num_shards = loop.out_of_blocks.shape[0]
  running = loop.slots >= 0
  return on_every_shard(ops(loop.state).append_slots)(
    loop.state,
    shard_seq_ids(loop),
    by_shard(loop.last_token[:, None], num_shards),
    by_shard(running.astype(jnp.int32), num_shards),
  )


def unless_out_of_blocks(loop: DecodeLoop, plan: CopyPlan, advance) -> DecodeLoop:
  """`advance(None)`, the step after an append whose `plan` every shard
  could carry out; else `loop` with the shards that ran out of blocks
  marked (no row steps)."""
  out_of_blocks = plan.status != Status.OK
  return jax.lax.cond(
    ~jnp.any(out_of_blocks), advance, lambda _: loop.replace(out_of_blocks=out_of_blocks), None
  )


def step_automata(table, automaton_state, stepped, tokens):
  """The rows' automaton states after the `stepped` rows drew `tokens`, and
  which of those rows' new states allow no token (they finish); without a
  `table`, the states unchanged and none."""
  if table is None:
    return automaton_state, jnp.zeros_like(stepped)
  advanced = jnp.where(stepped, structured.advance(table, automaton_state, tokens), automaton_state)
  return advanced, stepped & structured.is_dead(table, advanced)


def finish_step(loop: DecodeLoop, state, plan: CopyPlan, num_tokens, free, finished, **rows):
  """The carry after one step of `loop`'s rows, the bookkeeping every step
  ends with: `state` with the global slots `free` (-1: none) freed, the
  step and its rows counted with `plan`'s copies, the blocks in use and
  the `num_tokens` they hold, `finished` (a row finished) noted, and the
  rows' new fields `rows` (`kv`, `slots`, `last_token`, ...)."""
  cfg = state.cfg
  used = on_every_shard(used_blocks)(state)
  freed, _ = on_every_shard(ops(state).free)(
    state, per_shard(free, loop.out_of_blocks.shape[0], cfg.max_seqs)
  )
  held = jnp.sum(num_tokens)
  return loop.replace(
    state=freed,
    step=loop.step + 1,
    rows_run=loop.rows_run + jnp.sum(loop.slots >= 0),
    finished_any=loop.finished_any | finished,
    cow_copies=loop.cow_copies + copy_count(plan),
    peak_blocks=jnp.maximum(loop.peak_blocks, jnp.max(used)),
    utilization_sum=loop.utilization_sum + held / jnp.maximum(jnp.sum(used) * cfg.block_size, 1),
    **rows,
  )


def slot_mapping_of(tables: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
  """The slot mapping of each position `[rows, width]` (-1: none) through the
  rows' block tables."""
  blocks = jnp.take_along_axis(tables, jnp.maximum(positions, 0) // block_size, axis=1)
  return jnp.where(
    (positions >= 0) & (blocks >= 0), blocks * block_size + positions % block_size, -1
  )


def copy_for_append(kv, before, after, local, plan: CopyPlan, num_cols: int) -> KVCache:
  """The pages after an `append_slots` of up to `num_cols` tokens per row:
  its copy-on-write `plan`, then, with prefix caching, the copies that give
  the cached blocks it shared the K/V they lack (`unwritten_hit_copies`,
  over every block such a call can fill); on a hybrid cache, each type's
  plans on that type's pages."""
  if isinstance(before, HybridState):
    kv = hybrid_kv.copy_blocks(kv, plan)
    if not before.cfg.enable_prefix_caching:
      return kv
    types = tuple(
      _copy_unwritten_hits(c, b, a, local, p, num_cols)
      for c, b, a, p in zip(kv.types, before.groups, after.groups, plan.results)
    )
    return kv.replace(types=types)
  kv = kv_ops.copy_blocks(kv, plan)
  if not before.cfg.enable_prefix_caching:
    return kv
  return _copy_unwritten_hits(kv, before, after, local, plan, num_cols)


def _copy_unwritten_hits(kv, before, after, local, plan, num_cols: int) -> KVCache:
  span = -(-(num_cols - 1) // before.cfg.block_size) + 1
  hits = functools.partial(unwritten_hit_copies, span=span)
  return kv_ops.copy_blocks(kv, on_every_shard(hits)(before, after, local, plan))
