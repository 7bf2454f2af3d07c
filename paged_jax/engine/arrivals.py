"""Ending a decode launch before its next step when a request arrives.

A decode-only round runs up to `num_decode_steps` steps in one on-device
loop. With the arrival check on, the loop reads the engine's arrival flag
before each step; if a request arrived since the round began, the loop ends
there (after the step in flight when it arrived), and the next round admits
the request. A launch dispatched ahead (async scheduling) reads it too, so
it runs no step once one arrived.

On CPU the flag lives in a small C++ library (`arrivals.cc`, built by
`pallas_kernels.cpu_build`), which the loop reads through an FFI call in
its body (3.6% of a SmolLM2 decode step), and the program stays an
ordinary one (JAX's fast launch path, the persistent compilation cache). Elsewhere, or where the
library cannot be built, the loop asks the host in a host callback, which
costs a host round trip per step (an accelerator stalls), launches through
JAX's Python path (on CPU a tiny model's decode step took 57% longer) and
keeps the program out of the persistent compilation cache. Either way the
flag is found by the engine's id, a launch operand
(`ArrivalWatch.operand`), so engines with the same shapes share one
program.
"""

from __future__ import annotations

import ctypes
import heapq
import threading
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from paged_jax import kernel_choice
from pallas_kernels import cpu_build

TARGET = "paged_jax_arrived_cpu"
LIBRARY = cpu_build.Library(Path(__file__).with_name("arrivals.cc"), ((TARGET, "ArrivedCpu"),))
MAX_WATCHES = 4096  # engines alive at once in a process (kWatches in arrivals.cc)


class IdPool:
  """Ids `0 .. size - 1` for objects that C++ state is kept for (the
  lowest free id first), each returned when its object is collected.

  Args:
    size: how many objects may hold one at once.
    what: what runs out, for the error (``"engines check for arrivals"``).
  """

  def __init__(self, size: int, what: str):
    self.free = list(range(size))  # a heap
    self.size, self.what = size, what
    self._lock = threading.Lock()

  def take(self, holder) -> int:
    """The lowest free id, now `holder`'s until it is collected.

    Raises:
      RuntimeError: when every id is held.
    """
    with self._lock:
      if not self.free:
        raise RuntimeError(f"more than {self.size} {self.what} at once")
      taken = heapq.heappop(self.free)
    weakref.finalize(holder, self._give_back, taken)
    return taken

  def _give_back(self, taken: int) -> None:
    with self._lock:
      heapq.heappush(self.free, taken)


_ids = IdPool(MAX_WATCHES, "engines check for arrivals")
_watches: weakref.WeakValueDictionary[int, ArrivalWatch] = weakref.WeakValueDictionary()


class ArrivalWatch:
  """One engine's arrival flag, which its decode launches read each step.

  `note` may run on any thread (the server's, while the engine thread waits
  for a launch); the engine clears the flag when a round begins, as the
  scheduler is about to see every request added before.

  Attributes:
    operand: the engine's id as an int32 device scalar, the decode loop's
      argument (placed by `place`).
    check: how the loop reads the flag, ``"flag"`` (the C++ one) or
      ``"callback"`` (a host callback); default `preferred_check()`.
  """

  def __init__(self, place=jax.device_put, check: str | None = None):
    self.id = _ids.take(self)
    self.check = preferred_check() if check is None else check
    self._set_flag = _flag_setter() if self.check == "flag" else None
    self._arrived = threading.Event()
    self.operand = place(np.int32(self.id))
    _watches[self.id] = self
    self.clear()

  def note(self) -> None:
    """A request arrived: the launch in flight ends after its current step."""
    self._arrived.set()
    if self._set_flag is not None:
      self._set_flag(self.id, 1)

  def clear(self) -> None:
    self._arrived.clear()
    if self._set_flag is not None:
      self._set_flag(self.id, 0)

  def should_stop(self) -> bool:
    """Asked before each step of a launch: whether a request arrived."""
    return self._arrived.is_set()


def _flag_setter():
  setter = LIBRARY.function("paged_jax_set_arrived")
  setter.argtypes = (ctypes.c_int64, ctypes.c_int32)
  setter.restype = None
  return setter


def _should_stop(watch_id: np.ndarray, after=None) -> np.ndarray:
  """The host side of the callback: the watch's answer (False for an
  engine that is gone)."""
  watch = _watches.get(int(watch_id))
  return np.bool_(watch is not None and watch.should_stop())


def preferred_check() -> str:
  """``"flag"`` where the C++ flag serves (CPU, the library built), else
  ``"callback"``."""
  if kernel_choice.kernel_platform() == "cpu" and LIBRARY.unavailable_reason() is None:
    return "flag"
  return "callback"


def arrived(watch_id: jax.Array, check: str, after: jax.Array) -> jax.Array:
  """Whether the engine of `watch_id` (its `ArrivalWatch.operand`) saw a
  request arrive since its round began, once `after` (any array: its value
  is not used) is computed: a traced bool, read from the C++ flag (`check`
  ``"flag"``, in a program traced for CPU) or asked on the host (otherwise:
  an ahead-of-time compile for TPU of a CPU engine's launches asks too)."""
  result = jax.ShapeDtypeStruct((), jnp.bool_)
  if check == "flag" and kernel_choice.kernel_platform() == "cpu":
    return jax.ffi.ffi_call(TARGET, result)(watch_id, after)
  return io_callback(_should_stop, result, watch_id, after)


def check_arrivals(option, num_processes: int) -> bool:
  """`option`, whether an engine's decode launches check for arrivals.

  Raises:
    ValueError: for an `option` that is not a bool, or True with several
      processes (each would end its launches at its own step).
  """
  if not isinstance(option, bool):
    raise ValueError(f"stop_decode_on_arrival must be a bool, got {option!r}")
  if option and num_processes > 1:
    raise ValueError(
      f"stop_decode_on_arrival=True needs one process, not {num_processes}: each would end "
      "a launch at its own step"
    )
  return option
