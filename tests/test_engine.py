"""The engine: scheduling never changes results, memory comes back, requests
stop, stream, abort and fail the way users rely on."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import io_callback
from scipy import stats

import paged_jax as pj
from paged_jax import compile_guard, kernel_choice, models
from paged_jax.block_manager import manager
from paged_jax.engine import arrivals
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.packing import filled_budget, pack_decode_rows, pack_prefill, prompt_buckets
from paged_jax.engine.scheduler_output import PrefillChunk
from paged_jax.sampling import RowParams, categorical_rows, greedy_tokens, sample_rows
from pallas_kernels.paged_attention import cpu
from tests.tiny_models import BYTE_LLAMA, ENGINE_CFG

MODEL_CONFIG = BYTE_LLAMA
CFG = ENGINE_CFG  # 14 blocks of 4: the runs must preempt
TOKENIZER = models.ByteTokenizer()
GREEDY = pj.SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = pj.SamplingParams(
  max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=7, n=2, ignore_eos=True, logprobs=2
)


@pytest.fixture(scope="module")
def model():
  return models.Llama(MODEL_CONFIG, rngs=nnx.Rngs(0))


def _requests():
  """(id, prompt, params): ragged prompts, two sharing a prefix, one n=2."""
  system = "THE DEVIL'S "
  prompts = [
    "CAT, n. ",
    system + "DOG",
    system + "LOVE, n. A temporary",
    "WAR",
    "BORE, n. A person who talks",
  ]
  params = [GREEDY, GREEDY, SAMPLED, GREEDY, GREEDY]
  return [(str(i), p, s) for i, (p, s) in enumerate(zip(prompts, params))]


def _serve(engine, requests):
  """Runs `requests` to the end; checks the invariants after every step.

  Returns:
    `({id: final RequestOutput}, {id: [streamed RequestOutput]})`.
  """
  for request_id, prompt, params in requests:
    engine.add_request(request_id, prompt, params)
  finals, streamed = {}, {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      streamed.setdefault(out.request_id, []).append(out)
      if out.finished:
        finals[out.request_id] = out
    pj.check_invariants(engine.state)
  return finals, streamed


def _all_blocks_free(engine):
  state = engine.state
  assert engine.num_free_gpu_blocks() == CFG.num_gpu_blocks
  assert int(engine.cache_manager.bm.num_free_cpu_blocks(state)) == CFG.num_cpu_blocks
  assert np.all(np.asarray(state.tables) == -1)


def _tokens(finals):
  return {i: [o.token_ids for o in out.outputs] for i, out in finals.items()}


# Over 10 s: the module's first engine compiles the programs of CFG that most
# tests here reuse.
@pytest.fixture(scope="module")
def reference(model):
  """One sequence at a time, whole prompts: no chunking, no preemption."""
  engine = pj.LLMEngine(
    model, TOKENIZER, CFG, max_num_seqs=2, max_num_batched_tokens=64, num_decode_steps=4
  )
  finals, _ = _serve(engine, _requests())
  assert engine.stats.preemptions == 0
  _all_blocks_free(engine)
  return finals


# CI runs "swap"; "recompute" is `slow` (the random traces of
# tests/test_engine_random.py compare recompute runs with prefix caching in CI).
@pytest.mark.parametrize(
  "mode, budget, reverse",
  [
    pytest.param("recompute", 64, False, marks=pytest.mark.slow),
    ("swap", 8, True),
  ],
)
def test_outputs_do_not_depend_on_scheduling(model, reference, mode, budget, reverse):
  engine = pj.LLMEngine(
    model, TOKENIZER, CFG, preemption_mode=mode, max_num_batched_tokens=budget, num_decode_steps=4
  )
  requests = _requests()
  finals, _ = _serve(engine, requests[::-1] if reverse else requests)
  assert _tokens(finals) == _tokens(reference)
  assert [o.text for o in finals["2"].outputs] == [o.text for o in reference["2"].outputs]
  stats = engine.stats
  assert stats.preemptions > 0
  if mode == "swap":
    assert stats.swaps > 0
  if budget < 20:  # the longest prompt needs several chunks
    assert stats.prefill_tokens >= stats.prompt_tokens - 4 * 3
  _all_blocks_free(engine)


def _ragged_engine(model, max_num_seqs: int = 4, budget: int = 8, **kwargs) -> pj.LLMEngine:
  """An engine whose rounds with prompt work are ragged steps of at most
  `budget` tokens (prompt chunks and one decode token per running row)."""
  return pj.LLMEngine(
    model,
    TOKENIZER,
    CFG,
    max_num_seqs=max_num_seqs,
    max_num_batched_tokens=budget,
    num_decode_steps=4,
    decode_row_buckets=(4,),
    **kwargs,
  )


def _record_ragged_steps(engine, monkeypatch) -> list:
  """The `DecodeResult` of every ragged step's decode step, as they run;
  a prefill launch apart fails."""
  steps = []
  ragged_step = engine.runner.ragged_step

  def recorded(*args):
    draws, scores, result = ragged_step(*args)
    steps.append(result)
    return draws, scores, result

  monkeypatch.setattr(engine.runner, "ragged_step", recorded)
  monkeypatch.setattr(engine.runner, "prefill", None)
  return steps


def test_ragged_steps_give_the_same_outputs(model, reference, monkeypatch):
  engine = _ragged_engine(model)
  ragged_steps = _record_ragged_steps(engine, monkeypatch)
  finals, _ = _serve(engine, _requests())
  assert _tokens(finals) == _tokens(reference)
  assert [o.text for o in finals["2"].outputs] == [o.text for o in reference["2"].outputs]
  assert sum(step.row_steps > 0 for step in ragged_steps) >= 3
  assert engine.stats.preemptions > 0
  _all_blocks_free(engine)


def test_a_ragged_step_out_of_blocks_runs_the_chunks_and_preempts(model, monkeypatch):
  # After its first rounds "a" holds 9 + 3 tokens in 3 full blocks, so its
  # next step needs a block; "b"'s 44-token prompt takes the 11 free ones.
  greedy = pj.SamplingParams(max_tokens=12, ignore_eos=True)
  engine = _ragged_engine(model, budget=16)
  ragged_steps = _record_ragged_steps(engine, monkeypatch)
  engine.add_request("a", list(range(65, 74)), greedy)
  drawn = [len(engine.step()[0].outputs[0].token_ids) for _ in range(3)]
  assert drawn == [1, 2, 4]  # a ragged step, then launches of 1 and 2 steps
  engine.add_request("b", list(range(70, 114)), greedy)
  finals = _serve(engine, [])[0]
  assert engine.stats.preemptions == 1
  _all_blocks_free(engine)
  assert [bool(step.out_of_blocks.any()) for step in ragged_steps[:2]] == [False, True]
  alone = pj.LLMEngine(model, TOKENIZER, CFG, num_decode_steps=4)
  expected = _serve(
    alone, [(r, p, greedy) for r, p in (("a", range(65, 74)), ("b", range(70, 114)))]
  )
  assert _tokens(finals) == _tokens(expected[0])


def test_an_arrival_joins_the_next_step(model):
  # "a" decodes alone in launches of 1, 2, 4, 4 steps (the length ramps up
  # to num_decode_steps); "b" arrives and the next step is a ragged one:
  # "a" draws one token in it and "b" its first; then the ramp starts again.
  engine = _ragged_engine(model, budget=16)
  engine.add_request("a", [65, 66, 67], pj.SamplingParams(max_tokens=20, ignore_eos=True))
  drawn = [len(engine.step()[0].outputs[0].token_ids) for _ in range(5)]
  assert drawn == [1, 2, 4, 8, 12]
  engine.add_request("b", [68, 69, 70], GREEDY)
  outputs = {out.request_id: out for out in engine.step()}
  assert len(outputs["a"].outputs[0].token_ids) == 13
  assert len(outputs["b"].outputs[0].token_ids) == 1
  outputs = {out.request_id: out for out in engine.step()}
  assert len(outputs["a"].outputs[0].token_ids) == 14
  assert len(outputs["b"].outputs[0].token_ids) == 2
  while engine.has_unfinished_requests():
    engine.step()
  _all_blocks_free(engine)


def _arrive_at_check(engine, monkeypatch, check: int) -> list:
  """Makes a request arrive (`notify_arrival`) as the engine's decode
  launches ask, before a step, for the `check`-th time (counted from 1):
  that step runs no more. Returns the answers the launches get, in order
  (the engine's watch must ask the host: `check` "callback")."""
  watch = engine.runner.arrival_watch
  should_stop, answers = watch.should_stop, []

  def ask():
    if len(answers) + 1 == check:
      engine.notify_arrival()
    answers.append(should_stop())
    return answers[-1]

  monkeypatch.setattr(watch, "should_stop", ask)
  return answers


# Its decode loop compiles apart (a host callback): 29 s on the loaded 2-core
# machine, `slow`.
@pytest.mark.slow
def test_an_arrival_ends_a_decode_launch_before_its_next_step(model, reference, monkeypatch):
  # "3" alone: a ragged step draws token 1, launches of 1 and 2 steps draw
  # 2..4; the next would run 4 steps, but a request arrives during its
  # second step: it ends after 2 (tokens 5..6), and the next round prefills
  # "1" with one step of "3". Outputs are those of the reference.
  monkeypatch.setattr(arrivals, "preferred_check", lambda: "callback")  # asks, to count
  engine = _ragged_engine(model, budget=16, stop_decode_on_arrival=True)
  engine.add_request("3", _requests()[3][1], GREEDY)
  drawn = [len(engine.step()[0].outputs[0].token_ids) for _ in range(3)]
  assert drawn == [1, 2, 4]
  answers = _arrive_at_check(engine, monkeypatch, 3)  # after step 2 began
  steps = engine.stats.decode_steps
  assert len(engine.step()[0].outputs[0].token_ids) == 6
  assert answers == [False, False, True]  # asked before steps 1, 2 and 3
  assert engine.stats.decode_steps == steps + 2
  engine.add_request("1", _requests()[1][1], GREEDY)
  outputs = {out.request_id: out for out in engine.step()}
  assert {i: len(out.outputs[0].token_ids) for i, out in outputs.items()} == {"3": 7, "1": 1}
  finals, _ = _serve(engine, [])
  assert _tokens(finals) == {i: _tokens(reference)[i] for i in ("1", "3")}
  _all_blocks_free(engine)


# A warm-up of its own (decode loops with the check compile apart): `slow`.
@pytest.mark.slow
def test_an_arrival_ends_a_launch_running_ahead_and_the_one_after_runs_no_step(
  model, reference, monkeypatch
):
  # Async: launch 1 (1 step) is read back while launch 2 (2 steps) runs
  # ahead; a request arrives during launch 2's first step, which ends it
  # there. Launch 3, dispatched ahead before the request is added (as the
  # server adds it after the step), runs no step; then "1" is prefilled.
  monkeypatch.setattr(arrivals, "preferred_check", lambda: "callback")  # asks, to count
  engine = pj.LLMEngine(
    model,
    TOKENIZER,
    CFG,
    num_decode_steps=4,
    async_scheduling=True,
    stop_decode_on_arrival=True,
    warmup=True,
  )
  _all_blocks_free(engine)  # compiles the checks
  pj.check_invariants(engine.state)
  with compile_guard.no_compiles("arrivals during decoding after warm-up"):
    engine.add_request("3", _requests()[3][1], GREEDY)
    engine.step()  # the prompt, in a ragged step
    answers = _arrive_at_check(engine, monkeypatch, 4)  # launch 1 asks twice
    assert len(engine.step()[0].outputs[0].token_ids) == 2  # launch 1; launch 2 runs ahead
    assert len(engine.step()[0].outputs[0].token_ids) == 3  # launch 2 ran one step
    assert engine.stats.loop_launches_ahead == 2
    engine.runner.ahead.loop.step.block_until_ready()
    assert answers == [False, False, False, True, True]
    engine.add_request("1", _requests()[1][1], GREEDY)
    engine.step()  # reads launch 3 back
    # The ragged step's decode step, launch 1's and launch 2's: launch 3 ran none.
    assert engine.stats.decode_steps == 3 and not engine.running_ahead
    outputs = {out.request_id: out for out in engine.step()}  # "1"'s prompt, one step of "3"
    assert {i: len(out.outputs[0].token_ids) for i, out in outputs.items()} == {"3": 4, "1": 1}
    finals, _ = _serve(engine, [])
  assert _tokens(finals) == {i: _tokens(reference)[i] for i in ("1", "3")}
  _all_blocks_free(engine)


def _async_engine(model) -> pj.LLMEngine:
  """Dispatches the next decode launch before reading the last one back
  while the next round would only decode (`async_scheduling`)."""
  return pj.LLMEngine(model, TOKENIZER, CFG, num_decode_steps=4, async_scheduling=True)


def test_async_scheduling_gives_the_same_outputs(model, reference):
  engine = _async_engine(model)
  finals, _ = _serve(engine, _requests())
  assert _tokens(finals) == _tokens(reference)
  assert [o.text for o in finals["2"].outputs] == [o.text for o in reference["2"].outputs]
  stats = engine.stats
  assert stats.loop_launches_ahead > 0 and stats.preemptions > 0
  _all_blocks_free(engine)


def test_a_request_alone_runs_ahead_up_to_its_last_launch(model, reference):
  # 12 tokens: the ragged step draws token 1, then decode launches of 1, 2,
  # 4 and 4 steps draw 2, 3..4, 5..8 and 9..12, which ends it; launches 2 to
  # 4 run ahead, and no launch runs after 4.
  engine = _async_engine(model)
  finals, _ = _serve(engine, [("3", _requests()[3][1], GREEDY)])
  assert finals["3"].outputs[0].token_ids == reference["3"].outputs[0].token_ids
  stats = engine.stats
  assert (stats.loop_launches, stats.loop_launches_ahead, stats.decode_tokens) == (4, 3, 11)
  _all_blocks_free(engine)


# Alone, "4" draws its first token in a ragged step, then decode launches
# of 1, 2, 4 and 4 steps draw tokens 2, 3..4, 5..8 and 9..12; launch 2 is
# dispatched before launch 1 is read back, and so on. Launch 3's tokens 6
# and 7 (one character each) complete the stop string: launch 4 decodes it
# on (tokens 9..12), and those are dropped. With max_tokens=10 launch 4
# reaches the limit at token 10, so the device frees its blocks and the
# host must not free them again.
@pytest.mark.parametrize("max_tokens", [12, 10])
def test_a_stop_string_found_while_a_launch_runs_ahead_drops_its_tokens(
  model, reference, max_tokens
):
  expected = reference["4"].outputs[0]
  stop = expected.text[6:8]
  assert expected.text.index(stop) == 6
  assert TOKENIZER.decode(expected.token_ids[:8]).endswith(stop)
  engine = _async_engine(model)
  params = dataclasses.replace(GREEDY, max_tokens=max_tokens, stop=[stop])
  finals, streamed = _serve(engine, [("4", _requests()[4][1], params)])
  out = finals["4"].outputs[0]
  assert (out.finish_reason, out.stop_reason) == ("stop", stop)
  assert out.text == expected.text[:6]
  assert out.token_ids == expected.token_ids[:8]
  # Step 5 read launch 4 back and reported nothing more.
  assert [o.finished for o in streamed["4"]] == [False, False, False, True]
  stats = engine.stats
  assert (stats.loop_launches, stats.loop_launches_ahead) == (4, 3)
  assert stats.decode_tokens == 1 + 2 + 4 + max_tokens - 8  # the dropped ones too
  _all_blocks_free(engine)


def test_an_abort_or_a_request_while_a_launch_runs_ahead(model, reference):
  (_, cat, _), (_, dog, _), *_ = _requests()
  engine = _async_engine(model)
  engine.add_request("0", cat, GREEDY)
  engine.step()  # its prompt, in a ragged step
  first = engine.step()  # launch 1 (1 step); launch 2 (2 steps) runs ahead
  assert len(first[0].outputs[0].token_ids) == 2 and engine.stats.loop_launches_ahead == 1
  engine.add_request("1", dog, GREEDY)
  engine.abort_request("0")  # reads launch 2 back first: its outputs come next
  assert engine.stats.loop_launches == 2
  finals, streamed = _serve(engine, [])
  aborted = finals["0"].outputs[0]
  assert aborted.finish_reason == "abort"
  assert aborted.token_ids == reference["0"].outputs[0].token_ids[:4]
  assert [o.finished for o in streamed["0"]] == [False, True]
  assert finals["1"].outputs[0].token_ids == reference["1"].outputs[0].token_ids
  _all_blocks_free(engine)


def test_running_out_of_blocks_while_a_launch_runs_ahead_preempts_once(model):
  # Nothing waits, so every launch runs ahead; the two requests need 24 blocks
  # of the 14. The launch after the one that ran out runs no step.
  long = pj.SamplingParams(max_tokens=40, ignore_eos=True)
  requests = [("a", list(range(65, 73)), long), ("b", list(range(75, 83)), long)]
  finals = []
  for ahead in (True, False):
    engine = pj.LLMEngine(model, TOKENIZER, CFG, num_decode_steps=4, async_scheduling=ahead)
    finals.append(_serve(engine, requests)[0])
    assert engine.stats.preemptions == 1
    assert (engine.stats.loop_launches_ahead > 0) == ahead
    _all_blocks_free(engine)
  assert _tokens(finals[0]) == _tokens(finals[1])


def test_prompts_admitted_together_compute_their_shared_blocks_once(model, reference):
  # Requests 1 and 2 share "THE DEVIL'S " (3 blocks); 2 reads them as 1's
  # chunk writes them in the same launch.
  engine = pj.LLMEngine(model, TOKENIZER, CFG, num_decode_steps=4)
  finals, _ = _serve(engine, _requests()[1:3])
  assert _tokens(finals) == {i: _tokens(reference)[i] for i in ("1", "2")}
  stats = engine.stats
  assert stats.prefill_tokens == stats.prompt_tokens - 12
  _all_blocks_free(engine)


def test_a_decode_sharing_a_block_that_a_pending_prefill_holds_reads_its_own_kv(model):
  """A decoding sequence fills a block whose content another prompt's block
  already has, before that prompt's prefill wrote it: the decode shares the
  cached block (prefix caching) and must still attend to its own K/V."""
  params = pj.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
  prompt = list(TOKENIZER.encode("CAT,"))  # one full block

  def serve(later=()):
    # "first" draws 4 tokens in a ragged step (its prompt) and launches of 1
    # and 2 steps. "later" comes then: in the next ragged step "first"
    # writes position 7, completing its second block, while "later"'s
    # prefill of that block has written 3 of its 4 positions.
    engine = pj.LLMEngine(
      model, TOKENIZER, CFG, max_num_seqs=4, max_num_batched_tokens=4, num_decode_steps=4
    )
    engine.add_request("first", prompt, params)
    for _ in range(3):
      engine.step()
    finals, _ = _serve(engine, later)
    _all_blocks_free(engine)
    return finals, engine.stats

  alone, _ = serve()
  (want,) = alone["first"].outputs
  # The later prompt's second block is the block the first request's decode fills.
  later = prompt + want.token_ids[:4] + [7]
  finals, stats = serve([("later", later, pj.SamplingParams(max_tokens=1))])
  (got,) = finals["first"].outputs
  assert stats.prefix_cache_hit_rate > 0
  assert got.token_ids == want.token_ids
  for got_logprobs, want_logprobs in zip(got.logprobs, want.logprobs, strict=True):
    assert got_logprobs.keys() == want_logprobs.keys()
    for token, logprob in got_logprobs.items():
      assert logprob == pytest.approx(want_logprobs[token], abs=1e-4)


def test_a_swap_in_sharing_a_block_that_a_pending_prefill_holds_brings_its_own_kv():
  """A swapped-out sequence comes back while another prompt holds blocks of
  its content that its prefill has not written: the swap-in shares them
  (prefix caching) and must still put the sequence's own K/V there."""
  cache = CacheManager(CFG, MODEL_CONFIG)
  tables = jax.jit(manager.get_block_tables)
  slots = np.arange(CFG.max_seqs, dtype=np.int32)
  prompt = np.arange(60, 69, dtype=np.int32)  # 2 full blocks and 1 token
  cache.allocate(0, prompt, "swapped")
  cache.mark_computed([0], [prompt.size])
  blocks = np.asarray(tables(cache.shard_state(0), slots))[0, :3]
  pages = jax.random.normal(jax.random.key(0), cache.kv.k[0][:, :3].shape)
  cache.kv = cache.kv.replace(
    k=tuple(k.at[:, blocks].set(pages) for k in cache.kv.k),
    v=tuple(v.at[:, blocks].set(-pages) for v in cache.kv.v),
  )
  cache.move_out(cache.swap_out([0], "swapped"))
  # Another prompt takes every GPU block (evicting the cached ones) and writes them.
  cache.allocate(1, np.arange(4 * CFG.num_gpu_blocks, dtype=np.int32), "other")
  cache.kv = cache.kv.replace(
    k=tuple(jnp.ones_like(k) for k in cache.kv.k), v=tuple(jnp.ones_like(v) for v in cache.kv.v)
  )
  cache.free([1], "other")
  cache.allocate(2, prompt, "pending")  # its prefill would write the 2 full blocks
  cache.move_in(cache.swap_in([0], "swapped"))
  table = np.asarray(tables(cache.shard_state(0), slots))
  np.testing.assert_array_equal(table[0, :2], table[2, :2])  # shared, not copied
  for k, v in zip(cache.kv.k, cache.kv.v):
    np.testing.assert_array_equal(k[:, table[0, :3]], pages)
    np.testing.assert_array_equal(v[:, table[0, :3]], -pages)


def test_outputs_finish_with_a_reason_and_logprobs(reference):
  for request_id in ("0", "1", "3", "4"):
    (out,) = reference[request_id].outputs
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert out.text == TOKENIZER.decode(out.token_ids)
  samples = reference["2"].outputs
  assert [s.index for s in samples] == [0, 1]
  assert samples[0].token_ids != samples[1].token_ids
  for sample in samples:
    assert len(sample.logprobs) == 12
    chosen = [lp[t] for lp, t in zip(sample.logprobs, sample.token_ids)]
    assert all(2 <= len(lp) <= 3 for lp in sample.logprobs)
    assert sample.cumulative_logprob == pytest.approx(sum(chosen), rel=1e-5)
    assert all(v <= 0.0 for lp in sample.logprobs for v in lp.values())


def test_stats_count_the_prefill_and_decode_padding(model):
  # Prompts of 5, 5 and 36 tokens in one ragged step: 46 tokens packed into
  # the 64-token bucket (1 + 1 + 2 tiles of 32, of 4), beside no decoding
  # row (a ragged step computes only those). Then three sequences decode 2
  # tokens each in the 4-row bucket, in launches of 1 and 2 steps (the
  # second ends after 1).
  engine = pj.LLMEngine(model, TOKENIZER, CFG, num_decode_steps=4)
  params = pj.SamplingParams(max_tokens=3, ignore_eos=True)
  for request_id, length in (("short", 5), ("small", 5), ("long", 36)):
    engine.add_request(request_id, [ord(request_id[1])] * length, params)
  while engine.has_unfinished_requests():
    engine.step()
  stats = engine.stats
  assert (stats.prefill_tokens, stats.prefill_positions) == (46, 64)
  assert stats.prefill_padding == pytest.approx(1 - 46 / 64)
  assert stats.preemptions == 0
  assert (stats.decode_tokens, stats.decode_positions) == (3 * 2, 4 * 2)
  assert stats.decode_padding == pytest.approx(1 - 6 / 8)
  assert pj.GenerationStats().prefill_padding == pj.GenerationStats().decode_padding == 0.0


@pytest.mark.parametrize(
  "budget, demand, rows, planned",
  [
    (512, 40, 0, 512),  # fits the smallest bucket
    (512, 64, 0, 512),  # fills a bucket
    (512, 250, 0, 512),  # pads 6 of 256
    (512, 200, 0, 512),  # pads 56 of 256: at most a quarter
    (512, 180, 0, 128),  # would pad 76 of 256
    (512, 300, 0, 256),  # would pad 212 of 512
    (400, 1000, 0, 400),  # the budget pads 112 of 512
    (380, 1000, 0, 256),  # the budget would pad 132 of 512
    # Decoding rows ride in the bucket, a token each.
    (496, 200, 16, 496),  # 216 tokens pad 40 of 256
    (496, 170, 16, 112),  # 186 would pad 70 of 256: 112 beside the rows fill 128
    (480, 40, 32, 32),  # 72 would pad 56 of 128: 32 beside the rows fill 64
    (452, 1000, 60, 452),  # 60 rows and the budget fill 512
  ],
)
def test_a_round_fills_a_smaller_prompt_bucket_rather_than_pad_much(budget, demand, rows, planned):
  assert filled_budget(budget, demand, [64, 128, 256, 512], rows) == planned


def test_an_engine_for_another_platform_plans_its_whole_budget(model):
  with kernel_choice.target_platform("tpu"):
    engine = pj.LLMEngine(model, TOKENIZER, CFG, prefill_width=4, max_num_batched_tokens=32)
  assert engine.schedulers[0].token_buckets is None


def test_a_cpu_engine_leaves_what_would_pad_a_bucket_to_the_next_round(model):
  # Buckets of 8, 16 and 32 tokens. "b"'s 20 tokens and "a"'s decoding row
  # would pad 11 of 32 (more than a quarter), so its first ragged step runs
  # 15 beside the row (the 16-token bucket) and the next the last 5 (8):
  # 22 positions besides the row's, not 31.
  engine = pj.LLMEngine(model, TOKENIZER, CFG, prefill_width=4, max_num_batched_tokens=32)
  assert engine.schedulers[0].token_buckets == [8, 16, 32]
  assert engine.schedulers[0].rows_in_buckets
  engine.add_request("a", [65, 66, 67], GREEDY)
  engine.step()
  engine.add_request("b", list(range(70, 90)), GREEDY)
  positions = []
  for _ in range(2):
    before = engine.stats.prefill_positions
    engine.step()
    positions.append(engine.stats.prefill_positions - before)
  assert positions == [15, 7]
  finals, _ = _serve(engine, [])
  alone = pj.LLMEngine(model, TOKENIZER, CFG, num_decode_steps=4)
  expected, _ = _serve(alone, [("b", list(range(70, 90)), GREEDY)])
  assert _tokens(finals)["b"] == _tokens(expected)["b"]


def test_decode_rows_pack_each_shards_decoding_slots_into_a_bucket():
  running = np.array(
    [[False, True, False, True, True, False], [True, False, False, False, False, False]]
  )
  assert pack_decode_rows(running, [1, 2, 4, 6]).tolist() == [1, 3, 4, -1, 6, -1, -1, -1]
  assert pack_decode_rows(running[1:], [1, 2, 4, 6]).tolist() == [0]
  assert pack_decode_rows(np.zeros((1, 6), bool), [1, 2, 4, 6]).tolist() == [-1]
  # Five slots of a shard decode: every slot, in order.
  assert pack_decode_rows(np.array([[True] * 5 + [False]]), [1, 2, 4, 6]) is None


def test_prefill_packs_each_shards_chunks_into_one_token_axis():
  # Slots 0..3 on shard 0, 4..7 on shard 1; tiles of 4 tokens.
  chunk = lambda slot, size, start=0, write_from=0: PrefillChunk(
    None, types.SimpleNamespace(slot=slot), np.arange(100, 100 + size), start, [], write_from
  )
  chunks = [chunk(1, 5, start=8, write_from=10), chunk(6, 3), chunk(2, 2)]
  packed = pack_prefill(chunks, 4, 2, 4, prompt_buckets(4, 8, 4))
  # Shard 0 holds 7 tokens in 3 tiles: the (8 tokens, 4 tiles) shape.
  assert packed.tokens.shape == (2, 8) and packed.tiles.shape == (8, 4)
  assert packed.first_token == [0, 8, 5]
  assert packed.positions.tolist() == [
    [8, 9, 10, 11, 12, 0, 1, -1],
    [0, 1, 2, -1, -1, -1, -1, -1],
  ]
  assert packed.tokens[0, :7].tolist() == [100, 101, 102, 103, 104, 100, 101]
  assert packed.tiles.tolist() == [
    [0, 1, 2, 3], [4, -1, -1, -1], [5, 6, -1, -1], [-1] * 4,
    [0, 1, 2, -1], [-1] * 4, [-1] * 4, [-1] * 4,
  ]  # fmt: skip
  assert packed.tile_slots.tolist() == [[1, 1, 2, -1], [2, -1, -1, -1]]
  assert packed.write_from.tolist() == [10, 10, 0, 0, 0, 0, 0, 0]
  assert (packed.next_tokens == -1).all()
  # With room for a ragged step's decoding rows after each shard's chunks.
  with_rows = pack_prefill(chunks, 4, 2, 4, prompt_buckets(4, 16, 4), np.array([1, 3]))
  assert with_rows.tokens.shape == (2, 8)  # 7 + 1 and 3 + 3 tokens
  with_rows = pack_prefill(chunks, 4, 2, 4, prompt_buckets(4, 16, 4), np.array([2, 0]))
  assert with_rows.tokens.shape == (2, 16)
  assert with_rows.positions[0, :7].tolist() == packed.positions[0, :7].tolist()
  with pytest.raises(RuntimeError, match=r"holds 17 tokens \(prompt tokens and decoding rows"):
    pack_prefill(chunks, 4, 2, 4, prompt_buckets(4, 16, 4), np.array([10, 0]))


def test_greedy_tokens_are_jnp_argmax():
  rng = np.random.default_rng(0)
  logits = rng.integers(-3, 4, (6, 50)).astype(np.float32)  # ties in every row
  logits[1, 7] = logits[1, 30] = np.nan  # the first NaN, as jnp.argmax
  logits[2] = -np.inf  # a row whose mask allows nothing
  logits[3, :] = 2.0
  expected = jnp.argmax(logits, axis=-1)
  np.testing.assert_array_equal(jax.jit(greedy_tokens)(logits), expected)
  assert expected[1] == 7 and expected[2] == 0


def test_draws_rank_the_vocabulary_only_for_rows_that_want_their_top_tokens():
  # Greedy and processed (temperature) rows, some with -inf logits: the
  # token's log-probability is log_softmax's, bit for bit; the top tokens
  # are top_k's when some row wants them, zeros when none does.
  rows, vocab = 4, 300
  logits = jax.random.normal(jax.random.key(3), (rows, vocab)) * 4
  logits = logits.at[1, :250].set(-jnp.inf)
  params = RowParams(
    temperature=jnp.asarray([0.0, 0.0, 0.7, 0.7]),
    top_k=jnp.zeros(rows, jnp.int32),
    top_p=jnp.ones(rows),
    key_data=jax.random.key_data(jax.random.split(jax.random.key(4), rows)),
    stop_ids=jnp.full((rows, 1), -1, jnp.int32),
    processed=jnp.asarray([False, False, True, False]),
    wants_top=jnp.asarray([False, True, False, False]),
  )
  sample = jax.jit(sample_rows, static_argnums=3)
  index = jnp.zeros(rows, jnp.int32)
  draw = sample(logits, params, index, 3)
  raw = jax.nn.log_softmax(logits, axis=-1)
  processed = jax.nn.log_softmax(logits / 0.7, axis=-1)
  expected = jnp.where(params.processed[:, None], processed, raw)
  chosen = jnp.take_along_axis(expected, draw.tokens[:, None], axis=-1)[:, 0]
  np.testing.assert_array_equal(draw.logprob, chosen)
  top_logprobs, top_ids = jax.lax.top_k(expected, 3)
  np.testing.assert_array_equal(draw.top_ids, top_ids)
  np.testing.assert_array_equal(draw.top_logprobs, top_logprobs)
  unwanted = sample(logits, params.replace(wants_top=jnp.zeros(rows, bool)), index, 3)
  np.testing.assert_array_equal(unwanted.logprob, draw.logprob)
  assert not np.asarray(unwanted.top_ids).any() and not np.asarray(unwanted.top_logprobs).any()


def test_categorical_rows_draws_each_rows_softmax():
  # 3 rows over 21 tokens in blocks of 4 (the last block partly padding):
  # row 0 is spread out, row 1 has -inf tokens and a whole -inf block, row 2
  # puts almost everything on one token of the padded block.
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 21)).astype(np.float32)
  logits[1, [0, 4, 5, 6, 7, 13]] = -np.inf
  logits[2, 20] = 6.0
  samples = 40_000
  keys = jax.random.split(jax.random.key(0), samples * 3).reshape(samples, 3)
  draw = jax.jit(jax.vmap(lambda k: categorical_rows(k, jnp.asarray(logits), block=4)))
  tokens = np.asarray(draw(keys))
  probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
  for row in range(3):
    counts = np.bincount(tokens[:, row], minlength=21)
    assert counts[probs[row] == 0].sum() == 0  # never a -inf token
    seen = probs[row] > 0
    expected = probs[row][seen] / probs[row][seen].sum() * samples
    assert stats.chisquare(counts[seen], expected).pvalue > 1e-3, row
  # A row draws the same token whatever the batch around it.
  alone = jax.jit(lambda k: categorical_rows(k, jnp.asarray(logits[1:2]), block=4))(keys[0, 1:2])
  assert int(alone[0]) == tokens[0, 1]


