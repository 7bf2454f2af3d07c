"""What one chip's HBM holds of KV pages, for `python -m paged_jax aot`'s report.

The bytes left per chip after the weights and the largest temporaries of any
program hold either one table's KV blocks (`kv_blocks_per_chip`) or, on a
hybrid cache (`LLMEngine(hybrid_kv_cache=True)`: one block table and pool per
attention type), each type's pool as the engine splits a byte budget
(`hybrid_pools`, by `block_manager.hybrid.gpu_blocks_for_budget`). Both count
the sequences of `SEQUENCE_TOKENS` tokens that fit.
"""

from __future__ import annotations

import dataclasses
import math

SEQUENCE_TOKENS = 8192
BLOCK_SIZE = 16


def kv_bytes_left(hbm: int, weight_bytes: int, temp_bytes: int, least: int, what: str) -> int:
  """`hbm - weight_bytes - temp_bytes`, all per chip (weights after the
  tensor-parallel split, the largest temporaries of any program).

  Raises:
    ValueError: naming the bytes when that leaves less than `least` bytes
      (`what` says what they are for).
  """
  free = hbm - weight_bytes - temp_bytes
  if free < least:
    raise ValueError(
      f"too large for the chip: {weight_bytes} bytes of weights and {temp_bytes} bytes of "
      f"temporaries leave {free} of {hbm} bytes of HBM, less than {what}"
    )
  return free


def kv_blocks_per_chip(hbm: int, weight_bytes: int, temp_bytes: int, block_bytes: int) -> int:
  """KV blocks of one table one chip holds: the bytes left (`kv_bytes_left`)
  over one block's K and V pages and scales of all layers.

  Raises:
    ValueError: naming the bytes when they leave no room for one block.
  """
  what = f"one {block_bytes}-byte KV block"
  return kv_bytes_left(hbm, weight_bytes, temp_bytes, block_bytes, what) // block_bytes


def sequences_per_chip(blocks: int, block_size: int = BLOCK_SIZE) -> int:
  """Sequences of `SEQUENCE_TOKENS` tokens that `blocks` blocks of one table hold."""
  return blocks // math.ceil(SEQUENCE_TOKENS / block_size)


