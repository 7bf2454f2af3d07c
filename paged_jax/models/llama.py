"""A Llama-style decoder in Flax NNX with pluggable KV-cache backends.

RMSNorm pre-normalisation, RoPE on absolute positions, grouped-query
attention and a gated MLP, with the variations of the Llama 2/3, Mistral,
Qwen2, Qwen3, Gemma 2 and Gemma 3 families as config fields: Llama 3 and
linear RoPE scaling, sliding windows on all or some layers with their own
RoPE base, q/k/v biases, per-head q/k RMSNorm, Gemma's `1 + weight` norms,
norms after attention and MLP, GeGLU, the query scale, logit soft-caps and
scaled embeddings. One forward, three uses:

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
from paged_jax.models.layers import ACTIVATIONS, LinearRopeScaling, Llama3RopeScaling, RopeScaling
from paged_jax.models.quantized import QuantizedWeight

_DTYPES = ("float32", "bfloat16", "float16")
LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_SCALINGS = {"llama3": Llama3RopeScaling, "linear": LinearRopeScaling}


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
    mlp_hidden: inner width of the gated MLP.
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
    rope_scaling: RoPE frequency scaling (`Llama3RopeScaling` or
      `LinearRopeScaling`) of the full-attention layers, or None.
    sliding_window: keys each query of a sliding layer attends to (itself
      included), or None for the whole context on every layer. The paged
      cache serves it on a `CacheConfig` without a window (every block kept,
      attention masked); a `CacheConfig` with the same window frees the
      blocks that left it, see `PagedCache.attend`.
    layer_types: "full_attention" or "sliding_attention" for each layer
      (Gemma 2 and 3, Qwen2's `max_window_layers`), or None: every layer
      slides when `sliding_window` is set.
    local_rope_theta: RoPE base of the sliding layers, which then rotate
      without `rope_scaling` (Gemma 3's `rope_local_base_freq`); None: they
      rotate as the full layers do.
    norm_weight_offset: added to every RMSNorm gain (1.0 for Gemma, whose
      checkpoints store `gain - 1`).
    sandwich_norms: whether attention and MLP outputs are RMS-normalised
      before the residual add (Gemma 2 and 3: `post_attention_layernorm`,
      `post_feedforward_layernorm`).
    activation: gate activation of the MLP, "silu" (SwiGLU) or "gelu_tanh"
      (GeGLU with tanh-approximated GELU, Gemma).
    query_pre_attn_scalar: logits are scaled by its inverse square root
      (Gemma); None: by `head_dim ** -0.5`.
    attn_logit_softcap: attention logits become `c * tanh(logits / c)`
      (Gemma 2), or None.
    final_logit_softcap: the same for the output logits, or None.
    scale_embeddings: whether token embeddings are multiplied by
      `sqrt(hidden)`, rounded to the compute dtype (Gemma).
    output_bias: whether the attention output projection has a bias (Llama's
      `attention_bias`; Qwen2 has q/k/v biases only).
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
  rope_scaling: RopeScaling | None = None
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  local_rope_theta: float | None = None
  norm_weight_offset: float = 0.0
  sandwich_norms: bool = False
  activation: str = "silu"
  query_pre_attn_scalar: float | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  scale_embeddings: bool = False
  output_bias: bool = False

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
    for name in (
      "tie_embeddings",
      "attention_bias",
      "qk_norm",
      "sandwich_norms",
      "scale_embeddings",
      "output_bias",
    ):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
    window = self.sliding_window
    if window is not None and (
      isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
      raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
    self._check_layer_types()
    for name in (
      "local_rope_theta",
      "query_pre_attn_scalar",
      "attn_logit_softcap",
      "final_logit_softcap",
    ):
      value = getattr(self, name)
      if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a positive number or None, got {value!r}")
    if self.local_rope_theta is not None and not self.local_rope_theta > 1.0:
      raise ValueError(f"local_rope_theta must be > 1, got {self.local_rope_theta}")
    if self.norm_weight_offset not in (0.0, 1.0):
      raise ValueError(f"norm_weight_offset must be 0.0 or 1.0, got {self.norm_weight_offset!r}")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
    if isinstance(self.rope_scaling, dict):
      fields = dict(self.rope_scaling)
      kind = fields.pop("rope_type", "llama3")
      if kind not in _ROPE_SCALINGS:
        raise ValueError(f"rope_scaling rope_type must be one of {tuple(_ROPE_SCALINGS)}")
      object.__setattr__(self, "rope_scaling", _ROPE_SCALINGS[kind](**fields))
    if not isinstance(self.rope_scaling, (Llama3RopeScaling, LinearRopeScaling, type(None))):
      raise ValueError(
        "rope_scaling must be a Llama3RopeScaling, a LinearRopeScaling or None, "
        f"got {self.rope_scaling!r}"
      )
    for name in ("dtype", "param_dtype"):
      value = getattr(self, name)
      dtype_name = value if isinstance(value, str) else jnp.dtype(value).name
      if dtype_name not in _DTYPES:
        raise ValueError(f"{name} must be one of {_DTYPES}, got {value!r}")
      object.__setattr__(self, name, dtype_name)

  def _check_layer_types(self):
    if self.layer_types is None:
      return
    if not isinstance(self.layer_types, (tuple, list)) or len(self.layer_types) != self.num_layers:
      raise ValueError(
        f"layer_types must hold one entry per layer ({self.num_layers}), got {self.layer_types!r}"
      )
    unknown = sorted({kind for kind in self.layer_types if kind not in LAYER_TYPES})
    if unknown:
      raise ValueError(f"layer_types {unknown} are not supported (supported: {LAYER_TYPES})")
    if "sliding_attention" in self.layer_types and self.sliding_window is None:
      raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
    object.__setattr__(self, "layer_types", tuple(self.layer_types))

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def parameter_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @property
  def sm_scale(self) -> float:
    scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
    return float(scalar) ** -0.5

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of decoder layer `layer`, or None (full attention)."""
    if self.layer_types is not None and self.layer_types[layer] == "full_attention":
      return None
    return self.sliding_window

  def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
    """`(theta, scaling)` of decoder layer `layer`'s RoPE."""
    if self.local_rope_theta is not None and self.layer_window(layer) is not None:
      return self.local_rope_theta, None
    return self.rope_theta, self.rope_scaling

  def to_dict(self) -> dict[str, Any]:
    """The fields as a JSON-ready dict (`rope_scaling` tagged with its `rope_type`)."""
    fields = dataclasses.asdict(self)
    if self.rope_scaling is not None:
      kind = next(
        name for name, cls in _ROPE_SCALINGS.items() if isinstance(self.rope_scaling, cls)
      )
      fields["rope_scaling"] = {"rope_type": kind, **fields["rope_scaling"]}
    if self.layer_types is not None:
      fields["layer_types"] = list(self.layer_types)
    return fields

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
  """RMS normalisation with a learned gain (`offset + scale`)."""

  def __init__(self, dim: int, *, eps: float, offset: float = 0.0, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, param_dtype))
    self.eps = eps
    self.offset = offset

  def __call__(self, x: jax.Array) -> jax.Array:
    return layers.rms_norm(x, self.scale[...], self.eps, self.offset)


