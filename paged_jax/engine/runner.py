"""The runner: the model, the paged KV cache and the block manager's state.

It executes what the scheduler decides. `prefill` runs prompt chunks through
the model in one jitted call; `decode` runs up to `num_steps` decode steps in
one compiled `lax.while_loop` whose every step calls `append_slots` for all
running rows, executes the copy-on-write plan, writes K/V and attends
through `PagedCache`, samples each row with its own parameters, checks stop
tokens and token limits, and frees the rows that finished. The loop hands
control back early when blocks run out (the scheduler preempts) or, if asked,
when a row finishes (the scheduler admits more).

Rows of the loop are sequence slots of the block manager (`seq_id == row`).
Between launches the host owns small NumPy mirrors of the per-row arrays;
the manager state and the cache stay on the device.
"""

from __future__ import annotations

import functools

from flax import nnx
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.block_manager import manager
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.state import EMPTY, BlockManagerState
from paged_jax.config import AllocStatus, CacheConfig, Status
from paged_jax.engine import beam
from paged_jax.engine.sampling import Draw, RowParams, is_stop, sample_rows
from paged_jax.kv_cache import KVCache
from paged_jax import kv_cache as kv_ops
from paged_jax import sharding


@flax.struct.dataclass
class _Loop:
  """Carry of the decode loop; rows are sequence slots."""

  state: BlockManagerState
  kv: KVCache
  seq_ids: jax.Array        # int32[S], -1 where not running
  last_token: jax.Array     # int32[S], sampled, not yet in the cache
  num_generated: jax.Array  # int32[S], tokens sampled so far
  limit: jax.Array          # int32[S], tokens to sample at most
  beams: beam.Beams         # beam-search state of the rows in beam groups
  draws: Draw               # [S, num_steps] tokens of this launch
  step: jax.Array           # steps of this launch
  out_of_blocks: jax.Array
  finished_any: jax.Array
  cow_copies: jax.Array
  peak_blocks: jax.Array
  utilization_sum: jax.Array


