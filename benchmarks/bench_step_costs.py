"""What one engine step costs, paged_jax against vLLM CPU: prompts on an idle
engine, and decode steps of a few running sequences.

- prefill: `n` prompts of `L` random token ids, one output token each, on
  an idle engine: milliseconds until every request finished (best of 3).
- decode: `rows` requests of 200 random tokens, 65 output tokens each (EOS
  ignored), stepped one engine step at a time: the time from when each
  has its first token to the end, per token (contexts of 200 to 264).
- join: while `rows` such requests decode, one more of 200 tokens arrives:
  milliseconds from its arrival to its first token, stepped one engine
  step at a time (best of 3 arrivals), what a request that joins a busy
  server waits at least.

paged_jax runs the `serve` defaults' engine in this process (SmolLM2,
`--quantization none --max-model-len 512`, warmed up). With
`--vllm-python`, the same runs in vLLM's venv (this file with `--peer`,
importing nothing of paged_jax) on the Hugging Face folder `--hf-dir`,
vLLM on both cores as its CPU docs advise (`bench_vs_peers.vllm_cpu_env`).

  python benchmarks/bench_step_costs.py [--dtype bfloat16]
      [--vllm-python /work/peers/vllm/bin/python --hf-dir /work/peers/hf]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

PREFILLS = ((1, 56), (1, 200), (2, 200), (4, 128))  # (prompts, tokens each)
DECODE_ROWS = (1, 4, 16, 32)
JOIN_ROWS = (4, 16, 28)
DECODE_PROMPT, DECODE_TOKENS = 200, 65
RESULT = "step costs: "  # the peer's result line (vLLM logs to stdout too)


def prompts(rng, count: int, length: int) -> list[list[int]]:
  return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def step_costs(generate, decode_steps, join) -> dict:
  """Prefill times (ms) of `generate(prompts, max_tokens)`, which serves
  the prompts to the end, decode step times (ms) of
  `decode_steps(prompts, max_tokens)`, which returns the seconds and the
  steps from when every request has its first token to the end, and join
  times (ms) of `join(prompts, arrivals, tag)` (see `timed_join`)."""
  import random

  rng = random.Random(0)
  generate(prompts(rng, 2, DECODE_PROMPT), 2)  # anything left to warm up
  prefill = {}
  for count, length in PREFILLS:
    times = []
    for _ in range(3):
      batch = prompts(rng, count, length)
      start = time.perf_counter()
      generate(batch, 1)
      times.append(time.perf_counter() - start)
    prefill[f"{count} x {length}"] = min(times) * 1e3
  decode = {}
  for rows in DECODE_ROWS:
    seconds, steps = decode_steps(prompts(rng, rows, DECODE_PROMPT), DECODE_TOKENS)
    decode[str(rows)] = seconds / steps * 1e3
  joins = {}
  for rows in JOIN_ROWS:
    seconds = join(prompts(rng, rows, DECODE_PROMPT), prompts(rng, 3, DECODE_PROMPT), str(rows))
    joins[str(rows)] = seconds * 1e3
  return dict(prefill=prefill, decode=decode, join=joins)


def first_tokens(outputs, counts: dict) -> None:
  """Records each output's token count in `counts` by request id."""
  for out in outputs:
    counts[out.request_id] = len(out.outputs[0].token_ids)


def timed_join(add, step, batch, arrivals, tag: str) -> float:
  """`add(request_id, prompt, max_tokens)` the `batch` (65 tokens each),
  `step()` until each has a token, then for each of `arrivals` add it (one
  token) and step until it has its token: the least seconds that took.
  Request ids start with `tag`."""
  counts = {}
  for i, prompt in enumerate(batch):
    add(f"{tag}row{i}", prompt, DECODE_TOKENS)
  while len(counts) < len(batch) or min(counts.values()) < 1:
    first_tokens(step(), counts)
  times = []
  for i, prompt in enumerate(arrivals):
    start = time.perf_counter()
    add(f"{tag}join{i}", prompt, 1)
    while counts.get(f"{tag}join{i}", 0) < 1:
      first_tokens(step(), counts)
    times.append(time.perf_counter() - start)
  while len(counts) < len(batch) + len(arrivals) or any(
    counts[f"{tag}row{i}"] < DECODE_TOKENS for i in range(len(batch))
  ):
    first_tokens(step(), counts)
  return min(times)


