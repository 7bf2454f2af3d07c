"""paged_jax: vLLM's PagedAttention KV-cache manager as pure, jittable JAX."""

from paged_jax.attention import paged_attention, paged_prefill_attention
from paged_jax.block_manager import (
  AllocateResult,
  AlreadyAllocatedError,
  BlockManagerState,
  BlockSpaceManager,
  CopyPlan,
  InvalidArgumentError,
  NotAllocatedError,
  OpResult,
  OutOfBlocksError,
  PagedCacheError,
  SwapPlan,
  SwapSpaceExhaustedError,
  TableFullError,
  WrongDeviceError,
  check_invariants,
  checked,
)
from paged_jax.config import AllocStatus, CacheConfig, Status
from paged_jax.engine import (
  LLM,
  CompletionOutput,
  GenerationStats,
  LLMEngine,
  ModelProtocol,
  RequestOutput,
  SamplingParams,
)
from paged_jax.generate import Request, generate
from paged_jax.kv_cache import KVCache, copy_blocks, swap_in, swap_out, write_kv
from paged_jax.kv_memory import (
  bytes_per_block,
  device_memory_bytes,
  num_cpu_blocks_for_swap_space,
  num_gpu_blocks_for_memory,
)
from paged_jax.models.dense import generate_dense, sample_tokens
from paged_jax.structured import StructuredOutputsParams

__all__ = [
  "AllocStatus",
  "AllocateResult",
  "AlreadyAllocatedError",
  "BlockManagerState",
  "BlockSpaceManager",
  "CacheConfig",
  "CopyPlan",
  "InvalidArgumentError",
  "NotAllocatedError",
  "OpResult",
  "OutOfBlocksError",
  "PagedCacheError",
  "Status",
  "SwapPlan",
  "SwapSpaceExhaustedError",
  "TableFullError",
  "WrongDeviceError",
  "check_invariants",
  "checked",
  "KVCache",
  "bytes_per_block",
  "copy_blocks",
  "device_memory_bytes",
  "num_cpu_blocks_for_swap_space",
  "num_gpu_blocks_for_memory",
  "paged_attention",
  "paged_prefill_attention",
  "swap_in",
  "swap_out",
  "write_kv",
  "GenerationStats",
  "Request",
  "SamplingParams",
  "StructuredOutputsParams",
  "generate",
  "generate_dense",
  "sample_tokens",
  "LLM",
  "LLMEngine",
  "CompletionOutput",
  "RequestOutput",
  "ModelProtocol",
]
