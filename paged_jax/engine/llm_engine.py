"""`LLMEngine`: continuous batching on the paged KV cache, one step at a time."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from paged_jax import compilation_cache, compile_guard, kernel_choice, sharding, structured
from paged_jax.config import CacheConfig
from paged_jax.engine import arrivals, engine_checks, speculative, step_stream
from paged_jax.engine.admission import type_admission_error
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.input_processor import MAX_STOP_TOKENS, InputProcessor
from paged_jax.engine.lifecycle import EngineLifecycle
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.engine.outputs import GenerationStats, RequestOutput
from paged_jax.engine.protocol import check_model
from paged_jax.engine.rounds import EngineRounds
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.scheduler import Scheduler
from paged_jax.engine.sequence import SequenceGroup
from paged_jax.params import SamplingParams

# Warm-up's model programs compiling at once: about one core each.
COMPILE_THREADS = min(4, os.cpu_count() or 1)


class LLMEngine(EngineRounds, EngineLifecycle):
  """Serves requests as they come, on the paged KV cache (vLLM's online form).

  Every `step` is one scheduling round: swapped-out groups come back,
  waiting requests are admitted, and the round's work runs in one launch.
  A round with prompt work is a ragged step: its prompt chunks (within the
  token budget, after one token for each decoding sequence) and one decode
  step of every running sequence go through the model together, so a
  request that arrives joins the next step. A round with only decoding runs
  the compiled decode loop, whose length adapts: 1 step after a round with
  prompt work, then twice as many each decode-only round, up to
  `num_decode_steps`; with `stop_decode_on_arrival`, a request that arrives
  ends the launch after the step in flight. The host checks stop strings
  and builds the outputs between launches, so each launch's tokens stream
  as soon as it is read.

  Args:
    model: an `nnx.Module` following `paged_jax.engine.ModelProtocol`.
    tokenizer: has `encode(text)` and `decode(ids)` (and `eos_token_id` or
      `eos_id`); None to serve token ids only.
    cache_config: the paged cache; `max_seqs` is the number of sequence
      slots (running and swapped out). With a `sliding_window` of `W`,
      every layer of the model must slide over at most `W` keys; prompts
      then run in chunks of at most `W - w + 1` tokens (`w` the widest
      layer window), and so do prefill tiles (`prefill_width`).
    max_num_seqs: sequences running at once; defaults to
      `cache_config.max_seqs`.
    max_num_batched_tokens: tokens one round puts through the model (one per
      decoding sequence, the rest for prompt chunks); defaults to 512.
    preemption_mode: "recompute" or "swap", how a group is preempted when
      blocks run out.
    kv_cache_dtype: dtype of the KV pages; None for the model's.
    kv_cache_memory_bytes: bytes of KV pages per device (vLLM's option of
      that name): the cache gets as many GPU blocks as they hold, of the
      model's layers (and a draft model's) and of the KV heads one device
      stores, instead of `cache_config.num_gpu_blocks`, which must then be
      left at its default (or equal that count). The budget must hold one
      sequence of the longest length. None: `cache_config`'s blocks.
    hybrid_kv_cache: one block table and pool per attention type of the
      model's layers (`paged_jax.block_manager.hybrid`, docs/engine.md):
      a sliding layer's pages hold only its window (and one prompt chunk),
      so a model such as Gemma 2 or 3 holds several times more long
      sequences. Prompts run in chunks of half the smallest window (while
      speculating, at least `num_speculative_tokens + 1`). A draft model's
      layers join the target's types (`engine_checks.draft_layer_windows`).
      Every type's pool has `cache_config.num_gpu_blocks` blocks, or its
      share of `kv_cache_memory_bytes`; `engine.cfg.num_gpu_blocks` counts
      them all. One device (no mesh). False (default): one table, every
      block kept for every layer (each sliding layer masks its window).
    mesh: a ``("data", "model")`` mesh: the model's weights and the KV
      pages are split over "model" (tensor parallel), and every data shard
      has a cache of `cache_config`'s size, its own manager state,
      sequences and budgets (`max_num_seqs`, `max_num_batched_tokens`);
      a request goes to the shard with the fewest tokens outstanding. All
      shards run as one program (see `paged_jax.sharding`); with several
      processes, every process adds the same requests and sees every
      output. None for one device.
    num_decode_steps: the most decode steps one launch of the compiled loop
      runs (a decode-only stretch ramps up to it; every launch length runs
      the same program).
    max_logprobs: the largest `SamplingParams.logprobs` accepted.
    max_beam_width: the most beams (`n` with `use_beam_search`) a request
      may ask for; it sizes the decode loop's beam state.
    prefill_width: tokens per prefill attention tile: a round's prompt
      chunks run packed, without padding between them, through the model's
      matmuls and attend in tiles of this many tokens (see
      `compiled_programs`).
    decode_row_buckets: row counts per data shard the decode loop compiles
      for besides `max_seqs` (vLLM's CUDA-graph capture sizes, here XLA
      programs): a launch packs the decoding sequences into the smallest
      that holds them. None: powers of four up to the first that holds
      `max_num_seqs`; `()`: one program over every slot (fewest compiles,
      most padding).
    async_scheduling: overlap the host with the device (vLLM's option of
      that name): when the next round would only decode the same rows
      again (nothing waits, is swapped out or still prefills, no beam group,
      no row stopped on the host), the next decode launch is dispatched
      before this one is read back, detokenized and checked for stop
      strings, and the next `step` reads it back. A sequence that a stop
      string ends then draws one launch of tokens more, which are dropped
      (their blocks freed), and a request that arrives waits up to one
      launch longer (without `stop_decode_on_arrival`; with it, that
      launch runs no step once one arrived). Not with speculation. False
      (default): the host reads every launch back before the next is
      dispatched.
    stop_decode_on_arrival: each step of a decode launch first reads
      whether a request arrived since the round began (`add_request`, or
      `notify_arrival` from another thread); if one did, the launch ends
      there, and the next round admits it. On CPU a C++ flag (about 4%
      per SmolLM2 decode step); elsewhere a host callback per step, which
      stalls an accelerator and keeps the decode loops out of the
      persistent compilation cache (`paged_jax.engine.arrivals`). Off by
      default. One process only.
    stream_steps: each step of a decode launch publishes its draws as it
      ends, and `step(on_decode_step=...)` hands their outputs on while the
      launch runs, so a streamed token leaves one step after it was drawn
      instead of at the launch's end (`paged_jax.engine.step_stream`; not
      for beam groups or speculating launches, whose tokens are settled at
      the end, nor for a launch dispatched ahead with `async_scheduling`).
      On CPU a C++ channel; elsewhere a host callback per step, which
      stalls an accelerator. Outputs equal those without. Off by
      default (the server turns it on). One device only.
    speculative_config: speculative decoding in vLLM's form:
      `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max":
      4, "prompt_lookup_min": 1}` (prompt lookup) or `{"method":
      "draft_model", "model": draft, "num_speculative_tokens": k}`; every
      decode step then proposes up to `k` tokens per sequence and the model
      checks them in one call (see `paged_jax.engine.speculative`). Beam
      search is refused then, a sequence holds at most
      `max_tokens_per_seq - k` tokens (the lookahead slots), and prompt
      chunks run in a launch of their own before the round's decode loop
      (no ragged step). None: off.
    automaton_capacity: the size of the table of the automata of the
      structured outputs running at once (`pj.TableCapacity`: states and
      transitions). Every program carries a table of this size, constrained
      rows or not, so structured outputs compile nothing after warm-up. A
      request whose automaton alone does not fit is refused; one that does
      not fit beside the running requests' automata waits. None:
      `TableCapacity.for_vocabulary(vocab_size)` with a tokenizer; without
      one there are no structured outputs and the programs carry no table.
    warmup: compile every program the engine can launch now (`warmup()`),
      so that serving compiles nothing.
    seed: seed of the requests that give none.
    key: a PRNG key used instead of `seed`.

  Raises:
    TypeError, ValueError: for a model that does not follow the protocol or
      an argument out of range.
  """

  def __init__(
    self,
    model,
    tokenizer,
    cache_config: CacheConfig,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int = 512,
    preemption_mode: str = "recompute",
    kv_cache_dtype=None,
    kv_cache_memory_bytes: int | None = None,
    hybrid_kv_cache: bool = False,
    mesh=None,
    num_decode_steps: int = 8,
    max_logprobs: int = 5,
    max_beam_width: int = 4,
    prefill_width: int = 32,
    decode_row_buckets=None,
    async_scheduling: bool = False,
    speculative_config=None,
    stop_decode_on_arrival: bool = False,
    stream_steps: bool = False,
    automaton_capacity: structured.TableCapacity | None = None,
    warmup: bool = False,
    seed: int = 0,
    key: jax.Array | None = None,
  ):
    check_model(model)
    if not isinstance(cache_config, CacheConfig):
      raise TypeError(f"cache_config must be a pj.CacheConfig, got {type(cache_config).__name__}")
    max_num_seqs = cache_config.max_seqs if max_num_seqs is None else (max_num_seqs)
    engine_checks.check_limits(
      cache_config,
      max_num_seqs=max_num_seqs,
      max_num_batched_tokens=max_num_batched_tokens,
      num_decode_steps=num_decode_steps,
      max_logprobs=max_logprobs,
      max_beam_width=max_beam_width,
      prefill_width=prefill_width,
      decode_row_buckets=decode_row_buckets,
      preemption_mode=preemption_mode,
    )
    if automaton_capacity is not None and not isinstance(
      automaton_capacity, structured.TableCapacity
    ):
      raise TypeError(
        f"automaton_capacity must be a pj.TableCapacity or None, got {automaton_capacity!r}"
      )
    if automaton_capacity is None and tokenizer is not None:
      automaton_capacity = structured.TableCapacity.for_vocabulary(model.config.vocab_size)
    if mesh is not None:
      mesh = sharding.serving_mesh(mesh)
    self.speculative, draft = speculative.parse_config(speculative_config, model.config.vocab_size)
    if not isinstance(async_scheduling, bool):
      raise ValueError(f"async_scheduling must be a bool, got {async_scheduling!r}")
    if async_scheduling and self.speculative is not None:
      raise ValueError(
        "async_scheduling does not work with speculative_config: a speculating launch starts "
        "from the tokens the host read back"
      )
    hybrid, draft_windows = None, None
    lookahead = 0 if self.speculative is None else self.speculative.num_speculative_tokens
    if hybrid_kv_cache:
      if mesh is not None:
        raise ValueError("hybrid_kv_cache runs on one device: pass mesh=None")
      hybrid, cache_config, max_chunk, draft_windows = engine_checks.hybrid_cache(
        cache_config,
        model.config,
        budget_bytes=kv_cache_memory_bytes,
        kv_cache_dtype=kv_cache_dtype,
        lookahead=lookahead,
        draft_config=None if draft is None else draft.config,
      )
    else:
      max_chunk = engine_checks.max_chunk(cache_config, model.config)
    if not hybrid_kv_cache and kv_cache_memory_bytes is not None:
      cache_config = engine_checks.sized_for_budget(
        cache_config,
        kv_cache_memory_bytes,
        [model.config] + ([] if draft is None else [draft.config]),
        kv_cache_dtype=kv_cache_dtype,
        model_shards=1 if mesh is None else mesh.shape["model"],
        max_chunk=max_chunk,
      )
    if self.speculative is not None:
      engine_checks.check_speculation(self.speculative, cache_config, max_chunk, draft)
    self.draft = draft
    self._chooser = None
    if self.speculative is not None and self.speculative.adaptive:
      self._chooser = speculative.LaunchChooser()
    if max_chunk is not None:
      prefill_width = min(prefill_width, max_chunk)
    compilation_cache.enable()  # on disk, see paged_jax.compilation_cache
    self.model_config = model.config
    self.tokenizer = tokenizer
    self.cfg = cache_config
    eos_token_id = (
      None
      if tokenizer is None
      else getattr(tokenizer, "eos_token_id", getattr(tokenizer, "eos_id", None))
    )
    self.num_decode_steps = num_decode_steps
    self.async_scheduling = async_scheduling
    self.max_logprobs = max_logprobs
    self.cache_manager = CacheManager(
      cache_config,
      model.config,
      kv_cache_dtype=kv_cache_dtype,
      mesh=mesh,
      max_chunk=max_chunk,
      draft_config=None if draft is None else draft.config,
      lookahead=lookahead,
      hybrid=hybrid,
      draft_layer_windows=draft_windows,
    )
    watch = None
    if arrivals.check_arrivals(stop_decode_on_arrival, jax.process_count()):
      replicated = self.cache_manager.replicated
      watch = arrivals.ArrivalWatch(lambda a: jax.device_put(a, replicated))
    stream = None
    num_devices = 1 if mesh is None else mesh.devices.size
    if step_stream.check_streaming(stream_steps, num_devices * jax.process_count()):
      replicated = self.cache_manager.replicated
      stream = step_stream.StepStream(lambda a: jax.device_put(a, replicated))
    self.runner = ModelRunner(
      model,
      self.cache_manager,
      mesh=mesh,
      num_logprobs=max_logprobs,
      stop_width=MAX_STOP_TOKENS,
      max_beam_width=max_beam_width,
      prefill_width=prefill_width,
      max_prefill_tokens=max_num_batched_tokens,
      max_prefill_rows=-(-max_num_batched_tokens // prefill_width) + max_num_seqs,
      max_decode_rows=max_num_seqs,
      decode_row_buckets=decode_row_buckets,
      speculative=self.speculative,
      draft_model=draft,
      automaton_capacity=automaton_capacity,
      arrival_watch=watch,
      step_stream=stream,
    )
    engine_checks.check_program_count(self.runner, max_num_batched_tokens, max_num_seqs)
    self.inputs = InputProcessor(
      tokenizer,
      eos_token_id,
      model.config.vocab_size,
      self._max_len(),
      max_logprobs,
      max_beam_width,
      automaton_capacity,
    )
    self.processor = OutputProcessor(tokenizer)
    # On a CPU a padded prompt token costs what a real one does: rounds fill
    # their prompt buckets (`packing.filled_budget`).
    token_buckets = None
    if kernel_choice.kernel_platform() == "cpu":
      token_buckets = [tokens for tokens, _ in self.runner.prefill_buckets()]
    self.schedulers = [
      Scheduler(
        self.cache_manager,
        max_num_seqs,
        max_num_batched_tokens,
        preemption_mode,
        self._max_len(),
        shard,
        self._automaton_room,
        token_buckets,
        rows_in_buckets=self.speculative is None,
      )
      for shard in range(self.cache_manager.num_shards)
    ]
    self._loads = np.zeros(self.cache_manager.num_shards, np.int64)
    self._key = jax.random.key(seed) if key is None else key
    self._groups: dict[str, SequenceGroup] = {}
    self._pending: list[RequestOutput] = []
    self._deferred = None  # (rounds, result) the schedulers take once the launch ahead is read
    self._arrivals = 0
    self._prompt_tokens = 0
    self.timing = dict(rounds=0, wall_s=0.0, device_s=0.0)
    self.sleep_level = 0  # 0 awake; 1 or 2 after `sleep(level)`
    if warmup:
      self.warmup()

  # Programs.
  def compiled_programs(self) -> list[str]:
    """Every program the engine launches, one per shape: the bucket set.

    A ragged step runs each data shard's prompt chunks packed into one row
    of tokens, attending in tiles of `prefill_width` tokens, followed by
    one decode token for each of its decoding rows (of
    `ModelRunner.ragged_rows`): `2 * prefill_width * 2**i` tokens in `4 *
    2**i` tiles per shard, up to the first shape that holds
    `max_num_batched_tokens` tokens (the
    largest with room for `ceil(max_num_batched_tokens / prefill_width) +
    max_num_seqs` tiles: a chunk adds at most one partly filled tile).
    With speculation, prompt chunks run alone in those shapes instead. The
    decode loop runs each data shard's decoding sequences padded to a
    power of four below `max_seqs` (up to the
    first that holds `max_num_seqs`; or to one of `decode_row_buckets`),
    or every slot (`max_seqs` per shard, with the beam step, which runs
    only in steps with a beam group), with speculation each of those with
    speculating steps (and plain ones too when adaptive); every launch
    length runs the same program. With `async_scheduling`, a small program
    per decode row count carries a launch on to the next (and warm-up also
    runs the loop on such a carry, another argument kind on JAX 0.12); the block
    manager's calls over a group take its slots padded to `max_seqs`; swaps
    move fixed-capacity plans; a request's PRNG keys come from a few small
    host-side programs.
    """
    runner, shards, steps = self.runner, self.cache_manager.num_shards, self.num_decode_steps
    width = runner.prefill_width
    if self.speculative is None:
      prompts = [
        f"ragged step: {shards * t} tokens (prompt and decode) in {shards * r} tiles of "
        f"{width}, {shards * runner.ragged_rows()} decode rows"
        for t, r in runner.prefill_buckets()
      ]
    else:
      prompts = [
        f"prefill {shards * t} tokens in {shards * r} tiles of {width}"
        for t, r in runner.prefill_buckets()
      ]
    return (
      prompts
      + [
        f"{'speculating ' if kind else ''}decode loop {shards * r} rows x{steps} steps"
        for kind in runner.decode_kinds()
        for r in runner.decode_buckets()
      ]
      + [
        f"carry of a decode launch that continues one on {shards * r} rows"
        for r in (runner.decode_buckets() if self.async_scheduling else [])
      ]
      + ["block manager calls", "swap out", "swap in", "request keys"]
    )

  def warmup(self) -> None:
    """Compiles every program of `compiled_programs()` (the persistent
    compilation cache makes a later start with the same model and config
    read them back), showing a progress bar, then prints one summary line.
    The model programs compile on up to `COMPILE_THREADS` threads at once.

    Raises:
      RuntimeError: if requests are already running.
    """
    runner, steps = self.runner, self.num_decode_steps
    warm_prompts = runner.warm_up_prefill if self.speculative else runner.warm_up_ragged_step
    model_launches = [lambda b=b: warm_prompts(b) for b in runner.prefill_buckets()]
    model_launches += [
      lambda r=r: runner.warm_up_decode(steps, r, self.async_scheduling)
      for r in runner.decode_buckets()
    ]
    start = time.perf_counter()
    bar = tqdm(desc="warm-up", unit="program", leave=False)
    with compile_guard.count_compiles() as compiles, bar:
      # The model programs compile side by side first (lowered here, each
      # compiled on a thread of its own), then every launch runs.
      with runner.compile_only(COMPILE_THREADS) as pending:
        for launch in model_launches:
          launch()
        bar.total = len(pending)
        for compiled in concurrent.futures.as_completed(pending):
          compiled.result()
          bar.update()
      for launch in [*model_launches, self.cache_manager.warm_up, self._warm_up_request_keys]:
        launch()
    print(
      f"warm-up: {len(self.compiled_programs())} programs ({len(compiles)} compiles) in "
      f"{time.perf_counter() - start:.1f} s",
      file=sys.stderr,
    )

  def _warm_up_request_keys(self) -> None:
    """Derives the PRNG keys of a seeded and of an unseeded request."""
    for seed in (0, None):
      self.inputs.group("warm-up", [0], SamplingParams(n=2, seed=seed), self._key, 0)

  # Requests.
  def admission_error(self, num_prompt_tokens: int, params: SamplingParams) -> str | None:
    """Why a prompt of this length with `params` can never be served, or
    None (see `paged_jax.engine.admission.admission_error`)."""
    return type_admission_error(
      self.cache_manager.type_configs,
      max_len=self._max_len(),
      max_num_seqs=self.schedulers[0].max_num_seqs,
      num_prompt_tokens=num_prompt_tokens,
      params=params,
      max_chunk=self.cache_manager.max_chunk,
      lookahead=self.cache_manager.lookahead,
    )

  def _automaton_room(self, automaton) -> bool:
    """Whether `automaton` fits the launches' table beside the automata of
    every shard's running and swapped-out groups."""
    held = [
      group.automaton
      for scheduler in self.schedulers
      for group in (*scheduler.running, *scheduler.swapped)
      if group.automaton is not None
    ]
    return self.runner.automaton_capacity.shortfall([*held, automaton]) is None

  def _max_len(self) -> int:
    lookahead = 0 if self.speculative is None else self.speculative.num_speculative_tokens
    most = min(self.model_config.max_seq_len, self.cfg.max_tokens_per_seq - lookahead)
    return most if self.draft is None else min(most, self.draft.config.max_seq_len)

  def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
    """Queues a request; a prompt that can never fit finishes at the next
    step with finish reason "error" and the reason in `RequestOutput.error`.

    Args:
      request_id: a unique id.
      prompt: text, or token ids.
      params: sampling parameters; `SamplingParams()` (greedy) by default.

    Raises:
      ValueError: for a duplicate id, a bad prompt, `logprobs` above
        `max_logprobs`, too many stop tokens, stop strings or structured
        outputs without a tokenizer, structured outputs that cannot be
        compiled (before any step), or `logprobs_mode="processed"` with
        speculative decoding.
      EngineStateError: while the engine sleeps.
    """
    params = SamplingParams() if params is None else params
    self._refuse_asleep("add_request")
    if params.logprobs_mode == "processed" and self.speculative is not None:
      raise ValueError(
        f"request {request_id!r}: logprobs_mode='processed' does not run with speculative "
        f"decoding (speculative_config); use 'raw' or an engine without it"
      )
    if params.use_beam_search and self.speculative is not None:
      raise ValueError(
        f"request {request_id!r}: beam search does not run with speculative decoding "
        f"(speculative_config); use an engine without it"
      )
    if request_id in self._groups:
      raise ValueError(f"request_id {request_id!r} is already in use")
    group = self.inputs.group(request_id, prompt, params, self._key, self._arrivals)
    ids = group.prompt_token_ids
    self._arrivals += 1
    self._groups[request_id] = group
    self.notify_arrival()
    error = self.admission_error(ids.size, params)
    if error is not None:
      group.error = f"request {request_id!r}: {error}"
      self._finish(group, "error")
      return
    self._prompt_tokens += ids.size
    group.shard = int(np.argmin(self._loads))
    group.load = params.n * (ids.size + group.limit)
    self._loads[group.shard] += group.load
    self.schedulers[group.shard].add(group)

  def notify_arrival(self) -> None:
    """Ends the decode launch in flight after its current step, so that
    the next round admits a request (with `stop_decode_on_arrival`; else
    nothing). Thread-safe: a server thread calls it when it queues a
    request for the thread that steps the engine."""
    if self.runner.arrival_watch is not None:
      self.runner.arrival_watch.note()

  def abort_request(self, request_id: str) -> None:
    """Stops a request at once and frees its blocks; the next `step` reports
    it with finish reason "abort". Unknown or finished ids are ignored. A
    decode launch running ahead (`async_scheduling`) is read back first; the
    next `step` reports its tokens too."""
    group = self._groups.get(request_id)
    if group is None or group.finished:
      return
    if self.running_ahead:  # the host changes rows only after reading it back
      self._pending += self._outputs(self._take_ahead(False))
      if group.finished:
        return
    self.schedulers[group.shard].remove(group)
    self._finish(group, "abort")

  def has_unfinished_requests(self) -> bool:
    return (
      bool(self._pending) or self.running_ahead or any(s.has_unfinished() for s in self.schedulers)
    )

  def _finish(self, group: SequenceGroup, reason: str) -> None:
    """Finishes a group out of turn (an abort or error); the next step
    reports it."""
    self.processor.finish(group, reason)
    self._retire(group)
    self._pending.append(self.processor.output(group))

  def _retire(self, group: SequenceGroup) -> None:
    del self._groups[group.request_id]
    self._loads[group.shard] -= group.load

  # Introspection.
  @property
  def state(self):
    """The block manager's state (for `pj.check_invariants` and queries) of
    an engine with one data shard; see `shard_state`."""
    if self.cache_manager.num_shards > 1:
      raise ValueError(
        f"the engine has {self.cache_manager.num_shards} data shards: use engine.shard_state(shard)"
      )
    return self.cache_manager.shard_state(0)

  def shard_state(self, shard: int):
    """The block manager's state of data shard `shard`."""
    return self.cache_manager.shard_state(shard)

  @property
  def running_ahead(self) -> bool:
    """Whether a decode launch dispatched ahead (`async_scheduling`) is
    not read back yet: the cache's state (`num_free_gpu_blocks`,
    `stats.prefix_cache_hit_rate`, `state`) is read after it."""
    return self.runner.ahead is not None

  def num_free_gpu_blocks(self) -> int:
    """Free GPU blocks of all data shards (of every type, on a hybrid cache)."""
    return sum(
      self.cache_manager.num_free_gpu_blocks(shard)
      for shard in range(self.cache_manager.num_shards)
    )

  @property
  def stats(self) -> GenerationStats:
    """Counters of everything served so far (see `GenerationStats`)."""
    counters = self.runner.counters
    return GenerationStats(
      generated_tokens=self.processor.generated_tokens,
      prompt_tokens=self._prompt_tokens,
      prefill_tokens=sum(s.prefill_tokens for s in self.schedulers),
      prefill_positions=counters["prefill_positions"],
      decode_steps=counters["decode_steps"],
      decode_positions=counters["decode_positions"],
      decode_tokens=counters["decode_tokens"],
      loop_launches=counters["loop_launches"],
      loop_launches_ahead=counters["loop_launches_ahead"],
      peak_blocks=counters["peak_blocks"],
      kv_slot_utilization=counters["utilization_sum"] / max(counters["decode_steps"], 1),
      prefix_cache_hit_rate=self.cache_manager.prefix_cache_hit_rate(),
      cow_copies=counters["cow_copies"],
      preemptions=sum(s.num_preemptions for s in self.schedulers),
      swaps=self.cache_manager.num_swapped_blocks,
      **{name: counters[name] for name in counters if name.startswith("spec_decode_")},
    )
