"""The dense reference decoder: the models on a `DenseCache`, no engine.

`generate_dense(model, prompts, sampling, key)` prefills every prompt in one
row of a dense cache and decodes in a compiled `while_loop`, for comparison
with the paged engine: with the same key, prompt `i`'s tokens are drawn with
the keys the engine gives its `i`-th request (`pj.generate`'s request `i`),
so sampled outputs agree too. `sample_tokens` is one draw of the same
sampler for a batch of logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.models.llama import init_dense_cache
from paged_jax.params import SamplingParams
from paged_jax.sampling import RowParams, is_stop, sample_rows
from paged_jax.token_ids import check_token_ids


def _row_params(sampling: SamplingParams, keys: jax.Array) -> RowParams:
  """`sampling` for every row; row `b` draws with `keys[b]`."""
  rows = keys.shape[0]
  stop = sampling.stop_token_ids or (-1,)
  return RowParams(
    temperature=jnp.full(rows, sampling.temperature, jnp.float32),
    top_k=jnp.full(rows, sampling.top_k, jnp.int32),
    top_p=jnp.full(rows, sampling.top_p, jnp.float32),
    key_data=jax.random.key_data(keys),
    stop_ids=jnp.tile(jnp.asarray(stop, jnp.int32), (rows, 1)),
    processed=jnp.full(rows, sampling.logprobs_mode == "processed"),
    wants_top=jnp.full(rows, bool(sampling.logprobs)),
  )


def _request_keys(key: jax.Array, rows: int) -> jax.Array:
  """The key of sample 0 of requests 0 .. rows - 1, as the engine makes them."""
  return jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(key, i), 0))(jnp.arange(rows))


def sample_tokens(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """Draws one token per row with `params` (row `b` with `split(key)[b]`).

  Args:
    logits: float `[batch, vocab]`.
    key: a PRNG key.
    params: temperature, top-k and top-p.

  Returns:
    int32 `[batch]` token ids.
  """
  keys = jax.random.split(key, logits.shape[0])
  index = jnp.zeros(logits.shape[0], jnp.int32)
  return sample_rows(logits, _row_params(params, keys), index, 0).tokens


@functools.partial(jax.jit, static_argnums=(0, 2))
def _dense_generate(graphdef, params_state, sampling: SamplingParams, key, tokens, lengths, cache):
  """Prefill then a `while_loop` of decode steps on a dense cache."""
  model = nnx.merge(graphdef, params_state)
  batch, width = tokens.shape
  rows = _row_params(sampling, _request_keys(key, batch))
  columns = jnp.arange(width, dtype=jnp.int32)[None, :]
  positions = jnp.where(columns < lengths[:, None], columns, -1)
  logits, cache = model(tokens, positions, cache)
  last = logits[jnp.arange(batch), lengths - 1]
  token = sample_rows(last, rows, jnp.zeros(batch, jnp.int32), 0).tokens
  limit = sampling.max_tokens
  outputs = jnp.zeros((batch, limit), jnp.int32).at[:, 0].set(token)
  running = ~is_stop(token, rows.stop_ids) & (limit > 1)

  def step(carry):
    i, running, token, outputs, cache = carry
    model = nnx.merge(graphdef, params_state)
    positions = jnp.where(running, lengths + i - 1, -1)[:, None]
    logits, cache = model(token[:, None], positions, cache)
    new = sample_rows(logits[:, 0], rows, jnp.full(batch, i), 0).tokens
    outputs = outputs.at[:, i].set(jnp.where(running, new, 0))
    still = running & (i + 1 < limit) & ~is_stop(new, rows.stop_ids)
    return i + 1, still, jnp.where(running, new, token), outputs, cache

  carry = (jnp.int32(1), running, token, outputs, cache)
  _, _, _, outputs, _ = jax.lax.while_loop(lambda c: jnp.any(c[1]), step, carry)
  return outputs


def generate_dense(
  model, prompts: Sequence[np.ndarray], sampling: SamplingParams, key: jax.Array
) -> list[np.ndarray]:
  """Generates from every prompt on a dense cache (one row per prompt).

  Args:
    model: the decoder.
    prompts: int token ids, one non-empty 1-D array per sequence.
    sampling: how tokens are drawn and when sequences stop.
    key: PRNG key of the sampling (prompt `i` draws as the engine's request
      `i` does).

  Returns:
    The generated int32 tokens of each prompt, a stop token included when
    drawn.

  Raises:
    ValueError: if a prompt is empty or not 1-D.
  """
  prompts = [check_token_ids(p, None, "prompt") for p in prompts]
  lengths = np.array([p.size for p in prompts], np.int32)
  width = 8 * -(-int(lengths.max()) // 8)
  tokens = np.zeros((len(prompts), width), np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, : prompt.size] = prompt
  cache = init_dense_cache(model.config, len(prompts), width + sampling.max_tokens)
  graphdef, params_state = nnx.split(model)
  outputs = np.asarray(
    _dense_generate(graphdef, params_state, sampling, key, tokens, lengths, cache)
  )
  stops = list(sampling.stop_token_ids)
  results = []
  for row in outputs:
    hits = np.nonzero(np.isin(row, stops))[0]
    end = int(hits[0]) + 1 if hits.size else sampling.max_tokens
    results.append(row[:end].copy())
  return results
