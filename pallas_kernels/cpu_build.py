"""C++ kernels for XLA:CPU, built at first use and called through `jax.ffi`.

A `Library` is one C++ source of XLA FFI handlers (it may include the
shared `cpu_simd.h`, next to this module). The first call to
`Library.unavailable_reason` in a process builds it with the system C++
compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``; a few seconds) and
registers its handlers as FFI targets of the CPU platform. The library is
kept in a cache directory (``$PAGED_JAX_KERNEL_DIR``, else
``$XDG_CACHE_HOME/paged_jax/kernels`` or ``~/.cache/paged_jax/kernels``; one
per machine, shared by its processes) under a name keyed by the sources,
the jaxlib version (its FFI header), the compiler and the CPU's instruction
sets; concurrent processes (test workers) wait on a file lock for one build.
Nothing is downloaded. Where no compiler exists or the build fails,
`unavailable_reason` says so, and `paged_jax.kernel_choice` runs XLA instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

INCLUDE_DIR = Path(__file__).parent
HEADERS = (INCLUDE_DIR / "cpu_simd.h",)
FLAGS = (
  "-O3",
  "-march=native",
  "-ffp-contract=fast",
  "-fopenmp-simd",
  "-std=c++17",
  "-shared",
  "-fPIC",
)


def cache_dir() -> Path:
  """Where built libraries are kept."""
  if os.environ.get("PAGED_JAX_KERNEL_DIR"):
    return Path(os.environ["PAGED_JAX_KERNEL_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "paged_jax" / "kernels"


def find_compiler() -> str | None:
  """The C++ compiler to build with: ``$CXX``, else the first on PATH."""
  if os.environ.get("CXX"):
    return shutil.which(os.environ["CXX"])
  return next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)


def _cpu_features() -> str:
  """The CPU's instruction-set flags (``-march=native`` builds for them)."""
  with contextlib.suppress(OSError):
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  return platform.processor()


@functools.cache
def _compiler_version(compiler: str) -> str:
  return subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout


@contextlib.contextmanager
def _locked(path: Path):
  """An exclusive lock on `path` (where fcntl exists), so that one process builds."""
  try:
    import fcntl
  except ImportError:
    yield
    return
  with open(path, "w") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


_REGISTER_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Library:
  """A C++ source of XLA FFI handlers, built and registered at first use.

  Attributes:
    source: the ``.cc`` file.
    targets: ``(FFI target name, exported handler symbol)`` pairs.
  """

  source: Path
  targets: tuple[tuple[str, str], ...]

  def build_key(self, compiler: str) -> str:
    """A hash of what the built library depends on."""
    parts = tuple(path.read_bytes().hex() for path in (self.source, *HEADERS))
    parts += (jaxlib.__version__, _compiler_version(compiler), " ".join(FLAGS))
    parts += (platform.machine(), _cpu_features())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]

  def build(self, compiler: str) -> Path:
    """The shared library, compiled unless the cache holds it.

    Raises:
      RuntimeError: when the compiler fails (its output in the message).
    """
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    stem = self.source.stem
    library = directory / f"{stem}_{self.build_key(compiler)}.so"
    with _locked(directory / f"{stem}.lock"):
      if library.exists():
        return library
      with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / library.name
        includes = ("-I", jax.ffi.include_dir(), "-I", str(INCLUDE_DIR))
        command = [compiler, *FLAGS, *includes, str(self.source), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
          raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, library)
    return library

  def load(self) -> tuple[ctypes.CDLL | None, str | None]:
    """The built library, or None and why it cannot be built or loaded."""
    compiler = find_compiler()
    if compiler is None:
      wanted = os.environ.get("CXX") or "c++, g++ or clang++"
      return None, f"no C++ compiler found ({wanted})"
    try:
      return ctypes.cdll.LoadLibrary(str(self.build(compiler))), None
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
      return None, f"building it failed: {error}"

  def unavailable_reason(self) -> str | None:
    """Why the kernels cannot run here; None once they are built and
    registered (the first call builds them, once per process)."""
    with _REGISTER_LOCK:
      return _register(self)[1]

  def function(self, symbol: str):
    """A plain C function the library exports, through ctypes (after
    `unavailable_reason` says None)."""
    with _REGISTER_LOCK:
      return getattr(_register(self)[0], symbol)


@functools.cache
def _register(library: Library) -> tuple[ctypes.CDLL | None, str | None]:
  loaded, reason = library.load()
  if loaded is not None:
    for target, symbol in library.targets:
      jax.ffi.register_ffi_target(
        target, jax.ffi.pycapsule(getattr(loaded, symbol)), platform="cpu"
      )
  return loaded, reason
