"""The jitted programs the model runner launches: the ragged step, the decode
loop and (for speculation) prefill.

`ragged_step` is one engine step with prompt work: the step's prompt
chunks and one decode step of every running row, packed on one token axis
and run through the model together. It draws each row's next token and the
first token of the sequences whose prompt the chunks complete.

`decode_loop` runs the decode-only stretches between such steps: up to
`max_steps` decode steps in one compiled `lax.while_loop` whose every step
calls `append_slots` for all running rows, executes the copy-on-write plan,
writes K/V and attends through the paged cache, samples each row with its
own parameters, runs the beam-search step when beam groups run, checks stop
tokens and token limits, and frees the rows that finished. With structured
outputs, a table of the constrained rows' automata (`paged_jax.structured`)
rides along: each step masks those rows' logits before sampling and
advances their states in the carry, and a row whose state allows no token
finishes; without one the step masks nothing. It hands control back early
when a data shard's blocks run out (the scheduler preempts) or, if asked,
when a row finishes (the scheduler admits more).

`prefill` runs prompt chunks alone, each data shard's packed into one token
axis, for a speculating engine. The decode loop's rows are the running
sequences, each data shard's padded to a row bucket, or every global
sequence slot (see `paged_jax.engine.cache_manager`) while a beam group
runs; every program compiles once per shape (rows and tokens are
bucketed).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import kv_cache as kv_ops
from paged_jax import sharding, structured
from paged_jax.block_manager import manager
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.state import BlockManagerState, CopyPlan, on_every_shard
from paged_jax.config import Status
from paged_jax.engine import beam, speculative
from paged_jax.engine.sampling import (
  Draw,
  RowParams,
  categorical_rows,
  greedy_tokens,
  is_stop,
  row_keys,
  sample_rows,
  sampling_logits,
)
from paged_jax.kv_cache import KVCache
from paged_jax.models.paged import paged_cache, take_tiles, tile_token_index, untile


@flax.struct.dataclass
class DecodeLoop:
  """Carry of the decode loop.

  Rows are running sequences, `R / D` per data shard: row `r` decodes
  global slot `seq_ids[r]`, a slot of shard `r // (R / D)`. With `beams`,
  rows are every slot in order (`seq_ids[r]` is `r` or -1).
  """

  state: BlockManagerState  # one per data shard (leading axis)
  kv: KVCache
  seq_ids: jax.Array  # int32[R], -1 where not running
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


def _per_shard(ids: jax.Array, num_shards: int, slots_per_shard: int) -> jax.Array:
  """Rows' global slots `[R]` (-1: none) as each shard's local slots
  `[D, R/D]` (row `r` holds a slot of shard `r // (R/D)`)."""
  return jnp.where(ids >= 0, ids % slots_per_shard, -1).reshape(num_shards, -1)


def _pairs_per_shard(ids: jax.Array, num_shards: int, per: int) -> jax.Array:
  """Global slots `[K]` as local slots `[D, K]`, -1 outside each shard."""
  shard = jnp.where(ids >= 0, ids // per, -1)
  mine = shard[None, :] == jnp.arange(num_shards)[:, None]
  return jnp.where(mine, ids % per, -1)


def _decode_step(
  graphdef,
  params_state,
  rows: RowParams,
  table: structured.AutomatonTable | None,
  loop: DecodeLoop,
) -> DecodeLoop:
  """One decode step of every running row, or the shards out of blocks.

  With `loop.beams` (rows are slots), the beam-search step runs in the
  steps where a row of a beam group runs and is skipped in the others;
  without (rows are the running sequences), there is none. With a
  `table`, each constrained row draws from its masked logits, then its
  automaton steps; a row whose new state allows no token finishes. Without
  one (None, no constrained row runs), nothing is masked.
  """
  state, plan = _append_last_tokens(loop)
  out_of_blocks = plan.status != Status.OK
  advance = lambda _: _advance(graphdef, params_state, rows, table, loop, state, plan)[0]
  return jax.lax.cond(
    ~jnp.any(out_of_blocks), advance, lambda _: loop.replace(out_of_blocks=out_of_blocks), None
  )


def _append_last_tokens(loop: DecodeLoop):
  """`append_slots` of every running row's last token, on every shard."""
  cfg = loop.state.cfg
  num_shards = loop.out_of_blocks.shape[0]
  running = loop.seq_ids >= 0
  shaped = lambda a: a.reshape(num_shards, -1, *a.shape[1:])
  return on_every_shard(BlockSpaceManager(cfg).append_slots)(
    loop.state,
    _per_shard(loop.seq_ids, num_shards, cfg.max_seqs),
    shaped(loop.last_token[:, None]),
    shaped(running.astype(jnp.int32)),
  )


