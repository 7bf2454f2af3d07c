"""Prefix caching under a sliding window: the jitted managers against the reference.

Random programs run on the jitted `BlockSpaceManager` with a window and
prefix caching, and on a Gemma-shaped `HybridBlockSpaceManager` with
prefix caching, and on the plain-Python reference (`tests/reference/`),
which states the window rules (docs/semantics.md, "Prefix caching under a
window"): hits through dead entries, registration only under a parent with
content, the cascade on eviction and its orphans, swaps' left-to-right
lookups, the hybrid's common hit. After every operation both report the
same statuses, plans and hits, and hold the same tables, reference counts,
free counts, hit rates and cached blocks (which blocks hold content, and
for how many tokens).

The programs share one document: most prompts and appends continue it, so
sequences share prefixes longer than the window, and a small pool evicts
their blocks in every order.
"""

from __future__ import annotations

import dataclasses
import os
import random

import hypothesis
import hypothesis.strategies as st
import jax
import numpy as np
import pytest

from paged_jax.block_manager import hybrid
from paged_jax.block_manager.hybrid import HybridCacheConfig
from paged_jax.config import CacheConfig, Status
from tests import test_reference_window_prefix as reference_programs
from tests.jax_adapter import JaxManager
from tests.reference.block_manager import ReferenceBlockSpaceManager
from tests.reference.hybrid import ReferenceHybridManager
from tests.test_hybrid_manager import COLUMNS, HybridJaxManager

EXAMPLES = int(os.environ.get("PAGED_JAX_PROPERTY_EXAMPLES", "4"))
DOCUMENT = [1, 2, 1, 1, 2, 2, 1, 2, 2, 2, 1, 1, 2, 1]
PAD = 4  # HybridJaxManager's id width

PLAIN = CacheConfig(
  block_size=2, num_gpu_blocks=8, num_cpu_blocks=5, max_seqs=5, max_blocks_per_seq=8,
  watermark=0.0, sliding_window=4, enable_prefix_caching=True, hash_bits=2,
)  # fmt: skip
# Gemma-shaped: two sliding layers and a global one; the sliding pool the tighter.
GEMMA = HybridCacheConfig(
  dataclasses.replace(PLAIN, sliding_window=None, num_gpu_blocks=10),
  (3, 3, None),
  gpu_blocks=(10, 6),
  cpu_blocks=(6, 4),
)


def _tokens(rng, start: int, count: int) -> list[int]:
  """Mostly the document's tokens from `start`; sometimes one of them changed."""
  tokens = [DOCUMENT[(start + i) % len(DOCUMENT)] for i in range(count)]
  if tokens and rng.random() < 0.15:
    tokens[rng.randrange(len(tokens))] = 3
  return tokens


def _ids(rng, ref_seqs, want, count, max_seqs):
  """Mostly ids on device `want` (None: empty slots); sometimes any id, bad ones included."""
  slots = [s for s in range(max_seqs) if _device(ref_seqs[s]) == want]
  pool = slots if slots and rng.random() >= 0.08 else list(range(-1, max_seqs + 1))
  ids = [rng.choice(pool) for _ in range(count)]
  return list(dict.fromkeys(ids)) if rng.random() < 0.92 else ids


def _device(seq):
  return None if seq is None else seq.device


def random_operation(rng, ref_seqs, max_seqs: int, max_tokens: int, step: int) -> tuple:
  """One operation, drawn from the reference's slots (the same for both managers)."""
  name = rng.choices(
    ["allocate", "append", "fork", "free", "swap_out", "swap_in", "access", "reset"],
    weights=[4, 8, 1, 5, 1, 1, 6, 0.1],
  )[0]
  if name == "allocate":
    count = rng.choice([0, 0, rng.randint(0, max_tokens)])  # often empty, then appended
    tokens = _tokens(rng, 0, count)
    if rng.random() < 0.3:  # a prompt of its own: its takes evict cached blocks
      tokens = [rng.randint(3, 4) for _ in range(rng.randint(4, max_tokens))]
    return (
      name,
      _ids(rng, ref_seqs, None, rng.randint(1, 2), max_seqs),
      tokens,
      rng.choice([0, 0, 5]),
    )
  if name == "append":
    rows = []
    for seq_id in _ids(rng, ref_seqs, "gpu", rng.randint(1, 3), max_seqs):
      held = len(ref_seqs[seq_id].tokens) if 0 <= seq_id < max_seqs and ref_seqs[seq_id] else 0
      rows.append((seq_id, _tokens(rng, held, rng.choice([0, 1, 1, 1, 2, 2, 3, 4]))))
    return name, rows, rng.choice([0, 0, 1])
  if name == "fork":
    parent = _ids(rng, ref_seqs, rng.choice(["gpu", "cpu"]), 1, max_seqs)[0]
    return name, parent, _ids(rng, ref_seqs, None, 1, max_seqs)[0]
  if name in ("free", "swap_out", "swap_in"):
    device = {"free": rng.choice(["gpu", "gpu", "cpu"]), "swap_out": "gpu", "swap_in": "cpu"}[name]
    return name, _ids(rng, ref_seqs, device, rng.randint(1, 2), max_seqs)
  if name == "access":
    return name, rng.randint(-1, max_seqs - 1), step
  return (name,)


