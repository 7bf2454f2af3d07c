"""Weights kept quantized: formats, GGUF repacking, loading, errors, engine.

GGUF tensors are written by the `gguf` package (its own quantizer for Q8_0,
Q4_0 and Q4_1, random blocks with sane scales for the K-quants) and checked
against its own dequantization, bit for bit; tiny models load with
`quantization="gguf"` and give the logits of the same file loaded in float.
"""

import os
import pathlib
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax import models, sharding
from paged_jax.models import quantized
from paged_jax.models.quantized import QuantizedWeight
from tests.checkpoint_files import (
  GGUF_HF,
  K_QUANT_SCALES,
  TOKEN_IDS,
  _config,
  _encode_tensor,
  _forward,
  random_weights,
  write_gguf,
  write_hf,
)

T = gguf.GGMLQuantizationType
ROOT = pathlib.Path(__file__).resolve().parent.parent
# (bits, group size, minimums) each GGUF type becomes.
GGUF_FORMS = {
  T.Q8_0: (8, 32, False),
  T.Q4_0: (4, 32, True),
  T.Q4_1: (4, 32, True),
  T.Q4_K: (4, 32, True),
  T.Q5_K: (8, 32, True),
  T.Q6_K: (8, 16, False),
}


@pytest.mark.parametrize("kind", GGUF_FORMS, ids=lambda kind: kind.name)
def test_gguf_blocks_repack_without_loss(kind):
  rng = np.random.default_rng(int(kind))
  weight = rng.normal(0.0, 0.1, (4, 512)).astype(np.float32)
  stored, meant = _encode_tensor(weight, kind, rng)
  q = quantized.from_gguf(stored, kind, weight.shape, "blk.0.ffn_up.weight")
  assert (q.bits, q.group_size, q.minimums is not None) == GGUF_FORMS[kind]
  assert q.shape == weight.shape
  assert q.values.size * 8 == weight.size * q.bits  # 4 bits: two values per byte
  np.testing.assert_array_equal(np.asarray(q.dequantize()), meant)


