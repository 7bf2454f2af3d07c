"""Every family in both config formats, GGUF files of every architecture,
and windowed models on the paged cache.

Each family is one tiny random checkpoint written here (safetensors and a
`config.json` in transformers 4 keys, or converted to transformers 5's
`rope_parameters` and explicit `layer_types`; GGUF files through
`gguf.GGUFWriter` with llama.cpp's tensor names, Q/K row order and Gemma's
stored `1 + weight` norms). Logits are checked against
`tests/reference/decoder.py`, a float64 NumPy forward that reads the
transformers 4 config the way each family's published architecture does.
"""

import dataclasses
import importlib.util
import json
import pathlib
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import compile_guard, models
from paged_jax.engine.params import SamplingParams
from paged_jax.models import checkpoints
from paged_jax.models.dense import generate_dense
from paged_jax.models.layers import LinearRopeScaling, Llama3RopeScaling
from paged_jax.models.paged import PagedCache
from tests.reference.block_manager import ReferenceBlockSpaceManager
from tests.reference.decoder import GEMMA, inverse_frequencies, reference_logits
from tests.test_pretrained import SPECIAL_TOKENS, _merges, train_bpe, write_hf

T = gguf.GGMLQuantizationType
TOKENS = 12  # tokens per checked sequence; every window below is shorter
TOKEN_IDS = np.random.default_rng(11).integers(0, 300, TOKENS)
ATOL = 1e-4


def _config(arch, **changes):
  fields = dict(
    architectures=[arch],
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
  )
  fields.update(changes)
  return fields


# transformers 4 configs, one per family, each using the fields that change
# its math.
FAMILIES = {
  "llama": _config(
    "LlamaForCausalLM",
    rope_theta=500000.0,
    rope_scaling=dict(
      rope_type="llama3",
      factor=8.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=16,
    ),
    attention_bias=True,
  ),
  "mistral": _config("MistralForCausalLM", sliding_window=5, rope_theta=1e6),
  "qwen2": _config(
    "Qwen2ForCausalLM",
    tie_word_embeddings=True,
    use_sliding_window=True,
    sliding_window=4,
    max_window_layers=1,
    rope_theta=1e6,
  ),
  "qwen3": _config(
    "Qwen3ForCausalLM", head_dim=16, rope_scaling=dict(rope_type="linear", factor=2.0)
  ),
  "gemma2": _config(
    "Gemma2ForCausalLM",
    head_dim=16,
    query_pre_attn_scalar=12,
    sliding_window=4,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
  ),
  "gemma3": _config(
    "Gemma3ForCausalLM",
    num_hidden_layers=3,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=4,
    sliding_window_pattern=3,
    rope_theta=1e6,
    rope_local_base_freq=10000.0,
    rope_scaling=dict(rope_type="linear", factor=8.0),
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
  ),
}


def layer_types_of(hf):
  """The layer types transformers 5 writes for a transformers 4 config."""
  arch = hf["architectures"][0]
  layers = range(hf["num_hidden_layers"])
  if arch == "Gemma2ForCausalLM":
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in layers]
  if arch == "Gemma3ForCausalLM":
    pattern = hf["sliding_window_pattern"]
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in layers]
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    slides = hf.get("use_sliding_window") and hf.get("sliding_window") is not None
    first = hf.get("max_window_layers", len(layers))
    return ["sliding_attention" if slides and i >= first else "full_attention" for i in layers]
  return None


def transformers5(hf):
  """`hf` as transformers 5 writes it: `rope_parameters` (per layer type for
  Gemma 3) instead of `rope_theta`/`rope_scaling`, explicit `layer_types`."""
  hf = dict(hf)
  scaling = hf.pop("rope_scaling", None) or {"rope_type": "default"}
  rope = {**scaling, "rope_theta": hf.pop("rope_theta")}
  if hf["architectures"][0] == "Gemma3ForCausalLM":
    local = {"rope_type": "default", "rope_theta": hf.pop("rope_local_base_freq")}
    rope = {"full_attention": rope, "sliding_attention": local}
  hf["rope_parameters"] = rope
  types = layer_types_of(hf)
  if types is not None:
    hf.pop("sliding_window_pattern", None)
    hf["layer_types"] = types
  return hf


FORMATS = {"transformers4": lambda hf: hf, "transformers5": transformers5}


