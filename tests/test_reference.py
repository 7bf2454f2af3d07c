"""Hand-checkable tests of the plain-Python reference block manager.

Each test pins one rule of docs/semantics.md on a tiny
configuration whose expected block numbers can be worked out on paper; the
comments show the working.
"""

import copy
import random

import hypothesis
import pytest
from hypothesis import strategies as st

from paged_jax.config import AllocStatus, CacheConfig, Status
from tests.reference.allocators import (
  CachedBlockAllocator,
  LRUEvictor,
  PhysicalTokenBlock,
  UncachedBlockAllocator,
)
from tests.reference.block_manager import ReferenceBlockSpaceManager


def make_manager(**overrides) -> ReferenceBlockSpaceManager:
  fields = dict(
    block_size=2,
    num_gpu_blocks=6,
    num_cpu_blocks=6,
    max_seqs=8,
    max_blocks_per_seq=4,
    watermark=0.0,
  )
  fields.update(overrides)
  return ReferenceBlockSpaceManager(CacheConfig(**fields))


def table(manager, seq_id: int) -> list[int]:
  """The table without the trailing -1 padding."""
  entries = manager.get_block_table(seq_id)
  while entries and entries[-1] == -1:
    entries.pop()
  return entries


def next_gpu_take(manager, seq_id: int = 7) -> int:
  """Allocates one block to ``seq_id`` and reports which block it got."""
  assert manager.allocate([seq_id], [0], 1) == Status.OK
  return table(manager, seq_id)[0]


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


# Statuses, their precedence, and atomic failure.


def assert_fails_cleanly(manager, call, expected: Status):
  """``call`` returns ``expected`` (and an empty plan) and changes nothing."""
  before = copy.deepcopy(manager._state)
  result = call(manager)
  status = result[0] if isinstance(result, tuple) else result
  assert status == expected
  if isinstance(result, tuple):
    assert result[1] == []
  assert manager._state == before


def occupied_manager(**overrides):
  """Slot 0 on the GPU (3 tokens, 2 blocks), slot 1 on the CPU (1 block)."""
  manager = make_manager(max_seqs=4, **overrides)
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK
  assert manager.allocate([1], [4], 1) == Status.OK
  assert manager.swap_out([1])[0] == Status.OK
  return manager


@pytest.mark.parametrize(
  "call, expected",
  [
    (lambda m: m.allocate([4], [1], 1), Status.INVALID_ARGUMENT),
    (lambda m: m.allocate([-2], [1], 1), Status.INVALID_ARGUMENT),
    (lambda m: m.allocate([2, 2], [1], 1), Status.INVALID_ARGUMENT),
    (lambda m: m.allocate([2], [1], -1), Status.INVALID_ARGUMENT),
    (lambda m: m.allocate([2], [1], 2), Status.INVALID_ARGUMENT),
    (lambda m: m.allocate([0, 4], [1], 1), Status.INVALID_ARGUMENT),
    (lambda m: m.allocate([2, 0], [1], 1), Status.ALREADY_ALLOCATED),
    (lambda m: m.allocate([1], [1], 1), Status.ALREADY_ALLOCATED),
    (lambda m: m.allocate([0], [1] * 9, 9), Status.ALREADY_ALLOCATED),
    (lambda m: m.allocate([2], [1] * 9, 9), Status.TABLE_FULL),
    (lambda m: m.allocate([2], [1] * 7, 7), Status.OUT_OF_BLOCKS),
  ],
)
def test_allocate_statuses(call, expected):
  assert_fails_cleanly(occupied_manager(num_gpu_blocks=3), call, expected)


def test_allocate_all_padding_is_a_no_op():
  manager = occupied_manager()
  assert_fails_cleanly(manager, lambda m: m.allocate([-1, -1], [1], 1), Status.OK)


def test_allocate_zero_tokens_occupies_the_slot():
  manager = make_manager()
  assert manager.allocate([0], [], 0) == Status.OK
  assert manager.device_of(0) == "gpu"
  assert table(manager, 0) == []
  assert manager.allocate([0], [], 0) == Status.ALREADY_ALLOCATED


