"""The FastAPI app: OpenAI's completions and chat completions, vLLM's extras.

Handlers parse and validate a request completely (types, limits, the
context length, the vocabulary), tokenize it and render chat templates on
the event loop (host work, no JAX), then hand it to the engine thread
through `EngineClient` and turn its delta outputs into OpenAI responses or
server-sent events. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from paged_jax.engine.outputs import CompletionOutput
from paged_jax.models.tokenizer import ByteTokenizer
from paged_jax.params import SamplingParams
from paged_jax.server import protocol
from paged_jax.server.bodies import (
  APIError,
  json_logprob,
  parse_body,
  structured_outputs,
)
from paged_jax.server.engine_thread import EngineClient, EngineStopped
from paged_jax.server.limits import (
  DEFAULT_MAX_REQUEST_BYTES,
  DEFAULT_MAX_WAITING_REQUESTS,
  DEFAULT_REQUEST_TIMEOUT_S,
  MAX_STOP_CHARS,
  RETRY_AFTER_S,
  SCHEMA_COMPILE_TIMEOUT_S,
)
from paged_jax.server.metrics import ServerMetrics
from paged_jax.structured import compile_constraint

logger = logging.getLogger("paged_jax.server")

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


def _sse(payload: BaseModel | dict) -> str:
  data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
  return f"data: {data}\n\n"


def _encode(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
  if isinstance(tokenizer, ByteTokenizer):
    return tokenizer.encode(text, add_bos=add_special_tokens).tolist()
  return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


@dataclasses.dataclass
class _Choice:
  """What one sequence has produced so far (the sum of its deltas)."""

  text: str = ""
  num_tokens: int = 0
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  stop_reason: int | str | None = None


class Server:
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

  # Validation.
  def check_model(self, name: str | None) -> None:
    served = self.settings.served_model_name
    if name is not None and name != served:
      raise APIError(
        f"model: the model {name!r} does not exist; this server serves {served!r}", "model"
      )

  def check_ids(self, ids: list[int], param: str) -> None:
    if not ids:
      raise APIError(f"{param}: must not be empty", param)
    vocab = self.settings.vocab_size
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
      raise APIError(f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param)

  def prompt_ids(self, prompt) -> list[tuple[str | None, list[int]]]:
    """`(text or None, token ids)` of each prompt of a completions request."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
      prompt = [prompt]
    if not prompt:
      raise APIError("prompt: must not be empty", "prompt")
    prompts = []
    for item in prompt:
      if isinstance(item, str):
        if not item:
          raise APIError("prompt: must not be empty", "prompt")
        ids = _encode(self.tokenizer, item)
        prompts.append((item, ids))
      else:
        prompts.append((None, list(item)))
      self.check_ids(prompts[-1][1], "prompt")
    return prompts

  def check_length(self, num_prompt_tokens: int, max_tokens: int, field: str) -> None:
    limit = self.settings.max_model_len
    if num_prompt_tokens + max_tokens > limit:
      param = "prompt" if num_prompt_tokens >= limit else field
      raise APIError(
        f"{param}: this model's maximum context length is {limit} tokens (--max-model-len); "
        f"the request asks for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the "
        f"prompt, {max_tokens} in {field}). Shorten the prompt or lower {field}.",
        param,
      )

  def check_admission(self, num_prompt_tokens: int, params: SamplingParams) -> None:
    """Refuses what the engine would refuse: the engine's own admission rule
    (slots, positions, and the KV blocks of one data shard, with sliding
    windows, speculative lookahead and the watermark).

    Raises:
      APIError: 400 naming why.
    """
    error = self.engine_thread.admission_error(num_prompt_tokens, params)
    if error is not None:
      param = "n" if params.n > 1 else "prompt"
      raise APIError(f"{param}: the request can never be served: {error}", param)

  def check_n(self, n: int, use_beam_search: bool) -> None:
    settings = self.settings
    if use_beam_search:
      limit = min(settings.max_beam_width, (settings.max_num_seqs + 1) // 2)
      if n > limit:
        raise APIError(f"n: beam search serves at most {limit} beams, got {n}", "n")
    elif n > settings.max_num_seqs:
      raise APIError(f"n: must be <= {settings.max_num_seqs} (--max-num-seqs), got {n}", "n")

  def check_logprobs(self, k: int | None, field: str) -> None:
    if k is not None and k > self.settings.max_logprobs:
      raise APIError(
        f"{field}: must be <= {self.settings.max_logprobs} (--max-logprobs), got {k}", field
      )

  def sampling_params(self, body, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's `SamplingParams` (with delta outputs) of a request.

    Raises:
      APIError: naming the field that `SamplingParams` refused.
    """
    if body.top_k is not None and body.top_k < -1:
      raise APIError(f"top_k: must be -1, 0 (all tokens) or >= 1, got {body.top_k}", "top_k")
    if body.use_beam_search and logprobs is not None:
      raise APIError("logprobs: not available with use_beam_search", "logprobs")
    temperature = body.temperature
    if temperature is None:
      temperature = 0.0 if body.use_beam_search else 1.0
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
      raise APIError(
        f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}", "stop"
      )
    stop_ids = body.stop_token_ids or []
    vocab = self.settings.vocab_size
    bad = next((i for i in stop_ids if not 0 <= i < vocab), None)
    if bad is not None:
      raise APIError(
        f"stop_token_ids: token id {bad} is outside the vocabulary (0..{vocab - 1})",
        "stop_token_ids",
      )
    try:
      return SamplingParams(
        n=body.n,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        max_tokens=max(max_tokens, 1),
        stop=body.stop,
        stop_token_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        seed=body.seed,
        logprobs=logprobs,
        use_beam_search=body.use_beam_search,
        length_penalty=body.length_penalty,
        structured_outputs=structured_outputs(body),
        output_kind="delta",
      )
    except ValueError as err:
      message = str(err)
      raise APIError(message, message.split(" ", 1)[0]) from None

  # Generation.
  async def generate(
    self, request_id: str, prompts: list[list[int]], params: SamplingParams
  ) -> AsyncIterator[tuple[int, CompletionOutput]]:
    """Runs every prompt on the engine; yields `(prompt index, delta)`.

    Aborts the prompts still running when the caller stops early (a client
    that disconnects, an error) or when the request runs past
    `settings.request_timeout`.

    Raises:
      APIError: 400 for a request the engine refused, 503 when the server
        shuts down or more than `settings.max_waiting_requests` prompts
        would wait, 408 past the request timeout.
    """
    if self.shutting_down:
      raise APIError("the server is shutting down", status=503, kind="service_unavailable")
    self.check_queue(len(prompts))
    target: asyncio.Queue = asyncio.Queue()
    ids = [f"{request_id}-{index}" for index in range(len(prompts))]
    pending, waiting = set(), set()
    deadline = _deadline(self.settings.request_timeout)
    try:
      for index, (engine_id, token_ids) in enumerate(zip(ids, prompts)):
        try:
          self.client.add(engine_id, token_ids, params, target, index)
        except EngineStopped as err:
          raise APIError(str(err), status=503, kind="service_unavailable") from None
        pending.add(index)
        waiting.add(index)
        self.num_waiting += 1
      while pending:
        index, item = await self.next_output(target, deadline)
        if index in waiting:
          waiting.discard(index)
          self.num_waiting -= 1
        if isinstance(item, EngineStopped):
          pending.discard(index)
          raise APIError(str(item), status=503, kind="service_unavailable", outcome="aborted")
        if isinstance(item, ValueError):
          pending.discard(index)
          raise APIError(f"prompt {index}: {item}")
        if isinstance(item, BaseException):
          pending.discard(index)
          raise item
        if item.finished:
          pending.discard(index)
        if item.error is not None:
          raise APIError(item.error)
        for output in item.outputs:
          if output.finish_reason == "abort":
            raise APIError(
              "the request was aborted", status=503, kind="service_unavailable", outcome="aborted"
            )
          yield index, output
    finally:
      self.num_waiting -= len(waiting)
      for index in pending:
        self.client.abort(ids[index])

  async def compile_structured_outputs(self, params: SamplingParams) -> None:
    """Compiles the request's structured-output constraint on a worker
    thread, within `SCHEMA_COMPILE_TIMEOUT_S`, so the engine thread never
    stalls on one: the engine then finds it in the compile cache. A compile
    past the limit goes on in its thread, but the request is refused.

    Raises:
      APIError: 400 if the constraint does not compile, or not in time.
    """
    constraint = params.structured_outputs
    if constraint is None:
      return
    compiling = asyncio.to_thread(compile_constraint, constraint, self.tokenizer)
    try:
      await asyncio.wait_for(compiling, SCHEMA_COMPILE_TIMEOUT_S)
    except TimeoutError:
      raise APIError(
        f"structured_outputs: the constraint did not compile within {SCHEMA_COMPILE_TIMEOUT_S:g} s",
        "structured_outputs",
      ) from None
    except (TypeError, ValueError, RecursionError) as err:  # the schema libraries' own errors
      raise APIError(
        f"structured_outputs: the constraint cannot be compiled: {err}", "structured_outputs"
      ) from None

  def check_queue(self, num_prompts: int) -> None:
    """Refuses a request whose prompts would queue past `max_waiting_requests`.

    Raises:
      APIError: 503, with a `Retry-After` header.
    """
    limit = self.settings.max_waiting_requests
    if self.num_waiting + num_prompts > limit:
      raise APIError(
        f"the server is busy: {self.num_waiting} prompts wait for their first token and "
        f"this request would add {num_prompts} (--max-waiting-requests {limit}); "
        f"retry after {RETRY_AFTER_S} s",
        status=503,
        kind="service_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
      )

  async def next_output(self, target: asyncio.Queue, deadline: float | None):
    """The next `(index, item)` for this request.

    Raises:
      APIError: 408 once `deadline` (event-loop time) has passed.
    """
    if deadline is None:
      return await target.get()
    try:
      return await asyncio.wait_for(target.get(), deadline - asyncio.get_running_loop().time())
    except TimeoutError:
      raise APIError(
        f"the request ran past its {self.settings.request_timeout:g} s (--request-timeout) "
        "and was aborted",
        status=408,
        kind="timeout",
        outcome="aborted",
      ) from None

  def token_text(self, token_id: int) -> str:
    return self.tokenizer.decode([token_id])

  # Completions.
  async def completions(self, request: Request) -> Response:
    body = await parse_body(request, protocol.CompletionRequest, self.settings.max_request_bytes)
    self.check_model(body.model)
    prompts = self.prompt_ids(body.prompt)
    self.check_n(body.n, body.use_beam_search)
    self.check_logprobs(body.logprobs, "logprobs")
    if body.max_tokens == 0 and not body.echo:
      raise APIError("max_tokens: must be >= 1 unless echo is true", "max_tokens")
    longest = max(len(ids) for _, ids in prompts)
    max_tokens = (
      self.settings.max_model_len - longest if body.max_tokens is None else body.max_tokens
    )
    for _, ids in prompts:
      self.check_length(len(ids), max_tokens, "max_tokens")
    params = self.sampling_params(body, max_tokens, body.logprobs)
    for _, ids in prompts:
      self.check_admission(len(ids), params)
    await self.compile_structured_outputs(params)
    self.check_queue(len(prompts))  # before a stream's headers go out
    request_id = f"cmpl-{uuid.uuid4().hex}"
    echo = [self.echo_choice(text, ids) for text, ids in prompts]
    if body.echo and body.logprobs is not None:
      for (_, ids), choice in zip(prompts, echo):
        try:
          scored = await self.client.score(ids, body.logprobs)
        except EngineStopped as err:
          raise APIError(str(err), status=503, kind="service_unavailable") from None
        choice.logprobs = self.completion_logprobs(
          ids, scored.token_logprobs, scored.top_logprobs, 0
        )
    usage_prompt = sum(len(ids) for _, ids in prompts)
    events = self.completion_events(request_id, body, prompts, params, echo, usage_prompt)
    if body.stream:
      return _event_stream(events, body.include_usage, self.metrics)
    choices: dict[int, protocol.CompletionChoice] = {}
    completion_tokens = 0
    async for chunk in _until_disconnect(request, events):
      if chunk.usage is not None:
        completion_tokens = chunk.usage.completion_tokens
      for piece in chunk.choices:
        choice = choices.setdefault(
          piece.index, protocol.CompletionChoice(index=piece.index, text="")
        )
        choice.text += piece.text
        if piece.logprobs is not None:
          if choice.logprobs is None:
            choice.logprobs = protocol.CompletionLogprobs()
          for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(choice.logprobs, field).extend(getattr(piece.logprobs, field))
        choice.finish_reason = piece.finish_reason or choice.finish_reason
        choice.stop_reason = piece.stop_reason or choice.stop_reason
    response = protocol.CompletionResponse(
      id=request_id,
      model=self.settings.served_model_name,
      choices=[choices[i] for i in sorted(choices)],
      usage=protocol.Usage(
        prompt_tokens=usage_prompt,
        completion_tokens=completion_tokens,
        total_tokens=usage_prompt + completion_tokens,
      ),
    )
    return JSONResponse(response.model_dump())

  def echo_choice(self, text: str | None, ids: list[int]) -> protocol.CompletionChoice:
    prompt_text = self.tokenizer.decode(ids) if text is None else text
    return protocol.CompletionChoice(index=0, text=prompt_text)

  def completion_logprobs(
    self, token_ids: list[int], token_logprobs, top_logprobs, offset: int
  ) -> protocol.CompletionLogprobs:
    """OpenAI's completions logprobs of `token_ids`, text offsets from `offset`."""
    result = protocol.CompletionLogprobs()
    for token_id, logprob, top in zip(token_ids, token_logprobs, top_logprobs):
      token = self.token_text(token_id)
      result.tokens.append(token)
      result.token_logprobs.append(None if logprob is None else json_logprob(logprob))
      result.top_logprobs.append(
        None
        if top is None
        else {self.token_text(i): json_logprob(value) for i, value in top.items()}
      )
      result.text_offset.append(offset)
      offset += len(token)
    return result

  async def completion_events(
    self, request_id, body, prompts, params, echo, usage_prompt
  ) -> AsyncIterator[protocol.CompletionResponse]:
    """The chunks of a completions request; the last has no choices and the usage.

    Raises:
      APIError: see `generate`.
    """
    name, n = self.settings.served_model_name, body.n
    chunk = lambda choices, usage=None: protocol.CompletionResponse(
      id=request_id, model=name, choices=choices, usage=usage
    )
    offsets = {}
    finish = "length" if body.max_tokens == 0 else None
    if body.echo:
      for index, choice in enumerate(echo):
        for seq in range(n):
          offsets[index * n + seq] = len(choice.text)
          yield chunk([choice.model_copy(update=dict(index=index * n + seq, finish_reason=finish))])
    completion_tokens = 0
    if body.max_tokens != 0:
      async for index, output in self.generate(request_id, [ids for _, ids in prompts], params):
        completion_tokens += len(output.token_ids)
        if not (output.text or output.token_ids or output.finish_reason):
          continue
        choice_index = index * n + output.index
        offset = offsets.get(choice_index, 0)
        logprobs = None
        if body.logprobs is not None:
          logprobs = self.completion_logprobs(
            output.token_ids,
            [entry[token] for token, entry in zip(output.token_ids, output.logprobs)],
            output.logprobs,
            offset,
          )
          offsets[choice_index] = offset + sum(len(t) for t in logprobs.tokens)
        yield chunk(
          [
            protocol.CompletionChoice(
              index=choice_index,
              text=output.text,
              logprobs=logprobs,
              finish_reason=output.finish_reason,
              stop_reason=output.stop_reason,
            )
          ]
        )
    yield chunk([], _usage(usage_prompt, completion_tokens))

  # Chat completions.
  async def chat_completions(self, request: Request) -> Response:
    body = await parse_body(
      request, protocol.ChatCompletionRequest, self.settings.max_request_bytes
    )
    self.check_model(body.model)
    ids = self.render_chat(body.messages, body.add_generation_prompt)
    self.check_n(body.n, body.use_beam_search)
    if body.top_logprobs is not None and not body.logprobs:
      raise APIError("top_logprobs: needs logprobs set to true", "top_logprobs")
    self.check_logprobs(body.top_logprobs, "top_logprobs")
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
      max_tokens = self.settings.max_model_len - len(ids)
      if max_tokens < 1:
        raise APIError(
          f"messages: the conversation has {len(ids)} tokens, leaving none of this model's "
          f"maximum context length of {self.settings.max_model_len} (--max-model-len)",
          "messages",
        )
    self.check_length(len(ids), max_tokens, field)
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = self.sampling_params(body, max_tokens, k)
    self.check_admission(len(ids), params)
    await self.compile_structured_outputs(params)
    self.check_queue(1)  # before a stream's headers go out
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    events = self.chat_events(request_id, body, ids, params)
    if body.stream:
      return _event_stream(events, body.include_usage, self.metrics)
    choices: dict[int, protocol.ChatChoice] = {}
    usage = None
    async for chunk in _until_disconnect(request, events):
      usage = chunk.usage or usage
      for piece in chunk.choices:
        choice = choices.setdefault(
          piece.index,
          protocol.ChatChoice(index=piece.index, message=protocol.AssistantMessage(content="")),
        )
        choice.message.content += piece.delta.content or ""
        if piece.logprobs is not None:
          if choice.logprobs is None:
            choice.logprobs = protocol.ChatLogprobs(content=[])
          choice.logprobs.content.extend(piece.logprobs.content)
        choice.finish_reason = piece.finish_reason or choice.finish_reason
    response = protocol.ChatCompletionResponse(
      id=request_id,
      model=self.settings.served_model_name,
      choices=[choices[i] for i in sorted(choices)],
      usage=usage,
    )
    return JSONResponse(response.model_dump())

  def render_chat(self, messages, add_generation_prompt: bool) -> list[int]:
    try:
      conversation = [dict(role=m.role, content=m.text()) for m in messages]
      text = self.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
      )
    except ValueError as err:
      raise APIError(f"messages: {err}", "messages") from None
    except Exception as err:  # a template's raise_exception, a template that does not parse
      raise APIError(f"messages: the chat template refused them: {err}", "messages") from None
    ids = _encode(self.tokenizer, text)
    self.check_ids(ids, "messages")
    return ids

  def chat_logprobs(self, output: CompletionOutput, k: int) -> protocol.ChatLogprobs:
    content = []
    for token_id, entry in zip(output.token_ids, output.logprobs):
      token = self.token_text(token_id)
      best = sorted(entry.items(), key=lambda item: -item[1])[:k]
      content.append(
        protocol.TokenLogprob(
          token=token,
          logprob=json_logprob(entry[token_id]),
          bytes=list(token.encode("utf-8")),
          top_logprobs=[
            protocol.TopLogprob(
              token=self.token_text(i),
              logprob=json_logprob(v),
              bytes=list(self.token_text(i).encode("utf-8")),
            )
            for i, v in best
          ],
        )
      )
    return protocol.ChatLogprobs(content=content)

  async def chat_events(
    self, request_id, body, ids, params
  ) -> AsyncIterator[protocol.ChatCompletionChunk]:
    """The chunks of a chat request: each choice's role first, the usage last.

    Raises:
      APIError: see `generate`.
    """
    name = self.settings.served_model_name
    chunk = lambda choices, usage=None: protocol.ChatCompletionChunk(
      id=request_id, model=name, choices=choices, usage=usage
    )
    for index in range(body.n):
      role = protocol.Delta(role="assistant", content="")
      yield chunk([protocol.ChatChunkChoice(index=index, delta=role)])
    completion_tokens = 0
    async for _, output in self.generate(request_id, [ids], params):
      completion_tokens += len(output.token_ids)
      if not (output.text or output.token_ids or output.finish_reason):
        continue
      logprobs = self.chat_logprobs(output, body.top_logprobs or 0) if body.logprobs else None
      yield chunk(
        [
          protocol.ChatChunkChoice(
            index=output.index,
            delta=protocol.Delta(content=output.text),
            logprobs=logprobs,
            finish_reason=output.finish_reason,
          )
        ]
      )
    yield chunk([], _usage(len(ids), completion_tokens))

  # Tokenizer endpoints.
  async def tokenize(self, request: Request) -> Response:
    body = await parse_body(request, protocol.TokenizeRequest, self.settings.max_request_bytes)
    self.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
      raise APIError("prompt: give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
      ids = self.render_chat(body.messages, body.add_generation_prompt)
    else:
      ids = _encode(self.tokenizer, body.prompt, body.add_special_tokens)
    response = protocol.TokenizeResponse(
      count=len(ids), max_model_len=self.settings.max_model_len, tokens=ids
    )
    return JSONResponse(response.model_dump())

  async def detokenize(self, request: Request) -> Response:
    body = await parse_body(request, protocol.DetokenizeRequest, self.settings.max_request_bytes)
    self.check_model(body.model)
    vocab = self.settings.vocab_size
    bad = next((i for i in body.tokens if not 0 <= i < vocab), None)
    if bad is not None:
      raise APIError(f"tokens: token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
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


def _deadline(timeout: float | None) -> float | None:
  """The event loop's time `timeout` seconds from now, or None."""
  return None if timeout is None else asyncio.get_running_loop().time() + timeout


def _usage(prompt_tokens: int, completion_tokens: int) -> protocol.Usage:
  return protocol.Usage(
    prompt_tokens=prompt_tokens,
    completion_tokens=completion_tokens,
    total_tokens=prompt_tokens + completion_tokens,
  )


def _event_stream(
  events: AsyncIterator[BaseModel], include_usage: bool, metrics: ServerMetrics
) -> StreamingResponse:
  """Server-sent events of `events`, `data: [DONE]` last.

  The last chunk (no choices, the usage) is sent only with `include_usage`;
  an `APIError` on the way is sent as an error event and ends the stream.
  If the client disconnects, the response stops iterating `events`, whose
  cleanup aborts the requests. The stream's end counts its outcome.
  """

  async def serialize() -> AsyncIterator[str]:
    outcome = "aborted"  # unless it ends otherwise: the client went away
    try:
      async for chunk in events:
        if chunk.choices or include_usage:
          yield _sse(chunk)
      outcome = "completed"
    except APIError as err:
      outcome = err.outcome
      yield _sse(err.body())
      return
    except Exception as err:  # noqa: BLE001 - the headers are sent: end with an error event
      outcome = "failed"
      yield _sse(_internal_error(err).body())
      return
    finally:
      metrics.count_request(outcome)
      await events.aclose()
    yield "data: [DONE]\n\n"

  return StreamingResponse(serialize(), media_type="text/event-stream")


async def _until_disconnect(request: Request, events: AsyncIterator[BaseModel]):
  """The items of `events`, stopping it (and so aborting its requests) if the
  client disconnects first.

  Raises:
    APIError: 499 when the client has gone.
  """
  disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
  try:
    while True:
      step = asyncio.ensure_future(anext(events))
      done, _ = await asyncio.wait({step, disconnected}, return_when=asyncio.FIRST_COMPLETED)
      if step not in done:
        step.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
          await step
        raise APIError(
          "the client disconnected", status=499, kind="client_closed_request", outcome="aborted"
        )
      try:
        yield step.result()
      except StopAsyncIteration:
        return
  finally:
    disconnected.cancel()
    await events.aclose()


async def _wait_for_disconnect(request: Request) -> None:
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      return


def _internal_error(err: Exception) -> APIError:
  logger.error("request failed", exc_info=err)
  return APIError(
    f"internal error: {type(err).__name__}: {err}",
    status=500,
    kind="internal_server_error",
    outcome="failed",
  )


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
      return _internal_error(err).response()
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
