"""Prefix-hit rate under a sliding window: a shared system prompt longer than the window.

Each request is one shared system prompt followed by its own question. It
is served as the engine serves a windowed cache: allocated empty, then
appended chunk by chunk (each chunk under the window), then decoded a few
tokens, then freed. The hit rate is hit blocks over looked-up blocks, and
"blocks skipped" the share of each later request's prompt blocks found in
the cache.

Two caches, each with and without the window rule of docs/semantics.md
("Prefix caching under a window"):

* all-windowed (Mistral-like): one type of window `--window`;
* hybrid (Gemma-3-like): a global type and a sliding type;

and, as the ceiling, a cache that keeps every block (no window).

Without the rule, prefix caching was refused on both (`CacheConfig` and
`HybridCacheConfig` raised), so no block was ever a hit. With the rule the
numbers come from the plain-Python reference (`tests/reference/`), which
states it, and from the jitted managers (`BlockSpaceManager`,
`HybridBlockSpaceManager`), which implement it: the two must agree. These
are manager-level counts, not timings.

  python benchmarks/window_prefix_hits.py [--system 2048] [--window 1024] [--requests 16]
      [--managers reference,jax]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from paged_jax.block_manager import (  # noqa: E402
  BlockSpaceManager,
  HybridBlockSpaceManager,
  HybridCacheConfig,
)
from paged_jax.block_manager.arguments import jit_op  # noqa: E402
from paged_jax.config import CacheConfig, Status  # noqa: E402
from tests.reference.block_manager import ReferenceBlockSpaceManager  # noqa: E402
from tests.reference.hybrid import ReferenceHybridManager  # noqa: E402


def requests(args) -> list[list[int]]:
  rng = random.Random(0)
  system = [rng.randrange(32_000) for _ in range(args.system)]
  return [
    system + [rng.randrange(32_000) for _ in range(args.question)] for _ in range(args.requests)
  ]


def serve(manager, prompt: list[int], args) -> None:
  """Allocate empty, append the prompt in chunks, decode, free (one sequence, slot 0)."""
  append = manager.append_slots
  first = manager.allocate_counting_hits([0], [], 0)[0]
  assert first == Status.OK
  for start in range(0, len(prompt), args.chunk):
    piece = prompt[start : start + args.chunk]
    assert append([0], [piece], [len(piece)])[0] == Status.OK
  for token in range(args.decode):
    assert append([0], [[token]], [1])[0] == Status.OK
  freed = manager.free([0])
  assert (freed[0] if isinstance(freed, tuple) else freed) == Status.OK


class JaxRun:
  """A jitted manager (plain or hybrid) behind `serve`'s calls, with its counters."""

  def __init__(self, manager, chunk: int):
    self.manager, self.chunk = manager, chunk
    self.state = manager.init()
    self.ops = {
      name: jit_op(getattr(manager, name)) for name in ("allocate", "append_slots", "free")
    }
    self.empty = np.zeros(1, np.int32)

  def allocate_counting_hits(self, seq_ids, tokens, count):
    self.state, result = self.ops["allocate"](
      self.state, np.array(seq_ids, np.int32), self.empty, np.int32(count)
    )
    return (Status(int(result.status)),)

  def append_slots(self, seq_ids, rows, counts):
    width = self.chunk if counts[0] > 1 else 1  # two shapes: prompt chunks and decode steps
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : counts[0]] = rows[0]
    self.state, result = self.ops["append_slots"](
      self.state, np.array(seq_ids, np.int32), tokens, np.array(counts, np.int32)
    )
    return (Status(int(result.status)),)

  def free(self, seq_ids):
    self.state, result = self.ops["free"](self.state, np.array(seq_ids, np.int32))
    return (Status(int(result.status)),)

  def counters(self) -> tuple[int, int]:
    """(hits, lookups) of every type."""
    states = getattr(self.state, "groups", (self.state,))
    states = jax.device_get(states)
    return sum(int(s.num_hits) for s in states), sum(int(s.num_lookups) for s in states)


def _reference_counters(manager) -> tuple[int, int]:
  types = getattr(manager, "types", [manager])
  return sum(t._state.hits for t in types), sum(t._state.lookups for t in types)


def measure(args) -> list[tuple[str, str, float, float]]:
  cache = CacheConfig(
    block_size=args.block_size,
    num_gpu_blocks=args.gpu_blocks,
    num_cpu_blocks=0,
    max_seqs=1,
    max_blocks_per_seq=-(-(args.system + args.question + args.decode) // args.block_size),
    watermark=0.0,
    enable_prefix_caching=True,
  )
  window = dataclasses.replace(cache, sliding_window=args.window)
  hybrid = HybridCacheConfig(cache, (None, args.window))
  makers = {
    "reference": (
      lambda: ReferenceBlockSpaceManager(cache),
      lambda: ReferenceBlockSpaceManager(cache, sliding_window=args.window),
      lambda: ReferenceHybridManager(cache, [None, args.window]),
    ),
    "jax": (
      lambda: JaxRun(BlockSpaceManager(cache), args.chunk),
      lambda: JaxRun(BlockSpaceManager(window), args.chunk),
      lambda: JaxRun(HybridBlockSpaceManager(hybrid), args.chunk),
    ),
  }
  names = ("every block kept (no window)", "all-windowed", "hybrid global + window")
  rows = []
  for kind in args.managers.split(","):
    for name, make in zip(names, makers[kind]):
      manager = make()
      counters = manager.counters if kind == "jax" else lambda: _reference_counters(manager)
      prompts = requests(args)
      serve(manager, prompts[0], args)
      first_hits, first_lookups = counters()
      for prompt in prompts[1:]:
        serve(manager, prompt, args)
      hits, lookups = counters()
      rows.append(
        (
          kind,
          name,
          hits / max(lookups, 1),
          (hits - first_hits) / max(lookups - first_lookups, 1),
        )
      )
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--system", type=int, default=2048, help="shared system prompt tokens")
  parser.add_argument("--question", type=int, default=100, help="each request's own tokens")
  parser.add_argument("--window", type=int, default=1024)
  parser.add_argument("--chunk", type=int, default=512, help="prompt tokens per append")
  parser.add_argument("--decode", type=int, default=8)
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--gpu-blocks", type=int, default=512)
  parser.add_argument(
    "--managers", default="reference,jax", help="reference, jax (the jitted managers), or both"
  )
  args = parser.parse_args()
  print(
    f"system prompt {args.system} tokens, window {args.window}, chunks of {args.chunk}, "
    f"{args.requests} requests, block size {args.block_size}"
  )
  print("| manager | cache | without the rule | with the rule | requests 2.. with the rule |")
  print("|---|---|---|---|---|")
  for kind, name, rate, later in measure(args):
    without = "(no rule needed)" if "no window" in name else "0.0% (refused)"
    print(f"| {kind} | {name} | {without} | {rate:.1%} | {later:.1%} |")


if __name__ == "__main__":
  main()
