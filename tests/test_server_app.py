"""The HTTP app over stub engines (no model, no subprocess): the API key,
an unexpected error kept in its request, the limits (body size, waiting
queue, request timeout), hostile bodies, structured outputs compiled off
the engine thread, log-probabilities JSON can carry, and admission by the
engine's own rule."""

import asyncio
import json
import math
import re
import threading
import time
import types

import httpx
import jax
import pytest

import paged_jax as pj
from paged_jax.models import ByteTokenizer, load_tiny
from paged_jax.server import app as server_app
from paged_jax.server import cli, generation


def test_the_api_key_comes_from_the_environment_unless_given(monkeypatch):
  from paged_jax.__main__ import _parser

  monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
  assert _parser().parse_args(["serve"]).api_key is None
  monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
  assert _parser().parse_args(["serve"]).api_key == "from-env"
  assert _parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"


def test_the_automaton_capacity_flag_takes_states_and_edges(capsys):
  from paged_jax.__main__ import _parser

  assert _parser().parse_args(["serve"]).automaton_capacity is None
  args = _parser().parse_args(["serve", "--automaton-capacity", "512,65536"])
  assert args.automaton_capacity == pj.TableCapacity(states=512, edges=65536)
  for bad in ("512", "512,0", "a,b"):
    with pytest.raises(SystemExit):
      _parser().parse_args(["serve", "--automaton-capacity", bad])
    assert "STATES,EDGES (two positive ints) are needed" in capsys.readouterr().err


def test_bearer_matches_only_the_whole_key():
  assert server_app.bearer_matches("Bearer s3cret", "s3cret")
  for header in ("", "Bearer", "Bearer s3cre", "Bearer s3cret2", "bearer s3cret", "s3cret"):
    assert not server_app.bearer_matches(header, "s3cret"), header


STUB_SETTINGS = dict(
  served_model_name="stub",
  model_source="stub",
  max_model_len=128,
  vocab_size=258,
  max_num_seqs=4,
  max_logprobs=5,
  max_beam_width=4,
)


def _stub_app(engine, **limits):
  from paged_jax.server.app import ServerSettings, build_app
  from paged_jax.server.metrics import ServerMetrics

  settings = ServerSettings(**STUB_SETTINGS, **limits)
  return build_app(engine, ByteTokenizer(), settings, ServerMetrics("stub"))


def _exchange(app, talk):
  """Runs `talk(client)` against `app` in one event loop."""

  async def run():
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://stub") as client:
      return await talk(client)

  return asyncio.run(run())


class _FailingEngine:
  """Serves `"ok"` to every prompt but one that starts with token 0, which fails."""

  running = True

  def add(self, request_id, token_ids, params, sink):
    if token_ids[0] == 0:
      sink(RuntimeError("stub engine failure"))
      return
    completion = pj.CompletionOutput(0, "ok", [111, 107], 0.0, None, "length")
    sink(pj.RequestOutput(request_id, None, token_ids, [completion], finished=True))

  def abort(self, request_id):
    pass

  def admission_error(self, num_prompt_tokens, params):
    return None


def test_an_unexpected_error_answers_500_for_that_request_only():
  app = _stub_app(_FailingEngine())

  async def talk(client):
    failed = await client.post("/v1/completions", json=dict(prompt=[0, 1], max_tokens=2))
    served = await client.post("/v1/completions", json=dict(prompt=[1, 2], max_tokens=2))
    streamed = await client.post(
      "/v1/completions", json=dict(prompt=[0, 1], max_tokens=2, stream=True)
    )
    return failed, served, streamed

  failed, served, streamed = _exchange(app, talk)
  assert failed.status_code == 500
  assert failed.json()["error"]["type"] == "internal_server_error"
  assert "stub engine failure" in failed.json()["error"]["message"]
  assert served.status_code == 200 and served.json()["choices"][0]["text"] == "ok"
  assert served.json()["usage"]["completion_tokens"] == 2
  assert "stub engine failure" in streamed.text and "[DONE]" not in streamed.text


# Limits and hostile bodies: an app over a stub engine that never answers a
# prompt starting with token 0.


class _StallingEngine:
  """Answers "ok" at once, except to prompts that start with token 0."""

  running = True

  def __init__(self):
    self.added, self.aborted = [], []

  def add(self, request_id, token_ids, params, sink):
    self.added.append(request_id)
    self.params = params
    if token_ids[0] != 0:
      completion = pj.CompletionOutput(0, "ok", [111, 107], 0.0, None, "length")
      sink(pj.RequestOutput(request_id, None, token_ids, [completion], finished=True))

  def abort(self, request_id):
    self.aborted.append(request_id)

  def admission_error(self, num_prompt_tokens, params):
    return None


