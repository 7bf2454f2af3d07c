"""Constraints on a request's output (`StructuredOutputsParams`: a JSON
schema, a regex, choices or any JSON object) and the regular expression
each one means."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import outlines_core

# JSON Schema keywords that outlines-core's regex builder would drop without a
# word (the output would not be checked against them), so they are refused.
UNSUPPORTED_SCHEMA_KEYWORDS = (
  "contains",
  "dependencies",
  "dependentRequired",
  "dependentSchemas",
  "else",
  "exclusiveMaximum",
  "exclusiveMinimum",
  "if",
  "maxContains",
  "maxProperties",
  "maximum",
  "minContains",
  "minProperties",
  "minimum",
  "multipleOf",
  "not",
  "patternProperties",
  "propertyNames",
  "then",
  "unevaluatedItems",
  "unevaluatedProperties",
  "uniqueItems",
)
# Keywords whose value is a map from names to subschemas, or a list of them.
_SCHEMA_MAPS = ("properties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")
# Characters a choice literal escapes; outlines-core's regex syntax (Rust's
# regex crate) accepts a backslash before each of them.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")
# Levels of objects and arrays a `json_object` output may nest (the top-level
# object counts); a regex has no recursion, and its automaton grows about
# fourfold per level.
JSON_OBJECT_DEPTH = 2
_JSON_WHITESPACE = "[ ]?"


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
  """A constraint on a request's output text; exactly one field is set.

  Attributes:
    json: a JSON schema, as a dict or a JSON string; the output is a JSON
      value that validates against it. Stored as its JSON text (keys in the
      given order, which is the order the output's properties take).
    regex: the output matches this regular expression in full (the syntax of
      Rust's regex crate, which outlines-core uses; no lookaround or
      backreferences).
    choice: the output is exactly one of these strings.
    json_object: the output is a JSON object (OpenAI's
      `response_format={"type": "json_object"}`) whose values are scalars or
      objects and arrays of scalars (`JSON_OBJECT_DEPTH` levels).
    whitespace_pattern: with `json` or `json_object`, the regex of the
      whitespace allowed between JSON tokens; None allows one optional space.

  Raises:
    ValueError: if not exactly one constraint is set, or one is malformed.
  """

  json: str | Mapping[str, Any] | None = None
  regex: str | None = None
  choice: Sequence[str] | None = None
  json_object: bool = False
  whitespace_pattern: str | None = None

  def __post_init__(self):
    given = [
      name
      for name, value in (
        ("json", self.json),
        ("regex", self.regex),
        ("choice", self.choice),
        ("json_object", self.json_object or None),
      )
      if value is not None
    ]
    if len(given) != 1:
      raise ValueError(
        f"exactly one of json, regex, choice, json_object must be set, got {given or 'none'}"
      )
    if self.json is not None:
      object.__setattr__(self, "json", _schema_text(self.json))
    if self.regex is not None and not (isinstance(self.regex, str) and self.regex):
      raise ValueError(f"regex must be a non-empty str, got {self.regex!r}")
    if self.choice is not None:
      choice = (self.choice,) if isinstance(self.choice, str) else tuple(self.choice)
      if not choice or not all(isinstance(option, str) and option for option in choice):
        raise ValueError(f"choice must be a non-empty list of non-empty strs, got {self.choice!r}")
      object.__setattr__(self, "choice", choice)
    if self.whitespace_pattern is not None and self.json is None and not self.json_object:
      raise ValueError("whitespace_pattern applies only to json or json_object")

  def to_regex(self) -> str:
    """The regular expression the output must match in full.

    Returns:
      The pattern: from the JSON schema (outlines-core's builder), the regex
      itself, or the choices as an alternation of escaped literals.

    Raises:
      ValueError: if the schema uses a feature the builder cannot express
        (the message names the keyword and where it is).
    """
    if self.regex is not None:
      return self.regex
    if self.choice is not None:
      return "(" + "|".join(_escaped(option) for option in self.choice) + ")"
    if self.json_object:
      return json_object_regex(JSON_OBJECT_DEPTH, self.whitespace_pattern or _JSON_WHITESPACE)
    _refuse_unsupported(json.loads(self.json), "schema")
    try:
      return outlines_core.json_schema.build_regex_from_schema(self.json, self.whitespace_pattern)
    except ValueError as err:
      raise ValueError(f"JSON schema not supported: {err}") from err


def json_object_regex(depth: int, whitespace: str) -> str:
  """A regex of JSON objects nested `depth` levels deep at most (the top level is 1).

  Args:
    depth: levels of objects and arrays, at least 1.
    whitespace: the regex of the whitespace allowed between JSON tokens.

  Returns:
    The pattern.
  """
  schema = outlines_core.json_schema
  scalar = f"{schema.STRING}|{schema.NUMBER}|true|false|null"
  value = f"({scalar})"
  for level in range(1, depth + 1):
    member = f"{schema.STRING}{whitespace}:{whitespace}{value}"
    members = f"({member}({whitespace},{whitespace}{member})*)?"
    json_object = rf"\{{{whitespace}{members}{whitespace}\}}"
    if level == depth:
      return json_object
    items = f"({value}({whitespace},{whitespace}{value})*)?"
    value = rf"({scalar}|{json_object}|\[{whitespace}{items}{whitespace}\])"
  raise ValueError(f"depth must be at least 1, got {depth}")


def _schema_text(schema) -> str:
  """A schema (dict or JSON text) as JSON text; ValueError unless it is a JSON object."""
  if isinstance(schema, str):
    try:
      parsed = json.loads(schema)
    except json.JSONDecodeError as err:
      raise ValueError(f"json is not valid JSON: {err}") from err
  else:
    parsed = schema
  if not isinstance(parsed, Mapping):
    raise ValueError(f"json must be a JSON schema object, got {type(parsed).__name__}")
  return schema if isinstance(schema, str) else json.dumps(schema)


def _refuse_unsupported(schema, where: str) -> None:
  """Raises ValueError naming the first keyword of `UNSUPPORTED_SCHEMA_KEYWORDS` in `schema`."""
  if not isinstance(schema, Mapping):
    return
  for keyword in UNSUPPORTED_SCHEMA_KEYWORDS:
    if keyword in schema:
      raise ValueError(
        f"JSON schema keyword {keyword!r} (at {where}) is not supported: "
        "the regex builder cannot express it"
      )
  for keyword in _SCHEMA_MAPS:
    for name, subschema in (schema.get(keyword) or {}).items():
      _refuse_unsupported(subschema, f"{where}.{keyword}.{name}")
  for keyword in _SCHEMA_LISTS:
    for position, subschema in enumerate(schema.get(keyword) or ()):
      _refuse_unsupported(subschema, f"{where}.{keyword}[{position}]")
  for keyword in _SCHEMA_VALUES:
    value = schema.get(keyword)
    subschemas = value if isinstance(value, list) else [value]
    for subschema in subschemas:
      _refuse_unsupported(subschema, f"{where}.{keyword}")


def _escaped(literal: str) -> str:
  return "".join("\\" + char if char in _REGEX_META else char for char in literal)
