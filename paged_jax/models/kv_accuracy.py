"""How much a quantized KV cache changes a model's predictions.

Two measures, taken in one batch by ``evaluate_cache`` per cache dtype:

* the mean log-probability of fixed text, its first ``prefill_len`` tokens
  through paged prefill and the rest through paged decode (teacher forcing),
  so both attention paths read the cache;
* greedy continuations of prompts through the same prefill and decode.

``kv_cache_accuracy`` compares quantized caches with a baseline cache and
works for any model and tokenizer (the tiny model, or a real checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from paged_jax.config import CacheConfig
from paged_jax.kv_cache import KVCache
from paged_jax.models.llama import Llama
from paged_jax.paged_cache import PagedCache


def with_compute_dtype(model: Llama, dtype) -> Llama:
  """The same parameters with activations (and K/V) computed in ``dtype``."""
  config = dataclasses.replace(model.config, dtype=jnp.dtype(dtype).name)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, nnx.state(model))


def evaluate_cache(
  model: Llama,
  text_rows,
  prompts: Sequence[np.ndarray],
  *,
  prefill_len: int,
  num_tokens: int,
  kv_cache_dtype,
  block_size: int = 16,
) -> tuple[float, np.ndarray]:
  """Scores text and decodes greedily through one paged cache of a dtype.

  Text rows and prompts share one batch: a prefill (the first
  ``prefill_len`` tokens of each text row, each whole prompt), then a scan
  of decode steps that feed the text rows their own next token and the
  prompt rows their greedy choice.

  Args:
    model: the decoder.
    text_rows: int ``[rows, row_len]`` token ids, one text per row.
    prompts: int token ids, one array per prompt.
    prefill_len: text tokens per row run as one prefill, in
      ``1 .. row_len - 1``; the rest are decoded one at a time.
    num_tokens: greedy tokens per prompt.
    kv_cache_dtype: dtype of the cache pages (e.g. ``jnp.int8``).
    block_size: tokens per cache block.

  Returns:
    ``(mean_log_prob, greedy)``: the mean of ``log p(token | prefix)`` over
    ``text_rows[:, 1:]``, and int32 ``[len(prompts), num_tokens]``.

  Raises:
    ValueError: if ``prefill_len`` is out of range.
  """
  text_rows = np.asarray(text_rows, np.int32)
  row_len = text_rows.shape[1]
  if not 1 <= prefill_len < row_len:
    raise ValueError(f"prefill_len must be in 1..{row_len - 1}, got {prefill_len}")
  prompt_lens = np.array([len(p) for p in prompts], np.int32)
  padded = np.zeros((len(prompts), prompt_lens.max()), np.int32)
  for row, prompt in enumerate(prompts):
    padded[row, : len(prompt)] = prompt
  batch = len(text_rows) + len(prompts)
  blocks = -(-max(row_len, padded.shape[1] + num_tokens) // block_size)
  cfg = CacheConfig(
    block_size=block_size,
    num_gpu_blocks=batch * blocks,
    num_cpu_blocks=0,
    max_seqs=batch,
    max_blocks_per_seq=blocks,
  )
  mc = model.config
  kv = KVCache.create(cfg, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype=kv_cache_dtype)
  graphdef, state = nnx.split(model)
  log_prob, greedy = _evaluate(
    graphdef, state, kv, prefill_len, num_tokens, text_rows, padded, prompt_lens
  )
  return float(log_prob), np.asarray(greedy)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _evaluate(graphdef, state, kv, prefill_len, num_tokens, text, prompts, prompt_lens):
  """The prefill and decode scan of ``evaluate_cache``."""
  num_text, row_len = text.shape
  num_prompts, prompt_width = prompts.shape
  batch = num_text + num_prompts
  blocks = kv.num_gpu_blocks // batch
  tables = (jnp.arange(batch)[:, None] * blocks + jnp.arange(blocks)[None, :]).astype(jnp.int32)

  def forward(kv, inputs, positions):
    safe = jnp.maximum(positions, 0)
    slot_mapping = jnp.where(
      positions >= 0,
      tables[jnp.arange(batch)[:, None], safe // kv.block_size] * kv.block_size
      + safe % kv.block_size,
      -1,
    )
    cache = PagedCache(kv=kv, block_tables=tables, slot_mapping=slot_mapping)
    logits, cache = nnx.merge(graphdef, state)(inputs, positions, cache)
    return jax.nn.log_softmax(logits.astype(jnp.float32)), cache.kv

  def picked(log_probs, targets):
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]

  width = max(prefill_len, prompt_width)
  inputs = jnp.zeros((batch, width), jnp.int32)
  inputs = inputs.at[:num_text, :prefill_len].set(text[:, :prefill_len])
  inputs = inputs.at[num_text:, :prompt_width].set(prompts)
  lens = jnp.concatenate([jnp.full(num_text, prefill_len, jnp.int32), prompt_lens])
  columns = jnp.arange(width, dtype=jnp.int32)[None, :]
  log_probs, kv = forward(kv, inputs, jnp.where(columns < lens[:, None], columns, -1))
  text_total = picked(log_probs[:num_text, :prefill_len], text[:, 1 : prefill_len + 1]).sum()
  first = jnp.argmax(
    log_probs[num_text + jnp.arange(num_prompts), prompt_lens - 1], axis=-1
  ).astype(jnp.int32)

  def decode(carry, step):
    kv, greedy = carry
    text_pos = prefill_len + step
    text_on = text_pos < row_len - 1
    inputs = jnp.concatenate([text[:, jnp.minimum(text_pos, row_len - 1)], greedy])[:, None]
    positions = jnp.concatenate(
      [
        jnp.full(num_text, jnp.where(text_on, text_pos, -1)),
        jnp.where(step < num_tokens - 1, prompt_lens + step, -1),
      ]
    )[:, None]
    log_probs, kv = forward(kv, inputs, positions)
    target = text[:, jnp.minimum(text_pos + 1, row_len - 1)]
    text_sum = jnp.where(text_on, picked(log_probs[:num_text, 0], target).sum(), 0.0)
    greedy = jnp.argmax(log_probs[num_text:, 0], axis=-1).astype(jnp.int32)
    return (kv, greedy), (text_sum, greedy)

  steps = max(row_len - 1 - prefill_len, num_tokens - 1)
  _, (text_sums, greedy) = lax.scan(decode, (kv, first), jnp.arange(steps, dtype=jnp.int32))
  mean_log_prob = (text_total + text_sums.sum()) / (num_text * (row_len - 1))
  greedy = jnp.concatenate([first[:, None], greedy.T], axis=1)
  return mean_log_prob, greedy[:, :num_tokens]


def kv_cache_accuracy(
  model: Llama,
  tokenizer,
  text: str,
  prompts: Sequence[str],
  *,
  dtypes: Sequence,
  baseline=jnp.bfloat16,
  num_rows: int = 4,
  row_len: int | None = None,
  num_tokens: int = 16,
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
    raise ValueError(f"text has {ids.size} tokens, need {num_rows} rows of {row_len}")
  rows = ids[: num_rows * row_len].reshape(num_rows, row_len)
  encoded = [np.asarray(tokenizer.encode(p), np.int32) for p in prompts]
  results = []
  for dtype in (baseline, *dtypes):
    log_prob, greedy = evaluate_cache(
      model, rows, encoded, prefill_len=row_len // 2, num_tokens=num_tokens, kv_cache_dtype=dtype
    )
    if not results:
      base_log_prob, base_greedy = log_prob, greedy
    results.append(
      dict(
        dtype=jnp.dtype(dtype).name,
        mean_log_prob=log_prob,
        relative_change=abs(log_prob - base_log_prob) / abs(base_log_prob),
        greedy_agree=int((greedy == base_greedy).all(axis=1).sum()),
        num_prompts=len(prompts),
      )
    )
  return results
