"""pj.checked(bm): the friendly host layer that turns status codes into exceptions."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from paged_jax.block_manager.arguments import jit_op
from paged_jax.block_manager.state import EMPTY, ON_CPU, ON_GPU, BlockManagerState
from paged_jax.config import CacheConfig, Status


class PagedCacheError(Exception):
  """A block-manager call failed; the state passed in is unchanged."""


class OutOfBlocksError(PagedCacheError): ...


class SwapSpaceExhaustedError(PagedCacheError): ...


class NotAllocatedError(PagedCacheError): ...


class AlreadyAllocatedError(PagedCacheError): ...


class WrongDeviceError(PagedCacheError): ...


class TableFullError(PagedCacheError): ...


class InvalidArgumentError(PagedCacheError, ValueError): ...


# DOUBLE_FREE has no exception: only the pool layer's `release` reports it, and no op of
# the manager releases a block more often than its tables reference it.
ERRORS = {
  Status.OUT_OF_BLOCKS: OutOfBlocksError,
  Status.SWAP_SPACE_EXHAUSTED: SwapSpaceExhaustedError,
  Status.NOT_ALLOCATED: NotAllocatedError,
  Status.ALREADY_ALLOCATED: AlreadyAllocatedError,
  Status.WRONG_DEVICE: WrongDeviceError,
  Status.TABLE_FULL: TableFullError,
  Status.INVALID_ARGUMENT: InvalidArgumentError,
}

_MUTATING = ("allocate", "append_slots", "fork", "fork_each", "free", "swap_out", "swap_in")
_ID_QUERIES = ("get_block_table", "get_block_tables", "get_num_tokens", "get_slot_mapping")


class CheckedBlockSpaceManager:
  """The methods of a BlockSpaceManager, jitted, on host values; failures raise.

  A failing call raises a `PagedCacheError` subclass whose message names the
  sequence, the blocks and the numbers involved; the state you passed stays
  valid and unchanged (states are immutable). Arguments of the wrong dtype or
  shape, a state built from another `CacheConfig`, and (for the table and
  slot queries) an out-of-range id raise `InvalidArgumentError`.
  """

  def __init__(self, bm):
    self.bm = bm

  def __getattr__(self, name):
    method = getattr(self.bm, name)
    if not callable(method) or name.startswith("_") or name == "init":
      return method
    jitted = _jitted(self.bm, name)

    @functools.wraps(method)
    def call(state, *args, **kwargs):
      _check_state(name, state, self.bm.cfg)
      if name in _ID_QUERIES:
        _check_query_ids(
          name, state.cfg, args[0] if args else kwargs.get("seq_ids", kwargs.get("seq_id"))
        )
      try:
        out = jitted(state, *args, **kwargs)
      except ValueError as error:  # a dtype, shape or static argument, found at trace time
        raise InvalidArgumentError(f"{name}: {error}") from None
      if name not in _MUTATING:
        return out
      new_state, result = out
      status = Status(int(result.status))
      if status != Status.OK:
        raise ERRORS[status](describe_failure(name, status, state, args, kwargs))
      return new_state, result

    return call


@functools.cache
def _jitted(bm, name: str):
  return jit_op(getattr(bm, name))


def checked(bm) -> CheckedBlockSpaceManager:
  """Wraps a BlockSpaceManager so that failures raise instead of returning a status."""
  return CheckedBlockSpaceManager(bm)


def _check_state(op: str, state, cfg: CacheConfig) -> None:
  """InvalidArgumentError unless `state` is a BlockManagerState built from `cfg`."""
  if not isinstance(state, BlockManagerState):
    raise InvalidArgumentError(
      f"{op}: state must be a BlockManagerState, got {type(state).__name__}"
    )
  if state.cfg != cfg:
    differ = ", ".join(
      f"{f.name}={getattr(state.cfg, f.name)!r} (state) vs {getattr(cfg, f.name)!r} (manager)"
      for f in dataclasses.fields(cfg)
      if getattr(state.cfg, f.name) != getattr(cfg, f.name)
    )
    raise InvalidArgumentError(f"{op}: the state was built from another CacheConfig: {differ}")


def _check_query_ids(op: str, cfg: CacheConfig, seq_ids) -> None:
  """InvalidArgumentError for an id outside 0..max_seqs-1 (-1 is padding in an array)."""
  ids = np.asarray(seq_ids)
  padding = ids == -1 if ids.ndim else np.zeros((), bool)
  bad = ids[~padding & ((ids < 0) | (ids >= cfg.max_seqs))]
  if bad.size:
    raise InvalidArgumentError(
      f"{op}: seq id {int(bad.ravel()[0])} is outside 0..{cfg.max_seqs - 1}"
    )


def describe_failure(op: str, status: Status, state: BlockManagerState, args, kwargs) -> str:
  """A message that names the sequence, the block and the numbers of a failed call."""
  cfg = state.cfg
  device = np.asarray(state.device)
  num_tokens = np.asarray(state.num_tokens)
  parents, children = _parents_and_children(op, args, kwargs)
  if op in ("fork", "fork_each"):
    ids = parents + children
  else:
    ids = np.atleast_1d(np.asarray(_argument(args, kwargs, 0, "seq_ids"))).tolist()
  real = [seq for seq in ids if 0 <= seq < cfg.max_seqs]
  where = {EMPTY: "empty", ON_GPU: "on the GPU", ON_CPU: "on the CPU"}
  if status == Status.INVALID_ARGUMENT:
    reason = _invalid_reason(op, ids, cfg, args, kwargs, parents, children)
    return f"{op}: invalid arguments: {reason}"
  if status == Status.NOT_ALLOCATED:
    candidates = [seq for seq in parents if seq in real] if parents else real
    seq = next(seq for seq in candidates if device[seq] == EMPTY)
    return f"{op}: seq {seq} is not allocated (its slot is empty)"
  if status == Status.ALREADY_ALLOCATED:
    candidates = [seq for seq in children if seq in real] if children else real
    seq = next(seq for seq in candidates if device[seq] != EMPTY)
    return f"{op}: seq {seq} is already allocated ({num_tokens[seq]} tokens)"
  if status == Status.WRONG_DEVICE:
    wrong = ON_GPU if op == "swap_in" else ON_CPU
    seq = next(seq for seq in real if device[seq] == wrong)
    return f"{op}: seq {seq} is {where[int(device[seq])]}, which {op} cannot use"
  if status == Status.TABLE_FULL:
    limit = cfg.max_tokens_per_seq
    return (
      f"{op}: seq {real[0] if real else ids[0]} would exceed its block table "
      f"({cfg.max_blocks_per_seq} blocks of {cfg.block_size} = {limit} tokens)"
    )
  if status == Status.OUT_OF_BLOCKS:
    seq, need = _blocks_needed(op, state, args, kwargs, real)
    free_gpu = int(state.gpu.num_free())
    return (
      f"{op}: seq {seq} needs {need} GPU blocks, {free_gpu} free (watermark {cfg.watermark_blocks})"
    )
  # SWAP_SPACE_EXHAUSTED, the last status a mutating op returns.
  tables = np.asarray(state.tables)[real]
  distinct = len(set(tables[tables >= 0].tolist()))
  return (
    f"{op}: seqs {real} hold {distinct} distinct GPU blocks, "
    f"{int(state.cpu.num_free())} CPU blocks free"
  )


def _argument(args, kwargs, index: int, name: str):
  """The call's argument `name`, passed as positional argument `index` or by keyword."""
  return args[index] if len(args) > index else kwargs[name]


