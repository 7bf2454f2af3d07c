"""Hugging Face folders: `config.json` read as transformers reads each
family's config, and the safetensors weights mapped to our parameters."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import safetensors

from paged_jax.models.checkpoint_build import Source, build_llama, optional_float
from paged_jax.models.layers import LinearRopeScaling, Llama3RopeScaling, RopeScaling
from paged_jax.models.llama import LAYER_TYPES, LlamaConfig
from paged_jax.models.tokenizer import PretrainedTokenizer

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
    attn_logit_softcap=optional_float(
      hf.get("attn_logit_softcapping", 50.0 if arch == "Gemma2ForCausalLM" else None)
    ),
    final_logit_softcap=optional_float(
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


def hf_sources(config: LlamaConfig) -> dict[str, Source]:
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


def load_hf(directory: pathlib.Path, dtype: str, max_seq_len: int | None, quantizer=None):
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
  model = build_llama(config, hf_sources(config), stored, read, kernels)
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
