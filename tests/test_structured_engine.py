"""Structured outputs through the engine: masked and stepped inside the compiled decode loop."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import compile_guard
from paged_jax import structured as st
from paged_jax.engine import input_processor
from paged_jax.models import ByteTokenizer, load_tiny
from tests.test_structured import (
  CONSTRAINTS,
  check_output,
  model_constrained_greedy,
  reference_greedy,
)

PROMPT = "ANSWER, n. "
JSON_OBJECT = pj.StructuredOutputsParams(json_object=True)
ALL_CONSTRAINTS = (*CONSTRAINTS, JSON_OBJECT)
CFG = pj.CacheConfig(
  block_size=8, num_gpu_blocks=96, num_cpu_blocks=8, max_seqs=8, max_blocks_per_seq=16
)
# 26 blocks of 4 hold about two of the sequences below at once: the runs preempt.
SMALL_CFG = pj.CacheConfig(
  block_size=4,
  num_gpu_blocks=26,
  num_cpu_blocks=64,
  max_seqs=4,
  max_blocks_per_seq=16,
  watermark=0.0,
  enable_prefix_caching=True,
)
UNCONSTRAINED = (
  ("CAT, n. ", pj.SamplingParams(max_tokens=24)),
  ("DOG, n. ", pj.SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5, logprobs=2)),
)


@pytest.fixture(scope="module")
def tiny():
  return load_tiny()


# The module's engines compile one decode loop each (`decode_row_buckets=()`,
# every slot), the automaton steps inside; packed rows are tested in
# test_engine and the random traces.
@pytest.fixture(scope="module")
def llm(tiny):
  return pj.LLM(tiny, ByteTokenizer(), CFG, decode_row_buckets=())


# Over 10 s (the setup of its first test): the module's engine compiles its
# programs, the automaton steps inside the decode loop included.
@pytest.fixture(scope="module")
def mixed(llm):
  """Every constraint greedy, and the unconstrained requests, added at once.
  The default table (1,024 states, 16,384 transitions for the tiny
  vocabulary) does not hold the four automata together: the last one waits
  for room."""
  prompts = [PROMPT] * len(ALL_CONSTRAINTS) + [prompt for prompt, _ in UNCONSTRAINED]
  params = [
    pj.SamplingParams(max_tokens=96, structured_outputs=constraint)
    for constraint in ALL_CONSTRAINTS
  ] + [params for _, params in UNCONSTRAINED]
  return llm.generate(prompts, params)


def test_greedy_outputs_follow_their_constraints_and_the_host_reference(tiny, mixed):
  """The engine's tokens equal greedy decoding masked one step at a time with outlines-core."""
  tokenizer = ByteTokenizer()
  automata = [st.compile_constraint(constraint, tokenizer) for constraint in ALL_CONSTRAINTS]
  packed = st.pack_automata(automata, tiny.config.vocab_size)
  prompt = np.tile(tokenizer.encode(PROMPT), (len(automata), 1))
  states = jnp.asarray([packed.initial_state(automaton) for automaton in automata], jnp.int32)
  graphdef, weights = nnx.split(tiny)
  _, _, logits = model_constrained_greedy(graphdef, weights, packed.table, prompt, 96, states)
  for row, (automaton, constraint) in enumerate(zip(automata, ALL_CONSTRAINTS)):
    completion = mixed[row].outputs[0]
    expected, _ = reference_greedy(automaton, np.asarray(logits[row]))
    assert completion.token_ids == expected
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == automaton.eos_token_id
    check_output(constraint, completion.text)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm, mixed):
  alone = llm.generate([prompt for prompt, _ in UNCONSTRAINED], [p for _, p in UNCONSTRAINED])
  for together, by_itself in zip(mixed[len(ALL_CONSTRAINTS) :], alone):
    assert together.outputs[0].token_ids == by_itself.outputs[0].token_ids
    assert together.outputs[0].text == by_itself.outputs[0].text
    np.testing.assert_allclose(
      together.outputs[0].cumulative_logprob, by_itself.outputs[0].cumulative_logprob, rtol=1e-5
    )


def test_max_tokens_before_a_full_match_finishes_with_length(llm):
  params = pj.SamplingParams(max_tokens=6, structured_outputs=CONSTRAINTS[0])
  completion = llm.generate([PROMPT], params)[0].outputs[0]
  assert completion.finish_reason == "length"
  assert len(completion.token_ids) == 6
  assert completion.text.startswith("{")


