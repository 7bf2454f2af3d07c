"""Swap space: swap_out/swap_in between device pages and pinned host pages.

Plans are built by hand here, the way the block manager builds them (a block
shared by several tables moves once); the lead's end-to-end tests drive these
ops with the real manager.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import kv_cache, kv_swap
from paged_jax.config import CacheConfig
from pallas_kernels.paged_attention import paged_attention_reference

CFG = CacheConfig(
  block_size=8, num_gpu_blocks=16, num_cpu_blocks=8, max_seqs=4, max_blocks_per_seq=4
)
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 64
attend = jax.jit(paged_attention_reference)


class Plan(NamedTuple):
  """A SwapPlan/CopyPlan stand-in: the fields the cache ops read."""

  src: jax.Array
  dst: jax.Array
  count: jax.Array


def make_plan(pairs, capacity=8):
  pairs = list(pairs)
  src = np.full(capacity, -1, np.int32)
  dst = np.full(capacity, -1, np.int32)
  for i, (source, target) in enumerate(pairs):
    src[i], dst[i] = source, target
  return Plan(jnp.asarray(src), jnp.asarray(dst), jnp.int32(len(pairs)))


def random_cache(dtype, cfg=CFG, seed=0):
  """A cache whose device and host pages all hold random data."""
  cache = kv_cache.KVCache.create(cfg, LAYERS, KV_HEADS, HEAD_DIM, dtype)
  rng = np.random.default_rng(seed)

  def fill(pages):
    # Host pages (and on the CPU backend narrow float device pages) hold bit
    # patterns: random floats viewed as their bits.
    return tuple(
      jax.device_put(rng.standard_normal(p.shape).astype(dtype).view(p.dtype), p.sharding)
      for p in pages
    )

  return cache.replace(
    k=fill(cache.k), v=fill(cache.v), k_host=fill(cache.k_host), v_host=fill(cache.v_host)
  )


def device_pages(cache):
  """Every layer's device K, then V, as floats."""
  layers = [cache.pages(layer) for layer in range(cache.num_layers)]
  return [np.asarray(k) for k, _ in layers] + [np.asarray(v) for _, v in layers]


def host_pages(cache):
  """Every layer's host K, then V, as floats."""
  layers = [cache.host_pages(layer) for layer in range(cache.num_layers)]
  return [np.asarray(k) for k, _ in layers] + [np.asarray(v) for _, v in layers]


def write_tokens(cache, layer_rows, slots):
  """Writes one row per slot into every layer (K = rows, V = -rows)."""
  for layer in range(cache.num_layers):
    rows = layer_rows[layer]
    cache = kv_cache.write_kv(cache, layer, rows, -rows, slots)
  return cache


def attention_of(cache, q, tables, lengths):
  tables, lengths = jnp.asarray(tables, jnp.int32), jnp.asarray(lengths, jnp.int32)
  return [
    np.asarray(attend(q, *cache.pages(layer), tables, lengths)) for layer in range(cache.num_layers)
  ]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_preemption_round_trip_is_bitwise(dtype):
  """A forks B, B copies-on-write its last block; C shares A's first block.

  Swap out {A, B} (4 distinct blocks, the shared ones once), let D overwrite
  the freed device blocks, swap back into other blocks: A's and B's pages and
  attention outputs are bitwise what they were, and C never notices.
  """
  rng = np.random.default_rng(1)
  cache = random_cache(dtype)
  a_table, c_table = [3, 7, 5, -1], [3, 11, -1, -1]
  # Fork: B shares A's table; its next token copies block 5 into block 9.
  cache = kv_cache.copy_blocks(cache, make_plan([(5, 9)], capacity=2))
  b_table = [3, 7, 9, -1]
  new_rows = rng.standard_normal((LAYERS, 2, KV_HEADS, HEAD_DIM)).astype(dtype)
  cache = write_tokens(cache, new_rows, jnp.asarray([5 * 8 + 4, 9 * 8 + 4], jnp.int32))
  tables, lengths = [a_table, b_table, c_table], [21, 21, 12]
  q = jnp.asarray(rng.standard_normal((3, 4, HEAD_DIM)), dtype)
  before = attention_of(cache, q, tables, lengths)
  moved = [3, 7, 5, 9]
  pages_before = [p[:, moved] for p in device_pages(cache)]

  cache = kv_swap.swap_out(cache, make_plan(zip(moved, [4, 0, 6, 2])))
  for pages, want in zip(host_pages(cache), pages_before):
    np.testing.assert_array_equal(pages[:, [4, 0, 6, 2]], want)
  # D takes the freed blocks 9, 5, 7 and fills them with new tokens.
  reused = np.array([9, 5, 7])
  d_slots = (reused[:, None] * 8 + np.arange(8)).reshape(-1).astype(np.int32)
  d_rows = rng.standard_normal((LAYERS, d_slots.size, KV_HEADS, HEAD_DIM)).astype(dtype)
  cache = write_tokens(cache, d_rows, jnp.asarray(d_slots))
  c_after = attention_of(cache, q[2:], [c_table], [12])
  for got, want in zip(c_after, before):
    np.testing.assert_array_equal(got, want[2:])

  cache = kv_swap.swap_in(cache, make_plan(zip([4, 0, 6, 2], [12, 13, 14, 15])))
  for pages, want in zip(device_pages(cache), pages_before):
    np.testing.assert_array_equal(pages[:, [12, 13, 14, 15]], want)
  swapped_tables = [[12, 13, 14, -1], [12, 13, 15, -1], c_table]
  after = attention_of(cache, q, swapped_tables, lengths)
  for got, want in zip(after, before):
    np.testing.assert_array_equal(got, want)


