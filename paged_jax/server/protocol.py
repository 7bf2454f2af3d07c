"""Request and response bodies of the HTTP server, in OpenAI's shapes.

Requests are validated strictly (a JSON string is no number, a float is no
int), unknown fields are ignored as vLLM does, and the limits that depend on
the served model (context length, vocabulary, `n`, `logprobs`) are checked
by `paged_jax.server.app` before a request reaches the engine.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Request(BaseModel):
  model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
  include_usage: bool = False


def _finite_non_negative(name: str, value: float | None) -> float | None:
  if value is not None and (not math.isfinite(value) or value < 0):
    raise ValueError(f"{name} must be a finite number >= 0, got {value}")
  return value


class _SamplingFields(_Request):
  """Fields that completions and chat completions share."""

  model: str | None = None
  n: int = Field(1, ge=1)
  temperature: float | None = None
  top_p: float | None = None
  stop: str | list[str] | None = None
  seed: int | None = Field(None, ge=0)
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  # vLLM's extra sampling parameters.
  top_k: int | None = None
  ignore_eos: bool = False
  stop_token_ids: list[int] | None = None
  use_beam_search: bool = False
  length_penalty: float = 1.0
  min_tokens: int = Field(0, ge=0)
  # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs
  # ({"json": schema} | {"regex": str} | {"choice": [str]} | {"json_object": true}).
  response_format: dict[str, Any] | None = None
  structured_outputs: dict[str, Any] | None = None

  @field_validator("temperature")
  @classmethod
  def _temperature(cls, value):
    return _finite_non_negative("temperature", value)

  @field_validator("top_p")
  @classmethod
  def _top_p(cls, value):
    if value is not None and not (math.isfinite(value) and 0 < value <= 1):
      raise ValueError(f"top_p must be in (0, 1], got {value}")
    return value

  @field_validator("presence_penalty", "frequency_penalty")
  @classmethod
  def _no_penalty(cls, value, info):
    if value != 0:
      raise ValueError(f"{info.field_name} is not supported; only 0 is accepted, got {value}")
    return value

  @field_validator("min_tokens")
  @classmethod
  def _no_min_tokens(cls, value):
    if value != 0:
      raise ValueError(
        f"min_tokens is not supported by the engine; only 0 is accepted, got {value}"
      )
    return value

  @property
  def include_usage(self) -> bool:
    return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
  """`POST /v1/completions`."""

  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = Field(16, ge=0)
  logprobs: int | None = Field(None, ge=0)
  echo: bool = False


class ChatMessage(_Request):
  role: str
  content: str | list[dict[str, Any]] | None = None

  def text(self) -> str:
    """The message's text: the string, or its text parts joined."""
    if self.content is None or isinstance(self.content, str):
      return self.content or ""
    parts = []
    for part in self.content:
      if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise ValueError("messages: content parts must be {'type': 'text', 'text': str}")
      parts.append(part["text"])
    return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
  """`POST /v1/chat/completions`."""

  messages: list[ChatMessage] = Field(min_length=1)
  max_tokens: int | None = Field(None, ge=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0)
  add_generation_prompt: bool = True


class TokenizeRequest(_Request):
  """`POST /tokenize`: a `prompt`, or chat `messages` to render first.

  `add_special_tokens` defaults to False, which is how completions encode a
  text prompt, so the ids are those the model sees.
  """

  model: str | None = None
  prompt: str | None = None
  messages: list[ChatMessage] | None = None
  add_special_tokens: bool = False
  add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
  """`POST /detokenize`."""

  model: str | None = None
  tokens: list[int]


# Responses.


def _now() -> int:
  return int(time.time())


class ErrorInfo(BaseModel):
  message: str
  type: str
  param: str | None = None
  code: int


class ErrorResponse(BaseModel):
  error: ErrorInfo


class Usage(BaseModel):
  prompt_tokens: int
  completion_tokens: int
  total_tokens: int


class CompletionLogprobs(BaseModel):
  """OpenAI's legacy logprobs: parallel lists, one entry per token."""

  tokens: list[str] = []
  token_logprobs: list[float | None] = []
  top_logprobs: list[dict[str, float] | None] = []
  text_offset: list[int] = []


class CompletionChoice(BaseModel):
  index: int
  text: str
  logprobs: CompletionLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None = None
  stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
  id: str
  object: Literal["text_completion"] = "text_completion"
  created: int = Field(default_factory=_now)
  model: str
  choices: list[CompletionChoice]
  usage: Usage | None = None


class TopLogprob(BaseModel):
  token: str
  logprob: float
  bytes: list[int]


class TokenLogprob(TopLogprob):
  top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
  content: list[TokenLogprob]


class AssistantMessage(BaseModel):
  role: Literal["assistant"] = "assistant"
  content: str


class ChatChoice(BaseModel):
  index: int
  message: AssistantMessage
  logprobs: ChatLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None = None
  stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
  id: str
  object: Literal["chat.completion"] = "chat.completion"
  created: int = Field(default_factory=_now)
  model: str
  choices: list[ChatChoice]
  usage: Usage


class Delta(BaseModel):
  role: Literal["assistant"] | None = None
  content: str | None = None


class ChatChunkChoice(BaseModel):
  index: int
  delta: Delta
  logprobs: ChatLogprobs | None = None
  finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
  id: str
  object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
  created: int = Field(default_factory=_now)
  model: str
  choices: list[ChatChunkChoice]
  usage: Usage | None = None


class ModelCard(BaseModel):
  id: str
  object: Literal["model"] = "model"
  created: int = Field(default_factory=_now)
  owned_by: str = "paged_jax"
  root: str
  max_model_len: int


class ModelList(BaseModel):
  object: Literal["list"] = "list"
  data: list[ModelCard]


class TokenizeResponse(BaseModel):
  count: int
  max_model_len: int
  tokens: list[int]


class DetokenizeResponse(BaseModel):
  prompt: str
