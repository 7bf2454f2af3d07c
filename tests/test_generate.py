"""Paged generation against the dense cache: logits, greedy tokens, stats."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import models
from paged_jax.block_manager import manager
from paged_jax.generate import Request, SamplingParams, generate
from paged_jax.models.dense import generate_dense, sample_tokens
from paged_jax.paged_cache import PagedCache

CONFIG = models.LlamaConfig(
  vocab_size=61,
  num_layers=2,
  num_q_heads=4,
  num_kv_heads=2,
  head_dim=8,
  hidden=32,
  mlp_hidden=48,
  max_seq_len=64,
  tie_embeddings=False,
)
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def model():
  return models.Llama(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def requests():
  """Ragged random prompts; three share a 20-token prefix; some ask n=4."""
  rng = np.random.default_rng(1)
  shared = rng.integers(0, CONFIG.vocab_size, 20)
  prompts = [rng.integers(0, CONFIG.vocab_size, rng.integers(2, 18)) for _ in range(3)]
  prompts += [np.concatenate([shared, rng.integers(0, CONFIG.vocab_size, n)]) for n in (1, 5, 9)]
  return [Request(p.astype(np.int32), n=4 if i % 2 else 1) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def dense_outputs(model, requests):
  return generate_dense(model, [r.prompt for r in requests], GREEDY, jax.random.key(0))


def _jitted_forward(model):
  graphdef, state = nnx.split(model)
  return jax.jit(
    lambda state, tokens, positions, cache: nnx.merge(graphdef, state)(tokens, positions, cache)
  ).__get__(state)


def _allocated_prompts(rng, lengths):
  """Random prompts of `lengths` (at most 12) in slots 0, 1, ..., allocated
  on a fresh manager: `(manager, state, tokens, positions, NaN pages)`."""
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=32, num_cpu_blocks=0, max_seqs=3, max_blocks_per_seq=4
  )
  bm = pj.BlockSpaceManager(cfg)
  # Jitted: eagerly each manager op runs op by op (seconds per call).
  allocate = jax.jit(bm.allocate)
  state = bm.init()
  tokens = np.zeros((len(lengths), 12), np.int32)
  for row, length in enumerate(lengths):
    tokens[row, :length] = rng.integers(0, CONFIG.vocab_size, length)
    state, _ = allocate(state, jnp.array([row]), tokens[row], int(length))
  positions = np.where(np.arange(12) < lengths[:, None], np.arange(12), -1)
  kv = pj.KVCache.create(
    cfg, CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, dtype=jnp.float32
  )
  kv = kv.replace(
    k=tuple(jnp.full_like(k, jnp.nan) for k in kv.k),
    v=tuple(jnp.full_like(v, jnp.nan) for v in kv.v),
  )
  return bm, state, tokens, positions, kv


def test_paged_logits_match_dense_for_prefill_and_decode(model):
  forward = _jitted_forward(model)
  rng = np.random.default_rng(2)
  lengths = np.array([7, 3, 12], np.int32)
  bm, state, tokens, positions, kv = _allocated_prompts(rng, lengths)
  append_slots = jax.jit(bm.append_slots)
  block_tables, slot_mapping = jax.jit(bm.get_block_tables), manager.jit_op(bm.get_slot_mapping)
  ids = jnp.arange(3, dtype=jnp.int32)
  paged = PagedCache(
    kv=kv,
    block_tables=block_tables(state, ids),
    slot_mapping=slot_mapping(state, ids, lengths, width=12),
  )
  dense = models.init_dense_cache(CONFIG, 3)
  paged_logits, paged = forward(tokens, positions, paged)
  dense_logits, dense = forward(tokens, positions, dense)
  real = positions >= 0
  np.testing.assert_allclose(paged_logits[real], dense_logits[real], atol=1e-5, rtol=0)

  next_tokens = rng.integers(0, CONFIG.vocab_size, (3, 1)).astype(np.int32)
  state, plan = append_slots(state, ids, next_tokens, jnp.ones(3, jnp.int32))
  assert int(plan.status) == pj.Status.OK
  paged = PagedCache(
    kv=paged.kv,
    block_tables=block_tables(state, ids),
    slot_mapping=slot_mapping(state, ids, jnp.ones(3, jnp.int32), width=1),
  )
  paged_logits, _ = forward(next_tokens, lengths[:, None], paged)
  dense_logits, _ = forward(next_tokens, lengths[:, None], dense)
  assert np.all(np.isfinite(paged_logits))
  np.testing.assert_allclose(paged_logits, dense_logits, atol=1e-5, rtol=0)


def test_a_packed_call_equals_one_row_per_sequence(model):
  # Prefill packs several sequences' tokens into one row (`query_tiles`):
  # the logits and the written pages must be those of one row each.
  forward = _jitted_forward(model)
  lengths, starts = np.array([7, 3, 12]), np.array([0, 7, 10])
  bm, state, tokens, positions, kv = _allocated_prompts(np.random.default_rng(3), lengths)
  tables = np.asarray(jax.jit(bm.get_block_tables)(state, jnp.arange(3, dtype=jnp.int32)))
  slots = np.where(positions >= 0, tables[np.arange(3)[:, None], positions // 4] * 4, -1)
  slots = np.where(positions >= 0, slots + positions % 4, -1).astype(np.int32)
  rows_cache = PagedCache(kv=kv, block_tables=tables, slot_mapping=slots)
  row_logits, rows_cache = forward(tokens, positions, rows_cache)

  # 22 tokens packed into 24, attending in 2 + 1 + 3 tiles of 4 (of 8).
  packed_tokens = np.zeros((1, 24), np.int32)
  packed_positions = np.full((1, 24), -1, np.int32)
  packed_slots = np.full((1, 24), -1, np.int32)
  tiles = np.full((8, 4), -1, np.int32)
  tile_tables = np.full((8, 4), -1, np.int32)
  tile = 0
  for row, (length, start) in enumerate(zip(lengths, starts)):
    packed_tokens[0, start : start + length] = tokens[row, :length]
    packed_positions[0, start : start + length] = positions[row, :length]
    packed_slots[0, start : start + length] = slots[row, :length]
    for offset in range(0, length, 4):
      cells = np.arange(start + offset, start + min(length, offset + 4))
      tiles[tile, : cells.size], tile_tables[tile] = cells, tables[row]
      tile += 1
  packed_cache = PagedCache(
    kv=kv, block_tables=tile_tables, slot_mapping=packed_slots, query_tiles=tiles
  )
  packed_logits, packed_cache = forward(packed_tokens, packed_positions, packed_cache)
  for row, (length, start) in enumerate(zip(lengths, starts)):
    np.testing.assert_allclose(
      packed_logits[0, start : start + length], row_logits[row, :length], atol=1e-5, rtol=0
    )
  pages = lambda cache: cache.kv.k + cache.kv.v
  for packed, per_row in zip(pages(packed_cache), pages(rows_cache)):
    np.testing.assert_allclose(packed, per_row, atol=1e-5, rtol=0)  # NaN where neither wrote


def test_a_ragged_call_equals_a_prompt_call_and_a_decode_call(model):
  # Decode tokens ride in a packed row where `decode_tokens` puts them: the
  # chunk's logits are its own call's, the decode tokens' a decode call's,
  # and the pages hold what both calls write.
  forward = _jitted_forward(model)
  lengths = np.array([7, 3, 12])
  bm, state, tokens, positions, kv = _allocated_prompts(np.random.default_rng(4), lengths)
  ids = jnp.arange(3, dtype=jnp.int32)
  tables = jax.jit(bm.get_block_tables)
  slot_mapping = manager.jit_op(bm.get_slot_mapping)
  prompt_tables, prompt_slots = tables(state, ids), slot_mapping(state, ids, lengths, width=12)
  prompts = PagedCache(kv=kv, block_tables=prompt_tables[:2], slot_mapping=prompt_slots[:2])
  kv = forward(tokens[:2], positions[:2], prompts)[1].kv  # sequences 0 and 1 decode next

  decoding = ids[:2]
  next_tokens = np.array([[5], [9]], np.int32)
  state, plan = jax.jit(bm.append_slots)(state, decoding, next_tokens, jnp.ones(2, jnp.int32))
  assert int(plan.status) == pj.Status.OK
  decode_tables = tables(state, decoding)
  decode_slots = slot_mapping(state, decoding, jnp.ones(2, jnp.int32), width=1)
  decode_positions = lengths[:2, None].astype(np.int32)
  decode = PagedCache(kv=kv, block_tables=decode_tables, slot_mapping=decode_slots)
  decode_logits, decode = forward(next_tokens, decode_positions, decode)
  chunk = PagedCache(kv=decode.kv, block_tables=prompt_tables[2:], slot_mapping=prompt_slots[2:])
  chunk_logits, apart = forward(tokens[2:], positions[2:], chunk)

  # One row: the 12-token chunk in 3 tiles of 4 (of 4), the 2 decode tokens
  # (the second sequence's first), 4 padding; a third decode row has no token.
  ragged_tokens = np.zeros((1, 18), np.int32)
  ragged_positions = np.full((1, 18), -1, np.int32)
  ragged_slots = np.full((1, 18), -1, np.int32)
  ragged_tokens[0, :12], ragged_positions[0, :12] = tokens[2], positions[2]
  ragged_slots[0, :12] = prompt_slots[2]
  ragged_tokens[0, 12:14] = next_tokens[::-1, 0]
  ragged_positions[0, 12:14] = decode_positions[::-1, 0]
  ragged_slots[0, 12:14] = decode_slots[::-1, 0]
  tiles = np.full((4, 4), -1, np.int32)
  tiles[:3] = np.arange(12).reshape(3, 4)
  no_table = np.full((1, decode_tables.shape[1]), -1, np.int32)
  ragged = PagedCache(
    kv=kv,
    block_tables=np.repeat(np.asarray(prompt_tables[2:]), 4, axis=0),
    slot_mapping=ragged_slots,
    query_tiles=tiles,
    decode_tables=np.concatenate([decode_tables, no_table]),
    decode_tokens=np.array([[13, 12, 18]], np.int32),
  )
  logits, ragged = forward(ragged_tokens, ragged_positions, ragged)
  np.testing.assert_allclose(logits[0, :12], chunk_logits[0], atol=1e-5, rtol=0)
  np.testing.assert_allclose(logits[0, 12:14], decode_logits[::-1, 0], atol=1e-5, rtol=0)
  pages = lambda cache: cache.kv.k + cache.kv.v
  for together, separately in zip(pages(ragged), pages(apart)):
    np.testing.assert_allclose(together, separately, atol=1e-5, rtol=0)  # NaN where neither wrote


# Over 10 s: each cache config compiles an engine. With prefix caching (its
# decode loop twice the size, 20 s of compiles) it is `slow`, for the full
# suite: in CI, test_structured_engine checks the prefix-cached engine's
# greedy tokens against its uncached run, which equals the dense model's.
@pytest.mark.parametrize("prefix_caching", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_greedy_paged_tokens_equal_dense(model, requests, dense_outputs, prefix_caching):
  # Without caching the GPU pool is tight, so the loop runs out of blocks
  # and the engine swaps sequences out and back in.
  block_size, tokens_per_seq = 16, 48
  pool_tokens = 160 if prefix_caching else 112
  cfg = pj.CacheConfig(
    block_size=block_size,
    num_gpu_blocks=pool_tokens // block_size + 2,
    num_cpu_blocks=256 // block_size,
    max_seqs=16,
    max_blocks_per_seq=tokens_per_seq // block_size,
    enable_prefix_caching=prefix_caching,
    watermark=0.0,
  )
  outputs, stats = generate(model, requests, cfg, GREEDY, jax.random.key(0))
  for request, expected, samples in zip(requests, dense_outputs, outputs):
    assert len(samples) == request.n
    for sample in samples:
      np.testing.assert_array_equal(sample, expected)
  assert stats.generated_tokens == sum(r.n for r in requests) * 8
  assert stats.prompt_tokens == sum(r.prompt.size for r in requests)
  if prefix_caching:
    # Requests admitted together prefill their shared blocks each (a hit
    # skips only blocks an earlier prefill computed: see test_engine).
    assert stats.prefill_tokens <= stats.prompt_tokens
    assert 0.0 < stats.prefix_cache_hit_rate <= 1.0
  else:
    assert stats.prefill_tokens == stats.prompt_tokens
    assert stats.prefix_cache_hit_rate == -1.0
    assert stats.preemptions > 0 and stats.swaps > 0
  assert stats.cow_copies > 0  # n=4 samples share a partial last block


# One cache for the short runs below, so that they share their programs.
SMALL_CFG = pj.CacheConfig(
  block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, max_seqs=4, max_blocks_per_seq=20
)


def test_eos_stops_a_sequence(model, requests, dense_outputs):
  eos = int(dense_outputs[0][2])
  sampling = SamplingParams(max_tokens=8, stop_token_ids=[eos])
  outputs, _ = generate(model, requests[:1], SMALL_CFG, sampling, jax.random.key(0))
  expected = dense_outputs[0][: list(dense_outputs[0]).index(eos) + 1]
  np.testing.assert_array_equal(outputs[0][0], expected)


@pytest.fixture(scope="module")
def random_logits():
  return jax.random.normal(jax.random.key(3), (64, 50)) * 3.0


def test_top_k_one_and_tiny_top_p_are_greedy(random_logits):
  greedy = np.argmax(random_logits, axis=-1)
  for params in (
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6),
  ):
    tokens = sample_tokens(random_logits, jax.random.key(4), params)
    np.testing.assert_array_equal(tokens, greedy)


def test_top_k_samples_stay_in_the_top_k(random_logits):
  params = SamplingParams(temperature=2.0, top_k=5)
  tokens = np.asarray(sample_tokens(random_logits, jax.random.key(5), params))
  top5 = np.argsort(-np.asarray(random_logits), axis=-1)[:, :5]
  assert all(t in row for t, row in zip(tokens, top5))
  assert len(set(tokens.tolist())) > 5 or np.any(tokens != top5[:, 0])


def test_top_p_samples_stay_in_the_nucleus(random_logits):
  params = SamplingParams(temperature=1.0, top_p=0.5)
  tokens = np.asarray(sample_tokens(random_logits, jax.random.key(6), params))
  probs = np.asarray(jax.nn.softmax(random_logits, axis=-1))
  for row, token in zip(probs, tokens):
    order = np.argsort(-row)
    before = np.cumsum(row[order]) - row[order]
    assert token in order[before < 0.5]


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
  ],
)
def test_bad_sampling_params_raise(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SamplingParams(**kwargs)


@pytest.mark.parametrize(
  "prompt, n, message",
  [
    (np.zeros(0, np.int32), 1, "must not be empty"),
    (np.zeros((2, 2), np.int32), 1, "1-D"),
    (np.ones(3, np.int32), 0, "n must be"),
  ],
)
def test_bad_requests_raise(prompt, n, message):
  with pytest.raises(ValueError, match=message):
    Request(prompt, n=n)


@pytest.mark.parametrize(
  "request_, message",
  [
    (Request(np.ones(3, np.int32), n=9), "n=9 sequences exceed max_num_seqs"),
    (Request(np.ones(40, np.int32)), "no room"),
    (Request(np.full(3, 99, np.int32)), "token id 99 is outside the vocabulary"),
  ],
)
def test_generate_rejects_requests_that_do_not_fit(model, request_, message):
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=16, num_cpu_blocks=0, max_seqs=8, max_blocks_per_seq=10
  )
  with pytest.raises(ValueError, match=message):
    generate(model, [request_], cfg, GREEDY, jax.random.key(0))


@pytest.mark.parametrize(
  "num_gpu_blocks, prompt, n, message",
  [
    # Each of 4 samples holds 20 prompt + 7 new tokens (7 blocks of 4); they
    # share the 5 full prompt blocks: 5 + 4 x 2.
    (2, 20, 4, r"needs 13 GPU blocks .* the cache has 2"),
    # 10 prompt tokens and 7 more need 5 blocks of 4.
    (3, 10, 1, r"needs 5 GPU blocks .* the cache has 3"),
  ],
)
def test_a_cache_too_small_for_one_sequence_fails_up_front(
  model, num_gpu_blocks, prompt, n, message
):
  cfg = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=num_gpu_blocks,
    num_cpu_blocks=16,
    max_seqs=4,
    max_blocks_per_seq=10,
    watermark=0.0,
  )
  with pytest.raises(ValueError, match="request 0: " + message):
    generate(model, [Request(np.ones(prompt, np.int32), n=n)], cfg, GREEDY, jax.random.key(0))


def test_generation_stops_at_the_models_positions(model, requests, dense_outputs):
  # 60 prompt tokens leave 4 of the model's 64 positions for new tokens.
  prompt = np.concatenate([requests[0].prompt, np.ones(60, np.int32)])[-60:]
  llm = pj.LLM(model, None, SMALL_CFG)
  (out,) = llm.generate([prompt], pj.SamplingParams(max_tokens=40))
  expected = generate_dense(model, [prompt], GREEDY, jax.random.key(0))[0]
  assert out.outputs[0].finish_reason == "length"
  np.testing.assert_array_equal(out.outputs[0].token_ids, expected[:4])
  assert llm.engine.stats.generated_tokens == 4


def test_paged_cache_rejects_a_slot_mapping_of_the_wrong_shape():
  cfg = pj.CacheConfig(block_size=4, num_gpu_blocks=4, num_cpu_blocks=0)
  kv = pj.KVCache.create(cfg, 1, 2, 8, dtype=jnp.float32)
  cache = PagedCache(
    kv=kv, block_tables=jnp.zeros((2, 4), jnp.int32), slot_mapping=jnp.zeros((2, 3), jnp.int32)
  )
  q = jnp.ones((2, 5, 4, 8))
  k = jnp.ones((2, 5, 2, 8))
  with pytest.raises(ValueError, match=r"slot_mapping shape \(2, 3\) must be"):
    cache.attend(0, q, k, k, jnp.zeros((2, 5), jnp.int32), sm_scale=1.0)
