"""Prefix caching under a sliding window in the plain-Python reference
(docs/semantics.md, "Prefix caching under a window"): hits across dead
entries, registration only under a parent in the table, the cascade on
eviction, swaps' left-to-right lookups and the hybrid's common hit.

The reference states them with its `sliding_window` override;
tests/test_window_prefix_jax.py checks the jitted managers against it.
"""

import copy
import random

import hypothesis
import pytest
from hypothesis import strategies as st

from paged_jax.config import CacheConfig, Status
from tests.reference.allocators import CachedBlockAllocator
from tests.reference.block_manager import ReferenceBlockSpaceManager
from tests.reference.hybrid import ReferenceHybridManager
from tests.reference_cases import table
from tests.test_reference_random import (
  apply,
  check_allocate_equals_empty_allocate_then_append,
  check_invariants,
  random_operation,
)

PROMPT = list(range(10, 20))  # five blocks of two tokens


def cached_config(**overrides) -> CacheConfig:
  fields = dict(
    block_size=2,
    num_gpu_blocks=8,
    num_cpu_blocks=8,
    max_seqs=4,
    max_blocks_per_seq=8,
    watermark=0.0,
    enable_prefix_caching=True,
  )
  fields.update(overrides)
  return CacheConfig(**fields)


def windowed(window: int = 6, **overrides) -> ReferenceBlockSpaceManager:
  return ReferenceBlockSpaceManager(cached_config(**overrides), sliding_window=window)


def append_in_chunks(manager, seq_id, tokens, chunk=3):
  """The engine's way on a windowed cache: allocate empty, append chunk by chunk."""
  assert manager.allocate([seq_id], [], 0) == Status.OK
  for start in range(0, len(tokens), chunk):
    piece = tokens[start : start + chunk]
    assert manager.append_slots([seq_id], [piece], [len(piece)])[0] == Status.OK


def identities(manager, device="gpu"):
  return {b: block.identity for b, block in enumerate(manager._state.pools[device].blocks)}


def test_a_prompt_longer_than_the_window_hits_every_block_and_holds_the_window():
  manager = windowed()
  append_in_chunks(manager, 0, PROMPT)
  assert table(manager, 0) == [-1, -1, 2, 3, 4]
  # Every full block was registered: each one's parent was in the table.
  assert [identities(manager)[b][1] for b in range(5)] == [
    tuple(PROMPT[: 2 * (j + 1)]) for j in range(5)
  ]
  assert manager.allocate_counting_hits([1], PROMPT, 10) == (Status.OK, 5)
  # The dead blocks 0 and 1 were passed through, not held.
  assert table(manager, 1) == [-1, -1, 2, 3, 4]
  assert manager.ref_counts("gpu")[:5] == [0, 0, 2, 2, 2]
  append_in_chunks(manager, 2, PROMPT)
  assert table(manager, 2) == [-1, -1, 2, 3, 4]
  assert manager.prefix_cache_hit_rate() == 10 / 15


def test_no_block_is_registered_under_a_dead_entry():
  manager = windowed()
  # One allocate of the whole prompt: blocks 0 and 1 are dead at once, so the
  # live blocks have no parent in the table and stay without content.
  assert manager.allocate([0], PROMPT, 10) == Status.OK
  assert table(manager, 0) == [-1, -1, 0, 1, 2]
  assert set(identities(manager).values()) == {None}
  # A window that kills the parent in the same append breaks the chain there.
  manager = windowed(window=4)
  append_in_chunks(manager, 1, PROMPT)
  assert [identity is not None for identity in identities(manager).values()][:3] == [
    True,
    False,
    False,
  ]


def test_an_append_under_a_block_without_content_looks_nothing_up():
  manager = windowed(window=4)
  assert manager.allocate([0], PROMPT[:7], 7) == Status.OK  # block 0 dead; 1, 2 without content
  lookups = manager._state.lookups
  assert manager.append_slots([0], [PROMPT[7:8]], [1])[0] == Status.OK  # fills block 3
  assert manager._state.lookups == lookups
  assert identities(manager)[table(manager, 0)[3]] is None
  fresh = windowed(window=4)
  assert fresh.allocate([0], [], 0) == Status.OK
  assert fresh.append_slots([0], [PROMPT[:2]], [2])[0] == Status.OK  # block 0: looked up
  assert fresh._state.lookups == 1


@pytest.fixture
def evictor_with_a_stale_parent():
  """Seq 0's prompt in chunks; its dead blocks 0, 1 accessed before its live ones."""
  manager = windowed(num_gpu_blocks=6)
  assert manager.allocate([0], [], 0) == Status.OK
  for now, start in enumerate(range(0, 10, 3)):
    piece = PROMPT[start : start + 3]
    assert manager.append_slots([0], [piece], [len(piece)])[0] == Status.OK
    manager.access_all_blocks_in_seq(0, now)
  assert manager.free([0]) == Status.OK  # evictor: 0 (last accessed at 1), 1 (at 2), 2, 3, 4 (at 3)
  return manager


