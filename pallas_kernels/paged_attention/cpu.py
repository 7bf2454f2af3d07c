"""Paged decode and prefill attention on CPU as C++ kernels called through `jax.ffi`.

XLA:CPU runs the XLA implementations' page gathers slowly, and the chunked
prefill path computes every tile of a bucket over whole chunks of keys,
padding included; these kernels read each token's keys and values page by
page through its block table, in place, only as far as the token sees
(prefill tokens in blocks of 16 that share each key and value read), and
share the work items (a decode row or a block of prefill tokens, and a KV
head) between the calling thread and XLA's intra-op thread pool
(`cpu_attention.cc`).

`pallas_kernels.cpu_build` builds it at first use with the system C++
compiler and caches the library; `unavailable_reason` says why the kernel
cannot run (no compiler, a failed build); `paged_jax.kernel_choice` then runs
the XLA implementation, having logged the reason once.

It serves float32 and bfloat16 queries and pages of one dtype, any GQA group,
``sm_scale``, ``soft_cap`` and ``sliding_window``; not quantized pages.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_build
from pallas_kernels.cpu_build import find_compiler
from pallas_kernels.paged_attention import common

TARGET = "paged_jax_paged_decode_attention_cpu"
PREFILL_TARGET = "paged_jax_paged_prefill_attention_cpu"
LIBRARY = cpu_build.Library(
  Path(__file__).with_name("cpu_attention.cc"),
  ((TARGET, "PagedDecodeAttentionCpu"), (PREFILL_TARGET, "PagedPrefillAttentionCpu")),
)
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_NAME = "paged_attention_cpu"
_PREFILL_NAME = "paged_prefill_attention_cpu"
__all__ = [
  "find_compiler",
  "paged_attention",
  "paged_prefill_attention",
  "refusal",
  "unavailable_reason",
]


def unavailable_reason() -> str | None:
  """Why the kernel cannot run here; None once it is built and registered."""
  return LIBRARY.unavailable_reason()


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
  _check_servable(_NAME, q, k_pages, k_scales)
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
  return call(
    q,
    *map(_as_stored, (k_pages, v_pages)),
    jnp.asarray(block_tables, jnp.int32),
    jnp.asarray(lengths, jnp.int32),
    **_attributes(q, sm_scale, soft_cap, sliding_window),
  )


def paged_prefill_attention(
  q,
  k_pages,
  v_pages,
  block_tables,
  lengths,
  query_lens,
  *,
  sm_scale: float | None = None,
  soft_cap: float | None = None,
  sliding_window: int | None = None,
  k_scales=None,
  v_scales=None,
):
  """Causal attention of new tokens to their paged context, as
  `reference.paged_prefill_attention_reference` (same arguments and
  result), by the C++ kernel: a token's keys are read only up to its own
  position, and padding tokens (from ``query_lens``) cost nothing.

  Raises:
    ValueError, RuntimeError: as `paged_attention`.
  """
  common.check_attention_args(
    q,
    k_pages,
    v_pages,
    block_tables,
    lengths,
    query_rank=4,
    k_scales=k_scales,
    v_scales=v_scales,
    kernel=_PREFILL_NAME,
  )
  common.check_attention_options(sm_scale, soft_cap, sliding_window)
  common.check_query_lens(query_lens, lengths, kernel=_PREFILL_NAME)
  _check_servable(_PREFILL_NAME, q, k_pages, k_scales)
  call = jax.ffi.ffi_call(
    PREFILL_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential"
  )
  return call(
    q,
    *map(_as_stored, (k_pages, v_pages)),
    jnp.asarray(block_tables, jnp.int32),
    jnp.asarray(lengths, jnp.int32),
    jnp.asarray(query_lens, jnp.int32),
    **_attributes(q, sm_scale, soft_cap, sliding_window),
  )


def _check_servable(name: str, q, k_pages, k_scales) -> None:
  """Raises what `paged_attention` documents when the kernel cannot serve the call."""
  reason = refusal(q.dtype, k_pages.dtype, k_scales is not None)
  if reason:
    raise ValueError(f"{name}: {reason}")
  reason = unavailable_reason()
  if reason:
    raise RuntimeError(f"{name}: {reason}")


def _attributes(q, sm_scale, soft_cap, sliding_window) -> dict:
  """The kernels' FFI attributes."""
  return dict(
    scale=np.float32(common.default_sm_scale(q.shape[-1], sm_scale)),
    soft_cap=np.float32(soft_cap or 0.0),
    sliding_window=np.int64(sliding_window or 0),
  )
