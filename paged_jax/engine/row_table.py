"""The row table: every sequence slot's decoding state between launches.

The model runner's persistent batch: for each global sequence slot, whether
it decodes, from which token, how many it drew and may draw, and with which
sampling parameters (small NumPy arrays on the host), and the beam state
(on the device). The scheduler encodes a sequence's row with `new_row`,
and its `RowChanges` change the table (`apply`); a launch reads the rows
it runs (`row_params`, `row_constraints`), its carry is taken back
(`take`), and what it did per slot is its `DecodeResult`. A launch's rows
are slots (-1: padding), or every slot in order (None).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from paged_jax.engine import programs
from paged_jax.engine.scheduler_output import NewRow, RowChanges
from paged_jax.engine.sequence import Sequence, SequenceGroup
from paged_jax.sampling import Draw, RowParams


@dataclasses.dataclass
class DecodeResult:
  """What one launch of the decode loop did.

  Attributes:
    draws: NumPy draws `[S, num_steps]` of every row.
    counts: int `[S]`, the tokens each row drew.
    finished: bool `[S]`, the rows that finished on the device (their
      blocks are freed).
    out_of_blocks: bool `[D]`, the data shards whose blocks ran out (the
      loop stopped for them).
    finished_beams: the hypotheses of each beam group that finished, by
      leader slot (see `RowTable.finished_beams`).
    num_rows: the launch's rows (its row bucket, over every data shard).
    steps: steps the loop ran.
    row_steps: rows that decoded, summed over the steps.
  """

  draws: Draw
  counts: np.ndarray
  finished: np.ndarray
  out_of_blocks: np.ndarray
  finished_beams: dict[int, list]
  num_rows: int = 0
  steps: int = 0
  row_steps: int = 0


class RowTable:
  """Every slot's decoding state.

  Attributes:
    sampling: `RowParams` `[S]`, each slot's sampling parameters.
    slots: int32 `[S]`, the slot where it decodes, -1 where not.
    last_token: int32 `[S]`, the token it decodes from.
    num_generated: int32 `[S]`, tokens it drew.
    limit: int32 `[S]`, tokens it may draw.
    in_beam_group: bool `[S]`, slots of a running beam group.
    beams: the beam state (`beam.Beams`, per slot, on the device).
  """

  def __init__(self, num_slots: int, stop_width: int, beams):
    key_words = jax.random.key_data(jax.random.key(0)).shape[-1]
    self.sampling = RowParams(
      temperature=np.zeros(num_slots, np.float32),
      top_k=np.zeros(num_slots, np.int32),
      top_p=np.ones(num_slots, np.float32),
      key_data=np.zeros((num_slots, key_words), np.uint32),
      stop_ids=np.full((num_slots, stop_width), -1, np.int32),
      processed=np.zeros(num_slots, bool),
      wants_top=np.zeros(num_slots, bool),
    )
    self.slots = np.full(num_slots, -1, np.int32)
    self.last_token = np.zeros(num_slots, np.int32)
    self.num_generated = np.zeros(num_slots, np.int32)
    self.limit = np.zeros(num_slots, np.int32)
    self.in_beam_group = np.zeros(num_slots, bool)
    self.beams = beams

  def apply(self, changes: RowChanges) -> None:
    """Carries out the scheduler's row changes, in their order (see
    `RowChanges`)."""
    stopped = np.asarray(changes.stop, np.int64)
    self.slots[stopped] = -1
    for slots in changes.clear_beams:
      self.beams = programs.clear_beams(self.beams, self.group_slots(slots))
      self.in_beam_group[slots] = False
    sampling = self.sampling
    for row in changes.new_rows:
      slot = row.slot
      sampling.temperature[slot], sampling.top_k[slot] = row.temperature, row.top_k
      sampling.top_p[slot], sampling.key_data[slot] = row.top_p, row.key_data
      sampling.processed[slot], sampling.wants_top[slot] = row.processed, row.wants_top
      sampling.stop_ids[slot] = -1
      sampling.stop_ids[slot, : len(row.stop_ids)] = row.stop_ids
      self.limit[slot] = row.limit
    for slots, width, length_penalty in changes.new_beams:
      self.beams = programs.start_beams(self.beams, self.group_slots(slots), width, length_penalty)
      self.in_beam_group[slots] = True
    for slot, last_token, num_generated in changes.start:
      self.slots[slot] = slot
      self.last_token[slot], self.num_generated[slot] = last_token, num_generated
    resumed = np.asarray(changes.resume, np.int64)
    self.slots[resumed] = resumed

  def group_slots(self, slots) -> np.ndarray:
    """A beam group's slots padded with -1 to the group capacity (one
    compile of the beam programs whatever the width)."""
    padded = np.full(self.beams.slots.shape[1], -1, np.int32)
    padded[: len(slots)] = slots
    return padded

  def has_running_rows(self) -> bool:
    return bool(np.any(self.slots >= 0))

  def finished_beams(self) -> dict[int, list]:
    """The hypotheses of each beam group that finished, by leader slot:
    `(tokens, cumulative logprob, stopped)` triples, best first. While no
    group runs none, read without waiting for a launch that runs ahead."""
    if not np.any(self.in_beam_group):
      return {}
    leaders = np.flatnonzero(np.asarray(self.beams.done))
    beams = jax.device_get(self.beams) if leaders.size else None
    return {
      int(leader): _hypotheses(jax.tree.map(lambda a, leader=leader: a[leader], beams))
      for leader in leaders
    }

  def slots_of(self, row_slots) -> np.ndarray:
    """The slots of a launch's `row_slots`: themselves, or every slot for None."""
    return np.arange(self.slots.shape[0]) if row_slots is None else row_slots

  def row_params(self, row_slots) -> RowParams:
    """The sampling parameters of a launch's `row_slots` (see `slots_of`)."""
    return (
      self.sampling
      if row_slots is None
      else jax.tree.map(lambda a: a[np.maximum(row_slots, 0)], self.sampling)
    )

  def row_constraints(self, row_slots, constraints) -> tuple[int, list]:
    """The launch's row count and its `(row, automaton, state)` triples from
    `(slot, automaton, state)` ones of the running slots."""
    slots = self.slots_of(row_slots)
    row_of = np.full(self.slots.shape[0], -1)
    row_of[slots[slots >= 0]] = np.flatnonzero(slots >= 0)
    return slots.shape[0], [
      (row_of[slot], automaton, state)
      for slot, automaton, state in constraints
      if row_of[slot] >= 0 and self.slots[slot] >= 0
    ]

  def take(self, slots: np.ndarray, loop) -> tuple[np.ndarray, np.ndarray]:
    """Takes the new state of the rows of a launch on `slots` from its
    carry `loop`; returns `(counts, finished)` per slot: the tokens each
    drew, and the slots that finished on the device."""
    before = self.num_generated.copy()
    running = self.slots >= 0
    live = slots >= 0
    ran = slots[live]
    self.slots[ran] = np.asarray(loop.slots)[live]
    self.last_token[ran] = np.asarray(loop.last_token)[live]
    self.num_generated[ran] = np.asarray(loop.num_generated)[live]
    return self.num_generated - before, running & (self.slots < 0)


