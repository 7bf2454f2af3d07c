"""Plain-Python block pools of the reference block manager.

The objects follow a reading of vLLM 0.6's block manager (its physical
blocks, uncached and cached allocators and LRU evictor) with the exact pool
rules of docs/semantics.md. They are deliberately simple: lists, dicts and
linear scans.

A pool hands blocks out with ``take`` (ref count 0, no content) and the caller
then adds one reference per block table that holds the block, so a block's ref
count is always the number of tables holding it.
"""

from __future__ import annotations

import dataclasses

from paged_jax.config import Status

# Content identity of a full block: (salt, token prefix through the block).
Identity = tuple[int, tuple[int, ...]]


@dataclasses.dataclass
class PhysicalTokenBlock:
  """Bookkeeping of one block of a pool.

  Attributes:
    block_number: index of the block in its pool.
    ref_count: number of block tables that hold the block.
    identity: ``(salt, token prefix through the block)`` once the block is full
      and registered (prefix caching only), else None.
    num_hashed_tokens: length of that token prefix, 0 without identity.
    last_accessed: latest ``now`` given to ``access_all_blocks_in_seq``; -1
      for a block that has not been accessed since it was taken.
    computed: whether the block's KV is marked computed.
    release_order: value of the pool's release counter when the block last
      went to the evictor; breaks the evictor's last ties.
  """

  block_number: int
  ref_count: int = 0
  identity: Identity | None = None
  num_hashed_tokens: int = 0
  last_accessed: int = -1
  computed: bool = False
  release_order: int = -1


def _fresh_blocks(num_blocks: int) -> list[PhysicalTokenBlock]:
  return [PhysicalTokenBlock(number) for number in range(num_blocks)]


def _drop_reference(block: PhysicalTokenBlock) -> Status:
  """Decrements ``block.ref_count``; DOUBLE_FREE (and no change) if it is 0."""
  if block.ref_count == 0:
    return Status.DOUBLE_FREE
  block.ref_count -= 1
  return Status.OK


def _no_free_block(num_blocks: int) -> ValueError:
  return ValueError(f"no free block left in a pool of {num_blocks} blocks")


@dataclasses.dataclass
class UncachedBlockAllocator:
  """Pool without prefix caching: a LIFO stack of free block numbers.

  The stack starts as ``[0, 1, ..., N-1]``; ``take`` pops from the end (the
  first block handed out is N-1) and a block whose ref count drops to 0 is
  pushed back on the end.

  Attributes:
    num_blocks: blocks in the pool.
    blocks: one ``PhysicalTokenBlock`` per block number.
    free_stack: free block numbers, the next one to hand out last.
  """

  num_blocks: int
  blocks: list[PhysicalTokenBlock] = dataclasses.field(init=False)
  free_stack: list[int] = dataclasses.field(init=False)

  def __post_init__(self):
    self.blocks = _fresh_blocks(self.num_blocks)
    self.free_stack = list(range(self.num_blocks))

  def num_free(self) -> int:
    return len(self.free_stack)

  def take(self) -> int:
    """Hands out the block on top of the free stack.

    Returns:
      The block number, with ref count 0.

    Raises:
      ValueError: the stack is empty.
    """
    if not self.free_stack:
      raise _no_free_block(self.num_blocks)
    return self.free_stack.pop()

  def add_reference(self, block_number: int, count: int = 1) -> None:
    """Adds ``count`` references to a block that was taken or is held."""
    self.blocks[block_number].ref_count += count

  def release(self, block_number: int) -> Status:
    """Drops one reference; a block left with none goes back on the stack.

    Returns:
      OK, or DOUBLE_FREE (nothing changed) if the ref count was already 0.
    """
    status = _drop_reference(self.blocks[block_number])
    if status == Status.OK and self.blocks[block_number].ref_count == 0:
      self.free_stack.append(block_number)
    return status

  def settle(self) -> None:
    """Ends a call (nothing to do without content)."""


@dataclasses.dataclass
class LRUEvictor:
  """Released blocks that keep their content until they are evicted.

  Eviction takes the block with the smallest ``last_accessed``; ties go to the
  largest ``num_hashed_tokens``, remaining ties to the smallest
  ``release_order`` (the block released earliest).

  Attributes:
    blocks: the blocks in the evictor by block number.
  """

  blocks: dict[int, PhysicalTokenBlock] = dataclasses.field(default_factory=dict)

  def __contains__(self, block_number: int) -> bool:
    return block_number in self.blocks

  def __len__(self) -> int:
    return len(self.blocks)

  def add(self, block: PhysicalTokenBlock) -> None:
    self.blocks[block.block_number] = block

  def remove(self, block_number: int) -> None:
    del self.blocks[block_number]

  def evict(self) -> int:
    """Removes the next victim from the evictor.

    Returns:
      The victim's block number (its bookkeeping is left to the pool).

    Raises:
      ValueError: the evictor is empty.
    """
    if not self.blocks:
      raise ValueError("the evictor holds no block to evict")
    victim = min(self.blocks.values(), key=_eviction_rank)
    del self.blocks[victim.block_number]
    return victim.block_number


def _eviction_rank(block: PhysicalTokenBlock) -> tuple[int, int, int]:
  return (block.last_accessed, -block.num_hashed_tokens, block.release_order)


