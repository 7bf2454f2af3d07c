"""A soak of `python -m paged_jax serve`: many mixed requests, then checks
that nothing leaked and that every answer is the one it gives alone.

The requests (seeded, `--requests` of them, `--concurrency` at a time, each
retried after a 503's `Retry-After` as OpenAI's client does, with a burst of
`2 * --max-waiting-requests` requests that are not retried every
`--burst-every`):
completions and chat, streamed or not, n = 1..4, beam search, log
probabilities and echo, stop strings, structured outputs (a choice, a regex,
a JSON schema), greedy and seeded sampling; some streams disconnect after
their first event. Chat only where the model has a chat template (the tiny
model has none).

Afterwards it checks, and reports:
  - every request that completed gave the text it gives when sent alone
    (greedy and seeded ones; the solo reruns go one at a time);
  - every refused request got a 4xx/5xx with OpenAI's error body;
  - `/metrics`: requests in (`paged_jax:requests_total`, all outcomes)
    equals the requests sent, and completed plus refused matches what the
    client saw;
  - every KV block is free and no request runs or waits;
  - no program compiled after the engine's warm-up (the server's
    `paged_jax:compiles_while_serving_total`; the report names them from
    the server's log): a compile while serving stalls every request and
    keeps its compiler's memory in malloc's arenas, tens of MiB each;
  - the server's RSS is within 10% of its RSS after warm-up (the engine's,
    then a first mix of `--warm-up-requests` and one of each structured
    output, so that what each kind of request allocates once, such as the
    automata of its constraints, is in); the report adds RSS sampled each
    second through the soak and resident memory by mapping kind before and
    after;
  - the server still answers;
  - SIGTERM during a burst of streams: the process exits 0 within 10 s and
    every open stream ends with an error event or `[DONE]`.

With `--vllm-bench PATH` (vLLM's `vllm` command, from a side venv) and
`--bench-tokenizer DIR` (the model's Hugging Face tokenizer folder), a fresh
server with the default limits then takes vLLM's own load generator,
`vllm bench serve` (48 prompts of 200 tokens sliced from docs/semantics.md
by vLLM's `create_txt_slices_dataset`, 64 output tokens with `ignore_eos`)
at each `--bench-rates`, and the report gives its failed requests, output
tokens/s, TTFT, TPOT and ITL; a failed request fails the run. (vLLM's
`random` dataset decodes random token ids, which can give a NUL: the
server refuses it with 400.)

  python benchmarks/soak_serve.py [--model tiny] [--requests 2000] [--json]
      [--vllm-bench /venv/bin/vllm --bench-tokenizer DIR [--bench-rates 1 4 16]]

The last line with `--json` is one JSON object of the numbers. Exits 1 if a
check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

HEADWORDS = ("LOVE", "WAR", "PEACE", "LAWYER", "MONEY", "FRIEND", "HOPE", "FAME", "DEBT", "WIT")
STOPS = (" the", "e,", "\n", "ing")
MAX_RETRIES = 20
CONSTRAINTS = (
  dict(structured_outputs={"choice": ["yes", "no", "maybe"]}),
  dict(structured_outputs={"regex": "[a-z]{2,8}( [a-z]{2,8})?"}),
  dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}),
)


@dataclasses.dataclass
class Spec:
  """One request: its path and body, and how the client treats it."""

  path: str
  body: dict
  disconnect: bool = False  # a stream that leaves after its first event

  @property
  def deterministic(self) -> bool:
    body = self.body
    return body.get("temperature", 1.0) == 0 or "seed" in body or body.get("use_beam_search")


@dataclasses.dataclass
class Outcome:
  status: int
  texts: dict[int, str] | None = None  # choice index -> text, when completed
  error: dict | None = None
  disconnected: bool = False
  retry_after: float | None = None  # a 503's Retry-After


def make_spec(
  rng: random.Random, model: str, chat: bool = True, structured_share: float = 0.15
) -> Spec:
  """A random request of the mix (completions only unless `chat`;
  `structured_share` of them with a structured output)."""
  word = rng.choice(HEADWORDS)
  body = dict(model=model, max_tokens=rng.randint(1, 24), n=rng.randint(1, 4))
  sampling = rng.random()
  if sampling < 0.15:
    body.update(use_beam_search=True, n=2, temperature=0.0)
  elif sampling < 0.5:
    body.update(temperature=0.0)
  elif sampling < 0.8:
    body.update(temperature=0.8, seed=rng.randint(0, 10**6))
  if rng.random() < 0.3:
    body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
  if rng.random() < structured_share and not body.get("use_beam_search"):
    body.update(rng.choice(CONSTRAINTS))
  if rng.random() < 0.5 or not chat:
    body.update(prompt=f"{word}, n. ")
    if rng.random() < 0.3 and not body.get("use_beam_search"):
      body.update(logprobs=rng.randint(0, 3), echo=rng.random() < 0.5)
    path = "/v1/completions"
  else:
    body.update(messages=[{"role": "user", "content": f"Define {word.lower()}."}])
    if rng.random() < 0.3 and not body.get("use_beam_search"):
      body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
    path = "/v1/chat/completions"
  stream = rng.random() < 0.5
  if stream:
    body.update(stream=True)
  return Spec(path, body, disconnect=stream and rng.random() < 0.1)


def _choice_text(choice: dict) -> str:
  if "text" in choice:
    return choice["text"]
  part = choice.get("message") or choice.get("delta") or {}
  return part.get("content") or ""


async def event_lines(response: httpx.Response):
  """The lines of a server-sent event stream, split at CR and LF only, as the
  format says. (httpx's `aiter_lines` also splits at U+2028, U+2029 and
  U+0085, which a token's text may hold and JSON sends unescaped.)"""
  pending = ""
  async for text in response.aiter_text():
    *lines, pending = re.split(r"\r\n|\r|\n", pending + text)
    for line in lines:
      yield line
  if pending:
    yield pending


async def send(client: httpx.AsyncClient, spec: Spec, on_first_event=None) -> Outcome:
  """Sends `spec`; a streamed answer is joined into texts per choice, and
  `on_first_event()` is called when its first event arrives."""
  if not spec.body.get("stream"):
    response = await client.post(spec.path, json=spec.body)
    data = response.json()
    if response.status_code != 200:
      return _refusal(response, data)
    return Outcome(200, texts={c["index"]: _choice_text(c) for c in data["choices"]})
  texts: dict[int, str] = {}
  async with client.stream("POST", spec.path, json=spec.body) as response:
    if response.status_code != 200:
      return _refusal(response, json.loads(await response.aread()))
    async for line in event_lines(response):
      if not line.startswith("data: "):
        continue
      if on_first_event is not None:
        on_first_event()
        on_first_event = None
      if spec.disconnect:
        return Outcome(200, disconnected=True)
      payload = line.removeprefix("data: ")
      if payload == "[DONE]":
        return Outcome(200, texts=texts)
      event = json.loads(payload)
      if "error" in event:
        return Outcome(event["error"]["code"], error=event["error"])
      for choice in event["choices"]:
        texts[choice["index"]] = texts.get(choice["index"], "") + _choice_text(choice)
  return Outcome(200, error={"message": "the stream ended without [DONE]"})


def _refusal(response: httpx.Response, data: dict) -> Outcome:
  retry_after = response.headers.get("retry-after")
  return Outcome(
    response.status_code,
    error=data.get("error"),
    retry_after=None if retry_after is None else float(retry_after),
  )


def check_refusal(outcome: Outcome) -> bool:
  """A refusal is a 4xx/5xx with OpenAI's error body."""
  error = outcome.error or {}
  return outcome.status >= 400 and {"message", "type", "code"} <= set(error)


PAGED_JAX_SERVE = (sys.executable, "-m", "paged_jax", "serve")


class Server:
  """A server subprocess on a free port (in `env`, default this one's):
  `program` (default `python -m paged_jax serve`) with `--port PORT` and
  `args`, in a session of its own, so that `kill` also stops the processes
  it started (vLLM's engine core and workers)."""

  def __init__(self, args: list[str], env: dict | None = None, program=PAGED_JAX_SERVE):
    with socket.socket() as sock:
      sock.bind(("127.0.0.1", 0))
      self.port = sock.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    command = [*program, "--port", str(self.port), *args]
    self.process = subprocess.Popen(
      command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )

  def wait_healthy(self, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f"the server exited {self.process.returncode}:\n{self.output()}")
      with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
          return
      time.sleep(0.25)
    raise TimeoutError(f"no /health in {timeout} s")

  def rss_bytes(self) -> int:
    with open(f"/proc/{self.process.pid}/status") as status:
      kib = next(line for line in status if line.startswith("VmRSS:")).split()[1]
    return int(kib) * 1024

  def memory_by_kind(self) -> dict[str, float]:
    """MiB resident by mapping kind (`/proc/PID/smaps`): `heap` (the brk
    heap), `anon` (other anonymous memory: glibc's malloc arenas, arrays),
    `anon_exec` (XLA:CPU's compiled code), `file` (libraries, mapped files)."""
    kib = dict.fromkeys(("heap", "anon", "anon_exec", "file"), 0)
    kind = "anon"
    with open(f"/proc/{self.process.pid}/smaps") as smaps:
      for line in smaps:
        fields = line.split()
        if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", fields[0]):
          name = fields[5] if len(fields) > 5 else ""
          if name == "[heap]":
            kind = "heap"
          elif name.startswith("/"):
            kind = "file"
          else:
            kind = "anon_exec" if "x" in fields[1] else "anon"
        elif fields[0] == "Rss:":
          kib[kind] += int(fields[1])
    return {kind: round(value / 1024, 1) for kind, value in kib.items()}

  def compiles(self) -> int:
    """Programs the server compiled after its warm-up (its metric)."""
    return int(self.metrics()["paged_jax:compiles_while_serving_total"])

  def output(self) -> str:
    """What the server has printed so far."""
    with open(self.log.name) as log:
      return log.read()

  def compiled_programs(self) -> list[str]:
    """The server's log lines naming a program compiled after its warm-up."""
    return [line for line in self.output().splitlines() if "compiled while serving" in line]

  def metrics(self) -> dict[str, float]:
    """Every sample of `/metrics`, keyed by name and labels as printed."""
    text = httpx.get(f"{self.url}/metrics", timeout=30).text
    samples = {}
    for line in text.splitlines():
      if line and not line.startswith("#"):
        key, value = line.rsplit(" ", 1)
        samples[re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")] = float(value)
    return samples

  def kill(self) -> None:
    """Kills the server and every process of its session."""
    with contextlib.suppress(ProcessLookupError):
      os.killpg(self.process.pid, signal.SIGKILL)
    self.process.wait()


def outcome_counts(metrics: dict[str, float]) -> dict[str, int]:
  return {
    key.split('outcome="')[1].rstrip('"}'): int(value)
    for key, value in metrics.items()
    if key.startswith("paged_jax:requests_total")
  }


async def run_mix(url: str, specs: list[Spec], concurrency: int, burst_every: int, burst: int):
  """Sends `specs` at `concurrency`, each retried after a 503's Retry-After
  (up to `MAX_RETRIES` times, as OpenAI's client does), with a burst of
  `burst` extra requests (one spec, at once, never retried) every
  `burst_every` requests. Returns the mix's outcomes, the bursts' and the
  number of retries."""
  limits = httpx.Limits(max_connections=concurrency + burst + 8)
  retries = 0
  async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
    gate = asyncio.Semaphore(concurrency)

    async def gated(spec):
      nonlocal retries
      async with gate:
        outcome = await send(client, spec)
        for _ in range(MAX_RETRIES):  # a refusal after the last retry is the outcome
          if outcome.retry_after is None:
            break
          retries += 1
          await asyncio.sleep(outcome.retry_after)
          outcome = await send(client, spec)
        return outcome

    tasks, bursts = [], []
    for index, spec in enumerate(specs):
      tasks.append(asyncio.ensure_future(gated(spec)))
      if burst_every and index % burst_every == burst_every - 1:
        bursts += [asyncio.ensure_future(send(client, specs[index])) for _ in range(burst)]
      await asyncio.sleep(0)
    return await asyncio.gather(*tasks), await asyncio.gather(*bursts), retries


async def solo_texts(url: str, specs: list[Spec]) -> list[dict[int, str]]:
  """Each spec sent alone, one after another, as a non-streamed request."""
  async with httpx.AsyncClient(base_url=url, timeout=600) as client:
    return [
      (await send(client, Spec(spec.path, {**spec.body, "stream": False}))).texts for spec in specs
    ]


async def sigterm_during_burst(server: Server, spec: Spec, count: int) -> dict:
  """SIGTERM with `count` streams open: seconds to exit, exit code, and how
  each stream ended."""
  started = asyncio.Semaphore(0)
  async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
    streams = [asyncio.ensure_future(send(client, spec, started.release)) for _ in range(count)]
    for _ in range(count):
      await started.acquire()
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    ends = await asyncio.gather(*streams, return_exceptions=True)
    code = await asyncio.to_thread(server.process.wait, 30)
  return dict(
    exit_code=code,
    seconds_to_exit=round(time.monotonic() - start, 2),
    streams_done=sum(isinstance(e, Outcome) and e.texts is not None for e in ends),
    streams_with_error_event=sum(isinstance(e, Outcome) and e.error is not None for e in ends),
    streams_broken=sum(not isinstance(e, Outcome) for e in ends),
  )


@contextlib.contextmanager
def sampled_rss(server: Server, every_s: float = 1.0):
  """Yields a list that fills with `(seconds, RSS MiB)` of the server,
  sampled every `every_s` while the block runs (and once at its end)."""
  samples, done, start = [], threading.Event(), time.monotonic()

  def sample():
    while True:
      samples.append((round(time.monotonic() - start, 1), round(server.rss_bytes() / 2**20, 1)))
      if done.wait(every_s):
        return

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  try:
    yield samples
  finally:
    done.set()
    thread.join()
    samples.append((round(time.monotonic() - start, 1), round(server.rss_bytes() / 2**20, 1)))


def thinned(samples: list, count: int) -> list:
  """At most `count` of `samples`, evenly spaced, the first and last kept."""
  if len(samples) <= count:
    return list(samples)
  return [samples[round(i * (len(samples) - 1) / (count - 1))] for i in range(count)]


def settle(server: Server, num_requests: int, timeout: float = 60) -> dict[str, float]:
  """`/metrics` once nothing runs or waits and the server has counted
  `num_requests` outcomes (a stream whose client left is counted when the
  server closes it, maybe after its client returned), or after `timeout`."""
  deadline = time.monotonic() + timeout
  while True:
    metrics = server.metrics()
    idle = metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0
    if idle and sum(outcome_counts(metrics).values()) >= num_requests:
      return metrics
    if time.monotonic() > deadline:
      return metrics
    time.sleep(0.2)


def serves_chat(url: str) -> bool:
  """Whether the server's model has a chat template (the tiny one has none)."""
  messages = [{"role": "user", "content": "Hi."}]
  return httpx.post(f"{url}/tokenize", json=dict(messages=messages)).status_code == 200


def soak(args) -> dict:
  rng = random.Random(args.seed)
  server_args = [
    "--model", args.model, "--served-model-name", args.served_name,
    "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-logprobs", "5",
    "--max-waiting-requests", str(args.max_waiting_requests),
    *args.server_args,
  ]  # fmt: skip
  server = Server(server_args)
  try:
    server.wait_healthy(args.health_timeout)
    chat = serves_chat(server.url)
    specs = [
      make_spec(rng, args.served_name, chat, args.structured_share) for _ in range(args.requests)
    ]
    # A first mix, so that what each kind of request allocates once is in
    # the RSS to hold.
    warm = [
      make_spec(rng, args.served_name, chat, args.structured_share)
      for _ in range(args.warm_up_requests)
    ]
    if args.structured_share:
      warm += [Spec("/v1/completions", dict(prompt="a", max_tokens=4, **c)) for c in CONSTRAINTS]
    # The requests counted so far (`serves_chat`'s /tokenize is one), so
    # that the warm-up mix's own are awaited in full.
    counted_before_warm_up = sum(outcome_counts(server.metrics()).values())
    _, _, warm_retries = asyncio.run(run_mix(server.url, warm, args.concurrency, 0, 0))
    # Once the server counted the warm-up mix (a stream its client left
    # counts when the server closes it, maybe after the mix returned).
    warm_total = counted_before_warm_up + len(warm) + warm_retries
    before = outcome_counts(settle(server, warm_total))
    rss_start = server.rss_bytes()
    memory_start, compiled_in_warm_up_mix = server.memory_by_kind(), server.compiles()
    start = time.monotonic()
    with sampled_rss(server) as rss_samples:
      mixed, bursts, retries = asyncio.run(
        run_mix(
          server.url, specs, args.concurrency, args.burst_every, 2 * args.max_waiting_requests
        )
      )
      seconds = time.monotonic() - start
      before_total = sum(before.values())
      metrics = settle(server, before_total + len(mixed) + len(bursts) + retries)
      after = outcome_counts(metrics)
      counted = {k: after.get(k, 0) - before.get(k, 0) for k in after}
      outcomes = mixed + bursts
      completed = [(s, o) for s, o in zip(specs, mixed) if o.texts is not None]
      refused = [o for o in outcomes if o.texts is None and not o.disconnected]
      to_check = [(s, o) for s, o in completed if s.deterministic]
      solo = asyncio.run(solo_texts(server.url, [s for s, _ in to_check]))
      mismatches = [s.body for (s, o), alone in zip(to_check, solo) if o.texts != alone]
    rss_end, memory_end = server.rss_bytes(), server.memory_by_kind()
    compiled_in_soak = server.compiles() - compiled_in_warm_up_mix
    compiled_programs = server.compiled_programs()
    still_answers = (
      httpx.post(f"{server.url}/v1/completions", json=dict(prompt="WIT, n. ", max_tokens=2))
    ).status_code == 200
    long_stream = Spec(
      "/v1/completions",
      dict(prompt="LOVE, n. ", max_tokens=100, ignore_eos=True, stream=True, temperature=0.0),
    )
    shutdown = asyncio.run(sigterm_during_burst(server, long_stream, 8))
  finally:
    server.kill()
  free, total = metrics["paged_jax:num_free_gpu_blocks"], metrics["paged_jax:num_gpu_blocks"]
  report = dict(
    model=args.model,
    chat=chat,
    requests=len(outcomes) + retries,
    warm_up_requests=len(warm),
    retries_after_503=retries,
    seconds=round(seconds, 1),
    completed=len([o for o in outcomes if o.texts is not None]),
    refused=len(refused) + retries,
    disconnected=sum(o.disconnected for o in outcomes),
    statuses=sorted({o.status for o in refused}),
    counted_by_server=counted,
    checked_alone=len(to_check),
    mismatches=len(mismatches),
    blocks_free=f"{int(free)}/{int(total)}",
    rss_after_warmup_mib=round(rss_start / 2**20, 1),
    rss_after_soak_mib=round(rss_end / 2**20, 1),
    rss_peak_mib=max(mib for _, mib in rss_samples),
    rss_timeline_mib=thinned(rss_samples, 12),
    memory_by_kind_mib=dict(after_warmup=memory_start, after_soak=memory_end),
    compiled_while_serving=dict(warm_up_mix=compiled_in_warm_up_mix, soak=compiled_in_soak),
    compiled_programs=[line[-300:] for line in compiled_programs],
    still_answers=still_answers,
    shutdown=shutdown,
  )
  checks = {
    "answers equal the solo answers": not mismatches,
    "refusals carry an error body": all(map(check_refusal, refused)),
    "the server counted every request": sum(counted.values()) == report["requests"],
    # A stream that had already ended when its client left counts as completed.
    "completed as the client saw them": 0
    <= counted.get("completed", 0) - report["completed"]
    <= report["disconnected"],
    "no request failed": counted.get("failed", 0) == 0,
    "every block free, nothing running": free == total
    and metrics["vllm:num_requests_running"] == metrics["vllm:num_requests_waiting"] == 0,
    "nothing compiled after the engine's warm-up": compiled_in_warm_up_mix == compiled_in_soak == 0,
    "RSS within 10% of after warm-up": rss_end <= 1.1 * rss_start,
    "the server still answers": still_answers,
    "SIGTERM: exit 0 within 10 s": shutdown["exit_code"] == 0 and shutdown["seconds_to_exit"] <= 10,
    "SIGTERM: no stream left broken": shutdown["streams_broken"] == 0,
  }
  report["failed_checks"] = [name for name, passed in checks.items() if not passed]
  report["mismatched_examples"] = mismatches[:3]
  return report


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="tiny")
  parser.add_argument("--served-name", default="soak")
  parser.add_argument("--requests", type=int, default=2000)
  parser.add_argument("--concurrency", type=int, default=12)
  parser.add_argument("--max-waiting-requests", type=int, default=32)
  parser.add_argument("--burst-every", type=int, default=250)
  parser.add_argument("--warm-up-requests", type=int, default=40)
  parser.add_argument("--structured-share", type=float, default=0.15)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--health-timeout",
    type=float,
    default=900,
    help="seconds to wait for a started server's /health (its warm-up compiles)",
  )
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--vllm-bench", help="vLLM's `vllm` command, for `vllm bench serve`")
  parser.add_argument("--bench-tokenizer", help="the model's Hugging Face tokenizer folder")
  parser.add_argument("--bench-rates", type=float, nargs="+", default=[1.0, 4.0, 16.0])
  parser.add_argument("server_args", nargs="*", help="more `serve` flags, after --")
  return parser.parse_args(argv)


