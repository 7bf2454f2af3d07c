"""`python -m paged_jax demo|trace|serve|aot`: run a model, replay a trace, serve over HTTP, or
compile the engine's programs for a TPU topology without a TPU.

`demo` serves a batch of requests with `pj.LLM` on the paged cache and
reports throughput and paging statistics. With a pretrained model
(SmolLM2-135M-Instruct by default) the requests are chat conversations that
share a system prompt; with `--model tiny` (the shipped byte-level toy) they
are dictionary headwords, every other one after a shared prefix. Every
fourth request asks for 4 samples. `trace` replays a simulated serving
trace through the block manager alone. `serve` serves a model over an
OpenAI-compatible HTTP API (see `paged_jax.server`). `aot` compiles every
program of the engine's warm-up with libtpu for a named TPU topology and
reports compile seconds, HBM and KV blocks per chip (see `paged_jax.aot`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from paged_jax import aot as aot_tool
from paged_jax.aot_kv import describe_kv
from paged_jax.command_line import (
  add_quantization_argument,
  load_model,
  positive,
  weight_quantization,
)
from paged_jax.config import CacheConfig
from paged_jax.server import cli as serve_cli

SYSTEM_PREFIX = "The following are definitions from The Devil's Dictionary by Ambrose Bierce.\n\n"
HEADWORDS = (
  "LOVE",
  "WAR",
  "PEACE",
  "LAWYER",
  "MONEY",
  "FRIEND",
  "POLITICS",
  "HAPPINESS",
  "DEBT",
  "GENIUS",
  "HOPE",
  "PATIENCE",
  "CYNIC",
  "DIPLOMACY",
  "EDUCATION",
  "FAME",
)
DEFAULT_MODEL = "smollm2-135m-instruct"
SYSTEM_PROMPT = (
  "You are a helpful AI assistant named SmolLM, trained by "
  "Hugging Face. Answer in one or two short sentences."
)
QUESTIONS = (
  "What is the capital of France?",
  "Why is the sky blue?",
  "Name three primary colours.",
  "What is a prime number?",
  "How many legs does a spider have?",
  "What does a bee make?",
  "Give me a synonym for happy.",
  "What is the boiling point of water in Celsius?",
  "Who wrote Romeo and Juliet?",
  "What is photosynthesis?",
  "Suggest a name for a pet goldfish.",
  "What is the largest planet in the solar system?",
)


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m paged_jax")
  sub = parser.add_subparsers(dest="command", required=True)
  demo = sub.add_parser(
    "demo",
    help=f"serve a batch of requests on the paged cache ({DEFAULT_MODEL} unless --model says)",
  )
  demo.add_argument(
    "--num-requests",
    type=positive,
    default=None,
    help="default: 8 for a pretrained model, 32 for tiny",
  )
  demo.add_argument("--block-size", type=positive, default=16)
  demo.add_argument("--num-gpu-blocks", type=positive, default=96)
  demo.add_argument("--num-cpu-blocks", type=int, default=64)
  demo.add_argument("--max-seqs", type=positive, default=32)
  demo.add_argument(
    "--max-num-batched-tokens",
    type=positive,
    default=512,
    help="prompt tokens a round computes at most (bounds the prefill buckets)",
  )
  demo.add_argument(
    "--max-tokens", type=positive, default=40, help="tokens generated per sequence at most"
  )
  demo.add_argument("--seed", type=int, default=0)
  demo.add_argument(
    "--model",
    default=DEFAULT_MODEL,
    help=f"a Hugging Face folder, a .gguf file, a model name or 'tiny' (default: {DEFAULT_MODEL})",
  )
  demo.add_argument(
    "--dtype",
    default="float32",
    choices=("float32", "bfloat16", "float16"),
    help="parameter and compute dtype of a pretrained model",
  )
  demo.add_argument(
    "--max-seq-len", type=positive, default=256, help="context of a pretrained model in the demo"
  )
  add_quantization_argument(demo)
  demo.add_argument("--json", action="store_true", help="print machine-readable JSON")
  trace = sub.add_parser("trace", help="replay a ShareGPT-like trace through the block manager")
  trace.add_argument("--num-requests", type=positive, default=200)
  trace.add_argument("--block-size", type=positive, default=16)
  trace.add_argument("--num-gpu-blocks", type=positive, default=2048)
  trace.add_argument("--max-seqs", type=positive, default=32)
  trace.add_argument("--seed", type=int, default=0)
  trace.add_argument("--json", action="store_true", help="print machine-readable JSON")
  serve_cli.add_parser(sub)
  aot = sub.add_parser(
    "aot", help="compile the engine's programs for a TPU topology, no TPU needed"
  )
  aot.add_argument(
    "--model",
    required=True,
    help="what serve takes ('tiny', a folder, a name), or a shape-only model without weights: "
    + ", ".join(aot_tool.SHAPE_ONLY),
  )
  aot.add_argument(
    "--dtype",
    default="bfloat16",
    choices=("bfloat16", "float32"),
    help="weights and compute of a downloaded or shape-only model",
  )
  aot.add_argument("--topology", required=True, help="a libtpu topology name, e.g. v5e:2x2")
  aot.add_argument("--tensor-parallel-size", type=positive, default=1)
  add_quantization_argument(aot)
  aot.add_argument(
    "--variant",
    action="append",
    choices=[*aot_tool.VARIANTS, *aot_tool.OPTIONAL_VARIANTS],
    help="engine variants to compile (repeatable; default: all but the optional "
    f"{', '.join(aot_tool.OPTIONAL_VARIANTS)})",
  )
  aot.add_argument(
    "--program",
    action="append",
    help="compile only the launches of this name (repeatable; e.g. decode_loop, ragged_step; "
    "default: all)",
  )
  aot.add_argument("--json", action="store_true", help="last line: the report as one JSON object")
  return parser


def run_aot(args, parser) -> int:
  """Compiles the engine's programs for `args.topology`; prints the report."""
  if args.model in aot_tool.SHAPE_ONLY and args.quantization == "gguf":
    parser.error(f"--quantization gguf needs a GGUF file; {args.model} is shapes only")
  # The host engine the programs are captured from needs one CPU device per
  # model shard; set before JAX starts its backends.
  flag = f"--xla_force_host_platform_device_count={args.tensor_parallel_size}"
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  try:
    aot_tool.require_libtpu()
    if args.model in aot_tool.SHAPE_ONLY:
      quantization = weight_quantization(args.model, args.quantization)
      model = aot_tool.ShapeOnlyModel.named(args.model, args.dtype, quantization=quantization)
    else:
      model, _ = load_model(
        args.model, dtype=args.dtype, max_seq_len=256, quantization=args.quantization
      )
    known = aot_tool.VARIANTS | aot_tool.OPTIONAL_VARIANTS
    variants = {v: known[v] for v in args.variant or aot_tool.VARIANTS}
    report = aot_tool.compile_engine_programs(
      model, args.topology, args.tensor_parallel_size, variants, args.program
    )
  except (RuntimeError, ValueError, FileNotFoundError) as err:
    parser.exit(2, f"aot: {err}\n")
  if args.json:
    print(json.dumps(report))
    return 0
  for program in report["programs"]:
    print(
      f"{program['name']}: {program['compile_s']:.2f} s, {program['hbm_bytes']} bytes HBM, "
      f"{program['mosaic_kernels']} Mosaic kernel calls"
    )
  print(
    f"{args.topology}: {len(report['programs'])} programs; per chip "
    f"{report['weight_bytes_per_chip']} bytes of weights, "
    f"{report['max_temp_bytes']} bytes of temporaries at most"
  )
  for line in describe_kv(report):
    print(line)
  return 0


