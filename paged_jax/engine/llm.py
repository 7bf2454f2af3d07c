"""`LLM`: offline generation over a list of prompts (vLLM's offline form)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from paged_jax.config import CacheConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import RequestOutput
from paged_jax.engine.rollout import Rollout, rollout
from paged_jax.params import SamplingParams


def _as_prompt_list(prompts) -> list:
  if (
    isinstance(prompts, str)
    or (isinstance(prompts, np.ndarray) and prompts.ndim == 1)
    or (
      isinstance(prompts, Sequence)
      and prompts
      and all(isinstance(t, (int, np.integer)) for t in prompts)
    )
  ):
    return [prompts]
  return list(prompts)


class LLM:
  """Serves a batch of prompts to completion on the paged KV cache.

  Example:
    llm = pj.LLM(load_tiny(), ByteTokenizer(), pj.CacheConfig(...))
    outs = llm.generate(["LOVE, n. "], pj.SamplingParams(max_tokens=32))
    print(outs[0].outputs[0].text)

  Args:
    model: an `nnx.Module` following `paged_jax.engine.ModelProtocol`.
    tokenizer: `encode`/`decode` (and `eos_token_id` or `eos_id`), or None.
    cache_config: the paged cache.
    **engine_kwargs: `LLMEngine` options (`max_num_seqs`,
      `max_num_batched_tokens`, `preemption_mode`, `kv_cache_dtype`, `mesh`,
      `num_decode_steps`, `max_logprobs`, `async_scheduling`, `speculative_config`, `seed`).
  """

  def __init__(self, model, tokenizer, cache_config: CacheConfig, **engine_kwargs):
    self.engine = LLMEngine(model, tokenizer, cache_config, **engine_kwargs)
    self._next_id = 0

  def generate(
    self,
    prompts,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    progress: bool = False,
  ) -> list[RequestOutput]:
    """Generates for every prompt.

    Args:
      prompts: a text or token-id prompt, or a list of them.
      params: one `SamplingParams` for all prompts or one per prompt.
      progress: show a tqdm bar of finished requests.

    Returns:
      The final `RequestOutput` of each prompt, in order.

    Raises:
      ValueError: for a bad prompt or parameters (nothing is queued then).
    """
    prompts = _as_prompt_list(prompts)
    params = SamplingParams() if params is None else params
    if isinstance(params, SamplingParams):
      params = [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
    ids = [str(self._next_id + i) for i in range(len(prompts))]
    self._next_id += len(prompts)
    engine = self.engine
    try:
      for request_id, prompt, p in zip(ids, prompts, params):
        engine.add_request(request_id, prompt, p)
    except Exception:
      for request_id in ids:
        engine.abort_request(request_id)
      engine.step()
      raise
    finals: dict[str, RequestOutput] = {}
    with tqdm(total=len(ids), disable=not progress, unit="req") as bar:
      while engine.has_unfinished_requests():
        for out in engine.step():
          if out.finished:
            finals[out.request_id] = out
            bar.update(1)
    return [finals[i] for i in ids]

  def update_weights(self, new_weights, *, abort_running: bool = False, check_finite=True) -> None:
    """`LLMEngine.update_weights`: serve with new weights, compiling nothing."""
    self.engine.update_weights(new_weights, abort_running=abort_running, check_finite=check_finite)

  def sleep(self, level: int = 1) -> int:
    """`LLMEngine.sleep`: free the KV pages (and at level 2 the weights)."""
    return self.engine.sleep(level)

  def wake_up(self) -> None:
    """`LLMEngine.wake_up`: restore what `sleep` freed."""
    self.engine.wake_up()

  def rollout(self, prompts, n: int, params: SamplingParams | None = None) -> Rollout:
    """`pj.rollout(self, prompts, n, params)`: `n` samples per prompt as
    padded token, mask and log-probability arrays."""
    return rollout(self, prompts, n, params)
