"""`LLMEngine`: continuous batching on the paged KV cache, one step at a time."""

from __future__ import annotations

import sys
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from paged_jax import compilation_cache, compile_guard, sharding, structured
from paged_jax.config import CacheConfig
from paged_jax.engine import speculative, weights
from paged_jax.engine.admission import admission_error
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.input_processor import MAX_STOP_TOKENS, InputProcessor
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.engine.outputs import GenerationStats, RequestOutput
from paged_jax.engine.protocol import check_model
from paged_jax.engine.runner import ModelRunner
from paged_jax.engine.scheduler import PREEMPTION_MODES, Scheduler
from paged_jax.engine.scheduler_output import SchedulerOutput
from paged_jax.engine.sequence import SequenceGroup
from paged_jax.paged_cache import window_chunk
from paged_jax.params import SamplingParams

# The most model programs (prompt shapes and decode loops) one engine
# compiles: each costs a compile in warm-up and, on XLA:CPU, memory
# mappings of its code (Linux's vm.max_map_count bounds a process's).
MAX_MODEL_PROGRAMS = 12


class EngineStateError(RuntimeError):
  """An operation the engine's state does not allow now (requests running,
  asleep)."""


class LLMEngine:
  """Serves requests as they come, on the paged KV cache (vLLM's online form).

  Every `step` is one scheduling round: swapped-out groups come back,
  waiting requests are admitted, and the round's work runs in one launch.
  A round with prompt work is a ragged step: its prompt chunks (within the
  token budget, after one token for each decoding sequence) and one decode
  step of every running sequence go through the model together, so a
  request that arrives joins the next step. A round with only decoding runs
  the compiled decode loop, whose length adapts: 1 step after a round with
  prompt work, then twice as many each decode-only round, up to
  `num_decode_steps`. The host checks stop strings and builds the outputs
  between launches, so each launch's tokens stream as soon as it is read.

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
      launch longer. Not with speculation. False (default): the host
      reads every launch back before the next is dispatched.
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
    mesh=None,
    num_decode_steps: int = 8,
    max_logprobs: int = 5,
    max_beam_width: int = 4,
    prefill_width: int = 32,
    decode_row_buckets=None,
    async_scheduling: bool = False,
    speculative_config=None,
    automaton_capacity: structured.TableCapacity | None = None,
    warmup: bool = False,
    seed: int = 0,
    key: jax.Array | None = None,
  ):
    check_model(model)
    if not isinstance(cache_config, CacheConfig):
      raise TypeError(f"cache_config must be a pj.CacheConfig, got {type(cache_config).__name__}")
    max_num_seqs = cache_config.max_seqs if max_num_seqs is None else (max_num_seqs)
    for name, value, low, high in (
      ("max_num_seqs", max_num_seqs, 1, cache_config.max_seqs),
      ("max_num_batched_tokens", max_num_batched_tokens, 1, None),
      ("num_decode_steps", num_decode_steps, 1, None),
      ("max_logprobs", max_logprobs, 0, None),
      ("max_beam_width", max_beam_width, 1, None),
      ("prefill_width", prefill_width, 1, None),
    ):
      if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
      ):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    if decode_row_buckets is not None and not (
      isinstance(decode_row_buckets, (list, tuple))
      and all(
        isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= cache_config.max_seqs
        for b in decode_row_buckets
      )
    ):
      raise ValueError(
        f"decode_row_buckets must be a list or tuple of ints in 1..{cache_config.max_seqs} "
        f"(rows per data shard), got {decode_row_buckets!r}"
      )
    if max_num_batched_tokens < cache_config.block_size:
      raise ValueError(
        f"max_num_batched_tokens ({max_num_batched_tokens}) must hold at least one block "
        f"(block_size {cache_config.block_size})"
      )
    if preemption_mode not in PREEMPTION_MODES:
      raise ValueError(
        f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}"
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
    max_chunk = _max_chunk(cache_config, model.config)
    if self.speculative is not None:
      _check_speculation(self.speculative, cache_config, max_chunk, draft)
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
    self.cache = CacheManager(
      cache_config,
      model.config,
      kv_cache_dtype=kv_cache_dtype,
      mesh=mesh,
      max_chunk=max_chunk,
      draft_config=None if draft is None else draft.config,
      lookahead=0 if self.speculative is None else self.speculative.num_speculative_tokens,
    )
    self.runner = ModelRunner(
      model,
      self.cache,
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
    )
    _check_program_count(self.runner, max_num_batched_tokens, max_num_seqs)
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
    self.schedulers = [
      Scheduler(
        self.cache,
        max_num_seqs,
        max_num_batched_tokens,
        preemption_mode,
        self._max_len(),
        shard,
        self._automaton_room,
      )
      for shard in range(self.cache.num_shards)
    ]
    self._loads = np.zeros(self.cache.num_shards, np.int64)
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
    one decode token for each of `ModelRunner.ragged_rows` rows: `2 *
    prefill_width * 2**i` prompt tokens in `4 * 2**i` tiles per shard, up
    to the first shape that holds `max_num_batched_tokens` tokens (the
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
    runner, shards, steps = self.runner, self.cache.num_shards, self.num_decode_steps
    width = runner.prefill_width
    if self.speculative is None:
      prompts = [
        f"ragged step: {shards * t} prompt tokens in {shards * r} tiles of {width} and "
        f"{shards * runner.ragged_rows()} decode rows"
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

    Raises:
      RuntimeError: if requests are already running.
    """
    runner, steps = self.runner, self.num_decode_steps
    warm_prompts = runner.warm_up_prefill if self.speculative else runner.warm_up_ragged_step
    launches = [lambda b=b: warm_prompts(b) for b in runner.prefill_buckets()]
    launches += [
      lambda r=r: runner.warm_up_decode(steps, r, self.async_scheduling)
      for r in runner.decode_buckets()
    ]
    launches += [self.cache.warm_up, self._warm_up_request_keys]
    start = time.perf_counter()
    with compile_guard.count_compiles() as compiles:
      for launch in tqdm(launches, desc="warm-up", unit="program", leave=False):
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
    return admission_error(
      self.cfg,
      max_len=self._max_len(),
      max_num_seqs=self.schedulers[0].max_num_seqs,
      num_prompt_tokens=num_prompt_tokens,
      params=params,
      max_chunk=self.cache.max_chunk,
      lookahead=self.cache.lookahead,
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

  # Weights, sleep and wake.
  def update_weights(self, new_weights, *, abort_running: bool = False, check_finite=True) -> None:
    """Serves from now on with `new_weights`, without compiling.

    The weights are matched to the model's by path, cast to the engine's
    dtypes (float32 master weights for a bfloat16 engine) and put on its
    shardings (see `paged_jax.engine.weights.replace`), so every program
    runs as compiled; only a cast or a move between shardings compiles, once
    per leaf shape, on the first update that needs it. The prefix cache is
    dropped (`reset_prefix_cache`): its K/V came from the old weights. A
    speculative draft model keeps its weights.

    Args:
      new_weights: an `nnx.State` or `nnx.Module` of the model's class, or a
        pytree in its nesting (`nnx.to_pure_dict(state)`), in any dtype and
        on any sharding.
      abort_running: abort the unfinished requests first (the next `step`
        reports them with finish reason "abort") instead of refusing.
      check_finite: refuse weights with a NaN or infinity (one pass over
        them on the device before anything changes).

    Raises:
      EngineStateError: while requests are unfinished (without
        `abort_running`), or asleep at level 2 (`wake_up` first).
      WeightsMismatchError: naming the first missing, extra or misshapen
        weight; NonFiniteWeightsError: naming the first non-finite one.
        Nothing changes then.
    """
    if self.sleep_level == 2:
      raise EngineStateError("update_weights: the engine sleeps at level 2; call wake_up() first")
    self._idle_or_abort("update_weights", abort_running)
    self.runner.params = weights.replace(self.runner.params, new_weights, check_finite)
    self.reset_prefix_cache()

  def reset_prefix_cache(self) -> None:
    """Forgets every cached block (their K/V stays until overwritten; no
    prompt hits them again). The hit counters of `stats` go on.

    Raises:
      EngineStateError: while requests are unfinished.
    """
    self._idle_or_abort("reset_prefix_cache", False)
    self.cache.reset()

  def _idle_or_abort(self, what: str, abort_running: bool) -> None:
    """Aborts every unfinished request if `abort_running`; else raises
    `EngineStateError` if there is one."""
    unfinished = [g.request_id for g in self._groups.values() if not g.finished]
    if unfinished and not abort_running:
      raise EngineStateError(
        f"{what}: {len(unfinished)} request(s) unfinished (first {unfinished[0]!r}); let "
        f"them finish or pass abort_running=True"
      )
    for request_id in unfinished:
      self.abort_request(request_id)

  def sleep(self, level: int = 1) -> int:
    """Frees device memory while the engine is not needed (a training step).

    Level 1 deletes the KV pages (device and host swap pages); level 2 also
    copies the weights to host memory (NumPy) and drops their device arrays,
    which frees them unless something else holds them: the model given to
    the constructor shares its arrays with the engine until the first
    `update_weights` (a speculative draft model's weights stay). `wake_up`
    restores both. Unread outputs of finished or aborted requests are kept.

    Args:
      level: 1 or 2.

    Returns:
      The bytes of the arrays deleted or dropped.

    Raises:
      ValueError: for another level.
      EngineStateError: while requests are unfinished, or if already asleep.
    """
    if level not in (1, 2):
      raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    if self.sleep_level:
      raise EngineStateError(f"sleep: already asleep at level {self.sleep_level}")
    self._idle_or_abort("sleep", False)
    freed = self.cache.release_pages()
    if level == 2:
      freed += sum(leaf.nbytes for leaf in jax.tree.leaves(self.runner.params))
      self.runner.offload_weights()
    self.sleep_level = level
    return freed

  def wake_up(self) -> None:
    """Undoes `sleep`: zeroed KV pages, the block manager empty (no prefix
    cache), and after level 2 the weights back on the device; the same
    shapes and shardings, so nothing compiles. A no-op while awake."""
    if not self.sleep_level:
      return
    if self.sleep_level == 2:
      self.runner.reload_weights()
    self.cache.restore_pages()
    self.sleep_level = 0

  def _refuse_asleep(self, what: str) -> None:
    if self.sleep_level:
      raise EngineStateError(f"{what}: the engine sleeps (level {self.sleep_level}); wake_up first")

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

  def _record_launch(self, decoding, result, speculated: bool, seconds: float) -> None:
    """Tells the launch chooser a decode launch's time and speculation's
    tokens per row and step: counted, or for a plain launch those of prompt
    lookup's steps over the positions whose next `k` tokens are known (a
    launch takes the positions after the previous one's)."""
    chooser, k = self._chooser, self.speculative.num_speculative_tokens
    chooser.record_time(result.num_rows, speculated, seconds, result.steps)
    if speculated:
      chooser.record_tokens(result.num_rows, int(result.counts.sum()), result.row_steps)
      return
    steps = drawn = 0
    for slot, (group, seq) in decoding:
      if seq.finished:
        continue
      tokens = np.concatenate([group.prompt_token_ids, seq.token_ids]).astype(np.int32)
      drawn_before = len(tokens) - int(result.counts[slot])
      first = max(len(group.prompt_token_ids) + 1, drawn_before - k)
      at = range(first, max(first, len(tokens) - k))  # none while fewer than k follow
      row_steps, row_drawn = speculative.lookup_walk(tokens, at, self.speculative)
      steps, drawn = steps + row_steps, drawn + row_drawn
    chooser.record_tokens(result.num_rows, drawn, steps)

  def _retire(self, group: SequenceGroup) -> None:
    del self._groups[group.request_id]
    self._loads[group.shard] -= group.load

  # Steps.
  def step(self) -> list[RequestOutput]:
    """Runs one scheduling round: every shard's scheduler decides, the
    runner swaps pages, prefills and decodes, the output processor appends
    the tokens, and the schedulers take in the results. With
    `async_scheduling`, a round may instead read back the decode launch the
    last one dispatched ahead (dispatching the next one first when the
    round after would only decode the same rows again).

    Returns:
      A `RequestOutput` for every request that drew tokens or finished in
      this round (with `output_kind="final"`, only finished ones); while
      the engine sleeps, only those of requests aborted before.
    """
    if self.sleep_level:  # nothing runs; aborted requests are reported
      outputs, self._pending = self._pending, []
      return outputs
    start = time.perf_counter()
    touched = self._take_ahead(True) if self.running_ahead else self._round()
    outputs, self._pending = self._pending, []
    outputs += self._outputs(touched)
    self.timing["rounds"] += 1
    self.timing["wall_s"] += time.perf_counter() - start
    return outputs

  def _round(self) -> dict[str, SequenceGroup]:
    """A scheduling round (see `step`); returns the groups it touched."""
    rounds = [scheduler.schedule() for scheduler in self.schedulers]
    for out in rounds:
      for group in out.failed:
        self._finish(group, "error")
      for plan in out.swap_out:
        self.cache.move_out(plan)
      for plan in out.swap_in:
        self.cache.move_in(plan)
      self.runner.table.apply(out.rows)
    touched: dict[str, SequenceGroup] = {}
    chunks = [chunk for out in rounds for chunk in out.chunks]
    result = None
    if chunks and self.speculative is None:
      result = self._ragged_step(rounds, chunks, touched)
    elif chunks or self.runner.table.has_running_rows():
      if chunks:
        self._prefill(rounds, chunks, touched)
      result = self._decode(rounds, touched)
    self._update_or_defer(rounds, result)
    return touched

  def _prompt_draws(self, chunks):
    """`(samples, their constraints)` of a round's `chunks`: the sequences
    that draw their first token (see `ModelRunner.prefill`)."""
    drawing = [(chunk.group, s) for chunk in chunks for s in chunk.samples]
    samples = [(row, s.slot) for row, chunk in enumerate(chunks) for s in chunk.samples]
    return samples, _constraints(enumerate(drawing))

  def _ragged_step(self, rounds, chunks, touched):
    """Runs a round's chunks with one decode step of its running rows
    (`ModelRunner.ragged_step`) and takes in what they drew."""
    samples, sample_constraints = self._prompt_draws(chunks)
    draws, scores, result = self._timed(
      self.runner.ragged_step,
      chunks,
      samples,
      sample_constraints,
      _constraints(_decoding(rounds)),
    )
    for out in rounds:
      touched.update(self.processor.take_decode(out.decoding, result))
    touched.update(self.processor.take_prefill(chunks, draws, scores))
    for scheduler, out in zip(self.schedulers, rounds):
      self.runner.table.apply(scheduler.after_prefill(out))
    return result

  def _prefill(self, rounds, chunks, touched) -> None:
    """Runs a speculating round's chunks in their own launch."""
    samples, sample_constraints = self._prompt_draws(chunks)
    draws, scores = self._timed(self.runner.prefill, chunks, samples, sample_constraints)
    touched.update(self.processor.take_prefill(chunks, draws, scores))
    for scheduler, out in zip(self.schedulers, rounds):
      self.runner.table.apply(scheduler.after_prefill(out))

  def _decode(self, rounds, touched):
    """Runs the decode loop on the running rows (as many steps as
    `ModelRunner.decode` ramps up to) and takes in what they drew."""
    if not self.runner.table.has_running_rows():
      return None
    stop_on_finish = any(out.stop_on_finish for out in rounds)
    decoding = _decoding(rounds)
    speculate = self._chooser is None or self._chooser.speculate(self.runner.next_decode_rows())
    histories = []
    if self.speculative is not None and speculate:
      histories = [
        (slot, np.concatenate([group.prompt_token_ids, seq.token_ids]).astype(np.int32))
        for slot, (group, seq) in decoding
      ]
    launched = time.perf_counter()
    result = self._timed(
      self.runner.decode,
      self.num_decode_steps,
      stop_on_finish,
      _constraints(decoding),
      histories,
      speculate,
      self._may_run_ahead(),
    )
    seconds = time.perf_counter() - launched
    for out in rounds:
      touched.update(self.processor.take_decode(out.decoding, result))
    if self._chooser is not None:
      self._record_launch(decoding, result, speculate, seconds)
    return result

  def _may_run_ahead(self) -> bool:
    """Whether to dispatch the next decode launch before reading this one
    back: with `async_scheduling`, while rows decode and every shard's next
    round would only decode them again (`Scheduler.decodes_only`)."""
    return (
      self.async_scheduling
      and self.runner.table.has_running_rows()
      and all(scheduler.decodes_only() for scheduler in self.schedulers)
    )

  def _update_or_defer(self, rounds, result) -> None:
    """Hands the schedulers a round's decode `result`, or, while a launch
    runs ahead, keeps it until that one is read back: no block manager
    call goes between a launch and the one dispatched after it."""
    if self.running_ahead:
      self._deferred = (rounds, result)
      return
    for scheduler, out in zip(self.schedulers, rounds):
      scheduler.update(
        out,
        None if result is None else result.finished,
        result is not None and result.out_of_blocks[scheduler.shard],
      )

  def _take_ahead(self, may_run_ahead: bool) -> dict[str, SequenceGroup]:
    """Reads back the decode launch that runs ahead (dispatching the next
    one first, if `may_run_ahead` and the schedulers would take the last
    round's results without a block manager call); returns the groups it
    touched.

    Sequences that finished on the host (stop strings) before it ran drew
    tokens in it too: those are dropped, and their blocks freed (by the
    device, if it finished them there too).
    """
    rounds, before = self._deferred
    self._deferred = None
    run_ahead = (
      may_run_ahead
      and self._may_run_ahead()
      and self.runner.ahead_rows_fit()
      and not any(
        scheduler.update_frees(out, before.finished, before.out_of_blocks[scheduler.shard])
        for scheduler, out in zip(self.schedulers, rounds)
      )
    )
    result = self._timed(self.runner.take_ahead, run_ahead)
    for scheduler, out in zip(self.schedulers, rounds):
      scheduler.update(
        out, before.finished | result.finished, before.out_of_blocks[scheduler.shard]
      )
    rounds = [SchedulerOutput(s.shard, decoding=list(s.running)) for s in self.schedulers]
    touched: dict[str, SequenceGroup] = {}
    for out in rounds:
      touched.update(self.processor.take_decode(out.decoding, result))
    self._update_or_defer(rounds, result)
    return touched

  def _outputs(self, touched: dict[str, SequenceGroup]) -> list[RequestOutput]:
    """The outputs of the groups a round touched; retires finished ones."""
    outputs = []
    for group in touched.values():
      if group.finished:
        self._retire(group)
      if group.finished or (group.params.output_kind != "final" and not group.beam):
        outputs.append(self.processor.output(group))
    return outputs

  def _timed(self, function, *args):
    start = time.perf_counter()
    result = function(*args)
    self.timing["device_s"] += time.perf_counter() - start
    return result

  # Introspection.
  @property
  def state(self):
    """The block manager's state (for `pj.check_invariants` and queries) of
    an engine with one data shard; see `shard_state`."""
    if self.cache.num_shards > 1:
      raise ValueError(
        f"the engine has {self.cache.num_shards} data shards: use engine.shard_state(shard)"
      )
    return self.cache.shard_state(0)

  def shard_state(self, shard: int):
    """The block manager's state of data shard `shard`."""
    return self.cache.shard_state(shard)

  @property
  def running_ahead(self) -> bool:
    """Whether a decode launch dispatched ahead (`async_scheduling`) is
    not read back yet: the cache's state (`num_free_gpu_blocks`,
    `stats.prefix_cache_hit_rate`, `state`) is read after it."""
    return self.runner.ahead is not None

  def num_free_gpu_blocks(self) -> int:
    """Free GPU blocks of all data shards."""
    return sum(self.cache.num_free_gpu_blocks(shard) for shard in range(self.cache.num_shards))

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
      prefix_cache_hit_rate=self.cache.prefix_cache_hit_rate(),
      cow_copies=counters["cow_copies"],
      preemptions=sum(s.num_preemptions for s in self.schedulers),
      swaps=self.cache.num_swapped_blocks,
      **{name: counters[name] for name in counters if name.startswith("spec_decode_")},
    )


