"""Tiny random checkpoints written as Hugging Face folders and GGUF files,
for the loader's tests (tests/test_pretrained*.py, test_families*.py,
test_quantized_weights.py).

The checkpoints are written in PyTorch naming and layout (safetensors) and
through `gguf.GGUFWriter`. `reference_logits` is a float64 numpy forward
written from the published architecture descriptions (Llama, Mistral, Qwen2,
Qwen3 model cards and llama.cpp's GGUF conventions), independent of
`paged_jax.models`.
"""

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
import tokenizers
from flax import nnx

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


TOKEN_IDS = np.random.default_rng(1).integers(0, 300, TOKENS)

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