def random_weights(hf, rng):
  """Torch-layout float32 weights `{name: array}` for config `hf`."""
  arch = hf["architectures"][0]
  gemma = arch in GEMMA
  hidden, mlp = hf["hidden_size"], hf["intermediate_size"]
  heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
  head_dim = hf.get("head_dim") or hidden // heads
  shapes = {"model.embed_tokens.weight": (hf["vocab_size"], hidden), "model.norm.weight": (hidden,)}
  if not hf["tie_word_embeddings"]:
    shapes["lm_head.weight"] = (hf["vocab_size"], hidden)
  norms = ["input_layernorm", "post_attention_layernorm"]
  if gemma:
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({p + f"{norm}.weight": (hidden,) for norm in norms})
    shapes.update(
      {
        p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": (mlp, hidden),
        p + "mlp.up_proj.weight": (mlp, hidden),
        p + "mlp.down_proj.weight": (hidden, mlp),
      }
    )
    if arch == "Qwen2ForCausalLM" or hf.get("attention_bias"):
      for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        shapes[p + f"self_attn.{name}_proj.bias"] = (rows * head_dim,)
    if hf.get("attention_bias") and arch != "Qwen2ForCausalLM":
      shapes[p + "self_attn.o_proj.bias"] = (hidden,)
    if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
      shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
      shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
  weights = {}
  for name, shape in shapes.items():
    if name.endswith("norm.weight"):  # Gemma stores gain - 1
      weights[name] = rng.uniform(-0.5, 0.5, shape) if gemma else rng.uniform(0.5, 1.5, shape)
    elif gemma and "embed" in name:  # scaled by sqrt(hidden) on the way in
      weights[name] = rng.normal(0.0, 0.05, shape)
    else:
      weights[name] = rng.normal(0.0, 0.3 if "embed" in name else 0.15, shape)
  return {name: value.astype(np.float32) for name, value in weights.items()}


@pytest.fixture(scope="module")
def bpe():
  return train_bpe()


@pytest.fixture(scope="module")
def family_weights():
  rng = np.random.default_rng(10)
  return {family: random_weights(hf, rng) for family, hf in FAMILIES.items()}


def _forward(model, tokens, positions=None, cache=None):
  graphdef, state = nnx.split(model)
  return _jit_forward(
    graphdef,
    state,
    jnp.asarray(tokens),
    None if positions is None else jnp.asarray(positions),
    cache,
  )


@jax.jit(static_argnums=0)
def _jit_forward(graphdef, state, tokens, positions, cache):
  return nnx.merge(graphdef, state)(tokens, positions, cache)


# Hugging Face folders in both formats.


@pytest.mark.parametrize("config_format", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_family_logits_match_the_reference(
  tmp_path, bpe, family_weights, family, config_format, capsys
):
  hf = FAMILIES[family]
  weights = family_weights[family]
  folder = write_hf(tmp_path / family, FORMATS[config_format](hf), weights, bpe)
  model, _ = models.load_pretrained(folder, dtype="float32")
  logits, _ = _forward(model, TOKEN_IDS[None])
  expected = reference_logits(hf, weights, TOKEN_IDS)
  error = float(np.max(np.abs(np.asarray(logits[0]) - expected)))
  with capsys.disabled():
    print(f"\n{family} ({config_format}): max |logit error| vs float64 {error:.2e}")
  np.testing.assert_allclose(np.asarray(logits[0]), expected, atol=ATOL, rtol=ATOL)


def test_a_chat_templates_end_of_turn_token_is_the_eos(tmp_path, bpe, family_weights):
  """As Gemma's folders: `eos_token` is `<eos>`, turns end with
  `<end_of_turn>`, and replies stop at the latter."""
  folder = write_hf(tmp_path / "gemma2", FAMILIES["gemma2"], family_weights["gemma2"], bpe)
  settings = json.loads((folder / "tokenizer_config.json").read_text())
  settings["eos_token"] = "<|endoftext|>"
  (folder / "tokenizer_config.json").write_text(json.dumps(settings))
  _, tokenizer = models.load_pretrained(folder, dtype="float32")
  assert tokenizer.eos_token_id == bpe.token_to_id("<|im_end|>")
  del settings["chat_template"]
  (folder / "tokenizer_config.json").write_text(json.dumps(settings))
  _, tokenizer = models.load_pretrained(folder, dtype="float32")
  assert tokenizer.eos_token_id == bpe.token_to_id("<|endoftext|>")


def test_the_reference_sees_every_field_it_is_given(family_weights):
  """Each family's distinctive fields move the reference's logits, so the
  logit checks above would catch a loader that ignored them."""
  changes = {
    "llama": dict(rope_scaling=None),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(rope_scaling=None),
    "gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
    "gemma3": dict(rope_local_base_freq=1e6),
  }
  for family, change in changes.items():
    hf = FAMILIES[family]
    weights = family_weights[family]
    expected = reference_logits(hf, weights, TOKEN_IDS)
    changed = reference_logits(dict(hf, **change), weights, TOKEN_IDS)
    assert np.max(np.abs(changed - expected)) > 10 * ATOL, family


# Config parsing only: every known field, in both formats.

PARSED = [
  ("llama", {}, dict(rope_theta=500000.0, output_bias=True, attention_bias=True)),
  (
    "llama",
    {},
    dict(
      rope_scaling=Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
      )
    ),
  ),
  ("llama", dict(rope_scaling=dict(type="linear", factor=4.0)), {}),
  ("mistral", {}, dict(sliding_window=5, layer_types=None, rope_theta=1e6)),
  ("mistral", dict(sliding_window=None), dict(sliding_window=None)),
  (
    "qwen2",
    {},
    dict(
      sliding_window=4,
      layer_types=("full_attention", "sliding_attention"),
      attention_bias=True,
      output_bias=False,
      tie_embeddings=True,
    ),
  ),
  ("qwen2", dict(use_sliding_window=False), dict(sliding_window=None, layer_types=None)),
  ("qwen2", dict(max_window_layers=0), dict(sliding_window=4, layer_types=None)),
  ("qwen3", {}, dict(head_dim=16, qk_norm=True, rope_scaling=LinearRopeScaling(2.0))),
  (
    "gemma2",
    {},
    dict(
      head_dim=16,
      query_pre_attn_scalar=12.0,
      attn_logit_softcap=2.0,
      final_logit_softcap=3.0,
      sliding_window=4,
      layer_types=("sliding_attention", "full_attention"),
      activation="gelu_tanh",
      norm_weight_offset=1.0,
      sandwich_norms=True,
      scale_embeddings=True,
      qk_norm=False,
    ),
  ),
  (
    "gemma3",
    {},
    dict(
      qk_norm=True,
      rope_theta=1e6,
      local_rope_theta=10000.0,
      rope_scaling=LinearRopeScaling(8.0),
      layer_types=("sliding_attention", "sliding_attention", "full_attention"),
      attn_logit_softcap=None,
      final_logit_softcap=None,
      sm_scale=0.25,
    ),
  ),
  ("gemma3", dict(rope_scaling=None), dict(rope_scaling=None)),
]