def _outcomes(metrics_text: str) -> dict[str, int]:
  """`paged_jax:requests_total` by outcome."""
  found = re.findall(r'paged_jax:requests_total\{.*outcome="(\w+)".*\} (\S+)', metrics_text)
  return {outcome: int(float(value)) for outcome, value in found}


def test_a_body_over_max_request_bytes_gets_413_by_length_or_as_it_arrives():
  app = _stub_app(_StallingEngine(), max_request_bytes=100)
  body = json.dumps(dict(prompt="x" * 200, max_tokens=2)).encode()

  async def chunks():
    for start in range(0, len(body), 50):
      yield body[start : start + 50]

  async def talk(client):
    declared = await client.post("/v1/completions", content=body)
    streamed = await client.post("/v1/completions", content=chunks())  # no Content-Length
    small = await client.post("/v1/completions", json=dict(prompt="x", max_tokens=2))
    return declared, streamed, small

  declared, streamed, small = _exchange(app, talk)
  for response in (declared, streamed):
    assert response.status_code == 413
    assert "over 100 bytes (--max-request-bytes)" in response.json()["error"]["message"]
  assert small.status_code == 200


@pytest.mark.parametrize(
  "body,param,message",
  [
    (b'{"prompt": "a\\u0000b", "max_tokens": 2}', "prompt", "NUL"),
    (
      b'{"messages": [{"role": "user", "content": "\\u0000"}]}',
      "messages",
      "NUL",
    ),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
    (
      json.dumps(dict(prompt="a", max_tokens=2, stop="x" * 1_000_000)).encode(),
      "stop",
      "at most 1000 characters",
    ),
  ],
  ids=["nul-prompt", "nul-message", "deep-json", "megabyte-stop"],
)
def test_hostile_bodies_get_400_and_reach_no_engine(body, param, message):
  engine = _StallingEngine()
  app = _stub_app(engine)
  path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
  response = _exchange(app, lambda client: client.post(path, content=body))
  assert response.status_code == 400
  assert message in response.json()["error"]["message"]
  assert response.json()["error"]["param"] == param
  assert engine.added == []


def test_a_full_queue_gets_503_with_retry_after_and_a_timeout_aborts_with_408():
  engine = _StallingEngine()
  app = _stub_app(engine, max_waiting_requests=2, request_timeout=1.0)
  stalled = dict(prompt=[0, 1], max_tokens=2)

  async def talk(client):
    waiting = [
      asyncio.ensure_future(client.post("/v1/completions", json=stalled)) for _ in range(2)
    ]
    while len(engine.added) < 2:
      await asyncio.sleep(0.01)
    refused = await client.post("/v1/completions", json=dict(prompt=[1, 2], max_tokens=2))
    refused_stream = await client.post(
      "/v1/completions", json=dict(prompt=[1, 2], max_tokens=2, stream=True)
    )
    timed_out = await asyncio.gather(*waiting)
    served = await client.post("/v1/completions", json=dict(prompt=[1, 2], max_tokens=2))
    stream = await client.post("/v1/completions", json=dict(**stalled, stream=True))
    metrics = await client.get("/metrics")
    return refused, refused_stream, timed_out, served, stream, metrics

  refused, refused_stream, timed_out, served, stream, metrics = _exchange(app, talk)
  for response in (refused, refused_stream):
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert "--max-waiting-requests 2" in response.json()["error"]["message"]
  for response in timed_out:
    assert response.status_code == 408
    assert "--request-timeout" in response.json()["error"]["message"]
  assert served.status_code == 200  # the queue emptied when the stalled ones timed out
  assert stream.status_code == 200
  assert "--request-timeout" in stream.text and "[DONE]" not in stream.text
  stalled_ids = [rid for rid in engine.added if rid not in engine.aborted]
  assert len(engine.aborted) == 3 and len(stalled_ids) == 1  # only the served one finished
  assert _outcomes(metrics.text) == dict(completed=1, refused=2, aborted=3, failed=0)


def _deep_schema(depth: int) -> dict:
  schema = {"type": "string"}
  for _ in range(depth):
    schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
  return schema


