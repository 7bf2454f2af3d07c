"""The programs with prompt work: `ragged_step` and `prefill_step`.

`ragged_step` is one engine step with prompt work: the step's prompt
chunks and one decode step of every running row, packed on one token axis
and run through the model together. It draws each row's next token and the
first token of the sequences whose prompt the chunks complete.

`prefill_step` runs prompt chunks alone, each data shard's packed into one token
axis, for a speculating engine. Both compile once per shape (tokens and
tiles are bucketed).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax import sharding, structured
from paged_jax.block_manager.state import on_every_shard
from paged_jax.config import Status
from paged_jax.engine.programs.carry import DecodeLoop
from paged_jax.engine.programs.decode import advance_rows
from paged_jax.engine.programs.speculating import draft_call
from paged_jax.engine.programs.step import (
  append_last_tokens,
  ops,
  slot_mapping_of,
  without_copies,
)
from paged_jax.paged_cache import paged_cache, take_tiles, tile_token_index, untile
from paged_jax.sampling import (
  RowParams,
  sample_rows,
)


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
def prefill_step(
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
  row_params,
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
  index into the `D * T` tokens) with the sampling parameters `row_params[i]`,
  masked by `table`'s automaton state `draw_states[i]` when there is a
  `table`. Where a token has `next_tokens` (>= 0), it also scores them (see
  `score_next_tokens`; the vocabulary-wide work runs only when some token
  asks). A model with `hidden_states` and `logits` (see `ModelProtocol`)
  runs its output layer only at the drawing tokens, and at every token
  only when some token scores. With a speculative draft model
  (`draft_graphdef`, `draft_params`), the chunks also run through it,
  writing its layers of the cache.
  """
  tables, slot_mapping = _prompt_tables_and_slot_mapping(
    states, positions, tiles, tile_slots, write_from
  )
  window = getattr(states.cfg, "sliding_window", None)  # a hybrid cache's types have their own
  cache = paged_cache(
    kv=kv,
    block_tables=tables,
    slot_mapping=slot_mapping,
    cache_sliding_window=window,
    query_tiles=tiles,
  )
  model = graphdef.merge(params_state)
  args = sharding.split_rows(tokens, kv), sharding.split_rows(positions, kv), cache
  hidden, cache, logits_of = _hidden_states(model, args)
  last_logits = logits_of(hidden.reshape(-1, hidden.shape[-1])[last_token_of])
  index = jnp.zeros(last_token_of.shape, jnp.int32)
  mask = None if table is None else structured.allowed_mask(table, draw_states)
  draw = sample_rows(last_logits, row_params, index, num_logprobs, mask)
  scores = _scores_if_asked(logits_of, hidden, next_tokens, num_logprobs)
  kv = cache.kv
  if draft_graphdef is not None:
    _, kv = draft_call(
      (draft_graphdef, draft_params),
      kv,
      model.config.num_layers,
      tokens,
      positions,
      tables,
      slot_mapping,
      window,
      logits=False,
      query_tiles=tiles,
    )
  return sharding.replicate((draw, scores), kv), kv


def row_token_index(prompt_positions, row_positions):
  """Where a ragged step's decoding rows sit on their shard's token axis:
  int32 `[D, n]`, right after the shard's prompt tokens (`prompt_positions`
  `[D, T]`, padding at -1 after them), in row order; `T` (no token) for a
  row that does not decode (`row_positions` `[D, n]` at -1)."""
  decoding = row_positions >= 0
  first = jnp.sum(prompt_positions >= 0, axis=1, keepdims=True)
  index = first + jnp.cumsum(decoding, axis=1) - 1
  return jnp.where(decoding, index, prompt_positions.shape[1]).astype(jnp.int32)


