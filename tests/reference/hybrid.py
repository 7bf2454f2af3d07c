"""Plain-Python reference of a hybrid cache: one block manager per attention type.

The rules of docs/semantics.md ("Hybrid caches"), literally: every mutating
call runs on each type's `ReferenceBlockSpaceManager` in type order; if any
type fails, every type is put back as it was and the call reports the first
failing type's status. Admission answers the worst of the types' answers.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from paged_jax.config import AllocStatus, CacheConfig, Status
from tests.reference.block_manager import ReferenceBlockSpaceManager

POOL_STATUSES = (Status.OUT_OF_BLOCKS, Status.SWAP_SPACE_EXHAUSTED)


def attention_types(layer_windows: Sequence[int | None]) -> list[int | None]:
  """The distinct types, global (None) first, then the windows ascending."""
  windows = set(layer_windows)
  return ([None] if None in windows else []) + sorted(windows - {None})


class ReferenceHybridManager:
  """One `ReferenceBlockSpaceManager` per attention type.

  Args:
    cache: the shared config (its `sliding_window` is None).
    layer_windows: each layer's window, None for global attention.
    gpu_blocks, cpu_blocks: each type's pool sizes (default: the cache's).
  """

  def __init__(
    self,
    cache: CacheConfig,
    layer_windows: Sequence[int | None],
    gpu_blocks: Sequence[int] | None = None,
    cpu_blocks: Sequence[int] | None = None,
  ):
    self.windows = attention_types(layer_windows)
    count = len(self.windows)
    gpu_blocks = gpu_blocks or [cache.num_gpu_blocks] * count
    cpu_blocks = cpu_blocks or [cache.num_cpu_blocks] * count
    self.types = [
      ReferenceBlockSpaceManager(
        dataclasses.replace(cache, sliding_window=window, num_gpu_blocks=gpu, num_cpu_blocks=cpu)
      )
      for window, gpu, cpu in zip(self.windows, gpu_blocks, cpu_blocks)
    ]

  def _every_type(self, op: str, *args, **kwargs):
    """Runs `op` on each type; all or none. Returns (status, failing type or -1, results)."""
    saved = copy.deepcopy(self.types)
    results = [getattr(manager, op)(*args, **kwargs) for manager in self.types]
    statuses = [result[0] if isinstance(result, tuple) else result for result in results]
    failed = [g for g, status in enumerate(statuses) if status != Status.OK]
    if not failed:
      return Status.OK, -1, results
    self.types = saved
    status = statuses[failed[0]]
    return status, failed[0] if status in POOL_STATUSES else -1, None

  # Mutating calls: (status, failing type, per-type plans or hit counts).

  def allocate_counting_hits(self, seq_ids, token_ids, num_tokens, salt=0):
    status, group, results = self._every_type(
      "allocate_counting_hits", seq_ids, token_ids, num_tokens, salt
    )
    return status, group, [hits for _, hits in results] if results else [0] * len(self.types)

  def append_slots(self, seq_ids, new_token_ids, num_new, num_lookahead_slots=0):
    return self._with_plans(
      "append_slots", seq_ids, new_token_ids, num_new, num_lookahead_slots=num_lookahead_slots
    )

  def swap_out(self, seq_ids):
    return self._with_plans("swap_out", seq_ids)

  def swap_in(self, seq_ids):
    return self._with_plans("swap_in", seq_ids)

  def fork(self, parent_id, child_id):
    return self._every_type("fork", parent_id, child_id)[:2]

  def free(self, seq_ids):
    return self._every_type("free", seq_ids)[:2]

  def reset(self):
    for manager in self.types:
      manager.reset()

  def _with_plans(self, op, *args, **kwargs):
    status, group, results = self._every_type(op, *args, **kwargs)
    plans = [plan for _, plan in results] if results else [[] for _ in self.types]
    return status, group, plans

  # Admission: the worst answer, and the first type that gives it.

  def can_allocate(self, num_tokens):
    return _worst([manager.can_allocate(num_tokens) for manager in self.types])

  def can_swap_in(self, seq_ids, num_lookahead_slots=0):
    return _worst([manager.can_swap_in(seq_ids, num_lookahead_slots) for manager in self.types])

  def can_append_slots(self, seq_ids, num_lookahead_slots=0):
    return all(manager.can_append_slots(seq_ids, num_lookahead_slots) for manager in self.types)

  def can_swap_out(self, seq_ids):
    return all(manager.can_swap_out(seq_ids) for manager in self.types)

  # Queries, per type.

  def get_slot_mapping(self, seq_ids, num_new, width):
    return [manager.get_slot_mapping(seq_ids, num_new, width) for manager in self.types]

  def device_of(self, seq_id):
    return self.types[0].device_of(seq_id)

  def snapshot(self, max_seqs: int):
    """Per type: tables, ref counts and free counts; and the shared slots."""
    first = self.types[0]
    return dict(
      tokens=[first.get_num_tokens(s) for s in range(max_seqs)],
      devices=[first.device_of(s) for s in range(max_seqs)],
      types=[
        dict(
          tables=[manager.get_block_table(s) for s in range(max_seqs)],
          gpu_refs=manager.ref_counts("gpu"),
          cpu_refs=manager.ref_counts("cpu"),
          free=(manager.num_free_gpu_blocks(), manager.num_free_cpu_blocks()),
        )
        for manager in self.types
      ],
    )


def _worst(answers: list[AllocStatus]) -> tuple[AllocStatus, int]:
  worst = max(answers)
  return worst, -1 if worst == AllocStatus.OK else answers.index(worst)
