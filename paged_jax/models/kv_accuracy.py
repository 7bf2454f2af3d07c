"""How much a quantized KV cache changes a model's predictions.

Two measures, each run once per cache dtype on the same model:

* ``mean_log_prob``: the mean log-probability of fixed text, its first
  ``prefill_len`` tokens through paged prefill and the rest through paged
  decode (teacher forcing), so both attention paths read the cache.
* ``greedy_tokens``: ``paged_jax.generate`` with greedy sampling.

``kv_cache_accuracy`` compares quantized caches with a baseline cache and
works for any model and tokenizer (the tiny model, or a real checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import CacheConfig
from paged_jax.generate import Request, SamplingParams, generate
from paged_jax.kv_cache import KVCache
from paged_jax.models.llama import Llama
from paged_jax.models.paged import PagedCache


def with_compute_dtype(model: Llama, dtype) -> Llama:
  """The same parameters with activations (and K/V) computed in ``dtype``."""
  config = dataclasses.replace(model.config, dtype=jnp.dtype(dtype).name)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(config,
                                                       rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.state(model))


def mean_log_prob(model: Llama, tokens, *, prefill_len: int, kv_cache_dtype,
                  block_size: int = 16) -> float:
  """Mean log-probability of ``tokens[:, 1:]`` through a paged cache.

  Args:
    model: the decoder.
    tokens: int ``[batch, length]`` token ids, one text per row.
    prefill_len: tokens per row run as one prefill (at least 1); the rest
      are decoded one at a time, fed the text's own next token.
    kv_cache_dtype: dtype of the cache pages (e.g. ``jnp.int8``).
    block_size: tokens per cache block.

  Returns:
    The mean over rows and predicted positions of ``log p(token | prefix)``.

  Raises:
    ValueError: if ``prefill_len`` is not in ``1 .. length - 1``.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  batch, length = tokens.shape
  if not 1 <= prefill_len < length:
    raise ValueError(f"prefill_len must be in 1..{length - 1}, got "
                     f"{prefill_len}")
  blocks = -(-length // block_size)
  cfg = CacheConfig(block_size=block_size, num_gpu_blocks=batch * blocks,
                    num_cpu_blocks=0, max_seqs=batch,
                    max_blocks_per_seq=blocks)
  mc = model.config
  kv = KVCache.create(cfg, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                      dtype=kv_cache_dtype)
  graphdef, state = nnx.split(model)
  return float(_text_log_probs(graphdef, state, kv, prefill_len, tokens))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _text_log_probs(graphdef, state, kv, prefill_len, tokens):
  """Prefill ``prefill_len`` tokens, then a scan of teacher-forced decodes."""
  batch, length = tokens.shape
  block_size = kv.block_size
  blocks = kv.num_gpu_blocks // batch
  tables = (jnp.arange(batch)[:, None] * blocks
            + jnp.arange(blocks)[None, :]).astype(jnp.int32)

  def slots(positions):
    return (tables[jnp.arange(batch)[:, None], positions // block_size]
            * block_size + positions % block_size)

  def forward(cache, inputs, positions):
    cache = PagedCache(kv=cache, block_tables=tables,
                       slot_mapping=slots(positions))
    logits, cache = nnx.merge(graphdef, state)(inputs, positions, cache)
    return jax.nn.log_softmax(logits.astype(jnp.float32)), cache.kv

  def picked(log_probs, targets):
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]

  positions = jnp.broadcast_to(jnp.arange(prefill_len, dtype=jnp.int32),
                               (batch, prefill_len))
  log_probs, kv = forward(kv, tokens[:, :prefill_len], positions)
  prefill = picked(log_probs, tokens[:, 1:prefill_len + 1])

  def decode(kv, position):
    inputs = lax.dynamic_slice_in_dim(tokens, position, 1, axis=1)
    targets = lax.dynamic_slice_in_dim(tokens, position + 1, 1, axis=1)
    log_probs, kv = forward(kv, inputs,
                            jnp.full((batch, 1), position, jnp.int32))
    return kv, picked(log_probs, targets)[:, 0]

  _, decoded = lax.scan(decode, kv,
                        jnp.arange(prefill_len, length - 1, dtype=jnp.int32))
  return jnp.concatenate([prefill, decoded.T], axis=1).mean()


def greedy_tokens(model: Llama, prompts: Sequence[np.ndarray], *,
                  num_tokens: int, kv_cache_dtype,
                  block_size: int = 16) -> np.ndarray:
  """Greedy continuations from ``paged_jax.generate``.

  Returns:
    int32 ``[len(prompts), num_tokens]``.
  """
  longest = max(len(p) for p in prompts) + num_tokens
  blocks = -(-longest // block_size)
  cfg = CacheConfig(block_size=block_size,
                    num_gpu_blocks=len(prompts) * blocks, num_cpu_blocks=0,
                    max_seqs=len(prompts), max_blocks_per_seq=blocks)
  outputs, _ = generate(model, [Request(np.asarray(p, np.int32))
                                for p in prompts], cfg,
                        SamplingParams(max_new_tokens=num_tokens),
                        jax.random.key(0), kv_cache_dtype=kv_cache_dtype)
  return np.stack([samples[0] for samples in outputs])


def kv_cache_accuracy(model: Llama, tokenizer, text: str,
                      prompts: Sequence[str], *, dtypes: Sequence,
                      baseline=jnp.bfloat16, num_rows: int = 4,
                      row_len: int | None = None, num_tokens: int = 16
                      ) -> list[dict]:
  """Compares caches of ``dtypes`` with a ``baseline`` cache on one model.

  The model computes in the baseline dtype; ``text`` is cut into
  ``num_rows`` rows of ``row_len`` tokens (default: the model's
  ``max_seq_len``), half of each row prefilled.

  Args:
    model: the decoder.
    tokenizer: anything with ``encode(text) -> ids``.
    text: English text for the log-probabilities.
    prompts: prompts for the greedy comparison.
    dtypes: cache dtypes to compare (e.g. ``jnp.int8``,
      ``jnp.float8_e4m3fn``).
    baseline: the reference cache (and compute) dtype.
    num_rows: text rows scored in one batch.
    row_len: tokens per row.
    num_tokens: greedy tokens compared per prompt.

  Returns:
    One dict per dtype (the baseline first): ``dtype``, ``mean_log_prob``,
    ``relative_change`` (``|lp - lp_baseline| / |lp_baseline|``) and
    ``greedy_agree`` (prompts whose first ``num_tokens`` tokens equal the
    baseline's) out of ``num_prompts``.
  """
  model = with_compute_dtype(model, baseline)
  row_len = row_len or model.config.max_seq_len
  ids = np.asarray(tokenizer.encode(text), np.int32)
  if ids.size < num_rows * row_len:
    raise ValueError(f"text has {ids.size} tokens, need {num_rows} rows of "
                     f"{row_len}")
  rows = ids[:num_rows * row_len].reshape(num_rows, row_len)
  encoded = [np.asarray(tokenizer.encode(p), np.int32) for p in prompts]
  results = []
  for dtype in (baseline, *dtypes):
    log_prob = mean_log_prob(model, rows, prefill_len=row_len // 2,
                             kv_cache_dtype=dtype)
    greedy = greedy_tokens(model, encoded, num_tokens=num_tokens,
                           kv_cache_dtype=dtype)
    if not results:
      base_log_prob, base_greedy = log_prob, greedy
    results.append(dict(
        dtype=jnp.dtype(dtype).name, mean_log_prob=log_prob,
        relative_change=abs(log_prob - base_log_prob) / abs(base_log_prob),
        greedy_agree=int((greedy == base_greedy).all(axis=1).sum()),
        num_prompts=len(prompts)))
  return results
