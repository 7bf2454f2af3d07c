"""`generate`: a batch of token-id requests in, token arrays and stats out.

`generate(model, requests, cfg, sampling, key)` is a thin wrapper over
`paged_jax.LLMEngine` (continuous batching, preemption by swap, the decode
loop compiled) kept for what `pj.LLM` does not do:

* it raises a `ValueError` before the first step for a request that can
  never fit (`LLMEngine.admission_error`, the engine's own rule), where the
  engine finishes such a request with reason "error";
* it returns each sample's int32 token ids and the run's `GenerationStats`;
* it serves the same way every time, for comparisons: whole prompts in one
  round, preemption by swap, and request `i` drawing from `fold_in(key, i)`
  as `paged_jax.models.dense.generate_dense` draws prompt `i`.

Text prompts, stop strings, log-probabilities and streaming are `pj.LLM`'s
and `pj.LLMEngine`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from paged_jax.config import CacheConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import GenerationStats
from paged_jax.params import SamplingParams
from paged_jax.token_ids import check_token_ids

__all__ = ["GenerationStats", "Request", "SamplingParams", "generate"]


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt and how many samples to draw from it.

  Attributes:
    prompt: int32 token ids (at least one).
    n: number of samples; they share the prompt's blocks.
  """

  prompt: np.ndarray
  n: int = 1

  def __post_init__(self):
    object.__setattr__(self, "prompt", check_token_ids(self.prompt, None, "prompt"))
    if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
      raise ValueError(f"n must be an int >= 1, got {self.n!r}")


def generate(
  model,
  requests: Sequence[Request | np.ndarray],
  cfg: CacheConfig,
  sampling: SamplingParams,
  key: jax.Array,
  *,
  progress: Callable[[int], None] | None = None,
  kv_cache_dtype=None,
  mesh: jax.sharding.Mesh | None = None,
) -> tuple[list[list[np.ndarray]], GenerationStats]:
  """Serves `requests` on a paged KV cache (a wrapper over `LLMEngine`).

  Args:
    model: the decoder (see `paged_jax.engine.ModelProtocol`).
    requests: prompts and their sample counts (`n` overrides `sampling.n`).
    cfg: the paged cache's shape and policy (prefix caching, swap space).
    sampling: how tokens are drawn and when sequences stop.
    key: PRNG key of the sampling; request `i` draws from `fold_in(key, i)`.
    progress: optional callable, given the number of sequences that
      finished since its last call.
    kv_cache_dtype: dtype of the KV pages (``jnp.int8`` or
      ``jnp.float8_e4m3fn`` for a quantized cache); None for the model's.
    mesh: a ``("data", "model")`` mesh to serve on (see
      ``paged_jax.sharding``): each data shard has a cache of `cfg`'s size
      and serves its share of the requests, tensor parallel over "model";
      None for one device.

  Returns:
    `(outputs, stats)`: `outputs[i][j]` is the int32 tokens of sample `j` of
    request `i` (a stop token included when drawn), and the run's
    `GenerationStats`. A sequence stops at the model's `max_seq_len`.

  Raises:
    ValueError: before any step, naming the request, for token ids outside
      the vocabulary or a request that can never fit the model or the cache
      (`LLMEngine.admission_error`); or if the model's heads do not split
      over the mesh's "model" axis.
  """
  requests = [r if isinstance(r, Request) else Request(r) for r in requests]
  engine = LLMEngine(
    model,
    None,
    cfg,
    preemption_mode="swap",
    kv_cache_dtype=kv_cache_dtype,
    mesh=mesh,
    max_num_batched_tokens=cfg.max_seqs * cfg.max_tokens_per_seq,
    key=key,
  )
  for index, request in enumerate(requests):
    params = dataclasses.replace(sampling, n=request.n)
    error = engine.admission_error(request.prompt.size, params)
    if error is None:
      try:
        engine.add_request(str(index), request.prompt, params)
      except ValueError as err:
        error = str(err)
    if error is not None:
      raise ValueError(f"request {index}: {error}")
  outputs = [None] * len(requests)
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        outputs[int(out.request_id)] = [np.asarray(o.token_ids, np.int32) for o in out.outputs]
        if progress is not None:
          progress(len(out.outputs))
  return outputs, engine.stats
