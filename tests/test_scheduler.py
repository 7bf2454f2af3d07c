"""The scheduler and the cache manager without a model: preemption with
nothing to preempt, failures that name the request and what was short, and
the one answer to "can this request ever fit"."""

import dataclasses
import types

import numpy as np
import pytest

import paged_jax as pj
from paged_jax.engine.admission import admission_error
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.scheduler_output import SchedulerOutput
from paged_jax.engine.sequence import Sequence, SequenceGroup

CFG = pj.CacheConfig(
  block_size=4,
  num_gpu_blocks=6,
  num_cpu_blocks=4,
  max_seqs=4,
  max_blocks_per_seq=8,
  watermark=0.0,
)
MODEL_CONFIG = types.SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")


@pytest.fixture
def cache():
  return CacheManager(CFG, MODEL_CONFIG)


def _group(request_id: str, prompt_len: int, arrival: int = 0) -> SequenceGroup:
  return SequenceGroup(
    request_id=request_id,
    prompt=None,
    prompt_token_ids=np.arange(1, prompt_len + 1, dtype=np.int32),
    params=pj.SamplingParams(max_tokens=4),
    arrival=arrival,
    limit=4,
    stop_ids=(),
    seqs=[Sequence(index=0, key_data=np.zeros(2, np.uint32))],
  )


def test_out_of_blocks_with_every_group_finished_preempts_nothing(cache):
  scheduler = Scheduler(cache, 4, 64, "recompute", max_len=32)
  scheduler.update(SchedulerOutput(shard=0), None, out_of_blocks=True)
  assert scheduler.num_preemptions == 0
  assert not scheduler.schedule().preempted


def test_a_lone_group_out_of_blocks_raises_naming_it(cache):
  scheduler = Scheduler(cache, 4, 64, "recompute", max_len=32)
  scheduler.add(_group("lone", 8))
  out = scheduler.schedule()
  assert [c.group.request_id for c in out.chunks] == ["lone"]
  with pytest.raises(RuntimeError, match=r"request 'lone' ran out of GPU blocks with nothing else"):
    scheduler.update(out, None, out_of_blocks=True)


def test_a_lone_group_out_of_blocks_decodes_on_when_a_stop_string_freed_blocks(cache):
  scheduler = Scheduler(cache, 4, 64, "recompute", max_len=32)
  scheduler.add(_group("left", 8))
  scheduler.add(_group("stopped", 4, arrival=1))
  out = scheduler.schedule()
  assert [c.group.request_id for c in out.chunks] == ["left", "stopped"]
  free = cache.num_free_gpu_blocks()
  # The decode loop ran out of blocks; then the host saw a stop string end "stopped".
  out.decoding[1].seqs[0].finish_reason = "stop"
  scheduler.update(out, np.zeros(cache.num_slots, bool), out_of_blocks=True)
  assert cache.num_free_gpu_blocks() == free + 1
  assert scheduler.num_preemptions == 0
  assert [g.request_id for g in scheduler.running] == ["left"]
  # Out of blocks again with nothing freed since: it can never fit.
  with pytest.raises(RuntimeError, match=r"request 'left' ran out of GPU blocks with nothing else"):
    scheduler.update(SchedulerOutput(shard=0), None, out_of_blocks=True)


def test_allocation_failure_names_the_request_and_the_blocks_short(cache):
  cache.allocate(0, np.arange(16, dtype=np.int32), "first")  # 4 of 6 blocks
  with pytest.raises(
    RuntimeError,
    match=r"allocate of 12 tokens of request 'second' into seq 1 failed: OUT_OF_BLOCKS "
    r"\(3 needed, 2 free of 6 GPU blocks on shard 0\)",
  ):
    cache.allocate(1, np.arange(12, dtype=np.int32), "second")


def test_free_of_a_free_slot_names_the_request(cache):
  with pytest.raises(
    RuntimeError, match=r"free of request 'gone''s seqs \[2\] failed: NOT_ALLOCATED"
  ):
    cache.free([2], "gone")


