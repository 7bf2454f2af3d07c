"""A hybrid KV cache: one block-manager state per attention type (docs/semantics.md).

A model's layers each attend globally or to a sliding window of their last
`w` keys. Layers of one type share a block table; each type is a whole
`BlockManagerState` (its own pool, tables, reference counts), with the
type's window as its `sliding_window`, so a sliding type holds at most
``ceil(w / block_size) + 1`` blocks per sequence (plus lookahead) while the
global type holds every block.

Every mutating op runs the plain manager's op with the same arguments on
each type's state (a loop over the static, small number of types; each op
stays batched over sequences) and keeps every new state only if every type
succeeded; otherwise each type keeps the state it was given. To keep the
states' updates in place, a multi-type op runs the types' ops once for their
statuses and again under a `lax.cond` on them (XLA drops the first run's
writes); a select between old and new states would copy every array each
call (`benchmarks/bench_hybrid_manager.py`). Under `jax.vmap` over several
data shards the cond becomes such a select again. With a single type an op
is the plain op on that type's state, bit for bit.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax.block_manager import allocate as allocate_ops
from paged_jax.block_manager import append, queries, swap
from paged_jax.block_manager.arguments import static_args
from paged_jax.block_manager.invariants import check_invariants
from paged_jax.block_manager.state import _ShowsStatus, init_state
from paged_jax.config import AllocStatus, CacheConfig, Status

i32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class HybridCacheConfig:
  """A paged KV cache with one block table per attention type; frozen and hashable.

  Attributes:
    cache: what every type shares (block size, slots, table length,
      watermark, prefix caching); its `sliding_window` must be None, the
      windows come from `layer_windows`. Its pool sizes are each type's
      default.
    layer_windows: each decoder layer's type: None (global attention) or a
      positive int, the keys its sliding window sees.
    gpu_blocks: GPU blocks of each type, in type order (default: all
      `cache.num_gpu_blocks`).
    cpu_blocks: CPU blocks of each type (default: all `cache.num_cpu_blocks`).

  Raises:
    ValueError: naming the layer and the value, for a window that is not a
      positive int; and for pool sizes that do not give one positive count
      per type.
  """

  cache: CacheConfig
  layer_windows: tuple
  gpu_blocks: tuple | None = None
  cpu_blocks: tuple | None = None

  def __post_init__(self):
    if self.cache.sliding_window is not None:
      raise ValueError(
        "HybridCacheConfig: cache.sliding_window must be None "
        f"(got {self.cache.sliding_window}); each layer's window comes from layer_windows"
      )
    windows = tuple(self.layer_windows)
    if not windows:
      raise ValueError("HybridCacheConfig: layer_windows must name at least one layer")
    for layer, window in enumerate(windows):
      if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
      ):
        raise ValueError(
          f"layer {layer}: sliding_window must be a positive int or None, got {window!r}"
        )
    object.__setattr__(self, "layer_windows", windows)
    for name, default, minimum in (
      ("gpu_blocks", self.cache.num_gpu_blocks, 1),
      ("cpu_blocks", self.cache.num_cpu_blocks, 0),
    ):
      counts = getattr(self, name)
      counts = (default,) * len(self.windows) if counts is None else tuple(counts)
      if len(counts) != len(self.windows) or any(
        isinstance(c, bool) or not isinstance(c, int) or c < minimum for c in counts
      ):
        raise ValueError(
          f"HybridCacheConfig: {name} must be {len(self.windows)} ints >= {minimum} "
          f"(one per type {self.type_names()}), got {counts!r}"
        )
      object.__setattr__(self, name, counts)

  @property
  def block_size(self) -> int:
    return self.cache.block_size

  @property
  def max_seqs(self) -> int:
    return self.cache.max_seqs

  @property
  def max_tokens_per_seq(self) -> int:
    return self.cache.max_tokens_per_seq

  @property
  def enable_prefix_caching(self) -> bool:
    return self.cache.enable_prefix_caching

  @property
  def windows(self) -> tuple:
    """The attention types, in type order (`attention_types`)."""
    return attention_types(self.layer_windows)

  @property
  def num_groups(self) -> int:
    """How many attention types (block tables) the cache has."""
    return len(self.windows)

  def group_config(self, group: int) -> CacheConfig:
    """The plain manager's config of type `group`: its window and its pool sizes."""
    return dataclasses.replace(
      self.cache,
      sliding_window=self.windows[group],
      num_gpu_blocks=self.gpu_blocks[group],
      num_cpu_blocks=self.cpu_blocks[group],
    )

  def layer_group(self, layer: int) -> int:
    """The type whose block table layer `layer` reads; ValueError for a layer the model lacks."""
    if isinstance(layer, bool) or not isinstance(layer, int):
      raise ValueError(f"layer must be an int, got {layer!r}")
    if not 0 <= layer < len(self.layer_windows):
      raise ValueError(f"layer {layer}: the model declares layers 0..{len(self.layer_windows) - 1}")
    return self.windows.index(self.layer_windows[layer])

  def group_of_window(self, window: int | None) -> int:
    """The type of layers with this window; ValueError for a type no layer declares."""
    if window not in self.windows:
      raise ValueError(
        f"no layer declares the attention type {_type_name(window)}; "
        f"the model's types: {self.type_names()}"
      )
    return self.windows.index(window)

  def type_names(self) -> str:
    """The types, named: 'global, sliding window 512'."""
    return ", ".join(_type_name(window) for window in self.windows)

  def type_name(self, group: int) -> str:
    """Type `group`, named ('global' or 'sliding window 512')."""
    return _type_name(self.windows[group])