@pytest.mark.parametrize("config_format", FORMATS)
@pytest.mark.parametrize("family, changes, expected", PARSED)
def test_config_fields_are_read_in_both_formats(family, changes, expected, config_format):
  hf = FORMATS[config_format](dict(FAMILIES[family], **changes))
  config = checkpoints.config_from_hf(hf, dtype="float32")
  assert {name: getattr(config, name) for name in expected} == expected
  if "rope_scaling" in changes and changes["rope_scaling"] is not None:
    assert config.rope_scaling == LinearRopeScaling(4.0)


def test_gemma_defaults_and_model_type_without_architectures():
  hf = dict(FAMILIES["gemma3"], model_type="gemma3_text")
  del hf["architectures"], hf["sliding_window_pattern"], hf["query_pre_attn_scalar"]
  hf["num_hidden_layers"] = 7
  config = checkpoints.config_from_hf(hf)
  assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
  assert config.query_pre_attn_scalar == 256.0
  gemma2 = dict(FAMILIES["gemma2"])
  for name in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window"):
    del gemma2[name]
  config = checkpoints.config_from_hf(gemma2)
  assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
  assert config.sliding_window == 4096


def _yarn(hf):
  return dict(hf, rope_scaling=dict(rope_type="yarn", factor=4.0))


