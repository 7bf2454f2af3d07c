"""Ahead-of-time TPU compiles without a TPU: `python -m paged_jax aot`.

The engine's own warm-up runs on the host (CPU) in a capture mode in which
every jitted program it launches (`engine.programs`, the cache manager's
calls) is recorded with its arguments. Each recorded launch is then lowered
again from `jax.ShapeDtypeStruct`s whose shardings sit on a mesh of a named
TPU topology's compile-only devices (the same `PartitionSpec`s as on the
host mesh), with the kernels chosen for TPU (`kernel_choice.target_platform`:
Mosaic paged attention, the TPU `write_kv` and `copy_blocks`), and compiled
by libtpu on this host. No array is ever placed on a TPU.

A shape-only model (`SHAPE_ONLY`: Llama-3-8B, Gemma-3-4B; `ShapeOnlyModel`)
has no weights anywhere: warm-up is captured on a narrow stand-in with the
model's vocabulary, heads and layer kinds, and each launch is compiled with
the model's graph, its parameters as sharded `jax.ShapeDtypeStruct`s
(`nnx.eval_shape`) and a cache of its layers.

The set compiled is warm-up's set for each engine variant of `VARIANTS`
(plain, int8 and fp8 pages, async scheduling's carries, n-gram
speculation with its prefill apart; on request, `OPTIONAL_VARIANTS`' hybrid
tables, one block table per attention type, the decode loop's arrival
check, a host callback per step that an engine leaves off by default, and
streamed decode steps, a host callback per step too);
beams are part of every variant's every-slot decode loop, and every
program carries the engine's automaton table (structured outputs;
`pj.TableCapacity.for_vocabulary` of the model's vocabulary). Swaps are
left out (no host pages: `num_cpu_blocks` 0).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import math
import os
import time

from paged_jax.aot_kv import BLOCK_SIZE, SEQUENCE_TOKENS, kv_report

INSTALL_HINT = 'pip install "jax[tpu]" (needs Python >= 3.12 and JAX >= 0.12, which bring libtpu)'
# HBM per chip of the TPU generations the topology names start with.
HBM_BYTES = {"v5e": 16 * 2**30, "v6e": 32 * 2**30}
KNOWN_TOPOLOGIES = ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v6e:1x1", "v6e:2x2", "v6e:2x4")
# Shape-only models (`--model NAME`): the text configs of the published
# checkpoints, in Hugging Face's `config.json` form (read by
# `hf_checkpoint.config_from_hf`), without weights.
SHAPE_ONLY = {
  "llama-3-8b": {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
  },
  "gemma-3-4b": {  # the text decoder of Gemma3ForConditionalGeneration
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 262208,
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "num_hidden_layers": 34,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
  },
}
# Width of a shape-only model's stand-in (see `ShapeOnlyModel.stand_in`).
STAND_IN_WIDTH = 128
VARIANTS = {
  "plain": {},
  "int8 pages": dict(kv_cache_dtype="int8"),
  "fp8 pages": dict(kv_cache_dtype="float8_e4m3fn"),
  "async scheduling": dict(async_scheduling=True),
  "speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
}
# Variants compiled only when asked for (`--variant`): one block table per
# attention type (for a model with several; one chip, tensor parallel 1),
# the arrival check (`LLMEngine`'s `stop_decode_on_arrival`) and streamed
# decode steps (`stream_steps`, one chip).
OPTIONAL_VARIANTS = {
  "hybrid tables": dict(hybrid_kv_cache=True),
  "arrival check": dict(stop_decode_on_arrival=True),
  "stream steps": dict(stream_steps=True),
}


def require_libtpu() -> None:
  """Raises RuntimeError saying how to install libtpu unless JAX >= 0.12 with
  libtpu is importable."""
  import jax

  version = tuple(int(p) for p in jax.__version__.split(".")[:2])
  if version < (0, 12) or importlib.util.find_spec("libtpu") is None:
    raise RuntimeError(
      f"the TPU compile tool needs libtpu (JAX {jax.__version__} here has none): {INSTALL_HINT}"
    )


def topology_devices(name: str) -> list:
  """The compile-only TPU devices of topology `name` (e.g. ``"v5e:2x2"``).

  Raises:
    ValueError: naming `name` and some topologies libtpu knows.
  """
  from jax.experimental import topologies

  # Compile-only devices: another process holding libtpu does not matter.
  # Read when libtpu first loads, so set before the first topology.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
  except Exception as err:  # libtpu raises its own runtime errors for bad names
    if "lockfile" in str(err):  # another process holds libtpu
      raise RuntimeError(f"{err} (or set ALLOW_MULTIPLE_LIBTPU_LOAD=1)") from err
    raise ValueError(
      f"libtpu does not know topology {name!r} (known, e.g.: {', '.join(KNOWN_TOPOLOGIES)}): "
      f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
    ) from err


def hbm_per_chip(topology: str) -> int:
  """HBM bytes of one chip of `topology` (by its generation prefix)."""
  generation = topology.split(":")[0]
  if generation not in HBM_BYTES:
    raise ValueError(f"no HBM size known for {generation!r} (known: {', '.join(HBM_BYTES)})")
  return HBM_BYTES[generation]


def check_mesh(num_q_heads: int, num_kv_heads: int, tp: int, num_devices: int) -> None:
  """Raises ValueError unless `tp` equals the topology's `num_devices` chips
  and splits the heads (naming the numbers)."""
  from paged_jax import sharding

  if tp != num_devices:
    raise ValueError(f"--tensor-parallel-size {tp} must equal the topology's {num_devices} chips")
  sharding.check_heads(num_q_heads, num_kv_heads, tp)


class ShapeOnlyModel:
  """A model known by its config alone: no weights are ever allocated.

  The host engine whose warm-up is captured runs a small real stand-in
  (`stand_in`); each captured launch then gets this model's graph, its
  parameters as sharded `jax.ShapeDtypeStruct`s (`abstract_params`) and a
  KV cache of its layers (`with_layers`) before it is compiled.
  """

  def __init__(self, config, quantization: str | None = None):
    self.config = config
    self.quantization = quantization

  @classmethod
  def named(
    cls,
    name: str,
    dtype: str = "bfloat16",
    max_seq_len: int = SEQUENCE_TOKENS,
    quantization: str | None = None,
  ):
    """The shape-only model `name` (a key of `SHAPE_ONLY`) in `dtype`, its
    block tables sized for `max_seq_len` tokens, its decoder blocks' linear
    layers kept quantized as `quantization` says (None, "int8", "int4"; as
    `quantized.quantize_model` would)."""
    from paged_jax.models import quantized
    from paged_jax.models.hf_checkpoint import config_from_hf

    if name not in SHAPE_ONLY:
      raise ValueError(f"no shape-only model {name!r} (known: {', '.join(SHAPE_ONLY)})")
    if quantization is not None and quantization not in quantized.METHODS:
      raise ValueError(
        f"a shape-only model's quantization must be one of {quantized.METHODS}, "
        f"got {quantization!r}"
      )
    config = config_from_hf(SHAPE_ONLY[name], dtype=dtype, max_seq_len=max_seq_len)
    return cls(config, quantization)

  def stand_in(self):
    """A real model the host runs warm-up with: this model's vocabulary,
    heads and head size (so the launches' other arguments and the cache's
    sharding are this model's), one layer of each kind, `STAND_IN_WIDTH`
    wide."""
    from flax import nnx

    from paged_jax.models.llama import Llama
    from paged_jax.models.quantized import quantize_loaded

    config = self.config
    kinds = None if config.layer_types is None else kv_kinds(config)
    small = dataclasses.replace(
      config,
      num_layers=1 if kinds is None else len(kinds),
      layer_types=kinds,
      hidden=STAND_IN_WIDTH,
      mlp_hidden=2 * STAND_IN_WIDTH,
    )
    return quantize_loaded(Llama(small, rngs=nnx.Rngs(0)), self.quantization, "the stand-in")

  def abstract_params(self, mesh):
    """`(graph, params)`: the model's `HashedGraph` and its parameters
    (quantized ones as `quantized.quantize_shapes` makes them) as
    `jax.ShapeDtypeStruct`s on `mesh` (see `abstract_params`)."""
    from flax import nnx

    from paged_jax.models.llama import Llama
    from paged_jax.models.quantized import quantize_shapes

    def build():
      model = Llama(self.config, rngs=nnx.Rngs(0))
      return model if self.quantization is None else quantize_shapes(model, self.quantization)

    return abstract_params(nnx.eval_shape(build), mesh)

  def with_layers(self, kv):
    """The cache `kv` of the stand-in with every per-layer page and scale
    array repeated for this model's layers (their shapes are the same); a
    hybrid cache's each type's for this model's layers of that type."""
    from paged_jax.hybrid_kv import HybridKVCache

    if isinstance(kv, HybridKVCache):
      return self._hybrid_with_layers(kv)
    return _grown(kv, self.config.num_layers)

  def _hybrid_with_layers(self, kv):
    """A stand-in's `HybridKVCache` (one layer per kind) with this model's
    layers: each layer's type is the stand-in's of its kind."""
    stand_in = dict(zip(kv_kinds(self.config), kv.cfg.layer_windows))
    windows = tuple(stand_in[kind] for kind in self.config.layer_types)
    cfg = dataclasses.replace(kv.cfg, layer_windows=windows)
    types = tuple(_grown(c, windows.count(w)) for c, w in zip(kv.types, cfg.windows))
    return kv.replace(cfg=cfg, types=types)


def kv_kinds(config) -> tuple:
  """The distinct layer kinds of `config`, in order (the stand-in's layers)."""
  return tuple(dict.fromkeys(config.layer_types))


def _grown(kv, layers: int):
  """`kv` with every per-layer array repeated for `layers` layers."""
  grow = lambda pages: None if pages is None else (pages[0],) * layers
  fields = ("k", "v", "k_host", "v_host", "k_scale", "v_scale", "k_scale_host", "v_scale_host")
  return kv.replace(**{name: grow(getattr(kv, name)) for name in fields})


def abstract_params(model, mesh):
  """`(graph, params)`: `model`'s `HashedGraph` and its parameters as
  `jax.ShapeDtypeStruct`s placed on `mesh` by the engine's tensor-parallel
  rules (`sharding.state_partition_specs`)."""
  import jax
  from flax import nnx
  from jax.sharding import NamedSharding

  from paged_jax import sharding
  from paged_jax.engine.programs import HashedGraph

  graphdef, state = nnx.split(sharding.place_quantized(model, mesh))
  specs = sharding.state_partition_specs(state, mesh.shape["model"], model.config.num_kv_heads)
  place = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
  return HashedGraph(graphdef), jax.tree.map(place, state, specs)


@dataclasses.dataclass
class Launch:
  """One recorded program launch: the jitted function and its arguments."""

  name: str
  fn: object
  args: tuple
  kwargs: dict


@contextlib.contextmanager
def capture(launches: list):
  """Within, every jitted program of `engine.programs` and the cache manager
  that the host calls (not nested in a trace) runs and is appended to
  `launches`."""
  import jax

  from paged_jax.engine import cache_manager, programs

  # The package's names (what the runner calls) and its modules' (what the
  # programs call on the host, e.g. `continue_decoding`'s copy).
  modules = [programs, *(m for m in vars(programs).values() if isinstance(m, type(programs)))]
  saved = []
  for module in (*modules, cache_manager):
    for attr, fn in list(vars(module).items()):
      if callable(fn) and hasattr(fn, "lower") and hasattr(fn, "trace"):
        saved.append((module, attr, fn))

  def recorder(attr, fn):
    def record(*args, **kwargs):
      leaves = jax.tree.leaves((args, kwargs))
      if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        launches.append(Launch(attr.lstrip("_"), fn, args, kwargs))
      return fn(*args, **kwargs)

    record.lower = fn.lower  # warm-up's compiles ahead (`ModelRunner.compile_only`)
    return record

  for module, attr, fn in saved:
    setattr(module, attr, recorder(attr, fn))
  try:
    yield
  finally:
    for module, attr, fn in saved:
      setattr(module, attr, fn)


def abstract(tree, mesh):
  """`tree` with each array a `ShapeDtypeStruct` sharded on `mesh` (the TPU
  mesh) by its host `PartitionSpec` (replicated when it has none), and a KV
  cache's static shardings moved to `mesh` too."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec

  from paged_jax.kv_cache import KVCache

  def on_mesh(sharding):
    spec = getattr(sharding, "spec", PartitionSpec())
    kind = getattr(sharding, "memory_kind", None)
    return NamedSharding(mesh, spec, memory_kind=kind if kind == "pinned_host" else None)

  def leaf(x):
    if isinstance(x, KVCache):
      x = x.replace(
        device_sharding=on_mesh(x.device_sharding), host_sharding=on_mesh(x.host_sharding)
      )
      return jax.tree.map(leaf, x)
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_mesh(getattr(x, "sharding", None)))

  return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, KVCache))


def jax_mesh(devices: list, shape: tuple[int, int]):
  """A ``("data", "model")`` mesh of `shape` over the TPU `devices`."""
  import jax
  import numpy as np

  return jax.sharding.Mesh(np.array(devices).reshape(shape), ("data", "model"))


def _launch_key(launch: Launch, abstract_args) -> tuple:
  import jax

  leaves, treedef = jax.tree.flatten(abstract_args)
  specs = tuple(
    (x.shape, str(x.dtype), str(x.sharding.spec))
    if isinstance(x, jax.ShapeDtypeStruct)
    else (type(x).__name__, x if isinstance(x, (int, float, bool, str)) else id(x))
    for x in leaves
  )
  return launch.fn, str(treedef), specs


def lower_launch(fn, args, kwargs):
  """`fn` lowered for the TPU devices its abstract `args` and `kwargs` are
  sharded on, with the TPU kernels."""
  from paged_jax.kernel_choice import target_platform

  with target_platform("tpu"):
    return fn.lower(*args, **kwargs)


def compile_lowered(lowered) -> tuple[float, object, int]:
  """Compiles a `lower_launch` result; returns the seconds it took,
  `memory_analysis()`, and how many Mosaic kernels (TPU custom calls) the
  program's text calls."""
  start = time.perf_counter()
  compiled = lowered.compile()
  kernels = lowered.as_text().count("tpu_custom_call")
  return time.perf_counter() - start, compiled.memory_analysis(), kernels


@contextlib.contextmanager
def _naming_failure(variant: str, launch: str, topology: str, hbm: int):
  """Raises what fails within as a RuntimeError naming the program (XLA and
  Mosaic raise their own error types), saying so when it did not fit HBM."""
  try:
    yield
  except Exception as err:
    message = next((line for line in str(err).splitlines() if line.strip()), repr(err))
    if "RESOURCE_EXHAUSTED" in message or "out of memory" in message.lower():
      message = f"too large for a chip's {hbm / 2**30:.0f} GiB of HBM: {message}"
    raise RuntimeError(f"{variant}: {launch} failed to compile for {topology}: {message}") from err


def _program_report(topology: str, hbm: int, variant: str, launch: str, name: str, compile):
  """A program's line of the report, once its compile (a future) is done."""
  with _naming_failure(variant, launch, topology, hbm):
    seconds, memory, kernels = compile.result()
  return dict(
    name=name,
    compile_s=round(seconds, 3),
    hbm_bytes=_hbm(memory),
    argument_bytes=memory.argument_size_in_bytes,
    temp_bytes=memory.temp_size_in_bytes,
    mosaic_kernels=kernels,
  )


def _hbm(memory) -> int:
  """A program's HBM bytes per chip: arguments, outputs not aliased to
  arguments (donated pages), temporaries."""
  return (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
  )


def per_chip_bytes(tree) -> int:
  """Bytes of `tree`'s arrays (or sharded `jax.ShapeDtypeStruct`s) on one
  device (each its shard's shape)."""
  import jax

  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(tree)
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
  )


