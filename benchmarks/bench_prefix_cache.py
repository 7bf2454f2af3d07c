"""Prefix caching cost: allocate with a 50% prefix hit in a large, mostly cached pool.

A pool of 65,536 GPU blocks is first filled with cached content (distinct
2048-token prompts allocated and freed, so their blocks wait in the evictor).
Then a 2048-token prompt (128 blocks) whose first half is cached is allocated
and compared with the same allocate on an uncached manager of the same size:
a lookup must not scan the pool. Measured as one jitted call with the state
donated (what a host scheduler pays, dispatch included) and per allocation in
a compiled loop of 7 such prompts (each with a new second half), the two
configurations interleaved over 3 rounds. The decode step of
bench_block_manager.py is measured with caching on and off. Run from the repo
root:

    python benchmarks/bench_prefix_cache.py
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
import paged_jax as pj  # noqa: E402
from benchmarks.bench_block_manager import bench  # noqa: E402

NUM_BLOCKS = 65536
PROMPT = 2048
LOOPED = 7  # allocations per compiled loop (slots 1..7)


def config(caching: bool) -> pj.CacheConfig:
  return pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=NUM_BLOCKS,
    num_cpu_blocks=0,
    max_seqs=8,
    max_blocks_per_seq=PROMPT // 16,
    watermark=0.0,
    enable_prefix_caching=caching,
  )


def filled_state(bm: pj.BlockSpaceManager, num_prompts: int, rng):
  """Allocates and frees `num_prompts` distinct prompts; returns (state, the first prompt)."""
  alloc, free = jax.jit(bm.allocate), jax.jit(bm.free)
  state = bm.init()
  first = None
  for _ in range(num_prompts):
    tokens = jnp.asarray(rng.integers(0, 32000, PROMPT, dtype=np.int32))
    first = tokens if first is None else first
    state, res = alloc(state, jnp.array([0]), tokens, PROMPT)
    assert int(res.status) == 0, pj.Status(int(res.status))
    state, _ = free(state, jnp.array([0]))
  return state, first


def donated_time(fn, state, *args, repeat=10) -> float:
  """Best time of `fn(state, *args)` with the state donated (a fresh copy each run), as a
  serving loop that threads its state would pay."""
  best = float("inf")
  for _ in range(repeat + 1):
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    start = time.perf_counter()
    jax.block_until_ready(fn(fresh, *args))
    best = min(best, time.perf_counter() - start)
  return best


def looped_allocate(bm: pj.BlockSpaceManager, first_half, second_halves):
  """A compiled loop allocating one prompt per slot 1, 2, ...: `first_half` + a new half."""

  def body(i, state):
    prompt = jnp.concatenate([first_half, second_halves[i]])
    state, _ = bm.allocate(state, (i + 1)[None], prompt, PROMPT)
    return state

  return jax.jit(
    lambda state: jax.lax.fori_loop(0, second_halves.shape[0], body, state), donate_argnums=0
  )


def measure(label, num_prompts, rounds=3):
  """Per-call and in-loop allocate times, cached and uncached, interleaved over `rounds`."""
  rng = np.random.default_rng(0)
  seconds = jnp.asarray(rng.integers(0, 32000, (LOOPED, PROMPT // 2), dtype=np.int32))
  setups = {}
  for caching in (False, True):
    bm = pj.BlockSpaceManager(config(caching))
    state, first = filled_state(bm, num_prompts, np.random.default_rng(1))
    prompt = jnp.concatenate([first[: PROMPT // 2], seconds[0]])
    setups[caching] = (
      bm,
      state,
      prompt,
      jax.jit(bm.allocate, donate_argnums=0),
      looped_allocate(bm, first[: PROMPT // 2], seconds),
    )
  call, loop = {False: [], True: []}, {False: [], True: []}
  for _ in range(rounds):
    for caching, (_bm, state, prompt, alloc, looped) in setups.items():
      call[caching].append(donated_time(alloc, state, jnp.array([1]), prompt, PROMPT))
      loop[caching].append(donated_time(looped, state) / LOOPED)
  bm, state, prompt, alloc, _ = setups[True]
  after, res = alloc(jax.tree.map(jnp.copy, state), jnp.array([1]), prompt, PROMPT)
  assert int(res.status) == 0
  hit_rate = (int(after.num_hits) - int(state.num_hits)) / (
    int(after.num_lookups) - int(state.num_lookups)
  )
  return dict(
    label=label,
    call={c: min(t) for c, t in call.items()},
    loop={c: min(t) for c, t in loop.items()},
    hit_rate=hit_rate,
    cached=int(jnp.sum(after.gpu.content.has_content)),
  )


def main():
  per_prompt = PROMPT // 16
  rows = [
    measure("most blocks cached, room left", NUM_BLOCKS // per_prompt - 2 * LOOPED),
    measure("pool full, misses evict", NUM_BLOCKS // per_prompt),
  ]
  print(
    f"{'pool state':<30} {'call: uncached us':>17} {'cached us':>10} {'ratio':>6} "
    f"{'loop: uncached us':>17} {'cached us':>10} {'ratio':>6} {'hits':>5} "
    f"{'blocks w/ content':>17}"
  )
  for r in rows:
    call, loop = r["call"], r["loop"]
    print(
      f"{r['label']:<30} {call[False] * 1e6:17.1f} {call[True] * 1e6:10.1f} "
      f"{call[True] / call[False]:6.2f} {loop[False] * 1e6:17.1f} {loop[True] * 1e6:10.1f} "
      f"{loop[True] / loop[False]:6.2f} {r['hit_rate']:5.2f} {r['cached']:>17}"
    )
  decode = {b: (bench(b, caching=False)["loop"], bench(b, caching=True)["loop"]) for b in (32, 256)}
  for b, (off, on) in decode.items():
    print(
      f"decode step B={b} in a compiled loop: caching off {off * 1e6:.1f} us, "
      f"on {on * 1e6:.1f} us, {on / off:.2f}x"
    )
  room, full = rows
  print(
    f"summary: allocate 2048 tokens with a 50% hit costs "
    f"{room['call'][True] / room['call'][False]:.2f}x the uncached allocate per call, "
    f"{room['loop'][True] / room['loop'][False]:.2f}x in a compiled loop (target <= 3x; "
    f"{full['call'][True] / full['call'][False]:.2f}x per call when misses evict); decode "
    f"step with caching {decode[256][1] / decode[256][0]:.2f}x of caching off at B=256 "
    f"(target <= 1.5x)"
  )


if __name__ == "__main__":
  main()
