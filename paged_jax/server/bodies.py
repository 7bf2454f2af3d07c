"""Request bodies: reading them within limits, parsing and validating them,
OpenAI's error body, and the values JSON must carry in responses."""

from __future__ import annotations

import json
import re

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from paged_jax.server import protocol
from paged_jax.structured import StructuredOutputsParams

LOWEST_LOGPROB = -9999.0  # what -inf log-probabilities become in responses

UNION_FIELDS = {
  "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
  "stop": "a string or a list of strings",
}


class APIError(Exception):
  """An error answered with OpenAI's error body.

  Args:
    message: what was wrong, naming the field and the limit.
    param: the request field at fault, or None.
    status: the HTTP status.
    kind: OpenAI's error `type`.
    headers: extra response headers (`Retry-After`).
    outcome: how the request ended, as `/metrics` counts it: "refused"
      (before it ran), "aborted" (stopped while it ran) or "failed" (an
      unexpected error).
  """

  def __init__(
    self,
    message: str,
    param: str | None = None,
    status: int = 400,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
    outcome: str = "refused",
  ):
    super().__init__(message)
    self.message, self.param, self.status, self.kind = message, param, status, kind
    self.headers, self.outcome = headers, outcome

  def body(self) -> dict:
    return protocol.ErrorResponse(
      error=protocol.ErrorInfo(
        message=self.message, type=self.kind, param=self.param, code=self.status
      )
    ).model_dump()

  def response(self) -> JSONResponse:
    return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_message(err: ValidationError) -> tuple[str, str | None]:
  """(a message naming the field and the rule, the field) of a pydantic error."""
  first = err.errors()[0]
  location = [str(part) for part in first["loc"]]
  param = location[0] if location else None
  if param in UNION_FIELDS and first["type"] not in ("missing", "value_error"):
    return f"{param}: must be {UNION_FIELDS[param]}", param
  path = ".".join(part for part in location if "[" not in part)
  message = first["msg"].removeprefix("Value error, ")
  if not path or message.startswith(path):
    return message, param
  return f"{path}: {message}", param


async def _read_body(request: Request, limit: int) -> bytes:
  """The request body, read no further than `limit` bytes.

  Raises:
    APIError: 413 for a body over `limit` (by its Content-Length, or as it
      arrives).
  """
  too_large = APIError(
    f"the request body is over {limit} bytes (--max-request-bytes)",
    status=413,
    kind="request_too_large",
  )
  declared = request.headers.get("content-length", "")
  if declared.isdigit() and int(declared) > limit:
    raise too_large
  body = bytearray()
  async for chunk in request.stream():
    body += chunk
    if len(body) > limit:
      raise too_large
  return bytes(body)


def _first_nul_path(data) -> str | None:
  """The path of the first string (key or value) of `data` holding a NUL
  character, or None."""
  stack = [("", data)]
  while stack:
    path, item = stack.pop()
    if isinstance(item, str):
      if "\x00" in item:
        return path or "body"
    elif isinstance(item, dict):
      for key, value in item.items():
        if "\x00" in key:
          return f"{path}.{key!r}".lstrip(".")
        stack.append((f"{path}.{key}".lstrip("."), value))
    elif isinstance(item, list):
      stack.extend((f"{path}[{i}]", value) for i, value in enumerate(item))
  return None


async def parse_body(request: Request, model: type[BaseModel], max_bytes: int):
  """The request body as `model`.

  Raises:
    APIError: 413 for a body over `max_bytes`; 400 for a body that is not
      UTF-8, not JSON, nested too deeply, holds a NUL character, or is not a
      valid `model`.
  """
  raw = await _read_body(request, max_bytes)
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as err:
    raise APIError(f"the request body is not valid UTF-8: {err}") from None
  try:
    data = json.loads(text)
  except json.JSONDecodeError as err:
    raise APIError(f"the request body is not valid JSON: {err}") from None
  except RecursionError:
    raise APIError("the request body is JSON nested too deeply") from None
  if not isinstance(data, dict):
    raise APIError(f"the request body must be a JSON object, got {type(data).__name__}")
  nul = _first_nul_path(data)
  if nul is not None:
    raise APIError(f"{nul}: text must not hold a NUL character", re.split(r"[.\[]", nul)[0])
  try:
    return model.model_validate(data)
  except ValidationError as err:
    message, param = _validation_message(err)
    raise APIError(message, param) from None


def structured_outputs(body) -> StructuredOutputsParams | None:
  """The request's structured-output constraint: OpenAI's `response_format`
  (`text`, `json_object`, or `json_schema` with its `schema`) or vLLM's
  `structured_outputs` (the fields of `StructuredOutputsParams`).

  Raises:
    APIError: 400 naming the field, for both at once or a malformed one.
  """
  fields = body.structured_outputs
  param = "structured_outputs"
  if body.response_format is not None:
    if fields is not None:
      raise APIError(
        "response_format: give one of response_format and structured_outputs", "response_format"
      )
    param, fields = "response_format", _response_format_fields(body.response_format)
  if fields is None:
    return None
  try:
    return StructuredOutputsParams(**fields)
  except (TypeError, ValueError) as err:
    raise APIError(f"{param}: {err}", param) from None


def _response_format_fields(response_format: dict) -> dict | None:
  """`StructuredOutputsParams` fields of an OpenAI `response_format`, or None
  for plain text."""
  kind = response_format.get("type")
  if kind == "text":
    return None
  if kind == "json_object":
    return dict(json_object=True)
  schema = (response_format.get("json_schema") or {}).get("schema")
  if kind == "json_schema" and isinstance(schema, dict):
    return dict(json=schema)
  raise APIError(
    "response_format: must be {'type': 'text'}, {'type': 'json_object'} or "
    "{'type': 'json_schema', 'json_schema': {'schema': {...}}}",
    "response_format",
  )


def json_logprob(logprob: float) -> float:
  """A log-probability JSON can carry: a token that a constraint or top-k /
  top-p ruled out has -inf, sent as `LOWEST_LOGPROB`."""
  return max(logprob, LOWEST_LOGPROB)
