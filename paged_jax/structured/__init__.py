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

from paged_jax.structured.automaton import DEAD_LOCAL, Automaton, compile_constraint
from paged_jax.structured.constraints import (
  JSON_OBJECT_DEPTH,
  UNSUPPORTED_SCHEMA_KEYWORDS,
  StructuredOutputsParams,
  json_object_regex,
)
from paged_jax.structured.masking import (
  advance,
  allowed_mask,
  is_accepting,
  is_dead,
  mask_logits,
)
from paged_jax.structured.table import (
  DEAD_STATE,
  UNCONSTRAINED,
  AutomatonTable,
  PackedAutomata,
  TableCapacity,
  pack_automata,
  table_size,
)
from paged_jax.structured.vocabulary import vocabulary_key

__all__ = [
  "DEAD_LOCAL",
  "DEAD_STATE",
  "JSON_OBJECT_DEPTH",
  "UNCONSTRAINED",
  "UNSUPPORTED_SCHEMA_KEYWORDS",
  "Automaton",
  "AutomatonTable",
  "PackedAutomata",
  "StructuredOutputsParams",
  "TableCapacity",
  "advance",
  "allowed_mask",
  "compile_constraint",
  "is_accepting",
  "is_dead",
  "json_object_regex",
  "mask_logits",
  "pack_automata",
  "table_size",
  "vocabulary_key",
]
