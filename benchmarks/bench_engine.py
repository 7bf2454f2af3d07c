"""The engine on a trace of requests arriving over time, and against the old loop.

1. Online: requests arrive as a Poisson process with ShareGPT-like lengths
   (`paged_jax.simulate`), served by `pj.LLMEngine` step by step. Reports
   throughput, time to first token (TTFT) and inter-token latency (ITL)
   percentiles, the host time per scheduling round and the host's share of
   wall time (everything outside the runner's model calls).
2. Offline throughput on the same prompts, all arriving at once with the same
   `max_tokens`: the engine (`pj.LLM`) against `pj.generate` as it was at
   the base commit (`--base`, loaded from git), side by side in one run.

Usage: python benchmarks/bench_engine.py [--requests 64] [--rate 8] [--batch 32]
       [--model tiny|smollm2] [--base 19340af]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np

import paged_jax as pj
from paged_jax import simulate
from paged_jax.models import load_tiny

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_model(name: str):
  if name == "tiny":
    return load_tiny()
  from paged_jax import models

  try:
    # 256 positions keep the trace's lengths CPU-sized (max_len / 8 prompts).
    return models.load_pretrained("smollm2-135m-instruct", dtype="float32", max_seq_len=256)[0]
  except (AttributeError, FileNotFoundError, ImportError) as err:
    sys.exit(f"--model smollm2 is not available here: {err}")


def base_generate(commit: str):
  """`generate` and `Request` of paged_jax/generate.py at `commit`."""
  source = subprocess.run(
    ["git", "show", f"{commit}:paged_jax/generate.py"],
    cwd=ROOT,
    check=True,
    capture_output=True,
    text=True,
  ).stdout
  path = pathlib.Path(tempfile.mkdtemp()) / "base_generate.py"
  path.write_text(source)
  spec = importlib.util.spec_from_file_location("base_generate", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up
  spec.loader.exec_module(module)
  return module


def workload(model, num_requests: int, batch: int, seed: int):
  """An online trace's prompts (ShareGPT-like lengths of random token ids),
  their output lengths, a cache of `batch` full-length sequences in blocks
  of 16, and the generator that drew the prompts (it draws the arrivals
  next)."""
  max_len = model.config.max_seq_len
  trace = simulate.TraceConfig(
    num_requests=num_requests,
    mean_prompt=max_len / 8,
    mean_output=max_len / 4,
    max_len=max_len,
    seed=seed,
  )
  prompt_lens, output_lens = simulate.sample_lengths(trace)
  rng = np.random.default_rng(seed)
  vocab = model.config.vocab_size
  prompts = [rng.integers(0, min(vocab, 256), n).astype(np.int32) for n in prompt_lens]
  cfg = pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=batch * max_len // 16,
    num_cpu_blocks=0,
    max_seqs=batch,
    max_blocks_per_seq=-(-max_len // 16),
  )
  return prompts, output_lens, cfg, rng


def percentiles(values) -> str:
  values = np.asarray(values) * 1e3
  return " / ".join(f"{np.percentile(values, q):7.1f}" for q in (50, 90, 99))


def make_engine(model, cfg, args, warmup: bool = True) -> pj.LLMEngine:
  """The engine of the online runs: `--batch` sequences, `--budget` tokens per
  round, `--decode-steps` per launch."""
  return pj.LLMEngine(
    model,
    None,
    cfg,
    max_num_seqs=args.batch,
    max_num_batched_tokens=args.budget,
    num_decode_steps=args.decode_steps,
    warmup=warmup,
  )


def online(model, cfg, prompts, max_tokens, arrivals, args):
  return serve_trace(make_engine(model, cfg, args), prompts, max_tokens, arrivals)


def serve_trace(engine, prompts, max_tokens, arrivals, notify_arrivals: bool = False) -> dict:
  """Serves requests arriving at `arrivals` (seconds from the start) on an
  idle `engine`, stepping it as fast as it goes; returns the tokens, wall
  time, per-request TTFT and ITL (mean gap between a request's tokens after
  its first), the host's time per round and share of wall time, and the
  engine's stats. Requests are added between steps; with `notify_arrivals`
  a thread also tells the engine of each at its time (`notify_arrival`, as
  the server's request handlers do), ending the decode launch in flight."""
  engine.timing.update(rounds=0, wall_s=0.0, device_s=0.0)
  first, last, counts = {}, {}, {}
  start = time.perf_counter()
  if notify_arrivals:
    threading.Thread(target=_notify_at, args=(engine, start, arrivals), daemon=True).start()
  next_request = 0
  while next_request < len(prompts) or engine.has_unfinished_requests():
    now = time.perf_counter() - start
    while next_request < len(prompts) and arrivals[next_request] <= now:
      engine.add_request(
        str(next_request),
        prompts[next_request],
        pj.SamplingParams(max_tokens=int(max_tokens[next_request]), ignore_eos=True),
      )
      next_request += 1
    if not engine.has_unfinished_requests():
      time.sleep(max(0.0, arrivals[next_request] - now))
      continue
    for out in engine.step():
      t = time.perf_counter() - start
      n = len(out.outputs[0].token_ids)
      first.setdefault(out.request_id, t)
      last[out.request_id], counts[out.request_id] = t, n
  wall = time.perf_counter() - start
  ids = sorted(first, key=int)
  ttft = [first[i] - arrivals[int(i)] for i in ids]
  itl = [(last[i] - first[i]) / (counts[i] - 1) for i in ids if counts[i] > 1]
  timing = engine.timing
  host = timing["wall_s"] - timing["device_s"]
  return dict(
    tokens=sum(counts.values()),
    wall=wall,
    ttft=ttft,
    itl=itl,
    rounds=timing["rounds"],
    host_per_round=host / timing["rounds"],
    host_share=host / timing["wall_s"],
    stats=engine.stats,
  )


def _notify_at(engine, start: float, arrivals) -> None:
  """Calls `engine.notify_arrival()` at each of `arrivals` (seconds after `start`)."""
  for arrival in arrivals:
    time.sleep(max(0.0, start + arrival - time.perf_counter()))
    engine.notify_arrival()


def offline(model, cfg, prompts, max_tokens, args, base):
  llm = pj.LLM(
    model,
    None,
    cfg,
    max_num_seqs=args.batch,
    max_num_batched_tokens=args.budget,
    num_decode_steps=args.decode_steps,
  )
  params = pj.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  old_sampling = base.SamplingParams(max_new_tokens=max_tokens)
  requests = [base.Request(p) for p in prompts]
  key = jax.random.key(0)
  runs = dict(
    engine=lambda: llm.generate(prompts, params),
    base=lambda: base.generate(model, requests, cfg, old_sampling, key),
  )
  seconds = {}
  for name, run in runs.items():
    run()  # compile
    start = time.perf_counter()
    run()
    seconds[name] = time.perf_counter() - start
  return seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
  parser.add_argument("--batch", type=int, default=32, help="max_num_seqs")
  parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
  parser.add_argument("--decode-steps", type=int, default=16)
  parser.add_argument("--offline-tokens", type=int, default=48)
  parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
  parser.add_argument("--base", default="19340af", help="commit of the old generate")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  model = load_model(args.model)
  max_len = model.config.max_seq_len
  prompts, output_lens, cfg, rng = workload(model, args.requests, args.batch, args.seed)
  prompt_lens = np.array([p.size for p in prompts])
  arrivals = np.cumsum(rng.exponential(1.0 / args.rate, args.requests))

  result = online(model, cfg, prompts, output_lens, arrivals, args)
  print(
    f"online: {args.requests} requests at {args.rate}/s, mean prompt "
    f"{prompt_lens.mean():.0f}, mean output {output_lens.mean():.0f} tokens, "
    f"max_num_seqs {args.batch}"
  )
  print(
    f"{'tokens':>8}{'seconds':>9}{'tok/s':>8}  {'TTFT ms p50/p90/p99':>27}  "
    f"{'ITL ms p50/p90/p99':>27}{'rounds':>8}{'host ms/round':>15}{'host share':>12}"
  )
  print(
    f"{result['tokens']:>8}{result['wall']:>9.2f}{result['tokens'] / result['wall']:>8.0f}  "
    f"{percentiles(result['ttft']):>27}  {percentiles(result['itl']):>27}"
    f"{result['rounds']:>8}{result['host_per_round'] * 1e3:>15.2f}"
    f"{result['host_share']:>12.1%}"
  )
  print(result["stats"])

  offline_prompts = [p[: max_len - args.offline_tokens] for p in prompts[: args.batch]]
  seconds = offline(
    model, cfg, offline_prompts, args.offline_tokens, args, base_generate(args.base)
  )
  tokens = len(offline_prompts) * args.offline_tokens
  print()
  print(f"offline: {len(offline_prompts)} prompts x {args.offline_tokens} new tokens")
  print(f"{'path':<22}{'seconds':>9}{'tok/s':>8}")
  for name, label in (("engine", "pj.LLM"), ("base", f"pj.generate @ {args.base}")):
    print(f"{label:<22}{seconds[name]:>9.3f}{tokens / seconds[name]:>8.0f}")
  print()
  print(
    f"summary: engine/base offline throughput {seconds['base'] / seconds['engine']:.2f}x "
    f"(target >= 1x); online host share {result['host_share']:.1%} at batch "
    f"{args.batch} (target < 10%), {result['host_per_round'] * 1e3:.2f} ms per round"
  )


if __name__ == "__main__":
  main()
