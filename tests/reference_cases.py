"""Small reference managers for the hand-checkable tests of
tests/reference/block_manager.py (tests/test_reference*.py)."""

from paged_jax.config import CacheConfig, Status
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