def demo_requests(num_requests: int, seed: int, tokenizer):
  """The demo's prompts as token ids, the samples each asks for, and the text
  that shows each prompt.

  With a `ByteTokenizer` (the tiny model), headwords of which every other one
  follows the shared system prefix; else chat conversations, all with the
  same system prompt. Every fourth request asks for 4 samples.
  """
  import numpy as np

  rng = np.random.default_rng(seed)
  prompts, counts, shown = [], [], []
  for index in range(num_requests):
    if _byte_level(tokenizer):
      word = HEADWORDS[rng.integers(len(HEADWORDS))]
      text = shown_text = (SYSTEM_PREFIX if index % 2 == 0 else "") + f"{word}, n. "
      ids = tokenizer.encode(text)
    else:
      shown_text = QUESTIONS[(index + seed) % len(QUESTIONS)]
      text = tokenizer.apply_chat_template(
        [dict(role="system", content=SYSTEM_PROMPT), dict(role="user", content=shown_text)],
        add_generation_prompt=True,
      )
      ids = tokenizer.encode(text)
    prompts.append(np.asarray(ids, np.int32))
    counts.append(4 if index % 4 == 1 else 1)
    shown.append(shown_text)
  return prompts, counts, shown


def _byte_level(tokenizer) -> bool:
  """Whether `tokenizer` is the tiny and saved models' `ByteTokenizer` (no
  chat template: the demo sends them headwords)."""
  from paged_jax.models.tokenizer import ByteTokenizer

  return isinstance(tokenizer, ByteTokenizer)


