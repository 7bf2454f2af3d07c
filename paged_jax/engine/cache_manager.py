"""The cache manager: the block manager's states and the paged KV cache.

Data parallel shards (the "data" axis of a mesh) have one manager state
each, batched along a leading axis; the cache holds every shard's blocks
side by side, its block axis split over "data" (`paged_jax.sharding`).
Sequence slots are global: slot `g` is slot `g % max_seqs` of shard
`g // max_seqs`. The scheduler asks it what fits and changes the states
(allocations, forks, frees, swap plans); the engine has it move the pages
that swap plans name; the model runner's launches hand it their new pages
and states (`take_launch`). It alone stores them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import hybrid_kv, kv_swap, sharding
from paged_jax.block_manager import hybrid, manager
from paged_jax.block_manager.hybrid import (
  HybridBlockSpaceManager,
  HybridCacheConfig,
  HybridState,
  attention_types,
  init_hybrid_states,
)
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.state import EMPTY, BlockManagerState, init_states
from paged_jax.config import AllocStatus, CacheConfig, Status
from paged_jax.hybrid_kv import HybridKVCache
from paged_jax.kv_cache import KVCache


# The manager's operations take the config from the state, so one jitted
# function serves every config (one compile per operation, config and shape).
@functools.partial(jax.jit, static_argnums=0)
def _on_shard(op, states, shard, *args):
  """`op(state, *args) -> (state, result)` on shard `shard` of `states`."""
  state, result = op(jax.tree.map(lambda a: a[shard], states), *args)
  return jax.tree.map(lambda a, b: a.at[shard].set(b), states, state), result


@functools.partial(jax.jit, static_argnums=0)
def _read_shard(op, states, shard, *args):
  """`op(state, *args)` on shard `shard` of `states`."""
  return op(jax.tree.map(lambda a: a[shard], states), *args)


def _ops(state):
  """The block manager's functions for `state` (plain or hybrid)."""
  return hybrid if isinstance(state, HybridState) else manager


def _types(state) -> tuple:
  """Each attention type's plain state (one for a plain cache)."""
  return state.groups if isinstance(state, HybridState) else (state,)


def _answer(answer):
  """An `AllocStatus` answer, without the type a hybrid cache names."""
  return answer[0] if isinstance(answer, tuple) else answer


def _mark_computed(state, seq_ids, num_computed_tokens):
  return _ops(state).mark_blocks_as_computed(state, seq_ids, num_computed_tokens), None


def _can_allocate(state, num_tokens):
  return _answer(_ops(state).can_allocate(state, num_tokens))


def _can_swap_in(state, seq_ids):
  return _answer(_ops(state).can_swap_in(state, seq_ids))


def _free_gpu_blocks(state):
  """int32[types]: each type's free GPU blocks."""
  return jnp.stack([manager.num_free_gpu_blocks(s) for s in _types(state)])


def _free_cpu_blocks(state):
  return jnp.stack([manager.num_free_cpu_blocks(s) for s in _types(state)])


def _computed_blocks(state, seq_ids):
  """The blocks of `seq_ids` that every type has computed."""
  counts = [manager.get_common_computed_block_ids(s, seq_ids)[1] for s in _types(state)]
  return jnp.min(jnp.stack(counts))


@functools.cache
def _zeros_program(specs: tuple):
  """The jitted program that makes zeroed arrays of `(shape, dtype,
  sharding)` specs, compiled ahead (so that calling it compiles nothing)."""
  zeros = lambda: tuple(jnp.zeros(shape, dtype) for shape, dtype, _ in specs)
  program = jax.jit(zeros, out_shardings=tuple(sharding for _, _, sharding in specs))
  program.lower().compile()
  return program


_hit_counts = jax.jit(
  lambda states: (
    sum(jnp.sum(s.num_hits) for s in _types(states)),
    sum(jnp.sum(s.num_lookups) for s in _types(states)),
  )
)


