"""Ending a decode launch before its next step when a request arrives.

A decode-only round runs up to `num_decode_steps` steps in one on-device
loop. With the arrival check on, the loop asks the host before each step,
in one host callback, whether a request arrived since the round began; if
one did, the loop ends there (after the step in flight when it arrived),
and the next round admits the request. A launch dispatched ahead (async
scheduling) asks too, so it runs no step once one arrived.
The callback is a module-level function that takes the engine's id as an
operand (`ArrivalWatch.operand`), so engines with the same shapes share one
program, and the id finds the engine's watch here.

The check is off by default (`LLMEngine`'s `stop_decode_on_arrival`): a
host round trip per step stalls an accelerator; JAX launches a program
with a host callback through its Python path, not its C++ fast path (a
cost per launch: on CPU, a tiny model's decode step took 57% longer), and
writes none to its persistent compilation cache, so with the check on the
decode loops compile at every start.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

_ids = itertools.count()
_watches: weakref.WeakValueDictionary[int, ArrivalWatch] = weakref.WeakValueDictionary()


class ArrivalWatch:
  """One engine's arrival flag, which its decode launches read each step.

  `note` may run on any thread (the server's, while the engine thread waits
  for a launch); the engine clears the flag when a round begins, as the
  scheduler is about to see every request added before.

  Attributes:
    operand: the engine's id as an int32 device scalar, the decode loop's
      argument (placed by `place`).
  """

  def __init__(self, place=jax.device_put):
    self.id = next(_ids)
    self._arrived = threading.Event()
    self.operand = place(np.int32(self.id))
    _watches[self.id] = self

  def note(self) -> None:
    """A request arrived: the launch in flight ends after its current step."""
    self._arrived.set()

  def clear(self) -> None:
    self._arrived.clear()

  def should_stop(self) -> bool:
    """Asked before each step of a launch: whether a request arrived."""
    return self._arrived.is_set()


def _should_stop(watch_id: np.ndarray) -> np.ndarray:
  """The host side of the check: the watch's answer (False for an engine
  that is gone)."""
  watch = _watches.get(int(watch_id))
  return np.bool_(watch is not None and watch.should_stop())


def arrived(watch_id: jax.Array) -> jax.Array:
  """Whether the engine of `watch_id` (its `ArrivalWatch.operand`) saw a
  request arrive since its round began: a traced bool, asked on the host."""
  return io_callback(_should_stop, jax.ShapeDtypeStruct((), jnp.bool_), watch_id)


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
