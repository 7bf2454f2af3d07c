"""Tensor and data parallel serving on CPU meshes, and over two processes.

The mesh checks run in subprocesses (tests/sharding_worker.py) with forced
host devices, so the rest of the suite keeps one device: one process with 8
devices for the meshes (1, 2), (1, 4), (2, 2), (2, 4), (8, 1) (two of them
built by ``jax.make_mesh``, whose axes are Explicit, the rest by
``sharding.make_mesh``), and two processes of 4 devices on localhost for one
(2, 4) mesh over both (its data shards one per process, in one program).

Each engine on a new mesh compiles its programs anew (about 10 s of CPU),
so engines serve on three meshes: (1, 2) and (2, 4) (both of Explicit
axes) greedy requests, and (2, 2) every feature at once and the random
traces. Logits, cache and weight placement, and collectives are checked on
the others without an engine.
"""

import fcntl
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import sharding
from paged_jax.block_manager import manager
from paged_jax.block_manager.state import init_states, on_every_shard
from paged_jax.models import LlamaConfig
from paged_jax.paged_cache import ShardedPagedCache, paged_cache
from tests.conftest import FAST_COMPILE

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESHES = ("1x2", "1x4", "2x2", "2x4", "8x1")
TIMEOUT_S = 1200  # the full suite on a loaded 2-core machine


def _env(num_devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices} {FAST_COMPILE}"
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _worker(out, *extra):
  return [sys.executable, "-m", "tests.sharding_worker", str(out), *extra]


@pytest.fixture(scope="session")
def meshes(tmp_path_factory, worker_id):
  """What the 8-device run saw on every mesh: run once per session, its JSON
  shared by the pytest-xdist workers (the first to come runs it)."""
  shared = tmp_path_factory.getbasetemp()
  if worker_id != "master":
    shared = shared.parent
  out = shared / "sharding_meshes.json"
  with open(shared / "sharding_meshes.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not out.exists():
      result = subprocess.run(
        _worker(out), cwd=ROOT, env=_env(8), capture_output=True, text=True, timeout=TIMEOUT_S
      )
      assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(out.read_text())


@pytest.mark.slow
def test_every_mesh_gives_the_single_device_tokens(meshes):
  # (2, 2) serves the same requests among others: test_data_shards_serve_every_feature...
  for name in ("1x2", "2x4"):
    assert meshes[name]["tokens"] == meshes["reference"], name


@pytest.mark.slow
def test_meshes_of_explicit_axes_serve_as_auto_ones_do(meshes):
  # jax.make_mesh's Explicit axes once failed deep inside generate (a
  # sharding constraint on Explicit axes); 1x2 serves through pj.LLM.
  for name in ("1x2", "2x4"):
    assert meshes[name]["axis_types"] == ["Explicit", "Explicit"], name
    assert meshes[name]["tokens"] == meshes["reference"], name
  assert meshes["2x2"]["axis_types"] == ["Auto", "Auto"]


@pytest.mark.slow
def test_query_heads_that_do_not_split_are_named(meshes):
  # 6 query heads, 2 KV heads on a (1, 4) mesh: the cache stores each KV
  # head twice, and the query heads are checked where they are known.
  errors = meshes["head_errors"]
  assert errors["stored_kv_heads"] == "4"
  message = "num_q_heads (6) must be a multiple of the model axis (4)"
  assert message in errors["attend"]
  assert message in errors["engine"]


@pytest.mark.slow
def test_every_layout_gives_the_single_device_logits(meshes):
  # 1x2 and 2x2 run on the whole mesh (one prompt per data shard); 8x1 on
  # its last row (a one-device row off device 0).
  for name in ("1x2", "2x2", "8x1"):
    for got, want in zip(meshes[name]["logits"], meshes["reference_logits"]):
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=name)