def test_evicting_a_parent_takes_its_extensions_and_orphans_go_to_the_free_stack(
  evictor_with_a_stale_parent,
):
  manager = evictor_with_a_stale_parent
  # Takes: never-used 5, then evicts 0, then 1 (already an orphan of 0).
  assert manager.allocate([1], [90, 91, 92, 93, 94, 95], 6) == Status.OK
  assert table(manager, 1) == [5, 0, 1]
  # Blocks 2, 3, 4 extended block 0's prefix: they left the evictor for the
  # free stack in increasing order, so 4 is taken next.
  assert all(identities(manager)[b] is None for b in (2, 3, 4))
  assert manager._state.pools["gpu"].released == [2, 3, 4]
  assert manager.allocate([2], [7], 1) == Status.OK
  assert table(manager, 2) == [4]
  check_invariants(manager)


def test_an_orphan_that_the_same_call_evicts_is_taken_not_pushed(evictor_with_a_stale_parent):
  manager = evictor_with_a_stale_parent
  assert manager.allocate([1], list(range(90, 97)), 7) == Status.OK
  assert table(manager, 1) == [5, 0, 1, 4]  # 4: the next victim as the call began
  assert manager._state.pools["gpu"].released == [2, 3]


def test_a_held_block_keeps_its_page_but_loses_its_identity():
  manager = windowed(num_gpu_blocks=6)
  append_in_chunks(manager, 0, PROMPT)  # blocks 0, 1 in the evictor; 2, 3, 4 held
  assert manager.allocate([1], [90, 91, 92, 93], 4) == Status.OK  # takes 5, evicts 1
  assert table(manager, 0) == [-1, -1, 2, 3, 4]
  assert all(identities(manager)[b] is None for b in (2, 3, 4))
  assert manager.free([0]) == Status.OK  # without content: to the free stack
  assert manager._state.pools["gpu"].released == [4, 3, 2]
  assert len(manager._state.pools["gpu"].evictor) == 1  # block 0, still cached


def test_swap_in_looks_up_left_to_right_and_stops_at_the_first_miss():
  manager = windowed(window=8)
  append_in_chunks(manager, 0, PROMPT[:8])  # blocks 0 .. 3 held, all cached
  assert manager.fork(0, 1) == Status.OK
  assert manager.swap_out([0, 1])[0] == Status.OK  # the GPU copies stay cached
  append_in_chunks(manager, 2, [99, 98])  # takes never-used 4
  lookups, hits = manager._state.lookups, manager._state.hits
  status, plan = manager.swap_in([0, 1])
  assert status == Status.OK and plan == []
  # One lookup per distinct block, left to right from block 0: all hit.
  assert (manager._state.lookups - lookups, manager._state.hits - hits) == (4, 4)
  assert table(manager, 0) == table(manager, 1) == [0, 1, 2, 3]


def test_swap_in_counts_a_lookup_for_every_block_with_content():
  """Blocks past the first miss are not looked up, but each counts one lookup
  (docs/semantics.md, "Hit counting"), as the jitted manager counts them."""
  manager = ReferenceBlockSpaceManager(cached_config(num_gpu_blocks=6, max_blocks_per_seq=4))
  assert manager.allocate([0], [1, 2, 3, 4, 5, 6], 6) == Status.OK  # blocks 0, 1, 2
  assert manager.swap_out([0])[0] == Status.OK
  assert manager.allocate([1], [9] * 6, 6) == Status.OK  # never-used 3, 4, 5
  assert manager.allocate([2], [8] * 4, 4) == Status.OK  # evicts 2, then 1
  assert manager.free([1]) == Status.OK
  lookups, hits = manager._state.lookups, manager._state.hits
  assert manager.swap_in([0]) == (Status.OK, [(1, 5), (2, 4)])  # block 0 hits, 1 misses
  assert (manager._state.lookups - lookups, manager._state.hits - hits) == (3, 1)


def test_a_swap_registers_only_under_a_parent_with_content():
  manager = windowed(window=4)
  append_in_chunks(manager, 0, PROMPT[:7], chunk=2)  # blocks 1, 2 with content, 3 partial
  assert table(manager, 0) == [-1, 1, 2, 3]
  assert identities(manager)[1] is not None
  assert manager.swap_out([0])[0] == Status.OK
  cpu = identities(manager, "cpu")
  # The CPU copy of block 1 has a dead entry before it: no identity, and so
  # none for the copy of block 2 after it.
  assert set(cpu.values()) == {None}


