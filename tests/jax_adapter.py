"""The jitted BlockSpaceManager behind the reference model's mutable interface.

Lets one test body (and the differential property tests) drive both the
plain-Python reference and the JAX implementation. Array arguments are padded
to fixed shapes so that a jitted run compiles once per shape.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import paged_jax as pj
from paged_jax.block_manager.manager import jit_op
from paged_jax.block_manager.state import ON_CPU, ON_GPU


@functools.cache
def _compiled(cfg: pj.CacheConfig, name: str):
  return jit_op(getattr(pj.BlockSpaceManager(cfg), name))


@functools.cache
def _host_view_fn(cfg: pj.CacheConfig):
  """A jitted call that packs a state's leaves and the queries the tests compare into one
  int32 array (one transfer per state), and the shapes of those queries."""
  bm = pj.BlockSpaceManager(cfg)
  slots = np.arange(cfg.max_seqs, dtype=np.int32)

  def queries(state):
    return (
      bm.get_block_tables(state, slots),
      bm.get_num_tokens(state, slots),
      bm.num_free_gpu_blocks(state),
      bm.num_free_cpu_blocks(state),
      bm.prefix_cache_hit_rate(state),
    )

  def packed(state):
    return jnp.concatenate([_as_int32(x).ravel() for x in jax.tree.leaves((state, queries(state)))])

  return jax.jit(packed), jax.eval_shape(queries, bm.init())


def _as_int32(x):
  if x.dtype in (jnp.uint32, jnp.float32):
    return jax.lax.bitcast_convert_type(x, jnp.int32)
  return x.astype(jnp.int32)


def _unpack(packed: np.ndarray, like):
  """The pytree `like` (arrays or shapes) with its leaves read back from `packed`."""
  leaves, treedef = jax.tree.flatten(like)
  out, start = [], 0
  for leaf in leaves:
    dtype, size = np.dtype(leaf.dtype), math.prod(leaf.shape)
    chunk = packed[start : start + size].reshape(leaf.shape)
    start += size
    out.append(chunk.view(dtype) if dtype in (np.uint32, np.float32) else chunk.astype(dtype))
  return jax.tree.unflatten(treedef, out)


_DEVICES = {ON_GPU: "gpu", ON_CPU: "cpu"}


class JaxManager:
  """Mutable wrapper: holds a BlockManagerState and checks invariants after each call."""

  def __init__(
    self,
    cfg: pj.CacheConfig,
    pad_to: int = 4,
    token_pad: int | None = None,
    check: bool = True,
  ):
    self.cfg = cfg
    self.pad_to = pad_to
    self.token_pad = token_pad or cfg.max_tokens_per_seq
    self.check = check
    self.state, self._host_view = pj.BlockSpaceManager(cfg).init(), None

  def _call(self, name, *args, **kwargs):
    return _compiled(self.cfg, name)(*args, **kwargs)

  def _ids(self, seq_ids):
    ids = list(seq_ids)
    width = max(self.pad_to, len(ids))
    return np.array(ids + [-1] * (width - len(ids)), np.int32)

  def _mutate(self, name, *args, **kwargs):
    state, result = self._call(name, self.state, *args, **kwargs)
    self._set_state(state)
    return result

  def _set_state(self, state):
    self.state, self._host_view = state, None
    if self.check:
      pj.check_invariants(self._host()[0])

  def _host(self):
    """(state, compared queries) as NumPy, from one transfer per state."""
    if self._host_view is None:
      fn, query_shapes = _host_view_fn(self.cfg)
      self._host_view = _unpack(np.asarray(fn(self.state)), (self.state, query_shapes))
    return self._host_view

  # --- mutating calls
  def allocate(self, seq_ids, token_ids, num_tokens, salt=0):
    return self.allocate_counting_hits(seq_ids, token_ids, num_tokens, salt)[0]

  def allocate_counting_hits(self, seq_ids, token_ids, num_tokens, salt=0):
    tokens = list(token_ids)
    width = max(self.token_pad, len(tokens))
    padded = np.array(tokens + [0] * (width - len(tokens)), np.int32)
    # num_tokens beyond the real tokens must stay invalid after padding.
    n = num_tokens if num_tokens <= len(tokens) else width + 1
    res = self._mutate("allocate", self._ids(seq_ids), padded, np.int32(n), np.int32(salt))
    return pj.Status(int(res.status)), int(res.num_hit_blocks)

  def append_slots(self, seq_ids, new_token_ids, num_new, num_lookahead_slots=0):
    ids = self._ids(seq_ids)
    k_cols = max([len(r) for r in new_token_ids] + [1])
    tokens = np.zeros((len(ids), k_cols), np.int32)
    for i, row in enumerate(new_token_ids):
      tokens[i, : len(row)] = row
    counts = np.zeros(len(ids), np.int32)
    counts[: len(num_new)] = num_new
    plan = self._mutate(
      "append_slots", ids, tokens, counts, num_lookahead_slots=num_lookahead_slots
    )
    return pj.Status(int(plan.status)), _pairs(plan)

  def fork(self, parent_id, child_id):
    return pj.Status(int(self._mutate("fork", np.int32(parent_id), np.int32(child_id)).status))

  def free(self, seq_ids):
    return pj.Status(int(self._mutate("free", self._ids(seq_ids)).status))

  def swap_out(self, seq_ids):
    plan = self._mutate("swap_out", self._ids(seq_ids))
    return pj.Status(int(plan.status)), _pairs(plan)

  def swap_in(self, seq_ids):
    plan = self._mutate("swap_in", self._ids(seq_ids))
    return pj.Status(int(plan.status)), _pairs(plan)

  def reset(self):
    self._set_state(self._call("reset", self.state))

  def access_all_blocks_in_seq(self, seq_id, now):
    self._set_state(
      self._call("access_all_blocks_in_seq", self.state, np.int32(seq_id), np.int32(now))
    )

  def mark_blocks_as_computed(self, seq_ids, num_computed_tokens):
    ids = self._ids(seq_ids)
    if np.ndim(num_computed_tokens) == 0:
      counts = np.int32(num_computed_tokens)
    else:
      counts = np.zeros(len(ids), np.int32)
      counts[: len(num_computed_tokens)] = num_computed_tokens
    self._set_state(self._call("mark_blocks_as_computed", self.state, ids, counts))

  # --- queries
  def can_allocate(self, num_tokens):
    return pj.AllocStatus(int(self._call("can_allocate", self.state, np.int32(num_tokens))))

  def can_append_slots(self, seq_ids, num_lookahead_slots=0):
    return bool(
      self._call(
        "can_append_slots", self.state, self._ids(seq_ids), num_lookahead_slots=num_lookahead_slots
      )
    )

  def can_swap_out(self, seq_ids):
    return bool(self._call("can_swap_out", self.state, self._ids(seq_ids)))

  def can_swap_in(self, seq_ids, num_lookahead_slots=0):
    return pj.AllocStatus(
      int(
        self._call(
          "can_swap_in", self.state, self._ids(seq_ids), num_lookahead_slots=num_lookahead_slots
        )
      )
    )

  def get_common_computed_block_ids(self, seq_ids):
    ids, n = self._call("get_common_computed_block_ids", self.state, self._ids(seq_ids))
    return np.asarray(ids)[: int(n)].tolist()

  def get_block_table(self, seq_id):
    return np.asarray(self._call("get_block_table", self.state, np.int32(seq_id))).tolist()

  def get_num_tokens(self, seq_id):
    return int(self._call("get_num_tokens", self.state, np.array([seq_id], np.int32))[0])

  def get_slot_mapping(self, seq_ids, num_new, width):
    ids = self._ids(seq_ids)
    counts = np.zeros(len(ids), np.int32)
    counts[: len(num_new)] = num_new
    out = self._call("get_slot_mapping", self.state, ids, counts, width=width)
    return np.asarray(out)[: len(seq_ids)].tolist()

  def num_free_gpu_blocks(self):
    return int(self._call("num_free_gpu_blocks", self.state))

  def num_free_cpu_blocks(self):
    return int(self._call("num_free_cpu_blocks", self.state))

  def ref_counts(self, device):
    pool = {"gpu": self.state.gpu, "cpu": self.state.cpu}[device]
    return np.asarray(pool.ref_count).tolist()

  def device_of(self, seq_id):
    return _DEVICES.get(int(self._host()[0].device[seq_id]))

  def snapshot(self):
    """Tables, token counts, devices, ref counts, free counts and hit rate."""
    state, (tables, tokens, free_gpu, free_cpu, hit_rate) = self._host()
    return dict(
      tables=tables.tolist(),
      tokens=tokens.tolist(),
      devices=[_DEVICES.get(d) for d in state.device.tolist()],
      gpu_refs=state.gpu.ref_count.tolist(),
      cpu_refs=state.cpu.ref_count.tolist(),
      free=(int(free_gpu), int(free_cpu)),
      hit_rate=round(float(hit_rate), 6),
    )

  def prefix_cache_hit_rate(self):
    return float(self._call("prefix_cache_hit_rate", self.state))


def _pairs(plan):
  n = int(plan.count)
  return list(zip(np.asarray(plan.src)[:n].tolist(), np.asarray(plan.dst)[:n].tolist()))
