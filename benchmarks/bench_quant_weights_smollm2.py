"""SmolLM2-135M-Instruct with float and quantized weights, side by side in one run.

Each format runs in its own process (so that its memory is its own), named
`quantization:dtype` (`quantization` one of none, gguf, int8, int4; `dtype`
the compute and float-parameter dtype):

* `none:*`: every weight dequantized from the shipped Q4_1 GGUF to float;
* `gguf:*`: the GGUF's own tensors kept (Q4_1 kernels as int4 groups of 32
  with minimums; the Q8_0 embedding stays float, as every embedding does);
* `int8:*`, `int4:*`: the float32 weights of `none:float32`, written as a
  Hugging Face folder first, quantized at load (per-channel int8; int4 in
  groups of `--group-size`).

Per format: the bytes of the model's arrays, the process's resident memory
after the load (`VmRSS`) and its peak (`VmHWM`); load seconds; accuracy
against `none:float32` over the prompts (the 32 chat questions of
bench_vs_peers.py): each prompt plus float32's greedy continuation of
`--accuracy-tokens` tokens is scored teacher-forced, and at each continuation
position we compare the next-token argmax (greedy agreement) and take
KL(float32 || format) in nats; then `pj.LLM` (32 slots, no prefix caching,
so that every run computes the same shapes; compiled by a first run)
serves one greedy stream of `--tokens` tokens and the offline batch of the
prompts x `--tokens` (warm medians of `--repeats`, `ignore_eos`).

With `--interleaved`, one more process loads every format and serves one
stream on a 1-slot engine per format, the formats' runs taking turns.

Usage: python benchmarks/bench_quant_weights_smollm2.py
       [--formats none:float32 none:bfloat16 gguf:bfloat16 int8:bfloat16 int4:bfloat16]
       [--workloads accuracy single offline] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

MODEL = "smollm2-135m-instruct"
REFERENCE = "none:float32"
MAX_SEQ_LEN = 256


def status_kb(field: str) -> int:
  """A `/proc/self/status` memory field (VmRSS, VmHWM) in kB."""
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1])
  raise KeyError(field)


def load(form: str, hf_dir: pathlib.Path, group_size: int):
  from paged_jax.models import load_pretrained

  quantization, dtype = form.split(":")
  if quantization in ("int8", "int4"):
    size = group_size if quantization == "int4" else None
    return load_pretrained(
      hf_dir, dtype=dtype, max_seq_len=MAX_SEQ_LEN, quantization=quantization, group_size=size
    )
  return load_pretrained(
    MODEL,
    dtype=dtype,
    max_seq_len=MAX_SEQ_LEN,
    quantization=None if quantization == "none" else quantization,
  )


def prompts(tokenizer) -> list[list[int]]:
  from bench_vs_peers import QUESTIONS, chat_prompt

  return [chat_prompt(tokenizer, q) for q in QUESTIONS[:32]]


def continuation_log_probs(model, sequences, prompt_lens, tokens: int, rows: int = 8):
  """float32 `[len(sequences), tokens, vocab]`: log-probabilities of the
  next token at each of the last `tokens` positions of every sequence."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  graphdef, state = nnx.split(model)

  @jax.jit
  def score(state, ids, positions, picks):
    model = nnx.merge(graphdef, state)
    hidden, _ = model.hidden_states(ids, positions)
    hidden = jnp.take_along_axis(hidden, picks[..., None], axis=1)
    return jax.nn.log_softmax(model.logits(hidden), axis=-1)

  width = max(len(s) for s in sequences)
  out = []
  for start in range(0, len(sequences), rows):
    chunk = sequences[start : start + rows]
    ids = np.zeros((rows, width), np.int32)
    positions = np.full((rows, width), -1, np.int32)
    picks = np.zeros((rows, tokens), np.int32)
    for i, (seq, plen) in enumerate(zip(chunk, prompt_lens[start : start + rows], strict=True)):
      ids[i, : len(seq)] = seq
      positions[i, : len(seq)] = np.arange(len(seq))
      picks[i] = plen - 1 + np.arange(tokens)  # the position predicting each new token
    out.append(np.asarray(score(state, ids, positions, picks))[: len(chunk)])
  return np.concatenate(out)