def _with_unwritten_hits(plan, before, after, shard: int, slots: np.ndarray):
  """A swap-in plan that also copies each swapped block whose GPU hit is
  not computed (its K/V may not be written yet) onto that hit.

  Args:
    plan: the manager's `SwapPlan` of (host block, GPU block) pairs.
    before, after: the manager states (every shard) before and after the
      swap-in.
    shard: the data shard swapped in.
    slots: its sequence ids swapped in.

  Returns:
    The plan with those pairs after its own, one per GPU block.
  """
  host_blocks = np.asarray(before.tables)[shard, slots].ravel()
  gpu_blocks = np.asarray(after.tables)[shard, slots].ravel()
  content = before.gpu.content
  unwritten = np.asarray(content.has_content)[shard] & ~np.asarray(content.computed)[shard]
  src, dst = np.array(plan.src), np.array(plan.dst)
  count = int(plan.count)
  copied = set(dst[:count].tolist())
  for host_block, gpu_block in zip(host_blocks.tolist(), gpu_blocks.tolist()):
    if gpu_block >= 0 and gpu_block not in copied and unwritten[gpu_block]:
      src[count], dst[count] = host_block, gpu_block
      copied.add(gpu_block)
      count += 1
  put = lambda value, like: jax.device_put(value, like.sharding)
  return plan.replace(
    src=put(src, plan.src), dst=put(dst, plan.dst), count=put(np.int32(count), plan.count)
  )


