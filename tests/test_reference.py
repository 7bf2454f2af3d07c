"""Hand-checkable tests of the plain-Python reference block manager: pools,
block numbering, copy-on-write, phases and lookahead slots.

Each test pins one rule of docs/semantics.md on a tiny
configuration whose expected block numbers can be worked out on paper; the
comments show the working. The other rules are in tests/test_reference_*.py.
"""

import copy

import pytest

from paged_jax.config import AllocStatus, Status
from tests.reference.allocators import (
  CachedBlockAllocator,
  LRUEvictor,
  PhysicalTokenBlock,
  UncachedBlockAllocator,
)
from tests.reference_cases import make_manager, next_gpu_take, table

# Pools.


def test_uncached_pool_takes_from_the_top_of_the_stack():
  pool = UncachedBlockAllocator(4)
  assert [pool.take(), pool.take()] == [3, 2]
  pool.add_reference(3)
  assert pool.release(3) == Status.OK
  assert pool.take() == 3
  assert pool.num_free() == 2


def test_uncached_pool_raises_when_empty():
  pool = UncachedBlockAllocator(1)
  pool.take()
  with pytest.raises(ValueError, match="no free block"):
    pool.take()


@pytest.mark.parametrize("pool_type", [UncachedBlockAllocator, CachedBlockAllocator])
def test_releasing_an_unreferenced_block_is_a_double_free(pool_type):
  pool = pool_type(2)
  block = pool.take()
  pool.add_reference(block)
  assert pool.release(block) == Status.OK
  before = copy.deepcopy(pool)
  assert pool.release(block) == Status.DOUBLE_FREE
  assert pool == before


def test_cached_pool_take_order():
  pool = CachedBlockAllocator(4)
  # Never-used blocks first, in order.
  assert [pool.take() for _ in range(4)] == [0, 1, 2, 3]
  for block in range(4):
    pool.add_reference(block)
  pool.register(0, (0, (5, 6)), 2)
  for block in (1, 3, 0):
    pool.release(block)
  # Released without content, last released first; then eviction.
  assert [pool.take(), pool.take(), pool.take()] == [3, 1, 0]
  assert pool.lookup((0, (5, 6))) is None
  assert pool.blocks[0] == PhysicalTokenBlock(0)
  with pytest.raises(ValueError, match="no free block"):
    pool.take()


def test_cached_pool_revives_released_content():
  pool = CachedBlockAllocator(2)
  block = pool.take()
  pool.add_reference(block)
  pool.register(block, (0, (5, 6)), 2)
  pool.mark_computed(block)
  pool.release(block)
  assert pool.num_free() == 2
  assert pool.lookup((0, (5, 6))) == block
  pool.add_reference(block)
  assert pool.num_free() == 1
  assert block not in pool.evictor
  assert pool.blocks[block].computed


def test_touch_never_moves_last_accessed_backwards():
  pool = CachedBlockAllocator(1)
  block = pool.take()
  pool.touch(block, 5)
  pool.touch(block, 3)
  assert pool.blocks[block].last_accessed == 5


def test_lru_evictor_tie_breaks():
  evictor = LRUEvictor()
  # (block_number, last_accessed, num_hashed_tokens, release_order)
  for number, accessed, hashed, order in [(0, 1, 8, 0), (1, 0, 4, 1), (2, 0, 8, 3), (3, 0, 8, 2)]:
    evictor.add(
      PhysicalTokenBlock(
        number, last_accessed=accessed, num_hashed_tokens=hashed, release_order=order
      )
    )
  # Oldest access first; then longest prefix; then released earliest.
  assert [evictor.evict() for _ in range(4)] == [3, 2, 1, 0]
  with pytest.raises(ValueError, match="no block to evict"):
    evictor.evict()


# Block numbering and release order.


def test_blocks_come_from_the_top_of_the_stack():
  manager = make_manager(num_gpu_blocks=4)
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK
  assert manager.allocate([1], [4], 1) == Status.OK
  assert table(manager, 0) == [3, 2]
  assert table(manager, 1) == [1]
  assert manager.ref_counts("gpu") == [0, 1, 1, 1]


def test_free_walks_the_table_from_last_entry_to_first():
  manager = make_manager(num_gpu_blocks=4)
  assert manager.allocate([0], list(range(6)), 6) == Status.OK
  assert table(manager, 0) == [3, 2, 1]
  # Pushing 1, 2, 3 restores the stack [0, 1, 2, 3]: block 3 comes next.
  assert manager.free([0]) == Status.OK
  assert next_gpu_take(manager) == 3