def check_weights_fit(weight_bytes: int, hbm: int, topology: str, tp: int) -> None:
  """Raises ValueError naming the sizes when the weights alone fill a chip
  (checked before any compile)."""
  if weight_bytes >= hbm:
    raise ValueError(
      f"too large for {topology}: {weight_bytes / 2**30:.2f} GiB of weights per chip "
      f"(tensor parallel {tp}) do not fit a chip's {hbm / 2**30:.0f} GiB of HBM"
    )


def build_engine(model, tp: int, **kwargs):
  """A small engine on the host for capturing the programs (tensor-parallel
  over `tp` host devices)."""
  import paged_jax as pj
  from paged_jax import sharding
  from paged_jax.models.tokenizer import ByteTokenizer

  block_size = BLOCK_SIZE
  cfg = pj.CacheConfig(
    block_size=block_size,
    num_gpu_blocks=32,
    num_cpu_blocks=0,
    max_seqs=4,
    max_blocks_per_seq=math.ceil(model.config.max_seq_len / block_size),
    enable_prefix_caching=True,
  )
  mesh = sharding.make_mesh(model=tp) if tp > 1 else None
  return pj.LLMEngine(
    model, ByteTokenizer(), cfg, mesh=mesh, max_num_batched_tokens=64, num_decode_steps=2, **kwargs
  )


