"""A constraint compiled, on the host, to a deterministic automaton over the
model's tokens (`Automaton`), cached by constraint and vocabulary."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import outlines_core

from paged_jax.structured.constraints import StructuredOutputsParams
from paged_jax.structured.vocabulary import VOCABULARIES, vocabulary_key

# An automaton's own (host-side) number for "no allowed token": a row that
# draws a token its state does not allow.
DEAD_LOCAL = -1


@dataclasses.dataclass(frozen=True, eq=False)
class Automaton:
  """A constraint's token automaton, states numbered 0 (the start) to `num_states - 1`.

  Attributes:
    regex: the pattern the output matches in full.
    eos_token_id: the token allowed in accepting states, which ends a row.
    accepting: bool `[num_states]`, states where the text is a full match.
    offsets: int64 `[num_states + 1]`, state `s`'s transitions are
      `tokens[offsets[s]:offsets[s + 1]]` (ascending) and their `next_states`.
    tokens: int32 `[num_edges]`.
    next_states: int32 `[num_edges]`, states of this automaton.
    index: the outlines-core `Index` (host-side reference).
    index_states: int `[num_states]`, the `Index` state of each state.
  """

  regex: str
  eos_token_id: int
  accepting: np.ndarray
  offsets: np.ndarray
  tokens: np.ndarray
  next_states: np.ndarray
  index: Any
  index_states: np.ndarray

  @property
  def num_states(self) -> int:
    return self.accepting.size

  @property
  def num_edges(self) -> int:
    return self.tokens.size

  def next_state(self, state: int, token: int) -> int:
    """The state `token` leads to from `state` (host side), or `DEAD_LOCAL` if it is not allowed.

    Args:
      state: one of this automaton's states.
      token: the token drawn.
    """
    begin, end = int(self.offsets[state]), int(self.offsets[state + 1])
    at = begin + int(np.searchsorted(self.tokens[begin:end], token))
    return int(self.next_states[at]) if at < end and self.tokens[at] == token else DEAD_LOCAL

  def is_dead(self, state: int) -> bool:
    """Whether no token is allowed in `state` (host side; `DEAD_LOCAL` included)."""
    return state == DEAD_LOCAL or self.offsets[state + 1] == self.offsets[state]

  def bits(self, num_words: int) -> np.ndarray:
    """uint32 `[num_states, num_words]`: bit `t % 32` of word `t // 32` is set where `t` is allowed.

    Raises:
      ValueError: if a token does not fit in `num_words * 32`.
    """
    if self.num_edges and int(self.tokens.max()) >= num_words * 32:
      raise ValueError(f"token {int(self.tokens.max())} does not fit a {num_words * 32}-bit mask")
    allowed = np.zeros((self.num_states, num_words * 32), bool)
    rows = np.repeat(np.arange(self.num_states), np.diff(self.offsets))
    allowed[rows, self.tokens] = True
    return np.packbits(allowed, axis=1, bitorder="little").view("<u4")


def compile_constraint(constraint: StructuredOutputsParams, tokenizer) -> Automaton:
  """The token automaton of `constraint` over `tokenizer`'s vocabulary (cached).

  Args:
    constraint: what the output must be.
    tokenizer: a `ByteTokenizer` or `PretrainedTokenizer`.

  Returns:
    The automaton; the same object for the same constraint and vocabulary.

  Raises:
    ValueError: if the schema uses a feature the regex builder cannot
      express, the regex does not parse, or the vocabulary cannot spell any
      match (the message says which).
  """
  if not isinstance(constraint, StructuredOutputsParams):
    raise ValueError(
      f"constraint must be a StructuredOutputsParams, got {type(constraint).__name__}"
    )
  return _compiled(constraint, vocabulary_key(tokenizer))


@functools.lru_cache(maxsize=64)
def _compiled(constraint: StructuredOutputsParams, key: str) -> Automaton:
  regex = constraint.to_regex()
  vocabulary = VOCABULARIES[key]
  try:
    index = outlines_core.Index(regex, vocabulary)
  except ValueError as err:
    raise ValueError(f"cannot compile {regex!r} over the vocabulary: {err}") from err
  return _automaton(regex, index, vocabulary.get_eos_token_id())


def _automaton(regex: str, index, eos: int) -> Automaton:
  """Renumbers `index`'s states densely (the start first) into sorted CSR transitions."""
  transitions = index.get_transitions()
  order = [index.get_initial_state()]
  number = {order[0]: 0}
  for state in order:  # breadth first, so the list grows while it is read
    for target in transitions.get(state, {}).values():
      if target not in number:
        number[target] = len(order)
        order.append(target)
  counts, tokens, next_states = [], [], []
  for state in order:
    edges = sorted(transitions.get(state, {}).items())
    counts.append(len(edges))
    tokens.extend(token for token, _ in edges)
    next_states.extend(number[target] for _, target in edges)
  finals = index.get_final_states()
  return Automaton(
    regex=regex,
    eos_token_id=eos,
    accepting=np.array([state in finals for state in order], bool),
    offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
    tokens=np.asarray(tokens, np.int32),
    next_states=np.asarray(next_states, np.int32),
    index=index,
    index_states=np.asarray(order, np.int64),
  )