def _decode_step(graphdef, params_state, rows: RowParams, with_beams: bool,
                 loop: _Loop) -> _Loop:
  """One decode step of every running row, or an out-of-blocks flag.

  `with_beams` (static) compiles the beam-search step in; without it, no
  row may be in a beam group.
  """
  cfg = loop.state.cfg
  bm = BlockSpaceManager(cfg)
  running = loop.seq_ids >= 0
  state, plan = bm.append_slots(loop.state, loop.seq_ids,
                                loop.last_token[:, None],
                                running.astype(jnp.int32))

  def advance(_):
    kv = sharding.copy_blocks(loop.kv, plan)
    num_tokens = bm.get_num_tokens(state, loop.seq_ids)
    cache = sharding.paged_cache(kv=kv,
                       block_tables=bm.get_block_tables(state, loop.seq_ids),
                       slot_mapping=bm.get_slot_mapping(
                           state, loop.seq_ids, running.astype(jnp.int32),
                           width=1))
    positions = jnp.where(running, num_tokens - 1, -1)[:, None]
    model = nnx.merge(graphdef, params_state)
    logits, cache = model(loop.last_token[:, None], positions, cache)
    num_logprobs = loop.draws.top_ids.shape[-1]
    draw = sample_rows(logits[:, 0], rows, loop.num_generated, num_logprobs)
    column = jnp.where(running, loop.step, loop.draws.tokens.shape[1])
    draws = jax.tree.map(
        lambda out, new: out.at[jnp.arange(out.shape[0]), column].set(
            new, mode="drop"), loop.draws, draw)
    sampled = running & (loop.beams.leader < 0)
    num_generated = loop.num_generated + sampled
    done = sampled & ((num_generated >= loop.limit)
                      | is_stop(draw.tokens, rows.stop_ids))
    used = cfg.num_gpu_blocks - bm.num_free_gpu_blocks(state)
    held = jnp.sum(num_tokens)
    seq_ids = jnp.where(done, -1, loop.seq_ids)
    last_token = jnp.where(sampled, draw.tokens, loop.last_token)

    def beam_step(_):
      beams, moves = beam.step(
          loop.beams, jax.nn.log_softmax(logits[:, 0].astype(jnp.float32)),
          running, rows.stop_ids, loop.limit, seq_ids, last_token,
          num_generated)
      forked, _ = bm.fork_each(state, moves.fork_parents, moves.fork_children)
      return forked, beams, moves

    def no_beams(_):
      return state, loop.beams, beam.BeamMoves(
          fork_parents=jnp.full(s * 2 * loop.beams.hyp_len.shape[1], -1),
          fork_children=jnp.full(s * 2 * loop.beams.hyp_len.shape[1], -1),
          dropped=jnp.zeros(s, bool), seq_ids=seq_ids, last_token=last_token,
          num_generated=num_generated, finished=jnp.zeros(s, bool))

    s = running.shape[0]
    forked, beams, moves = jax.lax.cond(
        jnp.any(running & (loop.beams.leader >= 0)), beam_step, no_beams,
        None) if with_beams else no_beams(None)
    freed, _ = bm.free(forked, jnp.where(done | moves.dropped, loop.seq_ids,
                                         -1))
    return loop.replace(
        state=freed, kv=cache.kv, seq_ids=moves.seq_ids,
        last_token=moves.last_token, num_generated=moves.num_generated,
        beams=beams, draws=draws, step=loop.step + 1,
        finished_any=loop.finished_any | jnp.any(done)
        | jnp.any(moves.finished),
        cow_copies=loop.cow_copies + plan.count,
        peak_blocks=jnp.maximum(loop.peak_blocks, used),
        utilization_sum=loop.utilization_sum
        + held / jnp.maximum(used * cfg.block_size, 1))

  return jax.lax.cond(plan.status == Status.OK, advance,
                      lambda _: loop.replace(out_of_blocks=jnp.array(True)),
                      None)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(3,))
def _decode_loop(graphdef, params_state, rows: RowParams, loop: _Loop,
                 stop_on_finish, with_beams: bool) -> _Loop:
  """Decodes until no row runs, blocks run out, the launch's steps are done,
  or (if asked) a row finishes."""
  num_steps = loop.draws.tokens.shape[1]

  def keep_going(loop):
    return (jnp.any(loop.seq_ids >= 0) & ~loop.out_of_blocks
            & (loop.step < num_steps) & ~(stop_on_finish & loop.finished_any))

  return jax.lax.while_loop(
      keep_going,
      functools.partial(_decode_step, graphdef, params_state, rows,
                        with_beams), loop)


@functools.partial(jax.jit, static_argnums=(0, 8, 9), donate_argnums=(2,))
def _prefill(graphdef, params_state, kv, tokens, positions, tables, chunk_of,
             rows, num_logprobs, block_size):
  """Runs prompt chunks, then draws token 0 of sequences from their logits.

  Rows of `tokens` and `positions` are chunks (padding has position -1).
  Draw `i` samples from the last position of chunk `chunk_of[i]` with the
  sampling parameters `rows[i]`.
  """
  blocks = jnp.take_along_axis(tables, jnp.maximum(positions, 0) // block_size,
                               axis=1)
  slots = jnp.where((positions >= 0) & (blocks >= 0),
                    blocks * block_size + positions % block_size, -1)
  cache = sharding.paged_cache(kv=kv, block_tables=tables, slot_mapping=slots)
  logits, cache = nnx.merge(graphdef, params_state)(tokens, positions, cache)
  last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
  last_logits = logits[chunk_of, last[chunk_of]]
  index = jnp.zeros(chunk_of.shape, jnp.int32)
  return sample_rows(last_logits, rows, index, num_logprobs), cache.kv


