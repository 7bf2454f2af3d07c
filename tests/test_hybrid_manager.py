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


# CI runs the Gemma-shaped config; the two-window one runs in the full suite.
@pytest.mark.parametrize("name", ["gemma", pytest.param("two_windows", marks=pytest.mark.slow)])
@hypothesis.settings(
  max_examples=EXAMPLES,
  deadline=None,
  derandomize=True,
  suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(40, 60))
def test_hybrid_matches_reference(name, seed, num_ops):
  run_trace(name, seed, num_ops)


# One type: the plain manager's op, bit for bit.

_ONE_TYPE = {
  "uncached": HybridCacheConfig(dataclasses.replace(_BASE, num_gpu_blocks=8), (None, None)),
  "cached": HybridCacheConfig(
    dataclasses.replace(_BASE, enable_prefix_caching=True, num_gpu_blocks=8), (None, None)
  ),
  "window": HybridCacheConfig(dataclasses.replace(_BASE, num_gpu_blocks=8), (3, 3)),
}


# The cached variant compiles the cached plain and hybrid ops again (~20 s).
@pytest.mark.parametrize(
  "variant",
  [
    "uncached",
    pytest.param("cached", marks=pytest.mark.slow),
    "window",
  ],
)
def test_one_type_is_the_plain_manager(variant):
  """Every op on a one-type hybrid gives the plain manager's state and result, leaf for leaf."""
  cfg = _ONE_TYPE[variant]
  plain_bm = BlockSpaceManager(cfg.group_config(0))
  plain, hyb = plain_bm.init(), HybridBlockSpaceManager(cfg).init()
  ids = jnp.array([0, 1, -1, -1], jnp.int32)
  prompt = jnp.array([1, 2, 1, 2, 1, 0, 0, 0, 0, 0, 0, 0], jnp.int32)
  rows = jnp.array([[2, 1, 2, 1]] * 4, jnp.int32)
  script = [
    ("allocate", (ids, prompt, jnp.int32(5)), {}),
    ("append_slots", (ids, rows, jnp.array([3, 2, 0, 0], jnp.int32)), {"num_lookahead_slots": 2}),
    ("fork", (jnp.int32(1), jnp.int32(3)), {}),
    ("swap_out", (jnp.array([3, -1], jnp.int32),), {}),
    ("allocate", (jnp.array([2], jnp.int32), prompt, jnp.int32(12)), {}),  # OUT_OF_BLOCKS
    ("swap_in", (jnp.array([3, -1], jnp.int32),), {}),
    ("free", (ids,), {}),
  ]
  for name, args, kwargs in script:
    plain, want = jit_op(getattr(plain_bm, name))(plain, *args, **kwargs)
    hyb, got = _jitted(cfg, name)(hyb, *args, **kwargs)
    assert int(got.status) == int(want.status), name
    for mine, theirs in zip(
      jax.tree.leaves((hyb.groups[0], got.results[0])), jax.tree.leaves((plain, want))
    ):
      np.testing.assert_array_equal(mine, theirs, err_msg=name)
  assert int(want.status) == Status.OK  # the script ran to its end


# Bad input.


@pytest.mark.parametrize("window", [0, -4, 2.5, True, "512"])
def test_a_window_that_is_not_a_positive_int_names_the_layer(window):
  with pytest.raises(
    ValueError, match=rf"layer 1: sliding_window must be a positive int or None, got {window!r}"
  ):
    HybridCacheConfig(_BASE, (None, window, 4))


def test_config_refusals_name_what_is_wrong():
  with pytest.raises(ValueError, match="cache.sliding_window must be None"):
    HybridCacheConfig(dataclasses.replace(_BASE, sliding_window=4), (None, 4))
  with pytest.raises(
    ValueError, match=r"gpu_blocks must be 2 ints >= 1 \(one per type global, sliding window 4\)"
  ):
    HybridCacheConfig(_BASE, (4, None), gpu_blocks=(8,))
  with pytest.raises(ValueError, match="at least one layer"):
    HybridCacheConfig(_BASE, ())


def test_a_window_with_prefix_caching_follows_the_window_rules_in_every_type():
  """Once refused: windows with prefix caching (tests/test_window_prefix_jax.py runs them)."""
  cached = dataclasses.replace(_BASE, enable_prefix_caching=True)
  state = HybridBlockSpaceManager(HybridCacheConfig(cached, (4, None))).init()
  assert [s.window_rules for s in state.groups] == [True, True]  # the global type too
  assert BlockSpaceManager(dataclasses.replace(cached, sliding_window=4)).init().window_rules
  assert not BlockSpaceManager(cached).init().window_rules  # no window: today's rules
  state = HybridBlockSpaceManager(HybridCacheConfig(cached, (None, None))).init()
  assert [s.window_rules for s in state.groups] == [False]


def test_layers_and_types_the_model_does_not_declare():
  cfg = CONFIGS["gemma"]
  assert cfg.windows == (None, 3)
  assert [cfg.layer_group(layer) for layer in range(3)] == [1, 1, 0]
  assert cfg.group_of_window(3) == 1 and cfg.type_name(1) == "sliding window 3"
  with pytest.raises(ValueError, match=r"layer 3: the model declares layers 0..2"):
    cfg.layer_group(3)
  with pytest.raises(ValueError, match=r"layer -1: the model declares layers 0..2"):
    cfg.layer_group(-1)
  with pytest.raises(
    ValueError,
    match=r"type sliding window 7; the model's types: global, sliding window 3",
  ):
    cfg.group_of_window(7)
  with pytest.raises(ValueError, match="no layer declares the attention type global"):
    CONFIGS["two_windows"].group_of_window(None)