@dataclasses.dataclass
class CachedBlockAllocator:
  """Pool with prefix caching.

  ``take`` hands out a never-used block first (0, 1, 2, ...), then a released
  block without content (last released first), then evicts. A block with
  content whose ref count drops to 0 keeps its content in the evictor, where
  ``lookup`` still finds it and ``add_reference`` revives it.

  Attributes:
    num_blocks: blocks in the pool.
    blocks: one ``PhysicalTokenBlock`` per block number.
    num_used: blocks ``0 .. num_used - 1`` have been handed out at least once.
    released: released blocks without content, the next one to hand out last.
    evictor: released blocks with content.
    cached: block number of every registered identity (held or in the
      evictor): the block that registered it last. A swap-in can register
      a moved block under an identity that a block in the evictor still
      carries (its table's lookups stopped before that block); evicting
      the older block then leaves the entry to the newer one, as the
      jitted manager's content index does.
    release_counter: releases to the evictor so far.
    orphans: evictor blocks whose identity an eviction of this call took
      (see ``take``); ``settle`` moves them to ``released`` at the call's end.
  """

  num_blocks: int
  blocks: list[PhysicalTokenBlock] = dataclasses.field(init=False)
  num_used: int = 0
  released: list[int] = dataclasses.field(default_factory=list)
  evictor: LRUEvictor = dataclasses.field(default_factory=LRUEvictor)
  cached: dict[Identity, int] = dataclasses.field(default_factory=dict)
  release_counter: int = 0
  orphans: set[int] = dataclasses.field(default_factory=set)

  def __post_init__(self):
    self.blocks = _fresh_blocks(self.num_blocks)

  def num_free(self) -> int:
    return (self.num_blocks - self.num_used) + len(self.released) + len(self.evictor)

  def lookup(self, identity: Identity) -> int | None:
    """Returns the block registered with ``identity``, or None."""
    return self.cached.get(identity)

  def take(self) -> int:
    """Hands out a block for new content, evicting one if it must.

    Evicting a block also takes the identity of every cached block that
    extends its prefix (same salt, longer prefix), so no cached block
    outlives its parent: held ones keep their ref counts, unreferenced ones
    become orphans. Orphans keep their place in the evictor until ``settle``,
    so a call's takes follow the pool as it stood when the call began.

    Returns:
      The block number, with ref count 0, no content, not computed and
      ``last_accessed`` -1.

    Raises:
      ValueError: the pool has no free block.
    """
    if self.num_used < self.num_blocks:
      block_number = self.num_used
      self.num_used += 1
    elif self.released:
      block_number = self.released.pop()
    elif self.evictor:
      block_number = self.evictor.evict()
      identity = self.blocks[block_number].identity
      if identity is None:  # an orphan of this call, taken before it settles
        self.orphans.discard(block_number)
      else:
        if self.cached.get(identity) == block_number:  # (else a later block took it)
          del self.cached[identity]
        self._forget_extensions(identity)
    else:
      raise _no_free_block(self.num_blocks)
    self.blocks[block_number] = PhysicalTokenBlock(block_number)
    return block_number

  def add_reference(self, block_number: int, count: int = 1) -> None:
    """Adds ``count`` references, reviving the block from the evictor."""
    if block_number in self.evictor:
      self.evictor.remove(block_number)
    self.blocks[block_number].ref_count += count

  def release(self, block_number: int) -> Status:
    """Drops one reference; a block left with none becomes free.

    Returns:
      OK, or DOUBLE_FREE (nothing changed) if the ref count was already 0.
    """
    block = self.blocks[block_number]
    status = _drop_reference(block)
    if status == Status.OK and block.ref_count == 0:
      if block.identity is None:
        self.released.append(block_number)
      else:
        block.release_order = self.release_counter
        self.release_counter += 1
        self.evictor.add(block)
    return status

  def register(self, block_number: int, identity: Identity, num_hashed_tokens: int) -> None:
    """Gives a held block without content the identity of its full prefix."""
    block = self.blocks[block_number]
    block.identity = identity
    block.num_hashed_tokens = num_hashed_tokens
    self.cached[identity] = block_number

  def settle(self) -> None:
    """Ends a call: its orphans leave the evictor for ``released``, lowest first."""
    for block_number in sorted(self.orphans):
      self.evictor.remove(block_number)
      self.released.append(block_number)
    self.orphans.clear()

  def _forget_extensions(self, identity: Identity) -> None:
    """Takes the identity (and computed flag) of every block extending ``identity``."""
    salt, prefix = identity
    for other in list(self.cached):
      other_salt, other_prefix = other
      if (
        other_salt == salt
        and len(other_prefix) > len(prefix)
        and other_prefix[: len(prefix)] == prefix
      ):
        block = self.blocks[self.cached.pop(other)]
        block.identity, block.computed = None, False
        if block.block_number in self.evictor:
          self.orphans.add(block.block_number)

  def touch(self, block_number: int, now: int) -> None:
    """Moves ``last_accessed`` forward to ``now`` (never backwards)."""
    block = self.blocks[block_number]
    block.last_accessed = max(block.last_accessed, now)

  def mark_computed(self, block_number: int) -> None:
    self.blocks[block_number].computed = True
