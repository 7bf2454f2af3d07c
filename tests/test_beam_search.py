"""Beam search on the device against a plain beam search written here on a
dense cache, following Hugging Face transformers' rules (`num_beams=W`,
`length_penalty`, `early_stopping=False`)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import models
from tests.tiny_models import BYTE_LLAMA

# The byte Llama's shapes over a 40-token vocabulary.
MODEL_CONFIG = dataclasses.replace(BYTE_LLAMA, vocab_size=40)
CFG = pj.CacheConfig(
  block_size=4,
  num_gpu_blocks=48,
  num_cpu_blocks=32,
  max_seqs=8,
  max_blocks_per_seq=8,
  watermark=0.0,
  enable_prefix_caching=True,
)
MAX_TOKENS = 8
WIDTH = 24  # prompt + generated tokens, padded


@pytest.fixture(scope="module")
def model():
  return models.Llama(MODEL_CONFIG, rngs=nnx.Rngs(3))


@functools.partial(jax.jit, static_argnums=0)
def _last_logprobs(graphdef, params, tokens, lengths):
  """Log-probabilities after each row's tokens, through a fresh dense cache."""
  columns = jnp.arange(tokens.shape[1])[None, :]
  positions = jnp.where(columns < lengths[:, None], columns, -1)
  cache = models.init_dense_cache(MODEL_CONFIG, tokens.shape[0], WIDTH)
  logits, _ = nnx.merge(graphdef, params)(tokens, positions, cache)
  last = logits[jnp.arange(tokens.shape[0]), lengths - 1]
  return jax.nn.log_softmax(last.astype(jnp.float32), axis=-1)


def reference_beam_search(model, prompt, width, eos, length_penalty, max_tokens=MAX_TOKENS):
  """Hugging Face's beam search, one step at a time on the host.

  Returns:
    The best `width` hypotheses as `(tokens, sum_logprobs, stopped)`, best
    first; a stopped hypothesis ends with its EOS token.
  """
  graphdef, params = nnx.split(model)
  beams = [([], 0.0)]  # generated tokens, sum of logprobs
  hypotheses = []  # (score, tokens, sum_logprobs, stopped)

  def add(tokens, total, stopped):
    score = total / len(tokens) ** length_penalty
    worst = min(h[0] for h in hypotheses) if hypotheses else None
    if len(hypotheses) < width or score > worst:
      hypotheses.append((score, tokens, total, stopped))
      if len(hypotheses) > width:
        hypotheses.remove(min(hypotheses, key=lambda h: h[0]))

  for step in range(max_tokens):
    rows = np.zeros((width, WIDTH), np.int32)
    for i, (tokens, _) in enumerate(beams):
      seq = list(prompt) + tokens
      rows[i, : len(seq)] = seq
    lengths = np.full(width, len(prompt) + step, np.int32)
    logprobs = np.asarray(_last_logprobs(graphdef, params, rows, lengths))
    scores = np.full((width, logprobs.shape[1]), -np.inf, np.float32)
    for i, (_, total) in enumerate(beams):
      scores[i] = np.float32(total) + logprobs[i]
    top, order = jax.lax.top_k(jnp.asarray(scores.reshape(-1)), 2 * width)
    top, order = np.asarray(top), np.asarray(order)
    new_beams = []
    for rank, (score, index) in enumerate(zip(top, order)):
      beam, token = divmod(int(index), logprobs.shape[1])
      tokens = beams[beam][0] + [token]
      if token == eos:
        if rank < width:
          add(tokens, float(score), True)
      else:
        new_beams.append((tokens, float(score)))
      if len(new_beams) == width:
        break
    beams = new_beams
    length = step + 1
    if len(hypotheses) >= width and min(h[0] for h in hypotheses) >= (
      float(top[0]) / length**length_penalty
    ):
      break
  else:
    for tokens, total in beams:
      add(tokens, total, False)
  ordered = sorted(hypotheses, key=lambda h: -h[0])
  return [(tokens, total, stopped) for _, tokens, total, stopped in ordered]


def _eos_within_reach(model, prompt):
  """A token the greedy path draws within a few steps, so beams stop on it."""
  graphdef, params = nnx.split(model)
  rows = np.zeros((1, WIDTH), np.int32)
  rows[0, : len(prompt)] = prompt
  logprobs = _last_logprobs(graphdef, params, rows, np.array([len(prompt)], np.int32))
  return int(np.argsort(np.asarray(logprobs[0]))[-3])


PROMPTS = [[5, 9, 2, 7, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8, 8]]


# Over 10 s: the module's first engine compiles its decode loop with the beam
# step; the other tests of this config reuse it.
@pytest.fixture(scope="module")
def engine_results(model):
  """Every case through one engine (one compile), all requests at once."""
  cases = []
  for width in (1, 2, 4):
    for prompt in PROMPTS:
      cases.append((width, prompt, None, 1.0))
  eos = _eos_within_reach(model, PROMPTS[0])
  for width in (2, 4):
    for penalty in (1.0, 0.5, 2.0):
      cases.append((width, PROMPTS[0], eos, penalty))
  # One decode loop (every slot, as beam groups run): `decode_row_buckets=()`.
  engine = pj.LLMEngine(model, None, CFG, num_decode_steps=4, decode_row_buckets=())
  for i, (width, prompt, stop, penalty) in enumerate(cases):
    engine.add_request(
      str(i),
      prompt,
      pj.SamplingParams(
        n=width,
        use_beam_search=True,
        max_tokens=MAX_TOKENS,
        length_penalty=penalty,
        stop_token_ids=[] if stop is None else [stop],
      ),
    )
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      assert out.finished  # beams report once, at the end
      finals[out.request_id] = out
    pj.check_invariants(engine.state)
  assert engine.num_free_gpu_blocks() == CFG.num_gpu_blocks
  return cases, finals, engine.stats