def hybrid_pools(
  model_config, free_bytes: int, kv_cache_dtype=None, block_size: int = BLOCK_SIZE
) -> dict:
  """A hybrid cache's pools in `free_bytes` of one chip, split as
  `LLMEngine(hybrid_kv_cache=True, kv_cache_memory_bytes=free_bytes)` splits
  its budget for sequences of `SEQUENCE_TOKENS` tokens (`hybrid_cache`).

  Returns:
    `kv_bytes_per_chip` (`free_bytes`); `types`: for each attention type, in
    type order, its `name`, the model's `window` (None: global), the
    `tokens_kept` of a sequence (window plus a prompt chunk less one), its
    `layers`, `gpu_blocks`, `bytes_per_block` (its layers' K and V) and the
    `blocks_per_sequence` a sequence holds there at most; the
    `sequences_8k_per_chip` every pool holds; and
    `every_block_kept_sequences_8k_per_chip`, the one-table cache's in the
    same bytes.

  Raises:
    ValueError: naming the bytes when they hold no such sequence.
  """
  import jax.numpy as jnp

  from paged_jax.block_manager.hybrid import blocks_per_sequence
  from paged_jax.config import CacheConfig
  from paged_jax.engine.engine_checks import hybrid_cache
  from paged_jax.kv_memory import bytes_per_block

  config = dataclasses.replace(model_config, max_seq_len=SEQUENCE_TOKENS)
  cache = CacheConfig(
    block_size=block_size,
    num_cpu_blocks=0,
    max_blocks_per_seq=math.ceil(SEQUENCE_TOKENS / block_size),
  )
  layer_bytes = bytes_per_block(
    block_size=block_size,
    num_layers=1,
    num_kv_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    dtype=jnp.dtype(config.dtype if kv_cache_dtype is None else kv_cache_dtype),
  )
  every_block = config.num_layers * layer_bytes * cache.blocks_for(SEQUENCE_TOKENS)
  try:
    hybrid, _, chunk, _ = hybrid_cache(
      cache, config, budget_bytes=free_bytes, kv_cache_dtype=kv_cache_dtype
    )
  except ValueError as err:
    raise ValueError(f"{free_bytes} bytes of KV pages per chip: {err}") from err
  windows = [config.layer_window(layer) for layer in range(config.num_layers)]
  chunk_blocks = cache.blocks_for(chunk or 1)  # taken before a sliding type frees any
  need = lambda kept: blocks_per_sequence(kept, SEQUENCE_TOKENS, block_size, chunk_blocks)
  types = [_pool(hybrid, group, windows, layer_bytes, need) for group in range(hybrid.num_groups)]
  return dict(
    kv_bytes_per_chip=free_bytes,
    types=types,
    sequences_8k_per_chip=min(t["gpu_blocks"] // t["blocks_per_sequence"] for t in types),
    every_block_kept_sequences_8k_per_chip=free_bytes // every_block,
  )


def kv_report(
  model_config, hbm: int, weight_bytes: int, temp_bytes: int, block_bytes: int, hybrid: dict
) -> dict:
  """What one chip's `hbm` bytes hold of KV pages past `weight_bytes` and
  `temp_bytes`: with `block_bytes` (one table's block, 0 when only hybrid
  variants were compiled) `kv_block_bytes_per_chip`, `kv_blocks_per_chip`
  and `sequences_8k_per_chip`; for each variant of `hybrid` (its name: its
  pages' dtype, None for the model's) its pools under `hybrid_kv`
  (`hybrid_pools`).

  Raises:
    ValueError: naming the bytes when they hold no block of one table or no
      8k-token sequence of a hybrid cache.
  """
  report = {}
  if block_bytes:
    blocks = kv_blocks_per_chip(hbm, weight_bytes, temp_bytes, block_bytes)
    report.update(
      kv_block_bytes_per_chip=block_bytes,
      kv_blocks_per_chip=blocks,
      sequences_8k_per_chip=sequences_per_chip(blocks),
    )
  if hybrid:
    free = kv_bytes_left(hbm, weight_bytes, temp_bytes, 1, "one KV page")
    report["hybrid_kv"] = {
      variant: hybrid_pools(model_config, free, dtype) for variant, dtype in hybrid.items()
    }
  return report


def _pool(hybrid, group: int, windows: list, layer_bytes: int, need) -> dict:
  """Type `group`'s entry of `hybrid_pools` (`windows`: the model's, per layer;
  `need(tokens_kept)`: a sequence's most blocks there)."""
  kept = hybrid.windows[group]
  window = dict(zip(hybrid.layer_windows, windows))[kept]
  layers = hybrid.layer_windows.count(kept)
  return dict(
    name="global" if kept is None else f"sliding window {window}",
    window=window,
    tokens_kept=kept,
    layers=layers,
    gpu_blocks=hybrid.gpu_blocks[group],
    bytes_per_block=layers * layer_bytes,
    blocks_per_sequence=need(kept),
  )


def describe_kv(report: dict) -> list[str]:
  """The report's KV lines: one table's blocks, and each hybrid variant's pools."""
  lines = []
  if "kv_blocks_per_chip" in report:
    lines.append(
      f"one table: {report['kv_block_bytes_per_chip']} bytes per KV block: "
      f"{report['kv_blocks_per_chip']} KV blocks, {report['sequences_8k_per_chip']} sequences "
      f"of 8k tokens"
    )
  for variant, pools in report.get("hybrid_kv", {}).items():
    each = "; ".join(
      f"{t['name']}: {t['gpu_blocks']} blocks, {t['blocks_per_sequence']} per sequence"
      for t in pools["types"]
    )
    lines.append(
      f"{variant}: {pools['kv_bytes_per_chip']} bytes of KV pages per chip, a pool per type "
      f"({each}): {pools['sequences_8k_per_chip']} sequences of 8k tokens "
      f"({pools['every_block_kept_sequences_8k_per_chip']} with every block kept)"
    )
  return lines
