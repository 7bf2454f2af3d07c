"""One row times a weight `w [N, K]` (a decode step's projections at one
sequence), in the forms XLA:CPU might run: `jnp.dot(x, w.T)` (the form
`layers.dot_transposed` uses for one bfloat16 row before JAX 0.12),
`lax.dot_general` contracting both last axes, the same with the row padded
to two (its form from JAX 0.12 on), and a float32 multiply and sum. SmolLM2's
shapes; best of 5 rounds of 200 calls, microseconds per call. Run it under
each JAX to compare versions:

  python benchmarks/bench_one_row_product.py
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp

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
  print("| dtype | w [N, K] | " + " | ".join(FORMS) + " |")
  print("|---|---|" + "---:|" * len(FORMS))
  for dtype in (jnp.bfloat16, jnp.float32):
    for n, k in SHAPES:
      x = jax.random.normal(jax.random.PRNGKey(0), (1, k), dtype)
      w = jax.random.normal(jax.random.PRNGKey(1), (n, k), dtype)
      times = [best_time(jax.jit(form), x, w, calls=200) * 1e6 for form in FORMS.values()]
      cells = " | ".join(f"{t:,.0f} us" for t in times)
      print(f"| {jnp.dtype(dtype).name} | {n} x {k} | {cells} |")


if __name__ == "__main__":
  main()
