"""The engine on a hybrid cache (`hybrid_kv_cache=True`): one block table
and pool per attention type, so Gemma's sliding layers hold only their
window. Greedy tokens equal dense decoding's past the windows, in both
preemption modes and with prefix caching, and with speculative decoding
(prompt lookup, draft models whose layers join the target's types); the
pools come from one byte budget; what it cannot serve is refused, naming
the numbers."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import compile_guard, models
from paged_jax.block_manager.hybrid import check_hybrid_invariants, gpu_blocks_for_budget
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.engine_checks import draft_layer_windows, hybrid_cache
from paged_jax.models.dense import generate_dense
from paged_jax.params import SamplingParams
from tests.checkpoint_files import write_hf
from tests.family_checkpoints import FAMILIES, FORMATS
from tests.test_families_windows import WINDOWED, _tiny

# Gemma's shape: a sliding layer (window 8) and a global one.
GEMMA = WINDOWED["gemma_hybrid_window_8"]


def _cfg(**changes):
  fields = dict(
    block_size=4, num_gpu_blocks=12, num_cpu_blocks=32, max_seqs=4, max_blocks_per_seq=16
  )
  return pj.CacheConfig(**{**fields, **changes})


def test_the_pools_come_from_one_byte_budget_and_bad_input_names_the_numbers():
  model = _tiny(GEMMA, seed=0)  # 2 KV heads of 8 float32: 512 bytes per block and layer
  unsized = _cfg(num_gpu_blocks=pj.CacheConfig.num_gpu_blocks)
  engine = pj.LLMEngine(model, None, unsized, hybrid_kv_cache=True, kv_cache_memory_bytes=40_000)
  hybrid = engine.cache_manager.hybrid
  # Chunks of 4 (half the window): the sliding layer keeps its last 8 + 4 - 1 positions.
  assert hybrid.layer_windows == (11, None) and engine.cache_manager.max_chunk == 4
  expected = gpu_blocks_for_budget(
    (11, None),
    block_size=4,
    layer_block_bytes=512,
    budget_bytes=40_000,
    max_tokens=64,
    extra_blocks=1,
  )
  assert hybrid.gpu_blocks == expected and expected[0] > 2 * expected[1]
  assert engine.cfg.num_gpu_blocks == sum(expected) == engine.num_free_gpu_blocks()
  assert engine.cache_manager.kv.nbytes <= 40_000
  # One sequence of 64 tokens: 16 global blocks and 5 sliding ones, 512 bytes each.
  with pytest.raises(
    ValueError,
    match=r"kv_cache_memory_bytes=10000 holds no sequence of 64 tokens: it needs 10752 bytes "
    r"\(16 blocks in each of 1 layers, 5 blocks in each of 1 layers; 512 bytes",
  ):
    pj.LLMEngine(model, None, unsized, hybrid_kv_cache=True, kv_cache_memory_bytes=10_000)
  with pytest.raises(ValueError, match="cache_config.num_gpu_blocks is 12: give one of them"):
    pj.LLMEngine(model, None, _cfg(), hybrid_kv_cache=True, kv_cache_memory_bytes=40_000)
  with pytest.raises(ValueError, match="kv_cache_memory_bytes must be a positive int, got 0"):
    pj.LLMEngine(model, None, unsized, hybrid_kv_cache=True, kv_cache_memory_bytes=0)
  with pytest.raises(ValueError, match="cache_config.sliding_window must be None"):
    pj.LLMEngine(model, None, _cfg(sliding_window=12), hybrid_kv_cache=True)
  with pytest.raises(ValueError, match="hybrid_kv_cache runs on one device: pass mesh=None"):
    pj.LLMEngine(model, None, _cfg(), hybrid_kv_cache=True, mesh=_one_device_mesh())
  # Without a budget, every type's pool has the config's blocks; a request
  # that can never fit names the type whose pool is short.
  small = pj.LLMEngine(model, None, _cfg(num_gpu_blocks=6), hybrid_kv_cache=True)
  assert small.cache_manager.hybrid.gpu_blocks == (6, 6) and small.cfg.num_gpu_blocks == 12
  reason = small.admission_error(20, pj.SamplingParams(max_tokens=20))
  assert reason.startswith("in the global type's pool: needs 10 GPU blocks"), reason


def _one_device_mesh():
  return jax.make_mesh((1, 1), ("data", "model"), devices=jax.devices()[:1])


# A draft with other heads than the target's: a sliding layer of window 4
# (it joins the target's window-8 type) and a global one (the global type).
NARROW_DRAFT = models.LlamaConfig(
  vocab_size=61,
  num_layers=2,
  num_q_heads=2,
  num_kv_heads=1,
  head_dim=4,
  hidden=16,
  mlp_hidden=24,
  max_seq_len=64,
  tie_embeddings=True,
  sliding_window=4,
  layer_types=("sliding_attention", "full_attention"),
)


def test_draft_layers_join_the_narrowest_type_that_keeps_their_window():
  assert draft_layer_windows([8, None], [4, None, 8]) == (8, None, 8)
  assert draft_layer_windows([8, 16, None], [None, 12, 2, 20]) == (None, 16, 8, None)
  assert draft_layer_windows([8, 16], [3, 16]) == (8, 16)
  with pytest.raises(
    ValueError,
    match=r"draft layer 1 attends to the whole context, but no attention type of the model "
    r"keeps that many keys \(its types: sliding window 8, sliding window 16\)",
  ):
    draft_layer_windows([8, 16], [8, None])
  with pytest.raises(ValueError, match="draft layer 0 attends to a window of 17, but no attention"):
    draft_layer_windows([8, 16], [17])


def test_speculation_on_a_hybrid_cache_sizes_its_types_and_refuses_what_no_type_serves():
  model = _tiny(GEMMA, seed=0)
  # 5 proposals: a step's calls take 6 tokens, more than the prompt chunks
  # of 4, so the sliding type keeps 8 + 6 - 1 positions and prompts run in 6.
  hybrid, _, chunk, draft_windows = hybrid_cache(_cfg(), model.config, lookahead=5)
  assert hybrid.layer_windows == (13, None) and chunk == 6 and draft_windows is None
  # A draft's layers sit after the target's in their types' pages, and count
  # in the budget: 512 bytes per block and layer of the target, 128 of the draft.
  draft = models.Llama(NARROW_DRAFT, rngs=nnx.Rngs(1))
  spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
  unsized = _cfg(num_gpu_blocks=pj.CacheConfig.num_gpu_blocks)
  engine = pj.LLMEngine(
    model,
    None,
    unsized,
    hybrid_kv_cache=True,
    kv_cache_memory_bytes=40_000,
    speculative_config=spec,
  )
  manager = engine.cache_manager
  assert manager.hybrid.layer_windows == (11, None) and manager.kv.num_layers == 4
  for pages, blocks in zip(manager.kv.types, manager.hybrid.gpu_blocks):  # (heads, blocks, ...)
    assert [k.shape for k in pages.k] == [(2, blocks, 4, 8), (1, blocks, 4, 4)]
  expected = gpu_blocks_for_budget(
    (11, None, 11, None),
    block_size=4,
    layer_block_bytes=(512, 512, 128, 128),
    budget_bytes=40_000,
    max_tokens=64,
    extra_blocks=1,
  )
  assert manager.hybrid.gpu_blocks == expected and manager.kv.nbytes <= 40_000
  with pytest.raises(ValueError, match=r"it needs 13440 bytes \(16 blocks in each of 2 layers, 5 "):
    pj.LLMEngine(
      model,
      None,
      unsized,
      hybrid_kv_cache=True,
      kv_cache_memory_bytes=10_000,
      speculative_config=spec,
    )
  # A global draft layer on a target whose every layer slides: no type keeps its keys.
  mistral = _tiny(WINDOWED["mistral_window_8"], seed=0)
  with pytest.raises(ValueError, match="draft layer 1 attends to the whole context"):
    pj.LLMEngine(mistral, None, _cfg(), hybrid_kv_cache=True, speculative_config=spec)
  without_windows = {**spec, "model": SimpleNamespace(config=SimpleNamespace(vocab_size=61))}
  with pytest.raises(ValueError, match="the draft model's config has no layer_window"):
    pj.LLMEngine(model, None, _cfg(), hybrid_kv_cache=True, speculative_config=without_windows)


def test_a_hybrid_cache_manager_needs_each_draft_layers_type():
  model = _tiny(GEMMA, seed=0)
  hybrid = hybrid_cache(_cfg(), model.config)[0]
  kwargs = dict(hybrid=hybrid, draft_config=NARROW_DRAFT)
  with pytest.raises(ValueError, match="draft_layer_windows must give each of the draft's 2"):
    CacheManager(hybrid.cache, model.config, **kwargs, draft_layer_windows=(None,))
  with pytest.raises(ValueError, match="no layer declares the attention type sliding window 5"):
    CacheManager(hybrid.cache, model.config, **kwargs, draft_layer_windows=(5, None))
  with pytest.raises(ValueError, match="a hybrid cache runs on one device: pass mesh=None"):
    CacheManager(hybrid.cache, model.config, hybrid=hybrid, mesh=_one_device_mesh())


def _serve_checking_windows(llm, prompts, params, first_id=0):
  """`llm.generate`'s outputs, stepping by hand: no step compiles a
  program (the engine was warmed up), and after every step the hybrid
  state's invariants hold and no sequence holds more blocks in a sliding
  type than its window, a chunk and one block more."""
  engine = llm.engine
  for i, prompt in enumerate(prompts):
    engine.add_request(str(first_id + i), prompt, params)
  hybrid, finals = engine.cache_manager.hybrid, {}
  bound = {
    g: hybrid.cache.blocks_for(w) + 1 + hybrid.cache.blocks_for(engine.cache_manager.max_chunk)
    for g, w in enumerate(hybrid.windows)
    if w is not None
  }
  while engine.has_unfinished_requests():
    with compile_guard.no_compiles("a step on a hybrid cache after warm-up"):
      outs = engine.step()
    for out in outs:
      if out.finished:
        finals[int(out.request_id) - first_id] = out
    state = jax.device_get(engine.state)
    check_hybrid_invariants(state)
    for g, most in bound.items():
      held = (np.asarray(state.groups[g].tables) >= 0).sum(axis=1)
      assert held.max() <= most, (g, held, most)
  return [finals[i] for i in range(len(prompts))]


@pytest.mark.slow  # compiles the engine's programs for each model (~100 s at load 10)
@pytest.mark.parametrize(
  "family, config_format, preemption_mode",
  [("gemma2", "transformers4", "recompute"), ("gemma3", "transformers5", "swap")],
)
def test_gemma_on_per_type_tables_decodes_as_the_dense_model_past_its_windows(
  family, config_format, preemption_mode, family_weights, tmp_path, bpe
):
  """Tiny Gemma 2 and 3 checkpoints (windows of 4, sequences of 7 to 8
  windows), prefix caching on with a shared prefix of two windows, 12
  blocks per type: sequences are preempted, the sliding layers' pools
  never hold more than their windows, and nothing compiles after warm-up."""
  hf = FORMATS[config_format](FAMILIES[family])
  folder = write_hf(tmp_path / family, hf, family_weights[family], bpe)
  model, _ = models.load_pretrained(folder, dtype="float32", max_seq_len=64)
  rng = np.random.default_rng(7)
  shared = rng.integers(0, 300, 8)
  prompts = [np.concatenate([shared, rng.integers(0, 300, n)]).astype(np.int32) for n in (2, 5, 3)]
  llm = pj.LLM(
    model,
    None,
    _cfg(enable_prefix_caching=True),
    max_num_batched_tokens=8,
    num_decode_steps=4,
    preemption_mode=preemption_mode,
    decode_row_buckets=(),
    hybrid_kv_cache=True,
    warmup=True,
  )
  outputs = _serve_checking_windows(llm, prompts, pj.SamplingParams(max_tokens=20))
  dense = generate_dense(model, prompts, SamplingParams(max_tokens=20), jax.random.key(0))
  for output, expected in zip(outputs, dense):
    np.testing.assert_array_equal(output.outputs[0].token_ids, expected)
  stats = llm.engine.stats
  assert stats.preemptions > 0
  assert (stats.swaps > 0) == (preemption_mode == "swap")
  assert stats.prefix_cache_hit_rate > 0
  assert llm.engine.num_free_gpu_blocks() == llm.engine.cfg.num_gpu_blocks


@pytest.mark.slow  # compiles each engine's programs (~2 to 5 minutes each at load 10 to 20)
@pytest.mark.parametrize("proposer", ["ngram", "the target as its draft", "a narrow draft"])
def test_speculation_on_per_type_tables_decodes_as_plain_and_dense_past_the_windows(proposer):
  """The tiny Gemma-shaped model (window 8) with prefix caching, 16 blocks
  per type for sequences of 6 to 7 windows (they preempt): greedy tokens
  with speculation equal dense decoding's, and prompt lookup's equal the same
  engine's plain launches. 5 proposals widen the sliding type (8 + 6 - 1
  positions kept); the target as its own draft has every layer of its draft
  in the target's types and accepts almost every proposal (its draft's K/V
  equal the target's); the narrow draft's window-4 and global layers, with
  other heads, join the window-8 and global types. After every step the
  invariants hold, the sliding pools hold at most their windows and nothing
  compiles."""
  model = _tiny(GEMMA, seed=0)
  spec = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "adaptive": True},
    "the target as its draft": {"method": "draft_model", "model": model},
    "a narrow draft": {
      "method": "draft_model",
      "model": models.Llama(NARROW_DRAFT, rngs=nnx.Rngs(1)),
    },
  }[proposer]
  spec = {"num_speculative_tokens": 3, "adaptive": False, **spec}
  rng = np.random.default_rng(7)
  shared = rng.integers(0, 61, 8)
  prompts = [np.concatenate([shared, rng.integers(0, 61, n)]).astype(np.int32) for n in (2, 5, 3)]
  params = pj.SamplingParams(max_tokens=40)
  llm = pj.LLM(
    model,
    None,
    _cfg(num_gpu_blocks=16, enable_prefix_caching=True),
    max_num_batched_tokens=8,
    num_decode_steps=4,
    preemption_mode="swap",
    decode_row_buckets=(),
    hybrid_kv_cache=True,
    speculative_config=spec,
    warmup=True,
  )
  engine = llm.engine
  dense = generate_dense(model, prompts, SamplingParams(max_tokens=40), jax.random.key(0))
  runs = [True, False] if proposer == "ngram" else [True]  # speculating launches, then plain
  for speculate in runs:
    if engine._chooser is not None:
      engine._chooser.speculate = lambda num_rows: speculate
    drafts_before = engine.stats.spec_decode_num_draft_tokens
    outputs = _serve_checking_windows(llm, prompts, params, first_id=10 * speculate)
    for output, expected in zip(outputs, dense):
      np.testing.assert_array_equal(output.outputs[0].token_ids, expected)
    assert (engine.stats.spec_decode_num_draft_tokens > drafts_before) == speculate
  stats = engine.stats
  assert stats.preemptions > 0 and stats.swaps > 0 and stats.prefix_cache_hit_rate > 0
  if proposer == "ngram":  # the model repeats itself: lookup finds what it draws
    assert stats.spec_decode_num_accepted_tokens > 0
  if proposer == "the target as its draft":
    assert stats.spec_decode_acceptance_rate > 0.9
  assert engine.num_free_gpu_blocks() == engine.cfg.num_gpu_blocks
