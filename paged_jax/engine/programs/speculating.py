"""The speculating decode step: each row proposes up to `k` tokens (n-gram
prompt lookup or a draft model), the target runs once over them, and the
row emits the accepted ones and one of the target's (see
`paged_jax.engine.speculative` for the rules). Also the draft model's
calls, which the prompt programs use to fill its layers of the cache.

On a hybrid cache (one block table per attention type) the manager's
calls, tables and slot mappings come one per type, and every layer of the
target and the draft reads and writes through its type's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from paged_jax import sharding, structured
from paged_jax.block_manager.state import on_every_shard
from paged_jax.engine import speculative
from paged_jax.engine.programs.carry import DecodeLoop, by_shard, flat, shard_seq_ids
from paged_jax.engine.programs.step import (
  copy_for_append,
  finish_step,
  ops,
  slot_mapping_of,
  step_automata,
  unless_out_of_blocks,
)
from paged_jax.paged_cache import paged_cache
from paged_jax.sampling import (
  Draw,
  RowParams,
  categorical_rows,
  greedy_tokens,
  row_keys,
  sample_rows,
  sampling_logits,
)


def speculative_step(
  graphdef,
  params_state,
  row_params: RowParams,
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
  bm = ops(loop.state)
  spec, k = loop.spec, config.num_speculative_tokens
  num_shards = loop.out_of_blocks.shape[0]
  num_rows = loop.slots.shape[0]
  row_ids = jnp.arange(num_rows)
  running = loop.slots >= 0
  local = shard_seq_ids(loop)
  new_tokens = jnp.concatenate([spec.pending, spec.pending[:, :1]], axis=1)
  new_tokens = new_tokens.at[row_ids, spec.num_pending].set(loop.last_token)
  num_new = jnp.where(running, spec.num_pending + 1, 0)
  state, plan = on_every_shard(functools.partial(bm.append_slots, num_lookahead_slots=k))(
    loop.state, local, by_shard(new_tokens, num_shards), by_shard(num_new, num_shards)
  )

  def advance(_):
    kv = copy_for_append(loop.kv, loop.state, state, local, plan, k + 1)
    num_tokens = flat(on_every_shard(bm.get_num_tokens)(state, local))
    tables = jax.tree.map(flat, on_every_shard(bm.get_block_tables)(state, local))
    if draft is None:
      drafts, count = speculative.propose_ngram(
        spec.history, spec.history_len, k, config.prompt_lookup_min, config.prompt_lookup_max
      )
    else:
      drafts, draft_dists, kv = _draft_proposals(draft, row_params, loop, kv, tables, num_tokens, k)
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
      slot_mapping=jax.tree.map(lambda t: slot_mapping_of(t, positions, cfg.block_size), tables),
      cache_sliding_window=getattr(cfg, "sliding_window", None),
    )
    model = graphdef.merge(params_state)
    logits, cache = model(
      sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache
    )
    draw = _draw_every_position(logits, row_params, loop, table, loop.draws.top_ids.shape[-1])
    accepted = speculative.leading_true(
      (drafts == draw.tokens[:, :k]) & (offsets[None, :k] < count[:, None])
    )
    if draft is not None:  # sampled rows: the rule for a draft distribution
      accepted, draw = _accept_sampled_drafts(
        logits, row_params, loop, drafts, draft_dists, count, accepted, draw
      )
    stops = jnp.any(draw.tokens[..., None] == row_params.stop_ids[:, None, :], axis=-1)
    first_stop = jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1), k + 1)
    num_emitted = jnp.where(running, jnp.minimum(accepted + 1, first_stop + 1), 0)
    num_generated = loop.num_generated + num_emitted
    done = running & ((num_generated >= loop.limit) | (first_stop < num_emitted))
    # Constrained rows emit one token.
    automaton_state, dead = step_automata(table, loop.automaton_state, running, draw.tokens[:, 0])
    done = done | dead
    emitted = offsets[None, :] < num_emitted[:, None]
    column = jnp.where(
      emitted, spec.emitted[:, None] + offsets[None, :], loop.draws.tokens.shape[1]
    )
    draws = jax.tree.map(
      lambda out, new: out.at[row_ids[:, None], column].set(new, mode="drop"), loop.draws, draw
    )
    at = jnp.where(emitted, spec.history_len[:, None] + offsets[None, :], spec.history.shape[1])
    last = jnp.maximum(num_emitted - 1, 0)
    proposed = jnp.stack([jnp.sum(count > 0), jnp.sum(count), jnp.sum(accepted)])
    return finish_step(
      loop,
      state,
      plan,
      num_tokens,
      free=jnp.where(done, loop.slots, -1),
      finished=jnp.any(done),
      kv=cache.kv,
      slots=jnp.where(done, -1, loop.slots),
      last_token=jnp.where(running, draw.tokens[row_ids, last], loop.last_token),
      num_generated=num_generated,
      automaton_state=automaton_state,
      draws=draws,
      spec=spec.replace(
        history=spec.history.at[row_ids[:, None], at].set(draw.tokens, mode="drop"),
        history_len=spec.history_len + num_emitted,
        pending=draw.tokens[:, :k],
        num_pending=jnp.where(done, 0, last),
        emitted=spec.emitted + num_emitted,
        counts=spec.counts + proposed.astype(jnp.int32),
      ),
    )

  return unless_out_of_blocks(loop, plan, advance)


def _accept_sampled_drafts(logits, row_params, loop, drafts, draft_dists, count, accepted, draw):
  """Greedy rows keep `accepted` and `draw` (point-mass proposals); sampled
  rows take `speculative.accept_sampled`'s drafts and tokens, with the
  target's log-probabilities of those."""
  num_rows, width, vocab = logits.shape
  every = lambda a: jnp.repeat(a, width, axis=0)
  flat_logits = logits.reshape(-1, vocab)
  target = jax.nn.softmax(sampling_logits(flat_logits, jax.tree.map(every, row_params)), axis=-1)
  index = loop.num_generated[:, None] + jnp.arange(width)[None, :]
  keys = row_keys(jax.tree.map(every, row_params), index.ravel()).reshape(num_rows, width)
  sampled_accepted, tokens = speculative.accept_sampled(
    target.reshape(num_rows, width, vocab), draft_dists, drafts, count, keys
  )
  greedy = row_params.temperature <= 0.0
  tokens = jnp.where(greedy[:, None], draw.tokens, tokens)
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return jnp.where(greedy, accepted, sampled_accepted), draw.replace(
    tokens=tokens, logprob=jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
  )


