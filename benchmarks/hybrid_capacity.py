"""Concurrent long sequences at one KV byte budget: the engine's hybrid cache vs every block kept.

A Gemma-3-shaped tiny model (random weights; 6 layers, 5 sliding over
`--window` keys to 1 global, Gemma 3's norms, RoPE and soft caps) serves
`--requests` requests of `--prompt` prompt tokens and `--new` greedy new
tokens on `pj.LLMEngine`, twice with the same `kv_cache_memory_bytes`:

* every block kept (one block table; each sliding layer masks its window);
* `hybrid_kv_cache=True` (one table and pool per attention type: the
  sliding layers hold their window, plus one prompt chunk).

The budget holds `--budget-seqs` full-length sequences with every block
kept. Reported per design: the GPU blocks the budget gives, the most
sequences decoding at once (their whole prompt in the cache; after each
step), the most admitted (a hybrid cache admits a prompt empty and appends
its chunks as blocks allow), the most blocks in use during a decode step,
preemptions, steps, and the seconds it took (wall clock on a shared machine: compare only the two
lines of one run). Greedy tokens of the two designs are checked equal.

  python benchmarks/hybrid_capacity.py [--window 32] [--prompt 992] [--new 32]
      [--requests 24] [--budget-seqs 4] [--block-size 16]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import paged_jax as pj  # noqa: E402
from paged_jax import models  # noqa: E402
from paged_jax.models.layers import LinearRopeScaling  # noqa: E402


def gemma3_tiny(window: int, max_seq_len: int) -> models.Llama:
  """A Gemma-3-shaped model: 5 sliding layers to 1 global, tiny widths."""
  config = models.LlamaConfig(
    vocab_size=256,
    num_layers=6,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    hidden=64,
    mlp_hidden=128,
    max_seq_len=max_seq_len,
    tie_embeddings=True,
    sliding_window=window,
    layer_types=("sliding_attention",) * 5 + ("full_attention",),
    rope_theta=1e6,
    local_rope_theta=1e4,
    rope_scaling=LinearRopeScaling(8.0),
    qk_norm=True,
    norm_weight_offset=1.0,
    sandwich_norms=True,
    activation="gelu_tanh",
    query_pre_attn_scalar=16.0,
    scale_embeddings=True,
  )
  return models.Llama(config, rngs=nnx.Rngs(0))


def serve(model, cfg, prompts, params, budget: int, hybrid: bool) -> dict:
  """Serves `prompts` on one engine; its counts and greedy tokens."""
  engine = pj.LLMEngine(
    model,
    None,
    cfg,
    max_num_batched_tokens=256,
    num_decode_steps=8,
    decode_row_buckets=(),
    kv_cache_memory_bytes=budget,
    hybrid_kv_cache=hybrid,
  )
  for i, prompt in enumerate(prompts):
    engine.add_request(str(i), prompt, params)
  start, steps, most, admitted, tokens = time.perf_counter(), 0, 0, 0, {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        tokens[int(out.request_id)] = out.outputs[0].token_ids
    steps += 1
    running = [s for g in engine.schedulers[0].running for s in g.live()]
    admitted = max(admitted, len(running))
    most = max(most, sum(s.tokens_to_prefill is None for s in running))
  blocks = engine.cache_manager.hybrid.gpu_blocks if hybrid else (engine.cfg.num_gpu_blocks,)
  return dict(
    blocks=blocks,
    kv_bytes=engine.cache_manager.kv.nbytes,
    most_decoding=most,
    most_admitted=admitted,
    peak_blocks=engine.stats.peak_blocks,
    preemptions=engine.stats.preemptions,
    steps=steps,
    seconds=time.perf_counter() - start,
    tokens=[tokens[i] for i in range(len(prompts))],
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--window", type=int, default=32)
  parser.add_argument("--prompt", type=int, default=992)
  parser.add_argument("--new", type=int, default=32)
  parser.add_argument("--requests", type=int, default=24)
  parser.add_argument("--budget-seqs", type=int, default=4)
  parser.add_argument("--block-size", type=int, default=16)
  args = parser.parse_args()
  length = args.prompt + args.new
  model = gemma3_tiny(args.window, length)
  cfg = pj.CacheConfig(
    block_size=args.block_size,
    num_cpu_blocks=0,
    max_seqs=args.requests,
    max_blocks_per_seq=-(-length // args.block_size),
    watermark=0.0,
  )
  c = model.config
  per_seq = pj.bytes_per_block(
    block_size=args.block_size,
    num_layers=c.num_layers,
    num_kv_heads=c.num_kv_heads,
    head_dim=c.head_dim,
    dtype=c.dtype,
  ) * cfg.blocks_for(length)
  budget = args.budget_seqs * per_seq
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 256, args.prompt).astype(np.int32) for _ in range(args.requests)]
  params = pj.SamplingParams(max_tokens=args.new, ignore_eos=True)
  print(
    f"{args.requests} requests of {args.prompt} + {args.new} tokens, window {args.window}, "
    f"blocks of {args.block_size}, KV budget {budget} bytes ({args.budget_seqs} sequences with "
    f"every block kept)"
  )
  runs = {}
  for name, hybrid in (("every block kept", False), ("hybrid tables", True)):
    runs[name] = run = serve(model, cfg, prompts, params, budget, hybrid)
    print(
      f"{name:<17} blocks {run['blocks']}, {run['kv_bytes']} bytes; most decoding at once "
      f"{run['most_decoding']} (admitted {run['most_admitted']}), peak blocks "
      f"{run['peak_blocks']}, preemptions {run['preemptions']}, steps {run['steps']}, "
      f"{run['seconds']:.1f} s"
    )
  kept, hybrid = runs["every block kept"], runs["hybrid tables"]
  assert kept["tokens"] == hybrid["tokens"], "the two designs' greedy tokens differ"
  print(
    f"summary: {hybrid['most_decoding'] / kept['most_decoding']:.1f}x the sequences decoding "
    f"at once ({hybrid['most_decoding']} vs {kept['most_decoding']}), greedy tokens equal"
  )


if __name__ == "__main__":
  main()
