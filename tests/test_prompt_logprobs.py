"""Prompt log-probabilities: prefill scores every prompt token, in chunks and on
prefix-cache hits, and equals the model's own log-softmax."""

import jax
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import models
from tests.tiny_models import BYTE_LLAMA_2_LAYERS

MODEL_CONFIG = BYTE_LLAMA_2_LAYERS
CFG = pj.CacheConfig(
  block_size=4,
  num_gpu_blocks=32,
  num_cpu_blocks=8,
  max_seqs=4,
  max_blocks_per_seq=16,
  enable_prefix_caching=True,
)
TOKENIZER = models.ByteTokenizer()
PROMPT = "THE DEVIL'S DICTIONARY: CAT, n. A soft"
TOP = 3


@pytest.fixture(scope="module")
def model():
  return models.Llama(MODEL_CONFIG, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def reference(model):
  """Each prompt token's log-probability and the top 3 from a full forward."""
  ids = np.asarray(TOKENIZER.encode(PROMPT), np.int32)
  logits, _ = model(ids[None])
  logprobs = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
  return ids, logprobs


def _engine(model, budget=256):
  return pj.LLMEngine(
    model,
    TOKENIZER,
    CFG,
    max_num_batched_tokens=budget,
    max_logprobs=TOP,
    decode_row_buckets=(),  # one decode loop: packed rows are tested in test_engine
  )


@pytest.fixture(scope="module")
def engine(model):
  """One engine for the module (one compile of each program)."""
  return _engine(model)


def _serve(engine, request_id, params):
  engine.add_request(request_id, PROMPT, params)
  final = None
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.request_id == request_id and out.finished:
        final = out
  return final


def _check(prompt_logprobs, reference):
  ids, logprobs = reference
  assert len(prompt_logprobs) == ids.size and prompt_logprobs[0] is None
  for position in range(1, ids.size):
    entry, row = prompt_logprobs[position], logprobs[position - 1]
    token = int(ids[position])
    np.testing.assert_allclose(entry[token], row[token], atol=2e-5)
    best = set(np.argsort(-row)[:TOP].tolist())
    assert best <= set(entry) <= best | {token}
    for alternative in best:
      np.testing.assert_allclose(entry[alternative], row[alternative], atol=2e-5)


# Over 10 s: the first test on the module's engine compiles its prefill with scoring.
def test_prompt_logprobs_equal_the_models_log_softmax(engine, reference):
  out = _serve(engine, "one chunk", pj.SamplingParams(max_tokens=3, prompt_logprobs=TOP))
  _check(out.prompt_logprobs, reference)


def test_chunked_prefill_scores_every_chunk(model, reference):
  chunked = _engine(model, budget=8)
  out = _serve(chunked, "chunks", pj.SamplingParams(max_tokens=3, prompt_logprobs=TOP))
  _check(out.prompt_logprobs, reference)


def test_prompt_logprobs_on_prefix_cache_hits_keep_the_cache_intact(engine, reference):
  plain = pj.SamplingParams(max_tokens=6, ignore_eos=True)
  first = _serve(engine, "first", plain)
  assert first.prompt_logprobs is None
  scored = _serve(
    engine, "scored", pj.SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=TOP)
  )
  assert engine.stats.prefix_cache_hit_rate > 0  # the second prompt hit the first one's blocks
  _check(scored.prompt_logprobs, reference)
  again = _serve(engine, "again", plain)  # hits again: the blocks were not rewritten wrongly
  assert scored.outputs[0].token_ids == first.outputs[0].token_ids == again.outputs[0].token_ids
  assert engine.num_free_gpu_blocks() == CFG.num_gpu_blocks


def test_beam_search_also_returns_prompt_logprobs(engine, reference):
  params = pj.SamplingParams(n=2, use_beam_search=True, max_tokens=3, prompt_logprobs=0)
  out = _serve(engine, "beams", params)
  ids, logprobs = reference
  got = [entry[int(ids[i])] for i, entry in enumerate(out.prompt_logprobs) if i]
  want = [logprobs[i - 1, ids[i]] for i in range(1, ids.size)]
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_prompt_logprobs_are_checked(engine):
  with pytest.raises(ValueError, match="prompt_logprobs must be an int >= 0"):
    pj.SamplingParams(prompt_logprobs=-1)
  with pytest.raises(ValueError, match="prompt_logprobs=4 exceeds max_logprobs=3"):
    engine.add_request("x", PROMPT, pj.SamplingParams(prompt_logprobs=4))
  assert not engine.has_unfinished_requests()
