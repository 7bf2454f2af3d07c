"""`describe_kernels`: the backend and the kernels `impl="auto"` runs there."""

import jax
import jax.numpy as jnp
import pytest

from paged_jax import kernel_choice
from pallas_kernels.paged_attention import cpu

SHAPE = dict(dtype=jnp.bfloat16, block_size=16, head_dim=128, group=4)


@pytest.mark.parametrize(
  "reason,decode", [(None, "C++ (XLA FFI)"), ("no C++ compiler found", "chunked XLA")]
)
def test_cpu_runs_the_cpp_kernel_or_xla_and_names_interpret_mode(monkeypatch, reason, decode):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  monkeypatch.setattr(cpu, "unavailable_reason", lambda: reason)
  assert kernel_choice.describe_kernels(**SHAPE) == (
    f"backend cpu: decode attention = {decode}, prefill attention = {decode}, "
    "write_kv = XLA, copy_blocks = XLA; the Pallas kernels run on cpu only in interpret mode "
    "(impl='pallas')"
  )
  with kernel_choice.use_cpu_kernel(False):
    assert "decode attention = chunked XLA, prefill attention = chunked XLA" in (
      kernel_choice.describe_kernels(**SHAPE)
    )
  assert "decode attention = chunked XLA, prefill attention = chunked XLA" in (
    kernel_choice.describe_kernels(**SHAPE, quantized=True)
  )


def test_tpu_runs_mosaic(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  assert kernel_choice.describe_kernels(**SHAPE) == (
    "backend tpu: decode attention = Mosaic (Pallas TPU), prefill attention = Mosaic (Pallas TPU), "
    "write_kv = Mosaic (Pallas TPU), copy_blocks = Mosaic (Pallas TPU)"
  )


@pytest.mark.parametrize(
  "decode,name",
  [
    (("mosaic_gpu", False), "Mosaic GPU (Pallas)"),
    (("triton", False), "Triton (Pallas GPU)"),
    (None, "chunked XLA"),
  ],
)
def test_gpu_names_the_selected_decode_kernel(monkeypatch, decode, name):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(kernel_choice, "gpu_compute_capability", lambda: 9.0)
  asked = {}
  monkeypatch.setattr(
    kernel_choice, "select_attention_kernel", lambda impl, **kwargs: asked.update(kwargs) or decode
  )
  assert kernel_choice.describe_kernels(**SHAPE, quantized=True) == (
    f"backend gpu (compute capability 9.0): decode attention = {name}, prefill attention = "
    "chunked XLA, write_kv = Triton (Pallas GPU), copy_blocks = Triton (Pallas GPU)"
  )
  assert asked == {**SHAPE, "quantized": True}