def timed_decode(add, step, unfinished, batch, max_tokens):
  """`add(i, prompt)` each prompt, `step()` (outputs with `request_id` and
  `outputs[0].token_ids`) until each has a token, then until none is
  unfinished: (seconds, steps) of that decoding."""
  counts = {}
  for i, prompt in enumerate(batch):
    add(str(i), prompt)
  while len(counts) < len(batch) or min(counts.values()) < 1:
    for out in step():
      counts[out.request_id] = len(out.outputs[0].token_ids)
  start = time.perf_counter()
  while unfinished():
    step()
  return time.perf_counter() - start, max_tokens - 1


def paged_jax_costs(dtype: str) -> dict:
  import numpy as np

  import paged_jax as pj
  from paged_jax.server import cli

  parser = argparse.ArgumentParser()
  cli.add_parser(parser.add_subparsers())
  serve = ["serve", "--model", "smollm2-135m-instruct", "--dtype", dtype]
  args = parser.parse_args(serve + ["--quantization", "none", "--max-model-len", "512"])
  engine = cli.engine_builder(args)().engine
  ids = iter(range(10**9))

  def generate(batch, max_tokens):
    params = pj.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for prompt in batch:
      engine.add_request(str(next(ids)), np.asarray(prompt, np.int32), params)
    while engine.has_unfinished_requests():
      engine.step()

  def decode_steps(batch, max_tokens):
    params = pj.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    add = lambda i, p: engine.add_request(f"d{next(ids)}", np.asarray(p, np.int32), params)
    return timed_decode(add, engine.step, engine.has_unfinished_requests, batch, max_tokens)

  def join(batch, arrivals, tag):
    add = lambda i, p, n: engine.add_request(
      i, np.asarray(p, np.int32), pj.SamplingParams(max_tokens=n, ignore_eos=True)
    )
    return timed_join(add, engine.step, batch, arrivals, tag)

  return step_costs(generate, decode_steps, join)


def vllm_costs(hf_dir: str, dtype: str) -> dict:
  from vllm import LLM, SamplingParams

  llm = LLM(model=hf_dir, dtype=dtype, max_model_len=512, max_num_seqs=32)

  engine, ids = llm.llm_engine, iter(range(10**9))

  def generate(batch, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

  def decode_steps(batch, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    add = lambda i, p: engine.add_request(f"d{next(ids)}", {"prompt_token_ids": p}, params)
    return timed_decode(add, engine.step, engine.has_unfinished_requests, batch, max_tokens)

  def join(batch, arrivals, tag):
    add = lambda i, p, n: engine.add_request(
      i, {"prompt_token_ids": p}, SamplingParams(max_tokens=n, ignore_eos=True)
    )
    return timed_join(add, engine.step, batch, arrivals, tag)

  return step_costs(generate, decode_steps, join)


def run_vllm(python: str, hf_dir: str, dtype: str) -> dict:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  from bench_vs_peers import vllm_cpu_env

  command = [python, __file__, "--peer", "--hf-dir", hf_dir, "--dtype", dtype]
  out = subprocess.run(
    command, env=vllm_cpu_env(python), capture_output=True, text=True, check=False
  )
  if out.returncode != 0:
    raise SystemExit(f"vLLM's run failed ({out.returncode}):\n{out.stderr[-3000:]}")
  line = next(line for line in out.stdout.splitlines() if line.startswith(RESULT))
  return json.loads(line[len(RESULT) :])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--vllm-python")
  parser.add_argument("--hf-dir")
  parser.add_argument("--peer", action="store_true", help="run vLLM here (in its venv)")
  args = parser.parse_args()
  if args.peer:
    print(RESULT + json.dumps(vllm_costs(args.hf_dir, args.dtype)))
    return
  columns = {}  # vLLM first, before this process holds an engine
  if args.vllm_python:
    columns["vLLM CPU"] = run_vllm(args.vllm_python, args.hf_dir, args.dtype)
  columns["paged_jax"] = paged_jax_costs(args.dtype)
  names = list(columns)
  print(f"dtype {args.dtype}; milliseconds")
  print("| step | " + " | ".join(names) + " |")
  print("|---|" + "---:|" * len(names))
  labels = (
    ("prefill", "prompts {}"),
    ("decode", "decode step, {} rows"),
    ("join", "200-token arrival to its first token, {} rows decoding"),
  )
  for kind, label in labels:
    for key in columns[names[0]][kind]:
      cells = " | ".join(f"{columns[name][kind][key]:,.1f}" for name in names)
      print(f"| {label.format(key)} | {cells} |")


if __name__ == "__main__":
  main()
