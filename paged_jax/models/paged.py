"""The paged KV-cache backend of the Llama attention layer.

`PagedCache` adapts `paged_jax.write_kv` and the paged attention kernels to
the `KVCacheBackend` interface: each layer scatters its new keys and values
into the slots the block manager planned, then attends over the sequence's
pages through its block table. With a quantized `KVCache` (int8 or fp8
pages) `write_kv` quantizes the new rows and attention reads the layer's
scales with its pages.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax.attention import paged_attention, paged_prefill_attention
from paged_jax.kv_cache import KVCache, write_kv


@flax.struct.dataclass
class PagedCache:
  """A `KVCache` with the block tables and slots of one model call.

  Attributes:
    kv: the pages of every layer.
    block_tables: int32 `[batch, max_blocks_per_seq]`, -1 where no block.
    slot_mapping: int32 `[batch, tokens]`, the cache slot of each new token,
      -1 for padding.
  """

  kv: KVCache
  block_tables: jax.Array
  slot_mapping: jax.Array

  def attend(
    self,
    layer: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
  ) -> tuple[jax.Array, PagedCache]:
    """See `KVCacheBackend.attend`.

    A row's new tokens come first, padding (position -1) after them. One
    token per row runs the decode kernel, more run prefill attention over the
    cached pages and the new tokens.

    Raises:
      ValueError: if `slot_mapping` does not match the tokens of `k`, or for
        a sliding-window model: prefill here reads the prompt's keys from the
        pages, and the manager drops the blocks that left the window.
    """
    if sliding_window is not None:
      raise ValueError(
        f"PagedCache does not serve sliding-window models yet (window "
        f"{sliding_window}): their prefill would read blocks the manager "
        f"dropped; use DenseCache"
      )
    if self.slot_mapping.shape != k.shape[:2]:
      raise ValueError(
        f"slot_mapping shape {self.slot_mapping.shape} must be [batch, tokens] = {k.shape[:2]}"
      )
    kv = write_kv(self.kv, layer, k, v, self.slot_mapping)
    lengths = (jnp.max(positions, axis=1) + 1).astype(jnp.int32)
    k_pages, v_pages = kv.k[layer], kv.v[layer]
    scales = kv.scales(layer)
    if positions.shape[1] == 1:
      out = paged_attention(
        q[:, 0], k_pages, v_pages, self.block_tables, lengths, sm_scale=sm_scale, **scales
      )[:, None]
    else:
      query_lens = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
      out = paged_prefill_attention(
        q, k_pages, v_pages, self.block_tables, lengths, query_lens, sm_scale=sm_scale, **scales
      )
    return out, self.replace(kv=kv)
