"""KVCache: allocation, sizing, write_kv/copy_blocks, attention dispatch, and
an in-place decode step."""

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import attention, kernel_choice, kv_cache, kv_memory
from paged_jax.config import CacheConfig
from pallas_kernels.paged_attention import (
  gpu,
  paged_attention_reference,
  paged_prefill_attention_reference,
)

CFG = CacheConfig(
  block_size=8, num_gpu_blocks=12, num_cpu_blocks=4, max_seqs=4, max_blocks_per_seq=4
)
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64


class Plan(NamedTuple):
  """A CopyPlan/SwapPlan stand-in: the fields the cache ops read."""

  src: jax.Array
  dst: jax.Array
  count: jax.Array


def make_plan(pairs, capacity):
  src = np.full(capacity, -1, np.int32)
  dst = np.full(capacity, -1, np.int32)
  for i, (source, target) in enumerate(pairs):
    src[i], dst[i] = source, target
  return Plan(jnp.asarray(src), jnp.asarray(dst), jnp.int32(len(pairs)))


def random_cache(cfg=CFG, dtype=jnp.float32, seed=0):
  """A cache whose device pages hold random data."""
  cache = kv_cache.KVCache.create(cfg, LAYERS, KV_HEADS, HEAD_DIM, dtype)
  rng = np.random.default_rng(seed)

  def fill(pages):  # as the pages hold them (bits on the CPU backend for narrow floats)
    values = (jnp.asarray(rng.standard_normal(p.shape), dtype) for p in pages)
    return tuple(jax.lax.bitcast_convert_type(x, p.dtype) for x, p in zip(values, pages))

  return cache.replace(k=fill(cache.k), v=fill(cache.v))


def numpy_pages(cache):
  return [np.asarray(p) for p in cache.k + cache.v]