def _decoding(rounds) -> list:
  """`(slot, (group, seq))` of the rounds' sequences that hold a slot,
  beam groups' aside."""
  return [
    (s.slot, (group, s))
    for out in rounds
    for group in out.decoding
    if not group.beam
    for s in group.live()
    if s.slot >= 0
  ]


def _constraints(rows) -> list:
  """`(row, automaton, state)` of the constrained sequences among `(row,
  (group, seq))` pairs, for the runner's launches."""
  return [
    (row, group.automaton, seq.automaton_state)
    for row, (group, seq) in rows
    if group.automaton is not None
  ]


def _check_program_count(runner: ModelRunner, max_num_batched_tokens: int, max_num_seqs: int):
  """Raises ValueError if the engine's model programs (prompt shapes and
  decode loops, see `LLMEngine.compiled_programs`) pass `MAX_MODEL_PROGRAMS`."""
  prompts = len(runner.prefill_buckets())
  loops = len(runner.decode_kinds()) * len(runner.decode_buckets())
  if prompts + loops > MAX_MODEL_PROGRAMS:
    raise ValueError(
      f"this configuration compiles {prompts + loops} model programs, more than "
      f"{MAX_MODEL_PROGRAMS}: {prompts} prompt shapes (max_num_batched_tokens "
      f"{max_num_batched_tokens} in tiles of prefill_width {runner.prefill_width}) and {loops} "
      f"decode loops (row buckets {runner.decode_buckets()} for max_num_seqs {max_num_seqs}); "
      f"raise prefill_width, lower max_num_batched_tokens or pass fewer decode_row_buckets"
    )