def test_gguf_types_without_a_quantized_form_are_named():
  with pytest.raises(ValueError, match="tensor blk.3.attn_q.weight has GGUF type Q2_K"):
    quantized.from_gguf(np.zeros((4, 84), np.uint8), T.Q2_K, (4, 256), "blk.3.attn_q.weight")
  with pytest.raises(ValueError, match=r"tensor w: 10 bytes do not hold Q8_0 \(4, 32\)"):
    quantized.from_gguf(np.zeros(10, np.uint8), T.Q8_0, (4, 32), "w")


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groups_round_to_the_nearest_of_16_levels(group_size):
  weight = np.random.default_rng(group_size).normal(0.0, 0.1, (8, 256)).astype(np.float32)
  q = quantized.quantize_int4(weight, group_size)
  assert q.values.shape == (8, 128) and q.values.dtype == jnp.uint8
  assert q.scales.shape == (8, 256 // group_size) and q.scales.dtype == jnp.float16
  error = np.abs(np.asarray(q.dequantize()) - weight).reshape(8, -1, group_size)
  step = np.asarray(q.scales[...], np.float32)[..., None]
  # Half a step, plus float16's rounding of the minimum and of the scale.
  assert np.all(error <= 0.5 * step + 16 * np.finfo(np.float16).eps * np.abs(weight).max())


@pytest.mark.parametrize("group_size", [None, 32])
def test_int8_rounds_to_the_nearest_step(group_size):
  weight = np.random.default_rng(1).normal(0.0, 0.1, (8, 64)).astype(np.float32)
  q = quantized.quantize_int8(weight, group_size)
  assert q.values.dtype == jnp.int8 and q.scales.shape == (8, 64 // (group_size or 64))
  error = np.abs(np.asarray(q.dequantize()) - weight).reshape(8, q.scales.shape[1], -1)
  assert np.all(error <= 0.5001 * np.asarray(q.scales[...])[..., None])


def test_pack_and_unpack_int4_are_inverse():
  ints = np.random.default_rng(2).integers(0, 16, (3, 64)).astype(np.uint8)
  packed = quantized.pack_int4(ints)
  assert packed.shape == (3, 32)
  # Byte c of a row: input c low, input c + 32 high (each nibble a half row).
  assert packed[0, 0] == ints[0, 0] | (ints[0, 32] << 4)
  assert packed[2, 31] == ints[2, 31] | (ints[2, 63] << 4)
  np.testing.assert_array_equal(np.asarray(quantized.unpack_int4(packed)), ints)


# 96 inputs in groups of 32: the halves of a 4-bit row split the middle group.
FORMS = {
  "int8": lambda w: quantized.quantize_int8(w),
  "int8/g32": lambda w: quantized.quantize_int8(w, 32),
  "int4/g32": lambda w: quantized.quantize_int4(w, 32),
  "int4/no-minimums": lambda w: QuantizedWeight(
    quantized.pack_int4(np.arange(48 * 96).reshape(48, 96) % 16),
    np.full((48, 3), 0.01),
    bits=4,
    group_size=32,
  ),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [(2, 3), (1, 1)])  # the single row is `matvec`
def test_matmul_equals_the_dequantized_product(form, rows):
  rng = np.random.default_rng(3)
  q = FORMS[form](rng.normal(0.0, 0.1, (48, 96)).astype(np.float32))
  x = jnp.asarray(rng.normal(size=(*rows, 96)), jnp.float32)
  got = q.matmul(x, jnp.float32)
  np.testing.assert_allclose(got, x @ q.dequantize().T, rtol=1e-5, atol=1e-5)
  assert got.dtype == jnp.float32 and got.shape == (*rows, 48)


def test_group_sizes_that_do_not_divide_the_inputs_are_named():
  weight = np.zeros((4, 96), np.float32)
  with pytest.raises(ValueError, match="group_size 64 does not divide the input dimension 96"):
    quantized.quantize_int4(weight, 64)
  with pytest.raises(ValueError, match="group_size 40 does not divide the input dimension 96"):
    quantized.quantize_int8(weight, 40)
  with pytest.raises(ValueError, match=r"int4 group_size must be one of \(32, 64, 128\)"):
    quantized.quantize_int4(weight, 48)
  with pytest.raises(ValueError, match="scales have shape"):
    QuantizedWeight(np.zeros((4, 96), np.int8), np.zeros((4, 2)), bits=8, group_size=32)


# Models.


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory, bpe):
  """A tiny Llama GGUF whose matrices cycle through every quantized type."""
  rng = np.random.default_rng(2)
  weights = random_weights(GGUF_HF, rng)
  path = tmp_path_factory.mktemp("gguf") / "quantized.gguf"
  write_gguf(path, GGUF_HF, weights, bpe, list(GGUF_FORMS), rng)
  return path


def test_gguf_quantized_logits_equal_the_float32_logits(gguf_file):
  floating, _ = models.load_pretrained(gguf_file, dtype="float32")
  kept, _ = models.load_pretrained(gguf_file, dtype="float32", quantization="gguf")
  forms = {
    (q.bits, q.group_size, q.minimums is not None)
    for _, linear in quantized.quantizable_linears(kept)
    if isinstance(q := linear.kernel, QuantizedWeight)
  }
  assert forms == set(GGUF_FORMS.values())  # every type is in the model
  assert quantized.is_quantized(kept) and not quantized.is_quantized(floating)
  assert kept.embed.embedding.dtype == jnp.float32  # embedding and head stay float
  assert kept.lm_head.kernel.dtype == jnp.float32
  want, _ = _forward(floating, TOKEN_IDS[None])
  got, _ = _forward(kept, TOKEN_IDS[None])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  nbytes = lambda model: sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
  assert nbytes(kept) < nbytes(floating)


def test_gguf_loading_refuses_an_unsupported_type_with_quantization(tmp_path, bpe):
  path = tmp_path / "q2k.gguf"
  write_gguf(path, GGUF_HF, random_weights(GGUF_HF, np.random.default_rng(5)), bpe, [T.Q2_K],
             np.random.default_rng(6))  # fmt: skip
  with pytest.raises(ValueError, match="tensor token_embd.weight has GGUF type Q2_K"):
    models.load_pretrained(path, quantization="gguf")
  assert T.Q2_K in K_QUANT_SCALES  # written as the float loader's test writes it


def test_quantizing_a_quantized_gguf_file_is_refused(gguf_file):
  with pytest.raises(ValueError, match=r"tensor blk\.0\.\S+ is already Q\S+; load the file with"):
    models.load_pretrained(gguf_file, quantization="int8")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, bpe):
  hf = _config(hidden_size=128, intermediate_size=96)
  weights = random_weights(hf, np.random.default_rng(8))
  return write_hf(tmp_path_factory.mktemp("hf"), hf, weights, bpe)


