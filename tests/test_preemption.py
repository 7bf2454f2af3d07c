"""End-to-end preemption by swapping: block manager, KV cache, attention.

Four sequences decode one token per step. In the preempted run an idle
sequence holds most of the device blocks, so the others do not fit at once:
when ``append_slots`` runs out of blocks, the last running group is swapped
out to host memory (vLLM's preemption by swapping), the others decode into
the device blocks it freed, and the group is swapped back in once
``can_swap_in`` allows it. Sequences 2 and 3 are a forked pair: they share
blocks, copy-on-write their shared last block and move between the pools
together.

Every token's K/V and query are a fixed random function of (sequence,
position, layer), so the uninterrupted run (same cache, no idle sequence, no
preemption) must give the same attention output for every sequence at every
position, and that run must match dense attention over the tokens' K/V
(which catches what both runs share, copy-on-write for one). Device and host
pages start as NaN, so a stale or misplaced byte would show.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj

BLOCK_SIZE = 4
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 16
MAX_TOKENS = 32  # per sequence

# Groups in admission order; preemption takes the last one still running.
GROUPS = ((0,), (1,), (2, 3))
PROMPT_LENS = {0: 5, 1: 3, 2: 6}  # sequence 3 is forked from 2 after prefill
FORKS = {3: 2}
FINAL_LENS = {0: 15, 1: 9, 2: 20, 3: 17}
PROMPT_WIDTH = 8  # prompts are padded to this many tokens: one compile
IDLE_SLOT = 4  # holds IDLE_BLOCKS device blocks in the preempted run
IDLE_BLOCKS = 6  # leaves 10 blocks: too few for the four sequences at once
MAX_STEPS = 100  # far more than the longest sequence needs

CFG = pj.CacheConfig(
  block_size=BLOCK_SIZE,
  num_gpu_blocks=16,
  num_cpu_blocks=16,
  max_seqs=5,
  max_blocks_per_seq=MAX_TOKENS // BLOCK_SIZE,
  watermark=0.0,
)
BM = pj.BlockSpaceManager(CFG)


def prompt_len(seq: int) -> int:
  """Tokens of ``seq`` after prefill (a forked child has its parent's)."""
  return PROMPT_LENS[FORKS.get(seq, seq)]


def _random_table(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape, np.float32)


# Indexed by [sequence, position, layer]: K and V of the token, its query.
TOKEN_KV = _random_table(0, (len(FINAL_LENS), MAX_TOKENS, LAYERS, 2, KV_HEADS, HEAD_DIM))
TOKEN_QUERY = _random_table(1, (len(FINAL_LENS), MAX_TOKENS, LAYERS, Q_HEADS, HEAD_DIM))


def token_kv(seq_ids, positions, layer, dtype):
  """K and V (``[..., KV_HEADS, HEAD_DIM]`` each) of the tokens at positions."""
  kv = jnp.asarray(TOKEN_KV)[seq_ids, positions, layer].astype(dtype)
  return kv[..., 0, :, :], kv[..., 1, :, :]


def token_query(seq_ids, positions, layer, dtype):
  """The query (``[..., Q_HEADS, HEAD_DIM]``) of the tokens at positions."""
  return jnp.asarray(TOKEN_QUERY)[seq_ids, positions, layer].astype(dtype)


def dense_attention(seq: int, position: int, dtype) -> np.ndarray:
  """Attention of ``seq``'s query at ``position`` over its contiguous K/V.

  The independent oracle: tokens before the prompt's end of a forked child
  are its parent's. Inputs are rounded to ``dtype``, the math is float32.

  Returns:
    ``[LAYERS, Q_HEADS, HEAD_DIM]`` float32.
  """
  positions = np.arange(position + 1)
  owners = np.where(positions < prompt_len(seq), FORKS.get(seq, seq), seq)
  kv = _rounded(TOKEN_KV[owners, positions], dtype)  # [T, L, 2, KV_HEADS, D]
  q = _rounded(TOKEN_QUERY[seq, position], dtype)  # [L, Q_HEADS, D]
  group = Q_HEADS // KV_HEADS
  k = np.repeat(kv[:, :, 0], group, axis=2)  # [T, LAYERS, Q_HEADS, D]
  v = np.repeat(kv[:, :, 1], group, axis=2)
  logits = np.einsum("lhd,tlhd->lht", q, k) / np.sqrt(HEAD_DIM)
  weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
  weights /= weights.sum(axis=-1, keepdims=True)
  return np.einsum("lht,tlhd->lhd", weights, v)


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
  """``x`` rounded to ``dtype``, as float32."""
  return x.astype(dtype).astype(np.float32)


def nan_cache(dtype) -> pj.KVCache:
  """A cache whose device and host pages all hold NaN."""
  cache = pj.KVCache.create(CFG, LAYERS, KV_HEADS, HEAD_DIM, dtype)

  def poison(pages):
    return tuple(
      jax.device_put(
        jax.lax.bitcast_convert_type(jnp.full(p.shape, jnp.nan, dtype), p.dtype), p.sharding
      )
      for p in pages
    )

  return cache.replace(
    k=poison(cache.k), v=poison(cache.v), k_host=poison(cache.k_host), v_host=poison(cache.v_host)
  )


@functools.partial(jax.jit, donate_argnums=1)
def prefill(state, cache, seq_id, num_tokens):
  """Allocates a prompt of ``num_tokens`` for ``seq_id`` and writes its K/V.

  Args:
    state: the block manager's state.
    cache: the KV cache (donated).
    seq_id: int32 scalar.
    num_tokens: int32 scalar, at most ``PROMPT_WIDTH``.

  Returns:
    The new state and cache, and ``allocate``'s status.
  """
  seq_ids = seq_id[None]
  positions = jnp.arange(PROMPT_WIDTH, dtype=jnp.int32)
  state, result = BM.allocate(state, seq_ids, positions, num_tokens)
  slots = BM.get_slot_mapping(state, seq_ids, num_tokens[None], width=PROMPT_WIDTH)[0]
  for layer in range(LAYERS):
    k, v = token_kv(seq_id, positions, layer, cache.dtype)
    cache = pj.write_kv(cache, layer, k, v, slots)
  return state, cache, result.status


@functools.partial(jax.jit, donate_argnums=1)
def decode_step(state, cache, seq_ids):
  """One new token for every sequence in ``seq_ids``, attended at every layer.

  Copy-on-write runs before the writes. When ``append_slots`` fails, its
  state comes back unchanged and no slot is written.

  Args:
    state: the block manager's state.
    cache: the KV cache (donated).
    seq_ids: ``int32[max_seqs]``, -1 for slots that do not decode.

  Returns:
    The new state and cache, the attention outputs ``[LAYERS, max_seqs,
    Q_HEADS, HEAD_DIM]``, ``append_slots``'s status and its copy count.
  """
  positions = BM.get_num_tokens(state, seq_ids)
  state, cow = BM.append_slots(state, seq_ids, positions[:, None], (seq_ids >= 0).astype(jnp.int32))
  cache = pj.copy_blocks(cache, cow)
  slots = BM.get_slot_mapping(state, seq_ids, jnp.ones_like(seq_ids), width=1)[:, 0]
  slots = jnp.where(cow.status == pj.Status.OK, slots, -1)
  tables = BM.get_block_tables(state, seq_ids)
  lengths = BM.get_num_tokens(state, seq_ids)
  outputs = []
  for layer in range(LAYERS):
    k, v = token_kv(seq_ids, positions, layer, cache.dtype)
    cache = pj.write_kv(cache, layer, k, v, slots)
    q = token_query(seq_ids, positions, layer, cache.dtype)
    outputs.append(pj.paged_attention(q, *cache.pages(layer), tables, lengths))
  return state, cache, jnp.stack(outputs), cow.status, cow.count


allocate = jax.jit(BM.allocate)
fork = jax.jit(BM.fork)
free = jax.jit(BM.free)
plan_swap_out = jax.jit(BM.swap_out)
plan_swap_in = jax.jit(BM.swap_in)
can_append_slots = jax.jit(BM.can_append_slots)
can_swap_in = jax.jit(BM.can_swap_in)
block_tables = jax.jit(BM.get_block_tables)


def _ids(seqs) -> jax.Array:
  """``int32[max_seqs]``: entry ``i`` is ``i`` if ``seqs`` holds it, else -1.

  One shape for every call, so each jitted function compiles once.
  """
  return jnp.asarray([i if i in seqs else -1 for i in range(CFG.max_seqs)], jnp.int32)


class Scheduler:
  """A small vLLM-style scheduler that preempts by swapping.

  Each step decodes one token for every running sequence. When
  ``append_slots`` runs out of blocks (and ``can_append_slots`` agrees), the
  last running group is swapped out and the step is retried; after a step without
  preemption the first swapped group comes back once ``can_swap_in`` allows it.

  Attributes:
    outputs: ``(seq, position) -> [LAYERS, Q_HEADS, HEAD_DIM]`` float32, the
      attention output of the query at that position.
    swapped_out: the groups preempted, in order.
    shared_swapped: table entries that a swap-out did not move because
      another entry of the group already moved the same block.
    reused: device blocks that a swap-out freed and another sequence wrote
      into while the group was on the host.
    resumed: per swapped-in sequence, the positions it decoded afterwards.
    copies: copy-on-write copies executed.
  """

  def __init__(self, dtype, *, idle_blocks: int):
    self.cache = nan_cache(dtype)
    # Committed where the cache lives, as every jitted step returns it.
    self.state = jax.device_put(BM.init(), self.cache.device_sharding)
    self.idle_blocks = idle_blocks
    if idle_blocks:
      idle_tokens = idle_blocks * BLOCK_SIZE
      self.state, result = allocate(
        self.state, _ids([IDLE_SLOT]), jnp.zeros(idle_tokens, jnp.int32), idle_tokens
      )
      assert result.status == pj.Status.OK
    for seq, num_tokens in PROMPT_LENS.items():
      self.state, self.cache, status = prefill(
        self.state, self.cache, jnp.int32(seq), jnp.int32(num_tokens)
      )
      assert status == pj.Status.OK
    for child, parent in FORKS.items():
      self.state, result = fork(self.state, parent, child)
      assert result.status == pj.Status.OK
    self.running = [list(group) for group in GROUPS]
    self.swapped = []
    self.lengths = {seq: prompt_len(seq) for seq in FINAL_LENS}
    self.outputs, self.swapped_out, self.shared_swapped = {}, [], 0
    self.reused, self.resumed, self.copies = set(), {}, 0
    self._freed_by_swap = {}

  def run(self) -> Scheduler:
    """Steps until every sequence reached its final length, then frees all."""
    for _ in range(MAX_STEPS):
      if not (self.running or self.swapped):
        break
      self.step()
    else:
      raise AssertionError(f"not finished after {MAX_STEPS} steps")
    if self.idle_blocks:
      self.state, result = free(self.state, _ids([IDLE_SLOT]))
      assert result.status == pj.Status.OK
    pj.check_invariants(self.state)
    assert int(BM.num_free_gpu_blocks(self.state)) == CFG.num_gpu_blocks
    assert int(BM.num_free_cpu_blocks(self.state)) == CFG.num_cpu_blocks
    return self

  def step(self) -> None:
    """Decodes the running sequences (preempting as needed), then swaps in."""
    preempted = False
    while self.running:
      decoding = [seq for group in self.running for seq in group]
      state, self.cache, outputs, status, copies = decode_step(
        self.state, self.cache, _ids(decoding)
      )
      if status != pj.Status.OUT_OF_BLOCKS:
        assert status == pj.Status.OK
        self.state, self.copies = state, self.copies + int(copies)
        self._record(decoding, np.asarray(outputs, np.float32))
        break
      assert not can_append_slots(self.state, _ids(decoding))
      assert len(self.running) > 1, "a lone group ran out of device blocks"
      self._swap_out(self.running.pop())
      preempted = True
    if (
      self.swapped
      and not preempted
      and can_swap_in(self.state, _ids(self.swapped[0])) == pj.AllocStatus.OK
    ):
      self._swap_in(self.swapped.pop(0))
    assert self.running or not self.swapped, "swapped groups cannot return"

  def _record(self, decoding, outputs) -> None:
    """Keeps the step's outputs and reused blocks; frees finished sequences."""
    for seq in decoding:
      self.outputs[seq, self.lengths[seq]] = outputs[:, seq]
      if seq in self.resumed:
        self.resumed[seq].append(self.lengths[seq])
      self.lengths[seq] += 1
    held = set(np.asarray(block_tables(self.state, _ids(decoding))).ravel())
    for freed in self._freed_by_swap.values():
      self.reused |= freed & held
    done = [seq for seq in decoding if self.lengths[seq] == FINAL_LENS[seq]]
    if done:
      self.state, result = free(self.state, _ids(done))
      assert result.status == pj.Status.OK
      self.running = [
        group
        for group in ([seq for seq in group if seq not in done] for group in self.running)
        if group
      ]

  def _swap_out(self, group) -> None:
    entries = np.asarray(block_tables(self.state, _ids(group)))
    self.state, plan = plan_swap_out(self.state, _ids(group))
    assert plan.status == pj.Status.OK
    self.cache = pj.swap_out(self.cache, plan)
    freed = set(np.asarray(plan.src)[: int(plan.count)].tolist())
    self.shared_swapped += int((entries >= 0).sum()) - len(freed)
    self._freed_by_swap[tuple(group)] = freed
    self.swapped.append(group)
    self.swapped_out.append(tuple(group))

  def _swap_in(self, group) -> None:
    self.state, plan = plan_swap_in(self.state, _ids(group))
    assert plan.status == pj.Status.OK
    self.cache = pj.swap_in(self.cache, plan)
    del self._freed_by_swap[tuple(group)]
    self.running.append(group)
    for seq in group:
      self.resumed.setdefault(seq, [])


@pytest.fixture(
  scope="module",
  params=[pytest.param(jnp.float32, id="float32"), pytest.param(jnp.bfloat16, id="bfloat16")],
)
def runs(request) -> tuple[Scheduler, Scheduler]:
  """The preempted and the uninterrupted run, for one dtype."""
  return (
    Scheduler(request.param, idle_blocks=IDLE_BLOCKS).run(),
    Scheduler(request.param, idle_blocks=0).run(),
  )


def test_every_output_matches_the_uninterrupted_run(runs):
  preempted, uninterrupted = runs
  expected_keys = {
    (seq, position)
    for seq, final in FINAL_LENS.items()
    for position in range(prompt_len(seq), final)
  }
  assert set(preempted.outputs) == set(uninterrupted.outputs) == expected_keys
  for key, want in uninterrupted.outputs.items():
    assert np.isfinite(want).all(), key
    np.testing.assert_allclose(
      preempted.outputs[key], want, rtol=0, atol=1e-6, equal_nan=False, err_msg=str(key)
    )


def test_uninterrupted_run_matches_dense_attention(runs):
  _, uninterrupted = runs
  dtype = uninterrupted.cache.dtype
  atol = 1e-5 if dtype == jnp.float32 else 1e-2
  for (seq, position), got in uninterrupted.outputs.items():
    np.testing.assert_allclose(
      got, dense_attention(seq, position, dtype), rtol=0, atol=atol, err_msg=str((seq, position))
    )


def test_the_forked_pair_was_swapped_out_overwritten_and_resumed(runs):
  preempted, uninterrupted = runs
  assert uninterrupted.swapped_out == [] and uninterrupted.resumed == {}
  assert (2, 3) in preempted.swapped_out
  assert preempted.shared_swapped > 0, "no shared block was swapped"
  assert preempted.reused, "no freed device block was reused while swapped"
  for seq in (2, 3):
    assert preempted.resumed[seq], f"seq {seq} never decoded after swap-in"
  assert preempted.copies >= 1 and uninterrupted.copies >= 1
