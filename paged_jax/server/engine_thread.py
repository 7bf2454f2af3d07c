"""The engine thread: the one thread that calls JAX.

It builds the model and the `LLMEngine`, warms them up, then loops: it takes
requests, aborts and prompt-scoring jobs from a thread-safe inbox, steps the
engine while it has work, and hands every output to the request's sink. With
nothing to do it blocks on the inbox (no spinning). The asyncio side uses
`EngineClient`, whose sinks move each item into a per-request
`asyncio.Queue` through `loop.call_soon_threadsafe`; no handler calls JAX.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from paged_jax import compile_guard
from paged_jax.config import CacheConfig
from paged_jax.engine.outputs import RequestOutput
from paged_jax.params import SamplingParams
from paged_jax.server import prompt_logprobs
from paged_jax.server.metrics import ServerMetrics

logger = logging.getLogger("paged_jax.server")

WARMUP_ID = "paged-jax-warmup"
# While a decode launch runs ahead (async scheduling), the KV-cache gauges,
# which wait for it, are read at most this often.
GAUGES_EVERY_S_WHILE_AHEAD = 1.0


@dataclasses.dataclass
class BuiltEngine:
  """What the engine thread's `build` returns.

  Attributes:
    engine: the `LLMEngine`.
    model: the model it serves (prompt log-probabilities run it directly).
    cache_config: the cache of each data shard.
    num_data_shards: data-parallel shards (each has `cache_config`'s blocks).
  """

  engine: object
  model: object
  cache_config: CacheConfig
  num_data_shards: int = 1

  @property
  def num_gpu_blocks(self) -> int:
    """GPU blocks of all data shards."""
    return self.cache_config.num_gpu_blocks * self.num_data_shards


class EngineStopped(RuntimeError):
  """The engine thread has stopped (the server is shutting down)."""


@dataclasses.dataclass
class _Tracked:
  """What the engine thread keeps about one engine request."""

  sink: Callable[[object], None]
  num_prompt_tokens: int
  arrival: float
  first_token: float | None = None
  last_token: float | None = None


@dataclasses.dataclass
class _Add:
  request_id: str
  token_ids: np.ndarray
  params: SamplingParams
  sink: Callable[[object], None]


@dataclasses.dataclass
class _Abort:
  request_id: str


@dataclasses.dataclass
class _Score:
  token_ids: np.ndarray
  k: int
  sink: Callable[[object], None]


class _Stop:
  pass


class EngineThread:
  """Owns the engine on a thread of its own.

  Args:
    build: called on the engine thread (it loads the model and builds the
      engine there); returns a `BuiltEngine`.
    metrics: where the thread records what it serves.
  """

  def __init__(
    self,
    build: Callable[[], BuiltEngine],
    metrics: ServerMetrics,
  ):
    self._build = build
    self._metrics = metrics
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._ready = threading.Event()
    self._stopped = threading.Event()
    self._startup_error: BaseException | None = None
    self._tracked: dict[str, _Tracked] = {}
    self._scoring: dict[str, Callable[[object], None]] = {}  # prompt-scoring jobs' sinks
    self._num_scores = 0
    self._thread = threading.Thread(target=self._run, name="paged-jax-engine", daemon=True)
    self.engine = None
    self.built: BuiltEngine | None = None

  # Called from other threads.
  def start(self) -> None:
    """Starts the thread and waits until the engine is built and warmed up.

    Raises:
      Exception: whatever building or warming up the engine raised.
    """
    self._thread.start()
    self._ready.wait()
    if self._startup_error is not None:
      raise self._startup_error

  def add(self, request_id: str, token_ids, params: SamplingParams, sink) -> None:
    """Queues a request; `sink` gets its `RequestOutput`s, or an exception.
    With the engine's `stop_decode_on_arrival`, the decode launch in flight
    ends before its next step (`LLMEngine.notify_arrival`)."""
    self._put(_Add(request_id, np.asarray(token_ids, np.int32), params, sink))
    self._notify_arrival()

  def abort(self, request_id: str) -> None:
    """Aborts a request (ignored if it finished); frees its blocks at once."""
    if not self._stopped.is_set():
      self._inbox.put(_Abort(request_id))

  def score(self, token_ids, k: int, sink) -> None:
    """Queues a prompt-scoring job; `sink` gets `PromptLogprobs` or an exception."""
    self._put(_Score(np.asarray(token_ids, np.int32), k, sink))
    self._notify_arrival()

  def admission_error(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
    """The engine's answer to "can this request ever be served" (None: yes),
    `LLMEngine.admission_error`; it reads only the engine's configuration,
    so any thread may ask."""
    return self.engine.admission_error(num_prompt_tokens, params)

  def request_stop(self) -> None:
    """Asks the thread to abort every request (their sinks see finish
    reason "abort") and end; returns at once."""
    if self._thread.is_alive():
      self._inbox.put(_Stop())

  def stop(self, timeout: float | None = 30.0) -> None:
    """`request_stop`, then waits for the thread to end."""
    self.request_stop()
    self._thread.join(timeout)

  @property
  def running(self) -> bool:
    return self._ready.is_set() and not self._stopped.is_set()

  def _notify_arrival(self) -> None:
    """After a message is queued (never before: the launch it ends must
    find it in the inbox)."""
    engine = self.engine
    if engine is not None:
      engine.notify_arrival()

  def _put(self, message) -> None:
    if self._stopped.is_set():
      raise EngineStopped("the server is shutting down")
    self._inbox.put(message)

  # The thread.
  def _run(self) -> None:
    try:
      self.built = self._build()
      self.engine = self.built.engine
      self._warm_up()
      self._base = self.engine.stats  # the warm-up's counts do not count
      self._prefilled_prompt_tokens = 0
      self._counted: dict[int, int] = {}
      self._compiles: list[compile_guard.Compile] = []  # while serving
      self._num_compiles_counted = 0
      self._update_gauges()
    except BaseException as err:  # reported to `start`
      self._startup_error = err
      self._stopped.set()
      self._ready.set()
      return
    self._ready.set()
    try:
      with compile_guard.count_compiles() as self._compiles:
        self._loop()
    finally:
      self._stopped.set()
      self._fail_all(EngineStopped("the server is shutting down"))

  def _warm_up(self) -> None:
    """Compiles prefill, decode and freeing: one tiny request runs to its
    end, and one is aborted after its first step."""
    engine = self.engine
    engine.add_request(WARMUP_ID, np.zeros(2, np.int32), SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
      engine.step()
    aborted = f"{WARMUP_ID}-abort"
    engine.add_request(aborted, np.zeros(2, np.int32), SamplingParams(max_tokens=64))
    engine.step()
    engine.abort_request(aborted)
    while engine.has_unfinished_requests():
      engine.step()

  def _loop(self) -> None:
    engine = self.engine
    while True:
      for message in self._drain(block=not engine.has_unfinished_requests()):
        if isinstance(message, _Stop):
          self._shut_down()
          return
        self._handle(message)
      if engine.has_unfinished_requests():
        try:
          outputs = engine.step(on_decode_step=self._dispatch)
        except Exception as err:  # noqa: BLE001 - fail the requests in flight, keep serving
          logger.exception("engine step failed; failing the requests in flight")
          self._fail_all(err)
          continue
        self._dispatch(outputs)
      if (
        not engine.running_ahead or time.monotonic() >= self._gauges_at + GAUGES_EVERY_S_WHILE_AHEAD
      ):
        self._update_gauges()

  def _drain(self, block: bool) -> list:
    messages = [self._inbox.get()] if block else []
    while True:
      try:
        messages.append(self._inbox.get_nowait())
      except queue.Empty:
        return messages

  def _handle(self, message) -> None:
    if isinstance(message, _Add):
      try:
        self.engine.add_request(message.request_id, message.token_ids, message.params)
      except Exception as err:  # noqa: BLE001 - reported to this request only
        message.sink(err)
        return
      self._tracked[message.request_id] = _Tracked(
        message.sink, int(message.token_ids.size), time.monotonic()
      )
    elif isinstance(message, _Abort):
      if message.request_id in self._tracked:
        self.engine.abort_request(message.request_id)
    elif isinstance(message, _Score):
      self._num_scores += 1
      score_id = f"paged-jax-score-{self._num_scores}"
      try:
        params = prompt_logprobs.scoring_params(message.k)
        self.engine.add_request(score_id, message.token_ids, params)
      except Exception as err:  # noqa: BLE001 - reported to this request only
        message.sink(err)
        return
      self._scoring[score_id] = message.sink

  def _dispatch(self, outputs: list[RequestOutput]) -> None:
    metrics, now = self._metrics, time.monotonic()
    for output in outputs:
      sink = self._scoring.pop(output.request_id, None) if output.finished else None
      if sink is not None:
        try:
          sink(prompt_logprobs.from_output(output))
        except Exception as err:  # noqa: BLE001 - reported to this request only
          sink(err)
        continue
      tracked = self._tracked.get(output.request_id)
      if tracked is None:
        continue
      new_tokens = sum(len(c.token_ids) for c in output.outputs)
      if new_tokens:
        if tracked.first_token is None:
          tracked.first_token = now
          metrics.time_to_first_token.observe(now - tracked.arrival)
          metrics.prompt_tokens.inc(tracked.num_prompt_tokens)
          self._prefilled_prompt_tokens += tracked.num_prompt_tokens
        else:
          gap = (now - tracked.last_token) / new_tokens
          for _ in range(new_tokens):
            metrics.inter_token_latency.observe(gap)
        tracked.last_token = now
        metrics.generation_tokens.inc(new_tokens)
      if output.finished:
        metrics.e2e_request_latency.observe(now - tracked.arrival)
        del self._tracked[output.request_id]
      tracked.sink(output)

  def _update_gauges(self) -> None:
    self._gauges_at = time.monotonic()
    metrics, engine = self._metrics, self.engine
    waiting = sum(t.first_token is None for t in self._tracked.values())
    metrics.num_requests_waiting.set(waiting)
    metrics.num_requests_running.set(len(self._tracked) - waiting)
    free = engine.num_free_gpu_blocks()
    total = self.built.num_gpu_blocks
    metrics.num_gpu_blocks.set(total)
    metrics.num_free_gpu_blocks.set(free)
    metrics.kv_cache_usage_perc.set(1.0 - free / total)
    stats = engine.stats
    since = lambda name: getattr(stats, name) - getattr(self._base, name)
    skipped = self._prefilled_prompt_tokens - since("prefill_tokens")
    for counter, total in (
      (metrics.num_preemptions, since("preemptions")),
      (metrics.prefix_cache_queries, self._prefilled_prompt_tokens),
      (metrics.prefix_cache_hits, skipped),
      (metrics.spec_decode_num_drafts, since("spec_decode_num_drafts")),
      (metrics.spec_decode_num_draft_tokens, since("spec_decode_num_draft_tokens")),
      (metrics.spec_decode_num_accepted_tokens, since("spec_decode_num_accepted_tokens")),
    ):
      counted = self._counted.get(id(counter), 0)
      if total > counted:  # counters never go down
        counter.inc(total - counted)
        self._counted[id(counter)] = total
    self._count_compiles()

  def _count_compiles(self) -> None:
    """Counts and logs the programs compiled since the last call: the
    warm-up left each out, and its first launch stalled every request."""
    new = self._compiles[self._num_compiles_counted :]
    for compiled in new:
      logger.warning("compiled while serving (%.2f s): %s", compiled.seconds, compiled)
    self._metrics.compiles_while_serving.inc(len(new))
    self._num_compiles_counted += len(new)

  def _fail_all(self, err: Exception) -> None:
    for request_id, tracked in list(self._tracked.items()):
      if self.engine is not None:
        try:
          self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - the engine may be broken; the sink hears of it
          logger.exception("abort of %s failed", request_id)
      tracked.sink(err)
    self._tracked.clear()
    for request_id, sink in list(self._scoring.items()):
      if self.engine is not None:
        self.engine.abort_request(request_id)
      sink(err)
    self._scoring.clear()

  def _shut_down(self) -> None:
    """Aborts everything in flight and reports the aborts to the sinks."""
    self._stopped.set()
    for request_id in list(self._tracked):
      self.engine.abort_request(request_id)
    while self.engine.has_unfinished_requests() and self._tracked:
      self._dispatch(self.engine.step())
    self._fail_all(EngineStopped("the server is shutting down"))
    for message in self._drain(block=False):
      if isinstance(message, (_Add, _Score)):
        message.sink(EngineStopped("the server is shutting down"))


class EngineClient:
  """The asyncio side's handle on an `EngineThread` (call from the loop's thread).

  Args:
    thread: the started engine thread.
    loop: the event loop the handlers run on.
  """

  def __init__(self, thread: EngineThread, loop: asyncio.AbstractEventLoop):
    self._thread = thread
    self._loop = loop

  def _sink(self, target: asyncio.Queue, tag) -> Callable[[object], None]:
    loop = self._loop

    def deliver(item) -> None:
      try:
        loop.call_soon_threadsafe(target.put_nowait, (tag, item))
      except RuntimeError:  # the loop has closed: nobody is listening
        pass

    return deliver

  def add(self, request_id: str, token_ids, params: SamplingParams, target, tag) -> None:
    """Queues a request; `(tag, RequestOutput or exception)` items arrive in `target`."""
    self._thread.add(request_id, token_ids, params, self._sink(target, tag))

  def abort(self, request_id: str) -> None:
    self._thread.abort(request_id)

  async def score(self, token_ids, k: int):
    """The prompt's `PromptLogprobs`.

    Raises:
      Exception: whatever scoring raised.
    """
    target: asyncio.Queue = asyncio.Queue()
    self._thread.score(token_ids, k, self._sink(target, None))
    _, result = await target.get()
    if isinstance(result, BaseException):
      raise result
    return result
