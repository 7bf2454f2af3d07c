"""The paged KV-cache backend of the decoder's attention layers.

`PagedCache` adapts `paged_jax.write_kv` and the paged attention kernels to
the `KVCacheBackend` interface: each layer scatters its new keys and values
into the slots the block manager planned, then attends over the sequence's
pages through its block table. With a quantized `KVCache` (int8 or fp8
pages) `write_kv` quantizes the new rows and attention reads the layer's
scales with its pages.

Sliding windows, first step: on a `CacheConfig` without a window every
block is kept and a layer with a window masks its attention to it (the
kernels' `sliding_window`), so windowed and hybrid models (Mistral, Qwen2's
`max_window_layers`, Gemma 2 and 3) run with prefix caching and every other
feature. A `CacheConfig` with a window of `W` frees the blocks that leave
it; that cache serves layers whose windows are at most `W`, and a sequence
appends at most `W - w + 1` tokens per call (`window_chunk`), so that no
query reads a freed block (see `PagedCache.attend`).
On a hybrid cache (`paged_jax.hybrid_kv`, one block table per attention
type) `HybridPagedCache` runs each layer as a `PagedCache` on its type's
pages, tables and slots, whose manager window is that type's.

On a cache split over a mesh (`KVCache.create(..., mesh=mesh)`),
`ShardedPagedCache` runs the same writes and attention on every device, on
its data shard's rows and blocks and its model shard's heads;
`paged_cache` picks the backend for a cache.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax import sharding
from paged_jax.attention import paged_attention, paged_prefill_attention
from paged_jax.hybrid_kv import HybridKVCache
from paged_jax.kv_cache import KVCache, write_kv


@flax.struct.dataclass
class PagedCache:
  """A `KVCache` with the block tables and slots of one model call.

  Attributes:
    kv: the pages of every layer.
    block_tables: int32 `[batch, max_blocks_per_seq]`, -1 where no block:
      one table per row of the call, or with `query_tiles` per tile.
    slot_mapping: int32 `[batch, tokens]`, the cache slot of each new token,
      -1 for padding.
    cache_sliding_window: the `CacheConfig`'s `sliding_window` (static): the
      manager frees the blocks that leave it. None: every block is kept.
    query_tiles: None (each row of the call is one sequence's tokens), or
      for a packed call (each row holds several sequences' tokens, one after
      another: prefill packs a data shard's prompt chunks so that the
      model's matmuls run no padding), int32 `[tiles, width]`: the tokens
      of each attention tile, as indices into its row's tokens (-1:
      padding). A tile holds consecutive tokens of one sequence, the
      sequence of `block_tables[tile]`; tiles are grouped by row, `tiles /
      batch` each.
    decode_tables: None, or for a ragged packed call (prompt chunks and
      decode tokens in one call), int32 `[batch * n, max_blocks_per_seq]`:
      up to `n` tokens of each row are one-token queries, each of its own
      sequence (whose table this is), attended by the decode kernel.
    decode_tokens: with `decode_tables`, int32 `[batch, n]`: where those
      queries sit, as indices into their row's tokens (the row's length:
      no query). No tile indexes them.
  """

  kv: KVCache
  block_tables: jax.Array
  slot_mapping: jax.Array
  cache_sliding_window: int | None = flax.struct.field(pytree_node=False, default=None)
  query_tiles: jax.Array | None = None
  decode_tables: jax.Array | None = None
  decode_tokens: jax.Array | None = None

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
    soft_cap: float | None = None,
  ) -> tuple[jax.Array, PagedCache]:
    """See `KVCacheBackend.attend`.

    A row's new tokens come first, padding (position -1) after them. One
    token per row runs the decode kernel, more run prefill attention over the
    cached pages and the new tokens; a packed call (`query_tiles`) runs
    prefill attention tile by tile, and with `decode_tables` the decode
    kernel on the row's `decode_tokens`. `sliding_window` masks this layer's
    attention to its last keys and `soft_cap` caps its logits.

    On a cache whose `CacheConfig` frees blocks outside a window of `W`
    (`cache_sliding_window`), a layer's window `w` must be at most `W`, and
    each sequence's tokens of the call must come from one `append_slots` of
    at most `W - w + 1` tokens (`window_chunk`): the manager then still
    holds every key the call's first token sees.

    Raises:
      ValueError: if `slot_mapping` does not match the tokens of `k`; on a
        cache that frees blocks outside its window, for a layer whose window
        is None or wider than the cache's, or rows (a packed call's tiles)
        of more than `W - w + 1` tokens.
    """
    tiles = self.query_tiles
    self._check_window(layer, sliding_window, call_tokens=k.shape[1])
    if self.slot_mapping.shape != k.shape[:2]:
      raise ValueError(
        f"slot_mapping shape {self.slot_mapping.shape} must be [batch, tokens] = {k.shape[:2]}"
      )
    kv = write_kv(self.kv, layer, k, v, self.slot_mapping)
    k_pages, v_pages = kv.pages(layer)
    options = dict(
      sm_scale=sm_scale, soft_cap=soft_cap, sliding_window=sliding_window, **kv.scales(layer)
    )
    if tiles is not None:
      out = _attend_tiles(q, k_pages, v_pages, self.block_tables, positions, tiles, options)
      if self.decode_tables is not None:
        out = _attend_decode_tokens(
          out, q, k_pages, v_pages, self.decode_tables, self.decode_tokens, positions, options
        )
    elif positions.shape[1] == 1:
      lengths = (jnp.max(positions, axis=1) + 1).astype(jnp.int32)
      out = paged_attention(q[:, 0], k_pages, v_pages, self.block_tables, lengths, **options)[
        :, None
      ]
    else:
      out = _prefill_attention(q, k_pages, v_pages, self.block_tables, positions, options)
    return out, self.replace(kv=kv)

  def _check_window(self, layer: int, sliding_window: int | None, *, call_tokens: int) -> None:
    """Checks a sequence's tokens per call: a row's, or a packed call's tile's."""
    cache_window = self.cache_sliding_window
    if cache_window is None:
      return
    tokens = call_tokens if self.query_tiles is None else self.query_tiles.shape[1]
    most = window_chunk(cache_window, {layer: sliding_window})
    if tokens > most:
      raise ValueError(
        f"rows of {tokens} tokens, but on a cache that frees the blocks outside a window of "
        f"{cache_window} tokens layer {layer} (window {sliding_window}) takes at most {most} "
        f"tokens per sequence and call: earlier ones would read freed blocks"
      )


def _prefill_attention(q, k_pages, v_pages, block_tables, positions, options) -> jax.Array:
  """Prefill attention of rows whose tokens sit at `positions` (-1 after)."""
  lengths = (jnp.max(positions, axis=1) + 1).astype(jnp.int32)
  query_lens = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
  return paged_prefill_attention(q, k_pages, v_pages, block_tables, lengths, query_lens, **options)


def _attend_tiles(q, k_pages, v_pages, tile_tables, positions, tiles, options) -> jax.Array:
  """Prefill attention of a packed call: the queries `q` `[rows, tokens,
  ...]` gathered into their `tiles` (see `PagedCache.query_tiles`),
  attended with the tiles' tables, and put back in token order (zeros for
  tokens in no tile)."""
  flat = tile_token_index(tiles, *positions.shape)
  tile_positions = take_tiles(positions, flat, -1)
  queries = take_tiles(q, flat)
  out = _prefill_attention(queries, k_pages, v_pages, tile_tables, tile_positions, options)
  return untile(out, flat, positions.shape)


def _attend_decode_tokens(
  out, q, k_pages, v_pages, decode_tables, decode_tokens, positions, options
):
  """`out` with each row's `decode_tokens` (see `PagedCache`) replaced by
  their decode attention, each query to its own sequence (an index past
  the row, or a token at position -1: no query, a zero output)."""
  rows, tokens = q.shape[:2]
  flat = (jnp.arange(rows)[:, None] * tokens + decode_tokens).ravel()
  valid = decode_tokens.ravel() < tokens
  flat = jnp.where(valid, flat, rows * tokens)
  taken = jnp.minimum(flat, rows * tokens - 1)  # a row's last token for no query
  queries = q.reshape(rows * tokens, *q.shape[2:])[taken]
  lengths = jnp.where(valid, positions.reshape(-1)[taken] + 1, 0).astype(jnp.int32)
  attended = paged_attention(queries, k_pages, v_pages, decode_tables, lengths, **options)
  out = out.reshape(rows * tokens, *out.shape[2:])
  out = out.at[flat].set(attended.astype(out.dtype), mode="drop")
  return out.reshape(rows, tokens, *out.shape[1:])


def tile_token_index(tiles: jax.Array, rows: int, tokens: int) -> jax.Array:
  """Each cell of a packed call's `tiles` (see `PagedCache.query_tiles`) as
  an index into the call's `rows * tokens` tokens, flattened; `rows *
  tokens` (past the end) for padding."""
  row_of_tile = jnp.arange(tiles.shape[0]) // (tiles.shape[0] // rows)
  return jnp.where(tiles >= 0, row_of_tile[:, None] * tokens + tiles, rows * tokens)


def take_tiles(x: jax.Array, flat: jax.Array, fill=0) -> jax.Array:
  """`x` `[rows, tokens, ...]` gathered into tiles `[tiles, width, ...]` by
  `flat` (`tile_token_index`), `fill` in the padding."""
  values = x.reshape(-1, *x.shape[2:])
  taken = values[jnp.minimum(flat, values.shape[0] - 1)]
  valid = (flat < values.shape[0]).reshape(*flat.shape, *(1,) * (x.ndim - 2))
  return jnp.where(valid, taken, fill)


def untile(x: jax.Array, flat: jax.Array, shape, fill=0) -> jax.Array:
  """Tiles `[tiles, width, ...]` back in token order `[*shape, ...]` (the
  inverse of `take_tiles`; `fill` for tokens in no tile)."""
  rest = x.shape[2:]
  packed = jnp.full((shape[0] * shape[1], *rest), fill, x.dtype)
  packed = packed.at[flat.ravel()].set(x.reshape(-1, *rest), mode="drop")
  return packed.reshape(*shape, *rest)


def window_chunk(cache_window: int, layer_windows: dict[int, int | None]) -> int:
  """The most tokens a sequence may append per call on a cache that frees
  the blocks outside a window of `cache_window` tokens: `W - w + 1` for the
  widest window `w` of `layer_windows` (layer -> window, None for global
  attention), so that the call's first token still finds its whole window.

  Raises:
    ValueError: naming the first layer that attends to the whole context or
      to a window wider than the cache's.
  """
  for layer, window in layer_windows.items():
    if window is None or window > cache_window:
      seen = "the whole context" if window is None else f"a window of {window}"
      raise ValueError(
        f"layer {layer} attends to {seen}, but this cache frees the blocks outside a window "
        f"of {cache_window} tokens; use a CacheConfig without sliding_window (every block "
        f"kept, each layer masks its own window) or one whose window is at least the model's"
      )
  return cache_window - max(layer_windows.values()) + 1


@flax.struct.dataclass
class ShardedPagedCache(PagedCache):
  """`PagedCache` whose writes and attention run per device: rows and
  blocks of a data shard, heads of a model shard."""

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
    soft_cap: float | None = None,
  ) -> tuple[jax.Array, ShardedPagedCache]:
    """See `PagedCache.attend`; rows split over "data" (grouped by shard,
    tables in the shard's block ids), heads over "model".

    Raises:
      ValueError: as `PagedCache.attend` does, or if the query heads (of
        `q`) or the KV heads (of `k`) do not split over the model axis.
    """
    tiles = self.query_tiles
    self._check_window(layer, sliding_window, call_tokens=k.shape[1])
    mesh = self.kv.mesh
    sharding.check_heads(q.shape[2], k.shape[2], mesh.shape["model"])
    repeat = self.kv.num_kv_heads // k.shape[2]
    if repeat > 1:
      k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    heads = sharding.P("data", None, "model", None)
    rows = sharding.P("data")
    device = self.kv.device_part()
    pages = jax.tree.map(lambda _: sharding.PAGES, device)

    def local(kv, tables, slot_mapping, q, k, v, positions, tiles, decode_tables, decode_tokens):
      cache = PagedCache(
        kv=kv,
        block_tables=tables,
        slot_mapping=slot_mapping,
        cache_sliding_window=self.cache_sliding_window,
        query_tiles=tiles,
        decode_tables=decode_tables,
        decode_tokens=decode_tokens,
      )
      out, cache = cache.attend(
        layer,
        q,
        k,
        v,
        positions,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
      )
      return out, cache.kv

    out, written = sharding.per_device(
      local, mesh, (pages, rows, rows, heads, heads, heads, rows, rows, rows, rows), (heads, pages)
    )(
      device,
      self.block_tables,
      self.slot_mapping,
      q,
      k,
      v,
      positions,
      tiles,
      self.decode_tables,
      self.decode_tokens,
    )
    return out, self.replace(kv=self.kv.with_device_part(written))


@flax.struct.dataclass
class HybridPagedCache:
  """The backend of one model call on a hybrid cache (one block table per
  attention type, `paged_jax.hybrid_kv`): `block_tables`, `slot_mapping`
  and `decode_tables` hold one entry per type, as `PagedCache`'s fields;
  a layer attends as a `PagedCache` on its type's pages and entries, whose
  manager window is the type's (`HybridKVCache.cfg.windows`); the tiles and
  `decode_tokens` are every type's."""

  kv: HybridKVCache
  block_tables: tuple
  slot_mapping: tuple
  query_tiles: jax.Array | None = None
  decode_tables: tuple | None = None
  decode_tokens: jax.Array | None = None

  def attend(self, layer: int, q, k, v, positions, **options) -> tuple[jax.Array, HybridPagedCache]:
    """See `PagedCache.attend`: layer `layer` on its type's pages and tables."""
    group, index = self.kv.locate(layer)
    one = PagedCache(
      kv=self.kv.types[group],
      block_tables=self.block_tables[group],
      slot_mapping=self.slot_mapping[group],
      cache_sliding_window=self.kv.cfg.windows[group],
      query_tiles=self.query_tiles,
      decode_tables=None if self.decode_tables is None else self.decode_tables[group],
      decode_tokens=self.decode_tokens,
    )
    out, one = one.attend(index, q, k, v, positions, **options)
    types = self.kv.types[:group] + (one.kv,) + self.kv.types[group + 1 :]
    return out, self.replace(kv=self.kv.replace(types=types))


def paged_cache(
  kv,
  block_tables,
  slot_mapping,
  cache_sliding_window=None,
  query_tiles=None,
  decode_tables=None,
  decode_tokens=None,
) -> PagedCache | HybridPagedCache:
  """The paged backend of one model call: per device when `kv` is on a mesh
  (rows grouped by data shard, `rows / data` each; so are a packed call's
  tiles and decode tables); `cache_sliding_window` is the `CacheConfig`'s
  window, `query_tiles` a packed call's tiles, `decode_tables` and
  `decode_tokens` a ragged call's (see `PagedCache`). On a `HybridKVCache` (one device), a
  `HybridPagedCache`: tables, slots and decode tables hold one entry per
  type, and each type's window is its own."""
  if isinstance(kv, HybridKVCache):
    return HybridPagedCache(
      kv=kv,
      block_tables=tuple(block_tables),
      slot_mapping=tuple(slot_mapping),
      query_tiles=query_tiles,
      decode_tables=None if decode_tables is None else tuple(decode_tables),
      decode_tokens=decode_tokens,
    )
  cls = PagedCache if kv.mesh is None else ShardedPagedCache
  return cls(
    kv=kv,
    block_tables=block_tables,
    slot_mapping=slot_mapping,
    cache_sliding_window=cache_sliding_window,
    query_tiles=query_tiles,
    decode_tables=decode_tables,
    decode_tokens=decode_tokens,
  )
