"""Parsing and checking a request before it reaches the engine: the model
name, prompts and chats into token ids, lengths, admission, `n`,
log-probabilities and the sampling parameters."""

from __future__ import annotations

from paged_jax.models.tokenizer import ByteTokenizer
from paged_jax.params import SamplingParams
from paged_jax.server.bodies import APIError, structured_outputs
from paged_jax.server.limits import MAX_STOP_CHARS
from paged_jax.token_ids import check_token_ids


def encode(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
  """`text`'s token ids, with the tokenizer's special tokens (BOS) only if
  `add_special_tokens`."""
  if isinstance(tokenizer, ByteTokenizer):
    return tokenizer.encode(text, add_bos=add_special_tokens).tolist()
  return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


class RequestChecks:
  """The `Server`'s request checks (a mixin: they read its `settings`,
  `tokenizer` and `engine_thread`)."""

  def check_model(self, name: str | None) -> None:
    served = self.settings.served_model_name
    if name is not None and name != served:
      raise APIError(
        f"model: the model {name!r} does not exist; this server serves {served!r}", "model"
      )

  def check_ids(self, ids: list[int], param: str, allow_empty: bool = False) -> None:
    """Raises APIError (400, naming `param`) for ids `check_token_ids` refuses."""
    try:
      check_token_ids(ids, self.settings.vocab_size, param, allow_empty=allow_empty)
    except ValueError as err:
      raise APIError(str(err), param) from None

  def prompt_ids(self, prompt) -> list[tuple[str | None, list[int]]]:
    """`(text or None, token ids)` of each prompt of a completions request."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
      prompt = [prompt]
    if not prompt:
      raise APIError("prompt: must not be empty", "prompt")
    prompts = []
    for item in prompt:
      if isinstance(item, str):
        if not item:
          raise APIError("prompt: must not be empty", "prompt")
        ids = encode(self.tokenizer, item)
        prompts.append((item, ids))
      else:
        prompts.append((None, list(item)))
      self.check_ids(prompts[-1][1], "prompt")
    return prompts

  def check_length(self, num_prompt_tokens: int, max_tokens: int, field: str) -> None:
    limit = self.settings.max_model_len
    if num_prompt_tokens + max_tokens > limit:
      param = "prompt" if num_prompt_tokens >= limit else field
      raise APIError(
        f"{param}: this model's maximum context length is {limit} tokens (--max-model-len); "
        f"the request asks for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the "
        f"prompt, {max_tokens} in {field}). Shorten the prompt or lower {field}.",
        param,
      )

  def check_admission(self, num_prompt_tokens: int, params: SamplingParams) -> None:
    """Refuses what the engine would refuse: the engine's own admission rule
    (slots, positions, and the KV blocks of one data shard, with sliding
    windows, speculative lookahead and the watermark).

    Raises:
      APIError: 400 naming why.
    """
    error = self.engine_thread.admission_error(num_prompt_tokens, params)
    if error is not None:
      param = "n" if params.n > 1 else "prompt"
      raise APIError(f"{param}: the request can never be served: {error}", param)

  def check_n(self, n: int, use_beam_search: bool) -> None:
    settings = self.settings
    if use_beam_search:
      limit = min(settings.max_beam_width, (settings.max_num_seqs + 1) // 2)
      if n > limit:
        raise APIError(f"n: beam search serves at most {limit} beams, got {n}", "n")
    elif n > settings.max_num_seqs:
      raise APIError(f"n: must be <= {settings.max_num_seqs} (--max-num-seqs), got {n}", "n")

  def check_logprobs(self, k: int | None, field: str) -> None:
    if k is not None and k > self.settings.max_logprobs:
      raise APIError(
        f"{field}: must be <= {self.settings.max_logprobs} (--max-logprobs), got {k}", field
      )

  def sampling_params(self, body, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine's `SamplingParams` (with delta outputs) of a request.

    Raises:
      APIError: naming the field that `SamplingParams` refused.
    """
    if body.top_k is not None and body.top_k < -1:
      raise APIError(f"top_k: must be -1, 0 (all tokens) or >= 1, got {body.top_k}", "top_k")
    if body.use_beam_search and logprobs is not None:
      raise APIError("logprobs: not available with use_beam_search", "logprobs")
    temperature = body.temperature
    if temperature is None:
      temperature = 0.0 if body.use_beam_search else 1.0
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
      raise APIError(
        f"stop: a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}", "stop"
      )
    stop_ids = body.stop_token_ids or []
    self.check_ids(stop_ids, "stop_token_ids", allow_empty=True)
    try:
      return SamplingParams(
        n=body.n,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        max_tokens=max(max_tokens, 1),
        stop=body.stop,
        stop_token_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        seed=body.seed,
        logprobs=logprobs,
        use_beam_search=body.use_beam_search,
        length_penalty=body.length_penalty,
        structured_outputs=structured_outputs(body),
        output_kind="delta",
      )
    except ValueError as err:
      message = str(err)
      raise APIError(message, message.split(" ", 1)[0]) from None

  def render_chat(self, messages, add_generation_prompt: bool) -> list[int]:
    try:
      conversation = [dict(role=m.role, content=m.text()) for m in messages]
      text = self.tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
      )
    except ValueError as err:
      raise APIError(f"messages: {err}", "messages") from None
    except Exception as err:  # a template's raise_exception, a template that does not parse
      raise APIError(f"messages: the chat template refused them: {err}", "messages") from None
    ids = encode(self.tokenizer, text)
    self.check_ids(ids, "messages")
    return ids
