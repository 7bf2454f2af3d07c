"""Tests of the Llama model, its dense KV cache, tokenizer and tiny weights."""

import dataclasses
import json

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, serialization
from hypothesis import strategies as st

from paged_jax import models
from paged_jax.models import layers, pretrained

GQA_CONFIG = models.LlamaConfig(
  vocab_size=61,
  num_layers=2,
  num_q_heads=4,
  num_kv_heads=2,
  head_dim=8,
  hidden=32,
  mlp_hidden=48,
  max_seq_len=24,
  tie_embeddings=False,
)
MQA_TIED_CONFIG = dataclasses.replace(GQA_CONFIG, num_kv_heads=1, tie_embeddings=True)

BATCH = 3
CHUNK_WIDTH = 8
DECODE_STEPS = 4
TOTAL_WIDTH = 2 * CHUNK_WIDTH + DECODE_STEPS


def _forward_fn(model):
  """Jitted pure forward `(tokens, positions, cache) -> (logits, cache)`."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(
    lambda state, tokens, positions, cache: nnx.merge(graphdef, state)(tokens, positions, cache)
  )
  return lambda tokens, positions, cache=None: forward(state, tokens, positions, cache)


@pytest.fixture(
  scope="module", params=[GQA_CONFIG, MQA_TIED_CONFIG], ids=["gqa_untied", "mqa_tied"]
)
def small_model(request):
  model = models.Llama(request.param, rngs=nnx.Rngs(0))
  return model, _forward_fn(model)


def _ragged_schedule(rng):
  """Random tokens and per-row lengths of two prefill chunks and a decode."""
  tokens = rng.integers(0, GQA_CONFIG.vocab_size, (BATCH, TOTAL_WIDTH))
  chunk_lengths = np.stack(
    [
      rng.integers(1, CHUNK_WIDTH + 1, BATCH),
      rng.integers(0, CHUNK_WIDTH + 1, BATCH),
      rng.integers(0, DECODE_STEPS + 1, BATCH),
    ]
  )
  chunk_lengths[:, 0] = [CHUNK_WIDTH, CHUNK_WIDTH, DECODE_STEPS]  # one full row
  return tokens.astype(np.int32), chunk_lengths


def _chunk(tokens, starts, lengths, width):
  """Tokens and positions `[BATCH, width]` of each row's next tokens."""
  offsets = np.arange(width)[None, :]
  positions = np.where(offsets < lengths[:, None], starts[:, None] + offsets, -1).astype(np.int32)
  chunk_tokens = np.take_along_axis(tokens, np.maximum(positions, 0), axis=1)
  return chunk_tokens, positions


def _run_with_dense_cache(forward, config, tokens, chunk_lengths, fill=0.0):
  """Logits at every (row, position) fed: prefill, prefill, then decode."""
  cache = models.init_dense_cache(config, BATCH)
  cache = jax.tree.map(lambda x: jnp.full_like(x, fill), cache)
  logits_at = {}
  starts = np.zeros(BATCH, np.int64)

  def feed(lengths, width, cache):
    chunk_tokens, positions = _chunk(tokens, starts, lengths, width)
    logits, cache = forward(chunk_tokens, positions, cache)
    for row, column in zip(*np.nonzero(positions >= 0)):
      logits_at[row, positions[row, column]] = np.asarray(logits[row, column])
    return cache

  cache = feed(chunk_lengths[0], CHUNK_WIDTH, cache)
  starts += chunk_lengths[0]
  cache = feed(chunk_lengths[1], CHUNK_WIDTH, cache)
  starts += chunk_lengths[1]
  for step in range(DECODE_STEPS):
    cache = feed((chunk_lengths[2] > step).astype(np.int64), 1, cache)
    starts += chunk_lengths[2] > step
  return logits_at, starts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_cache_prefill_then_decode_matches_full_forward(small_model, seed):
  model, forward = small_model
  tokens, chunk_lengths = _ragged_schedule(np.random.default_rng(seed))
  cached, lengths = _run_with_dense_cache(forward, model.config, tokens, chunk_lengths)
  full_positions = np.where(
    np.arange(TOTAL_WIDTH) < lengths[:, None], np.arange(TOTAL_WIDTH), -1
  ).astype(np.int32)
  full_logits, cache = forward(tokens, full_positions)
  assert cache is None
  assert len(cached) == lengths.sum()
  for (row, position), logits in cached.items():
    np.testing.assert_allclose(
      logits, full_logits[row, position], rtol=0, atol=1e-5, err_msg=f"row {row} pos {position}"
    )


