"""Whether a kernel test runs a kernel compiled or in Pallas interpret mode.

A kernel runs compiled on the backend it is written for (the GPU flavour on
a GPU, the TPU flavour on a TPU) and in interpret mode everywhere else, so
the same tests check the interpreter on CPU and the compiled kernel on an
accelerator.
"""

import jax

_BACKENDS = {"gpu": ("gpu", "cuda", "rocm"), "tpu": ("tpu",)}


def interpret(kernel_backend: str) -> bool:
  """True unless JAX's default backend is the one `kernel_backend` ("gpu", "tpu") targets."""
  return jax.default_backend() not in _BACKENDS[kernel_backend]