def test_logprobs_are_those_of_the_masked_distribution(llm):
  """Every alternative with a finite log-probability is allowed, and they sum to one."""
  params = pj.SamplingParams(max_tokens=12, logprobs=3, structured_outputs=CONSTRAINTS[1])
  completion = llm.generate([PROMPT], params)[0].outputs[0]
  automaton = st.compile_constraint(CONSTRAINTS[1], ByteTokenizer())
  state = 0
  for token, alternatives in zip(completion.token_ids, completion.logprobs):
    begin, end = automaton.offsets[state], automaton.offsets[state + 1]
    allowed = set(automaton.tokens[begin:end].tolist())
    finite = {alt for alt, value in alternatives.items() if value > -np.inf}
    assert token in finite <= allowed
    if len(allowed) <= 3:  # all of the masked distribution is in the top 3
      assert sum(np.exp(alternatives[alt]) for alt in allowed) == pytest.approx(1.0, abs=1e-5)
    state = automaton.next_state(state, token)
  assert completion.token_ids[-1] == automaton.eos_token_id
  assert completion.logprobs[-1][automaton.eos_token_id] == 0.0  # EOS alone is allowed


# Slow (a warm-up of its own, 26 s): the CI soak (tests/test_soak.py) sends
# structured outputs to a warmed server and fails on any compile after its
# warm-up.
@pytest.mark.slow
def test_a_warm_engine_serves_constrained_rows_without_compiling(tiny):
  """Every program carries the engine's automaton table, so warm-up covers
  structured outputs: constrained rows, some waiting for table room, in
  ragged steps and decode loops of every length compile nothing."""
  llm = pj.LLM(tiny, ByteTokenizer(), CFG, decode_row_buckets=(), warmup=True)
  params = [pj.SamplingParams(max_tokens=40, structured_outputs=c) for c in ALL_CONSTRAINTS]
  with compile_guard.no_compiles("constrained rows after warm-up"):
    outputs = llm.generate([PROMPT] * len(params), params)
  for output, constraint in zip(outputs, ALL_CONSTRAINTS):
    assert output.outputs[0].token_ids
    if output.outputs[0].finish_reason == "stop":
      check_output(constraint, output.outputs[0].text)


def test_an_automaton_that_does_not_fit_beside_the_running_ones_waits(tiny, mixed):
  """Each automaton fits the default table alone, not two together: the
  second request waits until the first finishes, and both give the tokens
  they give in a batch."""
  engine = pj.LLMEngine(tiny, ByteTokenizer(), CFG, decode_row_buckets=())
  capacity = engine.runner.automaton_capacity
  first, second = ALL_CONSTRAINTS[0], JSON_OBJECT
  automata = [st.compile_constraint(c, ByteTokenizer()) for c in (first, second)]
  assert capacity.shortfall(automata[:1]) is None and capacity.shortfall(automata[1:]) is None
  assert capacity.shortfall(automata) is not None
  for request_id, constraint in zip("ab", (first, second)):
    engine.add_request(
      request_id, PROMPT, pj.SamplingParams(max_tokens=96, structured_outputs=constraint)
    )
  done = {}
  while engine.has_unfinished_requests():
    for output in engine.step():
      if output.finished:
        done[output.request_id] = output
    if "a" not in done:
      assert [g.request_id for g in engine.schedulers[0].running] == ["a"]
  assert done["a"].outputs[0].token_ids == mixed[0].outputs[0].token_ids
  assert done["b"].outputs[0].token_ids == mixed[len(ALL_CONSTRAINTS) - 1].outputs[0].token_ids


def test_an_automaton_larger_than_the_table_is_refused_with_both_sizes(tiny):
  small = pj.TableCapacity(states=64, edges=1024)
  engine = pj.LLMEngine(tiny, ByteTokenizer(), CFG, automaton_capacity=small)
  with pytest.raises(
    ValueError, match="needs 402 states and 9417 transitions, .* holds 64 and 1024"
  ):
    engine.add_request("a", PROMPT, pj.SamplingParams(structured_outputs=JSON_OBJECT))
  assert not engine.has_unfinished_requests()
  with pytest.raises(TypeError, match="automaton_capacity must be a pj.TableCapacity"):
    pj.LLMEngine(tiny, ByteTokenizer(), CFG, automaton_capacity=(64, 1024))
  for states, edges in ((0, 1024), (64, 2.5), (True, 8)):
    with pytest.raises(ValueError, match="must be a positive int"):
      pj.TableCapacity(states=states, edges=edges)


def test_bad_constraints_are_refused_when_added_before_any_step(tiny):
  engine = pj.LLMEngine(tiny, ByteTokenizer(), CFG, decode_row_buckets=())
  schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 3}}}
  with pytest.raises(ValueError, match="'minimum'"):
    engine.add_request(
      "a", PROMPT, pj.SamplingParams(structured_outputs=st.StructuredOutputsParams(json=schema))
    )
  with pytest.raises(ValueError, match="cannot compile"):
    engine.add_request(
      "b", PROMPT, pj.SamplingParams(structured_outputs=st.StructuredOutputsParams(regex="("))
    )
  assert not engine.has_unfinished_requests()
  assert engine.stats.loop_launches == 0
  without_tokenizer = pj.LLMEngine(tiny, None, CFG, decode_row_buckets=())
  with pytest.raises(ValueError, match="need a tokenizer"):
    without_tokenizer.add_request(
      "c", [65, 66], pj.SamplingParams(structured_outputs=CONSTRAINTS[1])
    )
  with pytest.raises(ValueError, match="use_beam_search"):
    pj.SamplingParams(n=2, use_beam_search=True, structured_outputs=CONSTRAINTS[1])


