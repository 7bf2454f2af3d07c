"""Weights that stay quantized: int8 and packed int4 with per-group scales.

A `QuantizedWeight` replaces the float `[out, in]` kernel of a `Linear`. It
holds, for `groups = in / group_size` groups of consecutive inputs per row:

* `values`: int8 `[out, in]` (8 bits), or uint8 `[out, in / 2]` (4 bits,
  two unsigned values 0..15 per byte: byte `c` of a row holds input `c` in
  its low nibble and input `c + in / 2` in its high one, so that each
  nibble holds a contiguous half of the row; see `matvec` for why);
* `scales`: `[out, groups]`, float16 where that is exact, else float32;
  once placed on TPU devices whose kernel serves the weight
  (`QuantizedWeight.place`), float16 is stored as its bits, int16 (the
  kernel's layout: Mosaic takes no float16 argument on v5e, and XLA:TPU
  would copy a bitcast on every call);
* `minimums`: `[out, groups]` like `scales`, or None.

Weight `(r, c)` is `ints[r, c] * scales[r, g] + minimums[r, g]` (`ints` the
unpacked values, int16 scales and minimums read as the float16 they hold)
with `g = c // group_size`, computed in float32. A per-channel scale is one
group spanning the whole row (`group_size == in`).

Formats, by source:

* `quantize_int8`: symmetric int8, one float32 scale per output channel
  (W8A16), or per group.
* `quantize_int4`: 4 bits with a float16 scale and minimum per group of 32,
  64 or 128 inputs (the group's range split into 15 steps; W4A16).
* `from_gguf`: a GGUF tensor's blocks, repacked without loss: Q8_0 -> int8
  groups of 32; Q4_0 and Q4_1 -> int4 groups of 32 (Q4_0's `-8 * d` and
  Q4_1's `m` as minimums); Q4_K -> int4 groups of 32 with minimums; Q5_K ->
  int8 groups of 32 with minimums (5-bit values in 8-bit storage); Q6_K ->
  int8 groups of 16. 4-bit values move from GGUF's nibble order into the
  halves layout above (a permutation).

The token embedding and the output layer stay in float (`quantize_model`).
"""

from __future__ import annotations

import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import kernel_choice
from paged_jax.models import layers
from pallas_kernels import quantized_matmul

METHODS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
T = gguf.GGMLQuantizationType
GGUF_QUANTIZED = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K)