def _draw_every_position(
  logits, row_params: RowParams, loop: DecodeLoop, table, num_logprobs
) -> Draw:
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
    logits.reshape(-1, vocab), jax.tree.map(every, row_params), index, num_logprobs, mask
  )
  return jax.tree.map(lambda a: a.reshape(num_rows, width, *a.shape[1:]), draw)


def append_pending(loop: DecodeLoop) -> DecodeLoop:
  """Appends each row's pending accepted proposals to the manager (their
  K/V is in the cache already), so that between launches the manager holds
  every token but `last_token`, as without speculation."""
  spec = loop.spec
  bm = ops(loop.state)
  num_shards = loop.out_of_blocks.shape[0]
  local = shard_seq_ids(loop)
  state, plan = on_every_shard(bm.append_slots)(
    loop.state, local, by_shard(spec.pending, num_shards), by_shard(spec.num_pending, num_shards)
  )
  kv = copy_for_append(loop.kv, loop.state, state, local, plan, spec.pending.shape[1])
  return loop.replace(
    state=state, kv=kv, spec=spec.replace(num_pending=jnp.zeros_like(spec.num_pending))
  )


def draft_call(
  draft,
  kv,
  first_layer,
  tokens,
  positions,
  tables,
  slot_mapping,
  window,
  logits=True,
  query_tiles=None,
):
  """The draft model's forward over its layers of `kv` (from `first_layer`
  on): `(logits or, without `logits`, hidden states where the model has
  them, the cache)`; `query_tiles` for a packed call (see `PagedCache`).
  On a hybrid cache `tables` and `slot_mapping` hold one entry per type."""
  graph, params = draft
  model = graph.merge(params)
  cache = paged_cache(
    kv=kv.layers(first_layer),
    block_tables=tables,
    slot_mapping=slot_mapping,
    cache_sliding_window=window,
    query_tiles=query_tiles,
  )
  args = sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache
  if not logits and hasattr(model, "hidden_states"):
    out, cache = model.hidden_states(*args)
  else:
    out, cache = model(*args)
  return out, kv.with_layers(first_layer, cache.kv)


def _draft_draw(logits, row_params: RowParams, index):
  """A draft model's token per row (its argmax for greedy rows, else drawn
  from its sampling distribution with the token's key salted) and that
  distribution, float32 `[rows, vocab]`."""
  processed = sampling_logits(logits, row_params)
  drawn = categorical_rows(row_keys(row_params, index, salt=3), processed)
  tokens = jnp.where(row_params.temperature <= 0.0, greedy_tokens(logits), drawn)
  return tokens.astype(jnp.int32), jax.nn.softmax(processed, axis=-1)


def _draft_proposals(draft, row_params: RowParams, loop: DecodeLoop, kv, tables, num_tokens, k):
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
  first_layer = kv.num_layers - graph.merge(params).config.num_layers

  def call(kv, tokens, positions):
    mapping = jax.tree.map(lambda t: slot_mapping_of(t, positions, cfg.block_size), tables)
    window = getattr(cfg, "sliding_window", None)
    return draft_call(draft, kv, first_layer, tokens, positions, tables, mapping, window)

  running = loop.slots >= 0
  recent = num_tokens[:, None] - (k + 1) + jnp.arange(k + 1)[None, :]
  positions = jnp.where(running[:, None] & (recent >= 0), recent, -1)
  tokens = jnp.take_along_axis(history, jnp.clip(recent, 0, history.shape[1] - 1), axis=1)
  logits, kv = call(kv, tokens, positions)
  token, probs = _draft_draw(logits[:, -1], row_params, loop.num_generated)
  tokens = jnp.zeros((token.shape[0], k), jnp.int32).at[:, 0].set(token)
  dists = jnp.zeros((*probs.shape[:1], k, probs.shape[1]), jnp.float32).at[:, 0].set(probs)

  def propose(j, carry):
    tokens, dists, kv = carry
    positions = jnp.where(running, num_tokens - 1 + j, -1)[:, None]
    logits, kv = call(kv, jax.lax.dynamic_slice_in_dim(tokens, j - 1, 1, axis=1), positions)
    token, probs = _draft_draw(logits[:, 0], row_params, loop.num_generated + j)
    return tokens.at[:, j].set(token), dists.at[:, j].set(probs), kv

  return jax.lax.fori_loop(1, k, propose, (tokens, dists, kv))
