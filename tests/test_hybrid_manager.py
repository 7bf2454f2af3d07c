"""The hybrid block manager (one state per attention type) against its reference.

Random operation sequences run on `HybridBlockSpaceManager` (jitted) and on
`tests.reference.hybrid.ReferenceHybridManager`; after every operation they
must report the same statuses, failing types, plans per type, hit counts,
admission answers and slot mappings, and hold the same tables, reference
counts, free counts, token counts and devices in every type. The jitted
state must satisfy every type's invariants, and a sliding type must hold at
most ``ceil(w / block_size) + 1`` blocks per sequence plus its lookahead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.block_manager import hybrid
from paged_jax.block_manager.arguments import jit_op
from paged_jax.block_manager.hybrid import HybridBlockSpaceManager, HybridCacheConfig
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.state import ON_CPU, ON_GPU
from paged_jax.config import AllocStatus, CacheConfig, Status
from tests.reference.hybrid import ReferenceHybridManager

EXAMPLES = int(os.environ.get("PAGED_JAX_PROPERTY_EXAMPLES", "6"))
COLUMNS = 4
PAD = 4
LOOKAHEAD = 2

_BASE = CacheConfig(
  block_size=2, num_gpu_blocks=14, num_cpu_blocks=8, max_seqs=5, max_blocks_per_seq=6,
  watermark=0.1,
)  # fmt: skip

CONFIGS = {
  # Gemma-shaped: sliding layers and a global one, the sliding pool the tighter.
  "gemma": HybridCacheConfig(_BASE, (3, 3, None), gpu_blocks=(14, 7), cpu_blocks=(8, 4)),
  # Two windows and no global layer.
  "two_windows": HybridCacheConfig(
    dataclasses.replace(_BASE, watermark=0.0), (2, 5, 2), gpu_blocks=(6, 9), cpu_blocks=(3, 6)
  ),
}
_DEVICES = {ON_GPU: "gpu", ON_CPU: "cpu"}


@functools.cache
def _jitted(cfg: HybridCacheConfig, name: str):
  return jit_op(getattr(HybridBlockSpaceManager(cfg), name))


class HybridJaxManager:
  """The jitted hybrid manager behind the reference's interface (ids padded to PAD)."""

  def __init__(self, cfg: HybridCacheConfig):
    self.cfg = cfg
    self.state = HybridBlockSpaceManager(cfg).init()

  def _call(self, name, *args, **kwargs):
    return _jitted(self.cfg, name)(*args, **kwargs)

  def _mutate(self, name, *args, **kwargs):
    self.state, result = self._call(name, self.state, *args, **kwargs)
    return Status(int(result.status)), int(result.group), result.results

  @staticmethod
  def _ids(seq_ids):
    ids = list(seq_ids)
    return np.array(ids + [-1] * (max(PAD, len(ids)) - len(ids)), np.int32)

  def allocate_counting_hits(self, seq_ids, token_ids, num_tokens, salt=0):
    width = self.cfg.cache.max_tokens_per_seq
    padded = np.array(list(token_ids) + [0] * (width - len(token_ids)), np.int32)
    n = num_tokens if num_tokens <= len(token_ids) else width + 1
    status, group, results = self._mutate(
      "allocate", self._ids(seq_ids), padded, np.int32(n), np.int32(salt)
    )
    return status, group, [int(r.num_hit_blocks) for r in results]

  def append_slots(self, seq_ids, new_token_ids, num_new, num_lookahead_slots=0):
    ids = self._ids(seq_ids)
    tokens = np.zeros((len(ids), COLUMNS), np.int32)
    for i, row in enumerate(new_token_ids):
      tokens[i, : len(row)] = row
    counts = np.zeros(len(ids), np.int32)
    counts[: len(num_new)] = num_new
    status, group, results = self._mutate(
      "append_slots", ids, tokens, counts, num_lookahead_slots=num_lookahead_slots
    )
    return status, group, [_pairs(r) for r in results]

  def swap_out(self, seq_ids):
    status, group, results = self._mutate("swap_out", self._ids(seq_ids))
    return status, group, [_pairs(r) for r in results]

  def swap_in(self, seq_ids):
    status, group, results = self._mutate("swap_in", self._ids(seq_ids))
    return status, group, [_pairs(r) for r in results]

  def fork(self, parent_id, child_id):
    return self._mutate("fork", np.int32(parent_id), np.int32(child_id))[:2]

  def free(self, seq_ids):
    return self._mutate("free", self._ids(seq_ids))[:2]

  def reset(self):
    self.state = self._call("reset", self.state)

  def can_allocate(self, num_tokens):
    status, group = self._call("can_allocate", self.state, np.int32(num_tokens))
    return AllocStatus(int(status)), int(group)

  def can_swap_in(self, seq_ids, num_lookahead_slots=0):
    status, group = self._call(
      "can_swap_in", self.state, self._ids(seq_ids), num_lookahead_slots=num_lookahead_slots
    )
    return AllocStatus(int(status)), int(group)

  def can_append_slots(self, seq_ids, num_lookahead_slots=0):
    return bool(
      self._call(
        "can_append_slots", self.state, self._ids(seq_ids), num_lookahead_slots=num_lookahead_slots
      )
    )

  def can_swap_out(self, seq_ids):
    return bool(self._call("can_swap_out", self.state, self._ids(seq_ids)))

  def get_slot_mapping(self, seq_ids, num_new, width):
    ids = self._ids(seq_ids)
    counts = np.zeros(len(ids), np.int32)
    counts[: len(num_new)] = num_new
    out = self._call("get_slot_mapping", self.state, ids, counts, width=width)
    return [np.asarray(m)[: len(seq_ids)].tolist() for m in out]

  def device_of(self, seq_id):
    return _DEVICES.get(int(self.state.groups[0].device[seq_id]))

  def snapshot(self, max_seqs: int):
    state = jax.device_get(self.state)
    first = state.groups[0]
    free_gpu = np.asarray(self._call("num_free_gpu_blocks", self.state)).tolist()
    free_cpu = np.asarray(self._call("num_free_cpu_blocks", self.state)).tolist()
    return dict(
      tokens=first.num_tokens.tolist(),
      devices=[_DEVICES.get(d) for d in first.device.tolist()],
      types=[
        dict(
          tables=s.tables.tolist(),
          gpu_refs=s.gpu.ref_count.tolist(),
          cpu_refs=s.cpu.ref_count.tolist(),
          free=(free_gpu[g], free_cpu[g]),
        )
        for g, s in enumerate(state.groups)
      ],
    )


