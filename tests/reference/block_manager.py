"""Plain-Python reference model of the block manager (docs/semantics.md).

``ReferenceBlockSpaceManager`` is the oracle that the jitted
``paged_jax.block_manager`` is checked against: same tables, ref counts,
plans, statuses, free counts and hit rates on every operation sequence. It is
sequential and simple on purpose. Every mutating call runs the phases of one
call (docs/semantics.md) literally, on a deep copy of the state that is only
kept when the call succeeds, so a failed call changes nothing, counters
included.

Block tables hold block numbers, one entry per logical block, -1 where a
block left the sliding window. Host-side queries raise ValueError for bad
arguments, except the admission queries (``can_*``), which answer no for a
group that their operation would refuse; mutating calls report them as a
``Status``.
"""

from __future__ import annotations

import copy
import dataclasses
import numbers
from collections.abc import Callable, Sequence

from paged_jax.config import AllocStatus, CacheConfig, Status
from tests.reference.allocators import CachedBlockAllocator, Identity, UncachedBlockAllocator

Pool = UncachedBlockAllocator | CachedBlockAllocator
Plan = list[tuple[int, int]]

PADDING = -1
DEVICES = ("gpu", "cpu")
FROM_CONFIG = object()  # ReferenceBlockSpaceManager's default window: cfg.sliding_window


@dataclasses.dataclass
class _Sequence:
  """A sequence slot's block table and the tokens it holds."""

  table: list[int]
  tokens: list[int]
  salt: int
  device: str


@dataclasses.dataclass
class _State:
  """Everything a call may change: pools, slots and hit-rate counters."""

  pools: dict[str, Pool]
  seqs: list[_Sequence | None]
  lookups: int = 0
  hits: int = 0


@dataclasses.dataclass
class _Entry:
  """What one call does to entry ``j`` of one row's table.

  ``action`` is ``"take"`` (the entry holds no block), ``"copy"`` (copy-on-write
  into a new block), ``"in_place"`` (write into the held block), ``"hit"`` (a
  registered block) or ``"share"`` (the block an earlier row of the call ends
  up with for the same identity, ``owner = (row, j)``).
  """

  j: int
  action: str
  held: int = PADDING
  identity: Identity | None = None
  hit_block: int | None = None
  owner: tuple[int, int] | None = None