def test_stop_strings_spanning_tokens_abort_and_streaming(model, reference):
  text = reference["0"].outputs[0].text
  stop = text[3:6]  # three bytes: three tokens
  start = text.index(stop)
  engine = pj.LLMEngine(model, TOKENIZER, CFG, num_decode_steps=4)
  requests = _requests()
  requests[0] = (
    "0",
    requests[0][1],
    dataclasses.replace(GREEDY, stop=["no such text", stop], output_kind="delta"),
  )
  requests[2] = ("2", requests[2][1], dataclasses.replace(SAMPLED, output_kind="delta"))
  for request_id, prompt, params in requests:
    engine.add_request(request_id, prompt, params)
  finals, streamed = {}, {}
  steps = 0
  while engine.has_unfinished_requests():
    for out in engine.step():
      streamed.setdefault(out.request_id, []).append(out)
      finals[out.request_id] = out
    steps += 1
    if steps == 2:
      engine.abort_request("4")
      assert engine.num_free_gpu_blocks() > 0
    pj.check_invariants(engine.state)
  _all_blocks_free(engine)

  stopped = finals["0"].outputs[0]
  assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
  joined = "".join(o.outputs[0].text for o in streamed["0"])
  assert joined == text[:start]
  tokens = sum((o.outputs[0].token_ids for o in streamed["0"]), [])
  assert tokens == reference["0"].outputs[0].token_ids[: len(tokens)]
  # Tokens end with the one that completed the stop string.
  assert stop in TOKENIZER.decode(tokens)
  assert stop not in TOKENIZER.decode(tokens[:-1])
  for index in (0, 1):  # the deltas of each sample add up to its output
    expected = reference["2"].outputs[index]
    assert "".join(o.outputs[index].text for o in streamed["2"]) == (expected.text)
    assert sum((o.outputs[index].token_ids for o in streamed["2"]), []) == (expected.token_ids)
  assert len(streamed["2"]) > 2
  aborted = finals["4"].outputs[0]
  assert finals["4"].finished and aborted.finish_reason == "abort"
  assert len(aborted.token_ids) < 12
  assert finals["1"].outputs[0].token_ids == reference["1"].outputs[0].token_ids


