"""Vocabularies: every token of a tokenizer as the bytes it stands for, and
outlines-core's `Vocabulary` of them, built once per vocabulary."""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
from collections.abc import Mapping
from typing import Any

import outlines_core


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
  """GPT-2's byte-level BPE alphabet: the printable character of each byte."""
  printable = [
    *range(ord("!"), ord("~") + 1),
    *range(ord("¡"), ord("¬") + 1),
    *range(ord("®"), ord("ÿ") + 1),
  ]
  characters = dict.fromkeys(range(256))
  for byte in printable:
    characters[byte] = chr(byte)
  extra = 0
  for byte in range(256):
    if characters[byte] is None:
      characters[byte] = chr(256 + extra)
      extra += 1
  return {char: byte for byte, char in characters.items()}


def _token_bytes(tokenizer) -> tuple[dict[bytes, list[int]], int]:
  """The bytes of every ordinary token of `tokenizer`, and its EOS id.

  Special tokens (BOS, chat markers, ...) are left out: they never spell
  constrained text. The EOS is the automaton's end marker instead.

  Raises:
    ValueError: if the tokenizer has no EOS, or a decoder this module does
      not know (byte-level BPE and SentencePiece-style byte fallback are known).
  """
  eos = tokenizer.eos_token_id
  if eos is None:
    raise ValueError("structured outputs need a tokenizer with an EOS token")
  if not hasattr(tokenizer, "tokenizer"):  # ByteTokenizer: id i is byte i below 256
    return {bytes([byte]): [byte] for byte in range(256)}, eos
  inner = tokenizer.tokenizer
  decoder = json.loads(inner.to_str()).get("decoder") or {}
  to_bytes = _decoder_to_bytes(decoder)
  added = inner.get_added_tokens_decoder()
  vocabulary: dict[bytes, list[int]] = {}
  for text, token_id in inner.get_vocab(with_added_tokens=True).items():
    if token_id in added:
      if added[token_id].special:
        continue
      data = text.encode("utf-8")
    else:
      data = to_bytes(text)
    if data:
      vocabulary.setdefault(data, []).append(token_id)
  return vocabulary, eos


def _decoder_to_bytes(decoder: Mapping[str, Any]):
  """A function from a token's text to its bytes, for the tokenizer's `decoder`."""
  kinds = {decoder.get("type")} | {step.get("type") for step in decoder.get("decoders", ())}
  if "ByteLevel" in kinds:
    alphabet = _byte_level_alphabet()

    def byte_level(text: str) -> bytes:
      try:
        return bytes(alphabet[char] for char in text)
      except KeyError as err:
        raise ValueError(f"token {text!r} is not in the byte-level alphabet") from err

    return byte_level
  if "ByteFallback" in kinds or "Metaspace" in kinds:

    def sentencepiece(text: str) -> bytes:
      if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
      return text.replace("\u2581", " ").encode("utf-8")

    return sentencepiece
  raise ValueError(f"tokenizer decoder {sorted(k for k in kinds if k)} is not supported")


_VOCABULARY_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
VOCABULARIES: dict[str, outlines_core.Vocabulary] = {}


def vocabulary_key(tokenizer) -> str:
  """A digest of `tokenizer`'s token bytes and EOS; equal vocabularies share automata.

  Builds the outlines-core `Vocabulary` on first use of a vocabulary.
  """
  key = _VOCABULARY_KEYS.get(tokenizer)
  if key is None:
    tokens, eos = _token_bytes(tokenizer)
    listing = sorted((data, ids) for data, ids in tokens.items())
    key = hashlib.sha256(repr((eos, listing)).encode()).hexdigest()
    if key not in VOCABULARIES:
      VOCABULARIES[key] = outlines_core.Vocabulary(eos, tokens)
    _VOCABULARY_KEYS[tokenizer] = key
  return key
