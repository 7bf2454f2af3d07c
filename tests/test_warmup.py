"""Warm-up's bucket set. That serving after warm-up compiles nothing is checked
where the engine is served hardest: the randomized traces of
tests/test_engine_random.py warm their engines up and run under
`compile_guard.no_compiles`, which names any program that compiles."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import models
from paged_jax.engine import packing, programs
from tests.tiny_models import BYTE_LLAMA

CFG = pj.CacheConfig(block_size=4, num_gpu_blocks=12, max_seqs=6, max_blocks_per_seq=16)


def test_compiled_programs_lists_the_bucket_set():
  model = models.Llama(BYTE_LLAMA, rngs=nnx.Rngs(1))
  engine = pj.LLMEngine(
    model, models.ByteTokenizer(), CFG, max_num_seqs=4, max_num_batched_tokens=48, prefill_width=16
  )
  # 48 tokens in ceil(48 / 16) + 4 = 7 tiles at most: 32 and 64 tokens; the
  # decode rows of every ragged step: the bucket that holds max_num_seqs.
  assert engine.compiled_programs()[:2] == [
    f"ragged step: {t} tokens (prompt and decode) in {t // 8} tiles of 16, 4 decode rows"
    for t in (32, 64)
  ]
  assert engine.compiled_programs()[2:] == [
    "decode loop 1 rows x8 steps",
    "decode loop 4 rows x8 steps",
    "decode loop 6 rows x8 steps",
    "block manager calls",
    "swap out",
    "swap in",
    "request keys",
  ]


def test_prompt_buckets_double_up_to_the_token_budget_and_its_tiles():
  # (tokens, tiles) per shard: (2 * width * 2**i, 4 * 2**i), the last with
  # room for every tile a budget's chunks can fill.
  assert packing.prompt_buckets(32, 512, 48) == [(64, 4), (128, 8), (256, 16), (512, 64)]
  assert packing.prompt_buckets(32, 500, 20) == [(64, 4), (128, 8), (256, 16), (512, 32)]
  assert packing.prompt_buckets(16, 8, 3) == [(32, 4)]


def _chunk(slot: int, size: int):
  seq = dataclasses.make_dataclass("Seq", ["slot"])(slot)
  return dataclasses.make_dataclass(
    "Chunk", ["seq", "tokens", "start", "write_from", "next_tokens"]
  )(seq, np.arange(size, dtype=np.int32), 0, 0, None)


def test_prompt_chunks_pack_into_the_smallest_bucket_that_holds_them():
  buckets = packing.prompt_buckets(32, 512, 48)
  shape = lambda sizes: packing.pack_prefill(
    [_chunk(i, n) for i, n in enumerate(sizes)], 32, 1, 64, buckets
  ).tokens.shape[1]
  assert shape([46]) == 64
  assert shape([200, 100]) == 512
  # Many short chunks fill more tiles than their tokens would: a larger shape.
  assert shape([5] * 5) == 128
  assert shape([1] * 40) == 512


def test_decode_row_buckets_choose_the_decode_programs():
  model = models.Llama(BYTE_LLAMA, rngs=nnx.Rngs(1))
  for buckets, rows in (((), [6]), ((2, 6), [2, 6]), ([3, 1], [1, 3, 6])):
    engine = pj.LLMEngine(model, None, CFG, decode_row_buckets=buckets)
    decode = [name for name in engine.compiled_programs() if name.startswith("decode loop")]
    assert decode == [f"decode loop {r} rows x8 steps" for r in rows]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_one_running_sequence_decodes_in_one_row(dtype):
  # On this AVX-512 machine a bfloat16 SmolLM2 stream decodes at 53 tokens/s
  # in one row against 42 in two (benchmarks/RESULTS.md).
  model = models.Llama(dataclasses.replace(BYTE_LLAMA, dtype=dtype), rngs=nnx.Rngs(1))
  engine = pj.LLMEngine(model, None, CFG, max_num_seqs=4)
  assert engine.runner.decode_buckets() == [1, 4, 6]


@pytest.mark.parametrize("buckets", [(0,), (7,), (2.0,), (True,), 4])
def test_decode_row_buckets_out_of_range_are_refused(buckets):
  model = models.Llama(BYTE_LLAMA, rngs=nnx.Rngs(1))
  with pytest.raises(
    ValueError, match=r"decode_row_buckets must be a list or tuple of ints in 1\.\.6"
  ):
    pj.LLMEngine(model, None, CFG, decode_row_buckets=buckets)


def test_a_launch_looks_its_model_up_without_hashing_the_graphdef(monkeypatch):
  # jit hashes static arguments on every call; a graphdef's hash walks the model.
  graph = lambda config: programs.HashedGraph(nnx.split(models.Llama(config, rngs=nnx.Rngs(1)))[0])
  one, same = graph(BYTE_LLAMA), graph(BYTE_LLAMA)
  assert one == same and hash(one) == hash(same)  # two engines of one model share programs
  assert one != graph(dataclasses.replace(BYTE_LLAMA, num_layers=2))
  calls = []
  graphdef_type = type(one.graphdef)
  original = graphdef_type.__hash__
  monkeypatch.setattr(graphdef_type, "__hash__", lambda self: calls.append(1) or original(self))
  assert {one: "program"}[one] == "program" and hash(one) == hash(same)
  assert calls == []
  engine = pj.LLMEngine(models.Llama(BYTE_LLAMA, rngs=nnx.Rngs(1)), None, CFG)
  assert isinstance(engine.runner.graphdef, programs.HashedGraph)