def test_dense_cache_never_reads_unwritten_entries(small_model):
  model, forward = small_model
  tokens, chunk_lengths = _ragged_schedule(np.random.default_rng(3))
  clean, _ = _run_with_dense_cache(forward, model.config, tokens, chunk_lengths)
  poisoned, _ = _run_with_dense_cache(forward, model.config, tokens, chunk_lengths, fill=np.nan)
  assert clean.keys() == poisoned.keys()
  for key, logits in clean.items():
    np.testing.assert_array_equal(poisoned[key], logits)


def test_padding_inside_a_row_changes_no_other_logits(small_model):
  _, forward = small_model
  rng = np.random.default_rng(4)
  num_real = TOTAL_WIDTH - 3
  real = rng.integers(0, GQA_CONFIG.vocab_size, num_real)
  junk = rng.integers(0, GQA_CONFIG.vocab_size, 3)
  padding = np.full(3, -1)
  at_end, _ = forward(
    np.concatenate([real, junk])[None].astype(np.int32),
    np.concatenate([np.arange(num_real), padding])[None].astype(np.int32),
  )
  in_middle, _ = forward(
    np.concatenate([real[:5], junk, real[5:]])[None].astype(np.int32),
    np.concatenate([np.arange(5), padding, np.arange(5, num_real)])[None].astype(np.int32),
  )
  np.testing.assert_allclose(
    np.concatenate([in_middle[:, :5], in_middle[:, 8:]], axis=1),
    at_end[:, :num_real],
    rtol=0,
    atol=1e-5,
  )


@pytest.mark.parametrize("one_row_pads", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("leading", [(1,), (1, 1), (3,), (2, 5)])
def test_dot_transposed_is_x_times_w_transposed(dtype, leading, one_row_pads, monkeypatch):
  # One row (bfloat16's own forms, each JAX version's) and several rows give
  # the float32 product.
  monkeypatch.setattr(layers, "_ONE_ROW_PADS", one_row_pads)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(*leading, 24)), dtype)
  w = jnp.asarray(rng.normal(size=(40, 24)), dtype)
  out = jax.jit(lambda x, w: layers.dot_transposed(x, w))(x, w)
  assert out.dtype == jnp.float32 and out.shape == (*leading, 40)
  expected = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_gqa_shapes():
  config = dataclasses.replace(GQA_CONFIG, num_q_heads=8, num_kv_heads=2)
  model = nnx.eval_shape(lambda: models.Llama(config, rngs=nnx.Rngs(0)))
  attention = model.blocks[0].attention
  assert attention.q_proj.kernel.shape == (8 * 8, 32)  # [out, in], as torch's
  assert attention.k_proj.kernel.shape == (2 * 8, 32)
  assert attention.v_proj.kernel.shape == (2 * 8, 32)
  assert attention.o_proj.kernel.shape == (32, 8 * 8)
  cache = models.init_dense_cache(config, batch_size=2, max_len=7)
  assert cache.num_layers == 2
  assert all(k.shape == (2, 7, 2, 8) for k in cache.k + cache.v)
  positions = jnp.tile(jnp.arange(3, dtype=jnp.int32), (2, 1))
  logits, cache = nnx.eval_shape(
    lambda model: model(jnp.ones((2, 3), jnp.int32), positions, cache), model
  )
  assert logits.shape == (2, 3, 61) and logits.dtype == jnp.float32
  assert all(k.shape == (2, 7, 2, 8) for k in cache.k + cache.v)


