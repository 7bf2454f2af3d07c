"""Pure building blocks of the decoder: RMSNorm, RoPE, activations, masked attention.

Every function here works on plain arrays, so the NNX modules in `llama.py` and
the KV-cache backends in `cache.py` share one reference implementation.
Positions are absolute token positions (int32); a position of -1 marks a
padding token, which is never attended to and whose output is zero.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from paged_jax import kernel_choice
from pallas_kernels import row_product


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """Llama 3.1's RoPE frequency scaling (`rope_type: "llama3"`).

  Rotations slower than `original_max_position_embeddings / low_freq_factor`
  positions per turn are slowed down `factor` times, those faster than
  `original_max_position_embeddings / high_freq_factor` are kept, and the band
  between is interpolated linearly in the inverse wavelength.

  Attributes:
    factor: slow-down of the low frequencies.
    low_freq_factor: context fraction below which wavelengths are scaled.
    high_freq_factor: context fraction above which wavelengths are kept.
    original_max_position_embeddings: the context length trained without it.
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    if not (
      self.factor >= 1.0
      and 0.0 < self.low_freq_factor < self.high_freq_factor
      and self.original_max_position_embeddings >= 1
    ):
      raise ValueError(
        "llama3 rope scaling needs factor >= 1, 0 < low_freq_factor < "
        f"high_freq_factor and original_max_position_embeddings >= 1, "
        f"got {self}"
      )


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Position interpolation (`rope_type: "linear"`): every inverse frequency
  divided by `factor` (Gemma 3's global layers).

  Attributes:
    factor: slow-down of every rotation.
  """

  factor: float

  def __post_init__(self):
    if not self.factor >= 1.0:
      raise ValueError(f"linear rope scaling needs factor >= 1, got {self}")


RopeScaling = Llama3RopeScaling | LinearRopeScaling
ACTIVATIONS = ("silu", "gelu_tanh")
# One bfloat16 row runs fastest padded to two rows from JAX 0.12 on (`dot_transposed`).
_ONE_ROW_PADS = jax.__version_info__ >= (0, 12)


def dot_transposed(x: jax.Array, w: jax.Array) -> jax.Array:
  """Float32 `x @ w.T`, accumulated in float32, for `x` `[..., K]` and a
  weight `w` `[N, K]` stored as torch checkpoints store it.

  Every backend computes the same product; the form is the one XLA:CPU runs
  fastest. Rows go through one `dot_general` contracting both last axes
  (its bfloat16 matmul; a weight stored `[K, N]` is up to 2x slower there,
  and 10x slower with a bfloat16 result). Up to
  `kernel_choice.ROW_PRODUCT_MAX_ROWS` bfloat16 rows times a bfloat16
  weight (a decode step) run the C++ kernel on CPU
  (`kernel_choice.cpu_row_product`: it reads the weight once, and beats
  the matmul at those rows). Without it, one bfloat16 row's form differs by
  JAX version: before 0.12 it is `jnp.dot` with `w.T`, which XLA:CPU fuses
  into one loop over the weight's rows (the other forms first convert the
  whole weight to float32: 15x slower); from 0.12 on, where that loop is
  10x slower, it is padded to two rows, which take the matmul
  (benchmarks/bench_one_row_product.py).
  """
  rows = math.prod(x.shape[:-1])
  few_rows = 0 < rows <= kernel_choice.ROW_PRODUCT_MAX_ROWS
  if x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and few_rows:
    if kernel_choice.cpu_row_product():
      return row_product.row_product(x, w)
  if x.dtype == jnp.bfloat16 and rows == 1:
    if not _ONE_ROW_PADS:
      return jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    padded = jnp.concatenate([x.reshape(1, -1), jnp.zeros_like(x.reshape(1, -1))])
    return _dot_general(padded, w)[:1].reshape(*x.shape[:-1], w.shape[0])
  return _dot_general(x, w)


def _dot_general(x: jax.Array, w: jax.Array) -> jax.Array:
  contract = (((x.ndim - 1,), (1,)), ((), ()))
  return jax.lax.dot_general(x, w, contract, preferred_element_type=jnp.float32)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
  """Root-mean-square normalisation over the last axis, computed in float32.

  Args:
    x: activations `[..., hidden]`.
    scale: learned per-feature gain `[hidden]`.
    eps: added to the mean square before the reciprocal square root.
    offset: added to `scale` (1.0 for Gemma, whose checkpoints store
      `gain - 1`).

  Returns:
    The normalised activations, in the dtype of `x`.
  """
  x32 = x.astype(jnp.float32)
  inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * inv_rms * (offset + scale.astype(jnp.float32))).astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
  """The gate activation of a gated MLP.

  Args:
    name: "silu" (SwiGLU: Llama, Mistral, Qwen) or "gelu_tanh" (GeGLU with
      the tanh approximation of GELU: Gemma's `gelu_pytorch_tanh`).
    x: gate pre-activations.

  Returns:
    The activations, in the dtype of `x`: computed in float32 and rounded
    once, as PyTorch computes them for bfloat16 (XLA:CPU would otherwise
    round after each of its elementwise steps, and run them slower).
  """
  if name == "silu":
    function = jax.nn.silu
  elif name == "gelu_tanh":
    function = functools.partial(jax.nn.gelu, approximate=True)
  else:
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")
  return function(x.astype(jnp.promote_types(x.dtype, jnp.float32))).astype(x.dtype)


def apply_soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
  """`cap * tanh(x / cap)` (Gemma 2's logit soft-capping), or `x` for None."""
  if cap is None:
    return x
  return cap * jnp.tanh(x / cap)


def rope_inverse_frequencies(
  head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
  """Rotation speed of each of the `head_dim // 2` RoPE feature pairs.

  Args:
    head_dim: size of one attention head (even).
    theta: RoPE base; larger values rotate slower.
    scaling: Llama 3 or linear frequency scaling, or None.

  Returns:
    float32 `[head_dim // 2]`, from 1 down to about `1 / theta`.
  """
  exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
  inv_freq = 1.0 / (theta**exponents)
  if scaling is None:
    return inv_freq
  if isinstance(scaling, LinearRopeScaling):
    return inv_freq / scaling.factor
  context = scaling.original_max_position_embeddings
  wavelength = 2.0 * math.pi / inv_freq
  smooth = (context / wavelength - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smooth = jnp.clip(smooth, 0.0, 1.0)
  return (1.0 - smooth) * inv_freq / scaling.factor + smooth * inv_freq


def apply_rope(
  x: jax.Array, positions: jax.Array, theta: float, scaling: RopeScaling | None = None
) -> jax.Array:
  """Rotates query or key heads by their absolute positions (rotate-half).

  Feature `i` of the first half of a head is paired with feature `i` of the
  second half, and the pair turns by `position * inverse_frequency[i]`.

  Args:
    x: `[batch, tokens, heads, head_dim]`.
    positions: int32 `[batch, tokens]`; negative entries (padding) are
      treated as position 0.
    theta: RoPE base.
    scaling: Llama 3 or linear frequency scaling, or None.

  Returns:
    The rotated array, same shape and dtype as `x`.
  """
  head_dim = x.shape[-1]
  angles = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * rope_inverse_frequencies(
    head_dim, theta, scaling
  )
  # The barrier keeps the tables whole: XLA would otherwise fuse the
  # cosines and sines into each product below, once per head and feature
  # instead of once per token (a quarter of a SmolLM2 prompt step on CPU).
  cos, sin = jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return rotated.astype(x.dtype)


def masked_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  q_positions: jax.Array,
  k_positions: jax.Array,
  *,
  sm_scale: float,
  sliding_window: int | None = None,
  soft_cap: float | None = None,
) -> jax.Array:
  """Grouped-query attention where a query sees keys at positions <= its own.

  Query head `h` reads key/value head `h // (num_q_heads // num_kv_heads)`.
  With a sliding window `w`, a query at position `p` sees only the keys at
  `p - w + 1 .. p`. With a soft cap `c`, the scaled logits become
  `c * tanh(logits / c)` before the mask and the softmax.

  Args:
    q: `[batch, q_tokens, num_q_heads, head_dim]`.
    k: `[batch, k_tokens, num_kv_heads, head_dim]`.
    v: same shape as `k`.
    q_positions: int32 `[batch, q_tokens]`, -1 for padding queries.
    k_positions: int32 `[batch, k_tokens]`, -1 for keys never to be read.
    sm_scale: multiplier of the query-key dot products.
    sliding_window: keys each query sees (itself included), or None for all.
    soft_cap: logit soft cap, or None.

  Returns:
    `[batch, q_tokens, num_q_heads, head_dim]` in the dtype of `q`; rows of
    padding queries are zero. Keys and values that no query sees never reach
    the output, even when they are NaN.
  """
  batch, q_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  grouped_q = q.reshape(batch, q_tokens, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
  logits = apply_soft_cap(
    jnp.einsum("bqhgd,bkhd->bhgqk", grouped_q, k, preferred_element_type=jnp.float32) * sm_scale,
    soft_cap,
  )
  visible = (k_positions[:, None, :] <= q_positions[:, :, None]) & (k_positions[:, None, :] >= 0)
  if sliding_window is not None:
    visible &= k_positions[:, None, :] > q_positions[:, :, None] - sliding_window
  logits = jnp.where(visible[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)
  # Zero values no query may read, so stale or NaN cache entries stay out.
  read_by_some_query = jnp.any(visible, axis=1)[:, :, None, None]
  v = jnp.where(read_by_some_query, v, jnp.zeros((), v.dtype))
  out = jnp.einsum(
    "bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
  )
  out = jnp.where((q_positions >= 0)[:, :, None, None, None], out, 0.0)
  return out.reshape(batch, q_tokens, num_q_heads, head_dim).astype(q.dtype)
