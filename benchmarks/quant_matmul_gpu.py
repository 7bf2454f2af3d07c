"""What one quantized product `x @ dequant(w).T` keeps in GPU memory, and
(on a GPU) how long it takes: XLA:GPU's product against the Triton kernel.

At Llama-3-8B's MLP size (a `[14336, 4096]` kernel), for each weight format
of `quant_matmul_tpu.FORMATS` and row count, compiles two forms:

* `xla`: `quantized.matmul` choosing as on CPU (XLA's product);
* `gpu`: `quantized.matmul` choosing as on a GPU
  (`kernel_choice.select_quantized_matmul`): the Triton kernel
  `pallas_kernels.quantized_matmul.gpu` for grouped weights, XLA for
  per-channel int8;

and reports from `memory_analysis()` the temporaries, and from the
optimized HLO each entry instruction that writes a float array at least
half the kernel's size (the dequantized kernel, or per-input scales, in
HBM). On a GPU it also times each form (median of `--iters` calls, after
one warm-up). Without a GPU it compiles for a compile-only H200 where the
CUDA plugin is installed (see `aot_cuda.py`), and times nothing.

  python benchmarks/quant_matmul_gpu.py [--rows 1 8 256] [--iters 50]
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/quant_matmul_gpu.py --gpu h200
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from benchmarks.quant_matmul_tpu import FORMATS, large_floats, weight_arrays
from paged_jax import kernel_choice
from paged_jax.models import quantized


def product_fn(form: str, fmt, k: int):
  """The jitted product of `form` for a weight of format `fmt` with `k` inputs."""
  bits, group_size, _ = fmt
  group_size = k if group_size is None else group_size

  def product(x, values, scales, minimums):
    return quantized.matmul(x, values, scales, minimums, bits, group_size, jnp.bfloat16)

  return jax.jit(product), ("cuda" if form == "gpu" else "cpu")


def compile_product(form: str, rows: int, n: int, k: int, fmt, device, run: bool):
  """`(compiled, arguments)` of `form` for `rows` bfloat16 rows on `device`:
  arrays where it `run`s, else ShapeDtypeStructs of a compile-only device."""
  values, scales, minimums, _ = weight_arrays(n, k, *fmt)
  rng = np.random.default_rng(0)
  arrays = (rng.standard_normal((rows, k)).astype(jnp.bfloat16), values, scales, minimums)
  sharding = jax.sharding.SingleDeviceSharding(device)
  if run:
    args = tuple(None if a is None else jax.device_put(a, device) for a in arrays)
  else:
    args = tuple(
      None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
      for a in arrays
    )
  fn, platform = product_fn(form, fmt, k)
  # Pallas GPU lowerings read the GPU from the device, or from an abstract one.
  abstract = AbstractDevice(device_kind=device.device_kind, num_cores=None, platform="cuda")
  mesh = AbstractMesh((1,), ("gpu",), (AxisType.Explicit,), abstract_device=abstract)
  with kernel_choice.target_platform(platform), contextlib.ExitStack() as stack:
    if not run:
      stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
    compiled = fn.trace(*args).lower().compile()
  return compiled, args


def median_ms(compiled, args, iters: int) -> float:
  compiled(*args).block_until_ready()
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    compiled(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def target_device(gpu: str | None):
  """The first GPU, else a compile-only one of kind `gpu` (h100, h200)."""
  if gpu is None:
    return jax.devices("gpu")[0]
  from benchmarks.aot_cuda import DEVICE_KINDS, compile_only_device

  return compile_only_device(DEVICE_KINDS[gpu])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpu", choices=["h100", "h200"], help="compile-only, without a GPU")
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256])
  parser.add_argument("--n", type=int, default=14336)
  parser.add_argument("--k", type=int, default=4096)
  parser.add_argument("--iters", type=int, default=50)
  parser.add_argument("--forms", nargs="+", default=["xla", "gpu"], choices=["xla", "gpu"])
  args = parser.parse_args()
  device = target_device(args.gpu)
  timed = args.gpu is None
  n, k = args.n, args.k
  print(
    f"{device.device_kind} ({'run' if timed else 'compiled only'}), kernel [{n}, {k}], "
    f"x bfloat16, jax {jax.__version__}"
  )
  print(
    "| rows | weights | form | kernel | weight MB | temporaries MB | ms "
    "| float arrays >= half the kernel |"
  )
  print("| ---: | --- | --- | --- | ---: | ---: | ---: | --- |")
  for rows in args.rows:
    for label, fmt in FORMATS.items():
      values, scales, minimums, _ = weight_arrays(n, k, *fmt)
      mb = sum(a.nbytes for a in (values, scales, minimums) if a is not None) / 1e6
      for form in args.forms:
        compiled, call_args = compile_product(form, rows, n, k, fmt, device, timed)
        temp = compiled.memory_analysis().temp_size_in_bytes / 1e6
        text = compiled.as_text()
        shown = ", ".join(large_floats(text, n, k)) or "none"
        kernel = "Triton" if "quantized_matmul_gpu" in text else "XLA"
        ms = f"{median_ms(compiled, call_args, args.iters):.3f}" if timed else "-"
        print(
          f"| {rows} | {label} | {form} | {kernel} | {mb:.1f} | {temp:.1f} | {ms} | {shown} |",
          flush=True,
        )


if __name__ == "__main__":
  main()
