"""Where one stream's decode step goes, per weight format (SmolLM2-135M-Instruct, one row).

Every format (`quantization:dtype`, as in bench_quant_weights_smollm2.py)
is loaded into one process; then, in rounds, each format's parts are timed
in turn (medians over the rounds, so that load the machine takes on weighs
on every format alike). Each part is its own jitted program, called
`--reps` times in a row, each call on the last one's output (ms per call,
dispatch included), on one row of the compute dtype:

  step            a decode step as a user sees it: a 1-slot `pj.LLM`,
                  (time of N tokens - time of 1 token) / (N - 1), prefix
                  caching off (sampling, host and detokenization included)
  layers, no attn `model.hidden_states` of one token with a backend whose
                  `attend` writes nothing and returns q: the 30 layers'
                  norms, RoPE and projections
  projections     the 7 projections of each of the 30 layers alone (the
                  model's own `Linear`s, so quantized kernels take their
                  one-row path, `quantized.matvec`), then the attention four
                  (q, k, v, o) and the MLP three (gate, up, down) apart
  output layer    `model.logits` (the tied embedding, float in every format)

Usage: PYTHONPATH=. python benchmarks/profile_single_stream.py
       [--formats none:bfloat16 gguf:bfloat16 int8:bfloat16 int4:bfloat16]
       [--rounds 5] [--reps 16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

BENCHMARKS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))
from bench_quant_weights_smollm2 import load  # noqa: E402
from bench_vs_llamacpp import engine, prepare, timed_generate  # noqa: E402
from profile_decode_step import NoAttention  # noqa: E402

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def chained_ms(fn, state, x, reps: int) -> float:
  """ms per call of a jitted `fn(state, x) -> x`, called `reps` times, each
  call on the last one's output (not in a `lax.fori_loop`: XLA hoists a
  float32 copy of each kernel, transposed or dequantized, out of such a
  loop, and the loop's products read that copy, 2x to 5x slower)."""
  jax.block_until_ready(fn(state, x))  # compiles
  start = time.perf_counter()
  for _ in range(reps):
    x = fn(state, x)
  jax.block_until_ready(x)
  return 1e3 * (time.perf_counter() - start) / reps


def projections(graphdef, names: tuple[str, ...]):
  """One pass through the named projections of every layer, each fed a row
  of its input width; returns the row, touched by every output."""

  def run(state, x):
    model = nnx.merge(graphdef, state)
    for block in model.blocks:
      for name in names:
        linear = getattr(block.mlp if name in MLP else block.attention, name)
        width = linear.kernel.shape[1]
        row = jnp.resize(x, (*x.shape[:-1], width)) if width != x.shape[-1] else x
        y = linear(row)
        x = x.at[..., 0].add(y[..., 0] * jnp.asarray(1e-3, x.dtype))
    return x

  return jax.jit(run)


def layers_no_attention(graphdef, position):
  """Every layer of one token (attention returning q); returns a token."""

  def run(state, token):
    model = nnx.merge(graphdef, state)
    hidden, _ = model.hidden_states(token, position, NoAttention())
    return (token + (hidden[:, :, 0] > 0).astype(jnp.int32)) % model.config.vocab_size

  return jax.jit(run)


def output_layer(graphdef):
  """The logits of one row; returns the row, touched by them."""

  def run(state, hidden):
    model = nnx.merge(graphdef, state)
    logits = model.logits(hidden)
    return hidden.at[:, :, 0].add((logits[:, :, 0] * 1e-6).astype(hidden.dtype))

  return jax.jit(run)


def parts(model, tokenizer, ids, reps: int, tokens: int) -> dict:
  """{part: a function timing it once, in ms}."""
  graphdef, state = nnx.split(model)
  dtype = model.config.compute_dtype
  row = jnp.ones((1, 1, model.config.hidden), dtype)
  token, position = jnp.full((1, 1), 100, jnp.int32), jnp.full((1, 1), 40, jnp.int32)
  llm = engine(model, tokenizer, 1)

  def step():
    first, _ = timed_generate(llm, ids[:1], 1)
    whole, count = timed_generate(llm, ids[:1], tokens)
    return 1e3 * (whole - first) / (count - 1)

  timers = {"step": step}
  chained = {
    "layers, no attention": (layers_no_attention(graphdef, position), token),
    "projections (7 x 30)": (projections(graphdef, ATTENTION + MLP), row),
    "  q, k, v, o (4 x 30)": (projections(graphdef, ATTENTION), row),
    "  gate, up, down (3 x 30)": (projections(graphdef, MLP), row),
    "output layer": (output_layer(graphdef), row),
  }
  for name, (fn, x) in chained.items():
    timers[name] = lambda fn=fn, x=x: chained_ms(fn, state, x, reps)
  return timers


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--formats",
    nargs="+",
    default=["none:bfloat16", "gguf:bfloat16", "int8:bfloat16", "int4:bfloat16"],
  )
  parser.add_argument("--rounds", type=int, default=5, help="counted rounds, after one warm-up")
  parser.add_argument("--reps", type=int, default=16, help="calls per timing")
  parser.add_argument("--tokens", type=int, default=32, help="tokens of the step's stream")
  parser.add_argument("--group-size", type=int, default=32)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory(prefix="profile_single_") as workdir:
    workdir = pathlib.Path(workdir)
    ids = prepare(args.formats, args.group_size, workdir)
    timers = {}
    for form in args.formats:
      model, tokenizer = load(form, workdir / "hf", args.group_size)
      timers[form] = parts(model, tokenizer, ids, args.reps, args.tokens)
  print(f"load average at start: {os.getloadavg()}", file=sys.stderr)
  times = {form: {name: [] for name in t} for form, t in timers.items()}
  for round_ in range(args.rounds + 1):  # round 0 compiles
    for form, named in timers.items():
      for name, timer in named.items():
        ms = timer()
        if round_:
          times[form][name].append(ms)
    print(f"round {round_} done, load {os.getloadavg()}", file=sys.stderr)
  medians = {f: {n: statistics.median(v) for n, v in t.items()} for f, t in times.items()}
  forms = list(medians)
  print("| part, ms | " + " | ".join(forms) + " |")
  print("| --- |" + " ---: |" * len(forms))
  for name in next(iter(medians.values())):
    print(f"| {name} | " + " | ".join(f"{medians[f][name]:.2f}" for f in forms) + " |")
  rest = {f: m["step"] - m["layers, no attention"] - m["output layer"] for f, m in medians.items()}
  print("| rest of the step (attention, sampling, host) | ", end="")
  print(" | ".join(f"{rest[f]:.2f}" for f in forms) + " |")
  print(f"\n(medians of {args.rounds} rounds; load average at end {os.getloadavg()})")


if __name__ == "__main__":
  main()
