"""How long the device waits for the host while an engine serves.

`watch_launches()` wraps the engine's model launches (`prefill_step`,
`decode_loop`, `ragged_step`): a thread waits for each launch's
outputs and notes when they are ready. The device runs launches in the order
they were dispatched, so launch `i` is busy from `max(dispatched_i,
ready_{i-1})` to `ready_i`; the rest of the wall time the device is idle,
waiting for the host to schedule, read back and process. The engine's small
block-manager programs count as idle (a few milliseconds per round).

Usage, around any serving code:

    with watch_launches() as watch:
      llm.generate(prompts, params)
    print(watch.idle_share())
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import jax

from paged_jax.engine import programs

LAUNCHES = ("prefill_step", "decode_loop", "ragged_step")


class LaunchWatch:
  """Dispatch and ready times of the launches made while it watches."""

  def __init__(self):
    self.launches: list[tuple[float, float]] = []  # (dispatched, ready)
    self.start = self.end = 0.0
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._wait_for_launches, daemon=True)

  def _wait_for_launches(self) -> None:
    while (item := self._queue.get()) is not None:
      dispatched, outputs = item
      # All of a launch's outputs are ready at once; those a later launch
      # took (donated) are gone, the others (its draws) stay.
      kept = [a for a in jax.tree.leaves(outputs) if not a.is_deleted()]
      jax.block_until_ready(kept[-1:])
      self.launches.append((dispatched, time.perf_counter()))

  def busy_seconds(self) -> float:
    busy, ready_before = 0.0, self.start
    for dispatched, ready in self.launches:
      busy += max(0.0, ready - max(dispatched, ready_before))
      ready_before = max(ready_before, ready)
    return busy

  def idle_share(self) -> float:
    """The share of the watched wall time in which no launch ran."""
    return 1.0 - self.busy_seconds() / (self.end - self.start)


@contextlib.contextmanager
def watch_launches():
  """Watches the engine's launches made inside the block (see the module
  docstring); yields the `LaunchWatch`."""
  watch = LaunchWatch()
  originals = {name: getattr(programs, name) for name in LAUNCHES}

  def watched(launch):
    def call(*args, **kwargs):
      outputs = launch(*args, **kwargs)
      watch._queue.put((time.perf_counter(), outputs))
      return outputs

    return call

  for name, launch in originals.items():
    setattr(programs, name, watched(launch))
  watch._thread.start()
  watch.start = time.perf_counter()
  try:
    yield watch
  finally:
    watch._queue.put(None)
    watch._thread.join()
    watch.end = time.perf_counter()
    for name, launch in originals.items():
      setattr(programs, name, launch)