def _leaves_equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_failing_type_leaves_every_type_unchanged():
  """Under jit: the sliding type runs out, the global one would not; nothing changes."""
  cfg = CONFIGS["gemma"]  # global 14 blocks, window 3 with 7
  state = HybridBlockSpaceManager(cfg).init()
  tokens = np.ones(cfg.cache.max_tokens_per_seq, np.int32)
  for seq in range(3):
    state, res = _jitted(cfg, "allocate")(
      state, np.array([seq, -1, -1, -1], np.int32), tokens, np.int32(6)
    )
    assert Status(int(res.status)) == Status.OK
  # Global: 3 blocks per sequence (9 of 14); window 3 of 6 tokens: blocks 1 and 2 (6 of 7).
  assert np.asarray(state.groups[0].tables)[0, :4].tolist() == [13, 12, 11, -1]
  assert np.asarray(state.groups[1].tables)[0, :4].tolist() == [-1, 6, 5, -1]
  before = state
  rows = np.ones((4, COLUMNS), np.int32)
  state, res = _jitted(cfg, "append_slots")(
    before, np.array([0, 1, 2, -1], np.int32), rows, np.array([2, 2, 2, 0], np.int32)
  )
  assert Status(int(res.status)) == Status.OUT_OF_BLOCKS and int(res.group) == 1
  assert _leaves_equal(state, before)
  assert [int(r.count) for r in res.results] == [0, 0]
  assert all(np.all(np.asarray(r.src) == -1) for r in res.results)
  state, res = _jitted(cfg, "free")(before, np.array([0, 7, -1, -1], np.int32))
  assert Status(int(res.status)) == Status.INVALID_ARGUMENT and int(res.group) == -1
  assert _leaves_equal(state, before)


def test_never_names_the_type_that_cannot_hold_the_prompt():
  small_global = HybridCacheConfig(
    dataclasses.replace(_BASE, watermark=0.0), (None, 2), gpu_blocks=(4, 20)
  )
  small_window = HybridCacheConfig(
    dataclasses.replace(_BASE, watermark=0.0), (None, 8), gpu_blocks=(20, 3)
  )
  for cfg, want in ((small_global, 0), (small_window, 1)):
    state = HybridBlockSpaceManager(cfg).init()
    status, group = _jitted(cfg, "can_allocate")(state, np.int32(12))
    assert (AllocStatus(int(status)), int(group)) == (AllocStatus.NEVER, want), cfg.type_names()
    message = hybrid.describe_admission(cfg, 12, status, group)
    assert message.startswith(f"can_allocate(12): NEVER: the {cfg.type_name(want)} type needs ")
    status, group = _jitted(cfg, "can_allocate")(state, np.int32(4))
    assert (AllocStatus(int(status)), int(group)) == (AllocStatus.OK, -1)
  message = hybrid.describe_admission(small_window, 12, AllocStatus.NEVER, 1)
  assert message == (
    "can_allocate(12): NEVER: the sliding window 8 type needs 4 of its 3 GPU blocks "
    "(watermark 0, table of 6 blocks)"
  )


@pytest.mark.slow  # a vmapped allocate of its own (~10 s of compiles)
def test_data_shards_run_as_one_vmapped_call():
  """Stacked per-shard hybrid states: a vmapped op is the op on each shard's state."""
  cfg = CONFIGS["gemma"]
  states = hybrid.init_hybrid_states(cfg, 2)
  tokens = np.ones((2, cfg.cache.max_tokens_per_seq), np.int32)
  ids = np.array([[0, -1, -1, -1], [1, 2, -1, -1]], np.int32)
  lengths = np.array([5, 7], np.int32)
  stacked, res = jax.jit(jax.vmap(HybridBlockSpaceManager(cfg).allocate))(
    states, ids, tokens, lengths
  )
  assert [Status(int(s)) for s in res.status] == [Status.OK, Status.OK]
  for shard in range(2):
    one, _ = _jitted(cfg, "allocate")(
      HybridBlockSpaceManager(cfg).init(), ids[shard], tokens[shard], np.int32(lengths[shard])
    )
    mine = jax.tree.map(lambda x: x[shard], stacked)
    assert _leaves_equal(mine, one), shard


def test_one_byte_budget_holds_several_times_more_long_sequences():
  """Gemma 3 4B's types at 32k tokens: the budget of 10 sequences with every block kept."""
  layers = tuple(None if (layer + 1) % 6 == 0 else 1024 for layer in range(34))
  block_bytes = 2 * 4 * 16 * 256 * 2  # one layer's K and V of a block: 4 heads of 256, bf16
  every_block = 34 * 2048 * block_bytes  # one 32k sequence, every layer, every block
  budget = 10 * every_block
  blocks = hybrid.gpu_blocks_for_budget(
    layers, block_size=16, layer_block_bytes=block_bytes, budget_bytes=budget, max_tokens=32768
  )
  global_blocks, sliding_blocks = blocks
  assert 5 * global_blocks * block_bytes + 29 * sliding_blocks * block_bytes <= budget
  sequences = min(global_blocks // 2048, sliding_blocks // (64 + 1))
  assert sequences == 57  # against 10: 5.7x
  with pytest.raises(ValueError, match="gives a type no block"):
    hybrid.gpu_blocks_for_budget(
      layers, block_size=16, layer_block_bytes=block_bytes, budget_bytes=1000, max_tokens=32768
    )
