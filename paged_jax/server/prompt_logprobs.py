"""Log-probabilities of a prompt's own tokens (OpenAI's `echo` with `logprobs`).

The engine computes them in prefill (`SamplingParams.prompt_logprobs`): the
engine thread serves a scoring job as a one-token request and turns the
request's `prompt_logprobs` into OpenAI's per-token lists.
"""

from __future__ import annotations

import dataclasses

from paged_jax.engine.outputs import RequestOutput
from paged_jax.params import SamplingParams


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


def scoring_params(k: int) -> SamplingParams:
  """The parameters of a request that only scores its prompt (top `k`)."""
  return SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=k)


def from_output(output: RequestOutput) -> PromptLogprobs:
  """The prompt log-probabilities of a finished scoring request.

  Raises:
    ValueError: if the engine could not serve it (the reason it gave).
  """
  if output.error is not None:
    raise ValueError(output.error)
  ids = [int(t) for t in output.prompt_token_ids]
  entries = output.prompt_logprobs
  token_logprobs = [None] + [entries[i][ids[i]] for i in range(1, len(ids))]
  return PromptLogprobs(token_logprobs, list(entries))
