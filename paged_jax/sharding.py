"""Several devices and hosts: the model and the paged KV cache over a Mesh.

A mesh has the axes ``("data", "model")`` (``make_mesh``).

Over ``"model"`` (tensor parallel) the weights are split the Megatron way
(``partition_spec``: column-split q/k/v/gate/up, row-split o/down, the
embedding and the head split over the vocabulary), and the KV cache is split
over KV heads (``create_kv_cache``; a quantized cache's scales likewise). With
fewer KV heads than model shards, each head is stored ``model //
num_kv_heads`` times, so every shard holds one head. ``write_kv``, paged
attention and ``copy_blocks`` run per shard under ``jax.shard_map``
(``paged_cache``, ``copy_blocks``); ``pj.swap_out`` and ``pj.swap_in`` serve
a sharded cache as they are: they gather and scatter along the block axis
only, heads first, so each shard moves its own heads. The block manager's
state is small and replicated: every shard sees the same block tables.

Over ``"data"`` every shard has its own manager state, cache and sequences:
``place_requests`` puts each request on the least loaded shard, and each data
shard serves its requests on its row of the mesh. ``init_states`` and
``batched`` give one manager state per shard as a stacked pytree and run the
manager's operations on all of them at once.

Several hosts run the same program after ``jax.distributed.initialize()``;
each process serves the data shards whose devices it holds and the results
are exchanged with ``process_allgather``.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Sequence

from flax import nnx
import flax.struct
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from paged_jax import attention
from paged_jax import kv_cache as kv_ops
from paged_jax.block_manager import manager
from paged_jax.kv_cache import KVCache
from paged_jax.models.paged import PagedCache

P = jax.sharding.PartitionSpec
AXES = ("data", "model")


def make_mesh(data: int = 1, model: int = 1, devices=None) -> jax.sharding.Mesh:
  """A ``("data", "model")`` mesh of ``data * model`` devices.

  Args:
    data: data-parallel shards.
    model: tensor-parallel shards (neighbouring devices, so a model shard
      stays on one host when it fits).
    devices: the devices; None for ``jax.devices()``.

  Returns:
    The mesh.

  Raises:
    ValueError: if the sizes are not positive or do not match the devices.
  """
  devices = jax.devices() if devices is None else list(devices)
  for name, size in (("data", data), ("model", model)):
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ValueError(f"{name} must be an int >= 1, got {size!r}")
  if data * model > len(devices):
    raise ValueError(f"a ({data}, {model}) mesh needs {data * model} devices, "
                     f"{len(devices)} available")
  grid = np.asarray(devices[:data * model], dtype=object).reshape(data, model)
  return jax.sharding.Mesh(grid, AXES)


def check_axes(mesh: jax.sharding.Mesh) -> None:
  """Raises ValueError unless ``mesh`` has the axes ``("data", "model")``."""
  if tuple(mesh.axis_names) != AXES:
    raise ValueError(f"mesh axes must be {AXES}, got {mesh.axis_names}")


def check_heads(num_q_heads: int, num_kv_heads: int, tp: int) -> None:
  """Checks that attention heads split evenly over ``tp`` model shards.

  Raises:
    ValueError: if ``tp`` does not divide ``num_q_heads``, or
      ``num_kv_heads`` and ``tp`` do not divide one another.
  """
  if num_q_heads % tp:
    raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of the "
                     f"model axis ({tp})")
  if num_kv_heads % tp and tp % num_kv_heads:
    raise ValueError(f"num_kv_heads ({num_kv_heads}) and the model axis ({tp}) "
                     "must divide one another")


def stored_kv_heads(num_kv_heads: int, tp: int) -> int:
  """KV heads the cache stores: each head repeated when fewer than ``tp``."""
  return max(num_kv_heads, tp)


# (path pattern, spec) in order; the first match wins, unmatched is replicated.
# Paths are nnx state paths joined by "/", e.g. "blocks/0/attention/q_proj/kernel".
_RULES = (
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P(None, "model")),
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/bias$", P("model")),
    (r"(o_proj|down_proj)/kernel$", P("model", None)),
    (r"embed/embedding$", P("model", None)),
    (r"lm_head/kernel$", P(None, "model")),
)


def partition_spec(path: str, shape: Sequence[int], tp: int, *,
                   num_kv_heads: int) -> jax.sharding.PartitionSpec:
  """The Megatron split of one parameter over the ``"model"`` axis.

  Column-parallel q/k/v/gate/up, row-parallel o/down, vocabulary-split
  embedding and head. A name no rule knows (norms, new parameters) and a
  dimension that ``tp`` does not divide are replicated; so are k/v when there
  are fewer KV heads than shards (each shard then computes the heads it
  stores).

  Args:
    path: the parameter's path, names joined by ``"/"``.
    shape: its shape.
    tp: size of the ``"model"`` axis.
    num_kv_heads: the model's KV heads.

  Returns:
    The PartitionSpec.
  """
  if num_kv_heads % tp and re.search(r"(k_proj|v_proj)/", path):
    return P()
  for pattern, spec in _RULES:
    if re.search(pattern, path):
      if len(spec) != len(shape):
        return P()
      return P(*(axis if axis is None or shape[i] % tp == 0 else None
                 for i, axis in enumerate(spec)))
  return P()


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
  """The model with its parameters placed by ``partition_spec`` on ``mesh``.

  Args:
    model: a Llama-style NNX model (``model.config`` has the head counts).
    mesh: a ``("data", "model")`` mesh; weights are replicated over
      ``"data"``.

  Returns:
    A new model whose parameters are sharded arrays.

  Raises:
    ValueError: see ``check_axes`` and ``check_heads``.
  """
  config = model.config
  check_axes(mesh)
  check_heads(config.num_q_heads, config.num_kv_heads, mesh.shape["model"])
  graphdef, state = nnx.split(model)
  tp = mesh.shape["model"]

  def place(path, value):
    name = "/".join(_key_name(key) for key in path)
    name = name.removesuffix("/value")  # the nnx.Variable's array
    spec = partition_spec(name, value.shape, tp,
                          num_kv_heads=config.num_kv_heads)
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(place, state))


def _key_name(key) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def create_kv_cache(cfg, num_layers: int, num_kv_heads: int, head_dim: int,
                    dtype, mesh: jax.sharding.Mesh) -> KVCache:
  """A zeroed cache whose device and host pages are split over KV heads.

  Pages are ``[stored_kv_heads, blocks, block_size, head_dim]`` with the head
  axis over ``"model"`` and replicated over ``"data"``: each device holds
  ``1 / model`` of the stored heads.

  Args:
    cfg: the ``CacheConfig``.
    num_layers: attention layers.
    num_kv_heads: the model's KV heads.
    head_dim: size of one head.
    dtype: element type of the pages.
    mesh: a ``("data", "model")`` mesh.

  Returns:
    The cache; its ``device_sharding`` carries the mesh.

  Raises:
    ValueError: if ``num_kv_heads`` and the model axis do not divide one
      another.
  """
  check_axes(mesh)
  attention.check_block_size(cfg.block_size, mesh.devices.flat[0].platform)
  tp = mesh.shape["model"]
  check_heads(tp * num_kv_heads, num_kv_heads, tp)
  heads = stored_kv_heads(num_kv_heads, tp)
  device_sharding = jax.sharding.NamedSharding(mesh, P("model"))
  host_kind = kv_ops.host_memory_kind(mesh.devices.flat[0])
  host_sharding = (device_sharding.with_memory_kind(host_kind)
                   if host_kind else device_sharding)
  return KVCache.zeros(cfg, num_layers, heads, head_dim,
                       kv_ops.check_cache_dtype(dtype), device_sharding,
                       host_sharding)


def cache_mesh(cache: KVCache) -> jax.sharding.Mesh | None:
  """The ``("data", "model")`` mesh of a cache from ``create_kv_cache``."""
  mesh = getattr(cache.device_sharding, "mesh", None)
  if mesh is not None and tuple(mesh.axis_names) == AXES:
    return mesh
  return None


def _device_part(cache: KVCache) -> KVCache:
  """The device pages (and scales) only: what runs per shard."""
  return cache.replace(k_host=(), v_host=(), k_scale_host=None,
                       v_scale_host=None)


def _with_device_part(cache: KVCache, part: KVCache) -> KVCache:
  return cache.replace(k=part.k, v=part.v, k_scale=part.k_scale,
                       v_scale=part.v_scale)


def _per_shard(fn, mesh, in_specs, out_specs):
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


def copy_blocks(cache: KVCache, plan) -> KVCache:
  """``kv_cache.copy_blocks``, per model shard on a sharded cache.

  Args:
    cache: the cache (donate it under jit).
    plan: a CopyPlan; it is replicated, every shard copies its heads.

  Returns:
    The cache with the blocks copied.
  """
  mesh = cache_mesh(cache)
  if mesh is None:
    return kv_ops.copy_blocks(cache, plan)
  src, dst, count = kv_ops._plan_arrays(plan)
  if attention.is_concrete(src, dst, count):
    kv_ops.check_plan(src, dst, count, num_src_blocks=cache.num_gpu_blocks,
                      num_dst_blocks=cache.num_gpu_blocks, name="copy plan",
                      disjoint=True)
  device = _device_part(cache)

  def local(pages, src, dst, count):
    return kv_ops.copy_blocks(pages, types.SimpleNamespace(
        src=src, dst=dst, count=count))

  pages_spec = jax.tree.map(lambda _: P("model"), device)
  copied = _per_shard(local, mesh, (pages_spec, P(), P(), P()),
                      pages_spec)(device, src, dst, count)
  return _with_device_part(cache, copied)


@flax.struct.dataclass
class ShardedPagedCache(PagedCache):
  """``PagedCache`` whose writes and attention run per model shard."""

  def attend(self, layer, q, k, v, positions, *, sm_scale):
    """See ``PagedCache.attend``; q/k/v heads split over ``"model"``."""
    mesh = cache_mesh(self.kv)
    repeat = self.kv.num_kv_heads // k.shape[2]
    if repeat > 1:
      k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    heads = P(None, None, "model", None)
    device = _device_part(self.kv)
    pages_spec = jax.tree.map(lambda _: P("model"), device)

    def local(kv, tables, slots, q, k, v, positions):
      cache = PagedCache(kv=kv, block_tables=tables, slot_mapping=slots)
      out, cache = cache.attend(layer, q, k, v, positions, sm_scale=sm_scale)
      return out, cache.kv

    out, written = _per_shard(
        local, mesh, (pages_spec, P(), P(), heads, heads, heads, P()),
        (heads, pages_spec))(device, self.block_tables, self.slot_mapping, q,
                             k, v, positions)
    return out, self.replace(kv=_with_device_part(self.kv, written))


def paged_cache(kv: KVCache, block_tables, slot_mapping) -> PagedCache:
  """The paged backend of one model call: per shard when ``kv`` is sharded."""
  cls = PagedCache if cache_mesh(kv) is None else ShardedPagedCache
  return cls(kv=kv, block_tables=block_tables, slot_mapping=slot_mapping)


def place_requests(loads: Sequence[int], num_shards: int) -> np.ndarray:
  """Puts each request, in arrival order, on the least loaded data shard.

  Args:
    loads: each request's load (e.g. the tokens it will hold).
    num_shards: data shards.

  Returns:
    int32 ``[len(loads)]``: the shard of each request (ties: the lowest).
  """
  totals = np.zeros(num_shards, np.int64)
  shards = np.zeros(len(loads), np.int32)
  for index, load in enumerate(loads):
    shard = int(np.argmin(totals))
    shards[index] = shard
    totals[shard] += load
  return shards


def init_states(bm, num_shards: int, mesh: jax.sharding.Mesh | None = None):
  """One empty manager state per data shard, stacked on a leading axis.

  Args:
    bm: a ``BlockSpaceManager``.
    num_shards: data shards.
    mesh: if given, the stack is split over its ``"data"`` axis.

  Returns:
    A ``BlockManagerState`` whose arrays have a leading ``num_shards`` axis.
  """
  state = bm.init()
  states = jax.tree.map(
      lambda x: jnp.broadcast_to(x, (num_shards, *x.shape)), state)
  if mesh is not None:
    states = jax.device_put(states, jax.sharding.NamedSharding(mesh, P("data")))
  return states


def batched(op):
  """``op`` of the block manager applied to every shard's state at once.

  Args:
    op: a function of ``paged_jax.block_manager.manager`` (``allocate``,
      ``append_slots``, ``free``, ``num_free_gpu_blocks``, ...).

  Returns:
    ``op`` vmapped over the leading shard axis of the state and of every
    other array argument (static ints such as ``width`` stay keywords).
  """
  return jax.vmap(op)


def least_loaded_shard(states) -> jax.Array:
  """The shard with the most free GPU blocks (ties: the lowest)."""
  return jnp.argmax(batched(manager.BlockSpaceManager.num_free_gpu_blocks)(
      states)).astype(jnp.int32)


def row_mesh(mesh: jax.sharding.Mesh, row: int) -> jax.sharding.Mesh:
  """Data shard ``row`` of ``mesh`` as a ``(1, model)`` mesh."""
  return jax.sharding.Mesh(mesh.devices[row:row + 1], AXES)


def serve_on_mesh(serve, requests, mesh: jax.sharding.Mesh,
                  max_new_tokens: int, stats_type):
  """Serves requests data-parallel: each data shard runs its own share.

  Requests go to the least loaded shard (``place_requests``, by prompt and
  generated tokens); each shard has its own manager state and cache on its
  row of the mesh, tensor-parallel over ``"model"``. A process serves the
  rows whose devices it holds, one after the other; with several processes
  the outputs are then exchanged, so every process returns all of them.

  Args:
    serve: ``serve(row_mesh, requests) -> (outputs, stats)``, one shard.
    requests: the ``Request`` list.
    mesh: a ``("data", "model")`` mesh.
    max_new_tokens: tokens generated per sequence at most.
    stats_type: the stats dataclass (numeric fields).

  Returns:
    ``(outputs, stats)`` like ``generate``: outputs in request order, stats
    summed over shards (``peak_blocks``: the largest shard's; rates and
    utilization: the mean over shards).

  Raises:
    ValueError: if the mesh axes are wrong or a data shard spans processes.
  """
  check_axes(mesh)
  shards = place_requests(
      [r.n * (r.prompt.size + max_new_tokens) for r in requests],
      mesh.shape["data"])
  outputs = [None] * len(requests)
  fields = [f.name for f in dataclasses.fields(stats_type)]
  rows = []
  for row in range(mesh.shape["data"]):
    owners = {d.process_index for d in mesh.devices[row]}
    if len(owners) > 1:
      raise ValueError(f"data shard {row} spans processes {sorted(owners)}: "
                       "keep each row of the mesh on one host")
    indices = np.flatnonzero(shards == row)
    if owners != {jax.process_index()} or not indices.size:
      continue
    row_outputs, stats = serve(row_mesh(mesh, row),
                               [requests[i] for i in indices])
    for i, out in zip(indices, row_outputs):
      outputs[i] = out
    rows.append([float(getattr(stats, f)) for f in fields])
  rows = np.asarray(rows, np.float64).reshape(-1, len(fields))
  if jax.process_count() > 1:
    outputs, rows = _exchange(outputs, rows, requests, max_new_tokens,
                              mesh.shape["data"])
  return outputs, _merge_stats(stats_type, fields, rows)


def _exchange(outputs, rows, requests, max_new_tokens, num_shards):
  """All processes' outputs and stats rows, gathered across processes."""
  max_n = max(r.n for r in requests)
  tokens = np.zeros((len(requests), max_n, max_new_tokens), np.int32)
  lengths = np.full((len(requests), max_n), -1, np.int32)
  for i, samples in enumerate(outputs):
    for j, sample in enumerate(samples or ()):
      tokens[i, j, :sample.size], lengths[i, j] = sample, sample.size
  padded = np.full((num_shards, rows.shape[1]), np.nan)
  padded[:len(rows)] = rows
  tokens, lengths, padded = (np.asarray(x) for x in
                             multihost_utils.process_allgather(
                                 (tokens, lengths, padded)))
  merged = []
  for i, request in enumerate(requests):
    source = int(np.argmax(lengths[:, i, 0] >= 0))
    merged.append([tokens[source, i, j, :lengths[source, i, j]].copy()
                   for j in range(request.n)])
  rows = padded.reshape(-1, rows.shape[1])
  return merged, rows[~np.isnan(rows[:, 0])]


_MAX_FIELDS = ("peak_blocks",)
_MEAN_FIELDS = ("kv_slot_utilization", "prefix_cache_hit_rate")


def _merge_stats(stats_type, fields, rows):
  merged = {}
  for column, name in enumerate(fields):
    values = rows[:, column]
    if name in _MAX_FIELDS:
      value = values.max(initial=0)
    elif name in _MEAN_FIELDS:
      value = values.mean() if values.size else 0.0
    else:
      value = values.sum()
    kind = type(getattr(stats_type(), name))
    merged[name] = kind(value)
  return stats_type(**merged)
