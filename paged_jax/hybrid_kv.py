"""The pages of a hybrid cache: one `KVCache` per attention type, each read through its own table.

Type `g` of a `HybridCacheConfig` owns the pages of its layers only
(``gpu_blocks[g]`` blocks each), so a layer's K/V is written with its
type's slot mapping, read with its type's block table, copied by its type's
copy-on-write plan and swapped by its type's swap plan. The block manager's
`HybridResult` carries one plan per type; these functions route them.

A speculative draft model's layers come after the target's (`stacked`):
each draft layer's pages sit in the pages of the type it joins, after that
type's target layers, in the same blocks, so the type's tables, copies and
swaps serve both models. `layers(start)` is the view a second model's call
takes (its layer 0 is layer `start`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax import kv_cache, kv_swap
from paged_jax.attention import paged_attention
from paged_jax.block_manager.hybrid import HybridCacheConfig, HybridResult
from paged_jax.kv_cache import KVCache


@flax.struct.dataclass
class HybridKVCache:
  """One `KVCache` per attention type, holding the pages of that type's layers in layer order."""

  cfg: HybridCacheConfig = flax.struct.field(pytree_node=False)
  types: tuple
  first_layer: int = flax.struct.field(pytree_node=False, default=0)

  @classmethod
  def create(
    cls,
    cfg: HybridCacheConfig,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    *,
    device: jax.Device | None = None,
  ) -> HybridKVCache:
    """Zeroed pages for every layer, each type's sized by its own pools (one device)."""
    counts = [0] * cfg.num_groups
    for layer in range(len(cfg.layer_windows)):
      counts[cfg.layer_group(layer)] += 1
    types = tuple(
      KVCache.create(cfg.group_config(g), counts[g], num_kv_heads, head_dim, dtype, device=device)
      for g in range(cfg.num_groups)
    )
    return cls(cfg=cfg, types=types)

  def locate(self, layer: int) -> tuple[int, int]:
    """(the type of `layer`, its index among that type's layers); ValueError for a bad layer."""
    layer = self.first_layer + layer
    group = self.cfg.layer_group(layer)
    return group, self.cfg.layer_windows[:layer].count(self.cfg.windows[group])

  @property
  def num_layers(self) -> int:
    """The layers this cache (or view, see `layers`) holds."""
    return len(self.cfg.layer_windows) - self.first_layer

  def layers(self, start: int) -> HybridKVCache:
    """The view of layers `start ..` only (its layer 0 is layer `start`):
    a second model's pages in the same blocks (a draft model's)."""
    return self.replace(first_layer=self.first_layer + start)

  def with_layers(self, start: int, part: HybridKVCache) -> HybridKVCache:
    """The cache with layers `start ..` from `part`, a `layers(start)` view
    that a call wrote (it holds every layer's pages)."""
    return part.replace(first_layer=self.first_layer)

  def stacked(self, other: HybridKVCache) -> HybridKVCache:
    """One cache of this cache's layers, then `other`'s: each of `other`'s
    layers in the pages of its type here, after this cache's layers of
    that type (the same blocks; each layer keeps its heads and head size).

    Raises:
      ValueError: naming a type of `other` that this cache lacks.
    """
    windows = self.cfg.windows
    for window in other.cfg.windows:
      self.cfg.group_of_window(window)  # raises for a type this cache lacks
    types = tuple(
      kv.stacked(other.types[other.cfg.windows.index(w)]) if w in other.cfg.windows else kv
      for kv, w in zip(self.types, windows)
    )
    layer_windows = self.cfg.layer_windows + other.cfg.layer_windows
    return self.replace(cfg=dataclasses.replace(self.cfg, layer_windows=layer_windows), types=types)

  def pages(self, layer: int) -> tuple[jax.Array, jax.Array]:
    """Layer `layer`'s K and V pages (those of its type's pool)."""
    group, index = self.locate(layer)
    return self.types[group].pages(index)

  @property
  def mesh(self):
    """None: a hybrid cache lives on one device."""
    return None

  @property
  def nbytes(self) -> int:
    """Device bytes of every type's pages."""
    return sum(kv.nbytes for kv in self.types)


def write_kv(kv: HybridKVCache, layer: int, k, v, slot_mappings: tuple) -> HybridKVCache:
  """Writes one layer's new K/V rows at the slots of its type's mapping.

  Args:
    kv: the pages.
    layer: the decoder layer.
    k, v: the new rows, as `kv_cache.write_kv` takes them.
    slot_mappings: one mapping per type (`HybridBlockSpaceManager.get_slot_mapping`).
  """
  group, index = kv.locate(layer)
  written = kv_cache.write_kv(kv.types[group], index, k, v, slot_mappings[group])
  return kv.replace(types=_replaced(kv.types, group, written))


def attend(kv: HybridKVCache, layer: int, q, block_tables: tuple, lengths, **options) -> jax.Array:
  """Decode attention of one layer through its type's block table, masked to its window.

  Args:
    kv: the pages.
    layer: the decoder layer.
    q: ``[batch, num_q_heads, head_dim]``.
    block_tables: one table per type (`HybridBlockSpaceManager.get_block_tables`).
    lengths: ``int32[batch]`` context lengths, the new token included.
    **options: `paged_attention`'s other options (``sm_scale``, ``soft_cap``, ``impl``).
  """
  group, _ = kv.locate(layer)
  k_pages, v_pages = kv.pages(layer)
  return paged_attention(
    q,
    k_pages,
    v_pages,
    block_tables[group],
    lengths,
    sliding_window=kv.cfg.windows[group],
    **options,
  )


def copy_blocks(kv: HybridKVCache, result: HybridResult) -> HybridKVCache:
  """Runs each type's copy-on-write plan on that type's pages."""
  return kv.replace(
    types=tuple(kv_cache.copy_blocks(c, plan) for c, plan in zip(kv.types, result.results))
  )


def swap_out(kv: HybridKVCache, result: HybridResult) -> HybridKVCache:
  """Moves each type's swapped-out blocks to its host pages."""
  return kv.replace(
    types=tuple(kv_swap.swap_out(c, plan) for c, plan in zip(kv.types, result.results))
  )


def swap_in(kv: HybridKVCache, result: HybridResult) -> HybridKVCache:
  """Moves each type's swapped-in blocks back to its device pages."""
  return kv.replace(
    types=tuple(kv_swap.swap_in(c, plan) for c, plan in zip(kv.types, result.results))
  )


def _replaced(items: tuple, index: int, value) -> tuple:
  return items[:index] + (value,) + items[index + 1 :]