@pytest.mark.parametrize(
  "call, expected",
  [
    (lambda m: m.append_slots([4], [[1]], [1]), Status.INVALID_ARGUMENT),
    (lambda m: m.append_slots([0, 0], [[1], [1]], [1, 1]), Status.INVALID_ARGUMENT),
    (lambda m: m.append_slots([0], [[1]], [-1]), Status.INVALID_ARGUMENT),
    (lambda m: m.append_slots([0], [[1]], [2]), Status.INVALID_ARGUMENT),
    (lambda m: m.append_slots([2, 7], [[1], [1]], [1, 1]), Status.INVALID_ARGUMENT),
    (lambda m: m.append_slots([2], [[1]], [1]), Status.NOT_ALLOCATED),
    (lambda m: m.append_slots([1, 2], [[1], [1]], [1, 1]), Status.NOT_ALLOCATED),
    (lambda m: m.append_slots([1], [[1]], [1]), Status.WRONG_DEVICE),
    (lambda m: m.append_slots([0, 1], [[1] * 6, [1]], [6, 1]), Status.WRONG_DEVICE),
    (lambda m: m.append_slots([0], [[1] * 6], [6]), Status.TABLE_FULL),
    (lambda m: m.append_slots([0], [[1] * 4], [4], num_lookahead_slots=2), Status.TABLE_FULL),
    (lambda m: m.append_slots([0], [[1] * 5], [5]), Status.OUT_OF_BLOCKS),
  ],
)
def test_append_slots_statuses(call, expected):
  assert_fails_cleanly(occupied_manager(num_gpu_blocks=3), call, expected)


def test_append_slots_ignores_padding_rows():
  manager = occupied_manager()
  status, _ = manager.append_slots([-1, 0], [[1, 1, 1], [9]], [-5, 1])
  assert status == Status.OK
  assert manager.get_num_tokens(0) == 4


def test_append_slots_rows_must_line_up():
  with pytest.raises(ValueError, match="num_new has 1 rows"):
    make_manager().append_slots([0, 1], [[1], [1]], [1])
  with pytest.raises(ValueError, match="new_token_ids has 1 rows"):
    make_manager().append_slots([0, 1], [[1]], [1, 1])


@pytest.mark.parametrize(
  "call, expected",
  [
    (lambda m: m.fork(0, 4), Status.INVALID_ARGUMENT),
    (lambda m: m.fork(-1, 2), Status.INVALID_ARGUMENT),
    (lambda m: m.fork(0, -1), Status.INVALID_ARGUMENT),
    (lambda m: m.fork(0, 0), Status.INVALID_ARGUMENT),
    (lambda m: m.fork(2, 0), Status.NOT_ALLOCATED),
    (lambda m: m.fork(2, 3), Status.NOT_ALLOCATED),
    (lambda m: m.fork(0, 1), Status.ALREADY_ALLOCATED),
    (lambda m: m.free([0, 4]), Status.INVALID_ARGUMENT),
    (lambda m: m.free([0, 0]), Status.INVALID_ARGUMENT),
    (lambda m: m.free([2, 5]), Status.INVALID_ARGUMENT),
    (lambda m: m.free([0, 2]), Status.NOT_ALLOCATED),
    (lambda m: m.swap_out([-3]), Status.INVALID_ARGUMENT),
    (lambda m: m.swap_out([0, 0]), Status.INVALID_ARGUMENT),
    (lambda m: m.swap_out([1, 2]), Status.NOT_ALLOCATED),
    (lambda m: m.swap_out([0, 1]), Status.WRONG_DEVICE),
    (lambda m: m.swap_out([0]), Status.SWAP_SPACE_EXHAUSTED),
    (lambda m: m.swap_in([9]), Status.INVALID_ARGUMENT),
    (lambda m: m.swap_in([2]), Status.NOT_ALLOCATED),
    (lambda m: m.swap_in([0, 1]), Status.WRONG_DEVICE),
  ],
)
def test_fork_free_and_swap_statuses(call, expected):
  assert_fails_cleanly(occupied_manager(num_cpu_blocks=2), call, expected)


def test_swap_in_out_of_blocks():
  manager = occupied_manager(num_gpu_blocks=3)  # slot 0 holds 2 of the 3
  assert manager.allocate([2], [5], 1) == Status.OK
  assert_fails_cleanly(manager, lambda m: m.swap_in([1]), Status.OUT_OF_BLOCKS)


def test_fork_and_free_work_on_the_cpu():
  manager = occupied_manager()  # slot 1 holds CPU block 5
  assert manager.fork(1, 2) == Status.OK
  assert manager.device_of(2) == "cpu"
  assert manager.ref_counts("cpu")[5] == 2
  assert manager.free([1, 2]) == Status.OK
  assert manager.num_free_cpu_blocks() == 6


