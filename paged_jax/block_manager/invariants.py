"""check_invariants: the rules a BlockManagerState must satisfy after every call."""

from __future__ import annotations

import jax
import numpy as np

from paged_jax.block_manager.prefix_cache import bucket_of
from paged_jax.block_manager.state import EMPTY, ON_CPU, ON_GPU, BlockManagerState, Pool


def check_invariants(state: BlockManagerState) -> None:
  """Raises AssertionError naming the first broken rule (host-side, not jittable)."""
  cfg = state.cfg
  state = jax.device_get(state)  # one transfer, then NumPy
  tables = np.asarray(state.tables)
  device = np.asarray(state.device)
  num_tokens = np.asarray(state.num_tokens)
  _require(
    np.all(num_tokens >= 0) and np.all(num_tokens <= cfg.max_tokens_per_seq),
    "token counts within 0 .. max_blocks_per_seq * block_size",
  )
  empty = device == EMPTY
  _require(
    np.all(tables[empty] == -1) and np.all(num_tokens[empty] == 0),
    "empty slots hold no table and no tokens",
  )
  for name, pool, dev in (("GPU", state.gpu, ON_GPU), ("CPU", state.cpu, ON_CPU)):
    _check_pool(name, pool, tables[device == dev])


def _check_pool(name: str, pool: Pool, tables: np.ndarray) -> None:
  num_blocks = pool.num_blocks
  ref = np.asarray(pool.ref_count)
  _require(
    np.all((tables >= -1) & (tables < num_blocks)), f"{name} table entries are -1 or a block number"
  )
  for row in tables:
    held = row[row >= 0]
    _require(len(set(held.tolist())) == len(held), f"a {name} table holds each block at most once")
  refs = np.bincount(tables[tables >= 0].ravel(), minlength=num_blocks)
  bad = np.nonzero(refs != ref)[0]
  _require(
    bad.size == 0,
    f"{name} ref count equals references from tables "
    f"(block {bad[:1].tolist()} has ref {ref[bad[:1]].tolist()}, tables {refs[bad[:1]].tolist()})",
  )
  next_fresh = int(pool.next_fresh)
  stack = np.asarray(pool.free_stack)[: int(pool.num_stacked)]
  free = np.concatenate([np.arange(next_fresh, num_blocks), stack])
  _require(len(set(free.tolist())) == len(free), f"{name} free lists name each block once")
  _require(np.all(ref[free] == 0), f"{name} free blocks are unreferenced (and in no table)")
  content = pool.content
  if content is None:
    _require(
      len(free) == num_blocks - np.count_nonzero(ref), f"{name} every unreferenced block is free"
    )
    return
  has = np.asarray(content.has_content)
  _require(not np.any(has[free]), f"{name} blocks on the free lists hold no content")
  evictable = has & (ref == 0)
  _require(int(content.num_evictable) == int(evictable.sum()), f"{name} evictor count is exact")
  _require(
    len(free) + int(evictable.sum()) == num_blocks - np.count_nonzero(ref),
    f"{name} every unreferenced block is free or in the evictor",
  )
  _check_hash_table(name, content, has)
  _check_parents(name, content, has)


def _check_parents(name, content, has) -> None:
  """No cached block outlives its parent: the block of its prefix one block shorter."""
  parent = np.asarray(content.parent)[has]
  tokens = np.asarray(content.num_hashed_tokens)
  block_size = np.asarray(content.tokens).shape[1]
  first = parent < 0
  _require(
    np.all((tokens[has] == block_size) == first), f"{name} a first block has no parent, others one"
  )
  up = parent[~first]
  _require(
    np.all(has[up])
    and np.all(tokens[up] == tokens[has][~first] - block_size)
    and np.all(np.asarray(content.salt)[up] == np.asarray(content.salt)[has][~first]),
    f"{name} a cached block's parent is cached, with its salt and a prefix one block shorter",
  )


def _check_hash_table(name, content, has) -> None:
  buckets = np.asarray(content.buckets)
  next_in_bucket = np.asarray(content.next_in_bucket)
  home = np.asarray(_bucket_of(content.hash, buckets.shape[0]))
  prev_in_bucket = np.asarray(content.prev_in_bucket)
  seen = np.zeros(has.shape[0], bool)
  for bucket, head in enumerate(buckets):
    node, before = int(head), -2 - bucket
    while node >= 0:
      _require(
        has[node] and not seen[node] and home[node] == bucket,
        f"{name} hash chains hold each cached block once, in its bucket",
      )
      _require(prev_in_bucket[node] == before, f"{name} hash chains are doubly linked")
      seen[node] = True
      node, before = int(next_in_bucket[node]), node
  _require(np.array_equal(seen, has), f"{name} every cached block is in the hash table")


_bucket_of = jax.jit(bucket_of, static_argnums=1)  # one dispatch instead of a dozen eager ops


def _require(condition, rule: str) -> None:
  if not condition:
    raise AssertionError(f"invariant broken: {rule}")