REFUSED = [
  ("llama", _yarn, "rope_scaling rope_type 'yarn' is not supported"),
  (
    "llama",
    lambda hf: transformers5(_yarn(hf)),
    "rope_parameters rope_type 'yarn' is not supported",
  ),
  (
    "llama",
    lambda hf: dict(hf, rope_scaling=dict(type="dynamic", factor=2.0)),
    "rope_type 'dynamic' is not supported",
  ),
  ("llama", lambda hf: dict(hf, hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
  (
    "gemma2",
    lambda hf: dict(hf, hidden_activation="gelu"),
    "hidden_activation 'gelu' is not supported",
  ),
  ("llama", lambda hf: dict(hf, mlp_bias=True), "config field mlp_bias=True is not supported"),
  (
    "llama",
    lambda hf: dict(hf, partial_rotary_factor=0.5),
    "config field partial_rotary_factor=0.5 is not supported",
  ),
  (
    "qwen3",
    lambda hf: dict(
      transformers5(hf),
      rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5),
    ),
    "rope_parameters partial_rotary_factor=0.5 is not supported",
  ),
  (
    "gemma3",
    lambda hf: dict(hf, use_bidirectional_attention=True),
    "use_bidirectional_attention=True is not supported",
  ),
  (
    "llama",
    lambda hf: dict(hf, quantization_config=dict(quant_method="gptq")),
    "config field quantization_config=",
  ),
  (
    "qwen2",
    lambda hf: dict(hf, layer_types=["chunked_attention", "full_attention"]),
    r"layer_types \['chunked_attention'\] are not supported",
  ),
  (
    "qwen2",
    lambda hf: dict(hf, layer_types=["full_attention"]),
    "layer_types has 1 entries for 2 layers",
  ),
  (
    "gemma3",
    lambda hf: _gemma3_local_scaling(transformers5(hf)),
    "rope_parameters.sliding_attention rope_type 'linear' is not supported",
  ),
  (
    "gemma3",
    lambda hf: dict(hf, architectures=["Gemma3ForConditionalGeneration"]),
    "architecture 'Gemma3ForConditionalGeneration' is not supported",
  ),
]


def _gemma3_local_scaling(hf):
  rope = dict(hf["rope_parameters"])
  rope["sliding_attention"] = dict(rope_type="linear", factor=2.0, rope_theta=1e4)
  return dict(hf, rope_parameters=rope)


@pytest.mark.parametrize("family, change, message", REFUSED)
def test_config_fields_the_model_does_not_implement_are_refused(family, change, message):
  with pytest.raises(ValueError, match=message):
    checkpoints.config_from_hf(change(FAMILIES[family]))


# GGUF files of every architecture, as llama.cpp's converter writes them.

GGUF_NAMES = {
  "input_layernorm": "attn_norm",
  "pre_feedforward_layernorm": "ffn_norm",
  "post_feedforward_layernorm": "post_ffw_norm",
  "self_attn.q_proj": "attn_q",
  "self_attn.k_proj": "attn_k",
  "self_attn.v_proj": "attn_v",
  "self_attn.o_proj": "attn_output",
  "self_attn.q_norm": "attn_q_norm",
  "self_attn.k_norm": "attn_k_norm",
  "mlp.gate_proj": "ffn_gate",
  "mlp.up_proj": "ffn_up",
  "mlp.down_proj": "ffn_down",
}
GGUF_ARCHES = {
  "llama": "llama",
  "mistral": "llama",
  "qwen2": "qwen2",
  "qwen3": "qwen3",
  "gemma2": "gemma2",
  "gemma3": "gemma3",
}


def llama_cpp_name(hf_name, gemma):
  """The GGUF name of a Hugging Face tensor."""
  top = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
  }
  if hf_name in top:
    return top[hf_name]
  _, _, layer, rest = hf_name.split(".", 3)
  module, kind = rest.rsplit(".", 1)
  if module == "post_attention_layernorm":
    module = "post_attention_norm" if gemma else "ffn_norm"
  else:
    module = GGUF_NAMES[module]
  return f"blk.{layer}.{module}.{kind}"


def llama_cpp_permute(weight, heads):
  """llama.cpp's converter's Q/K row order for `llama` files."""
  rows = weight.shape[0]
  return (
    weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    .swapaxes(1, 2)
    .reshape(weight.shape)
  )


def llama3_rope_freqs(hf):
  """`rope_freqs.weight` as llama.cpp's converter computes it."""
  scaling = hf["rope_scaling"]
  head_dim = hf["hidden_size"] // hf["num_attention_heads"]
  unscaled = inverse_frequencies(head_dim, hf["rope_theta"], None)
  return (unscaled / inverse_frequencies(head_dim, hf["rope_theta"], scaling)).astype(np.float32)


def write_family_gguf(path, family, weights, tokenizer, matrix_type, *, rope_freqs=None):
  """A GGUF file of `family`; returns the weights it really holds (F16
  rounding) under Hugging Face names."""
  hf = FAMILIES[family]
  gemma = hf["architectures"][0] in GEMMA
  arch = GGUF_ARCHES[family]
  heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(hf["num_hidden_layers"])
  writer.add_context_length(hf["max_position_embeddings"])
  writer.add_embedding_length(hf["hidden_size"])
  writer.add_feed_forward_length(hf["intermediate_size"])
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv_heads)
  writer.add_key_length(head_dim)
  writer.add_value_length(head_dim)
  writer.add_rope_freq_base(hf["rope_theta"])
  writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
  scaling = hf.get("rope_scaling")
  if scaling is not None and scaling["rope_type"] == "linear":
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(scaling["factor"])
  if gemma:
    writer.add_sliding_window(hf["sliding_window"])
    if arch == "gemma2":
      writer.add_attn_logit_softcapping(hf["attn_logit_softcapping"])
      writer.add_final_logit_softcapping(hf["final_logit_softcapping"])
    else:
      writer.add_sliding_window_pattern(hf["sliding_window_pattern"])
    if hf["query_pre_attn_scalar"] != head_dim:
      writer.add_attention_scale(hf["query_pre_attn_scalar"] ** -0.5)
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("smollm")
  vocab = tokenizer.get_vocab()
  tokens = sorted(vocab, key=vocab.get)
  writer.add_token_list(tokens)
  writer.add_token_merges(_merges(tokenizer))
  writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
  writer.add_eos_token_id(vocab["<|im_end|>"])
  if rope_freqs is not None:  # with the llama3 settings that differ from the converter's
    writer.add_rope_scaling_factor(scaling["factor"])
    writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    writer.add_tensor("rope_freqs.weight", rope_freqs)
  held = {}
  for name, weight in weights.items():
    stored = weight
    if weight.ndim == 2 and matrix_type == T.F16:
      stored = weight.astype(np.float16)
    held[name] = stored.astype(np.float32)
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
      stored = llama_cpp_permute(stored, heads if "q_proj" in name else kv_heads)
    if gemma and name.endswith("norm.weight"):
      stored = stored + np.float32(1.0)
    writer.add_tensor(llama_cpp_name(name, gemma), stored)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return held


