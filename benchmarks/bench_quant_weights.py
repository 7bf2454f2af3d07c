"""Quantized matmul forms on this backend: what XLA fuses and what runs fastest.

For one `[N, K]` kernel (float32, bfloat16, int8 per channel, int8 and int4
per group of 32) and `rows` activation rows, times `x @ w.T` written as:

* `dequant-dot`: the kernel dequantized in float32, rounded to the compute
  dtype and multiplied (`quantized.matmul`'s general form);
* `dot-scale`: the integers multiplied, the per-channel scales applied to
  the result (`quantized.matmul`'s per-channel int8 form);
* `group-dot`: one product per group of inputs, each scaled and summed
  (scale and minimum applied after the dot, per group);
* `library`: `quantized.matmul` as the models run it (one of the above, or
  at a single row `jnp.dot` with the dequantized kernel transposed).

and reports from the optimized HLO whether the dequantization became its own
fusion writing a float kernel (`materialized`), or fused into the product.

With `--tpu-topology v5e:1x1` (JAX >= 0.12 with libtpu) nothing runs: each
form is compiled for that TPU's compile-only devices and only the
`materialized` column is filled.

  python benchmarks/bench_quant_weights.py [--rows 1 32] [--n 4096 --k 2048]
                                           [--tpu-topology v5e:1x1]
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.models import layers, quantized


def group_dot(x, values, scales, minimums, bits, group_size, dtype):
  """`x @ w.T` as per-group products scaled after the dot (float32)."""
  ints = quantized.unpack_int4(values, group_size) if bits == 4 else values
  n, k = ints.shape
  groups = k // group_size
  xg = x.astype(dtype).reshape(*x.shape[:-1], groups, group_size)
  partial = jnp.einsum(
    "...gk,ngk->...ng",
    xg,
    ints.reshape(n, groups, group_size).astype(dtype),
    preferred_element_type=jnp.float32,
  )
  y = jnp.sum(partial * scales.astype(jnp.float32), axis=-1)
  if minimums is not None:
    sums = jnp.sum(xg.astype(jnp.float32), axis=-1)
    y = y + jnp.einsum("...g,ng->...n", sums, minimums.astype(jnp.float32))
  return y


def dequant_dot(x, values, scales, minimums, bits, group_size, dtype):
  weight = quantized.dequantize(values, scales, minimums, bits, group_size).astype(dtype)
  return layers.dot_transposed(x.astype(dtype), weight)


def dot_scale(x, values, scales, minimums, bits, group_size, dtype):
  y = layers.dot_transposed(x.astype(dtype), values.astype(dtype))
  return y * scales[:, 0].astype(jnp.float32)


def float_dot(x, weight, dtype):
  return layers.dot_transposed(x.astype(dtype), weight)


def materialized(compiled, n: int, k: int) -> bool:
  """Whether some fusion other than the product outputs a float `[n, k]`."""
  text = compiled.as_text()
  pattern = rf"(f32|bf16)\[{n},{k}\]\{{[^}}]*\}} fusion\("
  return re.search(pattern, text) is not None


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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
  parser.add_argument("--n", type=int, default=4096)
  parser.add_argument("--k", type=int, default=2048)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--tpu-topology", help="compile for this TPU (no run): fusions only")
  args = parser.parse_args()
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
        forms = {"dequant-dot": dequant_dot, "group-dot": group_dot}
        if label == "int8/channel":
          forms = {"dequant-dot": dequant_dot, "dot-scale": dot_scale}
        forms["library"] = quantized.matmul
        for form, impl in forms.items():
          fn = jax.jit(
            lambda x, v, s, m, impl=impl, q=q, dtype=dtype: impl(
              x, v, s, m, q.bits, q.group_size, dtype
            )
          )
          us, fused = report(fn, x, *arrays)
          print(f"| {rows} | {name} | {label} | {form} | {mb:.1f} | {us} | {fused} |")


if __name__ == "__main__":
  main()
