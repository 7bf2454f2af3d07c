"""The Mosaic TPU prefill (multi-query) paged-attention kernel against the XLA
reference: in TPU interpret mode on CPU, compiled on a TPU
(tests/kernel_modes.py); its choice in `paged_jax.attention`; and compiles
for TPU v5e by libtpu on this host where libtpu is installed.

Each case is a ragged step's tiles: per tile a context length, a query
length (chunks that start mid-block, padding rows, empty tiles) and a block
table. The bytes no query may read (free blocks, slots past a tile's length,
blocks that left the sliding window) hold NaN in the kernel's cache; the
reference reads the same cache with random data there. Interpret mode fills
the kernel's output and scratch buffers with NaN before it runs, so a row it
does not write shows.
"""

import dataclasses
import functools
import importlib.util
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention, kernel_choice
from pallas_kernels import quantization
from pallas_kernels.paged_attention import paged_prefill_attention_reference, tpu_prefill
from tests.kernel_modes import interpret

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu is not installed")
OPTIONS = ("sm_scale", "soft_cap", "sliding_window")


@dataclasses.dataclass(frozen=True)
class Tiles:
  tiles: tuple[tuple[int, int], ...]  # (length, query_len) per tile
  num_queries: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  max_blocks: int
  dtype: str
  kv_dtype: str | None = None  # int8 / float8_e4m3fn pages with scales
  sm_scale: float | None = None
  soft_cap: float | None = None
  sliding_window: int | None = None
  pages_per_step: int | None = None
  block_rows: int = tpu_prefill.BLOCK_ROWS

  def __str__(self):
    extras = "".join(
      f"-{name}{getattr(self, name)}"
      for name in (*OPTIONS, "kv_dtype", "pages_per_step")
      if getattr(self, name) is not None
    )
    return (
      f"t{len(self.tiles)}x{self.num_queries}-h{self.num_q_heads}x{self.num_kv_heads}"
      f"-d{self.head_dim}-bs{self.block_size}-m{self.max_blocks}-{self.dtype}"
      f"-rows{self.block_rows}{extras}"
    )

  @property
  def options(self):
    return dict(sm_scale=self.sm_scale, soft_cap=self.soft_cap, sliding_window=self.sliding_window)

  @property
  def kernel_options(self):
    return dict(self.options, pages_per_step=self.pages_per_step, block_rows=self.block_rows)


# Together: causal chunks from position 0 and from mid-block, query_lens below
# num_queries (padding rows), empty tiles (with and without a context), a
# tile whose context spans every page of its table over several steps, GQA
# groups 2 and 4 (1, 3 and 8 in the slow sweep), soft cap, sliding window
# (with the blocks it left freed), sm_scale, float32 and bfloat16 queries,
# int8 and fp8 pages, row blocks of whole heads and of part of one head, and
# a num_queries not a multiple of 8.
CASES = [
  Tiles(
    ((45, 8), (14, 5), (3, 3), (20, 0), (0, 0)),
    num_queries=8,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=64,
    block_size=8,
    max_blocks=6,
    dtype="float32",
    soft_cap=4.0,
    pages_per_step=2,
    block_rows=16,
  ),
  Tiles(
    ((70, 16), (9, 9), (30, 11)),
    num_queries=16,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=128,
    block_size=16,
    max_blocks=5,
    dtype="bfloat16",
    kv_dtype="int8",
    sliding_window=20,
    block_rows=8,
  ),
  Tiles(
    ((29, 5), (4, 2), (0, 0)),
    num_queries=5,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=64,
    block_size=8,
    max_blocks=4,
    dtype="float32",
    kv_dtype="float8_e4m3fn",
    sm_scale=0.3,
    sliding_window=7,
    block_rows=10,
  ),
]

# Larger shapes, as a ragged step of the engine brings them.
SLOW_CASES = [
  Tiles(
    ((300, 32), (33, 32), (64, 17), (1, 1), (0, 0), (250, 3)),
    num_queries=32,
    num_q_heads=8,
    num_kv_heads=2,
    head_dim=128,
    block_size=16,
    max_blocks=20,
    dtype="bfloat16",
  ),
  Tiles(
    ((300, 32), (40, 32), (97, 20)),
    num_queries=32,
    num_q_heads=8,
    num_kv_heads=1,
    head_dim=64,
    block_size=16,
    max_blocks=20,
    dtype="bfloat16",
    kv_dtype="float8_e4m3fn",
    soft_cap=30.0,
    sliding_window=64,
    block_rows=64,
  ),
  Tiles(
    ((200, 24), (24, 24), (77, 9)),
    num_queries=24,
    num_q_heads=12,
    num_kv_heads=4,
    head_dim=128,
    block_size=32,
    max_blocks=7,
    dtype="float32",
    kv_dtype="int8",
    sm_scale=0.05,
    soft_cap=10.0,
    pages_per_step=3,
  ),
]


