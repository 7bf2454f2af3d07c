"""Replays a simulated serving trace through the block manager (continuous batching).

No model runs: each decode step appends one token to every running sequence
with one jitted `append_slots` call, so the trace measures what paging does to
memory: how many allocated KV slots hold tokens, against a baseline that
reserves max-length contiguous space for every request.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.config import AllocStatus, CacheConfig, Status


@dataclasses.dataclass(frozen=True)
class TraceConfig:
  """A seeded ShareGPT-like workload (lognormal lengths)."""

  num_requests: int = 1000
  mean_prompt: float = 160.0
  mean_output: float = 340.0
  sigma: float = 0.8
  max_len: int = 2048
  seed: int = 0


def sample_lengths(trace: TraceConfig) -> tuple[np.ndarray, np.ndarray]:
  """(prompt lengths, output lengths), each clipped so prompt + output <= max_len."""
  rng = np.random.default_rng(trace.seed)

  def lognormal(mean):
    mu = np.log(mean) - trace.sigma**2 / 2  # so that the mean is `mean`
    return np.maximum(1, rng.lognormal(mu, trace.sigma, trace.num_requests).astype(int))

  prompts = np.minimum(lognormal(trace.mean_prompt), trace.max_len // 2)
  outputs = np.minimum(lognormal(trace.mean_output), trace.max_len - prompts)
  return prompts, outputs


def replay(cfg: CacheConfig, trace: TraceConfig, progress=None) -> dict:
  """Serves the trace; returns utilization and scheduling statistics."""
  prompts, outputs = sample_lengths(trace)
  bm = BlockSpaceManager(cfg)
  allocate = jax.jit(bm.allocate)
  append = jax.jit(bm.append_slots)
  free = jax.jit(bm.free)
  can_allocate = jax.jit(bm.can_allocate)
  state = bm.init()
  slots = cfg.max_seqs
  token_buf = jnp.zeros(cfg.max_tokens_per_seq, jnp.int32)
  ids = np.arange(slots, dtype=np.int32)
  request_of = np.full(slots, -1)  # request running in each slot
  remaining = np.zeros(slots, int)
  waiting = list(range(trace.num_requests))
  steps = preemptions = finished = 0
  held_tokens = used_slots = reserved_slots = 0.0
  while waiting or (request_of >= 0).any():
    while waiting and (request_of < 0).any():
      req = waiting[0]
      if AllocStatus(int(can_allocate(state, prompts[req]))) != AllocStatus.OK:
        break
      slot = int(np.argmax(request_of < 0))
      state, res = allocate(state, jnp.array([slot]), token_buf, prompts[req])
      if Status(int(res.status)) != Status.OK:
        break
      waiting.pop(0)
      request_of[slot], remaining[slot] = req, outputs[req]
    running = request_of >= 0
    if not running.any():
      raise RuntimeError(f"request {waiting[0]} can never be scheduled with {cfg}")
    batch = jnp.asarray(np.where(running, ids, -1))
    state, plan = append(state, batch, jnp.zeros((slots, 1), jnp.int32), jnp.ones(slots, jnp.int32))
    if Status(int(plan.status)) == Status.OUT_OF_BLOCKS:
      victim = int(np.nonzero(running)[0][-1])  # preempt by recomputation
      state, _ = free(state, jnp.array([victim]))
      waiting.insert(0, int(request_of[victim]))
      request_of[victim] = -1
      preemptions += 1
      continue
    steps += 1
    remaining[running] -= 1
    tokens = np.asarray(bm.get_num_tokens(state, jnp.asarray(ids)))
    held_tokens += tokens[running].sum()
    used_slots += (cfg.num_gpu_blocks - int(bm.num_free_gpu_blocks(state))) * cfg.block_size
    reserved_slots += running.sum() * trace.max_len
    done = running & (remaining <= 0)
    if done.any():
      state, _ = free(state, jnp.asarray(np.where(done, ids, -1)))
      finished += int(done.sum())
      request_of[done] = -1
      if progress is not None:
        progress(int(done.sum()))
  return dict(
    requests=trace.num_requests,
    finished=finished,
    decode_steps=steps,
    preemptions=preemptions,
    paged_utilization=held_tokens / used_slots,
    contiguous_utilization=held_tokens / reserved_slots,
    mean_prompt=float(prompts.mean()),
    mean_output=float(outputs.mean()),
  )