@pytest.mark.slow
def test_each_device_holds_its_share_of_the_cache(meshes):
  full = meshes["unsharded_bytes"]
  # Each data shard has a one-device cache's blocks. The tiny model has 2 KV
  # heads: 2 model shards split them, 4 store each head twice and hold one
  # head each, so a device holds half either way.
  for name, data, tp in (("1x2", 1, 2), ("1x4", 1, 4), ("2x2", 2, 2), ("2x4", 2, 4), ("8x1", 8, 1)):
    share = max(1, 2 // tp) / 2 if tp > 1 else 1
    for kind in ("device", "host"):
      per_device = meshes[name]["bytes"][kind]
      assert per_device == [full[kind][0] * share] * (data * tp), (name, kind)


@pytest.mark.slow
def test_weights_are_split_over_the_model_axis(meshes):
  full = meshes["unsharded_weight_bytes"]
  # Only the norms stay whole at tp=2; at tp=4 k/v (2 KV heads) and the
  # 258-token embedding are replicated too.
  for name, bound in (("1x2", 0.51), ("2x2", 0.51), ("1x4", 0.32), ("2x4", 0.32), ("8x1", 1.0)):
    assert max(meshes[name]["weight_bytes"]) <= bound * full, name


@pytest.mark.slow
def test_no_step_moves_a_cache_between_devices(meshes):
  # Pages are [heads, 48 blocks (96 on 2 data shards), 8, 32], and a shard's
  # part of them [heads, 48, 8, 32]; no collective may carry one.
  page = re.compile(r"\[\d+,(48|96),8,32\]")
  for name in ("1x2", "2x2"):
    steps = meshes[name]["collectives"]
    for step, ops in steps.items():
      assert not [op for op in ops if page.search(op[1])], (name, step, ops)
    # Tensor parallel for real: the row-split projections all-reduce.
    assert any(op == "all-reduce" for op, _ in steps["decode"]), name


@pytest.mark.slow
def test_data_shards_serve_every_feature_as_one_device_does(meshes):
  # Ragged steps (prompt chunks with a decode step) split over the mesh too.
  want, got = meshes["features_reference"], meshes["features_2x2"]
  _assert_same_tokens_and_logprobs(got, want)
  # Each request went to the shard with the fewest tokens outstanding, and
  # finished requests no longer count: a new one goes to shard 0 again.
  assert got["shards"] == [0, 1, 1, 0]
  assert got["late_shard"] == 0
  assert got["all_free"] and want["all_free"]
  assert got["swaps"] > 0 and got["preemptions"] > 0
  assert got["hit_rate"] > 0
  assert "the engine has 2 data shards: use engine.shard_state" in got["errors"]["state"]
  assert "a cache of 2 data shards needs one copy plan per shard" in got["errors"]["copy_plan"]
  assert "slots [0, 4] span several data shards" in got["errors"]["slots"]


@pytest.mark.slow
def test_async_scheduling_on_data_shards_serves_as_one_device_does(meshes):
  # Decode launches dispatched ahead on both data shards of one program.
  want, got = meshes["features_reference"], meshes["features_2x2_async"]
  _assert_same_tokens_and_logprobs(got, want)
  assert got["all_free"] and got["launches_ahead"] > 0


def _assert_same_tokens_and_logprobs(got: dict, want: dict) -> None:
  """`serve_features` results with equal tokens and close log-probabilities."""
  assert got["tokens"] == want["tokens"]
  np.testing.assert_allclose(
    [x for row in got["logprobs"] for x in row],
    [x for row in want["logprobs"] for x in row],
    atol=1e-4,
  )


@pytest.mark.slow  # its own process: three engines compile (about a minute)
def test_speculation_on_two_data_shards_gives_the_tokens_of_one_device(tmp_path):
  # Prompt lookup and a draft model on a (2, 2) mesh: the greedy and seeded
  # requests' tokens equal those served without speculation on one device
  # (the seeded one: prompt lookup only; a sampled draft keeps the
  # distribution, not the draws).
  out = tmp_path / "speculating.json"
  result = subprocess.run(
    _worker(out, "--speculating"),
    cwd=ROOT,
    env=_env(8),
    capture_output=True,
    text=True,
    timeout=TIMEOUT_S,
  )
  assert result.returncode == 0, result.stderr[-4000:]
  got = json.loads(out.read_text())
  assert got["ngram"] == got["plain"]
  assert got["draft"][1:] == got["plain"][1:]
  assert got["ngram_accepted"] > 0 and got["draft_accepted"] > 0


@pytest.mark.slow
def test_random_traces_on_two_data_shards(meshes):
  # tests/engine_traces.py on a (2, 2) mesh: every check after every step
  # on both shards' states, and every reproducible request equal to itself
  # served alone.
  traces = meshes["random_traces_2x2"]
  assert not traces["failures"], traces["failures"][0]
  # (Aborts are covered on one device: tests/test_engine_random.py.)
  assert traces["compared"] > 0 and traces["preemptions"] > 0


@pytest.mark.slow
def test_sharded_copy_and_swaps_match_one_device(meshes):
  # On a (2, 2) mesh: heads over "model", each data shard's blocks its own.
  assert meshes["ops_match"] is True
  assert meshes["int8_ops_match"] is True  # pages and scales, bit for bit


@pytest.mark.slow
def test_a_quantized_cache_serves_sharded(meshes):
  # The same K/V written into an int8 cache and attended on each shard of a
  # (2, 2) mesh: pages and scales bit for bit, attention to float rounding.
  attend = meshes["int8_2x2_attend"]
  assert attend["pages_and_scales_equal"] is True
  assert attend["out_max_diff"] < 1e-6
  # Through the model, the K/V computed on the mesh differ from one device's
  # in their last bits (float32 logits agree to 1e-5, above), and rounding to
  # int8 can turn a value at a half-code boundary into the next code (on JAX
  # 0.12's XLA:CPU: 1 of about 1,150 codes of layer 0, which moves the logits
  # by 1.5e-3 at prefill and 5.8e-3 at decode). So the sharded int8 logits
  # stay within half of int8's own error against float32 (0.038 and 0.019).
  for got, want, exact in zip(
    meshes["int8_2x2_logits"], meshes["int8_reference_logits"], meshes["reference_logits"]
  ):
    got, want, exact = map(np.asarray, (got, want, exact))
    assert np.abs(got - want).max() < 0.5 * np.abs(want - exact).max()
  full = meshes["int8_unsharded_bytes"]
  for kind in ("device", "host"):  # pages and scales split over 2 heads
    assert meshes["int8_2x2_bytes"][kind] == [full[kind][0] // 2] * 4


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_give_the_one_device_tokens(tmp_path):
  port = _free_port()
  procs = [
    subprocess.Popen(
      _worker(tmp_path / f"{i}.json", "--port", str(port), "--process_id", str(i)),
      cwd=ROOT,
      env=_env(4),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  try:
    logs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  for proc, log in zip(procs, logs):
    assert proc.returncode == 0, log[-4000:]
  seen = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
  for i in range(2):
    assert seen[i]["process_index"] == i
    assert (seen[i]["devices"], seen[i]["local_devices"]) == (8, 4)
    # Every process returns every output, of both data shards, and counts
    # every shard's tokens.
    assert seen[i]["tokens"] == seen[i]["reference"]
    assert seen[i]["generated_tokens"] == sum(map(len, seen[i]["tokens"]))
  assert seen[0]["tokens"] == seen[1]["tokens"]


# In-process checks on the one device of the suite.


def test_make_mesh_rejects_bad_sizes():
  with pytest.raises(ValueError, match="model must be an int >= 1"):
    sharding.make_mesh(1, 0)
  with pytest.raises(ValueError, match="needs 2 devices, 1 available"):
    sharding.make_mesh(2, 1, devices=jax.devices()[:1])
  mesh = sharding.make_mesh(1, 1)
  assert mesh.axis_names == ("data", "model")


def test_heads_must_split_over_the_model_axis():
  sharding.check_heads(8, 2, 4)
  sharding.check_heads(8, 4, 2)
  with pytest.raises(ValueError, match=r"num_q_heads \(6\) must be a multiple"):
    sharding.check_heads(6, 2, 4)
  with pytest.raises(ValueError, match=r"num_kv_heads \(3\) and the model"):
    sharding.check_heads(12, 3, 2)
  wrong = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("model", "data"))
  with pytest.raises(ValueError, match="mesh axes must be"):
    sharding.check_axes(wrong)
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, max_seqs=1, max_blocks_per_seq=2
  )
  with pytest.raises(ValueError, match="mesh axes must be"):
    pj.KVCache.create(cfg, 1, 2, 8, dtype="float32", mesh=wrong)
  with pytest.raises(ValueError, match="a device or a mesh, not both"):
    pj.KVCache.create(cfg, 1, 2, 8, device=jax.devices()[0], mesh=sharding.make_mesh(1, 1))


def test_a_mesh_of_explicit_axes_is_served_with_auto_axes():
  explicit = jax.make_mesh((1, 1), sharding.AXES)
  assert explicit.axis_types == (jax.sharding.AxisType.Explicit,) * 2
  auto = sharding.serving_mesh(explicit)
  assert auto.axis_types == (jax.sharding.AxisType.Auto,) * 2
  assert auto.devices.tolist() == explicit.devices.tolist()
  assert sharding.serving_mesh(auto) is auto
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, max_seqs=1, max_blocks_per_seq=2
  )
  cache = pj.KVCache.create(cfg, 1, 2, 8, dtype="float32", mesh=explicit)
  assert cache.mesh == auto
  assert cache.k[0].sharding.spec == sharding.PAGES


@pytest.mark.parametrize(
  "path, shape, tp, kv_heads, spec",
  [
    ("blocks/0/attention/q_proj/kernel", (256, 256), 4, 2, sharding.P("model", None)),
    ("blocks/0/attention/k_proj/kernel", (64, 256), 2, 2, sharding.P("model", None)),
    ("blocks/0/attention/k_proj/kernel", (64, 256), 4, 2, sharding.P()),
    ("blocks/1/attention/q_proj/bias", (256,), 4, 4, sharding.P("model")),
    ("blocks/0/attention/o_proj/kernel", (256, 256), 4, 2, sharding.P(None, "model")),
    ("blocks/0/mlp/down_proj/kernel", (256, 512), 2, 2, sharding.P(None, "model")),
    ("embed/embedding", (258, 256), 2, 2, sharding.P("model", None)),
    ("embed/embedding", (258, 256), 4, 2, sharding.P(None, None)),
    ("lm_head/kernel", (260, 256), 4, 2, sharding.P("model", None)),
    ("blocks/0/attention/q_norm/scale", (32,), 4, 2, sharding.P()),
    ("final_norm/scale", (256,), 4, 2, sharding.P()),
  ],
)
def test_partition_rules(path, shape, tp, kv_heads, spec):
  assert sharding.partition_spec(path, shape, tp, num_kv_heads=kv_heads) == spec


def test_shard_model_places_every_parameter_by_its_rule():
  model = pj.models.Llama(
    LlamaConfig(
      vocab_size=16,
      num_layers=1,
      num_q_heads=2,
      num_kv_heads=1,
      head_dim=4,
      hidden=8,
      mlp_hidden=16,
    ),
    rngs=nnx.Rngs(0),
  )
  sharded = sharding.shard_model(model, sharding.make_mesh(1, 1))
  kernel = sharded.blocks[0].attention.q_proj.kernel[...]
  assert kernel.sharding.spec == sharding.P("model", None)
  down = sharded.blocks[0].mlp.down_proj.kernel[...]
  assert down.sharding.spec == sharding.P(None, "model")
  assert sharded.final_norm.scale[...].sharding.spec == sharding.P()
  np.testing.assert_array_equal(kernel, model.blocks[0].attention.q_proj.kernel[...])


def test_batched_states_match_one_state_per_shard():
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=16, num_cpu_blocks=4, max_seqs=4, max_blocks_per_seq=4
  )
  bm = pj.BlockSpaceManager(cfg)
  states = init_states(cfg, 3)
  lengths = np.array([5, 13, 1], np.int32)
  tokens = np.arange(3 * 16, dtype=np.int32).reshape(3, 16)
  seq_ids = np.array([[0], [2], [1]], np.int32)
  states, results = jax.jit(jax.vmap(manager.allocate))(states, seq_ids, tokens, lengths)
  assert (np.asarray(results.status) == 0).all()
  allocate = jax.jit(manager.allocate)
  for shard in range(3):
    one, _ = allocate(bm.init(), seq_ids[shard], tokens[shard], lengths[shard])
    mine = jax.tree.map(lambda x, s=shard: x[s], states)
    for got, want in zip(jax.tree.leaves(mine), jax.tree.leaves(one)):
      np.testing.assert_array_equal(got, want)
  free = jax.vmap(manager.num_free_gpu_blocks)(states)
  np.testing.assert_array_equal(free, [14, 12, 15])