def make_tiles(case: Tiles, seed: int = 0):
  """Random queries, pages and tables for `case` (as NumPy arrays).

  Returns:
    q, clean pages, poisoned pages, block_tables, lengths, query_lens; pages
    are ``(k, v, k_scales, v_scales)`` (scales None for float pages). The
    table entries wholly before a tile's first query's window are -1, as a
    cache that frees them leaves them.
  """
  rng = np.random.default_rng(seed)
  lengths = np.array([t[0] for t in case.tiles], np.int32)
  query_lens = np.array([t[1] for t in case.tiles], np.int32)
  batch = len(case.tiles)
  num_blocks = batch * case.max_blocks + 3
  owners = rng.permutation(num_blocks)[: batch * case.max_blocks]
  tables = owners.reshape(batch, case.max_blocks).astype(np.int32)
  logical = np.arange(case.max_blocks)[None, :]
  live = logical * case.block_size < lengths[:, None]
  if case.sliding_window is not None:
    first_query = lengths - query_lens
    live &= (logical + 1) * case.block_size > (first_query[:, None] - case.sliding_window + 1)
  tables = np.where(live, tables, -1).astype(np.int32)

  page_shape = (case.num_kv_heads, num_blocks, case.block_size, case.head_dim)
  dtype = jnp.dtype(case.dtype)
  k = rng.standard_normal(page_shape).astype(dtype)
  v = rng.standard_normal(page_shape).astype(dtype)
  clean = (k, v, None, None)
  if case.kv_dtype is not None:
    (k, k_scales), (v, v_scales) = (
      map(np.asarray, quantization.quantize(jnp.asarray(x), case.kv_dtype)) for x in (k, v)
    )
    clean = (k, v, k_scales, v_scales)
  readable = np.zeros((num_blocks, case.block_size), bool)
  for seq, length in enumerate(lengths):
    for position in range(length):
      block = tables[seq, position // case.block_size]
      if block >= 0:
        readable[block, position % case.block_size] = True
  poisoned = tuple(None if x is None else x.copy() for x in clean)
  for x in poisoned:
    if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
      x[:, ~readable] = np.nan
  q_shape = (batch, case.num_queries, case.num_q_heads, case.head_dim)
  q = rng.standard_normal(q_shape).astype(dtype)
  return q, clean, poisoned, tables, lengths, query_lens


def attend(fn, q, pages, tables, lengths, query_lens, **options):
  k, v, k_scales, v_scales = (None if x is None else jnp.asarray(x) for x in pages)
  args = (jnp.asarray(a) for a in (q, k, v, tables, lengths, query_lens))
  return fn(*args, k_scales=k_scales, v_scales=v_scales, **options)


reference = jax.jit(paged_prefill_attention_reference, static_argnames=OPTIONS)
kernel = jax.jit(
  functools.partial(tpu_prefill.paged_prefill_attention, interpret=interpret("tpu")),
  static_argnames=OPTIONS + ("pages_per_step", "block_rows"),
)


def assert_close(out, expected, dtype):
  """float32: error below 2e-5; bfloat16: below 2e-2 of the output scale."""
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  assert np.isfinite(out).all()
  error = np.abs(out - expected).max()
  bound = 2e-5 if jnp.dtype(dtype) == jnp.float32 else 2e-2 * max(np.abs(expected).max(), 1.0)
  assert error < bound, error


def check_case(case: Tiles, seed: int = 0):
  q, clean, poisoned, tables, lengths, query_lens = make_tiles(case, seed)
  expected = attend(reference, q, clean, tables, lengths, query_lens, **case.options)
  out = attend(kernel, q, poisoned, tables, lengths, query_lens, **case.kernel_options)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_close(out, expected, case.dtype)
  padding = np.arange(case.num_queries)[None, :] >= query_lens[:, None]
  assert padding.any() and not np.asarray(out, np.float32)[padding].any()
  # Not a vacuous case: the real rows see keys and give non-zero outputs.
  assert np.abs(np.asarray(out, np.float32)[~padding]).sum(axis=-1).min() > 0


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_reference_on_poisoned_cache(case):
  check_case(case)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("case", SLOW_CASES, ids=str)
def test_kernel_matches_reference_at_engine_shapes(case, seed):
  check_case(case, seed)


def test_row_blocks_hold_whole_heads_or_part_of_one():
  assert tpu_prefill.row_block(64, 32) == 64  # at most block_rows: one block
  assert tpu_prefill.row_block(1024, 32, 512) == 512  # 16 whole heads
  assert tpu_prefill.row_block(8000, 1000, 512) == 200  # a fifth of a head
  assert tpu_prefill.row_block(16, 16, 8) == 8
  assert tpu_prefill.row_block(2002, 1001, 512) == 2002  # no multiple of 8 divides


def test_refusal_names_dtype_and_vmem():
  assert tpu_prefill.refusal(jnp.bfloat16, 32, 4, 16, 128, jnp.int8) is None
  assert "not float16" in tpu_prefill.refusal(jnp.float16, 32, 4, 16, 128)
  reason = tpu_prefill.refusal(jnp.float32, 1001, 4, 16, 256)
  assert "4004 query rows" in reason and "MiB of VMEM" in reason


def good_args(num_queries=8, dtype=jnp.float32):
  rng = np.random.default_rng(0)
  pages = jnp.asarray(rng.standard_normal((2, 10, 8, 64)), dtype)
  return dict(
    q=jnp.asarray(rng.standard_normal((2, num_queries, 4, 64)), dtype),
    k_pages=pages,
    v_pages=pages,
    block_tables=jnp.array([[0, 1, -1], [2, -1, -1]], jnp.int32),
    lengths=jnp.array([12, 5], jnp.int32),
    query_lens=jnp.array([8, 5], jnp.int32),
  )


@pytest.mark.parametrize(
  "overrides,message",
  [
    (dict(pages_per_step=0), "_tpu: pages_per_step must be an int >= 1, got 0"),
    (dict(block_rows=True), "_tpu: block_rows must be an int >= 1, got True"),
    (dict(query_lens=jnp.ones((3,), jnp.int32)), r"_tpu: query_lens must be int32\[2\]"),
    (dict(query_lens=jnp.ones((2,), jnp.float32)), "_tpu: query_lens must be int32"),
    (dict(query_lens=[1, 1]), "query_lens must be an array"),
    (dict(q=jnp.ones((2, 4, 64))), "q must be"),
    (dict(sliding_window=0), "sliding_window must be an int >= 1"),
    (dict(soft_cap=-1.0), "soft_cap must be > 0"),
    (dict(k_pages=jnp.ones((2, 10, 8, 64), jnp.int8)), "_tpu.*int8 pages need k_scales"),
    (good_args(dtype=jnp.float16), "_tpu cannot serve these shapes: .* not float16"),
    (good_args(num_queries=4001), "_tpu cannot serve these shapes: .* MiB of VMEM"),
  ],
)
def test_kernel_rejects_bad_arguments(overrides, message):
  with pytest.raises(ValueError, match=message):
    tpu_prefill.paged_prefill_attention(**{**good_args(), **overrides}, interpret=True)


def test_entry_point_runs_the_kernel_for_pallas_and_xla_for_auto_on_cpu():
  args = good_args()
  expected = paged_prefill_attention_reference(*args.values())
  for impl in ("pallas", "auto", "reference"):
    out = attention.paged_prefill_attention(*args.values(), impl=impl)
    assert_close(out, expected, jnp.float32)
  with pytest.raises(ValueError, match="impl must be one of"):
    attention.paged_prefill_attention(*args.values(), impl="triton")
  with pytest.raises(ValueError, match="query_lens must be int32"):
    attention.paged_prefill_attention(*list(args.values())[:5], args["lengths"][:1])
  with pytest.raises(ValueError, match="soft_cap must be > 0"):
    attention.paged_prefill_attention(*args.values(), soft_cap=0.0)


def test_entry_point_on_cpu_traces_the_kernel_only_for_pallas():
  args = good_args()
  for impl, kernel_in_program in (("pallas", True), ("auto", False)):
    run = functools.partial(attention.paged_prefill_attention, impl=impl)
    text = str(jax.make_jaxpr(run)(*args.values()))
    assert ("paged_prefill_attention_tpu" in text) == kernel_in_program, impl


SELECT = dict(dtype=jnp.bfloat16, num_queries=32, group=4, block_size=16, head_dim=128)


@pytest.mark.parametrize(
  "platform,impl,overrides,expected,logged",
  [
    ("tpu", "auto", {}, ("tpu", False), "Mosaic kernel"),
    ("tpu", "auto", dict(kv_dtype=jnp.int8), ("tpu", False), "Mosaic kernel"),
    ("tpu", "auto", dict(dtype=jnp.float16), None, "chunked XLA, because .* not float16"),
    (
      "tpu",
      "auto",
      dict(dtype=jnp.float32, num_queries=1001, head_dim=256),
      None,
      "chunked XLA, because a program of 4004 query rows",
    ),
    ("tpu", "pallas", {}, ("tpu", False), None),
    ("tpu", "reference", {}, None, None),
    ("cpu", "auto", {}, ("cpu", False), "C\\+\\+ kernel"),
    ("cpu", "auto", dict(kv_dtype=jnp.int8, quantized=True), None, "chunked XLA .*quantized"),
    ("cpu", "cpu", {}, ("cpu", False), None),
    ("cpu", "pallas", {}, ("tpu", True), None),
    ("cuda", "auto", {}, None, None),
  ],
)
def test_prefill_kernel_choice(caplog, platform, impl, overrides, expected, logged):
  kernel_choice._log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger="paged_jax"), kernel_choice.target_platform(platform):
    assert kernel_choice.select_prefill_kernel(impl, **{**SELECT, **overrides}) == expected
  messages = [r.getMessage() for r in caplog.records if r.name == "paged_jax"]
  if logged is None:
    assert not messages
  else:
    assert len(messages) == 1 and messages[0].startswith(f"prefill attention on {platform} (")
    assert re.search(logged, messages[0]), messages[0]