def test_pages_stay_in_their_memory_kinds_and_types():
  cache = random_cache(jnp.bfloat16)
  cache = kv_swap.swap_out(cache, make_plan([(1, 2)]))
  cache = kv_swap.swap_in(cache, make_plan([(2, 3)]))
  host = cache.k_host + cache.v_host
  assert {p.sharding.memory_kind for p in host} == {"pinned_host"}
  assert {p.dtype for p in host} == {jnp.dtype(jnp.uint16)}
  assert {p.sharding.memory_kind for p in cache.k + cache.v} == {"device"}
  # Bits on the CPU backend (see test_kv_cache), floats elsewhere.
  stored = jnp.uint16 if jax.default_backend() == "cpu" else jnp.bfloat16
  assert {p.dtype for p in cache.k + cache.v} == {jnp.dtype(stored)}
  assert {p.dtype for p in cache.pages(0) + cache.pages(1)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("swap", [kv_swap.swap_out, kv_swap.swap_in], ids=["out", "in"])
def test_count_zero_is_a_no_op(swap):
  cache = random_cache(jnp.float32)
  before = device_pages(cache) + host_pages(cache)
  stale = make_plan([(1, 2), (3, 4)])
  cache = swap(cache, stale._replace(count=jnp.int32(0)))
  after = device_pages(cache) + host_pages(cache)
  for got, want in zip(after, before):
    np.testing.assert_array_equal(got, want)


SWAP_ERRORS = [
  (
    kv_swap.swap_out,
    [(16, 0)],
    "swap_out plan entry 0: src block 16 is out"
    r" of range 0..15",
  ),
  (
    kv_swap.swap_out,
    [(0, 1), (2, 8)],
    "entry 1: dst block 8 is out of"
    r" range 0..7",
  ),
  (kv_swap.swap_in, [(8, 0)], "swap_in plan entry 0: src block 8"),
  (kv_swap.swap_in, [(0, 16)], "dst block 16 is out of range 0..15"),
  (kv_swap.swap_out, [(0, 1), (2, 1)], "dst block 1 appears 2 times"),
  (kv_swap.swap_in, [(0, 1), (-1, 2)], "src block -1 is out of range"),
]


@pytest.mark.parametrize("swap,pairs,message", SWAP_ERRORS)
def test_out_of_range_plans_raise_before_donating(swap, pairs, message):
  cache = random_cache(jnp.float32)
  with pytest.raises(ValueError, match=message):
    swap(cache, make_plan(pairs))
  assert not any(p.is_deleted() for p in cache.k + cache.k_host)


def test_count_beyond_capacity_raises():
  plan = make_plan([(0, 1)], capacity=2)._replace(count=jnp.int32(3))
  with pytest.raises(ValueError, match="count 3 is outside 0..2"):
    kv_swap.swap_out(random_cache(jnp.float32), plan)


@pytest.mark.parametrize(
  "swap,dtype",
  [
    (kv_swap._swap_out, jnp.float32),
    (kv_swap._swap_in, jnp.float32),
    # Bits on both sides on the CPU backend (see kv_cache).
    (kv_swap._swap_out, jnp.bfloat16),
    (kv_swap._swap_in, jnp.bfloat16),
  ],
  ids=["out", "in", "out-bfloat16", "in-bfloat16"],
)
def test_swap_memory_follows_the_plan_not_the_cache(swap, dtype):
  """In place, and temporaries of the planned blocks only, whatever the cache
  size: one staging buffer of the plan's capacity (on each side at most)."""
  capacity = 4
  plan = make_plan([(1, 2)], capacity)
  temps = []
  for num_blocks in (64, 256):
    cfg = CacheConfig(
      block_size=8,
      num_gpu_blocks=num_blocks,
      num_cpu_blocks=num_blocks,
      max_seqs=4,
      max_blocks_per_seq=4,
    )
    cache = kv_cache.KVCache.create(cfg, LAYERS, KV_HEADS, HEAD_DIM, dtype)
    compiled = kv_swap._jitted_for(cache, swap).lower(cache, *plan).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes == cache.nbytes + cache.host_nbytes
    temps.append(memory.temp_size_in_bytes)
  staged_bytes = 2 * LAYERS * KV_HEADS * capacity * 8 * HEAD_DIM * jnp.dtype(dtype).itemsize
  assert temps[0] == temps[1] <= 2 * staged_bytes + 1024


def test_swaps_compose_inside_a_jitted_step():
  cache = random_cache(jnp.bfloat16)
  want = np.asarray(cache.pages(1)[1])[:, 3]

  def step(cache, out_plan, in_plan):
    return kv_swap.swap_in(kv_swap.swap_out(cache, out_plan), in_plan)

  cache = jax.jit(step, donate_argnums=0)(cache, make_plan([(3, 6)]), make_plan([(6, 10)]))
  np.testing.assert_array_equal(np.asarray(cache.host_pages(1)[1])[:, 6], want)
  np.testing.assert_array_equal(np.asarray(cache.pages(1)[1])[:, 10], want)
  assert cache.v_host[1].sharding.memory_kind == "pinned_host"
