"""Paged decode attention on CPU as a C++ kernel called through `jax.ffi`.

XLA:CPU runs the XLA implementations' page gathers slowly; this kernel reads
each sequence's keys and values page by page through its block table, in
place, and shares the (sequence, KV head) pairs between the calling thread
and XLA's intra-op thread pool (`cpu_decode.cc`).

The package builds it at first use with the system C++ compiler (``$CXX``,
else ``c++``, ``g++`` or ``clang++``), which takes a few seconds, and keeps the
library in a cache directory (``$PAGED_JAX_KERNEL_DIR``, else
``$XDG_CACHE_HOME/paged_jax/kernels`` or ``~/.cache/paged_jax/kernels``; one
per machine, shared by its processes) under a name keyed by
the source, the jaxlib version (its FFI header), the compiler and the CPU's
instruction sets; concurrent processes (test workers) wait on a file lock for
one build. Nothing is downloaded. `unavailable_reason` says why the kernel
cannot run (no compiler, a failed build); `paged_jax.kernel_choice` then runs
the XLA implementation, having logged the reason once.

It serves float32 and bfloat16 queries and pages of one dtype, any GQA group,
``sm_scale``, ``soft_cap`` and ``sliding_window``; not quantized pages.
"""

from __future__ import annotations

import contextlib
import ctypes
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
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels.paged_attention import common

SOURCE = Path(__file__).with_name("cpu_decode.cc")
TARGET = "paged_jax_paged_decode_attention_cpu"
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
_NAME = "paged_attention_cpu"


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
def _build_key(compiler: str) -> str:
  version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
  parts = (SOURCE.read_bytes().hex(), jaxlib.__version__, version, " ".join(_FLAGS))
  parts += (platform.machine(), _cpu_features())
  return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def build(compiler: str) -> Path:
  """The kernel's shared library, compiled unless the cache holds it.

  Raises:
    RuntimeError: when the compiler fails (its output in the message).
  """
  directory = cache_dir()
  directory.mkdir(parents=True, exist_ok=True)
  library = directory / f"cpu_decode_{_build_key(compiler)}.so"
  with _locked(directory / "cpu_decode.lock"):
    if library.exists():
      return library
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
      built = Path(scratch) / library.name
      command = [compiler, *_FLAGS, "-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(built)]
      result = subprocess.run(command, capture_output=True, text=True)
      if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
      os.replace(built, library)
  return library


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


def load_library() -> tuple[ctypes.CDLL | None, str | None]:
  """The built kernel library, or None and why it cannot be built or loaded."""
  compiler = find_compiler()
  if compiler is None:
    wanted = os.environ.get("CXX") or "c++, g++ or clang++"
    return None, f"no C++ compiler found ({wanted})"
  try:
    return ctypes.cdll.LoadLibrary(str(build(compiler))), None
  except (OSError, RuntimeError, subprocess.SubprocessError) as error:
    return None, f"building it failed: {error}"


_REGISTER_LOCK = threading.Lock()


def unavailable_reason() -> str | None:
  """Why the kernel cannot run here; None once it is built and registered
  (the first call builds it, once per process)."""
  with _REGISTER_LOCK:
    return _register()


@functools.cache
def _register() -> str | None:
  library, reason = load_library()
  if library is not None:
    jax.ffi.register_ffi_target(
      TARGET, jax.ffi.pycapsule(library.PagedDecodeAttentionCpu), platform="cpu"
    )
  return reason


def refusal(dtype, kv_dtype, quantized: bool) -> str | None:
  """Why the kernel cannot serve queries of `dtype` on pages of `kv_dtype`; None if it can."""
  if quantized:
    return "it takes no quantized pages"
  if jnp.dtype(dtype) not in DTYPES or jnp.dtype(kv_dtype) != jnp.dtype(dtype):
    return (
      f"it serves float32 or bfloat16 queries and pages of one dtype, not "
      f"{jnp.dtype(dtype).name} on {jnp.dtype(kv_dtype).name}"
    )
  return None


def _as_stored(pages):
  """bfloat16 pages as their bits, as the CPU cache stores them (`KVCache.
  bits_of`): XLA then drops the bits-to-bfloat16 conversion of
  `KVCache.pages`, which it would otherwise run as a copy of the layer's
  pages per call."""
  if pages.dtype != jnp.bfloat16:
    return pages
  return jax.lax.bitcast_convert_type(pages, jnp.uint16)


def paged_attention(
  q,
  k_pages,
  v_pages,
  block_tables,
  lengths,
  *,
  sm_scale: float | None = None,
  soft_cap: float | None = None,
  sliding_window: int | None = None,
  k_scales=None,
  v_scales=None,
):
  """Decode attention, as `reference.paged_attention_reference` (same
  arguments and result), by the C++ kernel.

  Raises:
    ValueError: for quantized pages, a dtype other than float32 or
      bfloat16, or pages of another dtype than ``q``; RuntimeError when the
      kernel cannot be built here (the reason in the message).
  """
  common.check_attention_args(
    q, k_pages, v_pages, block_tables, lengths, k_scales=k_scales, v_scales=v_scales, kernel=_NAME
  )
  common.check_attention_options(sm_scale, soft_cap, sliding_window)
  reason = refusal(q.dtype, k_pages.dtype, k_scales is not None)
  if reason:
    raise ValueError(f"{_NAME}: {reason}")
  reason = unavailable_reason()
  if reason:
    raise RuntimeError(f"{_NAME}: {reason}")
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
  return call(
    q,
    *map(_as_stored, (k_pages, v_pages)),
    jnp.asarray(block_tables, jnp.int32),
    jnp.asarray(lengths, jnp.int32),
    scale=np.float32(common.default_sm_scale(q.shape[-1], sm_scale)),
    soft_cap=np.float32(soft_cap or 0.0),
    sliding_window=np.int64(sliding_window or 0),
  )
