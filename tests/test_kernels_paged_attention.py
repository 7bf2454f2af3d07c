"""Paged attention kernels against the XLA reference, and the reference
against a float64 NumPy model: on CPU in Pallas interpret mode, each flavour
compiled on its own backend (tests/kernel_modes.py).

Every case poisons the bytes no query may read (free blocks, slots past a
sequence's length, blocks that left the sliding window) with NaN; outputs
must equal the reference on the same cache with finite data there. Quantized
cases (int8, float8_e4m3fn pages) poison those slots' scales, and fp8 pages
too.
"""

import dataclasses
import functools
import importlib
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import (
  paged_attention as shipped_tpu_paged_attention,
)
from jax.experimental.pallas.ops.tpu.paged_attention import quantization_utils

from pallas_kernels import quantization
from pallas_kernels.paged_attention import (
  check_block_tables,
  cpu,
  gpu,
  paged_attention_chunked,
  paged_attention_reference,
  paged_prefill_attention_chunked,
  paged_prefill_attention_reference,
  reference,
  tpu,
)
from tests.abstract_gpu import lower_for
from tests.kernel_modes import interpret


def shipped_gpu_kernel():
  """JAX's GPU paged attention, an oracle JAX 0.12 deprecates; None once removed."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
      return importlib.import_module("jax.experimental.pallas.ops.gpu.paged_attention")
    except ImportError:
      return None


@dataclasses.dataclass(frozen=True)
class Case:
  batch: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  block_size: int
  max_blocks: int
  dtype: str
  sm_scale: float | None = None
  soft_cap: float | None = None
  sliding_window: int | None = None
  pages_per_step: int | None = None  # kernels only
  num_splits: int | None = None  # GPU kernel only
  hole: bool = False  # a -1 table entry inside the longest context
  kv_dtype: str | None = None  # quantized pages (with scales), else dtype

  def __str__(self):
    extras = "".join(
      f"-{name}{getattr(self, name)}"
      for name in ("sm_scale", "soft_cap", "sliding_window", "pages_per_step", "num_splits")
      if getattr(self, name) is not None
    )
    extras += "-hole" if self.hole else ""
    extras += f"-{self.kv_dtype}" if self.kv_dtype else ""
    return (
      f"b{self.batch}-h{self.num_q_heads}x{self.num_kv_heads}"
      f"-d{self.head_dim}-bs{self.block_size}-m{self.max_blocks}"
      f"-{self.dtype}{extras}"
    )

  @property
  def options(self):
    return dict(sm_scale=self.sm_scale, soft_cap=self.soft_cap, sliding_window=self.sliding_window)


# Together these cover batch 1..8, Hq/Hkv in {1, 2, 4, 8}, Hkv in {1, 2, 4, 8},
# head_dim 64 and 128, block sizes 8, 16, 32, both dtypes, every option, and
# tables that split unevenly into steps and splits; lengths (make_lengths)
# include 0, 1, block multiples and the maximum. The last two read int8 and
# fp8 pages.
CASES = [
  Case(1, 4, 4, 64, 8, 3, "float32", hole=True),
  Case(3, 4, 2, 128, 16, 3, "bfloat16", soft_cap=5.0),
  Case(8, 4, 1, 64, 32, 2, "float32", sliding_window=40),
  Case(4, 64, 8, 128, 8, 4, "bfloat16", sm_scale=0.05, soft_cap=2.0, sliding_window=13),
  Case(
    2, 8, 2, 64, 8, 7, "float32", sm_scale=0.2, sliding_window=30, pages_per_step=2, num_splits=3
  ),
  Case(2, 4, 1, 64, 16, 2, "bfloat16", soft_cap=5.0, kv_dtype="int8"),
  Case(
    2,
    4,
    2,
    64,
    8,
    4,
    "float32",
    sliding_window=20,
    pages_per_step=2,
    num_splits=2,
    hole=True,
    kv_dtype="float8_e4m3fn",
  ),
]
OPTIONS = ("sm_scale", "soft_cap", "sliding_window")
reference_attention = jax.jit(paged_attention_reference, static_argnames=OPTIONS)
prefill_attention = jax.jit(paged_prefill_attention_reference, static_argnames=OPTIONS)
# Chunks of two blocks, so that the cases' tables take several.
chunked_prefill_attention = jax.jit(
  paged_prefill_attention_chunked, static_argnames=OPTIONS + ("chunk_positions",)
)
KERNELS = {
  "chunked": jax.jit(paged_attention_chunked, static_argnames=OPTIONS + ("chunk_positions",)),
  "gpu": jax.jit(
    functools.partial(gpu.paged_attention, interpret=interpret("gpu")),
    static_argnames=OPTIONS + ("pages_per_step", "num_splits"),
  ),
  "tpu": jax.jit(
    functools.partial(tpu.paged_attention, interpret=interpret("tpu")),
    static_argnames=OPTIONS + ("pages_per_step",),
  ),
}


def make_lengths(rng, batch, capacity, block_size):
  """Ragged lengths that start with 0, 1, a block multiple, the maximum."""
  special = [0, 1, 2 * block_size, capacity]
  lengths = rng.integers(0, capacity + 1, size=batch)
  lengths[: min(batch, 4)] = special[:batch]
  if batch == 1:
    lengths[0] = capacity
  return lengths.astype(np.int32)


def make_inputs(case: Case, seed: int = 0, num_queries: int | None = None):
  """Random q and pages, tables as the block manager builds them.

  Returns:
    q, clean pages, poisoned pages, block_tables, lengths as NumPy arrays;
    pages are ``(k, v, k_scales, v_scales)``, scales None unless the case is
    quantized. Poisoned pages (or their scales) hold NaN at every slot no
    query may read; clean pages hold random data there.
  """
  rng = np.random.default_rng(seed)
  capacity = case.max_blocks * case.block_size
  lengths = make_lengths(rng, case.batch, capacity, case.block_size)
  num_blocks = case.batch * case.max_blocks + 3
  owners = rng.permutation(num_blocks)[: case.batch * case.max_blocks]
  tables = owners.reshape(case.batch, case.max_blocks).astype(np.int32)
  logical = np.arange(case.max_blocks)[None, :]
  live = logical * case.block_size < lengths[:, None]
  if case.sliding_window is not None:
    live &= (logical + 1) * case.block_size > (lengths[:, None] - case.sliding_window)
  tables = np.where(live, tables, -1).astype(np.int32)
  if case.hole:
    tables[np.argmax(lengths), 1] = -1  # not a manager table; must be skipped

  page_shape = (case.num_kv_heads, num_blocks, case.block_size, case.head_dim)
  dtype = jnp.dtype(case.dtype)
  k = rng.standard_normal(page_shape).astype(dtype)
  v = rng.standard_normal(page_shape).astype(dtype)
  readable = np.zeros((num_blocks, case.block_size), bool)
  for seq, length in enumerate(lengths):
    for position in range(length):
      block = tables[seq, position // case.block_size]
      if block >= 0:
        readable[block, position % case.block_size] = True
  clean = (k, v, None, None)
  if case.kv_dtype is not None:
    (k, k_scales), (v, v_scales) = (
      map(np.asarray, quantization.quantize(jnp.asarray(x), case.kv_dtype)) for x in (k, v)
    )
    clean = (k, v, k_scales, v_scales)
  poisoned = tuple(None if x is None else x.copy() for x in clean)
  for x in poisoned:
    if x is not None and jnp.issubdtype(x.dtype, jnp.floating):
      x[:, ~readable] = np.nan
  q_shape = (case.batch, case.num_q_heads, case.head_dim)
  if num_queries is not None:
    q_shape = (case.batch, num_queries, case.num_q_heads, case.head_dim)
  q = rng.standard_normal(q_shape).astype(dtype)
  return q, clean, poisoned, tables, lengths


def attend(fn, q, pages, tables, lengths, *extra, **options):
  """``fn`` on JAX copies of the inputs, pages given as (k, v, scales...)."""
  k, v, k_scales, v_scales = (None if x is None else jnp.asarray(x) for x in pages)
  return fn(
    *as_jax(q, k, v, tables, lengths, *extra), k_scales=k_scales, v_scales=v_scales, **options
  )


def dense_attention(q, pages, tables, lengths, query_pos, case: Case):
  """Float64 attention of queries at ``query_pos[b, t]`` (-1: padding)."""
  k, v, k_scales, v_scales = pages
  if k_scales is not None:
    k = k.astype(np.float64) * k_scales[..., None]
    v = v.astype(np.float64) * v_scales[..., None]
  batch, num_queries = query_pos.shape
  group = case.num_q_heads // case.num_kv_heads
  scale = case.sm_scale if case.sm_scale is not None else case.head_dim**-0.5
  out = np.zeros((batch, num_queries, case.num_q_heads, case.head_dim))
  for b in range(batch):
    positions = np.arange(lengths[b])
    blocks = tables[b, positions // case.block_size]
    for t in range(num_queries):
      pos = query_pos[b, t]
      keep = (positions <= pos) & (blocks >= 0)
      if case.sliding_window is not None:
        keep &= positions > pos - case.sliding_window
      if pos < 0 or not keep.any():
        continue
      slots = (blocks[keep], positions[keep] % case.block_size)
      for head in range(case.num_q_heads):
        kv_head = head // group
        keys = k[kv_head][slots].astype(np.float64)
        values = v[kv_head][slots].astype(np.float64)
        logits = keys @ q[b, t, head].astype(np.float64) * scale
        if case.soft_cap is not None:
          logits = case.soft_cap * np.tanh(logits / case.soft_cap)
        weights = np.exp(logits - logits.max())
        out[b, t, head] = weights @ values / weights.sum()
  return out


def assert_close(out, expected, dtype):
  """float32: error below 1e-5; bfloat16: below 2e-2 of the output scale."""
  out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
  expected = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  assert np.isfinite(out).all()
  error = np.abs(out - expected).max()
  if jnp.dtype(dtype) == jnp.float32:
    assert error < 1e-5, error
  else:
    assert error < 2e-2 * max(np.abs(expected).max(), 1.0), error


def as_jax(*arrays):
  return tuple(jnp.asarray(a) for a in arrays)


@pytest.fixture(scope="module", params=CASES, ids=str)
def decode_case(request):
  """A case, its inputs, and the reference output on the clean pages."""
  case = request.param
  q, clean, poisoned, tables, lengths = make_inputs(case)
  expected = attend(reference_attention, q, clean, tables, lengths, **case.options)
  return case, (q, poisoned, tables, lengths), expected


def test_reference_matches_float64_model(decode_case):
  case, (q, _, tables, lengths), expected = decode_case
  _, clean, _, _, _ = make_inputs(case)
  query_pos = (lengths - 1)[:, None]
  dense = dense_attention(q[:, None], clean, tables, lengths, query_pos, case)
  assert_close(expected, dense[:, 0].astype(np.float32), case.dtype)
  assert not np.asarray(expected, np.float32)[lengths == 0].any()


def test_reference_ignores_poisoned_slots(decode_case):
  case, (q, poisoned, tables, lengths), expected = decode_case
  out = attend(reference_attention, q, poisoned, tables, lengths, **case.options)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize("kernel", ["gpu", "tpu", "chunked"])
def test_kernel_matches_reference_on_poisoned_cache(decode_case, kernel):
  case, (q, poisoned, tables, lengths), expected = decode_case
  steps = dict(pages_per_step=case.pages_per_step)
  if kernel == "gpu":
    steps["num_splits"] = case.num_splits
  if kernel == "chunked":
    steps = dict(chunk_positions=2 * case.block_size)
  out = attend(KERNELS[kernel], q, poisoned, tables, lengths, **case.options, **steps)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert_close(out, expected, case.dtype)
  assert not np.asarray(out, np.float32)[lengths == 0].any()


def test_reference_agrees_with_jax_shipped_kernels():
  # JAX's kernels apply no sm_scale, need in-range tables and read the bytes
  # past each length (masked by weight, so not NaN-safe): clean pages only.
  case = Case(3, 16, 2, 128, 16, 4, "float32", sm_scale=1.0, soft_cap=4.0)
  q, (k, v, _, _), _, tables, lengths = make_inputs(case, seed=3)
  tables = np.maximum(tables, 0)
  args = as_jax(q, k, v, tables, lengths)
  expected = reference_attention(*args, **case.options)
  if shipped_gpu := shipped_gpu_kernel():
    shipped_gpu_out = shipped_gpu.paged_attention(
      *args,
      attn_logits_soft_cap=case.soft_cap,
      pages_per_compute_block=2,
      k_splits=2,
      interpret=True,
    )
    assert_close(shipped_gpu_out, expected, case.dtype)
  with pltpu.force_tpu_interpret_mode():
    shipped_tpu_out = shipped_tpu_paged_attention(
      args[0],
      args[1],
      args[2],
      args[4],
      args[3],
      attn_logits_soft_cap=case.soft_cap,
      pages_per_compute_block=2,
    )
  # The shipped TPU kernel computes with K/V rounded to bfloat16.
  assert_close(shipped_tpu_out, expected, "bfloat16")


def test_quantized_reference_agrees_with_jax_shipped_tpu_kernel():
  # The shipped kernel's quantization_utils scale is the per-token, per-head
  # absmax ([..., block_size, 1]) and it dequantizes as x * h / 127.5, so our
  # int8 pages serve it unchanged with h = scale * 127.5: the layouts meet.
  case = Case(2, 8, 2, 128, 16, 3, "float32", sm_scale=1.0, kv_dtype="int8")
  q, pages, _, tables, lengths = make_inputs(case, seed=6)
  tables = np.maximum(tables, 0)
  expected = attend(reference_attention, q, pages, tables, lengths, **case.options)
  k, v, k_scales, v_scales = map(jnp.asarray, pages)
  to_shipped = lambda x, s: quantization_utils.QuantizedTensor(
    x, s[..., None] * quantization_utils.MAX_INT8
  )
  with pltpu.force_tpu_interpret_mode():
    shipped = shipped_tpu_paged_attention(
      jnp.asarray(q),
      to_shipped(k, k_scales),
      to_shipped(v, v_scales),
      jnp.asarray(lengths),
      jnp.asarray(tables),
      pages_per_compute_block=1,
    )
  # It dequantizes K/V to bfloat16.
  assert_close(shipped, expected, "bfloat16")


PREFILL_CASES = [
  Case(3, 4, 2, 64, 8, 4, "float32", soft_cap=4.0),
  Case(2, 8, 2, 128, 16, 3, "bfloat16", sliding_window=9),
  Case(2, 4, 1, 64, 8, 2, "bfloat16", kv_dtype="int8"),
]


@pytest.mark.parametrize("chunked", [False, True], ids=["reference", "chunked"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill_matches_float64_model(case, chunked):
  num_queries = 5
  q, clean, poisoned, tables, lengths = make_inputs(case, seed=4, num_queries=num_queries)
  query_lens = np.minimum(lengths, [num_queries, 2, 1][: case.batch]).astype(np.int32)
  offsets = np.arange(num_queries)[None, :]
  query_pos = np.where(offsets < query_lens[:, None], (lengths - query_lens)[:, None] + offsets, -1)
  options = case.options
  if chunked:
    options = dict(options, chunk_positions=case.block_size)
  attention = chunked_prefill_attention if chunked else prefill_attention
  out = attend(attention, q, poisoned, tables, lengths, query_lens, **options)
  dense = dense_attention(q, clean, tables, lengths, query_pos, case)
  assert_close(out, dense.astype(np.float32), case.dtype)
  assert not np.asarray(out, np.float32)[query_pos < 0].any()


def test_prefill_with_one_query_is_decode():
  case = CASES[2]
  q, _, poisoned, tables, lengths = make_inputs(case, seed=5)
  args = as_jax(q, *poisoned[:2], tables, lengths)
  decode = reference_attention(*args, **case.options)
  prefill = prefill_attention(args[0][:, None], *args[1:], jnp.minimum(args[4], 1), **case.options)
  np.testing.assert_array_equal(np.asarray(prefill[:, 0]), np.asarray(decode))


@pytest.mark.parametrize(
  "kernel,platform",
  [(gpu.paged_attention, "cuda"), (tpu.paged_attention, "tpu")],
  ids=["triton", "mosaic"],
)
@pytest.mark.parametrize(
  "dtype,num_q_heads,kv_dtype",
  [("bfloat16", 32, None), ("float32", 8, None), ("bfloat16", 8, "int8")],
)
def test_kernel_lowers_for_its_platform(kernel, platform, dtype, num_q_heads, kv_dtype):
  shape = jax.ShapeDtypeStruct
  pages = shape((8, 100, 16, 128), kv_dtype or dtype)
  scales = shape((8, 100, 16), jnp.float32) if kv_dtype else None
  run = jax.jit(lambda *a, **scales: kernel(*a, soft_cap=30.0, sliding_window=40, **scales))
  lowered = lower_for(
    platform,
    run,
    shape((3, num_q_heads, 128), dtype),
    pages,
    pages,
    shape((3, 7), jnp.int32),
    shape((3,), jnp.int32),
    k_scales=scales,
    v_scales=scales,
  )
  assert "paged_attention" in lowered.as_text()


IMPLEMENTATIONS = [
  paged_attention_reference,
  paged_attention_chunked,
  lambda *a, **kw: gpu.paged_attention(*a, **kw, interpret=True),
  lambda *a, **kw: tpu.paged_attention(*a, **kw, interpret=True),
  cpu.paged_attention,
]
IMPLEMENTATION_IDS = ["reference", "chunked", "gpu", "tpu", "cpu"]


def good_args():
  q = jnp.ones((2, 4, 64), jnp.float32)
  pages = jnp.ones((2, 10, 8, 64), jnp.float32)
  return dict(
    q=q,
    k_pages=pages,
    v_pages=pages,
    block_tables=jnp.zeros((2, 3), jnp.int32),
    lengths=jnp.ones((2,), jnp.int32),
  )


BAD_ARGS = {
  "q rank": (dict(q=jnp.ones((2, 4, 1, 64))), "q must be"),
  "pages rank": (
    dict(k_pages=jnp.ones((10, 8, 64)), v_pages=jnp.ones((10, 8, 64))),
    "k_pages must be",
  ),
  "v shape": (dict(v_pages=jnp.ones((2, 10, 8, 32))), "v_pages shape"),
  "gqa": (dict(q=jnp.ones((2, 3, 64))), "multiple of num_kv_heads"),
  "dtype": (dict(q=jnp.ones((2, 4, 64), jnp.bfloat16)), "one dtype"),
  "head_dim": (dict(q=jnp.ones((2, 4, 32))), "head_dim"),
  "tables rank": (dict(block_tables=jnp.zeros((2,), jnp.int32)), "block_tables must be"),
  "tables dtype": (dict(block_tables=jnp.zeros((2, 3))), "block_tables must be int32"),
  "lengths": (dict(lengths=jnp.ones((3,), jnp.int32)), "lengths must be"),
  "soft cap": (dict(soft_cap=0.0), "soft_cap"),
  "window": (dict(sliding_window=0), "sliding_window"),
  "scale": (dict(sm_scale=float("nan")), "sm_scale"),
}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=IMPLEMENTATION_IDS)
@pytest.mark.parametrize("bad", BAD_ARGS, ids=str)
def test_bad_arguments_raise_value_error(impl, bad):
  overrides, message = BAD_ARGS[bad]
  args = {**good_args(), **overrides}
  with pytest.raises(ValueError, match=message):
    impl(**args)


@pytest.mark.parametrize(
  "kwargs,message",
  [
    (
      dict(k_pages=jnp.ones((2, 10, 6, 64)), v_pages=jnp.ones((2, 10, 6, 64))),
      "block_size must be a power of two",
    ),
    (dict(pages_per_step=3), "pages_per_step must be a power of two"),
    (dict(pages_per_step=1), "pages_per_step \\* block_size must be >= 16"),
    (dict(num_splits=0), "num_splits"),
  ],
)
def test_gpu_kernel_rejects_untileable_shapes(kwargs, message):
  with pytest.raises(ValueError, match=message):
    gpu.paged_attention(**{**good_args(), **kwargs}, interpret=True)


KERNEL_NAMES = [
  "paged_attention_reference",
  "paged_attention_chunked",
  "paged_attention_gpu",
  "paged_attention_tpu",
  "paged_attention_cpu",
]


@pytest.mark.parametrize(
  "impl,name", list(zip(IMPLEMENTATIONS, KERNEL_NAMES)), ids=IMPLEMENTATION_IDS
)
@pytest.mark.parametrize(
  "pages,scales,message",
  [
    ("int8", None, "int8 pages need k_scales"),
    ("float8_e5m2", "both", "cannot serve scales with float8_e5m2"),
    ("float32", "both", "cannot serve scales with float32"),
    ("int8", "k only", "both k_scales and v_scales or neither"),
    ("int8", "bad shape", r"k_scales must be float32\[2, 10, 8\]"),
  ],
  ids=["no scales", "e5m2", "float pages", "one scale", "scale shape"],
)
def test_quantization_errors_name_the_kernel(impl, name, pages, scales, message):
  args = good_args()
  args["k_pages"] = args["v_pages"] = args["k_pages"].astype(pages)
  good = jnp.ones((2, 10, 8), jnp.float32)
  args.update(
    {
      None: {},
      "both": dict(k_scales=good, v_scales=good),
      "k only": dict(k_scales=good),
      "bad shape": dict(k_scales=good[:, :, :4], v_scales=good),
    }[scales]
  )
  with pytest.raises(ValueError, match=f"{name}.*{message}"):
    impl(**args)


@pytest.mark.parametrize("capability,served", [("8.0", False), ("8.9", True), ("9.0", True)])
def test_gpu_kernel_serves_fp8_from_compute_capability_8_9(capability, served):
  device = types.SimpleNamespace(compute_capability=capability)
  if served:
    gpu.check_fp8_capability(device)
  else:
    with pytest.raises(
      ValueError,
      match="paged_attention_gpu cannot serve float8_e4m3fn pages on compute capability 8.0",
    ):
      gpu.check_fp8_capability(device)


def test_tpu_kernel_rejects_bad_step():
  with pytest.raises(ValueError, match="pages_per_step"):
    tpu.paged_attention(**good_args(), pages_per_step=0, interpret=True)


def test_prefill_rejects_bad_query_lens():
  args = good_args()
  with pytest.raises(ValueError, match="query_lens"):
    paged_prefill_attention_reference(
      args["q"][:, None],
      args["k_pages"],
      args["v_pages"],
      args["block_tables"],
      args["lengths"],
      jnp.ones((3,), jnp.int32),
    )


@pytest.mark.parametrize(
  "tables,lengths,message",
  [
    ([[0, 10, -1]], [3], r"block_tables\[0, 1\] = 10 is out of range"),
    ([[0, -2, -1]], [3], r"block_tables\[0, 1\] = -2"),
    ([[0, 1, 2]], [25], "length 25 is outside 0..24"),
    ([[0, 1, 2]], [-1], "length -1"),
  ],
)
def test_check_block_tables_names_the_bad_entry(tables, lengths, message):
  with pytest.raises(ValueError, match=message):
    check_block_tables(
      np.array(tables, np.int32), np.array(lengths, np.int32), num_blocks=10, block_size=8
    )


def test_check_block_tables_accepts_valid_tables():
  check_block_tables(
    np.array([[9, -1, -1]], np.int32), np.array([8], np.int32), num_blocks=10, block_size=8
  )


@pytest.mark.parametrize(
  "attention",
  [paged_attention_reference, functools.partial(paged_attention_chunked, chunk_positions=4)],
  ids=["reference", "chunked"],
)
def test_xla_attention_propagates_nan_read_inside_the_context(attention):
  check_nan_read_inside_the_context_propagates(attention)


def check_nan_read_inside_the_context_propagates(attention):
  """A NaN key the query can see poisons that output (stale reads stay visible)."""
  rng = np.random.default_rng(7)
  k_pages = rng.standard_normal((1, 4, 4, 8)).astype(np.float32)
  v_pages = rng.standard_normal((1, 4, 4, 8)).astype(np.float32)
  k_pages[0, 2, 1] = np.nan  # inside sequence 0's context, outside sequence 1's
  q = rng.standard_normal((2, 2, 8)).astype(np.float32)
  tables = np.array([[2, -1], [3, 1]], np.int32)
  out = attention(q, k_pages, v_pages, tables, np.array([3, 6], np.int32))
  assert np.all(np.isnan(np.asarray(out[0])))
  assert np.all(np.isfinite(np.asarray(out[1])))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's narrow-float gathers")
def test_bfloat16_blocks_are_gathered_as_bits():
  # XLA:CPU gathers bfloat16 from a float32 copy of the whole page array.
  pages = jax.random.normal(jax.random.key(0), (2, 64, 4, 8)).astype(jnp.bfloat16)
  tables = jax.random.randint(jax.random.key(1), (3, 5), 0, 64)
  np.testing.assert_array_equal(
    np.asarray(reference.take_blocks(pages, tables), np.float32),
    np.asarray(pages[:, tables], np.float32),
  )
  compiled = jax.jit(reference.take_blocks).lower(pages, tables).compile().as_text()
  assert "f32[2,64,4,8]" not in compiled
