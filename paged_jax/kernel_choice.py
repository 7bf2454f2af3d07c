"""Kernel choice: which implementation each paged op runs, in one place.

``impl`` chooses the implementation of the paged attention ops
(`paged_jax.attention`) and of the KV cache's ops (`paged_jax.kv_cache`:
`write_kv`, `copy_blocks`):

* ``"auto"``: the Mosaic kernel on TPU; on CUDA GPUs of compute capability
  9.0 and newer (Hopper, Blackwell) the Mosaic GPU kernel when this JAX has
  Mosaic GPU and it serves the page dtype and tiles, else the Pallas (Triton)
  kernel while this JAX ships it and its tiles fit (power-of-two block size
  and head_dim), as on older and ROCm GPUs. On CPU, attention runs the C++
  kernels (`pallas_kernels.paged_attention.cpu`, called through `jax.ffi`,
  built at first use): prefill for float32 and bfloat16 pages, decode for
  bfloat16 ones (float32 ones only with ``impl="cpu"``: a float32 decode
  step measured slower with it), unless no compiler builds them, the pages
  are quantized, or `use_cpu_kernel(False)` (or ``PAGED_JAX_CPU_KERNEL=0``)
  turns them off; everything else there runs the chunked XLA
  implementation, which reads only the table chunks the longest context
  reaches. On a GPU, and on CPU, the choice and its reason
  are logged once (logger ``paged_jax``).
* ``"pallas"``: the backend's kernel (the one ``"auto"`` prefers); on CPU the
  Triton kernel in interpret mode.
* ``"mosaic_gpu"``, ``"triton"``: that GPU kernel (decode attention only);
  on CPU in its interpret mode.
* ``"cpu"``: the C++ kernel (decode and prefill attention; CPU backend only).
* ``"reference"``: the XLA reference.

`select_attention_kernel`, `select_prefill_kernel` and `select_kernel`
resolve ``impl`` for the decode attention, prefill attention and the KV
cache's ops on the kernel platform (`kernel_platform`, or `target_platform`'s
inside it); `select_quantized_matmul` picks the product of weights kept
quantized (Mosaic on TPU, Triton on a GPU, C++ on CPU for a few rows, XLA
otherwise); `cpu_row_product` says whether a few bfloat16 rows times
a bfloat16 weight run the C++ kernel; `check_block_size` refuses a block
size no kernel serves; `describe_kernels` names what ``"auto"`` runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os

import jax
import jax.numpy as jnp

from pallas_kernels import quantized_matmul, row_product
from pallas_kernels.paged_attention import cpu, gpu, mosaic_gpu, tpu_prefill
from pallas_kernels.quantized_matmul import cpu as quantized_cpu

logger = logging.getLogger("paged_jax")

IMPLS = ("auto", "pallas", "reference")
ATTENTION_IMPLS = IMPLS + ("mosaic_gpu", "triton", "cpu")
PREFILL_IMPLS = IMPLS + ("cpu",)
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")
_TARGET_PLATFORM = contextvars.ContextVar("target_platform", default=None)
CPU_KERNELS = ("attention", "quantized_matmul", "row_product")
# The most rows (a decode step's sequences) that `layers.dot_transposed`
# gives the C++ row product; XLA's matmul takes more.
ROW_PRODUCT_MAX_ROWS = 32
_CPU_KERNEL = contextvars.ContextVar("cpu_kernel", default=())  # ((kernel, enabled), ...)
# Dtypes the C++ kernel serves but "auto" does not give it, and why.
_CPU_AUTO_REFUSALS = {
  "float32": "a float32 SmolLM2 decode step measured slower with it (benchmarks/RESULTS.md)"
}


@contextlib.contextmanager
def target_platform(platform: str):
  """Kernels traced inside choose those of `platform` (e.g. ``"tpu"``) instead
  of the default backend's: ahead-of-time compiles for devices this host lacks."""
  token = _TARGET_PLATFORM.set(platform)
  try:
    yield
  finally:
    _TARGET_PLATFORM.reset(token)


