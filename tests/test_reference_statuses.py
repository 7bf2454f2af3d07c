"""The reference block manager's statuses, their precedence, atomic failure
and swaps, on tiny configurations worked out on paper (docs/semantics.md).
"""

import copy

import pytest

from paged_jax.config import AllocStatus, Status
from tests.reference_cases import make_manager, table

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