def test_failed_call_restores_revived_blocks_and_counters():
  manager = make_manager(num_gpu_blocks=3, enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3, 4], 4) == Status.OK  # blocks 0, 1
  assert manager.free([0]) == Status.OK  # both to the evictor
  # Hits revive blocks 0 and 1 (pinned first); the 2 misses need 2 blocks
  # but only block 2 is left.
  prompt = [1, 2, 3, 4, 0, 0, 0, 0]
  assert_fails_cleanly(manager, lambda m: m.allocate([1], prompt, 8), Status.OUT_OF_BLOCKS)
  assert manager.prefix_cache_hit_rate() == 0.0


def test_failed_swap_in_restores_lookups():
  manager = make_manager(num_gpu_blocks=2, num_cpu_blocks=2, enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2], 2) == Status.OK  # GPU block 0
  assert manager.swap_out([0])[0] == Status.OK
  assert manager.allocate([1], [5, 6, 7], 3) == Status.OK  # GPU 1 and 0
  assert_fails_cleanly(manager, lambda m: m.swap_in([0]), Status.OUT_OF_BLOCKS)


# Swaps.


def test_swap_moves_shared_blocks_once():
  manager = make_manager(num_gpu_blocks=4, num_cpu_blocks=5)
  assert manager.allocate([0, 1], [1, 2, 3], 3) == Status.OK  # [3, 2] twice
  assert manager.can_swap_out([0, 1])
  status, plan = manager.swap_out([0, 1])
  assert (status, plan) == (Status.OK, [(3, 4), (2, 3)])
  assert table(manager, 0) == table(manager, 1) == [4, 3]
  assert manager.ref_counts("cpu") == [0, 0, 0, 2, 2]
  assert manager.ref_counts("gpu") == [0, 0, 0, 0]
  assert manager.device_of(0) == manager.device_of(1) == "cpu"
  assert manager.get_slot_mapping([0], [1], 1) == [[-1]]
  # GPU releases ended with 3 then 2 on the stack, so 2 is taken first.
  assert manager.can_swap_in([0, 1]) == AllocStatus.OK
  status, plan = manager.swap_in([1, 0])
  assert (status, plan) == (Status.OK, [(4, 2), (3, 3)])
  assert table(manager, 0) == table(manager, 1) == [2, 3]
  assert manager.ref_counts("gpu") == [0, 0, 2, 2]
  assert manager.num_free_cpu_blocks() == 5


def test_swapping_out_one_holder_keeps_the_others_blocks():
  manager = make_manager(num_gpu_blocks=4, num_cpu_blocks=4)
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK  # [3, 2]
  assert manager.fork(0, 1) == Status.OK
  assert manager.swap_out([1]) == (Status.OK, [(3, 3), (2, 2)])
  assert manager.ref_counts("gpu") == [0, 0, 1, 1]
  assert manager.ref_counts("cpu") == [0, 0, 1, 1]


