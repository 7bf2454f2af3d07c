"""The automata of the rows that run, packed into one `AutomatonTable` of
device arrays, and the `TableCapacity` an engine packs every table to."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.structured.automaton import Automaton

# A row's table state without a constraint, and the state that allows no
# token (state 0 of every table).
UNCONSTRAINED = -1
DEAD_STATE = 0
_MIN_STATES, _MIN_EDGES = 64, 1024


@flax.struct.dataclass
class AutomatonTable:
  """The automata of a batch's rows, as device arrays (state 0 is the dead state).

  Attributes:
    bits: uint32 `[num_states, ceil(vocab_size / 32)]`, each state's allowed tokens.
    accepting: bool `[num_states]`.
    offsets: int32 `[num_states + 1]`, CSR row starts into `tokens`.
    tokens: int32 `[num_edges]`, each state's allowed tokens, ascending.
    next_states: int32 `[num_edges]`, the state each allowed token leads to.
    vocab_size: static; the width of the logits the table masks.
  """

  bits: jax.Array
  accepting: jax.Array
  offsets: jax.Array
  tokens: jax.Array
  next_states: jax.Array
  vocab_size: int = flax.struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedAutomata:
  """A device table and where each automaton's states start in it.

  Attributes:
    table: the device arrays.
    automata: the automata, each once.
    starts: the table state of each automaton's state 0.
  """

  table: AutomatonTable
  automata: tuple[Automaton, ...]
  starts: tuple[int, ...]

  def initial_state(self, automaton: Automaton) -> int:
    """The table state a new row of `automaton` starts in.

    Raises:
      ValueError: if `automaton` is not in this table.
    """
    return self._start(automaton)

  def _start(self, automaton: Automaton) -> int:
    for candidate, start in zip(self.automata, self.starts):
      if candidate is automaton:
        return start
    raise ValueError("the automaton is not in this table")


@dataclasses.dataclass(frozen=True)
class TableCapacity:
  """The size every automaton table of an engine is packed to.

  Attributes:
    states: table states, the dead state included.
    edges: transitions (allowed tokens) of all states together.
  """

  states: int
  edges: int

  def __post_init__(self):
    for name in ("states", "edges"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TableCapacity.{name} must be a positive int, got {value!r}")

  @classmethod
  def for_vocabulary(cls, vocab_size: int) -> TableCapacity:
    """The default for a vocabulary: 1,024 states, and 32 transitions per
    token (at least 16,384). A 49,152-token vocabulary's `json_object`
    automaton has 401 states and 823,952 transitions, so SmolLM2's default
    (1,572,864) holds it and a few smaller ones; on the device that is 12.6
    MB of transitions and 6.3 MB of token masks."""
    return cls(states=1024, edges=max(-(-32 * vocab_size // 1024) * 1024, 16384))

  def shortfall(self, automata: Sequence[Automaton]) -> str | None:
    """Why `automata` (each counted once) do not fit one table, or None."""
    states, edges = table_size(automata)
    if states <= self.states and edges <= self.edges:
      return None
    return (
      f"{states} states and {edges} transitions, the automaton table holds "
      f"{self.states} and {self.edges} (TableCapacity)"
    )


def table_size(automata: Sequence[Automaton]) -> tuple[int, int]:
  """`(states, transitions)` one table of `automata` needs (the dead state
  and each automaton once)."""
  unique = {id(automaton): automaton for automaton in automata}.values()
  return 1 + sum(a.num_states for a in unique), sum(a.num_edges for a in unique)


def _bucket(count: int, minimum: int) -> int:
  return max(minimum, 1 << max(count - 1, 0).bit_length())


def pack_automata(
  automata: Sequence[Automaton], vocab_size: int, capacity: TableCapacity | None = None
) -> PackedAutomata:
  """Packs automata into one device table (cached by the automata, vocabulary
  size and capacity).

  State 0 is the dead state; then each automaton's states in turn. States and
  edges are padded to `capacity`, or without one to powers of two (at least
  64 states and 1024 edges), so tables share compiled programs; padding
  states have no allowed token.

  Args:
    automata: the automata of the rows that run (repeats are packed once).
    vocab_size: the width of the model's logits.
    capacity: the size to pad to, or None for power-of-two buckets.

  Returns:
    The packed table.

  Raises:
    ValueError: if an automaton's token does not fit `vocab_size`, or the
      automata do not fit `capacity` (naming both sizes).
  """
  unique = tuple({id(automaton): automaton for automaton in automata}.values())
  if capacity is not None and (reason := capacity.shortfall(unique)) is not None:
    raise ValueError(f"the automata need {reason}")
  return _packed(unique, vocab_size, capacity)


@functools.lru_cache(maxsize=4)
def _packed(
  automata: tuple[Automaton, ...], vocab_size: int, capacity: TableCapacity | None
) -> PackedAutomata:
  num_words = -(-vocab_size // 32)
  for automaton in automata:
    if automaton.num_edges and int(automaton.tokens.max()) >= vocab_size:
      raise ValueError(
        f"token {int(automaton.tokens.max())} of {automaton.regex!r} is outside the "
        f"vocabulary of {vocab_size}"
      )
  sizes = [automaton.num_states for automaton in automata]
  starts = tuple(int(start) for start in 1 + np.cumsum([0, *sizes[:-1]]))
  num_states = 1 + sum(sizes)
  num_edges = sum(automaton.num_edges for automaton in automata)
  if capacity is None:
    state_capacity, edge_capacity = _bucket(num_states, _MIN_STATES), _bucket(num_edges, _MIN_EDGES)
  else:
    state_capacity, edge_capacity = capacity.states, capacity.edges
  bits = np.zeros((state_capacity, num_words), np.uint32)
  accepting = np.zeros(state_capacity, bool)
  counts = np.zeros(state_capacity, np.int64)
  tokens = np.full(edge_capacity, vocab_size, np.int32)
  next_states = np.zeros(edge_capacity, np.int32)
  edge = 0
  for automaton, start in zip(automata, starts):
    states = slice(start, start + automaton.num_states)
    bits[states] = automaton.bits(num_words)
    accepting[states] = automaton.accepting
    counts[states] = np.diff(automaton.offsets)
    tokens[edge : edge + automaton.num_edges] = automaton.tokens
    next_states[edge : edge + automaton.num_edges] = automaton.next_states + start
    edge += automaton.num_edges
  offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
  table = AutomatonTable(
    bits=jnp.asarray(bits),
    accepting=jnp.asarray(accepting),
    offsets=jnp.asarray(offsets),
    tokens=jnp.asarray(tokens),
    next_states=jnp.asarray(next_states),
    vocab_size=vocab_size,
  )
  return PackedAutomata(table=table, automata=automata, starts=starts)
