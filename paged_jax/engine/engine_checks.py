"""`LLMEngine`'s checks of its configuration: speculation the cache can
hold, the most prompt tokens per round under a window, how many model
programs one engine compiles, and the blocks a KV byte budget holds."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from paged_jax import sharding
from paged_jax.block_manager.hybrid import (
  HybridCacheConfig,
  attention_types,
  blocks_per_sequence,
  gpu_blocks_for_budget,
)
from paged_jax.config import CacheConfig
from paged_jax.engine.admission import blocks_held
from paged_jax.engine.protocol import check_model
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.scheduler import PREEMPTION_MODES
from paged_jax.kv_memory import bytes_per_block, num_gpu_blocks_for_budget
from paged_jax.paged_cache import window_chunk

# The most model programs (prompt shapes and decode loops) one engine
# compiles: each costs a compile in warm-up and, on XLA:CPU, memory
# mappings of its code (Linux's vm.max_map_count bounds a process's).
MAX_MODEL_PROGRAMS = 12


def check_program_count(runner: ModelRunner, max_num_batched_tokens: int, max_num_seqs: int):
  """Raises ValueError if the engine's model programs (prompt shapes and
  decode loops, see `LLMEngine.compiled_programs`) pass `MAX_MODEL_PROGRAMS`."""
  prompts = len(runner.prefill_buckets())
  loops = len(runner.decode_kinds()) * len(runner.decode_buckets())
  if prompts + loops > MAX_MODEL_PROGRAMS:
    raise ValueError(
      f"this configuration compiles {prompts + loops} model programs, more than "
      f"{MAX_MODEL_PROGRAMS}: {prompts} prompt shapes (max_num_batched_tokens "
      f"{max_num_batched_tokens} in tiles of prefill_width {runner.prefill_width}) and {loops} "
      f"decode loops (row buckets {runner.decode_buckets()} for max_num_seqs {max_num_seqs}); "
      f"raise prefill_width, lower max_num_batched_tokens or pass fewer decode_row_buckets"
    )


def check_speculation(config, cfg: CacheConfig, max_chunk: int | None, draft) -> None:
  """Refuses speculation that the cache cannot hold.

  Raises:
    ValueError: if `k` lookahead slots leave no room in a block table, a
      cache that frees blocks outside its window takes fewer than `k + 1`
      tokens per call or would hold a draft model's pages, or the draft
      does not follow the model protocol.
  """
  k = config.num_speculative_tokens
  if draft is not None:
    check_model(draft)
    if cfg.sliding_window is not None:
      raise ValueError(
        "a draft model runs on a cache that keeps every block: use a CacheConfig without "
        "sliding_window (each layer masks its own window) or the ngram method"
      )
  if k >= cfg.max_tokens_per_seq:
    raise ValueError(
      f"num_speculative_tokens {k} leaves no room in a block table of "
      f"{cfg.max_tokens_per_seq} tokens"
    )
  if max_chunk is not None and k + 1 > max_chunk:
    raise ValueError(
      f"num_speculative_tokens {k}: a step appends {k + 1} tokens, but this cache's window "
      f"takes at most {max_chunk} per call; lower k or widen CacheConfig.sliding_window"
    )


def max_chunk(cfg: CacheConfig, model_config) -> int | None:
  """The most prompt tokens a sequence appends per round on a cache that
  frees the blocks outside its window (`window_chunk`); None on a cache
  that keeps every block.

  Raises:
    ValueError: if a layer attends beyond the cache's window, or the model's
      config has no `layer_window(layer)` to say what its layers see.
  """
  if cfg.sliding_window is None:
    return None
  layer_window = getattr(model_config, "layer_window", None)
  if layer_window is None:
    raise ValueError(
      f"this cache frees the blocks outside a window of {cfg.sliding_window} tokens, but "
      f"the model's config has no layer_window(layer) that says which keys its layers see; "
      f"use a CacheConfig without sliding_window"
    )
  windows = {layer: layer_window(layer) for layer in range(model_config.num_layers)}
  return window_chunk(cfg.sliding_window, windows)


def check_limits(
  cache_config: CacheConfig,
  *,
  max_num_seqs: int,
  max_num_batched_tokens: int,
  num_decode_steps: int,
  max_logprobs: int,
  max_beam_width: int,
  prefill_width: int,
  decode_row_buckets,
  preemption_mode: str,
) -> None:
  """Raises ValueError for an `LLMEngine` argument out of its range (see
  the engine's Args)."""
  for name, value, low, high in (
    ("max_num_seqs", max_num_seqs, 1, cache_config.max_seqs),
    ("max_num_batched_tokens", max_num_batched_tokens, 1, None),
    ("num_decode_steps", num_decode_steps, 1, None),
    ("max_logprobs", max_logprobs, 0, None),
    ("max_beam_width", max_beam_width, 1, None),
    ("prefill_width", prefill_width, 1, None),
  ):
    if (
      isinstance(value, bool)
      or not isinstance(value, int)
      or value < low
      or (high is not None and value > high)
    ):
      bound = f"in {low}..{high}" if high is not None else f">= {low}"
      raise ValueError(f"{name} must be an int {bound}, got {value!r}")
  if decode_row_buckets is not None and not (
    isinstance(decode_row_buckets, (list, tuple))
    and all(
      isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= cache_config.max_seqs
      for b in decode_row_buckets
    )
  ):
    raise ValueError(
      f"decode_row_buckets must be a list or tuple of ints in 1..{cache_config.max_seqs} "
      f"(rows per data shard), got {decode_row_buckets!r}"
    )
  if max_num_batched_tokens < cache_config.block_size:
    raise ValueError(
      f"max_num_batched_tokens ({max_num_batched_tokens}) must hold at least one block "
      f"(block_size {cache_config.block_size})"
    )
  if preemption_mode not in PREEMPTION_MODES:
    raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")


def kv_block_bytes(block_size: int, model_configs, dtype, model_shards: int = 1) -> int:
  """Bytes one block number takes on one device: every layer's K and V of
  each of `model_configs` (a draft's pages share the blocks), of the KV
  heads one of `model_shards` tensor-parallel devices stores."""
  return sum(
    bytes_per_block(
      block_size=block_size,
      num_layers=c.num_layers,
      num_kv_heads=sharding.stored_kv_heads(c.num_kv_heads, model_shards) // model_shards,
      head_dim=c.head_dim,
      dtype=jnp.dtype(dtype),
    )
    for c in model_configs
  )


def sized_for_budget(
  cfg: CacheConfig,
  budget_bytes: int,
  model_configs,
  *,
  kv_cache_dtype=None,
  model_shards: int = 1,
  max_chunk: int | None = None,
) -> CacheConfig:
  """`cfg` with as many GPU blocks as `budget_bytes` per device hold
  (`LLMEngine`'s `kv_cache_memory_bytes`).

  Args:
    cfg: the cache asked for; its `num_gpu_blocks` must be left at the
      default or equal what the budget holds.
    budget_bytes: bytes of KV pages per device.
    model_configs: the model's config, and a draft model's after it.
    kv_cache_dtype: the pages' dtype; None for the model's.
    model_shards: tensor-parallel devices (the mesh's "model" axis).
    max_chunk: see `admission.blocks_held`.

  Raises:
    ValueError: naming the numbers, for a budget that is not a positive int,
      that holds no sequence of the longest length (the models' and the
      block table's), or that conflicts with `cfg.num_gpu_blocks`.
  """
  dtype = model_configs[0].dtype if kv_cache_dtype is None else kv_cache_dtype
  block_bytes = kv_block_bytes(cfg.block_size, model_configs, dtype, model_shards)
  max_len = min([c.max_seq_len for c in model_configs] + [cfg.max_tokens_per_seq])
  need = blocks_held(cfg, max_len, max_chunk)
  blocks = num_gpu_blocks_for_budget(budget_bytes, block_bytes, min_blocks=need, max_tokens=max_len)
  default = CacheConfig.__dataclass_fields__["num_gpu_blocks"].default
  if cfg.num_gpu_blocks not in (default, blocks):
    raise ValueError(
      f"kv_cache_memory_bytes={budget_bytes} holds {blocks} GPU blocks of {block_bytes} bytes, "
      f"but cache_config.num_gpu_blocks is {cfg.num_gpu_blocks}: give one of them (leave "
      f"num_gpu_blocks at its default, {default}, to size the cache from the budget)"
    )
  return dataclasses.replace(cfg, num_gpu_blocks=blocks)


def hybrid_cache(
  cfg: CacheConfig,
  model_config,
  *,
  budget_bytes: int | None = None,
  kv_cache_dtype=None,
  lookahead: int = 0,
  draft_config=None,
) -> tuple[HybridCacheConfig, CacheConfig, int | None, tuple | None]:
  """The hybrid cache of `LLMEngine(hybrid_kv_cache=True)`: one block table
  and pool per attention type of the model's layers.

  A sliding type of window `w` keeps the blocks of its last `w + c - 1`
  positions, for calls of `c` tokens per sequence: prompt chunks of half
  the smallest window, or, while speculating with `lookahead` proposals,
  at least `lookahead + 1` (a step's last token and proposals): a call's
  first token still sees its whole window. A draft model's layers join
  the target's types (`draft_layer_windows`). Each type's pool has
  `cfg.num_gpu_blocks` blocks, or with `budget_bytes` (bytes of KV pages)
  its share of the budget by the bytes one sequence of the longest length
  holds in it, the draft's layers counted (`hybrid.gpu_blocks_for_budget`).

  Returns:
    (the hybrid config, `cfg` with `num_gpu_blocks` counting every type's
    blocks, the chunk `c`: None when no layer slides, the draft's layers'
    windows as `HybridKVCache.stacked` takes them: None without a draft).

  Raises:
    ValueError: for a cache with a `sliding_window`, a model or draft config
      without `layer_window`, a draft layer no type of the model serves, or
      a budget that is not a positive int, that gives a type fewer blocks
      than one longest sequence holds there, or that conflicts with
      `cfg.num_gpu_blocks`.
  """
  if cfg.sliding_window is not None:
    raise ValueError(
      f"hybrid_kv_cache: cache_config.sliding_window must be None (got {cfg.sliding_window}); "
      f"each attention type's window comes from the model's layers"
    )
  windows = _layer_windows(model_config, "the model's")
  sliding = [w for w in windows if w is not None]
  chunk = max(1, min(sliding) // 2, lookahead + 1) if sliding else None
  kept = tuple(None if w is None else w + chunk - 1 for w in windows)
  draft_kept = None
  if draft_config is not None:
    draft_windows = draft_layer_windows(windows, _layer_windows(draft_config, "the draft model's"))
    draft_kept = tuple(None if w is None else w + chunk - 1 for w in draft_windows)
  types = attention_types(kept)
  if budget_bytes is None:
    gpu_blocks = (cfg.num_gpu_blocks,) * len(types)
  else:
    gpu_blocks = _type_blocks_for_budget(
      cfg, [model_config, draft_config], [kept, draft_kept], budget_bytes, kv_cache_dtype, chunk
    )
  hybrid = HybridCacheConfig(cfg, kept, gpu_blocks=gpu_blocks)
  return hybrid, dataclasses.replace(cfg, num_gpu_blocks=sum(gpu_blocks)), chunk, draft_kept


def _layer_windows(config, whose: str) -> list:
  """Each layer's window (None: global) from `config.layer_window`."""
  layer_window = getattr(config, "layer_window", None)
  if layer_window is None:
    raise ValueError(f"hybrid_kv_cache: {whose} config has no layer_window(layer)")
  return [layer_window(layer) for layer in range(config.num_layers)]


def draft_layer_windows(target_windows, draft_windows) -> tuple:
  """The target window of the type each draft layer joins on a hybrid cache.

  A draft layer joins the narrowest of the target's types that sees every
  key it attends to: a layer with window `w` the type of the smallest
  target window `>= w` (the global type if none), a global layer the
  global type. It masks its own window there.

  Args:
    target_windows: each target layer's window, None for global attention.
    draft_windows: each draft layer's.

  Raises:
    ValueError: naming the first draft layer no type serves (a window wider
      than every target window, with no global type) and the model's types.
  """
  types = attention_types(target_windows)
  joined = []
  for layer, window in enumerate(draft_windows):
    wide_enough = [w for w in types if w is not None and window is not None and w >= window]
    if wide_enough:
      joined.append(min(wide_enough))
    elif None in types:
      joined.append(None)
    else:
      seen = "the whole context" if window is None else f"a window of {window}"
      names = ", ".join(f"sliding window {w}" for w in types)
      raise ValueError(
        f"hybrid_kv_cache: draft layer {layer} attends to {seen}, but no attention type of "
        f"the model keeps that many keys (its types: {names}); use a draft whose windows are "
        f"at most the model's, or hybrid_kv_cache=False"
      )
  return tuple(joined)


def _type_blocks_for_budget(cfg, model_configs, layer_windows, budget_bytes, dtype, chunk) -> tuple:
  """Each type's GPU blocks from one byte budget (see `hybrid_cache`):
  `model_configs` and `layer_windows` hold the model's and the draft's
  (None without a draft)."""
  if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
    raise ValueError(f"kv_cache_memory_bytes must be a positive int, got {budget_bytes!r}")
  dtype = model_configs[0].dtype if dtype is None else dtype
  kept, per_layer = (), ()
  for config, windows in zip(model_configs, layer_windows):
    if config is None:
      continue
    layer_bytes = bytes_per_block(
      block_size=cfg.block_size,
      num_layers=1,
      num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim,
      dtype=jnp.dtype(dtype),
    )
    kept, per_layer = kept + windows, per_layer + (layer_bytes,) * len(windows)
  max_len = min([c.max_seq_len for c in model_configs if c is not None] + [cfg.max_tokens_per_seq])
  extra = cfg.blocks_for(chunk or 1)
  types = attention_types(kept)
  need = [blocks_per_sequence(w, max_len, cfg.block_size, extra) for w in types]
  per_sequence = sum(n * b for w, b in zip(kept, per_layer) for t, n in zip(types, need) if t == w)
  held = ", ".join(f"{n} blocks in each of {kept.count(w)} layers" for w, n in zip(types, need))
  sizes = " or ".join(str(b) for b in dict.fromkeys(per_layer))
  if budget_bytes < per_sequence:
    raise ValueError(
      f"kv_cache_memory_bytes={budget_bytes} holds no sequence of {max_len} tokens: it needs "
      f"{per_sequence} bytes ({held}; {sizes} bytes per block and layer)"
    )
  blocks = gpu_blocks_for_budget(
    kept,
    block_size=cfg.block_size,
    layer_block_bytes=per_layer,
    budget_bytes=budget_bytes,
    max_tokens=max_len,
    extra_blocks=extra,
  )
  default = CacheConfig.__dataclass_fields__["num_gpu_blocks"].default
  if cfg.num_gpu_blocks != default:
    raise ValueError(
      f"kv_cache_memory_bytes={budget_bytes} sizes each type's pool ({blocks} GPU blocks), but "
      f"cache_config.num_gpu_blocks is {cfg.num_gpu_blocks}: give one of them (leave "
      f"num_gpu_blocks at its default, {default}, to size the cache from the budget)"
    )
  return blocks