def _call_model(model, tokens, positions, cache, kv):
  """The model's logits `[R, 1, vocab]` at the decode rows' tokens, and
  the cache after the call; nothing else."""
  logits, cache = model(sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache)
  return logits, cache, None


def _advance(
  graphdef,
  params_state,
  rows: RowParams,
  table: structured.AutomatonTable | None,
  loop: DecodeLoop,
  state: BlockManagerState,
  plan: CopyPlan,
  call_model=_call_model,
):
  """The decode step after its `append_slots` (`state`, `plan`): the
  model call, draws, stop checks, the beam step and frees (see
  `_decode_step`). `call_model(model, tokens, positions, cache, kv)` runs
  the rows' tokens `[R, 1]` through the model: `(logits [R, 1, vocab],
  cache, extra)`. Returns `(loop, extra)`."""
  cfg = loop.state.cfg
  bm = BlockSpaceManager(cfg)
  num_shards = loop.out_of_blocks.shape[0]
  running = loop.seq_ids >= 0
  local = _per_shard(loop.seq_ids, num_shards, cfg.max_seqs)
  shaped = lambda a: a.reshape(num_shards, -1, *a.shape[1:])
  flat = lambda a: a.reshape(-1, *a.shape[2:])
  kv = copy_for_append(loop.kv, loop.state, state, local, plan, 1)
  num_tokens = flat(on_every_shard(bm.get_num_tokens)(state, local))
  slot_mapping = on_every_shard(functools.partial(bm.get_slot_mapping, width=1))(
    state, local, shaped(running.astype(jnp.int32))
  )
  cache = paged_cache(
    kv=kv,
    block_tables=flat(on_every_shard(bm.get_block_tables)(state, local)),
    slot_mapping=flat(slot_mapping),
    cache_sliding_window=cfg.sliding_window,
  )
  positions = jnp.where(running, num_tokens - 1, -1)[:, None]
  model = graphdef.merge(params_state)
  logits, cache, extra = call_model(model, loop.last_token[:, None], positions, cache, kv)
  num_logprobs = loop.draws.top_ids.shape[-1]
  mask = None if table is None else structured.allowed_mask(table, loop.automaton_state)
  draw = sample_rows(logits[:, 0], rows, loop.num_generated, num_logprobs, mask)
  column = jnp.where(running, loop.step, loop.draws.tokens.shape[1])
  draws = jax.tree.map(
    lambda out, new: out.at[jnp.arange(out.shape[0]), column].set(new, mode="drop"),
    loop.draws,
    draw,
  )
  sampled = running if loop.beams is None else running & (loop.beams.leader < 0)
  num_generated = loop.num_generated + sampled
  done = sampled & ((num_generated >= loop.limit) | is_stop(draw.tokens, rows.stop_ids))
  automaton_state = loop.automaton_state
  if table is not None:
    automaton_state = jnp.where(
      sampled, structured.advance(table, automaton_state, draw.tokens), automaton_state
    )
    done = done | (sampled & structured.is_dead(table, automaton_state))
  used = cfg.num_gpu_blocks - on_every_shard(bm.num_free_gpu_blocks)(state)
  held = jnp.sum(num_tokens)
  seq_ids = jnp.where(done, -1, loop.seq_ids)
  last_token = jnp.where(sampled, draw.tokens, loop.last_token)
  s, per = running.shape[0], cfg.max_seqs
  num_pairs = 0 if loop.beams is None else s * 2 * loop.beams.hyp_len.shape[1]

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
    forked, _ = on_every_shard(bm.fork_each)(
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

  if loop.beams is None:
    forked, beams, moves = no_beams(None)
  else:
    forked, beams, moves = jax.lax.cond(
      jnp.any(running & (loop.beams.leader >= 0)), beam_step, no_beams, None
    )
  freed, _ = on_every_shard(bm.free)(
    forked, _per_shard(jnp.where(done | moves.dropped, loop.seq_ids, -1), num_shards, per)
  )
  return loop.replace(
    state=freed,
    kv=cache.kv,
    seq_ids=moves.seq_ids,
    last_token=moves.last_token,
    num_generated=moves.num_generated,
    beams=beams,
    automaton_state=automaton_state,
    draws=draws,
    step=loop.step + 1,
    rows_run=loop.rows_run + jnp.sum(running),
    finished_any=loop.finished_any | jnp.any(done) | jnp.any(moves.finished),
    cow_copies=loop.cow_copies + jnp.sum(plan.count),
    peak_blocks=jnp.maximum(loop.peak_blocks, jnp.max(used)),
    utilization_sum=loop.utilization_sum + held / jnp.maximum(jnp.sum(used) * cfg.block_size, 1),
  ), extra


def _speculative_step(
  graphdef,
  params_state,
  rows: RowParams,
  table: structured.AutomatonTable | None,
  config: speculative.SpeculativeConfig,
  draft,
  loop: DecodeLoop,
) -> DecodeLoop:
  """One speculating decode step of every running row (no beams), or the
  shards out of blocks.

  Each row appends its pending proposals and last token with `k` lookahead
  slots, proposes up to `k` tokens (`speculative.propose_ngram`, or the
  `draft` model's `(graphdef, params)`; none for a constrained row, and none
  past its token limit), and the target runs once over the last token and
  the proposals. The row then emits the accepted
  proposals and one token of the target's (see `paged_jax.engine.speculative`),
  cut after a stop token; the accepted ones stay pending for the next
  `append_slots`, which registers only them.
  """
  cfg = loop.state.cfg
  bm = BlockSpaceManager(cfg)
  spec, k = loop.spec, config.num_speculative_tokens
  num_shards = loop.out_of_blocks.shape[0]
  num_rows = loop.seq_ids.shape[0]
  row_ids = jnp.arange(num_rows)
  running = loop.seq_ids >= 0
  local = _per_shard(loop.seq_ids, num_shards, cfg.max_seqs)
  shaped = lambda a: a.reshape(num_shards, -1, *a.shape[1:])
  flat = lambda a: a.reshape(-1, *a.shape[2:])
  new_tokens = jnp.concatenate([spec.pending, spec.pending[:, :1]], axis=1)
  new_tokens = new_tokens.at[row_ids, spec.num_pending].set(loop.last_token)
  num_new = jnp.where(running, spec.num_pending + 1, 0)
  state, plan = on_every_shard(functools.partial(bm.append_slots, num_lookahead_slots=k))(
    loop.state, local, shaped(new_tokens), shaped(num_new)
  )

  def advance(_):
    kv = copy_for_append(loop.kv, loop.state, state, local, plan, k + 1)
    num_tokens = flat(on_every_shard(bm.get_num_tokens)(state, local))
    tables = flat(on_every_shard(bm.get_block_tables)(state, local))
    if draft is None:
      drafts, count = speculative.propose_ngram(
        spec.history, spec.history_len, k, config.prompt_lookup_min, config.prompt_lookup_max
      )
    else:
      drafts, draft_dists, kv = _draft_proposals(draft, rows, loop, kv, tables, num_tokens, k)
      count = jnp.full(num_rows, k, jnp.int32)
    room = jnp.maximum(loop.limit - loop.num_generated - 1, 0)
    count = jnp.where(
      running & (loop.automaton_state == structured.UNCONSTRAINED), jnp.minimum(count, room), 0
    )
    offsets = jnp.arange(k + 1)
    tokens = jnp.concatenate([loop.last_token[:, None], drafts], axis=1)
    queried = running[:, None] & (offsets[None, :] <= count[:, None])
    positions = jnp.where(queried, num_tokens[:, None] - 1 + offsets[None, :], -1)
    cache = paged_cache(
      kv=kv,
      block_tables=tables,
      slot_mapping=slots_of(tables, positions, cfg.block_size),
      cache_sliding_window=cfg.sliding_window,
    )
    model = graphdef.merge(params_state)
    logits, cache = model(
      sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache
    )
    draw = _draw_every_position(logits, rows, loop, table, loop.draws.top_ids.shape[-1])
    accepted = speculative.leading_true(
      (drafts == draw.tokens[:, :k]) & (offsets[None, :k] < count[:, None])
    )
    if draft is not None:  # sampled rows: the rule for a draft distribution
      accepted, draw = _accept_sampled_drafts(
        logits, rows, loop, drafts, draft_dists, count, accepted, draw
      )
    stops = jnp.any(draw.tokens[..., None] == rows.stop_ids[:, None, :], axis=-1)
    first_stop = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1), k + 1)
    num_emitted = jnp.where(running, jnp.minimum(accepted + 1, first_stop + 1), 0)
    num_generated = loop.num_generated + num_emitted
    done = running & ((num_generated >= loop.limit) | (first_stop < num_emitted))
    automaton_state = loop.automaton_state
    if table is not None:  # constrained rows emit one token
      automaton_state = jnp.where(
        running, structured.advance(table, automaton_state, draw.tokens[:, 0]), automaton_state
      )
      done = done | (running & structured.is_dead(table, automaton_state))
    emitted = offsets[None, :] < num_emitted[:, None]
    column = jnp.where(
      emitted, spec.emitted[:, None] + offsets[None, :], loop.draws.tokens.shape[1]
    )
    draws = jax.tree.map(
      lambda out, new: out.at[row_ids[:, None], column].set(new, mode="drop"), loop.draws, draw
    )
    at = jnp.where(emitted, spec.history_len[:, None] + offsets[None, :], spec.history.shape[1])
    last = jnp.maximum(num_emitted - 1, 0)
    used = cfg.num_gpu_blocks - on_every_shard(bm.num_free_gpu_blocks)(state)
    freed, _ = on_every_shard(bm.free)(
      state, _per_shard(jnp.where(done, loop.seq_ids, -1), num_shards, cfg.max_seqs)
    )
    proposed = jnp.stack([jnp.sum(count > 0), jnp.sum(count), jnp.sum(accepted)])
    return loop.replace(
      state=freed,
      kv=cache.kv,
      seq_ids=jnp.where(done, -1, loop.seq_ids),
      last_token=jnp.where(running, draw.tokens[row_ids, last], loop.last_token),
      num_generated=num_generated,
      automaton_state=automaton_state,
      draws=draws,
      step=loop.step + 1,
      rows_run=loop.rows_run + jnp.sum(running),
      finished_any=loop.finished_any | jnp.any(done),
      cow_copies=loop.cow_copies + jnp.sum(plan.count),
      peak_blocks=jnp.maximum(loop.peak_blocks, jnp.max(used)),
      utilization_sum=loop.utilization_sum
      + jnp.sum(num_tokens) / jnp.maximum(jnp.sum(used) * cfg.block_size, 1),
      spec=spec.replace(
        history=spec.history.at[row_ids[:, None], at].set(draw.tokens, mode="drop"),
        history_len=spec.history_len + num_emitted,
        pending=draw.tokens[:, :k],
        num_pending=jnp.where(done, 0, last),
        emitted=spec.emitted + num_emitted,
        counts=spec.counts + proposed.astype(jnp.int32),
      ),
    )

  out_of_blocks = plan.status != Status.OK
  return jax.lax.cond(
    ~jnp.any(out_of_blocks), advance, lambda _: loop.replace(out_of_blocks=out_of_blocks), None
  )