@pytest.mark.parametrize("method", [pytest.param("int8", marks=pytest.mark.slow), "int4"])
def test_float_checkpoints_quantize_at_load(hf_folder, method):
  floating, _ = models.load_pretrained(hf_folder, dtype="float32")
  kept, _ = models.load_pretrained(hf_folder, dtype="float32", quantization=method)
  kernels = [linear.kernel for _, linear in quantized.quantizable_linears(kept)]
  assert len(kernels) == 14 and all(isinstance(k, QuantizedWeight) for k in kernels)
  assert {k.bits for k in kernels} == {int(method[-1])}
  exact, _ = _forward(floating, TOKEN_IDS[None])
  for (_, linear), (_, twin) in zip(
    quantized.quantizable_linears(kept), quantized.quantizable_linears(floating), strict=True
  ):
    np.testing.assert_allclose(
      np.asarray(linear.kernel.dequantize()),
      np.asarray(twin.kernel[...]),
      atol=0.55 * float(jnp.max(linear.kernel.scales[...])),  # half a step
    )
    twin.kernel = nnx.Param(linear.kernel.dequantize())
  got, _ = _forward(kept, TOKEN_IDS[None])
  want, _ = _forward(floating, TOKEN_IDS[None])  # the float model of the rounded weights
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(got), np.asarray(exact), rtol=1e-5, atol=1e-5)


def test_bad_quantization_arguments_are_named(hf_folder, gguf_file):
  with pytest.raises(ValueError, match="quantization must be one of"):
    models.load_pretrained(hf_folder, quantization="int3")
  with pytest.raises(ValueError, match="quantization 'gguf' keeps a GGUF file's types"):
    models.load_pretrained(hf_folder, quantization="gguf")
  with pytest.raises(ValueError, match="group_size is for int8 and int4 quantization"):
    models.load_pretrained(gguf_file, quantization="gguf", group_size=32)
  with pytest.raises(
    ValueError,
    match="group_size 64 does not divide the input dimension 96 of blocks/0/mlp/down_proj$",
  ):
    models.load_pretrained(hf_folder, quantization="int4", group_size=64)


def test_quantizing_a_quantized_model_is_refused(tmp_path):
  model = quantized.quantize_model(models.load_tiny(), "int4")
  with pytest.raises(
    ValueError, match=r"blocks/0/attention/\w_proj is already quantized \(4 bits\)"
  ):
    quantized.quantize_model(model, "int8")
  with pytest.raises(ValueError, match="tiny is not a GGUF file"):
    quantized.quantize_loaded(models.load_tiny(), "gguf", "tiny")
  with pytest.raises(ValueError, match="save_model stores float weights"):
    models.save_model(model, tmp_path)


def test_quantized_kernels_shard_with_their_channels():
  spec = lambda path, shape: sharding.partition_spec(path, shape, 2, num_kv_heads=2)
  column = "blocks/0/mlp/up_proj/kernel"
  row = "blocks/0/mlp/down_proj/kernel"
  assert spec(f"{column}/values", (96, 32)) == sharding.P("model", None)
  assert spec(f"{column}/scales", (96, 2)) == sharding.P("model", None)
  assert spec(f"{row}/values", (64, 48)) == sharding.P(None, "model")
  assert spec(f"{row}/minimums", (64, 4)) == sharding.P(None, "model")
  assert spec(f"{row}/scales", (64, 1)) == sharding.P(None, None)  # per channel: rows kept
  assert spec("blocks/0/mlp/up_projection/values", (96, 32)) == sharding.P()


