"""Decode-step bookkeeping on a hybrid cache: append_slots of one token for B sequences.

Four managers over the same sequences (prompts of 1000 to 3000 tokens,
blocks of 16), each timed as STEPS one-token appends inside one compiled
lax.fori_loop, the variants taking turns so that the machine's load falls
on each alike:

* plain: `BlockSpaceManager`, every block kept (what serves Gemma today);
* hybrid, one type: `HybridBlockSpaceManager` of global layers only (it
  runs the plain op: the same cost is expected);
* hybrid, global + window 1024 (Gemma 3's types): both types' ops, run once
  for their statuses and again, in place, under a `lax.cond` on them;
* two plain managers, one per type, without rollback (what the hybrid's
  all-or-none costs is the difference to the line above);
* the same with the rollback as a select between old and new states (an
  earlier form of the hybrid op: the old states stay alive, so every
  scatter copies its array first).

  python benchmarks/bench_hybrid_manager.py [--batch 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.block_manager.hybrid import HybridBlockSpaceManager, HybridCacheConfig
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.config import CacheConfig, Status

STEPS = 64
WINDOW = 1024


def _cache(batch: int) -> CacheConfig:
  return CacheConfig(
    block_size=16,
    num_gpu_blocks=batch * 200 + 16,
    num_cpu_blocks=0,
    max_seqs=batch,
    max_blocks_per_seq=200,
    watermark=0.0,
  )


def _filled(allocate, state, batch: int, max_tokens: int):
  """`state` with every slot holding its prompt of 1000 to 3000 tokens (one call per sequence)."""
  allocate = jax.jit(allocate)
  tokens = np.ones(max_tokens, np.int32)
  lengths = np.random.default_rng(0).integers(1000, 3000, batch)
  for seq, length in enumerate(lengths):
    state, result = allocate(state, np.array([seq], np.int32), tokens, np.int32(length))
    assert Status(int(result.status)) == Status.OK
  return state


def _decode_loop(step):
  """Jitted: STEPS one-token appends of every sequence, `step(state, ids, tokens, counts)`."""

  @jax.jit
  def loop(state, ids):
    tokens = jnp.ones((ids.shape[0], 1), jnp.int32)
    counts = jnp.ones(ids.shape[0], jnp.int32)
    return jax.lax.fori_loop(0, STEPS, lambda _, s: step(s, ids, tokens, counts), state)

  return loop


def _variants(batch: int) -> dict:
  """{name: (jitted decode loop, its filled state)}."""
  cache = _cache(batch)
  plain = BlockSpaceManager(cache)
  one_type = HybridBlockSpaceManager(HybridCacheConfig(cache, (None,)))
  gemma = HybridBlockSpaceManager(
    HybridCacheConfig(cache, (WINDOW,) * 5 + (None,), gpu_blocks=(cache.num_gpu_blocks, batch * 66))
  )
  plain_each = [BlockSpaceManager(gemma.cfg.group_config(g)) for g in range(2)]
  tokens = cache.max_tokens_per_seq

  def plain_step(state, *args):
    return plain.append_slots(state, *args)[0]

  def hybrid_step(manager):
    return lambda state, *args: manager.append_slots(state, *args)[0]

  def unselected_step(states, *args):
    return tuple(m.append_slots(s, *args)[0] for m, s in zip(plain_each, states))

  def selected_step(states, *args):
    outs = [m.append_slots(s, *args) for m, s in zip(plain_each, states)]
    ok = jnp.all(jnp.stack([plan.status == Status.OK for _, plan in outs]))
    return tuple(
      jax.tree.map(lambda new, old: jnp.where(ok, new, old), new, old)
      for (new, _), old in zip(outs, states)
    )

  return {
    "plain, every block kept": (
      _decode_loop(plain_step),
      _filled(plain.allocate, plain.init(), batch, tokens),
    ),
    "hybrid, one type": (
      _decode_loop(hybrid_step(one_type)),
      _filled(one_type.allocate, one_type.init(), batch, tokens),
    ),
    f"hybrid, global + window {WINDOW}": (
      _decode_loop(hybrid_step(gemma)),
      _filled(gemma.allocate, gemma.init(), batch, tokens),
    ),
    "two plain managers, no select": (
      _decode_loop(unselected_step),
      tuple(_filled(m.allocate, m.init(), batch, tokens) for m in plain_each),
    ),
    "two plain managers, a select": (
      _decode_loop(selected_step),
      tuple(_filled(m.allocate, m.init(), batch, tokens) for m in plain_each),
    ),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  ids = np.arange(args.batch, dtype=np.int32)
  variants = _variants(args.batch)
  for loop, state in variants.values():  # compile
    jax.block_until_ready(loop(state, ids))
  best = {name: float("inf") for name in variants}
  for _ in range(args.repeats):
    for name, (loop, state) in variants.items():
      start = time.perf_counter()
      jax.block_until_ready(loop(state, ids))
      best[name] = min(best[name], (time.perf_counter() - start) / STEPS)
  print(
    f"append_slots of one token, batch {args.batch}, {jax.devices()[0].platform}, "
    f"best of {args.repeats}"
  )
  for name, seconds in best.items():
    print(f"  {name:<36} {seconds * 1e6:8.1f} us/step")


if __name__ == "__main__":
  main()