def test_swap_with_prefix_caching_shares_cached_content():
  manager = make_manager(num_gpu_blocks=4, num_cpu_blocks=4, enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK  # [0, 1]
  assert manager.swap_out([0]) == (Status.OK, [(0, 0), (1, 1)])
  # GPU block 0 kept its content in the evictor; swap_in finds it there (one
  # lookup, one hit) and only copies the partial block.
  assert manager.prefix_cache_hit_rate() == 0.0
  assert manager.swap_in([0]) == (Status.OK, [(1, 2)])
  assert table(manager, 0) == [0, 2]
  assert manager.prefix_cache_hit_rate() == 0.5
  # swap_out finds the content in the CPU pool but counts no lookup.
  assert manager.swap_out([0]) == (Status.OK, [(2, 2)])
  assert table(manager, 0) == [0, 2]
  assert manager.prefix_cache_hit_rate() == 0.5


def test_can_swap_counts_distinct_blocks():
  manager = make_manager(num_gpu_blocks=6, num_cpu_blocks=2, watermark=0.2)
  assert manager.allocate([0, 1], [1, 2, 3], 3) == Status.OK  # 2 shared
  assert manager.allocate([2], [4, 5, 6], 3) == Status.OK
  assert manager.can_swap_out([0, 1])
  assert not manager.can_swap_out([0, 1, 2])  # 4 blocks, 2 CPU blocks
  assert manager.swap_out([0, 1])[0] == Status.OK
  # 2 blocks + 2 seqs * 1 = 4 required; 4 free leave less than 1 reserved.
  assert manager.can_swap_in([0, 1]) == AllocStatus.LATER
  # 2 + 2 * (1 + ceil(1 / 2)) = 6 required: all 6 GPU blocks would do, so
  # not NEVER (unlike can_allocate, NEVER ignores the watermark).
  assert manager.can_swap_in([0, 1], num_lookahead_slots=1) == (AllocStatus.LATER)
  # 2 + 2 * (1 + ceil(3 / 2)) = 8 > 6 GPU blocks.
  assert manager.can_swap_in([0, 1], num_lookahead_slots=3) == (AllocStatus.NEVER)
  assert manager.free([2]) == Status.OK
  assert manager.can_swap_in([0, -1, 1]) == AllocStatus.OK


def test_can_allocate():
  manager = make_manager(num_gpu_blocks=5, watermark=0.2)  # 1 block reserved
  assert manager.can_allocate(-1) == AllocStatus.NEVER
  assert manager.can_allocate(9) == AllocStatus.NEVER  # table of 4 entries
  assert manager.can_allocate(8) == AllocStatus.OK
  assert manager.allocate([0], [1, 2], 2) == Status.OK
  assert manager.can_allocate(8) == AllocStatus.LATER
  roomy = make_manager(num_gpu_blocks=5, max_blocks_per_seq=8, watermark=0.2)
  assert roomy.can_allocate(9) == AllocStatus.NEVER  # 5 blocks: none reserved
  windowed = make_manager(num_gpu_blocks=1, sliding_window=2)
  assert windowed.can_allocate(8) == AllocStatus.OK  # holds only block 3


# Cached pool through the manager.


def test_cached_pool_take_order_through_the_manager():
  manager = make_manager(num_gpu_blocks=4, enable_prefix_caching=True)
  assert manager.allocate([0], [1], 1) == Status.OK  # block 0, no content
  assert manager.allocate([1], [2], 1) == Status.OK  # block 1, no content
  assert manager.allocate([2], [3, 4], 2) == Status.OK  # block 2, content
  assert manager.free([0, 1, 2]) == Status.OK
  # Never used (3); released without content, last first (1, 0); evict (2).
  taken = [next_gpu_take(manager, seq_id) for seq_id in (3, 4, 5, 6)]
  assert taken == [3, 1, 0, 2]


@pytest.mark.parametrize(
  "accesses, expected",
  [
    ([], [1, 0, 2]),  # longest prefix first, then the earliest released
    ([(0, 5), (1, 3)], [2, 1, 0]),  # least recently accessed first
    ([(0, 5), (1, 3), (0, 1)], [2, 1, 0]),  # accesses never go backwards
  ],
)
def test_lru_eviction_order(accesses, expected):
  manager = make_manager(num_gpu_blocks=3, enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3, 4], 4) == Status.OK  # 0 and 1
  assert manager.allocate([1], [5, 6], 2) == Status.OK  # 2
  for seq_id, now in accesses:
    manager.access_all_blocks_in_seq(seq_id, now)
  # Release order: 1, 0 (last entry first), then 2.
  assert manager.free([0, 1]) == Status.OK
  evicted = []
  for seq_id, content in zip((2, 3, 4), ([7, 8], [9, 10], [11, 12])):
    assert manager.allocate([seq_id], content, 2) == Status.OK
    evicted.append(table(manager, seq_id)[0])
  assert evicted == expected


def test_access_ignores_empty_slots_and_bad_ids():
  manager = make_manager(enable_prefix_caching=True)
  before = copy.deepcopy(manager._state)
  manager.access_all_blocks_in_seq(3, 5)
  manager.access_all_blocks_in_seq(99, 5)
  assert manager._state == before


# Prefix identity and hit rate.


def test_only_identical_salt_and_prefix_share():
  manager = make_manager(num_gpu_blocks=12, enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3, 4], 4) == Status.OK
  assert table(manager, 0) == [0, 1]
  # Same second block, different prefix: nothing shared.
  assert manager.allocate([1], [9, 9, 3, 4], 4) == Status.OK
  assert table(manager, 1) == [2, 3]
  # Same tokens, different salt: nothing shared.
  assert manager.allocate([2], [1, 2, 3, 4], 4, salt=1) == Status.OK
  assert table(manager, 2) == [4, 5]
  # Same salt and prefix: full blocks shared, the partial one never.
  assert manager.allocate([3], [1, 2, 3, 4, 5], 5) == Status.OK
  assert table(manager, 3) == [0, 1, 6]
  assert manager.allocate([4], [1, 2, 3, 4, 5], 5) == Status.OK
  assert table(manager, 4) == [0, 1, 7]
  # Hits: 2 + 2 of 10 lookups.
  assert manager.prefix_cache_hit_rate() == 0.4