def test_new_weights_for_a_quantized_model_are_quantized_alike():
  """`LLM.update_weights`'s check (`engine.weights.replace`): a quantized
  state of the model's structure is taken as it is; float kernels for
  quantized ones, quantized for float, or values of another dtype are
  refused naming the kernel."""
  from paged_jax.engine import weights

  floating = models.load_tiny()
  model = quantized.quantize_model(models.load_tiny(), "int4")
  for _, linear in quantized.quantizable_linears(floating):
    linear.kernel = nnx.Param(linear.kernel[...] * 1.5)
  new = nnx.state(quantized.quantize_model(floating, "int4"))
  got = weights.flat_weights(weights.replace(nnx.state(model), new))
  for path, leaf in weights.flat_weights(new).items():
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(leaf), err_msg=path)
  first = r"'blocks/0/attention/k_proj/kernel'"
  with pytest.raises(weights.WeightsMismatchError, match=f"{first} is float and the engine keeps"):
    weights.replace(nnx.state(model), nnx.state(models.load_tiny()))
  with pytest.raises(weights.WeightsMismatchError, match=f"{first} is quantized and the engine"):
    weights.replace(nnx.state(models.load_tiny()), new)
  kernel = "blocks/0/attention/q_proj/kernel"
  signed = weights.flat_weights(new)
  signed[f"{kernel}/values"] = signed[f"{kernel}/values"].astype(jnp.int8)
  with pytest.raises(weights.WeightsMismatchError, match=f"'{kernel}/values' is int8, the model"):
    weights.replace(nnx.state(model), signed)


def test_new_weights_reach_scales_stored_as_float16_bits():
  """On TPU a placed kernel holds float16 scales as int16 bits
  (`QuantizedWeight.place`); new float scales go there as the bits of
  their float16."""
  from paged_jax.engine import weights

  model = quantized.quantize_model(models.load_tiny(), "int4")
  kernel = "blocks/0/mlp/up_proj/kernel"
  placed = dict(quantized.quantizable_linears(model))[kernel.removesuffix("/kernel")].kernel
  placed.scales = nnx.Param(quantized.float16_bits(placed.scales[...]))
  new = weights.flat_weights(quantized.quantize_model(models.load_tiny(), "int4"))
  scales = new[f"{kernel}/scales"]
  new[f"{kernel}/scales"] = scales.astype(jnp.float32)  # a trainer's float32 is taken too
  got = weights.flat_weights(weights.replace(nnx.state(model), new))
  assert got[f"{kernel}/scales"].dtype == jnp.int16
  np.testing.assert_array_equal(
    np.asarray(got[f"{kernel}/scales"]), np.asarray(scales).view(np.int16)
  )
  assert got[f"{kernel}/minimums"].dtype == jnp.float16


# The engine and several devices (slow: each compiles its own programs).


def float_twin(model):
  """The tiny model with `model`'s quantized kernels dequantized to float32."""
  floating = models.load_tiny()
  for (_, linear), (_, twin) in zip(
    quantized.quantizable_linears(model), quantized.quantizable_linears(floating), strict=True
  ):
    twin.kernel = nnx.Param(linear.kernel.dequantize())
  return floating


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_engine_serves_quantized_weights_as_their_float_values(method):
  """Greedy tokens of the paged engine equal those of the same weights in
  float (the dequantized kernels), through prefill, decode, prefix caching
  and preemption."""
  from paged_jax.config import CacheConfig
  from paged_jax.generate import Request, SamplingParams, generate

  model = quantized.quantize_model(models.load_tiny(), method)
  floating = float_twin(model)
  prompts = [np.frombuffer(text.encode(), np.uint8).astype(np.int32) for text in
             ("LOVE, n. ", "HOPE, n. A", "LOVE, n. A tempor")]  # fmt: skip
  cfg = CacheConfig(
    block_size=4, num_gpu_blocks=12, num_cpu_blocks=16, max_seqs=3, max_blocks_per_seq=12,
    enable_prefix_caching=True,
  )  # fmt: skip
  greedy = SamplingParams(max_tokens=16, temperature=0.0)
  got, _ = generate(model, [Request(p) for p in prompts], cfg, greedy, jax.random.key(0))
  want, _ = generate(floating, [Request(p) for p in prompts], cfg, greedy, jax.random.key(0))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a[0], b[0])


