"""`python -m paged_jax aot`: the engine's programs compiled by libtpu for TPU
topologies on this host, and the tool's errors."""

import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from paged_jax import aot, aot_kv

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
  not HAS_LIBTPU, reason=f"libtpu is not installed ({aot.INSTALL_HINT})"
)


def test_missing_libtpu_says_how_to_install(monkeypatch):
  monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(RuntimeError, match=r'pip install "jax\[tpu\]"'):
    aot.require_libtpu()


def test_heads_not_divisible_by_the_mesh_names_both():
  with pytest.raises(ValueError, match=r"num_q_heads \(12\).*\(8\)"):
    aot.check_mesh(12, 4, 8, 8)
  with pytest.raises(ValueError, match="--tensor-parallel-size 2 must equal the topology's 4"):
    aot.check_mesh(8, 8, 2, 4)


def test_too_large_for_hbm_names_the_bytes():
  assert aot_kv.kv_blocks_per_chip(1000, 300, 100, 200) == 3
  with pytest.raises(ValueError, match="900 bytes of weights and 100 bytes of temporaries"):
    aot_kv.kv_blocks_per_chip(1000, 900, 100, 200)
  gemma = aot.ShapeOnlyModel.named("gemma-3-4b").config
  with pytest.raises(ValueError, match="leave 0 of 1000 bytes of HBM, less than one KV page"):
    aot_kv.kv_report(gemma, 1000, 900, 100, 0, {"hybrid tables": None})
  with pytest.raises(
    ValueError,
    match=r"10000000 bytes of KV pages per chip: .*holds no sequence of 8192 tokens: it needs "
    r"412942336 bytes \(512 blocks in each of 5 layers, 129 blocks in each of 29 layers",
  ):
    aot_kv.hybrid_pools(gemma, 10_000_000)


# Gemma 3 4B on one v5e chip (benchmarks/RESULTS.md, "TPU compile of Gemma 3 4B
# on per-type tables"): weights and the largest temporaries per chip.
GEMMA_4B_ON_V5E = dict(hbm=16 * 2**30, weight_bytes=7_760_526_336, temp_bytes=232_051_712)


def test_a_hybrid_variants_kv_line_splits_the_bytes_left_as_the_engine_does():
  """The bytes a v5e chip has left after Gemma 3 4B's weights and
  temporaries, split into a pool per attention type as
  `LLMEngine(hybrid_kv_cache=True, kv_cache_memory_bytes=...)` splits them:
  the cache those pools make fills the bytes, each pool holds the 8k-token
  sequences reported, and every block kept gives the one-table line's."""
  import jax
  import jax.numpy as jnp

  import paged_jax as pj
  from paged_jax.block_manager.hybrid import HybridCacheConfig
  from paged_jax.hybrid_kv import HybridKVCache

  gemma = aot.ShapeOnlyModel.named("gemma-3-4b").config  # 29 sliding layers, 5 global
  one_table = 34 * 65536  # 4 KV heads of 256, bfloat16, K and V, 16 tokens, every layer
  report = aot_kv.kv_report(gemma, **GEMMA_4B_ON_V5E, block_bytes=one_table, hybrid={"h": None})
  pools = report["hybrid_kv"]["h"]
  free = pools["kv_bytes_per_chip"]
  assert free == 16 * 2**30 - 7_760_526_336 - 232_051_712
  (glob, sliding) = pools["types"]
  assert (glob["name"], glob["layers"], glob["blocks_per_sequence"]) == ("global", 5, 512)
  # Chunks of half the window: a sliding layer keeps 1024 + 512 - 1 positions,
  # 96 blocks, one more, and a chunk's 32 before it frees any.
  assert (sliding["name"], sliding["tokens_kept"], sliding["layers"]) == (
    "sliding window 1024",
    1535,
    29,
  )
  assert sliding["blocks_per_sequence"] == 96 + 1 + 32
  per_sequence = (5 * 512 + 29 * 129) * 65536
  assert pools["sequences_8k_per_chip"] == free // per_sequence == 22
  for pool in (glob, sliding):
    assert 22 * pool["blocks_per_sequence"] <= pool["gpu_blocks"]
  # The pages of the cache the engine builds on these pools fill the bytes left.
  cache = pj.CacheConfig(block_size=16, num_cpu_blocks=0, max_blocks_per_seq=512)
  windows = tuple(None if w is None else 1535 for w in map(gemma.layer_window, range(34)))
  cfg = HybridCacheConfig(cache, windows, gpu_blocks=(glob["gpu_blocks"], sliding["gpu_blocks"]))
  pages = jax.eval_shape(lambda: HybridKVCache.create(cfg, 4, 256, jnp.bfloat16))
  nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pages))
  assert nbytes == sum(p["gpu_blocks"] * p["bytes_per_block"] for p in (glob, sliding))
  assert free - per_sequence < nbytes <= free
  # Every block kept: one table's sequences in the same bytes.
  assert pools["every_block_kept_sequences_8k_per_chip"] == report["sequences_8k_per_chip"] == 8
  assert report["kv_blocks_per_chip"] == free // one_table
  lines = aot_kv.describe_kv(report)
  assert lines[0] == (
    f"one table: {one_table} bytes per KV block: {free // one_table} KV blocks, "
    "8 sequences of 8k tokens"
  )
  assert lines[1] == (
    f"h: {free} bytes of KV pages per chip, a pool per type (global: {glob['gpu_blocks']} "
    f"blocks, 512 per sequence; sliding window 1024: {sliding['gpu_blocks']} blocks, 129 per "
    "sequence): 22 sequences of 8k tokens (8 with every block kept)"
  )
  only_hybrid = aot_kv.kv_report(gemma, **GEMMA_4B_ON_V5E, block_bytes=0, hybrid={"h": None})
  assert "kv_blocks_per_chip" not in only_hybrid and only_hybrid["hybrid_kv"]["h"] == pools


