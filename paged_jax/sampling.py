"""Per-row sampling: each row has its own temperature, top-k, top-p and key."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class RowParams:
  """Sampling parameters of every row (sequence slot) of a batch.

  Attributes:
    temperature: float32 `[rows]`; 0 is greedy.
    top_k: int32 `[rows]`; 0 keeps every token.
    top_p: float32 `[rows]`; 1 keeps every token.
    key_data: uint32 `[rows, key words]`, the raw PRNG key of each row; the
      token at index `t` of a row is drawn with `fold_in(key, t)`.
    stop_ids: int32 `[rows, width]` token ids that end the row, -1 padding.
    processed: bool `[rows]`: the row's log-probabilities are those of the
      distribution it samples from (`sampling_logits`), not the model's.
    wants_top: bool `[rows]`: the row returns its most likely alternatives
      (`SamplingParams.logprobs` > 0); `sample_rows` ranks the vocabulary
      only when some row does.
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  key_data: jax.Array
  stop_ids: jax.Array
  processed: jax.Array
  wants_top: jax.Array


@flax.struct.dataclass
class Draw:
  """What `sample_rows` draws for each row.

  Attributes:
    tokens: int32 `[rows]`.
    logprob: float32 `[rows]`, the token's log-probability under the model
      (under the masked distribution when `sample_rows` has a `logit_mask`),
      or, for a `processed` row, under the distribution it was drawn from.
    top_ids: int32 `[rows, k]`, the `k` most likely tokens.
    top_logprobs: float32 `[rows, k]`, their log-probabilities (both zeros
      when no row `wants_top`).
  """

  tokens: jax.Array
  logprob: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def _filtered(logits: jax.Array, top_k: jax.Array, top_p: jax.Array):
  """Sets the tokens outside each row's top-k and top-p nucleus to -inf."""
  ordered = -jnp.sort(-logits, axis=-1)
  vocab = logits.shape[-1]
  kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
  kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
  ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
  probs = jax.nn.softmax(ordered, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs
  cutoff = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits < jnp.maximum(kth, cutoff), -jnp.inf, logits)


def sampling_logits(logits: jax.Array, params: RowParams) -> jax.Array:
  """The float32 logits `[rows, vocab]` each row samples from: scaled by
  its temperature, outside its top-k and top-p nucleus -inf (a greedy row's
  are unchanged)."""
  logits = logits.astype(jnp.float32)
  greedy = params.temperature <= 0.0
  scaled = logits / jnp.where(greedy, 1.0, params.temperature)[:, None]
  truncating = ~greedy & ((params.top_k > 0) | (params.top_p < 1.0))
  return jax.lax.cond(  # the vocabulary sort only when a row needs it
    jnp.any(truncating),
    lambda x: jnp.where(truncating[:, None], _filtered(x, params.top_k, params.top_p), x),
    lambda x: x,
    scaled,
  )


def row_keys(params: RowParams, index: jax.Array, salt: int | None = None) -> jax.Array:
  """Each row's PRNG key for its output token `index[row]`: `fold_in(key,
  index)`, what `sample_rows` draws with; with `salt`, that key folded with
  it (another stream for the same token)."""

  def key(data, i):
    folded = jax.random.fold_in(jax.random.wrap_key_data(data), i)
    return folded if salt is None else jax.random.fold_in(folded, salt)

  return jax.vmap(key)(params.key_data, index)