GGUF_CASES = {
  # Llama 3.1-style: rope_freqs instead of rope_scaling metadata.
  "llama": T.F16,
  "qwen2": T.F32,
  "qwen3": T.F16,
  "gemma2": T.F32,
  "gemma3": T.F16,
}


def _gguf_family(family):
  """The family as its GGUF file describes it: llama.cpp runs Qwen files
  without a window (and this Llama is written without its biases)."""
  hf = FAMILIES[family]
  if family == "llama":
    return dict(hf, attention_bias=False)
  if family == "qwen2":
    return dict(hf, use_sliding_window=False)
  return hf


def _gguf_weights(family, family_weights):
  weights = family_weights[family]
  if family == "llama":
    return {name: value for name, value in weights.items() if not name.endswith(".bias")}
  return weights


@pytest.mark.parametrize("family", GGUF_CASES)
def test_gguf_logits_match_the_reference_for_every_architecture(
  tmp_path, bpe, family_weights, family, capsys
):
  meant = _gguf_family(family)
  weights = _gguf_weights(family, family_weights)
  path = tmp_path / f"{family}.gguf"
  rope_freqs = llama3_rope_freqs(meant) if family == "llama" else None
  held = write_family_gguf(path, family, weights, bpe, GGUF_CASES[family], rope_freqs=rope_freqs)
  model, tokenizer = models.load_pretrained(path, dtype="float32")
  logits, _ = _forward(model, TOKEN_IDS[None])
  expected = reference_logits(meant, held, TOKEN_IDS)
  error = float(np.max(np.abs(np.asarray(logits[0]) - expected)))
  with capsys.disabled():
    print(f"\n{family} (GGUF {GGUF_CASES[family].name}): max |logit error| vs float64 {error:.2e}")
  np.testing.assert_allclose(np.asarray(logits[0]), expected, atol=ATOL, rtol=ATOL)
  assert tokenizer.eos_token_id == bpe.token_to_id("<|im_end|>")
  if family == "llama":
    assert isinstance(model.config.rope_scaling, Llama3RopeScaling)


def test_gguf_rope_freqs_that_are_not_llama3_are_refused(tmp_path, bpe, family_weights):
  rope_freqs = llama3_rope_freqs(FAMILIES["llama"])
  rope_freqs[1] *= 1.5
  path = tmp_path / "bad_rope.gguf"
  weights = _gguf_weights("llama", family_weights)
  write_family_gguf(path, "llama", weights, bpe, T.F32, rope_freqs=rope_freqs)
  with pytest.raises(ValueError, match="rope_freqs.weight is not the llama3 RoPE scaling"):
    models.load_pretrained(path, dtype="float32")


# Windowed models on the paged cache.


def _tiny(config_fields, seed):
  config = models.LlamaConfig(
    vocab_size=61,
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=8,
    hidden=32,
    mlp_hidden=48,
    max_seq_len=64,
    tie_embeddings=True,
    **config_fields,
  )
  return models.Llama(config, rngs=nnx.Rngs(seed))


