"""Randomized request traces of `pj.LLMEngine`, and what every step must keep.

A trace is a seeded random sequence of `add_request` (random prompts, `n`,
beams, stop strings, seeds, logprobs, `max_tokens`), `abort_request` and
`step` calls, then steps until every request finished. After every step the
checks below run: the block manager's invariants on every data shard, no
block held by a slot that no unfinished request holds, and every request's
outputs (it ends exactly once, with a finish reason, and nothing comes
after). Once the trace drained, all blocks are free, and every greedy, seeded
or beam request that was not aborted is served again alone on the same
engine: it must give the same outputs (tokens, text, finish and stop
reasons, log-probabilities).

Used by tests/test_engine_random.py (one device) and tests/sharding_checks.py
(two data shards, in the 8-device subprocess). Only the functions of the
first section read the engine's internals; a refactor of the engine adapts
those.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

import paged_jax as pj
from paged_jax.block_manager import hybrid, manager
from paged_jax.models import ByteTokenizer, tiny_corpus

# Engine internals the checks read. Adapt these when the engine changes.


def num_data_shards(engine: pj.LLMEngine) -> int:
  """Data shards of the engine (one manager state each)."""
  return engine.cache_manager.num_shards


def slots_of_unfinished_requests(engine: pj.LLMEngine) -> dict[str, set[tuple[int, int]]]:
  """`(data shard, local sequence slot)` pairs each unfinished request holds
  (a beam request's reserved slots included)."""
  max_seqs = engine.cfg.max_seqs
  held = {}
  for request_id, group in engine._groups.items():
    slots = set(group.beam_slots) | {seq.slot for seq in group.seqs if seq.slot >= 0}
    held[request_id] = {divmod(slot, max_seqs) for slot in slots}
  return held


def slots_freed_at_the_next_step(engine: pj.LLMEngine) -> set[tuple[int, int]]:
  """`(data shard, sequence id)` of sequences that finished on the host
  (stop strings) while a decode launch ran ahead (`async_scheduling`): their
  blocks are freed once the next step reads that launch back."""
  if engine._deferred is None:
    return set()
  rounds, _ = engine._deferred
  return {
    divmod(seq.slot, engine.cfg.max_seqs)
    for out in rounds
    for group in out.decoding
    for seq in group.seqs
    if seq.finished and seq.slot >= 0
  }


def num_cpu_blocks(engine: pj.LLMEngine) -> int:
  """CPU blocks of one shard (of every type, on a hybrid cache)."""
  hybrid_cfg = engine.cache_manager.hybrid
  return engine.cfg.num_cpu_blocks if hybrid_cfg is None else sum(hybrid_cfg.cpu_blocks)


def num_free_cpu_blocks(engine: pj.LLMEngine, shard: int) -> int:
  return engine.cache_manager.num_free_cpu_blocks(shard)


# Checks.


def _is_hybrid(state) -> bool:
  return isinstance(state, hybrid.HybridState)


@functools.cache
def _jitted_block_tables(hybrid_state: bool):
  return jax.jit(hybrid.get_block_tables if hybrid_state else manager.get_block_tables)


def block_tables(state) -> np.ndarray:
  """int32 `[types, max_seqs, max_blocks_per_seq]`: every slot's block table
  in each attention type (one type unless `state` is a hybrid cache's)."""
  slots = np.arange(state.cfg.max_seqs, dtype=np.int32)
  tables = _jitted_block_tables(_is_hybrid(state))(state, slots)
  return np.asarray(tables) if _is_hybrid(state) else np.asarray(tables)[None]


def check_invariants(state) -> None:
  """The manager's invariants (each type's, and that the types agree, on a hybrid cache)."""
  if _is_hybrid(state):
    hybrid.check_hybrid_invariants(state)
  else:
    pj.check_invariants(state)


def check_blocks(engine: pj.LLMEngine) -> None:
  """The manager's invariants on every shard; only slots of unfinished
  requests hold blocks (or, for one more step, those of sequences that
  finished while a launch ran ahead), and no two requests share a slot."""
  owners = dict.fromkeys(slots_freed_at_the_next_step(engine), "a launch ahead")
  for request_id, slots in slots_of_unfinished_requests(engine).items():
    for slot in slots:
      assert slot not in owners, f"requests {owners[slot]!r} and {request_id!r} share slot {slot}"
      owners[slot] = request_id
  for shard in range(num_data_shards(engine)):
    state = engine.shard_state(shard)
    check_invariants(state)
    tables = block_tables(state)
    for local in np.flatnonzero((tables >= 0).any(axis=(0, 2))):
      held = [row[row >= 0].tolist() for row in tables[:, local]]
      assert (shard, int(local)) in owners, (
        f"slot {local} of shard {shard} holds blocks {held} (per type)"
        " but no unfinished request holds the slot"
      )


def check_all_free(engine: pj.LLMEngine) -> None:
  """With nothing left to serve, every block of every shard is free (cached
  blocks only in the evictor) and no slot holds a table."""
  assert not engine.has_unfinished_requests()
  assert not slots_of_unfinished_requests(engine)
  cfg, shards = engine.cfg, num_data_shards(engine)
  assert engine.num_free_gpu_blocks() == shards * cfg.num_gpu_blocks, (
    f"{engine.num_free_gpu_blocks()} of {shards * cfg.num_gpu_blocks} GPU blocks free"
  )
  for shard in range(shards):
    state = engine.shard_state(shard)
    check_invariants(state)
    assert (block_tables(state) == -1).all(), f"shard {shard} still holds tables"
    free_cpu, cpu = num_free_cpu_blocks(engine, shard), num_cpu_blocks(engine)
    assert free_cpu == cpu, f"shard {shard}: {free_cpu} of {cpu} CPU blocks free"


# Requests.

TOKENIZER = ByteTokenizer()
STOP_STRINGS = ("e", "the", ", ", ".", "in", "\n", "s ", "or")


@functools.cache
def prompt_bases() -> tuple[str, ...]:
  """Eight ASCII openings of dictionary entries; prompts are their prefixes,
  so requests share prefixes (prefix-cache hits)."""
  corpus = tiny_corpus()
  bases, start = [], 0
  while len(bases) < 8:
    start = corpus.index("\n\n", start) + 2
    text = corpus[start : start + 40]
    if text.isascii() and len(text) == 40 and text[:1].isupper():
      bases.append(text)
    start += 400
  return tuple(bases)


@dataclasses.dataclass(frozen=True)
class TraceShape:
  """How large a trace's requests are (small: every shape compiles once).

  Attributes:
    num_ops: random calls before the trace drains.
    max_prompt: longest prompt, in tokens (bytes).
    max_tokens: largest `max_tokens`.
    max_n: largest `n` (samples, or beams).
    beams: whether requests may use beam search.
    impossible: chance that a request can never fit (it must fail with
      finish reason "error").
  """

  num_ops: int = 40
  max_prompt: int = 16
  max_tokens: int = 12
  max_n: int = 2
  beams: bool = True
  impossible: float = 0.05


def random_request(rng: np.random.Generator, shape: TraceShape, too_long: int):
  """A random `(prompt, SamplingParams)`; `too_long` is a prompt length
  that never fits the engine."""
  bases = prompt_bases()
  base = bases[int(rng.integers(len(bases)))]
  if rng.random() < shape.impossible:
    return (base * (too_long // len(base) + 1))[:too_long], pj.SamplingParams(max_tokens=2)
  prompt = base[: int(rng.integers(1, shape.max_prompt + 1))]
  kind = rng.choice(["greedy", "seeded", "unseeded", "beam"], p=[0.35, 0.35, 0.1, 0.2])
  if kind == "beam" and not shape.beams:
    kind = "greedy"
  options = dict(
    n=int(rng.integers(1, shape.max_n + 1)),
    max_tokens=int(rng.integers(1, shape.max_tokens + 1)),
    ignore_eos=bool(rng.random() < 0.5),
  )
  if rng.random() < 0.3:
    options["stop"] = [str(s) for s in rng.choice(STOP_STRINGS, int(rng.integers(1, 3)), False)]
  if rng.random() < 0.3:
    options["logprobs"] = int(rng.integers(0, 3))
  if rng.random() < 0.15:
    options["prompt_logprobs"] = int(rng.integers(0, 3))
  if kind == "beam":
    options["use_beam_search"] = True
    prompt = base[: max(2, len(prompt))]
  elif kind != "greedy":
    options.update(temperature=float(rng.choice([0.7, 1.0])), top_k=int(rng.choice([0, 20])))
    options["top_p"] = float(rng.choice([1.0, 0.9]))
    if kind == "seeded":
      options["seed"] = int(rng.integers(2**16))
  return prompt, pj.SamplingParams(**options)


def reproducible(params: pj.SamplingParams) -> bool:
  """Whether a request's outputs are the same however it is served."""
  return params.temperature == 0.0 or params.seed is not None


# The ledger: what every request reported.


@dataclasses.dataclass
class Ledger:
  """Checks every `RequestOutput` against what the trace asked for.

  Attributes:
    max_len: positions a sequence may fill (the model's and the block
      table's).
    requests: request id -> `(prompt, params)` of every added request.
    finals: request id -> its finishing `RequestOutput`.
    aborted: ids the trace aborted while they were unfinished.
    reported: request id -> the token ids of its last output, per sequence.
  """

  max_len: int
  requests: dict = dataclasses.field(default_factory=dict)
  finals: dict = dataclasses.field(default_factory=dict)
  aborted: set = dataclasses.field(default_factory=set)
  reported: dict = dataclasses.field(default_factory=dict)

  def unfinished(self) -> list[str]:
    return [i for i in self.requests if i not in self.finals]

  def record(self, outputs) -> None:
    """Checks one step's outputs."""
    ids = [out.request_id for out in outputs]
    assert len(set(ids)) == len(ids), f"a request reported twice in one step: {ids}"
    for out in outputs:
      self._check(out)

  def _check(self, out: pj.RequestOutput) -> None:
    request_id = out.request_id
    assert request_id in self.requests, f"output of unknown request {request_id!r}"
    assert request_id not in self.finals, f"{request_id!r} reported after it finished"
    prompt, params = self.requests[request_id]
    assert out.prompt == prompt
    assert len(out.outputs) == params.n, (request_id, len(out.outputs))
    assert [c.index for c in out.outputs] == list(range(params.n))
    reasons = [c.finish_reason for c in out.outputs]
    assert out.finished == all(r is not None for r in reasons), (request_id, reasons)
    assert set(reasons) <= {"stop", "length", "abort", "error", None}, reasons
    assert (out.error is not None) == ("error" in reasons), (request_id, reasons, out.error)
    if "abort" in reasons:
      assert request_id in self.aborted, f"{request_id!r} finished with 'abort' unasked"
    if params.use_beam_search and "error" not in reasons:
      assert out.finished, f"beam request {request_id!r} reported before it finished"
    previous = self.reported.get(request_id)
    for j, completion in enumerate(out.outputs):
      if previous is not None:
        assert completion.token_ids[: len(previous[j])] == previous[j], (
          f"{request_id!r} sequence {j}: reported tokens changed"
        )
      self._check_completion(request_id, prompt, params, completion)
    self.reported[request_id] = [c.token_ids for c in out.outputs]
    if out.finished:
      self.finals[request_id] = out
      if request_id in self.aborted:
        assert "abort" in reasons or "error" in reasons, (request_id, reasons)

  def _check_completion(self, request_id, prompt, params, completion) -> None:
    tokens, reason = completion.token_ids, completion.finish_reason
    limit = min(params.max_tokens, self.max_len - len(TOKENIZER.encode(prompt)))
    assert len(tokens) <= max(limit, 0), (request_id, len(tokens), limit)
    if reason is None or reason == "abort":
      return
    where = f"request {request_id!r} sequence {completion.index}"
    if reason == "length":
      assert len(tokens) == limit, f"{where}: 'length' after {len(tokens)} of {limit} tokens"
    if reason == "stop":
      stop = completion.stop_reason
      if isinstance(stop, str):
        assert stop in params.stop and stop in TOKENIZER.decode(tokens), (where, stop)
      else:
        assert tokens and tokens[-1] == stop, (where, tokens, stop)
    if params.use_beam_search:
      return
    assert completion.text == expected_text(completion), (where, completion.text)
    assert not any(s in completion.text for s in params.stop), (where, completion.text)
    if params.logprobs is not None and reason != "error":
      assert len(completion.logprobs) == len(tokens), where
      for token, alternatives in zip(tokens, completion.logprobs):
        assert token in alternatives and len(alternatives) <= params.logprobs + 1, where
      chosen = sum(alternatives[t] for t, alternatives in zip(tokens, completion.logprobs))
      assert abs(completion.cumulative_logprob - chosen) < 1e-3, (where, chosen)


def expected_text(completion: pj.CompletionOutput) -> str:
  """A finished sequence's text: its tokens decoded, without a stop token,
  cut before a stop string."""
  tokens, stop = completion.token_ids, completion.stop_reason
  if isinstance(stop, str):
    return TOKENIZER.decode(tokens).split(stop)[0]
  if completion.finish_reason == "stop":
    tokens = tokens[:-1]
  return TOKENIZER.decode(tokens)


def same_outputs(got: pj.RequestOutput, want: pj.RequestOutput) -> str | None:
  """Why two finished outputs of one request differ, or None."""
  for a, b in zip(got.outputs, want.outputs):
    fields = ("token_ids", "text", "finish_reason", "stop_reason")
    for field in fields:
      if getattr(a, field) != getattr(b, field):
        return (
          f"sequence {a.index} {field}: {getattr(a, field)!r} != {getattr(b, field)!r}"
          + _first_difference(a, b)
        )
    if abs(a.cumulative_logprob - b.cumulative_logprob) > 1e-4:
      return (
        f"sequence {a.index} cumulative_logprob {a.cumulative_logprob} != {b.cumulative_logprob}"
      )
    if (a.logprobs is None) != (b.logprobs is None):
      return f"sequence {a.index} logprobs {a.logprobs} != {b.logprobs}"
    for t, (x, y) in enumerate(zip(a.logprobs or [], b.logprobs or [])):
      if x.keys() != y.keys() or any(abs(x[k] - y[k]) > 1e-4 for k in x):
        return f"sequence {a.index} logprobs of token {t}: {x} != {y}"
  return None


def _first_difference(a: pj.CompletionOutput, b: pj.CompletionOutput) -> str:
  """Where two sequences' tokens part, with both runs' log-probabilities
  there (a near tie or a wrong cache)."""
  first = next(
    (t for t, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
    min(len(a.token_ids), len(b.token_ids)),
  )
  if not a.logprobs or not b.logprobs or first >= min(len(a.logprobs), len(b.logprobs)):
    return f" (first difference at token {first})"
  return f" (first difference at token {first}: {a.logprobs[first]} vs {b.logprobs[first]})"


# Traces.


@dataclasses.dataclass
class TraceResult:
  """What a trace did (to check that it reached the paths it is for)."""

  requests: int = 0
  compared: int = 0
  aborted: int = 0
  errors: int = 0
  steps: int = 0


def _serve_until_done(engine: pj.LLMEngine, ledger: Ledger, log: list, max_steps: int) -> int:
  steps = 0
  while engine.has_unfinished_requests():
    assert steps < max_steps, f"not finished after {max_steps} steps: {ledger.unfinished()}"
    outputs = engine.step()
    log.append(("step",))
    ledger.record(outputs)
    check_blocks(engine)
    steps += 1
  return steps


def run_trace(
  engine: pj.LLMEngine, seed: int, shape: TraceShape, log: list, served_alone=None
) -> TraceResult:
  """One random trace on `engine` (idle before and after), every check on
  the way; `log` gets the calls made (to reproduce a failure), and the list
  `served_alone` (if given) `(prompt, params, final output)` of each request
  that equalled itself served alone (for another engine to serve too).

  Raises:
    AssertionError: naming the first broken rule.
  """
  rng = np.random.default_rng(seed)
  cfg = engine.cfg
  max_len = min(engine.model_config.max_seq_len, cfg.max_tokens_per_seq)
  ledger = Ledger(max_len=max_len)
  result = TraceResult()
  check_all_free(engine)
  for op in range(shape.num_ops):
    choice = rng.random()
    if choice < 0.45:
      request_id = f"{seed}-{op}"
      prompt, params = random_request(rng, shape, too_long=max_len + 4)
      log.append(("add_request", request_id, prompt, params))
      engine.add_request(request_id, prompt, params)
      ledger.requests[request_id] = (prompt, params)
    elif choice < 0.55 and ledger.requests:
      # Any request: aborting a finished one must change nothing.
      request_id = list(ledger.requests)[int(rng.integers(len(ledger.requests)))]
      log.append(("abort_request", request_id))
      engine.abort_request(request_id)
      if request_id not in ledger.finals:
        ledger.aborted.add(request_id)
    else:
      log.append(("step",))
      ledger.record(engine.step())
      check_blocks(engine)
      result.steps += 1
  result.steps += _serve_until_done(engine, ledger, log, max_steps=400)
  assert set(ledger.finals) == set(ledger.requests), "a request never finished"
  check_all_free(engine)
  result.requests = len(ledger.requests)
  result.aborted = len(ledger.aborted)
  for request_id, final in ledger.finals.items():
    reasons = {c.finish_reason for c in final.outputs}
    result.errors += "error" in reasons
    prompt, params = ledger.requests[request_id]
    if "abort" in reasons or not reproducible(params):
      continue
    alone = Ledger(max_len=max_len)
    alone.requests[request_id] = (prompt, params)
    log.append(("alone", request_id))
    engine.add_request(request_id, prompt, params)
    _serve_until_done(engine, alone, log, max_steps=100)
    check_all_free(engine)
    difference = same_outputs(final, alone.finals[request_id])
    assert difference is None, f"{request_id!r} differs from the request served alone: {difference}"
    result.compared += 1
    if served_alone is not None:
      served_alone.append((prompt, params, final))
  return result


def describe(log: list) -> str:
  """The calls of a trace, one per line (a failure's reproduction)."""
  return "\n".join(repr(call) for call in log)


def run_traces(engine: pj.LLMEngine, seeds, shape: TraceShape, served_alone=None) -> dict:
  """Runs a trace per seed; returns totals and the failures (the seed, the
  broken rule and the calls made), without raising; `served_alone` as in
  `run_trace`."""
  totals, failures = TraceResult(), []
  for seed in seeds:
    log = []
    try:
      result = run_trace(engine, seed, shape, log, served_alone)
    except AssertionError as error:
      failures.append(f"seed {seed}: {error}\ncalls:\n{describe(log)}")
      break  # the engine may be left in any state
    for field in dataclasses.fields(TraceResult):
      setattr(totals, field.name, getattr(totals, field.name) + getattr(result, field.name))
  stats = engine.stats
  return dict(
    dataclasses.asdict(totals),
    failures=failures,
    preemptions=stats.preemptions,
    loop_launches_ahead=stats.loop_launches_ahead,
    swaps=stats.swaps,
    cow_copies=stats.cow_copies,
    prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
  )
