"""Warm-up compiles every program the engine launches: a randomized online trace
after it compiles nothing (the guard names any program that does)."""

import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import compile_guard, models
from tests.tiny_models import BYTE_LLAMA

MODEL_CONFIG = BYTE_LLAMA
# 12 blocks of 4 do not hold every request at once: the trace preempts.
CFG = pj.CacheConfig(
  block_size=4,
  num_gpu_blocks=12,
  num_cpu_blocks=24,
  max_seqs=6,
  max_blocks_per_seq=16,
  watermark=0.0,
  enable_prefix_caching=True,
)
TOKENIZER = models.ByteTokenizer()
SHARED = "THE DEVIL'S DICTIONARY "


@pytest.fixture(scope="module")
def model():
  return models.Llama(MODEL_CONFIG, rngs=nnx.Rngs(1))


def _engine(model, mode):
  return pj.LLMEngine(
    model,
    TOKENIZER,
    CFG,
    max_num_seqs=4,
    max_num_batched_tokens=48,
    preemption_mode=mode,
    max_logprobs=2,
    max_beam_width=2,
    prefill_width=16,
    warmup=True,
  )


def _random_params(rng):
  kind = rng.integers(5)
  common = dict(max_tokens=int(rng.integers(4, 20)), ignore_eos=bool(rng.integers(2)))
  if kind == 0:
    return pj.SamplingParams(n=2, use_beam_search=True, **common)
  return pj.SamplingParams(
    n=int(rng.integers(1, 3)),
    temperature=float(rng.choice([0.0, 0.8])),
    top_k=int(rng.choice([0, 5])),
    seed=int(rng.integers(100)),
    stop=["E, "] if kind == 1 else None,
    logprobs=2 if kind == 2 else None,
    prompt_logprobs=1 if kind == 3 else None,
    **common,
  )


def _random_prompt(rng):
  length = int(rng.integers(2, 24))
  text = "".join(rng.choice(list("ABCDEFGHIJ, ."), length))
  return SHARED + text if rng.integers(2) else text


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_serving_after_warmup_compiles_nothing(model, mode):
  engine = _engine(model, mode)
  assert engine.num_free_gpu_blocks() == CFG.num_gpu_blocks  # warm-up changed nothing
  pj.check_invariants(engine.state)
  rng = np.random.default_rng(0 if mode == "recompute" else 1)
  finished = 0
  with compile_guard.no_compiles(f"a {mode} trace after warm-up"):
    for i in range(14):
      engine.add_request(str(i), _random_prompt(rng), _random_params(rng))
      if i == 5:
        engine.abort_request("3")
      for out in engine.step():
        finished += out.finished
    engine.add_request("1 token", "A", pj.SamplingParams(max_tokens=3))
    while engine.has_unfinished_requests():
      finished += sum(out.finished for out in engine.step())
  assert finished == 15
  assert engine.stats.preemptions > 0
  assert engine.stats.prefix_cache_hit_rate > 0
  assert engine.num_free_gpu_blocks() == CFG.num_gpu_blocks


def test_compiled_programs_lists_the_bucket_set(model):
  engine = pj.LLMEngine(
    model, TOKENIZER, CFG, max_num_seqs=4, max_num_batched_tokens=48, prefill_width=16
  )
  # ceil(48 / 16) + 4 = 7 rows at most: buckets 1, 2, 4, 8.
  assert engine.compiled_programs()[:4] == [f"prefill {r}x16 tokens" for r in (1, 2, 4, 8)]
  assert "decode loop with beams" in engine.compiled_programs()