def _accept_sampled_drafts(logits, rows, loop, drafts, draft_dists, count, accepted, draw):
  """Greedy rows keep `accepted` and `draw` (point-mass proposals); sampled
  rows take `speculative.accept_sampled`'s drafts and tokens, with the
  target's log-probabilities of those."""
  num_rows, width, vocab = logits.shape
  every = lambda a: jnp.repeat(a, width, axis=0)
  flat_logits = logits.reshape(-1, vocab)
  target = jax.nn.softmax(sampling_logits(flat_logits, jax.tree.map(every, rows)), axis=-1)
  index = loop.num_generated[:, None] + jnp.arange(width)[None, :]
  keys = row_keys(jax.tree.map(every, rows), index.ravel()).reshape(num_rows, width)
  sampled_accepted, tokens = speculative.accept_sampled(
    target.reshape(num_rows, width, vocab), draft_dists, drafts, count, keys
  )
  greedy = rows.temperature <= 0.0
  tokens = jnp.where(greedy[:, None], draw.tokens, tokens)
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.where(greedy, accepted, sampled_accepted), draw.replace(
    tokens=tokens, logprob=jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
  )


def _draw_every_position(logits, rows: RowParams, loop: DecodeLoop, table, num_logprobs) -> Draw:
  """The target's draw after every query position `[R, k + 1]`: position
  `i` of a row is its output token `num_generated + i` (keyed so), masked by
  the row's automaton at position 0 (a constrained row proposes nothing)."""
  num_rows, width, vocab = logits.shape
  every = lambda a: jnp.repeat(a, width, axis=0)
  mask = None
  if table is not None:
    first = structured.allowed_mask(table, loop.automaton_state)
    mask = jnp.ones((num_rows, width, vocab), bool).at[:, 0].set(first).reshape(-1, vocab)
  index = (loop.num_generated[:, None] + jnp.arange(width)[None, :]).ravel()
  draw = sample_rows(
    logits.reshape(-1, vocab), jax.tree.map(every, rows), index, num_logprobs, mask
  )
  return jax.tree.map(lambda a: a.reshape(num_rows, width, *a.shape[1:]), draw)