@pytest.mark.parametrize("num_shards", [1, 3])
def test_on_every_shard_equals_the_op_on_each_shard(num_shards):
  """One shard runs the op unbatched, several under vmap: the same states and
  results as the op on each shard alone, with the shard axis kept."""
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=16, num_cpu_blocks=4, max_seqs=4, max_blocks_per_seq=4
  )
  lengths = np.array([5, 13, 1][:num_shards], np.int32)
  tokens = np.arange(num_shards * 16, dtype=np.int32).reshape(num_shards, 16)
  seq_ids = np.array([[0], [2], [1]][:num_shards], np.int32)
  states, results = jax.jit(on_every_shard(manager.allocate))(
    init_states(cfg, num_shards), seq_ids, tokens, lengths
  )
  allocate = jax.jit(manager.allocate)
  for shard in range(num_shards):
    one = allocate(manager.init_state(cfg), seq_ids[shard], tokens[shard], lengths[shard])
    mine = jax.tree.map(lambda x, s=shard: x[s], (states, results))
    for got, want in zip(jax.tree.leaves(mine), jax.tree.leaves(one), strict=True):
      np.testing.assert_array_equal(got, want)


def test_a_shards_swap_plan_moves_its_own_blocks():
  plan = pj.SwapPlan(
    src=np.array([3, 0, -1], np.int32),
    dst=np.array([1, 2, -1], np.int32),
    count=np.int32(2),
    status=np.int32(0),
  )
  moved = sharding.shard_plan(plan, 2, num_src_blocks=10, num_dst_blocks=4)
  np.testing.assert_array_equal(moved.src, [23, 20, -1])
  np.testing.assert_array_equal(moved.dst, [9, 10, -1])
  assert int(moved.count) == 2


