"""Quantized KV caches (int8, fp8) against bfloat16: capacity, speed, accuracy.

1. Capacity: sequences of `--seq-len` tokens whose blocks fit the same KV
   memory, from `bytes_per_block` and `num_gpu_blocks_for_memory` (scales
   included: int8/fp8 rows cost `head_dim + 4` bytes against `2 * head_dim`),
   for a Llama-3-8B-like shape (32 layers, 8 KV heads) at head_dim 64, 128
   and 256; then a real cache of each dtype allocated on this device for a
   small budget, to check that its arrays take what the helpers counted.
2. Decode tokens/s: `generate` with the tiny model (bfloat16 compute) and
   each cache dtype, side by side in one run (compiled first, best of
   `--repeats`).
3. Accuracy: `kv_cache_accuracy` on the tiny model: mean log-probability of
   the book's text through paged prefill and decode, and greedy agreement of
   16 tokens, against the bfloat16 cache.

Usage: python benchmarks/bench_quant_kv.py [--batch 8] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import paged_jax as pj
from paged_jax.models import kv_accuracy
from paged_jax.models.pretrained import load_tiny, tiny_corpus
from paged_jax.models.tokenizer import ByteTokenizer

DTYPES = (jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn)


def capacity_rows(memory_gib: float, seq_len: int, block_size: int):
  """(head_dim, dtype, block bytes, blocks, sequences) per shape and dtype."""
  rows = []
  for head_dim in (64, 128, 256):
    for dtype in DTYPES:
      block_bytes = pj.bytes_per_block(
        block_size=block_size, num_layers=32, num_kv_heads=8, head_dim=head_dim, dtype=dtype
      )
      blocks = pj.num_gpu_blocks_for_memory(
        int(memory_gib * (1 << 30)), block_bytes, utilization=1.0
      )
      rows.append(
        (head_dim, jnp.dtype(dtype).name, block_bytes, blocks, blocks // -(-seq_len // block_size))
      )
  return rows


def allocated_bytes(budget_bytes: int, block_size: int, head_dim: int):
  """Blocks and the device bytes of real caches sized to ``budget_bytes``."""
  out = {}
  for dtype in DTYPES:
    block_bytes = pj.bytes_per_block(
      block_size=block_size, num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype=dtype
    )
    blocks = pj.num_gpu_blocks_for_memory(budget_bytes, block_bytes, utilization=1.0)
    cfg = pj.CacheConfig(block_size=block_size, num_gpu_blocks=blocks, num_cpu_blocks=0)
    cache = pj.KVCache.create(cfg, 2, 2, head_dim, dtype=dtype)
    out[jnp.dtype(dtype).name] = (blocks, cache.nbytes)
  return out


def decode_tokens_per_second(model, prompts, new_tokens: int, repeats: int) -> dict:
  """Generated tokens per second of ``generate`` per cache dtype."""
  longest = max(len(p) for p in prompts) + new_tokens
  blocks = -(-longest // 16)
  cfg = pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=len(prompts) * blocks,
    num_cpu_blocks=0,
    max_seqs=len(prompts),
    max_blocks_per_seq=blocks,
  )
  sampling = pj.SamplingParams(max_tokens=new_tokens)
  requests = [pj.Request(p) for p in prompts]
  rates = {}
  for dtype in DTYPES:

    def run():
      outputs, _ = pj.generate(
        model, requests, cfg, sampling, jax.random.key(0), kv_cache_dtype=dtype
      )
      return sum(len(o[0]) for o in outputs)

    run()  # compile
    best = float("inf")
    for _ in range(repeats):
      start = time.perf_counter()
      tokens = run()
      best = min(best, time.perf_counter() - start)
    rates[jnp.dtype(dtype).name] = tokens / best
  return rates


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--memory-gib", type=float, default=80.0)
  parser.add_argument("--seq-len", type=int, default=2048)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()

  print(
    f"1. Capacity in {args.memory_gib:g} GiB of KV memory, 32 layers x 8 "
    f"KV heads, block 16, sequences of {args.seq_len} tokens"
  )
  print(
    f"{'head_dim':>8} {'dtype':>14} {'bytes/block':>12} {'blocks':>8} {'seqs':>6} {'vs bf16':>8}"
  )
  rows = capacity_rows(args.memory_gib, args.seq_len, 16)
  base = {}
  for head_dim, name, block_bytes, blocks, seqs in rows:
    base.setdefault(head_dim, seqs)
    print(
      f"{head_dim:>8} {name:>14} {block_bytes:>12} {blocks:>8} "
      f"{seqs:>6} {seqs / base[head_dim]:>7.2f}x"
    )
  ratio_128 = {name: seqs / base[128] for d, name, _, _, seqs in rows if d == 128}

  budget = 64 << 20
  print(
    f"\n   Real caches for {budget >> 20} MiB (2 layers, 2 KV heads, head_dim 128) on",
    jax.devices()[0].platform,
  )
  for name, (blocks, nbytes) in allocated_bytes(budget, 16, 128).items():
    print(
      f"{name:>23} {blocks:>8} blocks, {nbytes:>10} bytes ({nbytes / budget:.3f} of the budget)"
    )

  model = kv_accuracy.with_compute_dtype(load_tiny(), jnp.bfloat16)
  text = tiny_corpus()
  tokenizer = ByteTokenizer()
  starts = np.linspace(30000, len(text) - 100, args.batch).astype(int)
  prompts = [tokenizer.encode(text[s : s + 32]) for s in starts]
  print(
    f"\n2. Decode, tiny model (bfloat16 compute), batch {args.batch}, "
    f"{args.new_tokens} new tokens, {jax.devices()[0].platform}"
  )
  rates = decode_tokens_per_second(model, prompts, args.new_tokens, args.repeats)
  for name, rate in rates.items():
    print(f"{name:>14} {rate:>10.1f} tokens/s {rate / rates['bfloat16']:>6.2f}x")

  print("\n3. Accuracy, tiny model, against the bfloat16 cache")
  eval_prompts = [text[s : s + 32] for s in range(30000, 350000, 20000)]
  results = kv_accuracy.kv_cache_accuracy(
    load_tiny(), tokenizer, text[20000:], eval_prompts, dtypes=DTYPES[1:], num_rows=8
  )
  print(f"{'dtype':>14} {'mean log p':>11} {'change':>8} {'greedy 16 agree':>16}")
  for r in results:
    print(
      f"{r['dtype']:>14} {r['mean_log_prob']:>11.4f} "
      f"{100 * r['relative_change']:>7.3f}% "
      f"{r['greedy_agree']:>9}/{r['num_prompts']}"
    )
  change = {r["dtype"]: r["relative_change"] for r in results}
  print(
    f"\nSummary: at head_dim 128 int8 fits {ratio_128['int8']:.2f}x and "
    f"fp8 {ratio_128['float8_e4m3fn']:.2f}x the sequences of bf16; decode "
    f"int8 {rates['int8'] / rates['bfloat16']:.2f}x, fp8 "
    f"{rates['float8_e4m3fn'] / rates['bfloat16']:.2f}x bf16 tokens/s; "
    f"log-prob change int8 {100 * change['int8']:.3f}%, fp8 "
    f"{100 * change['float8_e4m3fn']:.3f}%"
  )


if __name__ == "__main__":
  main()
