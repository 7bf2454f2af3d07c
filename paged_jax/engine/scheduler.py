"""The scheduler: host-side policy of vLLM 0.6's scheduler, no arrays of its own.

Groups (a request's `n` sequences) wait, run or sit swapped out, each queue in
arrival order, and only the scheduler moves them. Every round (`schedule`),
swapped groups come back first (while any stay out, nothing new is
admitted); then prompts are prefilled in chunks within the token budget
(`max_num_batched_tokens`, after one token per decoding sequence), and
waiting groups are admitted while the sequence budget (`max_num_seqs`), the
token budget and the free blocks allow. When the decode loop runs out of
blocks (`update` hears of it), the next round first preempts the
latest-arrived running group: by recompute (its blocks are freed, its tokens
kept, and it is prefilled again when re-admitted, prefix caching then
finding its blocks) or by swap (its blocks move to host memory). A
beam-search group reserves `2n - 1` slots (its beams fork into the spare
ones on the device) and is always preempted by swap, its beams' state
staying with the runner.

The scheduler changes the block manager's states through the cache manager
(what fits, allocations, forks, frees, swap plans) and says in a
`SchedulerOutput` what the engine must run: page swaps, row changes for the
model runner, prefill chunks.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from paged_jax.config import AllocStatus
from paged_jax.engine.admission import resident_fits, type_admission_error
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.packing import filled_budget
from paged_jax.engine.row_table import new_row
from paged_jax.engine.scheduler_output import (
  PrefillChunk,
  RowChanges,
  SchedulerOutput,
)
from paged_jax.engine.sequence import Sequence, SequenceGroup

PREEMPTION_MODES = ("recompute", "swap")


def _score_whole_prompt(group: SequenceGroup, leader: Sequence) -> None:
  """With prompt log-probabilities asked for, the leader's prefill starts
  at the first token: prefix-cache hits run again (their K/V stays)."""
  if group.params.prompt_logprobs is not None:
    leader.cached_prefix, leader.num_computed = leader.num_computed, 0


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
  """How many leading tokens `a` and `b` share."""
  n = min(a.size, b.size)
  differ = np.flatnonzero(a[:n] != b[:n])
  return int(differ[0]) if differ.size else n


def _enqueue(queue: collections.deque, group: SequenceGroup) -> None:
  """Puts a preempted group back into `queue`, keeping arrival order."""
  queue.append(group)
  ordered = sorted(queue, key=lambda g: g.arrival)
  queue.clear()
  queue.extend(ordered)


class Scheduler:
  """Decides what runs on one data shard; the engine executes it.

  Args:
    cache_manager: the `CacheManager` whose states the decisions read and
      change.
    max_num_seqs: sequences that run at once at most.
    max_num_batched_tokens: tokens one round runs through the model at most.
    preemption_mode: "recompute" or "swap". Groups of several sequences are
      swapped in either mode; swap falls back to recompute when the host pool
      has no room.
    max_len: positions a sequence may use.
    shard: the data shard whose slots and blocks this scheduler decides on.
    automaton_room: `automaton -> bool`, whether a structured output's
      automaton fits the launches' table beside the running ones (a group
      waits until it does); None: always.
    token_buckets: the token counts launches pad to, ascending: a round
      then plans no more prompt tokens than `packing.filled_budget` gives;
      None: the whole budget.
    rows_in_buckets: whether the decoding rows ride in the prompt launch
      (a ragged step), one token each of its bucket.
  """

  def __init__(
    self,
    cache_manager: CacheManager,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    preemption_mode: str,
    max_len: int,
    shard: int = 0,
    automaton_room=None,
    token_buckets=None,
    rows_in_buckets: bool = False,
  ):
    self.cache_manager = cache_manager
    self.token_buckets = token_buckets
    self.rows_in_buckets = rows_in_buckets
    self.shard = shard
    self.automaton_room = automaton_room
    self.max_num_seqs = max_num_seqs
    self.max_num_batched_tokens = max_num_batched_tokens
    self.preemption_mode = preemption_mode
    self.max_len = max_len
    self.waiting: collections.deque[SequenceGroup] = collections.deque()
    self.running: list[SequenceGroup] = []
    self.swapped: collections.deque[SequenceGroup] = collections.deque()
    self.free_slots = list(cache_manager.shard_slots(shard))
    self.num_preemptions = 0
    self.prefill_tokens = 0
    self._stalled = False  # a prompt chunk found too few free blocks this round
    # What the next round starts with: row changes and preemptions decided
    # since this round (swapped pages move before anything else runs).
    self._next = SchedulerOutput(shard=shard)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self.swapped)

  def num_running_seqs(self) -> int:
    return sum(len(g.live()) for g in self.running)

  def add(self, group: SequenceGroup) -> None:
    """Queues a new group."""
    self.waiting.append(group)

  def _take_slots(self, count: int) -> list[int]:
    self.free_slots.sort()
    slots, self.free_slots = self.free_slots[:count], self.free_slots[count:]
    return slots

  def _release(self, seq: Sequence) -> None:
    """Returns a sequence's slot (its blocks are already freed)."""
    if seq.slot >= 0:
      self.free_slots.append(seq.slot)
      seq.slot = -1

  def _free(self, group: SequenceGroup, slots) -> None:
    """Frees the blocks of `slots`; their rows stop."""
    self.cache_manager.free(slots, group.request_id)
    self._next.rows.stop += list(slots)

  def remove(self, group: SequenceGroup) -> None:
    """Takes a group out of its queue and frees what it holds (an abort)."""
    for queue in (self.waiting, self.swapped):
      if group in queue:
        queue.remove(group)
    if group in self.running:
      self.running.remove(group)
    held = self._held(group)
    if held:
      self._free(group, held)
    self._release_group(group)

  def _release_group(self, group: SequenceGroup) -> None:
    """Returns the slots of a group whose blocks are freed."""
    if group.beam_slots:
      self._next.rows.clear_beams.append(group.beam_slots)
      self.free_slots += group.beam_slots
      group.beam_slots = []
    for seq in group.seqs:
      if group.beam:
        seq.slot = -1
      else:
        self._release(seq)

  def _held(self, group: SequenceGroup) -> list[int]:
    """The slots whose block tables the group holds."""
    if group.beam:
      return self.cache_manager.held(group.beam_slots)
    return [s.slot for s in group.seqs if s.allocated]

  def _num_decoding(self) -> int:
    """Rows of running groups that decode (one token each per step)."""
    count = 0
    for group in self.running:
      if group.beam:
        if group.beam_slots and group.seqs[0].tokens_to_prefill is None:
          count += len(self.cache_manager.held(group.beam_slots))
      else:
        count += sum(
          s.slot >= 0 and s.tokens_to_prefill is None and bool(s.token_ids) for s in group.live()
        )
    return count

  # One round.
  def schedule(self) -> SchedulerOutput:
    """Swaps in (unless the last round preempted), admits, and plans this
    round's prefill chunks."""
    out = self._next  # what was decided since the last round, and now this one
    preempted = bool(out.preempted)
    if not preempted:
      self._swap_in(out)
    num_decoding = self._num_decoding()
    budget = self.max_num_batched_tokens - num_decoding
    if self.token_buckets is not None:
      rows = num_decoding if self.rows_in_buckets else 0
      budget = filled_budget(budget, self._prompt_demand(), self.token_buckets, rows)
    for group in self.running:
      budget = self._plan_chunks(group, budget, out)
    # After a preemption the running groups decode before anything is
    # admitted, or the victim would come straight back.
    while self.waiting and not self.swapped and budget > 0 and not preempted:
      group = self.waiting[0]
      status, reason = self._admissible(group)
      if status == AllocStatus.NEVER:
        self.waiting.popleft()
        group.error = group.error or f"request {group.request_id!r} cannot be admitted: {reason}"
        out.failed.append(group)
        continue
      if status == AllocStatus.LATER:
        break
      self.waiting.popleft()
      self._admit(group)
      self._skip_prefixes_written_now(group, out.chunks)
      budget = self._plan_chunks(group, budget, out)
    out.decoding = list(self.running)
    out.stop_on_finish = bool(self.waiting or self.swapped)
    self._next = SchedulerOutput(shard=self.shard)
    if self._stalled and not out.chunks and not self._num_decoding():
      self._preempt()  # only prompts run and none found its blocks: the next round frees some
    self._stalled = False
    return out

  def _prompt_demand(self) -> int:
    """The prompt tokens that could run now: the rest of the running groups'
    prompts, and the waiting groups' (in full: hits in the prefix cache
    make it less)."""
    running = sum(
      s.tokens_to_prefill.size - s.num_computed
      for g in self.running
      for s in g.live()
      if s.tokens_to_prefill is not None
    )
    return running + sum(len(g.prompt_token_ids) for g in self.waiting)

  def _admissible(self, group: SequenceGroup) -> tuple[AllocStatus, str | None]:
    """Whether a waiting group can be admitted now, later or never (with
    the reason)."""
    live = group.live()
    prompt = len(group.prompt_token_ids)
    lengths = None if group.fresh else [prompt + len(s.token_ids) - 1 for s in live]
    reason = type_admission_error(
      self.cache_manager.type_configs,
      max_len=self.max_len,
      max_num_seqs=self.max_num_seqs,
      num_prompt_tokens=prompt,
      params=group.params,
      resident_lengths=lengths,
      max_chunk=self.cache_manager.max_chunk,
      lookahead=self.cache_manager.lookahead,
    )
    if reason is not None:
      return AllocStatus.NEVER, reason
    if self.num_running_seqs() + len(live) > self.max_num_seqs or group.num_slots() > len(
      self.free_slots
    ):
      return AllocStatus.LATER, None
    room = self.automaton_room
    if group.automaton is not None and room is not None and not room(group.automaton):
      return AllocStatus.LATER, None
    if group.fresh:
      return self.cache_manager.can_allocate(prompt, self.shard), None
    cache_manager = self.cache_manager
    free = cache_manager.free_blocks_per_type(self.shard)
    fits = resident_fits(cache_manager.type_configs, free, prompt, lengths, cache_manager.max_chunk)
    return (AllocStatus.OK if fits else AllocStatus.LATER), None

  def _admit(self, group: SequenceGroup) -> None:
    """Allocates a group's blocks; its prompt (or tokens) await prefill."""
    if group.beam:
      self._admit_beams(group)
      return
    live = group.live()
    for seq, slot in zip(live, self._take_slots(len(live))):
      seq.slot = slot
      self._next.rows.new_rows.append(new_row(group, seq, slot, greedy=False))
    if group.fresh:
      leader = live[0]
      leader.tokens_to_prefill = group.prompt_token_ids
      leader.num_computed = self._allocate(leader, group.request_id)
      _score_whole_prompt(group, leader)
    else:
      for seq in live:
        seq.tokens_to_prefill = np.concatenate(
          [group.prompt_token_ids, np.asarray(seq.token_ids[:-1], np.int32)]
        )
        seq.num_computed = self._allocate(seq, group.request_id)
    self.running.append(group)

  def _admit_beams(self, group: SequenceGroup) -> None:
    """Reserves a beam group's slots; its leader prefills all of the prompt
    but the last token, which the first decode step runs (its logits give
    the first beams)."""
    slots = self._take_slots(group.num_slots())
    leader = group.seqs[0]
    for slot in slots:
      self._next.rows.new_rows.append(new_row(group, leader, slot, greedy=True))
    self._next.rows.new_beams.append((slots, group.params.n, group.params.length_penalty))
    group.beam_slots = slots
    leader.slot = slots[0]
    leader.tokens_to_prefill = group.prompt_token_ids[:-1]
    leader.num_computed = self._allocate(leader, group.request_id)
    _score_whole_prompt(group, leader)
    self.running.append(group)

  def _allocate(self, seq: Sequence, request_id: str) -> int:
    """Allocates the blocks of `seq.tokens_to_prefill`, or none yet on a cache that
    frees the blocks outside its window (each chunk appends its tokens, see
    `_plan_chunks`); returns the tokens already computed."""
    tokens = seq.tokens_to_prefill
    if self.cache_manager.max_chunk is not None:
      tokens = tokens[:0]
    return self.cache_manager.allocate(seq.slot, tokens, request_id)

  def _skip_prefixes_written_now(self, group: SequenceGroup, chunks: list[PrefillChunk]) -> None:
    """Starts a just-admitted group's prefill after the full blocks it
    shares with a sequence whose chunk this round writes them.

    With prefix caching, `allocate` hit those blocks (the other sequence's
    allocation registered them) but counts them as not computed yet. The
    launch writes every row's K/V before any row attends, so the group's
    chunk reads them as written and they are computed once. At least the
    last prompt token still runs (its logits draw the first token); a
    group that scores its prompt runs all of it.
    """
    if (
      not self.cache_manager.cfg.enable_prefix_caching
      or group.params.prompt_logprobs is not None
      or self.cache_manager.max_chunk is not None  # a windowed cache appends every prompt from 0
    ):
      return
    block_size = self.cache_manager.cfg.block_size
    for seq in group.live():
      if seq.tokens_to_prefill is None:
        continue
      shared = max(
        (
          _common_prefix(seq.tokens_to_prefill, c.seq.tokens_to_prefill[: c.start + c.tokens.size])
          for c in chunks
        ),
        default=0,
      )
      most = (seq.tokens_to_prefill.size - 1) // block_size * block_size
      seq.num_computed = max(seq.num_computed, min(shared // block_size * block_size, most))

  def _plan_chunks(self, group: SequenceGroup, budget: int, out: SchedulerOutput) -> int:
    """Plans the group's next prompt chunks within `budget`; a sequence
    whose prompt they complete decodes from this round on (a fresh group's
    samples once they drew their first token: `after_prefill`). On a cache
    that frees the blocks outside its window, a chunk has at most
    `max_chunk` tokens and appends them now; a sequence whose chunk finds
    too few free blocks waits (`_stalled`)."""
    max_chunk = self.cache_manager.max_chunk
    for seq in group.live():
      if seq.tokens_to_prefill is None or budget <= 0:
        continue
      start = seq.num_computed
      count = min(seq.tokens_to_prefill.size - start, budget, max_chunk or budget)
      if max_chunk is not None and not self.cache_manager.append_chunk(
        seq.slot, seq.tokens_to_prefill[start : start + count], group.request_id
      ):
        self._stalled = True
        continue
      seq.num_computed = start + count
      chunk = PrefillChunk(group, seq, seq.tokens_to_prefill[start : start + count], start)
      if group.params.prompt_logprobs is not None and group.fresh:
        chunk.write_from = seq.cached_prefix
        following = np.append(group.prompt_token_ids[1:], -1).astype(np.int32)
        chunk.next_tokens = following[start : start + count]
      if seq.num_computed == seq.tokens_to_prefill.size:
        if group.beam:  # the prompt's last token starts the first beam step
          self._next.rows.start.append((seq.slot, int(group.prompt_token_ids[-1]), 0))
        elif not group.fresh:
          self._next.rows.start.append((seq.slot, seq.token_ids[-1], len(seq.token_ids)))
        else:
          chunk.samples = group.live()
      out.chunks.append(chunk)
      self.prefill_tokens += count
      budget -= count
    return budget

  def _swap_in(self, out: SchedulerOutput) -> None:
    """Brings swapped groups back in arrival order while they fit: the
    manager's `can_swap_in` counts their blocks plus one new block per
    sequence, above the watermark."""
    while self.swapped:
      group = self.swapped[0]
      slots = self._held(group)
      if (
        self.num_running_seqs() + len(group.live()) > self.max_num_seqs
        or self.cache_manager.can_swap_in(slots) != AllocStatus.OK
      ):
        return
      self.swapped.popleft()
      out.swap_in.append(self.cache_manager.swap_in(slots, group.request_id))
      if group.beam:
        self._next.rows.resume += slots
      else:
        for seq in group.live():
          self._next.rows.start.append((seq.slot, seq.token_ids[-1], len(seq.token_ids)))
      self.running.append(group)
      self.running.sort(key=lambda g: g.arrival)

  def _preempt(self, freed_on_host: bool = False) -> None:
    """Preempts the latest-arrived running group, if any is left: when
    every group that ran out has finished since, their blocks are free.

    Args:
      freed_on_host: whether sequences that finished on the host (stop
        strings) freed blocks after the decode loop ran out: a lone group
        left then decodes on with them (the next round tells).

    Raises:
      RuntimeError: if it is the only group running and no blocks came free
        since it ran out (it can never fit), or a beam group whose beams the
        host pool cannot hold.
    """
    out = self._next
    candidates = [g for g in self.running if not g.finished]
    if not candidates:
      return
    if len(candidates) < 2:
      if freed_on_host:
        return
      raise RuntimeError(
        f"request {candidates[0].request_id!r} ran out of GPU blocks with nothing else "
        f"running ({self.cache_manager.num_free_gpu_blocks(self.shard)} free of "
        f"{self.cache_manager.cfg.num_gpu_blocks})"
      )
    group = max(candidates, key=lambda g: g.arrival)
    self.running.remove(group)
    self.num_preemptions += 1
    out.preempted.append(group)
    live = group.live()
    slots = self._held(group)
    decoding = all(s.tokens_to_prefill is None for s in live)
    # As in vLLM, a group of several sequences is swapped whatever the mode
    # (prefilled again, its sequences would share no blocks), unless the
    # host pool has no room; beams always are (their state is on the device).
    swap = self.preemption_mode == "swap" or len(live) > 1 or group.beam
    if swap and decoding and self.cache_manager.can_swap_out(slots):
      out.swap_out.append(self.cache_manager.swap_out(slots, group.request_id))
      self._next.rows.stop += slots
      _enqueue(self.swapped, group)
      return
    if group.beam and decoding:
      raise RuntimeError(
        f"beam-search request {group.request_id!r} must be preempted but "
        f"the host pool ({self.cache_manager.cfg.num_cpu_blocks} CPU blocks) cannot "
        "hold its beams; give the cache more num_cpu_blocks"
      )
    if slots:
      self._free(group, slots)
    self._release_group(group)
    for seq in live:
      seq.tokens_to_prefill, seq.num_computed = None, 0
    _enqueue(self.waiting, group)

  # Results.
  def after_prefill(self, out: SchedulerOutput) -> RowChanges:
    """Takes in this round's prefill, once the samples' first tokens are
    appended: marks the blocks computed, forks each completed fresh prompt
    into its samples and frees the samples that finished.

    Returns:
      The row changes that start the unfinished samples.
    """
    changes = RowChanges()
    chunks = out.chunks
    self.cache_manager.mark_computed(
      [c.seq.slot for c in chunks], [c.seq.num_computed for c in chunks]
    )
    for chunk in chunks:
      seq, request_id = chunk.seq, chunk.group.request_id
      if seq.num_computed < seq.tokens_to_prefill.size:
        continue
      seq.tokens_to_prefill = None
      for child in chunk.samples[1:]:
        self.cache_manager.fork(seq.slot, child.slot, request_id)
      for sample in chunk.samples:
        if sample.finished:
          self.cache_manager.free([sample.slot], request_id)
          self._release(sample)
        else:
          changes.start.append((sample.slot, sample.token_ids[-1], 1))
    return changes

  def update(self, out: SchedulerOutput, finished_on_device=None, out_of_blocks=False) -> None:
    """Takes in the round's decode: frees the sequences that finished on
    the host (the device freed its own), returns finished sequences' slots
    and retires finished groups.

    Args:
      out: the round's `SchedulerOutput`.
      finished_on_device: bool `[S]`, rows the decode loop finished (and
        freed); None when no decode ran.
      out_of_blocks: whether this shard ran out of blocks: the
        latest-arrived running group is preempted.
    """
    to_free = self._finished_on_host(out, finished_on_device)
    for group, seq in to_free:
      self._free(group, [seq.slot])
    for group in out.decoding:
      if group.beam:
        if group.finished and group.beam_slots:  # the device freed its blocks
          self._release_group(group)
        continue
      for seq in group.seqs:
        if seq.finished:
          self._release(seq)
    self.running = [g for g in self.running if not g.finished]
    if out_of_blocks:
      self._preempt(freed_on_host=bool(to_free))

  @staticmethod
  def _finished_on_host(out: SchedulerOutput, finished_on_device) -> list:
    """`(group, seq)` of the round's sequences that finished on the host
    (stop strings) and still hold blocks: `update` frees them."""
    return [
      (group, seq)
      for group in out.decoding
      if not group.beam
      for seq in group.seqs
      if seq.finished
      and seq.slot >= 0
      and (finished_on_device is None or not finished_on_device[seq.slot])
    ]

  def update_frees(self, out: SchedulerOutput, finished_on_device, out_of_blocks=False) -> bool:
    """Whether `update` with these results would change the block
    manager's state: free a sequence that finished on the host, or preempt."""
    return bool(out_of_blocks) or bool(self._finished_on_host(out, finished_on_device))

  def decodes_only(self) -> bool:
    """Whether its next round, as things stand, only decodes the running
    sequences in the rows they hold: no group waits or is swapped out,
    nothing was decided since the last round (rows stopped or started,
    preemptions, swaps), and every running sequence decodes (its prompt
    done; no beam group)."""
    since = self._next
    rows = since.rows
    decided = since.preempted or since.failed or since.swap_out or since.swap_in
    changed = any(getattr(rows, field.name) for field in dataclasses.fields(rows))
    prompts_left = any(
      group.beam or any(seq.tokens_to_prefill is not None for seq in group.live())
      for group in self.running
    )
    return not (self.waiting or self.swapped or decided or changed or prompts_left)
