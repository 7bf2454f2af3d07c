"""The model runner: the launcher of the jitted programs.

It keeps the model and its row table (`paged_jax.engine.row_table`: every
sequence slot's decoding state between launches, the beams). A decode
launch runs only the slots that decode: each data shard's are packed into
the smallest row bucket that holds them (`paged_jax.engine.packing`),
except while a beam group runs, when the rows are every slot. The
scheduler's `RowChanges` say how the rows change; `prefill`, `ragged_step`
and `decode` launch `paged_jax.engine.programs` with the cache manager's
states and pages and hand them back changed. With async scheduling, a
decode launch runs ahead (`paged_jax.engine.run_ahead`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import sharding, structured
from paged_jax.engine import beam, programs, step_stream
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.packing import (
  PackedPrefill,
  decode_buckets,
  pack_decode_rows,
  pack_prefill,
  prompt_buckets,
  prompt_outputs,
)
from paged_jax.engine.row_table import DecodeResult, RowTable, per_slot, speculation_carry
from paged_jax.engine.run_ahead import AheadLaunch, RunAhead
from paged_jax.sampling import Draw

# How long the read of a streamed launch waits for a step before it asks
# whether the launch ended.
STREAM_WAIT_S = 0.05


class ModelRunner(RunAhead):
  """Runs the model over the cache manager's pages.

  Args:
    model: an NNX model following `paged_jax.engine.ModelProtocol`.
    cache_manager: the `CacheManager` whose states and pages the programs use.
    num_logprobs: top log-probabilities computed per token (static).
    stop_width: stop-token ids per row (static).
    mesh: the mesh the model's weights are split over, or None.
    max_beam_width: the most beams a beam-search request may ask for
      (static: it sizes the beam state).
    prefill_width: tokens per prefill attention tile (a chunk attends as
      tiles of it).
    max_prefill_tokens: the most prompt tokens of one data shard in a round.
    max_prefill_rows: the most prefill tiles of one data shard in a round.
    max_decode_rows: the most sequences of one data shard that decode at
      once (it bounds the default decode row buckets).
    decode_row_buckets: the decode launches' row counts per data shard,
      besides `max_seqs` (always one); None for the default (see
      `decode_buckets`).
    speculative: a `SpeculativeConfig`: every decode step speculates (no
      beam groups then); None: none does.
    draft_model: the draft model of a "draft_model" config (its K/V layers
      follow the model's in `cache_manager.kv`), or None.
    automaton_capacity: the `structured.TableCapacity` every launch's
      automaton table is packed to, constrained rows or not, so that each
      program compiles once; None: launches without constrained rows take
      no table (and ones with them a power-of-two bucket).
    arrival_watch: the `ArrivalWatch` whose flag ends a decode launch
      after the step in which it is set (`paged_jax.engine.arrivals`), or
      None: a launch runs its steps whatever arrives.
    step_stream: the `StepStream` into which decode launches publish their
      steps (`paged_jax.engine.step_stream`), or None: their tokens come
      back when they end.
  """

  def __init__(
    self,
    model,
    cache_manager: CacheManager,
    *,
    num_logprobs: int = 0,
    stop_width: int = 4,
    mesh=None,
    max_beam_width: int = 4,
    prefill_width: int = 32,
    max_prefill_tokens: int = 32,
    max_prefill_rows: int = 1,
    max_decode_rows: int | None = None,
    decode_row_buckets=None,
    speculative=None,
    draft_model=None,
    automaton_capacity: structured.TableCapacity | None = None,
    arrival_watch=None,
    step_stream=None,
  ):
    self.cache_manager = cache_manager
    self.arrival_watch = arrival_watch
    self.step_stream = step_stream
    self._parity = 0  # the step stream channel of the newest decode launch
    self._compile_pool = None  # within `compile_only`: where model launches compile
    self._compiles: list[concurrent.futures.Future] = []
    self.automaton_capacity = automaton_capacity
    self.speculative = speculative
    self.draft = {}  # the draft model's graphdef and params, as the programs take them
    if draft_model is not None:
      draft_model = placed(draft_model, mesh)
      graphdef, params = nnx.split(draft_model)
      self.draft = dict(draft_graphdef=programs.HashedGraph(graphdef), draft_params=params)
    self.prefill_width, self.max_prefill_rows = prefill_width, max_prefill_rows
    self.max_prefill_tokens = max_prefill_tokens
    self.max_decode_rows = (
      cache_manager.cfg.max_seqs if max_decode_rows is None else max_decode_rows
    )
    self.decode_row_buckets = decode_row_buckets
    model = placed(model, mesh)
    graphdef, params = nnx.split(model)
    # Committed to where they are, as `update_weights` and `wake_up` place
    # weights: the programs see the same argument kinds (no new compile).
    self.params = jax.device_put(params, jax.tree.map(lambda a: a.sharding, params))
    self.graphdef = programs.HashedGraph(graphdef)
    self.vocab_size = model.config.vocab_size
    beams = beam.Beams.create(
      cache_manager.num_slots, max_beam_width, cache_manager.cfg.max_tokens_per_seq
    )
    self.table = RowTable(
      cache_manager.num_slots, stop_width, jax.device_put(beams, cache_manager.replicated)
    )
    self.max_beam_width = max_beam_width
    self.num_logprobs = num_logprobs
    self.ahead: AheadLaunch | None = None  # dispatched, not yet read back
    self._placed_table = (None, None)  # (PackedAutomata, its table on the cache's devices)
    self._next_steps = 1  # the next decode launch's steps (see `decode`)
    self.counters = dict(
      cow_copies=0,
      peak_blocks=0,
      utilization_sum=0.0,
      decode_steps=0,
      loop_launches=0,
      loop_launches_ahead=0,
      prefill_positions=0,
      decode_positions=0,
      decode_tokens=0,
      spec_decode_num_drafts=0,
      spec_decode_num_draft_tokens=0,
      spec_decode_num_accepted_tokens=0,
    )

  # Weights.
  def offload_weights(self) -> None:
    """Copies the weights to host memory (NumPy) and drops the device arrays
    (their memory is freed once nothing else holds them)."""
    self._host_params = jax.device_get(self.params)
    self._param_shardings = jax.tree.map(lambda a: a.sharding, self.params)
    self.params = None

  def reload_weights(self) -> None:
    """Puts the weights `offload_weights` kept back on their shardings."""
    self.params = jax.device_put(self._host_params, self._param_shardings)
    self._host_params = self._param_shardings = None

  # Launches.
  def prefill_buckets(self) -> list[tuple[int, int]]:
    """Every shape (per data shard) of a launch with prompt chunks (a
    ragged step, or prefill while speculating); see `prompt_buckets`."""
    return prompt_buckets(self.prefill_width, self.max_prefill_tokens, self.max_prefill_rows)

  def _automata(self, num_rows: int, constraints):
    """The device table of the constrained rows' automata, packed to
    `automaton_capacity`, and every row's table state (`UNCONSTRAINED` for
    the others); no table without a capacity and constrained rows.

    Args:
      num_rows: rows of the launch.
      constraints: `(row, automaton, state)` triples, `state` in the
        automaton's own numbering.
    """
    states = np.full(num_rows, structured.UNCONSTRAINED, np.int32)
    if not constraints and self.automaton_capacity is None:
      return None, states
    packed = structured.pack_automata(
      [automaton for _, automaton, _ in constraints], self.vocab_size, self.automaton_capacity
    )
    for row, automaton, state in constraints:
      states[row] = packed.initial_state(automaton) + state
    if self._placed_table[0] is not packed:  # placed once per table, not per launch
      self._placed_table = (packed, jax.device_put(packed.table, self.cache_manager.replicated))
    return self._placed_table[1], states

  def prefill(self, chunks, samples, constraints=()) -> tuple[Draw, list]:
    """Runs prompt chunks, then draws token 0 of the sequences in `samples`.

    Each data shard's chunks are packed one after another into one row of
    tokens for the model's matmuls, and cut into tiles of `prefill_width`
    tokens for attention (a chunk's last tile padded); the shards' tokens
    and tiles are padded to a shape of `prefill_buckets`, so prefill
    compiles once per bucket, whatever the chunks.

    Args:
      chunks: `PrefillChunk`s: `tokens` go to positions `start ..` of the
        sequence in `seq.slot`, whose blocks are allocated (positions before
        `write_from` already hold their K/V); `next_tokens`, when not None,
        are scored.
      samples: `(chunk, slot)` pairs: draw token 0 of `slot` (with its row's
        sampling parameters) from the logits chunk number `chunk` ends with.
      constraints: `(sample, automaton, state)` triples: sample number
        `sample` draws among the tokens `automaton` allows in `state`.

    Returns:
      `(draws, scores)`: NumPy draws, one per pair of `samples`, and per
      chunk None or its `PromptScores` (NumPy, one entry per token).
    """
    packed, last_token_of, sample_slots = self._pack_prompts(chunks, samples)
    table, draw_states = self._automata(last_token_of.shape[0], constraints)
    if table is None:  # the same program as warm-up's, which has no states
      draw_states = None
    draw, scores = self._launch_prefill(packed, last_token_of, sample_slots, table, draw_states)
    return prompt_outputs(chunks, packed, len(samples), draw, scores)

  def _pack_prompts(self, chunks, samples, decode_rows=None):
    """`(packed chunks, last_token_of, sample slots)` of a launch with
    prompt chunks (see `prefill`) and room for `decode_rows` per shard (see
    `pack_prefill`): one draw per slot, whatever the samples."""
    cache_manager = self.cache_manager
    num_shards, per_shard = cache_manager.num_shards, cache_manager.cfg.max_seqs
    packed = pack_prefill(
      chunks, self.prefill_width, num_shards, per_shard, self.prefill_buckets(), decode_rows
    )
    rows = 0 if decode_rows is None else int(np.sum(decode_rows))
    self.counters["prefill_positions"] += packed.tokens.size - rows
    num_draws = num_shards * per_shard
    last_token_of = np.zeros(num_draws, np.int32)
    sample_slots = np.zeros(num_draws, np.int32)
    for i, (chunk, slot) in enumerate(samples):
      last_token_of[i] = packed.first_token[chunk] + chunks[chunk].tokens.size - 1
      sample_slots[i] = slot
    return packed, last_token_of, sample_slots

  def _launch_prefill(
    self, packed: PackedPrefill, last_token_of, samples, table=None, draw_states=None
  ):
    cache_manager = self.cache_manager
    launched = self._run(
      programs.prefill_step,
      self.graphdef,
      self.params,
      cache_manager.kv,
      cache_manager.state,
      *packed.arrays(),
      last_token_of,
      jax.tree.map(lambda a: a[samples], self.table.sampling),
      self.num_logprobs,
      table,
      draw_states,
      **self.draft,
    )
    if launched is None:  # compiled only
      return None, None
    (draw, scores), kv = launched
    cache_manager.take_launch(kv)
    return draw, scores

  def decode_buckets(self) -> list[int]:
    """Every row count (per data shard) a decode launch can have, ascending
    (see `packing.decode_buckets`)."""
    return decode_buckets(
      self.cache_manager.cfg.max_seqs, self.max_decode_rows, self.decode_row_buckets
    )

  def ragged_rows(self) -> int:
    """The decode rows (per data shard) of every ragged step: the smallest
    decode bucket that holds `max_decode_rows`, so that the step's shape
    follows its prompt tokens alone (one program per prompt bucket)."""
    per_shard = self.cache_manager.cfg.max_seqs
    return next(b for b in self.decode_buckets() if b >= min(self.max_decode_rows, per_shard))

  def _ragged_row_slots(self) -> np.ndarray | None:
    """The slots of a ragged step's rows: the running ones packed into
    `ragged_rows` per shard, or every slot (None) while a beam group runs
    or when more rows run."""
    if np.any(self.table.in_beam_group):
      return None
    running = (self.table.slots >= 0).reshape(self.cache_manager.num_shards, -1)
    return pack_decode_rows(running, sorted({self.ragged_rows(), self.cache_manager.cfg.max_seqs}))

  def decode_kinds(self) -> list:
    """The kinds of decode launch: the `speculative` config (speculating
    steps) and/or None (plain ones); an adaptive config launches both."""
    if self.speculative is None:
      return [None]
    return [self.speculative, None] if self.speculative.adaptive else [self.speculative]

  def next_decode_rows(self) -> int:
    """The rows (over every data shard) the next decode launch runs."""
    row_slots = self._decode_row_slots()
    return self.table.slots.shape[0] if row_slots is None else row_slots.shape[0]

  def _decode_row_slots(self) -> np.ndarray | None:
    """The slots of the next decode launch's rows (see `pack_decode_rows`);
    None for every slot in order, while a beam group runs."""
    if np.any(self.table.in_beam_group):
      return None
    running = (self.table.slots >= 0).reshape(self.cache_manager.num_shards, -1)
    return pack_decode_rows(running, self.decode_buckets())

  @contextlib.contextmanager
  def compile_only(self, threads: int):
    """Within, the model launches (the `ragged_step`, `prefill_step` and
    `decode_loop` programs) run nothing: each lowers its program on the
    calling thread and compiles it on one of `threads` threads, and the
    pages and states stay as they are. Yields the compiles' futures (a
    failed compile raises from its `result()`); on leaving, waits for them.
    A launch of the same shapes after that runs at once: JAX keeps what
    `lower(...).compile()` built for the program's later calls."""
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="compile") as pool:
      self._compile_pool, self._compiles = pool, []
      try:
        yield self._compiles
      finally:
        self._compile_pool = None

  def _run(self, program, *args, **kwargs):
    """`program(*args, **kwargs)`; within `compile_only`, None, with the
    program lowered and its compile sent to the pool."""
    if self._compile_pool is None:
      return program(*args, **kwargs)
    lowered = program.lower(*args, **kwargs)
    self._compiles.append(self._compile_pool.submit(lowered.compile))
    return None

  def _refuse_while_decoding(self) -> None:
    if self.table.has_running_rows():
      raise RuntimeError("warm-up launches only while no row decodes")

  def warm_up_prefill(self, shape: tuple[int, int]) -> None:
    """Compiles prefill of `shape` (`(tokens, tiles)` per shard, one of
    `prefill_buckets`) on tokens that do nothing (the pages and states stay
    as they are).

    Raises:
      RuntimeError: if a row decodes.
    """
    self._refuse_while_decoding()
    no_draws = np.zeros(self.cache_manager.num_slots, np.int32)
    packed = PackedPrefill.empty(self.cache_manager.num_shards, shape, self.prefill_width)
    self._launch_prefill(packed, no_draws, no_draws, *self._unconstrained(no_draws.size))

  def warm_up_decode(self, num_steps: int, rows_per_shard: int, run_ahead: bool = False) -> None:
    """Compiles the decode loop of `num_steps` steps on `rows_per_shard`
    rows per shard that do nothing (for every slot: with beams, and the
    start and end of a beam group; the pages, states and beams stay as they
    are), and with `run_ahead` the carry of a launch that continues it and
    that launch (on JAX 0.12 the loop's outputs are another kind of
    argument than the host's arrays: another program).

    Raises:
      RuntimeError: if a row decodes.
    """
    self._refuse_while_decoding()
    row_slots = self._idle_row_slots(rows_per_shard)
    table, _ = self._unconstrained(0)
    for speculating in self.decode_kinds():
      loop = self.decode_carry(num_steps, row_slots, speculating=speculating)
      loop = self._launch_decode(loop, row_slots, False, table, speculating)
    if self._compile_pool is not None:
      return  # the rest takes a launch's outputs, or is small: it compiles as it runs
    if run_ahead:  # a launch on a continued carry: its arrays are the loop's outputs
      loop = self._launch_decode(self._continued(loop, 1), row_slots, False, table)
    if loop.beams is not None:
      no_group = self.table.group_slots([])  # starting and forgetting a group (results dropped)
      programs.start_beams(self.table.beams, no_group, 1, 1.0)
      programs.clear_beams(self.table.beams, no_group)

  def _unconstrained(self, num_rows: int):
    """`(table, states)` of a launch of `num_rows` draws without
    constrained rows, as `_automata` gives them (None, None without a
    capacity): warm-up compiles the programs that serving runs."""
    table, states = self._automata(num_rows, ())
    return table, None if table is None else states

  def _idle_row_slots(self, rows_per_shard: int) -> np.ndarray | None:
    """The rows of a warm-up launch: `rows_per_shard` rows per shard that
    run no slot, or None for every slot (see `_decode_row_slots`)."""
    if rows_per_shard == self.cache_manager.cfg.max_seqs:
      return None
    return np.full(self.cache_manager.num_shards * rows_per_shard, -1, np.int32)

  def _launch_decode(
    self, carry, row_slots, stop_on_finish: bool, table=None, speculating=None
  ) -> programs.DecodeLoop:
    loop = self._run(
      programs.decode_loop,
      self.graphdef,
      self.params,
      self.table.row_params(row_slots),
      carry,
      jnp.array(stop_on_finish),
      table,
      speculating,
      **(self.draft if speculating is not None else {}),
      **self._arrival_args(),
      **self._stream_args(),
    )
    if loop is None:  # compiled only
      return carry
    self._keep(loop)
    return loop

  def _arrival_args(self) -> dict:
    """The decode loop's arrival check: the engine's watch and how it is read."""
    watch = self.arrival_watch
    return {} if watch is None else dict(arrival_watch=watch.operand, arrival_check=watch.check)

  def _stream_args(self) -> dict:
    """The decode loop's step stream: the other channel than the last
    launch's (two may be in flight), emptied, and how it is published to."""
    stream = self.step_stream
    if stream is None:
      return {}
    self._parity ^= 1
    stream.clear(self._parity)
    return dict(stream_channel=stream.operands[self._parity], stream_mode=stream.mode)

  def _stream(self, loop: programs.DecodeLoop, row_slots, parity: int, on_step) -> None:
    """Hands each step of a dispatched launch on `row_slots` that
    publishes into channel `parity` to `on_step(slots, draw)` (the slots
    that drew in that step, their `Draw` of `[n]` and `[n, k]` arrays) as
    it comes, until the launch's end mark."""
    slots = self.table.slots_of(row_slots)
    rows, k = slots.shape[0], self.num_logprobs
    while True:
      done = loop.step.is_ready()  # a failed launch marks no end; its read raises
      published = self.step_stream.take(parity, rows, k, 0.0 if done else STREAM_WAIT_S)
      for step in published:
        if step.column == step_stream.ENDED:
          return
        drew = step.drew & (slots >= 0)
        draw = Draw(step.tokens, step.logprob, step.top_ids, step.top_logprobs)
        on_step(slots[drew], jax.tree.map(lambda a, drew=drew: a[drew], draw))
      if done and not published:
        return

  def _keep(self, loop: programs.DecodeLoop) -> None:
    """Takes a dispatched launch's pages, manager state and beams (maybe
    not computed yet) as the ones the next launch starts from."""
    self.cache_manager.take_launch(loop.kv, loop.state)
    if loop.beams is not None:
      self.table.beams = loop.beams

  def decode_carry(
    self,
    num_steps: int,
    row_slots,
    automaton_state=None,
    histories=(),
    speculating=None,
    max_steps: int | None = None,
  ) -> programs.DecodeLoop:
    """The decode loop's carry for a launch on the slots `row_slots` (see
    `_decode_row_slots`) with draws for `num_steps` steps, of which it runs at
    most `max_steps` (default all; a traced value: no new compile), the
    rows' automata in `automaton_state` (table states; None:
    unconstrained), and with `speculating` (a `SpeculativeConfig`) the
    rows' tokens in `histories` (`(slot, token ids)` pairs)."""
    slots = self.table.slots_of(row_slots)
    take = lambda a: a[np.maximum(slots, 0)]
    num_rows, k = slots.shape[0], self.num_logprobs
    if automaton_state is None:
      automaton_state = np.full(num_rows, structured.UNCONSTRAINED, np.int32)
    width = num_steps * (1 + _num_speculative(speculating))
    draws = Draw(
      tokens=np.zeros((num_rows, width), np.int32),
      logprob=np.zeros((num_rows, width), np.float32),
      top_ids=np.zeros((num_rows, width, k), np.int32),
      top_logprobs=np.zeros((num_rows, width, k), np.float32),
    )
    # Placed as the loop's outputs are, so that a launch continuing one
    # (`programs.continue_decoding`) runs the same program.
    rows_carry = jax.device_put(
      dict(
        slots=np.where(slots >= 0, take(self.table.slots), -1).astype(np.int32),
        last_token=take(self.table.last_token),
        num_generated=take(self.table.num_generated),
        limit=take(self.table.limit),
        automaton_state=automaton_state,
        draws=draws,
        max_steps=np.int32(num_steps if max_steps is None else max_steps),
        step=np.int32(0),
        rows_run=np.int32(0),
        out_of_blocks=np.zeros(self.cache_manager.num_shards, bool),
        finished_any=np.array(False),
        cow_copies=np.int32(0),
        peak_blocks=np.int32(0),
        utilization_sum=np.float32(0.0),
      ),
      self.cache_manager.replicated,
    )
    return programs.DecodeLoop(
      state=self.cache_manager.state,
      kv=self.cache_manager.kv,
      beams=self.table.beams if row_slots is None and self.speculative is None else None,
      spec=None
      if speculating is None
      else speculation_carry(
        slots,
        histories,
        speculating.num_speculative_tokens,
        self.cache_manager.cfg.max_tokens_per_seq,
      ),
      **rows_carry,
    )

  def decode(
    self,
    num_steps: int,
    stop_on_finish: bool,
    constraints=(),
    histories=(),
    speculate=True,
    run_ahead: bool = False,
    on_step=None,
  ) -> DecodeResult:
    """Runs decode steps of the running rows (stopping after a step in
    which a row finished if `stop_on_finish`): 1 after a ragged step, then
    twice as many as the launch before, up to `num_steps`.

    Args:
      num_steps: the decode loop's steps (its shape: one program for every
        launch length; a speculating step draws up to
        `num_speculative_tokens + 1` tokens per row).
      stop_on_finish: whether to stop after a step in which a row finished.
      constraints: `(slot, automaton, state)` triples of the constrained
        rows: each draws among the tokens its automaton allows, from
        `state` (the state after its last token) on.
      histories: when speculating, `(slot, token ids)` of the running
        rows: prompt and output so far, the last token included.
      speculate: with a `speculative` config, whether this launch's steps
        speculate (else they are plain ones).
      run_ahead: whether to dispatch the next launch on the same rows
        before reading this one back (see `take_ahead`), if the rows still
        fill their bucket then (`_rows_still_fill`); only without
        `stop_on_finish`, speculation or a beam group, and not when the
        loop does not launch.
      on_step: with a `step_stream`, what takes each step of the launch
        while it runs (see `_stream`), if it publishes them
        (`programs.streams`); the result still holds every step's draws.
    """
    speculating = self.speculative if speculate else None
    steps = self._launch_steps(num_steps)
    row_slots = self._decode_row_slots()
    table, automaton_state = self._automata(*self.table.row_constraints(row_slots, constraints))
    loop = self.decode_carry(num_steps, row_slots, automaton_state, histories, speculating, steps)
    streaming = on_step is not None and self.step_stream is not None
    streaming = streaming and programs.streams(speculating)
    loop = self._launch_decode(loop, row_slots, stop_on_finish, table, speculating)
    parity = self._parity
    if run_ahead and self._rows_still_fill(row_slots, steps):
      self._run_ahead(loop, row_slots, table)
    if streaming:
      self._stream(loop, row_slots, parity, on_step)
    result = self._take_step_results(row_slots, loop)
    self._launched(result)
    return result

  def _launch_steps(self, num_steps: int) -> int:
    """The steps of the decode launch about to be dispatched (of a loop of
    `num_steps`), and those of the next: twice as many, up to `num_steps`.
    A decode-only stretch so ramps up from one step after a ragged step."""
    steps = min(self._next_steps, num_steps)
    self._next_steps = min(2 * steps, num_steps)
    return steps

  def _take_step_results(self, row_slots, loop, padded: bool = True) -> DecodeResult:
    """Takes the carry of a launch on `row_slots` (see `_decode_row_slots`; a decode
    loop, or a ragged step) back into the pages, the beams and the slots'
    state, and returns what it did per slot. The model computed every row
    (`padded`, a decode loop) or only the decoding ones (a ragged step)."""
    slots = self.table.slots_of(row_slots)
    counts, finished = self.table.take(slots, loop)
    to_slots = lambda a: per_slot(np.asarray(a), slots, counts.shape[0])
    counters = self.counters
    counters["cow_copies"] += int(loop.cow_copies)
    counters["peak_blocks"] = max(counters["peak_blocks"], int(loop.peak_blocks))
    counters["utilization_sum"] += float(loop.utilization_sum)
    steps = int(loop.step)
    counters["decode_steps"] += steps
    counters["decode_positions"] += slots.shape[0] * steps if padded else int(loop.rows_run)
    counters["decode_tokens"] += int(loop.rows_run)
    if loop.spec is not None:
      drafts, draft_tokens, accepted = np.asarray(loop.spec.counts).tolist()
      counters["spec_decode_num_drafts"] += drafts
      counters["spec_decode_num_draft_tokens"] += draft_tokens
      counters["spec_decode_num_accepted_tokens"] += accepted
    return DecodeResult(
      draws=jax.tree.map(to_slots, loop.draws),
      counts=counts,
      finished=finished,
      out_of_blocks=np.array(loop.out_of_blocks),
      finished_beams=self.table.finished_beams(),
      num_rows=slots.shape[0],
      steps=steps,
      row_steps=int(loop.rows_run),
    )

  def ragged_step(
    self, chunks, samples, constraints=(), row_constraints=(), num_steps: int = 1
  ) -> tuple[Draw, list, DecodeResult]:
    """Runs one engine step: prompt chunks and one decode step of the
    running rows in one ragged launch (`programs.ragged_step`), drawing
    token 0 of the sequences in `samples`; its shape is the smallest prompt
    bucket that holds each shard's chunks and a token per decoding row. Not
    while speculating (prefill runs apart then).

    Args:
      chunks, samples, constraints: as for `prefill`.
      row_constraints: `(slot, automaton, state)` triples of the
        constrained running rows, as for `decode`.
      num_steps: columns of the result's draws (the step's are the first).

    Returns:
      `(draws, scores, result)`: `prefill`'s outputs, and the decode
      step's `DecodeResult` (per slot).
    """
    decoding = (self.table.slots >= 0).reshape(self.cache_manager.num_shards, -1)
    packed, last_token_of, sample_slots = self._pack_prompts(chunks, samples, decoding.sum(1))
    row_slots = self._ragged_row_slots()
    num_rows, triples = self.table.row_constraints(row_slots, row_constraints)
    num_draws = last_token_of.shape[0]
    drawing = [(num_rows + sample, automaton, state) for sample, automaton, state in constraints]
    table, states = self._automata(num_rows + num_draws, triples + drawing)
    loop = self.decode_carry(num_steps, row_slots, states[:num_rows])
    draw_states = None if table is None else states[num_rows:]
    loop, draw, scores = self._launch_ragged_step(
      loop, row_slots, packed, last_token_of, sample_slots, table, draw_states
    )
    result = self._take_step_results(row_slots, loop, padded=False)
    self._next_steps = 1
    draws, scores = prompt_outputs(chunks, packed, len(samples), draw, scores)
    return draws, scores, result

  def _launch_ragged_step(
    self,
    loop,
    row_slots,
    packed: PackedPrefill,
    last_token_of,
    samples,
    table=None,
    draw_states=None,
  ):
    launched = self._run(
      programs.ragged_step,
      self.graphdef,
      self.params,
      self.table.row_params(row_slots),
      loop,
      *packed.arrays(),
      last_token_of,
      jax.tree.map(lambda a: a[samples], self.table.sampling),
      self.num_logprobs,
      table,
      draw_states,
    )
    if launched is None:  # compiled only
      return loop, None, None
    loop, draw, scores = launched
    self._keep(loop)
    return loop, draw, scores

  def warm_up_ragged_step(self, shape: tuple[int, int], num_steps: int = 1) -> None:
    """Compiles `ragged_step` of prompt `shape` (see `warm_up_prefill`), on
    tokens and rows that do nothing.

    Raises:
      RuntimeError: if a row decodes.
    """
    self._refuse_while_decoding()
    row_slots = self._idle_row_slots(self.ragged_rows())
    no_draws = np.zeros(self.cache_manager.num_slots, np.int32)
    packed = PackedPrefill.empty(self.cache_manager.num_shards, shape, self.prefill_width)
    loop = self.decode_carry(num_steps, row_slots)
    self._launch_ragged_step(
      loop, row_slots, packed, no_draws, no_draws, *self._unconstrained(no_draws.size)
    )


def _num_speculative(speculating) -> int:
  return 0 if speculating is None else speculating.num_speculative_tokens


def placed(model, mesh):
  """`model` with its parameters on `mesh` (`sharding.shard_model`), or, with
  no mesh, a copy of it sharing its arrays with its quantized kernels readied
  for the default device (`sharding.place_quantized`)."""
  if mesh is not None:
    return sharding.shard_model(model, mesh)
  return sharding.place_quantized(nnx.clone(model), None)
