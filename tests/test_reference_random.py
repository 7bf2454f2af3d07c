"""Random operation sequences on the reference block manager: its invariants,
atomic failure, and equivalences between calls (docs/semantics.md).
"""

import copy
import random

import hypothesis
import pytest
from hypothesis import strategies as st

from paged_jax.config import Status
from tests.reference.allocators import (
  CachedBlockAllocator,
)
from tests.reference_cases import make_manager

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
  check_allocate_equals_empty_allocate_then_append(
    make_manager(max_seqs=4, enable_prefix_caching=caching), random.Random(seed)
  )


def check_allocate_equals_empty_allocate_then_append(one_step, rng: random.Random) -> None:
  """After random operations, allocating a prompt on a free slot equals
  allocating nothing, then appending the prompt: same status and state."""
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
