"""Saving and loading models, and the shipped tiny model and its corpus.

A model directory holds `config.json` (the `LlamaConfig` fields) and
`weights.msgpack` (the parameters as a nested dict, serialised with
`flax.serialization`). Weights may be stored in a narrower dtype to keep files
small; loading restores each parameter to the model's float32. Files keep
the linear layers' kernels `[in, out]`, as paged_jax's first releases wrote
them; the model holds them `[out, in]` (see `llama.Linear`).
"""

from __future__ import annotations

import importlib.resources
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, serialization

from paged_jax.models import quantized
from paged_jax.models.llama import Llama, LlamaConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "weights.msgpack"


def save_model(
  model: Llama, directory: str | pathlib.Path, *, weights_dtype: jnp.dtype = jnp.bfloat16
) -> None:
  """Writes `model`'s config and parameters into `directory`.

  Args:
    model: the model to save.
    directory: target folder; created if missing, files in it overwritten.
    weights_dtype: dtype the parameters are stored in.

  Raises:
    ValueError: for a model with quantized weights (the format stores float
      parameters only).
  """
  if quantized.is_quantized(model):
    raise ValueError("save_model stores float weights; this model's linear layers are quantized")
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  params = jax.tree.map(lambda x: np.asarray(x.astype(weights_dtype)), params)
  params = _transposed_kernels(params)
  (directory / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
  (directory / WEIGHTS_FILE).write_bytes(serialization.msgpack_serialize(params))


def load_model(directory: str | pathlib.Path) -> Llama:
  """Builds the model saved in `directory` by `save_model`.

  Args:
    directory: folder holding `config.json` and `weights.msgpack`.

  Returns:
    The model with float32 parameters.

  Raises:
    FileNotFoundError: if either file is missing.
    ValueError: if the config is invalid or the weights do not match it (a
      missing, unexpected or misshapen parameter).
  """
  directory = pathlib.Path(directory)
  for name in (CONFIG_FILE, WEIGHTS_FILE):
    if not (directory / name).is_file():
      raise FileNotFoundError(f"no {name} in model directory {directory}")
  config = LlamaConfig.from_dict(json.loads((directory / CONFIG_FILE).read_text()))
  stored = _transposed_kernels(
    serialization.msgpack_restore((directory / WEIGHTS_FILE).read_bytes())
  )
  abstract_model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  params = _checked_params(nnx.to_pure_dict(abstract_params), stored)
  nnx.replace_by_pure_dict(abstract_params, params)
  return nnx.merge(graphdef, abstract_params)


def load_tiny() -> Llama:
  """The tiny character-level model shipped with the package (no download).

  It was trained by `scripts/train_tiny.py` on Ambrose Bierce's "The Devil's
  Dictionary" and reads and writes `ByteTokenizer` ids.

  Returns:
    The model with float32 parameters.
  """
  return load_model(tiny_model_dir())


def tiny_model_dir() -> pathlib.Path:
  """Folder of the shipped tiny model inside the installed package."""
  return _assets_dir() / "tiny"


def tiny_corpus() -> str:
  """The tiny model's training text: "The Devil's Dictionary" (public domain).

  See `paged_jax/models/assets/README.md` for its source and licence.
  """
  return (_assets_dir() / "devils_dictionary.txt").read_text(encoding="utf-8")


def _assets_dir() -> pathlib.Path:
  return pathlib.Path(str(importlib.resources.files("paged_jax.models") / "assets"))


def _checked_params(expected: dict, stored: dict) -> dict:
  """`stored` arrays arranged and typed like `expected`, or a ValueError."""
  expected_flat = _flatten(expected)
  stored_flat = _flatten(stored)
  missing = sorted(set(expected_flat) - set(stored_flat))
  unexpected = sorted(set(stored_flat) - set(expected_flat))
  if missing or unexpected:
    raise ValueError(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
  for path, spec in expected_flat.items():
    shape = tuple(np.shape(stored_flat[path]))
    if shape != tuple(spec.shape):
      raise ValueError(f"parameter {path} has shape {shape}, the config needs {tuple(spec.shape)}")
  return jax.tree_util.tree_map_with_path(
    lambda path, spec: jnp.asarray(stored_flat[_path_string(path)], dtype=spec.dtype), expected
  )


def _transposed_kernels(params: dict) -> dict:
  """`params` with every 2-D linear kernel transposed (file <-> model layout)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: x.T if str(path[-1].key) == "kernel" and np.ndim(x) == 2 else x, params
  )


def _flatten(tree: dict) -> dict:
  """`{"blocks/0/attention/q_proj/kernel": leaf, ...}`, keys as strings."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_path_string(path): leaf for path, leaf in leaves}


def _path_string(path) -> str:
  return "/".join(str(key.key) for key in path)
