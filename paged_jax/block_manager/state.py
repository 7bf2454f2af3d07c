"""Pytrees of the block manager: pools, the manager state and the plans it returns."""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import CacheConfig, Status

EMPTY, ON_GPU, ON_CPU = 0, 1, 2  # values of BlockManagerState.device
NO_BLOCK = -1


@flax.struct.dataclass
class ContentIndex:
  """Content identities of a cached pool: who holds which full-block prefix.

  A block's identity is (salt, token prefix through the block). It is stored
  chained: the block's own tokens, its salt and its parent block (the block of
  the previous prefix, in the same pool; -1 for the first block). Because a
  parent never leaves the cache before its children (eviction takes children
  first), parent pointers never dangle. `hash` (two uint32 lanes, truncated to
  hash_bits) indexes the identity in a chained hash table
  (`buckets` heads, doubly linked by `next_in_bucket` and `prev_in_bucket`);
  lookups always compare exactly.
  """

  has_content: jax.Array  # bool[N]
  hash: jax.Array  # uint32[N, 2]
  parent: jax.Array  # int32[N]
  salt: jax.Array  # int32[N]
  tokens: jax.Array  # int32[N, block_size]
  num_hashed_tokens: jax.Array  # int32[N]: prefix length through the block
  last_accessed: jax.Array  # int32[N]
  release_time: jax.Array  # int32[N]: when the block last went to the evictor
  computed: jax.Array  # bool[N]
  buckets: jax.Array  # int32[T]: first block of each hash bucket, -1 if none
  next_in_bucket: jax.Array  # int32[N]
  prev_in_bucket: jax.Array  # int32[N]: -2 - bucket for the first block of a bucket
  release_clock: jax.Array  # int32 scalar
  num_evictable: jax.Array  # int32 scalar: blocks with content and no reference


@flax.struct.dataclass
class Pool:
  """Blocks of one device.

  Free blocks are taken in this order: never-used blocks (`next_fresh`,
  `next_fresh + 1`, ...), then the `free_stack` (last released first), then
  eviction of unreferenced blocks with content (cached pools only). The
  uncached pool starts with every block on the stack ``[0, ..., N-1]`` and no
  never-used counter, which is the uncached allocator of vLLM 0.6's block manager.
  """

  ref_count: jax.Array  # int32[N]
  free_stack: jax.Array  # int32[N]
  num_stacked: jax.Array  # int32 scalar
  next_fresh: jax.Array  # int32 scalar
  content: ContentIndex | None  # None without prefix caching or without blocks

  @property
  def num_blocks(self) -> int:
    return self.ref_count.shape[0]

  def num_free(self) -> jax.Array:
    free = self.num_blocks - self.next_fresh + self.num_stacked
    if self.content is not None:
      free = free + self.content.num_evictable
    return free


@flax.struct.dataclass
class SeqHashState:
  """Per-sequence state for content identities (prefix caching only).

  `rolling` holds two polynomial prefix-hash lanes of all tokens so far and
  the matching powers of the lane bases; `tail_tokens` holds the tokens of the
  partial last block, so a block's identity is known when it becomes full.
  """

  rolling: jax.Array  # uint32[S, 4]: (h0, h1, p0^n, p1^n)
  tail_tokens: jax.Array  # int32[S, block_size]


@flax.struct.dataclass
class BlockManagerState:
  """Everything the block manager knows. Immutable; the config is static."""

  cfg: CacheConfig = flax.struct.field(pytree_node=False)
  tables: jax.Array  # int32[S, M]: physical block per logical block, -1 if none
  num_tokens: jax.Array  # int32[S]
  device: jax.Array  # int32[S]: EMPTY, ON_GPU or ON_CPU
  salt: jax.Array  # int32[S]
  seq_hash: SeqHashState | None
  gpu: Pool
  cpu: Pool
  num_lookups: jax.Array  # int32 scalar: prefix-cache lookups in the GPU pool
  num_hits: jax.Array  # int32 scalar
  # Prefix caching follows the window rules (docs/semantics.md, "Prefix caching
  # under a window"): on a cache with a sliding window, and on every type of a
  # hybrid cache that has one. Static.
  window_rules: bool = flax.struct.field(pytree_node=False, default=False)


def _field_repr(name: str, value) -> str:
  """`name=value`, with a concrete status shown by its name (`Status.OK`)."""
  if name != "status" or isinstance(value, jax.core.Tracer):
    return f"{name}={value!r}"
  codes = np.asarray(value)
  try:
    names = [f"Status.{Status(int(code)).name}" for code in codes.ravel()]
  except ValueError:  # not a Status code
    return f"{name}={value!r}"
  if codes.ndim == 0:
    return f"{name}={names[0]}"
  return f"{name}=[{', '.join(names)}]"


