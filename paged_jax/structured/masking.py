"""The device side: pure, jittable functions over an `AutomatonTable` that
mask a batch's logits and step its rows' automata inside one launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.structured.table import DEAD_STATE, AutomatonTable


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
