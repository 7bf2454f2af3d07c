"""Windowed models (Mistral's sliding window, Gemma's sliding and global
layers) on the paged cache: greedy decoding equals the dense cache's past
the window, and a cache that frees blocks outside its window serves what
stays inside it and refuses what would read beyond.
"""

import dataclasses
import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import compile_guard, models
from paged_jax.models.dense import generate_dense
from paged_jax.models.layers import LinearRopeScaling
from paged_jax.paged_cache import PagedCache
from paged_jax.params import SamplingParams
from tests.checkpoint_files import _forward, write_hf
from tests.family_checkpoints import (
  ATOL,
  FAMILIES,
  TOKEN_IDS,
  TOKENS,
)
from tests.reference.block_manager import ReferenceBlockSpaceManager
from tests.reference.decoder import reference_logits

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


# CI runs the Gemma-shaped model: its sliding layers mask the same window as
# Mistral's every layer does (and it has global layers and soft caps too);
# Mistral's windows run in CI on the cache that frees blocks, below.
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize(
  "name", [pytest.param("mistral_window_8", marks=pytest.mark.slow), "gemma_hybrid_window_8"]
)
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


@pytest.mark.slow  # compiles the engine's programs for a windowed cache with prefix caching
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_cache_that_frees_blocks_caches_prefixes_longer_than_its_window(preemption_mode):
  """A Mistral-style model (every layer slides over 8 keys) on a cache that
  frees the blocks outside a window of 12, with prefix caching: four
  prompts share 24 tokens (two windows), so later prompts' chunks hit the
  blocks earlier ones registered, through entries that left the window. Few
  blocks, so a sequence is preempted and chunks wait for blocks. Greedy
  tokens equal dense decoding's."""
  model = _tiny(WINDOWED["mistral_window_8"], seed=3)
  rng = np.random.default_rng(6)
  shared = rng.integers(0, 61, 24)
  lengths = (3, 5, 2, 6)
  prompts = [np.concatenate([shared, rng.integers(0, 61, n)]).astype(np.int32) for n in lengths]
  cfg = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=14,
    num_cpu_blocks=16,
    max_seqs=4,
    max_blocks_per_seq=16,
    sliding_window=12,
    enable_prefix_caching=True,
  )
  llm = pj.LLM(
    model,
    None,
    cfg,
    max_num_batched_tokens=8,
    num_decode_steps=4,
    preemption_mode=preemption_mode,
    decode_row_buckets=(),
  )
  params = pj.SamplingParams(max_tokens=20, temperature=0.0)
  outputs = llm.generate(prompts, [params] * len(prompts))
  dense = generate_dense(model, prompts, SamplingParams(max_tokens=20), jax.random.key(0))
  for output, expected in zip(outputs, dense):
    np.testing.assert_array_equal(output.outputs[0].token_ids, expected)
  stats = llm.engine.stats
  assert stats.prefix_cache_hit_rate > 0.4
  assert stats.preemptions > 0


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