class _ShowsStatus:
  """A `__repr__` that names the status: ``OpResult(status=Status.OK)``."""

  def __repr__(self):
    fields = ", ".join(_field_repr(f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
    return f"{type(self).__name__}({fields})"


@flax.struct.dataclass(repr=False)
class OpResult(_ShowsStatus):
  """Result of fork and free."""

  status: jax.Array  # int32 scalar, a Status


@flax.struct.dataclass(repr=False)
class AllocateResult(_ShowsStatus):
  """Result of allocate: the status and the prompt blocks found in the prefix cache."""

  status: jax.Array  # int32 scalar, a Status
  num_hit_blocks: jax.Array  # int32 scalar: prefix-cache hits of the call (0 if none or failed)


@flax.struct.dataclass(repr=False)
class CopyPlan(_ShowsStatus):
  """Copy-on-write pairs: copy block `src[i]` to `dst[i]` for i < count (-1 after)."""

  src: jax.Array
  dst: jax.Array
  count: jax.Array
  status: jax.Array


@flax.struct.dataclass(repr=False)
class SwapPlan(_ShowsStatus):
  """Blocks to move between devices: `src[i]` (source pool) to `dst[i]` (destination)."""

  src: jax.Array
  dst: jax.Array
  count: jax.Array
  status: jax.Array


def hash_table_size(num_blocks: int) -> int:
  """Buckets of a pool's hash table: a power of two, at least twice the blocks."""
  return max(2, 1 << (2 * max(num_blocks, 1) - 1).bit_length())


def init_pool(num_blocks: int, cfg: CacheConfig) -> Pool:
  """A pool with every block free.

  With prefix caching it has a content index, unless it has no blocks (no
  swap space, say): every leaf of the state costs a jitted call dispatch time.
  """
  i32 = lambda v: jnp.asarray(v, jnp.int32)
  if not cfg.enable_prefix_caching or num_blocks == 0:
    return Pool(
      ref_count=jnp.zeros(num_blocks, jnp.int32),
      free_stack=jnp.arange(num_blocks, dtype=jnp.int32),
      num_stacked=i32(num_blocks),
      next_fresh=i32(num_blocks),
      content=None,
    )
  content = ContentIndex(
    has_content=jnp.zeros(num_blocks, bool),
    hash=jnp.zeros((num_blocks, 2), jnp.uint32),
    parent=jnp.full(num_blocks, NO_BLOCK, jnp.int32),
    salt=jnp.zeros(num_blocks, jnp.int32),
    tokens=jnp.zeros((num_blocks, cfg.block_size), jnp.int32),
    num_hashed_tokens=jnp.zeros(num_blocks, jnp.int32),
    last_accessed=jnp.full(num_blocks, -1, jnp.int32),
    release_time=jnp.zeros(num_blocks, jnp.int32),
    computed=jnp.zeros(num_blocks, bool),
    buckets=jnp.full(hash_table_size(num_blocks), NO_BLOCK, jnp.int32),
    next_in_bucket=jnp.full(num_blocks, NO_BLOCK, jnp.int32),
    prev_in_bucket=jnp.full(num_blocks, NO_BLOCK, jnp.int32),
    release_clock=i32(0),
    num_evictable=i32(0),
  )
  return Pool(
    ref_count=jnp.zeros(num_blocks, jnp.int32),
    free_stack=jnp.full(num_blocks, NO_BLOCK, jnp.int32),
    num_stacked=i32(0),
    next_fresh=i32(0),
    content=content,
  )


def window_rules(cfg: CacheConfig) -> bool:
  """Whether a plain manager on `cfg` caches prefixes by the window rules (caching and a window)."""
  return cfg.enable_prefix_caching and cfg.sliding_window is not None


def init_state(cfg: CacheConfig, rules: bool | None = None) -> BlockManagerState:
  """An empty manager: every slot empty, every block free.

  Args:
    cfg: the cache configuration.
    rules: whether prefix caching follows the window rules (default:
      `window_rules(cfg)`; a hybrid cache with a window sets it on every type,
      its global type included, since the common hit leaves blocks without
      content there too).
  """
  max_seqs, max_blocks = cfg.max_seqs, cfg.max_blocks_per_seq
  seq_hash = None
  if cfg.enable_prefix_caching:
    seq_hash = SeqHashState(
      rolling=jnp.tile(jnp.array([0, 0, 1, 1], jnp.uint32), (max_seqs, 1)),
      tail_tokens=jnp.zeros((max_seqs, cfg.block_size), jnp.int32),
    )
  return BlockManagerState(
    cfg=cfg,
    tables=jnp.full((max_seqs, max_blocks), NO_BLOCK, jnp.int32),
    num_tokens=jnp.zeros(max_seqs, jnp.int32),
    device=jnp.zeros(max_seqs, jnp.int32),
    salt=jnp.zeros(max_seqs, jnp.int32),
    seq_hash=seq_hash,
    gpu=init_pool(cfg.num_gpu_blocks, cfg),
    cpu=init_pool(cfg.num_cpu_blocks, cfg),
    num_lookups=jnp.zeros((), jnp.int32),
    num_hits=jnp.zeros((), jnp.int32),
    window_rules=(window_rules(cfg) if rules is None else rules) and cfg.enable_prefix_caching,
  )


def init_states(cfg: CacheConfig, num_shards: int) -> BlockManagerState:
  """One empty manager state per data shard, stacked on a leading axis.

  ``jax.vmap`` of a manager operation then runs it on every shard at once.

  Args:
    cfg: the cache configuration of one shard.
    num_shards: data shards.

  Returns:
    A ``BlockManagerState`` whose arrays have a leading ``num_shards`` axis.
  """
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_shards, *x.shape)), init_state(cfg))


def on_every_shard(op):
  """``op`` run on every shard of arguments stacked on a leading shard axis.

  ``jax.vmap(op)`` for several shards. For one shard (the common case), ``op``
  itself on that shard's arguments, its results given the axis back: the same
  values, but tracing and compiling an unbatched op takes about half as long
  (gathers and scatters without a batch dimension).
  """

  def run(*args):
    if jax.tree.leaves(args)[0].shape[0] > 1:
      return jax.vmap(op)(*args)
    one = op(*jax.tree.map(lambda a: a[0], args))
    return jax.tree.map(lambda a: a[None], one)

  return run


def first_failure(*checks: tuple[Status, jax.Array]) -> jax.Array:
  """The status of the first failing check (in the order given), else OK."""
  status = jnp.int32(Status.OK)
  for code, failed in reversed(checks):
    status = jnp.where(failed, jnp.int32(code), status)
  return status