def test_requests_that_cannot_fit_fail_without_blocking_the_queue(model):
  engine = pj.LLMEngine(model, TOKENIZER, CFG, max_num_seqs=4, num_decode_steps=4)
  engine.add_request("wide", "A" * 40, pj.SamplingParams(max_tokens=8, n=4))
  engine.add_request("many", "A", pj.SamplingParams(n=5))
  engine.add_request("long", "B" * 64, GREEDY)
  finals, _ = _serve(engine, [("ok", "D", dataclasses.replace(GREEDY, max_tokens=3))])
  assert finals["wide"].outputs[0].finish_reason == "error"
  # 4 samples of 40 + 7 tokens (12 blocks of 4) share 10 prompt blocks.
  assert "needs 18 GPU blocks" in finals["wide"].error
  assert "the cache has 14" in finals["wide"].error
  assert "n=5 sequences exceed max_num_seqs=4" in finals["many"].error
  assert "no room" in finals["long"].error
  assert len(finals["ok"].outputs[0].token_ids) == 3
  _all_blocks_free(engine)


@pytest.mark.parametrize(
  "kwargs, field",
  [
    (dict(n=0), "n"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(seed=-1), "seed"),
    (dict(logprobs=-1), "logprobs"),
    (dict(output_kind="all"), "output_kind"),
    (dict(use_beam_search=True, temperature=0.5), "temperature"),
  ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
  with pytest.raises(ValueError, match=f"^{field}"):
    pj.SamplingParams(**kwargs)


def test_bad_engine_arguments_and_requests_raise(model):
  with pytest.raises(ValueError, match="preemption_mode"):
    pj.LLMEngine(model, TOKENIZER, CFG, preemption_mode="kill")
  with pytest.raises(ValueError, match="max_num_seqs"):
    pj.LLMEngine(model, TOKENIZER, CFG, max_num_seqs=7)
  engine = pj.LLMEngine(model, None, CFG, num_decode_steps=4)
  with pytest.raises(ValueError, match="needs a tokenizer"):
    engine.add_request("a", "text")
  with pytest.raises(ValueError, match="token id 300 is outside the vocabulary"):
    engine.add_request("a", [1, 300])
  with pytest.raises(ValueError, match="logprobs=9 exceeds max_logprobs=5"):
    engine.add_request("a", [1], pj.SamplingParams(logprobs=9))
  engine.add_request("a", [1], GREEDY)
  with pytest.raises(ValueError, match="already in use"):
    engine.add_request("a", [2])
  ngram = {"method": "ngram", "num_speculative_tokens": 2}
  with pytest.raises(
    ValueError, match=r"max_num_batched_tokens \(3\) must hold at least one block"
  ):
    pj.LLMEngine(model, TOKENIZER, CFG, max_num_batched_tokens=3)
  with pytest.raises(
    ValueError, match=r"compiles 14 model programs, more than 12: 11 prompt shapes"
  ):
    pj.LLMEngine(model, TOKENIZER, CFG, max_num_batched_tokens=2048, prefill_width=1)
  with pytest.raises(ValueError, match="async_scheduling must be a bool"):
    pj.LLMEngine(model, TOKENIZER, CFG, async_scheduling=1)
  with pytest.raises(ValueError, match="stop_decode_on_arrival must be a bool, got None"):
    pj.LLMEngine(model, TOKENIZER, CFG, stop_decode_on_arrival=None)
  assert (
    pj.LLMEngine(model, TOKENIZER, CFG).runner.arrival_watch is None  # off by default
  )
  with pytest.raises(ValueError, match="async_scheduling does not work with speculative"):
    pj.LLMEngine(model, TOKENIZER, CFG, async_scheduling=True, speculative_config=ngram)


def test_a_request_that_arrives_as_a_round_begins_ends_the_launch_before_its_first_step(
  model, monkeypatch
):
  # The C++ flag (CPU's check): "3" draws its first token in a ragged step;
  # a request arrives right after the next round clears the flag, so that
  # round's launch (of 1 step) runs none; the round after runs the next
  # launch of the ramp, 2 steps.
  engine = _ragged_engine(model, budget=16, stop_decode_on_arrival=True)
  watch = engine.runner.arrival_watch
  assert watch.check == "flag"
  engine.add_request("3", _requests()[3][1], GREEDY)
  engine.step()
  clear = watch.clear
  monkeypatch.setattr(watch, "clear", lambda: (clear(), watch.note()))
  steps = engine.stats.decode_steps
  assert [len(out.outputs[0].token_ids) for out in engine.step()] in ([], [1])
  assert engine.stats.decode_steps == steps
  monkeypatch.setattr(watch, "clear", clear)
  assert len(engine.step()[0].outputs[0].token_ids) == 3
  assert engine.stats.decode_steps == steps + 2
  while engine.has_unfinished_requests():
    engine.step()
  _all_blocks_free(engine)


def test_the_cpu_flag_is_read_before_every_step_and_names_a_bad_id():
  watch, other = arrivals.ArrivalWatch(), arrivals.ArrivalWatch()
  assert watch.check == other.check == "flag" and watch.id != other.id
  read = jax.jit(lambda watch_id: arrivals.arrived(watch_id, "flag", after=watch_id))
  watch.note()
  assert read(watch.operand) and not read(other.operand)
  watch.clear()
  assert not read(watch.operand)

  def steps_until_arrival(watch_id):
    def step(count):  # a request arrives during the fourth step
      io_callback(lambda c: watch.note() if c == 3 else None, None, count, ordered=True)
      return count + 1

    going = lambda count: (count < 100) & ~arrivals.arrived(watch_id, "flag", after=count)
    return jax.lax.while_loop(going, step, jnp.int32(0))

  assert jax.jit(steps_until_arrival)(watch.operand) == 4
  with pytest.raises(ValueError, match="arrival watch id out of range"):
    read(jnp.int32(arrivals.MAX_WATCHES)).block_until_ready()


def test_a_program_traced_for_another_platform_asks_the_host():
  watch = arrivals.ArrivalWatch()
  # A new function per trace: JAX caches traces by function.
  traced = lambda: str(
    jax.make_jaxpr(lambda watch_id: arrivals.arrived(watch_id, "flag", after=watch_id))(
      watch.operand
    )
  )
  assert "ffi_call" in traced()
  with kernel_choice.target_platform("tpu"):
    asked = traced()
  assert "io_callback" in asked and "ffi_call" not in asked


def test_the_arrival_check_needs_one_process_and_asks_its_engines_watch():
  assert arrivals.check_arrivals(True, 1) and not arrivals.check_arrivals(False, 2)
  with pytest.raises(ValueError, match="needs one process, not 2"):
    arrivals.check_arrivals(True, 2)
  watch = arrivals.ArrivalWatch(check="callback")
  asks = lambda watch_id: bool(arrivals._should_stop(np.int32(watch_id)))
  watch.note()
  assert asks(watch.id) and not asks(watch.id + 1)  # no other engine's, none gone
  watch.clear()
  assert not asks(watch.id)


def test_kv_cache_memory_bytes_sizes_the_blocks_and_bad_budgets_name_the_numbers(model):
  block = pj.bytes_per_block(
    block_size=4, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32"
  )
  unsized = dataclasses.replace(CFG, num_gpu_blocks=pj.CacheConfig.num_gpu_blocks)
  engine = pj.LLMEngine(model, TOKENIZER, unsized, kv_cache_memory_bytes=20 * block + block // 2)
  assert engine.cfg.num_gpu_blocks == engine.num_free_gpu_blocks() == 20
  assert engine.cache_manager.kv.nbytes == 20 * block
  half = pj.LLM(model, None, unsized, kv_cache_memory_bytes=20 * block, kv_cache_dtype="bfloat16")
  assert half.engine.cfg.num_gpu_blocks == 40  # the pages' dtype sizes the blocks
  same = dataclasses.replace(CFG, num_gpu_blocks=20)  # a block count equal to the budget's
  assert pj.LLMEngine(model, None, same, kv_cache_memory_bytes=20 * block).cfg == same
  for budget in (0, -block, 2.0e9, True):
    with pytest.raises(
      ValueError, match=f"kv_cache_memory_bytes must be a positive int, got {budget}"
    ):
      pj.LLMEngine(model, None, unsized, kv_cache_memory_bytes=budget)
  # A sequence of 64 tokens (the model's positions) takes 16 blocks of 4.
  with pytest.raises(
    ValueError,
    match=rf"kv_cache_memory_bytes={15 * block} holds 15 blocks of {block} bytes, but one sequence "
    rf"of 64 tokens needs 16 \({16 * block} bytes\)",
  ):
    pj.LLMEngine(model, None, unsized, kv_cache_memory_bytes=15 * block)
  with pytest.raises(
    ValueError,
    match=rf"kv_cache_memory_bytes={20 * block} holds 20 GPU blocks of {block} bytes, but "
    r"cache_config.num_gpu_blocks is 14: give one of them",
  ):
    pj.LLMEngine(model, None, CFG, kv_cache_memory_bytes=20 * block)


class _Config:
  num_layers, num_kv_heads, head_dim = 1, 1, 8
  vocab_size, max_seq_len, dtype = 258, 64, "float32"


class _OwnModel(nnx.Module):
  """A model that is not the library's Llama: one attention layer, no MLP."""

  def __init__(self, rngs):
    self.config = _Config()
    self.embed = nnx.Embed(258, 8, rngs=rngs)
    self.qkv = nnx.Linear(8, 24, use_bias=False, rngs=rngs)

  def __call__(self, tokens, positions, cache):
    x = self.embed(tokens)
    q, k, v = jnp.split(self.qkv(x)[:, :, None, :], 3, axis=-1)
    if cache is None:  # causal attention over `tokens` alone
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 8**-0.5
      mask = positions[:, None, :, None] >= positions[:, None, None, :]
      out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask, scores, -1e30)), v)
    else:
      out, cache = cache.attend(0, q, k, v, positions, sm_scale=8**-0.5)
    return self.embed.attend(x + out[:, :, 0]), cache