def test_weights_larger_than_a_chip_name_the_sizes():
  aot.check_weights_fit(15 * 2**30, 16 * 2**30, "v5e:1x1", 1)
  with pytest.raises(
    ValueError, match=r"too large for v5e:1x1: 16.00 GiB .*tensor parallel 1.*16 GiB"
  ):
    aot.check_weights_fit(16 * 2**30, 16 * 2**30, "v5e:1x1", 1)


def test_shape_only_models_have_the_published_shapes():
  """Llama-3-8B; Gemma-3-4B's windows: 1024 on five of every six layers."""
  llama = aot.ShapeOnlyModel.named("llama-3-8b").config
  assert (llama.num_layers, llama.hidden, llama.mlp_hidden, llama.vocab_size) == (
    32,
    4096,
    14336,
    128256,
  )
  assert (llama.num_q_heads, llama.num_kv_heads, llama.head_dim, llama.dtype) == (
    32,
    8,
    128,
    "bfloat16",
  )
  gemma = aot.ShapeOnlyModel.named("gemma-3-4b").config
  assert (gemma.num_layers, gemma.num_q_heads, gemma.num_kv_heads, gemma.head_dim) == (
    34,
    8,
    4,
    256,
  )
  windows = [gemma.layer_window(layer) for layer in range(gemma.num_layers)]
  assert windows == [None if layer % 6 == 5 else 1024 for layer in range(34)]
  assert gemma.local_rope_theta == 10000.0 and gemma.attn_logit_softcap is None
  with pytest.raises(ValueError, match="no shape-only model 'llama-9'"):
    aot.ShapeOnlyModel.named("llama-9")


@pytest.mark.slow
def test_shape_only_parameters_and_stand_in():
  """Llama-3-8B's 8,030,261,248 parameters, shapes only; the stand-in the
  host runs has Gemma's vocabulary, heads and both layer kinds."""
  import jax

  host = aot.jax_mesh(jax.devices()[:1], (1, 1))
  _, params = aot.ShapeOnlyModel.named("llama-3-8b").abstract_params(host)
  assert sum(x.size for x in jax.tree.leaves(params)) == 8_030_261_248
  assert {x.dtype.name for x in jax.tree.leaves(params)} == {"bfloat16"}
  stand_in = aot.ShapeOnlyModel.named("gemma-3-4b").stand_in().config
  assert (stand_in.vocab_size, stand_in.num_kv_heads, stand_in.head_dim) == (262208, 4, 256)
  assert stand_in.layer_types == ("sliding_attention", "full_attention")


def test_a_stand_in_cache_grows_to_the_models_layers():
  import paged_jax as pj

  model = aot.ShapeOnlyModel.named("llama-3-8b")
  cfg = pj.CacheConfig(block_size=16, num_gpu_blocks=4, num_cpu_blocks=0, max_seqs=1)
  kv = model.with_layers(pj.KVCache.create(cfg, 1, 8, 128, dtype="int8"))
  assert len(kv.k) == len(kv.v) == len(kv.k_scale) == len(kv.v_scale) == 32
  assert kv.k[31].shape == (8, 4, 16, 128)