class ReferenceBlockSpaceManager:
  """Sequential object model of the paged KV-cache block manager.

  Args:
    cfg: the cache configuration.
    sliding_window: the window, if not ``cfg.sliding_window``; the hybrid
      reference gives each type its own.
  """

  def __init__(self, cfg: CacheConfig, sliding_window: int | None | object = FROM_CONFIG):
    self.cfg = cfg
    self.window = cfg.sliding_window if sliding_window is FROM_CONFIG else sliding_window
    self._state = self._initial_state()

  # Admission queries.

  def can_allocate(self, num_tokens: int) -> AllocStatus:
    """Whether a prompt of ``num_tokens`` tokens fits now, later or never."""
    num_entries = self.cfg.blocks_for(max(num_tokens, 0))
    if num_tokens < 0 or num_entries > self.cfg.max_blocks_per_seq:
      return AllocStatus.NEVER
    required = sum(not self._is_dead(j, num_tokens) for j in range(num_entries))
    if self.cfg.num_gpu_blocks - required < self.cfg.watermark_blocks:
      return AllocStatus.NEVER
    return self._admission(required)

  def can_append_slots(self, seq_ids: Sequence[int], num_lookahead_slots: int = 0) -> bool:
    """Whether one new token per sequence (plus lookahead) surely fits.

    False for a group that ``append_slots`` would refuse for an argument or
    device error (bad or repeated ids, an empty slot, a sequence on the CPU).
    """
    _check_lookahead(num_lookahead_slots)
    if self._refuses(seq_ids, device="gpu"):
      return False
    per_seq = 1 + self.cfg.blocks_for(num_lookahead_slots)
    return self.num_free_gpu_blocks() >= len(_non_padding(seq_ids)) * per_seq

  def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
    """Whether the CPU pool has a block for every distinct GPU block.

    False for a group that ``swap_out`` would refuse for an argument or
    device error.
    """
    if self._refuses(seq_ids, device="gpu"):
      return False
    num_blocks = len(self._distinct_blocks(_non_padding(seq_ids), "gpu"))
    return num_blocks <= self.num_free_cpu_blocks()

  def can_swap_in(self, seq_ids: Sequence[int], num_lookahead_slots: int = 0) -> AllocStatus:
    """Whether the group's CPU blocks (plus growth) fit on the GPU.

    NEVER for a group that ``swap_in`` would refuse for an argument or device
    error.
    """
    _check_lookahead(num_lookahead_slots)
    if self._refuses(seq_ids, device="cpu"):
      return AllocStatus.NEVER
    group = _non_padding(seq_ids)
    per_seq = 1 + self.cfg.blocks_for(num_lookahead_slots)
    required = len(self._distinct_blocks(group, "cpu")) + len(group) * per_seq
    if self.cfg.num_gpu_blocks < required:
      return AllocStatus.NEVER
    return self._admission(required)

  # Mutating calls.

  def allocate(
    self,
    seq_ids: Sequence[int],
    token_ids: Sequence[int],
    num_tokens: int,
    salt: int = 0,
    max_hit_blocks: int | None = None,
  ) -> Status:
    """Gives every sequence of a group the same table for one prompt.

    Args:
      seq_ids: the group's slots, -1 for padding.
      token_ids: the prompt, padded to any length.
      num_tokens: how many of ``token_ids`` are the prompt.
      salt: the group's salt; blocks are shared by content only within a salt.
      max_hit_blocks: the hybrid's common hit: blocks from this one on are
        not taken from the cache (None: no cap).

    Returns:
      The call's status.
    """
    group = _non_padding(seq_ids)
    if _ids_invalid(seq_ids, self.cfg.max_seqs) or num_tokens < 0 or num_tokens > len(token_ids):
      return Status.INVALID_ARGUMENT
    if any(self._state.seqs[seq_id] is not None for seq_id in group):
      return Status.ALREADY_ALLOCATED
    if self.cfg.blocks_for(num_tokens) > self.cfg.max_blocks_per_seq:
      return Status.TABLE_FULL
    if not group:
      return Status.OK
    tokens = list(token_ids[:num_tokens])
    status, _ = self._atomically(lambda: (self._allocate(group, tokens, salt, max_hit_blocks), []))
    return status

  def allocate_counting_hits(
    self,
    seq_ids: Sequence[int],
    token_ids: Sequence[int],
    num_tokens: int,
    salt: int = 0,
    max_hit_blocks: int | None = None,
  ) -> tuple[Status, int]:
    """``allocate``, and how many prompt blocks it found in the prefix cache."""
    hits = self._state.hits
    status = self.allocate(seq_ids, token_ids, num_tokens, salt, max_hit_blocks)
    return status, self._state.hits - hits

  def served_blocks(self, token_ids: Sequence[int], num_tokens: int, salt: int = 0) -> int:
    """How many leading full blocks of a prompt the GPU pool has cached (no lookup counted)."""
    if not self.cfg.enable_prefix_caching:
      return 0
    tokens = list(token_ids[:num_tokens])
    count = 0
    while (count + 1) * self.cfg.block_size <= len(tokens) and self._state.pools["gpu"].lookup(
      (salt, tuple(tokens[: (count + 1) * self.cfg.block_size]))
    ) is not None:
      count += 1
    return count

  def append_slots(
    self,
    seq_ids: Sequence[int],
    new_token_ids: Sequence[Sequence[int]],
    num_new: Sequence[int],
    num_lookahead_slots: int = 0,
  ) -> tuple[Status, Plan]:
    """Makes room for each row's new tokens and lookahead slots.

    Args:
      seq_ids: the rows' slots, -1 for padding.
      new_token_ids: per row, the new tokens (the first ``num_new[i]`` count).
      num_new: per row, how many new tokens.
      num_lookahead_slots: slots to reserve past the new tokens.

    Returns:
      The status and the copy-on-write plan, ``(src, dst)`` pairs in the order
      their destinations were taken.

    Raises:
      ValueError: ``num_lookahead_slots < 0``, or rows that do not line up.
    """
    _check_lookahead(num_lookahead_slots)
    _check_rows(seq_ids, new_token_ids=new_token_ids, num_new=num_new)
    if _ids_invalid(seq_ids, self.cfg.max_seqs) or any(
      not 0 <= num_new[i] <= len(new_token_ids[i])
      for i, seq_id in enumerate(seq_ids)
      if seq_id != PADDING
    ):
      return Status.INVALID_ARGUMENT, []
    rows = [
      (seq_id, list(new_token_ids[i][: num_new[i]]))
      for i, seq_id in enumerate(seq_ids)
      if seq_id != PADDING
    ]
    status = self._slot_status([seq_id for seq_id, _ in rows], device="gpu")
    if status != Status.OK:
      return status, []
    for seq_id, new in rows:
      total = len(self._state.seqs[seq_id].tokens) + len(new)
      if self.cfg.blocks_for(total + num_lookahead_slots) > (self.cfg.max_blocks_per_seq):
        return Status.TABLE_FULL, []
    return self._atomically(lambda: self._append(rows, num_lookahead_slots))

  def fork(self, parent_id: int, child_id: int) -> Status:
    """Gives the child the parent's table, tokens, salt and device."""
    if (
      not _in_range(parent_id, self.cfg.max_seqs)
      or not _in_range(child_id, self.cfg.max_seqs)
      or parent_id == child_id
    ):
      return Status.INVALID_ARGUMENT
    parent = self._state.seqs[parent_id]
    if parent is None:
      return Status.NOT_ALLOCATED
    if self._state.seqs[child_id] is not None:
      return Status.ALREADY_ALLOCATED
    pool = self._state.pools[parent.device]
    for block_number in _live(parent.table):
      pool.add_reference(block_number)
    self._state.seqs[child_id] = copy.deepcopy(parent)
    return Status.OK

  def free(self, seq_ids: Sequence[int]) -> Status:
    """Releases each table from its last entry to its first; empties slots."""
    if _ids_invalid(seq_ids, self.cfg.max_seqs):
      return Status.INVALID_ARGUMENT
    group = _non_padding(seq_ids)
    status = self._slot_status(group, device=None)
    if status != Status.OK:
      return status
    for seq_id in group:
      self._free_slot(seq_id)
    return Status.OK

  def swap_out(self, seq_ids: Sequence[int]) -> tuple[Status, Plan]:
    """Moves a group from the GPU to the CPU; plan pairs are (gpu, cpu)."""
    return self._swap(seq_ids, "gpu", "cpu", Status.SWAP_SPACE_EXHAUSTED)

  def swap_in(self, seq_ids: Sequence[int]) -> tuple[Status, Plan]:
    """Moves a group from the CPU to the GPU; plan pairs are (cpu, gpu)."""
    return self._swap(seq_ids, "cpu", "gpu", Status.OUT_OF_BLOCKS)

  def reset(self) -> None:
    """Frees every occupied slot in slot order; pools keep their content."""
    for seq_id, seq in enumerate(self._state.seqs):
      if seq is not None:
        self._free_slot(seq_id)

  # Prefix-caching bookkeeping.

  def access_all_blocks_in_seq(self, seq_id: int, now: int) -> None:
    """Moves ``last_accessed`` of every block of the table forward to ``now``.

    A no-op without prefix caching, for an empty slot or an id out of range.
    """
    if not self.cfg.enable_prefix_caching or not _in_range(seq_id, self.cfg.max_seqs):
      return
    seq = self._state.seqs[seq_id]
    if seq is None:
      return
    for block_number in _live(seq.table):
      self._state.pools[seq.device].touch(block_number, now)

  def mark_blocks_as_computed(
    self, seq_ids: Sequence[int], num_computed_tokens: Sequence[int] | int
  ) -> None:
    """Marks the blocks of each GPU sequence's computed tokens as computed.

    Args:
      seq_ids: the slots, -1 for padding.
      num_computed_tokens: absolute computed tokens, per row or one for all.

    Raises:
      ValueError: bad ids, a negative count, or counts that do not line up.
    """
    if isinstance(num_computed_tokens, numbers.Integral):
      num_computed_tokens = [num_computed_tokens] * len(seq_ids)
    _check_rows(seq_ids, num_computed_tokens=num_computed_tokens)
    self._query_group(seq_ids)
    if any(count < 0 for count in num_computed_tokens):
      raise ValueError(f"num_computed_tokens must be >= 0, got {list(num_computed_tokens)}")
    if not self.cfg.enable_prefix_caching:
      return
    for seq_id, count in zip(seq_ids, num_computed_tokens):
      seq = self._state.seqs[seq_id] if seq_id != PADDING else None
      if seq is None or seq.device != "gpu":
        continue
      num_blocks = min(count, len(seq.tokens)) // self.cfg.block_size
      for block_number in _live(seq.table[:num_blocks]):
        self._state.pools["gpu"].mark_computed(block_number)

  def get_common_computed_block_ids(self, seq_ids: Sequence[int]) -> list[int]:
    """Longest common prefix of the sequences' computed blocks (as vLLM).

    Per sequence of ``n >= 1`` tokens on the GPU, the computed blocks among
    entries ``j < (n - 1) // block_size``; an empty slot, a swapped-out
    sequence or an empty sequence makes the result empty.
    """
    group = self._query_group(seq_ids)
    if not self.cfg.enable_prefix_caching:
      return []
    pool = self._state.pools["gpu"]
    lists = []
    for seq_id in group:
      seq = self._state.seqs[seq_id]
      if seq is None or seq.device != "gpu" or not seq.tokens:
        return []
      last = (len(seq.tokens) - 1) // self.cfg.block_size
      lists.append([b for b in _live(seq.table[:last]) if pool.blocks[b].computed])
    return _common_prefix(lists)

  # Read-only views.

  def get_block_table(self, seq_id: int) -> list[int]:
    """The table padded with -1 to ``max_blocks_per_seq`` entries."""
    _check_id(seq_id, self.cfg.max_seqs)
    seq = self._state.seqs[seq_id]
    table = seq.table if seq is not None else []
    return table + [PADDING] * (self.cfg.max_blocks_per_seq - len(table))

  def get_num_tokens(self, seq_id: int) -> int:
    """Tokens the sequence holds; 0 for an empty slot."""
    _check_id(seq_id, self.cfg.max_seqs)
    seq = self._state.seqs[seq_id]
    return len(seq.tokens) if seq is not None else 0

  def get_slot_mapping(
    self, seq_ids: Sequence[int], num_new: Sequence[int], width: int
  ) -> list[list[int]]:
    """Cache slots of each row's last ``num_new`` tokens.

    Args:
      seq_ids: the slots, -1 for padding.
      num_new: per row, how many of the sequence's last tokens.
      width: the row length.

    Returns:
      Per row, the slots (``block * block_size + offset``) of the sequence's
      last ``min(num_new[i], num_tokens)`` positions in order, at most
      ``width`` of them, then -1. Positions outside a sliding window, empty
      slots, swapped-out sequences and padding rows give -1.

    Raises:
      ValueError: bad ids, negative counts or width, rows that do not line up.
    """
    _check_rows(seq_ids, num_new=num_new)
    self._query_group(seq_ids)
    if width < 0 or any(count < 0 for count in num_new):
      raise ValueError(
        f"width and num_new must be >= 0, got width={width}, num_new={list(num_new)}"
      )
    mapping = []
    for seq_id, count in zip(seq_ids, num_new):
      seq = self._state.seqs[seq_id] if seq_id != PADDING else None
      slots = []
      if seq is not None and seq.device == "gpu":
        num_tokens = len(seq.tokens)
        first = num_tokens - min(count, num_tokens)
        slots = [self._slot(seq, p) for p in range(first, num_tokens)][:width]
      mapping.append(slots + [PADDING] * (width - len(slots)))
    return mapping

  def num_free_gpu_blocks(self) -> int:
    """Free GPU blocks (with caching, evictable ones count as free)."""
    return self._state.pools["gpu"].num_free()

  def num_free_cpu_blocks(self) -> int:
    """Free CPU blocks (with caching, evictable ones count as free)."""
    return self._state.pools["cpu"].num_free()

  def ref_counts(self, device: str) -> list[int]:
    """Ref count of every block of the ``device`` pool, by block number."""
    _check_device(device)
    return [block.ref_count for block in self._state.pools[device].blocks]

  def device_of(self, seq_id: int) -> str | None:
    """``"gpu"``, ``"cpu"``, or None for an empty slot."""
    _check_id(seq_id, self.cfg.max_seqs)
    seq = self._state.seqs[seq_id]
    return seq.device if seq is not None else None

  def prefix_cache_hit_rate(self) -> float:
    """GPU hits / lookups; 0.0 before any lookup, -1.0 with caching off."""
    if not self.cfg.enable_prefix_caching:
      return -1.0
    if self._state.lookups == 0:
      return 0.0
    return self._state.hits / self._state.lookups

  # Internals.

  def _initial_state(self) -> _State:
    pool_type = CachedBlockAllocator if self.cfg.enable_prefix_caching else UncachedBlockAllocator
    return _State(
      pools={
        "gpu": pool_type(self.cfg.num_gpu_blocks),
        "cpu": pool_type(self.cfg.num_cpu_blocks),
      },
      seqs=[None] * self.cfg.max_seqs,
    )

  def _atomically(self, call: Callable[[], tuple[Status, Plan]]) -> tuple[Status, Plan]:
    """Runs ``call``; restores the state it found unless it returns OK."""
    saved = copy.deepcopy(self._state)
    status, plan = call()
    if status != Status.OK:
      self._state = saved
      return status, []
    for pool in self._state.pools.values():
      pool.settle()
    return status, plan

  def _admission(self, required: int) -> AllocStatus:
    """OK if ``required`` GPU blocks leave the watermark free, else LATER."""
    if self.num_free_gpu_blocks() - required >= self.cfg.watermark_blocks:
      return AllocStatus.OK
    return AllocStatus.LATER

  def _query_group(self, seq_ids: Sequence[int]) -> list[int]:
    """The non-padding ids of a host query; ValueError if any is bad."""
    if _ids_invalid(seq_ids, self.cfg.max_seqs):
      raise ValueError(
        f"seq_ids must be distinct ids in 0..{self.cfg.max_seqs - 1} or -1 "
        f"(padding), got {list(seq_ids)}"
      )
    return _non_padding(seq_ids)

  def _refuses(self, seq_ids: Sequence[int], device: str) -> bool:
    """Whether an op on ``device`` refuses the group with an argument or device error."""
    return (
      _ids_invalid(seq_ids, self.cfg.max_seqs)
      or self._slot_status(_non_padding(seq_ids), device) != Status.OK
    )

  def _slot_status(self, group: list[int], device: str | None) -> Status:
    """NOT_ALLOCATED, else WRONG_DEVICE (unless ``device`` is None), else OK."""
    seqs = [self._state.seqs[seq_id] for seq_id in group]
    if any(seq is None for seq in seqs):
      return Status.NOT_ALLOCATED
    if device is not None and any(seq.device != device for seq in seqs):
      return Status.WRONG_DEVICE
    return Status.OK

  def _is_dead(self, j: int, num_tokens: int) -> bool:
    """Whether block ``j`` of ``num_tokens`` tokens has left the window."""
    window = self.window
    return window is not None and (j + 1) * self.cfg.block_size <= (num_tokens - window)

  def _identity(self, seq: _Sequence, tokens: list[int], j: int) -> Identity:
    return (seq.salt, tuple(tokens[: (j + 1) * self.cfg.block_size]))

  def _look_up(self, identity: Identity) -> int | None:
    """Counts one GPU lookup; returns the registered block or None."""
    self._state.lookups += 1
    block_number = self._state.pools["gpu"].lookup(identity)
    if block_number is not None:
      self._state.hits += 1
    return block_number

  def _release(self, pool: Pool, block_number: int) -> None:
    status = pool.release(block_number)
    assert status == Status.OK, f"block {block_number} released twice"

  def _free_slot(self, seq_id: int) -> None:
    seq = self._state.seqs[seq_id]
    pool = self._state.pools[seq.device]
    for block_number in reversed(_live(seq.table)):
      self._release(pool, block_number)
    self._state.seqs[seq_id] = None

  def _distinct_blocks(self, group: list[int], device: str) -> set[int]:
    """Blocks held by the group's sequences that live on ``device``."""
    blocks = set()
    for seq_id in group:
      seq = self._state.seqs[seq_id]
      if seq is not None and seq.device == device:
        blocks.update(_live(seq.table))
    return blocks

  def _slot(self, seq: _Sequence, position: int) -> int:
    window = self.window
    block_number = seq.table[position // self.cfg.block_size]
    if block_number == PADDING or (window is not None and position < len(seq.tokens) - window):
      return PADDING
    return block_number * self.cfg.block_size + position % self.cfg.block_size

  def _allocate(
    self, group: list[int], tokens: list[int], salt: int, max_hit_blocks: int | None
  ) -> Status:
    """Phases of ``allocate``: lookups, takes, registration.

    Every full block is looked up; the hits are the cached chain from block 0
    (at most ``max_hit_blocks``). A hit whose entry is dead is passed through
    but not held. A new block is registered only if its identity is not
    cached and the entry before it holds a block with content.
    """
    pool = self._state.pools["gpu"]
    num_tokens = len(tokens)
    num_full = num_tokens // self.cfg.block_size
    caching = self.cfg.enable_prefix_caching
    template = _Sequence([PADDING] * self.cfg.blocks_for(num_tokens), tokens, salt, "gpu")
    table = template.table
    chain = []
    for j in range(num_full if caching else 0):
      self._state.lookups += 1
      found = pool.lookup(self._identity(template, tokens, j))
      if found is not None and len(chain) == j:
        chain.append(found)
    num_hits = len(chain) if max_hit_blocks is None else min(len(chain), max_hit_blocks)
    self._state.hits += num_hits
    for j in range(num_hits):
      if not self._is_dead(j, num_tokens):
        pool.add_reference(chain[j], len(group))
        table[j] = chain[j]
    misses = [
      j for j in range(len(table)) if table[j] == PADDING and not self._is_dead(j, num_tokens)
    ]
    if len(misses) > pool.num_free():
      return Status.OUT_OF_BLOCKS
    for j in misses:
      table[j] = pool.take()
      pool.add_reference(table[j], len(group))
    for j in misses:
      if caching and len(chain) <= j < num_full and _parent_has_content(pool, table, j):
        pool.register(table[j], self._identity(template, tokens, j), (j + 1) * self.cfg.block_size)
    for seq_id in group:
      self._state.seqs[seq_id] = copy.deepcopy(template)
    return Status.OK

  def _plan_row(
    self,
    row: int,
    seq: _Sequence,
    tokens: list[int],
    num_lookahead_slots: int,
    owners: dict[Identity, tuple[int, int]],
  ) -> list[_Entry]:
    """Phase 1 for one row: the entries it changes, with its lookups.

    Args:
      row: the row's index among the call's non-padding rows.
      seq: the row's sequence before the call.
      tokens: the sequence's tokens after the call.
      num_lookahead_slots: slots to reserve past the new tokens.
      owners: identities that earlier rows of the call need, and where; the
        row's misses are added.

    Returns:
      The changed entries in logical order; hits are pinned.

    The row's full landing blocks are looked up only if the entry before the
    first of them holds a block with content (or it is block 0). An entry
    the call leaves dead is looked up (the chain passes through it) but
    changes nothing.
    """
    block_size = self.cfg.block_size
    num_before, num_after = len(seq.tokens), len(tokens)
    first_landing = num_before // block_size
    last_landing = (
      self.cfg.blocks_for(num_after) - 1 if num_after > num_before else first_landing - 1
    )
    length = max(len(seq.table), self.cfg.blocks_for(num_after + num_lookahead_slots))
    looks_up = self.cfg.enable_prefix_caching and _parent_has_content(
      self._state.pools["gpu"], seq.table, first_landing
    )
    entries = []
    for j in range(first_landing, length):
      held = seq.table[j] if j < len(seq.table) else PADDING
      full = looks_up and j <= last_landing and (j + 1) * block_size <= num_after
      if self._is_dead(j, num_after):
        if full:
          self._look_up(self._identity(seq, tokens, j))
        continue
      if j > last_landing and held != PADDING:
        continue
      entry = _Entry(j, "take" if held == PADDING else "in_place", held)
      if full:
        entry.identity = self._identity(seq, tokens, j)
        entry.hit_block = self._look_up(entry.identity)
        if entry.hit_block is not None:
          entry.action = "hit"
          self._state.pools["gpu"].add_reference(entry.hit_block)
        elif entry.identity in owners:
          self._state.hits += 1
          entry.action, entry.owner = "share", owners[entry.identity]
        else:
          owners[entry.identity] = (row, j)
      entries.append(entry)
    return entries

  def _decide_copies(self, plans: list[list[_Entry]], ref_counts: list[int]) -> None:
    """Phase 2: which writes into held blocks copy-on-write.

    Of the writers of a block, hits and shares leave it; if every holder of
    the block writes, the last remaining writer writes in place.
    """
    writers = {}
    for entries in plans:
      for entry in entries:
        if entry.held != PADDING:
          writers.setdefault(entry.held, []).append(entry)
    for block_number, entries in writers.items():
      stay = [entry for entry in entries if entry.action == "in_place"]
      everyone_writes = len(entries) == ref_counts[block_number]
      for entry in stay[:-1] if everyone_writes else stay:
        entry.action = "copy"

  def _append(
    self, rows: list[tuple[int, list[int]]], num_lookahead_slots: int
  ) -> tuple[Status, Plan]:
    """Phases of ``append_slots`` for the non-padding rows, in array order."""
    pool = self._state.pools["gpu"]
    ref_counts = self.ref_counts("gpu")
    seqs = [self._state.seqs[seq_id] for seq_id, _ in rows]
    tokens = [seq.tokens + new for seq, (_, new) in zip(seqs, rows)]
    owners = {}
    plans = [
      self._plan_row(row, seq, row_tokens, num_lookahead_slots, owners)
      for row, (seq, row_tokens) in enumerate(zip(seqs, tokens))
    ]
    self._decide_copies(plans, ref_counts)
    takes = sum(entry.action in ("take", "copy") for entries in plans for entry in entries)
    if takes > pool.num_free():
      return Status.OUT_OF_BLOCKS, []
    tables = [_grown(seq.table, entries) for seq, entries in zip(seqs, plans)]
    copy_plan = []
    for table, entries in zip(tables, plans):
      for entry in entries:
        if entry.action in ("take", "copy"):
          table[entry.j] = pool.take()
          pool.add_reference(table[entry.j])
        if entry.action == "copy":
          copy_plan.append((entry.held, table[entry.j]))
        if entry.action == "hit":
          table[entry.j] = entry.hit_block
    for table, entries in zip(tables, plans):
      for entry in entries:
        if entry.action == "share":
          row, j = entry.owner
          table[entry.j] = tables[row][j]
          pool.add_reference(table[entry.j])
    for table, entries, row_tokens in zip(tables, plans, tokens):
      for entry in entries:
        if entry.action in ("copy", "hit", "share") and entry.held != PADDING:
          self._release(pool, entry.held)
      for j in range(len(table)):
        if table[j] != PADDING and self._is_dead(j, len(row_tokens)):
          self._release(pool, table[j])
          table[j] = PADDING
    for table, entries in zip(tables, plans):
      for entry in entries:
        if (
          entry.identity is not None
          and entry.action not in ("hit", "share")
          and _parent_has_content(pool, table, entry.j)
        ):
          pool.register(table[entry.j], entry.identity, (entry.j + 1) * self.cfg.block_size)
    for seq, table, row_tokens in zip(seqs, tables, tokens):
      seq.table, seq.tokens = table, row_tokens
    return Status.OK, copy_plan

  def _swap(
    self, seq_ids: Sequence[int], source: str, destination: str, exhausted: Status
  ) -> tuple[Status, Plan]:
    """Checks a swap and runs it atomically."""
    if _ids_invalid(seq_ids, self.cfg.max_seqs):
      return Status.INVALID_ARGUMENT, []
    group = _non_padding(seq_ids)
    status = self._slot_status(group, device=source)
    if status != Status.OK:
      return status, []
    return self._atomically(lambda: self._move(group, source, destination, exhausted))

  def _move(
    self, group: list[int], source: str, destination: str, exhausted: Status
  ) -> tuple[Status, Plan]:
    """Phases of a swap.

    Lookups and takes in the destination pool, releases in the source pool,
    then registration of the moved content. Each table is looked up from
    block 0, left to right, up to the first entry that is dead, holds a block
    without content or misses; a block several tables hold is looked up once.
    Every distinct block with content counts one GPU lookup (docs/semantics.md,
    "Hit counting"), reached or not.
    A moved block is registered only where the entry before it holds a block
    with content.
    """
    source_pool = self._state.pools[source]
    destination_pool = self._state.pools[destination]
    seqs = [self._state.seqs[seq_id] for seq_id in group]
    uses = {}
    for seq in seqs:
      for block_number in _live(seq.table):
        uses[block_number] = uses.get(block_number, 0) + 1
    identities = {b: source_pool.blocks[b].identity for b in uses}
    if destination == "gpu":  # one lookup counted per distinct block with content
      self._state.lookups += sum(identity is not None for identity in identities.values())
    found = {}
    for seq in seqs:
      for block_number in seq.table:
        if block_number == PADDING or identities[block_number] is None:
          break
        if block_number not in found:
          found[block_number] = destination_pool.lookup(identities[block_number])
          if destination == "gpu" and found[block_number] is not None:
            self._state.hits += 1
        if found[block_number] is None:
          break
    moved = {b: hit for b, hit in found.items() if hit is not None}
    for block_number, hit in moved.items():
      destination_pool.add_reference(hit, uses[block_number])
    misses = [b for b in uses if b not in moved]
    if len(misses) > destination_pool.num_free():
      return exhausted, []
    plan = []
    for block_number in misses:
      moved[block_number] = destination_pool.take()
      destination_pool.add_reference(moved[block_number], uses[block_number])
      plan.append((block_number, moved[block_number]))
    for seq in seqs:
      for block_number in _live(seq.table):
        self._release(source_pool, block_number)
    for seq in seqs:
      seq.table = [moved.get(b, PADDING) for b in seq.table]
      seq.device = destination
    to_register = {moved[b]: b for b in misses if identities[b] is not None}
    registered = True
    while registered:  # until no table registers one more block
      registered = False
      for seq in seqs:
        for j, block_number in enumerate(seq.table):
          if block_number in to_register and _parent_has_content(destination_pool, seq.table, j):
            b = to_register.pop(block_number)
            destination_pool.register(
              block_number, identities[b], source_pool.blocks[b].num_hashed_tokens
            )
            registered = True
    return Status.OK, plan


def _grown(table: list[int], entries: list[_Entry]) -> list[int]:
  """A copy of ``table`` long enough for the entries a call changes."""
  length = max([len(table)] + [entry.j + 1 for entry in entries])
  return table + [PADDING] * (length - len(table))


def _parent_has_content(pool: Pool, table: list[int], j: int) -> bool:
  """Whether entry ``j`` is block 0 or the entry before it holds a block with content."""
  return j == 0 or (table[j - 1] != PADDING and pool.blocks[table[j - 1]].identity is not None)


def _live(table: list[int]) -> list[int]:
  return [block_number for block_number in table if block_number != PADDING]


def _non_padding(seq_ids: Sequence[int]) -> list[int]:
  return [seq_id for seq_id in seq_ids if seq_id != PADDING]


def _in_range(seq_id: int, max_seqs: int) -> bool:
  return 0 <= seq_id < max_seqs


def _ids_invalid(seq_ids: Sequence[int], max_seqs: int) -> bool:
  """Whether an id is out of range (and not padding) or named twice."""
  group = _non_padding(seq_ids)
  return any(not _in_range(seq_id, max_seqs) for seq_id in group) or len(set(group)) != len(group)


def _check_id(seq_id: int, max_seqs: int) -> None:
  if not _in_range(seq_id, max_seqs):
    raise ValueError(f"seq_id must be in 0..{max_seqs - 1}, got {seq_id}")


def _check_device(device: str) -> None:
  if device not in DEVICES:
    raise ValueError(f"device must be one of {DEVICES}, got {device!r}")


def _check_lookahead(num_lookahead_slots: int) -> None:
  if num_lookahead_slots < 0:
    raise ValueError(f"num_lookahead_slots must be >= 0, got {num_lookahead_slots}")


def _check_rows(seq_ids: Sequence[int], **per_row: Sequence) -> None:
  """ValueError unless every per-row argument has one item per id."""
  for name, values in per_row.items():
    if len(values) != len(seq_ids):
      raise ValueError(f"{name} has {len(values)} rows but seq_ids has {len(seq_ids)}")


def _common_prefix(lists: list[list[int]]) -> list[int]:
  if not lists:
    return []
  prefix = lists[0]
  for other in lists[1:]:
    length = 0
    while length < min(len(prefix), len(other)) and prefix[length] == other[length]:
      length += 1
    prefix = prefix[:length]
  return prefix
