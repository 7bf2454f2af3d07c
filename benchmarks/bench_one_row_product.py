"""One row times a weight `w [N, K]` (a decode step's projections at one
sequence), in the forms XLA:CPU might run: `jnp.dot(x, w.T)` (the form
`layers.dot_transposed` uses for one bfloat16 row before JAX 0.12),
`lax.dot_general` contracting both last axes, the same with the row padded
to two (its form from JAX 0.12 on without the kernel), a float32 multiply
and sum, and for bfloat16 the C++ kernel (`pallas_kernels.row_product`, the
form it takes on CPU). SmolLM2's shapes; best of 5 rounds of 200 calls,
microseconds per call. Run it under each JAX to compare versions:

  python benchmarks/bench_one_row_product.py
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import row_product

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_cpu_prefill import best_time  # noqa: E402

SHAPES = ((1536, 576), (576, 1536), (49152, 576))  # [N, K]: MLP up, MLP down, tied output
FORMS = {
  "dot(x, w.T)": lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32),
  "dot_general": lambda x, w: jax.lax.dot_general(
    x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  ),
  "padded to two rows": lambda x, w: jax.lax.dot_general(
    jnp.concatenate([x, jnp.zeros_like(x)]),
    w,
    (((1,), (1,)), ((), ())),
    preferred_element_type=jnp.float32,
  )[:1],
  "float32 multiply and sum": lambda x, w: jnp.sum(
    x.astype(jnp.float32) * w.astype(jnp.float32), axis=-1
  )[None],
}


def main():
  print(f"JAX {jax.__version__}")
  kernel = row_product.unavailable_reason() is None
  print("| dtype | w [N, K] | " + " | ".join(FORMS) + " | C++ row product |")
  print("|---|---|" + "---:|" * (len(FORMS) + 1))
  for dtype in (jnp.bfloat16, jnp.float32):
    for n, k in SHAPES:
      x = jax.random.normal(jax.random.PRNGKey(0), (1, k), dtype)
      w = jax.random.normal(jax.random.PRNGKey(1), (n, k), dtype)
      forms = list(FORMS.values())
      if kernel and dtype == jnp.bfloat16:
        forms.append(row_product.row_product)
      times = [best_time(jax.jit(form), x, w, calls=200) * 1e6 for form in forms]
      cells = [f"{t:,.0f} us" for t in times] + ["-"] * (len(FORMS) + 1 - len(times))
      print(f"| {jnp.dtype(dtype).name} | {n} x {k} | {' | '.join(cells)} |")


if __name__ == "__main__":
  main()
