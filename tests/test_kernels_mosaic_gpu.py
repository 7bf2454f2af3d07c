"""The Mosaic GPU paged-attention kernel against the XLA reference.

On CPU the kernel runs in Mosaic GPU interpret mode (simulated shared memory,
barriers and TMA); on a GPU it compiles, and the Triton kernel runs on the
same cases. Every case poisons the bytes no query may read with NaN, block 0
(which the kernel copies for -1 table entries) included. The kernel takes
bfloat16 and float16 pages; float32 gets a ValueError (Mosaic GPU's wgmma
transposes only 16-bit operands) and the Triton kernel in "auto".
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention, kernel_choice
from pallas_kernels.paged_attention import cpu, gpu, mosaic_gpu
from tests.abstract_gpu import lower_for
from tests.test_kernels_paged_attention import (
  OPTIONS,
  Case,
  as_jax,
  assert_close,
  make_inputs,
  reference_attention,
)

ON_GPU = jax.default_backend() == "gpu"

# Block sizes 16 (4 pages a step), 64 (one page) and 128 (half a page a
# step); head_dim 64, 128 and 256; groups of 2, 8 and 1; ragged lengths with
# 0 and the maximum; a hole in a table; every option. The kernel options give
# one split of 3 steps through 2 buffers (slots refilled), the default splits
# through paged_attention(impl="mosaic_gpu"), and 3 splits of 2 steps over 4
# steps (the last split empty).
CASES = [
  (
    Case(3, 4, 2, 64, 16, 9, "bfloat16", sm_scale=0.2, hole=True),
    dict(num_splits=1, num_buffers=2),
  ),
  (Case(2, 8, 1, 128, 64, 3, "float16", soft_cap=5.0, sliding_window=70), {}),
  (Case(2, 2, 2, 256, 128, 2, "bfloat16", soft_cap=3.0, sliding_window=100), dict(num_splits=3)),
]
MOSAIC = jax.jit(
  functools.partial(mosaic_gpu.paged_attention, interpret=not ON_GPU),
  static_argnames=OPTIONS + ("num_splits", "num_buffers"),
)
PUBLIC = jax.jit(attention.paged_attention, static_argnames=OPTIONS + ("impl",))


def case_id(param):
  case, kernel_options = param
  options = "-".join(f"{k}{v}" for k, v in kernel_options.items())
  return f"{case}-{options or 'public'}"


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def decode_case(request):
  """A case, kernel options, poisoned inputs, the reference on clean pages."""
  case, kernel_options = request.param
  q, clean, poisoned, tables, lengths = make_inputs(case, seed=1)
  clean, poisoned = clean[:2], poisoned[:2]  # float pages: no scales
  free = np.setdiff1d(np.arange(clean[0].shape[1]), tables)[0]
  swap = {0: free, free: 0}
  tables = np.vectorize(lambda e: swap.get(e, e))(tables).astype(np.int32)
  for pages in (*clean, *poisoned):
    pages[:, [0, free]] = pages[:, [free, 0]]
  assert np.isnan(poisoned[1][:, 0]).all()  # block 0 is free, so poisoned
  expected = reference_attention(*as_jax(q, *clean, tables, lengths), **case.options)
  return (case, kernel_options, as_jax(q, *poisoned, tables, lengths), expected)


def test_mosaic_kernel_matches_reference_on_poisoned_cache(decode_case):
  case, kernel_options, args, expected = decode_case
  if kernel_options:
    out = MOSAIC(*args, **case.options, **kernel_options)
  else:
    out = PUBLIC(*args, **case.options, impl="mosaic_gpu")
  assert out.shape == args[0].shape and out.dtype == args[0].dtype
  assert_close(out, expected, case.dtype)
  assert not np.asarray(out, np.float32)[np.asarray(args[4]) == 0].any()


@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernel needs a GPU")
def test_triton_kernel_matches_reference_on_gpu(decode_case):
  case, _, args, expected = decode_case
  out = jax.jit(gpu.paged_attention, static_argnames=OPTIONS)(*args, **case.options)
  assert_close(out, expected, case.dtype)


@pytest.mark.parametrize(
  "dtype,block_size,head_dim,num_buffers", [("bfloat16", 16, 128, 4), ("float16", 128, 256, None)]
)
def test_mosaic_kernel_lowers_for_cuda(dtype, block_size, head_dim, num_buffers):
  """The Mosaic GPU lowering (layouts, wgmma and TMA shapes) runs on CPU."""
  shape = jax.ShapeDtypeStruct
  pages = shape((8, 100, block_size, head_dim), dtype)
  run = jax.jit(
    functools.partial(
      mosaic_gpu.paged_attention, soft_cap=30.0, sliding_window=40, num_buffers=num_buffers
    )
  )
  lowered = lower_for(
    "cuda",
    run,
    shape((3, 32, head_dim), dtype),
    pages,
    pages,
    shape((3, 7), jnp.int32),
    shape((3,), jnp.int32),
  )
  assert "mosaic_gpu" in lowered.as_text()


def mosaic_args(**overrides):
  pages = jnp.ones((2, 10, 16, 64), jnp.bfloat16)
  args = dict(
    q=jnp.ones((2, 4, 64), jnp.bfloat16),
    k_pages=pages,
    v_pages=pages,
    block_tables=jnp.zeros((2, 3), jnp.int32),
    lengths=jnp.ones((2,), jnp.int32),
  )
  return {**args, **overrides}


def bf16_pages(*shape):
  return dict(k_pages=jnp.ones(shape, jnp.bfloat16), v_pages=jnp.ones(shape, jnp.bfloat16))


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (dict(q=jnp.ones((2, 4, 64))), "one dtype"),
    (bf16_pages(2, 10, 8, 64), "block_size must be one of"),
    (
      dict(q=jnp.ones((2, 4, 96), jnp.bfloat16), **bf16_pages(2, 10, 16, 96)),
      "head_dim must be a multiple of 64",
    ),
    (dict(q=jnp.ones((2, 130, 64), jnp.bfloat16)), "at most 64 query heads"),
    (dict(num_splits=0), "num_splits"),
    (dict(num_buffers=1), "num_buffers must be an int in 2..4"),
    (
      dict(k_scales=jnp.ones((2, 10, 16)), v_scales=jnp.ones((2, 10, 16))),
      "Mosaic GPU .* quantized",
    ),
    (
      dict(
        q=jnp.ones((2, 4, 64)), k_pages=jnp.ones((2, 10, 16, 64)), v_pages=jnp.ones((2, 10, 16, 64))
      ),
      "bfloat16 or float16 pages, got float32; use impl='triton'",
    ),
    (
      dict(q=jnp.ones((2, 2, 256), jnp.bfloat16), **bf16_pages(2, 4, 16, 256), num_buffers=4),
      "num_buffers=4 needs .* shared memory",
    ),
  ],
)
def test_mosaic_kernel_rejects_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    mosaic_gpu.paged_attention(**mosaic_args(**kwargs), interpret=True)


def select(impl, dtype=jnp.bfloat16, block_size=16, head_dim=128, group=4, quantized=False):
  return kernel_choice.select_attention_kernel(
    impl, dtype=dtype, block_size=block_size, head_dim=head_dim, group=group, quantized=quantized
  )


@pytest.mark.parametrize(
  "capability,shape,expected",
  [
    (9.0, {}, ("mosaic_gpu", False)),
    (10.0, {}, ("mosaic_gpu", False)),
    (8.0, {}, ("triton", False)),
    (9.0, dict(dtype=jnp.float32), ("triton", False)),
    (9.0, dict(head_dim=192), ("mosaic_gpu", False)),
    (8.0, dict(head_dim=192), None),
    (9.0, dict(block_size=8), ("triton", False)),
    (9.0, dict(quantized=True), ("triton", False)),
  ],
)
def test_auto_picks_mosaic_on_sm90_and_newer(monkeypatch, capability, shape, expected):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(kernel_choice, "gpu_compute_capability", lambda: capability)
  assert select("auto", **shape) == expected
  assert select("triton", **shape) == ("triton", False)
  assert select("mosaic_gpu", **shape) == ("mosaic_gpu", False)
  assert select("reference", **shape) is None


def test_forced_gpu_kernels_interpret_on_cpu():
  assert select("mosaic_gpu") == ("mosaic_gpu", True)
  assert select("triton") == ("triton", True)
  assert select("pallas") == ("triton", True)
  # "auto" on CPU: the C++ kernel for bfloat16 where it builds, else XLA.
  built = cpu.unavailable_reason() is None
  assert select("auto") == (("cpu", False) if built else None)
  with kernel_choice.use_cpu_kernel(False):
    assert select("auto") is None
  with pytest.raises(ValueError, match="impl must be one of"):
    select("cuda")


def test_paged_attention_runs_the_forced_triton_kernel():
  case = Case(2, 2, 1, 64, 16, 2, "bfloat16", soft_cap=4.0)
  q, clean, poisoned, tables, lengths = make_inputs(case, seed=2)
  clean, poisoned = clean[:2], poisoned[:2]  # float pages: no scales
  out = PUBLIC(*as_jax(q, *poisoned, tables, lengths), soft_cap=4.0, impl="triton")
  expected = reference_attention(*as_jax(q, *clean, tables, lengths), soft_cap=4.0)
  assert_close(out, expected, case.dtype)


def on_gpu(monkeypatch, capability):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(kernel_choice, "gpu_compute_capability", lambda: capability)
  kernel_choice._log_once.cache_clear()


@pytest.mark.parametrize(
  "capability,shape,expected",
  [
    (9.0, {}, "(sm90, bfloat16): Mosaic GPU kernel"),
    (8.0, {}, "(sm80, bfloat16): Triton kernel, because Mosaic GPU kernel needs sm90+"),
    (
      9.0,
      dict(dtype=jnp.float32),
      "(sm90, float32): Triton kernel, because the Mosaic GPU kernel "
      "takes bfloat16 or float16 pages, got float32",
    ),
    (9.0, dict(quantized=True), "Triton kernel, because the Mosaic GPU kernel takes no quantized"),
    (
      8.0,
      dict(head_dim=192),
      "chunked XLA, because Mosaic GPU kernel needs sm90+ (TMA and wgmma; "
      "JAX's Ampere mma needs another kernel) and Triton tiles powers of two only",
    ),
  ],
)
def test_the_choice_and_its_reason_are_logged_once(
  monkeypatch, caplog, capability, shape, expected
):
  on_gpu(monkeypatch, capability)
  caplog.set_level(logging.INFO, logger="paged_jax")
  for _ in range(3):
    select("auto", **shape)
  assert [r.name for r in caplog.records] == ["paged_jax"]
  assert caplog.records[0].getMessage().startswith("paged attention on gpu (")
  assert expected in caplog.records[0].getMessage()


def test_jax_without_pallas_triton_takes_the_chunked_path(monkeypatch, caplog):
  on_gpu(monkeypatch, 8.0)
  monkeypatch.setattr(gpu, "pltriton", None)
  caplog.set_level(logging.INFO, logger="paged_jax")
  assert select("auto") is None
  assert select("pallas") is None
  assert select("auto", quantized=True) is None
  assert select("auto", block_size=64) is None
  assert "chunked XLA" in caplog.text and "this JAX ships no Pallas Triton" in caplog.text
  assert select("mosaic_gpu") == ("mosaic_gpu", False)
  with pytest.raises(NotImplementedError, match="needs a JAX with"):
    gpu.paged_attention(**mosaic_args(), interpret=True)


def test_jax_without_mosaic_gpu_falls_back_to_triton(monkeypatch):
  monkeypatch.setattr(mosaic_gpu, "plgpu", None)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(kernel_choice, "gpu_compute_capability", lambda: 9.0)
  assert select("auto") == ("triton", False)
  with pytest.raises(NotImplementedError, match="needs a JAX with"):
    mosaic_gpu.paged_attention(**mosaic_args())
