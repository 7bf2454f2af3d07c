"""KV-cache quantization: int8 or fp8 (e4m3) pages with per-token scales.

Each token's key (and value) row of each KV head is stored as
``round(x / scale)`` in the page dtype with one float32 ``scale = absmax(x) /
max_value`` (``max_value`` 127 for int8, 448 for float8_e4m3fn), and read
back as ``page.astype(float32) * scale``. Scales live in arrays
``[num_kv_heads, num_blocks, block_size]`` beside the pages
``[num_kv_heads, num_blocks, block_size, head_dim]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_VALUES = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}
QUANTIZED_DTYPES = tuple(MAX_VALUES)
SCALE_DTYPE = jnp.dtype(jnp.float32)


def is_quantized(dtype) -> bool:
  """True for the page dtypes that carry scales (int8, float8_e4m3fn)."""
  return jnp.dtype(dtype) in MAX_VALUES


def quantize(x, dtype) -> tuple[jax.Array, jax.Array]:
  """Quantizes rows along the last axis with one absmax scale per row.

  Args:
    x: float array ``[..., head_dim]``.
    dtype: ``jnp.int8`` or ``jnp.float8_e4m3fn``.

  Returns:
    ``(values, scales)``: ``values`` in ``dtype`` with the shape of ``x``,
    float32 ``scales`` of shape ``x.shape[:-1]``. An all-zero row has scale 0
    and zero values.

  Raises:
    ValueError: if ``dtype`` is not a quantized dtype or ``x`` not float.
  """
  dtype = jnp.dtype(dtype)
  if dtype not in MAX_VALUES:
    raise ValueError(
      f"cannot quantize to {dtype}; quantized dtypes are {[str(d) for d in QUANTIZED_DTYPES]}"
    )
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"only float arrays are quantized, got {x.dtype}")
  max_value = MAX_VALUES[dtype]
  x = x.astype(jnp.float32)
  scales = jnp.max(jnp.abs(x), axis=-1) / max_value
  safe = jnp.where(scales > 0, scales, 1.0)[..., None]
  scaled = jnp.clip(x / safe, -max_value, max_value)
  if dtype == jnp.int8:
    scaled = jnp.round(scaled)
  return scaled.astype(dtype), scales


def dequantize(values, scales, dtype=jnp.float32) -> jax.Array:
  """``values * scales[..., None]`` in ``dtype`` (computed in float32)."""
  return (values.astype(jnp.float32) * scales[..., None]).astype(dtype)


def check_scales(k_pages, v_pages, k_scales, v_scales, *, kernel: str) -> None:
  """Raises ValueError unless pages and scales form one quantized layer.

  With both scales None the pages must not be quantized; otherwise the pages
  must be int8 or float8_e4m3fn and each scale array float32
  ``[num_kv_heads, num_blocks, block_size]``.

  Args:
    k_pages: ``[num_kv_heads, num_blocks, block_size, head_dim]``.
    v_pages: same as ``k_pages``.
    k_scales: None or the K scales.
    v_scales: None or the V scales.
    kernel: the kernel's name, for the messages.
  """
  if (k_scales is None) != (v_scales is None):
    raise ValueError(f"{kernel}: pass both k_scales and v_scales or neither")
  if k_scales is None:
    if is_quantized(k_pages.dtype):
      raise ValueError(f"{kernel}: {k_pages.dtype} pages need k_scales and v_scales")
    return
  if not (is_quantized(k_pages.dtype) and v_pages.dtype == k_pages.dtype):
    raise ValueError(
      f"{kernel} cannot serve scales with {k_pages.dtype}/{v_pages.dtype} "
      f"pages; quantized pages are {[str(d) for d in QUANTIZED_DTYPES]}"
    )
  expected = k_pages.shape[:3]
  for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
    if scales.shape != expected or scales.dtype != SCALE_DTYPE:
      raise ValueError(
        f"{kernel}: {name} must be float32{list(expected)} ([num_kv_heads, "
        f"num_blocks, block_size]), got {scales.dtype}{list(scales.shape)}"
      )
