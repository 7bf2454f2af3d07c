"""vLLM 0.6's block space manager as pure, batched, jittable functions on pytrees.

One call style for every op: a module-level pure function ``op(state, ...)``
that takes the config from the state (`BlockManagerState.cfg`, static) and
returns new values, never changing its arguments. `BlockSpaceManager` binds
exactly those functions as static methods, so ``bm.op(state, ...)``,
``BlockSpaceManager.op(state, ...)`` and ``manager.op(state, ...)`` are one
function; only ``bm.init()`` uses the manager's own config. `pj.checked(bm)`
runs the same ops jitted on host values and raises on a failed status.

Every mutating op works in phases over the whole batch (docs/semantics.md:
lookups, copy-on-write decisions, takes, releases, registration): takes are
ranked with a prefix count, releases are an ordered event list, and every
write is a scatter masked by the call's status, so a failed call returns the
state it was given. The modules, by phase:

- `arguments`: static argument checks, id checks, `jit_op` and `static_args`.
- `allocate`: allocate, fork, fork_each, free, reset.
- `append`, `append_window`, `append_lookups`: append_slots and its phases.
- `swap`: swap_out, swap_in.
- `queries`: can_*, tables, slot mappings, counts, the hit rate, access times
  and computed marks.
- `commit`, `tables`, `pool`, `prefix_cache`: applying a call's effects to a
  pool, masked table writes, the free lists and evictor, content identities.
- `manager`: `BlockSpaceManager`, and every op under its name.
- `plans`: `unwritten_hit_copies`, the copies that fill prefix-cache hits whose
  K/V is not written yet (from two states).
- `hybrid`: a hybrid cache, one manager state per attention type (its pages,
  one `KVCache` per type, are `paged_jax.hybrid_kv`'s).
- `checked`, `invariants`: the raising host layer and the state's invariants.
"""

from paged_jax.block_manager.checked import (
  AlreadyAllocatedError,
  CheckedBlockSpaceManager,
  InvalidArgumentError,
  NotAllocatedError,
  OutOfBlocksError,
  PagedCacheError,
  SwapSpaceExhaustedError,
  TableFullError,
  WrongDeviceError,
  checked,
)
from paged_jax.block_manager.hybrid import (
  HybridBlockSpaceManager,
  HybridCacheConfig,
  HybridResult,
  HybridState,
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
