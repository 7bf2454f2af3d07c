"""What the engine needs from a model, written down and checked."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx

CONFIG_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "max_seq_len", "dtype")


class ModelConfig(Protocol):
  """The static shape the engine reads from `model.config`.

  Attributes:
    num_layers: attention layers; the KV cache holds one page array per layer.
    num_kv_heads: key/value heads per layer.
    head_dim: features per head.
    vocab_size: token ids are `0 .. vocab_size - 1`.
    max_seq_len: positions the model serves; no sequence runs past them.
    dtype: compute dtype (name or dtype); the KV cache's unless overridden.
  """

  num_layers: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  max_seq_len: int
  dtype: Any


@runtime_checkable
class ModelProtocol(Protocol):
  """A model the engine can serve: an `nnx.Module` with a `config` and

  `model(tokens, positions, cache) -> (logits, cache)`, where `tokens` and
  `positions` are int32 `[batch, tokens]` (position -1 is padding),
  `logits` is float `[batch, tokens, vocab_size]`, and `cache` is a
  `paged_jax.models.KVCacheBackend` (the engine passes a `PagedCache`) that
  every attention layer `l` calls as `cache.attend(l, q, k, v, positions,
  sm_scale=...)`, returning the cache it gets back.

  A model may also split its call in two, `model.hidden_states(tokens,
  positions, cache) -> (hidden, cache)` and `model.logits(hidden) ->
  logits` (`hidden` float `[batch, tokens, features]`); then prefill
  computes the output layer only at the positions it samples from (and at
  every position only when a request asks for prompt log-probabilities).

  On a cache with a `sliding_window`, `model.config.layer_window(l)` must
  give each layer's window (None: global attention), and every layer must
  pass it to `cache.attend` as `sliding_window=`.
  """

  config: ModelConfig

  def __call__(
    self, tokens: jax.Array, positions: jax.Array, cache: Any
  ) -> tuple[jax.Array, Any]: ...


def check_model(model) -> None:
  """Checks that `model` follows `ModelProtocol`.

  Raises:
    TypeError: if `model` is not a callable `nnx.Module` with a `config`.
    ValueError: if a config field is missing or not a positive int (`dtype`:
      not a dtype).
  """
  if not isinstance(model, nnx.Module) or not callable(model):
    raise TypeError(f"model must be a callable flax.nnx.Module, got {type(model).__name__}")
  config = getattr(model, "config", None)
  if config is None:
    raise TypeError(
      f"{type(model).__name__} has no `config`; the engine reads {', '.join(CONFIG_FIELDS)} from it"
    )
  missing = [name for name in CONFIG_FIELDS if not hasattr(config, name)]
  if missing:
    raise ValueError(
      f"model.config lacks {', '.join(missing)} (the engine needs {', '.join(CONFIG_FIELDS)})"
    )
  for name in CONFIG_FIELDS[:-1]:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"model.config.{name} must be a positive int, got {value!r}")
  try:
    jnp.dtype(config.dtype)
  except TypeError as err:
    raise ValueError(f"model.config.dtype must be a dtype, got {config.dtype!r}") from err
