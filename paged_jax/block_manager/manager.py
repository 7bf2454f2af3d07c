"""BlockSpaceManager: vLLM 0.6's block manager as pure, batched, jittable functions.

Every op is a module-level function `op(state, ...)` (see the package
docstring); this module re-exports each one under its name and binds them
all to `BlockSpaceManager`.
"""

from __future__ import annotations

import dataclasses

from paged_jax.block_manager.allocate import allocate, fork, fork_each, free, reset
from paged_jax.block_manager.append import append_slots
from paged_jax.block_manager.arguments import jit_op, static_args
from paged_jax.block_manager.queries import (
  access_all_blocks_in_seq,
  can_allocate,
  can_append_slots,
  can_swap_in,
  can_swap_out,
  get_block_table,
  get_block_tables,
  get_common_computed_block_ids,
  get_num_tokens,
  get_slot_mapping,
  mark_blocks_as_computed,
  num_free_cpu_blocks,
  num_free_gpu_blocks,
  prefix_cache_hit_rate,
)
from paged_jax.block_manager.state import BlockManagerState, init_state
from paged_jax.block_manager.swap import swap_in, swap_out
from paged_jax.config import CacheConfig

__all__ = [
  "BlockSpaceManager",
  "access_all_blocks_in_seq",
  "allocate",
  "append_slots",
  "can_allocate",
  "can_append_slots",
  "can_swap_in",
  "can_swap_out",
  "fork",
  "fork_each",
  "free",
  "get_block_table",
  "get_block_tables",
  "get_common_computed_block_ids",
  "get_num_tokens",
  "get_slot_mapping",
  "init_state",
  "jit_op",
  "mark_blocks_as_computed",
  "num_free_cpu_blocks",
  "num_free_gpu_blocks",
  "prefix_cache_hit_rate",
  "reset",
  "static_args",
  "swap_in",
  "swap_out",
]


@dataclasses.dataclass(frozen=True)
class BlockSpaceManager:
  """vLLM's block space manager as pure functions of a `BlockManagerState`.

  Hashable (its only field is the static config), so it can be closed over
  or passed to `jax.jit`. Its ops are the module functions themselves, bound
  as static methods: `bm.allocate is BlockSpaceManager.allocate is
  manager.allocate`. Each takes the state (which carries the config) and
  returns new values; sequence ids are int32 arrays with -1 as padding.

  Example:
    bm = BlockSpaceManager(CacheConfig(block_size=16, num_gpu_blocks=256))
    state = bm.init()
    state, res = jax.jit(bm.allocate)(state, jnp.array([0, 1]), prompt, len(prompt))
    state, cow = bm.append_slots(state, jnp.array([0, 1]), next_tokens[:, None],
                                 jnp.ones(2, jnp.int32))
  """

  cfg: CacheConfig

  def init(self) -> BlockManagerState:
    """An empty state for this manager's config: every slot empty, every block free."""
    return init_state(self.cfg)

  can_allocate = staticmethod(can_allocate)
  allocate = staticmethod(allocate)
  can_append_slots = staticmethod(can_append_slots)
  append_slots = staticmethod(append_slots)
  fork = staticmethod(fork)
  fork_each = staticmethod(fork_each)
  free = staticmethod(free)
  reset = staticmethod(reset)
  can_swap_out = staticmethod(can_swap_out)
  can_swap_in = staticmethod(can_swap_in)
  swap_out = staticmethod(swap_out)
  swap_in = staticmethod(swap_in)
  get_block_table = staticmethod(get_block_table)
  get_block_tables = staticmethod(get_block_tables)
  get_num_tokens = staticmethod(get_num_tokens)
  get_slot_mapping = staticmethod(get_slot_mapping)
  num_free_gpu_blocks = staticmethod(num_free_gpu_blocks)
  num_free_cpu_blocks = staticmethod(num_free_cpu_blocks)
  access_all_blocks_in_seq = staticmethod(access_all_blocks_in_seq)
  mark_blocks_as_computed = staticmethod(mark_blocks_as_computed)
  get_common_computed_block_ids = staticmethod(get_common_computed_block_ids)
  prefix_cache_hit_rate = staticmethod(prefix_cache_hit_rate)
