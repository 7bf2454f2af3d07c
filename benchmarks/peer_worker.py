"""Runs bench_vs_peers.py's workloads on a peer engine and prints the results as JSON.

It runs in the peer's own virtualenv (no JAX, no paged_jax there): only the
standard library and the peer's packages are imported. `bench_vs_peers.py`
starts it once per engine and dtype:

    PEER_PYTHON benchmarks/peer_worker.py SPEC.json

SPEC.json holds `engine` ("transformers" or "vllm"), `model_dir` (a Hugging
Face folder), `dtype` ("float32" or "bfloat16"), `repeats`, `max_model_len`,
`seed` and `workloads`: name -> `prompts` (token ids), `max_tokens` (one
int, or one per prompt), `n`, `temperature` and `arrivals` (seconds from the
start, for an online trace; null for offline). Every sequence ignores EOS and
generates its `max_tokens`.

The one line on stdout is a JSON object: `engine`, `version`, `dtype`,
`tokens_per_s` (workload -> warm median tokens/s, or null where the peer has
no such mode), `token_ids` (workload -> each sequence's token ids from the
warm-up run). Everything the libraries print goes to stderr.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def measure(run, repeats: int) -> tuple[float, list[list[int]]]:
  """Runs `run` (which returns every sequence's token ids) once to warm up,
  then `repeats` times; returns the median tokens/s and the warm-up's ids."""
  first = run()
  rates = []
  for _ in range(repeats):
    start = time.perf_counter()
    seqs = run()
    rates.append(sum(map(len, seqs)) / (time.perf_counter() - start))
  return statistics.median(rates), first


class TransformersPeer:
  """transformers' `generate`: one batch per workload, prompts left-padded."""

  name = "transformers"
  online = False

  def __init__(self, spec: dict):
    import torch
    import transformers

    self.torch = torch
    self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"
    torch.manual_seed(spec["seed"])
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
      spec["model_dir"], dtype=getattr(torch, spec["dtype"])
    ).eval()
    # No EOS: every row runs to max_new_tokens, as ignore_eos does.
    self.model.generation_config.eos_token_id = None
    self.pad_id = 0

  def generate(self, prompts, max_tokens: int, n: int, temperature: float) -> list[list[int]]:
    torch = self.torch
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
      ids[row, width - len(prompt) :] = torch.tensor(prompt)
      mask[row, width - len(prompt) :] = 1
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    with torch.inference_mode():
      out = self.model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_tokens,
        num_return_sequences=n,
        pad_token_id=self.pad_id,
        **(sampling if temperature > 0 else dict(do_sample=False)),
      )
    new = out[:, width:]
    if new.shape[1] != max_tokens:
      raise RuntimeError(f"generate stopped after {new.shape[1]} of {max_tokens} tokens")
    return new.tolist()


class VllmPeer:
  """vLLM's `LLM.generate` offline, its `LLMEngine` step by step online."""

  name = "vllm"
  online = True

  def __init__(self, spec: dict):
    import vllm

    self.vllm = vllm
    self.version = f"vllm {vllm.__version__}"
    self.llm = vllm.LLM(
      model=spec["model_dir"],
      dtype=spec["dtype"],
      seed=spec["seed"],
      max_model_len=spec["max_model_len"],
      # On CPU, vLLM reserves a share of the node's memory unless told the KV
      # cache's size; 2 GiB holds some 45k float32 tokens of SmolLM2.
      kv_cache_memory_bytes=2 * 2**30,
    )

  def params(self, max_tokens: int, n: int = 1, temperature: float = 0.0):
    return self.vllm.SamplingParams(
      n=n, temperature=temperature, max_tokens=max_tokens, ignore_eos=True
    )

  def generate(self, prompts, max_tokens: int, n: int, temperature: float) -> list[list[int]]:
    outs = self.llm.generate(
      [dict(prompt_token_ids=p) for p in prompts],
      self.params(max_tokens, n, temperature),
      use_tqdm=False,
    )
    return [list(c.token_ids) for o in outs for c in o.outputs]

  def serve_trace(self, prompts, max_tokens, arrivals) -> list[list[int]]:
    """Adds each request at its arrival time and steps the engine as fast as
    it goes (as bench_engine.serve_trace does for paged_jax)."""
    engine = self.llm.llm_engine
    final = {}
    start = time.perf_counter()
    next_request = 0
    while next_request < len(prompts) or engine.has_unfinished_requests():
      now = time.perf_counter() - start
      while next_request < len(prompts) and arrivals[next_request] <= now:
        engine.add_request(
          f"trace-{start}-{next_request}",
          dict(prompt_token_ids=prompts[next_request]),
          self.params(int(max_tokens[next_request])),
        )
        next_request += 1
      if not engine.has_unfinished_requests():
        time.sleep(max(0.0, arrivals[next_request] - now))
        continue
      for out in engine.step():
        if out.finished:
          final[out.request_id] = list(out.outputs[0].token_ids)
    return list(final.values())


PEERS = {"transformers": TransformersPeer, "vllm": VllmPeer}


def run_workloads(peer, spec: dict) -> dict:
  """Every workload of `spec` on `peer`: tokens/s and token ids by name."""
  rates, token_ids = {}, {}
  for name, w in spec["workloads"].items():
    if w["arrivals"] is not None:
      if not peer.online:
        rates[name] = None
        continue
      run = lambda: peer.serve_trace(w["prompts"], w["max_tokens"], w["arrivals"])
    else:
      run = lambda: peer.generate(w["prompts"], w["max_tokens"], w["n"], w["temperature"])
    print(f"[{peer.name} {spec['dtype']}] {name}", file=sys.stderr, flush=True)
    rates[name], token_ids[name] = measure(run, spec["repeats"])
  return dict(tokens_per_s=rates, token_ids=token_ids)


def main():
  result_stream = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)  # the libraries' own prints go to stderr
  with open(sys.argv[1]) as file:
    spec = json.load(file)
  peer = PEERS[spec["engine"]](spec)
  result = dict(engine=spec["engine"], version=peer.version, dtype=spec["dtype"])
  result.update(run_workloads(peer, spec))
  result_stream.write(json.dumps(result) + "\n")
  result_stream.flush()


if __name__ == "__main__":
  main()