def apply(manager, operation, access=None):
  """Runs an operation on a manager (reference or jitted); returns what it
  reported. `access(manager, seq_id, now)` marks a sequence's blocks used
  (default: the plain managers' method)."""
  name, *args = operation
  if name == "allocate":
    seq_ids, tokens, salt = args
    return manager.allocate_counting_hits(seq_ids, tokens, len(tokens), salt)
  if name == "append":
    rows, lookahead = args
    new = [t for _, t in rows]
    return manager.append_slots([s for s, _ in rows], new, [len(t) for t in new], lookahead)
  if name == "access":
    if access is None:
      manager.access_all_blocks_in_seq(*args)
    else:
      access(manager, *args)
    return None
  if name == "reset":
    manager.reset()
    return None
  return getattr(manager, name)(*args)  # fork, free: a status; swaps: (status, plan)


def cached_blocks(pool_content, ref_pool) -> tuple[list, list]:
  """(jitted, reference): each block's prefix length if it holds content, else 0."""
  mine = np.where(
    np.asarray(pool_content.has_content), np.asarray(pool_content.num_hashed_tokens), 0
  ).tolist()
  theirs = [b.num_hashed_tokens if b.identity is not None else 0 for b in ref_pool.blocks]
  return mine, theirs


def check_content(state, ref, where):
  state = jax.device_get(state)
  for device in ("gpu", "cpu"):
    pool = getattr(state, device)
    if pool.content is None:
      continue
    mine, theirs = cached_blocks(pool.content, ref._state.pools[device])
    assert mine == theirs, f"{where}: {device} cached blocks"


def run_plain(seed: int, num_ops: int, cfg: CacheConfig = PLAIN):
  ref, fast = ReferenceBlockSpaceManager(cfg), JaxManager(cfg, pad_to=PAD, token_pad=16)
  rng = random.Random(seed)
  for step in range(num_ops):
    operation = random_operation(rng, ref._state.seqs, cfg.max_seqs, cfg.max_tokens_per_seq, step)
    where = f"seed {seed}, step {step}, {operation}"
    assert apply(fast, operation) == apply(ref, operation), where
    assert fast.snapshot() == _plain_snapshot(ref, cfg), where
    check_content(fast.state, ref, where)


def _plain_snapshot(m, cfg):
  return dict(
    tables=[m.get_block_table(s) for s in range(cfg.max_seqs)],
    tokens=[m.get_num_tokens(s) for s in range(cfg.max_seqs)],
    devices=[m.device_of(s) for s in range(cfg.max_seqs)],
    gpu_refs=m.ref_counts("gpu"),
    cpu_refs=m.ref_counts("cpu"),
    free=(m.num_free_gpu_blocks(), m.num_free_cpu_blocks()),
    hit_rate=round(m.prefix_cache_hit_rate(), 6),
  )


def _access(manager, seq_id, now):
  if isinstance(manager, ReferenceHybridManager):
    for one in manager.types:
      one.access_all_blocks_in_seq(seq_id, now)
  else:
    manager.state = hybrid.access_all_blocks_in_seq(manager.state, np.int32(seq_id), np.int32(now))


def apply_hybrid(manager, operation):
  """Runs an operation on a hybrid manager; returns what it reported."""
  return apply(manager, operation, access=_access)


def run_hybrid(seed: int, num_ops: int, cfg: HybridCacheConfig = GEMMA):
  cache = cfg.cache
  ref = ReferenceHybridManager(cache, cfg.layer_windows, cfg.gpu_blocks, cfg.cpu_blocks)
  fast = HybridJaxManager(cfg)
  rng = random.Random(seed)
  for step in range(num_ops):
    seqs = ref.types[0]._state.seqs
    operation = random_operation(rng, seqs, cache.max_seqs, cache.max_tokens_per_seq, step)
    if operation[0] == "append":  # the hybrid adapter's rows are COLUMNS wide
      operation = ("append", [(s, t[:COLUMNS]) for s, t in operation[1]], operation[2])
    where = f"seed {seed}, step {step}, {operation}"
    assert apply_hybrid(fast, operation) == apply_hybrid(ref, operation), where
    assert fast.snapshot(cache.max_seqs) == ref.snapshot(cache.max_seqs), where
    assert float(hybrid.prefix_cache_hit_rate(fast.state)) == pytest.approx(
      _hybrid_hit_rate(ref), abs=1e-6
    ), where
    for g, state in enumerate(fast.state.groups):
      check_content(state, ref.types[g], f"{where}, type {g}")
    hybrid.check_hybrid_invariants(fast.state)