@pytest.mark.slow  # compiles the module's programs twice more
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the C++ kernel runs on CPU")
def test_the_cpu_attention_kernel_keeps_the_greedy_tokens(monkeypatch):
  """Decode attention by the C++ kernel (CPU's default for bfloat16) or by
  chunked XLA: the same greedy tokens. Jit caches are cleared around each
  run, so that each traces its programs under its own choice."""
  model = models.Llama(dataclasses.replace(MODEL_CONFIG, dtype="bfloat16"), rngs=nnx.Rngs(0))
  if cpu.unavailable_reason() is not None:
    pytest.skip(f"the C++ kernel cannot run here: {cpu.unavailable_reason()}")
  calls = []
  kernel = cpu.paged_attention
  monkeypatch.setattr(cpu, "paged_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  greedy = {}
  try:
    for enabled in (True, False):
      jax.clear_caches()
      calls.clear()
      with kernel_choice.use_cpu_kernel(enabled):
        engine = pj.LLMEngine(
          model, TOKENIZER, CFG, max_num_seqs=2, max_num_batched_tokens=64, num_decode_steps=4
        )
        finals, _ = _serve(engine, _requests())
      greedy[enabled] = {
        i: tokens for i, tokens in _tokens(finals).items() if finals[i].outputs[0].logprobs is None
      }
      assert bool(calls) == enabled
  finally:
    jax.clear_caches()
  assert greedy[True] == greedy[False] and len(greedy[True]) == 4


# Over 10 s: another model, so the engine compiles all its programs.
def test_serves_a_model_of_its_own_that_follows_the_protocol():
  own = _OwnModel(nnx.Rngs(1))
  assert isinstance(own, pj.ModelProtocol)
  llm = pj.LLM(own, TOKENIZER, CFG, num_decode_steps=4)
  (out,) = llm.generate("HELLO", pj.SamplingParams(max_tokens=6, ignore_eos=True))
  tokens = list(TOKENIZER.encode("HELLO"))
  # Greedy without a cache, the whole (causal, end-padded) sequence each time.
  forward = jax.jit(lambda ids: own(ids, jnp.arange(11)[None], None)[0])
  for _ in range(6):
    padded = jnp.asarray([tokens + [0] * (11 - len(tokens))])
    tokens.append(int(jnp.argmax(forward(padded)[0, len(tokens) - 1])))
  assert out.outputs[0].token_ids == tokens[5:]


def test_a_model_off_the_protocol_is_refused():
  with pytest.raises(TypeError, match="nnx.Module"):
    pj.LLM(object(), TOKENIZER, CFG)
  own = _OwnModel(nnx.Rngs(1))
  own.config = dataclasses.make_dataclass("C", ["num_layers"])(2)
  with pytest.raises(ValueError, match="lacks num_kv_heads, head_dim"):
    pj.LLM(own, TOKENIZER, CFG)


def test_a_cache_that_frees_blocks_needs_the_models_layer_windows():
  windowed = dataclasses.replace(CFG, sliding_window=8, enable_prefix_caching=False)
  with pytest.raises(ValueError, match=r"the model's config has no layer_window\(layer\)"):
    pj.LLMEngine(_OwnModel(nnx.Rngs(1)), TOKENIZER, windowed)
