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

  def step(self, on_decode_step=None) -> list[RequestOutput]:
    """Runs one scheduling round: every shard's scheduler decides, the
    runner swaps pages, prefills and decodes, the output processor appends
    the tokens, and the schedulers take in the results. With
    `async_scheduling`, a round may instead read back the decode launch the
    last one dispatched ahead (dispatching the next one first when the
    round after would only decode the same rows again).

    Args:
      on_decode_step: with `stream_steps`, called on this thread with a
        list of `RequestOutput`s after each step of a decode launch, while
        the launch runs: those of the requests that drew in that step and
        did not finish (none with `output_kind="final"`). What they carry
        is not returned again (with `output_kind="delta"`). A launch
        dispatched ahead (`async_scheduling`) is not streamed.

    Returns:
      A `RequestOutput` for every request that drew tokens or finished in
      this round (with `output_kind="final"`, only finished ones); while
      the engine sleeps, only those of requests aborted before.
    """
    if self.sleep_level:  # nothing runs; aborted requests are reported
      outputs, self._pending = self._pending, []
      return outputs
    start = time.perf_counter()
    if self.running_ahead:
      touched = self._take_ahead(True)
    else:
      touched = self._round(on_decode_step)
    outputs, self._pending = self._pending, []
    outputs += self._outputs(touched)
    self.timing["rounds"] += 1
    self.timing["wall_s"] += time.perf_counter() - start
    return outputs

  def _round(self, on_decode_step) -> dict[str, SequenceGroup]:
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
      result = self._decode(rounds, touched, on_decode_step)
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

  def _decode(self, rounds, touched, on_decode_step):
    """Runs the decode loop on the running rows (as many steps as
    `ModelRunner.decode` ramps up to) and takes in what they drew (with
    `stream_steps`, step by step as they draw)."""
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
    streamed = self._streamed(decoding, on_decode_step)
    result = self._timed(
      self.runner.decode,
      self.num_decode_steps,
      stop_on_finish,
      _constraints(decoding),
      histories,
      speculate,
      self._may_run_ahead(),
      streamed and streamed.take,
    )
    seconds = time.perf_counter() - launched
    self._take_decode(rounds, result, streamed, touched)
    if self._chooser is not None:
      self._record_launch(decoding, result, speculate, seconds)
    return result

  def _streamed(self, decoding, on_outputs) -> StreamedLaunch | None:
    """What takes the steps of a decode launch on the rows `decoding` as
    they are published (with `stream_steps`), or None."""
    if self.runner.step_stream is None:
      return None
    return StreamedLaunch(self.processor, decoding, self.runner.table.slots.shape[0], on_outputs)

  def _take_decode(self, rounds, result, streamed, touched) -> None:
    """Appends a decode launch's draws (those not streamed) to the
    sequences of `rounds`; the groups they touched go into `touched`."""
    taken = None if streamed is None else streamed.taken
    for out in rounds:
      touched.update(self.processor.take_decode(out.decoding, result, taken))
    if streamed is not None:
      touched.update(streamed.unreported)

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
    touched. Its steps are not streamed: a stop string found in them would
    free blocks under the launch dispatched after it.

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
    self._take_decode(rounds, result, None, touched)
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


class StreamedLaunch:
  """Takes the steps of a decode launch as it publishes them
  (`LLMEngine(stream_steps=True)`): appends each step's draws to their
  sequences and hands the outputs of the groups that drew and did not
  finish to `on_outputs`.

  Args:
    processor: the engine's `OutputProcessor`.
    decoding: `(slot, (group, seq))` of the launch's sequences.
    num_slots: the sequence slots.
    on_outputs: called with each step's `RequestOutput`s, or None.

  Attributes:
    taken: int `[num_slots]`, each slot's draws appended so far.
    unreported: the groups whose outputs the launch's read must report: those
      that finished (they are retired then), and without `on_outputs` all
      that drew.
  """

  def __init__(self, processor, decoding, num_slots: int, on_outputs):
    self.processor, self.on_outputs = processor, on_outputs
    self.by_slot = dict(decoding)
    self.taken = np.zeros(num_slots, np.int64)
    self.unreported: dict[str, SequenceGroup] = {}

  def take(self, slots: np.ndarray, draw) -> None:
    """Takes one step: `slots` drew `draw` (`[n]` and `[n, k]` arrays)."""
    drawn: dict[str, SequenceGroup] = {}
    for i, slot in enumerate(slots.tolist()):
      group, seq = self.by_slot.get(slot, (None, None))
      if seq is None or seq.finished:
        continue
      one = slice(i, i + 1)
      self.processor.append(
        group, seq, draw.tokens[one], draw.logprob[one], draw.top_ids[one], draw.top_logprobs[one]
      )
      self.taken[slot] += 1
      drawn[group.request_id] = group
    outputs = []
    for request_id, group in drawn.items():
      if group.finished or self.on_outputs is None:
        self.unreported[request_id] = group
      elif group.params.output_kind != "final":
        outputs.append(self.processor.output(group))
    if outputs:
      self.on_outputs(outputs)


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
