"""Log-probabilities of a prompt's own tokens (OpenAI's `echo` with `logprobs`).

One jitted forward of the model over the whole prompt, without a KV cache,
padded on the right to a power-of-two bucket so that each bucket compiles
once (the causal mask keeps padding out of every real position). It runs on
the engine thread, between engine steps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MIN_BUCKET = 16


@dataclasses.dataclass
class PromptLogprobs:
  """Per prompt token, what the model gave it from the tokens before it.

  Attributes:
    token_logprobs: the token's log-probability; None for the first token.
    top_logprobs: the `k` most likely token ids and the prompt's own token
      mapped to log-probabilities; None for the first token.
  """

  token_logprobs: list[float | None]
  top_logprobs: list[dict[int, float] | None]


def _bucket(length: int, max_len: int) -> int:
  bucket = MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, max_len)


def _score(graphdef, params, tokens, *, num_top: int):
  logits, _ = nnx.merge(graphdef, params)(tokens)
  logp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
  chosen = jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
  top_values, top_ids = jax.lax.top_k(logp, num_top)
  return chosen, top_ids, top_values


class PromptScorer:
  """Computes `PromptLogprobs` with the model's full forward pass.

  Args:
    model: a model called as `model(tokens) -> (logits, None)` with logits
      `[batch, tokens, vocab]`.
    max_len: the longest prompt it scores.
    max_top: the largest `k` a call may ask for.
  """

  def __init__(self, model, max_len: int, max_top: int):
    graphdef, self._params = nnx.split(model)
    self.max_len = max_len
    self.max_top = max_top
    self._forward = jax.jit(functools.partial(_score, graphdef, num_top=max(max_top, 1)))

  def __call__(self, token_ids, k: int) -> PromptLogprobs:
    """Scores `token_ids` (1-D ints, at most `max_len`), keeping the top `k`.

    Raises:
      ValueError: for an empty or too long prompt, or `k` above `max_top`.
    """
    ids = np.asarray(token_ids, np.int32)
    if not 1 <= ids.size <= self.max_len:
      raise ValueError(f"prompt of {ids.size} tokens: must have 1..{self.max_len}")
    if not 0 <= k <= self.max_top:
      raise ValueError(f"k={k} must be in 0..{self.max_top}")
    padded = np.zeros((1, _bucket(ids.size, self.max_len)), np.int32)
    padded[0, : ids.size] = ids
    chosen, top_ids, top_values = jax.device_get(self._forward(self._params, jnp.asarray(padded)))
    token_logprobs: list[float | None] = [None]
    top_logprobs: list[dict[int, float] | None] = [None]
    for position in range(ids.size - 1):
      alternatives = {
        int(i): float(v) for i, v in zip(top_ids[position, :k], top_values[position, :k])
      }
      alternatives[int(ids[position + 1])] = float(chosen[position])
      token_logprobs.append(float(chosen[position]))
      top_logprobs.append(alternatives)
    return PromptLogprobs(token_logprobs, top_logprobs)
