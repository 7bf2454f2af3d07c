"""The FastAPI app: OpenAI's completions and chat completions, vLLM's extras.

Handlers parse and validate a request completely (types, limits, the
context length, the vocabulary), tokenize it and render chat templates on
the event loop (host work, no JAX), then hand it to the engine thread
through `EngineClient` and turn its delta outputs into OpenAI responses or
server-sent events. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged_jax.server import protocol
from paged_jax.server.bodies import APIError, parse_body
from paged_jax.server.chat import ChatCompletions
from paged_jax.server.completions import Completions
from paged_jax.server.engine_thread import EngineClient
from paged_jax.server.generation import EngineRequests
from paged_jax.server.limits import (
  DEFAULT_MAX_REQUEST_BYTES,
  DEFAULT_MAX_WAITING_REQUESTS,
  DEFAULT_REQUEST_TIMEOUT_S,
)
from paged_jax.server.metrics import ServerMetrics
from paged_jax.server.request_checks import RequestChecks, encode
from paged_jax.server.streaming import internal_error

OPEN_PATHS = ("/health", "/metrics")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
  """What the handlers need to know about the served model and its limits.

  Attributes:
    served_model_name: the name clients put in `model`.
    model_source: what `--model` named (shown as the model's `root`).
    max_model_len: prompt plus generated tokens, at most.
    vocab_size: token ids are `0 .. vocab_size - 1`.
    max_num_seqs: sequences one request may ask for (`n`).
    max_logprobs: the largest `logprobs` / `top_logprobs`.
    max_beam_width: the most beams of a beam-search request.
    api_key: the key every endpoint but `/health` and `/metrics` needs.
    max_request_bytes: the largest request body (413 past it).
    max_waiting_requests: prompts waiting for their first token, at most;
      a request that would queue more gets 503 with `Retry-After`.
    request_timeout: seconds a request may run before it is aborted (its
      blocks freed, 408, or an error event ending its stream); None: no limit.
  """

  served_model_name: str
  model_source: str
  max_model_len: int
  vocab_size: int
  max_num_seqs: int
  max_logprobs: int
  max_beam_width: int
  api_key: str | None = None
  max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
  max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
  request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S


class Server(RequestChecks, EngineRequests, Completions, ChatCompletions):
  """The handlers, bound to one engine and tokenizer.

  Args:
    engine: an `EngineThread` (started), or anything with its `add`,
      `abort`, `score` and `running`.
    tokenizer: the model's tokenizer (`encode`, `decode`,
      `apply_chat_template`).
    settings: the served model's limits.
    metrics: the metrics `/metrics` shows.
  """

  def __init__(self, engine, tokenizer, settings: ServerSettings, metrics: ServerMetrics):
    self.engine_thread = engine
    self.tokenizer = tokenizer
    self.settings = settings
    self.metrics = metrics
    self._client: EngineClient | None = None
    self.shutting_down = False
    self.num_waiting = 0  # prompts sent to the engine that have no output yet

  @property
  def client(self) -> EngineClient:
    """The engine's client on the running event loop (made on first use)."""
    if self._client is None:
      self._client = EngineClient(self.engine_thread, asyncio.get_running_loop())
    return self._client

  def token_text(self, token_id: int) -> str:
    return self.tokenizer.decode([token_id])

  # Tokenizer endpoints.
  async def tokenize(self, request: Request) -> Response:
    body = await parse_body(request, protocol.TokenizeRequest, self.settings.max_request_bytes)
    self.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
      raise APIError("prompt: give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
      ids = self.render_chat(body.messages, body.add_generation_prompt)
    else:
      ids = encode(self.tokenizer, body.prompt, body.add_special_tokens)
    response = protocol.TokenizeResponse(
      count=len(ids), max_model_len=self.settings.max_model_len, tokens=ids
    )
    return JSONResponse(response.model_dump())

  async def detokenize(self, request: Request) -> Response:
    body = await parse_body(request, protocol.DetokenizeRequest, self.settings.max_request_bytes)
    self.check_model(body.model)
    self.check_ids(body.tokens, "tokens", allow_empty=True)
    return JSONResponse(
      protocol.DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens)).model_dump()
    )

  def models(self) -> Response:
    settings = self.settings
    card = protocol.ModelCard(
      id=settings.served_model_name,
      root=settings.model_source,
      max_model_len=settings.max_model_len,
    )
    return JSONResponse(protocol.ModelList(data=[card]).model_dump())


def _guarded(handler, metrics: ServerMetrics):
  """`handler` answering its `APIError`s with OpenAI's error body, and any
  other exception with a 500 (the server keeps serving); counts each
  request's outcome (a stream counts its own when it ends)."""

  async def route(request: Request) -> Response:
    try:
      response = await handler(request)
    except APIError as err:
      metrics.count_request(err.outcome)
      return err.response()
    except Exception as err:  # noqa: BLE001 - one request's failure stays its own
      metrics.count_request("failed")
      return internal_error(err).response()
    if not isinstance(response, StreamingResponse):
      metrics.count_request("completed")
    return response

  route.__name__ = handler.__name__
  return route


def bearer_matches(authorization: str, key: str) -> bool:
  """Whether an Authorization header is ``Bearer <key>``, compared in
  constant time (no timing tells how much of a guess was right)."""
  return hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())


def build_app(engine, tokenizer, settings: ServerSettings, metrics: ServerMetrics) -> FastAPI:
  """The FastAPI app serving `engine` (see `Server` for the arguments)."""
  server = Server(engine, tokenizer, settings, metrics)
  app = FastAPI(title="paged_jax")
  app.state.server = server

  @app.middleware("http")
  async def authenticate(request: Request, call_next):
    key = settings.api_key
    if key is not None and request.url.path not in OPEN_PATHS:
      if not bearer_matches(request.headers.get("authorization", ""), key):
        return APIError(
          "a valid API key is required: Authorization: Bearer <key>",
          status=401,
          kind="authentication_error",
        ).response()
    return await call_next(request)

  @app.get("/health")
  async def health():
    if not engine.running or server.shutting_down:
      return Response(status_code=503)
    return Response(status_code=200)

  @app.get("/metrics")
  async def prometheus_metrics():
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

  @app.get("/v1/models")
  async def models():
    return server.models()

  for path, handler in (
    ("/v1/completions", server.completions),
    ("/v1/chat/completions", server.chat_completions),
    ("/tokenize", server.tokenize),
    ("/detokenize", server.detokenize),
  ):
    app.add_api_route(path, _guarded(handler, metrics), methods=["POST"])

  return app
