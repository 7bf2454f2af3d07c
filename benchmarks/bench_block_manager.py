"""Decode-step bookkeeping: append_slots of one token for B running sequences.

Half the sequences are forked pairs (their first append copies on write), and
prompt lengths are spread so that some appends open a new block. Measured
(a) inside one compiled lax.fori_loop of STEPS steps, (b) as one jitted call
per step next to JAX's dispatch floor (a jitted identity on the same state),
and the plain-Python reference (tests/reference/) doing the same steps (a few
steps, up to B=256: it deep-copies its state per call to stay atomic). Run from the repo root:

    python benchmarks/bench_block_manager.py [--caching]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
import paged_jax as pj  # noqa: E402
from tests.reference.block_manager import ReferenceBlockSpaceManager  # noqa: E402

STEPS = 100
REFERENCE_STEPS = 5  # the reference copies its whole state per call: slow
REFERENCE_MAX_BATCH = 256


def config(caching: bool) -> pj.CacheConfig:
  return pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=16384,
    num_cpu_blocks=0,
    max_seqs=1024,
    max_blocks_per_seq=32,
    watermark=0.0,
    enable_prefix_caching=caching,
  )


def setup(cfg: pj.CacheConfig, batch: int, with_reference: bool):
  """B sequences: batch/2 single prompts and batch/4 forked pairs; returns (state, reference)."""
  bm = pj.BlockSpaceManager(cfg)
  alloc, fork = jax.jit(bm.allocate), jax.jit(bm.fork)
  state = bm.init()
  ref = ReferenceBlockSpaceManager(cfg) if with_reference else None
  rng = np.random.default_rng(0)
  seq = 0
  while seq < batch:
    n = int(rng.integers(20, 200))
    tokens = rng.integers(0, 30000, n).astype(np.int32)
    state, _ = alloc(state, jnp.array([seq]), jnp.asarray(np.pad(tokens, (0, 256 - n))), n)
    if ref:
      ref.allocate([seq], tokens.tolist(), n)
    if seq % 4 == 2 and seq + 1 < batch:
      state, _ = fork(state, seq, seq + 1)
      if ref:
        ref.fork(seq, seq + 1)
      seq += 1
    seq += 1
  return state, ref


def timed(fn, *args, repeat=5):
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeat):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def bench(batch: int, caching: bool) -> dict:
  cfg = config(caching)
  bm = pj.BlockSpaceManager(cfg)
  state, ref = setup(cfg, batch, with_reference=batch <= REFERENCE_MAX_BATCH)
  ids = jnp.arange(batch, dtype=jnp.int32)
  tokens = jnp.ones((batch, 1), jnp.int32)
  ones = jnp.ones(batch, jnp.int32)

  def step(st):
    st, _ = bm.append_slots(st, ids, tokens, ones)
    return st

  loop = jax.jit(lambda st: jax.lax.fori_loop(0, STEPS, lambda _, s: step(s), st))
  t_loop = timed(loop, state) / STEPS
  calls = {}
  for donate in (False, True):
    donated = (0,) if donate else ()
    calls[donate] = (
      per_call_time(jax.jit(step, donate_argnums=donated), state),
      per_call_time(jax.jit(lambda st: st, donate_argnums=donated), state),
    )
  t_ref = float("nan")
  if ref:
    id_list, rows, counts = list(range(batch)), [[1]] * batch, [1] * batch
    start = time.perf_counter()
    for _ in range(REFERENCE_STEPS):
      ref.append_slots(id_list, rows, counts)
    t_ref = (time.perf_counter() - start) / REFERENCE_STEPS
  return dict(
    batch=batch,
    loop=t_loop,
    call=calls[False][0],
    floor=calls[False][1],
    call_donated=calls[True][0],
    floor_donated=calls[True][1],
    ref=t_ref,
  )


def per_call_time(fn, state, repeat=5) -> float:
  """Seconds per call of `fn` chained STEPS times (a fresh copy of the state each run)."""
  best = float("inf")
  for _ in range(repeat + 1):
    st = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    start = time.perf_counter()
    for _ in range(STEPS):
      st = fn(st)
    jax.block_until_ready(st)
    best = min(best, time.perf_counter() - start)
  return best / STEPS


def bench_allocate_free(caching: bool) -> float:
  cfg = config(caching).__class__(**{**config(caching).__dict__, "max_blocks_per_seq": 128})
  bm = pj.BlockSpaceManager(cfg)
  tokens = jnp.arange(2048, dtype=jnp.int32)

  @jax.jit
  def alloc_free(st):
    st, _ = bm.allocate(st, jnp.array([0]), tokens, 2048)
    st, _ = bm.free(st, jnp.array([0]))
    return st

  return timed(alloc_free, bm.init())


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--caching", action="store_true", help="enable prefix caching")
  args = parser.parse_args()
  print(f"backend {jax.default_backend()}, prefix caching {args.caching}, {STEPS} steps")
  print(
    f"{'B':>6} {'loop us':>9} {'call us':>9} {'floor us':>9} {'call/floor':>10} "
    f"{'donated':>8} {'floor':>6} {'ratio':>6} {'python us':>10} {'py/loop':>8}"
  )
  rows = [bench(b, args.caching) for b in (32, 256, 1024)]
  for r in rows:
    print(
      f"{r['batch']:>6} {r['loop'] * 1e6:9.1f} {r['call'] * 1e6:9.1f} {r['floor'] * 1e6:9.1f} "
      f"{r['call'] / r['floor']:10.2f} {r['call_donated'] * 1e6:8.1f} "
      f"{r['floor_donated'] * 1e6:6.1f} {r['call_donated'] / r['floor_donated']:6.2f} "
      f"{r['ref'] * 1e6:10.1f} {r['ref'] / r['loop']:8.1f}"
    )
  af = bench_allocate_free(args.caching)
  print(f"allocate + free of a 2048-token prompt: {af * 1e6:.1f} us")
  by_b = {r["batch"]: r for r in rows}
  print(
    f"summary: B=256 loop {by_b[256]['ref'] / by_b[256]['loop']:.1f}x faster than Python "
    f"(target >= 30x); loop B=1024/B=32 {by_b[1024]['loop'] / by_b[32]['loop']:.2f}x "
    f"(target <= 4x); per-call/dispatch floor "
    f"{max(r['call'] / r['floor'] for r in rows):.2f}x at worst (target <= 2x; donated "
    f"{max(r['call_donated'] / r['floor_donated'] for r in rows):.2f}x)"
  )


if __name__ == "__main__":
  main()
