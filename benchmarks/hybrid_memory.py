"""KV-cache bytes per sequence of Gemma 3: every block kept vs. hybrid tables.

Two designs for a model whose layers mix sliding-window and global
attention:

* keep every block (a `CacheConfig` without a window, what the engine
  serves Gemma on today): every layer holds all of the sequence's blocks
  and the sliding layers mask their attention;
* hybrid (`HybridBlockSpaceManager`, one block table per attention type, as
  vLLM V1's hybrid allocator): the global layers hold every block, the
  sliding layers only the blocks that still hold one of the last `window`
  positions.

Shapes are those of the published Gemma 3 `config.json` files (bfloat16
K and V, 5 sliding layers to 1 global); no model is loaded. The block
counts come from the real managers: one sequence is served as the engine
would, a prompt appended in chunks, then decode steps, and the blocks each
type's table holds at the end are counted (and checked against the
arithmetic of `blocks_held`).

The "engine" columns count what `LLMEngine(hybrid_kv_cache=True)` holds:
its sliding types keep `window + chunk - 1` positions for prompt chunks of
half the window.

  python benchmarks/hybrid_memory.py [--tokens 8192 32768] [--block-size 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import numpy as np

from paged_jax.block_manager.arguments import jit_op
from paged_jax.block_manager.hybrid import HybridBlockSpaceManager, HybridCacheConfig
from paged_jax.config import CacheConfig, Status


@dataclasses.dataclass(frozen=True)
class HybridShape:
  """What sizes a hybrid model's KV cache.

  Attributes:
    name: the model.
    num_layers: decoder layers.
    num_kv_heads: key/value heads per layer.
    head_dim: features per head.
    sliding_window: keys a sliding layer's query sees.
    pattern: every `pattern`-th layer is global, the others slide.
  """

  name: str
  num_layers: int
  num_kv_heads: int
  head_dim: int
  sliding_window: int
  pattern: int = 6

  @property
  def num_global_layers(self) -> int:
    return self.num_layers // self.pattern

  @property
  def num_sliding_layers(self) -> int:
    return self.num_layers - self.num_global_layers


GEMMA3 = (
  HybridShape("gemma-3-1b", num_layers=26, num_kv_heads=1, head_dim=256, sliding_window=512),
  HybridShape("gemma-3-4b", num_layers=34, num_kv_heads=4, head_dim=256, sliding_window=1024),
  HybridShape("gemma-3-12b", num_layers=48, num_kv_heads=8, head_dim=256, sliding_window=1024),
  HybridShape("gemma-3-27b", num_layers=62, num_kv_heads=16, head_dim=128, sliding_window=1024),
)


def blocks_held(num_tokens: int, block_size: int, window: int | None) -> int:
  """Blocks one layer of a sequence of `num_tokens` holds: all of them, or
  with a window only those holding one of its last `window` positions."""
  if num_tokens == 0:
    return 0
  last = (num_tokens - 1) // block_size
  first = 0 if window is None else max(0, (num_tokens - window) // block_size)
  return last - first + 1


def kv_bytes_per_sequence(
  shape: HybridShape, num_tokens: int, *, block_size: int, hybrid: bool, dtype_bytes: int = 2
) -> int:
  """Bytes of K and V one sequence holds in either design.

  Args:
    shape: the model.
    num_tokens: the sequence's length.
    block_size: tokens per block.
    hybrid: sliding layers hold only their window's blocks (else every
      layer holds every block).
    dtype_bytes: bytes per element (2: bfloat16).

  Returns:
    Bytes over all layers.
  """
  block_bytes = 2 * shape.num_kv_heads * block_size * shape.head_dim * dtype_bytes  # K and V
  every_block = blocks_held(num_tokens, block_size, None)
  window_blocks = blocks_held(num_tokens, block_size, shape.sliding_window if hybrid else None)
  blocks = shape.num_global_layers * every_block + shape.num_sliding_layers * window_blocks
  return blocks * block_bytes


PROMPT_CHUNK = 512  # tokens per prompt chunk (at most the window, as the engine appends them)
DECODE_STEPS = 8  # one-token appends after the prompt


@functools.cache
def _ops(cfg):
  """The jitted allocate and append_slots of a hybrid manager."""
  manager = HybridBlockSpaceManager(cfg)
  return manager, jit_op(manager.allocate), jit_op(manager.append_slots)


def manager_blocks(
  windows: tuple, num_tokens: int, block_size: int, chunk: int = PROMPT_CHUNK
) -> dict[int | None, int]:
  """Blocks each attention type's table holds after serving one sequence of `num_tokens`.

  The sequence is allocated empty, its first `num_tokens - DECODE_STEPS`
  tokens appended in chunks of `chunk`, then the rest one token a
  step, on a `HybridCacheConfig` whose layers have `windows` (None: global).

  Returns:
    {window: blocks held in that type's table}.
  """
  table_len = -(-num_tokens // block_size)
  cache = CacheConfig(
    block_size=block_size,
    num_gpu_blocks=table_len + 1,
    num_cpu_blocks=0,
    max_seqs=1,
    max_blocks_per_seq=table_len,
    watermark=0.0,
  )
  cfg = HybridCacheConfig(cache, windows)
  manager, allocate, append = _ops(cfg)
  state, result = allocate(manager.init(), np.array([0], np.int32), np.zeros(1, np.int32), 0)
  prompt = num_tokens - DECODE_STEPS
  chunks = [chunk] * (prompt // chunk) + [prompt % chunk] * bool(prompt % chunk)
  steps = [(count, chunk) for count in chunks] + [(1, 1)] * DECODE_STEPS
  for count, width in steps:
    tokens = np.ones((1, width), np.int32)
    state, result = append(state, np.array([0], np.int32), tokens, np.array([count], np.int32))
    assert Status(int(result.status)) == Status.OK, Status(int(result.status))
  tables = jax.device_get(manager.get_block_tables(state, np.array([0], np.int32)))
  return {window: int(np.sum(table >= 0)) for window, table in zip(cfg.windows, tables)}


def measured_bytes_per_sequence(
  shape: HybridShape,
  num_tokens: int,
  *,
  block_size: int,
  hybrid: bool,
  dtype_bytes: int = 2,
  engine: bool = False,
) -> int:
  """`kv_bytes_per_sequence` from the real manager's block counts (the same
  design choice); with `engine`, on the hybrid cache `LLMEngine(...,
  hybrid_kv_cache=True)` builds: prompt chunks of half the window, and a
  sliding type that keeps `window + chunk - 1` positions."""
  chunk = shape.sliding_window // 2 if engine else PROMPT_CHUNK
  window = shape.sliding_window + (chunk - 1 if engine else 0)
  layers = [
    None if (layer + 1) % shape.pattern == 0 or not hybrid else window
    for layer in range(shape.num_layers)
  ]
  held = manager_blocks(tuple(layers), num_tokens, block_size, chunk)
  block_bytes = 2 * shape.num_kv_heads * block_size * shape.head_dim * dtype_bytes
  return sum(held[window] for window in layers) * block_bytes


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
  parser.add_argument("--block-size", type=int, default=16)
  args = parser.parse_args()
  for tokens in args.tokens:
    print(
      f"\nKV cache per sequence at {tokens} tokens, block size {args.block_size}, bfloat16 "
      "(block counts from the managers)\n"
    )
    print(
      f"{'model':<12} {'layers':>6} {'global':>6} {'kv x dim':>9} {'window':>6} "
      f"{'every block':>12} {'hybrid':>9} {'saved':>6} {'engine':>9} {'saved':>6}"
    )
    ratios = []
    for shape in GEMMA3:
      kept, hybrid = (
        measured_bytes_per_sequence(shape, tokens, block_size=args.block_size, hybrid=windowed)
        for windowed in (False, True)
      )
      for windowed, measured in ((False, kept), (True, hybrid)):
        arithmetic = kv_bytes_per_sequence(
          shape, tokens, block_size=args.block_size, hybrid=windowed
        )
        assert measured == arithmetic, (shape.name, windowed, measured, arithmetic)
      engine = measured_bytes_per_sequence(
        shape, tokens, block_size=args.block_size, hybrid=True, engine=True
      )
      ratios.append(kept / hybrid)
      print(
        f"{shape.name:<12} {shape.num_layers:>6} {shape.num_global_layers:>6} "
        f"{shape.num_kv_heads:>4} x {shape.head_dim:<3} {shape.sliding_window:>6} "
        f"{kept / 2**30:>10.2f} GiB {hybrid / 2**30:>5.2f} GiB {kept / hybrid:>5.1f}x "
        f"{engine / 2**30:>5.2f} GiB {kept / engine:>5.1f}x"
      )
    print(
      f"\nsummary: hybrid tables hold {min(ratios):.1f}x to {max(ratios):.1f}x less KV cache "
      f"than keeping every block at {tokens} tokens"
    )


if __name__ == "__main__":
  main()
