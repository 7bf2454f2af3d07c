"""`LLMEngine.step`: one scheduling round, its launches, and the decode
launch that runs ahead with async scheduling."""

from __future__ import annotations

import time

import numpy as np

from paged_jax.engine import speculative
from paged_jax.engine.outputs import RequestOutput
from paged_jax.engine.scheduler_output import SchedulerOutput
from paged_jax.engine.sequence import SequenceGroup


class EngineRounds:
  """The stepping part of `LLMEngine` (a mixin: it runs on the engine's
  `schedulers`, `runner`, `cache_manager`, `processor`, speculation settings and
  request bookkeeping, and finishes groups with its `_finish` and
  `_retire`)."""

  def step(self) -> list[RequestOutput]:
    """Runs one scheduling round: every shard's scheduler decides, the
    runner swaps pages, prefills and decodes, the output processor appends
    the tokens, and the schedulers take in the results. With
    `async_scheduling`, a round may instead read back the decode launch the
    last one dispatched ahead (dispatching the next one first when the
    round after would only decode the same rows again).

    Returns:
      A `RequestOutput` for every request that drew tokens or finished in
      this round (with `output_kind="final"`, only finished ones); while
      the engine sleeps, only those of requests aborted before.
    """
    if self.sleep_level:  # nothing runs; aborted requests are reported
      outputs, self._pending = self._pending, []
      return outputs
    start = time.perf_counter()
    touched = self._take_ahead(True) if self.running_ahead else self._round()
    outputs, self._pending = self._pending, []
    outputs += self._outputs(touched)
    self.timing["rounds"] += 1
    self.timing["wall_s"] += time.perf_counter() - start
    return outputs

  def _round(self) -> dict[str, SequenceGroup]:
    """A scheduling round (see `step`); returns the groups it touched."""
    if self.runner.arrival_watch is not None:  # the schedulers see every request added
      self.runner.arrival_watch.clear()
    rounds = [scheduler.schedule() for scheduler in self.schedulers]
    for out in rounds:
      for group in out.failed:
        self._finish(group, "error")
      for plan in out.swap_out:
        self.cache_manager.move_out(plan)
      for plan in out.swap_in:
        self.cache_manager.move_in(plan)
      self.runner.table.apply(out.rows)
    touched: dict[str, SequenceGroup] = {}
    chunks = [chunk for out in rounds for chunk in out.chunks]
    result = None
    if chunks and self.speculative is None:
      result = self._ragged_step(rounds, chunks, touched)
    elif chunks or self.runner.table.has_running_rows():
      if chunks:
        self._prefill(rounds, chunks, touched)
      result = self._decode(rounds, touched)
    self._update_or_defer(rounds, result)
    return touched

  def _prompt_draws(self, chunks):
    """`(samples, their constraints)` of a round's `chunks`: the sequences
    that draw their first token (see `ModelRunner.prefill`)."""
    drawing = [(chunk.group, s) for chunk in chunks for s in chunk.samples]
    samples = [(row, s.slot) for row, chunk in enumerate(chunks) for s in chunk.samples]
    return samples, _constraints(enumerate(drawing))

  def _ragged_step(self, rounds, chunks, touched):
    """Runs a round's chunks with one decode step of its running rows
    (`ModelRunner.ragged_step`) and takes in what they drew."""
    samples, sample_constraints = self._prompt_draws(chunks)
    draws, scores, result = self._timed(
      self.runner.ragged_step,
      chunks,
      samples,
      sample_constraints,
      _constraints(_decoding(rounds)),
    )
    for out in rounds:
      touched.update(self.processor.take_decode(out.decoding, result))
    touched.update(self.processor.take_prefill(chunks, draws, scores))
    for scheduler, out in zip(self.schedulers, rounds):
      self.runner.table.apply(scheduler.after_prefill(out))
    return result

  def _prefill(self, rounds, chunks, touched) -> None:
    """Runs a speculating round's chunks in their own launch."""
    samples, sample_constraints = self._prompt_draws(chunks)
    draws, scores = self._timed(self.runner.prefill, chunks, samples, sample_constraints)
    touched.update(self.processor.take_prefill(chunks, draws, scores))
    for scheduler, out in zip(self.schedulers, rounds):
      self.runner.table.apply(scheduler.after_prefill(out))

  def _decode(self, rounds, touched):
    """Runs the decode loop on the running rows (as many steps as
    `ModelRunner.decode` ramps up to) and takes in what they drew."""
    if not self.runner.table.has_running_rows():
      return None
    stop_on_finish = any(out.stop_on_finish for out in rounds)
    decoding = _decoding(rounds)
    speculate = self._chooser is None or self._chooser.speculate(self.runner.next_decode_rows())
    histories = []
    if self.speculative is not None and speculate:
      histories = [
        (slot, np.concatenate([group.prompt_token_ids, seq.token_ids]).astype(np.int32))
        for slot, (group, seq) in decoding
      ]
    launched = time.perf_counter()
    result = self._timed(
      self.runner.decode,
      self.num_decode_steps,
      stop_on_finish,
      _constraints(decoding),
      histories,
      speculate,
      self._may_run_ahead(),
    )
    seconds = time.perf_counter() - launched
    for out in rounds:
      touched.update(self.processor.take_decode(out.decoding, result))
    if self._chooser is not None:
      self._record_launch(decoding, result, speculate, seconds)
    return result

  def _may_run_ahead(self) -> bool:
    """Whether to dispatch the next decode launch before reading this one
    back: with `async_scheduling`, while rows decode and every shard's next
    round would only decode them again (`Scheduler.decodes_only`)."""
    return (
      self.async_scheduling
      and self.runner.table.has_running_rows()
      and all(scheduler.decodes_only() for scheduler in self.schedulers)
    )

  def _update_or_defer(self, rounds, result) -> None:
    """Hands the schedulers a round's decode `result`, or, while a launch
    runs ahead, keeps it until that one is read back: no block manager
    call goes between a launch and the one dispatched after it."""
    if self.running_ahead:
      self._deferred = (rounds, result)
      return
    for scheduler, out in zip(self.schedulers, rounds):
      scheduler.update(
        out,
        None if result is None else result.finished,
        result is not None and result.out_of_blocks[scheduler.shard],
      )

  def _take_ahead(self, may_run_ahead: bool) -> dict[str, SequenceGroup]:
    """Reads back the decode launch that runs ahead (dispatching the next
    one first, if `may_run_ahead` and the schedulers would take the last
    round's results without a block manager call); returns the groups it
    touched.

    Sequences that finished on the host (stop strings) before it ran drew
    tokens in it too: those are dropped, and their blocks freed (by the
    device, if it finished them there too).
    """
    rounds, before = self._deferred
    self._deferred = None
    run_ahead = (
      may_run_ahead
      and self._may_run_ahead()
      and self.runner.ahead_rows_fit()
      and not any(
        scheduler.update_frees(out, before.finished, before.out_of_blocks[scheduler.shard])
        for scheduler, out in zip(self.schedulers, rounds)
      )
    )
    result = self._timed(self.runner.take_ahead, run_ahead)
    for scheduler, out in zip(self.schedulers, rounds):
      scheduler.update(
        out, before.finished | result.finished, before.out_of_blocks[scheduler.shard]
      )
    rounds = [SchedulerOutput(s.shard, decoding=list(s.running)) for s in self.schedulers]
    touched: dict[str, SequenceGroup] = {}
    for out in rounds:
      touched.update(self.processor.take_decode(out.decoding, result))
    self._update_or_defer(rounds, result)
    return touched

  def _outputs(self, touched: dict[str, SequenceGroup]) -> list[RequestOutput]:
    """The outputs of the groups a round touched; retires finished ones."""
    outputs = []
    for group in touched.values():
      if group.finished:
        self._retire(group)
      if group.finished or (group.params.output_kind != "final" and not group.beam):
        outputs.append(self.processor.output(group))
    return outputs

  def _timed(self, function, *args):
    start = time.perf_counter()
    result = function(*args)
    self.timing["device_s"] += time.perf_counter() - start
    return result

  def _record_launch(self, decoding, result, speculated: bool, seconds: float) -> None:
    """Tells the launch chooser a decode launch's time and speculation's
    tokens per row and step: counted, or for a plain launch those of prompt
    lookup's steps over the positions whose next `k` tokens are known (a
    launch takes the positions after the previous one's)."""
    chooser, k = self._chooser, self.speculative.num_speculative_tokens
    chooser.record_time(result.num_rows, speculated, seconds, result.steps)
    if speculated:
      chooser.record_tokens(result.num_rows, int(result.counts.sum()), result.row_steps)
      return
    steps = drawn = 0
    for slot, (group, seq) in decoding:
      if seq.finished:
        continue
      tokens = np.concatenate([group.prompt_token_ids, seq.token_ids]).astype(np.int32)
      drawn_before = len(tokens) - int(result.counts[slot])
      first = max(len(group.prompt_token_ids) + 1, drawn_before - k)
      at = range(first, max(first, len(tokens) - k))  # none while fewer than k follow
      row_steps, row_drawn = speculative.lookup_walk(tokens, at, self.speculative)
      steps, drawn = steps + row_steps, drawn + row_drawn
    chooser.record_tokens(result.num_rows, drawn, steps)


def _decoding(rounds) -> list:
  """`(slot, (group, seq))` of the rounds' sequences that hold a slot,
  beam groups' aside."""
  return [
    (s.slot, (group, s))
    for out in rounds
    for group in out.decoding
    if not group.beam
    for s in group.live()
    if s.slot >= 0
  ]


def _constraints(rows) -> list:
  """`(row, automaton, state)` of the constrained sequences among `(row,
  (group, seq))` pairs, for the runner's launches."""
  return [
    (row, group.automaton, seq.automaton_state)
    for row, (group, seq) in rows
    if group.automaton is not None
  ]
