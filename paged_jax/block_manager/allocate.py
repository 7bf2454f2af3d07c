"""Ops that give and take whole tables: allocate, fork, fork_each, free and reset."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from paged_jax.block_manager import prefix_cache
from paged_jax.block_manager.arguments import check_ids, int_array, int_scalar, seq_id_array
from paged_jax.block_manager.commit import (
  commit,
  keeps_content,
  lost_by_takes,
  pool_of,
  revived_hits,
  with_pool,
)
from paged_jax.block_manager.pool import masked, plan_takes, scatter_count
from paged_jax.block_manager.state import (
  EMPTY,
  NO_BLOCK,
  ON_CPU,
  ON_GPU,
  AllocateResult,
  BlockManagerState,
  OpResult,
  first_failure,
)
from paged_jax.block_manager.tables import ceil_div, first_live_block, set_rows
from paged_jax.config import Status

i32 = jnp.int32


def allocate(state: BlockManagerState, seq_ids, token_ids, num_tokens, salt=0):
  """Gives every sequence of a group the table of one prompt of `num_tokens` tokens.

  With prefix caching, each full block of the prompt is looked up once for the
  group: a hit shares the cached block, a miss takes a block and registers its
  content. Each block gains one reference per sequence of the group. Under a
  sliding window (docs/semantics.md, "Prefix caching under a window") a hit
  whose entry is dead is counted but not held, and a miss is registered only
  under a parent with content.

  Args:
    state: the manager state.
    seq_ids: int32[B] the group's slots, -1 for padding (all padding: a no-op).
    token_ids: int32[T] the prompt, padded to any length.
    num_tokens: int32 scalar, how many of `token_ids` are the prompt.
    salt: int32 scalar; blocks are shared by content only within a salt.

  Returns:
    (new state, AllocateResult): `status` is OK or the first of
    INVALID_ARGUMENT (bad or repeated id, `num_tokens` outside 0..T),
    ALREADY_ALLOCATED, TABLE_FULL, OUT_OF_BLOCKS; `num_hit_blocks` counts the
    prompt blocks found in the cache (0 without caching or on failure). A
    failed call returns the state unchanged.

  Raises:
    ValueError: an argument of a non-integer dtype or the wrong rank (static).
  """
  return allocate_capped(state, seq_ids, token_ids, num_tokens, salt)


class _PromptChain(NamedTuple):
  """A prompt's full-block identities and the cached chain of them from block 0."""

  prompt: jax.Array  # int32[M * block_size]: the prompt, zero past its end
  rolling: jax.Array  # uint32[4]: its rolling hash state
  hashes: jax.Array  # uint32[M, 2]
  block_tokens: jax.Array  # int32[M, block_size]
  full: jax.Array  # bool[M]: full blocks of the prompt
  ends: jax.Array  # int32[M]: prefix length through each block
  hit: jax.Array  # bool[M]: the cached chain (a prefix of `full`)
  hit_block: jax.Array  # int32[M]: its blocks (-1 past it)


def _prompt_chain(state: BlockManagerState, token_ids, prompt_len, salt) -> _PromptChain:
  """Hashes a prompt's full blocks and looks the chain up in the GPU pool (nothing counted)."""
  cfg = state.cfg
  block_size, max_blocks = cfg.block_size, cfg.max_blocks_per_seq
  j = jnp.arange(max_blocks, dtype=i32)
  prompt = jnp.zeros(max_blocks * block_size, i32)
  prompt = prompt.at[: token_ids.shape[0]].set(token_ids[: max_blocks * block_size])
  prompt = jnp.where(jnp.arange(max_blocks * block_size) < prompt_len, prompt, 0)
  block_ends, rolling = prefix_cache.prompt_hashes(prompt, prompt_len, block_size)
  ends = (j + 1) * block_size
  full = ends <= prompt_len
  hashes = prefix_cache.identity_hash(block_ends, salt, ends, cfg.hash_bits)
  block_tokens = prompt.reshape(max_blocks, block_size)
  hit, hit_block = prefix_cache.lookup_chains(
    state.gpu.content,
    hashes[None],
    block_tokens[None],
    salt[None],
    jnp.array([NO_BLOCK], i32),
    full[None],
  )
  return _PromptChain(prompt, rolling, hashes, block_tokens, full, ends, hit[0], hit_block[0])