WINDOWED = {
  "mistral_window_8": dict(sliding_window=8),
  # Gemma 3's layers (a sliding and a global one), with Gemma 2's soft-caps
  # so that the paged kernels' soft cap is checked too.
  "gemma_hybrid_window_8": dict(
    sliding_window=8,
    layer_types=("sliding_attention", "full_attention"),
    rope_theta=1e6,
    local_rope_theta=1e4,
    rope_scaling=LinearRopeScaling(8.0),
    qk_norm=True,
    norm_weight_offset=1.0,
    sandwich_norms=True,
    activation="gelu_tanh",
    query_pre_attn_scalar=8.0,
    attn_logit_softcap=1.0,
    final_logit_softcap=5.0,
    scale_embeddings=True,
  ),
}


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("name", WINDOWED)
def test_paged_greedy_decoding_equals_dense_past_the_window(name, preemption_mode):
  """Every block kept, each layer masking its own window, with prefix
  caching: sequences of 4 to 5 windows in 20 blocks, so some are preempted.
  About 30 s of CPU per model: it compiles the engine's programs for one
  model (the two preemption modes share them); the windows are what it
  checks, so it cannot share another module's model."""
  model = _tiny(WINDOWED[name], seed=3)
  rng = np.random.default_rng(4)
  shared = rng.integers(0, 61, 8)  # two full blocks, cached for the later prompts
  prompts = [np.concatenate([shared, rng.integers(0, 61, n)]).astype(np.int32) for n in (2, 5, 7)]
  cfg = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=20,
    num_cpu_blocks=32,
    max_seqs=4,
    max_blocks_per_seq=16,
    enable_prefix_caching=True,
  )
  llm = pj.LLM(model, None, cfg, num_decode_steps=4, preemption_mode=preemption_mode)
  outputs = llm.generate(prompts, pj.SamplingParams(max_tokens=24, temperature=0.0))
  dense = generate_dense(model, prompts, SamplingParams(max_tokens=24), jax.random.key(0))
  for output, expected in zip(outputs, dense):  # 34 to 39 tokens, windows of 8
    np.testing.assert_array_equal(output.outputs[0].token_ids, expected)
  stats = llm.engine.stats
  assert stats.prefix_cache_hit_rate > 0
  assert stats.preemptions > 0
  assert (stats.swaps > 0) == (preemption_mode == "swap")
  # The same parameters without windows or soft-caps give other logits.
  plain = dict(WINDOWED[name], sliding_window=None, layer_types=None)
  plain.update(attn_logit_softcap=None, final_logit_softcap=None)
  sequence = np.concatenate([prompts[2], dense[2]])[None]
  logits = [np.asarray(_forward(m, sequence)[0][0, -1]) for m in (model, _tiny(plain, seed=3))]
  assert not np.allclose(logits[0], logits[1], atol=1e-3)
  if "attn_logit_softcap" in WINDOWED[name]:
    uncapped = dict(WINDOWED[name], attn_logit_softcap=None)
    assert not np.allclose(logits[0], _forward(_tiny(uncapped, seed=3), sequence)[0][0, -1])


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_cache_that_frees_blocks_outside_its_window_serves_long_sequences(preemption_mode):
  """A Mistral-style model (every layer slides over 8 keys) on a cache that
  frees the blocks outside a window of 12. The long prompt (3.5 windows)
  goes in chunks of at most 12 - 8 + 1 = 5 tokens; the short ones grow past
  the blocks they were admitted with, so sequences are preempted. 12 GPU
  blocks serve sequences of 4 to 7 windows, fewer than the longest needs
  with every block kept. The last request, the one preempted, has n=2 under
  swap (its samples fork on the window's blocks); under recompute it is a
  fourth prompt of n=1 (a group of two would be swapped). Greedy tokens
  equal dense decoding's."""
  model = _tiny(WINDOWED["mistral_window_8"], seed=3)
  rng = np.random.default_rng(5)
  lengths, last_n = ((28, 6, 5), 2) if preemption_mode == "swap" else ((28, 6, 5, 5), 1)
  prompts = [rng.integers(0, 61, n).astype(np.int32) for n in lengths]
  cfg = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=12,
    num_cpu_blocks=16,
    max_seqs=4,
    max_blocks_per_seq=16,
    sliding_window=12,
  )
  assert cfg.blocks_for(28 + 28) > cfg.num_gpu_blocks
  llm = pj.LLM(
    model,
    None,
    cfg,
    max_num_batched_tokens=8,
    num_decode_steps=4,
    preemption_mode=preemption_mode,
    decode_row_buckets=(),  # one decode loop: packed rows are tested in test_engine
    warmup=True,
  )
  assert llm.engine.runner.prefill_width == 5
  params = [pj.SamplingParams(max_tokens=28, temperature=0.0) for _ in prompts]
  params[-1] = dataclasses.replace(params[-1], n=last_n)
  with compile_guard.no_compiles("serving on a windowed cache"):  # warm-up appends chunks too
    outputs = llm.generate(prompts, params)
  dense = generate_dense(model, prompts, SamplingParams(max_tokens=28), jax.random.key(0))
  for output, expected in zip(outputs, dense):
    for sample in output.outputs:
      np.testing.assert_array_equal(sample.token_ids, expected)
  stats = llm.engine.stats
  assert stats.preemptions > 0
  assert (stats.swaps > 0) == (preemption_mode == "swap")


@pytest.mark.parametrize(
  "fields, window, message",
  [
    (dict(sliding_window=8), 7, "layer 0 attends to a window of 8, but this cache frees"),
    (
      dict(sliding_window=4, layer_types=("sliding_attention", "full_attention")),
      8,
      "layer 1 attends to the whole context",
    ),
  ],
)
def test_an_engine_refuses_a_model_that_sees_beyond_the_caches_window(fields, window, message):
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, max_seqs=1, sliding_window=window
  )
  with pytest.raises(ValueError, match=message):
    pj.LLMEngine(_tiny(fields, seed=0), None, cfg)


