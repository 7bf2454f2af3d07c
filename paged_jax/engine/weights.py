"""New weights for a serving engine: matched by path, cast and placed like the old.

A training loop holds its model in its own dtype (float32 master weights)
and sharding; the engine's programs were compiled for its own. `replace`
checks that the new weights have the engine's structure and shapes, casts
each leaf to the engine's dtype and puts it on the engine's sharding, so the
programs see arguments of the same types and run without compiling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


class WeightsMismatchError(ValueError):
  """New weights whose structure or shapes differ from the engine's."""


class NonFiniteWeightsError(ValueError):
  """New weights with a NaN or infinite value."""


def _key_name(entry) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def flat_weights(tree) -> dict[str, jax.Array]:
  """`{"blocks/0/attention/q_proj/kernel": array, ...}` of an `nnx.Module`,
  an `nnx.State` or a pytree of arrays in the model's nesting
  (`nnx.to_pure_dict(state)`), in flattening order."""
  if isinstance(tree, nnx.Module):
    tree = nnx.state(tree)
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = [_key_name(entry) for entry in path]
    if names and names[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
      names.pop()  # an nnx Variable's array
    flat["/".join(names)] = leaf
  return flat


def _quantized_kernels(flat: dict) -> list[str]:
  """The kernels of `flat` kept quantized (`.../kernel/values`, `/scales`, ...;
  see `paged_jax.models.quantized`), by their kernel's path."""
  return [path.removesuffix("/values") for path in flat if path.endswith("/values")]


def check_quantization(engine: dict, given: dict) -> None:
  """Raises `WeightsMismatchError` naming the first kernel that is float on
  one side and kept quantized on the other."""
  for kernel in _quantized_kernels(engine):
    if kernel in given:
      raise WeightsMismatchError(
        f"weight {kernel!r} is float and the engine keeps it quantized: quantize the new "
        f"weights as the engine's were (quantized.quantize_model) first"
      )
  for kernel in _quantized_kernels(given):
    if kernel in engine:
      raise WeightsMismatchError(
        f"weight {kernel!r} is quantized and the engine's is float: give float weights, or "
        f"serve an engine loaded with that quantization"
      )


def check_structure(engine: dict, given: dict) -> None:
  """Raises `WeightsMismatchError` naming the first path that is missing from
  `given`, extra in it, or of another shape than in `engine`, a kernel
  quantized on one side only (`check_quantization`), or quantized values
  (integers, which are never cast) of another dtype."""
  check_quantization(engine, given)
  missing = [path for path in engine if path not in given]
  if missing:
    raise WeightsMismatchError(f"weight {missing[0]!r} is missing ({len(missing)} missing)")
  extra = [path for path in given if path not in engine]
  if extra:
    raise WeightsMismatchError(f"weight {extra[0]!r} is not in the model ({len(extra)} extra)")
  for path, like in engine.items():
    shape = tuple(jnp.shape(given[path]))
    if shape != like.shape:
      raise WeightsMismatchError(f"weight {path!r} has shape {shape}, the model {like.shape}")
    dtype = jnp.result_type(given[path])
    if _float16_bits(like, dtype):
      continue
    if jnp.issubdtype(like.dtype, jnp.integer) and dtype != like.dtype:
      raise WeightsMismatchError(f"weight {path!r} is {dtype}, the model's {like.dtype}")


def _float16_bits(like, dtype) -> bool:
  """Whether a leaf of `dtype` goes to an engine leaf `like` that holds
  float16 as its int16 bits (a quantized kernel's scales laid out for the
  TPU kernel: `paged_jax.models.quantized`)."""
  return like.dtype == jnp.int16 and jnp.issubdtype(dtype, jnp.floating)


@functools.partial(jax.jit, static_argnums=1)
def _cast(x, dtype):
  return x.astype(dtype)


@jax.jit
def _float16_as_bits(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.int16)


@jax.jit
def _all_finite(leaves) -> jax.Array:
  """bool `[len(leaves)]`: whether each floating leaf is free of NaN and inf."""
  return jnp.stack(
    [
      jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
      for x in leaves
    ]
  )


def _like(x, like: jax.Array) -> jax.Array:
  """`x` in the dtype of `like` (cast where it lies; float to float16's bits
  for an int16 leaf), then on its sharding (no copy if it is there)."""
  if not isinstance(x, jax.Array):
    x = jnp.asarray(x)
  if _float16_bits(like, x.dtype):
    x = _float16_as_bits(x)
  if x.dtype != like.dtype:
    x = _cast(x, like.dtype)
  return jax.device_put(x, like.sharding)  # committed there, as the engine's are


def replace(params, weights, check_finite: bool = True):
  """`params` (the engine's `nnx.State`) with every leaf taken from
  `weights`, cast to its dtype and put on its sharding.

  Leaves that already have the engine's dtype and sharding are used as they
  are (no copy). A cast compiles one small program per leaf shape and dtype
  pair the first time; later calls with the same kinds of weights compile
  nothing.

  Raises:
    WeightsMismatchError: for a missing or extra path or another shape.
    NonFiniteWeightsError: with `check_finite`, naming the first leaf with a
      NaN or infinity (checked after the cast, before anything changes).
  """
  engine, given = flat_weights(params), flat_weights(weights)
  check_structure(engine, given)
  new = [_like(given[path], like) for path, like in engine.items()]
  if check_finite:
    finite = jax.device_get(_all_finite(new))
    if not finite.all():
      bad = [path for path, ok in zip(engine, finite) if not ok]
      raise NonFiniteWeightsError(
        f"weight {bad[0]!r} has a NaN or infinite value ({len(bad)} such leaves)"
      )
  return jax.tree.unflatten(jax.tree.structure(params), new)
