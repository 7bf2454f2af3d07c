"""A `Llama` built from a checkpoint's tensors, the part both formats share
(`hf_checkpoint` for Hugging Face folders, `gguf_checkpoint` for GGUF
files): shapes checked, weights read one at a time, linear kernels kept
quantized when asked."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.models import quantized
from paged_jax.models.llama import Llama, LlamaConfig

# A loader's plan for one parameter: where it comes from, the shape it has
# there, and how to turn the stored array into the parameter.
Source = tuple[str, tuple[int, ...], Callable[[np.ndarray], np.ndarray]]


def build_llama(
  config: LlamaConfig,
  sources: dict[str, Source],
  stored: dict[str, tuple[pathlib.Path, tuple[int, ...]]],
  read: Callable[[str], np.ndarray],
  kernels: Callable | None = None,
) -> Llama:
  """A `Llama` whose parameters are read one by one from a checkpoint.

  Args:
    config: the model's config.
    sources: what each parameter is made from (see `hf_sources`).
    stored: the checkpoint's tensors: name -> (file, shape).
    read: reads one stored tensor as a numpy array of the given dtype.
    kernels: `(path, name, layout) -> QuantizedWeight | None`, called for
      the linear kernels of the decoder blocks: the quantized kernel, or
      None to load that one in float. None: every kernel in float.

  Raises:
    ValueError: if a tensor is missing, extra or misshapen.
  """
  wanted = {name: shape for name, shape, _ in sources.values()}
  missing = sorted(set(wanted) - set(stored))
  if missing:
    raise ValueError(f"checkpoint {_files(stored)} misses tensor(s) {', '.join(missing)}")
  extra = sorted(set(stored) - set(wanted))
  if extra:
    raise ValueError(
      f"{stored[extra[0]][0]}: unexpected tensor(s) {', '.join(extra)} for this config"
    )
  for name, shape in wanted.items():
    file, actual = stored[name]
    if actual != shape:
      raise ValueError(f"{file}: tensor {name} has shape {actual}, the config needs {shape}")
  abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(abstract, nnx.Param)
  pure = nnx.to_pure_dict(params)
  dtype = config.parameter_dtype
  kept = {}

  def load(path, _):
    key = "/".join(str(k.key) for k in path)
    name, shape, layout = sources[key]
    if kernels is not None and is_block_kernel(key):
      weight = kernels(key, name, layout)
      if weight is not None:
        kept[key] = weight
        return jnp.zeros((0,), dtype)  # the placeholder of a kernel set below
    # Vectors (norms, biases) are small: laid out in float32, then cast,
    # so that Gemma's `gain - 1` loses nothing to a narrow dtype.
    stored_dtype = np.float32 if len(shape) == 1 else dtype
    return jnp.asarray(layout(read(name, stored_dtype)), dtype)

  nnx.replace_by_pure_dict(params, jax.tree_util.tree_map_with_path(load, pure))
  model = nnx.merge(graphdef, params)
  for key, weight in kept.items():
    _module_at(model, key.removesuffix("/kernel")).kernel = weight
  return model


def _module_at(model, path: str):
  """The submodule of `model` at `path` ("blocks/0/attention/q_proj")."""
  for name in path.split("/"):
    model = model[int(name)] if name.isdigit() else getattr(model, name)
  return model


def _files(stored: dict) -> str:
  return ", ".join(sorted({str(file) for file, _ in stored.values()})) or "?"


def float_quantizer(method: str | None, group_size: int | None):
  """`(path, float32 kernel) -> QuantizedWeight` for "int8"/"int4", else None."""
  if method is None:
    return None

  def quantize(path: str, weight: np.ndarray) -> quantized.QuantizedWeight:
    if group_size is not None:
      quantized.check_group_size(group_size, weight.shape[1], path.removesuffix("/kernel"))
    return quantized.quantize(weight, method, group_size)

  return quantize


def is_block_kernel(key: str) -> bool:
  """Whether parameter path `key` is a linear kernel of a decoder block."""
  return key.startswith("blocks/") and key.endswith("/kernel")


def optional_float(value) -> float | None:
  """`value` as a float, None staying None."""
  return None if value is None else float(value)
