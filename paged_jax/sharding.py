"""Several devices and hosts: the model and the paged KV cache over a Mesh.

A mesh has the axes ``("data", "model")`` (``make_mesh``).

Over ``"model"`` (tensor parallel) the weights are split the Megatron way
(``partition_spec``: column-split q/k/v/gate/up, row-split o/down, the
embedding and the head split over the vocabulary), and the KV cache is split
over KV heads (``create_kv_cache``; a quantized cache's scales likewise). With
fewer KV heads than model shards, each head is stored ``model //
num_kv_heads`` times, so every shard holds one head.

Over ``"data"`` every shard has its own blocks, sequences and manager state:
the cache holds ``data`` shards' blocks side by side, its block axis split
over ``"data"``, and the manager states are one batched state
(``init_states``) whose operations run on all shards at once under
``jax.vmap``; the engine puts each request on its least loaded shard. Block
tables hold a shard's own block ids and the rows of a batch are grouped by
shard, so ``write_kv``, paged attention and ``copy_blocks`` run on each
device's own heads and blocks under ``jax.shard_map`` (``paged_cache``,
``copy_blocks``), and ``pj.swap_out`` and ``pj.swap_in`` serve a sharded
cache as they are, given a shard's plan in the cache's block ids
(``shard_plan``).

Several hosts run the same program after ``jax.distributed.initialize()``:
every process runs the same scheduler on the same requests, and what the
host reads back (drawn tokens, flags, the manager's answers) is replicated,
so every process sees every output.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import attention
from paged_jax import kv_cache as kv_ops
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
    raise ValueError(
      f"a ({data}, {model}) mesh needs {data * model} devices, {len(devices)} available"
    )
  grid = np.asarray(devices[: data * model], dtype=object).reshape(data, model)
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
    raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of the model axis ({tp})")
  if num_kv_heads % tp and tp % num_kv_heads:
    raise ValueError(
      f"num_kv_heads ({num_kv_heads}) and the model axis ({tp}) must divide one another"
    )


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


def partition_spec(
  path: str, shape: Sequence[int], tp: int, *, num_kv_heads: int
) -> jax.sharding.PartitionSpec:
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
      return P(
        *(axis if axis is None or shape[i] % tp == 0 else None for i, axis in enumerate(spec))
      )
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
    spec = partition_spec(name, value.shape, tp, num_kv_heads=config.num_kv_heads)
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(place, state))


def _key_name(key) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def create_kv_cache(
  cfg, num_layers: int, num_kv_heads: int, head_dim: int, dtype, mesh: jax.sharding.Mesh
) -> KVCache:
  """A zeroed cache for every data shard, split over KV heads and shards.

  Pages are ``[stored_kv_heads, data * blocks, block_size, head_dim]``: the
  head axis over ``"model"`` and the block axis over ``"data"`` (data shard
  ``d`` owns blocks ``d * blocks ..``), so each device holds ``1 / model`` of
  the stored heads of its shard's ``cfg.num_gpu_blocks`` blocks. Host pages
  likewise.

  Args:
    cfg: the ``CacheConfig`` of one data shard.
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
  tp, data = mesh.shape["model"], mesh.shape["data"]
  check_heads(tp * num_kv_heads, num_kv_heads, tp)
  heads = stored_kv_heads(num_kv_heads, tp)
  device_sharding = jax.sharding.NamedSharding(mesh, P("model", "data"))
  host_kind = kv_ops.host_memory_kind(mesh.devices.flat[0])
  host_sharding = device_sharding.with_memory_kind(host_kind) if host_kind else device_sharding
  all_shards = dataclasses.replace(
    cfg, num_gpu_blocks=data * cfg.num_gpu_blocks, num_cpu_blocks=data * cfg.num_cpu_blocks
  )
  return KVCache.zeros(
    all_shards,
    num_layers,
    heads,
    head_dim,
    kv_ops.check_cache_dtype(dtype),
    device_sharding,
    host_sharding,
  )


def cache_mesh(cache: KVCache) -> jax.sharding.Mesh | None:
  """The ``("data", "model")`` mesh of a cache from ``create_kv_cache``."""
  mesh = getattr(cache.device_sharding, "mesh", None)
  if mesh is not None and tuple(mesh.axis_names) == AXES:
    return mesh
  return None


def shard_plan(plan, shard: int, num_src_blocks: int, num_dst_blocks: int):
  """A data shard's swap plan in the ids of the whole cache's blocks.

  Args:
    plan: a ``SwapPlan`` of shard ``shard``'s manager.
    shard: the data shard.
    num_src_blocks, num_dst_blocks: blocks per shard of the pool the plan
      reads and of the one it writes.

  Returns:
    The plan with shard ``shard``'s blocks offset to its part of the cache.
  """
  offset = lambda ids, size: jnp.where(ids >= 0, ids + shard * size, ids)
  return plan.replace(src=offset(plan.src, num_src_blocks), dst=offset(plan.dst, num_dst_blocks))


def split_rows(x: jax.Array, kv: KVCache) -> jax.Array:
  """``x`` with its rows (axis 0) split over ``"data"`` on a sharded cache."""
  mesh = cache_mesh(kv)
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, P("data")))


