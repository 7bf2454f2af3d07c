"""Quantized matmul forms on this backend: what XLA fuses and what runs fastest.

For one `[N, K]` kernel (float32, bfloat16, int8 per channel, int8 and int4
per group of 32) and `rows` activation rows, times `x @ w.T` written as:

* `dequant-dot`: the kernel dequantized in float32, rounded to the compute
  dtype and multiplied (`quantized.matmul`'s form for several rows; at one
  row `jnp.dot` with the kernel transposed);
* `dot-scale`: the integers multiplied, the per-channel scales applied to
  the result (per-channel int8 at several rows);
* `interleaved` (int4): `dequant-dot` over the layout int4 had before, the
  nibbles interleaved within each group of 32 (GGUF's Q4_0 order: byte `j`
  of a group holds its inputs `j` and `j + 16`), unpacked by a broadcast shift;
* `halves-concat` (int4): one float32 product over the two nibble halves of
  each row concatenated (the halves layout `quantized` keeps, without
  `matvec`'s two products);
* `library`: `quantized.matmul` as the models run it (at one row
  `quantized.matvec`: float32, no rounding of the weights, 4 bits as two
  products over the halves).

and reports from the optimized HLO whether some fusion other than the
product writes a float kernel (`materialized`: an output of at least
`N * K / 2` floats), or the dequantization fused into the product.

With `--tpu-topology v5e:1x1` (JAX >= 0.12 with libtpu) nothing runs: each
form is compiled for that TPU's compile-only devices and only the
`materialized` column is filled.

With `--smollm2-shapes`: bfloat16 rows (`--rows`, default 1) through
SmolLM2's kernel shapes, the float kernel, per-channel int8 and int4 (groups
of 32) before and now (`interleaved` against `library`, XLA's forms, traced
with the C++ kernel off) and by the C++ CPU kernel
(`pallas_kernels.quantized_matmul.cpu`), the forms' calls taking turns in
one process (median over rounds), for a machine whose load changes.

  python benchmarks/bench_quant_weights.py [--rows 1 32] [--n 4096 --k 2048]
                                           [--tpu-topology v5e:1x1]
  python benchmarks/bench_quant_weights.py --smollm2-shapes [--rows 1 4 8 16]
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import kernel_choice
from paged_jax.models import layers, quantized


def dequant_dot(x, values, scales, minimums, bits, group_size, dtype):
  weight = quantized.dequantize(values, scales, minimums, bits, group_size).astype(dtype)
  x = x.astype(dtype)
  if math.prod(x.shape[:-1]) == 1:
    return jnp.dot(x, weight.T, preferred_element_type=jnp.float32)
  return layers.dot_transposed(x, weight)


def dot_scale(x, values, scales, minimums, bits, group_size, dtype):
  y = layers.dot_transposed(x.astype(dtype), values.astype(dtype))
  return y * scales[:, 0].astype(jnp.float32)


def interleave(packed: np.ndarray, group_size: int) -> np.ndarray:
  """Halves-packed int4 values repacked with the nibbles interleaved within
  each group (byte `j` of a group: inputs `j` and `j + group_size / 2`)."""
  ints = np.asarray(quantized.unpack_int4(packed))
  out, k = ints.shape
  grouped = ints.reshape(out, k // group_size, 2, group_size // 2)
  return (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(out, k // 2)


def interleaved(x, values, scales, minimums, bits, group_size, dtype):
  """`dequant-dot` over interleaved values (see `interleave`)."""
  out, half = values.shape
  grouped = values.reshape(out, half * 2 // group_size, 1, group_size // 2)
  ints = ((grouped >> jnp.array([0, 4], jnp.uint8)[:, None]) & 0x0F).reshape(out, half * 2)
  weight = (
    ints.reshape(out, -1, group_size).astype(jnp.float32) * scales.astype(jnp.float32)[..., None]
    + minimums.astype(jnp.float32)[..., None]
  )
  weight = weight.reshape(out, half * 2).astype(dtype)
  return jnp.dot(x.astype(dtype), weight.T, preferred_element_type=jnp.float32)


def halves_concat(x, values, scales, minimums, bits, group_size, dtype):
  """One float32 product over the concatenated nibble halves."""
  weight = quantized.dequantize(values, scales, minimums, bits, group_size)
  x = x.astype(dtype).astype(jnp.float32)
  return jnp.dot(x, weight.T, preferred_element_type=jnp.float32)


def float_dot(x, weight, dtype):
  return layers.dot_transposed(x.astype(dtype), weight)


def materialized(compiled, n: int, k: int) -> bool:
  """Whether some fusion other than the product outputs a float kernel (at
  least `n * k / 2` floats: a whole kernel, or one half of a 4-bit one)."""
  for dims in re.findall(r"(?:f32|bf16)\[([\d,]+)\]\{[^}]*\} fusion\(", compiled.as_text()):
    if math.prod(int(d) for d in dims.split(",")) >= n * k // 2:
      return True
  return False


def on_tpu(topology: str):
  """`(args -> ShapeDtypeStructs on one compile-only TPU device)` for `topology`."""
  from paged_jax import aot

  devices = aot.topology_devices(topology)
  sharding = jax.sharding.SingleDeviceSharding(devices[0])

  def abstract(*args):
    return [
      None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args
    ]

  return abstract


def time_call(fn, *args, iters: int) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / iters)
  return best


SMOLLM2_SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536))


def smollm2_shapes(rows_list=(1,), rounds: int = 7, calls: int = 200) -> None:
  """Prints us per bfloat16 call of each form at SmolLM2's kernels: XLA's
  forms (traced with the C++ kernel off) and the C++ kernel's."""
  rng = np.random.default_rng(0)
  print(
    "| rows | kernel [out, in] | bfloat16 | int8 per channel | int8 C++ | int4 interleaved "
    "| int4 library | int4 C++ |"
  )
  print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
  bf16 = jnp.bfloat16
  traced = lambda fn, enabled: jax.jit(kernel_choice.use_cpu_kernel(enabled)(fn))
  for rows, (n, k) in itertools.product(rows_list, SMOLLM2_SHAPES):
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    q8, q4 = quantized.quantize_int8(w), quantized.quantize_int4(w, 32)
    int8 = (q8.values[...], q8.scales[...])
    int4 = (q4.values[...], q4.scales[...], q4.minimums[...])
    mixed = (jnp.asarray(interleave(int4[0], 32)), *int4[1:])
    product8 = lambda x, v, s: quantized.matmul(x, v, s, None, 8, k, bf16)
    product4 = lambda x, v, s, m: quantized.matmul(x, v, s, m, 4, 32, bf16)
    forms = [
      (jax.jit(lambda x, w: float_dot(x, w, bf16)), (x, jnp.asarray(w, bf16))),
      (traced(product8, False), (x, *int8)),
      (traced(product8, True), (x, *int8)),
      (traced(lambda x, v, s, m: interleaved(x, v, s, m, 4, 32, bf16), False), (x, *mixed)),
      (traced(product4, False), (x, *int4)),
      (traced(product4, True), (x, *int4)),
    ]
    times = [[] for _ in forms]
    for fn, args in forms:
      jax.block_until_ready(fn(*args))
    for _ in range(rounds):
      for (fn, args), spent in zip(forms, times, strict=True):
        start = time.perf_counter()
        for _ in range(calls):
          out = fn(*args)
        jax.block_until_ready(out)
        spent.append((time.perf_counter() - start) / calls * 1e6)
    cells = " | ".join(f"{np.median(t):.0f}" for t in times)
    print(f"| {rows} | [{n}, {k}] | {cells} |", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, nargs="+")
  parser.add_argument("--n", type=int, default=4096)
  parser.add_argument("--k", type=int, default=2048)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--tpu-topology", help="compile for this TPU (no run): fusions only")
  parser.add_argument("--smollm2-shapes", action="store_true", help="see the module docstring")
  args = parser.parse_args()
  args.rows_given = args.rows is not None
  args.rows = args.rows or [1, 32]
  if args.smollm2_shapes:
    smollm2_shapes(args.rows if args.rows_given else (1,))
    return
  tpu = on_tpu(args.tpu_topology) if args.tpu_topology else None

  def report(fn, *arrays, float_kernel: bool = False) -> tuple[str, str]:
    """`(us/call, materialized)` of `fn` on `arrays`."""
    if tpu is not None:
      compiled = fn.lower(*tpu(*arrays)).compile()
      return "-", "-" if float_kernel else ("yes" if materialized(compiled, n, k) else "no")
    us = f"{time_call(fn, *arrays, iters=args.iters) * 1e6:.0f}"
    if float_kernel:
      return us, "-"
    return us, "yes" if materialized(fn.lower(*arrays).compile(), n, k) else "no"

  n, k = args.n, args.k
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
  formats = {
    "int8/channel": quantized.quantize_int8(w),
    "int8/g32": quantized.quantize_int8(w, 32),
    "int4/g32": quantized.quantize_int4(w, 32),
  }
  backend = f"TPU {args.tpu_topology} (compiled only)" if tpu else jax.default_backend()
  print(f"backend {backend}, kernel [{n}, {k}], best of 3 x {args.iters}")
  print("| rows | dtype | weights | form | weight MB | us/call | materialized |")
  print("|---|---|---|---|---|---|---|")
  for rows in args.rows:
    for dtype in (jnp.bfloat16, jnp.float32):
      x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
      wf = jnp.asarray(w, dtype)
      fn = jax.jit(lambda x, w, dtype=dtype: float_dot(x, w, dtype))
      us, _ = report(fn, x, wf, float_kernel=True)
      name = jnp.dtype(dtype).name
      print(f"| {rows} | {name} | {name} | dot | {wf.nbytes / 1e6:.1f} | {us} | - |")
      for label, q in formats.items():
        arrays = (q.values[...], q.scales[...], None if q.minimums is None else q.minimums[...])
        mb = sum(a.nbytes for a in arrays if a is not None) / 1e6
        forms = {"dequant-dot": (dequant_dot, arrays)}
        if label == "int8/channel":
          forms["dot-scale"] = (dot_scale, arrays)
        if q.bits == 4 and rows == 1:
          mixed = (jnp.asarray(interleave(arrays[0], q.group_size)), *arrays[1:])
          forms["interleaved"] = (interleaved, mixed)
          forms["halves-concat"] = (halves_concat, arrays)
        forms["library"] = (quantized.matmul, arrays)
        for form, (impl, inputs) in forms.items():
          fn = jax.jit(
            lambda x, v, s, m, impl=impl, q=q, dtype=dtype: impl(
              x, v, s, m, q.bits, q.group_size, dtype
            )
          )
          us, fused = report(fn, x, *inputs)
          print(f"| {rows} | {name} | {label} | {form} | {mb:.1f} | {us} | {fused} |", flush=True)


if __name__ == "__main__":
  main()