class CacheManager:
  """Owns the manager states (one per data shard) and the KV cache.

  Args:
    cfg: the paged cache's configuration, per data shard.
    model_config: the model's config (layers, KV heads, head size, dtype).
    kv_cache_dtype: dtype of the KV pages; None for the model's dtype.
    mesh: a ``("data", "model")`` mesh (see `paged_jax.sharding`), or None
      for one device.
    max_chunk: on a cache that frees the blocks outside its sliding window,
      the most prompt tokens a sequence appends at once (`append_chunk`);
      None on a cache that keeps every block (prompts are allocated whole).
    draft_config: a speculative draft model's config: its K/V pages are
      layers after the model's in the same cache (one block table, copies
      and swaps move both; on a hybrid cache, each layer's in the pages of
      the type it joins, `draft_layer_windows`); None for none.
    lookahead: slots each decode step reserves past a sequence's tokens
      (`num_speculative_tokens`; what a sequence holds at most counts them).
    hybrid: a hybrid cache (one block table and pool per attention type,
      `HybridCacheConfig` over `cfg`; one device), whose states are
      `HybridState`s and pages a `HybridKVCache`; None for one table.
      `cfg.num_gpu_blocks` then counts every type's blocks.
    draft_layer_windows: on a hybrid cache with a draft, the window of the
      type each draft layer joins (one of `hybrid.layer_windows`, see
      `engine_checks.draft_layer_windows`).
  """

  def __init__(
    self,
    cfg: CacheConfig,
    model_config,
    *,
    kv_cache_dtype=None,
    mesh=None,
    max_chunk: int | None = None,
    draft_config=None,
    lookahead: int = 0,
    hybrid: HybridCacheConfig | None = None,
    draft_layer_windows: tuple | None = None,
  ):
    self.cfg = cfg
    self.hybrid = hybrid
    self.max_chunk = max_chunk
    self.lookahead = lookahead
    self.bm = BlockSpaceManager(cfg) if hybrid is None else HybridBlockSpaceManager(hybrid)
    dtype = jnp.dtype(model_config.dtype if kv_cache_dtype is None else kv_cache_dtype)
    pages = lambda mc: KVCache.create(
      cfg, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype=dtype, mesh=mesh
    )
    if hybrid is not None:
      self.kv = _hybrid_pages(hybrid, model_config, dtype, mesh, draft_config, draft_layer_windows)
    else:
      self.kv = pages(model_config)
      if draft_config is not None:  # its layers after the model's, in the same blocks
        self.kv = self.kv.stacked(pages(draft_config))
    # The pages' kinds as made (programs hand back arrays whose shardings
    # may print alike but key their caches apart), for `restore_pages`.
    leaves, self._kv_tree = jax.tree.flatten(self.kv)
    self._page_specs = tuple((a.shape, a.dtype, a.sharding) for a in leaves)
    if mesh is None:
      self.num_shards = 1
      self.replicated = jax.tree.leaves(self.kv)[0].sharding
    else:
      self.num_shards = mesh.shape["data"]
      self.replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # The states live where the pages do, so that every jitted call sees
    # the same input shardings before and after its first run (one compile).
    states = init_states(cfg, self.num_shards) if hybrid is None else init_hybrid_states(hybrid, 1)
    self.state = jax.device_put(states, self.replicated)
    self._empty_state = jax.device_get(self.state)  # on the host, for `reset`
    self.num_swapped_blocks = 0

  # Shards.
  @property
  def num_slots(self) -> int:
    """Sequence slots of all shards."""
    return self.num_shards * self.cfg.max_seqs

  def shard_slots(self, shard: int) -> range:
    """The global slots of data shard `shard`."""
    per_shard = self.cfg.max_seqs
    return range(shard * per_shard, (shard + 1) * per_shard)

  def _local(self, slots) -> tuple[int, np.ndarray]:
    """`(shard, sequence ids)` of global slots that share one shard."""
    shards, local = np.divmod(np.asarray(slots, np.int32), self.cfg.max_seqs)
    if np.unique(shards).size > 1:
      raise ValueError(f"slots {list(slots)} span several data shards")
    return int(shards.flat[0]), local.astype(np.int32)

  def _group(self, slots, values=None) -> tuple[int, np.ndarray, np.ndarray | None]:
    """`(shard, sequence ids, values)` of a group's slots, padded to
    `max_seqs` entries (-1 slots, 0 values), so that every manager call over
    a group compiles once whatever its size."""
    shard, local = self._local(slots)
    padded = np.full(self.cfg.max_seqs, -1, np.int32)
    padded[: local.size] = local
    if values is None:
      return shard, padded, None
    padded_values = np.zeros(self.cfg.max_seqs, np.int32)
    padded_values[: local.size] = values
    return shard, padded, padded_values

  def shard_state(self, shard: int) -> BlockManagerState | HybridState:
    """The manager state of data shard `shard`."""
    return jax.tree.map(lambda a: a[shard], self.state)

  @property
  def type_configs(self) -> list[tuple[str | None, CacheConfig]]:
    """`(name, config)` of each attention type's pool: one unnamed for a
    cache with one table; on a hybrid cache each type's, named."""
    if self.hybrid is None:
      return [(None, self.cfg)]
    h = self.hybrid
    return [(h.type_name(g), h.group_config(g)) for g in range(h.num_groups)]

  def free_blocks_per_type(self, shard: int = 0) -> list[int]:
    """Each type's free GPU blocks on `shard` (one entry without types)."""
    return np.asarray(_read_shard(_free_gpu_blocks, self.state, shard)).tolist()

  # Queries.
  def can_allocate(self, num_tokens: int, shard: int = 0) -> AllocStatus:
    return AllocStatus(int(_read_shard(_can_allocate, self.state, shard, num_tokens)))

  def num_free_gpu_blocks(self, shard: int = 0) -> int:
    """Free GPU blocks on `shard`, of every type."""
    return sum(self.free_blocks_per_type(shard))

  def num_free_cpu_blocks(self, shard: int = 0) -> int:
    return int(np.sum(np.asarray(_read_shard(_free_cpu_blocks, self.state, shard))))

  def can_swap_out(self, slots) -> bool:
    shard, local, _ = self._group(slots)
    return bool(_read_shard(_ops(self.state).can_swap_out, self.state, shard, local))

  def can_swap_in(self, slots) -> AllocStatus:
    shard, local, _ = self._group(slots)
    return AllocStatus(int(_read_shard(_can_swap_in, self.state, shard, local)))

  def held(self, slots) -> list[int]:
    """The slots among `slots` that hold a block table (on either device)."""
    device = np.asarray(_types(self.state)[0].device).reshape(-1)
    return [s for s in slots if device[s] != EMPTY]

  def prefix_cache_hit_rate(self) -> float:
    """Hits over lookups of every shard's prefix cache (-1 when disabled)."""
    if not self.cfg.enable_prefix_caching:
      return -1.0
    hits, lookups = (int(x) for x in _hit_counts(self.state))
    return hits / lookups if lookups else 0.0

  # Operations.
  def _check(self, result, what: str, shard: int, needed: int | None = None) -> None:
    """Raises RuntimeError naming `what` failed, why, and for a lack of
    blocks how many were needed and free."""
    status = Status(int(result.status))
    if status == Status.OK:
      return
    detail = ""
    if status == Status.OUT_OF_BLOCKS:
      free = self.num_free_gpu_blocks(shard)
      wanted = f"{needed} needed, " if needed is not None else ""
      detail = f" ({wanted}{free} free of {self.cfg.num_gpu_blocks} GPU blocks on shard {shard})"
    elif status == Status.SWAP_SPACE_EXHAUSTED:
      free = self.num_free_cpu_blocks(shard)
      detail = f" ({free} free of {self.cfg.num_cpu_blocks} CPU blocks on shard {shard})"
    raise RuntimeError(f"{what} failed: {status.name}{detail}")

  def _update(self, op, slots, *args):
    """`op(state, sequence ids, *args)` on the shard of `slots`."""
    shard, local = self._local(slots)
    self.state, result = _on_shard(op, self.state, shard, local, *args)
    return shard, result

  def _update_group(self, op, slots, values=None):
    """`op(state, sequence ids[, values])` on a group's padded slots."""
    shard, local, values = self._group(slots, values)
    args = (local,) if values is None else (local, values)
    self.state, result = _on_shard(op, self.state, shard, *args)
    return shard, result

  def allocate(self, slot: int, tokens: np.ndarray, request_id: str) -> int:
    """Allocates `tokens` into `slot` for request `request_id`; returns how
    many are already computed (prefix-cache hits whose K/V an earlier
    prefill wrote)."""
    padded = np.zeros(self.cfg.max_tokens_per_seq, np.int32)
    padded[: tokens.size] = tokens
    shard, result = self._update(_ops(self.state).allocate, [slot], padded, tokens.size)
    self._check(
      result,
      f"allocate of {tokens.size} tokens of request {request_id!r} into seq {slot}",
      shard,
      needed=self.cfg.blocks_for(tokens.size),
    )
    computed_blocks = _read_shard(_computed_blocks, self.state, shard, self._local([slot])[1])
    return int(computed_blocks) * self.cfg.block_size

  def append_chunk(self, slot: int, tokens: np.ndarray, request_id: str) -> bool:
    """Appends a prompt chunk's `tokens` (at most `max_chunk`) to `slot`'s
    sequence, on a cache that frees the blocks outside its window: the
    blocks that leave the window go back to the pool. No block of a
    prefilling sequence is shared (samples fork once the prompt is in), so
    nothing is copied.

    Returns:
      False, changing nothing, if the shard has too few free GPU blocks for
      the blocks the chunk starts (with prefix caching, a chunk's hits on
      evictable blocks count against them too: the manager's answer
      decides); True once appended.
    """
    shard, local = self._local([slot])
    before = int(np.asarray(_types(self.state)[0].num_tokens)[shard, local[0]])
    needed = self.cfg.blocks_for(before + tokens.size) - self.cfg.blocks_for(before)
    if needed > min(self.free_blocks_per_type(shard)):  # every type takes them first
      return False
    padded = np.zeros((1, self.max_chunk), np.int32)
    padded[0, : tokens.size] = tokens
    append = _ops(self.state).append_slots
    _, plan = self._update(append, [slot], padded, np.array([tokens.size], np.int32))
    if self.cfg.enable_prefix_caching and Status(int(plan.status)) == Status.OUT_OF_BLOCKS:
      return False  # a failed call changes nothing
    self._check(plan, f"append of a {tokens.size}-token chunk of request {request_id!r}", shard)
    return True

  def mark_computed(self, slots, num_computed) -> None:
    """Marks the first `num_computed` tokens' full blocks of each slot's
    sequence computed (prefix caching only)."""
    if not self.cfg.enable_prefix_caching:
      return
    slots, num_computed = np.asarray(slots), np.asarray(num_computed, np.int32)
    for shard in np.unique(slots // self.cfg.max_seqs):
      mine = slots // self.cfg.max_seqs == shard
      self._update_group(_mark_computed, slots[mine], num_computed[mine])

  def fork(self, parent: int, child: int, request_id: str) -> None:
    shard, (local_parent, local_child) = self._local([parent, child])
    fork = _ops(self.state).fork
    self.state, result = _on_shard(fork, self.state, shard, local_parent, local_child)
    self._check(result, f"fork of request {request_id!r}'s seq {parent} into seq {child}", shard)

  def free(self, slots, request_id: str) -> None:
    """Frees the sequences in `slots` of one shard (on the device or
    swapped out)."""
    shard, result = self._update_group(_ops(self.state).free, slots)
    self._check(result, f"free of request {request_id!r}'s seqs {list(slots)}", shard)

  def swap_out(self, slots, request_id: str):
    """Moves the tables of `slots` to the host pool; returns the plan of
    page copies for `move_out`."""
    shard, plan = self._update_group(_ops(self.state).swap_out, slots)
    self._check(plan, f"swap out of request {request_id!r}'s seqs {list(slots)}", shard)
    if self.hybrid is not None:  # one shard
      return plan
    return sharding.shard_plan(plan, shard, self.cfg.num_gpu_blocks, self.cfg.num_cpu_blocks)

  def swap_in(self, slots, request_id: str):
    """Moves the tables of `slots` back to GPU blocks; returns the plan of
    page copies for `move_in`.

    With prefix caching, the manager shares a GPU block that has a swapped
    block's content instead of taking one (a hit). A hit on a block that is
    not computed may not hold that K/V yet (a prompt registered it, and its
    prefill has not written it), so the plan copies the host page there too.
    """
    shard, local = self._local(slots)
    before = self.state
    shard, plan = self._update_group(_ops(self.state).swap_in, slots)
    self._check(plan, f"swap in of request {request_id!r}'s seqs {list(slots)}", shard)
    if self.hybrid is not None:  # one shard
      return _with_unwritten_hits_per_type(plan, before, self.state, shard, local)
    if self.cfg.enable_prefix_caching:
      plan = _with_unwritten_hits(plan, before, self.state, shard, local)
    return sharding.shard_plan(plan, shard, self.cfg.num_cpu_blocks, self.cfg.num_gpu_blocks)

  def take_launch(self, kv: KVCache | HybridKVCache, state=None) -> None:
    """Takes the pages and, if it changed them, the manager states that a
    launch of the model runner handed back (maybe not computed yet) as the
    ones the next operation starts from; the launch took the old ones
    (donated)."""
    self.kv = kv
    if state is not None:
      self.state = state

  def move_out(self, plan) -> None:
    """Copies the pages of a `swap_out` plan from the device to the host."""
    if self.hybrid is None:
      self.kv = kv_swap.swap_out(self.kv, plan)
    else:
      self.kv = hybrid_kv.swap_out(self.kv, plan)
    self.num_swapped_blocks += _plan_count(plan)

  def move_in(self, plan) -> None:
    """Copies the pages of a `swap_in` plan from the host to the device."""
    if self.hybrid is None:
      self.kv = kv_swap.swap_in(self.kv, plan)
    else:
      self.kv = hybrid_kv.swap_in(self.kv, plan)
    self.num_swapped_blocks += _plan_count(plan)

  # Sleep and new weights.
  def reset(self) -> None:
    """Empties every manager state (no sequence may hold blocks): the prefix
    cache forgets every block; the hit counters are kept. Nothing compiles."""
    empty = jax.device_put(self._empty_state, self.replicated)
    kept = lambda new, old: new.replace(num_lookups=old.num_lookups, num_hits=old.num_hits)
    if self.hybrid is None:
      self.state = kept(empty, self.state)
    else:
      groups = tuple(map(kept, empty.groups, self.state.groups))
      self.state = empty.replace(groups=groups)

  def release_pages(self) -> int:
    """Deletes the KV pages' arrays (device and host pages); returns their
    bytes. `restore_pages` makes new ones with the program that zeroes pages
    of their kinds (compiled here the first time)."""
    leaves = jax.tree.leaves(self.kv)
    _zeros_program(self._page_specs)
    self.kv = None
    freed = sum(leaf.nbytes for leaf in leaves)
    for leaf in leaves:
      leaf.delete()
    return freed

  def restore_pages(self) -> None:
    """Zeroed pages of the shapes and shardings `release_pages` deleted, and
    empty manager states (`reset`). Nothing compiles."""
    self.kv = jax.tree.unflatten(self._kv_tree, _zeros_program(self._page_specs)())
    self.reset()

  # Warm-up.
  def warm_up(self) -> None:
    """Compiles every manager call and page move the engine makes, on
    arguments that change nothing (padding slots, empty swap plans): the
    states and pages stay as they are."""
    shard, one = 0, np.full(1, -1, np.int32)
    _, no_group, no_values = self._group([self.shard_slots(0)[0]], [0])
    no_group[:] = -1
    tokens = np.zeros(self.cfg.max_tokens_per_seq, np.int32)
    no_seq = np.int32(-1)
    ops = _ops(self.state)
    for op, args in (
      (ops.allocate, (one, tokens, 0)),
      (_mark_computed, (no_group, no_values)),
      (ops.fork, (no_seq, no_seq)),
      (ops.free, (no_group,)),
    ):
      _on_shard(op, self.state, shard, *args)
    if self.max_chunk is not None:
      chunk = np.zeros((1, self.max_chunk), np.int32)
      _on_shard(ops.append_slots, self.state, shard, one, chunk, np.zeros(1, np.int32))
    for op, args in (
      (_can_allocate, (0,)),
      (_free_gpu_blocks, ()),
      (_free_cpu_blocks, ()),
      (ops.can_swap_out, (no_group,)),
      (_can_swap_in, (no_group,)),
      (_computed_blocks, (one,)),
    ):
      _read_shard(op, self.state, shard, *args)
    _hit_counts(self.state)
    if not self.cfg.num_cpu_blocks:  # nothing is ever swapped
      return
    if self.hybrid is not None:
      _, plan = _on_shard(ops.swap_out, self.state, shard, no_group)
      self.move_out(plan)
      _, plan = _on_shard(ops.swap_in, self.state, shard, no_group)
      self.move_in(_with_unwritten_hits_per_type(plan, self.state, self.state, shard, one[:0]))
      return
    sizes = (self.cfg.num_gpu_blocks, self.cfg.num_cpu_blocks)
    for op, move, (src, dst) in (
      (manager.swap_out, kv_swap.swap_out, sizes),
      (manager.swap_in, kv_swap.swap_in, sizes[::-1]),
    ):
      _, plan = _on_shard(op, self.state, shard, no_group)
      if op is manager.swap_in and self.cfg.enable_prefix_caching:
        # As `swap_in` hands it on: its arrays are new ones (no slot: no pair).
        plan = _with_unwritten_hits(plan, self.state, self.state, shard, np.zeros(0, np.int64))
      self.kv = move(self.kv, sharding.shard_plan(plan, shard, src, dst))


def _hybrid_pages(hybrid, model_config, dtype, mesh, draft_config, draft_layer_windows):
  """A hybrid cache's pages: the model's layers, then a draft's, each in its type's.

  Raises:
    ValueError: on a mesh, or for a draft without one window per layer.
  """
  if mesh is not None:
    raise ValueError("a hybrid cache runs on one device: pass mesh=None")
  kv = HybridKVCache.create(hybrid, model_config.num_kv_heads, model_config.head_dim, dtype)
  if draft_config is None:
    return kv
  windows = tuple(draft_layer_windows or ())
  if len(windows) != draft_config.num_layers:
    raise ValueError(
      f"draft_layer_windows must give each of the draft's {draft_config.num_layers} layers "
      f"its type's window, got {draft_layer_windows!r}"
    )
  gpu, cpu = hybrid.gpu_blocks, hybrid.cpu_blocks
  types = [hybrid.group_of_window(w) for w in attention_types(windows)]  # a type it lacks raises
  draft_cfg = dataclasses.replace(
    hybrid,
    layer_windows=windows,
    gpu_blocks=tuple(gpu[g] for g in types),
    cpu_blocks=tuple(cpu[g] for g in types),
  )
  heads, head_dim = draft_config.num_kv_heads, draft_config.head_dim
  return kv.stacked(HybridKVCache.create(draft_cfg, heads, head_dim, dtype))


def _plan_count(plan) -> int:
  """The pages a swap plan moves, of every type (a `HybridResult`)."""
  return sum(int(p.count) for p in getattr(plan, "results", (plan,)))


def _with_unwritten_hits_per_type(result, before, after, shard: int, slots: np.ndarray):
  """A hybrid swap-in's `HybridResult` with `_with_unwritten_hits` in each
  type's plan (with prefix caching)."""
  if not before.cfg.enable_prefix_caching:
    return result
  plans = tuple(
    _with_unwritten_hits(p, b, a, shard, slots)
    for p, b, a in zip(result.results, before.groups, after.groups)
  )
  return result.replace(results=plans)