def replicate(tree, kv: KVCache):
  """``tree`` replicated on every device of a sharded cache's mesh, so that
  every process can read it."""
  mesh = cache_mesh(kv)
  if mesh is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, jax.sharding.NamedSharding(mesh, P()))


def _device_part(cache: KVCache) -> KVCache:
  """The device pages (and scales) only: what runs per shard."""
  return cache.replace(k_host=(), v_host=(), k_scale_host=None, v_scale_host=None)


def _with_device_part(cache: KVCache, part: KVCache) -> KVCache:
  return cache.replace(k=part.k, v=part.v, k_scale=part.k_scale, v_scale=part.v_scale)


def _per_shard(fn, mesh, in_specs, out_specs):
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


_PAGES = P("model", "data")


def copy_blocks(cache: KVCache, plan) -> KVCache:
  """``kv_cache.copy_blocks`` on a sharded cache: each device copies its heads
  of its data shard's blocks.

  Args:
    cache: the cache (donate it under jit).
    plan: a CopyPlan in a shard's block ids; with several data shards, one
      per shard: ``src``, ``dst`` ``[data, K]`` and ``count`` ``[data]`` (as
      ``jax.vmap`` of the manager's ``append_slots`` gives).

  Returns:
    The cache with the blocks copied.

  Raises:
    ValueError: for a plan out of range, or one plan for several shards.
  """
  mesh = cache_mesh(cache)
  if mesh is None:
    return kv_ops.copy_blocks(cache, plan)
  data = mesh.shape["data"]
  if jnp.ndim(plan.src) == 1:
    src, dst, count = kv_ops._plan_arrays(plan)
    if data > 1:
      raise ValueError(
        f"a cache of {data} data shards needs one copy plan "
        f"per shard ([{data}, K] src and dst), got {src.shape}"
      )
    src, dst, count = src[None], dst[None], jnp.reshape(count, (1,))
  else:
    src, dst, count = (jnp.asarray(a) for a in (plan.src, plan.dst, plan.count))
  if attention.is_concrete(src, dst, count):
    for shard in range(data):
      kv_ops.check_plan(
        src[shard],
        dst[shard],
        count[shard],
        num_src_blocks=cache.num_gpu_blocks // data,
        num_dst_blocks=cache.num_gpu_blocks // data,
        name="copy plan",
        disjoint=True,
      )
  device = _device_part(cache)

  def local(pages, src, dst, count):
    return kv_ops.copy_blocks(pages, types.SimpleNamespace(src=src[0], dst=dst[0], count=count[0]))

  pages_spec = jax.tree.map(lambda _: _PAGES, device)
  shards = P("data")
  copied = _per_shard(local, mesh, (pages_spec, shards, shards, shards), pages_spec)(
    device, src, dst, count
  )
  return _with_device_part(cache, copied)


@flax.struct.dataclass
class ShardedPagedCache(PagedCache):
  """``PagedCache`` whose writes and attention run per device: rows and
  blocks of a data shard, heads of a model shard."""

  def attend(self, layer, q, k, v, positions, *, sm_scale, **options):
    """See ``PagedCache.attend`` (``options``: its ``sliding_window`` and
    ``soft_cap``); rows split over ``"data"`` (grouped by shard, tables in
    the shard's block ids), heads over ``"model"``."""
    self._check_window(layer, options.get("sliding_window"), tokens=k.shape[1])
    mesh = cache_mesh(self.kv)
    repeat = self.kv.num_kv_heads // k.shape[2]
    if repeat > 1:
      k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
    heads = P("data", None, "model", None)
    rows = P("data")
    device = _device_part(self.kv)
    pages_spec = jax.tree.map(lambda _: _PAGES, device)

    def local(kv, tables, slots, q, k, v, positions):
      cache = PagedCache(kv=kv, block_tables=tables, slot_mapping=slots)
      out, cache = cache.attend(layer, q, k, v, positions, sm_scale=sm_scale, **options)
      return out, cache.kv

    out, written = _per_shard(
      local, mesh, (pages_spec, rows, rows, heads, heads, heads, rows), (heads, pages_spec)
    )(device, self.block_tables, self.slot_mapping, q, k, v, positions)
    return out, self.replace(kv=_with_device_part(self.kv, written))


def paged_cache(kv: KVCache, block_tables, slot_mapping, cache_sliding_window=None) -> PagedCache:
  """The paged backend of one model call: per device when ``kv`` is sharded
  (rows grouped by data shard, ``rows / data`` each); ``cache_sliding_window``
  is the ``CacheConfig``'s window (see ``PagedCache``)."""
  cls = PagedCache if cache_mesh(kv) is None else ShardedPagedCache
  return cls(
    kv=kv,
    block_tables=block_tables,
    slot_mapping=slot_mapping,
    cache_sliding_window=cache_sliding_window,
  )


def init_states(bm, num_shards: int):
  """One empty manager state per data shard, stacked on a leading axis.

  ``jax.vmap`` of a manager operation then runs it on every shard at once.

  Args:
    bm: a ``BlockSpaceManager``.
    num_shards: data shards.

  Returns:
    A ``BlockManagerState`` whose arrays have a leading ``num_shards`` axis.
  """
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (num_shards, *x.shape)), bm.init())
