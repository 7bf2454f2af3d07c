"""Speculative decoding: the config, the proposals and the acceptance rule.

Each step of a speculating decode loop proposes up to `k` tokens per row,
runs the target model once over the row's last token and its proposals
(`k + 1` query tokens on the paged cache), and keeps the longest prefix of
proposals the target accepts plus one token of its own. The rules (what the
lookahead slots hold, what becomes of reserved blocks) are in
docs/semantics.md ("Speculative decoding").

Acceptance is the standard rejection rule (Leviathan et al. 2023, Chen et
al. 2023) with the target's draws keyed as without speculation: the token
at output index `t` of a row is drawn with `fold_in(key, t)`.

* A proposal that is a single token (prompt lookup, or a greedy row's
  draft) has a point-mass proposal distribution `q`. The rule then accepts
  `d` with probability `p(d)` and resamples a rejection from `p` without
  `d`: exactly what drawing `t ~ p` and accepting `d` when `t == d` does,
  emitting `t` at the first mismatch. So every emitted token is the
  target's own draw from the same prefix and key, and the output equals
  decoding without speculation token for token, greedy or seeded.
* A draft model's sampled proposal (`q` its distribution) is accepted with
  probability `min(1, p(d) / q(d))`; the first rejection is resampled from
  `norm(max(0, p - q))`, and after `k` acceptances the next token comes
  from `p`. The output then has the target's distribution, not its draws.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.sampling import categorical_rows

METHODS = ("ngram", "draft_model")
_KEYS = {
  "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
  "draft_model": {"method", "num_speculative_tokens", "model"},
}
# Ours, not vLLM's: whether launches that speculate give way to plain ones
# where those measure faster (see `LaunchChooser`).
_OPTIONS = {"adaptive"}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """How the decode loop speculates (static: one compile per config).

  Attributes:
    method: "ngram" (prompt lookup in the row's own tokens) or
      "draft_model" (a smaller model's greedy or sampled decode).
    num_speculative_tokens: `k`, tokens proposed per row and step.
    prompt_lookup_max: ngram: the longest suffix looked up.
    prompt_lookup_min: ngram: the shortest.
    adaptive: ngram: whether the engine runs a decode launch without
      speculation where that measures faster (`LaunchChooser`; the
      default); False: every launch speculates (a draft model's always do:
      it must run every token).
  """

  method: str
  num_speculative_tokens: int
  prompt_lookup_max: int = 4
  prompt_lookup_min: int = 1
  adaptive: bool = dataclasses.field(default=True, compare=False)  # the host's: one program


def parse_config(spec, vocab_size: int):
  """`(SpeculativeConfig, draft model or None)` from vLLM's dict form, or
  `(None, None)` for None.

  Raises:
    ValueError: naming an unknown method or key, a count out of range, or a
      draft model whose vocabulary differs from the target's.
  """
  if spec is None:
    return None, None
  if not isinstance(spec, dict):
    raise ValueError(f"speculative_config must be a dict or None, got {type(spec).__name__}")
  method = spec.get("method")
  if method not in METHODS:
    raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
  unknown = sorted(set(spec) - _KEYS[method] - _OPTIONS)
  if unknown:
    raise ValueError(
      f"speculative_config key {unknown[0]!r} is not understood for method {method!r} "
      f"(known: {sorted(_KEYS[method])})"
    )
  config = SpeculativeConfig(
    method=method,
    num_speculative_tokens=spec.get("num_speculative_tokens"),
    prompt_lookup_max=spec.get("prompt_lookup_max", 4),
    prompt_lookup_min=spec.get("prompt_lookup_min", 1),
    adaptive=spec.get("adaptive", method == "ngram"),
  )
  if not isinstance(config.adaptive, bool):
    raise ValueError(f"speculative_config adaptive must be a bool, got {config.adaptive!r}")
  if config.adaptive and method != "ngram":
    raise ValueError(
      "speculative_config adaptive needs the ngram method: a draft model must run every token, "
      "so every launch speculates"
    )
  for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"speculative_config {name} must be an int >= 1, got {value!r}")
  if config.prompt_lookup_min > config.prompt_lookup_max:
    raise ValueError(
      f"speculative_config prompt_lookup_min ({config.prompt_lookup_min}) must be at most "
      f"prompt_lookup_max ({config.prompt_lookup_max})"
    )
  draft = spec.get("model")
  if method == "draft_model":
    draft_vocab = getattr(getattr(draft, "config", None), "vocab_size", None)
    if draft_vocab is None:
      raise ValueError("speculative_config 'model' must be a model with config.vocab_size")
    if draft_vocab != vocab_size:
      raise ValueError(
        f"the draft model's vocabulary has {draft_vocab} tokens, the target's {vocab_size}: "
        f"a draft must share the target's tokenizer"
      )
  return config, draft


class LaunchChooser:
  """Picks, per decode launch, speculating or plain steps: whichever gives
  more tokens per second for the launch's row count.

  Speculation pays only when its accepted tokens outweigh its wider model
  call (`k + 1` query tokens a row: on a CPU about twice a one-token step).
  The chooser keeps, per row count, a moving average of each kind's seconds
  per step and of speculation's tokens per row and step, and picks the kind
  with the higher rate. Speculation's tokens are measured in speculating
  launches and, in plain ones, computed from the tokens drawn: prompt
  lookup's outputs equal plain decoding's, so what it would have accepted is
  known (`lookup_walk`) without running it. Seconds are measured only
  by running a kind: one not timed yet runs first, and the slower kind runs
  once every `remeasure_every` launches of its row count. Outputs do not
  depend on the choice (speculation is exact).
  """

  def __init__(self, remeasure_every: int = 32, decay: float = 0.5):
    self.remeasure_every, self.decay = remeasure_every, decay
    self._seconds: dict[tuple[int, bool], float] = {}  # (rows, speculated) -> s per step
    self._tokens: dict[int, float] = {}  # rows -> tokens per row and step, speculating
    self._since: dict[tuple[int, bool], int] = {}  # launches since a kind last ran

  def speculate(self, num_rows: int) -> bool:
    """Whether the next launch of `num_rows` rows speculates."""
    kind = self._pick(num_rows)
    self._since[num_rows, kind] = 0
    self._since[num_rows, not kind] = self._since.get((num_rows, not kind), 0) + 1
    return kind

  def _pick(self, num_rows: int) -> bool:
    for kind in (True, False):
      if (num_rows, kind) not in self._seconds:
        return kind
    faster = self.tokens_per_second(num_rows, True) >= self.tokens_per_second(num_rows, False)
    return faster != (self._since.get((num_rows, not faster), 0) >= self.remeasure_every - 1)

  def tokens_per_second(self, num_rows: int, speculated: bool) -> float:
    """The estimate of tokens per row and second of a kind of launch."""
    tokens = self._tokens[num_rows] if speculated else 1.0
    return tokens / self._seconds[num_rows, speculated]

  def record_time(self, num_rows: int, speculated: bool, seconds: float, steps: int) -> None:
    """Takes in a launch's duration and steps."""
    if steps > 0:
      self._average(self._seconds, (num_rows, speculated), seconds / steps)

  def record_tokens(self, num_rows: int, tokens: int, row_steps: int) -> None:
    """Takes in speculation's tokens over `row_steps` rows' steps, measured
    or computed."""
    if row_steps > 0:
      self._average(self._tokens, num_rows, tokens / row_steps)

  def _average(self, table: dict, key, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else self.decay * old + (1 - self.decay) * value


def lookup_walk(tokens: np.ndarray, positions: range, config: SpeculativeConfig) -> tuple[int, int]:
  """`(steps, tokens)` that speculating steps with prompt lookup would take
  and draw over `positions` of a row's `tokens` (prompt and output): from
  the first position on, a step at `t` looks up in `tokens[:t]`, checks its
  proposals against `tokens[t:]` (the tokens the target drew) and draws its
  accepted ones plus one, so the next step is at `t + accepted + 1`. The
  host's twin of `propose_ngram`, for `LaunchChooser`."""
  k, steps, drawn, t = config.num_speculative_tokens, 0, 0, positions.start
  while t < positions.stop:
    proposal = _lookup(tokens[:t], k, config.prompt_lookup_min, config.prompt_lookup_max)
    checked = tokens[t : t + len(proposal)]
    accepted = int(np.cumprod(proposal[: len(checked)] == checked).sum())
    steps, drawn, t = steps + 1, drawn + accepted + 1, t + accepted + 1
  return steps, drawn


def _lookup(tokens: np.ndarray, num_tokens: int, min_n: int, max_n: int) -> np.ndarray:
  """`propose_ngram`'s proposal for one row (byte search in C)."""
  data = np.ascontiguousarray(tokens, "<i4").tobytes()
  before_last = data[: len(data) - 4]  # an occurrence ends before the last token
  for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
    start = _last_aligned(before_last, data[len(data) - 4 * n :])
    if start >= 0:
      return tokens[start + n : start + n + num_tokens]
  return tokens[:0]


def _last_aligned(haystack: bytes, needle: bytes) -> int:
  """The element index of the last int32-aligned occurrence, or -1."""
  end = len(haystack)
  while (at := haystack.rfind(needle, 0, end)) >= 0:
    if at % 4 == 0:
      return at // 4
    end = at + len(needle) - 1
  return -1


def propose_ngram(
  history: jax.Array, length: jax.Array, num_tokens: int, min_n: int, max_n: int
) -> tuple[jax.Array, jax.Array]:
  """Prompt lookup: each row's proposal continues the latest earlier
  occurrence of its longest matching suffix.

  For the longest `n` in `min_n..max_n` whose last `n` tokens occur earlier
  in the row (overlapping the suffix is allowed, the suffix itself is not),
  the proposal is the tokens that followed the latest such occurrence.

  Args:
    history: int32 `[rows, H]`, each row's tokens (prompt and output).
    length: int32 `[rows]`, how many of them there are.
    num_tokens: `k`, the most tokens proposed (static).
    min_n, max_n: suffix lengths tried (static).

  Returns:
    `(drafts, count)`: int32 `[rows, k]` proposals, the first `count[row]`
    of each row real (0 where nothing matched).
  """
  rows, width = history.shape
  padded = jnp.concatenate([history, jnp.full((rows, max_n), -1, history.dtype)], axis=1)
  starts = jnp.arange(width)[None, :]
  follow = jnp.full(rows, -1, jnp.int32)
  for n in range(min_n, max_n + 1):  # a longer match overrides a shorter one
    tail = jnp.clip(length[:, None] - n + jnp.arange(n)[None, :], 0, width - 1)
    suffix = jnp.take_along_axis(history, tail, axis=1)
    match = starts + n < length[:, None]
    for i in range(n):
      match &= padded[:, i : i + width] == suffix[:, i : i + 1]
    latest = jnp.max(jnp.where(match, starts, -1), axis=1)
    follow = jnp.where(latest >= 0, latest + n, follow).astype(jnp.int32)
  count = jnp.where(follow >= 0, jnp.minimum(num_tokens, length - follow), 0)
  at = jnp.clip(follow[:, None] + jnp.arange(num_tokens)[None, :], 0, width - 1)
  return jnp.take_along_axis(history, at, axis=1), count.astype(jnp.int32)


def leading_true(accepted: jax.Array) -> jax.Array:
  """int32 `[rows]`: how many of each row's first entries of bool `[rows, k]`
  are True before the first False."""
  return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def accept_sampled(
  target_probs: jax.Array,
  draft_probs: jax.Array,
  drafts: jax.Array,
  count: jax.Array,
  keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """The rejection rule for drafts sampled from `draft_probs`.

  Draft `i` is accepted with probability `min(1, p_i(d) / q_i(d))`; the
  first rejected one is replaced by a draw from `norm(max(0, p_i - q_i))`;
  with all `count` accepted, the next token is drawn from `p_count`.

  Args:
    target_probs: float32 `[rows, k + 1, vocab]`, the target's distributions
      after each prefix (`p_0` after the row's last token).
    draft_probs: float32 `[rows, k, vocab]`, the draft's (`q_i`, that `d_i`
      was drawn from).
    drafts: int32 `[rows, k]`.
    count: int32 `[rows]`, real drafts per row.
    keys: PRNG keys `[rows, k + 1]`, one per position.

  Returns:
    `(accepted, tokens)`: int32 `[rows]` drafts accepted and int32
    `[rows, k + 1]` tokens emitted: the accepted drafts, then the
    replacement or next token at index `accepted`.
  """
  k = drafts.shape[1]
  p_d = jnp.take_along_axis(target_probs[:, :k], drafts[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0]
  fold = lambda data: jax.vmap(jax.vmap(lambda key: jax.random.fold_in(key, data)))(keys)
  uniforms = jax.vmap(jax.vmap(jax.random.uniform))(fold(1)[:, :k])
  ok = (uniforms * q_d < p_d) & (jnp.arange(k)[None, :] < count[:, None])
  accepted = leading_true(ok)
  rows = jnp.arange(drafts.shape[0])
  p_next = target_probs[rows, accepted]
  q_next = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)[
    rows, accepted
  ]
  rejected = (accepted < count)[:, None]
  weights = jnp.where(rejected, jnp.maximum(p_next - q_next, 0.0), p_next)
  replacement = categorical_rows(fold(2)[rows, accepted], jnp.log(weights))
  tokens = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
  tokens = tokens.at[rows, accepted].set(replacement)
  return accepted, tokens
