"""What a KV cache may hold and where: page dtypes, host memory, block counts.

``check_cache_dtype`` names the dtypes a cache holds, ``host_memory_kind``
where its swap pages live, and the sizing helpers turn memory budgets into
block counts as vLLM's ``gpu_memory_utilization`` and ``swap_space`` do.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels import quantization

_GIB = 1 << 30
FLOAT_DTYPES = tuple(map(jnp.dtype, (jnp.float32, jnp.bfloat16, jnp.float16)))
QUANTIZED_DTYPES = quantization.QUANTIZED_DTYPES


def check_cache_dtype(dtype) -> jnp.dtype:
  """Returns ``dtype`` as a ``jnp.dtype`` if a KV cache can hold it.

  Raises:
    ValueError: unless float32, bfloat16, float16, int8 or float8_e4m3fn.
  """
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as error:
    raise ValueError(f"not a dtype: {dtype!r}") from error
  if dtype not in FLOAT_DTYPES + QUANTIZED_DTYPES:
    raise ValueError(
      f"KV cache dtype {dtype} is not supported; use one of "
      f"{[str(d) for d in FLOAT_DTYPES]} or, quantized with scales, "
      f"{[str(d) for d in QUANTIZED_DTYPES]}"
    )
  return dtype


def host_memory_kind(device: jax.Device) -> str | None:
  """The memory kind for swap pages on ``device``: ``"pinned_host"``.

  Falls back, with one warning per backend, to ``"unpinned_host"`` or to
  device memory (None) where the backend lacks pinned host memory.
  """
  kinds = tuple(memory.kind for memory in device.addressable_memories())
  return pick_host_memory_kind(kinds, device.platform)


@functools.cache
def pick_host_memory_kind(kinds: tuple[str, ...], platform: str) -> str | None:
  """Picks the host memory kind from ``kinds``; warns (once) on a fallback.

  Args:
    kinds: the memory kinds a device offers.
    platform: the backend's name, for the warning.

  Returns:
    ``"pinned_host"``, else ``"unpinned_host"``, else None (device memory).
  """
  if "pinned_host" in kinds:
    return "pinned_host"
  fallback = "unpinned_host" if "unpinned_host" in kinds else None
  warnings.warn(
    f"{platform} offers no 'pinned_host' memory (it has {list(kinds)}); "
    f"KV swap space falls back to {fallback or 'device'} memory",
    RuntimeWarning,
    stacklevel=3,
  )
  return fallback


def bytes_per_block(
  *, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype
) -> int:
  """Bytes one block number occupies across all layers' K and V.

  A quantized dtype (int8, float8_e4m3fn) adds its float32 scales: each
  token's row of ``head_dim`` bytes costs ``head_dim + 4`` bytes, so int8
  holds ``2 * head_dim / (head_dim + 4)`` times the tokens of bfloat16
  (1.94x at head_dim 128, 1.88x at 64).
  """
  dtype = check_cache_dtype(dtype)
  row_bytes = head_dim * dtype.itemsize
  if quantization.is_quantized(dtype):
    row_bytes += quantization.SCALE_DTYPE.itemsize
  return 2 * num_layers * num_kv_heads * block_size * row_bytes


def num_gpu_blocks_for_memory(
  memory_bytes: int, block_bytes: int, *, utilization: float = 0.9, reserved_bytes: int = 0
) -> int:
  """Device blocks that fit a memory budget, like vLLM's gpu_memory_utilization.

  Args:
    memory_bytes: the device's memory (see ``device_memory_bytes``).
    block_bytes: ``bytes_per_block(...)``.
    utilization: fraction of ``memory_bytes`` this process may use.
    reserved_bytes: bytes kept for weights and activations.

  Returns:
    ``floor((memory_bytes * utilization - reserved_bytes) / block_bytes)``.
  """
  if not 0 < utilization <= 1:
    raise ValueError(f"utilization must be in (0, 1], got {utilization}")
  if block_bytes < 1 or memory_bytes < 0 or reserved_bytes < 0:
    raise ValueError(
      f"need block_bytes >= 1 and non-negative memory_bytes and "
      f"reserved_bytes, got {block_bytes}, {memory_bytes}, {reserved_bytes}"
    )
  budget = int(memory_bytes * utilization) - reserved_bytes
  blocks = budget // block_bytes
  if blocks < 1:
    raise ValueError(
      f"no room for KV blocks: {memory_bytes} bytes * utilization "
      f"{utilization} - {reserved_bytes} reserved < one block of "
      f"{block_bytes} bytes"
    )
  return blocks


def num_gpu_blocks_for_budget(
  budget_bytes: int, block_bytes: int, *, min_blocks: int = 1, max_tokens: int | None = None
) -> int:
  """Device blocks that a KV byte budget holds, like vLLM's ``kv_cache_memory_bytes``.

  Args:
    budget_bytes: bytes of KV pages per device.
    block_bytes: bytes one block takes on a device (``bytes_per_block(...)``,
      of the KV heads that device stores).
    min_blocks: the fewest blocks that serve one sequence.
    max_tokens: that sequence's length, for the error message.

  Returns:
    ``budget_bytes // block_bytes``.

  Raises:
    ValueError: naming the numbers, for a budget that is not a positive
      int or that holds fewer than ``min_blocks`` blocks.
  """
  if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
    raise ValueError(f"kv_cache_memory_bytes must be a positive int, got {budget_bytes!r}")
  if block_bytes < 1 or min_blocks < 1:
    raise ValueError(f"need block_bytes >= 1 and min_blocks >= 1, got {block_bytes}, {min_blocks}")
  blocks = budget_bytes // block_bytes
  if blocks < min_blocks:
    raise ValueError(
      f"kv_cache_memory_bytes={budget_bytes} holds {blocks} blocks of {block_bytes} bytes, "
      f"but one sequence{'' if max_tokens is None else f' of {max_tokens} tokens'} needs "
      f"{min_blocks} ({min_blocks * block_bytes} bytes)"
    )
  return blocks


def num_cpu_blocks_for_swap_space(swap_space_gib: float, block_bytes: int) -> int:
  """Host blocks that fit ``swap_space_gib`` GiB, like vLLM's swap_space.

  Args:
    swap_space_gib: host memory for swapped-out blocks, in GiB.
    block_bytes: ``bytes_per_block(...)``.

  Returns:
    ``floor(swap_space_gib * 2**30 / block_bytes)``.
  """
  if swap_space_gib < 0 or block_bytes < 1:
    raise ValueError(
      f"need swap_space_gib >= 0 and block_bytes >= 1, got {swap_space_gib}, {block_bytes}"
    )
  return int(swap_space_gib * _GIB) // block_bytes


def device_memory_bytes(device: jax.Device | None = None) -> int:
  """Total memory of ``device`` as its runtime reports it (GPU, TPU).

  Raises:
    ValueError: where the backend reports no memory limit (CPU).
  """
  device = jax.devices()[0] if device is None else device
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    raise ValueError(
      f"{device.platform} device {device.id} reports no memory limit; pass memory_bytes explicitly"
    )
  return int(stats["bytes_limit"])