def served_blocks(state: BlockManagerState, token_ids, num_tokens, salt=0) -> jax.Array:
  """int32 scalar: the leading full blocks of a prompt that the GPU pool has cached.

  No lookup is counted; 0 without prefix caching. A hybrid cache's `allocate`
  takes the smallest answer of its types as the common hit.
  """
  if not state.cfg.enable_prefix_caching:
    return i32(0)
  token_ids = int_array("token_ids", token_ids, (None,))
  prompt_len, salt = int_scalar("num_tokens", num_tokens), int_scalar("salt", salt)
  return jnp.sum(_prompt_chain(state, token_ids, prompt_len, salt).hit).astype(i32)


def allocate_capped(
  state: BlockManagerState, seq_ids, token_ids, num_tokens, salt=0, max_hit_blocks=None
):
  """`allocate`, taking at most `max_hit_blocks` leading blocks from the cache.

  The hybrid's common hit (docs/semantics.md): blocks the pool has cached past
  the cap are taken fresh and not registered (the cached ones keep the
  identity), and nothing after them is registered. Every full block still
  counts one lookup. A cap needs the window rules (`state.window_rules`).

  Args:
    state, seq_ids, token_ids, num_tokens, salt: as `allocate`.
    max_hit_blocks: int32 scalar, or None for no cap.
  """
  cfg = state.cfg
  block_size, max_blocks = cfg.block_size, cfg.max_blocks_per_seq
  rules = state.window_rules
  if max_hit_blocks is not None and not rules:
    raise ValueError("allocate: max_hit_blocks needs a state with the window rules")
  seq_ids = seq_id_array(seq_ids)
  token_ids = int_array("token_ids", token_ids, (None,))
  prompt_len, salt = int_scalar("num_tokens", num_tokens), int_scalar("salt", salt)
  real, safe, bad_ids = check_ids(seq_ids, cfg.max_seqs)
  group_size = jnp.sum(real).astype(i32)
  invalid = bad_ids | (prompt_len < 0) | (prompt_len > token_ids.shape[0])
  already = jnp.any(real & (state.device[safe] != EMPTY))
  table_full = ceil_div(prompt_len, block_size) > max_blocks
  j = jnp.arange(max_blocks, dtype=i32)
  first_live = first_live_block(cfg, prompt_len)
  live = (j >= first_live) & (j < ceil_div(prompt_len, block_size)) & (group_size > 0)
  gpu = state.gpu
  hit = jnp.zeros(max_blocks, bool)
  hit_block = jnp.full(max_blocks, NO_BLOCK, i32)
  if cfg.enable_prefix_caching:
    chain = _prompt_chain(state, token_ids, prompt_len, salt)
    full = chain.full & (group_size > 0)
    hit, hit_block = chain.hit & full, jnp.where(full, chain.hit_block, NO_BLOCK)
  chain_len = jnp.sum(hit).astype(i32)
  if max_hit_blocks is not None:
    hit = hit & (j < int_scalar("max_hit_blocks", max_hit_blocks))
  held = hit & live if rules else hit  # a dead entry's hit is passed through, not held
  need_take = live & ~held
  # One chain: its hit blocks are distinct.
  pins = jnp.where(held, hit_block, NO_BLOCK)
  takes = plan_takes(gpu, need_take, pins, revived_hits(gpu, pins, distinct=True))
  status = first_failure(
    (Status.INVALID_ARGUMENT, invalid),
    (Status.ALREADY_ALLOCATED, already),
    (Status.TABLE_FULL, table_full),
    (Status.OUT_OF_BLOCKS, takes.exceed(gpu)),
  )
  ok = (status == Status.OK) & (group_size > 0)
  num_hit_blocks = jnp.where(ok, jnp.sum(hit), 0).astype(i32)
  row = jnp.where(held, hit_block, takes.block_of(need_take))
  lost = lost_by_takes(state, gpu, takes)
  registrations = None
  if cfg.enable_prefix_caching:
    registered = need_take & full
    if rules:
      registered &= (j >= chain_len) & _chain_continues(
        gpu, chain_len, hit, hit_block, lost, first_live
      )
    registrations = prefix_cache.Registrations(
      blocks=jnp.where(registered, row, NO_BLOCK),
      hash=chain.hashes,
      parent=jnp.concatenate([jnp.array([NO_BLOCK], i32), row[:-1]]),
      salt=jnp.broadcast_to(salt, (max_blocks,)),
      tokens=chain.block_tokens,
      num_hashed_tokens=chain.ends,
    )
  state = commit(
    state,
    True,
    ok,
    gains=row,
    gain_weight=group_size,
    releases=jnp.zeros(0, i32),
    takes=takes,
    registrations=registrations,
    lost=lost,
  )
  keep = real & ok
  state = state.replace(
    tables=set_rows(state.tables, safe, keep, row[None]),
    num_tokens=set_rows(state.num_tokens, safe, keep, prompt_len),
    device=set_rows(state.device, safe, keep, ON_GPU),
    salt=set_rows(state.salt, safe, keep, salt),
  )
  if cfg.enable_prefix_caching:
    tail_start = (prompt_len // block_size) * block_size
    tail = jnp.where(
      jnp.arange(block_size) < prompt_len - tail_start,
      jax.lax.dynamic_slice(jnp.pad(chain.prompt, (0, block_size)), (tail_start,), (block_size,)),
      0,
    )
    seq_hash = state.seq_hash
    state = state.replace(
      seq_hash=seq_hash.replace(
        rolling=set_rows(seq_hash.rolling, safe, keep, chain.rolling),
        tail_tokens=set_rows(seq_hash.tail_tokens, safe, keep, tail[None]),
      ),
      num_lookups=state.num_lookups + jnp.where(ok, jnp.sum(full), 0),
      num_hits=state.num_hits + num_hit_blocks,
    )
  return state, AllocateResult(status=status, num_hit_blocks=num_hit_blocks)


def _chain_continues(pool, chain_len, hit, hit_block, lost, first_live) -> jax.Array:
  """Whether the misses after a prompt's cached chain are registered (window rules).

  The first miss, block `chain_len`, is registered when it is block 0, or
  when the entry before it holds the chain's last block (live, taken from
  the cache, not past the cap) and that block keeps its content through the
  call's evictions; each later miss then has its parent registered before it.
  """
  last = jnp.maximum(chain_len - 1, 0)
  parent_kept = (
    (chain_len - 1 >= first_live)
    & (jnp.sum(hit) == chain_len)
    & keeps_content(pool, hit_block[last], lost)
  )
  return jnp.where(chain_len == 0, first_live == 0, parent_kept)


def fork(state: BlockManagerState, parent_id, child_id):
  """Gives the child the parent's table, token count, salt and device.

  Each block of the table gains one reference, in the pool where it lives (a
  swapped-out parent can be forked). Never takes a block.

  Args:
    state: the manager state.
    parent_id: int32 scalar slot.
    child_id: int32 scalar slot.

  Returns:
    (new state, OpResult): status OK or the first of INVALID_ARGUMENT (an id
    out of range, parent == child), NOT_ALLOCATED (the parent),
    ALREADY_ALLOCATED (the child); a failed call changes nothing.

  Raises:
    ValueError: an id that is not an integer scalar (static).
  """
  max_seqs = state.cfg.max_seqs
  parent, child = (
    jnp.where(slot < 0, max_seqs, slot)[None]  # -1 is an id here, not padding
    for slot in (int_scalar("parent_id", parent_id), int_scalar("child_id", child_id))
  )
  return fork_each(state, parent, child)


def fork_each(state: BlockManagerState, parent_ids, child_ids):
  """`fork` of every pair at once: child `i` gets parent `i`'s table.

  Parents are read before any child is written. A parent may have several
  children (beams forking); a child may not be a parent of the same call.

  Args:
    state: the manager state.
    parent_ids: int32[K] slots, -1 where the pair is padding.
    child_ids: int32[K] slots, -1 exactly where `parent_ids` is.

  Returns:
    (new state, OpResult): status OK or the first of INVALID_ARGUMENT (an id
    out of range, padding in one id of a pair only, a repeated child, a child
    that is also a parent), NOT_ALLOCATED (a parent), ALREADY_ALLOCATED (a
    child); a failed call changes nothing.

  Raises:
    ValueError: ids that are not 1-D integer arrays of one length (static).
  """
  max_seqs = state.cfg.max_seqs
  parents = int_array("parent_ids", parent_ids, (None,))
  children = int_array("child_ids", child_ids, parents.shape)
  padding = parents == NO_BLOCK
  out_of_range = lambda ids: ~padding & ((ids < 0) | (ids >= max_seqs))
  parent_slot = jnp.clip(parents, 0, max_seqs - 1)
  child_slot = jnp.clip(children, 0, max_seqs - 1)
  child_count = scatter_count(jnp.where(padding, NO_BLOCK, children), max_seqs)
  parent_count = scatter_count(jnp.where(padding, NO_BLOCK, parents), max_seqs)
  invalid = jnp.any(
    out_of_range(parents)
    | out_of_range(children)
    | (padding != (children == NO_BLOCK))
    | (~padding & (parent_count[child_slot] > 0))
  ) | jnp.any(child_count > 1)
  status = first_failure(
    (Status.INVALID_ARGUMENT, invalid),
    (Status.NOT_ALLOCATED, jnp.any(~padding & (state.device[parent_slot] == EMPTY))),
    (Status.ALREADY_ALLOCATED, jnp.any(~padding & (state.device[child_slot] != EMPTY))),
  )
  keep = ~padding & (status == Status.OK)
  rows = state.tables[parent_slot]
  for on_gpu, device in ((True, ON_GPU), (False, ON_CPU)):
    pool = pool_of(state, on_gpu)
    here = keep & (state.device[parent_slot] == device)
    gains = masked(rows, here[:, None] & (rows >= 0), pool.num_blocks)
    pool = pool.replace(ref_count=pool.ref_count.at[gains.reshape(-1)].add(1, mode="drop"))
    state = with_pool(state, on_gpu, pool)
  copy_rows = lambda array: set_rows(array, child_slot, keep, array[parent_slot])
  state = state.replace(
    tables=copy_rows(state.tables),
    num_tokens=copy_rows(state.num_tokens),
    device=copy_rows(state.device),
    salt=copy_rows(state.salt),
  )
  if state.seq_hash is not None:
    seq_hash = state.seq_hash
    state = state.replace(
      seq_hash=seq_hash.replace(
        rolling=copy_rows(seq_hash.rolling), tail_tokens=copy_rows(seq_hash.tail_tokens)
      )
    )
  return state, OpResult(status=status)


def free(state: BlockManagerState, seq_ids):
  """Releases every block of each sequence (last entry first); the slots become empty.

  Works on the GPU and on the CPU; a released block with content goes to the
  evictor, one without to the free stack.

  Args:
    state: the manager state.
    seq_ids: int32[B] slots, -1 for padding.

  Returns:
    (new state, OpResult): status OK or the first of INVALID_ARGUMENT (bad or
    repeated id), NOT_ALLOCATED (an empty slot); a failed call changes nothing.

  Raises:
    ValueError: `seq_ids` is not a 1-D integer array (static).
  """
  seq_ids = seq_id_array(seq_ids)
  real, safe, invalid = check_ids(seq_ids, state.cfg.max_seqs)
  devices = state.device[safe]
  status = first_failure(
    (Status.INVALID_ARGUMENT, invalid), (Status.NOT_ALLOCATED, jnp.any(real & (devices == EMPTY)))
  )
  ok = status == Status.OK
  rows = state.tables[safe][:, ::-1]
  for on_gpu, device in ((True, ON_GPU), (False, ON_CPU)):
    releases = jnp.where((real & (devices == device))[:, None], rows, NO_BLOCK).ravel()
    state = commit(state, on_gpu, ok, gains=jnp.zeros(0, i32), releases=releases)
  return _clear_slots(state, safe, real & ok), OpResult(status=status)


def _clear_slots(state: BlockManagerState, slots: jax.Array, keep: jax.Array):
  """Empties the slots where `keep`: no table, no tokens, no salt, a fresh hash state."""
  state = state.replace(
    tables=set_rows(state.tables, slots, keep, NO_BLOCK),
    num_tokens=set_rows(state.num_tokens, slots, keep, 0),
    device=set_rows(state.device, slots, keep, EMPTY),
    salt=set_rows(state.salt, slots, keep, 0),
  )
  if state.seq_hash is not None:
    seq_hash = state.seq_hash
    state = state.replace(
      seq_hash=seq_hash.replace(
        rolling=set_rows(seq_hash.rolling, slots, keep, jnp.array([0, 0, 1, 1], jnp.uint32)),
        tail_tokens=set_rows(seq_hash.tail_tokens, slots, keep, 0),
      )
    )
  return state


def reset(state: BlockManagerState) -> BlockManagerState:
  """Frees every occupied slot in slot order; cached content and counters stay."""
  slots = jnp.arange(state.cfg.max_seqs, dtype=i32)
  state, _ = free(state, jnp.where(state.device != EMPTY, slots, NO_BLOCK))
  return state
