"""A Llama-style decoder in Flax NNX with pluggable KV-cache backends.

RMSNorm pre-normalisation, RoPE on absolute positions, grouped-query
attention and a SwiGLU MLP, with the variations of the Llama 2/3, Mistral,
Qwen2 and Qwen3 families as config fields (Llama 3 RoPE scaling, a sliding
window, q/k/v biases, per-head q/k RMSNorm). One forward, three uses:

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

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax.models import layers
from paged_jax.models.cache import DenseCache, KVCacheBackend
from paged_jax.models.layers import Llama3RopeScaling

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
      dtype object is accepted and stored by name.
    tie_embeddings: whether the output projection reuses the token embedding.
    norm_eps: RMSNorm epsilon.
    param_dtype: dtype name of the parameters (same choices as `dtype`).
    attention_bias: whether the q/k/v projections have biases (Qwen2).
    qk_norm: whether queries and keys get a per-head RMSNorm before RoPE
      (Qwen3).
    rope_scaling: Llama 3 RoPE frequency scaling, or None.
    sliding_window: keys each query attends to (itself included), or None for
      the whole context (Mistral). A paged `CacheConfig` takes the same
      value, so blocks that slide out of the window are freed.
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
  param_dtype: str = "float32"
  attention_bias: bool = False
  qk_norm: bool = False
  rope_scaling: Llama3RopeScaling | None = None
  sliding_window: int | None = None

  def __post_init__(self):
    for name in (
      "vocab_size",
      "num_layers",
      "num_q_heads",
      "num_kv_heads",
      "head_dim",
      "hidden",
      "mlp_hidden",
      "max_seq_len",
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if self.num_q_heads % self.num_kv_heads:
      raise ValueError(
        f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
      )
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if not self.rope_theta > 1.0:
      raise ValueError(f"rope_theta must be > 1, got {self.rope_theta}")
    if not self.norm_eps > 0.0:
      raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
    for name in ("tie_embeddings", "attention_bias", "qk_norm"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    window = self.sliding_window
    if window is not None and (
      isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
      raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", Llama3RopeScaling(**self.rope_scaling))
    if not isinstance(self.rope_scaling, (Llama3RopeScaling, type(None))):
      raise ValueError(
        f"rope_scaling must be a Llama3RopeScaling or None, got {self.rope_scaling!r}"
      )
    for name in ("dtype", "param_dtype"):
      value = getattr(self, name)
      dtype_name = value if isinstance(value, str) else jnp.dtype(value).name
      if dtype_name not in _DTYPES:
        raise ValueError(f"{name} must be one of {_DTYPES}, got {value!r}")
      object.__setattr__(self, name, dtype_name)

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def parameter_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @property
  def sm_scale(self) -> float:
    return self.head_dim**-0.5

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
    required = {
      field.name for field in dataclasses.fields(cls) if field.default is dataclasses.MISSING
    }
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
    num_layers=config.num_layers,
    batch_size=batch_size,
    max_len=config.max_seq_len if max_len is None else max_len,
    num_kv_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    dtype=config.compute_dtype,
  )


class RMSNorm(nnx.Module):
  """RMS normalisation with a learned gain."""

  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return layers.rms_norm(x, self.scale[...], self.eps)


def _linear(
  in_features: int,
  out_features: int,
  config: LlamaConfig,
  rngs: nnx.Rngs,
  *,
  use_bias: bool = False,
) -> nnx.Linear:
  return nnx.Linear(
    in_features,
    out_features,
    use_bias=use_bias,
    dtype=config.compute_dtype,
    param_dtype=config.parameter_dtype,
    rngs=rngs,
  )


def _norm(dim: int, config: LlamaConfig) -> RMSNorm:
  return RMSNorm(dim, eps=config.norm_eps, param_dtype=config.parameter_dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention that stores K/V through a cache backend."""

  def __init__(self, config: LlamaConfig, layer_index: int, *, rngs: nnx.Rngs):
    self.config = config
    self.layer_index = layer_index
    q_width = config.num_q_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    bias = config.attention_bias
    self.q_proj = _linear(config.hidden, q_width, config, rngs, use_bias=bias)
    self.k_proj = _linear(config.hidden, kv_width, config, rngs, use_bias=bias)
    self.v_proj = _linear(config.hidden, kv_width, config, rngs, use_bias=bias)
    self.o_proj = _linear(q_width, config.hidden, config, rngs)
    self.q_norm = _norm(config.head_dim, config) if config.qk_norm else None
    self.k_norm = _norm(config.head_dim, config) if config.qk_norm else None

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
    if config.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = layers.apply_rope(q, positions, config.rope_theta, config.rope_scaling)
    k = layers.apply_rope(k, positions, config.rope_theta, config.rope_scaling)
    window = {} if config.sliding_window is None else {"sliding_window": config.sliding_window}
    if cache is None:
      out = layers.masked_attention(
        q, k, v, positions, positions, sm_scale=config.sm_scale, **window
      )
    else:
      out, cache = cache.attend(
        self.layer_index, q, k, v, positions, sm_scale=config.sm_scale, **window
      )
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
    self.attention_norm = _norm(config.hidden, config)
    self.attention = Attention(config, layer_index, rngs=rngs)
    self.mlp_norm = _norm(config.hidden, config)
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
    self.embed = nnx.Embed(
      config.vocab_size,
      config.hidden,
      dtype=config.compute_dtype,
      param_dtype=config.parameter_dtype,
      embedding_init=nnx.initializers.normal(0.02),
      rngs=rngs,
    )
    self.blocks = nnx.List([DecoderBlock(config, i, rngs=rngs) for i in range(config.num_layers)])
    self.final_norm = _norm(config.hidden, config)
    self.lm_head = (
      None if config.tie_embeddings else _linear(config.hidden, config.vocab_size, config, rngs)
    )

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
        f"tokens must be an int array [batch, tokens], got {tokens.dtype}{list(tokens.shape)}"
      )
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    positions = jnp.asarray(positions)
    if positions.shape != tokens.shape:
      raise ValueError(f"positions shape {positions.shape} must equal tokens shape {tokens.shape}")
    positions = positions.astype(jnp.int32)
    x = self.embed(tokens)
    for block in self.blocks:
      x, cache = block(x, positions, cache)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    return logits.astype(jnp.float32), cache
