"""Requests as the host tracks them: a group of `n` sequences per request."""

from __future__ import annotations

import dataclasses

import numpy as np

from paged_jax.params import SamplingParams
from paged_jax.structured import Automaton


def token_limit(max_len: int, num_prompt_tokens: int, params: SamplingParams) -> int:
  """Tokens each sequence of a request may draw: `max_tokens`, or fewer
  where the sequence would pass `max_len` positions."""
  return min(params.max_tokens, max_len - num_prompt_tokens)


@dataclasses.dataclass
class Detokenized:
  """A sequence's text, decoded a few tokens at a time, as vLLM's detokenizer does.

  Tokens `prefix_offset .. read_offset` are the context the newest tokens are
  decoded with (so that a tokenizer that drops a leading space at the start
  of a text decodes them as it would in the whole sequence); `pending` is
  the text of the tokens after `read_offset`, held back while it ends in a
  partial UTF-8 character ("\\ufffd").

  Attributes:
    text: the text of tokens `0 .. read_offset`.
    pending: the text of the tokens after `read_offset`.
    prefix_offset: first token of the context.
    read_offset: tokens whose text is in `text`.
  """

  text: str = ""
  pending: str = ""
  prefix_offset: int = 0
  read_offset: int = 0

  @property
  def full_text(self) -> str:
    """The text of every token added (a full decode of them)."""
    return self.text + self.pending


@dataclasses.dataclass
class Sequence:
  """One sequence of a group.

  Attributes:
    index: the sequence's index among the group's `n`.
    key_data: the sequence's PRNG key (raw words).
    slot: its sequence slot, -1 when it holds none.
    token_ids: the tokens drawn so far (a stop token included).
    token_logprobs: their log-probabilities.
    cumulative_logprob: a finished beam's, read from the device.
    logprobs: per token, the most likely alternatives (when asked for).
    finish_reason, stop_reason: why it finished (None while running).
    detokenized: its text (with a tokenizer).
    sent_text, sent_tokens: characters and tokens already streamed (delta
      outputs).
    tokens_to_prefill: tokens to put in the cache on admission (the prompt,
      or prompt and output after a recomputation), None once they are.
    num_computed: tokens of `tokens_to_prefill` planned into the cache so far.
    cached_prefix: tokens of `tokens_to_prefill` whose K/V the cache already holds
      (prefix-cache hits) but that run through prefill again for their
      prompt log-probabilities; prefill does not write them.
    automaton_state: with structured outputs, the state of the group's
      automaton after `token_ids` (its own numbering, 0 the start).
  """

  index: int
  key_data: np.ndarray
  slot: int = -1
  token_ids: list[int] = dataclasses.field(default_factory=list)
  token_logprobs: list[float] = dataclasses.field(default_factory=list)
  cumulative_logprob: float | None = None
  logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  detokenized: Detokenized = dataclasses.field(default_factory=Detokenized)
  sent_text: int = 0
  sent_tokens: int = 0
  tokens_to_prefill: np.ndarray | None = None
  num_computed: int = 0
  cached_prefix: int = 0
  automaton_state: int = 0

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  @property
  def allocated(self) -> bool:
    """Whether the sequence holds a table in its slot."""
    return self.slot >= 0 and (self.tokens_to_prefill is not None or bool(self.token_ids))


@dataclasses.dataclass
class SequenceGroup:
  """A request: its prompt, parameters and sequences."""

  request_id: str
  prompt: str | None
  prompt_token_ids: np.ndarray
  params: SamplingParams
  arrival: int
  limit: int  # tokens each sequence draws at most
  stop_ids: tuple[int, ...]
  seqs: list[Sequence]
  error: str | None = None
  beam_slots: list[int] = dataclasses.field(default_factory=list)
  shard: int = 0  # the data shard that serves it
  load: int = 0  # tokens it adds to its shard's load
  # With `params.prompt_logprobs`: None for the first prompt token, then one
  # dict per prompt token (alternatives and the token itself -> logprob).
  prompt_logprobs: list[dict[int, float] | None] = dataclasses.field(default_factory=list)
  automaton: Automaton | None = None  # of `params.structured_outputs`, compiled

  @property
  def beam(self) -> bool:
    return self.params.use_beam_search

  def num_slots(self) -> int:
    """Sequence slots the group needs: `2n - 1` for `n` beams (spare slots
    for the beams that fork), else one per unfinished sequence."""
    return 2 * self.params.n - 1 if self.beam else len(self.live())

  def live(self) -> list[Sequence]:
    return [s for s in self.seqs if not s.finished]

  @property
  def finished(self) -> bool:
    return all(s.finished for s in self.seqs)

  @property
  def fresh(self) -> bool:
    """No token drawn yet: prefill the prompt once, then fork `n` samples."""
    return not any(s.token_ids for s in self.seqs)