def _check_speculation(config, cfg: CacheConfig, max_chunk: int | None, draft) -> None:
  """Refuses speculation that the cache cannot hold.

  Raises:
    ValueError: if `k` lookahead slots leave no room in a block table, a
      cache that frees blocks outside its window takes fewer than `k + 1`
      tokens per call or would hold a draft model's pages, or the draft
      does not follow the model protocol.
  """
  k = config.num_speculative_tokens
  if draft is not None:
    check_model(draft)
    if cfg.sliding_window is not None:
      raise ValueError(
        "a draft model runs on a cache that keeps every block: use a CacheConfig without "
        "sliding_window (each layer masks its own window) or the ngram method"
      )
  if k >= cfg.max_tokens_per_seq:
    raise ValueError(
      f"num_speculative_tokens {k} leaves no room in a block table of "
      f"{cfg.max_tokens_per_seq} tokens"
    )
  if max_chunk is not None and k + 1 > max_chunk:
    raise ValueError(
      f"num_speculative_tokens {k}: a step appends {k + 1} tokens, but this cache's window "
      f"takes at most {max_chunk} per call; lower k or widen CacheConfig.sliding_window"
    )


def _max_chunk(cfg: CacheConfig, model_config) -> int | None:
  """The most prompt tokens a sequence appends per round on a cache that
  frees the blocks outside its window (`window_chunk`); None on a cache
  that keeps every block.

  Raises:
    ValueError: if a layer attends beyond the cache's window, or the model's
      config has no `layer_window(layer)` to say what its layers see.
  """
  if cfg.sliding_window is None:
    return None
  layer_window = getattr(model_config, "layer_window", None)
  if layer_window is None:
    raise ValueError(
      f"this cache frees the blocks outside a window of {cfg.sliding_window} tokens, but "
      f"the model's config has no layer_window(layer) that says which keys its layers see; "
      f"use a CacheConfig without sliding_window"
    )
  windows = {layer: layer_window(layer) for layer in range(model_config.num_layers)}
  return window_chunk(cfg.sliding_window, windows)