@contextlib.contextmanager
def use_cpu_kernel(enabled: bool, kernel: str | None = None):
  """Whether the C++ kernels run on CPU for what is traced inside: `kernel`
  one of ``CPU_KERNELS`` (the decode attention kernel, for ``impl="auto"``;
  the quantized product; the bfloat16 one-row product), or None for all
  (default: on unless ``PAGED_JAX_CPU_KERNEL=0``). Programs already
  compiled keep the choice they were traced with.

  Raises:
    ValueError: for another `kernel`.
  """
  if kernel is not None and kernel not in CPU_KERNELS:
    raise ValueError(f"kernel must be one of {CPU_KERNELS} or None, got {kernel!r}")
  names = CPU_KERNELS if kernel is None else (kernel,)
  settings = {**dict(_CPU_KERNEL.get()), **dict.fromkeys(names, enabled)}
  token = _CPU_KERNEL.set(tuple(settings.items()))
  try:
    yield
  finally:
    _CPU_KERNEL.reset(token)


def cpu_kernel_enabled(kernel: str = "attention") -> bool:
  """`use_cpu_kernel`'s setting for `kernel`, else ``PAGED_JAX_CPU_KERNEL``
  (on unless ``0``)."""
  enabled = dict(_CPU_KERNEL.get()).get(kernel)
  if enabled is None:
    return os.environ.get("PAGED_JAX_CPU_KERNEL", "1") != "0"
  return enabled


def kernel_platform() -> str:
  """The platform kernels are chosen for: `target_platform`'s, else the default backend."""
  return _TARGET_PLATFORM.get() or jax.default_backend()


def select_prefill_kernel(
  impl: str,
  *,
  dtype,
  num_queries: int,
  group: int,
  block_size: int,
  head_dim: int,
  kv_dtype=None,
  quantized: bool = False,
):
  """Resolves ``impl`` of ``paged_prefill_attention`` for the kernel platform.

  Args:
    impl: one of ``PREFILL_IMPLS``.
    dtype: dtype of the queries.
    num_queries: query tokens per sequence (a tile's width).
    group: query heads per KV head.
    block_size: tokens per page.
    head_dim: size of a head.
    kv_dtype: dtype of the pages; None for ``dtype``.
    quantized: whether the pages come with scales (int8 / fp8).

  Returns:
    None for XLA (the reference, or the chunked implementation), else
    ``("tpu", interpret)`` or ``("cpu", False)``. On TPU and CPU, ``"auto"``
    logs its choice once, and why not the kernel when it cannot serve the
    call. On CPU it runs the C++ kernel for float32 and bfloat16 pages (both
    measured faster than the chunked path, unlike decode's float32) unless
    it is switched off (`use_cpu_kernel`) or cannot be built.

  Raises:
    ValueError: for an unknown ``impl``, or ``"cpu"`` off the CPU backend.
  """
  if impl not in PREFILL_IMPLS:
    raise ValueError(f"impl must be one of {PREFILL_IMPLS}, got {impl!r}")
  platform = kernel_platform()
  if impl == "reference":
    return None
  if impl == "pallas":
    return "tpu", platform != "tpu"
  if impl == "cpu":
    if platform != "cpu":
      raise ValueError(f"impl='cpu' (the C++ kernel) runs on the cpu backend only, not {platform}")
    return "cpu", False
  if platform == "cpu":
    return _cpu_prefill_kernel(dtype, kv_dtype or dtype, quantized)
  if platform != "tpu":
    return None
  reason = tpu_prefill.refusal(dtype, num_queries, group, block_size, head_dim, kv_dtype)
  choice = "Mosaic kernel" if reason is None else f"chunked XLA, because {reason}"
  _log_once(
    f"prefill attention on tpu ({jnp.dtype(dtype).name}, {num_queries} queries x {group} "
    f"heads per KV head, block_size {block_size}, head_dim {head_dim}): {choice}"
  )
  return None if reason else ("tpu", False)


def _cpu_prefill_kernel(dtype, kv_dtype, quantized: bool) -> tuple[str, bool] | None:
  """``"auto"``'s prefill choice on CPU, logged once."""
  if not cpu_kernel_enabled():
    return None
  reason = cpu.refusal(dtype, kv_dtype, quantized) or cpu.unavailable_reason()
  choice = "C++ kernel" if reason is None else f"chunked XLA (C++ kernel: {reason})"
  _log_once(f"prefill attention on cpu ({jnp.dtype(dtype).name}): {choice}")
  return None if reason else ("cpu", False)


