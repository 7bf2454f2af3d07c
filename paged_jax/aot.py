"""Ahead-of-time TPU compiles without a TPU: `python -m paged_jax aot`.

The engine's own warm-up runs on the host (CPU) in a capture mode in which
every jitted program it launches (`engine.programs`, the cache manager's
calls) is recorded with its arguments. Each recorded launch is then lowered
again from `jax.ShapeDtypeStruct`s whose shardings sit on a mesh of a named
TPU topology's compile-only devices (the same `PartitionSpec`s as on the
host mesh), with the kernels chosen for TPU (`attention.target_platform`:
Mosaic paged attention, the TPU `write_kv` and `copy_blocks`), and compiled
by libtpu on this host. No array is ever placed on a TPU.

The set compiled is warm-up's set for each engine variant of `VARIANTS`
(plain, int8 and fp8 pages, async scheduling's carries, n-gram
speculation with its prefill apart); beams are part of every variant's
every-slot decode loop. Swaps are left out (no host pages: `num_cpu_blocks`
0), as are structured outputs' automaton tables, which warm-up does not
launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import time

INSTALL_HINT = 'pip install "jax[tpu]" (needs Python >= 3.12 and JAX >= 0.12, which bring libtpu)'
# HBM per chip of the TPU generations the topology names start with.
HBM_BYTES = {"v5e": 16 * 2**30, "v6e": 32 * 2**30}
KNOWN_TOPOLOGIES = ("v5e:1x1", "v5e:2x2", "v5e:2x4", "v6e:1x1", "v6e:2x2", "v6e:2x4")
SEQUENCE_TOKENS = 8192
BLOCK_SIZE = 16
VARIANTS = {
  "plain": {},
  "int8 pages": dict(kv_cache_dtype="int8"),
  "fp8 pages": dict(kv_cache_dtype="float8_e4m3fn"),
  "async scheduling": dict(async_scheduling=True),
  "speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
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


def kv_blocks_per_chip(hbm: int, weight_bytes: int, temp_bytes: int, block_bytes: int) -> int:
  """KV blocks one chip holds: `(hbm - weight_bytes - temp_bytes) //
  block_bytes`, all per chip (weights after the tensor-parallel split, the
  largest temporaries of any program, one block's K and V pages and scales
  over all layers).

  Raises:
    ValueError: naming the bytes when the weights and temporaries leave no
      room for one block.
  """
  free = hbm - weight_bytes - temp_bytes
  if free < block_bytes:
    raise ValueError(
      f"too large for the chip: {weight_bytes} bytes of weights and {temp_bytes} bytes of "
      f"temporaries leave {free} of {hbm} bytes of HBM, less than one {block_bytes}-byte KV block"
    )
  return free // block_bytes


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

  saved = []
  for module in (programs, cache_manager):
    for attr, fn in list(vars(module).items()):
      if callable(fn) and hasattr(fn, "lower") and hasattr(fn, "trace"):
        saved.append((module, attr, fn))

  def recorder(attr, fn):
    def record(*args, **kwargs):
      leaves = jax.tree.leaves((args, kwargs))
      if not any(isinstance(x, jax.core.Tracer) for x in leaves):
        launches.append(Launch(attr.lstrip("_"), fn, args, kwargs))
      return fn(*args, **kwargs)

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


def compile_launch(launch: Launch, mesh) -> tuple[float, object]:
  """Compiles `launch` for the TPU `mesh` with the TPU kernels; returns the
  seconds it took and `memory_analysis()`."""
  from paged_jax.attention import target_platform

  args, kwargs = abstract((launch.args, launch.kwargs), mesh)
  start = time.perf_counter()
  with target_platform("tpu"):
    compiled = launch.fn.lower(*args, **kwargs).compile()
  return time.perf_counter() - start, compiled.memory_analysis()


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
  """Bytes of `tree`'s arrays on one device (each its shard's shape)."""
  import jax

  return sum(
    math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for x in jax.tree.leaves(tree)
    if isinstance(x, jax.Array)
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


def compile_engine_programs(model, topology: str, tp: int = 1, variants=VARIANTS) -> dict:
  """Compiles warm-up's whole program set of `model`'s engine (each of
  `variants`; a launch already compiled for an earlier variant is skipped) for
  `topology`. Returns the report: each program's name, compile seconds and
  HBM bytes per chip, the weights and one KV block per chip, the largest
  temporaries, and `kv_blocks_per_chip` and the 8k-token sequences they hold."""
  import jax

  require_libtpu()
  devices = topology_devices(topology)
  check_mesh(model.config.num_q_heads, model.config.num_kv_heads, tp, len(devices))
  if jax.device_count() < tp:
    raise ValueError(
      f"tensor parallelism {tp} needs {tp} host devices to capture on, {jax.device_count()} here "
      f"(set XLA_FLAGS=--xla_force_host_platform_device_count={tp})"
    )
  programs, seen, weights, block_bytes = [], set(), 0, 0
  for variant, kwargs in variants.items():
    engine = build_engine(model, tp, **kwargs)
    host_mesh = engine.cache.kv.device_sharding.mesh if tp > 1 else None
    shape = host_mesh.devices.shape if host_mesh is not None else (1, 1)
    mesh = jax_mesh(devices, shape)
    launches = []
    with capture(launches):
      engine.warmup()
    weights = max(weights, per_chip_bytes(engine.runner.params))
    kv = engine.cache.kv
    block_bytes = max(block_bytes, per_chip_bytes(kv) // engine.cfg.num_gpu_blocks)
    counts = {}
    for launch in launches:
      key = _launch_key(launch, abstract((launch.args, launch.kwargs), mesh))
      if key in seen:
        continue
      seen.add(key)
      counts[launch.name] = counts.get(launch.name, 0) + 1
      try:
        seconds, memory = compile_launch(launch, mesh)
      except Exception as err:  # XLA and Mosaic raise their own error types
        message = next((line for line in str(err).splitlines() if line.strip()), repr(err))
        raise RuntimeError(
          f"{variant}: {launch.name} failed to compile for {topology}: {message}"
        ) from err
      programs.append(
        dict(
          name=f"{variant}: {launch.name} #{counts[launch.name]}",
          compile_s=round(seconds, 3),
          hbm_bytes=_hbm(memory),
          temp_bytes=memory.temp_size_in_bytes,
        )
      )
  temps = max(p["temp_bytes"] for p in programs)
  blocks = kv_blocks_per_chip(hbm_per_chip(topology), weights, temps, block_bytes)
  return dict(
    topology=topology,
    tensor_parallel_size=tp,
    programs=programs,
    weight_bytes_per_chip=weights,
    kv_block_bytes_per_chip=block_bytes,
    max_temp_bytes=temps,
    kv_blocks_per_chip=blocks,
    sequences_8k_per_chip=blocks // math.ceil(SEQUENCE_TOKENS / BLOCK_SIZE),
  )