def _pairs(plan):
  n = int(plan.count)
  return list(zip(np.asarray(plan.src)[:n].tolist(), np.asarray(plan.dst)[:n].tolist()))


def _pick_ids(rng, manager, max_seqs, want_device, count):
  """Mostly ids on `want_device`; sometimes anything (invalid ones included)."""
  slots = [s for s in range(max_seqs) if manager.device_of(s) == want_device]
  pool = slots if slots and rng.random() >= 0.1 else list(range(-1, max_seqs + 1))
  ids = [rng.choice(pool) for _ in range(count)]
  return list(dict.fromkeys(ids)) if rng.random() < 0.9 else ids


def _run_op(rng, m, cfg: HybridCacheConfig, op: int):
  """One random operation on manager `m`; returns what it reported."""
  cache = cfg.cache
  max_seqs = cache.max_seqs
  if op == 0:
    ids = _pick_ids(rng, m, max_seqs, None, rng.randint(1, 2))
    tokens = [rng.randint(1, 3) for _ in range(rng.randint(0, cache.max_tokens_per_seq + 1))]
    n = len(tokens) if rng.random() < 0.95 else rng.choice([-1, len(tokens) + 1])
    return m.allocate_counting_hits(ids, tokens, n)
  if op in (1, 2, 3):
    ids = _pick_ids(rng, m, max_seqs, "gpu", rng.randint(1, 3))
    counts = [rng.choice([0, 1, 1, 1, 2, 3, 4]) for _ in ids]
    if rng.random() < 0.03:
      counts[0] = rng.choice([-1, COLUMNS + 1])
    rows = [[rng.randint(1, 2) for _ in range(COLUMNS)] for _ in ids]
    return m.append_slots(ids, rows, counts, num_lookahead_slots=rng.choice([0, 0, LOOKAHEAD]))
  if op == 4:
    parent = _pick_ids(rng, m, max_seqs, rng.choice(["gpu", "cpu"]), 1)[0]
    return m.fork(parent, _pick_ids(rng, m, max_seqs, None, 1)[0])
  if op == 5:
    return m.free(_pick_ids(rng, m, max_seqs, rng.choice(["gpu", "cpu"]), rng.randint(1, 2)))
  if op == 6:
    ids = _pick_ids(rng, m, max_seqs, "gpu", rng.randint(1, 2))
    return m.can_swap_out(ids), m.swap_out(ids)
  if op == 7:
    ids = _pick_ids(rng, m, max_seqs, "cpu", rng.randint(1, 2))
    return m.can_swap_in(ids, rng.choice([0, 2])), m.swap_in(ids)
  if op == 8:
    ids = _pick_ids(rng, m, max_seqs, "gpu", rng.randint(1, 3))
    real = [i for i in ids if i != -1]
    valid = all(0 <= i < max_seqs for i in real) and len(set(real)) == len(real)
    return (
      m.can_allocate(rng.randint(-1, cache.max_tokens_per_seq + 2)),
      m.can_append_slots(ids, rng.choice([0, 3])),
      m.get_slot_mapping(ids, [rng.randint(0, 5) for _ in ids], 4) if valid else None,
    )
  m.reset()
  return None


def _check_window_bound(fast: HybridJaxManager, cfg: HybridCacheConfig):
  """A sliding type holds at most ceil(w / block_size) + 1 blocks per sequence, plus lookahead."""
  block_size = cfg.cache.block_size
  for window, group_state in zip(cfg.windows, fast.state.groups):
    held = np.sum(np.asarray(group_state.tables) >= 0, axis=1)
    if window is not None:
      bound = math.ceil(window / block_size) + 1 + math.ceil(LOOKAHEAD / block_size)
      assert held.max() <= bound, (window, held.tolist())


def run_trace(name: str, seed: int, num_ops: int):
  cfg = CONFIGS[name]
  ref = ReferenceHybridManager(cfg.cache, cfg.layer_windows, cfg.gpu_blocks, cfg.cpu_blocks)
  fast = HybridJaxManager(cfg)
  rng = random.Random(seed)
  for step in range(num_ops):
    op = rng.choices(range(10), weights=[4, 4, 4, 4, 2, 2, 2, 2, 1, 0.3])[0]
    saved = rng.getstate()
    expected = _run_op(rng, ref, cfg, op)
    rng.setstate(saved)
    got = _run_op(rng, fast, cfg, op)
    where = f"config {name}, seed {seed}, step {step}, op {op}"
    assert got == expected, where
    assert fast.snapshot(cfg.cache.max_seqs) == ref.snapshot(cfg.cache.max_seqs), where
    hybrid.check_hybrid_invariants(fast.state)
    _check_window_bound(fast, cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
@hypothesis.settings(
  max_examples=EXAMPLES,
  deadline=None,
  derandomize=True,
  suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(40, 60))
def test_hybrid_matches_reference(name, seed, num_ops):
  run_trace(name, seed, num_ops)