def load_demo_model(args):
  """`(model, tokenizer)` of the demo's `--model` (see
  `command_line.load_model`, which `serve` loads with too)."""
  return load_model(
    args.model, dtype=args.dtype, max_seq_len=args.max_seq_len, quantization=args.quantization
  )


def run_demo(args, parser) -> dict:
  """Serves the demo batch with `pj.LLM`; returns the report."""
  import dataclasses

  from paged_jax.engine import LLM, SamplingParams

  try:
    model, tokenizer = load_demo_model(args)
  except (FileNotFoundError, ValueError) as err:
    parser.error(f"--model: {err}")
  max_len = model.config.max_seq_len
  try:
    cfg = CacheConfig(
      block_size=args.block_size,
      num_gpu_blocks=args.num_gpu_blocks,
      num_cpu_blocks=args.num_cpu_blocks,
      max_seqs=args.max_seqs,
      max_blocks_per_seq=-(-max_len // args.block_size),
      enable_prefix_caching=True,
    )
  except ValueError as err:
    parser.error(str(err))
  if args.num_gpu_blocks * args.block_size < max_len:
    parser.error(
      f"--num-gpu-blocks {args.num_gpu_blocks} x --block-size "
      f"{args.block_size} cannot hold one {max_len}-token sequence"
    )
  byte_level = _byte_level(tokenizer)
  num_requests = args.num_requests or (32 if byte_level else 8)
  prompts, counts, shown = demo_requests(num_requests, args.seed, tokenizer)
  if max(counts) > args.max_seqs:
    parser.error(f"--max-seqs {args.max_seqs} is below the 4 samples some requests ask for")
  sampling = SamplingParams(
    max_tokens=args.max_tokens,
    temperature=0.8 if byte_level else 0.6,
    top_k=40,
    top_p=1.0 if byte_level else 0.9,
  )
  params = [dataclasses.replace(sampling, n=n) for n in counts]
  # Preemption by swap; the tokenizer's EOS stops.
  llm = LLM(
    model,
    tokenizer,
    cfg,
    preemption_mode="swap",
    seed=args.seed,
    max_num_batched_tokens=args.max_num_batched_tokens,
  )
  for index, (prompt, p) in enumerate(zip(prompts, params)):
    error = llm.engine.admission_error(prompt.size, p)
    if error is not None:
      parser.error(f"request {index}: {error}")
  # Every program compiles first (the token budget bounds the prefill
  # buckets), so the timed run compiles nothing.
  llm.engine.warmup()
  start = time.perf_counter()
  outputs = llm.generate(prompts, params, progress=not args.json)
  seconds = time.perf_counter() - start
  stats = llm.engine.stats
  samples = [
    dict(prompt=shown[i], outputs=[o.text.strip() for o in outputs[i].outputs])
    for i in range(min(3, len(prompts)))
  ]
  return dict(
    requests=len(prompts),
    sequences=sum(counts),
    generated_tokens=stats.generated_tokens,
    seconds=round(seconds, 3),
    tokens_per_s=round(stats.generated_tokens / seconds, 1),
    peak_blocks=stats.peak_blocks,
    num_gpu_blocks=cfg.num_gpu_blocks,
    kv_slot_utilization=round(stats.kv_slot_utilization, 4),
    prefix_cache_hit_rate=round(stats.prefix_cache_hit_rate, 4),
    prompt_tokens=stats.prompt_tokens,
    prefill_tokens=stats.prefill_tokens,
    prefill_padding=round(stats.prefill_padding, 4),
    decode_padding=round(stats.decode_padding, 4),
    cow_copies=stats.cow_copies,
    preemptions=stats.preemptions,
    swapped_blocks=stats.swaps,
    decode_steps=stats.decode_steps,
    samples=samples,
  )


def print_demo(report: dict) -> None:
  for sample in report["samples"]:
    print(f"--- prompt: {sample['prompt']!r}")
    for text in sample["outputs"]:
      print(f"    -> {text!r}")
  print(
    f"served {report['requests']} requests ({report['sequences']} sequences), "
    f"{report['generated_tokens']} tokens in {report['seconds']:.1f} s "
    f"(after warm-up): {report['tokens_per_s']:.0f} tokens/s"
  )
  print(
    f"peak blocks {report['peak_blocks']}/{report['num_gpu_blocks']}, "
    f"KV slot utilization {report['kv_slot_utilization']:.1%} (tokens of every "
    f"sequence per allocated slot: shared blocks lift it above 100%), "
    f"prefix-cache hit rate {report['prefix_cache_hit_rate']:.1%} "
    f"({report['prefill_tokens']}/{report['prompt_tokens']} prompt tokens computed, "
    f"{report['prefill_padding']:.0%} of prefill and {report['decode_padding']:.0%} of "
    "decode positions padding)"
  )
  print(
    f"copy-on-write copies {report['cow_copies']}, preemptions "
    f"{report['preemptions']}, swapped blocks {report['swapped_blocks']}"
  )


def run_trace(args, parser) -> None:
  from paged_jax.simulate import TraceConfig, replay

  max_len = 2048
  try:
    cfg = CacheConfig(
      block_size=args.block_size,
      num_gpu_blocks=args.num_gpu_blocks,
      num_cpu_blocks=0,
      max_seqs=args.max_seqs,
      max_blocks_per_seq=-(-max_len // args.block_size),
    )
  except ValueError as err:
    parser.error(str(err))
  if args.num_gpu_blocks * args.block_size < max_len:
    parser.error(
      f"--num-gpu-blocks {args.num_gpu_blocks} x --block-size {args.block_size} "
      f"cannot hold one {max_len}-token request"
    )
  report = replay(cfg, TraceConfig(num_requests=args.num_requests, max_len=max_len, seed=args.seed))
  if args.json:
    print(json.dumps(report))
    return
  print(
    f"served {report['finished']}/{report['requests']} requests in "
    f"{report['decode_steps']} decode steps ({report['preemptions']} preemptions)"
  )
  print(f"mean prompt {report['mean_prompt']:.0f} tokens, mean output {report['mean_output']:.0f}")
  print(
    f"KV slots holding tokens: paged {report['paged_utilization']:.1%}, "
    f"contiguous max-length reservation {report['contiguous_utilization']:.1%}"
  )


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.command == "trace":
    run_trace(args, parser)
    return 0
  if args.command == "serve":
    return serve_cli.run(args)
  if args.command == "aot":
    return run_aot(args, parser)
  if args.num_cpu_blocks < 0:
    parser.error(f"--num-cpu-blocks must be >= 0, got {args.num_cpu_blocks}")
  report = run_demo(args, parser)
  if args.json:
    print(json.dumps(report))
  else:
    print_demo(report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