def _on_tpu(launch: Launch, mesh, swap: dict, model):
  """`launch`'s arguments, abstract on the TPU `mesh`: objects in `swap` (by
  id) replaced by their values, and a shape-only `model`'s KV caches grown
  to its layers."""
  import jax

  from paged_jax.hybrid_kv import HybridKVCache
  from paged_jax.kv_cache import KVCache

  shape_only = isinstance(model, ShapeOnlyModel)
  caches = (KVCache, HybridKVCache)

  def leaf(x):
    if id(x) in swap:
      return swap[id(x)]
    return model.with_layers(x) if shape_only and isinstance(x, caches) else x

  tree = jax.tree.map(
    leaf, (launch.args, launch.kwargs), is_leaf=lambda x: id(x) in swap or isinstance(x, caches)
  )
  return abstract(tree, mesh)


def compile_engine_programs(
  model, topology: str, tp: int = 1, variants=VARIANTS, programs=None
) -> dict:
  """Compiles warm-up's whole program set of `model`'s engine (each of
  `variants`; a launch already compiled for an earlier variant is skipped) for
  `topology`, or only its launches named in `programs` (e.g.
  `{"decode_loop"}`). `model` is a real model or a `ShapeOnlyModel`. Programs
  are lowered in order and compiled on up to `COMPILE_THREADS` threads at
  once (a program's compile seconds are its own thread's). Returns the
  report: each program's name, compile seconds, HBM bytes per chip and Mosaic
  kernel calls (`tpu_custom_call`s in its text), the weights per chip, the
  largest temporaries, and what the HBM left holds (`aot_kv.kv_report`: one
  table's KV blocks and 8k-token sequences for the variants with one table, a
  hybrid variant's pools under `hybrid_kv`).

  Raises:
    RuntimeError: without libtpu (saying how to install it), or naming the
      program that failed to compile.
    ValueError: also for `programs` that name no launch of warm-up.
    ValueError: for an unknown topology, a tensor-parallel size that does not
      match the chips or split the heads, or weights (and temporaries) that
      leave no HBM for a KV block (or a hybrid variant's one 8k-token sequence).
  """
  import jax

  from paged_jax.engine.llm_engine import COMPILE_THREADS

  require_libtpu()
  devices = topology_devices(topology)
  config = model.config
  check_mesh(config.num_q_heads, config.num_kv_heads, tp, len(devices))
  hbm = hbm_per_chip(topology)
  if jax.device_count() < tp:
    raise ValueError(
      f"tensor parallelism {tp} needs {tp} host devices to capture on, {jax.device_count()} here "
      f"(set XLA_FLAGS=--xla_force_host_platform_device_count={tp})"
    )
  shape_only = isinstance(model, ShapeOnlyModel)
  # The engine's mesh is (1, tp) (`build_engine`); the weights must fit
  # before anything is built or compiled.
  mesh = jax_mesh(devices, (1, tp))
  graph, params = model.abstract_params(mesh) if shape_only else abstract_params(model, mesh)
  weights = per_chip_bytes(params)
  check_weights_fit(weights, hbm, topology, tp)
  host_model = model.stand_in() if shape_only else model
  wanted, compiles, seen, block_bytes, names, hybrid = programs, [], set(), 0, set(), {}
  with concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS) as pool:
    for variant, kwargs in variants.items():
      engine = build_engine(host_model, tp, **kwargs)
      swap = {}
      if shape_only:
        swap = {id(engine.runner.graphdef): graph, id(engine.runner.params): params}
      kv = engine.cache_manager.kv
      if engine.cache_manager.hybrid is not None:  # its pools come from the bytes left
        hybrid[variant] = kwargs.get("kv_cache_dtype")
      else:
        big_kv = abstract(model.with_layers(kv) if shape_only else kv, mesh)
        block_bytes = max(block_bytes, per_chip_bytes(big_kv) // engine.cfg.num_gpu_blocks)
      launches = []
      with capture(launches):
        engine.warmup()
      counts = {}
      for launch in launches:
        names.add(launch.name)
        if wanted is not None and launch.name not in wanted:
          continue
        args, kwargs = _on_tpu(launch, mesh, swap, model)
        key = _launch_key(launch, (args, kwargs))
        if key in seen:
          continue
        seen.add(key)
        counts[launch.name] = counts.get(launch.name, 0) + 1
        name = f"{variant}: {launch.name} #{counts[launch.name]}"
        with _naming_failure(variant, launch.name, topology, hbm):
          lowered = lower_launch(launch.fn, args, kwargs)
        compiles.append((variant, launch.name, name, pool.submit(compile_lowered, lowered)))
    programs = [_program_report(topology, hbm, *compile) for compile in compiles]
  if not programs:
    raise ValueError(f"no launch named {sorted(wanted)}; warm-up launches {sorted(names)}")
  temps = max(p["temp_bytes"] for p in programs)
  return dict(
    topology=topology,
    tensor_parallel_size=tp,
    programs=programs,
    weight_bytes_per_chip=weights,
    max_temp_bytes=temps,
    **kv_report(config, hbm, weights, temps, block_bytes, hybrid),
  )
