"""Every family in both config formats: Hugging Face folders of tiny random
checkpoints (tests/family_checkpoints.py) load with the reference's logits,
every field each family reads is parsed in both formats, and the fields the
model does not implement are refused. GGUF files are in
tests/test_families_gguf.py, windowed models in tests/test_families_windows.py.
"""

import json

import numpy as np
import pytest

from paged_jax import models
from paged_jax.models import hf_checkpoint
from paged_jax.models.layers import LinearRopeScaling, Llama3RopeScaling
from tests.checkpoint_files import _forward, write_hf
from tests.family_checkpoints import (
  ATOL,
  FAMILIES,
  FORMATS,
  TOKEN_IDS,
  transformers5,
)
from tests.reference.decoder import reference_logits

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
  config = hf_checkpoint.config_from_hf(hf, dtype="float32")
  assert {name: getattr(config, name) for name in expected} == expected
  if "rope_scaling" in changes and changes["rope_scaling"] is not None:
    assert config.rope_scaling == LinearRopeScaling(4.0)


def test_gemma_defaults_and_model_type_without_architectures():
  hf = dict(FAMILIES["gemma3"], model_type="gemma3_text")
  del hf["architectures"], hf["sliding_window_pattern"], hf["query_pre_attn_scalar"]
  hf["num_hidden_layers"] = 7
  config = hf_checkpoint.config_from_hf(hf)
  assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
  assert config.query_pre_attn_scalar == 256.0
  gemma2 = dict(FAMILIES["gemma2"])
  for name in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window"):
    del gemma2[name]
  config = hf_checkpoint.config_from_hf(gemma2)
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
    hf_checkpoint.config_from_hf(change(FAMILIES[family]))
