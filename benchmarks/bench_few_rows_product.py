"""A few bfloat16 rows times bfloat16 weights `w [N, K]` (a decode step's
projections at 1 to 32 sequences): the C++ kernel (`pallas_kernels.
row_product`, what `layers.dot_transposed` takes on CPU up to
`kernel_choice.ROW_PRODUCT_MAX_ROWS` rows) against XLA's matmul
(`lax.dot_general` contracting both last axes, float32 sums).

As in a model's step, the weights come from memory, not from cache: each
call of one jitted program runs the product over 80 MB of distinct weights
of one shape (two of the tied output layer's). SmolLM2's shapes; best of 5
rounds, microseconds per product, and the largest difference between the
two relative to the largest output.

  python benchmarks/bench_few_rows_product.py [--rows 1 4 8 16 32]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import row_product

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu_prefill import best_time  # noqa: E402

SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))  # [N, K]
WEIGHT_BYTES = 80e6


def xla_product(x, w):
  return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
  args = parser.parse_args()
  reason = row_product.unavailable_reason()
  if reason:
    raise SystemExit(f"the C++ kernel cannot run here: {reason}")
  rng = np.random.default_rng(0)
  print(f"JAX {jax.__version__}")
  print("| rows | w [N, K] | XLA (us) | C++ kernel (us) | XLA / kernel | difference |")
  print("|---:|---|---:|---:|---:|---:|")
  for n, k in SHAPES:
    copies = max(2, int(WEIGHT_BYTES // (n * k * 2)))
    weights = [jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16) for _ in range(copies)]
    for m in args.rows:
      x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
      kernel = jax.jit(lambda x, *ws: [row_product.row_product(x, w) for w in ws])
      xla = jax.jit(lambda x, *ws: [xla_product(x, w) for w in ws])
      got, want = np.asarray(kernel(x, *weights)[0]), np.asarray(xla(x, *weights)[0])
      difference = np.max(np.abs(got - want)) / np.max(np.abs(want))
      kernel_us = best_time(kernel, x, *weights) / copies * 1e6
      xla_us = best_time(xla, x, *weights) / copies * 1e6
      print(
        f"| {m} | [{n}, {k}] | {xla_us:,.0f} | {kernel_us:,.0f} | {xla_us / kernel_us:.2f}x "
        f"| {difference:.1e} |"
      )


if __name__ == "__main__":
  main()
