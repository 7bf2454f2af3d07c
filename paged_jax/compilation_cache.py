"""A persistent compilation cache, so a second start compiles nothing new.

XLA compiles every program the engine runs (prefill widths, the decode loop,
swaps, copies) when it is first called, and on CPU that takes most of a
short run's time. With JAX's persistent compilation cache on, each compiled
program is also written to disk, keyed by the program, the devices, the XLA
flags and the jaxlib version, and a later process that runs the same program
reads it back instead of compiling.

`LLMEngine` calls `enable()` when it is created, so the cache is on by
default. Where it lives:

* ``$PAGED_JAX_CACHE_DIR`` if that variable is set and not empty;
* else ``$XDG_CACHE_HOME/paged_jax/jax``, or ``~/.cache/paged_jax/jax``
  without ``XDG_CACHE_HOME``.

``PAGED_JAX_CACHE_DIR=""`` (set, but empty) turns it off, and so does
calling ``enable("")`` before the first engine is built. A directory the
user gave JAX itself (``jax.config.update("jax_compilation_cache_dir", ...)``
or ``JAX_COMPILATION_CACHE_DIR``) is left alone, with the user's thresholds.
The cache grows without bound; delete the directory to empty it. Like every
JAX compilation cache it is trusted: whoever can write to it can run code in
the processes that read it, so keep it private.
"""

from __future__ import annotations

import os
import pathlib

import jax

CACHE_DIR_ENV = "PAGED_JAX_CACHE_DIR"
# Cache every program, however quick to compile or small: the engine's
# programs are many and small, and together they are most of a start.
MIN_COMPILE_TIME_SECS = 0.0
MIN_ENTRY_SIZE_BYTES = -1  # no size threshold (JAX's -1), and no override of it

_UNSET = object()  # enable() not called yet
_settled = _UNSET  # then: the directory, or None for off


def default_cache_dir(environ=None) -> str:
  """The per-user cache directory, ``paged_jax/jax`` under the XDG cache home.

  Args:
    environ: the environment to read ``XDG_CACHE_HOME`` from; None for
      `os.environ`.

  Returns:
    ``$XDG_CACHE_HOME/paged_jax/jax``, or ``~/.cache/paged_jax/jax``.
  """
  environ = os.environ if environ is None else environ
  base = environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return str(pathlib.Path(base) / "paged_jax" / "jax")


def resolve_cache_dir(cache_dir: str | None = None, environ=None) -> str | None:
  """Where the cache goes: `cache_dir`, else ``$PAGED_JAX_CACHE_DIR``, else
  `default_cache_dir`; an empty string at either level means off.

  Args:
    cache_dir: a directory, "" for no cache, or None to ask the environment.
    environ: the environment to read; None for `os.environ`.

  Returns:
    The absolute directory, or None when the cache is off.
  """
  environ = os.environ if environ is None else environ
  if cache_dir is None:
    cache_dir = environ.get(CACHE_DIR_ENV, default_cache_dir(environ))
  if not cache_dir:
    return None
  return os.path.abspath(os.path.expanduser(cache_dir))


def enable(cache_dir: str | None = None) -> str | None:
  """Turns JAX's persistent compilation cache on, once per process.

  The first call settles the directory for the process (JAX reads it when
  it first compiles with a cache); later calls with no argument or the same
  one return it again and change nothing. If JAX already has a
  ``jax_compilation_cache_dir`` (the user's own), that is kept and nothing
  is set. Otherwise this sets ``jax_compilation_cache_dir`` and lowers
  ``jax_persistent_cache_min_compile_time_secs`` and
  ``jax_persistent_cache_min_entry_size_bytes`` so that small, quick
  programs are cached too.

  Args:
    cache_dir: the directory; "" to keep the cache off; None for
      ``$PAGED_JAX_CACHE_DIR`` or the per-user default (see the module's
      docstring).

  Returns:
    The directory JAX caches in, or None when the cache is off.

  Raises:
    ValueError: if `cache_dir` names a different choice than the one an
      earlier call settled.
  """
  global _settled
  if _settled is not _UNSET:
    wanted = _settled if cache_dir is None else resolve_cache_dir(cache_dir)
    if wanted != _settled:
      raise ValueError(
        f"the compilation cache is already settled ({_settled or 'off'}); "
        f"enable({cache_dir!r}) must come before the first engine is built"
      )
    return _settled
  users_dir = jax.config.jax_compilation_cache_dir
  if users_dir:
    _settled = users_dir
    return _settled
  _settled = resolve_cache_dir(cache_dir)
  if _settled is not None:
    jax.config.update("jax_compilation_cache_dir", _settled)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", MIN_ENTRY_SIZE_BYTES)
  return _settled
