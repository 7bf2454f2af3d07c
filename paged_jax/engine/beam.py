"""Beam search on the device: one compiled step for every beam group at once.

A group of `W` beams reserves `2W - 1` sequence slots, the first being its
leader (the row that holds the group's settings and finished hypotheses).
Each step follows Hugging Face transformers' beam search (`num_beams=W`,
`early_stopping=False`):

- every beam's candidates score `beam log-probability + token log-prob`;
  the group keeps its best `2W` candidates, in order;
- a candidate ending in a stop token among the first `W` becomes a finished
  hypothesis scored `sum_logprobs / generated_len ** length_penalty`
  (`generated_len` counts the stop token); the group keeps its best `W`;
- the first `W` other candidates are the next beams: the first child of a
  beam keeps its slot, the others fork into the group's free slots (they
  share every block; copy-on-write later copies the last partial one), and
  beams left without a child are freed;
- the group is done once it holds `W` hypotheses and the best candidate's
  score, divided by `generated_len ** length_penalty`, cannot beat the worst
  of them; at `max_tokens` the running beams join the hypotheses.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class Beams:
  """Beam state of every row (sequence slot); rows not in a group ignore it.

  Per row:
    leader: int32 `[S]`, the slot of the row's group leader, -1 if none.
    index: int32 `[S]`, the beam's rank in its group (Hugging Face's order).
    score: float32 `[S]`, the sum of the beam's token log-probabilities.
    tokens: int32 `[S, T]`, the beam's generated tokens.
  At each leader row:
    slots: int32 `[S, R]`, the group's reserved slots (`R = 2 W_max - 1`),
      -1 padding.
    width: int32 `[S]`, the group's beams `W` (0 on other rows).
    length_penalty: float32 `[S]`.
    steps: int32 `[S]`, tokens each beam of the group has generated.
    hyp_tokens, hyp_len, hyp_score, hyp_logprob, hyp_stopped: the group's
      best `W` finished hypotheses (`[S, W_max, T]` and `[S, W_max]`), best
      first; `hyp_score` is -inf where empty.
    done: bool `[S]`, the group has finished.
  """

  leader: jax.Array
  index: jax.Array
  score: jax.Array
  tokens: jax.Array
  slots: jax.Array
  width: jax.Array
  length_penalty: jax.Array
  steps: jax.Array
  hyp_tokens: jax.Array
  hyp_len: jax.Array
  hyp_score: jax.Array
  hyp_logprob: jax.Array
  hyp_stopped: jax.Array
  done: jax.Array

  @classmethod
  def create(cls, num_rows: int, max_width: int, max_tokens: int) -> Beams:
    s, w, t = num_rows, max_width, max_tokens
    return cls(
      leader=jnp.full(s, -1, jnp.int32),
      index=jnp.zeros(s, jnp.int32),
      score=jnp.zeros(s, jnp.float32),
      tokens=jnp.zeros((s, t), jnp.int32),
      slots=jnp.full((s, 2 * w - 1), -1, jnp.int32),
      width=jnp.zeros(s, jnp.int32),
      length_penalty=jnp.ones(s, jnp.float32),
      steps=jnp.zeros(s, jnp.int32),
      hyp_tokens=jnp.zeros((s, w, t), jnp.int32),
      hyp_len=jnp.zeros((s, w), jnp.int32),
      hyp_score=jnp.full((s, w), -jnp.inf, jnp.float32),
      hyp_logprob=jnp.zeros((s, w), jnp.float32),
      hyp_stopped=jnp.zeros((s, w), bool),
      done=jnp.zeros(s, bool),
    )

  def start(self, slots, width: int, length_penalty: float) -> Beams:
    """A new group in `slots` (its leader first, `-1` padding to the group
    capacity `2 W_max - 1`), with one beam, empty."""
    slots = jnp.asarray(slots, jnp.int32)
    leader = slots[0]
    fresh = Beams.create(*self.hyp_len.shape, self.tokens.shape[1])
    one = lambda a, value: a.at[leader].set(value)
    beams = jax.tree.map(lambda a, f: a.at[leader].set(f[0]), self, fresh)
    return beams.replace(
      leader=self.leader.at[self._rows(slots)].set(leader, mode="drop"),
      index=one(beams.index, 0),
      score=one(beams.score, 0.0),
      slots=one(beams.slots, slots),
      width=one(beams.width, width),
      length_penalty=one(beams.length_penalty, length_penalty),
    )

  def clear(self, slots) -> Beams:
    """Forgets the group in `slots` (its leader first, `-1` padding)."""
    fresh = Beams.create(*self.hyp_len.shape, self.tokens.shape[1])
    rows = self._rows(jnp.asarray(slots, jnp.int32))
    return jax.tree.map(lambda a, f: a.at[rows].set(f[0], mode="drop"), self, fresh)

  def _rows(self, slots: jax.Array) -> jax.Array:
    """`slots` with the `-1` padding moved out of range (dropped by
    scatters)."""
    return jnp.where(slots >= 0, slots, self.leader.shape[0])


class BeamMoves(flax.struct.PyTreeNode):
  """What one beam step asks of the block manager and the decode loop.

  fork_parents, fork_children: int32 `[S * 2 W_max]` pairs for `fork_each`
    (-1 padding): beams that fork into a free slot of their group.
  dropped: bool `[S]`, beam rows to free (no child, or their group ended).
  slots, last_token, num_generated: the rows' new values (beam rows only;
    other rows keep theirs).
  finished: bool `[S]`, leaders whose group finished in this step.
  """

  fork_parents: jax.Array
  fork_children: jax.Array
  dropped: jax.Array
  slots: jax.Array
  last_token: jax.Array
  num_generated: jax.Array
  finished: jax.Array


def _take(a: jax.Array, index: jax.Array) -> jax.Array:
  """a[g, index[g, i]] for every row g (index of shape [S, k])."""
  extra = a.ndim - 2
  return jnp.take_along_axis(a, index.reshape(index.shape + (1,) * extra), axis=1)


def _merge_hypotheses(beams: Beams, update, score, tokens, length, logprob, stopped) -> Beams:
  """Keeps each updated group's best `W` of its hypotheses and new ones."""
  w_max = beams.hyp_score.shape[1]
  cat = lambda old, new: jnp.concatenate([old, new], axis=1)
  all_score = cat(beams.hyp_score, score)
  best_score, best = jax.lax.top_k(all_score, w_max)  # ties: older first
  in_width = jnp.arange(w_max)[None, :] < beams.width[:, None]
  best_score = jnp.where(in_width, best_score, -jnp.inf)
  keep = lambda old, new: jnp.where(
    update.reshape((-1,) + (1,) * (old.ndim - 1)), _take(cat(old, new), best), old
  )
  return beams.replace(
    hyp_score=jnp.where(update[:, None], best_score, beams.hyp_score),
    hyp_tokens=keep(beams.hyp_tokens, tokens),
    hyp_len=keep(beams.hyp_len, length),
    hyp_logprob=keep(beams.hyp_logprob, logprob),
    hyp_stopped=keep(beams.hyp_stopped, stopped),
  )