def _parents_and_children(op: str, args, kwargs) -> tuple[list[int], list[int]]:
  """The parent and child ids of a fork or fork_each call, padding included ([] otherwise)."""
  if op == "fork":
    return [int(_argument(args, kwargs, 0, "parent_id"))], [
      int(_argument(args, kwargs, 1, "child_id"))
    ]
  if op == "fork_each":
    return (
      np.asarray(_argument(args, kwargs, 0, "parent_ids")).reshape(-1).tolist(),
      np.asarray(_argument(args, kwargs, 1, "child_ids")).reshape(-1).tolist(),
    )
  return [], []


def _blocks_needed(op, state, args, kwargs, real) -> tuple[int, int]:
  """(the first sequence that needs new GPU blocks, how many the call needs in all)."""
  cfg = state.cfg
  block_size = cfg.block_size
  tables = np.asarray(state.tables)
  if op == "allocate":
    return real[0], -(-int(_argument(args, kwargs, 2, "num_tokens")) // block_size)
  if op == "swap_in":
    held = tables[real]
    return real[0], len(set(held[held >= 0].tolist()))
  # append_slots: growth of each table, plus a copy of each shared block written into.
  counts = np.asarray(_argument(args, kwargs, 2, "num_new")).reshape(-1)
  lookahead = kwargs.get("num_lookahead_slots", args[3] if len(args) > 3 else 0)
  ref = np.asarray(state.gpu.ref_count)
  needs = []
  seq_ids = np.asarray(_argument(args, kwargs, 0, "seq_ids")).reshape(-1).tolist()
  for row, seq in enumerate(seq_ids):
    if seq not in real:
      continue
    seq_len, num_new = int(state.num_tokens[seq]), int(counts[row])
    held = tables[seq][tables[seq] >= 0]
    last = (
      tables[seq][(seq_len - 1) // block_size]
      if seq_len and num_new and seq_len % block_size
      else -1
    )
    growth = max(0, -(-(seq_len + num_new + lookahead) // block_size) - len(held))
    needs.append((seq, growth + int(last >= 0 and ref[last] > 1)))
  total = sum(need for _, need in needs)
  return next((seq for seq, need in needs if need), real[0]), total


def _invalid_reason(op, ids, cfg, args, kwargs, parents, children) -> str:
  """Why a call's arguments are INVALID_ARGUMENT, in the order the op checks them."""
  bad = [seq for seq in ids if seq != -1 and not 0 <= seq < cfg.max_seqs]
  if bad:
    return f"seq id {bad[0]} is outside 0..{cfg.max_seqs - 1}"
  if op == "fork" and ids[0] == ids[1]:
    return f"parent and child are both seq {ids[0]}"
  if op == "fork_each":
    return _invalid_pairs(parents, children)
  real = [seq for seq in ids if seq != -1]
  if len(set(real)) != len(real):
    twice = next(seq for seq in real if real.count(seq) > 1)
    return f"seq {twice} is named twice in one call"
  if op == "allocate":
    num_tokens = int(_argument(args, kwargs, 2, "num_tokens"))
    token_ids = np.asarray(_argument(args, kwargs, 1, "token_ids"))
    return f"num_tokens={num_tokens} must be in 0..{token_ids.size} (len(token_ids))"
  if op == "append_slots":
    num_new = np.asarray(_argument(args, kwargs, 2, "num_new"))
    new_token_ids = np.asarray(_argument(args, kwargs, 1, "new_token_ids"))
    return f"num_new={num_new.tolist()} must be in 0..{new_token_ids.shape[-1]} per row"
  return "see the call's arguments"


def _invalid_pairs(parents: list[int], children: list[int]) -> str:
  """Why fork_each's pairs are invalid (ids already known to be in range or -1)."""
  for parent, child in zip(parents, children):
    if (parent == -1) != (child == -1):
      return f"pair (parent {parent}, child {child}) pads only one id (-1 must pad both)"
  real_children = [child for child in children if child != -1]
  twice = [child for child in real_children if real_children.count(child) > 1]
  if twice:
    return f"seq {twice[0]} is a child twice in one call"
  return (
    f"seq {next(child for child in real_children if child in parents)} is both a parent and a child"
  )
