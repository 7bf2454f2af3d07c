"""The KV cache ops' plans and slots: their shapes, and host checks of
concrete ones.

A plan is any object with int32 fields ``src``, ``dst`` (fixed capacity,
unused entries -1) and an int32 scalar ``count`` (one per data shard for a
sharded cache's copies). `plan_arrays` and `shard_plans` check its shapes;
`check_plan` and `check_slot_mapping` check a concrete plan's entries and
slots on the host (the ops call them outside jit) and name the bad one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_plan(
  src,
  dst,
  count,
  *,
  num_src_blocks: int,
  num_dst_blocks: int,
  name: str = "plan",
  disjoint: bool = False,
) -> None:
  """Host-side check of a concrete plan (the checked path).

  Args:
    src: int32 source blocks.
    dst: int32 destination blocks.
    count: number of leading entries in use.
    num_src_blocks: blocks in the source pool.
    num_dst_blocks: blocks in the destination pool.
    name: how error messages call the plan.
    disjoint: also require that no block is both a source and a destination
      (copy plans).

  Raises:
    ValueError: naming the first bad entry: a block out of range, a
      destination used twice, a block both read and written, or a count
      outside ``0 .. capacity``.
  """
  src, dst = np.asarray(jax.device_get(src)), np.asarray(jax.device_get(dst))
  count = int(jax.device_get(count))
  if not 0 <= count <= src.shape[0]:
    raise ValueError(f"{name}: count {count} is outside 0..{src.shape[0]} (the plan's capacity)")
  src, dst = src[:count], dst[:count]
  for label, blocks, limit in (("src", src, num_src_blocks), ("dst", dst, num_dst_blocks)):
    bad = np.flatnonzero((blocks < 0) | (blocks >= limit))
    if bad.size:
      entry = bad[0]
      raise ValueError(
        f"{name} entry {entry}: {label} block {blocks[entry]} is out of range 0..{limit - 1}"
      )
  values, counts = np.unique(dst, return_counts=True)
  if (counts > 1).any():
    raise ValueError(
      f"{name}: dst block {values[counts > 1][0]} appears {counts[counts > 1][0]} times"
    )
  if disjoint:
    both = np.intersect1d(src, dst)
    if both.size:
      raise ValueError(f"{name}: block {both[0]} is both a source and a destination")


def check_slot_mapping(slot_mapping, num_slots: int) -> None:
  """Host-side check of concrete slots: each -1 or in range, none repeated.

  Args:
    slot_mapping: int32 slots.
    num_slots: ``num_gpu_blocks * block_size``.

  Raises:
    ValueError: naming the first bad slot.
  """
  slots = np.asarray(jax.device_get(slot_mapping)).reshape(-1)
  bad = np.flatnonzero((slots < -1) | (slots >= num_slots))
  if bad.size:
    raise ValueError(
      f"slot_mapping[{bad[0]}] = {slots[bad[0]]} is out of range -1..{num_slots - 1}"
    )
  written = slots[slots >= 0]
  values, counts = np.unique(written, return_counts=True)
  if (counts > 1).any():
    raise ValueError(
      f"slot {values[counts > 1][0]} is written {counts[counts > 1][0]} times in one slot_mapping"
    )


def shard_plans(plan, num_shards: int):
  """``src``, ``dst`` ``[num_shards, K]`` and ``count`` ``[num_shards]`` of
  one plan (one shard) or of the plans of ``num_shards`` data shards."""
  if jnp.ndim(plan.src) == 1:
    if num_shards > 1:
      raise ValueError(
        f"a cache of {num_shards} data shards needs one copy plan per shard "
        f"([{num_shards}, K] src and dst), got {jnp.shape(plan.src)}"
      )
    return tuple(a[None] for a in plan_arrays(plan))
  return plan_arrays(plan, (num_shards,))


def plan_arrays(plan, shards: tuple[int, ...] = ()):
  """The plan's arrays, checked to be int32 ``src``, ``dst`` ``[*shards,
  capacity]`` and ``count`` ``[*shards]``."""
  src, dst = jnp.asarray(plan.src), jnp.asarray(plan.dst)
  count = jnp.asarray(plan.count)
  rows = "".join(f"{size}, " for size in shards)
  for name, array in (("src", src), ("dst", dst)):
    if (
      array.ndim != len(shards) + 1
      or array.shape[: len(shards)] != shards
      or array.dtype != jnp.int32
    ):
      raise ValueError(
        f"plan.{name} must be int32[{rows}capacity], got {array.dtype}{list(array.shape)}"
      )
  if src.shape != dst.shape:
    raise ValueError(f"plan.src {src.shape} and plan.dst {dst.shape} differ")
  if count.shape != shards or count.dtype != jnp.int32:
    kind = f"int32[{rows[:-2]}]" if shards else "an int32 scalar"
    raise ValueError(f"plan.count must be {kind}, got {count.dtype}{list(count.shape)}")
  return src, dst, count