def slots_of(tables: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
  """The cache slot of each position `[rows, width]` (-1: none) through the
  rows' block tables."""
  blocks = jnp.take_along_axis(tables, jnp.maximum(positions, 0) // block_size, axis=1)
  return jnp.where(
    (positions >= 0) & (blocks >= 0), blocks * block_size + positions % block_size, -1
  )


def _append_pending(loop: DecodeLoop) -> DecodeLoop:
  """Appends each row's pending accepted proposals to the manager (their
  K/V is in the cache already), so that between launches the manager holds
  every token but `last_token`, as without speculation."""
  cfg, spec = loop.state.cfg, loop.spec
  bm = BlockSpaceManager(cfg)
  num_shards = loop.out_of_blocks.shape[0]
  local = _per_shard(loop.seq_ids, num_shards, cfg.max_seqs)
  shaped = lambda a: a.reshape(num_shards, -1, *a.shape[1:])
  state, plan = on_every_shard(bm.append_slots)(
    loop.state, local, shaped(spec.pending), shaped(spec.num_pending)
  )
  kv = copy_for_append(loop.kv, loop.state, state, local, plan, spec.pending.shape[1])
  return loop.replace(
    state=state, kv=kv, spec=spec.replace(num_pending=jnp.zeros_like(spec.num_pending))
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
    seq_ids: int32[B] the step's local slots, -1 where no row runs.
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
  last = jnp.maximum(manager.get_num_tokens(after, seq_ids) - 1, 0) // block_size
  columns = last[:, None] - jnp.arange(span)[None, :]
  blocks_at = lambda state: jnp.take_along_axis(
    manager.get_block_tables(state, seq_ids), jnp.maximum(columns, 0), axis=1
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


@functools.partial(jax.jit, static_argnums=(0, 6, 7), donate_argnums=(3,))
def decode_loop(
  graphdef,
  params_state,
  rows: RowParams,
  loop: DecodeLoop,
  stop_on_finish,
  table: structured.AutomatonTable | None = None,
  speculating: speculative.SpeculativeConfig | None = None,
  draft_graphdef=None,
  draft_params=None,
) -> DecodeLoop:
  """Decodes until no row runs, a shard runs out of blocks, the launch's
  steps are done (`loop.max_steps`, at most the draws' columns), or (if
  asked) a row finishes. `table` holds the automata
  of the constrained rows (None when none runs; one compile per table
  bucket). With `speculating` (and `loop.spec`), each step is a
  speculating one (proposing with the draft model `draft_graphdef`,
  `draft_params` when it has one), and the rows' pending proposals are
  appended at the end."""
  per_step = 1 if speculating is None else speculating.num_speculative_tokens + 1
  num_steps = loop.draws.tokens.shape[1] // per_step

  def keep_going(loop):
    return (
      jnp.any(loop.seq_ids >= 0)
      & ~jnp.any(loop.out_of_blocks)
      & (loop.step < jnp.minimum(num_steps, loop.max_steps))
      & ~(stop_on_finish & loop.finished_any)
    )

  if speculating is None:
    step = functools.partial(_decode_step, graphdef, params_state, rows, table)
  else:
    draft = None if draft_graphdef is None else (draft_graphdef, draft_params)
    step = functools.partial(
      _speculative_step, graphdef, params_state, rows, table, speculating, draft
    )
  loop = jax.lax.while_loop(keep_going, step, loop)
  if speculating is not None:
    loop = _append_pending(loop)
  kv = loop.kv
  return sharding.replicate(loop.replace(kv=None), kv).replace(kv=kv)


# A continued launch's carry: the rows' state carries on, the launch's
# draws and counters start afresh.
_CARRIED = (
  "seq_ids",
  "last_token",
  "num_generated",
  "limit",
  "automaton_state",
  "out_of_blocks",
)
_FRESH = (
  "draws",
  "step",
  "rows_run",
  "finished_any",
  "cow_copies",
  "peak_blocks",
  "utilization_sum",
)


@jax.jit
def _next_launch_rows(loop: DecodeLoop) -> dict:
  """Copies of the rows' carry (the launch that takes them donates them,
  and the host still reads the originals) and a fresh launch's draws and
  counters."""
  take = lambda names, fn: {name: jax.tree.map(fn, getattr(loop, name)) for name in names}
  return take(_CARRIED, jnp.copy) | take(_FRESH, jnp.zeros_like)


def continue_decoding(loop: DecodeLoop, max_steps: jax.Array) -> DecodeLoop:
  """The carry of the decode launch that continues a dispatched one
  (`decode_loop`'s output `loop`, maybe not computed yet) on the same rows
  for `max_steps` steps at most: its pages, manager state, rows and beams,
  fresh draws. A launch that ran out of blocks hands that on, so the one
  after it runs no step."""
  rows = _next_launch_rows(loop.replace(state=None, kv=None, beams=None))
  return loop.replace(**rows, max_steps=max_steps)


@flax.struct.dataclass
class PromptScores:
  """Log-probabilities of the prompt tokens that follow each chunk position.

  Attributes:
    logprob: float32 `[rows, tokens]`, of the next prompt token.
    top_ids: int32 `[rows, tokens, k]`, the most likely next tokens.
    top_logprobs: float32 `[rows, tokens, k]`, their log-probabilities.
  """

  logprob: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def score_next_tokens(logits, next_tokens, num_logprobs: int) -> PromptScores:
  """Each position's log-probability of `next_tokens` (-1: none) and the
  `num_logprobs` most likely tokens, from logits `[rows, width, vocab]`."""
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_tokens, 0)[..., None], axis=-1)[..., 0]
  top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
  return PromptScores(
    logprob=jnp.where(next_tokens >= 0, chosen, 0.0),
    top_ids=top_ids.astype(jnp.int32),
    top_logprobs=top_logprobs,
  )


@functools.partial(
  jax.jit, static_argnums=(0, 12), static_argnames=("draft_graphdef",), donate_argnums=(2,)
)
def prefill(
  graphdef,
  params_state,
  kv,
  states,
  tokens,
  positions,
  tiles,
  tile_slots,
  write_from,
  next_tokens,
  last_token_of,
  rows,
  num_logprobs,
  table=None,
  draw_states=None,
  draft_params=None,
  draft_graphdef=None,
):
  """Runs prompt chunks packed per data shard, then draws token 0 of
  sequences from their logits.

  `tokens` and `positions` `[D, T]` hold each data shard's chunks one after
  another (padding has position -1), so the model's matmuls run `T` tokens
  per shard whatever the chunks' lengths; attention runs per tile (see
  `PagedCache.query_tiles`): `tiles` `[D * R, W]` index the tokens of each
  tile in its shard's row, and `tile_slots` int32 `[D, R]` are the tiles'
  slots in their shard (-1: no tile). A tile's positions before
  `write_from[tile]` already hold their K/V in the cache and are not
  written again. Draw `i` samples from the token at `last_token_of[i]` (an
  index into the `D * T` tokens) with the sampling parameters `rows[i]`,
  masked by `table`'s automaton state `draw_states[i]` when there is a
  `table`. Where a token has `next_tokens` (>= 0), it also scores them (see
  `score_next_tokens`; the vocabulary-wide work runs only when some token
  asks). A model with `hidden_states` and `logits` (see `ModelProtocol`)
  runs its output layer only at the drawing tokens, and at every token
  only when some token scores. With a speculative draft model
  (`draft_graphdef`, `draft_params`), the chunks also run through it,
  writing its layers of the cache.
  """
  tables, slots = _prompt_tables_and_slots(states, positions, tiles, tile_slots, write_from)
  cache = paged_cache(
    kv=kv,
    block_tables=tables,
    slot_mapping=slots,
    cache_sliding_window=states.cfg.sliding_window,
    query_tiles=tiles,
  )
  model = graphdef.merge(params_state)
  args = sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache
  hidden, cache, logits_of = _hidden_states(model, args)
  last_logits = logits_of(hidden.reshape(-1, hidden.shape[-1])[last_token_of])
  index = jnp.zeros(last_token_of.shape, jnp.int32)
  mask = None if table is None else structured.allowed_mask(table, draw_states)
  draw = sample_rows(last_logits, rows, index, num_logprobs, mask)
  scores = _scores_if_asked(logits_of, hidden, next_tokens, num_logprobs)
  kv = cache.kv
  if draft_graphdef is not None:
    _, kv = _draft_call(
      (draft_graphdef, draft_params),
      kv,
      model.config.num_layers,
      tokens,
      positions,
      tables,
      slots,
      states.cfg.sliding_window,
      logits=False,
      query_tiles=tiles,
    )
  return sharding.replicate((draw, scores), kv), kv


def _prompt_tables_and_slots(states, positions, tiles, tile_slots, write_from):
  """A packed prompt call's block table per tile and cache slot per token
  (-1 where a token's K/V is written already, or padding); see `prefill`."""
  tables = on_every_shard(manager.get_block_tables)(states, tile_slots)
  tables = tables.reshape(-1, tables.shape[-1])
  flat = tile_token_index(tiles, *positions.shape)
  tile_positions = take_tiles(positions, flat, -1)
  written = jnp.where(tile_positions >= write_from[:, None], tile_positions, -1)
  slots = untile(slots_of(tables, written, states.cfg.block_size), flat, positions.shape, -1)
  return tables, slots


def _hidden_states(model, args):
  """`(hidden states, cache, logits_of)` of a model call on `args`:
  `logits_of` maps hidden states to logits, so a model with
  `hidden_states` and `logits` (see `ModelProtocol`) runs its output layer
  only where asked; another model's call gives logits already."""
  if hasattr(model, "hidden_states") and hasattr(model, "logits"):
    hidden, cache = model.hidden_states(*args)
    return hidden, cache, model.logits
  logits, cache = model(*args)
  return logits, cache, lambda logits: logits


def _scores_if_asked(logits_of, hidden, next_tokens, num_logprobs: int) -> PromptScores:
  """`score_next_tokens` at every position, run only when some token asks
  (`next_tokens >= 0`); zeros otherwise."""
  score = lambda: score_next_tokens(logits_of(hidden), next_tokens, num_logprobs)
  return jax.lax.cond(
    jnp.any(next_tokens >= 0),
    score,
    lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(score)),
  )


@functools.partial(jax.jit, static_argnums=(0, 12), donate_argnums=(3,))
def ragged_step(
  graphdef,
  params_state,
  rows: RowParams,
  loop: DecodeLoop,
  tokens,
  positions,
  tiles,
  tile_slots,
  write_from,
  next_tokens,
  last_token_of,
  sample_params: RowParams,
  num_logprobs: int,
  table=None,
  draw_states=None,
):
  """One engine step: prompt chunks and one decode step of the running rows
  in one ragged model call; draws each row's next token and token 0 of the
  sequences whose prompt the chunks complete.

  Each data shard's token axis holds its prompt chunks packed (`tokens`,
  `positions` `[D, T]`: every chunk has its own length and first position,
  attended in `tiles` through its sequence's block table; as in `prefill`),
  then its decode rows' last tokens, one query each (attended by the decode
  kernel through the row's table, see `PagedCache.decode_tables`): the
  model's weights are read once for the whole step. The rows' step is
  `_decode_step`'s, except that when a shard is out of blocks no row
  decodes (the chunks still run) and `out_of_blocks` says so. Draw `i`
  samples from the prompt token at `last_token_of[i]` with
  `sample_params[i]`, masked by `table`'s state `draw_states[i]` when there
  is a `table`, which also holds the rows' automata
  (`loop.automaton_state`).

  Returns:
    `(loop after the step, draws, prompt scores)` as `decode_loop` and
    `prefill` return them.
  """
  state, plan = _append_last_tokens(loop)
  out_of_blocks = plan.status != Status.OK
  blocked = jnp.any(out_of_blocks)
  state = jax.tree.map(lambda new, old: jnp.where(blocked, old, new), state, loop.state)
  plan = plan.replace(count=jnp.where(blocked, 0, plan.count))
  prompt_tables, prompt_slots = _prompt_tables_and_slots(
    state, positions, tiles, tile_slots, write_from
  )
  num_shards, num_prompt_tokens = tokens.shape

  def call_model(model, row_tokens, row_positions, cache, kv):
    per_shard = lambda a: a.reshape(num_shards, -1)
    ragged = paged_cache(
      kv=cache.kv,
      block_tables=prompt_tables,
      slot_mapping=jnp.concatenate([prompt_slots, per_shard(cache.slot_mapping)], axis=1),
      cache_sliding_window=cache.cache_sliding_window,
      query_tiles=tiles,
      decode_tables=cache.block_tables,
    )
    args = (
      sharding.split_rows(jnp.concatenate([tokens, per_shard(row_tokens)], axis=1), kv),
      sharding.split_rows(jnp.concatenate([positions, per_shard(row_positions)], axis=1), kv),
      ragged,
    )
    hidden, ragged, logits_of = _hidden_states(model, args)
    prompt_hidden = hidden[:, :num_prompt_tokens]
    row_hidden = hidden[:, num_prompt_tokens:].reshape(-1, hidden.shape[-1])
    sample_hidden = prompt_hidden.reshape(-1, hidden.shape[-1])[last_token_of]
    logits = logits_of(jnp.concatenate([row_hidden, sample_hidden]))
    num_rows = row_tokens.shape[0]
    scores = _scores_if_asked(logits_of, prompt_hidden, next_tokens, num_logprobs)
    return logits[:num_rows, None], ragged, (logits[num_rows:], scores)

  decoding = loop.replace(seq_ids=jnp.where(blocked, -1, loop.seq_ids))
  stepped, (sample_logits, scores) = _advance(
    graphdef, params_state, rows, table, decoding, state, plan, call_model
  )
  stepped = stepped.replace(
    seq_ids=jnp.where(blocked, loop.seq_ids, stepped.seq_ids), out_of_blocks=out_of_blocks
  )
  index = jnp.zeros(last_token_of.shape, jnp.int32)
  mask = None if table is None else structured.allowed_mask(table, draw_states)
  draw = sample_rows(sample_logits, sample_params, index, num_logprobs, mask)
  kv = stepped.kv
  stepped, draw, scores = sharding.replicate((stepped.replace(kv=None), draw, scores), kv)
  return stepped.replace(kv=kv), draw, scores


def _draft_call(
  draft, kv, first_layer, tokens, positions, tables, slots, window, logits=True, query_tiles=None
):
  """The draft model's forward over its layers of `kv` (from `first_layer`
  on): `(logits or, without `logits`, hidden states where the model has
  them, the cache)`; `query_tiles` for a packed call (see `PagedCache`)."""
  graph, params = draft
  model = graph.merge(params)
  cache = paged_cache(
    kv=kv.layers(first_layer),
    block_tables=tables,
    slot_mapping=slots,
    cache_sliding_window=window,
    query_tiles=query_tiles,
  )
  args = sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache
  if not logits and hasattr(model, "hidden_states"):
    out, cache = model.hidden_states(*args)
  else:
    out, cache = model(*args)
  return out, kv.with_layers(first_layer, cache.kv)


def _draft_draw(logits, rows: RowParams, index):
  """A draft model's token per row (its argmax for greedy rows, else drawn
  from its sampling distribution with the token's key salted) and that
  distribution, float32 `[rows, vocab]`."""
  processed = sampling_logits(logits, rows)
  drawn = categorical_rows(row_keys(rows, index, salt=3), processed)
  tokens = jnp.where(rows.temperature <= 0.0, greedy_tokens(logits), drawn)
  return tokens.astype(jnp.int32), jax.nn.softmax(processed, axis=-1)


def _draft_proposals(draft, rows: RowParams, loop: DecodeLoop, kv, tables, num_tokens, k):
  """`k` tokens per row from the draft model, the distributions they were
  drawn from (`[R, k]`, float32 `[R, k, vocab]`), and the cache with the
  draft's K/V.

  The first call runs the row's last `k + 1` tokens (from `spec.history`)
  at their positions: the draft has not run the newest ones (the last
  token, and proposals it made but never ran, the last of a launch's
  included); rerunning older ones rewrites the same K/V. Then `k - 1` calls
  run one proposal each. Proposal `j` is the row's output token
  `num_generated + j`, keyed so (salted).
  """
  cfg, history = loop.state.cfg, loop.spec.history
  graph, params = draft
  first_layer = len(kv.k) - graph.merge(params).config.num_layers
  call = lambda kv, tokens, positions: _draft_call(
    draft,
    kv,
    first_layer,
    tokens,
    positions,
    tables,
    slots_of(tables, positions, cfg.block_size),
    cfg.sliding_window,
  )
  running = loop.seq_ids >= 0
  recent = num_tokens[:, None] - (k + 1) + jnp.arange(k + 1)[None, :]
  positions = jnp.where(running[:, None] & (recent >= 0), recent, -1)
  tokens = jnp.take_along_axis(history, jnp.clip(recent, 0, history.shape[1] - 1), axis=1)
  logits, kv = call(kv, tokens, positions)
  token, probs = _draft_draw(logits[:, -1], rows, loop.num_generated)
  tokens = jnp.zeros((token.shape[0], k), jnp.int32).at[:, 0].set(token)
  dists = jnp.zeros((*probs.shape[:1], k, probs.shape[1]), jnp.float32).at[:, 0].set(probs)

  def propose(j, carry):
    tokens, dists, kv = carry
    positions = jnp.where(running, num_tokens - 1 + j, -1)[:, None]
    logits, kv = call(kv, jax.lax.dynamic_slice_in_dim(tokens, j - 1, 1, axis=1), positions)
    token, probs = _draft_draw(logits[:, 0], rows, loop.num_generated + j)
    return tokens.at[:, j].set(token), dists.at[:, j].set(probs), kv

  return jax.lax.fori_loop(1, k, propose, (tokens, dists, kv))


start_beams = jax.jit(beam.Beams.start)
clear_beams = jax.jit(beam.Beams.clear)
