"""GGUF files: their `{arch}.*` metadata read as llama.cpp reads it, their
tensors renamed, unpermuted and dequantized (or kept quantized) into our
parameters."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import gguf
import numpy as np

from paged_jax.models import quantized
from paged_jax.models.checkpoint_build import (
  Source,
  build_llama,
  float_quantizer,
  is_block_kernel,
  optional_float,
)
from paged_jax.models.hf_checkpoint import hf_sources
from paged_jax.models.layers import LinearRopeScaling, Llama3RopeScaling
from paged_jax.models.llama import LlamaConfig
from paged_jax.models.tokenizer import PretrainedTokenizer

# `llama` also holds Mistral: llama.cpp's converter writes MistralForCausalLM
# as `llama` (and runs it without its sliding window).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
# Architectures whose converter permutes Q/K rows for llama.cpp's
# interleaved RoPE; the others keep Hugging Face's rotate-half order.
_GGUF_PERMUTED = ("llama",)
# Layer counts of Gemma 2 27B and Gemma 3 27B, whose queries llama.cpp
# scales by (hidden / heads) ** -0.5 instead of head_dim ** -0.5.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Every n-th layer of a Gemma file is global, the others slide.
_GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
ROPE_FREQS = "rope_freqs.weight"
GGUF_TYPES = tuple(
  gguf.GGMLQuantizationType[name]
  for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
)


def config_from_gguf(
  fields: dict,
  *,
  dtype: str = "bfloat16",
  max_seq_len: int | None = None,
  tied: bool = True,
  rope_freqs: np.ndarray | None = None,
  source: str = "GGUF file",
) -> LlamaConfig:
  """The `LlamaConfig` of a GGUF file's `{arch}.*` metadata, read as llama.cpp
  reads it for the architecture.

  Args:
    fields: the file's metadata.
    dtype: parameter and compute dtype.
    max_seq_len: see `load_pretrained`.
    tied: whether the file has no `output.weight`.
    rope_freqs: the file's `rope_freqs.weight` (llama.cpp's per-frequency
      divisors of the RoPE inverse frequencies), or None. It must equal the
      llama3 scaling of the metadata (`rope.scaling.factor`, else its
      largest entry; `rope.scaling.original_context_length`, else 8192;
      frequency factors 1 and 4, as llama.cpp's converter writes it).
    source: the file, for messages.

  Raises:
    ValueError: if the architecture or a setting is not supported, a field
      is missing, or `rope_freqs` is not a llama3 scaling.
  """
  arch = fields.get("general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise ValueError(
      f"{source}: GGUF architecture {arch!r} is not supported "
      f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
    )

  def field(key, default=None):
    value = fields.get(f"{arch}.{key}", default)
    if value is None:
      raise ValueError(f"{source}: no {arch}.{key} field")
    return value

  hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
  num_layers = int(field("block_count"))
  head_dim = int(field("attention.key_length", hidden // heads))
  value_dim = int(field("attention.value_length", head_dim))
  if value_dim != head_dim:
    raise ValueError(f"{source}: value heads of {value_dim} != key heads of {head_dim}")
  rotated = int(field("rope.dimension_count", head_dim))
  if rotated != head_dim:
    raise ValueError(f"{source}: partial RoPE ({rotated} of {head_dim} features) is not supported")
  theta = float(field("rope.freq_base", 10000.0))
  scaling_type = fields.get(f"{arch}.rope.scaling.type", "none")
  if scaling_type not in ("none", "linear"):
    raise ValueError(f"{source}: RoPE scaling {scaling_type!r} is not supported (none, linear)")
  scaling = None
  if scaling_type == "linear":
    scaling = LinearRopeScaling(factor=float(field("rope.scaling.factor")))
  if rope_freqs is not None:
    if scaling is not None:
      raise ValueError(f"{source}: rope_freqs.weight together with {scaling_type} RoPE scaling")
    scaling = _llama3_from_rope_freqs(fields, arch, rope_freqs, head_dim, theta, source)
  gemma = arch.startswith("gemma")
  window, layer_types = _gguf_windows(fields, arch, num_layers, source)
  vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
  softcaps = {
    key: fields.get(f"{arch}.{key}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping")
  }
  return LlamaConfig(
    vocab_size=int(vocab),
    num_layers=num_layers,
    num_q_heads=heads,
    num_kv_heads=int(field("attention.head_count_kv", heads)),
    head_dim=head_dim,
    hidden=hidden,
    mlp_hidden=int(field("feed_forward_length")),
    rope_theta=theta,
    max_seq_len=max_seq_len or int(field("context_length", 2048)),
    dtype=dtype,
    param_dtype=dtype,
    tie_embeddings=tied,
    norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
    attention_bias=arch == "qwen2",
    qk_norm=arch in ("qwen3", "gemma3"),
    rope_scaling=scaling,
    sliding_window=window,
    layer_types=layer_types,
    local_rope_theta=float(field("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
    norm_weight_offset=1.0 if gemma else 0.0,
    sandwich_norms=gemma,
    activation="gelu_tanh" if gemma else "silu",
    query_pre_attn_scalar=_gguf_query_scalar(fields, arch, num_layers, hidden, heads, head_dim),
    attn_logit_softcap=optional_float(softcaps["attn_logit_softcapping"]),
    final_logit_softcap=optional_float(softcaps["final_logit_softcapping"]),
    scale_embeddings=gemma,
  )


def _gguf_windows(fields: dict, arch: str, num_layers: int, source: str):
  """`(sliding_window, layer_types)` of a Gemma GGUF (none for the others:
  llama.cpp runs Llama, Mistral and Qwen files without a window)."""
  if not arch.startswith("gemma"):
    return None, None
  window = fields.get(f"{arch}.attention.sliding_window")
  if window is None:
    raise ValueError(f"{source}: no {arch}.attention.sliding_window field")
  pattern = fields.get(f"{arch}.attention.sliding_window_pattern", _GEMMA_SLIDING_PATTERN[arch])
  if isinstance(pattern, int):  # every pattern-th layer is global
    sliding = [i % pattern < pattern - 1 for i in range(num_layers)]
  else:
    sliding = [bool(slides) for slides in pattern]
    if len(sliding) != num_layers:
      raise ValueError(
        f"{source}: {arch}.attention.sliding_window_pattern has {len(sliding)} entries "
        f"for {num_layers} layers"
      )
  types = tuple("sliding_attention" if slides else "full_attention" for slides in sliding)
  return int(window), None if all(sliding) else types


def _gguf_query_scalar(fields, arch, num_layers, hidden, heads, head_dim) -> float | None:
  """Gemma's `query_pre_attn_scalar`: from `{arch}.attention.scale` if the
  file has it, else as llama.cpp decides: `hidden / heads` for the 27B
  models (known by their layer count), `head_dim` for the others."""
  if not arch.startswith("gemma"):
    return None
  scale = fields.get(f"{arch}.attention.scale")
  if scale is not None:
    return float(scale) ** -2
  if num_layers == _GEMMA_27B_LAYERS[arch]:
    return hidden / heads
  return float(head_dim)


def llama3_rope_divisors(head_dim: int, theta: float, scaling: Llama3RopeScaling) -> np.ndarray:
  """float64 `[head_dim // 2]`: what llama.cpp's converter stores as
  `rope_freqs.weight` for `scaling` (unscaled / scaled inverse frequency)."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  context = scaling.original_max_position_embeddings
  low, high = scaling.low_freq_factor, scaling.high_freq_factor
  wavelength = 2 * np.pi / inv_freq
  smooth = (context / wavelength - low) / (high - low)
  interpolated = 1.0 / ((1.0 - smooth) / scaling.factor + smooth)
  return np.where(
    wavelength < context / high,
    1.0,
    np.where(wavelength > context / low, scaling.factor, interpolated),
  )


def _llama3_from_rope_freqs(fields, arch, rope_freqs, head_dim, theta, source):
  rope_freqs = np.asarray(rope_freqs, np.float64).ravel()
  if rope_freqs.shape != (head_dim // 2,):
    raise ValueError(
      f"{source}: rope_freqs.weight has {rope_freqs.size} entries, RoPE has {head_dim // 2}"
    )
  scaling = Llama3RopeScaling(
    factor=float(fields.get(f"{arch}.rope.scaling.factor", rope_freqs.max())),
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=int(
      fields.get(f"{arch}.rope.scaling.original_context_length", 8192)
    ),
  )
  expected = llama3_rope_divisors(head_dim, theta, scaling)
  if not np.allclose(rope_freqs, expected, rtol=1e-5, atol=0.0):
    worst = int(np.argmax(np.abs(rope_freqs - expected)))
    raise ValueError(
      f"{source}: rope_freqs.weight is not the llama3 RoPE scaling of the metadata "
      f"({scaling}): entry {worst} is {rope_freqs[worst]:.6g}, llama3 gives "
      f"{expected[worst]:.6g}"
    )
  return scaling


def _unpermute_rows(heads: int) -> Callable[[np.ndarray], np.ndarray]:
  """Undoes llama.cpp's Q/K row order (pairs interleaved, not split halves)."""

  def unpermute(weight):
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)

  return unpermute


_GGUF_NAMES = {
  "model.embed_tokens.weight": "token_embd.weight",
  "model.norm.weight": "output_norm.weight",
  "lm_head.weight": "output.weight",
  "input_layernorm.weight": "attn_norm.weight",
  "mlp.gate_proj.weight": "ffn_gate.weight",
  "mlp.up_proj.weight": "ffn_up.weight",
  "mlp.down_proj.weight": "ffn_down.weight",
  "self_attn.q_proj.weight": "attn_q.weight",
  "self_attn.k_proj.weight": "attn_k.weight",
  "self_attn.v_proj.weight": "attn_v.weight",
  "self_attn.o_proj.weight": "attn_output.weight",
  "self_attn.q_proj.bias": "attn_q.bias",
  "self_attn.k_proj.bias": "attn_k.bias",
  "self_attn.v_proj.bias": "attn_v.bias",
  "self_attn.o_proj.bias": "attn_output.bias",
  "self_attn.q_norm.weight": "attn_q_norm.weight",
  "self_attn.k_norm.weight": "attn_k_norm.weight",
}
# The norm after attention: Llama's MLP norm, or Gemma's post-attention norm.
_GGUF_SANDWICH_NAMES = {
  "post_attention_layernorm.weight": "post_attention_norm.weight",
  "pre_feedforward_layernorm.weight": "ffn_norm.weight",
  "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def _gguf_sources(config: LlamaConfig, arch: str) -> dict[str, Source]:
  """Our parameter paths -> GGUF tensor names, (numpy) shapes and layouts.

  Only `llama` files (Llama, Mistral) have llama.cpp's permuted Q/K rows;
  Gemma files store RMSNorm gains as `1 + weight`.
  """
  renamed = dict(_GGUF_NAMES)
  if config.sandwich_norms:
    renamed.update(_GGUF_SANDWICH_NAMES)
  else:
    renamed["post_attention_layernorm.weight"] = "ffn_norm.weight"
  sources = {}
  for path, (name, shape, layout) in hf_sources(config).items():
    rest = name.split(".", 3)[3] if name.startswith("model.layers.") else name
    if name.startswith("model.layers."):
      name = f"blk.{name.split('.')[2]}.{renamed[rest]}"
    else:
      name = renamed[name]
    if arch in _GGUF_PERMUTED and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
      heads = config.num_q_heads if "q_proj" in rest else config.num_kv_heads
      layout = _unpermute_rows(heads)
    if config.norm_weight_offset and rest.endswith("norm.weight"):
      layout = (lambda offset: lambda x: x - offset)(config.norm_weight_offset)
    sources[path] = (name, shape, layout)
  return sources


def load_gguf(
  path: pathlib.Path, dtype: str, max_seq_len: int | None, quantization=None, group_size=None
):
  try:
    reader = gguf.GGUFReader(str(path))
  except (ValueError, OSError) as err:
    raise ValueError(f"{path}: not a readable GGUF file: {err}") from err
  fields = {
    key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
  }
  tensors = {tensor.name: tensor for tensor in reader.tensors}
  for tensor in tensors.values():
    if tensor.tensor_type not in GGUF_TYPES:
      raise ValueError(
        f"{path}: tensor {tensor.name} has GGUF type "
        f"{tensor.tensor_type.name}, not one of "
        f"{', '.join(kind.name for kind in GGUF_TYPES)}"
      )
  stored = {
    name: (path, tuple(int(n) for n in reversed(tensor.shape))) for name, tensor in tensors.items()
  }

  def read(name, dtype):
    return _dequantize(tensors[name], stored[name][1], dtype)

  rope_freqs = read(ROPE_FREQS, np.float32) if ROPE_FREQS in tensors else None
  stored.pop(ROPE_FREQS, None)
  config = config_from_gguf(
    fields,
    dtype=dtype,
    max_seq_len=max_seq_len,
    tied="output.weight" not in tensors,
    rope_freqs=rope_freqs,
    source=str(path),
  )
  sources = _gguf_sources(config, fields["general.architecture"])
  kernels = _gguf_kernels(path, tensors, sources, read, quantization, group_size)
  model = build_llama(config, sources, stored, read, kernels)
  tokenizer = PretrainedTokenizer.from_gguf_fields(fields, source=str(path))
  return model, tokenizer


def _gguf_kernels(path, tensors, sources, read, quantization, group_size):
  """The `kernels` argument of `build_llama` for a GGUF file (see `build_llama`).

  Raises:
    ValueError: for "int8"/"int4" when a kernel of the decoder blocks is
      stored quantized (naming it and its type).
  """
  if quantization is None:
    return None
  if quantization == "gguf":

    def keep(_, name, layout):
      tensor = tensors[name]
      if tensor.tensor_type not in quantized.GGUF_QUANTIZED:
        return None  # a float tensor stays float
      shape = tuple(int(n) for n in reversed(tensor.shape))
      data = tensor.data.reshape(shape[0], -1)
      return _rows(quantized.from_gguf(data, tensor.tensor_type, shape, name), layout)

    return keep
  for key, (name, _, _) in sources.items():
    kind = tensors[name].tensor_type if name in tensors else None
    if is_block_kernel(key) and kind in quantized.GGUF_QUANTIZED:
      raise ValueError(
        f"{path}: quantization {quantization!r} quantizes float weights, but tensor "
        f"{name} is already {kind.name}; load the file with quantization='gguf' "
        "(its own types) or None (float)"
      )
  quantizer = float_quantizer(quantization, group_size)
  return lambda key, name, layout: quantizer(key, layout(read(name, np.float32)))


def _rows(weight: quantized.QuantizedWeight, layout) -> quantized.QuantizedWeight:
  """`weight` with `layout` (a reordering of rows, or nothing) applied to
  each of its arrays, which all have one row per output feature."""
  arrays = [weight.values[...], weight.scales[...]]
  arrays.append(None if weight.minimums is None else weight.minimums[...])
  moved = [None if a is None else layout(np.asarray(a)) for a in arrays]
  return quantized.QuantizedWeight(*moved, bits=weight.bits, group_size=weight.group_size)


def _dequantize(tensor, shape: tuple[int, ...], dtype, rows_per_chunk: int = 4096) -> np.ndarray:
  """`tensor` as a `dtype` array of `shape`, dequantized a few rows at a time
  so that no float32 copy of a large tensor exists."""
  data = tensor.data.reshape(-1, tensor.data.shape[-1])
  out = np.empty((data.shape[0], int(np.prod(shape)) // data.shape[0]), dtype)
  for start in range(0, data.shape[0], rows_per_chunk):
    chunk = data[start : start + rows_per_chunk]
    out[start : start + len(chunk)] = gguf.quants.dequantize(chunk, tensor.tensor_type).reshape(
      len(chunk), -1
    )
  return out.reshape(shape)