def test_admission_error_is_the_same_answer_on_arrival_and_readmission():
  params = pj.SamplingParams(max_tokens=8)
  fits = dict(max_len=32, max_num_seqs=4, params=params)
  # 16 + 8 - 1 tokens: 6 blocks, the whole cache.
  assert admission_error(CFG, num_prompt_tokens=16, **fits) is None
  assert "needs 7 GPU blocks" in admission_error(CFG, num_prompt_tokens=18, **fits)
  # Re-admitted after a recompute preemption with 4 more tokens than fit.
  message = admission_error(CFG, num_prompt_tokens=16, resident_lengths=[25], **fits)
  assert message is not None and "need 7 GPU blocks to be prefilled again" in message
  wide = pj.SamplingParams(n=5)
  assert "n=5 sequences exceed max_num_seqs=4" in admission_error(
    CFG, max_len=32, max_num_seqs=4, num_prompt_tokens=4, params=wide
  )


def test_admission_counts_a_window_and_a_chunk_per_sequence_on_a_freeing_cache():
  """On a cache that frees the blocks outside a window of 8, a sequence
  holds at most ceil(8 / 4) + 1 + ceil(chunk / 4) blocks however long."""
  windowed = dataclasses.replace(CFG, sliding_window=8)
  long = dict(max_len=32, max_num_seqs=4, params=pj.SamplingParams(max_tokens=8))
  # 24 + 8 - 1 tokens span 8 blocks of the 6; held at once: 2 + 1 + 1 = 4.
  assert "needs 8 GPU blocks" in admission_error(CFG, num_prompt_tokens=24, **long)
  assert admission_error(windowed, num_prompt_tokens=24, max_chunk=4, **long) is None
  # Chunks of 8: 2 + 1 + 2 = 5 blocks each; two samples share none of them.
  assert admission_error(windowed, num_prompt_tokens=24, max_chunk=8, **long) is None
  two = dict(long, params=pj.SamplingParams(max_tokens=8, n=2))
  assert "needs 10 GPU blocks" in admission_error(
    windowed, num_prompt_tokens=24, max_chunk=8, **two
  )


def test_swap_out_without_host_room_names_the_request_and_the_pool(cache):
  cache.allocate(0, np.arange(16, dtype=np.int32), "first")  # 4 blocks: the whole host pool
  cache.allocate(1, np.arange(4, dtype=np.int32), "second")
  cache.swap_out([0], "first")
  with pytest.raises(
    RuntimeError,
    match=r"swap out of request 'second''s seqs \[1\] failed: SWAP_SPACE_EXHAUSTED "
    r"\(0 free of 4 CPU blocks on shard 0\)",
  ):
    cache.swap_out([1], "second")


def test_prompts_that_stall_on_a_windowed_cache_preempt_the_latest():
  """On a cache that frees the blocks outside its window, prompts append
  their chunks as they run. Two prompts that filled the 4 blocks with
  nothing decoding stall: the latest is preempted, the other goes on."""
  cfg = pj.CacheConfig(
    block_size=4,
    num_gpu_blocks=4,
    num_cpu_blocks=0,
    max_seqs=4,
    max_blocks_per_seq=8,
    watermark=0.0,
    sliding_window=8,
  )
  cache = CacheManager(cfg, MODEL_CONFIG, max_chunk=4)
  scheduler = Scheduler(cache, 4, 8, "recompute", max_len=32)
  scheduler.add(_group("first", 24))
  scheduler.add(_group("second", 24, arrival=1))
  rounds = []
  for _ in range(4):
    out = scheduler.schedule()
    rounds.append(([c.group.request_id for c in out.chunks], [g.request_id for g in out.preempted]))
    scheduler.update(out)
  assert rounds == [
    (["first", "second"], []),
    (["first", "second"], []),
    ([], []),  # each needs a block before its oldest leaves the window
    (["first"], ["second"]),
  ]
  assert cache.num_free_gpu_blocks() == 2  # "first": the blocks of positions 4 .. 11