def select_kernel(impl: str, *, tile_sizes: tuple[int, ...] = ()):
  """Resolves ``impl`` for the kernel platform (`kernel_platform`).

  Args:
    impl: ``"auto"``, ``"pallas"`` or ``"reference"``.
    tile_sizes: sizes the GPU kernels tile by; ``"auto"`` uses the XLA
      reference on a GPU unless all are powers of two.

  Returns:
    None for the XLA reference, else ``(backend, interpret)`` with backend
    ``"gpu"`` or ``"tpu"``.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  platform = kernel_platform()
  if impl == "reference":
    return None
  if platform == "tpu":
    return "tpu", False
  if platform in _GPU_PLATFORMS:
    if impl == "auto" and not all(_is_power_of_two(n) for n in tile_sizes):
      return None
    return "gpu", False
  return None if impl == "auto" else ("gpu", True)


def select_attention_kernel(
  impl: str,
  *,
  dtype,
  block_size: int,
  head_dim: int,
  group: int,
  quantized: bool = False,
  kv_dtype=None,
):
  """Resolves ``impl`` of ``paged_attention`` for the kernel platform (`kernel_platform`).

  Args:
    impl: one of ``ATTENTION_IMPLS``.
    dtype: dtype of the queries.
    block_size: tokens per page.
    head_dim: size of a head.
    group: query heads per KV head.
    quantized: whether the pages are int8 / fp8 with scales, which the Mosaic
      GPU kernel does not serve (``"auto"`` then takes the Triton kernel).
    kv_dtype: dtype of the pages; None for ``dtype``.

  Returns:
    None for XLA (the reference, or the chunked implementation), else
    ``(kernel, interpret)`` with kernel ``"tpu"``, ``"mosaic_gpu"``,
    ``"triton"`` or ``"cpu"``.

  Raises:
    ValueError: for an unknown ``impl``, or ``"cpu"`` off the CPU backend.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  platform = kernel_platform()
  on_gpu = platform in _GPU_PLATFORMS
  if impl in ("mosaic_gpu", "triton"):
    return impl, not on_gpu
  if impl == "reference":
    return None
  if impl == "cpu":
    if platform != "cpu":
      raise ValueError(f"impl='cpu' (the C++ kernel) runs on the cpu backend only, not {platform}")
    return "cpu", False
  if platform == "tpu":
    return "tpu", False
  if not on_gpu:
    if impl != "auto":
      return "triton", True
    if platform != "cpu" or not cpu_kernel_enabled():
      return None
    reason = (
      cpu.refusal(dtype, kv_dtype or dtype, quantized)
      or _CPU_AUTO_REFUSALS.get(jnp.dtype(dtype).name)
      or cpu.unavailable_reason()
    )
    choice = "C++ kernel" if reason is None else f"chunked XLA (C++ kernel: {reason})"
    _log_once(f"paged attention on cpu ({jnp.dtype(dtype).name}): {choice}")
    return None if reason else ("cpu", False)
  capability = gpu_compute_capability()
  kernel, reason = gpu_kernel_choice(
    impl == "auto", capability, dtype, block_size, head_dim, group, quantized
  )
  names = {"mosaic_gpu": "Mosaic GPU kernel", "triton": "Triton kernel", None: "chunked XLA"}
  choice = names[kernel] + (f", because {reason}" if reason else "")
  sm = f"sm{round(capability * 10)}"
  _log_once(f"paged attention on {platform} ({sm}, {jnp.dtype(dtype).name}): {choice}")
  return None if kernel is None else (kernel, False)


def gpu_kernel_choice(
  auto: bool, capability: float, dtype, block_size: int, head_dim: int, group: int, quantized: bool
) -> tuple[str | None, str | None]:
  """The decode kernel for a GPU, and why not a kernel it prefers.

  Mosaic GPU where this JAX has it and the GPU (sm90+: TMA and wgmma), page
  dtype and shapes can be served; else Triton while this JAX ships it (for
  ``auto`` only on power-of-two tiles); else the chunked XLA path (None).

  Args:
    auto: whether ``impl`` is ``"auto"`` (else ``"pallas"``).
    capability: the GPU's compute capability (9.0 for Hopper).
    dtype: dtype of the queries and pages.
    block_size: tokens per page.
    head_dim: size of a head.
    group: query heads per KV head.
    quantized: whether the pages are int8 / fp8 with scales.

  Returns:
    ``(kernel, reason)``: kernel ``"mosaic_gpu"``, ``"triton"`` or None; the
    reason is None for Mosaic GPU.
  """
  reason = mosaic_gpu_refusal(capability, dtype, block_size, head_dim, group, quantized)
  if reason is None:
    return "mosaic_gpu", None
  if gpu.pltriton is None:
    return None, f"{reason} and this JAX ships no Pallas Triton"
  if auto and not all(_is_power_of_two(n) for n in (block_size, head_dim)):
    return None, f"{reason} and Triton tiles powers of two only"
  return "triton", reason


