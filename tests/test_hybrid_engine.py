"""The engine on a hybrid cache (`hybrid_kv_cache=True`): one block table
and pool per attention type, so Gemma's sliding layers hold only their
window. Greedy tokens equal dense decoding's past the windows, in both
preemption modes and with prefix caching; the pools come from one byte
budget; what it cannot serve is refused, naming the numbers."""

import jax
import numpy as np
import pytest

import paged_jax as pj
from paged_jax import compile_guard, models
from paged_jax.block_manager.hybrid import check_hybrid_invariants, gpu_blocks_for_budget
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
  ngram = {"method": "ngram", "num_speculative_tokens": 2}
  with pytest.raises(ValueError, match="without speculative_config"):
    pj.LLMEngine(model, None, _cfg(), hybrid_kv_cache=True, speculative_config=ngram)
  # Without a budget, every type's pool has the config's blocks; a request
  # that can never fit names the type whose pool is short.
  small = pj.LLMEngine(model, None, _cfg(num_gpu_blocks=6), hybrid_kv_cache=True)
  assert small.cache_manager.hybrid.gpu_blocks == (6, 6) and small.cfg.num_gpu_blocks == 12
  reason = small.admission_error(20, pj.SamplingParams(max_tokens=20))
  assert reason.startswith("in the global type's pool: needs 10 GPU blocks"), reason


def _serve_checking_windows(llm, prompts, params):
  """`llm.generate`'s outputs, stepping by hand: no step compiles a
  program (the engine was warmed up), and after every step the hybrid
  state's invariants hold and no sequence holds more blocks in a sliding
  type than its window, a chunk and one block more."""
  engine = llm.engine
  for i, prompt in enumerate(prompts):
    engine.add_request(str(i), prompt, params)
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
        finals[int(out.request_id)] = out
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