@pytest.mark.slow
def test_beams_structured_outputs_and_a_draft_of_other_quantization():
  """On an int4 model, greedy rows, beam search and a structured output give
  the tokens of its float twin; with an int8 draft proposing (speculation),
  the greedy rows keep those tokens."""
  import paged_jax as pj

  model = quantized.quantize_model(models.load_tiny(), "int4")
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, max_seqs=4, max_blocks_per_seq=16,
    enable_prefix_caching=True,
  )  # fmt: skip
  prompts = ["LOVE, n. ", "HOPE, n. A"]
  greedy = pj.SamplingParams(max_tokens=12, ignore_eos=True)
  beams = pj.SamplingParams(max_tokens=8, n=2, use_beam_search=True, ignore_eos=True)
  choice = pj.StructuredOutputsParams(choice=["A passion", "A hope", "Nothing"])
  structured = pj.SamplingParams(max_tokens=16, structured_outputs=choice)

  def tokens(llm, params=(greedy, beams, structured)):
    outs = [out for p in params for out in llm.generate(prompts, p)]
    return [[list(o.token_ids) for o in out.outputs] for out in outs]

  want = tokens(pj.LLM(float_twin(model), models.ByteTokenizer(), cfg))
  assert tokens(pj.LLM(model, models.ByteTokenizer(), cfg)) == want
  draft = quantized.quantize_model(models.load_tiny(), "int8")
  spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2, "adaptive": False}
  speculating = pj.LLM(model, models.ByteTokenizer(), cfg, speculative_config=spec)
  assert tokens(speculating, [greedy]) == want[:2]
  assert speculating.engine.stats.spec_decode_num_draft_tokens > 0


@pytest.mark.slow
def test_tensor_parallel_quantized_logits_equal_one_device(tmp_path):
  script = """
import numpy as np, jax
from paged_jax import sharding
from paged_jax.models import load_tiny, quantized
model = quantized.quantize_model(load_tiny(), "int4")
tokens = np.arange(1, 13, dtype=np.int32)[None]
want = np.asarray(model(tokens)[0])
sharded = sharding.shard_model(model, sharding.make_mesh(1, 2))
up = sharded.blocks[0].mlp.up_proj.kernel
down = sharded.blocks[0].mlp.down_proj.kernel
assert up.values[...].sharding.spec == sharding.P("model", None), up.values[...].sharding
assert up.scales[...].sharding.spec == sharding.P("model", None)
assert down.values[...].sharding.spec == sharding.P(None, "model")
assert down.scales[...].sharding.spec == sharding.P(None, "model")
# Each kernel knows its split (the TPU kernel runs on each device's shard).
assert up.placement[1] == sharding.P("model", None), up.placement
assert down.placement[1] == sharding.P(None, "model"), down.placement
got = np.asarray(sharded(tokens)[0])
np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
print("ok")
"""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
  result = subprocess.run(
    [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_a_served_draft_model_takes_its_own_quantization():
  import argparse

  from paged_jax.server import cli

  spec = dict(method="draft_model", model="tiny", num_speculative_tokens=2)
  for target, own, expected in (("int8", "int4", 4), ("int8", None, None)):
    config = dict(spec, quantization=own)
    args = argparse.Namespace(
      model="tiny", dtype="auto", max_model_len=None, quantization=target,
      speculative_config=config,
    )  # fmt: skip
    loaded = cli._with_draft(args)
    assert "quantization" not in loaded
    kernel = loaded["model"].blocks[0].mlp.up_proj.kernel
    assert (kernel.bits if isinstance(kernel, QuantizedWeight) else None) == expected
  args.quantization, args.speculative_config = "int8", dict(spec)  # inherits --quantization
  assert cli._with_draft(args)["model"].blocks[0].mlp.up_proj.kernel.bits == 8