def _naive_attention(q, k, v, q_positions, k_positions, sm_scale):
  """Loop-by-loop GQA reference: query head h reads kv head h // group."""
  batch, q_tokens, num_q_heads, head_dim = q.shape
  group = num_q_heads // k.shape[2]
  out = np.zeros(q.shape, np.float64)
  for b in range(batch):
    for t in range(q_tokens):
      if q_positions[b, t] < 0:
        continue
      keys = [j for j in range(k.shape[1]) if 0 <= k_positions[b, j] <= q_positions[b, t]]
      for h in range(num_q_heads):
        scores = np.array([q[b, t, h] @ k[b, j, h // group] for j in keys])
        weights = np.exp(sm_scale * scores - np.max(sm_scale * scores))
        weights /= weights.sum()
        out[b, t, h] = sum(w * v[b, j, h // group] for w, j in zip(weights, keys))
  return out


def test_masked_attention_matches_naive_gqa_reference():
  rng = np.random.default_rng(5)
  q = rng.normal(size=(2, 3, 6, 4)).astype(np.float32)
  k = rng.normal(size=(2, 5, 2, 4)).astype(np.float32)
  v = rng.normal(size=(2, 5, 2, 4)).astype(np.float32)
  q_positions = np.array([[2, 3, -1], [0, 4, 1]], np.int32)
  k_positions = np.array([[0, 1, 2, 3, -1], [4, 3, 2, 1, 0]], np.int32)
  out = layers.masked_attention(q, k, v, q_positions, k_positions, sm_scale=0.5)
  expected = _naive_attention(q, k, v, q_positions, k_positions, 0.5)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_rope_depends_only_on_relative_position():
  rng = np.random.default_rng(6)
  q = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)
  k = rng.normal(size=(1, 1, 1, 16)).astype(np.float32)

  def rotate(x, position):
    return layers.apply_rope(x, jnp.array([[position]], jnp.int32), 500.0)

  def score(q_position, k_position):
    return float(jnp.vdot(rotate(q, q_position), rotate(k, k_position)))

  np.testing.assert_allclose(score(7, 3), score(107, 103), rtol=1e-4)
  assert not np.isclose(score(7, 3), score(3, 7), rtol=1e-3)
  np.testing.assert_allclose(rotate(q, 0), q)
  np.testing.assert_allclose(np.linalg.norm(rotate(q, 41)), np.linalg.norm(q), rtol=1e-5)


def test_rms_norm_matches_formula():
  rng = np.random.default_rng(7)
  x = rng.normal(size=(3, 5)).astype(np.float32) * 4 + 1
  scale = rng.normal(size=(5,)).astype(np.float32)
  expected = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale
  np.testing.assert_allclose(layers.rms_norm(x, scale, 1e-6), expected, rtol=1e-5)


@pytest.mark.parametrize("name", layers.ACTIVATIONS)
def test_activation_rounds_bfloat16_once(name):
  """A bfloat16 gate's activation is the float32 one rounded once (as
  PyTorch computes it), not rounded after each elementwise step."""
  x = jnp.asarray(np.random.default_rng(0).normal(0.0, 3.0, (64, 96)), jnp.bfloat16)
  out = jax.jit(lambda x: layers.activation(name, x))(x)
  in_float32 = jax.jit(lambda x: layers.activation(name, x.astype(jnp.float32)))
  expected = in_float32(x).astype(jnp.bfloat16)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_bfloat16_forward_tracks_float32(small_model):
  model, forward = small_model
  tokens = (
    np.random.default_rng(8)
    .integers(0, GQA_CONFIG.vocab_size, (BATCH, TOTAL_WIDTH))
    .astype(np.int32)
  )
  positions = np.tile(np.arange(TOTAL_WIDTH, dtype=np.int32), (BATCH, 1))
  config_bf16 = dataclasses.replace(model.config, dtype=jnp.bfloat16)
  assert config_bf16.dtype == "bfloat16"
  model_bf16 = models.Llama(config_bf16, rngs=nnx.Rngs(0))
  logits_bf16, _ = _forward_fn(model_bf16)(tokens, positions)
  logits_f32, _ = forward(tokens, positions)
  assert logits_bf16.dtype == jnp.float32
  np.testing.assert_allclose(logits_bf16, logits_f32, rtol=0.05, atol=0.05)


# Config validation.


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(vocab_size=0), "vocab_size must be a positive int"),
    (dict(num_layers=2.0), "num_layers must be a positive int"),
    (dict(hidden=True), "hidden must be a positive int"),
    (dict(num_q_heads=3), "must be a multiple of num_kv_heads"),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(rope_theta=1.0), "rope_theta must be > 1"),
    (dict(norm_eps=0.0), "norm_eps must be > 0"),
    (dict(tie_embeddings=1), "tie_embeddings must be a bool"),
    (dict(dtype="int32"), "dtype must be one of"),
  ],
)
def test_config_rejects_bad_fields(change, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(GQA_CONFIG, **change)


def test_config_dict_round_trip_and_errors():
  fields = GQA_CONFIG.to_dict()
  assert json.loads(json.dumps(fields)) == fields
  assert models.LlamaConfig.from_dict(fields) == GQA_CONFIG
  assert hash(models.LlamaConfig.from_dict(fields)) == hash(GQA_CONFIG)
  with pytest.raises(ValueError, match=r"unknown LlamaConfig fields: \['heads'\]"):
    models.LlamaConfig.from_dict({**fields, "heads": 4})
  del fields["hidden"]
  with pytest.raises(ValueError, match=r"missing LlamaConfig fields: \['hidden'\]"):
    models.LlamaConfig.from_dict(fields)


# Bad inputs to the model and the dense cache.


def test_model_rejects_bad_tokens_and_positions():
  model = models.Llama(GQA_CONFIG, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="tokens must be an int array"):
    model(jnp.ones((4,), jnp.int32))
  with pytest.raises(ValueError, match="tokens must be an int array"):
    model(jnp.ones((1, 4), jnp.float32))
  with pytest.raises(ValueError, match="positions shape"):
    model(jnp.ones((1, 4), jnp.int32), jnp.zeros((1, 3), jnp.int32))


def test_dense_cache_rejects_mismatched_shapes():
  model = models.Llama(GQA_CONFIG, rngs=nnx.Rngs(0))

  def one_token(batch):
    return jnp.ones((batch, 1), jnp.int32), jnp.zeros((batch, 1), jnp.int32)

  wrong_batch = models.init_dense_cache(GQA_CONFIG, batch_size=2)
  with pytest.raises(ValueError, match="do not fit a cache of batch 2"):
    jax.eval_shape(lambda: model(*one_token(3), wrong_batch))
  too_few_layers = models.DenseCache.create(
    num_layers=1, batch_size=1, max_len=4, num_kv_heads=2, head_dim=8
  )
  with pytest.raises(ValueError, match="layer 1 out of range"):
    jax.eval_shape(lambda: model(*one_token(1), too_few_layers))


@pytest.mark.parametrize(
  "name, value",
  [
    ("num_layers", 0),
    ("batch_size", -1),
    ("max_len", 2.5),
    ("num_kv_heads", None),
    ("head_dim", False),
  ],
)
def test_dense_cache_create_rejects_bad_sizes(name, value):
  sizes = dict(num_layers=1, batch_size=1, max_len=4, num_kv_heads=1, head_dim=2)
  with pytest.raises(ValueError, match=f"{name} must be a positive int"):
    models.DenseCache.create(**{**sizes, name: value})


# Tokenizer.


@hypothesis.given(st.text())
@hypothesis.settings(max_examples=100, deadline=None)
def test_tokenizer_round_trip(text):
  tokenizer = models.ByteTokenizer()
  ids = tokenizer.encode(text, add_bos=True, add_eos=True)
  assert ids.dtype == np.int32
  assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
  assert len(ids) == len(text.encode("utf-8")) + 2
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode(jnp.asarray(ids).tolist()) == text


def test_tokenizer_specials_and_errors():
  tokenizer = models.ByteTokenizer()
  assert tokenizer.vocab_size == 258
  assert len({tokenizer.bos_id, tokenizer.eos_id}) == 2
  assert max(tokenizer.bos_id, tokenizer.eos_id) < tokenizer.vocab_size
  assert tokenizer.encode("").shape == (0,)
  assert tokenizer.decode([]) == ""
  assert tokenizer.decode([0xC3]) == "\ufffd"
  with pytest.raises(ValueError, match="text must be a str"):
    tokenizer.encode(b"bytes")


# Saving, loading and the shipped tiny model.


def test_save_and_load_round_trip(tmp_path):
  model = models.Llama(GQA_CONFIG, rngs=nnx.Rngs(1))
  models.save_model(model, tmp_path, weights_dtype=jnp.float32)
  loaded = models.load_model(tmp_path)
  assert loaded.config == GQA_CONFIG
  expected = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  actual = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, actual, expected)
  # The file keeps kernels [in, out], as the shipped model and older files do.
  stored = serialization.msgpack_restore((tmp_path / pretrained.WEIGHTS_FILE).read_bytes())
  down = model.blocks[0].mlp.down_proj.kernel[...]
  np.testing.assert_array_equal(stored["blocks"][0]["mlp"]["down_proj"]["kernel"], down.T)


