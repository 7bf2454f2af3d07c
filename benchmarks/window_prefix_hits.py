"""Prefix-hit rate under a sliding window: a shared system prompt longer than the window.

Each request is one shared system prompt followed by its own question. It
is served as the engine serves a windowed cache: allocated empty, then
appended chunk by chunk (each chunk under the window), then decoded a few
tokens, then freed. The hit rate is hit blocks over looked-up blocks, and
"blocks skipped" the share of each later request's prompt blocks found in
the cache.

Two caches, each with and without the window rule of docs/semantics.md
("What prefix caching under a window needs"):

* all-windowed (Mistral-like): one type of window `--window`;
* hybrid (Gemma-3-like): a global type and a sliding type;

and, as the ceiling, a cache that keeps every block (no window).

Without the rule, prefix caching is refused on both (`CacheConfig` and
`HybridCacheConfig` raise), so no block is ever a hit. With the rule the
numbers come from the plain-Python reference (`tests/reference/`), which
states it; the jitted manager does not implement it yet, so these are
manager-level counts of the rule, not timings.

  python benchmarks/window_prefix_hits.py [--system 2048] [--window 1024] [--requests 16]
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

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


def hit_rate(state) -> float:
  return state.hits / max(state.lookups, 1)


def measure(args) -> list[tuple[str, float, float]]:
  cache = CacheConfig(
    block_size=args.block_size,
    num_gpu_blocks=args.gpu_blocks,
    num_cpu_blocks=0,
    max_seqs=1,
    max_blocks_per_seq=-(-(args.system + args.question + args.decode) // args.block_size),
    watermark=0.0,
    enable_prefix_caching=True,
  )
  rows = []
  for name, make in (
    ("every block kept (no window)", lambda: ReferenceBlockSpaceManager(cache)),
    ("all-windowed", lambda: ReferenceBlockSpaceManager(cache, sliding_window=args.window)),
    ("hybrid global + window", lambda: ReferenceHybridManager(cache, [None, args.window])),
  ):
    manager = make()
    types = getattr(manager, "types", [manager])
    prompts = requests(args)
    serve(manager, prompts[0], args)
    before = [(t._state.hits, t._state.lookups) for t in types]
    for prompt in prompts[1:]:
      serve(manager, prompt, args)
    later_hits = sum(t._state.hits - h for t, (h, _) in zip(types, before))
    later_lookups = sum(t._state.lookups - n for t, (_, n) in zip(types, before))
    rate = sum(t._state.hits for t in types) / max(sum(t._state.lookups for t in types), 1)
    rows.append((name, rate, later_hits / max(later_lookups, 1)))
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
  args = parser.parse_args()
  print(
    f"system prompt {args.system} tokens, window {args.window}, chunks of {args.chunk}, "
    f"{args.requests} requests, block size {args.block_size}"
  )
  print("| cache | without the rule | with the rule | requests 2.. with the rule |")
  print("|---|---|---|---|")
  for name, rate, later in measure(args):
    without = "(no rule needed)" if "no window" in name else "0.0% (refused)"
    print(f"| {name} | {without} | {rate:.1%} | {later:.1%} |")


if __name__ == "__main__":
  main()
