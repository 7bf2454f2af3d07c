"""How many bytes of accelerator memory arrays hold, on any backend."""

from __future__ import annotations

import jax


def bytes_in_use(device: jax.Device | None = None) -> tuple[int, str]:
  """`(bytes, source)`: the bytes in use on `device` (default: the first),
  from its allocator's `memory_stats()` ("memory_stats") where the backend
  keeps them; the CPU backend keeps none (None), so there the bytes of the
  live arrays' buffers on it, each buffer counted once (arrays may share
  one), device and host memory kinds together ("live_arrays")."""
  device = jax.devices()[0] if device is None else device
  stats = device.memory_stats()
  if stats is not None and "bytes_in_use" in stats:
    return int(stats["bytes_in_use"]), "memory_stats"
  buffers = {}
  for array in jax.live_arrays():
    for shard in array.addressable_shards:
      if shard.device == device:
        buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
  return sum(buffers.values()), "live_arrays"
