"""Admission: whether a request can ever fit the engine, and the blocks
its sequences hold.

`admission_error` answers "can this request ever be served" (slots,
positions, GPU blocks for one group alone, with the cache's sliding window
and speculation's lookahead); the scheduler asks it before admitting, the
engine when a request arrives. `blocks_held` and `resident_blocks` count
the blocks a sequence, and a group admitted again after a recompute
preemption, hold at once.
"""

from __future__ import annotations

from paged_jax.config import CacheConfig
from paged_jax.engine.sequence import token_limit
from paged_jax.params import SamplingParams


def blocks_held(cfg: CacheConfig, num_tokens: int, max_chunk: int | None = None) -> int:
  """The most GPU blocks a sequence of `num_tokens` tokens holds at once:
  every block, or on a cache that frees the blocks outside its window
  (appending prompts in chunks of at most `max_chunk` tokens) the window's
  plus one chunk's, since an append takes blocks before it frees them."""
  every = cfg.blocks_for(num_tokens)
  if cfg.sliding_window is None:
    return every
  return min(every, cfg.blocks_for(cfg.sliding_window) + 1 + cfg.blocks_for(max_chunk or 1))


def resident_blocks(
  cfg: CacheConfig, num_prompt_tokens: int, lengths, max_chunk: int | None = None
) -> int:
  """GPU blocks sequences of `lengths` tokens take when their group is
  admitted again after a recompute preemption (each is prefilled on its own;
  with prefix caching they share the prompt's full blocks)."""
  needed = sum(blocks_held(cfg, length, max_chunk) for length in lengths)
  if cfg.enable_prefix_caching:
    needed -= (len(lengths) - 1) * (num_prompt_tokens // cfg.block_size)
  return needed


def admission_error(
  cfg: CacheConfig,
  *,
  max_len: int,
  max_num_seqs: int,
  num_prompt_tokens: int,
  params: SamplingParams,
  resident_lengths=None,
  max_chunk: int | None = None,
  lookahead: int = 0,
) -> str | None:
  """Why a request can never be served, or None: the one answer to "can it
  ever fit", asked when it arrives and whenever it is to be admitted.

  A request fits if its sequences and slots fit the budgets, its prompt
  leaves room for new tokens in `max_len` positions, and one group alone
  fits the GPU blocks: finishing (each of its `n` sequences holds `prompt +
  max_tokens - 1` tokens and `lookahead` slots; they share the prompt's
  full blocks) and being
  admitted (above the watermark: its prompt, or `resident_lengths` after a
  recompute preemption).

  Args:
    cfg: the cache of one data shard.
    max_len: positions a sequence may use (the model's and the block
      table's).
    max_num_seqs: sequences that run at once at most.
    num_prompt_tokens: the prompt's length.
    params: the request's sampling parameters.
    resident_lengths: tokens each unfinished sequence puts in the cache when
      the group is admitted again after a recompute preemption; None for a
      new request.
    max_chunk: the most prompt tokens a sequence appends at once on a cache
      that frees the blocks outside its window (see `blocks_held`).
    lookahead: slots each decode step reserves past a sequence's tokens
      (speculative decoding's proposals).
  """
  n = params.n
  if n > max_num_seqs:
    return f"n={n} sequences exceed max_num_seqs={max_num_seqs}"
  if params.use_beam_search:
    if 2 * n - 1 > cfg.max_seqs:
      return f"{n} beams need {2 * n - 1} sequence slots, the cache has max_seqs={cfg.max_seqs}"
    if num_prompt_tokens < 2:
      return "beam search needs a prompt of at least 2 tokens"
  if num_prompt_tokens >= max_len:
    return (
      f"a prompt of {num_prompt_tokens} tokens leaves no room for new tokens in {max_len} "
      f"positions (the model's max_seq_len and the block table's {cfg.max_tokens_per_seq} tokens)"
    )
  limit = token_limit(max_len, num_prompt_tokens, params)
  per_seq = blocks_held(cfg, num_prompt_tokens + limit - 1 + lookahead, max_chunk)
  # Under a window the samples' shared prompt blocks leave it as they decode.
  shared = 0 if cfg.sliding_window else min(num_prompt_tokens // cfg.block_size, per_seq)
  needed = per_seq + (n - 1) * (per_seq - shared)
  admittable = cfg.num_gpu_blocks - cfg.watermark_blocks
  if needed > cfg.num_gpu_blocks or (
    resident_lengths is None and blocks_held(cfg, num_prompt_tokens, max_chunk) > admittable
  ):
    return (
      f"needs {needed} GPU blocks (n={n} x ({num_prompt_tokens} prompt "
      f"+ {limit} new tokens{f' + {lookahead} lookahead slots' if lookahead else ''}) "
      f"in blocks of {cfg.block_size}), the "
      f"cache has {cfg.num_gpu_blocks} (watermark {cfg.watermark_blocks})"
    )
  if resident_lengths is not None:
    resident = resident_blocks(cfg, num_prompt_tokens, resident_lengths, max_chunk)
    if resident > admittable:
      return (
        f"its sequences of {list(resident_lengths)} tokens need {resident} GPU blocks to be "
        f"prefilled again, the cache has {admittable} above the watermark"
      )
  return None


def type_admission_error(type_configs, **kwargs) -> str | None:
  """`admission_error` in every attention type's pool (`type_configs`:
  `(name, CacheConfig)` pairs, `CacheManager.type_configs`), the first
  answer that is not None, naming its type on a hybrid cache."""
  for name, cfg in type_configs:
    reason = admission_error(cfg, **kwargs)
    if reason is not None:
      return reason if name is None else f"in the {name} type's pool: {reason}"
  return None


def resident_fits(type_configs, free_blocks, num_prompt_tokens: int, lengths, max_chunk) -> bool:
  """Whether a group's sequences of `lengths` tokens, admitted again after a
  recompute preemption, fit every type's free blocks above its watermark."""
  return all(
    resident_blocks(cfg, num_prompt_tokens, lengths, max_chunk) <= free - cfg.watermark_blocks
    for (_, cfg), free in zip(type_configs, free_blocks)
  )
