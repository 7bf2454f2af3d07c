"""Sampling inside a training loop: new weights without compiling, sleep and
wake, the log-probabilities a policy gradient needs, and padded rollouts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import compile_guard, models
from paged_jax.engine import memory, weights
from paged_jax.sampling import RowParams, sampling_logits
from tests.tiny_models import BYTE_LLAMA

CFG = pj.CacheConfig(
  block_size=4,
  num_gpu_blocks=64,
  num_cpu_blocks=8,
  max_seqs=8,
  max_blocks_per_seq=16,
  enable_prefix_caching=True,
)
TOKENIZER = models.ByteTokenizer()
PROMPT = "THE DEVIL'S DICTIONARY: CAT, n. "  # 32 bytes: 8 full blocks
GREEDY = pj.SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = pj.SamplingParams(
  max_tokens=10, temperature=0.8, top_k=40, top_p=0.9, n=3, seed=11, ignore_eos=True
)


def _model(seed: int):
  return models.Llama(BYTE_LLAMA, rngs=nnx.Rngs(seed))


def _llm(model):
  return pj.LLM(model, TOKENIZER, CFG, num_decode_steps=4, decode_row_buckets=())


@pytest.fixture(scope="module")
def llm():
  """One LLM for the module; it holds the only reference to its weights
  (those of `_model(0)`), so that sleeping at level 2 frees them."""
  return _llm(_model(0))


@pytest.fixture(autouse=True)
def weights_of_model_0(llm):
  """Every test starts from the weights of `_model(0)`, awake."""
  llm.wake_up()
  llm.update_weights(nnx.state(_model(0)))


def _tokens(llm, prompt=PROMPT, params=GREEDY):
  return [o.token_ids for o in llm.generate(prompt, params)[0].outputs]


def _hits(llm) -> int:
  return int(np.asarray(llm.engine.cache_manager.state.num_hits).sum())


# update_weights.
def test_new_weights_serve_as_a_fresh_engine_would_without_compiling(llm):
  before = _tokens(llm)
  with compile_guard.count_compiles() as compiles:
    for seed in range(10):
      llm.update_weights(nnx.state(_model(seed % 2 + 1)))
    after = _tokens(llm)
  assert compiles == []
  assert after == _tokens(_llm(_model(2)))
  assert after != before


def test_update_weights_drops_the_prefix_cache(llm):
  _tokens(llm)
  hits = _hits(llm)
  _tokens(llm)
  assert _hits(llm) > hits  # the same weights: the prompt's full blocks hit
  hits = _hits(llm)
  llm.update_weights(nnx.state(_model(0)))
  _tokens(llm)
  assert _hits(llm) == hits  # new weights (equal or not): nothing hits


def test_float32_weights_are_cast_to_the_engine_dtype_and_placed_on_its_sharding():
  engine_params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(_model(0)))
  given = nnx.state(_model(1))
  new = weights.replace(engine_params, given)
  for path, leaf in weights.flat_weights(new).items():
    like = weights.flat_weights(engine_params)[path]
    assert leaf.dtype == jnp.bfloat16 and leaf.sharding == like.sharding, path
    np.testing.assert_array_equal(leaf, weights.flat_weights(given)[path].astype(jnp.bfloat16))


def test_a_pure_dict_of_weights_is_accepted(llm):
  llm.update_weights(nnx.to_pure_dict(nnx.state(_model(2))))
  assert _tokens(llm) == _tokens(_llm(_model(2)))


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda d: d.pop("final_norm"), "'final_norm/scale' is missing"),
    (lambda d: d.update(extra={"w": np.zeros(2)}), "'extra/w' is not in the model"),
    (
      lambda d: d["embed"].update(embedding=np.zeros((258, 8), np.float32)),
      r"'embed/embedding' has shape \(258, 8\), the model \(258, 16\)",
    ),
  ],
)
def test_mismatched_weights_name_the_first_wrong_path(llm, change, message):
  before = _tokens(llm)
  pure = nnx.to_pure_dict(nnx.state(_model(1)))
  change(pure)
  with pytest.raises(pj.WeightsMismatchError, match=message):
    llm.update_weights(pure)
  assert _tokens(llm) == before  # nothing changed


def test_nan_weights_are_refused_unless_unchecked(llm):
  pure = nnx.to_pure_dict(nnx.state(_model(1)))
  pure["final_norm"]["scale"] = pure["final_norm"]["scale"].at[3].set(jnp.nan)
  with pytest.raises(pj.NonFiniteWeightsError, match="'final_norm/scale' has a NaN"):
    llm.update_weights(pure)
  llm.update_weights(pure, check_finite=False)


def test_update_weights_refuses_while_requests_run_unless_told_to_abort(llm):
  engine = llm.engine
  engine.add_request("running", PROMPT, GREEDY)
  engine.step()
  with pytest.raises(pj.EngineStateError, match="1 request.*'running'.*abort_running=True"):
    engine.update_weights(nnx.state(_model(2)))
  engine.update_weights(nnx.state(_model(2)), abort_running=True)
  (out,) = engine.step()
  assert out.request_id == "running" and out.outputs[0].finish_reason == "abort"
  assert not engine.has_unfinished_requests()
  assert engine.num_free_gpu_blocks() == CFG.num_gpu_blocks
  assert _tokens(llm) == _tokens(_llm(_model(2)))


# Sleep and wake.
def test_sleep_frees_the_pages_and_waking_serves_the_same_without_compiling(llm):
  expected = _tokens(llm, params=SAMPLED)
  kv_bytes = sum(a.nbytes for a in jax.tree.leaves(llm.engine.cache_manager.kv))
  for cycle in range(2):
    with compile_guard.count_compiles() as compiles:
      before, source = memory.bytes_in_use()
      freed = llm.sleep(level=1)
      after, _ = memory.bytes_in_use()
      llm.wake_up()
      assert llm.engine.num_free_gpu_blocks() == CFG.num_gpu_blocks
      assert _tokens(llm, params=SAMPLED) == expected
    assert freed == kv_bytes
    if source == "live_arrays":  # CPU: exact
      assert before - after == kv_bytes
    if cycle:  # the first sleep compiles the program that zeroes pages
      assert compiles == []


def test_sleep_level_2_also_frees_the_weights_and_wake_restores_them(llm):
  expected = _tokens(llm)
  llm.update_weights(nnx.state(_model(0)))  # the engine's own arrays
  weight_bytes = sum(a.nbytes for a in jax.tree.leaves(llm.engine.runner.params))
  kv_bytes = sum(a.nbytes for a in jax.tree.leaves(llm.engine.cache_manager.kv))
  before, source = memory.bytes_in_use()
  freed = llm.sleep(level=2)
  after, _ = memory.bytes_in_use()
  assert freed == kv_bytes + weight_bytes
  if source == "live_arrays":
    assert before - after == freed
  with pytest.raises(pj.EngineStateError, match="level 2; call wake_up"):
    llm.update_weights(nnx.state(_model(1)))
  with compile_guard.count_compiles() as compiles:
    llm.wake_up()
    assert _tokens(llm) == expected
  assert compiles == []


def test_sleeping_twice_and_serving_asleep_are_errors_waking_awake_is_a_no_op(llm):
  llm.wake_up()  # awake: nothing happens
  assert _tokens(llm) == _tokens(llm)
  llm.sleep(1)
  with pytest.raises(pj.EngineStateError, match="already asleep at level 1"):
    llm.sleep(2)
  with pytest.raises(pj.EngineStateError, match="add_request: the engine sleeps"):
    llm.generate(PROMPT, GREEDY)
  with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
    _llm(_model(0)).sleep(3)


def test_sleep_refuses_while_requests_run(llm):
  engine = llm.engine
  engine.add_request("busy", PROMPT, GREEDY)
  with pytest.raises(pj.EngineStateError, match="sleep: 1 request"):
    engine.sleep()
  engine.abort_request("busy")
  engine.step()
  engine.sleep()


# Log-probabilities.
def _dense_logits(prompt_ids, token_ids) -> np.ndarray:
  """float32 `[len(token_ids), vocab]`: the logits each generated token was
  drawn from, by one dense forward pass of `_model(0)` over all tokens."""
  ids = np.concatenate([prompt_ids, token_ids]).astype(np.int32)
  logits, _ = _model(0)(ids[None])
  return np.asarray(logits[0, prompt_ids.size - 1 : -1], np.float32)


def _processed(logits, params: pj.SamplingParams) -> np.ndarray:
  rows = logits.shape[0]
  row_params = RowParams(
    temperature=jnp.full(rows, params.temperature, jnp.float32),
    top_k=jnp.full(rows, params.top_k, jnp.int32),
    top_p=jnp.full(rows, params.top_p, jnp.float32),
    key_data=jnp.zeros((rows, 2), jnp.uint32),
    stop_ids=jnp.full((rows, 1), -1, jnp.int32),
    processed=jnp.ones(rows, bool),
    wants_top=jnp.zeros(rows, bool),
  )
  return np.asarray(sampling_logits(jnp.asarray(logits), row_params))


@pytest.mark.parametrize("mode", ["raw", "processed", "processed_logprobs"])
def test_token_logprobs_match_a_dense_forward_pass(llm, mode):
  params = dataclasses.replace(SAMPLED, logprobs_mode=mode, logprobs=2)
  (out,) = llm.generate(PROMPT, params)
  for completion in out.outputs:
    logits = _dense_logits(out.prompt_token_ids, completion.token_ids)
    if params.logprobs_mode == "processed":
      logits = _processed(logits, params)
    expected = np.take_along_axis(
      np.asarray(jax.nn.log_softmax(logits, axis=-1)), np.array(completion.token_ids)[:, None], -1
    )[:, 0]
    lp = completion.token_logprobs
    assert isinstance(lp, np.ndarray) and lp.dtype == np.float32 and lp.shape == (10,)
    np.testing.assert_allclose(lp, expected, atol=1e-4)
    assert completion.cumulative_logprob == pytest.approx(float(lp.sum()), abs=1e-4)
    assert [d[t] for d, t in zip(completion.logprobs, completion.token_ids)] == pytest.approx(
      lp.tolist(), abs=1e-6
    )
  raw = llm.generate(PROMPT, dataclasses.replace(params, logprobs_mode="raw"))[0]
  assert [c.token_ids for c in raw.outputs] == [c.token_ids for c in out.outputs]
  differ = not np.allclose(raw.outputs[0].token_logprobs, out.outputs[0].token_logprobs)
  assert differ == (params.logprobs_mode == "processed")


def test_logprobs_mode_is_checked():
  assert pj.SamplingParams(logprobs_mode="raw_logprobs").logprobs_mode == "raw"
  with pytest.raises(ValueError, match="logprobs_mode must be one of"):
    pj.SamplingParams(logprobs_mode="sampled")
  spec = pj.LLM(
    _model(0), TOKENIZER, CFG, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
  )
  with pytest.raises(ValueError, match="logprobs_mode='processed' does not run with speculative"):
    spec.generate(PROMPT, pj.SamplingParams(logprobs_mode="processed"))


# Rollouts.
def test_rollout_pads_samples_into_arrays_and_shares_prompt_blocks(llm):
  prompts = [PROMPT, "WAR, n. "]  # 8 and 2 blocks
  params = pj.SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
  # Sample 0 of prompt 0 draws the same tokens again, so it stops at its 6th.
  stop = int(pj.rollout(llm, prompts, n=4, params=params).tokens[0, 0, 5])
  params = dataclasses.replace(params, stop_token_ids=[stop])
  copies = llm.engine.stats.cow_copies
  rollout = pj.rollout(llm, prompts, n=4, params=params)
  assert rollout.tokens.shape == rollout.mask.shape == rollout.logprobs.shape == (2, 4, 12)
  assert rollout.tokens.dtype == np.int32 and rollout.logprobs.dtype == np.float32
  for p, out in enumerate(rollout.outputs):
    assert rollout.prompt_token_ids[p].tolist() == list(TOKENIZER.encode(prompts[p]))
    for c in out.outputs:
      size = len(c.token_ids)
      assert rollout.mask[p, c.index].tolist() == [True] * size + [False] * (12 - size)
      assert rollout.tokens[p, c.index, :size].tolist() == c.token_ids
      np.testing.assert_array_equal(rollout.logprobs[p, c.index, :size], c.token_logprobs)
  assert rollout.mask[0, 0].sum() <= 6  # a sample that stopped early
  assert rollout.logprobs[~rollout.mask].tolist() == [0.0] * int((~rollout.mask).sum())
  copied = llm.engine.stats.cow_copies - copies
  assert rollout.blocks_saved == 3 * (8 + 2) - copied > 0
  assert llm.rollout(prompts, 4, params).tokens.tolist() == rollout.tokens.tolist()


def test_rollout_refuses_beam_search(llm):
  with pytest.raises(ValueError, match="use_beam_search returns no per-token"):
    pj.rollout(llm, [PROMPT], 2, pj.SamplingParams(use_beam_search=True))


def test_request_output_arrays_pad_each_sequence(llm):
  (out,) = llm.generate(PROMPT, dataclasses.replace(SAMPLED, max_tokens=6))
  tokens, mask, logprobs = out.arrays(8)
  assert tokens.shape == mask.shape == logprobs.shape == (3, 8)
  for row, c in enumerate(out.outputs):
    assert tokens[row].tolist() == c.token_ids + [0, 0]
    assert mask[row].tolist() == [True] * 6 + [False] * 2
    assert logprobs[row].tolist() == c.token_logprobs.tolist() + [0.0, 0.0]
  assert out.arrays()[0].shape == (3, 6)
  with pytest.raises(ValueError, match="sequence 0: 6 tokens do not fit 5"):
    out.arrays(5)


def test_reset_prefix_cache_refuses_while_requests_run(llm):
  engine = llm.engine
  engine.add_request("holding", PROMPT, GREEDY)
  engine.step()
  with pytest.raises(pj.EngineStateError, match="reset_prefix_cache: 1 request"):
    engine.reset_prefix_cache()
  engine.abort_request("holding")
  engine.step()
  engine.reset_prefix_cache()