class QuantizedWeight(nnx.Module):
  """A quantized `[out, in]` kernel; see the module docstring for the layout.

  Attributes:
    values: int8 `[out, in]` or packed uint8 `[out, in / 2]`.
    scales: float `[out, in / group_size]`, or int16 holding float16's bits.
    minimums: like `scales`, or None.
    bits: 8 or 4.
    group_size: inputs per scale.
  """

  def __init__(self, values, scales, minimums=None, *, bits: int, group_size: int):
    if bits not in (4, 8):
      raise ValueError(f"bits must be 4 or 8, got {bits}")
    out, stored = np.shape(values)
    in_features = stored * 8 // bits
    check_group_size(group_size, in_features)
    groups = in_features // group_size
    for name, array in (("scales", scales), ("minimums", minimums)):
      if array is not None and tuple(np.shape(array)) != (out, groups):
        raise ValueError(f"{name} have shape {np.shape(array)}, the values need {(out, groups)}")
    self.values = nnx.Param(jnp.asarray(values))
    self.scales = nnx.Param(jnp.asarray(scales))
    self.minimums = nnx.data(None) if minimums is None else nnx.Param(jnp.asarray(minimums))
    self.bits = bits
    self.group_size = group_size
    self.placement = None  # (mesh, values' PartitionSpec) once split over devices

  def place(self, mesh, values_spec, dtype) -> None:
    """Readies the weight for the devices of `mesh` (None: one device of the
    kernel platform) and products in `dtype` (`sharding.place_quantized`
    does): records that the arrays are split as `values_spec` says, so a
    kernel runs on each device, and where the TPU kernel serves the weight
    stores float16 scales and minimums as their int16 bits."""
    self.placement = None if mesh is None or mesh.size == 1 else (mesh, values_spec)
    platform = kernel_choice.kernel_platform() if mesh is None else mesh.devices.flat[0].platform
    with kernel_choice.target_platform(platform):
      out, in_features = self.shape
      kernel = kernel_choice.select_quantized_matmul(
        out_features=out,
        in_features=in_features,
        bits=self.bits,
        group_size=self.group_size,
        dtype=dtype,
      )
    if kernel is not None and kernel[0] == "tpu":
      # get_value: the array, or its shape in a model made by nnx.eval_shape.
      self.scales = nnx.Param(float16_bits(self.scales.get_value()))
      if self.minimums is not None:
        self.minimums = nnx.Param(float16_bits(self.minimums.get_value()))

  @property
  def shape(self) -> tuple[int, int]:
    """The float kernel's `(out, in)`."""
    out, stored = self.values.shape
    return out, stored * 8 // self.bits

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The float `[out, in]` kernel, computed in float32, rounded to `dtype`."""
    minimums = None if self.minimums is None else self.minimums[...]
    return dequantize(
      self.values[...], self.scales[...], minimums, self.bits, self.group_size
    ).astype(dtype)

  def matmul(self, x: jax.Array, dtype) -> jax.Array:
    """Float32 `x @ kernel.T` for `x` `[..., in]` in `dtype`; see `matmul`."""
    minimums = None if self.minimums is None else self.minimums[...]
    return matmul(
      x,
      self.values[...],
      self.scales[...],
      minimums,
      self.bits,
      self.group_size,
      dtype,
      placement=self.placement,
    )


def float16_bits(per_group):
  """float16 `per_group` (an array, or a shape under `nnx.eval_shape`) as its
  int16 bits; other dtypes as they are."""
  if per_group.dtype != jnp.float16:
    return per_group
  if isinstance(per_group, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(per_group.shape, jnp.int16, sharding=per_group.sharding)
  return jax.lax.bitcast_convert_type(per_group, jnp.int16)


def check_group_size(group_size: int, in_features: int, name: str = "the weight") -> None:
  """Raises ValueError, naming both, unless `group_size` divides `in_features`."""
  if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}")
  if in_features % group_size:
    raise ValueError(
      f"group_size {group_size} does not divide the input dimension {in_features} of {name}"
    )


def nibbles(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two halves of each row of packed 4-bit values: uint8 `[out, in / 2]`
  each, of inputs `[0, in / 2)` (the low nibbles) and `[in / 2, in)` (high)."""
  return packed & 0x0F, packed >> 4


def unpack_int4(packed: jax.Array) -> jax.Array:
  """uint8 `[out, in / 2]` -> uint8 `[out, in]` of values 0..15."""
  return jnp.concatenate(nibbles(packed), axis=-1)


def pack_int4(values: np.ndarray) -> np.ndarray:
  """numpy uint8 `[out, in]` of values 0..15 -> packed uint8 `[out, in / 2]`
  (input `c` in the low nibble of byte `c`, input `c + in / 2` in the high)."""
  values = np.asarray(values, np.uint8)
  half = values.shape[1] // 2
  return values[:, :half] | (values[:, half:] << 4)


def per_input(per_group: jax.Array, group_size: int) -> jax.Array:
  """float32 `[out, in]`: each input's entry of a `[out, groups]` array (a
  broadcast, which XLA fuses into its consumer)."""
  out, groups = per_group.shape
  per_group = quantized_matmul.float_groups(per_group).astype(jnp.float32)
  spread = jnp.broadcast_to(per_group[..., None], (out, groups, group_size))
  return spread.reshape(out, groups * group_size)


