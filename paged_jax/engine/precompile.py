"""Warm-up's model programs compiled side by side, on threads.

An XLA:CPU compile of one model program runs mostly on the thread that asked
for it, and a model's programs (each prompt bucket, each decode loop) are
independent: XLA releases Python's GIL while it compiles, so threads compile
them at once, one per core. A warm-up launch cannot itself run on a thread:
each launch donates the cache's pages and takes back the new ones. So warm-up
runs each launch twice. First `ProgramCalls.first_call` runs it up to its
first model program call, records the program and its arguments and stops it
there (nothing has changed yet: a launch changes the engine's state only
after its program returns); `compile_side_by_side` lowers and compiles those
calls on threads. Then warm-up runs the launches for real, one after another,
and JAX finds each program already compiled in its in-memory cache.
"""

from __future__ import annotations

import concurrent.futures
import os


class _Stopped(Exception):
  """A launch stopped at its first model program call (`ProgramCalls.first_call`)."""


class ProgramCalls:
  """The model runner's calls of its model programs: made, or while
  `first_call` runs a launch, recorded and stopped."""

  def __init__(self):
    self._recorded: list | None = None

  def __call__(self, program, *args, **kwargs):
    """`program(*args, **kwargs)`, unless `first_call` is recording.

    Raises:
      _Stopped: while recording, after recording the call.
    """
    if self._recorded is None:
      return program(*args, **kwargs)
    self._recorded.append((program, args, kwargs))
    raise _Stopped

  def first_call(self, launch) -> tuple | None:
    """Runs `launch()` up to its first model program call, which is not made.

    Returns:
      `(program, args, kwargs)` of that call, or None if `launch` made none
      (it then ran to its end).
    """
    self._recorded = []
    try:
      launch()
    except _Stopped:
      pass
    finally:
      recorded, self._recorded = self._recorded, None
    return recorded[0] if recorded else None


def compile_workers() -> int:
  """Threads for `compile_side_by_side`: the cores this process may run on."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def compile_side_by_side(calls, workers: int, on_done=lambda: None) -> None:
  """Lowers and compiles each recorded `(program, args, kwargs)` of `calls`
  for its arguments, on up to `workers` threads (in this thread for one), so
  that calling the program with such arguments compiles nothing; calls
  `on_done()` as each finishes.

  Raises:
    whatever lowering or compiling a call raises.
  """

  def compile_one(call) -> None:
    program, args, kwargs = call
    program.lower(*args, **kwargs).compile()

  if workers <= 1 or len(calls) <= 1:
    for call in calls:
      compile_one(call)
      on_done()
    return
  with concurrent.futures.ThreadPoolExecutor(min(workers, len(calls))) as pool:
    for future in concurrent.futures.as_completed([pool.submit(compile_one, c) for c in calls]):
      future.result()
      on_done()
