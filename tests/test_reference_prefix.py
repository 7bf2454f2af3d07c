"""The reference block manager's prefix caching (cached pool, identity, hit
rate, computed flags) and its admission and host-side queries, on tiny
configurations worked out on paper (docs/semantics.md).
"""

import copy

import pytest

from paged_jax.config import AllocStatus, CacheConfig, Status
from tests.reference_cases import make_manager, next_gpu_take, table

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
