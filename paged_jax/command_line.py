"""What the `demo`, `serve` and `aot` commands share: argument types,
`--quantization`, and the model and tokenizer a `--model` names, loaded the
same way by each."""

from __future__ import annotations

import argparse
import pathlib

# `--quantization`'s choices; "none" asks for float weights whatever the source.
QUANTIZATION_CHOICES = ("none", "gguf", "int8", "int4")


def positive(text: str) -> int:
  """An argument that must be an int >= 1."""
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
  """`--quantization`, as `serve`, `demo` and `aot` take it (see
  `weight_quantization` for its default)."""
  parser.add_argument(
    "--quantization",
    choices=QUANTIZATION_CHOICES,
    default=None,
    help="weights kept quantized in memory: gguf (a GGUF file's own types), int8 (per output "
    "channel) or int4 (groups of 32), quantized at load, or none (float weights); default: "
    "gguf for a GGUF file (the default model's Q4_1 stays 4-bit), else none",
  )


def weight_quantization(source: str, quantization: str | None) -> str | None:
  """The `load_pretrained` quantization of `--quantization` for `--model
  source`: its default (None) is "gguf" for a GGUF file (a named model that
  is one too) and float otherwise; "none" is float."""
  if quantization == "none":
    return None
  if quantization is not None or source == "tiny":
    return quantization
  from paged_jax.models import checkpoints

  try:
    path = checkpoints.resolve_source(source)
  except FileNotFoundError:
    return None  # the load names what is missing
  return "gguf" if path.is_file() and path.suffix == ".gguf" else None


def load_model(
  source: str,
  *,
  dtype: str = "auto",
  max_seq_len: int | None = None,
  quantization: str | None = None,
):
  """`(model, tokenizer)` that `--model source` names: "tiny" (the shipped
  byte-level toy), a folder saved by `pretrained.save_model` (both with a
  `ByteTokenizer`), a Hugging Face folder, a `.gguf` file or a named model.

  Args:
    source: what `--model` says.
    dtype: a pretrained checkpoint's dtype; "auto": float32 on CPU, else
      bfloat16.
    max_seq_len: a pretrained checkpoint's context (None: its own); the
      tiny and saved models keep theirs.
    quantization: what `--quantization` says (see `weight_quantization`).

  Raises:
    FileNotFoundError, ValueError: see `load_pretrained`.
  """
  from paged_jax.models import load_pretrained, pretrained
  from paged_jax.models.quantized import quantize_loaded
  from paged_jax.models.tokenizer import ByteTokenizer

  quantization = weight_quantization(source, quantization)
  if source == "tiny":
    return quantize_loaded(pretrained.load_tiny(), quantization, source), ByteTokenizer()
  if (pathlib.Path(source) / pretrained.WEIGHTS_FILE).is_file():
    return quantize_loaded(pretrained.load_model(source), quantization, source), ByteTokenizer()
  if dtype == "auto":
    import jax

    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  return load_pretrained(source, dtype=dtype, max_seq_len=max_seq_len, quantization=quantization)
