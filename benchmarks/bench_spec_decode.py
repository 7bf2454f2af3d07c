"""Speculative decoding on SmolLM2-135M-Instruct: tokens/s with and without.

Two workloads, prompts rendered by the chat template, greedy, up to
`--max-tokens` each (EOS ends a sequence):

* `repetitive`: rewrite a paragraph with its typos fixed, or edit code; the
  answer repeats the prompt, where prompt lookup helps;
* `open`: open-ended chat questions.

Each runs at batch 1 (the first prompt) and batch 8, on one engine per
method, all measured side by side in one run, their runs interleaved: no speculation, prompt lookup
(`ngram`: the engine speculates in the launches where that measures faster,
`ngram-always`: in every launch), the target as its own draft (acceptance
1: checks the machinery) and a random 2-layer draft with SmolLM2's
vocabulary (acceptance near 0: checks exactness); the drafts speculate in
every launch. Prints a Markdown table of the median tokens/s, the
speedup over no speculation, the acceptance rate and mean accepted length,
and whether every sequence's tokens equal those without speculation.

Usage: python benchmarks/bench_spec_decode.py [--dtype float32] [--k 4]
       [--max-tokens 128] [--repeats 2] [--methods none ngram ngram-always self random]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from flax import nnx

import paged_jax as pj
from paged_jax import models

PARAGRAPH = (
  "The quick brown fox jumpd over the lazy dog. It was a sunny day in the vilage, and the "
  "children were playing in the park near the old church. Their parents sat on benches, "
  "talking about the wether and the price of bread at the market."
)
CODE = """def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)"""
REPETITIVE = [
  f"Rewrite this paragraph with its spelling mistakes fixed:\n\n{PARAGRAPH}",
  f"Add type hints and a docstring to this Python function:\n\n{CODE}",
  f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}",
  f"Rename the variable `total` to `running_sum` in this code:\n\n{CODE}",
  f"Correct the grammar of this text and return it in full:\n\n{PARAGRAPH}",
  f"Rewrite this function so that it returns 0.0 for an empty list:\n\n{CODE}",
  f"Copy this text, replacing every 'the' by 'a':\n\n{PARAGRAPH}",
  f"Convert this function to use the built-in sum():\n\n{CODE}",
]
OPEN = [
  "Tell me about the history of Rome.",
  "What are some good habits for staying healthy?",
  "Explain how a rainbow forms.",
  "Write a short poem about the sea.",
  "What should I pack for a week of hiking?",
  "Why do cats purr?",
  "Give me three ideas for a birthday party.",
  "How does a bicycle stay upright?",
]
BLOCK_SIZE = 16


def chat(tokenizer, question: str) -> list[int]:
  text = tokenizer.apply_chat_template(
    [dict(role="user", content=question)], add_generation_prompt=True
  )
  return list(tokenizer.encode(text))


def speculative_config(method: str, model, k: int):
  if method == "none":
    return None
  if method in ("ngram", "ngram-always"):
    adaptive = method == "ngram"
    return {"method": "ngram", "num_speculative_tokens": k, "adaptive": adaptive}
  draft = model
  if method == "random":
    draft = models.Llama(dataclasses.replace(model.config, num_layers=2), rngs=nnx.Rngs(0))
  return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "adaptive": False}


SPEC_COUNTERS = (
  "spec_decode_num_drafts",
  "spec_decode_num_draft_tokens",
  "spec_decode_num_accepted_tokens",
)


def timed_run(llm: pj.LLM, prompts, params):
  """`(tokens/s, token ids, stats of the run)` of one `generate`."""
  before = llm.engine.stats
  start = time.perf_counter()
  outs = llm.generate(prompts, params)
  seconds = time.perf_counter() - start
  after = llm.engine.stats
  stats = pj.GenerationStats(**{n: getattr(after, n) - getattr(before, n) for n in SPEC_COUNTERS})
  tokens = [o.outputs[0].token_ids for o in outs]
  return sum(map(len, tokens)) / seconds, tokens, stats


def measure(engines: dict, prompts, params, repeats: int) -> dict:
  """Per method: a warm-up run, then `repeats` runs interleaved with the
  other methods' (so that the machine's drift hits all alike): the median
  tokens/s, the warm-up's token ids and the measured runs' counters."""
  first = {m: timed_run(llm, prompts, params)[1] for m, llm in engines.items()}
  rates = {m: [] for m in engines}
  stats = {m: pj.GenerationStats() for m in engines}
  for _ in range(repeats):
    for method, llm in engines.items():
      rate, _, run = timed_run(llm, prompts, params)
      rates[method].append(rate)
      stats[method] = pj.GenerationStats(
        **{n: getattr(stats[method], n) + getattr(run, n) for n in SPEC_COUNTERS}
      )
  return {m: (statistics.median(rates[m]), first[m], stats[m]) for m in engines}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
  parser.add_argument("--max-tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument(
    "--methods", nargs="+", default=["none", "ngram", "ngram-always", "self", "random"]
  )
  parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
  args = parser.parse_args()
  model, tokenizer = models.load_pretrained(
    "smollm2-135m-instruct", dtype=args.dtype, max_seq_len=1024
  )
  workloads = {
    "repetitive": [chat(tokenizer, q) for q in REPETITIVE],
    "open": [chat(tokenizer, q) for q in OPEN],
  }
  params = pj.SamplingParams(max_tokens=args.max_tokens)
  max_seqs = max(args.batches)
  blocks = 1024 // BLOCK_SIZE
  cfg = pj.CacheConfig(
    block_size=BLOCK_SIZE,
    num_gpu_blocks=max_seqs * blocks,
    num_cpu_blocks=0,
    max_seqs=max_seqs,
    max_blocks_per_seq=blocks,
  )
  methods = ("none", *[m for m in args.methods if m != "none"])
  engines = {
    method: pj.LLM(
      model,
      tokenizer,
      cfg,
      speculative_config=speculative_config(method, model, args.k),
      warmup=True,
    )
    for method in methods
  }
  results = {}
  for workload, prompts in workloads.items():
    for batch in args.batches:
      measured = measure(engines, prompts[:batch], params, args.repeats)
      reference = measured["none"][1]
      for method, (rate, tokens, stats) in measured.items():
        results[method, workload, batch] = (rate, stats, tokens == reference)
        print(f"{method} {workload} batch {batch}: {rate:.1f} tokens/s", flush=True)
  print(
    f"\n{args.dtype}, k={args.k}, up to {args.max_tokens} tokens, greedy\n\n"
    "| method | workload | batch | tokens/s | speedup | acceptance | mean accepted length "
    "| tokens equal |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"
  )
  for (method, workload, batch), (rate, stats, equal) in sorted(
    results.items(), key=lambda item: methods.index(item[0][0])
  ):
    base = results["none", workload, batch][0]
    spec = method != "none"
    print(
      f"| {method} | {workload} | {batch} | {rate:.1f} | {rate / base:.2f}x | "
      f"{f'{stats.spec_decode_acceptance_rate:.2f}' if spec else '-'} | "
      f"{f'{stats.spec_decode_mean_accepted_length:.2f}' if spec else '-'} | "
      f"{'yes' if equal else 'NO'} |"
    )


if __name__ == "__main__":
  main()