def select_quantized_matmul(
  *,
  out_features: int,
  in_features: int,
  bits: int,
  group_size: int,
  dtype,
  rows: int = 1,
  split: bool = False,
) -> tuple[str, bool] | None:
  """The product `x @ dequant(w).T` of a quantized kernel on the kernel platform.

  On TPU the Mosaic kernel and on a GPU the Triton kernel
  (`pallas_kernels.quantized_matmul`), which dequantize tile by tile on
  chip, where XLA:TPU writes a grouped kernel's float copy to HBM first;
  but per-channel int8, whose integers XLA feeds its matmul directly
  (scales applied after), and shapes or dtypes a kernel does not tile stay
  on XLA. On CPU, up to `quantized_matmul.cpu.MAX_ROWS` rows of `x` run the
  C++ kernel (`pallas_kernels.quantized_matmul.cpu`, built at first use)
  unless no compiler builds it, the weights are split over devices, or
  `use_cpu_kernel(False)` (``PAGED_JAX_CPU_KERNEL=0``, which turns off the
  decode attention kernel too) turns it off; more rows stay on XLA, whose
  product writes the float kernel once. The choice and its reason are
  logged once per kernel shape (on CPU once per dtype; logger ``paged_jax``).

  Args:
    out_features: the kernel's rows.
    in_features: the kernel's inputs.
    bits: 8 or 4.
    group_size: inputs per scale (`in_features` for per-channel int8).
    dtype: the compute dtype of `x`.
    rows: rows of `x` (the CPU kernel takes a few).
    split: whether the weights are split over devices.

  Returns:
    None for XLA, else ``("tpu", False)``, ``("gpu", False)`` or ``("cpu", False)``.
  """
  platform = kernel_platform()
  if platform == "cpu":
    return _cpu_quantized_matmul(dtype, rows, split)
  if platform != "tpu" and platform not in _GPU_PLATFORMS:
    return None
  kernel, name = ("tpu", "Mosaic kernel") if platform == "tpu" else ("gpu", "Triton kernel")
  if bits == 8 and group_size == in_features:
    reason = "XLA fuses per-channel int8 into its matmul"
  elif kernel == "tpu":
    reason = quantized_matmul.refusal(
      1, out_features, in_features, bits=bits, group_size=group_size, dtype=dtype
    )
  else:
    reason = quantized_matmul.gpu.refusal(
      1, out_features, in_features, bits=bits, group_size=group_size, dtype=dtype
    )
  choice = name if reason is None else f"XLA, because {reason}"
  _log_once(
    f"quantized matmul on {platform} ({bits}-bit, groups of {group_size}, "
    f"[{out_features}, {in_features}], {jnp.dtype(dtype).name}): {choice}"
  )
  return None if reason else (kernel, False)


def _cpu_quantized_matmul(dtype, rows: int, split: bool) -> tuple[str, bool] | None:
  """The CPU choice of `select_quantized_matmul`."""
  if rows > quantized_cpu.MAX_ROWS or split or not cpu_kernel_enabled("quantized_matmul"):
    return None
  reason = quantized_cpu.refusal(rows, dtype) or quantized_cpu.unavailable_reason()
  choice = "C++ kernel" if reason is None else f"XLA (C++ kernel: {reason})"
  _log_once(
    f"quantized matmul on cpu ({jnp.dtype(dtype).name}, up to "
    f"{quantized_cpu.MAX_ROWS} rows): {choice}"
  )
  return None if reason else ("cpu", False)


def cpu_row_product() -> bool:
  """Whether a few bfloat16 rows (up to `ROW_PRODUCT_MAX_ROWS`) times a
  bfloat16 weight run the C++ kernel
  (`pallas_kernels.row_product`, built at first use): on CPU unless no
  compiler builds it or `use_cpu_kernel(False)` turns it off. Weights split
  over host devices (tensor parallel on CPU) are gathered for it: GSPMD
  replicates a custom call's operands; turn it off there. The choice is
  logged once."""
  if kernel_platform() != "cpu" or not cpu_kernel_enabled("row_product"):
    return False
  reason = row_product.unavailable_reason()
  _log_once(
    "bfloat16 products of a few rows on cpu: "
    + ("C++ kernel" if reason is None else f"XLA (C++ kernel: {reason})")
  )
  return reason is None


