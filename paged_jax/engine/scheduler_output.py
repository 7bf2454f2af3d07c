"""What the scheduler decides for one round, in types of their own.

The scheduler writes a `SchedulerOutput` per data shard; the model runner
applies its `RowChanges` (with `NewRow`s) to its row table and runs its
`PrefillChunk`s. Neither imports the other: both import these types.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.engine.sequence import Sequence, SequenceGroup


@dataclasses.dataclass
class NewRow:
  """A request's sampling parameters and token limit for a decode row."""

  slot: int
  temperature: float
  top_k: int
  top_p: float
  key_data: np.ndarray
  stop_ids: tuple[int, ...]
  limit: int
  processed: bool = False
  wants_top: bool = False


@dataclasses.dataclass
class RowChanges:
  """How the model runner's decode rows change, applied in this order.

  Attributes:
    stop: slots that stop decoding (freed, swapped out or released).
    clear_beams: slot lists (leader first) of beam groups to forget.
    new_rows: rows that get a request's parameters.
    new_beams: `(slots, width, length_penalty)` of new beam groups.
    start: `(slot, last token, tokens drawn)`: rows that decode from then.
    resume: beam rows that decode on from where they were (swapped in).
  """

  stop: list[int] = dataclasses.field(default_factory=list)
  clear_beams: list[list[int]] = dataclasses.field(default_factory=list)
  new_rows: list[NewRow] = dataclasses.field(default_factory=list)
  new_beams: list[tuple[list[int], int, float]] = dataclasses.field(default_factory=list)
  start: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
  resume: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PrefillChunk:
  """Prompt tokens that go into a sequence's cache this round.

  Attributes:
    group, seq: the sequence.
    tokens: the tokens, for positions `start ..`.
    start: the first one's position.
    samples: the sequences that draw their first token from the logits this
      chunk ends with (a fresh group's when it completes its prompt).
    write_from: positions before it already hold their K/V (prefix-cache
      hits that run again for their prompt log-probabilities).
    next_tokens: with prompt log-probabilities asked for, the prompt token
      after each position (-1 after the last), whose log-probability the
      chunk computes; else None.
  """

  group: SequenceGroup
  seq: Sequence
  tokens: np.ndarray
  start: int
  samples: list[Sequence] = dataclasses.field(default_factory=list)
  write_from: int = 0
  next_tokens: np.ndarray | None = None


@dataclasses.dataclass
class SchedulerOutput:
  """One round of one data shard, as the scheduler decided it.

  The engine moves the swapped pages, applies the row changes, runs the
  chunks, hands the first tokens and `after_prefill`'s row changes back,
  decodes, and reports to `update`. What was decided after the last round
  (aborts, finished sequences, the preemption after its decode) comes first.

  Attributes:
    shard: the data shard.
    preempted: groups preempted after the last round's decode (already
      back in a queue); nothing is swapped in or admitted this round.
    failed: groups that can never be admitted (taken out of the queue).
    swap_out, swap_in: the swap plans whose pages must move, in order.
    rows: the decode rows' changes since the last round.
    chunks: the prompt chunks to run.
    decoding: the running groups; their started rows decode.
    stop_on_finish: whether the decode loop should hand back control when
      a row finishes (groups wait to be admitted or swapped in).
  """

  shard: int
  preempted: list[SequenceGroup] = dataclasses.field(default_factory=list)
  failed: list[SequenceGroup] = dataclasses.field(default_factory=list)
  swap_out: list = dataclasses.field(default_factory=list)
  swap_in: list = dataclasses.field(default_factory=list)
  rows: RowChanges = dataclasses.field(default_factory=RowChanges)
  chunks: list[PrefillChunk] = dataclasses.field(default_factory=list)
  decoding: list[SequenceGroup] = dataclasses.field(default_factory=list)
  stop_on_finish: bool = False