def test_a_stand_in_hybrid_cache_grows_to_the_models_layers_of_each_type():
  import paged_jax as pj
  from paged_jax.block_manager.hybrid import HybridCacheConfig
  from paged_jax.hybrid_kv import HybridKVCache

  model = aot.ShapeOnlyModel.named("gemma-3-4b")  # 29 sliding layers, 5 global ones
  cfg = pj.CacheConfig(block_size=16, num_gpu_blocks=4, num_cpu_blocks=0, max_seqs=1)
  stand_in = HybridCacheConfig(cfg, (1535, None), gpu_blocks=(4, 2))  # the stand-in's 2 layers
  kv = model.with_layers(HybridKVCache.create(stand_in, 4, 256, "bfloat16"))
  assert kv.cfg.layer_windows == ((1535,) * 5 + (None,)) * 5 + (1535,) * 4
  assert (len(kv.types[0].k), len(kv.types[1].k)) == (5, 29)
  assert kv.types[0].k[4].shape == (4, 4, 16, 256) and kv.types[1].k[28].shape == (4, 2, 16, 256)
  assert kv.locate(33) == (1, 28) and kv.locate(29) == (0, 4)


def test_the_cli_without_libtpu_says_how_to_install(monkeypatch, capsys):
  from paged_jax.__main__ import main

  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # the tool appends to it
  monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(SystemExit) as exit_:
    main(["aot", "--model", "llama-3-8b", "--topology", "v5e:1x1"])
  assert exit_.value.code == 2
  assert 'pip install "jax[tpu]"' in capsys.readouterr().err


def test_the_cli_refuses_gguf_quantization_of_a_shape_only_model(capsys):
  from paged_jax.__main__ import main

  with pytest.raises(SystemExit) as exit_:
    main(["aot", "--model", "llama-3-8b", "--topology", "v5e:1x1", "--quantization", "gguf"])
  assert exit_.value.code == 2
  assert "--quantization gguf needs a GGUF file; llama-3-8b is shapes only" in (
    capsys.readouterr().err
  )
  with pytest.raises(ValueError, match="quantization must be one of .* got 'gguf'"):
    aot.ShapeOnlyModel.named("llama-3-8b", quantization="gguf")


@pytest.mark.parametrize("method", [pytest.param("int8", marks=pytest.mark.slow), "int4"])
def test_shape_only_quantized_parameters_are_a_quantized_models(method):
  """A shape-only model's quantized parameters have the shapes and dtypes
  `quantize_model` gives real weights; its stand-in is quantized alike."""
  import jax
  from flax import nnx

  from paged_jax.models import pretrained, quantized

  config = pretrained.load_tiny().config
  host = aot.jax_mesh(jax.devices()[:1], (1, 1))
  _, params = aot.ShapeOnlyModel(config, method).abstract_params(host)
  real = nnx.state(quantized.quantize_model(pretrained.load_tiny(), method))
  described = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]
  assert described(params) == described(real)
  stand_in = aot.ShapeOnlyModel(config, method).stand_in()
  kernels = [linear.kernel for _, linear in quantized.quantizable_linears(stand_in)]
  assert kernels and all(kernel.bits == int(method[-1]) for kernel in kernels)


@needs_libtpu
def test_bad_setups_fail_before_compiling_naming_the_limit():
  llama_f32 = aot.ShapeOnlyModel.named("llama-3-8b", "float32")
  with pytest.raises(ValueError, match=r"too large for v5e:1x1: 29.9\d GiB of weights"):
    aot.compile_engine_programs(llama_f32, "v5e:1x1")
  gemma = aot.ShapeOnlyModel.named("gemma-3-4b")
  with pytest.raises(
    ValueError, match=r"num_q_heads \(8\) must be a multiple of the model axis \(16\)"
  ):
    aot.compile_engine_programs(gemma, "v5e:4x4", 16)
  with pytest.raises(ValueError, match="no HBM size known for 'v4'"):
    aot.compile_engine_programs(gemma, "v4:2x2x1", 8)


def test_a_failed_compile_is_named_with_its_first_line():
  failed = concurrent.futures.Future()
  failed.set_exception(ValueError("\nMosaic failed: bad tile\ntraceback"))
  with pytest.raises(
    RuntimeError,
    match=r"^plain: decode_loop failed to compile for v5e:2x2: Mosaic failed: bad tile$",
  ):
    aot._program_report(
      "v5e:2x2", 16 * 2**30, "plain", "decode_loop", "plain: decode_loop #1", failed
    )


