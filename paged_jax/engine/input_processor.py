"""The input processor: a request's prompt and parameters become a group."""

from __future__ import annotations

import jax
import numpy as np

from paged_jax.engine.sequence import Sequence, SequenceGroup, token_limit
from paged_jax.params import SamplingParams
from paged_jax.structured import Automaton, compile_constraint
from paged_jax.token_ids import check_token_ids

MAX_STOP_TOKENS = 8


class InputProcessor:
  """Checks and encodes requests.

  Args:
    tokenizer: has `encode(text)`; None to take token ids only.
    eos_token_id: the stop token added unless `ignore_eos`, or None.
    vocab_size: token ids are `0 .. vocab_size - 1`.
    max_len: positions a sequence may use.
    max_logprobs: the largest `SamplingParams.logprobs` accepted.
    max_beam_width: the most beams a request may ask for.
    automaton_capacity: the `TableCapacity` a request's automaton must fit
      alone, or None (no tokenizer: no structured outputs).
  """

  def __init__(
    self,
    tokenizer,
    eos_token_id,
    vocab_size,
    max_len,
    max_logprobs,
    max_beam_width,
    automaton_capacity=None,
  ):
    self.tokenizer = tokenizer
    self.eos_token_id = eos_token_id
    self.vocab_size = vocab_size
    self.max_len = max_len
    self.max_logprobs = max_logprobs
    self.max_beam_width = max_beam_width
    self.automaton_capacity = automaton_capacity

  def _encode(self, prompt) -> tuple[str | None, np.ndarray]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass token ids")
      return prompt, np.asarray(self.tokenizer.encode(prompt), np.int32)
    return None, check_token_ids(prompt, self.vocab_size, "prompt")

  def group(
    self, request_id: str, prompt, params: SamplingParams, key: jax.Array, arrival: int
  ) -> SequenceGroup:
    """The request's group: its prompt's ids, stop tokens and one PRNG key
    per sequence (from the request's seed, else from `key`).

    Raises:
      ValueError: for a bad prompt, too many beams, `logprobs` above
        `max_logprobs`, too many stop tokens, stop strings or structured
        outputs without a tokenizer, or structured outputs that cannot be
        compiled.
    """
    if params.use_beam_search and params.n > self.max_beam_width:
      raise ValueError(f"n={params.n} beams exceed max_beam_width={self.max_beam_width}")
    if params.logprobs is not None and params.logprobs > self.max_logprobs:
      raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={self.max_logprobs}")
    if params.prompt_logprobs is not None and params.prompt_logprobs > self.max_logprobs:
      raise ValueError(
        f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs={self.max_logprobs}"
      )
    if params.stop and self.tokenizer is None:
      raise ValueError("stop strings need a tokenizer")
    automaton = self._automaton(params)
    text, ids = self._encode(prompt)
    eos = () if params.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
    if automaton is not None:  # the automaton's end marker always ends a constrained row
      eos = (automaton.eos_token_id,)
    stop_ids = tuple(dict.fromkeys(params.stop_token_ids + eos))
    if len(stop_ids) > MAX_STOP_TOKENS:
      raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKENS} with EOS, got {len(stop_ids)}")
    key = (
      jax.random.key(params.seed) if params.seed is not None else jax.random.fold_in(key, arrival)
    )
    seqs = [
      Sequence(index=j, key_data=np.asarray(jax.random.key_data(jax.random.fold_in(key, j))))
      for j in range(params.n)
    ]
    return SequenceGroup(
      request_id=request_id,
      prompt=text,
      prompt_token_ids=ids,
      params=params,
      arrival=arrival,
      limit=token_limit(self.max_len, ids.size, params),
      stop_ids=stop_ids,
      seqs=seqs,
      automaton=automaton,
    )

  def _automaton(self, params: SamplingParams) -> Automaton | None:
    """The compiled automaton of the request's structured output, or None.

    Raises:
      ValueError: without a tokenizer, or if the constraint cannot be
        compiled (`paged_jax.structured.compile_constraint` says why),
        spells tokens outside the model's vocabulary, or needs a larger
        automaton table than the engine's `automaton_capacity`.
    """
    constraint = params.structured_outputs
    if constraint is None:
      return None
    if self.tokenizer is None:
      raise ValueError("structured_outputs need a tokenizer (the automaton is over its tokens)")
    automaton = compile_constraint(constraint, self.tokenizer)
    if automaton.num_edges and int(automaton.tokens.max()) >= self.vocab_size:
      raise ValueError(
        f"structured_outputs: token {int(automaton.tokens.max())} of the tokenizer is outside "
        f"the model's vocabulary of {self.vocab_size}"
      )
    capacity = self.automaton_capacity
    if capacity is not None and (reason := capacity.shortfall([automaton])) is not None:
      raise ValueError(f"structured_outputs: the constraint's automaton needs {reason}")
    return automaton