def test_dense_cache_serves_a_hybrid_model_prefill_then_decode(family_weights, tmp_path, bpe):
  hf = FAMILIES["gemma3"]
  weights = family_weights["gemma3"]
  folder = write_hf(tmp_path / "gemma3", hf, weights, bpe)
  model, _ = models.load_pretrained(folder, dtype="float32", max_seq_len=16)
  cache = models.init_dense_cache(model.config, 1)
  prefill = 7
  logits, cache = _forward(model, TOKEN_IDS[None, :prefill], np.arange(prefill)[None], cache)
  rows = [np.asarray(logits[0])]
  for position in range(prefill, TOKENS):
    logits, cache = _forward(
      model, TOKEN_IDS[None, position : position + 1], np.array([[position]]), cache
    )
    rows.append(np.asarray(logits[0]))
  np.testing.assert_allclose(
    np.concatenate(rows), reference_logits(hf, weights, TOKEN_IDS), atol=ATOL, rtol=ATOL
  )


def _paged_call(window, tokens):
  cfg = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=8,
    num_cpu_blocks=0,
    max_seqs=1,
    max_blocks_per_seq=4,
    sliding_window=window,
  )
  kv = pj.KVCache.create(cfg, 2, 2, 8, dtype=jnp.float32)
  return PagedCache(
    kv=kv,
    block_tables=jnp.zeros((1, 4), jnp.int32),
    slot_mapping=jnp.zeros((1, tokens), jnp.int32),
    cache_sliding_window=window,
  )


@pytest.mark.parametrize(
  "model_fields, tokens, message",
  [
    ({}, 1, "layer 0 attends to the whole context, but this cache frees"),
    (dict(sliding_window=8), 1, "layer 0 attends to a window of 8, but this cache frees"),
    (dict(sliding_window=4), 2, r"layer 0 \(window 4\) takes at most 1 tokens per sequence"),
    (dict(sliding_window=3), 3, r"layer 0 \(window 3\) takes at most 2 tokens per sequence"),
    (
      dict(sliding_window=4, layer_types=("sliding_attention", "full_attention")),
      1,
      "layer 1 attends to the whole context",
    ),
  ],
)
def test_a_cache_that_frees_blocks_outside_its_window_refuses_what_would_read_them(
  model_fields, tokens, message
):
  model = _tiny(model_fields, seed=0)
  cache = _paged_call(4, tokens)
  positions = jnp.arange(tokens, dtype=jnp.int32)[None]
  with pytest.raises(ValueError, match=message):
    jax.eval_shape(lambda: model(jnp.ones((1, tokens), jnp.int32), positions, cache))


@pytest.mark.parametrize("window, tokens", [(4, 1), (3, 2)])
def test_a_cache_that_frees_blocks_serves_calls_that_see_their_whole_window(window, tokens):
  model = _tiny(dict(sliding_window=window), seed=0)
  cache = _paged_call(4, tokens)
  positions = jnp.arange(tokens, dtype=jnp.int32)[None]
  logits, _ = jax.eval_shape(lambda: model(jnp.ones((1, tokens), jnp.int32), positions, cache))
  assert logits.shape == (1, tokens, 61)


@pytest.mark.parametrize("tile_width", [2, 3])
def test_a_cache_that_frees_blocks_checks_a_packed_calls_tiles(tile_width):
  # Window 3 on a cache of 4: at most 2 tokens per sequence and call. A
  # packed call of 6 tokens holds 6 / tile_width sequences' chunks, a tile
  # each: the tiles' width counts, not the row's.
  model = _tiny(dict(sliding_window=3), seed=0)
  tiles = jnp.arange(6, dtype=jnp.int32).reshape(-1, tile_width)
  cache = _paged_call(4, 6).replace(
    block_tables=jnp.zeros((tiles.shape[0], 4), jnp.int32), query_tiles=tiles
  )
  positions = jnp.tile(jnp.arange(tile_width, dtype=jnp.int32), 6 // tile_width)[None]
  call = lambda: model(jnp.ones((1, 6), jnp.int32), positions, cache)
  if tile_width == 2:
    assert jax.eval_shape(call)[0].shape == (1, 6, 61)
  else:
    with pytest.raises(ValueError, match=r"rows of 3 tokens.*takes at most 2 tokens"):
      jax.eval_shape(call)


def test_config_fields_round_trip_through_a_dict():
  config = _tiny(WINDOWED["gemma_hybrid_window_8"], seed=0).config
  assert models.LlamaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
  with pytest.raises(ValueError, match="layer_types must hold one entry per layer"):
    dataclasses.replace(config, layer_types=("full_attention",))
  with pytest.raises(ValueError, match=r"layer_types \['global'\] are not supported"):
    dataclasses.replace(config, layer_types=("global",) * 2)
  with pytest.raises(ValueError, match="sliding_attention layers but sliding_window is None"):
    dataclasses.replace(config, sliding_window=None)
  with pytest.raises(ValueError, match="activation must be one of"):
    dataclasses.replace(config, activation="relu")
  with pytest.raises(ValueError, match="norm_weight_offset must be 0.0 or 1.0"):
    dataclasses.replace(config, norm_weight_offset=0.5)
  with pytest.raises(ValueError, match="attn_logit_softcap must be a positive number"):
    dataclasses.replace(config, attn_logit_softcap=0.0)
  with pytest.raises(ValueError, match="linear rope scaling needs factor >= 1"):
    dataclasses.replace(config, rope_scaling=LinearRopeScaling(0.5))


def test_hybrid_memory_counts_the_blocks_the_manager_keeps(monkeypatch):
  path = pathlib.Path(__file__).parent.parent / "benchmarks" / "hybrid_memory.py"
  spec = importlib.util.spec_from_file_location("hybrid_memory", path)
  hybrid_memory = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "hybrid_memory", hybrid_memory)  # for its dataclass
  spec.loader.exec_module(hybrid_memory)
  for window in (3, 8, 16):
    cfg = pj.CacheConfig(
      block_size=4,
      num_gpu_blocks=64,
      num_cpu_blocks=0,
      max_seqs=1,
      max_blocks_per_seq=16,
      sliding_window=window,
    )
    for num_tokens in (1, 5, 16, 17, 40):
      manager = ReferenceBlockSpaceManager(cfg)
      manager.allocate([0], list(range(num_tokens)), num_tokens)
      kept = sum(block >= 0 for block in manager.get_block_table(0))
      assert hybrid_memory.blocks_held(num_tokens, 4, window) == kept, (window, num_tokens)
  assert hybrid_memory.blocks_held(40, 4, None) == 10