def sample_rows(
  logits: jax.Array,
  params: RowParams,
  index: jax.Array,
  num_logprobs: int,
  logit_mask: jax.Array | None = None,
) -> Draw:
  """Draws one token per row.

  With `logit_mask`, every row draws from its masked distribution: the
  logits of disallowed tokens become -inf before anything else, so greedy,
  top-k, top-p and seeded draws pick only allowed tokens, and the returned
  log-probabilities are those of the masked (renormalized) distribution (the
  top `num_logprobs` may include disallowed tokens at -inf when fewer are
  allowed). A row whose mask is all True draws exactly as without a mask; a
  row with no allowed token gets an arbitrary token and NaN log-probabilities.
  A `processed` row's log-probabilities (the token's and the top ones) are
  those of the distribution it draws from: after temperature, top-k and top-p
  (tokens outside them at -inf); a greedy row's are the model's.

  Args:
    logits: float `[rows, vocab]`.
    params: each row's sampling parameters and key.
    index: int32 `[rows]`, the index of the drawn token in its sequence's
      output (the key of the draw), so a row draws the same token whatever
      the batch around it.
    num_logprobs: static; how many of the most likely tokens to return.
    logit_mask: bool `[rows, vocab]`, the tokens each row may draw (for
      structured outputs, `paged_jax.structured.allowed_mask`), or None.

  Returns:
    The tokens with their log-probabilities and the top `num_logprobs`.
  """
  logits = logits.astype(jnp.float32)
  if logit_mask is not None:
    logits = jnp.where(logit_mask, logits, -jnp.inf)
  greedy = params.temperature <= 0.0

  def draw(_):
    keys = row_keys(params, index)
    processed = sampling_logits(logits, params)
    return categorical_rows(keys, processed), processed

  argmax = greedy_tokens(logits)
  drawn, processed = jax.lax.cond(jnp.all(greedy), lambda _: (argmax, logits), draw, None)
  tokens = jnp.where(greedy, argmax, drawn)
  logprob = jax.lax.cond(  # the processed distribution only when a row asks for it
    jnp.any(params.processed),
    lambda: jnp.where(
      params.processed, token_logprob(processed, tokens), token_logprob(logits, tokens)
    ),
    lambda: token_logprob(logits, tokens),
  )

  def top():
    raw = jax.nn.log_softmax(logits, axis=-1)
    logprobs = jax.lax.cond(
      jnp.any(params.processed),
      lambda: jnp.where(params.processed[:, None], jax.nn.log_softmax(processed, axis=-1), raw),
      lambda: raw,
    )
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_logprobs)
    return top_ids.astype(jnp.int32), top_logprobs

  none = lambda: (
    jnp.zeros((logits.shape[0], num_logprobs), jnp.int32),
    jnp.zeros((logits.shape[0], num_logprobs), jnp.float32),
  )
  top_ids, top_logprobs = jax.lax.cond(jnp.any(params.wants_top), top, none)
  return Draw(tokens=tokens, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs)


def token_logprob(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """`jax.nn.log_softmax(logits)` at `tokens` `[rows]`, by the same float
  operations, without the vocabulary-wide log-probabilities."""
  most = jnp.max(logits, axis=-1, initial=-jnp.inf)
  total = jnp.log(jnp.sum(jnp.exp(logits - most[:, None]), axis=-1))
  return (jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - most) - total


def categorical_rows(keys: jax.Array, logits: jax.Array, block: int = 128) -> jax.Array:
  """int32 `[rows]`: one token per row drawn from `softmax(logits[row])`
  with `keys[row]`: the distribution of `jax.random.categorical` (not its
  token for the same key), from `vocab / block + block` random numbers per
  row instead of one per token.

  The vocabulary is cut into blocks of `block` tokens: a row draws a block by
  its total probability, then a token of that block by its probability in
  it (Gumbel-max both times), which is exactly the token's probability.
  XLA:CPU draws 32 rows of 49,152 tokens this way in under 1 ms, 20 ms as
  `jax.random.categorical`. Tokens at -inf are never drawn; a row with no
  finite logit gets an arbitrary token.
  """
  rows, vocab = logits.shape
  logits = jnp.pad(logits, ((0, 0), (0, -vocab % block)), constant_values=-jnp.inf)
  blocks = logits.reshape(rows, -1, block)

  def draw(key, blocks):
    block_key, token_key = jax.random.split(key)
    chosen = jax.random.categorical(block_key, jax.nn.logsumexp(blocks, axis=-1))
    return chosen * block + jax.random.categorical(token_key, blocks[chosen])

  return jax.vmap(draw)(keys, blocks).astype(jnp.int32)


def greedy_tokens(logits: jax.Array) -> jax.Array:
  """int32 `[rows]`: `jnp.argmax(logits, axis=-1)` (the first largest
  logit; the first NaN in a row that has one), as a max and a min, which
  XLA:CPU runs 2 to 4 times faster than its argmax over a vocabulary."""
  best = jnp.max(logits, axis=-1, keepdims=True)
  hits = jnp.where(jnp.isnan(best), jnp.isnan(logits), logits == best)
  index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(hits, index, logits.shape[-1]), axis=-1)


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
  """bool `[rows]`: whether each row's token is one of its stop ids."""
  return jnp.any(tokens[:, None] == stop_ids, axis=-1)