def test_describe_kernels_names_the_prefill_choice(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  shape = dict(block_size=16, head_dim=128, group=4)
  assert "prefill attention = Mosaic (Pallas TPU)" in kernel_choice.describe_kernels(
    dtype=jnp.bfloat16, **shape
  )
  assert "prefill attention = chunked XLA" in kernel_choice.describe_kernels(
    dtype=jnp.float16, **shape
  )


# TPU v5e compiles by libtpu (Python >= 3.12, JAX >= 0.12), at a ragged step's
# shapes: 16 tiles x 32 queries, 8 query heads over 2 KV heads, block 16,
# 2,048 blocks. A compile says that Mosaic accepts the kernel, not how fast it runs.
AOT_SHAPES = [
  pytest.param("bfloat16", None, 128, {}, id="bf16-d128"),
  pytest.param("bfloat16", "int8", 64, {}, id="int8-d64"),
  pytest.param("bfloat16", None, 64, {}, id="bf16-d64", marks=pytest.mark.slow),
  pytest.param("bfloat16", "int8", 128, {}, id="int8-d128", marks=pytest.mark.slow),
  pytest.param(
    "bfloat16",
    "float8_e4m3fn",
    128,
    dict(soft_cap=30.0, sliding_window=40),
    id="fp8-d128-cap-window",
    marks=pytest.mark.slow,
  ),
  pytest.param(
    "float32", None, 128, dict(sliding_window=40), id="f32-d128-window", marks=pytest.mark.slow
  ),
]


def compile_for_v5e(dtype, kv_dtype, head_dim, options, *, tiles=16, num_queries=32):
  from paged_jax import aot

  device = aot.topology_devices("v5e:1x1")[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  shape = lambda dims, dt: jax.ShapeDtypeStruct(dims, dt, sharding=sharding)
  pages = shape((2, 2048, 16, head_dim), kv_dtype or dtype)
  scales = shape((2, 2048, 16), jnp.float32) if kv_dtype else None

  def run(q, k, v, tables, lengths, query_lens, k_scales, v_scales):
    return attention.paged_prefill_attention(
      q, k, v, tables, lengths, query_lens, k_scales=k_scales, v_scales=v_scales, **options
    )

  with kernel_choice.target_platform("tpu"):
    lowered = jax.jit(run).lower(
      shape((tiles, num_queries, 8, head_dim), dtype),
      pages,
      pages,
      shape((tiles, 128), jnp.int32),
      shape((tiles,), jnp.int32),
      shape((tiles,), jnp.int32),
      scales,
      scales,
    )
  assert "paged_prefill_attention_tpu" in lowered.as_text()
  return lowered.compile()


@needs_libtpu
@pytest.mark.parametrize("dtype,kv_dtype,head_dim,options", AOT_SHAPES)
def test_kernel_compiles_for_tpu_v5e(dtype, kv_dtype, head_dim, options):
  compiled = compile_for_v5e(dtype, kv_dtype, head_dim, options)
  out = compiled.out_info
  assert out.shape == (16, 32, 8, head_dim) and out.dtype == jnp.dtype(dtype)


@needs_libtpu
@pytest.mark.slow
def test_kernel_compiles_for_tpu_v5e_in_row_blocks():
  # 1,000 queries x 4 heads per KV head: blocks of 200 rows, a fifth of a head.
  compiled = compile_for_v5e("bfloat16", "int8", 128, {}, tiles=2, num_queries=1000)
  assert compiled.out_info.shape == (2, 1000, 8, 128)
