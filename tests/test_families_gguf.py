"""GGUF files of every architecture, written through `gguf.GGUFWriter` with
llama.cpp's tensor names, Q/K row order and Gemma's stored `1 + weight`
norms, load with the reference's logits; their metadata is read as
llama.cpp reads it, and what the model does not implement is refused.
"""

import gguf
import numpy as np
import pytest

from paged_jax import models
from paged_jax.models import gguf_checkpoint
from paged_jax.models.layers import LinearRopeScaling, Llama3RopeScaling
from tests.checkpoint_files import SPECIAL_TOKENS, _forward, _merges
from tests.family_checkpoints import (
  ATOL,
  FAMILIES,
  TOKEN_IDS,
  T,
)
from tests.reference.decoder import GEMMA, inverse_frequencies, reference_logits

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
  config = gguf_checkpoint.config_from_gguf(fields, dtype="float32")
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
    gguf_checkpoint.config_from_gguf(fields)
