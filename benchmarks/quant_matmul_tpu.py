"""What one quantized product `x @ dequant(w).T` keeps in HBM, compiled for a TPU.

Compiles (never runs) each product at Llama-3-8B's MLP size (a `[14336,
4096]` kernel: gate and up projections) for one compile-only device of a TPU
topology (libtpu, JAX >= 0.12) and reports from `memory_analysis()` the
temporaries, and from the optimized HLO each instruction of the entry
computation that outputs a float array at least half the kernel's size (its op, a fusion's kind, and
shape: the dequantized kernel, or per-input scales, written to HBM). Forms:

* `xla`: `quantized.matmul` choosing as on CPU: XLA's product;
* `tpu`: `quantized.matmul` choosing as on TPU (what the models run there,
  `kernel_choice.select_quantized_matmul`): the Mosaic kernel
  `pallas_kernels.quantized_matmul` for grouped weights, XLA for per-channel int8.

  python benchmarks/quant_matmul_tpu.py [--topology v5e:1x1] [--rows 1 8 256]
"""

from __future__ import annotations

import argparse
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import aot, kernel_choice
from paged_jax.models import quantized

FORMATS = {  # label: (bits, group_size or None for per channel, minimums)
  "int8/channel": (8, None, False),
  "int8/g32": (8, 32, False),
  "int4/g32": (4, 32, True),
  "int4/g128": (4, 128, True),
  "int4/g128 no minimums": (4, 128, False),
}


def large_floats(hlo: str, n: int, k: int) -> list[str]:
  """`"op dtype[shape]"` (`fusion:kind` for fusions) of each instruction of
  `hlo`'s entry computation (arrays in HBM, not a fusion's insides) whose
  float output holds at least `n * k / 2` elements."""
  entry = hlo[hlo.index("\nENTRY ") :]
  entry = entry[: entry.index("\n}")]
  found = []
  pattern = r"= ((?:f32|bf16)\[([\d,]+)\])\{[^}]*\} ([\w-]+)\(([^\n]*)"
  for shape, dims, op, rest in re.findall(pattern, entry):
    if math.prod(int(d) for d in dims.split(",")) >= n * k // 2:
      kind = re.search(r"kind=(k\w+)", rest) if op == "fusion" else None
      found.append(f"{op}:{kind.group(1)} {shape}" if kind else f"{op} {shape}")
  return found


def weight_arrays(n: int, k: int, bits: int, group_size, with_minimums: bool):
  """ShapeDtypeStructs-to-be (numpy zeros are never sent anywhere) of one kernel."""
  group_size = k if group_size is None else group_size
  values = np.zeros((n, k) if bits == 8 else (n, k // 2), np.int8 if bits == 8 else np.uint8)
  scale_dtype = np.float32 if bits == 8 else np.float16
  scales = np.zeros((n, k // group_size), scale_dtype)
  return values, scales, (scales if with_minimums else None), group_size


def compile_product(form: str, rows: int, n: int, k: int, fmt, device):
  """The compiled product of `form` (`xla`, `tpu`) for `rows` bfloat16 rows."""
  bits, group_size, with_minimums = fmt
  values, scales, minimums, group_size = weight_arrays(n, k, bits, group_size, with_minimums)
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = lambda a: (
    None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
  )

  def product(x, values, scales, minimums):
    return quantized.matmul(x, values, scales, minimums, bits, group_size, jnp.bfloat16)

  x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16, sharding=sharding)
  with kernel_choice.target_platform("tpu" if form == "tpu" else "cpu"):
    lowered = jax.jit(product).lower(x, *map(abstract, (values, scales, minimums)))
  return lowered.compile()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--topology", default="v5e:1x1")
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256])
  parser.add_argument("--n", type=int, default=14336)
  parser.add_argument("--k", type=int, default=4096)
  parser.add_argument("--forms", nargs="+", default=["xla", "tpu"], choices=["xla", "tpu"])
  args = parser.parse_args()
  device = aot.topology_devices(args.topology)[0]
  n, k = args.n, args.k
  print(
    f"TPU {args.topology} (compiled only), kernel [{n}, {k}], x bfloat16, jax {jax.__version__}"
  )
  print("| rows | weights | form | weight MB | temporaries MB | float arrays >= half the kernel |")
  print("| ---: | --- | --- | ---: | ---: | --- |")
  for rows in args.rows:
    for label, fmt in FORMATS.items():
      values, scales, minimums, _ = weight_arrays(n, k, *fmt)
      mb = sum(a.nbytes for a in (values, scales, minimums) if a is not None) / 1e6
      for form in args.forms:
        compiled = compile_product(form, rows, n, k, fmt, device)
        temp = compiled.memory_analysis().temp_size_in_bytes / 1e6
        fusions = large_floats(compiled.as_text(), n, k)
        shown = ", ".join(fusions) or "none"
        print(f"| {rows} | {label} | {form} | {mb:.1f} | {temp:.1f} | {shown} |", flush=True)


if __name__ == "__main__":
  main()
