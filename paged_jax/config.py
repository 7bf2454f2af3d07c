"""Static configuration and status codes of the paged KV cache."""

from __future__ import annotations

import dataclasses
import enum
import math


class Status(enum.IntEnum):
  """Result code of every mutating block-manager call (an int32 under jit)."""

  OK = 0
  OUT_OF_BLOCKS = 1
  SWAP_SPACE_EXHAUSTED = 2
  DOUBLE_FREE = 3
  NOT_ALLOCATED = 4
  ALREADY_ALLOCATED = 5
  WRONG_DEVICE = 6
  TABLE_FULL = 7
  INVALID_ARGUMENT = 8


class AllocStatus(enum.IntEnum):
  """Answer of `can_allocate` and `can_swap_in`, as in vLLM."""

  OK = 0
  LATER = 1
  NEVER = 2


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Shape and policy of a paged KV cache; frozen and hashable (static under jit).

  Attributes:
    block_size: tokens per KV block.
    num_gpu_blocks: blocks in accelerator memory (at least 1).
    num_cpu_blocks: blocks of host swap space (0: no swapping).
    max_seqs: sequence slots; sequence ids are ``0 .. max_seqs - 1``.
    max_blocks_per_seq: entries of a block table, so the longest sequence is
      ``max_blocks_per_seq * block_size`` tokens.
    watermark: fraction of GPU blocks that admission (``can_allocate``,
      ``can_swap_in``) keeps free.
    sliding_window: a sequence keeps a block only while it holds one of
      its last `sliding_window` positions (the others are freed); None
      keeps every block (docs/semantics.md, "Sliding window").
    enable_prefix_caching: share full blocks of identical prefixes (with a
      sliding window too, by the rules of docs/semantics.md, "Prefix caching
      under a window").
    hash_bits: width of the hash that indexes cached blocks (0..64). Lookups
      are exact whatever the width; it only changes how often keys collide.
  """

  block_size: int = 16
  num_gpu_blocks: int = 1024
  num_cpu_blocks: int = 256
  max_seqs: int = 64
  max_blocks_per_seq: int = 128
  watermark: float = 0.01
  sliding_window: int | None = None
  enable_prefix_caching: bool = False
  hash_bits: int = 64

  def __post_init__(self):
    for name in ("block_size", "num_gpu_blocks", "max_seqs", "max_blocks_per_seq"):
      _require_int(name, getattr(self, name), minimum=1)
    _require_int("num_cpu_blocks", self.num_cpu_blocks, minimum=0)  # 0: no swap space
    if not 0.0 <= self.watermark < 1.0:
      raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
    if self.sliding_window is not None:
      _require_int("sliding_window", self.sliding_window, minimum=1)
    _require_int("hash_bits", self.hash_bits, minimum=0)
    if self.hash_bits > 64:
      raise ValueError(f"hash_bits must be in 0..64, got {self.hash_bits}")
    if max(self.num_gpu_blocks, self.num_cpu_blocks) * self.block_size >= 2**31:
      raise ValueError("num_blocks * block_size must fit in int32 slot numbers")

  @property
  def watermark_blocks(self) -> int:
    """GPU blocks that admission keeps free: ``int(watermark * num_gpu_blocks)``."""
    return int(self.watermark * self.num_gpu_blocks)

  @property
  def max_tokens_per_seq(self) -> int:
    """Longest sequence a block table can hold."""
    return self.max_blocks_per_seq * self.block_size

  def blocks_for(self, num_tokens: int) -> int:
    """Logical blocks (table entries) that ``num_tokens`` tokens span."""
    return math.ceil(num_tokens / self.block_size)


def _require_int(name: str, value, *, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name} must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
