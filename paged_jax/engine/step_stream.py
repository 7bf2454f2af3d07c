"""Streaming a decode launch's tokens step by step while it runs.

A decode-only round runs up to `num_decode_steps` steps in one on-device
loop, and its tokens reach the host when the launch ends. With
`LLMEngine(stream_steps=True)` the loop publishes each step's draws as the
step ends, and the engine's thread takes them while the launch runs
(`ModelRunner._stream`), appends them to their sequences and hands their
outputs on (`LLMEngine.step`'s `on_decode_step`): a streamed token reaches
its client one step after it was drawn, not at the launch's end.

On CPU the draws go through a small C++ library (`step_stream.cc`, built
by `pallas_kernels.cpu_build`): an FFI call at the end of each step copies
them into the launch's channel, and the host waits on that channel without
holding Python's lock. Elsewhere, or where the library cannot be built,
each step hands them to the host in a host callback (an accelerator stalls
for it). An engine has two channels, as two of its launches may be in
flight (with async scheduling, the streamed one and the one dispatched
ahead of it, which publishes too but is not read): a launch publishes into
the one its `channel` operand names, so engines with the same shapes share
one program.
"""

from __future__ import annotations

import ctypes
import dataclasses
import queue
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from paged_jax import kernel_choice
from paged_jax.engine.arrivals import IdPool
from pallas_kernels import cpu_build

PUBLISH_TARGET = "paged_jax_publish_step_cpu"
END_TARGET = "paged_jax_end_launch_cpu"
LIBRARY = cpu_build.Library(
  Path(__file__).with_name("step_stream.cc"),
  ((PUBLISH_TARGET, "PublishStepCpu"), (END_TARGET, "EndLaunchCpu")),
)
MAX_STREAMS = 4096  # engines alive at once in a process
MAX_CHANNELS = 2 * MAX_STREAMS  # kChannels in step_stream.cc
ENDED = -1  # the column of a launch's end mark
TAKE_AT_ONCE = 64  # the most steps one `StepStream.take` returns

_ids = IdPool(MAX_STREAMS, "engines stream their decode steps")
_streams: weakref.WeakValueDictionary[int, StepStream] = weakref.WeakValueDictionary()


@dataclasses.dataclass
class PublishedStep:
  """One step of a decode launch, as the host takes it.

  Attributes:
    column: the step's index in its launch, or `ENDED` for the mark that
      the launch ended (then the arrays are None).
    tokens, logprob: `[R]`, the launch's rows' draws in this step.
    top_ids, top_logprobs: `[R, k]`, their most likely alternatives.
    drew: bool `[R]`, the rows that drew in this step (the others' draws
      mean nothing).
  """

  column: int
  tokens: np.ndarray | None = None
  logprob: np.ndarray | None = None
  top_ids: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None
  drew: np.ndarray | None = None


class StepStream:
  """One engine's two channels, into which its decode launches publish
  their steps (see the module docstring).

  Attributes:
    operands: per channel, its id as an int32 device scalar, the decode
      loop's argument (placed by `place`).
    mode: how the loop publishes, ``"ffi"`` (the C++ library) or
      ``"callback"`` (a host callback); default `preferred_mode()`.
  """

  def __init__(self, place=jax.device_put, mode: str | None = None):
    self.id = _ids.take(self)
    self.mode = preferred_mode() if mode is None else mode
    self.channels = (2 * self.id, 2 * self.id + 1)
    self.operands = tuple(place(np.int32(channel)) for channel in self.channels)
    self._queues = (queue.SimpleQueue(), queue.SimpleQueue())  # the callback's
    if self.mode == "ffi":
      self._take = _library_function("paged_jax_take_steps", ctypes.c_int32, _TAKE_ARGS)
      self._clear = _library_function("paged_jax_clear_steps", None, (ctypes.c_int64,))
    _streams[self.id] = self
    for parity in (0, 1):  # what an engine gone before left in them
      self.clear(parity)

  def clear(self, parity: int) -> None:
    """Drops what channel `parity` (0 or 1) holds, before a launch uses it."""
    if self.mode == "ffi":
      self._clear(self.channels[parity])
      return
    while not self._queues[parity].empty():
      self._queues[parity].get()

  def take(self, parity: int, rows: int, k: int, timeout_s: float) -> list[PublishedStep]:
    """The steps published into channel `parity` since the last `take` (up
    to `TAKE_AT_ONCE`), in order, waiting up to `timeout_s` for the first;
    [] if none came. A launch of `rows` rows with `k` alternatives each
    published them.

    Raises:
      ValueError: if a published step has another shape.
    """
    if self.mode == "ffi":
      return self._take_published(self.channels[parity], rows, k, timeout_s)
    taken = []
    try:
      taken.append(self._queues[parity].get(timeout=timeout_s))
      while len(taken) < TAKE_AT_ONCE:
        taken.append(self._queues[parity].get_nowait())
    except queue.Empty:
      pass
    for step in taken:
      if step.column != ENDED and step.top_ids.shape != (rows, k):
        raise ValueError(f"a published step has {step.top_ids.shape}, not {(rows, k)}, rows and k")
    return taken

  def _take_published(self, channel: int, rows: int, k: int, timeout_s: float):
    n = TAKE_AT_ONCE
    columns = np.empty(n, np.int32)
    tokens, drew = np.empty((n, rows), np.int32), np.empty((n, rows), np.uint8)
    logprob = np.empty((n, rows), np.float32)
    top_ids, top_logprobs = np.empty((n, rows, k), np.int32), np.empty((n, rows, k), np.float32)
    pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    arrays = (columns, tokens, logprob, top_ids, top_logprobs, drew)
    taken = self._take(channel, rows, k, n, int(timeout_s * 1e6), *map(pointer, arrays))
    if taken == -2:
      raise ValueError(f"a published step of channel {channel} is not {rows} rows by {k}")
    return [
      PublishedStep(ENDED)
      if columns[i] == ENDED
      else PublishedStep(
        int(columns[i]), tokens[i], logprob[i], top_ids[i], top_logprobs[i], drew[i] != 0
      )
      for i in range(taken)
    ]


