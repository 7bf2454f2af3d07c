"""The paged KV cache: device pages, host swap pages, and the ops on them.

``KVCache`` is a pytree. Each layer has K and V pages
``[num_kv_heads, num_gpu_blocks, block_size, head_dim]`` in accelerator memory
and swap pages ``[num_kv_heads, num_cpu_blocks, block_size, head_dim]`` in
host memory (memory kind ``"pinned_host"``). The ops execute the block
manager's plans and return a new cache; callers donate the old one
(``jax.jit(step, donate_argnums=...)``), and every op then updates its arrays
in place, touching only the slots and blocks it names:

* ``write_kv`` scatters new tokens' K/V into their slots (one layer).
* ``copy_blocks`` executes a CopyPlan on every layer's K and V in one call.
* ``swap_out`` / ``swap_in`` (`paged_jax.kv_swap`) move a SwapPlan's blocks
  between device and host memory: one gather, one transfer, one scatter for
  all layers. They are jitted there with the cache donated.

``KVCache.create(..., mesh=mesh)`` splits a cache over a ``("data",
"model")`` mesh (see ``paged_jax.sharding``): heads over "model", every data
shard's blocks side by side over "data". ``copy_blocks`` then copies on each
device under ``jax.shard_map``, from its data shard's plan; the swaps serve
it as they are, given a shard's plan in the whole cache's block ids
(``sharding.shard_plan``). Dtypes, host memory kinds and sizing are in
``paged_jax.kv_memory``.

A cache created with ``dtype=jnp.int8`` or ``jnp.float8_e4m3fn`` is
quantized: beside each layer's pages it keeps float32 scales ``k_scale``,
``v_scale`` ``[num_kv_heads, num_blocks, block_size]``, one per token and KV
head (host copies ``k_scale_host``, ``v_scale_host`` for swap space).
``write_kv`` quantizes each row with its absmax (``scale = absmax / 127``
for int8, rounding to nearest; ``absmax / 448`` for fp8 e4m3), every op moves
the scales with their pages, and attention dequantizes as it reads (pass
``k_scales=kv.k_scale[layer]``, ``v_scales=kv.v_scale[layer]``). Float
caches have no scales (the fields are None). The scales are written,
copied and swapped by XLA scatters and gathers (in place when donated); the
pages go through the Pallas kernels where ``impl`` picks them.

A plan is any object with int32 fields ``src``, ``dst`` (fixed capacity,
unused entries -1) and an int32 scalar ``count``. Called outside jit
(concrete plans, slots), the ops first check them on the host and raise a
ValueError that names the bad entry (`paged_jax.kv_plans`); under jit nothing is checked and entries
that are -1 or past ``count`` are skipped.

In a step, run ``copy_blocks`` (and swaps) before ``write_kv`` and attention,
as vLLM does: XLA updates a donated array in place only after the reads it
can order before the update, and a read of the same pages that does not feed
the update (attention, then a copy) makes it copy the whole array.

On the CPU backend, XLA computes a bfloat16 (or float16, fp8) scatter by
converting the whole array to float32, a copy of the layer's pages for every
token written. So there the device pages of floats narrower than 32 bits
hold their bit patterns as unsigned ints of the same width (``bits_of`` is
the float type), updated in place like integers; ``pages(layer)`` views them
as floats, and attention's gathers read through the view. On GPU and TPU
the pages hold the floats themselves. Host pages always hold bit patterns,
so the host side of a swap is in place on every backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from paged_jax import sharding
from paged_jax.kernel_choice import check_block_size, is_concrete, select_kernel
from paged_jax.kv_memory import check_cache_dtype, host_memory_kind
from paged_jax.kv_plans import check_plan, check_slot_mapping, shard_plans
from pallas_kernels import bits, quantization
from pallas_kernels import copy_blocks as copy_blocks_kernels
from pallas_kernels import write_kv as write_kv_kernels


@struct.dataclass
class KVCache:
  """Per-layer K/V pages in device memory and swap pages in host memory.

  Attributes:
    k: per layer ``[num_kv_heads, num_gpu_blocks, block_size, head_dim]``,
      of the cache's ``dtype`` or, where ``bits_of`` is set, its bit
      patterns (read them with ``pages``).
    v: same as ``k``.
    k_host: per layer ``[num_kv_heads, num_cpu_blocks, block_size,
      head_dim]`` in host memory, holding the pages' bit patterns as unsigned
      ints of the same width (``host_pages`` views them as floats). Swaps
      only move bits, and XLA:CPU, which runs the host side, updates narrow
      floats by converting the whole array but integers in place.
    v_host: same as ``k_host``.
    device_sharding: where ``k`` and ``v`` live (static).
    host_sharding: where ``k_host`` and ``v_host`` live (static); device
      memory when the backend has no host memory kind.
    k_scale: quantized caches: per layer float32 ``[num_kv_heads,
      num_gpu_blocks, block_size]``, the scale of each token's K row per KV
      head; None for float caches.
    v_scale: same as ``k_scale``, for V.
    k_scale_host: quantized caches: per layer float32 ``[num_kv_heads,
      num_cpu_blocks, block_size]`` in host memory; None for float caches.
    v_scale_host: same as ``k_scale_host``, for V.
    bits_of: the pages' float type where ``k`` and ``v`` hold its bit
      patterns (narrow floats on the CPU backend); None where they hold the
      values (static).
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  k_host: tuple[jax.Array, ...]
  v_host: tuple[jax.Array, ...]
  device_sharding: jax.sharding.Sharding = struct.field(pytree_node=False)
  host_sharding: jax.sharding.Sharding = struct.field(pytree_node=False)
  k_scale: tuple[jax.Array, ...] | None = None
  v_scale: tuple[jax.Array, ...] | None = None
  k_scale_host: tuple[jax.Array, ...] | None = None
  v_scale_host: tuple[jax.Array, ...] | None = None
  bits_of: jnp.dtype | None = struct.field(pytree_node=False, default=None)

  @classmethod
  def create(
    cls,
    cfg,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.bfloat16,
    *,
    device: jax.Device | None = None,
    mesh: jax.sharding.Mesh | None = None,
  ) -> KVCache:
    """Allocates a zeroed cache for ``cfg``, on one device or over a mesh.

    On a ``("data", "model")`` mesh every data shard gets ``cfg``'s blocks:
    pages are ``[stored_kv_heads, data * num_gpu_blocks, block_size,
    head_dim]`` (host pages likewise with ``num_cpu_blocks``), placed by
    ``sharding.PAGES``: heads over ``"model"``, blocks over ``"data"`` (data
    shard ``d`` owns blocks ``d * num_gpu_blocks ..``). With fewer KV heads
    than model shards each head is stored ``model // num_kv_heads`` times
    (``sharding.stored_kv_heads``), so every device holds one.

    Args:
      cfg: a ``CacheConfig`` (``block_size``, ``num_gpu_blocks``,
        ``num_cpu_blocks``), of one data shard on a mesh.
      num_layers: attention layers.
      num_kv_heads: the model's KV heads per layer.
      head_dim: size of one head.
      dtype: element type of the pages: float32, bfloat16 or float16, or
        int8 / float8_e4m3fn for a quantized cache with float32 scales.
      device: the accelerator; None for ``jax.devices()[0]`` (without a
        mesh).
      mesh: a ``("data", "model")`` mesh of any axis types; None for one
        device.

    Returns:
      The new cache; on a mesh its ``mesh`` is that mesh (Auto axes).

    Raises:
      ValueError: for a size below 1, an unsupported dtype, a block size
        that no attention kernel of the device serves (`check_block_size`),
        both a device and a mesh, a mesh without the axes, or KV heads and a
        model axis that do not divide one another.
    """
    for name, value in (
      ("num_layers", num_layers),
      ("num_kv_heads", num_kv_heads),
      ("head_dim", head_dim),
    ):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    dtype = check_cache_dtype(dtype)
    if mesh is None:
      device = jax.devices()[0] if device is None else device
      # NamedSharding (not SingleDeviceSharding) carries the memory kind into
      # traced types, which host-side gathers and scatters need under jit.
      one_device = jax.sharding.Mesh(np.asarray([device]), ("device",))
      device_sharding = jax.sharding.NamedSharding(one_device, jax.sharding.PartitionSpec())
    else:
      if device is not None:
        raise ValueError("pass a device or a mesh, not both")
      mesh = sharding.serving_mesh(mesh)
      device = mesh.devices.flat[0]
      tp, data = mesh.shape["model"], mesh.shape["data"]
      sharding.check_kv_heads(num_kv_heads, tp)
      num_kv_heads = sharding.stored_kv_heads(num_kv_heads, tp)
      device_sharding = jax.sharding.NamedSharding(mesh, sharding.PAGES)
      cfg = dataclasses.replace(
        cfg, num_gpu_blocks=data * cfg.num_gpu_blocks, num_cpu_blocks=data * cfg.num_cpu_blocks
      )
    check_block_size(cfg.block_size, device.platform)
    host_kind = host_memory_kind(device)
    host_sharding = device_sharding.with_memory_kind(host_kind) if host_kind else device_sharding
    return cls.zeros(cfg, num_layers, num_kv_heads, head_dim, dtype, device_sharding, host_sharding)

  @classmethod
  def zeros(
    cls,
    cfg,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype,
    device_sharding: jax.sharding.NamedSharding,
    host_sharding: jax.sharding.NamedSharding,
  ) -> KVCache:
    """A zeroed cache placed by the given shardings (heads on axis 0).

    ``create`` places it on one device or over a mesh; ``dtype`` is checked
    there.
    """
    page = (cfg.block_size, head_dim)
    device_shape = (num_kv_heads, cfg.num_gpu_blocks, *page)
    host_shape = (num_kv_heads, cfg.num_cpu_blocks, *page)
    platform = next(iter(device_sharding.device_set)).platform
    bits_of = dtype if platform == "cpu" and bits.is_narrow_float(dtype) else None
    groups = [
      (device_shape, dtype if bits_of is None else bits.bits_dtype(dtype), device_sharding),
      (host_shape, bits.bits_dtype(dtype), host_sharding),
    ]
    if quantization.is_quantized(dtype):
      scale = quantization.SCALE_DTYPE
      groups += [(device_shape[:3], scale, device_sharding), (host_shape[:3], scale, host_sharding)]
    # Each group gives K then V of every layer.
    specs = [
      (shape, kind, sharding) for shape, kind, sharding in groups for _ in range(2 * num_layers)
    ]
    arrays = jax.jit(
      lambda: tuple(jnp.zeros(shape, kind) for shape, kind, _ in specs),
      out_shardings=tuple(sharding for _, _, sharding in specs),
    )()
    layers = [
      tuple(arrays[i * num_layers : (i + 1) * num_layers]) for i in range(len(arrays) // num_layers)
    ]
    k, v, k_host, v_host, *scales = layers
    scale_fields = dict(zip(("k_scale", "v_scale", "k_scale_host", "v_scale_host"), scales))
    return cls(
      k,
      v,
      k_host,
      v_host,
      device_sharding=device_sharding,
      host_sharding=host_sharding,
      **scale_fields,
      bits_of=bits_of,
    )

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def mesh(self) -> jax.sharding.Mesh | None:
    """The ``("data", "model")`` mesh the cache is split over; None for a
    one-device cache."""
    mesh = getattr(self.device_sharding, "mesh", None)
    if mesh is not None and tuple(mesh.axis_names) == sharding.AXES:
      return mesh
    return None

  @property
  def num_data_shards(self) -> int:
    """Data shards whose blocks the cache holds side by side (1 off a mesh)."""
    return 1 if self.mesh is None else self.mesh.shape["data"]

  def device_part(self) -> KVCache:
    """The device pages (and scales) only, no host pages: what a step runs
    on each device under ``jax.shard_map``."""
    return self.replace(k_host=(), v_host=(), k_scale_host=None, v_scale_host=None)

  def with_device_part(self, part: KVCache) -> KVCache:
    """The cache with its device pages (and scales) from ``part``."""
    return self.replace(k=part.k, v=part.v, k_scale=part.k_scale, v_scale=part.v_scale)

  def layers(self, start: int) -> KVCache:
    """The cache of layers `start ..` only: a second model's pages in the
    same blocks (a speculative draft model's, after the target's)."""
    return self.replace(
      **{name: None if pages is None else pages[start:] for name, pages in self._layer_fields()}
    )

  def with_layers(self, start: int, part: KVCache) -> KVCache:
    """The cache with layers `start ..` from `part` (see `layers`)."""
    return self.replace(
      **{
        name: None if pages is None else pages[:start] + getattr(part, name)
        for name, pages in self._layer_fields()
      }
    )

  def stacked(self, other: KVCache) -> KVCache:
    """One cache of this cache's layers, then `other`'s (the same blocks,
    placement and dtype; each layer keeps its own heads and head size)."""
    return self.replace(
      **{
        name: None if pages is None else pages + getattr(other, name)
        for name, pages in self._layer_fields()
      }
    )

  def _layer_fields(self):
    names = ("k", "v", "k_host", "v_host", "k_scale", "v_scale", "k_scale_host", "v_scale_host")
    return [(name, getattr(self, name)) for name in names]

  @property
  def dtype(self) -> jnp.dtype:
    """The pages' element type (float, or int8 / fp8 of a quantized cache)."""
    return self.k[0].dtype if self.bits_of is None else self.bits_of

  def pages(self, layer: int) -> tuple[jax.Array, jax.Array]:
    """Layer ``layer``'s device K and V pages viewed as ``dtype`` (what
    attention reads)."""
    return tuple(_as_values(self, pages[layer]) for pages in (self.k, self.v))

  @property
  def quantized(self) -> bool:
    """True for int8 / float8_e4m3fn pages with scales."""
    return self.k_scale is not None

  def scales(self, layer: int) -> dict:
    """``k_scales``/``v_scales`` of ``layer`` for the attention calls.

    Returns:
      ``dict(k_scales=..., v_scales=...)``, both None for a float cache.
    """
    if not self.quantized:
      return dict(k_scales=None, v_scales=None)
    return dict(k_scales=self.k_scale[layer], v_scales=self.v_scale[layer])

  def host_pages(self, layer: int) -> tuple[jax.Array, jax.Array]:
    """Layer ``layer``'s host K and V pages viewed as ``dtype``."""
    return tuple(
      lax.bitcast_convert_type(pages[layer], self.dtype) for pages in (self.k_host, self.v_host)
    )

  @property
  def num_kv_heads(self) -> int:
    return self.k[0].shape[0]

  @property
  def num_gpu_blocks(self) -> int:
    return self.k[0].shape[1]

  @property
  def num_cpu_blocks(self) -> int:
    return self.k_host[0].shape[1]

  @property
  def block_size(self) -> int:
    return self.k[0].shape[2]

  @property
  def head_dim(self) -> int:
    return self.k[0].shape[3]

  @property
  def nbytes(self) -> int:
    """Bytes of the device pages and scales (all layers, K and V)."""
    return _nbytes(self.k, self.v, self.k_scale, self.v_scale)

  @property
  def host_nbytes(self) -> int:
    """Bytes of the host swap pages and scales (all layers, K and V)."""
    return _nbytes(self.k_host, self.v_host, self.k_scale_host, self.v_scale_host)


def _nbytes(*groups) -> int:
  return sum(a.size * a.dtype.itemsize for group in groups if group for a in group)


def write_kv(kv: KVCache, layer: int, k, v, slot_mapping, *, impl: str = "auto") -> KVCache:
  """Writes new tokens' keys and values of one layer into their slots.

  Args:
    kv: the cache (donate it under jit).
    layer: the layer index, a Python int.
    k: ``[..., num_kv_heads, head_dim]``, one row per token, in the cache's
      dtype; any float dtype for a quantized cache, which quantizes each row
      (absmax scale per token and KV head).
    v: same as ``k``.
    slot_mapping: int32 with the leading shape of ``k`` (e.g. the block
      manager's ``[batch, width]`` slot mapping): ``block * block_size +
      offset``, or -1 to skip the token. Slots must be distinct.
    impl: ``"auto"``, ``"pallas"`` or ``"reference"`` (see
      ``paged_jax.attention``).

  Returns:
    The cache with the tokens written.
  """
  _check_layer(kv, layer)
  k, v, slot_mapping = map(jnp.asarray, (k, v, slot_mapping))
  if k.shape[:-2] != slot_mapping.shape:
    raise ValueError(
      f"slot_mapping shape {slot_mapping.shape} must be the leading shape of k {k.shape}"
    )
  tokens = slot_mapping.size
  k = k.reshape(tokens, *k.shape[-2:])
  v = v.reshape(tokens, *v.shape[-2:])
  slot_mapping = slot_mapping.reshape(tokens)
  if is_concrete(slot_mapping):
    check_slot_mapping(slot_mapping, kv.num_gpu_blocks * kv.block_size)
  scales = {}
  if not kv.quantized and not k.dtype == v.dtype == kv.dtype:
    raise ValueError(
      f"k, v and the cache must share one dtype, got {k.dtype}, {v.dtype}, {kv.dtype}"
    )
  if kv.quantized:
    (k, k_scales), (v, v_scales) = (quantization.quantize(x, kv.dtype) for x in (k, v))
    k_scale, v_scale = write_kv_kernels.write_scales(
      kv.k_scale[layer], kv.v_scale[layer], k_scales, v_scales, slot_mapping
    )
    scales = dict(
      k_scale=_replace_layer(kv.k_scale, layer, k_scale),
      v_scale=_replace_layer(kv.v_scale, layer, v_scale),
    )
  args = (kv.k[layer], kv.v[layer], _as_stored(kv, k), _as_stored(kv, v), slot_mapping)
  kernel = select_kernel(impl, tile_sizes=(kv.head_dim,))
  if kernel is None:
    k_pages, v_pages = write_kv_kernels.write_kv_reference(*args)
  else:
    backend, interpret = kernel
    k_pages, v_pages = write_kv_kernels.write_kv(*args, backend=backend, interpret=interpret)
  return kv.replace(
    k=_replace_layer(kv.k, layer, k_pages), v=_replace_layer(kv.v, layer, v_pages), **scales
  )


def copy_blocks(kv: KVCache, plan, *, impl: str = "auto") -> KVCache:
  """Executes a CopyPlan (copy-on-write) on every layer's K and V in one call.

  A quantized cache's scales are copied with their blocks. On a cache over a
  mesh each device copies its heads of its data shard's blocks (under
  ``jax.shard_map``) from that shard's plan.

  Args:
    kv: the cache (donate it under jit).
    plan: ``src``, ``dst`` (device blocks) and ``count``; entry ``i <
      count`` copies block ``src[i]`` to ``dst[i]``. The plans of a cache's
      data shards come batched on a leading axis, each in its shard's own
      block ids: ``src``, ``dst`` ``[data, K]`` and ``count`` ``[data]`` (as
      ``jax.vmap`` of the manager's ``append_slots`` gives them; ``data`` is
      1 for a one-device cache). A cache of one data shard also takes one
      plan.
    impl: ``"auto"``, ``"pallas"`` or ``"reference"``.

  Returns:
    The cache with the blocks copied.

  Raises:
    ValueError: for a plan of the wrong shape or dtype (one plan for a cache
      of several data shards), or a concrete plan out of range.
  """
  src, dst, count = shard_plans(plan, kv.num_data_shards)
  if is_concrete(src, dst, count):
    blocks = kv.num_gpu_blocks // kv.num_data_shards
    for shard in range(kv.num_data_shards):
      check_plan(
        src[shard],
        dst[shard],
        count[shard],
        num_src_blocks=blocks,
        num_dst_blocks=blocks,
        name="copy plan",
        disjoint=True,
      )
  mesh = kv.mesh
  if mesh is None:
    return _copy_blocks(kv, src[0], dst[0], count[0], impl)
  device = kv.device_part()
  pages = jax.tree.map(lambda _: sharding.PAGES, device)
  shards = sharding.P("data")
  local = lambda part, src, dst, count: _copy_blocks(part, src[0], dst[0], count[0], impl)
  copied = sharding.per_device(local, mesh, (pages, shards, shards, shards), pages)(
    device, src, dst, count
  )
  return kv.with_device_part(copied)


def _copy_blocks(kv: KVCache, src, dst, count, impl: str) -> KVCache:
  """``copy_blocks`` of one plan on the cache's (or one device's) pages."""

  def copy(pages):
    kernel = select_kernel(impl, tile_sizes=(kv.block_size, pages[0].shape[-1]))
    if kernel is None:
      return copy_blocks_kernels.copy_blocks_reference(pages, src, dst, count)
    backend, interpret = kernel
    return copy_blocks_kernels.copy_blocks(
      pages, src, dst, count, backend=backend, interpret=interpret
    )

  pages = in_shape_groups(copy, kv.k + kv.v)
  layers = kv.num_layers
  kv = kv.replace(k=pages[:layers], v=pages[layers:])
  if not kv.quantized:
    return kv
  # Scales are [num_kv_heads, num_blocks, block_size]: copied in XLA as
  # pages with head_dim 1 (the live pairs one after another, in place when donated).
  scales = in_shape_groups(
    lambda scales: copy_blocks_kernels.copy_blocks_reference(
      [s[..., None] for s in scales], src, dst, count
    ),
    kv.k_scale + kv.v_scale,
  )
  scales = tuple(s[..., 0] for s in scales)
  return kv.replace(k_scale=scales[:layers], v_scale=scales[layers:])


def in_shape_groups(op, pages, *aligned) -> tuple:
  """``op(pages, *aligned)`` on each group of layers whose ``pages`` have
  one shape (a cache that holds a draft model's layers after the model's
  has two), its per-layer results put back in layer order; ``aligned`` are
  sequences indexed like ``pages`` (a layer's host pages). One group, the
  common case, is one call."""
  groups = {}
  for i, page in enumerate(pages):
    groups.setdefault((page.shape, page.dtype), []).append(i)
  out = [None] * len(pages)
  for members in groups.values():
    results = op(
      tuple(pages[i] for i in members), *(tuple(seq[i] for i in members) for seq in aligned)
    )
    for i, result in zip(members, results):
      out[i] = result
  return tuple(out)


def _as_stored(kv: KVCache, x: jax.Array) -> jax.Array:
  """``x`` (of the cache's dtype) as its device pages hold it."""
  return x if kv.bits_of is None else lax.bitcast_convert_type(x, kv.k[0].dtype)


def _as_values(kv: KVCache, pages: jax.Array) -> jax.Array:
  """Device pages viewed as the cache's dtype."""
  return pages if kv.bits_of is None else lax.bitcast_convert_type(pages, kv.bits_of)


def _check_layer(kv: KVCache, layer) -> None:
  if isinstance(layer, bool) or not isinstance(layer, int) or not (0 <= layer < kv.num_layers):
    raise ValueError(f"layer must be an int in 0..{kv.num_layers - 1}, got {layer!r}")


def _replace_layer(layers: tuple, layer: int, value) -> tuple:
  return layers[:layer] + (value,) + layers[layer + 1 :]
