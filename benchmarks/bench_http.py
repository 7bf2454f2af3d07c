"""The HTTP serving workload, driven by vLLM's own client (`vllm bench serve`).

Starts `python -m paged_jax serve` for each code tree of `--code` (label=DIR,
so that two commits run side by side in one run) and each `--dtypes`, then
drives it with `vllm bench serve`: 200-token slices of the project's own
docs (`soak_serve.text_slices`: vLLM's random prompts can hold a NUL, which
the server refuses), 64 output tokens with `--ignore-eos`, 48 requests,
arriving at 4 requests/s and then all at once under 16 concurrent. It
reports output tokens/s and TTFT, TPOT and inter-chunk latency (ITL) at
p50/p99, one row per server and workload, and for paged_jax the programs
compiled after warm-up so far (its `/metrics`), which should stay 0.

`vllm bench serve` comes from a side venv with vLLM installed (`--vllm`, the
venv's `vllm` command); it only sends requests, so any vLLM build serves.
`--tokenizer` is a Hugging Face tokenizer folder of the model (the prompts
are sliced in its tokens). Servers run one at a time.

`--vllm-server PYTHON` adds vLLM's own OpenAI server as a peer, from a venv
with vLLM's CPU build, on the Hugging Face folder `--hf-dir` (written by
`bench_vs_peers.save_hf_folder`), set up as its CPU documentation advises
for a dedicated machine (`bench_vs_peers.vllm_cpu_env`: every core bound,
tcmalloc and Intel OpenMP preloaded), with the same `--max-model-len`.

Usage:
  python benchmarks/bench_http.py --vllm /venv/bin/vllm --tokenizer DIR \\
    [--code before=/tree/of/old/commit "after=.;--quantization none"] \\
    [--dtypes bfloat16 float32] \\
    [--vllm-server /venv/bin/python --hf-dir DIR] [--max-model-len 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from soak_serve import (  # noqa: E402
  BENCH_FIELDS,
  Server,
  run_quietly,
  text_slices,
  text_slices_flags,
)

WORKLOADS = {
  "4 req/s": ["--request-rate", "4"],
  "16 concurrent": ["--request-rate", "inf", "--max-concurrency", "16"],
}


def bench_serve(args, url: str, workload: list[str]) -> dict:
  """One `vllm bench serve` run against `url`; the fields of `BENCH_FIELDS`."""
  with tempfile.TemporaryDirectory() as folder:
    command = [
      args.vllm, "bench", "serve", "--backend", "openai", "--base-url", url,
      "--model", args.served_name, "--tokenizer", args.tokenizer,
      *text_slices_flags(args.dataset), "--num-prompts", str(args.num_prompts),
      "--seed", str(args.seed),
      *workload, "--save-result", "--result-dir", folder, "--result-filename", "result.json",
      "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    run_quietly(command, timeout=1800)
    measured = json.loads(pathlib.Path(folder, "result.json").read_text())
  return {field: measured.get(field) for field in BENCH_FIELDS}


def run_server(args, label: str, dtype: str, server: Server, paged_jax=True) -> list[dict]:
  """Every workload against a started `server`, which it stops. A paged_jax
  server's rows also count the programs it compiled after its warm-up, so
  far (`compiles`; None for vLLM)."""
  start = time.perf_counter()
  rows = []
  try:
    server.wait_healthy()
    ready_s = time.perf_counter() - start
    for name, workload in WORKLOADS.items():
      print(f"[{label} {dtype}] {name}", file=sys.stderr, flush=True)
      row = dict(server=label, dtype=dtype, workload=name, start_s=round(ready_s, 1))
      row |= bench_serve(args, server.url, workload)
      rows.append(row | dict(compiles=server.compiles() if paged_jax else None))
  finally:
    server.kill()
  return rows


def paged_jax_server(args, tree: str, dtype: str) -> Server:
  """`python -m paged_jax serve` of the code in `tree` (`DIR`, or `DIR;FLAGS`
  with flags for this tree's server only)."""
  tree, _, tree_flags = tree.partition(";")
  env = dict(os.environ, PYTHONPATH=str(pathlib.Path(tree).resolve()))
  flags = ["--model", args.model, "--served-model-name", args.served_name, "--dtype", dtype]
  flags += ["--max-model-len", str(args.max_model_len), *shlex.split(tree_flags)]
  return Server([*flags, *args.server_args], env=env)


def vllm_server(args, dtype: str) -> Server:
  """vLLM's OpenAI server on `--hf-dir`, on every core as its CPU docs advise."""
  from bench_vs_peers import vllm_cpu_env

  flags = ["--model", str(args.hf_dir), "--served-model-name", args.served_name]
  flags += ["--dtype", dtype, "--max-model-len", str(args.max_model_len)]
  # 2 GiB of KV pages, as peer_worker gives vLLM offline: left to size its
  # cache itself, vLLM's CPU worker grew to 22 of the machine's 24 GiB.
  flags += ["--kv-cache-memory-bytes", str(2 * 2**30)]
  program = (args.vllm_server, "-m", "vllm.entrypoints.openai.api_server")
  return Server(flags, env=vllm_cpu_env(args.vllm_server), program=program)


def markdown(rows: list[dict]) -> str:
  """The rows as a Markdown table."""
  header = (
    "| server | dtype | workload | tok/s | TTFT p50/p99 (ms) | TPOT p50/p99 | ITL p50/p99 "
    "| compiled while serving |"
  )
  lines = [header, "|---|---|---|---:|---:|---:|---:|---:|"]
  pair = lambda row, a, b: f"{row[a]:,.0f} / {row[b]:,.0f}"
  for row in rows:
    compiles = "" if row["compiles"] is None else row["compiles"]
    lines.append(
      f"| {row['server']} | {row['dtype']} | {row['workload']} | "
      f"{row['output_throughput']:.1f} | {pair(row, 'median_ttft_ms', 'p99_ttft_ms')} | "
      f"{pair(row, 'median_tpot_ms', 'p99_tpot_ms')} | "
      f"{pair(row, 'median_itl_ms', 'p99_itl_ms')} | {compiles} |"
    )
  return "\n".join(lines)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vllm", required=True, help="vLLM's `vllm` command (a side venv)")
  parser.add_argument("--tokenizer", required=True, help="the model's HF tokenizer folder")
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--served-name", default="smollm2")
  parser.add_argument(
    "--code",
    nargs="+",
    default=["paged_jax=."],
    help="LABEL=DIR trees, or LABEL=DIR;FLAGS with serve flags for that tree only",
  )
  parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  parser.add_argument("--num-prompts", type=int, default=48)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-model-len", type=int, default=512, help="of every server")
  parser.add_argument("--vllm-server", help="python of a venv with vLLM's CPU build: a peer")
  parser.add_argument("--hf-dir", help="the model's Hugging Face folder, for --vllm-server")
  parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
  parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
  args = parser.parse_args(argv)
  if args.vllm_server and not args.hf_dir:
    parser.error("--vllm-server needs --hf-dir, the folder vLLM serves")
  return args


def main(argv=None) -> None:
  args = parse_args(argv)
  rows = []
  with tempfile.TemporaryDirectory() as folder:
    args.dataset = f"{folder}/prompts.json"
    text_slices(args.vllm, args.tokenizer, args.dataset, args.num_prompts, args.seed)
    for dtype in args.dtypes:
      for label, tree in (code.split("=", 1) for code in args.code):
        rows += run_server(args, label, dtype, paged_jax_server(args, tree, dtype))
      if args.vllm_server:
        rows += run_server(args, "vLLM CPU", dtype, vllm_server(args, dtype), paged_jax=False)
  print(markdown(rows))
  if args.json:
    print(json.dumps(rows))


if __name__ == "__main__":
  main()