_TAKE_ARGS = (ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int64)
_TAKE_ARGS += (ctypes.c_void_p,) * 6


def _library_function(symbol: str, restype, argtypes):
  function = LIBRARY.function(symbol)
  function.restype, function.argtypes = restype, argtypes
  return function


def preferred_mode() -> str:
  """``"ffi"`` where the C++ library serves (CPU, the library built), else
  ``"callback"``."""
  if kernel_choice.kernel_platform() == "cpu" and LIBRARY.unavailable_reason() is None:
    return "ffi"
  return "callback"


def _uses_ffi(mode: str) -> bool:
  """Whether a program traced now publishes through the C++ library (an
  ahead-of-time compile for TPU of a CPU engine's launches calls back)."""
  return mode == "ffi" and kernel_choice.kernel_platform() == "cpu"


def publish_step(channel: jax.Array, mode: str, column, draw, drew, passed):
  """Publishes a decode step into `channel` (a `StepStream.operands`
  entry) as `mode` says: the rows' `draw` (a `sampling.Draw` of `[R]` and
  `[R, k]` arrays) in the launch's `column`, and `drew` (bool `[R]`).
  Returns `passed` (a bool scalar), which the caller uses in the step's
  place: the publishing runs once `passed` is computed."""
  operands = (channel, column, draw.tokens, draw.logprob, draw.top_ids, draw.top_logprobs, drew)
  result = jax.ShapeDtypeStruct((), jnp.bool_)
  if _uses_ffi(mode):
    return jax.ffi.ffi_call(PUBLISH_TARGET, result)(*operands, passed)
  return io_callback(_publish_on_host, result, *operands, passed)


def end_launch(channel: jax.Array, mode: str, steps):
  """Marks the end of the launch publishing into `channel`; returns
  `steps` (an int32 scalar), which the caller uses in its place."""
  result = jax.ShapeDtypeStruct((), jnp.int32)
  if _uses_ffi(mode):
    return jax.ffi.ffi_call(END_TARGET, result)(channel, steps)
  return io_callback(_end_on_host, result, channel, steps)


def _channel_queue(channel) -> queue.SimpleQueue | None:
  stream = _streams.get(int(channel) // 2)
  return None if stream is None else stream._queues[int(channel) % 2]


def _publish_on_host(channel, column, tokens, logprob, top_ids, top_logprobs, drew, passed):
  """The host side of `publish_step`'s callback (nothing for an engine
  that is gone)."""
  steps = _channel_queue(channel)
  if steps is not None:
    arrays = (tokens, logprob, top_ids, top_logprobs, drew)
    steps.put(PublishedStep(int(column), *(np.array(a) for a in arrays)))
  return np.bool_(passed)


def _end_on_host(channel, steps):
  ended = _channel_queue(channel)
  if ended is not None:
    ended.put(PublishedStep(ENDED))
  return np.int32(steps)


def check_streaming(option, num_devices: int) -> bool:
  """`option`, whether an engine streams its decode steps.

  Raises:
    ValueError: for an `option` that is not a bool, or True with several
      devices (each would publish every step).
  """
  if not isinstance(option, bool):
    raise ValueError(f"stream_steps must be a bool, got {option!r}")
  if option and num_devices > 1:
    raise ValueError(
      f"stream_steps=True needs one device, not {num_devices}: each would publish every step"
    )
  return option
