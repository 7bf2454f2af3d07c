"""The runner: the model, the paged KV cache and the block manager's state.

It executes what the scheduler decides. `prefill` runs prompt chunks through
the model in one jitted call; `decode` runs up to `num_steps` decode steps in
one compiled `lax.while_loop` whose every step calls `append_slots` for all
running rows, executes the copy-on-write plan, writes K/V and attends
through `PagedCache`, samples each row with its own parameters, checks stop
tokens and token limits, and frees the rows that finished. The loop hands
control back early when blocks run out (the scheduler preempts) or, if asked,
when a row finishes (the scheduler admits more).

Data parallel shards (the "data" axis of a mesh) are one program: the
manager state is batched, one state per shard (its leading axis), and its
operations run on all shards at once under `jax.vmap`; the cache holds
every shard's blocks side by side, its block axis split over "data"
(`paged_jax.sharding`). Rows of the loop are global sequence slots: slot `g`
is slot `g % max_seqs` of shard `g // max_seqs`, and `seq_id == slot`.
Between launches the host owns small NumPy mirrors of the per-row arrays;
the manager states and the cache stay on the device.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import kv_cache as kv_ops
from paged_jax import sharding
from paged_jax.block_manager import manager
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.state import EMPTY, BlockManagerState, init_states
from paged_jax.config import AllocStatus, CacheConfig, Status
from paged_jax.engine import beam
from paged_jax.engine.sampling import Draw, RowParams, is_stop, sample_rows
from paged_jax.kv_cache import KVCache
from paged_jax.models.paged import paged_cache


@flax.struct.dataclass
class _Loop:
  """Carry of the decode loop; rows are global sequence slots."""

  state: BlockManagerState  # one per data shard (leading axis)
  kv: KVCache
  seq_ids: jax.Array  # int32[R], -1 where not running
  last_token: jax.Array  # int32[R], sampled, not yet in the cache
  num_generated: jax.Array  # int32[R], tokens sampled so far
  limit: jax.Array  # int32[R], tokens to sample at most
  beams: beam.Beams  # beam-search state of the rows in beam groups
  draws: Draw  # [R, num_steps] tokens of this launch
  step: jax.Array  # steps of this launch
  out_of_blocks: jax.Array  # bool[D], the shards that ran out
  finished_any: jax.Array
  cow_copies: jax.Array
  peak_blocks: jax.Array
  utilization_sum: jax.Array


def _per_shard(ids: jax.Array, num_shards: int) -> jax.Array:
  """Global slots `[R]` (-1: none) as each shard's local slots `[D, R/D]`."""
  per = ids.shape[0] // num_shards
  return jnp.where(ids >= 0, ids % per, -1).reshape(num_shards, per)