def _requests():
  """Constrained n=2 seeded samples and greedy requests sharing a prompt prefix; the
  regexes bound every output to 36 tokens, so all finish at EOS."""
  sampled = dict(temperature=1.0, top_k=40, seed=11, n=2, max_tokens=40)
  regex = lambda pattern: pj.StructuredOutputsParams(regex=pattern)
  return [
    (PROMPT + "ONE", pj.SamplingParams(**sampled, structured_outputs=regex("[a-z ]{20,30}"))),
    (PROMPT + "TWO", pj.SamplingParams(max_tokens=40, structured_outputs=regex("[A-Z]{20,30}"))),
    (PROMPT + "THREE", pj.SamplingParams(**sampled, structured_outputs=CONSTRAINTS[2])),
    (PROMPT + "FOUR", pj.SamplingParams(max_tokens=40, structured_outputs=regex("[a-z]{25,35}"))),
  ]


@pytest.fixture(scope="module")
def served_alone(llm):
  return [llm.generate([prompt], params)[0] for prompt, params in _requests()]


# Over 10 s: a tight cache with prefix caching compiles its engine's programs,
# the automaton steps inside the ragged step and the decode loop included
# (27 s on 2 cores), so every case is `slow`. "swap": a group preempted
# mid-prompt is recomputed even so; "ahead": a launch's automaton states carry
# on to the next on the device. In CI the tests above serve constrained rows
# on the ragged step and the decode loop, and the CI soak
# (tests/test_soak.py) serves structured outputs with `--async-scheduling`.
@pytest.mark.parametrize(
  "preemption_mode, ahead",
  [
    pytest.param("recompute", False, marks=pytest.mark.slow),
    pytest.param("swap", False, marks=pytest.mark.slow),
    pytest.param("swap", True, marks=pytest.mark.slow),
  ],
)
def test_prefix_caching_preemption_and_n2_keep_outputs_valid_and_equal(
  tiny, served_alone, preemption_mode, ahead
):
  small = pj.LLM(
    tiny,
    ByteTokenizer(),
    SMALL_CFG,
    preemption_mode=preemption_mode,
    decode_row_buckets=(),
    async_scheduling=ahead,
  )
  requests = _requests()
  outputs = small.generate([prompt for prompt, _ in requests], [params for _, params in requests])
  stats = small.engine.stats
  assert stats.preemptions > 0
  assert stats.prefix_cache_hit_rate > 0
  assert (stats.loop_launches_ahead > 0) == ahead
  for (_, params), together, alone in zip(requests, outputs, served_alone):
    assert len(together.outputs) == params.n
    for completion, reference in zip(together.outputs, alone.outputs):
      assert completion.token_ids == reference.token_ids
      assert completion.finish_reason == "stop"
      check_output(params.structured_outputs, completion.text)


def test_a_state_that_allows_no_token_finishes_the_row_with_abort(tiny, llm, monkeypatch):
  """An automaton "a" then "b" then nothing: the prefill draws "a", the decode loop "b"."""
  dead_end = st.Automaton(
    regex="ab",
    eos_token_id=ByteTokenizer().eos_token_id,
    accepting=np.zeros(3, bool),
    offsets=np.array([0, 1, 2, 2]),
    tokens=np.array([ord("a"), ord("b")], np.int32),
    next_states=np.array([1, 2], np.int32),
    index=None,
    index_states=np.arange(3),
  )
  monkeypatch.setattr(input_processor, "compile_constraint", lambda constraint, tokenizer: dead_end)
  params = pj.SamplingParams(max_tokens=10, structured_outputs=CONSTRAINTS[1])
  outputs = llm.generate([PROMPT, "CAT, n. "], [params, UNCONSTRAINED[0][1]])
  completion = outputs[0].outputs[0]
  assert completion.token_ids == [ord("a"), ord("b")]
  assert (completion.finish_reason, completion.stop_reason) == ("abort", "structured_outputs")
  assert outputs[1].outputs[0].finish_reason == "length"


@pytest.mark.slow  # its own decode loop (speculating, with the automata)
def test_speculation_leaves_constrained_and_unconstrained_rows_as_they_are(tiny, llm, mixed):
  # Constrained rows draw one token a step, unconstrained ones speculate
  # beside them: both give what the engine without speculation gives.
  spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
  speculating = pj.LLM(tiny, ByteTokenizer(), CFG, decode_row_buckets=(), speculative_config=spec)
  prompts = [PROMPT] * len(ALL_CONSTRAINTS) + [prompt for prompt, _ in UNCONSTRAINED]
  params = [
    pj.SamplingParams(max_tokens=96, structured_outputs=constraint)
    for constraint in ALL_CONSTRAINTS
  ] + [params for _, params in UNCONSTRAINED]
  got = speculating.generate(prompts, params)
  assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in mixed]
  assert speculating.engine.stats.spec_decode_num_draft_tokens > 0
