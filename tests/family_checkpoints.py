"""One tiny random checkpoint per model family (Llama, Mistral, Qwen2, Qwen3,
Gemma 2, Gemma 3) in transformers 4 keys, converted to transformers 5's
`rope_parameters` and explicit `layer_types` on demand, for
tests/test_families*.py. Logits are checked against
`tests/reference/decoder.py`, a float64 NumPy forward that reads the
transformers 4 config the way each family's published architecture does.
"""

import gguf
import numpy as np

from tests.reference.decoder import GEMMA

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