@needs_libtpu
@pytest.mark.slow  # warm-up's capture of the tiny engine: ~18 s
def test_a_program_that_fails_to_compile_is_named_with_its_reason(monkeypatch):
  """Compiles run on threads; a failed one still raises naming its program,
  and says when the chip's HBM was too small."""
  from paged_jax.models import pretrained

  def exhausted(lowered):
    raise RuntimeError("RESOURCE_EXHAUSTED: 20.1G of 16G hbm\nmore lines")

  monkeypatch.setattr(aot, "compile_lowered", exhausted)
  with pytest.raises(
    RuntimeError,
    match=r"^plain: start_beams failed to compile for v5e:1x1: too large for a chip's 16 GiB "
    r"of HBM: RESOURCE_EXHAUSTED: 20.1G of 16G hbm$",
  ):
    aot.compile_engine_programs(
      pretrained.load_tiny(), "v5e:1x1", variants={"plain": {}}, programs={"start_beams"}
    )


@needs_libtpu
def test_unknown_topology_names_it_and_known_ones():
  with pytest.raises(ValueError, match=r"'v9z:3x3'.*v5e:2x2"):
    aot.topology_devices("v9z:3x3")


def _run_tool(
  topology: str, tp: int, variants: list[str], model="tiny", timeout=900, programs=()
) -> dict:
  # This process may hold libtpu already (the in-process tests).
  env = {**os.environ, "PYTHONPATH": os.getcwd(), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  args = ["--model", model, "--topology", topology, "--tensor-parallel-size", str(tp), "--json"]
  args += [a for v in variants for a in ("--variant", v)]
  args += [a for p in programs for a in ("--program", p)]
  result = subprocess.run(
    [sys.executable, "-m", "paged_jax", "aot", *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def _check_report(report: dict, topology: str, variants) -> None:
  """Each variant compiled programs of its own (launches equal to an earlier
  variant's are compiled once)."""
  assert report["topology"] == topology
  names = [p["name"] for p in report["programs"]]
  for variant in variants:
    assert any(n.startswith(f"{variant}: ") for n in names), variant
  assert all(p["hbm_bytes"] > 0 and p["compile_s"] > 0 for p in report["programs"])
  assert report["kv_blocks_per_chip"] > 0


@needs_libtpu
@pytest.mark.parametrize(
  "topology, tp",
  [pytest.param("v5e:1x1", 1, marks=pytest.mark.slow), ("v5e:2x2", 4)],  # CI: tensor parallel
)
def test_tiny_engine_compiles_for_tpu(topology, tp):
  """The whole program set of warm-up compiles, one program per shape the
  engine lists, and the attention launches run the Mosaic kernels."""
  from paged_jax.models import pretrained

  report = _run_tool(topology, tp, ["plain"])
  _check_report(report, topology, ["plain"])
  listed = aot.build_engine(pretrained.load_tiny(), 1).compiled_programs()
  programs = {p["name"]: p for p in report["programs"]}
  decode = [p for name, p in programs.items() if name.startswith("plain: decode_loop")]
  ragged = [p for name, p in programs.items() if name.startswith("plain: ragged_step")]
  assert len(decode) == sum("decode loop" in n for n in listed) > 0
  assert len(ragged) == sum(n.startswith("ragged step") for n in listed) > 0
  assert all(p["mosaic_kernels"] > 0 for p in decode + ragged)
  assert programs["plain: start_beams #1"]["mosaic_kernels"] == 0


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("topology, tp", [("v5e:1x1", 1), ("v5e:2x2", 4)])
def test_tiny_engine_compiles_every_variant_for_tpu(topology, tp):
  report = _run_tool(topology, tp, list(aot.VARIANTS))
  _check_report(report, topology, aot.VARIANTS)
  names = [p["name"] for p in report["programs"]]
  assert any("ragged_step" in n for n in names)
  assert any(n.startswith("speculation: prefill") for n in names)
  assert any("next_launch_rows" in n for n in names)  # async scheduling's continued carry


@needs_libtpu
@pytest.mark.slow
def test_the_tool_reports_a_hybrid_variants_pools():
  """With the hybrid tables beside the plain engine, the report keeps the
  one-table line and adds the pools; the tiny model's layers are all
  global, so its one pool holds what one table does."""
  report = _run_tool("v5e:1x1", 1, ["plain", "hybrid tables"], programs=["start_beams"])
  pools = report["hybrid_kv"]["hybrid tables"]
  free = 16 * 2**30 - report["weight_bytes_per_chip"] - report["max_temp_bytes"]
  assert pools["kv_bytes_per_chip"] == free
  (only,) = pools["types"]
  assert only["name"] == "global" and only["gpu_blocks"] == report["kv_blocks_per_chip"]
  assert only["bytes_per_block"] == report["kv_block_bytes_per_chip"]
  assert pools["sequences_8k_per_chip"] == report["sequences_8k_per_chip"] > 0


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize(
  "model, topology, tp", [("llama-3-8b", "v5e:2x4", 8), ("gemma-3-4b", "v5e:1x1", 1)]
)
def test_shape_only_models_compile_for_tpu(model, topology, tp):
  """Setups (b) and (c), bfloat16 (about 8 minutes each on 2 CPU cores)."""
  report = _run_tool(topology, tp, ["plain"], model=model, timeout=2400)
  _check_report(report, topology, ["plain"])
  config = aot.ShapeOnlyModel.named(model).config
  heads = max(config.num_kv_heads, tp) // tp  # stored per chip
  block = config.num_layers * heads * aot.BLOCK_SIZE * config.head_dim * 2 * 2  # K, V; bfloat16
  assert report["kv_block_bytes_per_chip"] == block
  assert report["max_temp_bytes"] > 0
  names = [p["name"] for p in report["programs"]]
  assert any(n.startswith("plain: decode_loop") for n in names)
  assert any(n.startswith("plain: ragged_step") for n in names)
  # Every program that holds the weights holds at least this chip's share.
  largest = max(p["argument_bytes"] for p in report["programs"])
  assert largest >= report["weight_bytes_per_chip"] + 32 * block


@needs_libtpu
@pytest.mark.slow
def test_programs_that_name_no_launch_are_refused_naming_the_launches():
  from paged_jax.models import pretrained

  with pytest.raises(
    ValueError, match=r"no launch named \['decode'\]; warm-up launches \[.*'decode_loop'"
  ):
    aot.compile_engine_programs(
      pretrained.load_tiny(), "v5e:1x1", variants={"plain": {}}, programs={"decode"}
    )


@pytest.mark.slow  # the hybrid manager's allocate and append compile: ~40 s on a loaded 2-core host
def test_a_hybrid_variants_pools_serve_the_sequences_it_reports():
  """The block manager on the pools of Gemma 3 4B's reported split serves
  its 22 sequences of 8k tokens at once, as the engine appends them
  (prompt chunks of 512 tokens, the first one short so no chunk starts on a
  block), without running out, and no sequence holds more blocks in a type
  than the split counted for it."""
  import jax
  import numpy as np

  import paged_jax as pj
  from paged_jax.block_manager.arguments import jit_op
  from paged_jax.block_manager.hybrid import HybridBlockSpaceManager, HybridCacheConfig

  gemma = aot.ShapeOnlyModel.named("gemma-3-4b").config
  report = aot_kv.kv_report(gemma, **GEMMA_4B_ON_V5E, block_bytes=0, hybrid={"h": None})
  pools = report["hybrid_kv"]["h"]
  count = pools["sequences_8k_per_chip"]
  kept = tuple(None if w is None else 1535 for w in map(gemma.layer_window, range(34)))
  cache = pj.CacheConfig(
    block_size=16, num_cpu_blocks=0, max_seqs=count, max_blocks_per_seq=512, watermark=0.0
  )
  blocks = tuple(t["gpu_blocks"] for t in pools["types"])
  manager = HybridBlockSpaceManager(HybridCacheConfig(cache, kept, gpu_blocks=blocks))
  allocate, append = jit_op(manager.allocate), jit_op(manager.append_slots)
  seq_ids = np.arange(count, dtype=np.int32)
  state = manager.init()
  for seq_id in range(count):  # admitted empty, as the engine admits a prompt on these tables
    state, result = allocate(state, np.array([seq_id], np.int32), np.zeros(1, np.int32), 0)
    assert int(result.status) == int(pj.Status.OK)
  most = np.zeros(2, int)
  for width in [505] + [512] * 15 + [7]:  # 8,192 tokens
    tokens = np.ones((count, 512), np.int32)
    state, result = append(state, seq_ids, tokens, np.full(count, width, np.int32))
    assert int(result.status) == int(pj.Status.OK), width
    tables = jax.device_get(manager.get_block_tables(state, seq_ids))
    most = np.maximum(most, [int((table >= 0).sum(axis=1).max()) for table in tables])
  assert list(most) <= [t["blocks_per_sequence"] for t in pools["types"]]
  assert most[0] == 512
