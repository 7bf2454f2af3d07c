"""What tests/sharding_worker.py runs: the tiny model on several CPU meshes.

Each function writes what it saw as JSON for tests/test_sharding.py to check.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import jax
import numpy as np
from flax import nnx

import paged_jax as pj
from paged_jax import kv_cache as kv_ops
from paged_jax import sharding
from paged_jax.block_manager import manager
from paged_jax.engine import programs
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.packing import PackedPrefill
from paged_jax.engine.runner import ModelRunner
from paged_jax.models import LlamaConfig, load_tiny
from paged_jax.paged_cache import paged_cache
from tests import engine_traces

MESHES = ((1, 2), (1, 4), (2, 2), (2, 4), (8, 1))
# Built with jax.make_mesh, whose axes are Explicit (JAX 0.10 and later); the
# others with sharding.make_mesh (Auto axes).
JAX_MESHES = ((1, 2), (2, 4))
NUM_GPU_BLOCKS = 48  # distinctive, to find cache-sized arrays in the HLO
CFG = pj.CacheConfig(
  block_size=8, num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_blocks=16, max_seqs=4, max_blocks_per_seq=8
)
SAMPLING = pj.SamplingParams(max_tokens=6)
# A collective's result: one shape, or a tuple of them (combined ops).
COLLECTIVE = re.compile(
  r"= (\([^)]*\)|\S+) (all-gather|all-to-all|collective-permute|all-reduce"
  r"|reduce-scatter)(?:-start)?\("
)


def requests() -> list[pj.Request]:
  rng = np.random.default_rng(0)
  return [pj.Request(rng.integers(0, 258, size=n).astype(np.int32)) for n in (5, 13)]


# The manager's ops jitted: run eagerly they go op by op, each op compiled
# on its own, which cost about 10 s of CPU here.
_allocate = manager.jit_op(manager.allocate)
_append_slots = manager.jit_op(manager.append_slots)
_block_tables = manager.jit_op(manager.get_block_tables)
_slot_mapping = manager.jit_op(manager.get_slot_mapping)


def tokens_of(outputs) -> list[list[int]]:
  return [samples[0].tolist() for samples in outputs]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, params, kv, tokens, positions, tables, slots):
  cache = paged_cache(kv=kv, block_tables=tables, slot_mapping=slots)
  logits, cache = nnx.merge(graphdef, params)(tokens, positions, cache)
  return logits, cache.kv


def logits_of(model, mesh, kv_cache_dtype=None) -> list[list[float]]:
  """Prefill logits of the prompts, then the logits of one decode step, on a
  cache of `kv_cache_dtype` (None: the model's compute dtype)."""
  prompts = [r.prompt for r in requests()]
  state, seqs, lengths = _prompt_state()
  config = model.config
  if mesh is not None:
    model = sharding.shard_model(model, mesh)
  kv = pj.KVCache.create(
    CFG,
    config.num_layers,
    config.num_kv_heads,
    config.head_dim,
    dtype=kv_cache_dtype or config.compute_dtype,
    mesh=mesh,
  )
  graphdef, params = nnx.split(model)
  width = 16
  ids = np.zeros((len(prompts), width), np.int32)
  positions = np.full((len(prompts), width), -1, np.int32)
  for row, prompt in enumerate(prompts):
    ids[row, : prompt.size] = prompt
    positions[row, : prompt.size] = np.arange(prompt.size)
  slots = _slot_mapping(state, seqs, lengths, width=width)
  prefill, kv = _forward(graphdef, params, kv, ids, positions, _block_tables(state, seqs), slots)
  last = np.asarray(prefill)[seqs, lengths - 1]
  token = np.argmax(last, axis=-1).astype(np.int32)[:, None]
  ones = np.ones(len(prompts), np.int32)
  state, _ = _append_slots(state, seqs, token, ones)
  decode, _ = _forward(
    graphdef,
    params,
    kv,
    token,
    lengths[:, None],
    _block_tables(state, seqs),
    _slot_mapping(state, seqs, ones, width=1),
  )
  valid = np.asarray(prefill)[positions >= 0]
  return [valid.ravel().tolist(), np.asarray(decode).ravel().tolist()]


@functools.partial(jax.jit, static_argnums=0)
def _attend(layer, kv, q, k, v, positions, tables, slots):
  cache = paged_cache(kv=kv, block_tables=tables, slot_mapping=slots)
  out, cache = cache.attend(layer, q, k, v, positions, sm_scale=0.2)
  return out, cache.kv


def quantized_attend(mesh) -> dict:
  """The same random K/V written into an int8 cache and attended by the
  prompts' rows (one per data shard) on `mesh` and on one device: whether
  the pages and scales are equal bit for bit (each data shard's blocks
  where the one-device cache has them) and the attention outputs' largest
  difference."""
  state, seqs, lengths = _prompt_state()
  width, num_q_heads, num_kv_heads, head_dim = 16, 4, 2, 32
  rng = np.random.default_rng(3)
  q = rng.standard_normal((len(seqs), width, num_q_heads, head_dim), np.float32)
  k, v = (rng.standard_normal((len(seqs), width, num_kv_heads, head_dim), np.float32) for _ in "kv")
  positions = np.full((len(seqs), width), -1, np.int32)
  for row, length in enumerate(lengths):
    positions[row, :length] = np.arange(length)
  tables, slots = _block_tables(state, seqs), _slot_mapping(state, seqs, lengths, width=width)
  runs = []
  for on in (None, mesh):
    kv = pj.KVCache.create(CFG, 1, num_kv_heads, head_dim, dtype="int8", mesh=on)
    out, kv = _attend(0, kv, q, k, v, positions, tables, slots)
    runs.append((np.asarray(out)[positions >= 0], kv))
  (want_out, want), (got_out, got) = runs
  data = mesh.shape["data"]
  # The rows use distinct blocks, so adding the shards' (zeroed elsewhere) blocks
  # lays them out as the one-device cache has them.
  merged = lambda x: np.asarray(x).reshape(x.shape[0], data, -1, *x.shape[2:]).sum(1, x.dtype)
  equal = all(
    np.array_equal(np.asarray(getattr(want, name)[0]), merged(getattr(got, name)[0]))
    for name in ("k", "v", "k_scale", "v_scale")
  )
  return {"pages_and_scales_equal": equal, "out_max_diff": float(np.abs(got_out - want_out).max())}


def _prompt_state():
  """The manager state with the prompts allocated, their seq ids and lengths."""
  prompts = [r.prompt for r in requests()]
  seqs = np.arange(len(prompts), dtype=np.int32)
  lengths = np.array([p.size for p in prompts], np.int32)
  state = pj.BlockSpaceManager(CFG).init()
  for seq, prompt in zip(seqs, prompts):
    tokens = np.zeros(CFG.max_tokens_per_seq, np.int32)
    tokens[: prompt.size] = prompt
    state, _ = _allocate(state, seqs[seq : seq + 1], tokens, prompt.size)
  return state, seqs, lengths


def device_bytes(kv) -> dict[str, list[int]]:
  """Bytes of device and host pages (and scales) on each device, from the
  shardings."""
  result = {}
  scales = (
    (kv.k_scale + kv.v_scale, kv.k_scale_host + kv.v_scale_host) if kv.quantized else ((), ())
  )
  for name, pages in (
    ("device", kv.k + kv.v + scales[0]),
    ("host", kv.k_host + kv.v_host + scales[1]),
  ):
    per_device = {}
    for array in pages:
      for shard in array.addressable_shards:
        per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    result[name] = [per_device[d] for d in sorted(per_device)]
  return result


def weight_bytes(model, mesh) -> list[int]:
  """Parameter bytes on each device of ``mesh`` after ``shard_model``."""
  per_device = {}
  params = nnx.state(sharding.shard_model(model, mesh), nnx.Param)
  for array in jax.tree.leaves(params):
    for shard in array.addressable_shards:
      per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
  return [per_device[d] for d in sorted(per_device)]


def collectives(hlo: str) -> list[list[str]]:
  """(op, result shape) of every collective in a compiled HLO text."""
  return [[op, shape] for shape, op in COLLECTIVE.findall(hlo)]


def step_collectives(model, mesh) -> dict[str, list[list[str]]]:
  """Collectives of the compiled decode loop, prefill and swaps on ``mesh``."""
  cache = CacheManager(CFG, model.config, mesh=mesh)
  runner = ModelRunner(model, cache, mesh=mesh)
  decode = programs.decode_loop.lower(
    runner.graphdef,
    runner.params,
    runner.table.sampling,
    runner.decode_carry(4, None),
    np.array(True),
  )
  packed = PackedPrefill.empty(cache.num_shards, (32, 2), runner.prefill_width)
  draws = cache.num_shards * CFG.max_seqs
  prefill = programs.prefill_step.lower(
    runner.graphdef,
    runner.params,
    cache.kv,
    cache.state,
    *packed.arrays(),
    np.zeros(draws, np.int32),
    jax.tree.map(lambda a: a[:draws], runner.table.sampling),
    0,
  )
  plan = np.zeros(8, np.int32)
  kv = cache.kv
  swaps = [
    kv_ops._jitted_for(kv, fn).lower(kv, plan, plan, np.int32(0))
    for fn in (kv_ops._swap_out, kv_ops._swap_in)
  ]
  return {
    name: collectives(lowered.compile().as_text())
    for name, lowered in (
      ("decode", decode),
      ("prefill", prefill),
      ("swap_out", swaps[0]),
      ("swap_in", swaps[1]),
    )
  }


def ops_match(mesh, dtype="float32") -> bool:
  """Sharded copy_blocks, swap_out, swap_in equal the one-device ops.

  Random pages and scales (NaN in the never-written host ones) and random
  plans, on a cache with 4 KV heads, so both layouts store the same heads;
  the one-device cache has every data shard's blocks side by side. Each
  shard copies its own blocks; the last shard swaps out, the first in.
  """
  rng = np.random.default_rng(1)
  heads, head_dim, data = 4, 32, mesh.shape["data"]
  all_blocks = dataclasses.replace(
    CFG, num_gpu_blocks=data * NUM_GPU_BLOCKS, num_cpu_blocks=data * CFG.num_cpu_blocks
  )
  one = pj.KVCache.create(all_blocks, 2, heads, head_dim, dtype=dtype)
  many = pj.KVCache.create(CFG, 2, heads, head_dim, dtype=dtype, mesh=mesh)
  shape, host_shape = one.k[0].shape, one.k_host[0].shape
  if one.quantized:
    pages = [rng.integers(-127, 128, shape).astype(np.int8) for _ in range(4)]
  else:
    pages = [rng.standard_normal(shape, np.float32) for _ in range(4)]
  host = np.frombuffer(
    rng.bytes(pages[0].nbytes * host_shape[1] // shape[1]), one.k_host[0].dtype
  ).reshape(host_shape)
  scales = [rng.random(shape[:3], np.float32) for _ in range(4)]
  nan = np.full(host_shape[:3], np.nan, np.float32)

  def fill(cache):
    put = lambda arrays, sharding_: tuple(jax.device_put(a, sharding_) for a in arrays)
    cache = cache.replace(
      k=put(pages[:2], cache.device_sharding),
      v=put(pages[2:], cache.device_sharding),
      k_host=put([host] * 2, cache.host_sharding),
      v_host=put([host] * 2, cache.host_sharding),
    )
    if not cache.quantized:
      return cache
    return cache.replace(
      k_scale=put(scales[:2], cache.device_sharding),
      v_scale=put(scales[2:], cache.device_sharding),
      k_scale_host=put([nan] * 2, cache.host_sharding),
      v_scale_host=put([nan] * 2, cache.host_sharding),
    )

  blocks = np.stack([rng.permutation(NUM_GPU_BLOCKS) for _ in range(data)]).astype(np.int32)
  counts = (5 + np.arange(data) % 2).astype(np.int32)
  cow = pj.CopyPlan(
    src=blocks[:, :6], dst=blocks[:, 6:12], count=counts, status=np.zeros(data, np.int32)
  )
  live = np.arange(6) < counts[:, None]
  offsets = NUM_GPU_BLOCKS * np.arange(data, dtype=np.int32)[:, None]
  global_ids = lambda ids: (ids + offsets)[live].astype(np.int32)
  one_cow = pj.CopyPlan(
    src=global_ids(blocks[:, :6]),
    dst=global_ids(blocks[:, 6:12]),
    count=np.int32(live.sum()),
    status=np.int32(0),
  )
  out = sharding.shard_plan(
    pj.SwapPlan(
      src=blocks[-1, 12:20], dst=np.arange(8, dtype=np.int32), count=np.int32(7), status=np.int32(0)
    ),
    data - 1,
    NUM_GPU_BLOCKS,
    CFG.num_cpu_blocks,
  )
  back = pj.SwapPlan(
    src=np.arange(8, dtype=np.int32), dst=blocks[0, 20:28], count=np.int32(7), status=np.int32(0)
  )
  results = []
  for cache, plan in (
    (fill(one), one_cow),
    (fill(many), cow),
  ):
    cache = pj.swap_in(pj.swap_out(pj.copy_blocks(cache, plan), out), back)
    results.append([np.asarray(a) for a in jax.tree.leaves(cache)])
  return all(np.array_equal(a, b, equal_nan=True) for a, b in zip(*results))


def row_mesh(mesh, row: int) -> jax.sharding.Mesh:
  """Data shard ``row`` of ``mesh`` as a ``(1, model)`` mesh."""
  return jax.sharding.Mesh(mesh.devices[row : row + 1], sharding.AXES)


# Every feature at once on a data-parallel mesh: prefix caching (two prompts
# share 16 tokens), seeded sampling with n=2, beam search, and preemption by
# swap (8 blocks per shard cannot hold the two greedy requests at once).
FEATURES_CFG = pj.CacheConfig(
  block_size=8,
  num_gpu_blocks=8,
  num_cpu_blocks=32,
  max_seqs=4,
  max_blocks_per_seq=8,
  watermark=0.0,
  enable_prefix_caching=True,
)


def feature_requests():
  """Loads n * (prompt + max_tokens) of 46, 43, 49, 38 tokens: the least
  loaded shard of each is 0, 1, 1, 0 (round robin would give 0, 1, 0, 1)."""
  rng = np.random.default_rng(2)
  shared = rng.integers(0, 258, 16)
  prompts = (
    [rng.integers(0, 258, 7)]
    + [np.concatenate([shared, rng.integers(0, 258, n)]) for n in (3, 9)]
    + [rng.integers(0, 258, 11)]
  )
  greedy = pj.SamplingParams(max_tokens=24)
  params = [
    pj.SamplingParams(max_tokens=16, n=2, temperature=0.8, seed=3),
    greedy,
    greedy,
    pj.SamplingParams(max_tokens=8, n=2, use_beam_search=True),
  ]
  return [(p.astype(np.int32), q) for p, q in zip(prompts, params)]


def features_engine(model, mesh, **options) -> pj.LLMEngine:
  """The engine of `serve_features` on ``mesh``, with more `options`."""
  return pj.LLMEngine(
    model,
    None,
    FEATURES_CFG,
    mesh=mesh,
    preemption_mode="swap",
    num_decode_steps=4,
    max_num_batched_tokens=32,
    **options,
  )


def serve_features(model, mesh, kv_cache_dtype=None, **options) -> dict:
  """Tokens and log-probs of `feature_requests` on an engine on ``mesh``
  (with more engine `options`), where each request went, and what the
  shards hold at the end; then where one more request goes once all have
  finished (their loads are gone)."""
  engine = features_engine(model, mesh, kv_cache_dtype=kv_cache_dtype, **options)
  requests = feature_requests()
  for i, (prompt, params) in enumerate(requests):
    engine.add_request(str(i), prompt, params)
  shards = [engine._groups[str(i)].shard for i in range(len(requests))]
  finals = {}
  while engine.has_unfinished_requests():
    for out in engine.step():
      if out.finished:
        finals[out.request_id] = out
    for shard in range(engine.cache_manager.num_shards):
      pj.check_invariants(engine.shard_state(shard))
  stats = engine.stats
  engine.add_request("late", requests[0][0], requests[0][1])
  late_shard = engine._groups["late"].shard
  engine.abort_request("late")
  engine.step()
  errors = {}
  if mesh is not None:
    try:
      _ = engine.state
    except ValueError as err:
      errors["state"] = str(err)
    plan = pj.CopyPlan(
      src=np.zeros(2, np.int32), dst=np.ones(2, np.int32), count=np.int32(1), status=np.int32(0)
    )
    try:
      pj.copy_blocks(engine.cache_manager.kv, plan)
    except ValueError as err:
      errors["copy_plan"] = str(err)
    try:
      engine.cache_manager.free([0, FEATURES_CFG.max_seqs], "late")  # slot 0 of shards 0, 1
    except ValueError as err:
      errors["slots"] = str(err)
  return {
    "errors": errors,
    "tokens": [[o.token_ids for o in finals[str(i)].outputs] for i in range(len(requests))],
    "logprobs": [
      [o.cumulative_logprob for o in finals[str(i)].outputs] for i in range(len(requests))
    ],
    "shards": shards,
    "late_shard": late_shard,
    "all_free": engine.num_free_gpu_blocks()
    == engine.cache_manager.num_shards * FEATURES_CFG.num_gpu_blocks,
    "swaps": stats.swaps,
    "preemptions": stats.preemptions,
    "hit_rate": stats.prefix_cache_hit_rate,
    "launches_ahead": stats.loop_launches_ahead,
  }


def speculating(out: str) -> None:
  """Tokens of `feature_requests` without the beam request (refused while
  speculating) on one device without speculation, then on a (2, 2) mesh
  with prompt lookup and with a draft model (the model itself), and their
  accepted proposals."""
  model, mesh = load_tiny(), sharding.make_mesh(2, 2)
  drafting = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
  result = {}
  for name, mesh_of_run, spec in (
    ("plain", None, None),
    ("ngram", mesh, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}),
    ("draft", mesh, {**drafting, "adaptive": False}),
  ):
    engine = features_engine(model, mesh_of_run, decode_row_buckets=(), speculative_config=spec)
    requests = feature_requests()[:3]
    for i, (prompt, params) in enumerate(requests):
      engine.add_request(str(i), prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
      for out_ in engine.step():
        if out_.finished:
          finals[out_.request_id] = out_
    result[name] = [[o.token_ids for o in finals[str(i)].outputs] for i in range(len(requests))]
    result[f"{name}_accepted"] = engine.stats.spec_decode_num_accepted_tokens
  with open(out, "w") as f:
    json.dump(result, f)


def head_errors() -> dict[str, str]:
  """What a model of 6 query heads and 2 KV heads meets on a (1, 4) mesh: its
  KV heads fit (each stored twice), its query heads do not split over 4."""
  config = LlamaConfig(
    vocab_size=16, num_layers=1, num_q_heads=6, num_kv_heads=2, head_dim=8, hidden=16, mlp_hidden=16
  )
  model = pj.models.Llama(config, rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh(1, 4)
  kv = pj.KVCache.create(CFG, 1, 2, 8, dtype="float32", mesh=mesh)
  errors = {"stored_kv_heads": str(kv.num_kv_heads)}
  tables = np.zeros((1, CFG.max_blocks_per_seq), np.int32)
  graphdef, params = nnx.split(model)
  try:  # the weights whole, the cache split: attention checks the heads
    _forward(
      graphdef,
      params,
      kv,
      np.ones((1, 1), np.int32),
      np.zeros((1, 1), np.int32),
      tables,
      tables[:, :1],
    )
  except ValueError as err:
    errors["attend"] = str(err)
  try:
    pj.LLMEngine(model, None, CFG, mesh=mesh)
  except ValueError as err:
    errors["engine"] = str(err)
  return errors


def mesh_of(shape) -> jax.sharding.Mesh:
  """A ``("data", "model")`` mesh of ``shape`` from the constructor
  ``JAX_MESHES`` picks for it."""
  if shape in JAX_MESHES:
    return jax.make_mesh(shape, sharding.AXES)
  return sharding.make_mesh(*shape)


def llm_tokens(model, mesh) -> list[list[int]]:
  """Greedy tokens of ``requests()`` through ``pj.LLM`` on ``mesh``."""
  llm = pj.LLM(model, None, CFG, mesh=mesh)
  return [
    out.outputs[0].token_ids for out in llm.generate([r.prompt for r in requests()], SAMPLING)
  ]


def random_traces(model, mesh) -> dict:
  """Randomized traces (tests/engine_traces.py) on two data shards, with
  `serve_features`' cache and engine arguments so that they reuse its
  programs; `PAGED_JAX_RANDOM_TRACES` sets the number of traces."""
  engine = pj.LLMEngine(
    model,
    engine_traces.TOKENIZER,
    FEATURES_CFG,
    mesh=mesh,
    preemption_mode="swap",
    num_decode_steps=4,
    max_num_batched_tokens=8,
  )
  seeds = range(5000, 5000 + int(os.environ.get("PAGED_JAX_RANDOM_TRACES", "1")))
  # Longer requests than on one device: each shard has 8 blocks of 8 tokens.
  shape = engine_traces.TraceShape(max_prompt=24, max_tokens=20)
  return engine_traces.run_traces(engine, seeds, shape)


def single_process(out: str) -> None:
  model = load_tiny()
  reqs = requests()
  result = {"reference": tokens_of(pj.generate(model, reqs, CFG, SAMPLING, jax.random.key(0))[0])}
  result["reference_logits"] = logits_of(model, None)
  result["int8_reference_logits"] = logits_of(model, None, "int8")
  result["unsharded_bytes"] = device_bytes(pj.KVCache.create(CFG, 4, 2, 32, dtype="float32"))
  result["unsharded_weight_bytes"] = sum(
    a.nbytes for a in jax.tree.leaves(nnx.state(model, nnx.Param))
  )
  for shape in MESHES:
    mesh = mesh_of(shape)
    name = f"{shape[0]}x{shape[1]}"
    result[name] = {
      "axis_types": [axis.name for axis in mesh.axis_types],
      "bytes": device_bytes(pj.KVCache.create(CFG, 4, 2, 32, dtype="float32", mesh=mesh)),
      "weight_bytes": weight_bytes(model, mesh),
    }
    if shape == (1, 2):  # the engine's offline form, as a user calls it
      result[name]["tokens"] = llm_tokens(model, mesh)
    if shape == (2, 4):
      result[name]["tokens"] = tokens_of(
        pj.generate(model, reqs, CFG, SAMPLING, jax.random.key(0), mesh=mesh)[0]
      )
    if shape in ((1, 2), (2, 2)):  # 2 rows: one per data shard
      result[name]["logits"] = logits_of(model, mesh)
    if shape == (8, 1):  # a tensor-parallel-free row, off device 0
      result[name]["logits"] = logits_of(model, row_mesh(mesh, 7))
  result["head_errors"] = head_errors()
  result["features_reference"] = serve_features(model, None)
  result["features_2x2"] = serve_features(model, sharding.make_mesh(2, 2))
  result["features_2x2_async"] = serve_features(
    model, sharding.make_mesh(2, 2), async_scheduling=True
  )
  result["random_traces_2x2"] = random_traces(model, sharding.make_mesh(2, 2))
  result["ops_match"] = ops_match(sharding.make_mesh(2, 2))
  result["int8_ops_match"] = ops_match(sharding.make_mesh(2, 2), "int8")
  int8_mesh = sharding.make_mesh(2, 2)
  result["int8_2x2_logits"] = logits_of(model, int8_mesh, "int8")
  result["int8_2x2_attend"] = quantized_attend(int8_mesh)
  result["int8_2x2_bytes"] = device_bytes(
    pj.KVCache.create(CFG, 4, 2, 32, dtype="int8", mesh=int8_mesh)
  )
  result["int8_unsharded_bytes"] = device_bytes(pj.KVCache.create(CFG, 4, 2, 32, dtype="int8"))
  for shape in ((1, 2), (2, 2)):
    result[f"{shape[0]}x{shape[1]}"]["collectives"] = step_collectives(
      model, sharding.make_mesh(*shape)
    )
  with open(out, "w") as f:
    json.dump(result, f)


def multi_process(out: str) -> None:
  """One process of a two-process run: serves one (2, 4) mesh over both, then
  the same requests on one of its own devices."""
  model, reqs = load_tiny(), requests()
  outputs, stats = pj.generate(
    model, reqs, CFG, SAMPLING, jax.random.key(0), mesh=sharding.make_mesh(2, 4)
  )
  own = sharding.make_mesh(1, 1, devices=jax.local_devices())
  reference, _ = pj.generate(model, reqs, CFG, SAMPLING, jax.random.key(0), mesh=own)
  with open(out, "w") as f:
    json.dump(
      {
        "tokens": tokens_of(outputs),
        "reference": tokens_of(reference),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "process_index": jax.process_index(),
        "generated_tokens": stats.generated_tokens,
      },
      f,
    )