def test_hybrid_allocate_takes_only_the_common_hit():
  cache = cached_config()
  hybrid = ReferenceHybridManager(cache, [None, 4])
  assert hybrid.allocate_counting_hits([0], PROMPT, 10)[0] == Status.OK
  assert hybrid.free([0])[0] == Status.OK
  # The global type has all five blocks cached, the sliding type none (its
  # one-shot allocate registered nothing): the common hit is 0, and the
  # global type takes fresh blocks without registering them.
  assert hybrid.allocate_counting_hits([1], PROMPT, 10) == (Status.OK, -1, [0, 0])
  global_type = hybrid.types[0]
  assert table(global_type, 1) == [5, 6, 7, 4, 3]
  assert all(identities(global_type)[b] is None for b in table(global_type, 1))


def test_hybrid_prompts_in_chunks_hit_in_every_type():
  hybrid = ReferenceHybridManager(cached_config(), [None, 6])
  for seq_id in (0, 1):
    assert hybrid.allocate_counting_hits([seq_id], [], 0)[0] == Status.OK
    for start in range(0, 10, 3):
      piece = PROMPT[start : start + 3]
      assert hybrid.append_slots([seq_id], [piece], [len(piece)])[0] == Status.OK
  assert hybrid.allocate_counting_hits([2], PROMPT, 10) == (Status.OK, -1, [5, 5])
  assert [table(manager, 2) for manager in hybrid.types] == [[0, 1, 2, 3, 4], [-1, -1, 2, 3, 4]]


def check_cached_chains(manager):
  """No dangling parents: every cached identity's parent prefix is cached too."""
  block_size = manager.cfg.block_size
  for pool in manager._state.pools.values():
    assert isinstance(pool, CachedBlockAllocator)
    assert not pool.orphans
    for salt, prefix in pool.cached:
      if len(prefix) > block_size:
        assert (salt, prefix[:-block_size]) in pool.cached, "a cached block outlived its parent"


@pytest.mark.parametrize("window", [3, 5])
@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_random_programs_keep_chains_whole_and_fail_atomically(window, seed):
  rng = random.Random(seed)
  manager = ReferenceBlockSpaceManager(
    cached_config(num_gpu_blocks=5, num_cpu_blocks=4, max_blocks_per_seq=4),
    sliding_window=window,
  )
  for _ in range(24):
    before = copy.deepcopy(manager._state)
    status = apply(manager, random_operation(rng, manager))
    if status != Status.OK:
      assert manager._state == before
    check_invariants(manager)
    check_cached_chains(manager)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_without_a_window_the_new_rules_change_nothing(seed):
  """Today's manager (no window) never cascades: its chains stay whole as they were."""
  rng = random.Random(seed)
  manager = ReferenceBlockSpaceManager(cached_config(num_gpu_blocks=4, max_blocks_per_seq=4))
  for _ in range(24):
    apply(manager, random_operation(rng, manager))
    check_cached_chains(manager)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_allocate_equals_empty_allocate_then_append_under_a_window(seed):
  check_allocate_equals_empty_allocate_then_append(
    ReferenceBlockSpaceManager(
      cached_config(num_gpu_blocks=6, max_blocks_per_seq=5), sliding_window=3
    ),
    random.Random(seed),
  )


def apply_hybrid(hybrid, operation):
  """`apply` on the hybrid reference: its status."""
  name, *args = operation
  if name == "allocate":
    seq_ids, tokens, salt = args
    return hybrid.allocate_counting_hits(seq_ids, tokens, len(tokens), salt)[0]
  if name == "append":
    rows, lookahead = args
    seq_ids, new = [s for s, _ in rows], [t for _, t in rows]
    return hybrid.append_slots(seq_ids, new, [len(t) for t in new], lookahead)[0]
  if name == "access":
    for manager in hybrid.types:
      manager.access_all_blocks_in_seq(*args)
    return Status.OK
  return getattr(hybrid, name)(*args)[0]  # fork, free, swap_out, swap_in


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
@hypothesis.example(seed=2850)  # a swap-in registers an identity an evictor block still has
def test_hybrid_random_programs_keep_every_type_whole(seed):
  rng = random.Random(seed)
  hybrid = ReferenceHybridManager(
    cached_config(num_gpu_blocks=6, num_cpu_blocks=4, max_blocks_per_seq=4),
    [None, 3, 5],
    gpu_blocks=[6, 4, 5],
  )
  for _ in range(24):
    before = copy.deepcopy([manager._state for manager in hybrid.types])
    status = apply_hybrid(hybrid, random_operation(rng, hybrid.types[0]))
    if status != Status.OK:
      assert [manager._state for manager in hybrid.types] == before
    for manager in hybrid.types:
      check_invariants(manager)
      check_cached_chains(manager)
    slots = [[(s.device, s.tokens) if s else None for s in m._state.seqs] for m in hybrid.types]
    assert all(other == slots[0] for other in slots)