def _prompt_tables_and_slot_mapping(states, positions, tiles, tile_slots, write_from):
  """A packed prompt call's block table per tile and slot mapping per token
  (-1 where a token's K/V is written already, or padding); see `prefill_step`."""
  tables = on_every_shard(ops(states).get_block_tables)(states, tile_slots)
  tables = jax.tree.map(lambda t: t.reshape(-1, t.shape[-1]), tables)
  flat = tile_token_index(tiles, *positions.shape)
  tile_positions = take_tiles(positions, flat, -1)
  written = jnp.where(tile_positions >= write_from[:, None], tile_positions, -1)
  slot_mapping = jax.tree.map(  # one table and mapping per type on a hybrid cache
    lambda t: untile(slot_mapping_of(t, written, states.cfg.block_size), flat, positions.shape, -1),
    tables,
  )
  return tables, slot_mapping


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
  row_params: RowParams,
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
  attended in `tiles` through its sequence's block table; as in `prefill_step`),
  then the last tokens of its decoding rows, one query each (attended by
  the decode kernel through the row's table, see `PagedCache.decode_tables`;
  `row_token_index` places them), then padding: the model's weights are
  read once for the whole step, and its matmuls run `T` tokens, which must
  hold the shard's prompt tokens and decoding rows. The rows' step is
  `decode_step`'s, except that when a shard is out of blocks no row
  decodes (the chunks still run) and `out_of_blocks` says so. Draw `i`
  samples from the prompt token at `last_token_of[i]` with
  `sample_params[i]`, masked by `table`'s state `draw_states[i]` when there
  is a `table`, which also holds the rows' automata
  (`loop.automaton_state`).

  Returns:
    `(loop after the step, draws, prompt scores)` as `decode_loop` and
    `prefill_step` return them.
  """
  state, plan = append_last_tokens(loop)
  out_of_blocks = plan.status != Status.OK
  blocked = jnp.any(out_of_blocks)
  state = jax.tree.map(lambda new, old: jnp.where(blocked, old, new), state, loop.state)
  plan = without_copies(plan, blocked)
  prompt_tables, prompt_slot_mapping = _prompt_tables_and_slot_mapping(
    state, positions, tiles, tile_slots, write_from
  )
  num_shards, num_tokens = tokens.shape

  def call_model(model, row_tokens, row_positions, cache, kv):
    row_index = row_token_index(positions, row_positions.reshape(num_shards, -1))
    shard = jnp.arange(num_shards)[:, None]
    into_axis = lambda prompt, rows: prompt.at[shard, row_index].set(
      rows.reshape(num_shards, -1), mode="drop"
    )
    ragged = paged_cache(
      kv=cache.kv,
      block_tables=prompt_tables,
      slot_mapping=jax.tree.map(into_axis, prompt_slot_mapping, cache.slot_mapping),
      cache_sliding_window=getattr(cache, "cache_sliding_window", None),
      query_tiles=tiles,
      decode_tables=cache.block_tables,
      decode_tokens=row_index,
    )
    args = (
      sharding.split_rows(into_axis(tokens, row_tokens), kv),
      sharding.split_rows(into_axis(positions, row_positions), kv),
      ragged,
    )
    hidden, ragged, logits_of = _hidden_states(model, args)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    row_hidden = flat_hidden[(shard * num_tokens + jnp.minimum(row_index, num_tokens - 1)).ravel()]
    logits = logits_of(jnp.concatenate([row_hidden, flat_hidden[last_token_of]]))
    num_rows = row_tokens.shape[0]
    scores = _scores_if_asked(logits_of, hidden, next_tokens, num_logprobs)
    return logits[:num_rows, None], ragged, (logits[num_rows:], scores)

  decoding = loop.replace(slots=jnp.where(blocked, -1, loop.slots))
  stepped, (sample_logits, scores) = advance_rows(
    graphdef, params_state, row_params, table, decoding, state, plan, call_model
  )
  stepped = stepped.replace(
    slots=jnp.where(blocked, loop.slots, stepped.slots), out_of_blocks=out_of_blocks
  )
  index = jnp.zeros(last_token_of.shape, jnp.int32)
  mask = None if table is None else structured.allowed_mask(table, draw_states)
  draw = sample_rows(sample_logits, sample_params, index, num_logprobs, mask)
  kv = stepped.kv
  stepped, draw, scores = sharding.replicate((stepped.replace(kv=None), draw, scores), kv)
  return stepped.replace(kv=kv), draw, scores
