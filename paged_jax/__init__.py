"""paged_jax: vLLM's PagedAttention KV-cache manager as pure, jittable JAX."""

from paged_jax.block_manager import (
    AlreadyAllocatedError, BlockManagerState, BlockSpaceManager, CopyPlan,
    DoubleFreeError, InvalidArgumentError, NotAllocatedError, OpResult,
    OutOfBlocksError, PagedCacheError, SwapPlan, SwapSpaceExhaustedError,
    TableFullError, WrongDeviceError, check_invariants, checked)
from paged_jax.config import AllocStatus, CacheConfig, Status

__all__ = [
    "AllocStatus", "AlreadyAllocatedError", "BlockManagerState", "BlockSpaceManager",
    "CacheConfig", "CopyPlan", "DoubleFreeError", "InvalidArgumentError",
    "NotAllocatedError", "OpResult", "OutOfBlocksError", "PagedCacheError", "Status",
    "SwapPlan", "SwapSpaceExhaustedError", "TableFullError", "WrongDeviceError",
    "check_invariants", "checked",
]
