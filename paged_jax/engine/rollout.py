"""Rollouts for reinforcement learning: `n` samples per prompt as padded arrays."""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.engine.outputs import RequestOutput
from paged_jax.params import SamplingParams


@dataclasses.dataclass
class Rollout:
  """`n` samples of every prompt, padded to `max_tokens`: the shapes a
  group-relative policy loss (GRPO) takes.

  Attributes:
    prompt_token_ids: each prompt's token ids (int32 NumPy arrays).
    tokens: int32 `[prompts, n, max_tokens]`, the generated tokens, 0 after
      a sample's end.
    mask: bool `[prompts, n, max_tokens]`, True on generated tokens.
    logprobs: float32 `[prompts, n, max_tokens]`, each token's
      log-probability under `SamplingParams.logprobs_mode`, 0 where masked.
    blocks_saved: KV blocks the samples shared instead of holding copies:
      per prompt, `n - 1` times its blocks, less the blocks copied on write
      (over the whole call; prefix-cache hits between prompts not counted).
    outputs: the `RequestOutput` of every prompt.
  """

  prompt_token_ids: list[np.ndarray]
  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  blocks_saved: int
  outputs: list[RequestOutput]


def rollout(llm, prompts, n: int, params: SamplingParams | None = None) -> Rollout:
  """Samples `n` completions of every prompt with `llm` (a `pj.LLM`).

  The `n` samples of a prompt fork from its prefilled blocks and share them,
  copying a block only when a sample writes into a shared one (copy on
  write); `Rollout.blocks_saved` counts what that saved.

  Args:
    llm: the `LLM` to sample with (its current weights: `update_weights`).
    prompts: texts or token-id lists.
    n: samples per prompt (overrides `params.n`).
    params: how to sample; `SamplingParams(temperature=1.0)` by default.
      Use `logprobs_mode="processed"` for the log-probabilities of the
      distribution sampled (they differ from the model's with a temperature
      other than 1, top-k or top-p).

  Returns:
    The `Rollout`, padded to `params.max_tokens` (one shape per call, so a
    jitted loss compiles once).

  Raises:
    ValueError: for beam search, or what `LLM.generate` raises.
  """
  params = SamplingParams(temperature=1.0) if params is None else params
  if params.use_beam_search:
    raise ValueError("rollout samples; use_beam_search returns no per-token log-probabilities")
  params = dataclasses.replace(params, n=n)
  engine = llm.engine
  copies_before = engine.stats.cow_copies
  outputs = llm.generate(prompts, params)
  copies = engine.stats.cow_copies - copies_before
  shared = sum((n - 1) * engine.cfg.blocks_for(out.prompt_token_ids.size) for out in outputs)
  tokens, mask, logprobs = (
    np.stack(arrays) for arrays in zip(*(out.arrays(params.max_tokens) for out in outputs))
  )
  return Rollout(
    prompt_token_ids=[np.asarray(out.prompt_token_ids, np.int32) for out in outputs],
    tokens=tokens,
    mask=mask,
    logprobs=logprobs,
    blocks_saved=shared - copies,
    outputs=outputs,
  )