class Linear(nnx.Module):
  """`x @ kernel.T + bias` with the kernel stored `[out, in]`, as torch
  checkpoints store it (see `layers.dot_transposed` for why), accumulated
  in float32 and rounded once to `dtype`. The kernel is a float `nnx.Param`
  or a `quantized.QuantizedWeight` (int8 or int4, kept quantized)."""

  def __init__(
    self, in_features: int, out_features: int, *, use_bias: bool, dtype, param_dtype, rngs
  ):
    init = nnx.initializers.lecun_normal(in_axis=-1, out_axis=-2)
    self.kernel = nnx.Param(init(rngs.params(), (out_features, in_features), param_dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if use_bias else nnx.data(None)
    self.dtype = dtype

  def __call__(self, x: jax.Array) -> jax.Array:
    if isinstance(self.kernel, QuantizedWeight):
      y = self.kernel.matmul(x, self.dtype)
    else:
      y = layers.dot_transposed(x.astype(self.dtype), self.kernel[...].astype(self.dtype))
    y = y.astype(self.dtype)
    return y if self.bias is None else y + self.bias[...].astype(self.dtype)


def _linear(
  in_features: int,
  out_features: int,
  config: LlamaConfig,
  rngs: nnx.Rngs,
  *,
  use_bias: bool = False,
) -> Linear:
  return Linear(
    in_features,
    out_features,
    use_bias=use_bias,
    dtype=config.compute_dtype,
    param_dtype=config.parameter_dtype,
    rngs=rngs,
  )


def _norm(dim: int, config: LlamaConfig) -> RMSNorm:
  return RMSNorm(
    dim, eps=config.norm_eps, offset=config.norm_weight_offset, param_dtype=config.parameter_dtype
  )


class Attention(nnx.Module):
  """Grouped-query self-attention that stores K/V through a cache backend."""

  def __init__(self, config: LlamaConfig, layer_index: int, *, rngs: nnx.Rngs):
    self.config = config
    self.layer_index = layer_index
    self.rope_theta, self.rope_scaling = config.layer_rope(layer_index)
    self.sliding_window = config.layer_window(layer_index)
    q_width = config.num_q_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    bias = config.attention_bias
    self.q_proj = _linear(config.hidden, q_width, config, rngs, use_bias=bias)
    self.k_proj = _linear(config.hidden, kv_width, config, rngs, use_bias=bias)
    self.v_proj = _linear(config.hidden, kv_width, config, rngs, use_bias=bias)
    self.o_proj = _linear(q_width, config.hidden, config, rngs, use_bias=config.output_bias)
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
    q = layers.apply_rope(q, positions, self.rope_theta, self.rope_scaling)
    k = layers.apply_rope(k, positions, self.rope_theta, self.rope_scaling)
    # Only the options this layer has, so backends without them still serve it.
    options = {"sliding_window": self.sliding_window, "soft_cap": config.attn_logit_softcap}
    options = {name: value for name, value in options.items() if value is not None}
    if cache is None:
      out = layers.masked_attention(
        q, k, v, positions, positions, sm_scale=config.sm_scale, **options
      )
    else:
      out, cache = cache.attend(
        self.layer_index, q, k, v, positions, sm_scale=config.sm_scale, **options
      )
    return self.o_proj(out.reshape(batch, tokens, -1)), cache


class GatedMLP(nnx.Module):
  """Gated MLP: `down(act(gate(x)) * up(x))`, SwiGLU or GeGLU."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.activation = config.activation
    self.gate_proj = _linear(config.hidden, config.mlp_hidden, config, rngs)
    self.up_proj = _linear(config.hidden, config.mlp_hidden, config, rngs)
    self.down_proj = _linear(config.mlp_hidden, config.hidden, config, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(layers.activation(self.activation, self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nnx.Module):
  """Pre-norm residual block: attention, then MLP; with `sandwich_norms` each
  output is normalised again before its residual add (Gemma 2 and 3)."""

  def __init__(self, config: LlamaConfig, layer_index: int, *, rngs: nnx.Rngs):
    self.attention_norm = _norm(config.hidden, config)
    self.attention = Attention(config, layer_index, rngs=rngs)
    self.mlp_norm = _norm(config.hidden, config)
    self.mlp = GatedMLP(config, rngs=rngs)
    sandwich = config.sandwich_norms
    self.post_attention_norm = _norm(config.hidden, config) if sandwich else None
    self.post_mlp_norm = _norm(config.hidden, config) if sandwich else None

  def __call__(
    self, x: jax.Array, positions: jax.Array, cache: KVCacheBackend | None
  ) -> tuple[jax.Array, KVCacheBackend | None]:
    attended, cache = self.attention(self.attention_norm(x), positions, cache)
    if self.post_attention_norm is not None:
      attended = self.post_attention_norm(attended)
    x = x + attended
    transformed = self.mlp(self.mlp_norm(x))
    if self.post_mlp_norm is not None:
      transformed = self.post_mlp_norm(transformed)
    return x + transformed, cache


class Llama(nnx.Module):
  """Llama-style decoder-only language model (every family of `LlamaConfig`)."""

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
    """Next-token logits for every input token: `logits(hidden_states(...))`.

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
    hidden, cache = self.hidden_states(tokens, positions, cache)
    return self.logits(hidden), cache

  def hidden_states(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    cache: KVCacheBackend | None = None,
  ) -> tuple[jax.Array, KVCacheBackend | None]:
    """The final-normed hidden states `[batch, tokens, hidden]` of every input
    token and the backend, as `__call__` takes them (no output layer)."""
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
    if self.config.scale_embeddings:
      x = x * jnp.asarray(self.config.hidden**0.5, x.dtype)
    for block in self.blocks:
      x, cache = block(x, positions, cache)
    return self.final_norm(x), cache

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Float32 next-token logits `[..., vocab_size]` of hidden states `[..., hidden]`."""
    if self.lm_head is None:  # tied: float32 logits straight from the float32 accumulation
      embedding = self.embed.embedding[...].astype(self.config.compute_dtype)
      logits = layers.dot_transposed(hidden.astype(embedding.dtype), embedding)
    else:
      logits = self.lm_head(hidden)
    return layers.apply_soft_cap(logits.astype(jnp.float32), self.config.final_logit_softcap)
