"""Several devices and hosts: meshes and the partition rules over them.

A mesh has the axes ``("data", "model")`` (``make_mesh``, or any
``jax.sharding.Mesh`` with those names and any axis types: ``serving_mesh``
gives the library the same mesh with Auto axes).

Over ``"model"`` (tensor parallel) the weights are split the Megatron way
(``partition_spec``: column-split q/k/v/gate/up, row-split o/down, the
embedding and the head split over the vocabulary), and the KV cache is split
over KV heads (``PAGES``; a quantized cache's scales likewise). With fewer KV
heads than model shards, each head is stored ``model // num_kv_heads`` times,
so every shard holds one head (``stored_kv_heads``).

Over ``"data"`` every shard has its own blocks, sequences and manager state:
the cache holds ``data`` shards' blocks side by side, its block axis split
over ``"data"`` (``KVCache.create(..., mesh=mesh)``), and the manager states
are one batched state (``block_manager.state.init_states``) whose operations
run on all shards at once under ``jax.vmap``; the engine puts each request
on its least loaded shard. Block tables hold a shard's own block ids and the
rows of a batch are grouped by shard, so ``write_kv``, paged attention and
``copy_blocks`` run on each device's own heads and blocks under
``jax.shard_map`` (``per_device``: ``paged_cache.ShardedPagedCache``,
``kv_cache.copy_blocks``), and ``pj.swap_out`` and ``pj.swap_in`` serve a
sharded cache as they are, given a shard's plan in the cache's block ids
(``shard_plan``).

Several hosts run the same program after ``jax.distributed.initialize()``:
every process runs the same scheduler on the same requests, and what the
host reads back (drawn tokens, flags, the manager's answers) is replicated,
so every process sees every output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

P = jax.sharding.PartitionSpec
AXES = ("data", "model")
# KV pages and scales [heads, blocks, ...]: heads over "model", blocks over "data".
PAGES = P("model", "data")


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


def serving_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """``mesh`` with both axes Auto: the mesh the library shards over.

  ``jax.make_mesh`` gives Explicit axes (JAX 0.10 and later), where sharding
  is part of every array's type and ``with_sharding_constraint`` refuses
  them; the library places arrays itself, so it serves the same devices with
  Auto axes, whatever the axis types of the mesh it is given.

  Args:
    mesh: a ``("data", "model")`` mesh of any axis types.

  Returns:
    The mesh of the same devices and names with Auto axes (``mesh`` itself
    when they already are).

  Raises:
    ValueError: see ``check_axes``.
  """
  check_axes(mesh)
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)
  if tuple(mesh.axis_types) == auto:
    return mesh
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def check_heads(num_q_heads: int, num_kv_heads: int, tp: int) -> None:
  """Checks that attention heads split evenly over ``tp`` model shards.

  Raises:
    ValueError: if ``tp`` does not divide ``num_q_heads``, or
      ``num_kv_heads`` and ``tp`` do not divide one another.
  """
  if num_q_heads % tp:
    raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of the model axis ({tp})")
  check_kv_heads(num_kv_heads, tp)


def check_kv_heads(num_kv_heads: int, tp: int) -> None:
  """Checks that ``tp`` model shards can split (or repeat) the KV heads.

  Raises:
    ValueError: if ``num_kv_heads`` and ``tp`` do not divide one another.
  """
  if num_kv_heads % tp and tp % num_kv_heads:
    raise ValueError(
      f"num_kv_heads ({num_kv_heads}) and the model axis ({tp}) must divide one another"
    )


def stored_kv_heads(num_kv_heads: int, tp: int) -> int:
  """KV heads the cache stores: each head repeated when fewer than ``tp``."""
  return max(num_kv_heads, tp)


# (path pattern, spec) in order; the first match wins, unmatched is replicated.
# Paths are nnx state paths joined by "/", e.g. "blocks/0/attention/q_proj/kernel".
# A quantized kernel's values, scales and minimums (`kernel/values`, ...)
# all have one row per output feature and their inputs (or input groups)
# along axis 1, so they split as the float kernel does: a column-split
# layer's scales with its output channels, a row-split one's with its input
# groups (replicated when the groups do not split evenly).
_KERNEL = r"kernel(/values|/scales|/minimums)?$"
_RULES = (
  (rf"(q_proj|k_proj|v_proj|gate_proj|up_proj)/{_KERNEL}", P("model", None)),
  (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/bias$", P("model")),
  (rf"(o_proj|down_proj)/{_KERNEL}", P(None, "model")),
  (r"embed/embedding$", P("model", None)),
  (rf"lm_head/{_KERNEL}", P("model", None)),
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
    mesh: a ``("data", "model")`` mesh (any axis types); weights are
      replicated over ``"data"``.

  Returns:
    A new model whose parameters are sharded arrays.

  Raises:
    ValueError: see ``check_axes`` and ``check_heads``.
  """
  config = model.config
  mesh = serving_mesh(mesh)
  check_heads(config.num_q_heads, config.num_kv_heads, mesh.shape["model"])
  graphdef, state = nnx.split(model)
  specs = state_partition_specs(state, mesh.shape["model"], config.num_kv_heads)
  place = lambda value, spec: jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
  return place_quantized(nnx.merge(graphdef, jax.tree.map(place, state, specs)), mesh)


def place_quantized(model: nnx.Module, mesh: jax.sharding.Mesh | None) -> nnx.Module:
  """``model`` with each quantized kernel (a layer's ``kernel`` with a
  ``place`` method: ``models.quantized.QuantizedWeight``) told how
  ``partition_spec`` splits it over ``mesh`` (None: one device of the kernel
  platform) and its layer's dtype, so a kernel runs on each device's shard
  and the TPU kernel finds its scales in the layout it loads; returns
  ``model``, changed in place."""
  tp = 1 if mesh is None else mesh.shape["model"]
  num_kv_heads = model.config.num_kv_heads
  for path, module in nnx.iter_graph(model):
    kernel = getattr(module, "kernel", None)
    if hasattr(kernel, "place"):
      name = "/".join(str(key) for key in (*path, "kernel", "values"))
      spec = partition_spec(name, kernel.values.shape, tp, num_kv_heads=num_kv_heads)
      kernel.place(mesh, spec, module.dtype)
  return model


def state_partition_specs(state, tp: int, num_kv_heads: int):
  """``state`` (an ``nnx.State`` of arrays or ``jax.ShapeDtypeStruct``s) with
  each leaf replaced by its ``partition_spec`` over ``tp`` model shards."""

  def spec(path, value):
    name = "/".join(_key_name(key) for key in path)
    name = name.removesuffix("/value")  # the nnx.Variable's array
    return partition_spec(name, value.shape, tp, num_kv_heads=num_kv_heads)

  return jax.tree_util.tree_map_with_path(spec, state)


def _key_name(key) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


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


def split_rows(x: jax.Array, kv) -> jax.Array:
  """``x`` with its rows (axis 0) split over ``"data"`` when the cache ``kv``
  is on a mesh (``kv.mesh``)."""
  if kv.mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(kv.mesh, P("data")))


def replicate(tree, kv):
  """``tree`` replicated on every device of the cache ``kv``'s mesh, so that
  every process can read it."""
  if kv.mesh is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, jax.sharding.NamedSharding(kv.mesh, P()))


def per_device(fn, mesh: jax.sharding.Mesh, in_specs, out_specs):
  """``fn`` run on every device's block of its arguments (``jax.shard_map``)."""
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