@pytest.mark.parametrize("order, expected", [([0, 1], 2), ([1, 0], 3)])
def test_free_releases_in_array_order(order, expected):
  manager = make_manager(num_gpu_blocks=4)
  assert manager.allocate([0], [1], 1) == Status.OK  # block 3
  assert manager.allocate([1], [2], 1) == Status.OK  # block 2
  assert manager.free(order) == Status.OK
  assert next_gpu_take(manager) == expected  # the last one released


def test_reset_frees_in_slot_order():
  manager = make_manager(num_gpu_blocks=4)
  assert manager.allocate([1], [1], 1) == Status.OK  # block 3
  assert manager.allocate([0], [2], 1) == Status.OK  # block 2
  manager.reset()
  # Slot 0 pushes 2, then slot 1 pushes 3.
  assert next_gpu_take(manager) == 3
  assert manager.num_free_gpu_blocks() == 3


def test_reset_keeps_cached_content():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2], 2) == Status.OK
  manager.reset()
  assert manager.allocate([1], [1, 2], 2) == Status.OK
  assert table(manager, 1) == [0]
  assert manager.prefix_cache_hit_rate() == 0.5


# Copy-on-write.


@pytest.mark.parametrize("rows", [[0, 1], [1, 0]])
def test_last_writer_writes_in_place(rows):
  manager = make_manager()
  assert manager.allocate([0], [1], 1) == Status.OK  # block 5
  assert manager.fork(0, 1) == Status.OK
  status, plan = manager.append_slots(rows, [[2], [2]], [1, 1])
  # Both holders write: the first row copies into block 4, the last writes
  # into block 5 in place.
  assert (status, plan) == (Status.OK, [(5, 4)])
  assert table(manager, rows[0]) == [4]
  assert table(manager, rows[1]) == [5]
  assert manager.ref_counts("gpu")[4:] == [1, 1]


def test_writers_copy_when_a_holder_stays():
  manager = make_manager()
  assert manager.allocate([0], [1], 1) == Status.OK  # block 5
  assert manager.fork(0, 1) == Status.OK
  assert manager.fork(0, 2) == Status.OK
  status, plan = manager.append_slots([0, 1], [[2], [3]], [1, 1])
  assert (status, plan) == (Status.OK, [(5, 4), (5, 3)])
  assert [table(manager, s) for s in range(3)] == [[4], [3], [5]]
  assert manager.ref_counts("gpu")[3:] == [1, 1, 1]


def test_appending_nothing_copies_nothing():
  manager = make_manager()
  assert manager.allocate([0, 1], [1], 1) == Status.OK
  assert manager.append_slots([0], [[9]], [0]) == (Status.OK, [])
  assert table(manager, 0) == table(manager, 1) == [5]
  assert manager.get_num_tokens(0) == 1


def test_copy_into_full_shared_block_is_not_needed():
  # The new token opens block 1; the shared full block 0 is not written.
  manager = make_manager()
  assert manager.allocate([0, 1], [1, 2], 2) == Status.OK
  assert manager.append_slots([0], [[3]], [1]) == (Status.OK, [])
  assert table(manager, 0) == [5, 4]
  assert manager.ref_counts("gpu")[5] == 2


# Phases: takes before releases.


def test_a_block_released_in_a_call_is_not_taken_in_it():
  manager = make_manager(block_size=1, num_gpu_blocks=4, sliding_window=1)
  assert manager.allocate([0], [7], 1) == Status.OK  # block 3
  assert manager.allocate([1], [8], 1) == Status.OK  # block 2
  # Takes: row 0 gets 1, row 1 gets 0; then 3 and 2 leave the window.
  # (One call per row would have handed block 3 to row 1.)
  status, plan = manager.append_slots([0, 1], [[9], [9]], [1, 1])
  assert (status, plan) == (Status.OK, [])
  assert table(manager, 0) == [-1, 1]
  assert table(manager, 1) == [-1, 0]
  assert next_gpu_take(manager) == 2


def test_takes_follow_array_then_logical_order():
  manager = make_manager(num_gpu_blocks=8)
  assert manager.allocate([0], [1, 2], 2) == Status.OK  # block 7
  assert manager.allocate([1], [3, 4], 2) == Status.OK  # block 6
  status, _ = manager.append_slots([1, 0], [[5, 6, 7], [8, 9, 0]], [3, 3])
  assert status == Status.OK
  assert table(manager, 1) == [6, 5, 4]
  assert table(manager, 0) == [7, 3, 2]


