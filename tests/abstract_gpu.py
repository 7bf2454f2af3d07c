"""Lowering for a platform this machine lacks.

JAX 0.12's Pallas GPU lowerings read the GPU's compute capability from the
device, or, without one, from the abstract device of the abstract mesh in
context; tracing and lowering under an abstract H100 mesh serves every
supported JAX (the abstract mesh API is the same on JAX 0.10.2).
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")


def lower_for(platform, fn, *args, **kwargs):
  """Traces and lowers jitted `fn` for `platform`, CUDA as an abstract H100."""
  if platform != "cuda":
    return fn.trace(*args, **kwargs).lower(lowering_platforms=(platform,))
  mesh = AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=H100)
  with jax.sharding.use_abstract_mesh(mesh):
    return fn.trace(*args, **kwargs).lower(lowering_platforms=(platform,))