@pytest.mark.parametrize(
  "fields,constraint",
  [
    (dict(response_format={"type": "json_object"}), dict(json_object=True)),
    (
      dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}),
      dict(json='{"type": "integer"}'),
    ),
    (dict(structured_outputs={"choice": ["yes", "no"]}), dict(choice=("yes", "no"))),
    (dict(structured_outputs={"regex": "[a-z]{1,5}"}), dict(regex="[a-z]{1,5}")),
    (dict(response_format={"type": "text"}), None),
  ],
  ids=["json-object", "json-schema", "choice", "regex", "text"],
)
def test_structured_outputs_reach_the_engine_compiled(fields, constraint):
  from paged_jax import structured
  from paged_jax.structured import automaton

  engine = _StallingEngine()
  body = dict(prompt="a", max_tokens=4, **fields)
  response = _exchange(_stub_app(engine), lambda client: client.post("/v1/completions", json=body))
  assert response.status_code == 200, response.text
  given = engine.params.structured_outputs
  if constraint is None:
    assert given is None
    return
  assert given == pj.StructuredOutputsParams(**constraint)
  hits = automaton._compiled.cache_info().hits
  structured.compile_constraint(given, ByteTokenizer())  # the engine's compile: a cache hit
  assert automaton._compiled.cache_info().hits == hits + 1


@pytest.mark.parametrize(
  "fields,param,message",
  [
    (
      dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
      "response_format",
      "give one of",
    ),
    (dict(response_format={"type": "xml"}), "response_format", "must be {'type': 'text'}"),
    (dict(structured_outputs={"grammar": "x"}), "structured_outputs", "grammar"),
    (dict(structured_outputs={"regex": "(a"}), "structured_outputs", "cannot be compiled"),
    (dict(structured_outputs={"json": _deep_schema(200)}), "structured_outputs", "cannot be"),
  ],
  ids=["both", "unknown-type", "unknown-field", "bad-regex", "deep-schema"],
)
def test_bad_structured_outputs_get_400_before_the_engine(fields, param, message):
  engine = _StallingEngine()
  body = dict(prompt="a", max_tokens=4, **fields)
  response = _exchange(_stub_app(engine), lambda client: client.post("/v1/completions", json=body))
  assert response.status_code == 400, response.text
  assert response.json()["error"]["param"] == param
  assert message in response.json()["error"]["message"]
  assert engine.added == []


def test_a_constraint_that_compiles_too_long_gets_400_and_the_server_keeps_serving(monkeypatch):
  monkeypatch.setattr(generation, "SCHEMA_COMPILE_TIMEOUT_S", 0.2)
  monkeypatch.setattr(generation, "compile_constraint", lambda *args: time.sleep(2))
  engine = _StallingEngine()
  slow = dict(prompt="a", max_tokens=4, structured_outputs={"regex": "[ab]+"})

  async def talk(client):
    refused = await client.post("/v1/completions", json=slow)
    served = await client.post("/v1/completions", json=dict(prompt="a", max_tokens=4))
    return refused, served

  refused, served = _exchange(_stub_app(engine), talk)
  assert refused.status_code == 400
  assert "did not compile within 0.2 s" in refused.json()["error"]["message"]
  assert served.status_code == 200 and len(engine.added) == 1


class _RuledOutEngine(_StallingEngine):
  """Answers one token whose top log-probabilities include a ruled-out one (-inf)."""

  def add(self, request_id, token_ids, params, sink):
    self.added.append(request_id)
    logprobs = [{111: -0.5, 112: -math.inf}]
    completion = pj.CompletionOutput(0, "o", [111], -0.5, logprobs, "length")
    sink(pj.RequestOutput(request_id, None, token_ids, [completion], finished=True))


@pytest.mark.parametrize("stream", [False, True])
def test_a_ruled_out_token_s_logprob_is_sent_as_minus_9999(stream):
  body = dict(prompt="a", max_tokens=1, logprobs=2, stream=stream)
  response = _exchange(
    _stub_app(_RuledOutEngine()), lambda client: client.post("/v1/completions", json=body)
  )
  assert response.status_code == 200, response.text
  text = response.text.replace(" ", "")
  assert '{"o":-0.5,"p":-9999.0}' in text and "Infinity" not in text


class _AdmittingEngine(_StallingEngine):
  """Answers at once, and admits by a real engine's rule."""

  def __init__(self, engine):
    super().__init__()
    self.admission_error = engine.admission_error