def test_dead_window_blocks_are_released_after_a_rows_other_releases():
  manager = make_manager(sliding_window=2)
  # Parent P = slot 0 with 3 tokens: table [5, 4]; child C = slot 1 shares it.
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK
  assert manager.fork(0, 1) == Status.OK
  # Row C (3 tokens, 6 in all): entries 0 and 1 die, entry 2 takes block 3.
  # Row P (1 token, 4 in all): entry 0 dies; it writes into block 4, which C
  # does not leave by a copy or a hit, so P copies it into block 2.
  status, plan = manager.append_slots([1, 0], [[4, 5, 6], [7, 0, 0]], [3, 1])
  assert (status, plan) == (Status.OK, [(4, 2)])
  assert table(manager, 1) == [-1, -1, 3]
  assert table(manager, 0) == [-1, 2]
  # Releases: C drops 5 and 4 (ref 2 -> 1); P drops its copy source 4 (pushed
  # first), then its dead block 5 (pushed last, so taken next).
  assert manager.num_free_gpu_blocks() == 4
  assert next_gpu_take(manager) == 5


def test_slots_outside_the_window_are_padding():
  manager = make_manager(sliding_window=1)
  # Block 0 (positions 0, 1) is dead; block 1 lives but position 2 is out.
  assert manager.allocate([0], [1, 2, 3, 4], 4) == Status.OK
  assert table(manager, 0) == [-1, 5]
  assert manager.get_slot_mapping([0], [4], 4) == [[-1, -1, -1, 11]]


def test_sliding_window_allocate_keeps_only_live_blocks():
  manager = make_manager(block_size=1, max_blocks_per_seq=6, sliding_window=2)
  assert manager.can_allocate(5) == AllocStatus.OK
  assert manager.allocate([0], [1, 2, 3, 4, 5], 5) == Status.OK
  assert table(manager, 0) == [-1, -1, -1, 5, 4]
  assert manager.get_slot_mapping([0], [5], 6) == [[-1, -1, -1, 5, 4, -1]]


# Lookahead slots.


def test_lookahead_reserves_blocks_that_later_tokens_use():
  manager = make_manager(num_gpu_blocks=8, max_blocks_per_seq=3)
  assert manager.allocate([0], [1], 1) == Status.OK  # block 7
  assert manager.can_append_slots([0], num_lookahead_slots=3)  # 7 >= 1 + 2
  # 2 tokens + 3 lookahead slots span 3 blocks: entries 1 and 2 are taken.
  assert manager.append_slots([0], [[2]], [1], num_lookahead_slots=3) == (Status.OK, [])
  assert table(manager, 0) == [7, 6, 5]
  assert manager.get_num_tokens(0) == 2
  # Later tokens land in the reserved blocks and take nothing.
  assert manager.append_slots([0], [[3, 4, 5]], [3]) == (Status.OK, [])
  assert table(manager, 0) == [7, 6, 5]
  assert manager.get_slot_mapping([0], [3], 3) == [[12, 13, 10]]
  assert manager.append_slots([0], [[6, 7]], [2]) == (Status.TABLE_FULL, [])
  assert manager.append_slots([0], [[]], [0], num_lookahead_slots=2) == (Status.TABLE_FULL, [])


def test_can_append_slots_counts_lookahead_per_sequence():
  manager = make_manager(num_gpu_blocks=5)
  assert manager.allocate([0], [1], 1) == Status.OK
  assert manager.allocate([1], [1], 1) == Status.OK
  # 3 free blocks; each row needs 1 + ceil(lookahead / 2).
  assert manager.can_append_slots([0, -1, 1], num_lookahead_slots=0)
  assert not manager.can_append_slots([0, 1], num_lookahead_slots=1)
  assert manager.can_append_slots([0], num_lookahead_slots=4)
  assert not manager.can_append_slots([0], num_lookahead_slots=5)


@pytest.mark.parametrize(
  "query",
  [
    lambda m: m.append_slots([0], [[1]], [1], num_lookahead_slots=-1),
    lambda m: m.can_append_slots([0], num_lookahead_slots=-1),
    lambda m: m.can_swap_in([0], num_lookahead_slots=-1),
  ],
)
def test_negative_lookahead_raises(query):
  with pytest.raises(ValueError, match="num_lookahead_slots"):
    query(make_manager())
