"""Model and cache configs the engine tests share: tiny Llamas over the byte vocabulary."""

import dataclasses

import paged_jax as pj
from paged_jax import models

# One layer, 258 byte tokens (ByteTokenizer), 64 positions: compiles fast.
BYTE_LLAMA = models.LlamaConfig(
  vocab_size=258,
  num_layers=1,
  num_q_heads=2,
  num_kv_heads=1,
  head_dim=8,
  hidden=16,
  mlp_hidden=32,
  max_seq_len=64,
)
# Two layers, so that a layer's K/V written in one chunk is read by the next.
BYTE_LLAMA_2_LAYERS = dataclasses.replace(BYTE_LLAMA, num_layers=2)

# The cache of tests/test_engine.py and of the random traces of
# tests/test_engine_random.py: their engines (BYTE_LLAMA, 4 decode steps per
# launch, the default logprobs and beam widths) share every compiled program.
# 14 blocks of 4 do not hold all their sequences at once: the runs preempt.
ENGINE_CFG = pj.CacheConfig(
  block_size=4,
  num_gpu_blocks=14,
  num_cpu_blocks=32,
  max_seqs=6,
  max_blocks_per_seq=20,
  watermark=0.0,
  enable_prefix_caching=True,
)