def test_the_server_refuses_exactly_what_the_engine_would_refuse():
  cfg = pj.CacheConfig(
    block_size=16, num_gpu_blocks=12, num_cpu_blocks=0, max_seqs=4, max_blocks_per_seq=8
  )
  engine = pj.LLMEngine(load_tiny(), ByteTokenizer(), cfg)
  stub = _AdmittingEngine(engine)
  app = _stub_app(stub)
  grid = [
    (prompt_len, max_tokens, n, beams)
    for prompt_len in (1, 30, 70, 100)
    for max_tokens in (1, 27, 50)
    for n, beams in ((1, False), (2, False), (4, False), (2, True))
    if prompt_len + max_tokens <= STUB_SETTINGS["max_model_len"]
  ]

  async def talk(client):
    return [
      await client.post(
        "/v1/completions",
        json=dict(
          prompt=[1] * prompt_len,
          max_tokens=max_tokens,
          n=n,
          use_beam_search=beams,
          temperature=0.0 if beams else 1.0,
        ),
      )
      for prompt_len, max_tokens, n, beams in grid
    ]

  responses = _exchange(app, talk)
  refused = 0
  for (prompt_len, max_tokens, n, beams), response in zip(grid, responses):
    params = pj.SamplingParams(n=n, max_tokens=max_tokens, use_beam_search=beams, temperature=0)
    error = engine.admission_error(prompt_len, params)
    if error is None:
      assert response.status_code == 200, (prompt_len, max_tokens, n, beams, response.text)
    else:
      refused += 1
      assert response.status_code == 400, (prompt_len, max_tokens, n, beams)
      assert error in response.json()["error"]["message"]
  assert 0 < refused < len(grid)  # the grid crosses the boundary
  assert len(stub.added) == len(grid) - refused


# The engine thread counts what compiles after its warm-up.


@jax.jit
def _token_sum(token_ids):
  return token_ids.sum()


class _CompilingEngine:
  """Finishes each request in one step, which runs a jitted function on the
  prompt: a prompt of a length the warm-up's (2) did not have compiles."""

  running_ahead = False

  def __init__(self):
    self.stats = types.SimpleNamespace(
      preemptions=0,
      prefill_tokens=0,
      spec_decode_num_drafts=0,
      spec_decode_num_draft_tokens=0,
      spec_decode_num_accepted_tokens=0,
    )
    self.pending = {}
    self.events = []

  def notify_arrival(self):
    self.events.append("arrival")

  def add_request(self, request_id, token_ids, params):
    self.events.append(request_id)
    self.pending[request_id] = token_ids

  def abort_request(self, request_id):
    self.pending.pop(request_id, None)

  def has_unfinished_requests(self):
    return bool(self.pending)

  def step(self, on_decode_step=None):
    outputs = []
    for request_id, token_ids in self.pending.items():
      token = int(_token_sum(token_ids))
      completion = pj.CompletionOutput(0, "x", [token], 0.0, None, "length")
      outputs.append(pj.RequestOutput(request_id, None, token_ids, [completion], finished=True))
    self.pending.clear()
    return outputs

  def num_free_gpu_blocks(self):
    return 8


def test_the_engine_thread_counts_and_logs_each_program_compiled_while_serving(caplog):
  from paged_jax.server.engine_thread import BuiltEngine, EngineThread
  from paged_jax.server.metrics import ServerMetrics

  metrics = ServerMetrics("stub")
  cache_config = pj.CacheConfig(block_size=4, num_gpu_blocks=8, max_seqs=2, max_blocks_per_seq=4)
  engine = _CompilingEngine()
  thread = EngineThread(lambda: BuiltEngine(engine, None, cache_config), metrics)
  compiled = lambda: metrics.registry.get_sample_value(
    "paged_jax:compiles_while_serving_total", {"model_name": "stub"}
  )
  thread.start()
  try:
    for prompt, compiles in (([3, 4], 0), ([5, 6], 0), ([1, 2, 3], 1)):  # a new length
      done = threading.Event()
      thread.add(str(prompt), prompt, pj.SamplingParams(max_tokens=1), lambda _: done.set())
      assert done.wait(30)
      deadline = time.monotonic() + 10  # counted right after the step's outputs
      while compiled() != compiles and time.monotonic() < deadline:
        time.sleep(0.01)
      assert compiled() == compiles, prompt
  finally:
    thread.stop()
  assert compiled() == 1
  # Each request ended the launch in flight (`notify_arrival`) once queued.
  assert engine.events.count("arrival") == 3
  [warning] = [r.getMessage() for r in caplog.records if "compiled while serving" in r.getMessage()]
  assert "int32[3]" in warning, warning
