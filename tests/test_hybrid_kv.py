"""Each attention type's layers read and write their pages through their own block tables.

Decoding past the window on a hybrid cache (a global layer between two
sliding ones), with a fork (copy-on-write on each type's pages) and a swap
out and in, every layer's paged attention equals dense attention over the
sequence's own keys: all of them for the global layer, the last `w` for a
sliding one, although the sliding type holds only the blocks of its window.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from paged_jax import hybrid_kv
from paged_jax.block_manager.arguments import jit_op
from paged_jax.block_manager.hybrid import HybridBlockSpaceManager, HybridCacheConfig
from paged_jax.config import CacheConfig, Status

WINDOW = 3
CFG = HybridCacheConfig(
  CacheConfig(
    block_size=2, num_gpu_blocks=24, num_cpu_blocks=12, max_seqs=4, max_blocks_per_seq=10,
    watermark=0.0,
  ),
  (WINDOW, None, WINDOW),
  gpu_blocks=(24, 9),
  cpu_blocks=(12, 6),
)  # fmt: skip
HEADS, KV_HEADS, DIM = 2, 1, 4


@functools.cache
def _op(name):
  return jit_op(getattr(HybridBlockSpaceManager(CFG), name))


def _dense(q, keys, values, window):
  """One query's attention over `keys` (the last `window` of them, if any)."""
  if window is not None:
    keys, values = keys[-window:], values[-window:]
  logits = np.einsum("hd,td->ht", q, keys[:, 0]) / np.sqrt(DIM)
  weights = np.exp(logits - logits.max(axis=1, keepdims=True))
  weights /= weights.sum(axis=1, keepdims=True)
  return np.einsum("ht,td->hd", weights, values[:, 0])


def _ok(result):
  assert Status(int(result.status)) == Status.OK, result
  return result


def test_each_type_reads_its_own_table_past_the_window():
  rng = np.random.default_rng(0)
  num_layers = len(CFG.layer_windows)
  cache = hybrid_kv.HybridKVCache.create(CFG, KV_HEADS, DIM, np.float32)
  assert [c.num_layers for c in cache.types] == [1, 2]
  assert [c.num_gpu_blocks for c in cache.types] == [24, 9]
  state = HybridBlockSpaceManager(CFG).init()
  pad = np.full(4, -1, np.int32)
  state, _ = _op("allocate")(state, np.array([0, 1, -1, -1], np.int32), np.zeros(1, np.int32), 0)
  history = {seq: [[] for _ in range(num_layers)] for seq in (0, 1)}  # (k, v) per layer
  for step in range(14):
    seqs = sorted(history)
    ids = np.concatenate([np.array(seqs, np.int32), pad])[:4]
    if step == 5:  # fork mid-block: the next append copies the shared block in each type
      state, res = _op("fork")(state, np.int32(0), np.int32(2))
      _ok(res)
      history[2] = [list(layer) for layer in history[0]]
      continue
    if step == 9:  # swap sequence 1 out and back in: each type moves its own blocks
      out_ids = np.array([1, -1, -1, -1], np.int32)
      state, res = _op("swap_out")(state, out_ids)
      cache = hybrid_kv.swap_out(cache, _ok(res))
      state, res = _op("swap_in")(state, out_ids)
      cache = hybrid_kv.swap_in(cache, _ok(res))
    state, res = _op("append_slots")(
      state, ids, np.ones((4, 1), np.int32), (ids >= 0).astype(np.int32)
    )
    cache = hybrid_kv.copy_blocks(cache, _ok(res))
    if step == 6:
      assert [int(r.count) for r in res.results] == [1, 1]  # the forked block, in each type
    slots = _op("get_slot_mapping")(state, ids, np.ones(4, np.int32), width=1)
    tables = _op("get_block_tables")(state, ids)
    lengths = np.asarray(_op("get_num_tokens")(state, ids))
    sliding_held = (np.asarray(tables[1])[: len(seqs)] >= 0).sum(axis=1)
    assert sliding_held.max() <= -(-WINDOW // 2) + 1, sliding_held
    q = rng.standard_normal((4, HEADS, DIM)).astype(np.float32)
    for layer in range(num_layers):
      k, v = rng.standard_normal((2, 4, 1, KV_HEADS, DIM)).astype(np.float32)
      cache = hybrid_kv.write_kv(cache, layer, k, v, slots)
      out = np.asarray(hybrid_kv.attend(cache, layer, q, tables, lengths, impl="reference"))
      for row, seq in enumerate(seqs):
        history[seq][layer].append((k[row, 0], v[row, 0]))
        keys, values = (np.stack(x) for x in zip(*history[seq][layer]))
        want = _dense(q[row], keys, values, CFG.layer_windows[layer])
        np.testing.assert_allclose(out[row], want, rtol=1e-5, atol=1e-5, err_msg=(step, layer))
  assert lengths[:3].tolist() == [13, 13, 13]  # the child has the 5 tokens of its parent


def test_a_layer_the_model_does_not_have_is_refused():
  cache = hybrid_kv.HybridKVCache.create(CFG, KV_HEADS, DIM, np.float32)
  assert cache.locate(2) == (1, 1)
  with pytest.raises(ValueError, match=r"layer 3: the model declares layers 0..2"):
    cache.pages(3)


def test_a_drafts_layers_sit_in_their_types_pages_after_the_targets():
  # A draft of a global layer and a window-3 one, with other heads and head size.
  cache = hybrid_kv.HybridKVCache.create(CFG, KV_HEADS, DIM, np.float32)
  draft_cfg = dataclasses.replace(CFG, layer_windows=(None, WINDOW))
  both = cache.stacked(hybrid_kv.HybridKVCache.create(draft_cfg, 2, 8, np.float32))
  assert both.num_layers == 5 and [c.num_layers for c in both.types] == [2, 3]
  assert [both.locate(layer) for layer in range(5)] == [(1, 0), (0, 0), (1, 1), (0, 1), (1, 2)]
  draft = both.layers(3)  # the view a draft's call takes: its layer 0 is layer 3
  assert draft.num_layers == 2 and draft.locate(1) == (1, 2)
  rng = np.random.default_rng(1)
  k, v = rng.standard_normal((2, 1, 1, 2, 8)).astype(np.float32)
  slots = (np.array([[5]], np.int32), np.array([[3]], np.int32))  # one slot per type
  written = both.with_layers(3, hybrid_kv.write_kv(draft, 1, k, v, slots))
  assert written.first_layer == 0 and written.num_layers == 5
  k_pages, v_pages = written.pages(4)  # [heads, blocks, block_size, head_dim]
  np.testing.assert_array_equal(k_pages[:, 1, 1], k[0, 0])
  np.testing.assert_array_equal(v_pages[:, 1, 1], v[0, 0])
  for layer in range(4):  # the other layers' pages stay zero
    assert not np.any(written.pages(layer)[0])
  narrower = dataclasses.replace(CFG, layer_windows=(2,), gpu_blocks=None, cpu_blocks=None)
  with pytest.raises(ValueError, match="no layer declares the attention type sliding window 2"):
    cache.stacked(hybrid_kv.HybridKVCache.create(narrower, 2, 8, np.float32))
