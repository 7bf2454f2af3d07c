"""The decode loop: `decode_loop` runs up to `max_steps` decode steps in one
compiled `lax.while_loop`.

Each step (`decode_step`) calls `append_slots` for all running rows,
executes the copy-on-write plan, writes K/V and attends through the paged
cache, samples each row with its own parameters, runs the beam-search step
when beam groups run, checks stop tokens and token limits, and frees the
rows that finished. With structured outputs, a table of the constrained
rows' automata (`paged_jax.structured`) rides along: each step masks those
rows' logits before sampling and advances their states in the carry, and
a row whose state allows no token finishes; without one the step masks
nothing. The loop hands control back early when a data shard's blocks run
out (the scheduler preempts), if asked, when a row finishes (the
scheduler admits more), and, with the engine's arrival check, before the
first step after a request arrived (`paged_jax.engine.arrivals`). With
streamed steps, each step publishes its draws as it ends
(`paged_jax.engine.step_stream`). A speculating loop's step is
`paged_jax.engine.programs.speculating`'s. `continue_decoding` is the carry
of the launch that continues a dispatched one (async scheduling).

The rows are the running sequences, each data shard's padded to a row
bucket, or every global sequence slot (see
`paged_jax.engine.cache_manager`) while a beam group runs; the loop
compiles once per shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_jax import sharding, structured
from paged_jax.block_manager.state import BlockManagerState, CopyPlan, on_every_shard
from paged_jax.engine import arrivals, beam, speculative, step_stream
from paged_jax.engine.programs.carry import (
  DecodeLoop,
  by_shard,
  flat,
  pairs_per_shard,
  shard_seq_ids,
)
from paged_jax.engine.programs.speculating import append_pending, speculative_step
from paged_jax.engine.programs.step import (
  append_last_tokens,
  copy_for_append,
  finish_step,
  ops,
  step_automata,
  unless_out_of_blocks,
)
from paged_jax.paged_cache import paged_cache
from paged_jax.sampling import (
  RowParams,
  is_stop,
  sample_rows,
)


def decode_step(
  graphdef,
  params_state,
  row_params: RowParams,
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
  state, plan = append_last_tokens(loop)
  advance = lambda _: advance_rows(graphdef, params_state, row_params, table, loop, state, plan)[0]
  return unless_out_of_blocks(loop, plan, advance)


def _call_model(model, tokens, positions, cache, kv):
  """The model's logits `[R, 1, vocab]` at the decode rows' tokens, and
  the cache after the call; nothing else."""
  logits, cache = model(sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache)
  return logits, cache, None


def advance_rows(
  graphdef,
  params_state,
  row_params: RowParams,
  table: structured.AutomatonTable | None,
  loop: DecodeLoop,
  state: BlockManagerState,
  plan: CopyPlan,
  call_model=_call_model,
):
  """The decode step after its `append_slots` (`state`, `plan`): the
  model call, draws, stop checks, the beam step and frees (see
  `decode_step`). `call_model(model, tokens, positions, cache, kv)` runs
  the rows' tokens `[R, 1]` through the model: `(logits [R, 1, vocab],
  cache, extra)`. Returns `(loop, extra)`."""
  cfg = loop.state.cfg
  bm = ops(state)
  num_shards = loop.out_of_blocks.shape[0]
  running = loop.slots >= 0
  local = shard_seq_ids(loop)
  kv = copy_for_append(loop.kv, loop.state, state, local, plan, 1)
  num_tokens = flat(on_every_shard(bm.get_num_tokens)(state, local))
  slot_mapping = on_every_shard(functools.partial(bm.get_slot_mapping, width=1))(
    state, local, by_shard(running.astype(jnp.int32), num_shards)
  )
  cache = paged_cache(
    kv=kv,
    block_tables=jax.tree.map(flat, on_every_shard(bm.get_block_tables)(state, local)),
    slot_mapping=jax.tree.map(flat, slot_mapping),
    cache_sliding_window=getattr(cfg, "sliding_window", None),
  )
  positions = jnp.where(running, num_tokens - 1, -1)[:, None]
  model = graphdef.merge(params_state)
  logits, cache, extra = call_model(model, loop.last_token[:, None], positions, cache, kv)
  num_logprobs = loop.draws.top_ids.shape[-1]
  mask = None if table is None else structured.allowed_mask(table, loop.automaton_state)
  draw = sample_rows(logits[:, 0], row_params, loop.num_generated, num_logprobs, mask)
  column = jnp.where(running, loop.step, loop.draws.tokens.shape[1])
  draws = jax.tree.map(
    lambda out, new: out.at[jnp.arange(out.shape[0]), column].set(new, mode="drop"),
    loop.draws,
    draw,
  )
  sampled = running if loop.beams is None else running & (loop.beams.leader < 0)
  num_generated = loop.num_generated + sampled
  done = sampled & ((num_generated >= loop.limit) | is_stop(draw.tokens, row_params.stop_ids))
  automaton_state, dead = step_automata(table, loop.automaton_state, sampled, draw.tokens)
  done = done | dead
  slots = jnp.where(done, -1, loop.slots)
  last_token = jnp.where(sampled, draw.tokens, loop.last_token)
  s, per = running.shape[0], cfg.max_seqs
  num_pairs = 0 if loop.beams is None else s * 2 * loop.beams.hyp_len.shape[1]

  def beam_step(_):
    beams, moves = beam.step(
      loop.beams,
      jax.nn.log_softmax(logits[:, 0].astype(jnp.float32)),
      running,
      row_params.stop_ids,
      loop.limit,
      slots,
      last_token,
      num_generated,
    )
    forked, _ = on_every_shard(bm.fork_each)(
      state,
      pairs_per_shard(moves.fork_parents, num_shards, per),
      pairs_per_shard(moves.fork_children, num_shards, per),
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
        slots=slots,
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
  return finish_step(
    loop,
    forked,
    plan,
    num_tokens,
    free=jnp.where(done | moves.dropped, loop.slots, -1),
    finished=jnp.any(done) | jnp.any(moves.finished),
    kv=cache.kv,
    slots=moves.slots,
    last_token=moves.last_token,
    num_generated=moves.num_generated,
    beams=beams,
    automaton_state=automaton_state,
    draws=draws,
  ), extra


@functools.partial(
  jax.jit,
  static_argnums=(0, 6, 7),
  # Named too: given static_argnames, jit names no static_argnums for a keyword.
  static_argnames=("graphdef", "speculating", "draft_graphdef", "arrival_check", "stream_mode"),
  donate_argnums=(3,),
)
def decode_loop(
  graphdef,
  params_state,
  row_params: RowParams,
  loop: DecodeLoop,
  stop_on_finish,
  table: structured.AutomatonTable | None = None,
  speculating: speculative.SpeculativeConfig | None = None,
  draft_graphdef=None,
  draft_params=None,
  arrival_watch: jax.Array | None = None,
  arrival_check: str | None = None,
  stream_channel: jax.Array | None = None,
  stream_mode: str | None = None,
) -> DecodeLoop:
  """Decodes until no row runs, a shard runs out of blocks, the launch's
  steps are done (`loop.max_steps`, at most the draws' columns), (if
  asked) a row finishes, or (with an `arrival_watch`, an engine's id) a
  request arrived at that engine: the loop reads its flag before each step,
  as `arrival_check` says (see `arrivals.arrived`). With a
  `stream_channel` (a `step_stream.StepStream` operand), a launch that
  `streams` publishes each step's draws there as `stream_mode` says, and
  marks its end. `table` holds the automata
  of the constrained rows (None when none runs; one compile per table
  bucket). With `speculating` (and `loop.spec`), each step is a
  speculating one (proposing with the draft model `draft_graphdef`,
  `draft_params` when it has one), and the rows' pending proposals are
  appended at the end."""
  per_step = 1 if speculating is None else speculating.num_speculative_tokens + 1
  num_steps = loop.draws.tokens.shape[1] // per_step

  def keep_going(loop):
    return (
      jnp.any(loop.slots >= 0)
      & ~jnp.any(loop.out_of_blocks)
      & (loop.step < jnp.minimum(num_steps, loop.max_steps))
      & ~(stop_on_finish & loop.finished_any)
    )

  if speculating is None:
    step = functools.partial(decode_step, graphdef, params_state, row_params, table)
  else:
    draft = None if draft_graphdef is None else (draft_graphdef, draft_params)
    step = functools.partial(
      speculative_step, graphdef, params_state, row_params, table, speculating, draft
    )
  publishing = stream_mode is not None and streams(speculating)
  if publishing:
    step = _publishing(step, stream_channel, stream_mode)
  if arrival_check is None:
    loop = jax.lax.while_loop(keep_going, step, loop)
  else:
    # The flag is read before the first step, then at the end of each (the
    # read waits for the step's `finished_any`), in the loop's body: XLA:CPU
    # runs a loop whose condition makes an FFI call far slower.
    arrived = lambda loop: arrivals.arrived(arrival_watch, arrival_check, after=loop.finished_any)

    def step_and_read(carry):
      loop = step(carry[0])
      return loop, arrived(loop)

    going = lambda carry: keep_going(carry[0]) & ~carry[1]
    loop, _ = jax.lax.while_loop(going, step_and_read, (loop, arrived(loop)))
  if publishing:
    loop = loop.replace(step=step_stream.end_launch(stream_channel, stream_mode, loop.step))
  if speculating is not None:
    loop = append_pending(loop)
  kv = loop.kv
  return sharding.replicate(loop.replace(kv=None), kv).replace(kv=kv)


def streams(speculating) -> bool:
  """Whether a launch publishes its steps when asked: plain steps (a
  speculating step's tokens are known at the launch's end). A beam
  group's rows publish too; the host passes them by."""
  return speculating is None


def _publishing(step, channel, mode):
  """`step`, then its draws published (`step_stream.publish_step`)."""

  def step_and_publish(loop: DecodeLoop) -> DecodeLoop:
    after = step(loop)
    in_column = lambda a: jax.lax.dynamic_index_in_dim(a, loop.step, axis=1, keepdims=False)
    drew = after.num_generated > loop.num_generated
    passed = step_stream.publish_step(
      channel, mode, loop.step, jax.tree.map(in_column, after.draws), drew, after.finished_any
    )
    return after.replace(finished_any=passed)

  return step_and_publish


# A continued launch's carry: the rows' state carries on, the launch's
# draws and counters start afresh.
_CARRIED = (
  "slots",
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


start_beams = jax.jit(beam.Beams.start)
clear_beams = jax.jit(beam.Beams.clear)
