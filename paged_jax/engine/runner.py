"""The model runner: launches the jitted programs on the decode rows.

It keeps the model and, between launches, every sequence slot's decoding
state on the host (whether the slot decodes, from which token, with which
sampling parameters; small NumPy arrays) and the beam state on the device.
A decode launch runs only the slots that decode: each data shard's are
packed into the smallest row bucket that holds them (`decode_buckets`),
except while a beam group runs, when the rows are every slot. The scheduler's
`RowChanges` say how the rows change; `prefill` and `decode` launch
`paged_jax.engine.programs` with the cache manager's states and pages and
hand them back changed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import sharding, structured
from paged_jax.engine import beam, programs
from paged_jax.engine.cache_manager import CacheManager
from paged_jax.engine.sampling import Draw, RowParams
from paged_jax.engine.scheduler import RowChanges


@dataclasses.dataclass
class DecodeResult:
  """What one launch of the decode loop did.

  Attributes:
    draws: NumPy draws `[S, num_steps]` of every row.
    counts: int `[S]`, the tokens each row drew.
    finished: bool `[S]`, the rows that finished on the device (their
      blocks are freed).
    out_of_blocks: bool `[D]`, the data shards whose blocks ran out (the
      loop stopped for them).
    beams_done: bool `[S]`, leaders whose beam group has finished.
    num_rows: the launch's rows (its row bucket, over every data shard).
    steps: steps the loop ran.
    row_steps: rows that decoded, summed over the steps.
  """

  draws: Draw
  counts: np.ndarray
  finished: np.ndarray
  out_of_blocks: np.ndarray
  beams_done: np.ndarray
  num_rows: int = 0
  steps: int = 0
  row_steps: int = 0


class ModelRunner:
  """Runs the model over the cache manager's pages.

  Args:
    model: an NNX model following `paged_jax.engine.ModelProtocol`.
    cache: the cache manager whose states and pages the programs use.
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
      follow the model's in `cache`), or None.
    automaton_capacity: the `structured.TableCapacity` every launch's
      automaton table is packed to, constrained rows or not, so that each
      program compiles once; None: launches without constrained rows take
      no table (and ones with them a power-of-two bucket).
  """

  def __init__(
    self,
    model,
    cache: CacheManager,
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
  ):
    self.cache = cache
    self.automaton_capacity = automaton_capacity
    self.speculative = speculative
    self.draft = {}  # the draft model's graphdef and params, as the programs take them
    if draft_model is not None:
      if mesh is not None:
        draft_model = sharding.shard_model(draft_model, mesh)
      graphdef, params = nnx.split(draft_model)
      self.draft = dict(draft_graphdef=programs.HashedGraph(graphdef), draft_params=params)
    self.prefill_width, self.max_prefill_rows = prefill_width, max_prefill_rows
    self.max_prefill_tokens = max_prefill_tokens
    self.max_decode_rows = cache.cfg.max_seqs if max_decode_rows is None else max_decode_rows
    self.decode_row_buckets = decode_row_buckets
    if mesh is not None:
      model = sharding.shard_model(model, mesh)
    graphdef, params = nnx.split(model)
    # Committed to where they are, as `update_weights` and `wake_up` place
    # weights: the programs see the same argument kinds (no new compile).
    self.params = jax.device_put(params, jax.tree.map(lambda a: a.sharding, params))
    self.graphdef = programs.HashedGraph(graphdef)
    self.vocab_size = model.config.vocab_size
    num_rows = cache.num_slots
    self.beams = jax.device_put(
      beam.Beams.create(num_rows, max_beam_width, cache.cfg.max_tokens_per_seq), cache.replicated
    )
    self.max_beam_width = max_beam_width
    self.num_logprobs = num_logprobs
    key_words = jax.random.key_data(jax.random.key(0)).shape[-1]
    self.rows = RowParams(
      temperature=np.zeros(num_rows, np.float32),
      top_k=np.zeros(num_rows, np.int32),
      top_p=np.ones(num_rows, np.float32),
      key_data=np.zeros((num_rows, key_words), np.uint32),
      stop_ids=np.full((num_rows, stop_width), -1, np.int32),
      processed=np.zeros(num_rows, bool),
    )
    self.seq_ids = np.full(num_rows, -1, np.int32)
    self.last_token = np.zeros(num_rows, np.int32)
    self.num_generated = np.zeros(num_rows, np.int32)
    self.limit = np.zeros(num_rows, np.int32)
    self.in_beam_group = np.zeros(num_rows, bool)
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

  # Rows.
  def apply(self, changes: RowChanges) -> None:
    """Carries out the scheduler's row changes, in their order (see
    `RowChanges`)."""
    stopped = np.asarray(changes.stop, np.int64)
    self.seq_ids[stopped] = -1
    for slots in changes.clear_beams:
      self.beams = programs.clear_beams(self.beams, self._group_slots(slots))
      self.in_beam_group[slots] = False
    rows = self.rows
    for row in changes.new_rows:
      slot = row.slot
      rows.temperature[slot], rows.top_k[slot] = row.temperature, row.top_k
      rows.top_p[slot], rows.key_data[slot] = row.top_p, row.key_data
      rows.processed[slot] = row.processed
      rows.stop_ids[slot] = -1
      rows.stop_ids[slot, : len(row.stop_ids)] = row.stop_ids
      self.limit[slot] = row.limit
    for slots, width, length_penalty in changes.new_beams:
      self.beams = programs.start_beams(self.beams, self._group_slots(slots), width, length_penalty)
      self.in_beam_group[slots] = True
    for slot, last_token, num_generated in changes.start:
      self.seq_ids[slot] = slot
      self.last_token[slot], self.num_generated[slot] = last_token, num_generated
    resumed = np.asarray(changes.resume, np.int64)
    self.seq_ids[resumed] = resumed

  def _group_slots(self, slots) -> np.ndarray:
    """A beam group's slots padded with -1 to the group capacity (one
    compile of the beam programs whatever the width)."""
    padded = np.full(self.beams.slots.shape[1], -1, np.int32)
    padded[: len(slots)] = slots
    return padded

  def has_running_rows(self) -> bool:
    return bool(np.any(self.seq_ids >= 0))

  def hypotheses(self, leader: int, count: int):
    """The best `count` finished hypotheses of a beam group, best first:
    `(tokens, cumulative logprob, stopped)` triples."""
    b = jax.tree.map(lambda a: np.asarray(a)[leader], self.beams)
    return [
      (b.hyp_tokens[i, : b.hyp_len[i]].tolist(), float(b.hyp_logprob[i]), bool(b.hyp_stopped[i]))
      for i in range(count)
      if b.hyp_score[i] > -np.inf
    ]

  def _beams_done(self) -> np.ndarray:
    """bool `[S]`, leaders whose beam group finished; while no group runs
    none, read without waiting for a launch that runs ahead."""
    if not np.any(self.in_beam_group):
      return np.zeros(self.seq_ids.shape[0], bool)
    return np.asarray(self.beams.done)

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
      self._placed_table = (packed, jax.device_put(packed.table, self.cache.replicated))
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
    return self._prompt_outputs(chunks, packed, len(samples), draw, scores)

  def _pack_prompts(self, chunks, samples):
    """`(packed chunks, last_token_of, sample slots)` of a launch with
    prompt chunks (see `prefill`): one draw per slot, whatever the samples."""
    cache = self.cache
    num_shards, per_shard = cache.num_shards, cache.cfg.max_seqs
    packed = pack_prefill(chunks, self.prefill_width, num_shards, per_shard, self.prefill_buckets())
    self.counters["prefill_positions"] += packed.tokens.size
    num_draws = num_shards * per_shard
    last_token_of = np.zeros(num_draws, np.int32)
    sample_slots = np.zeros(num_draws, np.int32)
    for i, (chunk, slot) in enumerate(samples):
      last_token_of[i] = packed.first_token[chunk] + chunks[chunk].tokens.size - 1
      sample_slots[i] = slot
    return packed, last_token_of, sample_slots

  @staticmethod
  def _prompt_outputs(chunks, packed, num_samples: int, draw, scores) -> tuple[Draw, list]:
    """A prompt launch's device outputs as `prefill` returns them."""
    draws = jax.tree.map(lambda a: np.asarray(a)[:num_samples], draw)
    scored = [chunk.next_tokens is not None for chunk in chunks]
    if any(scored):
      scores = jax.tree.map(lambda a: np.asarray(a).reshape(-1, *a.shape[2:]), scores)
    return draws, [
      jax.tree.map(lambda a, first=first, size=chunk.tokens.size: a[first : first + size], scores)
      if wanted
      else None
      for chunk, first, wanted in zip(chunks, packed.first_token, scored)
    ]

  def _launch_prefill(
    self, packed: PackedPrefill, last_token_of, samples, table=None, draw_states=None
  ):
    cache = self.cache
    (draw, scores), cache.kv = programs.prefill(
      self.graphdef,
      self.params,
      cache.kv,
      cache.state,
      *packed.arrays(),
      last_token_of,
      jax.tree.map(lambda a: a[samples], self.rows),
      self.num_logprobs,
      table,
      draw_states,
      **self.draft,
    )
    return draw, scores

  def decode_buckets(self) -> list[int]:
    """Every row count (per data shard) a decode launch can have, ascending:
    `decode_row_buckets`, or by default the powers of four below
    `max_seqs` that `max_decode_rows` reaches; then
    `max_seqs` (every slot: a beam group's launches, or a full shard).
    Powers of four, not two: each bucket costs a compile of the decode loop
    (in warm-up), and a launch pads to at most four times its rows."""
    per_shard, buckets = self.cache.cfg.max_seqs, [1]
    if self.decode_row_buckets is not None:
      return sorted({*self.decode_row_buckets, per_shard})
    while buckets[-1] < min(self.max_decode_rows, per_shard):
      buckets.append(4 * buckets[-1])
    return [b for b in buckets if b < per_shard] + [per_shard]

  def ragged_rows(self) -> int:
    """The decode rows (per data shard) of every ragged step: the smallest
    decode bucket that holds `max_decode_rows`, so that the step's shape
    follows its prompt tokens alone (one program per prompt bucket)."""
    per_shard = self.cache.cfg.max_seqs
    return next(b for b in self.decode_buckets() if b >= min(self.max_decode_rows, per_shard))

  def _ragged_step_rows(self) -> np.ndarray | None:
    """The slots of a ragged step's rows: the running ones packed into
    `ragged_rows` per shard, or every slot (None) while a beam group runs
    or when more rows run."""
    if np.any(self.in_beam_group):
      return None
    running = (self.seq_ids >= 0).reshape(self.cache.num_shards, -1)
    return pack_decode_rows(running, sorted({self.ragged_rows(), self.cache.cfg.max_seqs}))

  def decode_kinds(self) -> list:
    """The kinds of decode launch: the `speculative` config (speculating
    steps) and/or None (plain ones); an adaptive config launches both."""
    if self.speculative is None:
      return [None]
    return [self.speculative, None] if self.speculative.adaptive else [self.speculative]

  def next_decode_rows(self) -> int:
    """The rows (over every data shard) the next decode launch runs."""
    rows = self._decode_rows()
    return self.seq_ids.shape[0] if rows is None else rows.shape[0]

  def _decode_rows(self) -> np.ndarray | None:
    """The slots of the next decode launch's rows (see `pack_decode_rows`);
    None for every slot in order, while a beam group runs."""
    if np.any(self.in_beam_group):
      return None
    running = (self.seq_ids >= 0).reshape(self.cache.num_shards, -1)
    return pack_decode_rows(running, self.decode_buckets())

  def _refuse_while_decoding(self) -> None:
    if self.has_running_rows():
      raise RuntimeError("warm-up launches only while no row decodes")

  def warm_up_prefill(self, shape: tuple[int, int]) -> None:
    """Compiles prefill of `shape` (`(tokens, tiles)` per shard, one of
    `prefill_buckets`) on tokens that do nothing (the pages and states stay
    as they are).

    Raises:
      RuntimeError: if a row decodes.
    """
    self._refuse_while_decoding()
    no_draws = np.zeros(self.cache.num_slots, np.int32)
    packed = PackedPrefill.empty(self.cache.num_shards, shape, self.prefill_width)
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
    rows = self._idle_rows(rows_per_shard)
    table, _ = self._unconstrained(0)
    for speculating in self.decode_kinds():
      loop = self.decode_carry(num_steps, rows, speculating=speculating)
      loop = self._launch_decode(loop, rows, False, table, speculating)
    if run_ahead:  # a launch on a continued carry: its arrays are the loop's outputs
      loop = self._launch_decode(self._continued(loop, 1), rows, False, table)
    if loop.beams is not None:
      no_group = self._group_slots([])  # starting and forgetting a group (results dropped)
      programs.start_beams(self.beams, no_group, 1, 1.0)
      programs.clear_beams(self.beams, no_group)

  def _unconstrained(self, num_rows: int):
    """`(table, states)` of a launch of `num_rows` draws without
    constrained rows, as `_automata` gives them (None, None without a
    capacity): warm-up compiles the programs that serving runs."""
    table, states = self._automata(num_rows, ())
    return table, None if table is None else states

  def _idle_rows(self, rows_per_shard: int) -> np.ndarray | None:
    """The rows of a warm-up launch: `rows_per_shard` rows per shard that
    run no slot, or None for every slot (see `_decode_rows`)."""
    if rows_per_shard == self.cache.cfg.max_seqs:
      return None
    return np.full(self.cache.num_shards * rows_per_shard, -1, np.int32)

  def _launch_decode(
    self, carry, rows, stop_on_finish: bool, table=None, speculating=None
  ) -> programs.DecodeLoop:
    loop = programs.decode_loop(
      self.graphdef,
      self.params,
      self._row_params(rows),
      carry,
      jnp.array(stop_on_finish),
      table,
      speculating,
      **(self.draft if speculating is not None else {}),
    )
    self._keep(loop)
    return loop

  def _keep(self, loop: programs.DecodeLoop) -> None:
    """Takes a dispatched launch's pages, manager state and beams (maybe
    not computed yet) as the ones the next launch starts from."""
    self.cache.state, self.cache.kv = loop.state, loop.kv
    if loop.beams is not None:
      self.beams = loop.beams

  def _row_params(self, rows) -> RowParams:
    """The sampling parameters of a launch's `rows` (see `_decode_rows`)."""
    return self.rows if rows is None else jax.tree.map(lambda a: a[np.maximum(rows, 0)], self.rows)

  def decode_carry(
    self,
    num_steps: int,
    rows,
    automaton_state=None,
    histories=(),
    speculating=None,
    max_steps: int | None = None,
  ) -> programs.DecodeLoop:
    """The decode loop's carry for a launch on the slots `rows` (see
    `_decode_rows`) with draws for `num_steps` steps, of which it runs at
    most `max_steps` (default all; a traced value: no new compile), the
    rows' automata in `automaton_state` (table states; None:
    unconstrained), and with `speculating` (a `SpeculativeConfig`) the
    rows' tokens in `histories` (`(slot, token ids)` pairs)."""
    slots = np.arange(self.seq_ids.shape[0]) if rows is None else rows
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
        seq_ids=np.where(slots >= 0, take(self.seq_ids), -1).astype(np.int32),
        last_token=take(self.last_token),
        num_generated=take(self.num_generated),
        limit=take(self.limit),
        automaton_state=automaton_state,
        draws=draws,
        max_steps=np.int32(num_steps if max_steps is None else max_steps),
        step=np.int32(0),
        rows_run=np.int32(0),
        out_of_blocks=np.zeros(self.cache.num_shards, bool),
        finished_any=np.array(False),
        cow_copies=np.int32(0),
        peak_blocks=np.int32(0),
        utilization_sum=np.float32(0.0),
      ),
      self.cache.replicated,
    )
    return programs.DecodeLoop(
      state=self.cache.state,
      kv=self.cache.kv,
      beams=self.beams if rows is None and self.speculative is None else None,
      spec=self._speculation(slots, histories, speculating),
      **rows_carry,
    )

  def _speculation(self, slots: np.ndarray, histories, speculating):
    """A speculating launch's per-row carry: each row's tokens from
    `histories` (`(slot, token ids)`), nothing pending; None when not
    `speculating`."""
    if speculating is None:
      return None
    k, num_rows = _num_speculative(speculating), slots.shape[0]
    history = np.zeros((num_rows, self.cache.cfg.max_tokens_per_seq), np.int32)
    history_len = np.zeros(num_rows, np.int32)
    row_of = {int(slot): row for row, slot in enumerate(slots) if slot >= 0}
    for slot, tokens in histories:
      row = row_of.get(slot)
      if row is not None:
        history[row, : len(tokens)] = tokens
        history_len[row] = len(tokens)
    zeros = np.zeros(num_rows, np.int32)
    return programs.Speculation(
      history=history,
      history_len=history_len,
      pending=np.zeros((num_rows, k), np.int32),
      num_pending=zeros,
      emitted=zeros,
      counts=np.zeros(3, np.int32),
    )

  def decode(
    self,
    num_steps: int,
    stop_on_finish: bool,
    constraints=(),
    histories=(),
    speculate=True,
    run_ahead: bool = False,
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
    """
    speculating = self.speculative if speculate else None
    steps = self._launch_steps(num_steps)
    rows = self._decode_rows()
    table, automaton_state = self._automata(*self._row_constraints(rows, constraints))
    loop = self.decode_carry(num_steps, rows, automaton_state, histories, speculating, steps)
    loop = self._launch_decode(loop, rows, stop_on_finish, table, speculating)
    if run_ahead and self._rows_still_fill(rows, steps):
      self._run_ahead(loop, rows, table)
    result = self._take_step_results(rows, loop)
    self._launched(result)
    return result

  def _launch_steps(self, num_steps: int) -> int:
    """The steps of the decode launch about to be dispatched (of a loop of
    `num_steps`), and those of the next: twice as many, up to `num_steps`.
    A decode-only stretch so ramps up from one step after a ragged step."""
    steps = min(self._next_steps, num_steps)
    self._next_steps = min(2 * steps, num_steps)
    return steps

  def _run_ahead(self, loop: programs.DecodeLoop, rows, table) -> None:
    """Dispatches the launch that continues `loop` (dispatched, maybe not
    computed) on its rows, for `take_ahead`."""
    steps = self._launch_steps(loop.draws.tokens.shape[1])
    launch = self._launch_decode(self._continued(loop, steps), rows, False, table)
    self.ahead = AheadLaunch(launch, rows, table, steps)
    self.counters["loop_launches_ahead"] += 1

  def _continued(self, loop: programs.DecodeLoop, steps: int) -> programs.DecodeLoop:
    """The carry of a launch that continues `loop` for `steps` steps at most."""
    max_steps = jax.device_put(np.int32(steps), self.cache.replicated)
    return programs.continue_decoding(loop, max_steps)

  def _launched(self, result: DecodeResult) -> None:
    """Counts a decode launch read back; the launch running ahead of it
    learns whether it ran out of blocks (then it ran no step)."""
    self.counters["loop_launches"] += 1
    if self.ahead is not None:
      self.ahead.ran_out_before = result.out_of_blocks

  def take_ahead(self, run_ahead: bool) -> DecodeResult:
    """Reads back the launch that `decode` (or the last `take_ahead`)
    dispatched ahead, taking its rows' new state as `decode` does.

    Args:
      run_ahead: whether to dispatch the launch after it first, on the same
        rows; only while the host changed none of them since (no row
        started, stopped or was preempted, no pages moved) and they still
        fill that row bucket (`ahead_rows_fit`).

    Returns:
      Its `DecodeResult`. It reports running out of blocks only if the
      launch before it did not (then this one ran no step).
    """
    ahead, self.ahead = self.ahead, None
    if run_ahead:
      self._run_ahead(ahead.loop, ahead.rows, ahead.table)
    result = self._take_step_results(ahead.rows, ahead.loop)
    result.out_of_blocks &= ~ahead.ran_out_before
    self._launched(result)
    return result

  def ahead_rows_fit(self) -> bool:
    """Whether the rows of the launch running ahead still fill its row
    bucket once it is done (see `_rows_still_fill`)."""
    ahead = self.ahead
    return self._rows_still_fill(ahead.rows, ahead.max_steps)

  def _rows_still_fill(self, rows, num_steps: int) -> bool:
    """Whether some running slots are left running by their token limits
    after `num_steps` more tokens each, and still need the row bucket of
    `rows` (every slot when None): a launch dispatched ahead on those rows
    pads no more than a launch packed after reading this one back. Rows
    that stop on a stop token are not foreseen."""
    running = (self.seq_ids >= 0) & (self.limit - self.num_generated > num_steps)
    packed = pack_decode_rows(running.reshape(self.cache.num_shards, -1), self.decode_buckets())
    bucket = lambda r: self.seq_ids.shape[0] if r is None else r.shape[0]
    return bool(running.any()) and bucket(packed) == bucket(rows)

  def _row_constraints(self, rows, constraints) -> tuple[int, list]:
    """The launch's row count and its `(row, automaton, state)` triples from
    `(slot, automaton, state)` ones of the running slots."""
    slots = np.arange(self.seq_ids.shape[0]) if rows is None else rows
    row_of = np.full(self.seq_ids.shape[0], -1)
    row_of[slots[slots >= 0]] = np.flatnonzero(slots >= 0)
    return slots.shape[0], [
      (row_of[slot], automaton, state)
      for slot, automaton, state in constraints
      if row_of[slot] >= 0 and self.seq_ids[slot] >= 0
    ]

  def _take_step_results(self, rows, loop) -> DecodeResult:
    """Takes the carry of a launch on `rows` (see `_decode_rows`; a decode
    loop, or a ragged step) back into the pages, the beams and the slots'
    state, and returns what it did per slot."""
    before = self.num_generated.copy()
    running = self.seq_ids >= 0
    slots = np.arange(running.shape[0]) if rows is None else rows
    live = slots >= 0
    to_slots = lambda a: _scatter(np.asarray(a), slots, running.shape[0])
    ran = slots[live]
    self.seq_ids[ran] = np.asarray(loop.seq_ids)[live]
    self.last_token[ran] = np.asarray(loop.last_token)[live]
    self.num_generated[ran] = np.asarray(loop.num_generated)[live]
    counters = self.counters
    counters["cow_copies"] += int(loop.cow_copies)
    counters["peak_blocks"] = max(counters["peak_blocks"], int(loop.peak_blocks))
    counters["utilization_sum"] += float(loop.utilization_sum)
    steps = int(loop.step)
    counters["decode_steps"] += steps
    counters["decode_positions"] += slots.shape[0] * steps
    counters["decode_tokens"] += int(loop.rows_run)
    if loop.spec is not None:
      drafts, draft_tokens, accepted = np.asarray(loop.spec.counts).tolist()
      counters["spec_decode_num_drafts"] += drafts
      counters["spec_decode_num_draft_tokens"] += draft_tokens
      counters["spec_decode_num_accepted_tokens"] += accepted
    return DecodeResult(
      draws=jax.tree.map(to_slots, loop.draws),
      counts=self.num_generated - before,
      finished=running & (self.seq_ids < 0),
      out_of_blocks=np.array(loop.out_of_blocks),
      beams_done=self._beams_done(),
      num_rows=slots.shape[0],
      steps=steps,
      row_steps=int(loop.rows_run),
    )

  def ragged_step(
    self, chunks, samples, constraints=(), row_constraints=(), num_steps: int = 1
  ) -> tuple[Draw, list, DecodeResult]:
    """Runs one engine step: prompt chunks and one decode step of the
    running rows in one ragged launch (`programs.ragged_step`), drawing
    token 0 of the sequences in `samples`. Not while speculating (prefill
    runs apart then).

    Args:
      chunks, samples, constraints: as for `prefill`.
      row_constraints: `(slot, automaton, state)` triples of the
        constrained running rows, as for `decode`.
      num_steps: columns of the result's draws (the step's are the first).

    Returns:
      `(draws, scores, result)`: `prefill`'s outputs, and the decode
      step's `DecodeResult` (per slot).
    """
    packed, last_token_of, sample_slots = self._pack_prompts(chunks, samples)
    rows = self._ragged_step_rows()
    num_rows, triples = self._row_constraints(rows, row_constraints)
    num_draws = last_token_of.shape[0]
    drawing = [(num_rows + sample, automaton, state) for sample, automaton, state in constraints]
    table, states = self._automata(num_rows + num_draws, triples + drawing)
    loop = self.decode_carry(num_steps, rows, states[:num_rows])
    draw_states = None if table is None else states[num_rows:]
    loop, draw, scores = self._launch_ragged_step(
      loop, rows, packed, last_token_of, sample_slots, table, draw_states
    )
    result = self._take_step_results(rows, loop)
    self._next_steps = 1
    draws, scores = self._prompt_outputs(chunks, packed, len(samples), draw, scores)
    return draws, scores, result

  def _launch_ragged_step(
    self, loop, rows, packed: PackedPrefill, last_token_of, samples, table=None, draw_states=None
  ):
    loop, draw, scores = programs.ragged_step(
      self.graphdef,
      self.params,
      self._row_params(rows),
      loop,
      *packed.arrays(),
      last_token_of,
      jax.tree.map(lambda a: a[samples], self.rows),
      self.num_logprobs,
      table,
      draw_states,
    )
    self._keep(loop)
    return loop, draw, scores

  def warm_up_ragged_step(self, shape: tuple[int, int], num_steps: int = 1) -> None:
    """Compiles `ragged_step` of prompt `shape` (see `warm_up_prefill`), on
    tokens and rows that do nothing.

    Raises:
      RuntimeError: if a row decodes.
    """
    self._refuse_while_decoding()
    rows = self._idle_rows(self.ragged_rows())
    no_draws = np.zeros(self.cache.num_slots, np.int32)
    packed = PackedPrefill.empty(self.cache.num_shards, shape, self.prefill_width)
    loop = self.decode_carry(num_steps, rows)
    self._launch_ragged_step(
      loop, rows, packed, no_draws, no_draws, *self._unconstrained(no_draws.size)
    )


@dataclasses.dataclass
class AheadLaunch:
  """A decode launch dispatched before the one it continues was read back.

  Attributes:
    loop: its output carry (device arrays, maybe not computed yet).
    rows: its rows (see `ModelRunner._decode_rows`).
    table: the automata of its constrained rows, or None.
    max_steps: the steps it runs at most.
    ran_out_before: bool `[D]`, the shards whose blocks the launch before it
      ran out of (known once that one is read back): the carry handed that
      on, so this launch ran no step.
  """

  loop: programs.DecodeLoop
  rows: np.ndarray | None
  table: object
  max_steps: int
  ran_out_before: np.ndarray | None = None


@dataclasses.dataclass
class PackedPrefill:
  """A prefill launch's chunks, packed per data shard (see `pack_prefill`).

  Attributes:
    tokens, positions, next_tokens: int32 `[D, T]`: each shard's chunks one
      after another, then padding (position -1, next token -1).
    tiles: int32 `[D * R, W]`, each tile's tokens as indices into its
      shard's `T` (-1: padding); a chunk fills `ceil(length / W)` tiles.
    tile_slots: int32 `[D, R]`, each tile's sequence slot in its shard (-1:
      no tile).
    write_from: int32 `[D * R]`, its chunk's `write_from`.
    first_token: each chunk's first token, as an index into the `D * T`.
  """

  tokens: np.ndarray
  positions: np.ndarray
  next_tokens: np.ndarray
  tiles: np.ndarray
  tile_slots: np.ndarray
  write_from: np.ndarray
  first_token: list[int]

  def arrays(self) -> tuple[np.ndarray, ...]:
    """The arrays the prompt programs take, in their order: `tokens,
    positions, tiles, tile_slots, write_from, next_tokens`."""
    return (
      self.tokens,
      self.positions,
      self.tiles,
      self.tile_slots,
      self.write_from,
      self.next_tokens,
    )

  @classmethod
  def empty(cls, num_shards: int, shape: tuple[int, int], width: int) -> PackedPrefill:
    """No chunk in `shape` (`(tokens, tiles)` per shard) with tiles of `width`."""
    per_tokens, per_tiles = shape
    no_tokens = np.full((num_shards, per_tokens), -1, np.int32)
    return cls(
      tokens=np.zeros_like(no_tokens),
      positions=no_tokens,
      next_tokens=no_tokens.copy(),
      tiles=np.full((num_shards * per_tiles, width), -1, np.int32),
      tile_slots=np.full((num_shards, per_tiles), -1, np.int32),
      write_from=np.zeros(num_shards * per_tiles, np.int32),
      first_token=[],
    )


def pack_prefill(chunks, width: int, num_shards: int, per_shard: int, buckets) -> PackedPrefill:
  """Packs `PrefillChunk`s into the smallest of the `(tokens, tiles)`
  `buckets` (see `prompt_buckets`) that holds every shard's, with attention
  tiles of `width` tokens (`per_shard`: sequence slots per data shard)."""
  shard_of = [chunk.seq.slot // per_shard for chunk in chunks]
  num_tokens = np.bincount(shard_of, [c.tokens.size for c in chunks], minlength=num_shards)
  num_tiles = np.bincount(shard_of, [-(-c.tokens.size // width) for c in chunks], num_shards)
  per_tokens, per_tiles = next(
    (t, r) for t, r in buckets if t >= num_tokens.max() and r >= num_tiles.max()
  )
  packed = PackedPrefill.empty(num_shards, (per_tokens, per_tiles), width)
  tokens_used, tiles_used = np.zeros(num_shards, np.int64), np.zeros(num_shards, np.int64)
  for chunk, shard in zip(chunks, shard_of):
    start, size = int(tokens_used[shard]), chunk.tokens.size
    packed.first_token.append(shard * per_tokens + start)
    packed.tokens[shard, start : start + size] = chunk.tokens
    packed.positions[shard, start : start + size] = np.arange(chunk.start, chunk.start + size)
    if chunk.next_tokens is not None:
      packed.next_tokens[shard, start : start + size] = chunk.next_tokens
    for offset in range(0, size, width):
      tile = shard * per_tiles + int(tiles_used[shard])
      cells = np.arange(start + offset, min(start + size, start + offset + width))
      packed.tiles[tile, : cells.size] = cells
      packed.tile_slots.reshape(-1)[tile] = chunk.seq.slot % per_shard
      packed.write_from[tile] = chunk.write_from
      tiles_used[shard] += 1
    tokens_used[shard] += size
  return packed


def prompt_buckets(width: int, max_tokens: int, max_tiles: int) -> list[tuple[int, int]]:
  """The shapes per data shard, `(tokens, tiles)`, of launches with prompt
  chunks in attention tiles of `width` tokens: `(2 * width * 2**i, 4 *
  2**i)` from two tiles' tokens up to the first that holds `max_tokens`, the last
  with room for `max_tiles` tiles (each chunk adds at most one partly
  filled tile; a launch whose chunks fill more tiles than its tokens'
  bucket has takes the next)."""
  buckets = [(2 * width, 4)]
  while buckets[-1][0] < max_tokens:
    buckets.append((2 * buckets[-1][0], 2 * buckets[-1][1]))
  tokens, tiles = buckets[-1]
  buckets[-1] = (tokens, max(tiles, 1 << (max_tiles - 1).bit_length()))
  return buckets


def _num_speculative(speculating) -> int:
  return 0 if speculating is None else speculating.num_speculative_tokens


def pack_decode_rows(running: np.ndarray, buckets: list[int]) -> np.ndarray | None:
  """The global slots each decode row runs, -1 for padding.

  Args:
    running: bool `[D, S]`, the slots of each data shard that decode.
    buckets: row counts per shard, ascending, the last `S`.

  Returns:
    int32 `[D * b]`: each shard's decoding slots in order, padded to `b`,
    the smallest bucket that holds every shard's; None when that is `S`
    (every slot in order).
  """
  num_shards, per_shard = running.shape
  per_row = next(b for b in buckets if b >= running.sum(axis=1).max())
  if per_row == per_shard:
    return None
  order = np.argsort(~running, axis=1, kind="stable")[:, :per_row]
  first = np.arange(num_shards)[:, None] * per_shard
  slots = np.where(np.take_along_axis(running, order, axis=1), order + first, -1)
  return slots.reshape(-1).astype(np.int32)


def _scatter(values: np.ndarray, slots: np.ndarray, num_slots: int) -> np.ndarray:
  """Per-row `values` as per-slot values (zeros where no row ran)."""
  out = np.zeros((num_slots, *values.shape[1:]), values.dtype)
  out[slots[slots >= 0]] = values[slots >= 0]
  return out