def _hybrid_hit_rate(ref) -> float:
  lookups = sum(t._state.lookups for t in ref.types)
  return sum(t._state.hits for t in ref.types) / lookups if lookups else 0.0


_SETTINGS = dict(
  max_examples=EXAMPLES,
  deadline=None,
  derandomize=True,
  suppress_health_check=list(hypothesis.HealthCheck),
)


# Slow, as the hybrid one below (35 s in a CI run on a quiet machine): CI runs
# the hand-built side-by-side cases further down.
@pytest.mark.slow
@hypothesis.settings(**_SETTINGS)
@hypothesis.given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(50, 70))
def test_windowed_cache_matches_reference(seed, num_ops):
  run_plain(seed, num_ops)


# Slow (128 s for 6 examples at load 14, mostly compiles): CI's hybrid coverage is
# the hand-built side-by-side cases below and test_hybrid_manager's.
@pytest.mark.slow
@hypothesis.settings(**_SETTINGS)
@hypothesis.given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(40, 60))
def test_gemma_shaped_hybrid_matches_reference(seed, num_ops):
  run_hybrid(seed, num_ops)


def lockstep(operations, cfg: CacheConfig = PLAIN):
  """Runs operations on the jitted manager and the reference, comparing after each one."""
  ref, fast = ReferenceBlockSpaceManager(cfg), JaxManager(cfg, pad_to=PAD, token_pad=16)
  for step, operation in enumerate(operations):
    where = f"step {step}, {operation}"
    got, want = apply(fast, operation), apply(ref, operation)
    assert got == want, where
    assert got is None or (got[0] if isinstance(got, tuple) else got) == Status.OK, where
    assert fast.snapshot() == _plain_snapshot(ref, cfg), where
    check_content(fast.state, ref, where)
  return fast, ref


def in_chunks(seq_id, tokens, chunk=2, now=0):
  """The engine's way on a windowed cache: allocate empty, append chunk by chunk (accessed)."""
  operations = [("allocate", [seq_id], [], 0)]
  for start in range(0, len(tokens), chunk):
    operations.append(("append", [(seq_id, tokens[start : start + chunk])], 0))
    operations.append(("access", seq_id, now + start))
  return operations


def _cached(manager):
  content = jax.device_get(manager.state.gpu.content)
  return np.flatnonzero(content.has_content).tolist()


def _free_stack(manager):
  pool = jax.device_get(manager.state.gpu)
  return np.asarray(pool.free_stack)[: int(pool.num_stacked)].tolist()


def test_evicting_a_stale_parent_orphans_its_extensions():
  """A dead parent accessed before its children is evicted first: its cached
  extensions leave the evictor for the free stack, lowest first, and an orphan
  that the same call evicts later is taken, not pushed."""
  prompt = DOCUMENT[:10]  # five blocks; a window of 4 keeps the last two
  operations = in_chunks(0, prompt) + [
    ("free", [0]),  # evictor: 0, 1, 2 (accessed at 0, 2, 4), then 3 and 4 (at 8)
    ("allocate", [1], [3, 4, 3, 4, 3, 4, 3, 4, 3], 0),  # never-used 5, 6, 7
  ]
  fast, _ = lockstep(operations + [("allocate", [2], [4, 3] * 5, 0)])  # evicts 0, then 1
  assert fast.get_block_table(2)[:5] == [-1, -1, -1, 0, 1]
  assert _cached(fast) == []  # 1 .. 4 extended block 0's prefix
  assert _free_stack(fast) == [2, 3, 4]  # 1, an orphan of 0, was taken
  fast, _ = lockstep(operations + [("allocate", [2], [4, 3], 0)])  # evicts 0 only
  assert _free_stack(fast) == [1, 2, 3, 4]