def measure(run, repeats: int) -> float:
  run()  # compiles
  rates = []
  for _ in range(repeats):
    start = time.perf_counter()
    tokens = run()
    rates.append(tokens / (time.perf_counter() - start))
  return statistics.median(rates)


def child(args) -> dict:
  """Measures one format (`args.form`); returns its row."""
  import jax
  from flax import nnx

  import paged_jax as pj

  workdir = pathlib.Path(args.workdir)
  start = time.perf_counter()
  model, tokenizer = load(args.form, workdir / "hf", args.group_size)
  load_s = time.perf_counter() - start
  gc.collect()
  row = dict(
    form=args.form,
    weight_mb=sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))) / 1e6,
    rss_mb=status_kb("VmRSS") / 1e3,
    peak_rss_mb=status_kb("VmHWM") / 1e3,
    load_s=load_s,
  )
  if args.form == REFERENCE and not (workdir / "hf").exists():
    from bench_vs_peers import save_hf_folder

    save_hf_folder(model, tokenizer, workdir / "hf")
  ids = prompts(tokenizer)
  if "accuracy" in args.workloads:
    row.update(accuracy(model, tokenizer, ids, workdir, args))
  options = dict(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
  cfg = pj.CacheConfig(
    block_size=16,
    num_gpu_blocks=32 * (MAX_SEQ_LEN // 16),
    num_cpu_blocks=0,
    max_seqs=32,
    max_blocks_per_seq=MAX_SEQ_LEN // 16,
    enable_prefix_caching=False,  # repeated runs compute what the first did
  )
  llm = pj.LLM(model, tokenizer, cfg, warmup=False)
  params = pj.SamplingParams(**options)
  count = lambda outs: sum(len(c.token_ids) for o in outs for c in o.outputs)
  if "single" in args.workloads:
    row["single_tok_s"] = measure(lambda: count(llm.generate(ids[:1], params)), args.repeats)
  if "offline" in args.workloads:
    row["offline_tok_s"] = measure(lambda: count(llm.generate(ids, params)), args.repeats)
  row["peak_rss_after_serving_mb"] = status_kb("VmHWM") / 1e3
  return row


def interleaved(args) -> dict:
  """Single-stream tokens/s of every format in one process, their runs
  interleaved (round r runs each format once), so that a load the machine
  takes on mid-run weighs on every format alike; medians over the rounds."""
  import paged_jax as pj

  workdir = pathlib.Path(args.workdir)
  llms, ids = {}, None
  for form in [REFERENCE] + [f for f in args.formats if f != REFERENCE]:
    model, tokenizer = load(form, workdir / "hf", args.group_size)
    ids = ids or prompts(tokenizer)
    cfg = pj.CacheConfig(
      block_size=16,
      num_gpu_blocks=MAX_SEQ_LEN // 16,
      num_cpu_blocks=0,
      max_seqs=1,
      max_blocks_per_seq=MAX_SEQ_LEN // 16,
    )
    llms[form] = pj.LLM(model, tokenizer, cfg, warmup=False)
  params = pj.SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
  rates = {form: [] for form in llms}
  for round_ in range(args.repeats + 1):  # the first round compiles
    for form, llm in llms.items():
      start = time.perf_counter()
      outs = llm.generate(ids[:1], params)
      if round_:
        rates[form].append(len(outs[0].outputs[0].token_ids) / (time.perf_counter() - start))
  return {form: statistics.median(r) for form, r in rates.items()}


def accuracy(model, tokenizer, ids, workdir: pathlib.Path, args) -> dict:
  """Greedy agreement and KL against the reference (which writes them)."""
  import numpy as np

  reference = workdir / "reference.npz"
  if args.form == REFERENCE:
    import paged_jax as pj

    cfg = pj.CacheConfig(
      block_size=16, num_gpu_blocks=32 * 16, num_cpu_blocks=0, max_seqs=32, max_blocks_per_seq=16
    )
    llm = pj.LLM(model, tokenizer, cfg, warmup=False)
    params = pj.SamplingParams(max_tokens=args.accuracy_tokens, ignore_eos=True, temperature=0.0)
    outs = llm.generate(ids, params)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(ids, outs, strict=True)]
    np.savez(reference, *[np.asarray(s, np.int32) for s in sequences])
    del llm
  stored = np.load(reference)
  sequences = [stored[f"arr_{i}"] for i in range(len(stored.files))]
  lens = [len(p) for p in ids]
  log_probs = continuation_log_probs(model, sequences, lens, args.accuracy_tokens)
  path = workdir / "reference_log_probs.npy"
  if args.form == REFERENCE:
    np.save(path, log_probs)
    return dict(agreement=1.0, kl=0.0)
  want = np.load(path, mmap_mode="r")
  agree, kl = [], []
  for got_row, want_row in zip(log_probs, want, strict=True):
    want_row = np.asarray(want_row, np.float64)
    agree.append(np.argmax(got_row, -1) == np.argmax(want_row, -1))
    kl.append(np.sum(np.exp(want_row) * (want_row - got_row), axis=-1))
  return dict(agreement=float(np.mean(agree)), kl=float(np.mean(kl)))


def table(rows: list[dict]) -> str:
  base = next((r for r in rows if r["form"] == "none:bfloat16"), None)
  lines = [
    "| weights:dtype | weight MB | RSS after load MB | peak RSS MB | greedy agreement "
    "| KL nats | single tok/s | offline tok/s | single tok/s, interleaved |",
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ]
  fmt = lambda r, k, spec: "-" if k not in r else format(r[k], spec)
  for r in rows:
    single = fmt(r, "single_tok_s", ".1f")
    if base and "single_tok_s" in r and "single_tok_s" in base:
      single += f" ({r['single_tok_s'] / base['single_tok_s']:.2f}x bf16)"
    lines.append(
      f"| {r['form']} | {r['weight_mb']:.0f} | {r['rss_mb']:.0f} | {r['peak_rss_mb']:.0f} "
      f"| {fmt(r, 'agreement', '.1%')} | {fmt(r, 'kl', '.4f')} | {single} "
      f"| {fmt(r, 'offline_tok_s', '.1f')} | {fmt(r, 'interleaved_tok_s', '.1f')} |"
    )
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--formats",
    nargs="+",
    default=["none:float32", "none:bfloat16", "gguf:bfloat16", "int8:bfloat16", "int4:bfloat16"],
  )
  parser.add_argument(
    "--workloads", nargs="*", default=["accuracy", "single", "offline"],
    choices=("accuracy", "single", "offline"),
  )  # fmt: skip
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--accuracy-tokens", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--group-size", type=int, default=32)
  parser.add_argument(
    "--interleaved",
    action="store_true",
    help="also one process serving a single stream (1-slot engines) of every format in turn",
  )
  parser.add_argument("--form", help=argparse.SUPPRESS)
  parser.add_argument("--workdir", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.form:
    print(json.dumps(interleaved(args) if args.form == "interleaved" else child(args)))
    return
  forms = [REFERENCE] + [f for f in args.formats if f != REFERENCE]
  rows = []
  with tempfile.TemporaryDirectory(prefix="quant_smollm2_") as workdir:
    for form in forms:
      command = [sys.executable, __file__, "--form", form, "--workdir", workdir]
      command += ["--workloads", *args.workloads, "--tokens", str(args.tokens)]
      command += ["--accuracy-tokens", str(args.accuracy_tokens), "--repeats", str(args.repeats)]
      command += ["--group-size", str(args.group_size)]
      start = time.perf_counter()
      result = subprocess.run(command, capture_output=True, text=True)
      if result.returncode:
        sys.exit(f"{form} failed:\n{result.stderr[-4000:]}")
      rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
      print(f"{form}: {rows[-1]} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if args.interleaved:
      command = [sys.executable, __file__, "--form", "interleaved", "--workdir", workdir]
      command += ["--formats", *forms, "--tokens", str(args.tokens)]
      command += ["--repeats", str(args.repeats), "--group-size", str(args.group_size)]
      result = subprocess.run(command, capture_output=True, text=True)
      if result.returncode:
        sys.exit(f"interleaved run failed:\n{result.stderr[-4000:]}")
      rates = json.loads(result.stdout.strip().splitlines()[-1])
      for row in rows:
        row["interleaved_tok_s"] = rates[row["form"]]
  print(table(rows))


if __name__ == "__main__":
  main()