def _pairs_per_shard(ids: jax.Array, num_shards: int, per: int) -> jax.Array:
  """Global slots `[K]` as local slots `[D, K]`, -1 outside each shard."""
  shard = jnp.where(ids >= 0, ids // per, -1)
  mine = shard[None, :] == jnp.arange(num_shards)[:, None]
  return jnp.where(mine, ids % per, -1)


def _decode_step(graphdef, params_state, rows: RowParams, with_beams: bool, loop: _Loop) -> _Loop:
  """One decode step of every running row, or the shards out of blocks.

  `with_beams` (static) compiles the beam-search step in; without it, no
  row may be in a beam group.
  """
  cfg = loop.state.cfg
  bm = BlockSpaceManager(cfg)
  num_shards = loop.out_of_blocks.shape[0]
  running = loop.seq_ids >= 0
  local = _per_shard(loop.seq_ids, num_shards)
  shaped = lambda a: a.reshape(num_shards, -1, *a.shape[1:])
  flat = lambda a: a.reshape(-1, *a.shape[2:])
  state, plan = jax.vmap(bm.append_slots)(
    loop.state, local, shaped(loop.last_token[:, None]), shaped(running.astype(jnp.int32))
  )

  def advance(_):
    kv = kv_ops.copy_blocks(loop.kv, plan)
    num_tokens = flat(jax.vmap(bm.get_num_tokens)(state, local))
    slot_mapping = jax.vmap(functools.partial(bm.get_slot_mapping, width=1))(
      state, local, shaped(running.astype(jnp.int32))
    )
    cache = paged_cache(
      kv=kv,
      block_tables=flat(jax.vmap(bm.get_block_tables)(state, local)),
      slot_mapping=flat(slot_mapping),
      cache_sliding_window=cfg.sliding_window,
    )
    positions = jnp.where(running, num_tokens - 1, -1)[:, None]
    model = nnx.merge(graphdef, params_state)
    logits, cache = model(
      sharding.split_rows(loop.last_token[:, None], kv), sharding.split_rows(positions, kv), cache
    )
    num_logprobs = loop.draws.top_ids.shape[-1]
    draw = sample_rows(logits[:, 0], rows, loop.num_generated, num_logprobs)
    column = jnp.where(running, loop.step, loop.draws.tokens.shape[1])
    draws = jax.tree.map(
      lambda out, new: out.at[jnp.arange(out.shape[0]), column].set(new, mode="drop"),
      loop.draws,
      draw,
    )
    sampled = running & (loop.beams.leader < 0)
    num_generated = loop.num_generated + sampled
    done = sampled & ((num_generated >= loop.limit) | is_stop(draw.tokens, rows.stop_ids))
    used = cfg.num_gpu_blocks - jax.vmap(bm.num_free_gpu_blocks)(state)
    held = jnp.sum(num_tokens)
    seq_ids = jnp.where(done, -1, loop.seq_ids)
    last_token = jnp.where(sampled, draw.tokens, loop.last_token)
    s = running.shape[0]
    num_pairs = s * 2 * loop.beams.hyp_len.shape[1]

    def beam_step(_):
      beams, moves = beam.step(
        loop.beams,
        jax.nn.log_softmax(logits[:, 0].astype(jnp.float32)),
        running,
        rows.stop_ids,
        loop.limit,
        seq_ids,
        last_token,
        num_generated,
      )
      per = s // num_shards
      forked, _ = jax.vmap(bm.fork_each)(
        state,
        _pairs_per_shard(moves.fork_parents, num_shards, per),
        _pairs_per_shard(moves.fork_children, num_shards, per),
      )
      return forked, beams, moves

    def no_beams(_):
      return (
        state,
        loop.beams,
        beam.BeamMoves(
          fork_parents=jnp.full(num_pairs, -1),
          fork_children=jnp.full(num_pairs, -1),
          dropped=jnp.zeros(s, bool),
          seq_ids=seq_ids,
          last_token=last_token,
          num_generated=num_generated,
          finished=jnp.zeros(s, bool),
        ),
      )

    forked, beams, moves = (
      jax.lax.cond(jnp.any(running & (loop.beams.leader >= 0)), beam_step, no_beams, None)
      if with_beams
      else no_beams(None)
    )
    freed, _ = jax.vmap(bm.free)(
      forked, _per_shard(jnp.where(done | moves.dropped, loop.seq_ids, -1), num_shards)
    )
    return loop.replace(
      state=freed,
      kv=cache.kv,
      seq_ids=moves.seq_ids,
      last_token=moves.last_token,
      num_generated=moves.num_generated,
      beams=beams,
      draws=draws,
      step=loop.step + 1,
      finished_any=loop.finished_any | jnp.any(done) | jnp.any(moves.finished),
      cow_copies=loop.cow_copies + jnp.sum(plan.count),
      peak_blocks=jnp.maximum(loop.peak_blocks, jnp.max(used)),
      utilization_sum=loop.utilization_sum + held / jnp.maximum(jnp.sum(used) * cfg.block_size, 1),
    )

  out_of_blocks = plan.status != Status.OK
  return jax.lax.cond(
    ~jnp.any(out_of_blocks), advance, lambda _: loop.replace(out_of_blocks=out_of_blocks), None
  )


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(3,))
def _decode_loop(
  graphdef, params_state, rows: RowParams, loop: _Loop, stop_on_finish, with_beams: bool
) -> _Loop:
  """Decodes until no row runs, a shard runs out of blocks, the launch's
  steps are done, or (if asked) a row finishes."""
  num_steps = loop.draws.tokens.shape[1]

  def keep_going(loop):
    return (
      jnp.any(loop.seq_ids >= 0)
      & ~jnp.any(loop.out_of_blocks)
      & (loop.step < num_steps)
      & ~(stop_on_finish & loop.finished_any)
    )

  loop = jax.lax.while_loop(
    keep_going, functools.partial(_decode_step, graphdef, params_state, rows, with_beams), loop
  )
  kv = loop.kv
  return sharding.replicate(loop.replace(kv=None), kv).replace(kv=kv)