BENCH_PROMPTS = 48
BENCH_FIELDS = (
  "completed",
  "failed",
  "total_input_tokens",
  "output_throughput",
  "median_ttft_ms",
  "p99_ttft_ms",
  "median_tpot_ms",
  "p99_tpot_ms",
  "median_itl_ms",
  "p99_itl_ms",
)


BENCH_TEXT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "semantics.md"


def run_quietly(command: list[str], timeout: float) -> None:
  """Runs `command`; if it fails, raises with the end of what it printed."""
  done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
  if done.returncode != 0:
    raise RuntimeError(f"{command[:3]} exited {done.returncode}:\n{done.stderr[-3000:]}")


def text_slices(vllm: str, tokenizer: str, path: str, num_prompts: int, seed: int) -> None:
  """Writes to `path` `num_prompts` 200-token slices of `BENCH_TEXT`, cut by
  vLLM's own tool (`create_txt_slices_dataset`, run by the Python of
  `vllm`'s venv): prompts of valid text. vLLM's `random` dataset decodes
  random token ids, and one prompt in 48 held a NUL, which the server
  refuses with 400 as it must. The file is in ShareGPT's form (one
  conversation per prompt), which `vllm bench serve` reads without pandas
  (its `custom` dataset needs `vllm[bench]`)."""
  python = str(pathlib.Path(vllm).with_name("python"))
  slices = f"{path}.jsonl"
  command = [
    python, "-m", "vllm.benchmarks.datasets.create_txt_slices_dataset",
    "--input", str(BENCH_TEXT), "--output", slices, "--tokenizer", tokenizer,
    "--num-prompts", str(num_prompts), "--input-len", "200", "--output-len", "64",
    "--seed", str(seed),
  ]  # fmt: skip
  run_quietly(command, timeout=600)
  with open(slices) as lines:
    prompts = [json.loads(line)["prompt"] for line in lines]
  conversations = [dict(conversations=[dict(value=p), dict(value="")]) for p in prompts]
  pathlib.Path(path).write_text(json.dumps(conversations))