def test_load_model_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="no config.json in model"):
    models.load_model(tmp_path)
  models.save_model(models.Llama(GQA_CONFIG, rngs=nnx.Rngs(0)), tmp_path)
  config_file = tmp_path / pretrained.CONFIG_FILE
  config_file.write_text(json.dumps(dataclasses.replace(GQA_CONFIG, mlp_hidden=40).to_dict()))
  with pytest.raises(ValueError, match=r"blocks/0/mlp/down_proj/kernel has shape \(32, 48\)"):
    models.load_model(tmp_path)
  config_file.write_text(json.dumps(dataclasses.replace(GQA_CONFIG, tie_embeddings=True).to_dict()))
  with pytest.raises(ValueError, match=r"unexpected \['lm_head/kernel'\]"):
    models.load_model(tmp_path)
  (tmp_path / pretrained.WEIGHTS_FILE).unlink()
  with pytest.raises(FileNotFoundError, match="no weights.msgpack"):
    models.load_model(tmp_path)


@pytest.fixture(scope="module")
def tiny_model():
  return models.load_tiny()


def test_load_tiny_produces_the_saved_config(tiny_model):
  saved = json.loads((pretrained.tiny_model_dir() / pretrained.CONFIG_FILE).read_text())
  assert tiny_model.config == models.LlamaConfig.from_dict(saved)
  assert tiny_model.config.vocab_size == models.ByteTokenizer.vocab_size
  assert tiny_model.config.num_q_heads > tiny_model.config.num_kv_heads
  weights_bytes = (pretrained.tiny_model_dir() / pretrained.WEIGHTS_FILE).stat().st_size
  assert weights_bytes <= 5 * 2**20


def test_tiny_model_predicts_held_out_text(tiny_model):
  """The shipped weights are trained: uniform guessing scores 5.55 nats and
  letter frequencies alone about 3; the shipped model scores about 2.0."""
  tokenizer = models.ByteTokenizer()
  window = tiny_model.config.max_seq_len
  held_out = tokenizer.encode(models.tiny_corpus()[-4 * window :])
  targets = held_out.reshape(4, window)
  inputs = np.concatenate([np.full((4, 1), tokenizer.bos_id, np.int32), targets[:, :-1]], axis=1)
  positions = np.tile(np.arange(window, dtype=np.int32), (4, 1))
  logits, _ = _forward_fn(tiny_model)(inputs, positions)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  loss = -float(jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)))
  assert loss < 2.5
