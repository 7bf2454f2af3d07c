"""Streaming a response: server-sent events, a client that disconnects, and
the error a handler's unexpected failure answers with."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from paged_jax.server import protocol
from paged_jax.server.bodies import APIError
from paged_jax.server.metrics import ServerMetrics

logger = logging.getLogger("paged_jax.server")


def sse(payload: BaseModel | dict) -> str:
  data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
  return f"data: {data}\n\n"


def token_usage(prompt_tokens: int, completion_tokens: int) -> protocol.Usage:
  return protocol.Usage(
    prompt_tokens=prompt_tokens,
    completion_tokens=completion_tokens,
    total_tokens=prompt_tokens + completion_tokens,
  )


def event_stream(
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
          yield sse(chunk)
      outcome = "completed"
    except APIError as err:
      outcome = err.outcome
      yield sse(err.body())
      return
    except Exception as err:  # noqa: BLE001 - the headers are sent: end with an error event
      outcome = "failed"
      yield sse(internal_error(err).body())
      return
    finally:
      metrics.count_request(outcome)
      await events.aclose()
    yield "data: [DONE]\n\n"

  return StreamingResponse(serialize(), media_type="text/event-stream")


async def until_disconnect(request: Request, events: AsyncIterator[BaseModel]):
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


def internal_error(err: Exception) -> APIError:
  logger.error("request failed", exc_info=err)
  return APIError(
    f"internal error: {type(err).__name__}: {err}",
    status=500,
    kind="internal_server_error",
    outcome="failed",
  )