def _gguf_fields(arch, **changes):
  fields = {
    "general.architecture": arch,
    f"{arch}.embedding_length": 64,
    f"{arch}.attention.head_count": 4,
    f"{arch}.attention.head_count_kv": 2,
    f"{arch}.attention.key_length": 8,
    f"{arch}.block_count": 4,
    f"{arch}.feed_forward_length": 96,
    f"{arch}.rope.freq_base": 1e6,
    f"{arch}.vocab_size": 300,
    f"{arch}.attention.sliding_window": 16,
  }
  fields.update({f"{arch}.{key}": value for key, value in changes.items()})
  return fields


@pytest.mark.parametrize(
  "fields, expected",
  [
    (
      _gguf_fields("gemma2"),
      dict(query_pre_attn_scalar=8.0, layer_types=("sliding_attention", "full_attention") * 2),
    ),
    # Gemma 2 27B: 46 layers, queries scaled by (hidden / heads) ** -0.5.
    (_gguf_fields("gemma2", block_count=46), dict(query_pre_attn_scalar=16.0)),
    (_gguf_fields("gemma3", block_count=62), dict(query_pre_attn_scalar=16.0)),
    (
      _gguf_fields("gemma3", **{"attention.sliding_window_pattern": [True, False, True, True]}),
      dict(
        layer_types=(
          "sliding_attention",
          "full_attention",
          "sliding_attention",
          "sliding_attention",
        ),
        local_rope_theta=10000.0,
        sliding_window=16,
      ),
    ),
    (
      _gguf_fields("gemma3", **{"rope.freq_base_swa": 5e4, "attention.scale": 0.25}),
      dict(local_rope_theta=5e4, query_pre_attn_scalar=16.0, layer_types=None),
    ),
    (
      _gguf_fields("qwen2", **{"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
      dict(rope_scaling=LinearRopeScaling(4.0), attention_bias=True, sliding_window=None),
    ),
  ],
)
def test_gguf_metadata_is_read_as_llama_cpp_reads_it(fields, expected):
  config = checkpoints.config_from_gguf(fields, dtype="float32")
  assert {name: getattr(config, name) for name in expected} == expected


@pytest.mark.parametrize(
  "fields, message",
  [
    (
      _gguf_fields("gemma2", **{"attention.sliding_window": None}),
      "no gemma2.attention.sliding_window",
    ),
    (
      _gguf_fields("gemma3", **{"attention.sliding_window_pattern": [True, False]}),
      "sliding_window_pattern has 2 entries for 4 layers",
    ),
    (
      _gguf_fields("llama", **{"rope.scaling.type": "yarn"}),
      "RoPE scaling 'yarn' is not supported",
    ),
    (
      _gguf_fields("qwen3", **{"attention.value_length": 16}),
      "value heads of 16 != key heads of 8",
    ),
    (_gguf_fields("mistral3"), "GGUF architecture 'mistral3' is not supported"),
  ],
)
def test_gguf_metadata_the_model_does_not_implement_is_refused(fields, message):
  with pytest.raises(ValueError, match=message):
    checkpoints.config_from_gguf(fields)