def new_row(group: SequenceGroup, seq: Sequence, slot: int, greedy: bool) -> NewRow:
  """The row of `seq` (of `group`) in `slot`: its request's sampling
  parameters (greedy ones for a beam search's rows), key, stop tokens and
  token limit."""
  params = group.params
  return NewRow(
    slot=slot,
    temperature=0.0 if greedy else params.temperature,
    top_k=0 if greedy else params.top_k,
    top_p=1.0 if greedy else params.top_p,
    key_data=seq.key_data,
    stop_ids=group.stop_ids,
    limit=group.limit,
    processed=params.logprobs_mode == "processed",
    wants_top=bool(params.logprobs),
  )


def per_slot(values: np.ndarray, slots: np.ndarray, num_slots: int) -> np.ndarray:
  """Per-row `values` as per-slot values (zeros where no row ran)."""
  out = np.zeros((num_slots, *values.shape[1:]), values.dtype)
  out[slots[slots >= 0]] = values[slots >= 0]
  return out


def _hypotheses(group) -> list:
  """A beam group's finished hypotheses (one group's `Beams` rows, NumPy),
  best first, as `(tokens, cumulative logprob, stopped)` triples."""
  return [
    (
      group.hyp_tokens[i, : group.hyp_len[i]].tolist(),
      float(group.hyp_logprob[i]),
      bool(group.hyp_stopped[i]),
    )
    for i in range(group.hyp_score.shape[0])
    if group.hyp_score[i] > -np.inf
  ]


def speculation_carry(slots: np.ndarray, histories, k: int, max_tokens: int):
  """A speculating launch's per-row carry (`programs.Speculation`, `k`
  proposals a step) on `slots`: each row's tokens from `histories`
  (`(slot, token ids)`, at most `max_tokens`), nothing pending."""
  num_rows = slots.shape[0]
  history = np.zeros((num_rows, max_tokens), np.int32)
  history_len = np.zeros(num_rows, np.int32)
  row_of = {int(slot): row for row, slot in enumerate(slots) if slot >= 0}
  for slot, tokens in histories:
    row = row_of.get(slot)
    if row is not None:
      history[row, : len(tokens)] = tokens
      history_len[row] = len(tokens)
  zeros = np.zeros(num_rows, np.int32)
  return programs.Speculation(
    history=history,
    history_len=history_len,
    pending=np.zeros((num_rows, k), np.int32),
    num_pending=zeros,
    emitted=zeros,
    counts=np.zeros(3, np.int32),
  )
