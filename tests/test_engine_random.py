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
engine's programs are already compiled. On per-type tables
(`hybrid_kv_cache`, a Gemma-shaped model whose sliding layer sees 8 keys)
the same checks run on every type's table, and each reproducible request
must also give the one-table engine's outputs (`slow`: the hybrid engine
compiles its own programs).

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
import types

import jax
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import compile_guard, models
from paged_jax.engine import programs
from tests import engine_traces
from tests.test_families_windows import WINDOWED
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


def test_a_program_that_fails_to_compile_fails_warm_up_and_changes_nothing(model, monkeypatch):
  engine = pj.LLMEngine(
    model, engine_traces.TOKENIZER, cache_config(True), max_num_batched_tokens=8, num_decode_steps=4
  )

  def refuse():
    raise RuntimeError("XLA refused the decode loop")

  lowered = types.SimpleNamespace(compile=refuse)
  monkeypatch.setattr(programs, "decode_loop", types.SimpleNamespace(lower=lambda *a, **k: lowered))
  with pytest.raises(RuntimeError, match="XLA refused the decode loop"):
    engine.warmup()
  monkeypatch.undo()
  engine_traces.check_all_free(engine)
  engine.add_request("0", "WAR", pj.SamplingParams(max_tokens=6, ignore_eos=True))
  outputs = []
  while engine.has_unfinished_requests():
    outputs += engine.step()
  assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 6


# Per-type tables (`hybrid_kv_cache`): a Gemma-shaped model whose sliding
# layer sees 8 keys (its type keeps 11 positions, prompts go in chunks of 4),
# so the traces' sequences (up to 36 tokens) run far past the window.
GEMMA_BYTES = dataclasses.replace(
  BYTE_LLAMA, num_layers=2, num_kv_heads=2, num_q_heads=4, **WINDOWED["gemma_hybrid_window_8"]
)


@pytest.fixture(scope="module")
def gemma():
  return models.Llama(GEMMA_BYTES, rngs=nnx.Rngs(0))


def serve_together(engine: pj.LLMEngine, requests) -> list:
  """The finished outputs of `(prompt, params)` requests added at once."""
  for i, (prompt, params) in enumerate(requests):
    engine.add_request(str(i), prompt, params)
  finals = {}
  while engine.has_unfinished_requests():
    finals.update((int(out.request_id), out) for out in engine.step() if out.finished)
  return [finals[i] for i in range(len(requests))]


def one_table_engine(model) -> pj.LLMEngine:
  """`model` on one table that keeps every block for every layer (each
  sliding layer masks its window), room for every sequence, no prefix
  caching: what a hybrid engine must serve."""
  cfg = dataclasses.replace(
    ENGINE_CFG, num_gpu_blocks=ENGINE_CFG.max_seqs * 20, enable_prefix_caching=False
  )
  return pj.LLMEngine(model, engine_traces.TOKENIZER, cfg, num_decode_steps=4)


# Requests that run four windows past the prompt: beams, parallel samples.
LONG_REQUESTS = [
  ("ABSURDITY, n.  A ", pj.SamplingParams(n=2, use_beam_search=True, max_tokens=20)),
  ("ADMIRAL, n.", pj.SamplingParams(n=2, max_tokens=20, ignore_eos=True)),
  ("ALONE, adj.  In ", pj.SamplingParams(n=2, max_tokens=20, seed=3, temperature=1.0)),
]


# Slow: each setup compiles its hybrid engine's programs (warm-up) and the
# one-table engine's: 5 to 15 min a setup on 2 cores at load 4 to 17
# (2026-12-05); the traces themselves take seconds.
@pytest.mark.slow
@pytest.mark.parametrize(
  "preemption_mode, kv_cache_memory_bytes, first_seed, ahead",
  [
    # 14 blocks in each type's pool, as the setups above.
    pytest.param("recompute", None, 8000, False, id="recompute"),
    # The pools split 22,000 bytes by what a longest sequence holds in each
    # type (32 global blocks, 10 sliding ones).
    pytest.param("swap", 22_000, 9000, True, id="swap-budget-async"),
  ],
)
def test_random_traces_on_hybrid_tables(
  gemma, preemption_mode, kv_cache_memory_bytes, first_seed, ahead, capsys
):
  """The traces' checks on every type's table, with prefix caching, `n > 1`
  and beams; then every reproducible request (greedy, seeded, beams) and
  `LONG_REQUESTS` give the outputs the one-table engine gives them."""
  jax.clear_caches()
  cfg = ENGINE_CFG
  if kv_cache_memory_bytes is not None:
    cfg = dataclasses.replace(cfg, num_gpu_blocks=pj.CacheConfig.num_gpu_blocks)
  engine = pj.LLMEngine(
    gemma,
    engine_traces.TOKENIZER,
    cfg,
    max_num_batched_tokens=8,
    preemption_mode=preemption_mode,
    kv_cache_memory_bytes=kv_cache_memory_bytes,
    hybrid_kv_cache=True,
    num_decode_steps=4,
    async_scheduling=ahead,
    warmup=True,
  )
  assert "warm-up: " in capsys.readouterr().err
  seeds = range(first_seed, first_seed + NUM_TRACES)
  engine_traces.check_all_free(engine)  # the warm-up changed nothing (compiles the checks)
  served = []
  with compile_guard.no_compiles(f"{preemption_mode} traces on hybrid tables after warm-up"):
    summary = engine_traces.run_traces(engine, seeds, SHAPE, served)
    launches_ahead = engine.stats.loop_launches_ahead
    long_outputs = serve_together(engine, LONG_REQUESTS)
    launches_ahead = engine.stats.loop_launches_ahead - launches_ahead
  engine_traces.check_all_free(engine)
  assert not summary["failures"], summary["failures"][0]
  window = GEMMA_BYTES.sliding_window
  reached = {
    "compared": summary["compared"] > 0,
    "aborted": summary["aborted"] > 0,
    "preemptions": summary["preemptions"] > 0,
    "prefix cache hits": summary["prefix_cache_hit_rate"] > 0,
    "n > 1": any(params.n > 1 for _, params, _ in served),
    "beams": any(params.use_beam_search for _, params, _ in served),
    "past the window": any(
      len(final.prompt_token_ids) + len(c.token_ids) > 2 * window
      for _, _, final in served
      for c in final.outputs
    ),
  }
  if ahead:
    reached["launches ahead"] = summary["loop_launches_ahead"] > 0 and launches_ahead > 0
  missed = [path for path, hit in reached.items() if not hit]
  assert not missed, f"the traces no longer reach {missed}: pick other seeds ({summary})"
  requests = [(p, params) for p, params, _ in served] + LONG_REQUESTS
  expected = serve_together(one_table_engine(gemma), requests)
  got = [final for _, _, final in served] + long_outputs
  for (prompt, params), final, want in zip(requests, got, expected):
    too_long = len(final.prompt_token_ids) > GEMMA_BYTES.max_seq_len
    assert (final.error is not None) == too_long, f"{prompt!r} {params}: {final.error}"
    difference = engine_traces.same_outputs(final, want)
    assert difference is None, f"{prompt!r} {params}: not the one-table engine's: {difference}"
