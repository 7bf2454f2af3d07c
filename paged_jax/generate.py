"""Generation on the paged KV cache, with the whole decode loop compiled.

`generate` serves a list of requests. The host admits requests into sequence
slots, runs their prefill (only the suffix a prefix-cache hit does not cover)
and forks a prompt's blocks to its `n` samples. Then one jitted
`lax.while_loop` decodes: every step calls `append_slots` for all running
rows, executes the copy-on-write plan, writes K/V and attends through
`PagedCache`, samples, and frees the sequences that reached EOS or their
token limit. The loop hands control back to the host only when it runs out of
blocks (the host swaps a sequence out and resumes), when every row is done,
or, while requests wait, when a row finishes (the host admits more).

`generate_dense` runs the same model and sampling on a `DenseCache`, for
comparison.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence

from flax import nnx
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.block_manager import manager
from paged_jax.block_manager.manager import BlockSpaceManager
from paged_jax.block_manager.state import BlockManagerState
from paged_jax.config import AllocStatus, CacheConfig, Status
from paged_jax.kv_cache import KVCache
from paged_jax import kv_cache as kv_ops
from paged_jax import sharding
from paged_jax.models.llama import Llama, init_dense_cache


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn; frozen and hashable (static under jit).

  Attributes:
    max_new_tokens: tokens generated per sequence at most.
    temperature: softmax temperature; 0 means greedy (argmax).
    top_k: keep the `top_k` most likely tokens; 0 keeps all.
    top_p: keep the smallest set of tokens whose probability reaches `top_p`.
    eos_id: token that ends a sequence, or None.
  """

  max_new_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int | None = None

  def __post_init__(self):
    if (isinstance(self.max_new_tokens, bool)
        or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1):
      raise ValueError(
          f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
    if not self.temperature >= 0.0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (
        self.top_k < 0):
      raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt and how many samples to draw from it.

  Attributes:
    prompt: int32 token ids (at least one).
    n: number of samples; they share the prompt's blocks.
  """

  prompt: np.ndarray
  n: int = 1

  def __post_init__(self):
    prompt = np.asarray(self.prompt)
    if prompt.ndim != 1 or prompt.size < 1 or not np.issubdtype(
        prompt.dtype, np.integer):
      raise ValueError(
          f"prompt must be a non-empty 1-D int array, got {prompt.dtype}"
          f"{list(prompt.shape)}")
    if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
      raise ValueError(f"n must be an int >= 1, got {self.n!r}")
    object.__setattr__(self, "prompt", prompt.astype(np.int32))


@dataclasses.dataclass
class GenerationStats:
  """What a `generate` call did.

  Attributes:
    generated_tokens: tokens sampled over all sequences.
    prompt_tokens: prompt tokens over all requests.
    prefill_tokens: prompt tokens that ran through the model (prefix-cache
      hits skip the rest).
    decode_steps: iterations of the decode loop.
    loop_launches: times the host entered the compiled loop.
    peak_blocks: most GPU blocks in use at once.
    kv_slot_utilization: over decode steps, tokens held by the running
      sequences per allocated KV slot (above 1 when blocks are shared).
    prefix_cache_hit_rate: the manager's hit rate; -1 with caching off.
    cow_copies: blocks copied on write.
    preemptions: sequences swapped out for lack of blocks.
    swaps: blocks moved between device and host (out and in).
  """

  generated_tokens: int = 0
  prompt_tokens: int = 0
  prefill_tokens: int = 0
  decode_steps: int = 0
  loop_launches: int = 0
  peak_blocks: int = 0
  kv_slot_utilization: float = 0.0
  prefix_cache_hit_rate: float = -1.0
  cow_copies: int = 0
  preemptions: int = 0
  swaps: int = 0


def sample_tokens(logits: jax.Array, key: jax.Array,
                  params: SamplingParams) -> jax.Array:
  """Draws one token per row.

  Args:
    logits: float `[batch, vocab]`.
    key: a PRNG key; each row uses its own split of it.
    params: temperature, top-k and top-p.

  Returns:
    int32 `[batch]` token ids.
  """
  if params.temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / params.temperature
  if params.top_k:
    kth = jax.lax.top_k(logits, min(params.top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if params.top_p < 1.0:
    ordered = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(before < params.top_p, ordered, jnp.inf),
                     axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  keys = jax.random.split(key, logits.shape[0])
  return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


@flax.struct.dataclass
class _Loop:
  """Carry of the decode loop; rows are sequence slots."""

  state: BlockManagerState
  kv: KVCache
  seq_ids: jax.Array        # int32[S], -1 where not running
  last_token: jax.Array     # int32[S], sampled, not yet in the cache
  num_generated: jax.Array  # int32[S]
  limit: jax.Array          # int32[S], tokens to generate at most
  outputs: jax.Array        # int32[S, max_new_tokens]
  step: jax.Array
  out_of_blocks: jax.Array
  finished_any: jax.Array
  cow_copies: jax.Array
  peak_blocks: jax.Array
  utilization_sum: jax.Array


def _decode_step(graphdef, params_state, sampling: SamplingParams, key,
                 loop: _Loop) -> _Loop:
  """One decode step of every running row, or an out-of-blocks flag."""
  cfg = loop.state.cfg
  bm = BlockSpaceManager(cfg)
  running = loop.seq_ids >= 0
  state, plan = bm.append_slots(loop.state, loop.seq_ids,
                                loop.last_token[:, None],
                                running.astype(jnp.int32))

  def advance(_):
    kv = sharding.copy_blocks(loop.kv, plan)
    num_tokens = bm.get_num_tokens(state, loop.seq_ids)
    cache = sharding.paged_cache(
        kv=kv, block_tables=bm.get_block_tables(state, loop.seq_ids),
        slot_mapping=bm.get_slot_mapping(
            state, loop.seq_ids, running.astype(jnp.int32), width=1))
    positions = jnp.where(running, num_tokens - 1, -1)[:, None]
    model = nnx.merge(graphdef, params_state)
    logits, cache = model(loop.last_token[:, None], positions, cache)
    token = sample_tokens(logits[:, 0], jax.random.fold_in(key, loop.step),
                          sampling)
    rows = jnp.arange(loop.seq_ids.shape[0])
    column = jnp.where(running, loop.num_generated, loop.outputs.shape[1])
    outputs = loop.outputs.at[rows, column].set(token, mode="drop")
    num_generated = loop.num_generated + running
    done = running & (num_generated >= loop.limit)
    if sampling.eos_id is not None:
      done |= running & (token == sampling.eos_id)
    used = cfg.num_gpu_blocks - bm.num_free_gpu_blocks(state)
    held = jnp.sum(num_tokens)
    freed, _ = bm.free(state, jnp.where(done, loop.seq_ids, -1))
    return loop.replace(
        state=freed, kv=cache.kv, seq_ids=jnp.where(done, -1, loop.seq_ids),
        last_token=jnp.where(running, token, loop.last_token),
        num_generated=num_generated, outputs=outputs, step=loop.step + 1,
        finished_any=loop.finished_any | jnp.any(done),
        cow_copies=loop.cow_copies + plan.count,
        peak_blocks=jnp.maximum(loop.peak_blocks, used),
        utilization_sum=loop.utilization_sum
        + held / jnp.maximum(used * cfg.block_size, 1))

  return jax.lax.cond(plan.status == Status.OK, advance,
                      lambda _: loop.replace(out_of_blocks=jnp.array(True)),
                      None)


@functools.partial(jax.jit, static_argnums=(0, 2), donate_argnums=(4,))
def _decode_loop(graphdef, params_state, sampling: SamplingParams, key,
                 loop: _Loop, stop_on_finish) -> _Loop:
  """Decodes until no row runs, blocks run out, or (if asked) a row ends."""

  def keep_going(loop):
    return (jnp.any(loop.seq_ids >= 0) & ~loop.out_of_blocks
            & ~(stop_on_finish & loop.finished_any))

  loop = loop.replace(out_of_blocks=jnp.array(False),
                      finished_any=jnp.array(False))
  return jax.lax.while_loop(
      keep_going,
      functools.partial(_decode_step, graphdef, params_state, sampling, key),
      loop)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _paged_forward(graphdef, params_state, kv, tokens, positions, tables,
                   slots):
  """Prefill forward: logits of every token and the cache with their K/V."""
  cache = sharding.paged_cache(kv=kv, block_tables=tables, slot_mapping=slots)
  logits, cache = nnx.merge(graphdef, params_state)(tokens, positions, cache)
  return logits, cache.kv


@functools.partial(jax.jit, static_argnums=(2,))
def _sample_jit(logits, key, sampling):
  return sample_tokens(logits, key, sampling)


# The manager's operations take the config from the state, so one jitted
# function serves every config (one compile per config and shape).
_allocate = jax.jit(manager.allocate)
_can_allocate = jax.jit(manager.can_allocate)
_fork = jax.jit(manager.fork)
_free = jax.jit(manager.free)
_slot_mapping = jax.jit(manager.get_slot_mapping, static_argnames="width")
_block_tables = jax.jit(manager.get_block_tables)


def _bucket(size: int, minimum: int = 1) -> int:
  """The power of two >= size (one compile per bucket, not per length)."""
  return max(minimum, 1 << max(size - 1, 0).bit_length())


class _Driver:
  """Host side of `generate`: admission, prefill, preemption and results."""

  def __init__(self, model: Llama, cfg: CacheConfig, sampling: SamplingParams,
               key: jax.Array, kv_cache_dtype=None,
               mesh: jax.sharding.Mesh | None = None):
    self.cfg, self.sampling, self.key = cfg, sampling, key
    self.bm = BlockSpaceManager(cfg)
    mc = model.config
    dtype = mc.compute_dtype if kv_cache_dtype is None else kv_cache_dtype
    if mesh is None:
      self.kv = KVCache.create(cfg, mc.num_layers, mc.num_kv_heads,
                               mc.head_dim, dtype=dtype)
    else:
      model = sharding.shard_model(model, mesh)
      self.kv = sharding.create_kv_cache(cfg, mc.num_layers, mc.num_kv_heads,
                                         mc.head_dim, dtype, mesh)
    self.graphdef, self.params = nnx.split(model)
    s = cfg.max_seqs
    self.loop = _Loop(
        state=self.bm.init(), kv=None, seq_ids=jnp.full(s, -1, jnp.int32),
        last_token=jnp.zeros(s, jnp.int32),
        num_generated=jnp.zeros(s, jnp.int32), limit=jnp.zeros(s, jnp.int32),
        outputs=jnp.zeros((s, sampling.max_new_tokens), jnp.int32),
        step=jnp.int32(0), out_of_blocks=jnp.array(False),
        finished_any=jnp.array(False), cow_copies=jnp.int32(0),
        peak_blocks=jnp.int32(0), utilization_sum=jnp.float32(0.0))
    self.owner: dict[int, tuple[int, int]] = {}  # slot -> (request, sample)
    self.admitted_at: dict[int, int] = {}  # slot -> admission counter
    self.swapped: collections.deque[int] = collections.deque()
    self.stats = GenerationStats()

  def free_slots(self) -> list[int]:
    return [s for s in range(self.cfg.max_seqs) if s not in self.owner]

  def admit(self, requests, waiting: collections.deque) -> None:
    """Allocates and prefills waiting requests while slots and blocks last."""
    admitted = []
    state = self.loop.state
    while waiting:
      index = waiting[0]
      request = requests[index]
      slots = self.free_slots()
      length = request.prompt.size
      if len(slots) < request.n or AllocStatus(int(
          _can_allocate(state, length))) != AllocStatus.OK:
        break
      waiting.popleft()
      parent = slots[0]
      tokens = np.zeros(self.cfg.max_tokens_per_seq, np.int32)
      tokens[:length] = request.prompt
      state, result = _allocate(state, jnp.array([parent], jnp.int32),
                                        tokens, length)
      if Status(int(result.status)) != Status.OK:
        raise RuntimeError(f"allocate of request {index} failed: "
                           f"{Status(int(result.status)).name}")
      # A hit is a block of the prompt's prefix that is in the cache or that
      # an earlier row of this prefill batch writes before any row attends.
      hits = int(result.num_hit_blocks)
      cached = min(hits * self.cfg.block_size, length - 1)
      for sample, slot in enumerate(slots[:request.n]):
        self.owner[slot] = (index, sample)
        self.admitted_at[slot] = len(self.admitted_at)
      admitted.append((index, slots[:request.n], cached))
    self.loop = self.loop.replace(state=state)
    if admitted:
      self.prefill(requests, admitted)

  def prefill(self, requests, admitted) -> None:
    """Runs the uncached prompt suffixes, forks samples, samples token one."""
    cfg = self.cfg
    rows = _bucket(len(admitted))
    width = _bucket(max(requests[i].prompt.size - cached
                        for i, _, cached in admitted), 8)
    tokens = np.zeros((rows, width), np.int32)
    positions = np.full((rows, width), -1, np.int32)
    parents = np.full(rows, -1, np.int32)
    suffix = np.zeros(rows, np.int32)
    for row, (index, slots, cached) in enumerate(admitted):
      prompt = requests[index].prompt
      count = prompt.size - cached
      tokens[row, :count] = prompt[cached:]
      positions[row, :count] = np.arange(cached, prompt.size)
      parents[row], suffix[row] = slots[0], count
      self.stats.prompt_tokens += prompt.size
      self.stats.prefill_tokens += count
    state = self.loop.state
    slot_mapping = _slot_mapping(state, parents, suffix, width=width)
    tables = _block_tables(state, parents)
    logits, self.kv = _paged_forward(self.graphdef, self.params, self.kv,
                                     tokens, positions, tables, slot_mapping)
    last = logits[jnp.arange(rows), jnp.maximum(suffix - 1, 0)]
    sample_rows = np.concatenate(
        [np.full(len(slots), row) for row, (_, slots, _) in enumerate(admitted)])
    self.key, subkey = jax.random.split(self.key)
    first = np.asarray(_sample_jit(last[sample_rows], subkey, self.sampling))
    loop = self.loop
    seq_ids = np.asarray(loop.seq_ids).copy()
    last_token = np.asarray(loop.last_token).copy()
    num_generated = np.asarray(loop.num_generated).copy()
    limit = np.asarray(loop.limit).copy()
    outputs = np.asarray(loop.outputs).copy()
    cursor = 0
    for index, slots, _ in admitted:
      budget = min(self.sampling.max_new_tokens,
                   cfg.max_tokens_per_seq - requests[index].prompt.size)
      for slot in slots:
        if slot != slots[0]:
          state, result = _fork(state, slots[0], slot)
          if Status(int(result.status)) != Status.OK:
            raise RuntimeError(f"fork to slot {slot} failed: "
                               f"{Status(int(result.status)).name}")
        token = int(first[cursor])
        cursor += 1
        seq_ids[slot], last_token[slot] = slot, token
        num_generated[slot], limit[slot] = 1, budget
        outputs[slot, 0] = token
        if budget <= 1 or token == self.sampling.eos_id:
          seq_ids[slot] = -1
    done = [s for _, slots, _ in admitted for s in slots if seq_ids[s] < 0]
    if done:
      state, _ = _free(state, jnp.asarray(done, jnp.int32))
    self.loop = loop.replace(
        state=state, seq_ids=jnp.asarray(seq_ids),
        last_token=jnp.asarray(last_token),
        num_generated=jnp.asarray(num_generated), limit=jnp.asarray(limit),
        outputs=jnp.asarray(outputs))

  def preempt(self) -> None:
    """Swaps the most recently admitted running sequence out to host memory."""
    seq_ids = np.asarray(self.loop.seq_ids).copy()
    running = np.nonzero(seq_ids >= 0)[0]
    victim = int(max(running, key=self.admitted_at.__getitem__))
    state = self.loop.state
    if not bool(self.bm.can_swap_out(state, jnp.array([victim]))):
      raise RuntimeError(
          f"out of GPU blocks and no swap space for seq {victim}: raise "
          f"num_gpu_blocks ({self.cfg.num_gpu_blocks}) or num_cpu_blocks "
          f"({self.cfg.num_cpu_blocks})")
    state, plan = self.bm.swap_out(state, jnp.array([victim]))
    self.kv = sharding.swap_out(self.kv, plan)
    seq_ids[victim] = -1
    self.swapped.append(victim)
    self.stats.preemptions += 1
    self.stats.swaps += int(plan.count)
    self.loop = self.loop.replace(state=state, seq_ids=jnp.asarray(seq_ids))

  def resume_swapped(self) -> None:
    """Swaps preempted sequences back in, oldest first, while blocks allow."""
    seq_ids = np.asarray(self.loop.seq_ids).copy()
    state = self.loop.state
    while self.swapped:
      slot = self.swapped[0]
      if AllocStatus(int(self.bm.can_swap_in(state, jnp.array([slot])))) != (
          AllocStatus.OK):
        break
      swapped_in, plan = self.bm.swap_in(state, jnp.array([slot]))
      # Leave a block for every running sequence's next token, or the loop
      # would run out at once and swap this sequence straight back out.
      running = int(np.sum(seq_ids >= 0)) + 1
      if int(self.bm.num_free_gpu_blocks(swapped_in)) < running:
        break
      state = swapped_in
      self.swapped.popleft()
      self.kv = sharding.swap_in(self.kv, plan)
      self.stats.swaps += int(plan.count)
      seq_ids[slot] = slot
    self.loop = self.loop.replace(state=state, seq_ids=jnp.asarray(seq_ids))

  def collect(self, results) -> None:
    """Moves the outputs of finished sequences into `results`."""
    seq_ids = np.asarray(self.loop.seq_ids)
    outputs = np.asarray(self.loop.outputs)
    counts = np.asarray(self.loop.num_generated)
    for slot in list(self.owner):
      if seq_ids[slot] < 0 and slot not in self.swapped:
        index, sample = self.owner.pop(slot)
        results[index][sample] = outputs[slot, :counts[slot]].copy()
        self.stats.generated_tokens += int(counts[slot])

  def run(self, requests: Sequence[Request], progress=None):
    results = [[None] * r.n for r in requests]
    waiting = collections.deque(range(len(requests)))
    while waiting or self.owner:
      self.resume_swapped()
      if not self.swapped:
        self.admit(requests, waiting)
      if not self.owner:
        raise RuntimeError(
            f"request {waiting[0]} ({requests[waiting[0]].prompt.size} tokens, "
            f"n={requests[waiting[0]].n}) cannot be admitted with {self.cfg}")
      if bool(jnp.any(self.loop.seq_ids >= 0)):
        self.loop = _decode_loop(self.graphdef, self.params, self.sampling,
                                 self.key, self.loop.replace(kv=self.kv),
                                 jnp.array(bool(waiting or self.swapped)))
        self.kv = self.loop.kv
        self.loop = self.loop.replace(kv=None)
        self.stats.loop_launches += 1
        if bool(self.loop.out_of_blocks):
          self.preempt()
      elif self.swapped and not np.any(np.asarray(self.loop.seq_ids) >= 0):
        pending = [s for s in self.owner if s not in self.swapped]
        if not pending:
          raise RuntimeError(
              f"seq {self.swapped[0]} cannot be swapped back in: "
              f"num_gpu_blocks ({self.cfg.num_gpu_blocks}) is too small")
      before = sum(r is not None for rs in results for r in rs)
      self.collect(results)
      if progress is not None:
        done = sum(r is not None for rs in results for r in rs)
        progress(done - before)
    loop = self.loop
    self.stats.decode_steps = int(loop.step)
    self.stats.cow_copies = int(loop.cow_copies)
    self.stats.peak_blocks = int(loop.peak_blocks)
    self.stats.kv_slot_utilization = float(loop.utilization_sum) / max(
        int(loop.step), 1)
    self.stats.prefix_cache_hit_rate = float(
        self.bm.prefix_cache_hit_rate(loop.state))
    return results, self.stats


def generate(model: Llama, requests: Sequence[Request], cfg: CacheConfig,
             sampling: SamplingParams, key: jax.Array, *, progress=None,
             kv_cache_dtype=None, mesh: jax.sharding.Mesh | None = None
             ) -> tuple[list[list[np.ndarray]], GenerationStats]:
  """Serves `requests` on a paged KV cache.

  Args:
    model: the decoder.
    requests: prompts and their sample counts.
    cfg: the paged cache's shape and policy (prefix caching, swap space).
    sampling: how tokens are drawn and when sequences stop.
    key: PRNG key of the sampling.
    progress: optional callable, given the number of sequences that
      finished since its last call.
    kv_cache_dtype: dtype of the KV pages: None for the model's compute
      dtype, or ``jnp.int8`` / ``jnp.float8_e4m3fn`` for a quantized cache
      (one device only, for now).
    mesh: a ``("data", "model")`` mesh to serve on (see
      ``paged_jax.sharding``), or None for one device.

  Returns:
    `(outputs, stats)`: `outputs[i][j]` is the int32 tokens of sample `j` of
    request `i` (EOS included when drawn), and the run's `GenerationStats`.

  Raises:
    ValueError: if a request does not fit the cache configuration, or the
      model's heads do not split over the mesh's "model" axis.
    RuntimeError: if the cache cannot make progress (too few blocks even
      after swapping out).
  """
  requests = [r if isinstance(r, Request) else Request(r) for r in requests]
  for index, request in enumerate(requests):
    length = request.prompt.size
    if request.n > cfg.max_seqs:
      raise ValueError(f"request {index} asks for n={request.n} samples, more "
                       f"than max_seqs={cfg.max_seqs}")
    if length + 1 > cfg.max_tokens_per_seq:
      raise ValueError(
          f"request {index}: prompt of {length} tokens leaves no room in a "
          f"block table of {cfg.max_tokens_per_seq} tokens")
    if int(request.prompt.max()) >= model.config.vocab_size or int(
        request.prompt.min()) < 0:
      raise ValueError(f"request {index} has token ids outside "
                       f"0..{model.config.vocab_size - 1}")
  if mesh is not None:
    if kv_cache_dtype is not None and jnp.dtype(kv_cache_dtype) in (
        jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)):
      raise ValueError("a quantized kv_cache_dtype cannot be served on a mesh "
                       "yet; pass mesh=None")

    def serve(row_mesh, row_requests):
      return _Driver(model, cfg, sampling, key, kv_cache_dtype,
                     mesh=row_mesh).run(row_requests, progress)

    return sharding.serve_on_mesh(serve, requests, mesh,
                                  sampling.max_new_tokens, GenerationStats)
  return _Driver(model, cfg, sampling, key, kv_cache_dtype).run(requests,
                                                                progress)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _dense_generate(graphdef, params_state, sampling: SamplingParams, key,
                    tokens, lengths, cache):
  """Prefill then a `while_loop` of decode steps on a dense cache."""
  model = nnx.merge(graphdef, params_state)
  batch, width = tokens.shape
  columns = jnp.arange(width, dtype=jnp.int32)[None, :]
  positions = jnp.where(columns < lengths[:, None], columns, -1)
  logits, cache = model(tokens, positions, cache)
  last = logits[jnp.arange(batch), lengths - 1]
  token = sample_tokens(last, jax.random.fold_in(key, 0), sampling)
  limit = sampling.max_new_tokens
  outputs = jnp.zeros((batch, limit), jnp.int32).at[:, 0].set(token)
  running = jnp.ones(batch, bool) if limit > 1 else jnp.zeros(batch, bool)
  if sampling.eos_id is not None:
    running &= token != sampling.eos_id

  def step(carry):
    i, running, token, outputs, cache = carry
    model = nnx.merge(graphdef, params_state)
    positions = jnp.where(running, lengths + i - 1, -1)[:, None]
    logits, cache = model(token[:, None], positions, cache)
    new = sample_tokens(logits[:, 0], jax.random.fold_in(key, i), sampling)
    outputs = outputs.at[:, i].set(jnp.where(running, new, 0))
    still = running & (i + 1 < limit)
    if sampling.eos_id is not None:
      still &= new != sampling.eos_id
    return i + 1, still, jnp.where(running, new, token), outputs, cache

  carry = (jnp.int32(1), running, token, outputs, cache)
  _, _, _, outputs, _ = jax.lax.while_loop(lambda c: jnp.any(c[1]), step,
                                           carry)
  return outputs


def generate_dense(model: Llama, prompts: Sequence[np.ndarray],
                   sampling: SamplingParams, key: jax.Array
                   ) -> list[np.ndarray]:
  """Generates from every prompt on a dense cache (one row per prompt).

  Args:
    model: the decoder.
    prompts: int token ids, one non-empty 1-D array per sequence.
    sampling: how tokens are drawn and when sequences stop.
    key: PRNG key of the sampling.

  Returns:
    The generated int32 tokens of each prompt, EOS included when drawn.

  Raises:
    ValueError: if a prompt is empty or not 1-D.
  """
  prompts = [Request(p).prompt for p in prompts]
  lengths = np.array([p.size for p in prompts], np.int32)
  width = _bucket(int(lengths.max()), 8)
  tokens = np.zeros((len(prompts), width), np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, :prompt.size] = prompt
  cache = init_dense_cache(model.config, len(prompts),
                           width + sampling.max_new_tokens)
  graphdef, params_state = nnx.split(model)
  outputs = np.asarray(_dense_generate(graphdef, params_state, sampling, key,
                                       tokens, lengths, cache))
  results = []
  for row in outputs:
    end = sampling.max_new_tokens
    if sampling.eos_id is not None:
      hits = np.nonzero(row == sampling.eos_id)[0]
      end = int(hits[0]) + 1 if hits.size else end
    results.append(row[:end].copy())
  return results
