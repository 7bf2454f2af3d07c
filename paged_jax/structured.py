"""Structured outputs: JSON schemas, regexes and choices as token automata on the device.

A constraint (`StructuredOutputsParams`) compiles once, on the host, to a
regular expression and then, with outlines-core, to a deterministic automaton
over the model's tokens (`Automaton`): from each state, the tokens that keep
the text a prefix of a match and the state each leads to. The tokenizer's EOS
is allowed exactly in the accepting states (where the text so far is a full
match). Compiled automata are cached by constraint and vocabulary.

The automata of the rows that run are packed into one `AutomatonTable` of
device arrays (`pack_automata`): a bitmask of the allowed tokens of every
state, and the transitions in compressed sparse rows (per state, its allowed
tokens in ascending order and their next states). State 0 of every table is
the dead state (no allowed token), and each automaton's states follow at its
own offset. An engine packs every table to one `TableCapacity`, so its
programs compile once with or without constrained rows; without a capacity,
padding rounds a table up to power-of-two buckets. A row's state is an int32
index into the table, or `UNCONSTRAINED` (-1) for a row without a constraint.

The device functions (`allowed_mask`, `mask_logits`, `advance`, `is_dead`,
`is_accepting`) are pure and jittable, so a decode loop can mask, sample and
step the automata of all its rows inside one launch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import outlines_core

UNCONSTRAINED = -1
DEAD_STATE = 0
# An automaton's own (host-side) number for "no allowed token": a row that
# draws a token its state does not allow.
DEAD_LOCAL = -1
# JSON Schema keywords that outlines-core's regex builder would drop without a
# word (the output would not be checked against them), so they are refused.
UNSUPPORTED_SCHEMA_KEYWORDS = (
  "contains",
  "dependencies",
  "dependentRequired",
  "dependentSchemas",
  "else",
  "exclusiveMaximum",
  "exclusiveMinimum",
  "if",
  "maxContains",
  "maxProperties",
  "maximum",
  "minContains",
  "minProperties",
  "minimum",
  "multipleOf",
  "not",
  "patternProperties",
  "propertyNames",
  "then",
  "unevaluatedItems",
  "unevaluatedProperties",
  "uniqueItems",
)
# Keywords whose value is a map from names to subschemas, or a list of them.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")
# Characters a choice literal escapes; outlines-core's regex syntax (Rust's
# regex crate) accepts a backslash before each of them.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
_MIN_STATES, _MIN_EDGES = 64, 1024
# Levels of objects and arrays a `json_object` output may nest (the top-level
# object counts); a regex has no recursion, and its automaton grows about
# fourfold per level.
JSON_OBJECT_DEPTH = 2
_JSON_WHITESPACE = "[ ]?"


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
  """A constraint on a request's output text; exactly one field is set.

  Attributes:
    json: a JSON schema, as a dict or a JSON string; the output is a JSON
      value that validates against it. Stored as its JSON text (keys in the
      given order, which is the order the output's properties take).
    regex: the output matches this regular expression in full (the syntax of
      Rust's regex crate, which outlines-core uses; no lookaround or
      backreferences).
    choice: the output is exactly one of these strings.
    json_object: the output is a JSON object (OpenAI's
      `response_format={"type": "json_object"}`) whose values are scalars or
      objects and arrays of scalars (`JSON_OBJECT_DEPTH` levels).
    whitespace_pattern: with `json` or `json_object`, the regex of the
      whitespace allowed between JSON tokens; None allows one optional space.

  Raises:
    ValueError: if not exactly one constraint is set, or one is malformed.
  """

  json: str | Mapping[str, Any] | None = None
  regex: str | None = None
  choice: Sequence[str] | None = None
  json_object: bool = False
  whitespace_pattern: str | None = None

  def __post_init__(self):
    given = [
      name
      for name, value in (
        ("json", self.json),
        ("regex", self.regex),
        ("choice", self.choice),
        ("json_object", self.json_object or None),
      )
      if value is not None
    ]
    if len(given) != 1:
      raise ValueError(
        f"exactly one of json, regex, choice, json_object must be set, got {given or 'none'}"
      )
    if self.json is not None:
      object.__setattr__(self, "json", _schema_text(self.json))
    if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
      raise ValueError(f"regex must be a non-empty str, got {self.regex!r}")
    if self.choice is not None:
      choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
      if not choice or not all(isinstance(option, str) and option for option in choice):
        raise ValueError(f"choice must be a non-empty list of non-empty strs, got {self.choice!r}")
      object.__setattr__(self, "choice", choice)
    if self.whitespace_pattern is not None and self.json is None and not self.json_object:
      raise ValueError("whitespace_pattern applies only to json or json_object")

  def to_regex(self) -> str:
    """The regular expression the output must match in full.

    Returns:
      The pattern: from the JSON schema (outlines-core's builder), the regex
      itself, or the choices as an alternation of escaped literals.

    Raises:
      ValueError: if the schema uses a feature the builder cannot express
        (the message names the keyword and where it is).
    """
    if self.regex is not None:
      return self.regex
    if self.choice is not None:
      return "(" + "|".join(_escaped(option) for option in self.choice) + ")"
    if self.json_object:
      return json_object_regex(JSON_OBJECT_DEPTH, self.whitespace_pattern or _JSON_WHITESPACE)
    _refuse_unsupported(json.loads(self.json), "schema")
    try:
      return outlines_core.json_schema.build_regex_from_schema(self.json, self.whitespace_pattern)
    except ValueError as err:
      raise ValueError(f"JSON schema not supported: {err}") from err


def json_object_regex(depth: int, whitespace: str) -> str:
  """A regex of JSON objects nested `depth` levels deep at most (the top level is 1).

  Args:
    depth: levels of objects and arrays, at least 1.
    whitespace: the regex of the whitespace allowed between JSON tokens.

  Returns:
    The pattern.
  """
  schema = outlines_core.json_schema
  scalar = f"{schema.STRING}|{schema.NUMBER}|true|false|null"
  value = f"({scalar})"
  for level in range(1, depth + 1):
    member = f"{schema.STRING}{whitespace}:{whitespace}{value}"
    members = f"({member}({whitespace},{whitespace}{member})*)?"
    json_object = rf"\{{{whitespace}{members}{whitespace}\}}"
    if level == depth:
      return json_object
    items = f"({value}({whitespace},{whitespace}{value})*)?"
    value = rf"({scalar}|{json_object}|\[{whitespace}{items}{whitespace}\])"
  raise ValueError(f"depth must be at least 1, got {depth}")


def _schema_text(schema) -> str:
  """A schema (dict or JSON text) as JSON text; ValueError unless it is a JSON object."""
  if isinstance(schema, str):
    try:
      parsed = json.loads(schema)
    except json.JSONDecodeError as err:
      raise ValueError(f"json is not valid JSON: {err}") from err
  else:
    parsed = schema
  if not isinstance(parsed, Mapping):
    raise ValueError(f"json must be a JSON schema object, got {type(parsed).__name__}")
  return schema if isinstance(schema, str) else json.dumps(schema)


def _refuse_unsupported(schema, where: str) -> None:
  """Raises ValueError naming the first keyword of `UNSUPPORTED_SCHEMA_KEYWORDS` in `schema`."""
  if not isinstance(schema, Mapping):
    return
  for keyword in UNSUPPORTED_SCHEMA_KEYWORDS:
    if keyword in schema:
      raise ValueError(
        f"JSON schema keyword {keyword!r} (at {where}) is not supported: "
        "the regex builder cannot express it"
      )
  for keyword in _SCHEMA_MAPS:
    for name, subschema in (schema.get(keyword) or {}).items():
      _refuse_unsupported(subschema, f"{where}.{keyword}.{name}")
  for keyword in _SCHEMA_LISTS:
    for position, subschema in enumerate(schema.get(keyword) or ()):
      _refuse_unsupported(subschema, f"{where}.{keyword}[{position}]")
  for keyword in _SCHEMA_VALUES:
    value = schema.get(keyword)
    subschemas = value if isinstance(value, list) else [value]
    for subschema in subschemas:
      _refuse_unsupported(subschema, f"{where}.{keyword}")


def _escaped(literal: str) -> str:
  return "".join("\\" + char if char in _REGEX_META else char for char in literal)


# Vocabularies: every token as the bytes it stands for.


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
  """GPT-2's byte-level BPE alphabet: the printable character of each byte."""
  printable = [
    *range(ord("!"), ord("~") + 1),
    *range(ord("¡"), ord("¬") + 1),
    *range(ord("®"), ord("ÿ") + 1),
  ]
  characters = dict.fromkeys(range(256))
  for byte in printable:
    characters[byte] = chr(byte)
  extra = 0
  for byte in range(256):
    if characters[byte] is None:
      characters[byte] = chr(256 + extra)
      extra += 1
  return {char: byte for byte, char in characters.items()}


def _token_bytes(tokenizer) -> tuple[dict[bytes, list[int]], int]:
  """The bytes of every ordinary token of `tokenizer`, and its EOS id.

  Special tokens (BOS, chat markers, ...) are left out: they never spell
  constrained text. The EOS is the automaton's end marker instead.

  Raises:
    ValueError: if the tokenizer has no EOS, or a decoder this module does
      not know (byte-level BPE and SentencePiece-style byte fallback are known).
  """
  eos = tokenizer.eos_token_id
  if eos is None:
    raise ValueError("structured outputs need a tokenizer with an EOS token")
  if not hasattr(tokenizer, "tokenizer"):  # ByteTokenizer: id i is byte i below 256
    return {bytes([byte]): [byte] for byte in range(256)}, eos
  inner = tokenizer.tokenizer
  decoder = json.loads(inner.to_str()).get("decoder") or {}
  to_bytes = _decoder_to_bytes(decoder)
  added = inner.get_added_tokens_decoder()
  vocabulary: dict[bytes, list[int]] = {}
  for text, token_id in inner.get_vocab(with_added_tokens=True).items():
    if token_id in added:
      if added[token_id].special:
        continue
      data = text.encode("utf-8")
    else:
      data = to_bytes(text)
    if data:
      vocabulary.setdefault(data, []).append(token_id)
  return vocabulary, eos


def _decoder_to_bytes(decoder: Mapping[str, Any]):
  """A function from a token's text to its bytes, for the tokenizer's `decoder`."""
  kinds = {decoder.get("type")} | {step.get("type") for step in decoder.get("decoders", ())}
  if "ByteLevel" in kinds:
    alphabet = _byte_level_alphabet()

    def byte_level(text: str) -> bytes:
      try:
        return bytes(alphabet[char] for char in text)
      except KeyError as err:
        raise ValueError(f"token {text!r} is not in the byte-level alphabet") from err

    return byte_level
  if "ByteFallback" in kinds or "Metaspace" in kinds:

    def sentencepiece(text: str) -> bytes:
      if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
      return text.replace("\u2581", " ").encode("utf-8")

    return sentencepiece
  raise ValueError(f"tokenizer decoder {sorted(k for k in kinds if k)} is not supported")


_VOCABULARY_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VOCABULARIES: dict[str, outlines_core.Vocabulary] = {}


def vocabulary_key(tokenizer) -> str:
  """A digest of `tokenizer`'s token bytes and EOS; equal vocabularies share automata.

  Builds the outlines-core `Vocabulary` on first use of a vocabulary.
  """
  key = _VOCABULARY_KEYS.get(tokenizer)
  if key is None:
    tokens, eos = _token_bytes(tokenizer)
    listing = sorted((data, ids) for data, ids in tokens.items())
    key = hashlib.sha256(repr((eos, listing)).encode()).hexdigest()
    if key not in _VOCABULARIES:
      _VOCABULARIES[key] = outlines_core.Vocabulary(eos, tokens)
    _VOCABULARY_KEYS[tokenizer] = key
  return key


# Automata.


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
  vocabulary = _VOCABULARIES[key]
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


# The device table.


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


# Device functions.


def _safe(table: AutomatonTable, states: jax.Array) -> jax.Array:
  return jnp.clip(states, 0, table.accepting.shape[0] - 1)


def allowed_mask(table: AutomatonTable, states: jax.Array) -> jax.Array:
  """bool `[rows, vocab_size]`: the tokens each row may draw (all, for unconstrained rows).

  Args:
    table: the packed automata.
    states: int32 `[rows]`, each row's table state or `UNCONSTRAINED`.
  """
  words = table.bits[_safe(table, states)]
  bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
  allowed = bits.reshape(states.shape[0], -1)[:, : table.vocab_size].astype(bool)
  return allowed | (states < 0)[:, None]


def mask_logits(logits: jax.Array, table: AutomatonTable, states: jax.Array) -> jax.Array:
  """`logits` with -inf at every token a row's state does not allow.

  Unconstrained rows come back bit for bit; EOS survives only in accepting
  states; a dead row is -inf everywhere.

  Args:
    logits: float `[rows, vocab_size]`.
    table: the packed automata.
    states: int32 `[rows]`.

  Raises:
    ValueError: (while tracing) if the logits are not `vocab_size` wide.
  """
  if logits.shape[-1] != table.vocab_size:
    raise ValueError(f"logits have {logits.shape[-1]} columns, the table {table.vocab_size}")
  return jnp.where(allowed_mask(table, states), logits, -jnp.inf)


def advance(table: AutomatonTable, states: jax.Array, tokens: jax.Array) -> jax.Array:
  """Each row's state after its token (a binary search in the state's transitions).

  Args:
    table: the packed automata.
    states: int32 `[rows]`.
    tokens: int32 `[rows]`, the tokens drawn.

  Returns:
    int32 `[rows]`: the next states; `UNCONSTRAINED` rows stay so, and a
    token the state does not allow leads to the dead state.
  """
  safe = _safe(table, states)
  begin, end = table.offsets[safe], table.offsets[safe + 1]
  last = table.tokens.shape[0] - 1

  def halve(_, bounds):
    low, high = bounds
    middle = (low + high) // 2
    right = table.tokens[jnp.minimum(middle, last)] < tokens
    open_ = low < high
    return jnp.where(open_ & right, middle + 1, low), jnp.where(open_ & ~right, middle, high)

  steps = max(table.tokens.shape[0], 1).bit_length()
  found_at, _ = jax.lax.fori_loop(0, steps, halve, (begin, end))
  hit = (found_at < end) & (table.tokens[jnp.minimum(found_at, last)] == tokens)
  after = jnp.where(hit, table.next_states[jnp.minimum(found_at, last)], DEAD_STATE)
  return jnp.where(states < 0, states, after).astype(jnp.int32)


def is_dead(table: AutomatonTable, states: jax.Array) -> jax.Array:
  """bool `[rows]`: the row's state allows no token at all (never for unconstrained rows)."""
  safe = _safe(table, states)
  return (states >= 0) & (table.offsets[safe + 1] == table.offsets[safe])


def is_accepting(table: AutomatonTable, states: jax.Array) -> jax.Array:
  """bool `[rows]`: the row's text is a full match (always for unconstrained rows)."""
  return (states < 0) | table.accepting[_safe(table, states)]