def test_sharded_copy_checks_a_concrete_plan():
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=4, num_cpu_blocks=2, max_seqs=1, max_blocks_per_seq=2
  )
  cache = pj.KVCache.create(cfg, 1, 2, 8, dtype="float32", mesh=sharding.make_mesh(1, 1))
  bad = pj.CopyPlan(
    src=np.array([0], np.int32), dst=np.array([4], np.int32), count=np.int32(1), status=np.int32(0)
  )
  with pytest.raises(ValueError, match="dst block 4 is out of range 0..3"):
    pj.copy_blocks(cache, bad)
  batched = jax.tree.map(lambda a: np.stack([a, a]), bad)  # two shards' plans, one shard
  with pytest.raises(ValueError, match=r"plan.src must be int32\[1, capacity\], got int32\[2, 1\]"):
    pj.copy_blocks(cache, batched)
  with pytest.raises(ValueError, match="swap_out plan entry 0: dst block 4"):
    pj.swap_out(cache, bad)
  with pytest.raises(ValueError, match="swap_in plan entry 0: src block 2 is out of range 0..1"):
    pj.swap_in(
      cache,
      pj.SwapPlan(
        src=np.array([2], np.int32),
        dst=np.array([0], np.int32),
        count=np.int32(1),
        status=np.int32(0),
      ),
    )


