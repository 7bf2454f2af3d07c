"""Structured outputs: compile time of constraints, and the device cost of a masked step.

Usage: `python benchmarks/bench_structured.py [--smollm2] [--rows 64] [--engine]`

For each tokenizer (the tiny model's bytes; SmolLM2's 49,152 tokens with
`--smollm2`) and each constraint it prints the host compile time (regex to
outlines-core `Index` to dense automaton; the first compile of a vocabulary
also builds its `Vocabulary`), the automaton's states and transitions, the
packing time and the packed table's shapes; then the time of one jitted
`allowed_mask` + `sample_rows` + `advance` step for `--rows` rows against
`sample_rows` alone on the same logits, greedy (the mask's own cost) and
with temperature 0.8 and top-p 0.95 (a full-vocabulary sort per row, so the
two differ also by what the sort meets).

With `--engine`, it serves a batch of 8 JSON-schema requests with SmolLM2
(float32, 256 positions) through `pj.LLM`, and the same batch without the
constraint, side by side (each run once to compile, then timed): tokens per
second, the ratio, and the decode loop's steps per launch (the loop keeps
running all its steps with constrained rows). Seconds per decode step
(prefill included) separate the mask's cost from the constrained rows
finishing earlier, which leaves fewer rows per step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

import paged_jax as pj
from paged_jax import structured as st
from paged_jax.models import ByteTokenizer
from paged_jax.sampling import RowParams, sample_rows

PERSON = {
  "type": "object",
  "properties": {
    "name": {"type": "string"},
    "age": {"type": "integer"},
    "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string"}},
  },
  "required": ["name", "age", "colour", "tags"],
}
CONSTRAINTS = {
  "schema": pj.StructuredOutputsParams(json=PERSON),
  "choice": pj.StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
  "regex": pj.StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"),
  "json_object": pj.StructuredOutputsParams(json_object=True),
}


def _seconds(function, repeats: int) -> float:
  jax.block_until_ready(function())
  start = time.perf_counter()
  for _ in range(repeats):
    out = function()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / repeats


def bench_tokenizer(name: str, tokenizer, vocab_size: int, rows: int) -> None:
  start = time.perf_counter()
  st.vocabulary_key(tokenizer)
  print(f"{name}: vocabulary of {vocab_size} tokens built in {time.perf_counter() - start:.2f} s")
  print(f"{'constraint':>12} {'compile s':>9} {'states':>7} {'edges':>9} {'pack s':>7}  table")
  automata = []
  for label, constraint in CONSTRAINTS.items():
    start = time.perf_counter()
    automaton = st.compile_constraint(constraint, tokenizer)
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    packed = st.pack_automata([automaton], vocab_size)
    jax.block_until_ready(packed.table)
    packing = time.perf_counter() - start
    automata.append(automaton)
    shapes = f"bits {packed.table.bits.shape}, edges {packed.table.tokens.shape[0]}"
    print(
      f"{label:>12} {compiled:9.2f} {automaton.num_states:7d} {automaton.num_edges:9d} "
      f"{packing:7.2f}  {shapes}"
    )
  packed = st.pack_automata(automata, vocab_size)
  starts = [packed.initial_state(automaton) for automaton in automata]
  states = jnp.asarray([starts[row % len(starts)] for row in range(rows)], jnp.int32)
  logits = jax.random.normal(jax.random.key(0), (rows, vocab_size))
  index = jnp.zeros(rows, jnp.int32)
  for label, temperature, top_p in (
    ("greedy", 0.0, 1.0),
    ("temperature 0.8, top-p 0.95", 0.8, 0.95),
  ):
    params = RowParams(
      temperature=jnp.full(rows, temperature),
      top_k=jnp.zeros(rows, jnp.int32),
      top_p=jnp.full(rows, top_p),
      key_data=jax.random.key_data(jax.random.split(jax.random.key(1), rows)),
      stop_ids=jnp.full((rows, 1), -1, jnp.int32),
      processed=jnp.zeros(rows, bool),
    )
    plain = jax.jit(lambda logits, params: sample_rows(logits, params, index, 0).tokens)

    @jax.jit
    def masked(table, states, logits, params):
      draw = sample_rows(logits, params, index, 0, st.allowed_mask(table, states))
      return st.advance(table, states, draw.tokens)

    plain_s = _seconds(lambda: plain(logits, params), 10)
    masked_s = _seconds(lambda: masked(packed.table, states, logits, params), 10)
    print(
      f"one step of {rows} rows ({label}): sample_rows {plain_s * 1e3:.2f} ms, "
      f"masked + advance {masked_s * 1e3:.2f} ms ({jax.default_backend()})"
    )


CITY = {
  "type": "object",
  "properties": {
    "city": {"type": "string", "maxLength": 20},
    "country": {"type": "string", "maxLength": 20},
    "population_millions": {"type": "integer", "maxDigits": 2},
  },
  "required": ["city", "country", "population_millions"],
}
CITIES = ("Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Delhi", "Quito")


def bench_engine(max_tokens: int, num_decode_steps: int) -> None:
  """Tokens/s of 8 JSON-schema requests against the same 8 unconstrained, on SmolLM2."""
  from paged_jax.models import load_pretrained

  model, tokenizer = load_pretrained("smollm2-135m-instruct", dtype="float32", max_seq_len=256)
  cfg = pj.CacheConfig(block_size=16, num_gpu_blocks=256, max_seqs=8, max_blocks_per_seq=16)
  llm = pj.LLM(model, tokenizer, cfg, num_decode_steps=num_decode_steps)
  prompts = [f"Describe the city of {city} as JSON: " for city in CITIES]
  schema = pj.StructuredOutputsParams(json=CITY)
  batches = {
    "unconstrained": pj.SamplingParams(max_tokens=max_tokens),
    "json schema": pj.SamplingParams(max_tokens=max_tokens, structured_outputs=schema),
  }
  print(
    f"{'batch of 8':>14} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'steps/launch':>13} "
    f"{'s/step':>7}"
  )
  rates = {}
  for label, params in batches.items():
    llm.generate(prompts, params)  # compiles
    before = llm.engine.stats
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = llm.engine.stats
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
    steps = after.decode_steps - before.decode_steps
    launches = after.loop_launches - before.loop_launches
    rates[label] = tokens / seconds
    print(
      f"{label:>14} {tokens:7d} {seconds:8.2f} {rates[label]:9.1f} "
      f"{steps / max(launches, 1):13.2f} {seconds / max(steps, 1):7.3f}"
    )
    if params.structured_outputs is not None:
      print(f"{'':>14} first output: {outputs[0].outputs[0].text!r}")
  ratio = rates["json schema"] / rates["unconstrained"]
  print(f"json schema / unconstrained: {ratio:.2f}x ({jax.default_backend()})")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smollm2", action="store_true", help="also SmolLM2's vocabulary")
  parser.add_argument("--rows", type=int, default=64)
  parser.add_argument("--engine", action="store_true", help="the engine on SmolLM2 only")
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--num-decode-steps", type=int, default=8)
  args = parser.parse_args()
  if args.engine:
    bench_engine(args.max_tokens, args.num_decode_steps)
    return
  bench_tokenizer("ByteTokenizer", ByteTokenizer(), ByteTokenizer.vocab_size, args.rows)
  if args.smollm2:
    from paged_jax.models import load_pretrained

    model, tokenizer = load_pretrained("smollm2-135m-instruct")
    bench_tokenizer("SmolLM2", tokenizer, model.config.vocab_size, args.rows)


if __name__ == "__main__":
  main()
