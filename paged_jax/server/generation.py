"""Running a request's prompts on the engine thread: the queue limit, the
request timeout, aborting what the caller leaves, and compiling a
structured-output constraint off the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from paged_jax.engine.outputs import CompletionOutput
from paged_jax.params import SamplingParams
from paged_jax.server.bodies import APIError
from paged_jax.server.engine_thread import EngineStopped
from paged_jax.server.limits import RETRY_AFTER_S, SCHEMA_COMPILE_TIMEOUT_S
from paged_jax.structured import compile_constraint


class EngineRequests:
  """The `Server`'s calls to the engine (a mixin: they use its `client`,
  `settings`, `tokenizer`, `shutting_down` and `num_waiting`)."""

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


def _deadline(timeout: float | None) -> float | None:
  """The event loop's time `timeout` seconds from now, or None."""
  return None if timeout is None else asyncio.get_running_loop().time() + timeout