def test_forks_inherit_the_salt():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1], 1, salt=3) == Status.OK
  assert manager.fork(0, 1) == Status.OK
  assert manager.append_slots([1], [[2]], [1])[0] == Status.OK  # copy, 1
  assert manager.allocate([2], [1, 2], 2, salt=3) == Status.OK
  assert table(manager, 2) == table(manager, 1) == [1]
  assert manager.allocate([3], [1, 2], 2) == Status.OK
  assert table(manager, 3) == [2]


def test_group_allocation_counts_one_lookup_per_block_and_refs_per_seq():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0, 1], [1, 2, 3, 4, 5], 5) == Status.OK
  assert manager.prefix_cache_hit_rate() == 0.0  # 2 lookups, 0 hits
  assert manager.ref_counts("gpu")[:3] == [2, 2, 2]
  assert manager.allocate([2, 3], [1, 2, 3], 3) == Status.OK
  assert manager.ref_counts("gpu")[:4] == [4, 2, 2, 2]
  assert manager.prefix_cache_hit_rate() == pytest.approx(1 / 3)


def test_second_row_shares_the_identity_the_first_row_took():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1], 1) == Status.OK  # block 0
  assert manager.allocate([1], [1], 1) == Status.OK  # block 1
  # Row 0 fills block 0 in place; row 1 needs the same identity, shares
  # block 0 and releases block 1: 2 lookups, 1 hit, nothing copied.
  assert manager.append_slots([0, 1], [[2], [2]], [1, 1]) == (Status.OK, [])
  assert table(manager, 0) == table(manager, 1) == [0]
  assert manager.ref_counts("gpu")[:2] == [2, 0]
  assert manager.prefix_cache_hit_rate() == 0.5
  assert manager.num_free_gpu_blocks() == 5


def test_forked_rows_filling_one_block_alike_copy_nothing():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1], 1) == Status.OK  # block 0
  assert manager.fork(0, 1) == Status.OK
  # Row 1 leaves block 0 by a hit on row 0's result, so row 0 is the last
  # writer and writes in place; row 1 shares block 0 again.
  assert manager.append_slots([0, 1], [[2], [2]], [1, 1]) == (Status.OK, [])
  assert table(manager, 0) == table(manager, 1) == [0]
  assert manager.ref_counts("gpu")[0] == 2
  assert manager.prefix_cache_hit_rate() == 0.5


def test_rows_share_the_block_an_earlier_row_copied_or_took():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1], 1) == Status.OK  # block 0
  assert manager.fork(0, 1) == Status.OK
  assert manager.allocate([2], [1], 1) == Status.OK  # block 1
  assert manager.allocate([3], [], 0) == Status.OK
  # Row 0 copies shared block 0 into block 2 and fills it; row 2 shares
  # block 2 and drops block 1; row 3 shares it too, taking nothing.
  status, plan = manager.append_slots([0, 2, 3], [[2], [2], [1, 2]], [1, 1, 2])
  assert (status, plan) == (Status.OK, [(0, 2)])
  assert [table(manager, s) for s in range(4)] == [[2], [0], [2], [2]]
  assert manager.ref_counts("gpu")[:4] == [1, 0, 3, 0]
  assert manager.prefix_cache_hit_rate() == pytest.approx(2 / 3)


def test_a_hit_replaces_the_partial_block():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2], 2) == Status.OK  # block 0, cached
  assert manager.allocate([1], [1], 1) == Status.OK  # block 1, partial
  assert manager.append_slots([1], [[2, 3]], [2]) == (Status.OK, [])
  # Entry 0 becomes block 0 (hit), block 1 is released, entry 1 takes 2.
  assert table(manager, 1) == [0, 2]
  assert manager.ref_counts("gpu")[:3] == [2, 0, 1]
  assert manager.prefix_cache_hit_rate() == pytest.approx(1 / 2)


def test_hit_rate_without_caching_and_before_lookups():
  assert make_manager().prefix_cache_hit_rate() == -1.0
  assert make_manager(enable_prefix_caching=True).prefix_cache_hit_rate() == 0.0