def step(
  beams: Beams,
  logprobs: jax.Array,
  running: jax.Array,
  stop_ids: jax.Array,
  limit: jax.Array,
  slots: jax.Array,
  last_token: jax.Array,
  num_generated: jax.Array,
) -> tuple[Beams, BeamMoves]:
  """One beam-search step of every group from its beams' log-probabilities.

  Args:
    beams: the beam state.
    logprobs: float32 `[S, V]`, each row's next-token log-probabilities.
    running: bool `[S]`, rows that ran this step.
    stop_ids: int32 `[S, E]`, stop tokens (read at leaders), -1 padding.
    limit: int32 `[S]`, tokens to generate at most (read at leaders).
    slots, last_token, num_generated: the rows' current values.

  Returns:
    The new beam state and the moves to carry out.
  """
  num_rows, _ = logprobs.shape
  w_max = beams.hyp_score.shape[1]
  k, t = 2 * w_max, beams.tokens.shape[1]
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  active = running & (beams.leader >= 0)
  candidates = jnp.where(active[:, None], beams.score[:, None] + logprobs, -jnp.inf)
  row_score, row_token = jax.lax.top_k(candidates, k)
  # Each group's beams in beam order, then its best 2W candidates.
  members = (
    jnp.full((num_rows, w_max), -1, jnp.int32)
    .at[jnp.where(active, beams.leader, num_rows), beams.index]
    .set(rows, mode="drop")
  )
  present = members >= 0
  safe_members = jnp.maximum(members, 0)
  flat = lambda a: a.reshape(num_rows, w_max * k)
  group_score = flat(jnp.where(present[..., None], row_score[safe_members], -jnp.inf))
  score, pick = jax.lax.top_k(group_score, k)
  token = _take(flat(row_token[safe_members]), pick)
  parent = _take(flat(jnp.broadcast_to(members[..., None], (num_rows, w_max, k))), pick)
  live = (beams.width > 0) & jnp.any(present, axis=1) & ~beams.done

  width = beams.width[:, None]
  rank = jnp.arange(k)[None, :]
  stops = jnp.any(token[..., None] == stop_ids[:, None, :], axis=-1)
  new_hyp = live[:, None] & stops & (rank < width)
  beam_rank = jnp.cumsum(~stops, axis=1) - 1
  chosen = live[:, None] & ~stops & (beam_rank < width)
  length = beams.steps + 1
  denominator = (length.astype(jnp.float32) ** beams.length_penalty)[:, None]
  column = jnp.arange(t)[None, None, :]
  cand_tokens = jnp.where(
    column == (length - 1)[:, None, None], token[..., None], beams.tokens[jnp.maximum(parent, 0)]
  )
  lengths = jnp.broadcast_to(length[:, None], (num_rows, k))
  beams = _merge_hypotheses(
    beams,
    live,
    jnp.where(new_hyp, score / denominator, -jnp.inf),
    cand_tokens,
    lengths,
    score,
    jnp.ones((num_rows, k), bool),
  )
  worst = beams.hyp_score[rows, jnp.maximum(beams.width - 1, 0)]
  done = live & (worst > -jnp.inf) & (worst >= score[:, 0] / denominator[:, 0])
  at_limit = live & ~done & (length >= limit)
  # At max_tokens the running beams join the hypotheses (in beam order).
  in_beams = jnp.argsort(jnp.where(chosen, beam_rank, k), axis=1, stable=True)
  beams = _merge_hypotheses(
    beams,
    at_limit,
    jnp.where(_take(chosen, in_beams), _take(score, in_beams) / denominator, -jnp.inf),
    _take(cand_tokens, in_beams),
    lengths,
    _take(score, in_beams),
    jnp.zeros((num_rows, k), bool),
  )
  finished = done | at_limit

  # Next beams: a beam's first child keeps its slot, others fork.
  child_of = chosen & ~finished[:, None]
  earlier = jnp.tril(jnp.ones((k, k), bool), -1)[None]
  repeat = jnp.any(
    (parent[:, :, None] == parent[:, None, :]) & child_of[:, None, :] & earlier, axis=-1
  )
  first = child_of & ~repeat
  forks = child_of & repeat
  reserved = beams.slots
  spare = (reserved >= 0) & ~running[jnp.maximum(reserved, 0)]
  spare_rank = jnp.cumsum(spare, axis=1) - 1
  spare_slots = (
    jnp.full_like(reserved, -1)
    .at[rows[:, None], jnp.where(spare, spare_rank, reserved.shape[1])]
    .set(reserved, mode="drop")
  )
  fork_rank = jnp.clip(jnp.cumsum(forks, axis=1) - 1, 0, reserved.shape[1] - 1)
  child = jnp.where(first, parent, jnp.where(forks, _take(spare_slots, fork_rank), -1))
  kept = (
    jnp.zeros(num_rows, bool)
    .at[jnp.where(first, parent, num_rows).reshape(-1)]
    .set(True, mode="drop")
  )
  dropped = active & ~kept

  dst = jnp.where(child_of, child, num_rows).reshape(-1)
  put = lambda a, values: a.at[dst].set(values.reshape((-1,) + a.shape[1:]), mode="drop")
  beams = beams.replace(
    score=put(beams.score, score),
    index=put(beams.index, beam_rank),
    tokens=put(beams.tokens, cand_tokens),
    steps=jnp.where(live, length, beams.steps),
    done=beams.done | finished,
  )
  moves = BeamMoves(
    fork_parents=jnp.where(forks, parent, -1).reshape(-1),
    fork_children=jnp.where(forks, child, -1).reshape(-1),
    dropped=dropped,
    slots=put(jnp.where(dropped, -1, slots), child),
    last_token=put(last_token, token),
    num_generated=put(num_generated, lengths),
    finished=finished,
  )
  return beams, moves