def test_a_held_extension_keeps_its_page_but_loses_its_identity():
  prompt = DOCUMENT[:10]
  operations = in_chunks(0, prompt) + [  # 0, 1, 2 dead in the evictor; 3, 4 held
    ("allocate", [1], [3, 4, 3, 4, 3, 4, 3, 4], 0),  # 5, 6
    ("allocate", [2], [4, 3, 4, 3, 4, 3, 4, 3], 0),  # 7, then evicts 0
  ]
  fast, _ = lockstep(operations)
  assert fast.get_block_table(0)[:5] == [-1, -1, -1, 3, 4]
  assert _cached(fast) == []  # 3 and 4 (held) lost their identity, 1 and 2 too (orphans)
  assert _free_stack(fast) == [1, 2]
  fast, _ = lockstep(operations + [("free", [0])])
  assert _free_stack(fast)[-2:] == [4, 3]  # without content: to the free stack
  fast, _ = lockstep(operations + [("free", [0]), ("allocate", [3], prompt, 0)])
  assert fast.prefix_cache_hit_rate() == 0.0  # the chain is gone


def test_swaps_look_up_left_to_right_and_register_under_parents_with_content():
  fast, _ = lockstep(
    in_chunks(0, DOCUMENT[:4])  # blocks 0, 1 live and cached
    + [
      ("fork", 0, 1),
      ("swap_out", [0, 1]),  # the CPU copies are registered
      ("swap_in", [0, 1]),  # both GPU blocks hit, each looked up once
      ("append", [(0, DOCUMENT[4:7])], 0),  # block 0 dies; 2 full, 3 partial
      ("swap_out", [0]),  # a dead first entry: nothing registers on the CPU
      ("swap_in", [0]),
      ("swap_out", [1]),  # hits the CPU blocks registered before
    ]
  )
  assert fast.prefix_cache_hit_rate() == pytest.approx(2 / 5)  # swap_in: 2 of 2


def test_hybrid_allocate_takes_only_the_common_hit():
  ref = ReferenceHybridManager(GEMMA.cache, GEMMA.layer_windows, GEMMA.gpu_blocks, GEMMA.cpu_blocks)
  fast = HybridJaxManager(GEMMA)
  prompt = DOCUMENT[:10]
  chunked = [("allocate", [1], [], 0)] + [
    ("append", [(1, prompt[start : start + 2])], 0) for start in range(0, 10, 2)
  ]
  operations = (
    [("allocate", [0], prompt, 0), ("free", [0])]  # the sliding type registers nothing
    + [("allocate", [0], prompt, 0)]  # common hit 0: the global type takes fresh blocks
    + [("free", [0])]
    + chunked  # registers the prompt in the sliding type
    + [("free", [1]), ("allocate", [2], prompt, 0)]  # now every type hits
  )
  results = []
  for operation in operations:
    got, want = apply_hybrid(fast, operation), apply_hybrid(ref, operation)
    assert got == want, operation
    assert fast.snapshot(5) == ref.snapshot(5), operation
    results.append(got)
  assert results[2] == (Status.OK, -1, [0, 0])
  assert results[-1] == (Status.OK, -1, [5, 5])


def test_allocate_hits_through_dead_entries_and_holds_the_window():
  """A prompt in chunks, then the same prompt at once: every block hits, the
  dead ones are passed through (counted, not held), and stay cached."""
  prompt = DOCUMENT[:10]
  operations = in_chunks(0, prompt) + [("allocate", [1], prompt, 0)]
  fast, _ = lockstep(operations)
  assert fast.get_block_table(1)[:5] == [-1, -1, -1, 3, 4]
  assert fast.ref_counts("gpu")[:5] == [0, 0, 0, 2, 2]
  fast, _ = lockstep(operations + [("allocate", [2], prompt, 0)])
  assert fast.prefix_cache_hit_rate() == pytest.approx(10 / 15)


# Slow (compiles a three-type hybrid manager of its own).
@pytest.mark.slow
def test_a_swap_in_under_an_identity_an_evictor_block_has_matches_reference():
  """The reference's random hybrid program at seed 2850
  (test_reference_window_prefix): a swap-in registers a moved block under
  an identity a block in the evictor still carries, then evictions and
  allocations go on; the jitted manager and the reference agree step by
  step."""
  cache = reference_programs.cached_config(num_gpu_blocks=6, num_cpu_blocks=4, max_blocks_per_seq=4)
  ref = ReferenceHybridManager(cache, [None, 3, 5], [6, 4, 5], [4, 4, 4])
  fast = HybridJaxManager(HybridCacheConfig(cache, (None, 3, 5), (6, 4, 5), (4, 4, 4)))
  rng = random.Random(2850)
  for step in range(24):
    operation = reference_programs.random_operation(rng, ref.types[0])
    where = f"step {step}, {operation}"
    assert apply_hybrid(fast, operation) == apply_hybrid(ref, operation), where
    assert fast.snapshot(cache.max_seqs) == ref.snapshot(cache.max_seqs), where
    for g, state in enumerate(fast.state.groups):
      check_content(state, ref.types[g], f"{where}, type {g}")
