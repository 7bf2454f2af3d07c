"""The C++ paged decode and prefill attention of the CPU backend
(`pallas_kernels/paged_attention/cpu.py`) against the XLA reference and a
float64 model, their build, and the choice that runs them
(`paged_jax.kernel_choice`).

Every case poisons the bytes no query may read with NaN, as in
tests/test_kernels_paged_attention.py, whose inputs these reuse. The
kernel's output buffer comes uninitialized from XLA, so each element it
failed to write (rows of length 0 included, which must be zeros) would show
as a mismatch.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention, kernel_choice
from pallas_kernels import cpu_build
from pallas_kernels.paged_attention import cpu
from tests.test_kernels_paged_attention import (
  Case,
  assert_close,
  attend,
  check_nan_read_inside_the_context_propagates,
  dense_attention,
  good_args,
  make_inputs,
  reference_attention,
)

pytestmark = pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="the C++ kernel runs on the CPU backend"
)
OPTIONS = ("sm_scale", "soft_cap", "sliding_window")
kernel = jax.jit(cpu.paged_attention, static_argnames=OPTIONS)
prefill_kernel = jax.jit(cpu.paged_prefill_attention, static_argnames=OPTIONS)

# SmolLM2's heads (9 query, 3 KV: a group of 3) at head sizes 64 and 128
# (compiled for their size) and 8 and 80 (any size), both dtypes, every
# option, a -1 table entry inside a context; lengths (`make_lengths`) include
# 0, 1, a full last block and the maximum.
CASES = [
  Case(6, 9, 3, 64, 16, 4, "bfloat16"),
  Case(6, 9, 3, 64, 16, 4, "float32", hole=True),
  Case(5, 4, 1, 128, 8, 5, "bfloat16", sm_scale=0.3, soft_cap=4.0),
  Case(4, 2, 1, 8, 4, 6, "float32", sliding_window=9),
  Case(3, 6, 2, 80, 16, 3, "bfloat16", soft_cap=3.0, sliding_window=20, hole=True),
]


@pytest.fixture(scope="module", autouse=True)
def built():
  """Builds the kernel (once per machine: the library is cached); skips
  where no compiler exists, fails where one exists and the build fails."""
  if cpu.find_compiler() is None:
    pytest.skip("no C++ compiler")
  assert cpu.unavailable_reason() is None


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_reference_on_poisoned_cache(case):
  q, clean, poisoned, tables, lengths = make_inputs(case, seed=11)
  expected = attend(reference_attention, q, clean, tables, lengths, **case.options)
  out = attend(kernel, q, poisoned, tables, lengths, **case.options)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_close(out, expected, case.dtype)
  assert not np.asarray(out, np.float32)[lengths == 0].any()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_kernel_matches_float64_model_on_poisoned_cache(case):
  """Ragged new tokens per sequence (a full tile, a few, one, none): each
  attends causally up to its own position; padding tokens give zeros."""
  num_queries = 7
  q, clean, poisoned, tables, lengths = make_inputs(case, seed=21, num_queries=num_queries)
  wanted = np.array([num_queries, 3, 1, 0, 5, 2][: case.batch])
  query_lens = np.minimum(lengths, wanted).astype(np.int32)
  offsets = np.arange(num_queries)[None, :]
  query_pos = np.where(offsets < query_lens[:, None], (lengths - query_lens)[:, None] + offsets, -1)
  q = np.where(query_pos[..., None, None] >= 0, q, np.nan).astype(q.dtype)  # padding unread
  out = attend(prefill_kernel, q, poisoned, tables, lengths, query_lens, **case.options)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_close(out, dense_attention(q, clean, tables, lengths, query_pos, case), case.dtype)
  assert not np.asarray(out, np.float32)[query_pos < 0].any()


# Shapes the prefill kernel runs in blocks of query tokens (head sizes of 64,
# 128 or 256, pages of a multiple of 16 keys), with a window that starts
# inside 16 keys.
BLOCK_CASES = [
  Case(6, 9, 3, 64, 16, 4, "bfloat16"),
  Case(6, 9, 3, 64, 16, 4, "float32", soft_cap=5.0, sliding_window=19, hole=True),
  Case(6, 8, 2, 128, 32, 3, "bfloat16", sm_scale=0.2, sliding_window=40),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=str)
def test_prefill_blocks_of_queries_match_float64_model_on_poisoned_cache(case):
  """21 query slots: two whole blocks of tokens and part of a third, across
  pages, and sequences with fewer new tokens than a block, one or none."""
  num_queries = 21
  q, clean, poisoned, tables, lengths = make_inputs(case, seed=5, num_queries=num_queries)
  wanted = np.array([num_queries, num_queries, num_queries, num_queries, 13, 9][: case.batch])
  query_lens = np.minimum(lengths, wanted).astype(np.int32)
  offsets = np.arange(num_queries)[None, :]
  query_pos = np.where(offsets < query_lens[:, None], (lengths - query_lens)[:, None] + offsets, -1)
  q = np.where(query_pos[..., None, None] >= 0, q, np.nan).astype(q.dtype)
  out = attend(prefill_kernel, q, poisoned, tables, lengths, query_lens, **case.options)
  assert (query_lens > 8).sum() >= 2  # sequences that fill whole blocks
  assert_close(out, dense_attention(q, clean, tables, lengths, query_pos, case), case.dtype)
  assert not np.asarray(out, np.float32)[query_pos < 0].any()


def test_prefill_block_keeps_a_later_nan_value_from_earlier_tokens():
  """A NaN value at position 9 of a 16-token block reaches tokens 9 on,
  which see it, and no earlier token (for which it is a future key)."""
  case = Case(1, 2, 1, 64, 16, 1, "float32")
  rng = np.random.default_rng(3)
  q = rng.standard_normal((1, 16, 2, 64)).astype(np.float32)
  k, v = (rng.standard_normal((1, 2, 16, 64)).astype(np.float32) for _ in range(2))
  tables, lengths, query_lens = np.array([[1]], np.int32), np.array([16]), np.array([16])
  poisoned = v.copy()
  poisoned[0, 1, 9] = np.nan
  out = np.asarray(
    attend(prefill_kernel, q, (k, poisoned, None, None), tables, lengths, query_lens)
  )
  query_pos = np.arange(16)[None, :]
  expected = dense_attention(q, (k, v, None, None), tables, lengths, query_pos, case)
  assert_close(out[:, :9], expected[:, :9], case.dtype)
  assert np.isnan(out[:, 9:]).all()


def test_prefill_auto_runs_the_kernel_on_cpu_in_both_dtypes(monkeypatch):
  calls = []
  real = cpu.paged_prefill_attention
  monkeypatch.setattr(
    cpu, "paged_prefill_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
  )
  for case in CASES[:2]:  # bfloat16, float32
    q, _, poisoned, tables, lengths = make_inputs(case, seed=22, num_queries=4)
    query_lens = np.minimum(lengths, 4).astype(np.int32)
    attend(attention.paged_prefill_attention, q, poisoned, tables, lengths, query_lens)
  assert len(calls) == 2
  with kernel_choice.use_cpu_kernel(False):
    attend(attention.paged_prefill_attention, q, poisoned, tables, lengths, query_lens)
  assert len(calls) == 2


def test_prefill_kernel_refuses_quantized_pages_and_bad_query_lens():
  args = good_args()
  q = args.pop("q")[:, None]
  query_lens = jnp.ones(args["lengths"].shape, jnp.int32)
  scales = jnp.ones((2, 10, 8), jnp.float32)
  int8 = dict(
    args, k_pages=args["k_pages"].astype(jnp.int8), v_pages=args["v_pages"].astype(jnp.int8)
  )
  with pytest.raises(ValueError, match="paged_prefill_attention_cpu: it takes no quantized pages"):
    cpu.paged_prefill_attention(q, **int8, query_lens=query_lens, k_scales=scales, v_scales=scales)
  with pytest.raises(ValueError, match="paged_prefill_attention_cpu: query_lens must be int32"):
    cpu.paged_prefill_attention(q, **args, query_lens=query_lens.astype(jnp.float32))
  choice = kernel_choice.select_prefill_kernel(
    "auto", dtype=jnp.bfloat16, num_queries=8, group=2, block_size=8, head_dim=64,
    kv_dtype=jnp.int8, quantized=True,
  )  # fmt: skip
  assert choice is None  # the chunked XLA implementation serves them
  with kernel_choice.target_platform("tpu"), pytest.raises(ValueError, match="cpu backend only"):
    attention.paged_prefill_attention(q, **args, query_lens=query_lens, impl="cpu")


def test_attention_auto_runs_the_kernel_on_cpu(monkeypatch):
  case = CASES[0]
  q, _, poisoned, tables, lengths = make_inputs(case, seed=12)
  calls = []
  monkeypatch.setattr(cpu, "paged_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  out = attend(attention.paged_attention, q, poisoned, tables, lengths)
  assert calls and np.isfinite(np.asarray(out, np.float32)).all()
  with kernel_choice.use_cpu_kernel(False):
    attend(attention.paged_attention, q, poisoned, tables, lengths)
  assert len(calls) == 1


def test_kernel_propagates_nan_read_inside_the_context():
  check_nan_read_inside_the_context_propagates(kernel)


def test_kernel_runs_under_vmap():
  case = CASES[3]
  q, clean, _, tables, lengths = make_inputs(case, seed=13)
  k, v = (jnp.asarray(x) for x in clean[:2])
  expected = reference_attention(q, k, v, tables, lengths, sliding_window=9)
  batched = jax.vmap(lambda q: kernel(q, k, v, tables, lengths, sliding_window=9))
  out = batched(jnp.stack([q, 2 * q]))
  assert_close(out[0], expected, case.dtype)


@pytest.mark.parametrize(
  "dtype,kv_dtype,quantized,message",
  [
    ("float16", "float16", False, "float32 or bfloat16 .* not float16 on float16"),
    ("bfloat16", "int8", True, "no quantized pages"),
  ],
)
def test_kernel_refuses_what_it_cannot_serve(dtype, kv_dtype, quantized, message):
  assert cpu.refusal(jnp.dtype(dtype), jnp.dtype(kv_dtype), quantized) is not None
  args = good_args()
  args["q"] = args["q"].astype(dtype)
  args["k_pages"] = args["v_pages"] = args["k_pages"].astype(kv_dtype)
  if quantized:
    args["k_scales"] = args["v_scales"] = jnp.ones((2, 10, 8), jnp.float32)
  with pytest.raises(ValueError, match=f"paged_attention_cpu: .*{message}"):
    cpu.paged_attention(**args)
  choice = kernel_choice.select_attention_kernel(
    "auto", dtype=dtype, block_size=8, head_dim=64, group=2, quantized=quantized, kv_dtype=kv_dtype
  )
  assert choice is None  # the chunked XLA implementation serves them


def test_auto_leaves_float32_to_xla_and_cpu_impl_runs_it(caplog):
  kernel_choice._log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="paged_jax"):
    choice = kernel_choice.select_attention_kernel(
      "auto", dtype=jnp.float32, block_size=8, head_dim=64, group=2
    )
  assert choice is None and "float32 SmolLM2 decode step measured slower" in caplog.text
  asked = kernel_choice.select_attention_kernel(
    "cpu", dtype=jnp.float32, block_size=8, head_dim=64, group=2
  )
  assert asked == ("cpu", False)


def test_cpu_impl_runs_on_the_cpu_backend_only():
  with kernel_choice.target_platform("tpu"), pytest.raises(ValueError, match="cpu backend only"):
    attention.paged_attention(**good_args(), impl="cpu")


def test_without_a_kernel_auto_falls_back_and_logs_why(monkeypatch, caplog):
  reason = "no C++ compiler found (c++, g++ or clang++)"
  monkeypatch.setattr(cpu, "unavailable_reason", lambda: reason)
  kernel_choice._log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="paged_jax"):
    choice = kernel_choice.select_attention_kernel(
      "auto", dtype=jnp.bfloat16, block_size=8, head_dim=64, group=2
    )
  assert choice is None
  assert f"chunked XLA (C++ kernel: {reason})" in caplog.text
  with pytest.raises(RuntimeError, match="paged_attention_cpu: no C\\+\\+ compiler"):
    cpu.paged_attention(**good_args())


def test_a_failed_build_or_no_compiler_gives_the_reason(monkeypatch, tmp_path):
  monkeypatch.setenv("PAGED_JAX_KERNEL_DIR", str(tmp_path))
  monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
  library, reason = cpu.LIBRARY.load()
  assert library is None and reason.startswith("building it failed:") and "false" in reason
  monkeypatch.setenv("CXX", "no-such-compiler-here")
  library, reason = cpu.LIBRARY.load()
  assert library is None and reason == "no C++ compiler found (no-such-compiler-here)"
  assert not list(tmp_path.glob("*.so"))


def test_a_built_kernel_is_reused_without_compiling(monkeypatch):
  compiler = cpu_build.find_compiler()
  library = cpu.LIBRARY.build(compiler)  # built by the fixture: cached
  assert library.exists() and library.parent == cpu_build.cache_dir()

  def no_compile(*args, **kwargs):
    raise AssertionError("compiled again")

  monkeypatch.setattr(cpu_build.subprocess, "run", no_compile)
  assert cpu.LIBRARY.build(compiler) == library