def mosaic_gpu_refusal(
  capability: float, dtype, block_size: int, head_dim: int, group: int, quantized: bool
) -> str | None:
  """Why the Mosaic GPU kernel cannot serve this GPU, dtype and shapes; None if it can."""
  if capability < 9.0:
    return "Mosaic GPU kernel needs sm90+ (TMA and wgmma; JAX's Ampere mma needs another kernel)"
  if quantized:
    return "the Mosaic GPU kernel takes no quantized pages"
  return mosaic_gpu.refusal(dtype, block_size, head_dim, group)


@functools.cache
def _log_once(message: str) -> None:
  logger.info(message)


def kernel_block_sizes(platform: str) -> dict[str, str]:
  """The block sizes each compiled attention kernel of `platform` serves."""
  if platform in _GPU_PLATFORMS:
    return {"triton": "powers of two", "mosaic_gpu": ", ".join(map(str, mosaic_gpu.BLOCK_SIZES))}
  if platform == "tpu":
    return {"tpu": "any"}
  return {"reference (XLA)": "any"}


def check_block_size(block_size: int, platform: str | None = None) -> None:
  """Refuses a block size that no attention kernel of `platform` serves.

  Args:
    block_size: tokens per page.
    platform: a JAX backend name; None for the default backend.

  Raises:
    ValueError: naming the block size and the sizes each kernel serves (on a
      GPU, Triton needs a power of two and Mosaic GPU one of its sizes).
  """
  platform = platform or kernel_platform()
  if platform in _GPU_PLATFORMS and not _is_power_of_two(block_size):
    sizes = "; ".join(
      f"{kernel}: {served}" for kernel, served in kernel_block_sizes(platform).items()
    )
    raise ValueError(
      f"block_size {block_size} is served by no paged-attention kernel on {platform} ({sizes})"
    )


def gpu_compute_capability() -> float:
  """Compute capability of the first device (9.0 for Hopper), 0 if none."""
  capability = getattr(jax.devices()[0], "compute_capability", None)
  try:
    return float(capability)
  except (TypeError, ValueError):
    return 0.0


def is_concrete(*arrays) -> bool:
  """True when no argument is a tracer (called outside jit)."""
  return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def _is_power_of_two(size: int) -> bool:
  return size > 0 and not size & (size - 1)


def describe_kernels(
  *,
  dtype,
  block_size: int,
  head_dim: int,
  group: int,
  quantized: bool = False,
  num_queries: int = 32,
) -> str:
  """One line naming the default backend and what ``impl="auto"`` runs there.

  Takes ``select_attention_kernel``'s arguments, and ``num_queries`` (a
  prefill tile's width) for the prefill choice; e.g. ``"backend tpu: decode
  attention = Mosaic (Pallas TPU), prefill attention = Mosaic (Pallas TPU),
  write_kv = Mosaic (Pallas TPU), copy_blocks = Mosaic (Pallas TPU)"``.
  """
  names = {
    "tpu": "Mosaic (Pallas TPU)",
    "mosaic_gpu": "Mosaic GPU (Pallas)",
    "triton": "Triton (Pallas GPU)",
    "gpu": "Triton (Pallas GPU)",
    "cpu": "C++ (XLA FFI)",
  }
  name = lambda kernel, xla: xla if kernel is None else names[kernel[0]]
  decode = select_attention_kernel(
    "auto", dtype=dtype, block_size=block_size, head_dim=head_dim, group=group, quantized=quantized
  )
  prefill = select_prefill_kernel(
    "auto",
    dtype=dtype,
    num_queries=num_queries,
    group=group,
    block_size=block_size,
    head_dim=head_dim,
    kv_dtype=jnp.int8 if quantized else dtype,
    quantized=quantized,
  )
  write = select_kernel("auto", tile_sizes=(head_dim,))
  copy = select_kernel("auto", tile_sizes=(block_size, head_dim))
  platform = kernel_platform()
  backend = platform
  if platform in _GPU_PLATFORMS:
    backend += f" (compute capability {gpu_compute_capability():.1f})"
  line = (
    f"backend {backend}: decode attention = {name(decode, 'chunked XLA')}, "
    f"prefill attention = {name(prefill, 'chunked XLA')}, write_kv = {name(write, 'XLA')}, "
    f"copy_blocks = {name(copy, 'XLA')}"
  )
  if platform != "tpu" and platform not in _GPU_PLATFORMS:
    line += f"; the Pallas kernels run on {platform} only in interpret mode (impl='pallas')"
  return line