@functools.partial(jax.jit, static_argnums=(0, 9, 10), donate_argnums=(2,))
def _prefill(
  graphdef,
  params_state,
  kv,
  states,
  tokens,
  positions,
  local,
  chunk_of,
  rows,
  num_logprobs,
  block_size,
):
  """Runs prompt chunks, then draws token 0 of sequences from their logits.

  Rows of `tokens` and `positions` are chunks (padding has position -1),
  `rows / D` per data shard; `local` int32 `[D, rows / D]` are the chunks'
  slots in their shard. Draw `i` samples from the last position of chunk
  `chunk_of[i]` with the sampling parameters `rows[i]`.
  """
  tables = jax.vmap(manager.get_block_tables)(states, local)
  tables = tables.reshape(-1, tables.shape[-1])
  blocks = jnp.take_along_axis(tables, jnp.maximum(positions, 0) // block_size, axis=1)
  slots = jnp.where(
    (positions >= 0) & (blocks >= 0), blocks * block_size + positions % block_size, -1
  )
  cache = paged_cache(
    kv=kv, block_tables=tables, slot_mapping=slots, cache_sliding_window=states.cfg.sliding_window
  )
  logits, cache = nnx.merge(graphdef, params_state)(
    sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache
  )
  last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
  last_logits = logits[chunk_of, last[chunk_of]]
  index = jnp.zeros(chunk_of.shape, jnp.int32)
  draw = sample_rows(last_logits, rows, index, num_logprobs)
  return sharding.replicate(draw, kv), cache.kv


# The manager's operations take the config from the state, so one jitted
# function serves every config (one compile per operation, config and shape).
@functools.partial(jax.jit, static_argnums=0)
def _on_shard(op, states, shard, *args):
  """`op(state, *args) -> (state, result)` on shard `shard` of `states`."""
  state, result = op(jax.tree.map(lambda a: a[shard], states), *args)
  return jax.tree.map(lambda a, b: a.at[shard].set(b), states, state), result


@functools.partial(jax.jit, static_argnums=0)
def _read_shard(op, states, shard, *args):
  """`op(state, *args)` on shard `shard` of `states`."""
  return op(jax.tree.map(lambda a: a[shard], states), *args)


def _mark_computed(state, seq_ids, num_computed_tokens):
  return manager.mark_blocks_as_computed(state, seq_ids, num_computed_tokens), None


_start_beams = jax.jit(beam.Beams.start)
_clear_beams = jax.jit(beam.Beams.clear)
_hit_counts = jax.jit(lambda states: (jnp.sum(states.num_hits), jnp.sum(states.num_lookups)))


def bucket(size: int, minimum: int = 1) -> int:
  """The power of two >= size (one compile per bucket, not per length)."""
  return max(minimum, 1 << max(size - 1, 0).bit_length())


class ModelRunner:
  """Owns the model, the KV cache and the manager states; runs what it is told.

  Args:
    model: an NNX model following `paged_jax.engine.ModelProtocol`.
    cfg: the paged cache's configuration, per data shard.
    kv_cache_dtype: dtype of the KV pages; None for the model's dtype.
    num_logprobs: top log-probabilities computed per token (static).
    stop_width: stop-token ids per row (static).
    mesh: a ``("data", "model")`` mesh: the model and the cache are split
      over "model" and every data shard has its own manager state, blocks
      and `cfg.max_seqs` slots (see `paged_jax.sharding`); None for one
      device.
    max_beam_width: the most beams a beam-search request may ask for
      (static: it sizes the beam state).
  """

  def __init__(
    self,
    model,
    cfg: CacheConfig,
    *,
    kv_cache_dtype=None,
    num_logprobs: int = 0,
    stop_width: int = 4,
    mesh=None,
    max_beam_width: int = 4,
  ):
    self.cfg = cfg
    self.bm = BlockSpaceManager(cfg)
    mc = model.config
    dtype = jnp.dtype(mc.dtype if kv_cache_dtype is None else kv_cache_dtype)
    if mesh is None:
      self.num_shards = 1
      self.kv = KVCache.create(cfg, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype=dtype)
      replicated = self.kv.k[0].sharding
    else:
      self.num_shards = mesh.shape["data"]
      model = sharding.shard_model(model, mesh)
      self.kv = KVCache.create(
        cfg, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype=dtype, mesh=mesh
      )
      replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.graphdef, self.params = nnx.split(model)
    # The states live where the pages do, so that every jitted call sees
    # the same input shardings before and after its first run (one compile).
    self.state = jax.device_put(init_states(cfg, self.num_shards), replicated)
    s = self.num_shards * cfg.max_seqs
    self.beams = jax.device_put(
      beam.Beams.create(s, max_beam_width, cfg.max_tokens_per_seq), replicated
    )
    self.max_beam_width = max_beam_width
    self.in_beam_group = np.zeros(s, bool)
    self.num_logprobs, self.stop_width = num_logprobs, stop_width
    key_words = jax.random.key_data(jax.random.key(0)).shape[-1]
    self.rows = RowParams(
      temperature=np.zeros(s, np.float32),
      top_k=np.zeros(s, np.int32),
      top_p=np.ones(s, np.float32),
      key_data=np.zeros((s, key_words), np.uint32),
      stop_ids=np.full((s, stop_width), -1, np.int32),
    )
    self.seq_ids = np.full(s, -1, np.int32)
    self.last_token = np.zeros(s, np.int32)
    self.num_generated = np.zeros(s, np.int32)
    self.limit = np.zeros(s, np.int32)
    self.counters = dict(
      cow_copies=0, peak_blocks=0, utilization_sum=0.0, decode_steps=0, loop_launches=0, swaps=0
    )

  # Shards.
  def shard_slots(self, shard: int) -> range:
    """The global slots of data shard `shard`."""
    s = self.cfg.max_seqs
    return range(shard * s, (shard + 1) * s)

  def _local(self, slots) -> tuple[int, np.ndarray]:
    """`(shard, local slots)` of global slots that share one shard."""
    shards, local = np.divmod(np.asarray(slots, np.int32), self.cfg.max_seqs)
    if np.unique(shards).size > 1:
      raise ValueError(f"slots {list(slots)} span several data shards")
    return int(shards.flat[0]), local.astype(np.int32)

  def shard_state(self, shard: int) -> BlockManagerState:
    """The manager state of data shard `shard`."""
    return jax.tree.map(lambda a: a[shard], self.state)

  # Queries the scheduler asks.
  def can_allocate(self, num_tokens: int, shard: int = 0) -> AllocStatus:
    return AllocStatus(int(_read_shard(manager.can_allocate, self.state, shard, num_tokens)))

  def num_free_gpu_blocks(self, shard: int = 0) -> int:
    return int(_read_shard(BlockSpaceManager.num_free_gpu_blocks, self.state, shard))

  def num_running(self, shard: int = 0) -> int:
    """Rows of `shard` that decode."""
    return int(np.sum(self.seq_ids[self.shard_slots(shard)] >= 0))

  def can_swap_out(self, slots) -> bool:
    shard, local = self._local(slots)
    return bool(_read_shard(manager.can_swap_out, self.state, shard, local))

  def can_swap_in(self, slots) -> AllocStatus:
    shard, local = self._local(slots)
    return AllocStatus(int(_read_shard(manager.can_swap_in, self.state, shard, local)))

  # Rows.
  def set_row(
    self,
    slot: int,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    key_data: np.ndarray,
    stop_ids,
    limit: int,
  ):
    """Gives `slot` a request's sampling parameters and token limit."""
    rows = self.rows
    rows.temperature[slot], rows.top_k[slot] = temperature, top_k
    rows.top_p[slot], rows.key_data[slot] = top_p, key_data
    rows.stop_ids[slot] = -1
    rows.stop_ids[slot, : len(stop_ids)] = stop_ids
    self.limit[slot] = limit

  def start(self, slot: int, last_token: int, num_generated: int):
    """Lets `slot` decode from `last_token`, its `num_generated`-th token."""
    self.seq_ids[slot] = slot
    self.last_token[slot], self.num_generated[slot] = last_token, num_generated

  def resume(self, slots) -> None:
    """Lets swapped-in beam rows decode on from where they were."""
    self.seq_ids[np.asarray(slots, np.int64)] = slots

  def stop(self, slots) -> None:
    self.seq_ids[np.asarray(slots, np.int64)] = -1

  # Beam groups.
  def start_beams(self, slots, width: int, length_penalty: float) -> None:
    """Makes `slots` (leader first) a beam group of `width` beams."""
    self.beams = _start_beams(self.beams, np.asarray(slots, np.int32), width, length_penalty)
    self.in_beam_group[np.asarray(slots)] = True

  def clear_beams(self, slots) -> None:
    self.beams = _clear_beams(self.beams, np.asarray(slots, np.int32))
    self.in_beam_group[np.asarray(slots)] = False

  def beams_done(self) -> np.ndarray:
    """bool `[S]`: leaders whose beam group has finished."""
    return np.asarray(self.beams.done)

  def hypotheses(self, leader: int, count: int):
    """The best `count` finished hypotheses of a group, best first:
    `(tokens, cumulative logprob, stopped)` triples."""
    b = jax.device_get(jax.tree.map(lambda a: a[leader], self.beams))
    return [
      (b.hyp_tokens[i, : b.hyp_len[i]].tolist(), float(b.hyp_logprob[i]), bool(b.hyp_stopped[i]))
      for i in range(count)
      if b.hyp_score[i] > -np.inf
    ]

  def held(self, slots) -> list[int]:
    """The slots among `slots` that hold a block table (on either device)."""
    device = np.asarray(self.state.device).reshape(-1)
    return [s for s in slots if device[s] != EMPTY]

  # Manager operations.
  def _check(self, result, what: str):
    status = Status(int(result.status))
    if status != Status.OK:
      raise RuntimeError(f"{what} failed: {status.name}")

  def _update(self, op, slots, *args):
    """`op(state, local slots, *args)` on the shard of `slots`."""
    shard, local = self._local(slots)
    self.state, result = _on_shard(op, self.state, shard, local, *args)
    return shard, result

  def allocate(self, slot: int, tokens: np.ndarray) -> int:
    """Allocates `tokens` into `slot`; returns how many are already computed
    (prefix-cache hits whose K/V an earlier prefill wrote)."""
    padded = np.zeros(self.cfg.max_tokens_per_seq, np.int32)
    padded[: tokens.size] = tokens
    shard, result = self._update(manager.allocate, [slot], padded, tokens.size)
    self._check(result, f"allocate of {tokens.size} tokens into seq {slot}")
    _, computed_blocks = _read_shard(
      manager.get_common_computed_block_ids, self.state, shard, self._local([slot])[1]
    )
    return int(computed_blocks) * self.cfg.block_size

  def mark_computed(self, slots, num_computed) -> None:
    if not self.cfg.enable_prefix_caching:
      return
    slots, num_computed = np.asarray(slots), np.asarray(num_computed, np.int32)
    for shard in np.unique(slots // self.cfg.max_seqs):
      mine = slots // self.cfg.max_seqs == shard
      self._update(_mark_computed, slots[mine], num_computed[mine])

  def fork(self, parent: int, child: int) -> None:
    shard, (local_parent, local_child) = self._local([parent, child])
    self.state, result = _on_shard(manager.fork, self.state, shard, local_parent, local_child)
    self._check(result, f"fork of seq {parent} into seq {child}")

  def free(self, slots) -> None:
    """Frees the sequences in `slots` of one shard (on the device or
    swapped out)."""
    _, result = self._update(manager.free, slots)
    self.stop(slots)
    self._check(result, f"free of seqs {list(slots)}")

  def swap_out(self, slots) -> None:
    shard, plan = self._update(BlockSpaceManager.swap_out, slots)
    self.stop(slots)
    self._check(plan, f"swap out of seqs {list(slots)}")
    self.kv = kv_ops.swap_out(
      self.kv, sharding.shard_plan(plan, shard, self.cfg.num_gpu_blocks, self.cfg.num_cpu_blocks)
    )
    self.counters["swaps"] += int(plan.count)

  def swap_in(self, slots) -> None:
    shard, plan = self._update(BlockSpaceManager.swap_in, slots)
    self._check(plan, f"swap in of seqs {list(slots)}")
    self.kv = kv_ops.swap_in(
      self.kv, sharding.shard_plan(plan, shard, self.cfg.num_cpu_blocks, self.cfg.num_gpu_blocks)
    )
    self.counters["swaps"] += int(plan.count)

  # Model calls.
  def prefill(self, chunks, samples) -> Draw:
    """Runs prompt chunks, then draws token 0 of the sequences in `samples`.

    Args:
      chunks: `(slot, tokens, start)` triples: `tokens` go to positions
        `start ..` of the sequence in `slot`, whose blocks are allocated.
      samples: `(chunk, slot)` pairs: draw token 0 of `slot` (with its row's
        sampling parameters) from the logits chunk number `chunk` ends with.

    Returns:
      NumPy draws, one per pair of `samples`.
    """
    d, per_shard = self.num_shards, self.cfg.max_seqs
    shard_of = [slot // per_shard for slot, _, _ in chunks]
    per_row = bucket(int(np.bincount(shard_of, minlength=d).max()))
    width = bucket(max(tokens.size for _, tokens, _ in chunks), 8)
    tokens = np.zeros((d * per_row, width), np.int32)
    positions = np.full((d * per_row, width), -1, np.int32)
    local = np.full((d, per_row), -1, np.int32)
    filled = np.zeros(d, np.int64)
    row_of = []
    for shard, (slot, chunk, start) in zip(shard_of, chunks):
      row = shard * per_row + filled[shard]
      tokens[row, : chunk.size] = chunk
      positions[row, : chunk.size] = np.arange(start, start + chunk.size)
      local[shard, filled[shard]] = slot % per_shard
      filled[shard] += 1
      row_of.append(row)
    num_draws = d * per_shard  # one compile, whatever the samples
    chunk_of = np.zeros(num_draws, np.int32)
    sample_slots = np.zeros(num_draws, np.int32)
    for i, (chunk, slot) in enumerate(samples):
      chunk_of[i], sample_slots[i] = row_of[chunk], slot
    rows = jax.tree.map(lambda a: a[sample_slots], self.rows)
    draw, self.kv = _prefill(
      self.graphdef,
      self.params,
      self.kv,
      self.state,
      tokens,
      positions,
      local,
      chunk_of,
      rows,
      self.num_logprobs,
      self.cfg.block_size,
    )
    return jax.tree.map(lambda a: np.asarray(a)[: len(samples)], draw)

  def decode_carry(self, num_steps: int) -> _Loop:
    """The decode loop's carry for a launch of up to `num_steps` steps."""
    s, k = self.seq_ids.shape[0], self.num_logprobs
    draws = Draw(
      tokens=jnp.zeros((s, num_steps), jnp.int32),
      logprob=jnp.zeros((s, num_steps), jnp.float32),
      top_ids=jnp.zeros((s, num_steps, k), jnp.int32),
      top_logprobs=jnp.zeros((s, num_steps, k), jnp.float32),
    )
    return _Loop(
      state=self.state,
      kv=self.kv,
      seq_ids=self.seq_ids,
      last_token=self.last_token,
      num_generated=self.num_generated,
      limit=self.limit,
      beams=self.beams,
      draws=draws,
      step=jnp.int32(0),
      out_of_blocks=jnp.zeros(self.num_shards, bool),
      finished_any=jnp.array(False),
      cow_copies=jnp.int32(0),
      peak_blocks=jnp.int32(0),
      utilization_sum=jnp.float32(0.0),
    )

  def decode(self, num_steps: int, stop_on_finish: bool):
    """Runs up to `num_steps` decode steps of the running rows.

    Returns:
      `(draws, counts, finished, out_of_blocks)`: NumPy draws `[S,
      num_steps]`, the tokens each row drew, the rows that finished on the
      device, and bool `[D]`, the data shards whose blocks ran out (the loop
      stopped for them).
    """
    before = self.num_generated.copy()
    running = self.seq_ids >= 0
    loop = self.decode_carry(num_steps)
    # The beam step compiles only once a beam group runs.
    with_beams = bool(np.any(self.in_beam_group & running))
    loop = _decode_loop(
      self.graphdef, self.params, self.rows, loop, jnp.array(stop_on_finish), with_beams
    )
    self.state, self.kv, self.beams = loop.state, loop.kv, loop.beams
    self.seq_ids = np.array(loop.seq_ids)
    self.last_token = np.array(loop.last_token)
    self.num_generated = np.array(loop.num_generated)
    counters = self.counters
    counters["cow_copies"] += int(loop.cow_copies)
    counters["peak_blocks"] = max(counters["peak_blocks"], int(loop.peak_blocks))
    counters["utilization_sum"] += float(loop.utilization_sum)
    counters["decode_steps"] += int(loop.step)
    counters["loop_launches"] += 1
    finished = running & (self.seq_ids < 0)
    return (
      jax.tree.map(np.asarray, loop.draws),
      self.num_generated - before,
      finished,
      np.array(loop.out_of_blocks),
    )

  def prefix_cache_hit_rate(self) -> float:
    """Hits over lookups of every shard's prefix cache (-1 when disabled)."""
    if not self.cfg.enable_prefix_caching:
      return -1.0
    hits, lookups = (int(x) for x in _hit_counts(self.state))
    return hits / lookups if lookups else 0.0