def dequantize(values, scales, minimums, bits: int, group_size: int) -> jax.Array:
  """Float32 `[out, in]` from the arrays of a `QuantizedWeight`."""
  ints = unpack_int4(values) if bits == 4 else values
  out, in_features = ints.shape
  grouped = ints.reshape(out, in_features // group_size, group_size).astype(jnp.float32)
  as_float = lambda a: quantized_matmul.float_groups(a).astype(jnp.float32)[..., None]
  weight = grouped * as_float(scales)
  if minimums is not None:
    weight = weight + as_float(minimums)
  return weight.reshape(out, in_features)


def matmul(
  x, values, scales, minimums, bits: int, group_size: int, dtype, placement=None
) -> jax.Array:
  """Float32 `x @ dequantize(...).T`, accumulated in float32.

  On CPU, a few rows (a decode step; `kernel_choice.select_quantized_matmul`)
  run the C++ kernel (`pallas_kernels.quantized_matmul.cpu`), which computes
  each weight in registers from the bytes, in float32 (not rounded to
  `dtype`, as `matvec`). On TPU the Mosaic kernel and on a GPU the Triton kernel
  (`pallas_kernels.quantized_matmul`, chosen by
  `kernel_choice.select_quantized_matmul`) dequantize on chip what the
  forms below would write to HBM: the several-row product's numbers, at
  every row count; with `placement` `(mesh, values_spec)` (weights split
  over devices) on each device under `shard_map`. Elsewhere:

  Several rows: the kernel, dequantized in float32 and rounded to `dtype`
  (the weight a float load of the same numbers has; per-channel int8: the
  integers, exact in `dtype`, and the scales applied to the result), goes
  through `dtype`'s matmul (`layers.dot_transposed`); XLA:CPU writes that
  float kernel first. A single row (one stream decoding) is `matvec`,
  which writes no kernel and does not round the weights to `dtype`.
  """
  x = x.astype(dtype)
  out_features, in_features = values.shape[0], x.shape[-1]
  kernel = kernel_choice.select_quantized_matmul(
    out_features=out_features,
    in_features=in_features,
    bits=bits,
    group_size=group_size,
    dtype=dtype,
    rows=math.prod(x.shape[:-1]),
    split=placement is not None,
  )
  if kernel == ("cpu", False):
    return quantized_matmul.cpu.quantized_matmul(
      x, values, scales, minimums, bits=bits, group_size=group_size
    )
  if kernel is not None and placement is not None:
    mesh, values_spec = placement
    return quantized_matmul.quantized_matmul_sharded(
      x,
      values,
      scales,
      minimums,
      bits=bits,
      group_size=group_size,
      mesh=mesh,
      values_spec=values_spec,
      kernel=kernel[0],
    )
  if kernel is not None:
    product = quantized_matmul.quantized_matmul
    product = product if kernel[0] == "tpu" else quantized_matmul.gpu.quantized_matmul
    return product(x, values, scales, minimums, bits=bits, group_size=group_size)
  if math.prod(x.shape[:-1]) == 1:
    return matvec(x.astype(jnp.float32), values, scales, minimums, bits, group_size)
  if bits == 8 and minimums is None and scales.shape[1] == 1:
    y = layers.dot_transposed(x, values.astype(dtype))
    return y * quantized_matmul.float_groups(scales)[:, 0].astype(jnp.float32)
  weight = dequantize(values, scales, minimums, bits, group_size).astype(dtype)
  return layers.dot_transposed(x, weight)


def matvec(x, values, scales, minimums, bits: int, group_size: int) -> jax.Array:
  """Float32 `x @ dequantize(...).T` for one float32 row `x` `[..., in]`.

  Written so that XLA:CPU makes each product one loop over the quantized
  bytes, which computes each weight as it multiplies it: `jnp.dot` with the
  kernel transposed, in float32 (rounding every weight to bfloat16 would
  cost 4x the product). That loop is fast only where its inputs run
  contiguously, so 4-bit values make two products, one per nibble, each
  over its contiguous half of the inputs; nibbles interleaved within a
  group, or the halves concatenated, make the loop 3x to 15x slower
  (benchmarks/bench_quant_weights.py).
  """
  dot = lambda x, weight: jnp.dot(x, weight.T, preferred_element_type=jnp.float32)
  if bits == 8 and minimums is None and scales.shape[1] == 1:
    scale = quantized_matmul.float_groups(scales)[:, 0].astype(jnp.float32)
    return dot(x, values.astype(jnp.float32)) * scale
  if bits == 8:
    return dot(x, dequantize(values, scales, minimums, bits, group_size))
  half = values.shape[1]
  scale = per_input(scales, group_size)
  minimum = None if minimums is None else per_input(minimums, group_size)
  y = []
  for ints, cols in zip(nibbles(values), (slice(None, half), slice(half, None)), strict=True):
    weight = ints.astype(jnp.float32) * scale[:, cols]
    weight = weight if minimum is None else weight + minimum[:, cols]
    y.append(dot(x[..., cols], weight))
  # A rounding that changes no float32 value: without it XLA:CPU fuses the
  # sum into the second product as a matmul, which writes its float kernel.
  return y[0] + jax.lax.reduce_precision(y[1], exponent_bits=8, mantissa_bits=23)


# Quantizing float weights.


def _compact(x: np.ndarray) -> np.ndarray:
  """`x` (float32) as float16 when that is exact, else as it is."""
  half = x.astype(np.float16)
  return half if np.array_equal(half.astype(np.float32), x) else x


def quantize_int8(weight: np.ndarray, group_size: int | None = None) -> QuantizedWeight:
  """Symmetric int8: `round(w / scale)` with `scale = absmax / 127` per row
  (`group_size` None: per output channel) or per group; float32 scales."""
  weight = np.asarray(weight, np.float32)
  out, in_features = weight.shape
  group_size = in_features if group_size is None else group_size
  check_group_size(group_size, in_features)
  grouped = weight.reshape(out, in_features // group_size, group_size)
  scales = np.abs(grouped).max(axis=-1) / 127.0
  safe = np.where(scales > 0, scales, 1.0)[..., None]
  values = np.clip(np.rint(grouped / safe), -127, 127).astype(np.int8)
  return QuantizedWeight(
    values.reshape(out, in_features), scales.astype(np.float32), bits=8, group_size=group_size
  )


def quantize_int4(weight: np.ndarray, group_size: int = 32) -> QuantizedWeight:
  """Asymmetric 4 bits per group of `group_size` (32, 64 or 128) inputs:
  the group's `[min, max]` in 15 steps, float16 scale and minimum."""
  if group_size not in INT4_GROUP_SIZES:
    raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
  weight = np.asarray(weight, np.float32)
  out, in_features = weight.shape
  check_group_size(group_size, in_features)
  grouped = weight.reshape(out, in_features // group_size, group_size)
  low, high = grouped.min(axis=-1), grouped.max(axis=-1)
  scales = ((high - low) / 15.0).astype(np.float16)
  minimums = low.astype(np.float16)
  safe = np.where(scales > 0, scales, 1.0).astype(np.float32)[..., None]
  ints = np.clip(np.rint((grouped - minimums.astype(np.float32)[..., None]) / safe), 0, 15)
  packed = pack_int4(ints.astype(np.uint8).reshape(out, in_features))
  return QuantizedWeight(packed, scales, minimums, bits=4, group_size=group_size)


def quantize(weight: np.ndarray, method: str, group_size: int | None = None) -> QuantizedWeight:
  """`quantize_int8` or `quantize_int4` by name (`METHODS`); `group_size`
  None takes per-channel int8 and int4 groups of 32."""
  if method == "int8":
    return quantize_int8(weight, group_size)
  if method == "int4":
    return quantize_int4(weight, 32 if group_size is None else group_size)
  raise ValueError(f"quantization method must be one of {METHODS}, got {method!r}")


# GGUF blocks.


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
  """float32 of the little-endian float16 at byte `offset` of every block."""
  return blocks[..., offset : offset + 2].copy().view("<f2")[..., 0].astype(np.float32)


def _nibbles(data: np.ndarray, span: int) -> np.ndarray:
  """uint8 values 0..15 of bytes where, in each run of `span // 2` bytes,
  byte `j` holds element `j` (low nibble) and `j + span // 2` (high)."""
  lead = data.shape[:-1]
  runs = data.reshape(*lead, -1, span // 2)
  return np.concatenate([runs & 0x0F, runs >> 4], axis=-1).reshape(*lead, -1)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The eight 6-bit scales and minimums of Q4_K/Q5_K's 12 scale bytes."""
  d, m, both = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
  scales = np.concatenate([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
  minimums = np.concatenate([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], axis=-1)
  return scales.astype(np.float32), minimums.astype(np.float32)


def _gguf_arrays(kind, blocks: np.ndarray):
  """`(ints, scales, minimums, bits, group_size)` of blocks `[out, n, bytes]`;
  `ints` `[out, n * block_size]` (int8, or uint8 0..15 for 4 bits)."""
  out, n, _ = blocks.shape
  if kind == T.Q8_0:
    ints = blocks[..., 2:].copy().view(np.int8)
    return ints.reshape(out, -1), _f16(blocks, 0), None, 8, 32
  if kind == T.Q4_0:
    d = _f16(blocks, 0)
    return _nibbles(blocks[..., 2:], 32).reshape(out, -1), d, -8.0 * d, 4, 32
  if kind == T.Q4_1:
    return _nibbles(blocks[..., 4:], 32).reshape(out, -1), _f16(blocks, 0), _f16(blocks, 2), 4, 32
  if kind in (T.Q4_K, T.Q5_K):
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sc, m = _k_scales(blocks[..., 4:16])
    scales, minimums = (d * sc).reshape(out, -1), (-dmin * m).reshape(out, -1)
    if kind == T.Q4_K:
      return _nibbles(blocks[..., 16:], 64).reshape(out, -1), scales, minimums, 4, 32
    high = blocks[..., 16:48]  # bit i of byte j: the fifth bit of element 32 * i + j
    low = _nibbles(blocks[..., 48:], 64)
    fifth = (high[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    ints = (low | (fifth.reshape(out, n, -1) << 4)).astype(np.int8)
    return ints.reshape(out, -1), scales, minimums, 8, 32
  if kind == T.Q6_K:
    low = _nibbles(blocks[..., :128], 128).reshape(out, n, 2, 128)
    high = blocks[..., 128:192].reshape(out, n, 2, 1, 32)
    high = ((high >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(out, n, 2, 128)
    ints = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    scales = (_f16(blocks, 208)[..., None] * sc).reshape(out, -1)
    return ints.reshape(out, -1), scales, None, 8, 16
  raise ValueError(f"GGUF type {T(kind).name} has no quantized form")


def from_gguf(data: np.ndarray, kind, shape: tuple[int, int], name: str) -> QuantizedWeight:
  """A GGUF tensor's blocks as a `QuantizedWeight`, without loss.

  Args:
    data: the tensor's bytes, uint8 `[out, bytes per row]`.
    kind: its `gguf.GGMLQuantizationType`, one of `GGUF_QUANTIZED`.
    shape: the float kernel's `(out, in)`.
    name: the tensor's name, for messages.

  Raises:
    ValueError: for another type (naming it and `name`) or a shape that
      does not match the bytes.
  """
  if kind not in GGUF_QUANTIZED:
    raise ValueError(
      f"tensor {name} has GGUF type {T(kind).name}, which has no quantized form "
      f"(supported: {', '.join(k.name for k in GGUF_QUANTIZED)})"
    )
  block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
  out, in_features = shape
  if in_features % block_size or np.size(data) != out * in_features // block_size * block_bytes:
    raise ValueError(f"tensor {name}: {np.size(data)} bytes do not hold {T(kind).name} {shape}")
  blocks = np.asarray(data, np.uint8).reshape(out, in_features // block_size, block_bytes)
  ints, scales, minimums, bits, group_size = _gguf_arrays(kind, blocks)
  values = pack_int4(ints) if bits == 4 else ints
  return QuantizedWeight(
    values,
    _compact(scales),
    None if minimums is None else _compact(minimums),
    bits=bits,
    group_size=group_size,
  )


# Models.


def quantize_model(model, method: str, group_size: int | None = None):
  """Quantizes every `Linear` kernel of the decoder blocks in place and
  returns `model`; the embedding and the output layer stay in float.

  Raises:
    ValueError: for an unknown method, a group size that does not divide a
      layer's input dimension (naming both), or a model already quantized.
  """
  for path, linear in quantizable_linears(model):
    if isinstance(linear.kernel, QuantizedWeight):
      raise ValueError(f"{path} is already quantized ({linear.kernel.bits} bits)")
    in_features = linear.kernel.shape[1]
    if group_size is not None:
      check_group_size(group_size, in_features, path)
    linear.kernel = quantize(np.asarray(linear.kernel[...], np.float32), method, group_size)
  return model


def placeholder(shape: tuple[int, int], method: str, group_size: int | None = None):
  """A `QuantizedWeight` of zeros with the shapes and dtypes that `quantize`
  gives a float `[out, in]` kernel (under `nnx.eval_shape`: shapes only)."""
  out, in_features = shape
  if method not in METHODS:
    raise ValueError(f"quantization method must be one of {METHODS}, got {method!r}")
  bits = 8 if method == "int8" else 4
  if group_size is None:
    group_size = in_features if bits == 8 else 32
  check_group_size(group_size, in_features)
  groups = (out, in_features // group_size)
  if bits == 8:
    values = jnp.zeros(shape, jnp.int8)
    return QuantizedWeight(values, jnp.zeros(groups, jnp.float32), bits=8, group_size=group_size)
  values = jnp.zeros((out, in_features // 2), jnp.uint8)
  scales, minimums = jnp.zeros(groups, jnp.float16), jnp.zeros(groups, jnp.float16)
  return QuantizedWeight(values, scales, minimums, bits=4, group_size=group_size)


def quantize_shapes(model, method: str, group_size: int | None = None):
  """`quantize_model` for a model whose parameters are shapes only
  (`nnx.eval_shape`): each kernel a `placeholder`. Call it inside
  `nnx.eval_shape` so that no array is allocated."""
  for _, linear in quantizable_linears(model):
    linear.kernel = placeholder(tuple(linear.kernel.shape), method, group_size)
  return model


def quantize_loaded(model, quantization: str | None, source: str):
  """A model loaded in float (the tiny model, a `save_model` folder) with
  `quantization` applied: None keeps it, "int8"/"int4" quantize it.

  Raises:
    ValueError: for "gguf", which needs a GGUF file, naming `source`.
  """
  if quantization is None:
    return model
  if quantization == "gguf":
    raise ValueError(f"quantization 'gguf' keeps a GGUF file's types; {source} is not a GGUF file")
  return quantize_model(model, quantization)


def quantizable_linears(model):
  """`(path, Linear)` of every linear layer inside the decoder blocks."""
  for path, module in nnx.iter_graph(model):
    names = [str(key) for key in path]
    if names[:1] == ["blocks"] and hasattr(module, "kernel") and hasattr(module, "bias"):
      yield "/".join(names), module


def is_quantized(model) -> bool:
  """Whether any linear layer of `model` holds a `QuantizedWeight`."""
  return any(isinstance(linear.kernel, QuantizedWeight) for _, linear in quantizable_linears(model))
