"""The TPU or GPU product in a program whose weights are split over devices.

XLA cannot split a Pallas kernel by itself (and `custom_partitioning` does
not reach libtpu: jax-ml/jax#38196), so `quantized_matmul_sharded` runs the
kernel on each device's shards under `jax.shard_map`, given how the values
are split (`values_spec`, a `PartitionSpec` of the mesh):

* outputs split (a column-split layer: `values` and scales split over their
  rows): each device multiplies its rows by the whole `x`;
* inputs split (a row-split layer: `values` split over its stored columns):
  for 4 bits, shard `j` of `c` stored columns holds two runs of inputs, one
  per nibble half (`[j * c, (j + 1) * c)` and the same plus `in / 2`), so
  each device takes those inputs of `x` and those groups of the scales (the
  scales whole on every device first, a small gather) and the partial
  products are summed over the devices (`psum`).

`x` comes whole to every device (data-parallel rows included) and the output
leaves split as the outputs are. Where a device's shard is not tiled by the
kernel, it computes the reference form (XLA) instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.quantized_matmul import common, gpu, reference, tpu

# kernel: (why it cannot serve a product, the product)
KERNELS = {
  "tpu": (common.refusal, tpu.quantized_matmul),
  "gpu": (gpu.refusal, gpu.quantized_matmul),
}


def quantized_matmul_sharded(
  x,
  values,
  scales,
  minimums=None,
  *,
  bits: int,
  group_size: int,
  mesh: jax.sharding.Mesh,
  values_spec: P,
  kernel: str = "tpu",
  interpret: bool = False,
) -> jax.Array:
  """`kernel`'s `quantized_matmul` on each device of `mesh`.

  Args:
    x: float `[..., in]` of a dtype the kernel computes in.
    values, scales, minimums, bits, group_size: as `tpu.quantized_matmul`.
    mesh: the devices the weights are on.
    values_spec: how `values` is split over `mesh`: `P(rows, columns)`,
      each a mesh axis (or axes) or None.
    kernel: "tpu" (Mosaic) or "gpu" (Triton).
    interpret: run the kernel in its interpret mode, e.g. on CPU.

  Returns:
    float32 `[..., out]`.
  """
  common.check_args(x, values, scales, minimums, bits=bits, group_size=group_size)
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {kernel!r}")
  rows_axis, columns_axis = tuple(values_spec) + (None,) * (2 - len(values_spec))
  shards = _size(mesh, columns_axis)
  lead, k = x.shape[:-1], x.shape[-1]
  groups_spec = P(rows_axis, None)
  arrays = (x.reshape(-1, k), values, scales) + (() if minimums is None else (minimums,))
  specs = (P(), P(rows_axis, columns_axis)) + (groups_spec,) * (len(arrays) - 2)
  local = functools.partial(
    _device_product,
    bits=bits,
    group_size=group_size,
    columns_axis=columns_axis,
    shards=shards,
    kernel=kernel,
    interpret=interpret,
  )
  # Under jit, which moves arrays split otherwise (the scales of a row
  # split) to the specs; outside a jit shard_map would refuse them.
  split = jax.shard_map(
    local, mesh=mesh, in_specs=specs, out_specs=P(None, rows_axis), check_vma=False
  )
  out = jax.jit(split)(*arrays)
  return out.reshape(*lead, values.shape[0])


def _size(mesh, axis) -> int:
  names = () if axis is None else (axis if isinstance(axis, tuple) else (axis,))
  size = 1
  for name in names:
    size *= mesh.shape[name]
  return size


def _device_product(
  x, values, scales, minimums=None, *, bits, group_size, columns_axis, shards, kernel, interpret
):
  """One device's product: its output rows, or its part of a sum over inputs."""
  product = functools.partial(
    local_product, bits=bits, group_size=group_size, kernel=kernel, interpret=interpret
  )
  if shards == 1:
    return product(x, values, scales, minimums)
  shard = jax.lax.axis_index(columns_axis)
  x, scales, minimums = shard_inputs(
    x, scales, minimums, shard, values.shape[1], bits=bits, group_size=group_size
  )
  return jax.lax.psum(product(x, values, scales, minimums), columns_axis)


def local_product(
  x, values, scales, minimums, *, bits: int, group_size: int, kernel="tpu", interpret=False
):
  """`kernel`'s product where it tiles these arrays, else the reference (XLA)."""
  n, k = values.shape[0], x.shape[-1]
  refusal, product = KERNELS[kernel]
  if refusal(x.shape[0], n, k, bits=bits, group_size=group_size, dtype=x.dtype) is None:
    return product(
      x, values, scales, minimums, bits=bits, group_size=group_size, interpret=interpret
    )
  return reference.quantized_matmul_reference(
    x, values, scales, minimums, bits=bits, group_size=group_size
  )


def shard_inputs(x, scales, minimums, shard, columns: int, *, bits: int, group_size: int):
  """`(x, scales, minimums)` of the inputs that shard `shard` of `columns`
  stored columns holds, in its own order (row halves for 4 bits).

  Raises:
    ValueError: when a shard's columns split a group, naming both.
  """
  halves = 2 if bits == 4 else 1
  per_half = x.shape[-1] // halves
  if columns % group_size:
    raise ValueError(
      f"a shard of {columns} stored columns splits the groups of {group_size} inputs"
    )

  def take(array, size: int, half: int):
    starts = [h * half + shard * size for h in range(halves)]
    parts = [jax.lax.dynamic_slice_in_dim(array, s, size, axis=1) for s in starts]
    return jnp.concatenate(parts, axis=1)

  groups = columns // group_size
  x = take(x, columns, per_half)
  scales = take(scales, groups, per_half // group_size)
  minimums = None if minimums is None else take(minimums, groups, per_half // group_size)
  return x, scales, minimums
