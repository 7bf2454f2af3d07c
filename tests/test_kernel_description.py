"""`describe_kernels`: the backend and the kernels `impl="auto"` runs there."""

import jax
import jax.numpy as jnp
import pytest

from paged_jax import kernel_choice

SHAPE = dict(dtype=jnp.bfloat16, block_size=16, head_dim=128, group=4)


def test_cpu_runs_xla_and_names_interpret_mode(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert kernel_choice.describe_kernels(**SHAPE) == (
    "backend cpu: decode attention = chunked XLA, prefill attention = chunked XLA, "
    "write_kv = XLA, copy_blocks = XLA; the Pallas kernels run on cpu only in interpret mode "
    "(impl='pallas')"
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
