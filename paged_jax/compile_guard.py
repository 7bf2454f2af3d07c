"""Counting XLA compiles: what compiled, and a guard that fails when anything does.

A serving engine must not compile while it serves: a new shape mid-trace costs
seconds of latency. `count_compiles` records every backend compile inside a
`with` block (the program's name and its argument shapes); `no_compiles`
raises `RecompileError` naming each one. A program that JAX finds in its
in-memory cache does not count; one loaded from the persistent compilation
cache does (it was not warm in this process).

Example:
  engine = pj.LLMEngine(model, tokenizer, cfg, warmup=True)
  with compile_guard.no_compiles("serving"):
    while engine.has_unfinished_requests():
      engine.step()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator

from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_LOWERING_LOGGER = "jax._src.interpreters.pxla"


@dataclasses.dataclass(frozen=True)
class Compile:
  """One backend compile.

  Attributes:
    name: the program's name (`jit(<function>)`).
    shapes: its arguments' shapes and dtypes as JAX printed them when
      lowering ("" if it was not lowered inside the block).
    seconds: time spent compiling (or loading it from the persistent cache).
  """

  name: str
  shapes: str
  seconds: float

  def __str__(self) -> str:
    return f"{self.name} {self.shapes}".rstrip()


class RecompileError(RuntimeError):
  """Programs compiled where none may (see `no_compiles`)."""


class _Recorder(logging.Handler):
  """Collects compiles, with the shapes of their latest lowering."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.compiles: list[Compile] = []
    self._shapes: dict[str, str] = {}

  def emit(self, record: logging.LogRecord) -> None:
    if record.msg.startswith("Compiling %s with global shapes"):
      name, shapes = record.args[0], record.args[1]
      self._shapes[str(name)] = str(shapes)

  def compiled(self, name: str, seconds: float) -> None:
    self.compiles.append(Compile(name, self._shapes.get(name, ""), seconds))


class _PassOn(logging.Handler):
  """Hands on to the parent logger's handlers what the lowering logger let
  through before recording set it to DEBUG (it does not propagate meanwhile,
  so the DEBUG records reach the recorders alone)."""

  def __init__(self, logger: logging.Logger):
    super().__init__(logger.getEffectiveLevel())
    self._parent = logger.parent

  def emit(self, record: logging.LogRecord) -> None:
    self._parent.handle(record)


_active: list[_Recorder] = []
_saved: list = []  # the logger's level, propagate and `_PassOn`, while any recorder is active
_lock = threading.Lock()
_listening = False


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event != _BACKEND_COMPILE_EVENT:
    return
  with _lock:
    recorders = list(_active)
  for recorder in recorders:
    recorder.compiled(str(kwargs.get("fun_name", "?")), duration)


def _start(recorder: _Recorder) -> None:
  """Attaches `recorder`; the first one sets the lowering logger to DEBUG."""
  global _listening
  logger = logging.getLogger(_LOWERING_LOGGER)
  with _lock:
    if not _listening:
      monitoring.register_event_duration_secs_listener(_on_duration)
      _listening = True
    if not _active:
      pass_on = _PassOn(logger) if logger.propagate else None
      _saved[:] = [logger.level, logger.propagate, pass_on]
      if pass_on is not None:
        logger.addHandler(pass_on)
      logger.setLevel(logging.DEBUG)
      logger.propagate = False
    logger.addHandler(recorder)
    _active.append(recorder)


def _stop(recorder: _Recorder) -> None:
  """Detaches `recorder`; the last one restores the logger."""
  logger = logging.getLogger(_LOWERING_LOGGER)
  with _lock:
    _active.remove(recorder)
    logger.removeHandler(recorder)
    if not _active:
      level, propagate, pass_on = _saved
      if pass_on is not None:
        logger.removeHandler(pass_on)
      logger.setLevel(level)
      logger.propagate = propagate


@contextlib.contextmanager
def count_compiles() -> Iterator[list[Compile]]:
  """Records the backend compiles of every thread while the block runs.

  JAX's lowering logger is at DEBUG level meanwhile (the shapes come from
  its records), its DEBUG records kept from every other handler.

  Yields:
    The list of `Compile`s, filled as programs compile.
  """
  recorder = _Recorder()
  _start(recorder)
  try:
    yield recorder.compiles
  finally:
    _stop(recorder)


@contextlib.contextmanager
def no_compiles(what: str = "this block") -> Iterator[None]:
  """Fails if any program compiles while the block runs.

  Args:
    what: names the block in the error message.

  Raises:
    RecompileError: after the block, naming each program that compiled and
      its argument shapes.
  """
  with count_compiles() as compiles:
    yield
  if compiles:
    listed = "\n  ".join(str(c) for c in compiles)
    raise RecompileError(f"{len(compiles)} program(s) compiled during {what}:\n  {listed}")