def text_slices_flags(path: str) -> list[str]:
  """`vllm bench serve`'s flags for the prompts `text_slices` wrote to
  `path`, sent as they are (no chat template), 64 output tokens each
  (`ignore_eos`)."""
  return [
    "--dataset-name", "sharegpt", "--dataset-path", path, "--sharegpt-output-len", "64",
    "--ignore-eos",
  ]  # fmt: skip


def vllm_bench(args) -> list[dict]:
  """`vllm bench serve` at each of `args.bench_rates` against a fresh server
  with the default limits; the fields of `BENCH_FIELDS` per rate. The
  prompts are slices of `BENCH_TEXT` (see `text_slices`)."""
  server = Server(
    ["--model", args.model, "--served-model-name", args.served_name, *args.server_args]
  )
  rows = []
  try:
    server.wait_healthy(args.health_timeout)
    with tempfile.TemporaryDirectory() as folder:
      dataset = f"{folder}/prompts.json"
      text_slices(args.vllm_bench, args.bench_tokenizer, dataset, BENCH_PROMPTS, args.seed)
      for rate in args.bench_rates:
        command = [
          args.vllm_bench, "bench", "serve", "--backend", "openai",
          "--base-url", server.url, "--model", args.served_name,
          "--tokenizer", args.bench_tokenizer, *text_slices_flags(dataset),
          "--num-prompts", str(BENCH_PROMPTS), "--request-rate", str(rate),
          "--seed", str(args.seed), "--save-result", "--result-dir", folder,
          "--result-filename", "result.json",
          "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        ]  # fmt: skip
        run_quietly(command, timeout=1800)
        with open(f"{folder}/result.json") as result:
          measured = json.load(result)
        rows.append(dict(request_rate=rate, **{k: measured.get(k) for k in BENCH_FIELDS}))
  finally:
    server.kill()
  return rows


def main(argv=None) -> int:
  args = parse_args(argv)
  report = soak(args)
  if args.vllm_bench:
    report["vllm_bench_serve"] = vllm_bench(args)
    if any(row["failed"] for row in report["vllm_bench_serve"]):
      report["failed_checks"].append("vllm bench serve: no failed request")
  if args.json:
    print(json.dumps(report))
  else:
    for key, value in report.items():
      print(f"{key}: {value}")
  return 1 if report["failed_checks"] else 0


if __name__ == "__main__":
  sys.exit(main())
