"""The scheduler: host-side policy of vLLM 0.6's scheduler, no arrays of its own.

Groups (a request's `n` sequences) wait, run or sit swapped out, each queue in
arrival order. Every round, swapped groups come back first (while any stay
out, nothing new is admitted); then prompts are prefilled in chunks within
the token budget (`max_num_batched_tokens`, after one token per decoding
sequence), and waiting groups are admitted while the sequence budget
(`max_num_seqs`), the token budget and the free blocks allow. When the
decode loop runs out of blocks, the latest-arrived running group is
preempted: by recompute (its blocks are freed, its tokens kept, and it is
prefilled again when re-admitted, prefix caching then finding its blocks) or
by swap (its blocks move to host memory). A beam-search group reserves `2n -
1` slots (its beams fork into the spare ones on the device) and is always
preempted by swap, its beams' state staying with the runner.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from paged_jax.config import AllocStatus
from paged_jax.engine.params import SamplingParams
from paged_jax.engine.runner import ModelRunner

PREEMPTION_MODES = ("recompute", "swap")


@dataclasses.dataclass
class Sequence:
  """One sequence of a group, as the host tracks it."""

  index: int
  key_data: np.ndarray  # the sequence's PRNG key (raw words)
  slot: int = -1
  token_ids: list[int] = dataclasses.field(default_factory=list)
  token_logprobs: list[float] = dataclasses.field(default_factory=list)
  cumulative_logprob: float | None = None  # a beam's, read from the device
  logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  text: str = ""
  sent_text: int = 0  # characters already streamed (delta outputs)
  sent_tokens: int = 0  # tokens already streamed (delta outputs)
  prefill: np.ndarray | None = None  # tokens to put in the cache on admission
  num_computed: int = 0  # tokens of `prefill` in the cache

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  @property
  def allocated(self) -> bool:
    """Whether the sequence holds a table in its slot."""
    return self.slot >= 0 and (self.prefill is not None or bool(self.token_ids))


@dataclasses.dataclass
class SequenceGroup:
  """A request: its prompt, parameters and sequences."""

  request_id: str
  prompt: str | None
  prompt_token_ids: np.ndarray
  params: SamplingParams
  arrival: int
  limit: int  # tokens each sequence draws at most
  stop_ids: tuple[int, ...]
  seqs: list[Sequence]
  error: str | None = None
  beam_slots: list[int] = dataclasses.field(default_factory=list)
  shard: int = 0  # the data shard that serves it
  load: int = 0  # tokens it adds to its shard's load

  @property
  def beam(self) -> bool:
    return self.params.use_beam_search

  def num_slots(self) -> int:
    """Sequence slots the group needs: `2n - 1` for `n` beams (spare slots
    for the beams that fork), else one per unfinished sequence."""
    return 2 * self.params.n - 1 if self.beam else len(self.live())

  def live(self) -> list[Sequence]:
    return [s for s in self.seqs if not s.finished]

  @property
  def finished(self) -> bool:
    return all(s.finished for s in self.seqs)

  @property
  def fresh(self) -> bool:
    """No token drawn yet: prefill the prompt once, then fork `n` samples."""
    return not any(s.token_ids for s in self.seqs)


def _enqueue(queue: collections.deque, group: SequenceGroup) -> None:
  """Puts a preempted group back into `queue`, keeping arrival order."""
  queue.append(group)
  ordered = sorted(queue, key=lambda g: g.arrival)
  queue.clear()
  queue.extend(ordered)


class Scheduler:
  """Decides what runs; the runner executes it.

  Args:
    runner: the `ModelRunner` whose manager state the decisions read.
    max_num_seqs: sequences that run at once at most.
    max_num_batched_tokens: tokens one round runs through the model at most.
    preemption_mode: "recompute" or "swap". Groups of several sequences are
      swapped in either mode; swap falls back to recompute when the host pool
      has no room.
    shard: the data shard whose slots and blocks this scheduler decides on
      (one scheduler per shard).
  """

  def __init__(
    self,
    runner: ModelRunner,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    preemption_mode: str,
    shard: int = 0,
  ):
    self.runner = runner
    self.shard = shard
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    self.preemption_mode = preemption_mode
    self.waiting: collections.deque[SequenceGroup] = collections.deque()
    self.running: list[SequenceGroup] = []
    self.swapped: collections.deque[SequenceGroup] = collections.deque()
    self.free_slots = list(runner.shard_slots(shard))
    self.num_preemptions = 0
    self.prefill_tokens = 0
    # After a preemption the running groups decode before anything is
    # admitted or swapped in, or the victim would come straight back.
    self._preempted = False

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self.swapped)

  def num_running_seqs(self) -> int:
    return sum(len(g.live()) for g in self.running)

  def _take_slots(self, count: int) -> list[int]:
    self.free_slots.sort()
    slots, self.free_slots = self.free_slots[:count], self.free_slots[count:]
    return slots

  def release(self, seq: Sequence) -> None:
    """Returns a finished sequence's slot (its blocks are already freed)."""
    if seq.slot >= 0:
      self.free_slots.append(seq.slot)
      seq.slot = -1

  def remove(self, group: SequenceGroup) -> None:
    """Takes a group out of its queue and frees what it holds."""
    for queue in (self.waiting, self.swapped):
      if group in queue:
        queue.remove(group)
    if group in self.running:
      self.running.remove(group)
    if group.beam:
      held = self.runner.held(group.beam_slots)
    else:
      held = [s.slot for s in group.seqs if s.allocated]
    if held:
      self.runner.free(held)
    self.release_group(group)

  def release_group(self, group: SequenceGroup) -> None:
    """Returns the slots of a group whose blocks are freed."""
    if group.beam_slots:
      self.runner.clear_beams(group.beam_slots)
      self.free_slots += group.beam_slots
      group.beam_slots = []
    for seq in group.seqs:
      if group.beam:
        seq.slot = -1
      else:
        self.release(seq)

  # One round.
  def schedule(self) -> tuple[list, list[SequenceGroup]]:
    """Swaps in, admits and plans this round's prefill chunks.

    Returns:
      `(chunks, failed)`: `(group, seq, tokens, start)` prefill chunks, and
      groups at the head of the queue that can never be admitted (taken out).
    """
    preempted, self._preempted = self._preempted, False
    if not preempted:
      self._swap_in()
    budget = self.max_num_batched_tokens - self.runner.num_running(self.shard)
    chunks = []
    for group in self.running:
      budget = self._plan_chunks(group, budget, chunks)
    failed = []
    while self.waiting and not self.swapped and budget > 0 and not preempted:
      group = self.waiting[0]
      status = self._admissible(group)
      if status == AllocStatus.NEVER:
        self.waiting.popleft()
        group.error = group.error or (
          f"request {group.request_id!r} cannot be admitted: it needs more "
          f"blocks or sequence slots than the cache has with nothing else "
          f"running ({self.runner.cfg})"
        )
        failed.append(group)
        continue
      if status == AllocStatus.LATER:
        break
      self.waiting.popleft()
      self._admit(group)
      budget = self._plan_chunks(group, budget, chunks)
    return chunks, failed

  def _idle(self) -> bool:
    return not self.running and not self.swapped

  def _admissible(self, group: SequenceGroup) -> AllocStatus:
    live = group.live()
    cfg = self.runner.cfg
    seqs_ok = self.num_running_seqs() + len(live) <= self.max_num_seqs and group.num_slots() <= len(
      self.free_slots
    )
    if group.fresh:
      status = self.runner.can_allocate(group.prompt_token_ids.size, self.shard)
    else:
      needed = sum(cfg.blocks_for(len(group.prompt_token_ids) + len(s.token_ids) - 1) for s in live)
      if cfg.enable_prefix_caching:  # the prompt's full blocks are shared
        needed -= (len(live) - 1) * (len(group.prompt_token_ids) // cfg.block_size)
      free = self.runner.num_free_gpu_blocks(self.shard) - cfg.watermark_blocks
      status = AllocStatus.OK if needed <= free else AllocStatus.LATER
    if status == AllocStatus.OK and not seqs_ok:
      status = AllocStatus.LATER
    if status == AllocStatus.LATER and self._idle():
      return AllocStatus.NEVER
    return status

  def _admit(self, group: SequenceGroup) -> None:
    """Allocates a group's blocks; its prompt (or tokens) await prefill."""
    if group.beam:
      self._admit_beams(group)
      return
    live = group.live()
    params = group.params
    for seq, slot in zip(live, self._take_slots(len(live))):
      seq.slot = slot
      self.runner.set_row(
        slot,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        key_data=seq.key_data,
        stop_ids=group.stop_ids,
        limit=group.limit,
      )
    if group.fresh:
      leader = live[0]
      leader.prefill = group.prompt_token_ids
      leader.num_computed = self.runner.allocate(leader.slot, leader.prefill)
    else:
      for seq in live:
        seq.prefill = np.concatenate(
          [group.prompt_token_ids, np.asarray(seq.token_ids[:-1], np.int32)]
        )
        seq.num_computed = self.runner.allocate(seq.slot, seq.prefill)
    self.running.append(group)

  def _admit_beams(self, group: SequenceGroup) -> None:
    """Reserves a beam group's slots; its leader prefills all of the prompt
    but the last token, which the first decode step runs (its logits give
    the first beams)."""
    slots = self._take_slots(group.num_slots())
    for slot in slots:
      self.runner.set_row(
        slot,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        key_data=group.seqs[0].key_data,
        stop_ids=group.stop_ids,
        limit=group.limit,
      )
    self.runner.start_beams(slots, group.params.n, group.params.length_penalty)
    group.beam_slots = slots
    leader = group.seqs[0]
    leader.slot = slots[0]
    leader.prefill = group.prompt_token_ids[:-1]
    leader.num_computed = self.runner.allocate(leader.slot, leader.prefill)
    self.running.append(group)

  def _plan_chunks(self, group: SequenceGroup, budget: int, chunks) -> int:
    for seq in group.live():
      if seq.prefill is None or budget <= 0:
        continue
      count = min(seq.prefill.size - seq.num_computed, budget)
      start = seq.num_computed
      chunks.append((group, seq, seq.prefill[start : start + count], start))
      self.prefill_tokens += count
      budget -= count
    return budget

  def _swap_in(self) -> None:
    """Brings swapped groups back in arrival order while they fit: the
    manager's `can_swap_in` counts their blocks plus one new block per
    sequence, above the watermark."""
    while self.swapped:
      group = self.swapped[0]
      slots = self._held(group)
      if (
        self.num_running_seqs() + len(group.live()) > self.max_num_seqs
        or self.runner.can_swap_in(slots) != AllocStatus.OK
      ):
        return
      self.swapped.popleft()
      self.runner.swap_in(slots)
      if group.beam:
        self.runner.resume(slots)
      else:
        for seq in group.live():
          self.runner.start(seq.slot, seq.token_ids[-1], len(seq.token_ids))
      self.running.append(group)
      self.running.sort(key=lambda g: g.arrival)

  def _held(self, group: SequenceGroup) -> list[int]:
    """The slots whose block tables the group holds."""
    if group.beam:
      return self.runner.held(group.beam_slots)
    return [s.slot for s in group.live() if s.allocated]

  def preempt(self) -> SequenceGroup:
    """Preempts the latest-arrived running group.

    Raises:
      RuntimeError: if it is the only group running (it can never fit).
    """
    candidates = [g for g in self.running if not g.finished]
    if len(candidates) < 2:
      raise RuntimeError(
        f"request {candidates[0].request_id!r} ran out of GPU blocks with "
        f"nothing else running ({self.runner.num_free_gpu_blocks(self.shard)}"
        " free of "
        f"{self.runner.cfg.num_gpu_blocks})"
      )
    group = max(candidates, key=lambda g: g.arrival)
    self.running.remove(group)
    self.num_preemptions += 1
    self._preempted = True
    live = group.live()
    slots = self._held(group)
    decoding = all(s.prefill is None for s in live)
    # As in vLLM, a group of several sequences is swapped whatever the mode
    # (prefilled again, its sequences would share no blocks), unless the
    # host pool has no room; beams always are (their state is on the device).
    swap = self.preemption_mode == "swap" or len(live) > 1 or group.beam
    if swap and decoding and self.runner.can_swap_out(slots):
      self.runner.swap_out(slots)
      _enqueue(self.swapped, group)
      return group
    if group.beam and decoding:
      raise RuntimeError(
        f"beam-search request {group.request_id!r} must be preempted but "
        f"the host pool ({self.runner.cfg.num_cpu_blocks} CPU blocks) cannot "
        "hold its beams; give the cache more num_cpu_blocks"
      )
    if slots:
      self.runner.free(slots)
    self.release_group(group)
    for seq in live:
      seq.prefill, seq.num_computed = None, 0
    _enqueue(self.waiting, group)
    return group
