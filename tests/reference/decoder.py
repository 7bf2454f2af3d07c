"""A float64 NumPy forward of the decoder families, written from their
published architectures (the Llama 3, Mistral, Qwen2, Qwen3, Gemma 2 and
Gemma 3 model cards, reports and transformers 4 modeling code), independent
of `paged_jax.models`.

It reads a transformers 4 `config.json` dict (top-level `rope_theta`,
`rope_scaling`, `sliding_window_pattern`, ...) and torch-layout weights
under Hugging Face names, and returns the logits of one sequence.
"""

import numpy as np

GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


def inverse_frequencies(head_dim, theta, scaling):
  """RoPE inverse frequencies; linear scaling divides them all, Llama 3.1's
  scaling as in Meta's reference code."""
  freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
  kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
  if kind in (None, "default"):
    return freqs
  if kind == "linear":
    return freqs / scaling["factor"]
  assert kind == "llama3", kind
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


def layer_attention(hf, layer):
  """`(window, theta, rope_scaling)` of one layer, as each family defines it."""
  arch = hf["architectures"][0]
  window = hf.get("sliding_window")
  theta, scaling = hf["rope_theta"], hf.get("rope_scaling")
  if arch == "LlamaForCausalLM":
    return None, theta, scaling
  if arch == "MistralForCausalLM":
    return window, theta, scaling
  if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
    slides = hf.get("use_sliding_window") and layer >= hf["max_window_layers"]
    return (window if slides else None), theta, scaling
  if arch == "Gemma2ForCausalLM":  # even layers slide
    return (window if layer % 2 == 0 else None), theta, scaling
  assert arch == "Gemma3ForCausalLM", arch
  if (layer + 1) % hf["sliding_window_pattern"]:  # local: own base, no scaling
    return window, hf["rope_local_base_freq"], None
  return None, theta, scaling


def _rms_norm(x, weight, eps, gemma):
  normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return normed * (1.0 + weight if gemma else weight)


def _rope(x, freqs):
  """Rotate-half RoPE of `[tokens, heads, head_dim]` at positions 0, 1, ..."""
  angles = np.arange(x.shape[0])[:, None, None] * freqs
  cos, sin = np.cos(angles), np.sin(angles)
  first, second = np.split(x, 2, axis=-1)
  return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _cap(x, cap):
  return x if cap is None else cap * np.tanh(x / cap)


def reference_logits(hf, weights, tokens):
  """float64 logits `[tokens, vocab]` of one sequence starting at position 0."""
  w = {name: np.asarray(value, np.float64) for name, value in weights.items()}
  arch = hf["architectures"][0]
  gemma = arch in GEMMA
  heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
  eps = hf["rms_norm_eps"]
  scale = hf["query_pre_attn_scalar"] ** -0.5 if gemma else head_dim**-0.5
  activation = _gelu_tanh if gemma else (lambda x: x / (1 + np.exp(-x)))
  positions = np.arange(len(tokens))
  x = w["model.embed_tokens.weight"][tokens]
  if gemma:
    x = x * np.sqrt(hf["hidden_size"])
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    window, theta, scaling = layer_attention(hf, i)
    freqs = inverse_frequencies(head_dim, theta, scaling)
    h = _rms_norm(x, w[p + "input_layernorm.weight"], eps, gemma)

    def project(name, n):
      out = h @ w[p + f"self_attn.{name}.weight"].T
      if p + f"self_attn.{name}.bias" in w:
        out = out + w[p + f"self_attn.{name}.bias"]
      return out.reshape(len(tokens), n, head_dim)

    q, k, v = project("q_proj", heads), project("k_proj", kv_heads), project("v_proj", kv_heads)
    if p + "self_attn.q_norm.weight" in w:
      q = _rms_norm(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
      k = _rms_norm(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
    q, k = _rope(q, freqs), _rope(k, freqs)
    k = np.repeat(k, heads // kv_heads, axis=1)
    v = np.repeat(v, heads // kv_heads, axis=1)
    scores = _cap(np.einsum("qhd,khd->hqk", q, k) * scale, hf.get("attn_logit_softcapping"))
    visible = positions[None, :] <= positions[:, None]
    if window is not None:
      visible &= positions[None, :] > positions[:, None] - window
    scores = np.where(visible, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attended = np.einsum("hqk,khd->qhd", probs, v).reshape(len(tokens), -1)
    attended = attended @ w[p + "self_attn.o_proj.weight"].T
    if p + "self_attn.o_proj.bias" in w:
      attended = attended + w[p + "self_attn.o_proj.bias"]
    if gemma:
      attended = _rms_norm(attended, w[p + "post_attention_layernorm.weight"], eps, gemma)
      h = _rms_norm(x + attended, w[p + "pre_feedforward_layernorm.weight"], eps, gemma)
    else:
      h = _rms_norm(x + attended, w[p + "post_attention_layernorm.weight"], eps, gemma)
    x = x + attended
    gate = h @ w[p + "mlp.gate_proj.weight"].T
    up = h @ w[p + "mlp.up_proj.weight"].T
    out = (activation(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    if gemma:
      out = _rms_norm(out, w[p + "post_feedforward_layernorm.weight"], eps, gemma)
    x = x + out
  x = _rms_norm(x, w["model.norm.weight"], eps, gemma)
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return _cap(x @ head.T, hf.get("final_logit_softcapping"))
