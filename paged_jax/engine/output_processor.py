"""The output processor: drawn tokens become sequences' tokens, text and outputs.

Text is decoded incrementally, as vLLM's detokenizer does: each new token
is decoded with the few tokens before it as context, and text that ends in a
partial UTF-8 character waits for the next token, so appending a token costs
the same however long the sequence is, and the text equals a full decode of
the tokens. Stop strings are looked for after every token, in the text it
adds (and the end of the text before it), so a stop string may span tokens.
"""

from __future__ import annotations

import numpy as np

from paged_jax.engine.outputs import CompletionOutput, RequestOutput
from paged_jax.engine.sequence import Sequence, SequenceGroup

PARTIAL_CHARACTER = "\ufffd"
# The stop reason of a structured output whose automaton allows no more token.
DEAD_END = "structured_outputs"


class OutputProcessor:
  """Appends drawn tokens to sequences, finishes them and builds outputs.

  Args:
    tokenizer: has `decode(ids)`; None to serve token ids only (no text, no
      stop strings).
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.generated_tokens = 0

  def append(self, group: SequenceGroup, seq: Sequence, tokens, logprob, top_ids, top_logprobs):
    """Adds drawn tokens to `seq` until it finishes: on a stop token, a
    structured output's dead end (a state that allows no token), its token
    limit or a stop string (the tokens after the one that completed the
    stop string are dropped). Steps the sequence's automaton.

    Args:
      group: the sequence's group.
      seq: the sequence.
      tokens: int `[T]`, the tokens drawn in order.
      logprob: float `[T]`, their log-probabilities.
      top_ids, top_logprobs: `[T, k]`, the most likely alternatives.

    Returns:
      The number of tokens added.
    """
    k = group.params.logprobs
    added = 0
    for t, token in enumerate(int(x) for x in tokens):
      seq.token_ids.append(token)
      seq.token_logprobs.append(float(logprob[t]))
      if k is not None:
        alternatives = {int(i): float(v) for i, v in zip(top_ids[t, :k], top_logprobs[t, :k])}
        alternatives[token] = float(logprob[t])
        seq.logprobs.append(alternatives)
      added += 1
      if token in group.stop_ids:  # a stop token is kept but not decoded
        seq.finish_reason, seq.stop_reason = "stop", token
        break
      if group.automaton is not None:
        seq.automaton_state = group.automaton.next_state(seq.automaton_state, token)
        if group.automaton.is_dead(seq.automaton_state):
          seq.finish_reason, seq.stop_reason = "abort", DEAD_END
          break
      if self.tokenizer is not None and self._decode_last(group, seq):
        break
      if len(seq.token_ids) >= group.limit:
        seq.finish_reason = "length"
        break
    self.generated_tokens += added
    return added

  def take_prefill(self, chunks, draws, scores) -> dict[str, SequenceGroup]:
    """Appends the first tokens prefill drew for the chunks' samples, and the
    prompt log-probabilities of the chunks that computed them.

    Args:
      chunks: the round's `PrefillChunk`s, in the order prefill ran them.
      draws: one draw per sample, in the chunks' order.
      scores: per chunk, None or its `PromptScores` (one entry per token).

    Returns:
      The groups that drew, by request id.
    """
    for chunk, score in zip(chunks, scores):
      if score is not None:
        _add_prompt_logprobs(chunk, score)
    touched = {}
    drawn = [(chunk.group, seq) for chunk in chunks for seq in chunk.samples]
    for i, (group, seq) in enumerate(drawn):
      row = slice(i, i + 1)
      self.append(
        group,
        seq,
        draws.tokens[row],
        draws.logprob[row],
        draws.top_ids[row],
        draws.top_logprobs[row],
      )
      touched[group.request_id] = group
    return touched

  def take_decode(self, groups, result, taken=None) -> dict[str, SequenceGroup]:
    """Appends what a decode launch drew to the sequences of `groups`, and
    the hypotheses of the beam groups that finished.

    Args:
      groups: the groups that were running.
      result: the launch's `DecodeResult`.
      taken: int `[slots]`, the draws of each slot already appended while
        the launch ran (`LLMEngine(stream_steps=True)`), or None.

    Returns:
      The groups that drew or finished, by request id.

    Raises:
      RuntimeError: if a row finished on the device but its sequence did
        not on the host (the two disagree on stop tokens or limits).
    """
    touched = {}
    draws = result.draws
    for group in groups:
      if group.beam:
        leader = group.beam_slots[0] if group.beam_slots else None
        hypotheses = result.finished_beams.get(leader)
        if hypotheses is not None:
          self.finish_beams(group, hypotheses[: group.params.n])
          touched[group.request_id] = group
        continue
      for seq in group.live():
        slot = seq.slot
        if slot < 0:
          continue
        first, count = 0 if taken is None else int(taken[slot]), int(result.counts[slot])
        if count > first:
          self.append(
            group,
            seq,
            draws.tokens[slot, first:count],
            draws.logprob[slot, first:count],
            draws.top_ids[slot, first:count],
            draws.top_logprobs[slot, first:count],
          )
          touched[group.request_id] = group
        if result.finished[slot] and not seq.finished:
          raise RuntimeError(
            f"seq {slot} of request {group.request_id!r} stopped on the device but not on the host"
          )
    return touched

  def _decode_last(self, group: SequenceGroup, seq: Sequence) -> bool:
    """Decodes the newest token of `seq`; finishes it if that completes a
    stop string. Returns whether it did."""
    state = seq.detokenized
    searched_to = len(state.text)
    ids = seq.token_ids
    context = self.tokenizer.decode(ids[state.prefix_offset : state.read_offset])
    text = self.tokenizer.decode(ids[state.prefix_offset :])
    if len(text) <= len(context) or text.endswith(PARTIAL_CHARACTER):
      state.pending = text[len(context) :]
    else:
      state.text += text[len(context) :]
      state.pending = ""
      state.prefix_offset, state.read_offset = state.read_offset, len(ids)
    stops = group.params.stop
    if not stops:
      return False
    full = state.full_text
    start = max(0, searched_to - max(map(len, stops)) + 1)
    found = [(position, stop) for stop in stops if (position := full.find(stop, start)) >= 0]
    if not found:
      return False
    position, stop = min(found)
    state.text, state.pending = full[:position], ""
    seq.finish_reason, seq.stop_reason = "stop", stop
    return True

  def finish_beams(self, group: SequenceGroup, hypotheses) -> None:
    """Gives a finished beam group's sequences its best hypotheses.

    Args:
      group: the beam group.
      hypotheses: `(tokens, cumulative logprob, stopped)` triples, best
        first, one per sequence.
    """
    for seq, (tokens, cumulative_logprob, stopped) in zip(group.seqs, hypotheses):
      seq.token_ids, seq.cumulative_logprob = tokens, cumulative_logprob
      seq.finish_reason = "stop" if stopped else "length"
      seq.stop_reason = tokens[-1] if stopped else None
      if self.tokenizer is not None:
        seq.detokenized.text = self.tokenizer.decode(tokens[:-1] if stopped else tokens)
      self.generated_tokens += len(tokens)

  @staticmethod
  def finish(group: SequenceGroup, reason: str) -> None:
    """Finishes every unfinished sequence of `group` with `reason`."""
    for seq in group.live():
      seq.finish_reason = reason

  @staticmethod
  def _visible_text(group: SequenceGroup, seq: Sequence) -> str:
    """What may be shown of a sequence's text: all of it once finished;
    while running, neither a trailing partial character nor what could be
    the start of a stop string."""
    state = seq.detokenized
    if seq.finished:
      return state.full_text
    text = state.text + state.pending.rstrip(PARTIAL_CHARACTER)
    hold = max(map(len, group.params.stop), default=1) - 1
    return text[: max(len(text) - hold, 0)]

  def output(self, group: SequenceGroup) -> RequestOutput:
    """The group's `RequestOutput` now (with `output_kind="delta"`, only
    what was not sent before, which then counts as sent)."""
    delta = group.params.output_kind == "delta"
    completions = []
    for seq in group.seqs:
      text = self._visible_text(group, seq)
      ids, logprobs, token_logprobs = seq.token_ids, seq.logprobs, seq.token_logprobs
      if delta:
        text = text[seq.sent_text :]
        sent = seq.sent_tokens
        ids, logprobs, token_logprobs = ids[sent:], logprobs[sent:], token_logprobs[sent:]
        seq.sent_text += len(text)
        seq.sent_tokens += len(ids)
      completions.append(
        CompletionOutput(
          index=seq.index,
          text=text,
          token_ids=list(ids),
          cumulative_logprob=float(sum(seq.token_logprobs))
          if seq.cumulative_logprob is None
          else seq.cumulative_logprob,
          logprobs=list(logprobs) if group.params.logprobs is not None else None,
          finish_reason=seq.finish_reason,
          stop_reason=seq.stop_reason,
          token_logprobs=None if group.beam else np.asarray(token_logprobs, np.float32),
        )
      )
    return RequestOutput(
      request_id=group.request_id,
      prompt=group.prompt,
      prompt_token_ids=group.prompt_token_ids,
      outputs=completions,
      finished=group.finished,
      error=group.error,
      prompt_logprobs=list(group.prompt_logprobs)
      if group.params.prompt_logprobs is not None
      else None,
    )


def _add_prompt_logprobs(chunk, score) -> None:
  """Appends a chunk's prompt log-probabilities to its group's (a chunk at
  position 0 starts them again: a preempted prompt is prefilled anew)."""
  group, k = chunk.group, chunk.group.params.prompt_logprobs
  if chunk.start == 0:
    group.prompt_logprobs = [None]
  for i, token in enumerate(int(t) for t in chunk.next_tokens):
    if token < 0:
      continue
    alternatives = {
      int(t): float(v) for t, v in zip(score.top_ids[i, :k], score.top_logprobs[i, :k])
    }
    alternatives[token] = float(score.logprob[i])
    group.prompt_logprobs.append(alternatives)
