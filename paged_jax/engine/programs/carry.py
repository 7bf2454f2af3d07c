"""The decode loop's carry and the helpers every program shares.

`DecodeLoop` is what a decode launch carries from step to step (the rows,
the manager states, the pages, the launch's draws and counters);
`Speculation` is what a speculating loop adds per row. `HashedGraph` makes
a model's graphdef a cheap static jit argument. `per_shard` and
`pairs_per_shard` turn the rows' global slots into each data shard's
sequence ids, `by_shard` and `flat` reshape row arrays between `[R]` and
`[D, R / D]`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.block_manager.state import BlockManagerState
from paged_jax.engine import beam
from paged_jax.kv_cache import KVCache
from paged_jax.sampling import (
  Draw,
)


@flax.struct.dataclass
class DecodeLoop:
  """Carry of the decode loop.

  Rows are running sequences, `R / D` per data shard: row `r` decodes
  global slot `slots[r]`, a slot of shard `r // (R / D)`. With `beams`,
  rows are every slot in order (`slots[r]` is `r` or -1).
  """

  state: BlockManagerState  # one per data shard (leading axis)
  kv: KVCache
  slots: jax.Array  # int32[R], -1 where not running
  last_token: jax.Array  # int32[R], sampled, not yet in the cache
  num_generated: jax.Array  # int32[R], tokens sampled so far
  limit: jax.Array  # int32[R], tokens to sample at most
  beams: beam.Beams | None  # beam-search state (rows = slots), None: no group
  automaton_state: jax.Array  # int32[R], table states (structured outputs), -1: none
  draws: Draw  # [R, num_steps] tokens of this launch
  max_steps: jax.Array  # steps this launch runs at most (<= num_steps)
  step: jax.Array  # steps of this launch
  rows_run: jax.Array  # rows that decoded, summed over the steps
  out_of_blocks: jax.Array  # bool[D], the shards that ran out
  finished_any: jax.Array
  cow_copies: jax.Array
  peak_blocks: jax.Array
  utilization_sum: jax.Array
  spec: Speculation | None = None  # speculating loops only


@flax.struct.dataclass
class Speculation:
  """What a speculating decode loop carries per row (`k` proposals a step).

  Attributes:
    history: int32 `[R, H]`, each row's tokens: prompt, output, and
      `last_token` at `history_len - 1` (prompt lookup searches them).
    history_len: int32 `[R]`.
    pending: int32 `[R, k]`, accepted proposals the target computed but the
      manager has not appended yet (the next step's `append_slots` does).
    num_pending: int32 `[R]`.
    emitted: int32 `[R]`, tokens drawn in this launch (their draw columns).
    counts: int32 `[3]`: steps of a row with a proposal, proposed tokens,
      accepted ones (over the launch).
  """

  history: jax.Array
  history_len: jax.Array
  pending: jax.Array
  num_pending: jax.Array
  emitted: jax.Array
  counts: jax.Array


class HashedGraph:
  """A model's `nnx.GraphDef` as a static jit argument, hashed once.

  jit hashes its static arguments on every call, and hashing a graphdef
  walks the whole model (3 ms for SmolLM2, against a 30 ms decode step);
  the runner keeps one of these per model, so a launch's cache lookup is an
  identity check.
  """

  __slots__ = ("graphdef", "_hash")

  def __init__(self, graphdef):
    self.graphdef, self._hash = graphdef, hash(graphdef)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return self is other or (isinstance(other, HashedGraph) and self.graphdef == other.graphdef)

  def merge(self, params):
    """The model, as `nnx.merge` builds it."""
    return nnx.merge(self.graphdef, params)


def by_shard(rows: jax.Array, num_shards: int) -> jax.Array:
  """A per-row array `[R, ...]` as `[D, R/D, ...]`, each shard's rows."""
  return rows.reshape(num_shards, -1, *rows.shape[1:])


def flat(per_shard_rows: jax.Array) -> jax.Array:
  """A per-shard array `[D, R/D, ...]` as one of rows `[R, ...]`."""
  return per_shard_rows.reshape(-1, *per_shard_rows.shape[2:])


def shard_seq_ids(loop: DecodeLoop) -> jax.Array:
  """The loop's rows as each shard's sequence ids `[D, R/D]` (see `per_shard`)."""
  return per_shard(loop.slots, loop.out_of_blocks.shape[0], loop.state.cfg.max_seqs)


def per_shard(ids: jax.Array, num_shards: int, slots_per_shard: int) -> jax.Array:
  """Rows' global slots `[R]` (-1: none) as each shard's sequence ids
  `[D, R/D]` (row `r` holds a slot of shard `r // (R/D)`)."""
  return jnp.where(ids >= 0, ids % slots_per_shard, -1).reshape(num_shards, -1)


def pairs_per_shard(ids: jax.Array, num_shards: int, per: int) -> jax.Array:
  """Global slots `[K]` as sequence ids `[D, K]`, -1 outside each shard."""
  shard = jnp.where(ids >= 0, ids // per, -1)
  mine = shard[None, :] == jnp.arange(num_shards)[:, None]
  return jnp.where(mine, ids % per, -1)
