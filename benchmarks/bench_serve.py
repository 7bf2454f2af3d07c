"""Open-loop load on an OpenAI-compatible server over HTTP streaming.

Like `vllm bench serve`: requests arrive as a Poisson process at each
`--request-rate` (requests/s; `inf` sends them all at once) without waiting
for earlier ones, each streams its completion, and the run reports request
throughput, output tokens/s, and TTFT (time to first token), TPOT (time per
output token after the first) and ITL (gap between streamed chunks; a
server that sends several tokens per chunk shows fewer, longer gaps) at
p50/p90/p99. Prompts are a fixed synthetic set that share a system prompt;
`ignore_eos` with `max_tokens=--output-len` fixes the output lengths, and
output tokens are the server's own usage counts (`include_usage`).

Works against any OpenAI-compatible server (`python -m paged_jax serve`,
`vllm serve`, ...).

Usage:
  python -m paged_jax serve --model smollm2-135m-instruct --max-model-len 512 &
  python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 \\
    --model smollm2-135m-instruct --request-rate 0.5 1 --num-prompts 16 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import time

import httpx
import numpy as np
from soak_serve import event_lines  # this folder: run as `python benchmarks/bench_serve.py`

SYSTEM_PROMPT = (
  "You are a careful assistant for a museum of natural history. Answer every "
  "question in plain words for a curious visitor, give one concrete example, "
  "and keep the answer short.\n\n"
)
TOPICS = (
  "how glaciers carve valleys",
  "why some birds migrate at night",
  "what fossils tell us about ancient climates",
  "how coral reefs grow",
  "why volcanoes form along plate boundaries",
  "how bees find their way home",
  "what makes a mineral a gemstone",
  "how whales communicate over long distances",
  "why deserts can be cold at night",
  "how tree rings record droughts",
  "what causes the northern lights",
  "how octopuses change colour",
  "why dinosaurs had hollow bones",
  "how caves form in limestone",
  "what lives at the bottom of the ocean",
  "how seeds travel far from their parent plant",
)


def prompts(count: int) -> list[str]:
  """`count` prompts, the shared system prompt then a question each."""
  return [
    f"{SYSTEM_PROMPT}Visitor: Please explain {TOPICS[i % len(TOPICS)]}"
    f"{'' if i < len(TOPICS) else f' (question {i})'}.\nGuide:"
    for i in range(count)
  ]


@dataclasses.dataclass
class Result:
  """One request's timings in seconds."""

  ok: bool
  latency: float = 0.0
  ttft: float = 0.0
  output_tokens: int = 0
  itl: list[float] = dataclasses.field(default_factory=list)
  error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> Result:
  """Streams one completion; times its first token, its chunks and its end."""
  start = time.perf_counter()
  ttft, last, gaps, tokens = None, None, [], 0
  try:
    async with client.stream("POST", url, json=body) as response:
      if response.status_code != 200:
        return Result(ok=False, error=f"HTTP {response.status_code}: {await response.aread()!r}")
      async for line in event_lines(response):
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:
          return Result(ok=False, error=chunk["error"]["message"])
        if chunk.get("usage"):
          tokens = chunk["usage"]["completion_tokens"]
        if any(choice.get("text") for choice in chunk.get("choices", [])):
          now = time.perf_counter()
          if ttft is None:
            ttft = now - start
          else:
            gaps.append(now - last)
          last = now
  except httpx.HTTPError as err:
    return Result(ok=False, error=f"{type(err).__name__}: {err}")
  if ttft is None:
    return Result(ok=False, error="no token streamed")
  return Result(
    ok=True, latency=time.perf_counter() - start, ttft=ttft, output_tokens=tokens, itl=gaps
  )


async def run_rate(args, rate: float, texts: list[str]) -> dict:
  """Sends every prompt at Poisson arrivals of `rate` per second; returns the summary."""
  rng = np.random.default_rng(args.seed)
  gaps = np.zeros(len(texts)) if math.isinf(rate) else rng.exponential(1 / rate, len(texts))
  headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
  url = f"{args.base_url.rstrip('/')}/v1/completions"
  limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
  async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
    start = time.perf_counter()
    tasks = []
    for gap, text in zip(gaps, texts):
      await asyncio.sleep(gap)
      body = dict(
        model=args.model,
        prompt=text,
        max_tokens=args.output_len,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
      )
      tasks.append(asyncio.create_task(one_request(client, url, body)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
  return summarize(rate, results, duration)


def _percentiles(values: list[float]) -> list[float]:
  if not values:
    return [float("nan")] * 3
  return [float(np.percentile(values, q)) * 1000 for q in (50, 90, 99)]


def summarize(rate: float, results: list[Result], duration: float) -> dict:
  done = [r for r in results if r.ok]
  tokens = sum(r.output_tokens for r in done)
  tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
  return dict(
    request_rate=rate,
    completed=len(done),
    failed=len(results) - len(done),
    errors=sorted({r.error for r in results if not r.ok})[:3],
    duration_s=round(duration, 2),
    request_throughput=round(len(done) / duration, 3),
    output_tokens_per_s=round(tokens / duration, 1),
    ttft_ms=[round(v, 1) for v in _percentiles([r.ttft for r in done])],
    tpot_ms=[round(v, 1) for v in _percentiles(tpot)],
    itl_ms=[round(v, 1) for v in _percentiles([g for r in done for g in r.itl])],
  )


def print_table(rows: list[dict]) -> None:
  header = (
    f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>6} {'tok/s':>7} "
    f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>22}"
  )
  print(header)
  triple = lambda v: "/".join(f"{x:.0f}" for x in v)
  for row in rows:
    print(
      f"{row['request_rate']:>6g} {row['completed']:>5} {row['failed']:>4} "
      f"{row['request_throughput']:>6.2f} {row['output_tokens_per_s']:>7.1f} "
      f"{triple(row['ttft_ms']):>22} {triple(row['tpot_ms']):>22} {triple(row['itl_ms']):>22}"
    )
    for error in row["errors"]:
      print(f"       error: {error}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--base-url", default="http://127.0.0.1:8000")
  parser.add_argument("--model", required=True, help="the served model name")
  parser.add_argument("--request-rate", type=float, nargs="+", default=[1.0])
  parser.add_argument("--num-prompts", type=int, default=16)
  parser.add_argument("--output-len", type=int, default=32)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--api-key", default=None)
  parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
  parser.add_argument("--json", action="store_true", help="print one JSON line per rate as well")
  args = parser.parse_args()
  texts = prompts(args.num_prompts)
  rows = []
  for rate in args.request_rate:
    rows.append(asyncio.run(run_rate(args, rate, texts)))
    if args.json:
      print(json.dumps(rows[-1]))
  print_table(rows)
  best = max(rows, key=lambda row: row["output_tokens_per_s"])
  print(
    f"{args.model} at {args.base_url}: {sum(r['completed'] for r in rows)} requests of "
    f"{args.output_len} output tokens; best {best['output_tokens_per_s']} output tokens/s at "
    f"{best['request_rate']:g} req/s (TTFT p50 {best['ttft_ms'][0]:.0f} ms, TPOT p50 "
    f"{best['tpot_ms'][0]:.0f} ms)"
  )


if __name__ == "__main__":
  main()