def test_beams_equal_the_plain_beam_search(model, engine_results):
  cases, finals, _ = engine_results
  for i, (width, prompt, eos, penalty) in enumerate(cases):
    expected = reference_beam_search(model, prompt, width, -1 if eos is None else eos, penalty)
    got = finals[str(i)].outputs
    assert len(got) == width
    for out, (tokens, total, stopped) in zip(got, expected):
      assert out.token_ids == tokens, (i, width, eos, penalty)
      assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
      assert out.finish_reason == ("stop" if stopped else "length")


def test_beams_stop_on_eos_and_share_blocks(engine_results):
  cases, finals, stats = engine_results
  stopped = [
    o
    for i, c in enumerate(cases)
    if c[2] is not None
    for o in finals[str(i)].outputs
    if o.finish_reason == "stop"
  ]
  assert stopped, "no hypothesis ended with EOS: pick another EOS token"
  assert stats.cow_copies > 0  # beams forked and wrote shared partial blocks


def test_beam_search_refuses_what_it_cannot_serve(model):
  engine = pj.LLMEngine(model, None, CFG, max_beam_width=2)
  with pytest.raises(ValueError, match="n=3 beams exceed max_beam_width=2"):
    engine.add_request("a", [1, 2], pj.SamplingParams(n=3, use_beam_search=True))
  engine.add_request("b", [1], pj.SamplingParams(n=2, use_beam_search=True))
  (out,) = engine.step()
  assert out.outputs[0].finish_reason == "error"
  assert "at least 2 tokens" in out.error
  wide = pj.LLMEngine(model, None, CFG, max_beam_width=5)
  wide.add_request("c", [1, 2], pj.SamplingParams(n=5, use_beam_search=True))
  (out,) = wide.step()
  assert "5 beams need 9 sequence slots, the cache has max_seqs=8" in out.error


def test_beams_that_must_be_swapped_without_a_host_pool_raise(model):
  no_host = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=9,
    num_cpu_blocks=0,
    max_seqs=12,
    max_blocks_per_seq=8,
    watermark=0.0,
  )
  engine = pj.LLMEngine(model, None, no_host, num_decode_steps=4, decode_row_buckets=())
  for i, prompt in enumerate(PROMPTS[1:]):
    engine.add_request(
      str(i), prompt, pj.SamplingParams(max_tokens=MAX_TOKENS, n=2, temperature=0.8, seed=i)
    )
  engine.add_request(
    "beams", PROMPTS[0], pj.SamplingParams(n=4, use_beam_search=True, max_tokens=MAX_TOKENS)
  )
  with pytest.raises(
    RuntimeError, match="beam-search request 'beams' must be preempted but the host pool"
  ):
    while engine.has_unfinished_requests():
      engine.step()


# Over 10 s: a cache config of its own (9 blocks and a host pool) compiles its programs.
def test_beams_survive_preemption_by_swap(model):
  # 9 blocks of 4 (what the 4 beams need alone) cannot hold them and the
  # sampled requests at once: the beams, latest to arrive, are swapped out
  # and back.
  tight = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=9,
    num_cpu_blocks=32,
    max_seqs=12,
    max_blocks_per_seq=8,
    watermark=0.0,
  )
  engine = pj.LLMEngine(model, None, tight, num_decode_steps=4, decode_row_buckets=())
  engine.add_request(
    "first", PROMPTS[1], pj.SamplingParams(max_tokens=MAX_TOKENS, n=2, temperature=0.8, seed=1)
  )
  engine.add_request(
    "second", PROMPTS[2], pj.SamplingParams(max_tokens=MAX_TOKENS, n=2, temperature=0.8, seed=2)
  )
  engine.add_request(
    "beams", PROMPTS[0], pj.SamplingParams(n=4, use_beam_search=True, max_tokens=MAX_TOKENS)
  )
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      finals[out.request_id] = out
    pj.check_invariants(engine.state)
  assert engine.stats.preemptions > 0 and engine.stats.swaps > 0
  expected = reference_beam_search(model, PROMPTS[0], 4, -1, 1.0)
  assert [o.token_ids for o in finals["beams"].outputs] == [tokens for tokens, _, _ in expected]
  assert engine.num_free_gpu_blocks() == tight.num_gpu_blocks


def test_aborting_beams_frees_their_blocks_and_slots(model):
  engine = pj.LLMEngine(
    model, None, CFG, num_decode_steps=4, decode_row_buckets=()
  )  # engine_results' programs
  engine.add_request(
    "beams", PROMPTS[1], pj.SamplingParams(n=4, use_beam_search=True, max_tokens=MAX_TOKENS)
  )
  engine.step()  # the beams have forked and hold blocks
  assert engine.num_free_gpu_blocks() < CFG.num_gpu_blocks
  engine.abort_request("beams")
  pj.check_invariants(engine.state)
  assert engine.num_free_gpu_blocks() == CFG.num_gpu_blocks
  assert sorted(engine.schedulers[0].free_slots) == list(range(CFG.max_seqs))
  (out,) = engine.step()
  assert out.finished and out.outputs[0].finish_reason == "abort"
  assert not engine.has_unfinished_requests()