def describe_admission(cfg: HybridCacheConfig, num_tokens: int, answer, group) -> str:
  """A message for `can_allocate`'s answer that names the type that decided it.

  Args:
    cfg: the hybrid config.
    num_tokens: the prompt length asked about.
    answer: the AllocStatus `can_allocate` returned.
    group: the type it named (-1 for OK).
  """
  answer, group = AllocStatus(int(answer)), int(group)
  if answer == AllocStatus.OK:
    return f"can_allocate({num_tokens}): OK in every type ({cfg.type_names()})"
  type_cfg = cfg.group_config(group)
  first_live = 0
  if type_cfg.sliding_window is not None:
    first_live = max(0, (num_tokens - type_cfg.sliding_window) // type_cfg.block_size)
  need = max(type_cfg.blocks_for(max(num_tokens, 0)) - first_live, 0)
  return (
    f"can_allocate({num_tokens}): {answer.name}: the {cfg.type_name(group)} type needs "
    f"{need} of its {type_cfg.num_gpu_blocks} GPU blocks "
    f"(watermark {type_cfg.watermark_blocks}, table of {type_cfg.max_blocks_per_seq} blocks)"
  )


def attention_types(layer_windows) -> tuple:
  """The distinct layer types, in type order: None (global) first, then the windows ascending."""
  distinct = set(layer_windows)
  return ((None,) if None in distinct else ()) + tuple(sorted(distinct - {None}))


def blocks_per_sequence(window: int | None, num_tokens: int, block_size: int, extra: int = 0):
  """Blocks one sequence of `num_tokens` holds in a type: all, or its window's (plus `extra`).

  `extra` counts the blocks an append takes before the window frees any
  (a prompt chunk's, lookahead slots'); a type never holds more than every
  block.
  """
  every = -(-num_tokens // block_size)
  if window is None:
    return every
  return min(every, -(-window // block_size) + 1 + extra)


def gpu_blocks_for_budget(
  layer_windows,
  *,
  block_size: int,
  layer_block_bytes,
  budget_bytes: int,
  max_tokens: int,
  extra_blocks: int = 0,
) -> tuple:
  """Each type's GPU blocks, splitting one byte budget by what a longest sequence needs.

  A type's share of the budget is its share of the bytes that one sequence
  of `max_tokens` holds (its layers times its blocks per sequence), so
  every type runs out at the same number of such sequences.

  Args:
    layer_windows: each layer's window, None for global attention.
    block_size: tokens per block.
    layer_block_bytes: bytes of one block of one layer (K and V;
      `pj.bytes_per_block(num_layers=1, ...)`): an int for every layer, or
      one per layer (a speculative draft's layers may have other heads).
    budget_bytes: device bytes for every type's pages together.
    max_tokens: the longest sequence the split is made for.
    extra_blocks: blocks a sliding type holds past its window (see
      `blocks_per_sequence`).

  Returns:
    The blocks of each type, in type order (`HybridCacheConfig.gpu_blocks`).

  Raises:
    ValueError: a budget that cannot give every type one block.
  """
  windows = tuple(layer_windows)
  types = attention_types(windows)
  per_layer = layer_block_bytes
  if isinstance(per_layer, int):
    per_layer = (per_layer,) * len(windows)
  type_bytes = [sum(b for window, b in zip(windows, per_layer) if window == w) for w in types]
  need = [blocks_per_sequence(w, max_tokens, block_size, extra_blocks) for w in types]
  per_sequence = sum(n * b for n, b in zip(need, type_bytes))
  blocks = tuple(budget_bytes * n // per_sequence for n in need)  # (budget * n * b / per_seq) / b
  if min(blocks) < 1:
    raise ValueError(
      f"a budget of {budget_bytes} bytes gives a type no block "
      f"(one sequence of {max_tokens} tokens needs {per_sequence} bytes)"
    )
  return blocks


def _type_name(window: int | None) -> str:
  return "global" if window is None else f"sliding window {window}"


@flax.struct.dataclass
class HybridState:
  """One `BlockManagerState` per attention type, in type order. Immutable."""

  cfg: HybridCacheConfig = flax.struct.field(pytree_node=False)
  groups: tuple


@flax.struct.dataclass(repr=False)
class HybridResult(_ShowsStatus):
  """A mutating op's result on a hybrid cache.

  `status` is the call's (OK only if every type succeeded); `group` is the
  type whose pool failed (OUT_OF_BLOCKS, SWAP_SPACE_EXHAUSTED), else -1;
  `results` holds each type's own result (its plan in that type's block
  ids), with the call's status and, on failure, an empty plan.
  """

  status: jax.Array
  group: jax.Array
  results: tuple


def init_hybrid_state(cfg: HybridCacheConfig) -> HybridState:
  """An empty hybrid cache: every slot empty, every block of every type free.

  With prefix caching and a window, every type follows the window rules
  (the global type too: the common hit leaves blocks without content there).
  """
  rules = cfg.cache.enable_prefix_caching and any(w is not None for w in cfg.windows)
  groups = tuple(init_state(cfg.group_config(g), rules) for g in range(cfg.num_groups))
  return HybridState(cfg=cfg, groups=groups)


def init_hybrid_states(cfg: HybridCacheConfig, num_shards: int) -> HybridState:
  """One empty hybrid state per data shard, stacked on a leading axis (as `init_states`).

  ``jax.vmap`` (or `paged_jax.block_manager.state.on_every_shard`) of a
  hybrid op then runs it on every shard at once.
  """
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_shards, *x.shape)), init_hybrid_state(cfg))


def _first_failure(statuses: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """(the first non-OK status in type order, else OK; the type it names, else -1)."""
  status, group = i32(Status.OK), i32(-1)
  for g in reversed(range(len(statuses))):
    failed = statuses[g] != Status.OK
    status = jnp.where(failed, statuses[g], status)
    group = jnp.where(failed, g, group)
  pool_failure = (status == Status.OUT_OF_BLOCKS) | (status == Status.SWAP_SPACE_EXHAUSTED)
  return status, jnp.where(pool_failure, group, -1).astype(i32)


def _emptied(result, ok: jax.Array, status: jax.Array):
  """A type's result with the call's status, its plan emptied unless the call succeeded."""
  fields = {"status": status}
  if hasattr(result, "count"):
    fields.update(
      count=jnp.where(ok, result.count, 0),
      src=jnp.where(ok, result.src, -1),
      dst=jnp.where(ok, result.dst, -1),
    )
  if hasattr(result, "num_hit_blocks"):
    fields.update(num_hit_blocks=jnp.where(ok, result.num_hit_blocks, 0))
  return result.replace(**fields)


def _on_every_type(state: HybridState, op, *args, **kwargs):
  """Runs a mutating op on every type's state; keeps the new states only if all succeed."""
  outs = [op(group_state, *args, **kwargs) for group_state in state.groups]
  if len(outs) == 1:  # one type: the plain op, bit for bit
    new, result = outs[0]
    status, group = _first_failure([result.status])
    return state.replace(groups=(new,)), HybridResult(
      status=result.status, group=group, results=(result,)
    )
  status, group = _first_failure([result.status for _, result in outs])
  ok = status == Status.OK

  def run(groups):
    return [op(group_state, *args, **kwargs) for group_state in groups]

  def unchanged(groups):
    return [(old, _emptied(result, ok, status)) for old, (_, result) in zip(groups, outs)]

  # The run above only decides the status (its states are dropped); this one writes
  # the states in place, where a select would keep the old ones alive and copy them.
  outs = jax.lax.cond(ok, run, unchanged, state.groups)
  groups = tuple(new for new, _ in outs)
  results = tuple(_emptied(result, ok, status) for _, result in outs)
  return state.replace(groups=groups), HybridResult(status=status, group=group, results=results)


def _worst(answers: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """(the worst AllocStatus of the types, the first type that gave it, -1 when OK)."""
  stacked = jnp.stack([jnp.asarray(a, i32) for a in answers])
  worst = jnp.max(stacked)
  group = jnp.argmax(stacked == worst).astype(i32)
  return worst, jnp.where(worst == AllocStatus.OK, -1, group).astype(i32)


def allocate(state: HybridState, seq_ids, token_ids, num_tokens, salt=0):
  """`allocate` on every type: each type's table holds the blocks its window keeps.

  With prefix caching on several types, every type takes only the common
  hit: the leading blocks that every type's GPU pool has cached
  (docs/semantics.md, "The common hit").

  Returns:
    (new state, HybridResult); `results[g]` is type g's AllocateResult.
  """
  if len(state.groups) == 1 or not state.cfg.cache.enable_prefix_caching:
    return _on_every_type(state, allocate_ops.allocate, seq_ids, token_ids, num_tokens, salt)
  common = jnp.min(
    jnp.stack([allocate_ops.served_blocks(s, token_ids, num_tokens, salt) for s in state.groups])
  )
  return _on_every_type(
    state, allocate_ops.allocate_capped, seq_ids, token_ids, num_tokens, salt, common
  )


@static_args("num_lookahead_slots")
def append_slots(state: HybridState, seq_ids, new_token_ids, num_new, num_lookahead_slots=0):
  """`append_slots` on every type; `results[g]` is type g's CopyPlan (in its block ids)."""
  return _on_every_type(
    state,
    append.append_slots,
    seq_ids,
    new_token_ids,
    num_new,
    num_lookahead_slots=num_lookahead_slots,
  )


def fork(state: HybridState, parent_id, child_id):
  """`fork` on every type: the child gets the parent's table of each type."""
  return _on_every_type(state, allocate_ops.fork, parent_id, child_id)


def fork_each(state: HybridState, parent_ids, child_ids):
  """`fork_each` on every type (beam search's forks)."""
  return _on_every_type(state, allocate_ops.fork_each, parent_ids, child_ids)


def free(state: HybridState, seq_ids):
  """`free` on every type: each type's blocks go back to its own pool."""
  return _on_every_type(state, allocate_ops.free, seq_ids)


def reset(state: HybridState) -> HybridState:
  """Frees every occupied slot of every type."""
  return state.replace(groups=tuple(allocate_ops.reset(s) for s in state.groups))


def swap_out(state: HybridState, seq_ids):
  """`swap_out` on every type; `results[g]` is type g's SwapPlan (GPU to CPU blocks)."""
  return _on_every_type(state, swap.swap_out, seq_ids)


def swap_in(state: HybridState, seq_ids):
  """`swap_in` on every type; `results[g]` is type g's SwapPlan (CPU to GPU blocks)."""
  return _on_every_type(state, swap.swap_in, seq_ids)


def can_allocate(state: HybridState, num_tokens):
  """(AllocStatus, type): the worst answer of the types, and the first type that gave it.

  Each type counts the blocks its window keeps of a prompt of `num_tokens`
  against its own pool and watermark. The type is -1 when the answer is OK.
  """
  return _worst([queries.can_allocate(s, num_tokens) for s in state.groups])


@static_args("num_lookahead_slots")
def can_append_slots(state: HybridState, seq_ids, num_lookahead_slots: int = 0):
  """bool scalar: `can_append_slots` holds for every type."""
  answers = [
    queries.can_append_slots(s, seq_ids, num_lookahead_slots=num_lookahead_slots)
    for s in state.groups
  ]
  return jnp.all(jnp.stack(answers))


def can_swap_out(state: HybridState, seq_ids):
  """bool scalar: every type's CPU pool has room for the group's blocks of that type."""
  return jnp.all(jnp.stack([queries.can_swap_out(s, seq_ids) for s in state.groups]))


@static_args("num_lookahead_slots")
def can_swap_in(state: HybridState, seq_ids, num_lookahead_slots: int = 0):
  """(AllocStatus, type): the worst `can_swap_in` of the types, and the first type giving it."""
  return _worst(
    [queries.can_swap_in(s, seq_ids, num_lookahead_slots=num_lookahead_slots) for s in state.groups]
  )


def get_block_tables(state: HybridState, seq_ids) -> tuple:
  """Each type's `get_block_tables`, in type order."""
  return tuple(queries.get_block_tables(s, seq_ids) for s in state.groups)


def get_num_tokens(state: HybridState, seq_ids) -> jax.Array:
  """int32[B]: each sequence's token count (the same in every type)."""
  return queries.get_num_tokens(state.groups[0], seq_ids)


@static_args("width")
def get_slot_mapping(state: HybridState, seq_ids, num_new, width: int) -> tuple:
  """Each type's `get_slot_mapping`: its sliding window gives -1 outside it."""
  return tuple(queries.get_slot_mapping(s, seq_ids, num_new, width=width) for s in state.groups)


def num_free_gpu_blocks(state: HybridState) -> jax.Array:
  """int32[num_groups]: each type's free GPU blocks."""
  return jnp.stack([queries.num_free_gpu_blocks(s) for s in state.groups])


def num_free_cpu_blocks(state: HybridState) -> jax.Array:
  """int32[num_groups]: each type's free CPU blocks."""
  return jnp.stack([queries.num_free_cpu_blocks(s) for s in state.groups])


def prefix_cache_hit_rate(state: HybridState) -> jax.Array:
  """float32: hits of every type over their lookups (0 before any, -1 without caching)."""
  if not state.cfg.cache.enable_prefix_caching:
    return jnp.float32(-1.0)
  lookups = sum(s.num_lookups for s in state.groups)
  hits = sum(s.num_hits for s in state.groups)
  return jnp.where(lookups > 0, hits / jnp.maximum(lookups, 1), 0.0).astype(jnp.float32)


def access_all_blocks_in_seq(state: HybridState, seq_id, now) -> HybridState:
  """`access_all_blocks_in_seq` on every type."""
  return state.replace(
    groups=tuple(queries.access_all_blocks_in_seq(s, seq_id, now) for s in state.groups)
  )


def mark_blocks_as_computed(state: HybridState, seq_ids, num_computed_tokens) -> HybridState:
  """`mark_blocks_as_computed` on every type."""
  return state.replace(
    groups=tuple(
      queries.mark_blocks_as_computed(s, seq_ids, num_computed_tokens) for s in state.groups
    )
  )


def get_common_computed_block_ids(state: HybridState, seq_ids) -> tuple:
  """Each type's `get_common_computed_block_ids`: (ids, count) per type."""
  return tuple(queries.get_common_computed_block_ids(s, seq_ids) for s in state.groups)


@dataclasses.dataclass(frozen=True)
class HybridBlockSpaceManager:
  """The block manager of a hybrid cache: one `BlockSpaceManager` state per attention type.

  Its ops are this module's functions, bound as static methods; each takes
  a `HybridState` and returns new values. Hashable, so it can be closed over
  or passed to `jax.jit`.

  Example:
    cfg = HybridCacheConfig(CacheConfig(block_size=16), layer_windows=(512,) * 5 + (None,))
    hbm = HybridBlockSpaceManager(cfg)
    state = hbm.init()
    state, res = jax.jit(hbm.allocate)(state, jnp.array([0]), prompt, len(prompt))
    global_tables, sliding_tables = hbm.get_block_tables(state, jnp.array([0]))
  """

  cfg: HybridCacheConfig

  def init(self) -> HybridState:
    """An empty state for this manager's config."""
    return init_hybrid_state(self.cfg)

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
  get_block_tables = staticmethod(get_block_tables)
  get_num_tokens = staticmethod(get_num_tokens)
  get_slot_mapping = staticmethod(get_slot_mapping)
  num_free_gpu_blocks = staticmethod(num_free_gpu_blocks)
  num_free_cpu_blocks = staticmethod(num_free_cpu_blocks)
  access_all_blocks_in_seq = staticmethod(access_all_blocks_in_seq)
  mark_blocks_as_computed = staticmethod(mark_blocks_as_computed)
  get_common_computed_block_ids = staticmethod(get_common_computed_block_ids)
  prefix_cache_hit_rate = staticmethod(prefix_cache_hit_rate)


def check_hybrid_invariants(state: HybridState) -> None:
  """Each type's `check_invariants`, and the types agree on slots, devices and token counts."""
  state = jax.device_get(state)
  first = state.groups[0]
  for g, group_state in enumerate(state.groups):
    check_invariants(group_state)
    for field in ("device", "num_tokens", "salt"):
      if not (getattr(group_state, field) == getattr(first, field)).all():
        raise AssertionError(f"invariant broken: type {g} disagrees with type 0 on {field}")
