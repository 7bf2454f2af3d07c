"""Model configs the engine tests share: tiny Llamas over the byte vocabulary."""

import dataclasses

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
