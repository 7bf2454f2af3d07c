"""pj.checked(bm): the friendly host layer that turns status codes into exceptions."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from paged_jax.block_manager.manager import jit_op
from paged_jax.block_manager.state import EMPTY, ON_CPU, ON_GPU, BlockManagerState
from paged_jax.config import CacheConfig, Status


class PagedCacheError(Exception):
  """A block-manager call failed; the state passed in is unchanged."""


class OutOfBlocksError(PagedCacheError): ...


class SwapSpaceExhaustedError(PagedCacheError): ...


class DoubleFreeError(PagedCacheError): ...


class NotAllocatedError(PagedCacheError): ...


class AlreadyAllocatedError(PagedCacheError): ...


class WrongDeviceError(PagedCacheError): ...


class TableFullError(PagedCacheError): ...


class InvalidArgumentError(PagedCacheError, ValueError): ...


ERRORS = {
  Status.OUT_OF_BLOCKS: OutOfBlocksError,
  Status.SWAP_SPACE_EXHAUSTED: SwapSpaceExhaustedError,
  Status.DOUBLE_FREE: DoubleFreeError,
  Status.NOT_ALLOCATED: NotAllocatedError,
  Status.ALREADY_ALLOCATED: AlreadyAllocatedError,
  Status.WRONG_DEVICE: WrongDeviceError,
  Status.TABLE_FULL: TableFullError,
  Status.INVALID_ARGUMENT: InvalidArgumentError,
}

_MUTATING = ("allocate", "append_slots", "fork", "free", "swap_out", "swap_in")
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
  if op == "fork":
    ids = [int(a) for a in args[:2]]
  else:
    ids = np.atleast_1d(np.asarray(args[0])).tolist()
  real = [i for i in ids if 0 <= i < cfg.max_seqs]
  where = {EMPTY: "empty", ON_GPU: "on the GPU", ON_CPU: "on the CPU"}
  free_gpu = int(state.gpu.num_free())
  if status == Status.INVALID_ARGUMENT:
    return f"{op}: invalid arguments: {_invalid_reason(op, ids, cfg, args)}"
  if status == Status.NOT_ALLOCATED:
    seq = next(i for i in real if device[i] == EMPTY)
    return f"{op}: seq {seq} is not allocated (its slot is empty)"
  if status == Status.ALREADY_ALLOCATED:
    seq = ids[1] if op == "fork" else next(i for i in real if device[i] != EMPTY)
    return f"{op}: seq {seq} is already allocated ({num_tokens[seq]} tokens)"
  if status == Status.WRONG_DEVICE:
    wrong = ON_GPU if op == "swap_in" else ON_CPU
    seq = next(i for i in real if device[i] == wrong)
    return f"{op}: seq {seq} is {where[int(device[seq])]}, which {op} cannot use"
  if status == Status.TABLE_FULL:
    limit = cfg.max_tokens_per_seq
    return (
      f"{op}: seq {real[0] if real else ids[0]} would exceed its block table "
      f"({cfg.max_blocks_per_seq} blocks of {cfg.block_size} = {limit} tokens)"
    )
  if status == Status.OUT_OF_BLOCKS:
    seq, need = _blocks_needed(op, state, args, kwargs, real)
    return (
      f"{op}: seq {seq} needs {need} GPU blocks, {free_gpu} free (watermark {cfg.watermark_blocks})"
    )
  if status == Status.SWAP_SPACE_EXHAUSTED:
    tables = np.asarray(state.tables)[real]
    distinct = len(set(tables[tables >= 0].tolist()))
    return (
      f"{op}: seqs {real} hold {distinct} distinct GPU blocks, "
      f"{int(state.cpu.num_free())} CPU blocks free"
    )
  return f"{op}: {status.name}"


def _blocks_needed(op, state, args, kwargs, real) -> tuple[int, int]:
  """(the first sequence that needs new GPU blocks, how many the call needs in all)."""
  cfg = state.cfg
  bs = cfg.block_size
  tables = np.asarray(state.tables)
  if op == "allocate":
    return real[0], -(-int(args[2]) // bs)
  if op == "swap_in":
    held = tables[real]
    return real[0], len(set(held[held >= 0].tolist()))
  # append_slots: growth of each table, plus a copy of each shared block written into.
  counts = np.asarray(args[2]).reshape(-1)
  lookahead = kwargs.get("num_lookahead_slots", args[3] if len(args) > 3 else 0)
  ref = np.asarray(state.gpu.ref_count)
  needs = []
  for row, seq in enumerate(np.asarray(args[0]).reshape(-1).tolist()):
    if seq not in real:
      continue
    n, k = int(state.num_tokens[seq]), int(counts[row])
    held = tables[seq][tables[seq] >= 0]
    last = tables[seq][(n - 1) // bs] if n and k and n % bs else -1
    needs.append(
      (seq, max(0, -(-(n + k + lookahead) // bs) - len(held)) + int(last >= 0 and ref[last] > 1))
    )
  total = sum(need for _, need in needs)
  return next((seq for seq, need in needs if need), real[0]), total


def _invalid_reason(op, ids, cfg, args) -> str:
  bad = [i for i in ids if i != -1 and not 0 <= i < cfg.max_seqs]
  if bad:
    return f"seq id {bad[0]} is outside 0..{cfg.max_seqs - 1}"
  real = [i for i in ids if i != -1]
  if op == "fork" and ids[0] == ids[1]:
    return f"parent and child are both seq {ids[0]}"
  if len(set(real)) != len(real):
    twice = next(i for i in real if real.count(i) > 1)
    return f"seq {twice} is named twice in one call"
  if op == "allocate":
    return f"num_tokens={int(args[2])} must be in 0..{np.asarray(args[1]).size} (len(token_ids))"
  if op == "append_slots":
    k = np.asarray(args[2])
    return f"num_new={k.tolist()} must be in 0..{np.asarray(args[1]).shape[-1]} per row"
  return "see the call's arguments"