# Computed flags.


def test_revived_block_keeps_computed_and_evicted_block_loses_it():
  manager = make_manager(num_gpu_blocks=2, enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK  # [0, 1]
  manager.mark_blocks_as_computed([0], 3)
  assert manager.get_common_computed_block_ids([0]) == [0]
  assert manager.free([0]) == Status.OK
  assert manager.allocate([1], [1, 2, 3], 3) == Status.OK  # revives 0
  assert manager.get_common_computed_block_ids([1]) == [0]
  assert manager.free([1]) == Status.OK
  assert manager.allocate([2], [7, 8, 9], 3) == Status.OK  # evicts 0
  assert manager.free([2]) == Status.OK
  assert manager.allocate([3], [1, 2, 3], 3) == Status.OK
  assert manager.get_common_computed_block_ids([3]) == []


def test_copy_destination_is_not_computed():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK  # [0, 1]
  assert manager.fork(0, 1) == Status.OK
  manager.mark_blocks_as_computed([0, 1], [3, 3])
  assert manager.append_slots([1], [[4, 5]], [2]) == (Status.OK, [(1, 2)])
  assert manager.get_common_computed_block_ids([1]) == [0]
  manager.mark_blocks_as_computed([1], 5)
  assert manager.get_common_computed_block_ids([1]) == [0, 2]
  assert manager.get_common_computed_block_ids([0, 1]) == [0]


def test_computed_marks_skip_swapped_out_sequences():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK  # GPU [0, 1]
  assert manager.allocate([1], [5, 6, 7], 3) == Status.OK  # GPU [2, 3]
  assert manager.swap_out([1]) == (Status.OK, [(2, 0), (3, 1)])
  manager.mark_blocks_as_computed([-1, 1], 3)
  assert manager.get_common_computed_block_ids([0]) == []
  assert manager.get_common_computed_block_ids([0, 1]) == []
  manager.mark_blocks_as_computed([0], 3)
  assert manager.get_common_computed_block_ids([0, -1]) == [0]
  # Slot 1's CPU block 0 is not GPU block 0.
  assert manager.get_common_computed_block_ids([1]) == []


def test_computed_marks_stop_at_the_last_token():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK  # [0, 1]
  assert manager.append_slots([0], [[]], [0], num_lookahead_slots=3) == (Status.OK, [])
  assert table(manager, 0) == [0, 1, 2]
  # 6 computed tokens are capped at the 3 the sequence holds: block 0 only.
  manager.mark_blocks_as_computed([0], 6)
  assert manager.append_slots([0], [[4, 5, 6]], [3]) == (Status.OK, [])
  assert manager.get_common_computed_block_ids([0]) == [0]


def test_computed_ids_exclude_the_last_token_block():
  manager = make_manager(enable_prefix_caching=True)
  assert manager.allocate([0], [1, 2, 3, 4], 4) == Status.OK  # [0, 1]
  manager.mark_blocks_as_computed([0], 4)
  assert manager.get_common_computed_block_ids([0]) == [0]
  assert manager.allocate([1], [], 0) == Status.OK
  assert manager.get_common_computed_block_ids([0, 1]) == []
  assert manager.get_common_computed_block_ids([-1]) == []


def test_computed_flags_need_caching():
  manager = make_manager()
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK
  manager.mark_blocks_as_computed([0], 3)
  assert manager.get_common_computed_block_ids([0]) == []


# Admission queries about a group that their operation refuses.


def test_can_queries_answer_no_for_a_group_their_op_refuses(manager_factory):
  """Bad or repeated ids, an empty slot or the wrong device: no, whatever the space."""
  manager = manager_factory(
    CacheConfig(
      block_size=2,
      num_gpu_blocks=8,
      num_cpu_blocks=8,
      max_seqs=4,
      max_blocks_per_seq=4,
      watermark=0.0,
    )
  )
  assert manager.allocate([0], [1, 2, 3], 3) == Status.OK  # seq 0 on the GPU
  assert manager.allocate([1], [4, 5], 2) == Status.OK
  assert manager.swap_out([1])[0] == Status.OK  # seq 1 on the CPU; 2, 3 empty
  refused = {
    "gpu": [[0, 0], [0, 4], [-2], [2], [1], [0, 1]],
    "cpu": [[1, 1], [1, 4], [-2], [3], [0], [1, 0]],
  }
  for ids in refused["gpu"]:
    assert manager.can_append_slots(ids) is False, ids
    assert manager.can_swap_out(ids) is False, ids
  for ids in refused["cpu"]:
    assert manager.can_swap_in(ids) == AllocStatus.NEVER, ids
  assert manager.can_allocate(-1) == AllocStatus.NEVER
  # The same groups without the refused id are admitted.
  assert manager.can_append_slots([0, -1]) and manager.can_swap_out([0])
  assert manager.can_swap_in([-1, 1]) == AllocStatus.OK
  assert manager.can_allocate(8) == AllocStatus.OK


# Host-side query errors.


@pytest.mark.parametrize(
  "query, message",
  [
    (lambda m: m.get_block_table(8), "seq_id"),
    (lambda m: m.get_num_tokens(-1), "seq_id"),
    (lambda m: m.device_of(8), "seq_id"),
    (lambda m: m.ref_counts("tpu"), "device"),
    (lambda m: m.get_common_computed_block_ids([8]), "seq_ids"),
    (lambda m: m.mark_blocks_as_computed([8], 1), "seq_ids"),
    (lambda m: m.mark_blocks_as_computed([0], [-1]), "num_computed_tokens"),
    (lambda m: m.mark_blocks_as_computed([0], [1, 2]), "num_computed_tokens"),
    (lambda m: m.get_slot_mapping([0], [1], -1), "width"),
    (lambda m: m.get_slot_mapping([0], [-1], 1), "num_new"),
    (lambda m: m.get_slot_mapping([0], [1, 1], 1), "num_new"),
    (lambda m: m.get_slot_mapping([9], [1], 1), "seq_ids"),
  ],
)
def test_bad_query_arguments_raise(query, message):
  with pytest.raises(ValueError, match=message):
    query(make_manager())


def test_slot_mapping():
  manager = make_manager()
  assert manager.allocate([0, 1], [1, 2, 3], 3) == Status.OK  # [5, 4]
  # Last 2 positions (1 and 2), then the last 5 capped at 3, then width 1.
  assert manager.get_slot_mapping([0, -1, 1, 3], [2, 1, 5, 1], 3) == [
    [11, 8, -1],
    [-1, -1, -1],
    [10, 11, 8],
    [-1, -1, -1],
  ]
  assert manager.get_slot_mapping([0], [5], 1) == [[10]]


# Random operation sequences: invariants, atomicity and equivalences.


def check_invariants(manager):
  """The rules of docs/semantics.md on live entries and pools."""
  state, cfg = manager._state, manager.cfg
  for device, pool in state.pools.items():
    holders = [0] * pool.num_blocks
    for seq in state.seqs:
      if seq is not None and seq.device == device:
        live = [b for b in seq.table if b != -1]
        assert len(set(live)) == len(live), "a table holds a block twice"
        for b in live:
          holders[b] += 1
    assert [block.ref_count for block in pool.blocks] == holders
    assert pool.num_free() == holders.count(0)
    if isinstance(pool, CachedBlockAllocator):
      for identity, b in pool.cached.items():
        assert pool.blocks[b].identity == identity
      for b in pool.evictor.blocks:
        assert pool.blocks[b].ref_count == 0
        assert pool.blocks[b].identity is not None
      for b in pool.released:
        assert pool.blocks[b].ref_count == 0
        assert pool.blocks[b].identity is None
  for seq in state.seqs:
    if seq is None:
      continue
    num_tokens = len(seq.tokens)
    assert len(seq.table) >= cfg.blocks_for(num_tokens)
    for j, b in enumerate(seq.table):
      assert (b == -1) == manager._is_dead(j, num_tokens)


CONFIGS = [
  dict(),
  dict(sliding_window=3),
  dict(enable_prefix_caching=True),
  dict(enable_prefix_caching=True, num_gpu_blocks=4),
]


def random_operation(rng, manager) -> tuple:
  """A mostly valid operation for ``manager``'s state; some ids are bad."""
  slots = range(manager.cfg.max_seqs)
  by_device = {
    device: [s for s in slots if manager.device_of(s) == device] for device in ("gpu", "cpu", None)
  }

  def some(ids, most):
    chosen = rng.sample(ids, min(len(ids), rng.randint(1, most)))
    if rng.random() < 0.1:
      chosen.append(rng.randint(-2, manager.cfg.max_seqs))
    return chosen

  def tokens(most):
    return [rng.randint(0, 1) for _ in range(rng.randint(0, most))]

  name = rng.choice(
    ["allocate", "append", "append", "fork", "free", "swap_out", "swap_in", "access"]
  )
  if name == "allocate":
    return name, some(by_device[None], 2), tokens(6), rng.randint(0, 1)
  if name == "append":
    rows = [(s, tokens(3)) for s in some(by_device["gpu"], 3)]
    return name, rows, rng.randint(0, 2)
  if name == "fork":
    return (
      name,
      rng.choice(by_device["gpu"] + by_device["cpu"] or [0]),
      rng.choice(by_device[None] or [0]),
    )
  if name == "free":
    return name, some(by_device["gpu"] + by_device["cpu"], 2)
  if name == "swap_out":
    return name, some(by_device["gpu"], 2)
  if name == "swap_in":
    return name, some(by_device["cpu"], 2)
  return name, rng.randint(-1, manager.cfg.max_seqs), rng.randint(0, 5)


def apply(manager, operation):
  """Runs one operation; returns its status."""
  name, *args = operation
  if name == "allocate":
    seq_ids, tokens, salt = args
    return manager.allocate(seq_ids, tokens, len(tokens), salt=salt)
  if name == "append":
    rows, lookahead = args
    return manager.append_slots(
      [s for s, _ in rows], [t for _, t in rows], [len(t) for _, t in rows], lookahead
    )[0]
  if name == "fork":
    return manager.fork(*args)
  if name == "access":
    manager.access_all_blocks_in_seq(*args)
    return Status.OK
  if name == "free":
    return manager.free(*args)
  return getattr(manager, name)(*args)[0]  # swap_out, swap_in


@pytest.mark.parametrize("config", CONFIGS)
@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_random_programs_keep_invariants_and_fail_atomically(config, seed):
  rng = random.Random(seed)
  manager = make_manager(max_seqs=4, max_blocks_per_seq=4, num_cpu_blocks=4, **config)
  for _ in range(24):
    before = copy.deepcopy(manager._state)
    status = apply(manager, random_operation(rng, manager))
    if status != Status.OK:
      assert manager._state == before
    check_invariants(manager)


@pytest.mark.parametrize("caching", [False, True])
@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_allocate_equals_empty_allocate_then_append(caching, seed):
  rng = random.Random(seed)
  one_step = make_manager(max_seqs=4, enable_prefix_caching=caching)
  for _ in range(rng.randint(0, 8)):
    apply(one_step, random_operation(rng, one_step))
  seq_id = next((s for s in range(4) if one_step.device_of(s) is None), None)
  hypothesis.assume(seq_id is not None)
  tokens = [rng.randint(0, 1) for _ in range(rng.randint(0, 8))]
  two_steps = copy.deepcopy(one_step)
  status = one_step.allocate([seq_id], tokens, len(tokens))
  assert two_steps.allocate([seq_id], [], 0) == Status.OK
  assert two_steps.append_slots([seq_id], [tokens], [len(tokens)])[0] == status
  if status == Status.OK:
    assert two_steps._state == one_step._state


@pytest.mark.parametrize("config", CONFIGS[:2])
@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_append_that_frees_nothing_equals_one_call_per_row(config, seed):
  rng = random.Random(seed)
  batched = make_manager(max_seqs=4, **config)
  for _ in range(rng.randint(0, 10)):
    apply(batched, random_operation(rng, batched))
  _, rows, lookahead = random_operation_of(rng, batched, "append")
  sequential = copy.deepcopy(batched)
  held_before = [n > 0 for n in batched.ref_counts("gpu")]
  status, plan = batched.append_slots(
    [s for s, _ in rows], [t for _, t in rows], [len(t) for _, t in rows], lookahead
  )
  held_after = [n > 0 for n in batched.ref_counts("gpu")]
  hypothesis.assume(status == Status.OK)
  hypothesis.assume(not any(b and not a for b, a in zip(held_before, held_after)))
  sequential_plan = []
  for seq_id, new in rows:
    row_status, row_plan = sequential.append_slots([seq_id], [new], [len(new)], lookahead)
    assert row_status == Status.OK
    sequential_plan += row_plan
  assert plan == sequential_plan
  assert sequential._state == batched._state


def random_operation_of(rng, manager, name: str) -> tuple:
  """A random operation called ``name``."""
  while True:
    operation = random_operation(rng, manager)
    if operation[0] == name:
      return operation
