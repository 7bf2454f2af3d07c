"""KV-cache backends of the Llama attention layer.

The attention layer projects and rotates queries, keys and values, then hands
them to a backend's `attend`, which stores the new keys and values, attends
over everything the sequence has cached so far, and returns the output with
the updated backend. A backend is a pytree, so it goes into and comes out of
`jax.jit` like any other argument; nothing is mutated in place.

`DenseCache` (here) keeps one contiguous `[batch, max_len, kv_heads, head_dim]`
buffer per layer. The paged backend adapts `paged_jax.kv_cache.write_kv` and
`paged_jax.attention.paged_attention` to the same interface.
"""

from __future__ import annotations

from typing import Protocol

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax.models import layers


class KVCacheBackend(Protocol):
  """What the attention layer needs from a KV cache."""

  def attend(
    self,
    layer: int,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float,
  ) -> tuple[jax.Array, KVCacheBackend]:
    """Stores `layer`'s new keys and values, then attends over the context.

    A backend also takes `sliding_window` (the keys each query of this layer
    sees) and `soft_cap` (Gemma 2's attention logit cap) when the layer has
    them; the model passes neither otherwise. `DenseCache` serves both, and
    `PagedCache` serves them as its docstring says.

    Args:
      layer: static index of the decoder layer.
      q: rotated queries `[batch, tokens, num_q_heads, head_dim]`.
      k: rotated keys `[batch, tokens, num_kv_heads, head_dim]`.
      v: values, same shape as `k`.
      positions: int32 `[batch, tokens]` absolute positions of the new tokens,
        -1 for padding. A row's new tokens follow its cached prefix directly.
      sm_scale: multiplier of the query-key dot products.

    Returns:
      `(out, backend)`: attention output shaped like `q` (zero for padding
      tokens) and the backend holding the new keys and values.
    """
    ...


@flax.struct.dataclass
class DenseCache:
  """Contiguous per-sequence KV cache: row `b` holds sequence `b`'s positions.

  Attributes:
    k: one array per layer, `[batch, max_len, num_kv_heads, head_dim]`.
    v: same as `k`.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]

  @classmethod
  def create(
    cls,
    *,
    num_layers: int,
    batch_size: int,
    max_len: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype = jnp.float32,
  ) -> DenseCache:
    """Allocates an empty cache.

    Args:
      num_layers: decoder layers.
      batch_size: sequences, one row each.
      max_len: positions per sequence.
      num_kv_heads: key/value heads per layer.
      head_dim: features per head.
      dtype: storage dtype of keys and values.

    Returns:
      A zero-filled `DenseCache`.

    Raises:
      ValueError: if a size is not a positive int.
    """
    sizes = dict(
      num_layers=num_layers,
      batch_size=batch_size,
      max_len=max_len,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
    )
    for name, value in sizes.items():
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    shape = (batch_size, max_len, num_kv_heads, head_dim)
    zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
    return cls(k=zeros, v=zeros)

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def max_len(self) -> int:
    return self.k[0].shape[1]

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
  ) -> tuple[jax.Array, DenseCache]:
    """See `KVCacheBackend.attend`; `sliding_window` and `soft_cap` as in
    `masked_attention`.

    Tokens at positions outside `0 .. max_len - 1` are not stored. A query at
    position `p` reads cache positions `0 .. p`, which the caller must have
    filled (earlier calls or this one).

    Raises:
      ValueError: if `layer` is out of range or the shapes of `k`/`v` do not
        match the cache.
    """
    if not 0 <= layer < self.num_layers:
      raise ValueError(f"layer {layer} out of range for a cache of {self.num_layers} layers")
    cache_k, cache_v = self.k[layer], self.v[layer]
    batch, _, num_kv_heads, head_dim = cache_k.shape
    if k.shape[0] != batch or k.shape[2:] != (num_kv_heads, head_dim):
      raise ValueError(
        f"keys of shape {k.shape} do not fit a cache of batch {batch}, "
        f"{num_kv_heads} kv heads and head_dim {head_dim}"
      )
    rows = jnp.arange(batch)[:, None]
    columns = jnp.where(positions >= 0, positions, self.max_len)
    cache_k = cache_k.at[rows, columns].set(k.astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[rows, columns].set(v.astype(cache_v.dtype), mode="drop")
    cache_positions = jnp.broadcast_to(
      jnp.arange(self.max_len, dtype=jnp.int32), (batch, self.max_len)
    )
    out = layers.masked_attention(
      q,
      cache_k.astype(q.dtype),
      cache_v.astype(q.dtype),
      positions,
      cache_positions,
      sm_scale=sm_scale,
      sliding_window=sliding_window,
      soft_cap=soft_cap,
    )
    new_cache = self.replace(
      k=_replace_at(self.k, layer, cache_k), v=_replace_at(self.v, layer, cache_v)
    )
    return out, new_cache


def _replace_at(items: tuple, index: int, value) -> tuple:
  return items[:index] + (value,) + items[index + 1 :]
