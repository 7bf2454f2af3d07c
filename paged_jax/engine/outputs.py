"""What the engine returns: one `RequestOutput` per request, as in vLLM."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class CompletionOutput:
  """One sequence generated for a request.

  Attributes:
    index: the sequence's index among the request's `n`.
    text: the generated text (empty without a tokenizer). A stop string and
      what follows it are left out; stop tokens are not decoded.
    token_ids: the generated token ids, a stop token included.
    cumulative_logprob: sum of the log-probabilities of `token_ids` under the
      model (before temperature, top-k and top-p), or with
      `logprobs_mode="processed"` under the distribution they were drawn from.
    logprobs: with `SamplingParams.logprobs=k`, one dict per token mapping the
      `k` most likely token ids, and the drawn one, to log-probabilities.
    finish_reason: None while running, then "stop" (a stop token or string),
      "length" (`max_tokens`, or the model's or block table's positions),
      "abort" or "error".
    stop_reason: the stop token id or string that ended the sequence.
    token_logprobs: float32 `[len(token_ids)]`, each token's log-probability
      (under `SamplingParams.logprobs_mode`'s distribution), ready for
      `jnp`; None for beam search, whose tokens come from the hypotheses.
  """

  index: int
  text: str
  token_ids: list[int]
  cumulative_logprob: float
  logprobs: list[dict[int, float]] | None
  finish_reason: str | None = None
  stop_reason: int | str | None = None
  token_logprobs: np.ndarray | None = None


@dataclasses.dataclass
class RequestOutput:
  """A request's state as one `LLMEngine.step` or `LLM.generate` reports it.

  Attributes:
    request_id: the id given to `add_request`.
    prompt: the prompt text, or None when token ids were given.
    prompt_token_ids: the prompt's token ids.
    outputs: the request's sequences (all of them, or only what is new with
      `output_kind="delta"`).
    finished: whether every sequence has finished.
    error: why the request could not be served (finish reason "error").
    prompt_logprobs: with `SamplingParams.prompt_logprobs=k`, None for the
      first prompt token, then per prompt token a dict mapping it and its
      `k` most likely alternatives to their log-probabilities given the
      tokens before it (complete once the prompt is prefilled); else None.
  """

  request_id: str
  prompt: str | None
  prompt_token_ids: np.ndarray
  outputs: list[CompletionOutput]
  finished: bool
  error: str | None = None
  prompt_logprobs: list[dict[int, float] | None] | None = None

  def arrays(self, length: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(tokens, mask, logprobs)`, one row per entry of `outputs`, padded to
    `length` columns (default: the longest): int32 token ids (0 after a
    sequence's end), bool True on its tokens, float32 `token_logprobs` (0
    after its end), ready for `jnp`.

    Raises:
      ValueError: for a sequence longer than `length`, or one without
        `token_logprobs` (beam search).
    """
    sizes = [len(c.token_ids) for c in self.outputs]
    length = max(sizes, default=0) if length is None else length
    shape = (len(self.outputs), length)
    tokens, mask = np.zeros(shape, np.int32), np.zeros(shape, bool)
    logprobs = np.zeros(shape, np.float32)
    for row, (completion, size) in enumerate(zip(self.outputs, sizes)):
      if size > length or completion.token_logprobs is None:
        raise ValueError(
          f"request {self.request_id!r} sequence {completion.index}: "
          + (f"{size} tokens do not fit {length}" if size > length else "no token_logprobs")
        )
      tokens[row, :size], mask[row, :size] = completion.token_ids, True
      logprobs[row, :size] = completion.token_logprobs
    return tokens, mask, logprobs


@dataclasses.dataclass
class GenerationStats:
  """What an engine (or a `generate` call) did.

  Attributes:
    generated_tokens: tokens sampled over all sequences (as returned).
    prompt_tokens: prompt tokens over all requests.
    prefill_tokens: tokens that ran through prefill (prefix-cache hits skip
      some; recomputed preempted sequences run theirs again).
    prefill_positions: token positions the prefill launches computed,
      besides a ragged step's decoding rows: the prefill tokens plus the
      padding of their token buckets (`LLMEngine.compiled_programs`);
      `prefill_padding` is the padded share.
    decode_steps: iterations of the decode loop.
    decode_positions: rows the decode launches computed, summed over their
      steps: a decode loop runs each data shard's decoding sequences padded
      to a row bucket (`LLMEngine.compiled_programs`), a ragged step only
      its decoding rows.
    decode_tokens: the rows of those that decoded a sequence;
      `decode_padding` is the padded share.
    loop_launches: times the host entered the compiled loop.
    loop_launches_ahead: of those, launches dispatched before the one they
      continue was read back (`LLMEngine(async_scheduling=True)`).
    peak_blocks: most GPU blocks in use at once (of every attention type, on
      a hybrid cache).
    kv_slot_utilization: mean over decode steps of tokens held by running
      sequences per allocated KV slot. Above 1 when sequences share blocks
      (forked samples, prefix-cache hits): each holder counts the tokens.
    prefix_cache_hit_rate: the block manager's hits / lookups; the sentinel
      -1.0 means prefix caching is off (0.0: on, nothing hit).
    cow_copies: blocks copied on write.
    preemptions: groups preempted for lack of blocks (recompute or swap).
    swaps: blocks moved between device and host (out and in).
    spec_decode_num_drafts: speculative decoding: steps in which a sequence
      had proposals (vLLM's `vllm:spec_decode_num_drafts`).
    spec_decode_num_draft_tokens: tokens proposed.
    spec_decode_num_accepted_tokens: proposed tokens the target accepted.
  """

  generated_tokens: int = 0
  prompt_tokens: int = 0
  prefill_tokens: int = 0
  prefill_positions: int = 0
  decode_steps: int = 0
  decode_positions: int = 0
  decode_tokens: int = 0
  loop_launches: int = 0
  loop_launches_ahead: int = 0
  peak_blocks: int = 0
  kv_slot_utilization: float = 0.0
  prefix_cache_hit_rate: float = -1.0
  cow_copies: int = 0
  preemptions: int = 0
  swaps: int = 0
  spec_decode_num_drafts: int = 0
  spec_decode_num_draft_tokens: int = 0
  spec_decode_num_accepted_tokens: int = 0

  @property
  def spec_decode_acceptance_rate(self) -> float:
    """Accepted over proposed tokens (0.0 before any proposal)."""
    proposed = self.spec_decode_num_draft_tokens
    return self.spec_decode_num_accepted_tokens / proposed if proposed else 0.0

  @property
  def spec_decode_mean_accepted_length(self) -> float:
    """Tokens emitted per step with proposals: 1 + accepted per draft (0.0
    before any)."""
    drafts = self.spec_decode_num_drafts
    return 1.0 + self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0

  @property
  def prefill_padding(self) -> float:
    """The share of prefill positions that were padding (0.0 before any prefill)."""
    return 1.0 - self.prefill_tokens / self.prefill_positions if self.prefill_positions else 0.0

  @property
  def decode_padding(self) -> float:
    """The share of decode positions that were padding (0.0 before any decode)."""
    return 1.0 - self.decode_tokens / self.decode_positions if self.decode_positions else 0.0
