"""Randomized stateful traces of the engine: the safety net of its refactors.

Each trace (tests/engine_traces.py) is a seeded random sequence of
`add_request` (random prompt lengths, `n`, beam search, stop strings,
seeds, logprobs, `max_tokens`, now and then a request that can never fit),
`abort_request` and `step`, then steps until every request finished. After
every step: the block manager's invariants on every shard, no block in a
slot that no unfinished request holds, every request reports until it
finishes exactly once with a finish reason, and nothing after. Once the
trace drained every block is free, and each greedy, seeded or beam request
that was not aborted, served again alone on the same engine, gives the same
outputs (tokens, text, finish and stop reasons, log-probabilities).

Setups: test_engine's model and cache (`tests.tiny_models.ENGINE_CFG`: 14
GPU blocks of 4 tokens, so requests preempt one another; the two modules'
engines share their compiled programs), each preemption mode, prefix
caching off and on, prompts mixed with a decode step, and decode launches
dispatched ahead (`async_scheduling`). Each engine warms up first, and the traces run under
`compile_guard.no_compiles`: after warm-up, serving compiles nothing. The
two-data-shard setup runs in the 8-device subprocess of
tests/test_sharding.py (`test_random_traces_on_two_data_shards`), where its
engine's programs are already compiled.

CI runs one trace per setup with prefix caching on (the two setups without it
compile their own programs and are `slow`, run by the full suite). For a
longer run, set the number of traces per setup (seeds from each setup's
first seed on; a failure names its seed and the calls made):

    PAGED_JAX_RANDOM_TRACES=200 python -m pytest -q -p no:cacheprovider tests/test_engine_random.py

The engine internals the checks read are the functions at the top of
tests/engine_traces.py.
"""

import dataclasses
import os

import jax
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import compile_guard, models
from tests import engine_traces
from tests.tiny_models import BYTE_LLAMA, ENGINE_CFG

NUM_TRACES = int(os.environ.get("PAGED_JAX_RANDOM_TRACES", "1"))
SHAPE = engine_traces.TraceShape(max_prompt=24)


def cache_config(enable_prefix_caching: bool) -> pj.CacheConfig:
  return dataclasses.replace(ENGINE_CFG, enable_prefix_caching=enable_prefix_caching)


@pytest.fixture(scope="module")
def model():
  return models.Llama(BYTE_LLAMA, rngs=nnx.Rngs(0))


def make_engine(
  model, preemption_mode: str, enable_prefix_caching: bool, ahead=False
) -> pj.LLMEngine:
  """Engines of one cache config share their compiled programs, whatever the
  preemption mode (and with prefix caching, test_engine's too); `ahead`
  dispatches decode launches before reading the last one back
  (`async_scheduling`)."""
  return pj.LLMEngine(
    model,
    engine_traces.TOKENIZER,
    cache_config(enable_prefix_caching),
    max_num_batched_tokens=8,  # prompts go in chunks
    preemption_mode=preemption_mode,
    num_decode_steps=4,
    async_scheduling=ahead,
    warmup=True,
  )


@pytest.mark.parametrize(
  "preemption_mode, enable_prefix_caching, first_seed, ahead",
  [
    # Without prefix caching (its own programs, about 30 s of compiles): the full suite.
    pytest.param("recompute", False, 0, False, id="recompute", marks=pytest.mark.slow),
    pytest.param("swap", False, 1000, False, id="swap", marks=pytest.mark.slow),
    pytest.param("recompute", True, 2001, False, id="recompute-prefix-caching"),
    # CI: swap preemption in tests/test_engine.py's scheduling run (CI time).
    pytest.param("swap", True, 3006, False, id="swap-prefix-caching", marks=pytest.mark.slow),
    # Decode launches dispatched ahead of reading the last one back.
    pytest.param("recompute", True, 5000, True, id="recompute-prefix-caching-async"),
  ],
)
# Over 10 s where its warm-up compiles the engine's programs (alone, about 25 s
# on 2 cores; in CI test_engine's tests ran first and most are warm); the
# traces themselves take a few seconds.
def test_random_traces(model, preemption_mode, enable_prefix_caching, first_seed, ahead, capsys):
  # As in a fresh server: a program that an earlier module's engine
  # compiled must not hide one that this warm-up leaves out (it did: swap-in
  # plans of another argument kind, fixed in `CacheManager.warm_up`).
  jax.clear_caches()
  engine = make_engine(model, preemption_mode, enable_prefix_caching, ahead)
  num_programs = len(engine.compiled_programs())
  assert f"warm-up: {num_programs} programs (" in capsys.readouterr().err
  seeds = range(first_seed, first_seed + NUM_TRACES)
  engine_traces.check_all_free(engine)  # the warm-up changed nothing (compiles the checks)
  with compile_guard.no_compiles(f"{preemption_mode} traces after warm-up"):
    summary = engine_traces.run_traces(engine, seeds, SHAPE)
  assert not summary["failures"], summary["failures"][0]
  # (A group preempted while its prompt is still in chunks is recomputed
  # even in "swap" mode, so swaps are not required.)
  reached = {path: summary[path] > 0 for path in ("compared", "aborted", "preemptions")}
  if enable_prefix_caching:
    reached["prefix cache hits"] = summary["prefix_cache_hit_rate"] > 0
  if ahead:
    reached["launches ahead"] = summary["loop_launches_ahead"] > 0
  missed = [path for path, hit in reached.items() if not hit]
  assert not missed, f"the traces no longer reach {missed}: pick other seeds ({summary})"


def test_warmup_refuses_while_a_request_runs(model):
  engine = make_engine(model, "recompute", True)  # the programs of the traces above
  engine.add_request("0", "WAR", pj.SamplingParams(max_tokens=12, ignore_eos=True))
  engine.step()
  with pytest.raises(RuntimeError, match="warm-up launches only while no row decodes"):
    engine.warmup()
  while engine.has_unfinished_requests():
    engine.step()
  engine_traces.check_all_free(engine)