def test_pages_of_bit_patterns_passed_to_attention_name_the_view():
  cache = kv_cache.KVCache.create(CFG, 1, KV_HEADS, HEAD_DIM, jnp.bfloat16)
  if cache.bits_of is None:
    pytest.skip("the device pages hold the floats on this backend")
  q = jnp.ones((1, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  tables, lengths = jnp.array([[0]], jnp.int32), jnp.array([1], jnp.int32)
  with pytest.raises(ValueError, match=r"read with `cache\.pages\(layer\)`"):
    attention.paged_attention(q, cache.k[0], cache.v[0], tables, lengths)
  out = attention.paged_attention(q, *cache.pages(0), tables, lengths)
  assert out.dtype == jnp.bfloat16


def test_create_allocates_zeroed_device_and_host_pages():
  cache = kv_cache.KVCache.create(CFG, 3, KV_HEADS, HEAD_DIM, jnp.bfloat16)
  device_shape = (KV_HEADS, CFG.num_gpu_blocks, CFG.block_size, HEAD_DIM)
  host_shape = (KV_HEADS, CFG.num_cpu_blocks, CFG.block_size, HEAD_DIM)
  assert len(cache.k) == len(cache.v) == len(cache.k_host) == 3
  # On the CPU backend the device pages hold bfloat16 bits too (XLA:CPU
  # would copy a whole float array per scatter); elsewhere the floats.
  stored = jnp.uint16 if jax.default_backend() == "cpu" else jnp.bfloat16
  assert cache.dtype == jnp.bfloat16
  for pages in cache.k + cache.v:
    assert pages.shape == device_shape and pages.dtype == stored
    assert pages.sharding.memory_kind == "device"
  for pages in cache.pages(2):
    assert pages.dtype == jnp.bfloat16 and not np.asarray(pages, np.float32).any()
  for pages in cache.k_host + cache.v_host:
    assert pages.shape == host_shape and pages.dtype == jnp.uint16  # bits
    assert pages.sharding.memory_kind == "pinned_host"
  for pages in cache.host_pages(2):
    assert pages.dtype == jnp.bfloat16 and not np.asarray(pages, np.float32).any()
  assert (cache.num_layers, cache.num_kv_heads, cache.block_size, cache.head_dim) == (
    3,
    KV_HEADS,
    CFG.block_size,
    HEAD_DIM,
  )
  assert (cache.num_gpu_blocks, cache.num_cpu_blocks) == (12, 4)
  assert cache.nbytes == 2 * 3 * np.prod(device_shape) * 2
  assert cache.host_nbytes == 2 * 3 * np.prod(host_shape) * 2


@pytest.mark.parametrize(
  "kwargs", [dict(num_layers=0), dict(head_dim=True), dict(num_kv_heads=2.0)]
)
def test_create_rejects_bad_sizes(kwargs):
  sizes = {**dict(num_layers=1, num_kv_heads=1, head_dim=8), **kwargs}
  with pytest.raises(ValueError, match=next(iter(kwargs))):
    kv_cache.KVCache.create(CFG, **sizes)


def test_sizing_follows_vllm_formulas():
  llama3_8b = dict(block_size=16, num_layers=32, num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
  block = kv_memory.bytes_per_block(**llama3_8b)
  assert block == 2 * 32 * 8 * 16 * 128 * 2  # K and V, bf16: 2 MiB
  gib = 1 << 30
  # (80 GiB * 0.9 - 16 GiB) / 2 MiB = 56 GiB / 2 MiB
  assert (
    kv_memory.num_gpu_blocks_for_memory(80 * gib, block, utilization=0.9, reserved_bytes=16 * gib)
    == 28672
  )
  assert kv_memory.num_gpu_blocks_for_memory(block * 10 + 1, block, utilization=1.0) == 10
  assert kv_memory.num_cpu_blocks_for_swap_space(4, block) == 2048
  assert kv_memory.num_cpu_blocks_for_swap_space(0, block) == 0


@pytest.mark.parametrize(
  "call,message",
  [
    (lambda: kv_memory.num_gpu_blocks_for_memory(1 << 30, 1, utilization=0.0), "utilization"),
    (lambda: kv_memory.num_gpu_blocks_for_memory(1 << 30, 1, utilization=1.5), "utilization"),
    (lambda: kv_memory.num_gpu_blocks_for_memory(100, 64, reserved_bytes=50), "no room"),
    (lambda: kv_memory.num_gpu_blocks_for_memory(-1, 64), "non-negative"),
    (lambda: kv_memory.num_cpu_blocks_for_swap_space(-1, 64), "swap_space_gib"),
    (lambda: kv_memory.num_cpu_blocks_for_swap_space(1, 0), "block_bytes"),
    (lambda: kv_memory.device_memory_bytes(jax.devices("cpu")[0]), "reports no memory limit"),
  ],
)
def test_sizing_errors(call, message):
  with pytest.raises(ValueError, match=message):
    call()


@pytest.mark.parametrize(
  "kinds,expected", [(("device", "unpinned_host"), "unpinned_host"), (("device",), None)]
)
def test_host_memory_fallback_warns_once(kinds, expected):
  with pytest.warns(RuntimeWarning, match="no 'pinned_host' memory"):
    assert kv_memory.pick_host_memory_kind(kinds, "testbackend") == expected
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert kv_memory.pick_host_memory_kind(kinds, "testbackend") == expected


def test_pinned_host_is_picked_without_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert (
      kv_memory.pick_host_memory_kind(("device", "pinned_host", "unpinned_host"), "cpu")
      == "pinned_host"
    )


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_write_kv_writes_one_layer_at_its_slots(impl):
  cache = random_cache()
  before = numpy_pages(cache)
  rng = np.random.default_rng(1)
  # The block manager's [batch, width] slot mapping, -1 padded.
  slots = np.array([[3 * 8 + 5, 3 * 8 + 6, -1], [10 * 8 + 0, -1, -1]], np.int32)
  k = rng.standard_normal((2, 3, KV_HEADS, HEAD_DIM)).astype(np.float32)
  v = rng.standard_normal((2, 3, KV_HEADS, HEAD_DIM)).astype(np.float32)
  cache = kv_cache.write_kv(cache, 1, k, v, jnp.asarray(slots), impl=impl)
  expected = [pages.copy() for pages in before]
  for pages, rows in ((expected[1], k), (expected[3], v)):  # layer 1 K, V
    for seq, position in np.argwhere(slots >= 0):
      slot = slots[seq, position]
      pages[:, slot // 8, slot % 8] = rows[seq, position]
  for got, want in zip(numpy_pages(cache), expected):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_copy_blocks_copies_every_layer(impl):
  cache = random_cache()
  before = numpy_pages(cache)
  plan = make_plan([(2, 7), (4, 0), (11, 5)], capacity=6)
  cache = kv_cache.copy_blocks(cache, plan, impl=impl)
  for got, want in zip(numpy_pages(cache), before):
    want = want.copy()
    want[:, [7, 0, 5]] = want[:, [2, 4, 11]]
    np.testing.assert_array_equal(got, want)


WRITE_ERRORS = {
  "layer": (dict(layer=2), "layer must be an int in 0..1"),
  "slot range": (dict(slots=[0, 96]), r"slot_mapping\[1\] = 96 is out"),
  "slot below -1": (dict(slots=[-2, 0]), r"slot_mapping\[0\] = -2"),
  "duplicate": (dict(slots=[5, 5]), "slot 5 is written 2 times"),
  "shape": (dict(slots=[0, 1, 2]), "leading shape of k"),
  "dtype": (dict(dtype=jnp.bfloat16), "k, v and the cache must share one dtype, got bfloat16"),
}


@pytest.mark.parametrize("bad", WRITE_ERRORS, ids=str)
def test_write_kv_checked_path_errors(bad):
  overrides, message = WRITE_ERRORS[bad]
  cache = random_cache()
  rows = jnp.ones((2, KV_HEADS, HEAD_DIM), overrides.get("dtype", cache.dtype))
  slots = jnp.asarray(overrides.get("slots", [0, 1]), jnp.int32)
  with pytest.raises(ValueError, match=message):
    kv_cache.write_kv(cache, overrides.get("layer", 0), rows, rows, slots)


COPY_ERRORS = {
  "src range": ([(12, 0)], 4, "copy plan entry 0: src block 12 is out"),
  "dst range": ([(0, 1), (2, -1)], 4, "entry 1: dst block -1 is out"),
  "duplicate dst": ([(0, 1), (2, 1)], 4, "dst block 1 appears 2 times"),
  "overlap": ([(0, 1), (1, 2)], 4, "block 1 is both a source and a"),
}


@pytest.mark.parametrize("bad", COPY_ERRORS, ids=str)
def test_copy_blocks_checked_path_errors(bad):
  pairs, capacity, message = COPY_ERRORS[bad]
  with pytest.raises(ValueError, match=message):
    kv_cache.copy_blocks(random_cache(), make_plan(pairs, capacity))


@pytest.mark.parametrize(
  "plan,message",
  [
    (
      Plan(jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32), jnp.int32(3)),
      "count 3 is outside 0..2",
    ),
    (Plan(jnp.zeros(2), jnp.ones(2, jnp.int32), jnp.int32(1)), "plan.src must be int32"),
    (Plan(jnp.zeros(2, jnp.int32), jnp.ones(3, jnp.int32), jnp.int32(1)), "differ"),
    (
      Plan(jnp.zeros(2, jnp.int32), jnp.ones(2, jnp.int32), jnp.zeros(1, int)),
      "plan.count must be an int32 scalar",
    ),
  ],
)
def test_malformed_plans_raise(plan, message):
  with pytest.raises(ValueError, match=message):
    kv_cache.copy_blocks(random_cache(), plan)


def test_unknown_impl_raises():
  cache = random_cache()
  with pytest.raises(ValueError, match="impl must be one of"):
    kv_cache.copy_blocks(cache, make_plan([(0, 1)], 2), impl="triton")


def decode_inputs(seed=0):
  """Two sequences on CFG's cache: q, block tables and lengths."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((2, 4, HEAD_DIM)), jnp.float32)
  tables = jnp.asarray([[3, 9, -1, -1], [6, 1, 8, -1]], jnp.int32)
  lengths = jnp.asarray([13, 17], jnp.int32)
  return q, tables, lengths


def test_attention_dispatch_on_cpu():
  cache = random_cache()
  q, tables, lengths = decode_inputs()
  args = (q, *cache.pages(0), tables, lengths)
  run = jax.jit(attention.paged_attention, static_argnames=("soft_cap", "impl"))
  expected = jax.jit(paged_attention_reference, static_argnames="soft_cap")(*args, soft_cap=9.0)
  auto = run(*args, soft_cap=9.0, impl="auto")  # the C++ kernel where it builds
  np.testing.assert_allclose(auto, expected, atol=1e-6)
  with kernel_choice.use_cpu_kernel(False):  # the chunked XLA path: the reference's sums
    chunked = jax.jit(attention.paged_attention, static_argnames="soft_cap")(*args, soft_cap=9.0)
  np.testing.assert_array_equal(np.asarray(chunked), np.asarray(expected))
  pallas = run(*args, soft_cap=9.0, impl="pallas")
  interpreted = jax.jit(gpu.paged_attention, static_argnames=("soft_cap", "interpret"))(
    *args, soft_cap=9.0, interpret=True
  )
  np.testing.assert_array_equal(np.asarray(pallas), np.asarray(interpreted))
  np.testing.assert_allclose(pallas, expected, atol=1e-5)


def test_prefill_dispatch_matches_the_reference():
  cache = random_cache()
  q, tables, lengths = decode_inputs()
  q = jnp.stack([q, 2 * q, -q], axis=1)
  query_lens = jnp.asarray([3, 2], jnp.int32)
  args = (q, *cache.pages(1), tables, lengths, query_lens)
  got = jax.jit(attention.paged_prefill_attention, static_argnames="sliding_window")(
    *args, sliding_window=5
  )
  want = jax.jit(paged_prefill_attention_reference, static_argnames="sliding_window")(
    *args, sliding_window=5
  )
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prefill", [False, True])
def test_attention_checked_path_rejects_out_of_range_tables(prefill):
  cache = random_cache()
  q, tables, lengths = decode_inputs()
  tables = tables.at[1, 2].set(CFG.num_gpu_blocks)
  args = (q, *cache.pages(0), tables, lengths)
  with pytest.raises(ValueError, match=r"block_tables\[1, 2\] = 12"):
    if prefill:
      attention.paged_prefill_attention(q[:, None], *args[1:], jnp.ones(2, jnp.int32))
    else:
      attention.paged_attention(*args)


@pytest.mark.parametrize(
  "dtype,attention_impl",
  [
    ("float32", "reference"),
    ("int8", "reference"),
    ("bfloat16", "reference"),
    ("bfloat16", "auto"),  # on CPU the chunked loop, which reads the pages in every chunk
    ("float8_e4m3fn", "reference"),
  ],
)
def test_decode_step_updates_the_cache_in_place(dtype, attention_impl):
  """copy_blocks, then write_kv and paged_attention per layer, jitted with
  the cache donated, hold no second copy of the cache, scales included
  (reference copies and writes; on the CPU backend bfloat16 and fp8 pages
  are bits, which XLA:CPU scatters into and gathers from in place)."""
  cfg = CacheConfig(
    block_size=8, num_gpu_blocks=512, num_cpu_blocks=16, max_seqs=4, max_blocks_per_seq=4
  )
  if dtype == "int8":
    cache = kv_cache.KVCache.create(cfg, LAYERS, KV_HEADS, HEAD_DIM, dtype=dtype)  # only lowered
  else:
    cache = random_cache(cfg, dtype)
  q, tables, lengths = decode_inputs()
  values = jnp.float32 if cache.quantized else cache.dtype  # what write_kv and attention take
  q = q.astype(values)
  new_k = jnp.ones((2, KV_HEADS, HEAD_DIM), values)
  slots = jnp.asarray([9 * 8 + 4, 8 * 8 + 0], jnp.int32)
  plan = make_plan([(20, 9)], capacity=4)  # copy-on-write of seq 0's block

  def step(cache, plan, new_k, slots, q, tables, lengths):
    cache = kv_cache.copy_blocks(cache, plan, impl="reference")
    outputs = []
    for layer in range(cache.num_layers):
      cache = kv_cache.write_kv(cache, layer, new_k, -new_k, slots, impl="reference")
      outputs.append(
        attention.paged_attention(
          q,
          *cache.pages(layer),
          tables,
          lengths,
          impl=attention_impl,
          **cache.scales(layer),
        )
      )
    return cache, outputs

  compiled = (
    jax.jit(step, donate_argnums=0).lower(cache, plan, new_k, slots, q, tables, lengths).compile()
  )
  memory = compiled.memory_analysis()
  assert memory.temp_size_in_bytes < 0.1 * cache.nbytes
  assert memory.alias_size_in_bytes == cache.nbytes + cache.host_nbytes
