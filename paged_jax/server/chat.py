"""`/v1/chat/completions`: OpenAI's chat completions, with log-probabilities
and streaming."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from paged_jax.engine.outputs import CompletionOutput
from paged_jax.server import protocol
from paged_jax.server.bodies import APIError, json_logprob, parse_body
from paged_jax.server.streaming import event_stream, token_usage, until_disconnect


class ChatCompletions:
  """The `Server`'s chat endpoint (a mixin over its checks, `render_chat`,
  `generate` and `token_text`)."""

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
      return event_stream(events, body.include_usage, self.metrics)
    choices: dict[int, protocol.ChatChoice] = {}
    usage = None
    async for chunk in until_disconnect(request, events):
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
    yield chunk([], token_usage(len(ids), completion_tokens))
