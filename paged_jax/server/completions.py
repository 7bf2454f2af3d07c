"""`/v1/completions`: OpenAI's completions, with echo, log-probabilities and
streaming."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from paged_jax.server import protocol
from paged_jax.server.bodies import APIError, json_logprob, parse_body
from paged_jax.server.engine_thread import EngineStopped
from paged_jax.server.streaming import event_stream, token_usage, until_disconnect


class Completions:
  """The `Server`'s completions endpoint (a mixin over its checks, `generate`
  and `token_text`)."""

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
      return event_stream(events, body.include_usage, self.metrics)
    choices: dict[int, protocol.CompletionChoice] = {}
    completion_tokens = 0
    async for chunk in until_disconnect(request, events):
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
    yield chunk([], token_usage(usage_prompt, completion_tokens))
