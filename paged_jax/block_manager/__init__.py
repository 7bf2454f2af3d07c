"""vLLM's v1 BlockSpaceManager as pure, jittable functions on pytrees."""

from paged_jax.block_manager.checked import (
  AlreadyAllocatedError,
  CheckedBlockSpaceManager,
  DoubleFreeError,
  InvalidArgumentError,
  NotAllocatedError,
  OutOfBlocksError,
  PagedCacheError,
  SwapSpaceExhaustedError,
  TableFullError,
  WrongDeviceError,
  checked,
)
from paged_jax.block_manager.invariants import check_invariants
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.state import (
  AllocateResult,
  BlockManagerState,
  CopyPlan,
  OpResult,
  SwapPlan,
)
