"""Block-table arithmetic and masked writes to the per-sequence arrays.

Token counts to blocks, the sliding window's first live block, and the
scatters that write rows and table entries only where a call keeps them
(a failed call masks every write).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.block_manager.pool import masked
from paged_jax.config import CacheConfig


def floor_div(numerator, divisor: int):
  """numerator // divisor. A power-of-two divisor is an arithmetic shift (cheaper fusions)."""
  if isinstance(numerator, int) or divisor & (divisor - 1):
    return numerator // divisor
  return jnp.right_shift(numerator, divisor.bit_length() - 1)


def ceil_div(numerator, divisor: int):
  """ceil(numerator / divisor) for numerator >= 0."""
  return floor_div(numerator + divisor - 1, divisor)


def first_live_block(cfg: CacheConfig, num_tokens: jax.Array) -> jax.Array:
  """First logical block still inside the sliding window (0 without one)."""
  if cfg.sliding_window is None:
    return jnp.zeros_like(num_tokens)
  return jnp.maximum(0, floor_div(num_tokens - cfg.sliding_window, cfg.block_size))


def set_rows(array: jax.Array, rows: jax.Array, keep: jax.Array, values) -> jax.Array:
  """array[rows[i]] = values[i] where keep[i] (a masked row scatter)."""
  index = masked(rows, keep, array.shape[0])
  values = jnp.broadcast_to(values, (rows.shape[0],) + array.shape[1:])
  return array.at[index].set(values.astype(array.dtype), mode="drop")


def table_entries(tables: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
  """tables[rows[:, None], cols] (cols clipped into range), as one flat gather."""
  max_blocks = tables.shape[1]
  return tables.reshape(-1)[rows[:, None] * max_blocks + jnp.clip(cols, 0, max_blocks - 1)]


def set_table_entries(tables, rows, cols, keep, values) -> jax.Array:
  """tables[rows[i], cols[i, j]] = values[i, j] where keep[i, j] (cols in range), flat."""
  max_seqs, max_blocks = tables.shape
  index = masked(rows[:, None] * max_blocks + cols, keep, max_seqs * max_blocks)
  values = jnp.broadcast_to(jnp.asarray(values, tables.dtype), index.shape)
  flat = tables.reshape(-1).at[index.ravel()].set(values.ravel(), mode="drop")
  return flat.reshape(max_seqs, max_blocks)


def prefix_mask(mask: jax.Array) -> jax.Array:
  """Keeps each row's leading run of True."""
  return jnp.cumprod(mask.astype(jnp.int32), axis=1).astype(bool)
