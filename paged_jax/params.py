"""`SamplingParams`: how a request's tokens are drawn and when they stop.

Field names follow vLLM's `SamplingParams`, so its users feel at home.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from paged_jax.structured import StructuredOutputsParams

OUTPUT_KINDS = ("cumulative", "delta", "final")
# `logprobs_mode` values and the longer names they may be given by.
LOGPROBS_MODES = {"raw": "raw", "processed": "processed"}
LOGPROBS_MODES.update({"raw_logprobs": "raw", "processed_logprobs": "processed"})


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How tokens are drawn and when a sequence stops; frozen and hashable.

  Attributes:
    n: sequences returned per prompt (samples, or beams with beam search).
    temperature: softmax temperature; 0 means greedy (argmax).
    top_p: keep the smallest set of tokens whose probability reaches `top_p`.
    top_k: keep the `top_k` most likely tokens; 0 keeps all.
    max_tokens: tokens generated per sequence at most. A sequence also stops,
      with finish reason "length", where the model's `max_seq_len` positions
      or the block table end.
    stop: strings that end a sequence when they appear in its text (checked
      on the host, so they may span tokens); the text stops before them.
    stop_token_ids: token ids that end a sequence (kept in `token_ids`).
    ignore_eos: keep going past the tokenizer's EOS token.
    seed: per-request seed; the same seed gives the same tokens whatever the
      batch, budgets or preemptions. None draws from the engine's seed.
    logprobs: how many of each token's most likely alternatives to return
      (with their log-probabilities); None returns none.
    prompt_logprobs: for every prompt token after the first, its
      log-probability given the tokens before it and the `prompt_logprobs`
      most likely alternatives (`RequestOutput.prompt_logprobs`); None
      computes none. Prefill computes them, also where the prompt's blocks
      are prefix-cache hits (their positions run through the model again;
      their cached K/V is not rewritten).
    logprobs_mode: which distribution every log-probability returned for a
      generated token (`CompletionOutput.token_logprobs`,
      `cumulative_logprob`, `logprobs`) is taken from: "raw", the model's
      softmax; or "processed", the distribution the token was drawn from,
      after temperature, top-k and top-p (tokens outside them at -inf;
      greedy draws: the model's), the one a policy-gradient ratio needs.
      "raw_logprobs" and "processed_logprobs" are accepted and stored as
      "raw" and "processed". Prompt log-probabilities are always "raw".
      "processed" is refused with speculative decoding.
    use_beam_search: beam search with `n` beams, on the device (temperature
      must be 0; see `paged_jax.engine.beam`).
    length_penalty: beam scores are `sum_logprobs / length**length_penalty`.
    output_kind: what a streamed `RequestOutput` carries: "cumulative" (all
      text so far), "delta" (only what is new) or "final" (nothing until the
      request finishes).
    structured_outputs: a constraint on the output (a JSON schema, a regex
      or a list of choices; see `paged_jax.structured`), or None. It is
      compiled when the request is added (an error then, before any step,
      if it cannot be), and every draw (first token included) is masked to
      the tokens that keep the text a prefix of a match, on the device; EOS
      is allowed only where the text is a full match and always ends the
      row (`ignore_eos` does not apply). Finish reasons: "stop" at EOS (the
      text matches in full) or at a stop string or stop token (the text may
      be cut short); "length" when `max_tokens` (or the model's length) runs
      out first (the text may be incomplete); "abort", with stop_reason
      "structured_outputs", if the automaton reaches a state that allows no
      token. Log-probabilities are those of the masked distribution. Not
      supported with beam search.

  Raises:
    ValueError: naming the field when a value is out of range.
  """

  n: int = 1
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  max_tokens: int = 64
  stop: str | Sequence[str] | None = None
  stop_token_ids: Sequence[int] | None = None
  ignore_eos: bool = False
  seed: int | None = None
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  logprobs_mode: str = "raw"
  use_beam_search: bool = False
  length_penalty: float = 1.0
  output_kind: str = "cumulative"
  structured_outputs: StructuredOutputsParams | None = None

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    self._require_int("n", 1)
    self._require_int("max_tokens", 1)
    self._require_int("top_k", 0)
    if self.seed is not None:
      self._require_int("seed", 0)
    if self.logprobs is not None:
      self._require_int("logprobs", 0)
    if self.prompt_logprobs is not None:
      self._require_int("prompt_logprobs", 0)
    if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0.0):
      raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
    if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.length_penalty, (int, float)):
      raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
    if self.logprobs_mode not in LOGPROBS_MODES:
      raise ValueError(
        f"logprobs_mode must be one of {tuple(LOGPROBS_MODES)}, got {self.logprobs_mode!r}"
      )
    set_("logprobs_mode", LOGPROBS_MODES[self.logprobs_mode])
    if self.output_kind not in OUTPUT_KINDS:
      raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
    stop = self.stop
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
      raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
    set_("stop", tuple(stop))
    ids = tuple(self.stop_token_ids or ())
    if not all(_is_int(i) and i >= 0 for i in ids):
      raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
    set_("stop_token_ids", ids)
    if self.structured_outputs is not None and not isinstance(
      self.structured_outputs, StructuredOutputsParams
    ):
      raise ValueError(
        "structured_outputs must be a StructuredOutputsParams, got "
        f"{type(self.structured_outputs).__name__}"
      )
    if self.use_beam_search and self.structured_outputs is not None:
      raise ValueError("structured_outputs are not supported with use_beam_search")
    if self.use_beam_search and self.temperature != 0.0:
      raise ValueError(f"temperature must be 0 with use_beam_search, got {self.temperature}")

  def _require_int(self, name: str, minimum: int) -> None:
    value = getattr(self, name)
    if not _is_int(value) or value < minimum:
      raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
