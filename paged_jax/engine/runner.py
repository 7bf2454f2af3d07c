"""The model runner: launches the jitted programs on the decode rows.

It keeps the model and, between launches, the decode loop's rows on the
host (which slot decodes, from which token, with which sampling parameters;
small NumPy arrays) and the beam state on the device. The scheduler's
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
  """

  draws: Draw
  counts: np.ndarray
  finished: np.ndarray
  out_of_blocks: np.ndarray
  beams_done: np.ndarray


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
  ):
    self.cache = cache
    if mesh is not None:
      model = sharding.shard_model(model, mesh)
    self.graphdef, self.params = nnx.split(model)
    num_rows = cache.num_slots
    self.beams = jax.device_put(
      beam.Beams.create(num_rows, max_beam_width, cache.cfg.max_tokens_per_seq), cache.replicated
    )
    self.max_beam_width = max_beam_width
    self.in_beam_group = np.zeros(num_rows, bool)
    self.num_logprobs = num_logprobs
    self.vocab_size = model.config.vocab_size
    key_words = jax.random.key_data(jax.random.key(0)).shape[-1]
    self.rows = RowParams(
      temperature=np.zeros(num_rows, np.float32),
      top_k=np.zeros(num_rows, np.int32),
      top_p=np.ones(num_rows, np.float32),
      key_data=np.zeros((num_rows, key_words), np.uint32),
      stop_ids=np.full((num_rows, stop_width), -1, np.int32),
    )
    self.seq_ids = np.full(num_rows, -1, np.int32)
    self.last_token = np.zeros(num_rows, np.int32)
    self.num_generated = np.zeros(num_rows, np.int32)
    self.limit = np.zeros(num_rows, np.int32)
    self.counters = dict(
      cow_copies=0, peak_blocks=0, utilization_sum=0.0, decode_steps=0, loop_launches=0
    )

  # Rows.
  def apply(self, changes: RowChanges) -> None:
    """Carries out the scheduler's row changes, in their order (see
    `RowChanges`)."""
    stopped = np.asarray(changes.stop, np.int64)
    self.seq_ids[stopped] = -1
    for slots in changes.clear_beams:
      self.beams = programs.clear_beams(self.beams, np.asarray(slots, np.int32))
      self.in_beam_group[np.asarray(slots)] = False
    rows = self.rows
    for row in changes.new_rows:
      slot = row.slot
      rows.temperature[slot], rows.top_k[slot] = row.temperature, row.top_k
      rows.top_p[slot], rows.key_data[slot] = row.top_p, row.key_data
      rows.stop_ids[slot] = -1
      rows.stop_ids[slot, : len(row.stop_ids)] = row.stop_ids
      self.limit[slot] = row.limit
    for slots, width, length_penalty in changes.new_beams:
      self.beams = programs.start_beams(
        self.beams, np.asarray(slots, np.int32), width, length_penalty
      )
      self.in_beam_group[np.asarray(slots)] = True
    for slot, last_token, num_generated in changes.start:
      self.seq_ids[slot] = slot
      self.last_token[slot], self.num_generated[slot] = last_token, num_generated
    resumed = np.asarray(changes.resume, np.int64)
    self.seq_ids[resumed] = resumed

  def has_running_rows(self) -> bool:
    return bool(np.any(self.seq_ids >= 0))

  def hypotheses(self, leader: int, count: int):
    """The best `count` finished hypotheses of a beam group, best first:
    `(tokens, cumulative logprob, stopped)` triples."""
    b = jax.device_get(jax.tree.map(lambda a: a[leader], self.beams))
    return [
      (b.hyp_tokens[i, : b.hyp_len[i]].tolist(), float(b.hyp_logprob[i]), bool(b.hyp_stopped[i]))
      for i in range(count)
      if b.hyp_score[i] > -np.inf
    ]

  # Launches.
  def _automata(self, num_rows: int, constraints):
    """The device table of the constrained rows' automata and every row's
    table state (`UNCONSTRAINED` for the others); no table without any.

    Args:
      num_rows: rows of the launch.
      constraints: `(row, automaton, state)` triples, `state` in the
        automaton's own numbering.
    """
    states = np.full(num_rows, structured.UNCONSTRAINED, np.int32)
    if not constraints:
      return None, states
    packed = structured.pack_automata(
      [automaton for _, automaton, _ in constraints], self.vocab_size
    )
    for row, automaton, state in constraints:
      states[row] = packed.initial_state(automaton) + state
    return packed.table, states

  def prefill(self, chunks, samples, constraints=()) -> Draw:
    """Runs prompt chunks, then draws token 0 of the sequences in `samples`.

    Args:
      chunks: `(slot, tokens, start)` triples: `tokens` go to positions
        `start ..` of the sequence in `slot`, whose blocks are allocated.
      samples: `(chunk, slot)` pairs: draw token 0 of `slot` (with its row's
        sampling parameters) from the logits chunk number `chunk` ends with.
      constraints: `(sample, automaton, state)` triples: sample number
        `sample` draws among the tokens `automaton` allows in `state`.

    Returns:
      NumPy draws, one per pair of `samples`.
    """
    cache = self.cache
    num_shards, per_shard = cache.num_shards, cache.cfg.max_seqs
    shard_of = [slot // per_shard for slot, _, _ in chunks]
    per_row = programs.bucket(int(np.bincount(shard_of, minlength=num_shards).max()))
    width = programs.bucket(max(tokens.size for _, tokens, _ in chunks), 8)
    tokens = np.zeros((num_shards * per_row, width), np.int32)
    positions = np.full((num_shards * per_row, width), -1, np.int32)
    local = np.full((num_shards, per_row), -1, np.int32)
    filled = np.zeros(num_shards, np.int64)
    row_of = []
    for shard, (slot, chunk, start) in zip(shard_of, chunks):
      row = shard * per_row + filled[shard]
      tokens[row, : chunk.size] = chunk
      positions[row, : chunk.size] = np.arange(start, start + chunk.size)
      local[shard, filled[shard]] = slot % per_shard
      filled[shard] += 1
      row_of.append(row)
    num_draws = num_shards * per_shard  # one compile, whatever the samples
    chunk_of = np.zeros(num_draws, np.int32)
    sample_slots = np.zeros(num_draws, np.int32)
    for i, (chunk, slot) in enumerate(samples):
      chunk_of[i], sample_slots[i] = row_of[chunk], slot
    rows = jax.tree.map(lambda a: a[sample_slots], self.rows)
    table, draw_states = self._automata(num_draws, constraints)
    draw, cache.kv = programs.prefill(
      self.graphdef,
      self.params,
      cache.kv,
      cache.state,
      tokens,
      positions,
      local,
      chunk_of,
      rows,
      self.num_logprobs,
      cache.cfg.block_size,
      table,
      draw_states,
    )
    return jax.tree.map(lambda a: np.asarray(a)[: len(samples)], draw)

  def decode_carry(self, num_steps: int, automaton_state=None) -> programs.DecodeLoop:
    """The decode loop's carry for a launch of up to `num_steps` steps, the
    rows' automata in `automaton_state` (table states; None: unconstrained)."""
    if automaton_state is None:
      automaton_state = np.full(self.seq_ids.shape[0], structured.UNCONSTRAINED, np.int32)
    num_rows, k = self.seq_ids.shape[0], self.num_logprobs
    draws = Draw(
      tokens=jnp.zeros((num_rows, num_steps), jnp.int32),
      logprob=jnp.zeros((num_rows, num_steps), jnp.float32),
      top_ids=jnp.zeros((num_rows, num_steps, k), jnp.int32),
      top_logprobs=jnp.zeros((num_rows, num_steps, k), jnp.float32),
    )
    return programs.DecodeLoop(
      state=self.cache.state,
      kv=self.cache.kv,
      seq_ids=self.seq_ids,
      last_token=self.last_token,
      num_generated=self.num_generated,
      limit=self.limit,
      beams=self.beams,
      automaton_state=automaton_state,
      draws=draws,
      step=jnp.int32(0),
      out_of_blocks=jnp.zeros(self.cache.num_shards, bool),
      finished_any=jnp.array(False),
      cow_copies=jnp.int32(0),
      peak_blocks=jnp.int32(0),
      utilization_sum=jnp.float32(0.0),
    )

  def decode(self, num_steps: int, stop_on_finish: bool, constraints=()) -> DecodeResult:
    """Runs up to `num_steps` decode steps of the running rows (stopping
    after a step in which a row finished if `stop_on_finish`).

    Args:
      num_steps: decode steps at most.
      stop_on_finish: whether to stop after a step in which a row finished.
      constraints: `(slot, automaton, state)` triples of the constrained
        rows: each draws among the tokens its automaton allows, from
        `state` (the state after its last token) on.
    """
    before = self.num_generated.copy()
    running = self.seq_ids >= 0
    table, automaton_state = self._automata(self.seq_ids.shape[0], constraints)
    loop = self.decode_carry(num_steps, automaton_state)
    # The beam step compiles only once a beam group runs; masks only with a table.
    with_beams = bool(np.any(self.in_beam_group & running))
    loop = programs.decode_loop(
      self.graphdef, self.params, self.rows, loop, jnp.array(stop_on_finish), with_beams, table
    )
    self.cache.state, self.cache.kv, self.beams = loop.state, loop.kv, loop.beams
    self.seq_ids = np.array(loop.seq_ids)
    self.last_token = np.array(loop.last_token)
    self.num_generated = np.array(loop.num_generated)
    counters = self.counters
    counters["cow_copies"] += int(loop.cow_copies)
    counters["peak_blocks"] = max(counters["peak_blocks"], int(loop.peak_blocks))
    counters["utilization_sum"] += float(loop.utilization_sum)
    counters["decode_steps"] += int(loop.step)
    counters["loop_launches"] += 1
    return DecodeResult(
      draws=jax.tree.map(np.asarray, loop.draws),
      counts=self.num_generated - before,
      finished=running & (self.seq_ids < 0),
      out_of_blocks=np.array(loop.out_of_blocks),
      beams_done=np.asarray(self.beams.done),
    )
