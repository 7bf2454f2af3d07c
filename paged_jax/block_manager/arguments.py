"""Arguments of the block-manager ops: static checks on the host, id checks under jit.

Host-side checks (dtype, rank, static ints) raise ValueError at trace time.
The id checks run under jit and feed a call's status: padding (-1) is skipped,
an id out of range or named twice makes the call INVALID_ARGUMENT.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.block_manager.pool import scatter_count
from paged_jax.block_manager.state import NO_BLOCK, BlockManagerState

i32 = jnp.int32


def static_args(*names: str):
  """Declares an op's static arguments (`jax.jit`'s `static_argnames`) beside it."""

  def mark(op):
    op.static_argnames = names
    return op

  return mark


def jit_op(op):
  """`jax.jit` of a block-manager op, with the static arguments it declares."""
  return jax.jit(op, static_argnames=getattr(op, "static_argnames", ()))


def int_array(name: str, value, shape: tuple) -> jax.Array:
  """`value` as an int32 array, after checking its static dtype and shape.

  Args:
    name: the argument's name, for the message.
    value: an integer array (or Python ints).
    shape: the expected shape; None for a dimension of any size.

  Returns:
    The int32 array.

  Raises:
    ValueError: naming the argument, when its dtype is not an integer type
      (a float would be truncated) or its shape is not `shape`.
  """
  array = jnp.asarray(value)
  if not jnp.issubdtype(array.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got dtype {array.dtype}")
  if array.ndim != len(shape) or any(
    want not in (None, got) for want, got in zip(shape, array.shape)
  ):
    raise ValueError(f"{name} must have shape {_dims(shape)}, got {_dims(array.shape)}")
  return array.astype(i32)


def _dims(shape) -> str:
  """A shape as text, `n` for any size: [4, n]."""
  return "[" + ", ".join("n" if size is None else str(size) for size in shape) + "]"


def seq_id_array(seq_ids) -> jax.Array:
  """int32[B] sequence ids (-1 padding); ValueError unless a 1-D integer array."""
  return int_array("seq_ids", seq_ids, (None,))


def int_scalar(name: str, value) -> jax.Array:
  """An int32 scalar; ValueError unless an integer scalar."""
  return int_array(name, value, ())


def static_lookahead(num_lookahead_slots) -> int:
  """`num_lookahead_slots`, checked to be a static Python int >= 0 (ValueError if not)."""
  if not isinstance(num_lookahead_slots, int) or num_lookahead_slots < 0:
    raise ValueError(
      f"num_lookahead_slots must be a static Python int >= 0, got {num_lookahead_slots!r}"
    )
  return num_lookahead_slots


def check_ids(ids: jax.Array, num_slots: int):
  """Splits a call's ids into real ones and padding, and finds invalid ones.

  Args:
    ids: int32[B] slot ids, -1 for padding.
    num_slots: how many slots there are.

  Returns:
    (real bool[B], safe int32[B] ids clipped into range, invalid bool scalar):
    padding is neither real nor invalid; an id out of range or named twice
    is invalid.
  """
  padding = ids == NO_BLOCK
  out_of_range = ~padding & ((ids < 0) | (ids >= num_slots))
  real = ~padding & ~out_of_range
  safe = jnp.clip(ids, 0, num_slots - 1)
  twice = jnp.any(scatter_count(jnp.where(real, ids, NO_BLOCK), num_slots) > 1)
  return real, safe, jnp.any(out_of_range) | twice


def refuses(state: BlockManagerState, seq_ids: jax.Array, device: int) -> jax.Array:
  """Whether an op that needs `device` refuses the group (bool scalar).

  It does for INVALID_ARGUMENT, NOT_ALLOCATED or WRONG_DEVICE: a bad or
  repeated id, or a real id whose sequence is not on `device`.
  """
  real, safe, invalid = check_ids(seq_ids, state.cfg.max_seqs)
  return invalid | jnp.any(real & (state.device[safe] != device))
