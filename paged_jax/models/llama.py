"""A Llama-style decoder in Flax NNX with pluggable KV-cache backends.

RMSNorm pre-normalisation, RoPE on absolute positions, grouped-query
attention and a SwiGLU MLP. One forward, three uses:

* training: `model(tokens)`, full causal self-attention, no cache;
* dense cache: `model(tokens, positions, cache=DenseCache)` for prefill
  (many tokens per sequence) and decode (one token per sequence);
* paged cache: the same call with a paged backend (see `cache.py`).

Positions are explicit so that new tokens after a cached prefix are rotated
and masked by where they really are; -1 marks padding of ragged batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from paged_jax.models import layers
from paged_jax.models.cache import DenseCache, KVCacheBackend

_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Static shape of a Llama decoder; frozen and hashable.

  Attributes:
    vocab_size: number of token ids.
    num_layers: decoder blocks.
    num_q_heads: query heads per layer.
    num_kv_heads: key/value heads per layer; divides `num_q_heads` (GQA).
    head_dim: features per head (even, for RoPE).
    hidden: width of the residual stream.
    mlp_hidden: inner width of the SwiGLU MLP.
    rope_theta: RoPE base.
    max_seq_len: longest sequence the model is meant for (dense caches default
      to it).
    dtype: computation dtype name ("float32", "bfloat16" or "float16"); a
      dtype object is accepted and stored by name. Parameters stay float32.
    tie_embeddings: whether the output projection reuses the token embedding.
    norm_eps: RMSNorm epsilon.
  """

  vocab_size: int
  num_layers: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  hidden: int
  mlp_hidden: int
  rope_theta: float = 10000.0
  max_seq_len: int = 1024
  dtype: str = "float32"
  tie_embeddings: bool = True
  norm_eps: float = 1e-5

  def __post_init__(self):
    for name in ("vocab_size", "num_layers", "num_q_heads", "num_kv_heads",
                 "head_dim", "hidden", "mlp_hidden", "max_seq_len"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.num_q_heads % self.num_kv_heads:
      raise ValueError(
          f"num_q_heads ({self.num_q_heads}) must be a multiple of "
          f"num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if not self.rope_theta > 1.0:
      raise ValueError(f"rope_theta must be > 1, got {self.rope_theta}")
    if not self.norm_eps > 0.0:
      raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
    if not isinstance(self.tie_embeddings, bool):
      raise ValueError(
          f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
    dtype_name = (self.dtype if isinstance(self.dtype, str)
                  else jnp.dtype(self.dtype).name)
    if dtype_name not in _DTYPES:
      raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
    object.__setattr__(self, "dtype", dtype_name)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def sm_scale(self) -> float:
    return self.head_dim ** -0.5

  def to_dict(self) -> dict[str, Any]:
    """The fields as a JSON-ready dict."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, fields: dict[str, Any]) -> LlamaConfig:
    """Builds a config from `to_dict` output.

    Raises:
      ValueError: if a field is unknown or a required one is missing.
    """
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(f"unknown LlamaConfig fields: {unknown}")
    required = {field.name for field in dataclasses.fields(cls)
                if field.default is dataclasses.MISSING}
    missing = sorted(required - set(fields))
    if missing:
      raise ValueError(f"missing LlamaConfig fields: {missing}")
    return cls(**fields)


def init_dense_cache(
    config: LlamaConfig, batch_size: int, max_len: int | None = None
) -> DenseCache:
  """An empty `DenseCache` shaped for `config`.

  Args:
    config: the model's configuration.
    batch_size: sequences in the batch.
    max_len: positions per sequence; defaults to `config.max_seq_len`.

  Returns:
    A zero-filled cache in the model's compute dtype.
  """
  return DenseCache.create(
      num_layers=config.num_layers, batch_size=batch_size,
      max_len=config.max_seq_len if max_len is None else max_len,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
      dtype=config.compute_dtype)


class RMSNorm(nnx.Module):
  """RMS normalisation with a learned gain."""

  def __init__(self, dim: int, *, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return layers.rms_norm(x, self.scale[...], self.eps)


def _linear(in_features: int, out_features: int, config: LlamaConfig,
            rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(in_features, out_features, use_bias=False,
                    dtype=config.compute_dtype, param_dtype=jnp.float32,
                    rngs=rngs)


class Attention(nnx.Module):
  """Grouped-query self-attention that stores K/V through a cache backend."""

  def __init__(self, config: LlamaConfig, layer_index: int, *, rngs: nnx.Rngs):
    self.config = config
    self.layer_index = layer_index
    q_width = config.num_q_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    self.q_proj = _linear(config.hidden, q_width, config, rngs)
    self.k_proj = _linear(config.hidden, kv_width, config, rngs)
    self.v_proj = _linear(config.hidden, kv_width, config, rngs)
    self.o_proj = _linear(q_width, config.hidden, config, rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, cache: KVCacheBackend | None
  ) -> tuple[jax.Array, KVCacheBackend | None]:
    """Attends from `x` `[batch, tokens, hidden]` at `positions`.

    Returns:
      `(out, cache)`: `[batch, tokens, hidden]` and the updated backend
      (`None` when attending over `x` alone).
    """
    config = self.config
    batch, tokens, _ = x.shape
    q_shape = (batch, tokens, config.num_q_heads, config.head_dim)
    kv_shape = (batch, tokens, config.num_kv_heads, config.head_dim)
    q = self.q_proj(x).reshape(q_shape)
    k = self.k_proj(x).reshape(kv_shape)
    v = self.v_proj(x).reshape(kv_shape)
    q = layers.apply_rope(q, positions, config.rope_theta)
    k = layers.apply_rope(k, positions, config.rope_theta)
    if cache is None:
      out = layers.masked_attention(q, k, v, positions, positions,
                                    sm_scale=config.sm_scale)
    else:
      out, cache = cache.attend(self.layer_index, q, k, v, positions,
                                sm_scale=config.sm_scale)
    return self.o_proj(out.reshape(batch, tokens, -1)), cache


class SwiGLU(nnx.Module):
  """Gated MLP: `down(silu(gate(x)) * up(x))`."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.gate_proj = _linear(config.hidden, config.mlp_hidden, config, rngs)
    self.up_proj = _linear(config.hidden, config.mlp_hidden, config, rngs)
    self.down_proj = _linear(config.mlp_hidden, config.hidden, config, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nnx.Module):
  """Pre-norm residual block: attention, then MLP."""

  def __init__(self, config: LlamaConfig, layer_index: int, *, rngs: nnx.Rngs):
    self.attention_norm = RMSNorm(config.hidden, eps=config.norm_eps)
    self.attention = Attention(config, layer_index, rngs=rngs)
    self.mlp_norm = RMSNorm(config.hidden, eps=config.norm_eps)
    self.mlp = SwiGLU(config, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, cache: KVCacheBackend | None
  ) -> tuple[jax.Array, KVCacheBackend | None]:
    attended, cache = self.attention(self.attention_norm(x), positions, cache)
    x = x + attended
    return x + self.mlp(self.mlp_norm(x)), cache


class Llama(nnx.Module):
  """Llama-style decoder-only language model."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(config.vocab_size, config.hidden,
                           dtype=config.compute_dtype, param_dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(0.02),
                           rngs=rngs)
    self.blocks = nnx.List(
        [DecoderBlock(config, i, rngs=rngs) for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config.hidden, eps=config.norm_eps)
    self.lm_head = (None if config.tie_embeddings else
                    _linear(config.hidden, config.vocab_size, config, rngs))

  def __call__(
      self,
      tokens: jax.Array,
      positions: jax.Array | None = None,
      cache: KVCacheBackend | None = None,
  ) -> tuple[jax.Array, KVCacheBackend | None]:
    """Next-token logits for every input token.

    Args:
      tokens: int32 `[batch, tokens]`.
      positions: int32 `[batch, tokens]` absolute positions, -1 for padding;
        defaults to `0 .. tokens - 1` in every row.
      cache: a KV-cache backend holding each sequence's earlier tokens, or
        `None` to attend within `tokens` only (training, scoring).

    Returns:
      `(logits, cache)`: float32 `[batch, tokens, vocab_size]` and the backend
      with this call's keys and values added (`None` without a cache).

    Raises:
      ValueError: if `tokens` is not a 2-D integer array or `positions` does
        not match its shape.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
          f"tokens must be an int array [batch, tokens], got {tokens.dtype}"
          f"{list(tokens.shape)}")
    if positions is None:
      positions = jnp.broadcast_to(
          jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    positions = jnp.asarray(positions)
    if positions.shape != tokens.shape:
      raise ValueError(
          f"positions shape {positions.shape} must equal tokens shape "
          f"{tokens.shape}")
    positions = positions.astype(jnp.int32)
    x = self.embed(tokens)
    for block in self.blocks:
      x, cache = block(x, positions, cache)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32), cache