def test_an_engine_rejects_a_mesh_without_the_axes():
  wrong = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("device",))
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, max_seqs=1, max_blocks_per_seq=2
  )
  with pytest.raises(ValueError, match="mesh axes must be"):
    pj.LLMEngine(pj.models.load_tiny(), None, cfg, mesh=wrong)


def test_the_sharded_cache_refuses_a_sliding_window_model():
  # As the one-device PagedCache does (it once failed with a TypeError).
  config = LlamaConfig(
    vocab_size=16,
    num_layers=1,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=4,
    hidden=8,
    mlp_hidden=16,
    sliding_window=3,
  )
  windowed = pj.models.Llama(config, rngs=nnx.Rngs(0))
  cfg = pj.CacheConfig(
    block_size=4, num_gpu_blocks=4, num_cpu_blocks=0, max_seqs=1, max_blocks_per_seq=2
  )
  kv = pj.KVCache.create(cfg, 1, 1, 4, dtype="float32", mesh=sharding.make_mesh(1, 1))
  # A cache that frees the blocks outside a window of 2 cannot serve a layer
  # that reads 3 keys back.
  tables, slots = np.zeros((1, 2), np.int32), np.zeros((1, 1), np.int32)
  cache = paged_cache(kv, tables, slots, cache_sliding_window=2)
  assert isinstance(cache, ShardedPagedCache)
  with pytest.raises(ValueError, match="frees the blocks outside a window of 2"):
    windowed(np.ones((1, 1), np.int32), np.zeros((1, 1), np.int32), cache)