# The manager's operations take the config from the state, so one jitted
# function serves every config (one compile per config and shape).
_allocate = jax.jit(manager.allocate)
_can_allocate = jax.jit(manager.can_allocate)
_fork = jax.jit(manager.fork)
_free = jax.jit(manager.free)
_swap_out = jax.jit(BlockSpaceManager.swap_out)
_swap_in = jax.jit(BlockSpaceManager.swap_in)
_can_swap_out = jax.jit(manager.can_swap_out)
_can_swap_in = jax.jit(manager.can_swap_in)
_block_tables = jax.jit(manager.get_block_tables)
_mark_computed = jax.jit(manager.mark_blocks_as_computed)
_common_computed = jax.jit(manager.get_common_computed_block_ids)
_start_beams = jax.jit(beam.Beams.start)
_clear_beams = jax.jit(beam.Beams.clear)


def bucket(size: int, minimum: int = 1) -> int:
  """The power of two >= size (one compile per bucket, not per length)."""
  return max(minimum, 1 << max(size - 1, 0).bit_length())


class ModelRunner:
  """Owns the model, the KV cache and the manager state; runs what it is told.

  Args:
    model: an NNX model following `paged_jax.engine.ModelProtocol`.
    cfg: the paged cache's configuration.
    kv_cache_dtype: dtype of the KV pages; None for the model's dtype.
    num_logprobs: top log-probabilities computed per token (static).
    stop_width: stop-token ids per row (static).
    mesh: a ``("data", "model")`` mesh with one data row: the model and the
      cache are split over "model" (see `paged_jax.sharding`); None for one
      device.
    max_beam_width: the most beams a beam-search request may ask for
      (static: it sizes the beam state).
  """

  def __init__(self, model, cfg: CacheConfig, *, kv_cache_dtype=None,
               num_logprobs: int = 0, stop_width: int = 4, mesh=None,
               max_beam_width: int = 4):
    self.cfg = cfg
    self.bm = BlockSpaceManager(cfg)
    mc = model.config
    dtype = jnp.dtype(mc.dtype if kv_cache_dtype is None else kv_cache_dtype)
    if mesh is None:
      self.kv = KVCache.create(cfg, mc.num_layers, mc.num_kv_heads,
                               mc.head_dim, dtype=dtype)
    else:
      model = sharding.shard_model(model, mesh)
      self.kv = sharding.create_kv_cache(cfg, mc.num_layers, mc.num_kv_heads,
                                         mc.head_dim, dtype, mesh)
    self.graphdef, self.params = nnx.split(model)
    # The state lives where the pages do, so that every jitted call sees
    # the same input shardings before and after its first run (one compile).
    replicated = self.kv.k[0].sharding if mesh is None else (
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    # The state lives where the pages do, so that every jitted call sees
    # the same input shardings before and after its first run (one compile).
    self.state = jax.device_put(self.bm.init(), replicated)
    self.beams = jax.device_put(beam.Beams.create(
        cfg.max_seqs, max_beam_width, cfg.max_tokens_per_seq), replicated)
    self.max_beam_width = max_beam_width
    self.in_beam_group = np.zeros(cfg.max_seqs, bool)
    self.num_logprobs, self.stop_width = num_logprobs, stop_width
    s = cfg.max_seqs
    key_words = jax.random.key_data(jax.random.key(0)).shape[-1]
    self.rows = RowParams(
        temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32), key_data=np.zeros((s, key_words),
                                                        np.uint32),
        stop_ids=np.full((s, stop_width), -1, np.int32))
    self.seq_ids = np.full(s, -1, np.int32)
    self.last_token = np.zeros(s, np.int32)
    self.num_generated = np.zeros(s, np.int32)
    self.limit = np.zeros(s, np.int32)
    self.counters = dict(cow_copies=0, peak_blocks=0, utilization_sum=0.0,
                         decode_steps=0, loop_launches=0, swaps=0)

  # Queries the scheduler asks.
  def can_allocate(self, num_tokens: int) -> AllocStatus:
    return AllocStatus(int(_can_allocate(self.state, num_tokens)))

  def num_free_gpu_blocks(self) -> int:
    return int(self.bm.num_free_gpu_blocks(self.state))

  def can_swap_out(self, slots) -> bool:
    return bool(_can_swap_out(self.state, np.asarray(slots, np.int32)))

  def can_swap_in(self, slots) -> AllocStatus:
    return AllocStatus(int(_can_swap_in(self.state, np.asarray(slots,
                                                               np.int32))))

  # Rows.
  def set_row(self, slot: int, *, temperature: float, top_k: int,
              top_p: float, key_data: np.ndarray, stop_ids, limit: int):
    """Gives `slot` a request's sampling parameters and token limit."""
    rows = self.rows
    rows.temperature[slot], rows.top_k[slot] = temperature, top_k
    rows.top_p[slot], rows.key_data[slot] = top_p, key_data
    rows.stop_ids[slot] = -1
    rows.stop_ids[slot, :len(stop_ids)] = stop_ids
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
    self.beams = _start_beams(self.beams, np.asarray(slots, np.int32), width,
                              length_penalty)
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
    return [(b.hyp_tokens[i, :b.hyp_len[i]].tolist(), float(b.hyp_logprob[i]),
             bool(b.hyp_stopped[i])) for i in range(count)
            if b.hyp_score[i] > -np.inf]

  def held(self, slots) -> list[int]:
    """The slots among `slots` that hold a block table (on either device)."""
    device = np.asarray(self.state.device)
    return [s for s in slots if device[s] != EMPTY]

  # Manager operations.
  def _check(self, result, what: str):
    status = Status(int(result.status))
    if status != Status.OK:
      raise RuntimeError(f"{what} failed: {status.name}")

  def allocate(self, slot: int, tokens: np.ndarray) -> int:
    """Allocates `tokens` into `slot`; returns how many are already computed
    (prefix-cache hits whose K/V an earlier prefill wrote)."""
    padded = np.zeros(self.cfg.max_tokens_per_seq, np.int32)
    padded[:tokens.size] = tokens
    self.state, result = _allocate(self.state, np.array([slot], np.int32),
                                   padded, tokens.size)
    self._check(result, f"allocate of {tokens.size} tokens into seq {slot}")
    _, computed_blocks = _common_computed(self.state,
                                          np.array([slot], np.int32))
    return int(computed_blocks) * self.cfg.block_size

  def mark_computed(self, slots, num_computed) -> None:
    if self.cfg.enable_prefix_caching:
      self.state = _mark_computed(self.state, np.asarray(slots, np.int32),
                                  np.asarray(num_computed, np.int32))

  def fork(self, parent: int, child: int) -> None:
    self.state, result = _fork(self.state, parent, child)
    self._check(result, f"fork of seq {parent} into seq {child}")

  def free(self, slots) -> None:
    """Frees the sequences in `slots` (on the device or swapped out)."""
    slots = np.asarray(slots, np.int32)
    self.stop(slots)
    self.state, result = _free(self.state, slots)
    self._check(result, f"free of seqs {slots.tolist()}")

  def swap_out(self, slots) -> None:
    slots = np.asarray(slots, np.int32)
    self.stop(slots)
    self.state, plan = _swap_out(self.state, slots)
    self._check(plan, f"swap out of seqs {slots.tolist()}")
    self.kv = kv_ops.swap_out(self.kv, plan)
    self.counters["swaps"] += int(plan.count)

  def swap_in(self, slots) -> None:
    slots = np.asarray(slots, np.int32)
    self.state, plan = _swap_in(self.state, slots)
    self._check(plan, f"swap in of seqs {slots.tolist()}")
    self.kv = kv_ops.swap_in(self.kv, plan)
    self.counters["swaps"] += int(plan.count)

  # Model calls.
  def prefill(self, chunks, samples) -> Draw:
    """Runs prompt chunks, then draws token 0 of the sequences in `samples`.

    Args:
      chunks: `(slot, tokens, start)` triples: `tokens` go to positions
        `start ..` of the sequence in `slot`, whose blocks are allocated.
      samples: `(chunk, slot)` pairs: draw token 0 of `slot` (with its row's
        sampling parameters) from the logits chunk `chunk` ends with.

    Returns:
      NumPy draws, one per pair of `samples`.
    """
    num_rows = bucket(len(chunks))
    width = bucket(max(tokens.size for _, tokens, _ in chunks), 8)
    tokens = np.zeros((num_rows, width), np.int32)
    positions = np.full((num_rows, width), -1, np.int32)
    slots = np.full(num_rows, -1, np.int32)
    for row, (slot, chunk, start) in enumerate(chunks):
      tokens[row, :chunk.size] = chunk
      positions[row, :chunk.size] = np.arange(start, start + chunk.size)
      slots[row] = slot
    num_draws = self.cfg.max_seqs   # one compile, whatever the samples
    chunk_of = np.zeros(num_draws, np.int32)
    sample_slots = np.zeros(num_draws, np.int32)
    for i, (chunk, slot) in enumerate(samples):
      chunk_of[i], sample_slots[i] = chunk, slot
    tables = _block_tables(self.state, slots)
    rows = jax.tree.map(lambda a: a[sample_slots], self.rows)
    draw, self.kv = _prefill(self.graphdef, self.params, self.kv, tokens,
                             positions, tables, chunk_of, rows,
                             self.num_logprobs, self.cfg.block_size)
    return jax.tree.map(lambda a: np.asarray(a)[:len(samples)], draw)

  def decode_carry(self, num_steps: int) -> _Loop:
    """The decode loop's carry for a launch of up to `num_steps` steps."""
    s, k = self.cfg.max_seqs, self.num_logprobs
    draws = Draw(tokens=jnp.zeros((s, num_steps), jnp.int32),
                 logprob=jnp.zeros((s, num_steps), jnp.float32),
                 top_ids=jnp.zeros((s, num_steps, k), jnp.int32),
                 top_logprobs=jnp.zeros((s, num_steps, k), jnp.float32))
    return _Loop(
        state=self.state, kv=self.kv, seq_ids=self.seq_ids,
        last_token=self.last_token, num_generated=self.num_generated,
        limit=self.limit, beams=self.beams, draws=draws, step=jnp.int32(0),
        out_of_blocks=jnp.array(False), finished_any=jnp.array(False),
        cow_copies=jnp.int32(0), peak_blocks=jnp.int32(0),
        utilization_sum=jnp.float32(0.0))

  def decode(self, num_steps: int, stop_on_finish: bool):
    """Runs up to `num_steps` decode steps of the running rows.

    Returns:
      `(draws, counts, finished, out_of_blocks)`: NumPy draws `[S,
      num_steps]`, the tokens each row drew, the rows that finished on the
      device, and whether the loop stopped for lack of blocks.
    """
    before = self.num_generated.copy()
    running = self.seq_ids >= 0
    loop = self.decode_carry(num_steps)
    # The beam step compiles only once a beam group runs.
    with_beams = bool(np.any(self.in_beam_group & running))
    loop = _decode_loop(self.graphdef, self.params, self.rows, loop,
                        jnp.array(stop_on_finish), with_beams)
    self.state, self.kv, self.beams = loop.state, loop.kv, loop.beams
    self.seq_ids = np.array(loop.seq_ids)
    self.last_token = np.array(loop.last_token)
    self.num_generated = np.array(loop.num_generated)
    counters = self.counters
    counters["cow_copies"] += int(loop.cow_copies)
    counters["peak_blocks"] = max(counters["peak_blocks"],
                                  int(loop.peak_blocks))
    counters["utilization_sum"] += float(loop.utilization_sum)
    counters["decode_steps"] += int(loop.step)
    counters["loop_launches"] += 1
    finished = running & (self.seq_ids < 0)
    return (jax.tree.map(np.asarray, loop.draws), self.num_generated - before,
            finished, bool(loop.out_of_blocks))
