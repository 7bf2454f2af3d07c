"""`generate`: a batch of requests through the engine; `generate_dense` to compare.

`generate(model, requests, cfg, sampling, key)` is a thin wrapper over
`paged_jax.LLMEngine` (continuous batching, chunked prefill, preemption by
swap, the decode loop compiled): it serves token-id requests and returns
their tokens and the run's `GenerationStats`.

`generate_dense` runs the same model and sampling on a `DenseCache`, for
comparison: with the same key, request `i`'s tokens are drawn with the keys
the engine gives the `i`-th request, so sampled outputs agree too.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.config import CacheConfig
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import GenerationStats
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.sampling import RowParams, is_stop, sample_rows
from paged_jax.models.llama import init_dense_cache

__all__ = [
  "GenerationStats",
  "Request",
  "SamplingParams",
  "generate",
  "generate_dense",
  "sample_tokens",
]


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
    prompt = np.asarray(self.prompt)
    if prompt.ndim != 1 or prompt.size < 1 or not np.issubdtype(prompt.dtype, np.integer):
      raise ValueError(
        f"prompt must be a non-empty 1-D int array, got {prompt.dtype}{list(prompt.shape)}"
      )
    if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
      raise ValueError(f"n must be an int >= 1, got {self.n!r}")
    object.__setattr__(self, "prompt", prompt.astype(np.int32))


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
    ValueError: before any step, if a request does not fit the model or the
      cache (naming the GPU blocks it needs and those available), or the
      model's heads do not split over the mesh's "model" axis.
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
  vocab = model.config.vocab_size
  params = []
  for index, request in enumerate(requests):
    p = dataclasses.replace(sampling, n=request.n, max_new_tokens=None, eos_id=None)
    if int(request.prompt.max()) >= vocab or int(request.prompt.min()) < 0:
      raise ValueError(f"request {index} has token ids outside 0..{vocab - 1}")
    error = engine.admission_error(request.prompt.size, p)
    if error is not None:
      raise ValueError(f"request {index}: {error}")
    params.append(p)
  for index, (request, p) in enumerate(zip(requests, params)):
    engine.add_request(str(index), request.prompt, p)
  outputs = [None] * len(requests)
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        outputs[int(out.request_id)] = [np.asarray(o.token_ids, np.int32) for o in out.outputs]
        if progress is not None:
          progress(len(out.outputs))
  return outputs, engine.stats


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
    key: PRNG key of the sampling (prompt `i` draws as `generate`'s request
      `i`).

  Returns:
    The generated int32 tokens of each prompt, a stop token included when
    drawn.

  Raises:
    ValueError: if a prompt is empty or not 1-D.
  """
  prompts = [Request(p).prompt for p in prompts]
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
