"""Tokenizers: the tiny model's bytes, and pretrained models' vocabularies.

`ByteTokenizer` maps UTF-8 bytes to ids 0..255 (then BOS and EOS) and needs no
file. `PretrainedTokenizer` wraps a Hugging Face `tokenizers.Tokenizer` built
from a `tokenizer.json` or from a GGUF file's `tokenizer.ggml.*` fields, and
renders chat templates with jinja2 the way transformers does. Both have
`encode`, `decode`, `vocab_size`, `bos_token_id`, `eos_token_id` and
`apply_chat_template`.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers

from paged_jax.token_ids import check_token_ids


class ByteTokenizer:
  """Encodes text as its UTF-8 bytes; needs no vocabulary file.

  Attributes:
    bos_id: id that starts a sequence (256).
    eos_id: id that ends a sequence (257).
    vocab_size: number of ids (258).
    bos_token_id: `bos_id`, under the name `PretrainedTokenizer` uses.
    eos_token_id: `eos_id`, likewise.
    chat_template: None: the tiny model knows no chat format.
  """

  bos_id = 256
  eos_id = 257
  vocab_size = 258
  bos_token_id = bos_id
  eos_token_id = eos_id
  chat_template = None

  def apply_chat_template(self, messages, **kwargs) -> str:
    """Raises: ValueError, always: there is no chat template."""
    raise ValueError("ByteTokenizer has no chat template")

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> np.ndarray:
    """Token ids of `text`.

    Args:
      text: any string.
      add_bos: prepend `bos_id`.
      add_eos: append `eos_id`.

    Returns:
      int32 ids, one per UTF-8 byte (plus the requested specials).

    Raises:
      ValueError: if `text` is not a str.
    """
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    prefix = [self.bos_id] if add_bos else []
    suffix = [self.eos_id] if add_eos else []
    return np.concatenate([np.asarray(prefix, np.int32), ids, np.asarray(suffix, np.int32)])

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """Text of `ids`, leaving out BOS and EOS.

    Byte runs that are not valid UTF-8 (a model can emit them) become U+FFFD.

    Args:
      ids: token ids: an integer array (NumPy or JAX) or a sequence of ints.

    Returns:
      The decoded string.

    Raises:
      ValueError: if an id is outside `0 .. vocab_size - 1`.
    """
    ids = check_token_ids(ids, self.vocab_size, "ids", allow_empty=True, flatten=True)
    data = ids[ids < 256].astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")


# End-of-turn tokens that llama.cpp treats as ending generation; a model whose
# chat template closes turns with one of them stops there.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# GGUF token types (llama.cpp's llama_token_type) that are special tokens.
_GGUF_NORMAL, _GGUF_CONTROL, _GGUF_USER_DEFINED = 1, 3, 4
_SENTENCEPIECE_SPACE = "\u2581"  # "▁"


class PretrainedTokenizer:
  """A pretrained model's tokenizer (Hugging Face `tokenizers` underneath).

  Attributes:
    tokenizer: the underlying `tokenizers.Tokenizer`.
    bos_token: text of the beginning-of-sequence token, or None.
    eos_token: text of the token that ends a reply, or None.
    chat_template: jinja2 source of the chat template, or None.
  """

  def __init__(
    self,
    tokenizer: tokenizers.Tokenizer,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    chat_template: str | None = None,
  ):
    """Wraps `tokenizer`.

    Raises:
      ValueError: if `bos_token` or `eos_token` is not in the vocabulary.
    """
    for name, token in (("bos_token", bos_token), ("eos_token", eos_token)):
      if token is not None and tokenizer.token_to_id(token) is None:
        raise ValueError(f"{name} {token!r} is not in the vocabulary")
    self.tokenizer = tokenizer
    self.bos_token = bos_token
    self.eos_token = eos_token
    self.chat_template = chat_template

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def bos_token_id(self) -> int | None:
    return _token_id(self.tokenizer, self.bos_token)

  @property
  def eos_token_id(self) -> int | None:
    return _token_id(self.tokenizer, self.eos_token)

  def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`; special tokens written in it map to their ids.

    Args:
      text: any string.
      add_special_tokens: let the tokenizer's post-processor add its tokens
        (a BOS for Llama 3, say). A rendered chat template has them already.

    Returns:
      The ids.

    Raises:
      ValueError: if `text` is not a str.
    """
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = True) -> str:
    """Text of `ids`.

    Args:
      ids: token ids: an integer array or a sequence of ints.
      skip_special_tokens: leave out special tokens (BOS, end of turn, ...).

    Returns:
      The decoded string.

    Raises:
      ValueError: if an id is outside `0 .. vocab_size - 1`.
    """
    ids = check_token_ids(ids, self.vocab_size, "ids", allow_empty=True, flatten=True)
    return self.tokenizer.decode(ids.tolist(), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(
    self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, **variables
  ) -> str:
    """Renders a conversation with the model's chat template.

    As transformers does: jinja2 in a sandbox with `trim_blocks` and
    `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter, and
    `raise_exception` and `strftime_now` globals; the template sees
    `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and
    `variables`.

    Args:
      messages: dicts with `role` and `content`.
      add_generation_prompt: end with the header of an assistant turn.
      **variables: more template variables (`tools`, ...).

    Returns:
      The prompt text; encode it with `encode` (no special tokens added).

    Raises:
      ValueError: if the tokenizer has no chat template.
      jinja2.TemplateError: if the template rejects the conversation (its
        `raise_exception` message) or does not parse.
    """
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template")
    template = _compiled_template(self.chat_template)
    return template.render(
      messages=list(messages),
      add_generation_prompt=add_generation_prompt,
      bos_token=self.bos_token or "",
      eos_token=self.eos_token or "",
      **variables,
    )

  @classmethod
  def from_files(
    cls, tokenizer_json: str, tokenizer_config: str | None = None, chat_template: str | None = None
  ) -> PretrainedTokenizer:
    """Builds the tokenizer of a Hugging Face model folder.

    Args:
      tokenizer_json: path of `tokenizer.json`.
      tokenizer_config: path of `tokenizer_config.json` (BOS, EOS and the
        chat template), or None.
      chat_template: path of a `chat_template.jinja`, which wins over the
        config's template, or None.

    When the chat template closes turns with an end-of-turn token
    (`<end_of_turn>` of Gemma, `<|im_end|>`, `<|eot_id|>`, ...), that token
    is the EOS, whatever the config's `eos_token` says: a chat reply ends
    there (transformers lists it in `generation_config.json`).

    Returns:
      The tokenizer.

    Raises:
      ValueError: if a file does not parse or names a token not in the
        vocabulary.
    """
    try:
      tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    except Exception as err:  # the Rust library raises a bare Exception
      raise ValueError(f"cannot read {tokenizer_json}: {err}") from err
    settings = {}
    if tokenizer_config is not None:
      with open(tokenizer_config, encoding="utf-8") as file:
        settings = json.load(file)
    template = _default_template(settings.get("chat_template"))
    if chat_template is not None:
      with open(chat_template, encoding="utf-8") as file:
        template = file.read()
    eos = _end_of_turn_or(_token_text(settings.get("eos_token")), template, tokenizer.get_vocab())
    return cls(
      tokenizer,
      bos_token=_token_text(settings.get("bos_token")),
      eos_token=eos,
      chat_template=template,
    )

  @classmethod
  def from_gguf_fields(
    cls, fields: Mapping[str, Any], source: str = "GGUF file"
  ) -> PretrainedTokenizer:
    """Builds the tokenizer stored in a GGUF file's metadata.

    Two kinds of vocabulary (`tokenizer.ggml.model`):

    * "gpt2": byte-level BPE from `tokens` and `merges` (SmolLM2, Qwen,
      Llama 3);
    * "llama": SentencePiece BPE from `tokens` and `scores` (Llama 2,
      Mistral, Gemma), tokenized as llama.cpp does: spaces become "▁", a
      space is put before the text and after each special token when
      `add_space_prefix` (default true), then the adjacent pair whose join
      has the highest score merges first, and a character with no piece
      falls back to its `<0xXX>` byte pieces. (The merges are derived from
      the scores, between pieces, so every character of a piece must be a
      piece, as in the vocabularies SentencePiece trains; pieces of equal
      score may merge in another order than llama.cpp's leftmost-first.)

    Tokens of the control and user-defined types become special tokens.
    When the chat template closes turns with an end-of-turn token
    (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...), that token is the
    EOS, as in llama.cpp, whatever `eos_token_id` says.

    Args:
      fields: `tokenizer.ggml.*` and `tokenizer.chat_template` values, by key.
      source: the file, for error messages.

    Returns:
      The tokenizer.

    Raises:
      ValueError: if the vocabulary is missing or of another kind.
    """
    kind = fields.get("tokenizer.ggml.model")
    builders = {"gpt2": _gguf_byte_level_bpe, "llama": _gguf_sentencepiece_bpe}
    if kind not in builders:
      raise ValueError(
        f"{source}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2' BPE and "
        f"'llama' SentencePiece vocabularies)"
      )
    if "tokenizer.ggml.tokens" not in fields:
      raise ValueError(f"{source}: no tokenizer.ggml.tokens field")
    tokens = list(fields["tokenizer.ggml.tokens"])
    tokenizer = builders[kind](fields, tokens, source)
    token_types = fields.get("tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens(
      [
        tokenizers.AddedToken(tokens[index], special=True, normalized=False)
        for index, token_type in enumerate(token_types)
        if token_type in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
      ]
    )
    template = fields.get("tokenizer.chat_template")

    def token(key):
      index = fields.get(key)
      return None if index is None or index >= len(tokens) else tokens[index]

    return cls(
      tokenizer,
      bos_token=token("tokenizer.ggml.bos_token_id"),
      eos_token=_end_of_turn_or(token("tokenizer.ggml.eos_token_id"), template, tokens),
      chat_template=template,
    )


def _gguf_byte_level_bpe(fields, tokens: list[str], source: str) -> tokenizers.Tokenizer:
  """GPT-2's byte-level BPE from the GGUF's tokens and merges."""
  if "tokenizer.ggml.merges" not in fields:
    raise ValueError(f"{source}: no tokenizer.ggml.merges field")
  merges = [tuple(merge.split(" ", 1)) for merge in fields["tokenizer.ggml.merges"]]
  model = tokenizers.models.BPE(
    {token: index for index, token in enumerate(tokens)}, merges, fuse_unk=False
  )
  tokenizer = tokenizers.Tokenizer(model)
  tokenizer.pre_tokenizer = _gguf_pre_tokenizer(fields.get("tokenizer.ggml.pre"))
  tokenizer.decoder = tokenizers.decoders.ByteLevel()
  return tokenizer


def _gguf_sentencepiece_bpe(fields, tokens: list[str], source: str) -> tokenizers.Tokenizer:
  """SentencePiece BPE (llama.cpp's "llama" vocabulary) from the GGUF's
  tokens and scores: a pair merges with the rank of its join's score."""
  if "tokenizer.ggml.scores" not in fields:
    raise ValueError(f"{source}: no tokenizer.ggml.scores field")
  scores = [float(score) for score in fields["tokenizer.ggml.scores"]]
  token_types = list(fields.get("tokenizer.ggml.token_type", [_GGUF_NORMAL] * len(tokens)))
  if not len(scores) == len(token_types) == len(tokens):
    raise ValueError(
      f"{source}: {len(tokens)} tokens, {len(scores)} scores and {len(token_types)} token types"
    )
  pieces = {t for t, kind in zip(tokens, token_types) if kind == _GGUF_NORMAL}
  merges = []  # (score of the join, its id, left, right)
  for index, (piece, kind) in enumerate(zip(tokens, token_types)):
    if kind != _GGUF_NORMAL:
      continue
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in pieces and right in pieces:
        merges.append((-scores[index], index, left, right))
  merges.sort()
  unk_id = fields.get("tokenizer.ggml.unknown_token_id")
  model = tokenizers.models.BPE(
    {token: index for index, token in enumerate(tokens)},
    [(left, right) for _, _, left, right in merges],
    unk_token=None if unk_id is None else tokens[unk_id],
    fuse_unk=True,
    byte_fallback=True,
  )
  tokenizer = tokenizers.Tokenizer(model)
  spaces = tokenizers.normalizers.Replace(" ", _SENTENCEPIECE_SPACE)
  to_text = [
    tokenizers.decoders.Replace(_SENTENCEPIECE_SPACE, " "),
    tokenizers.decoders.ByteFallback(),
    tokenizers.decoders.Fuse(),
  ]
  if fields.get("tokenizer.ggml.add_space_prefix", True):
    prefix = tokenizers.normalizers.Prepend(_SENTENCEPIECE_SPACE)
    tokenizer.normalizer = tokenizers.normalizers.Sequence([prefix, spaces])
    to_text.append(tokenizers.decoders.Strip(" ", 1, 0))
  else:
    tokenizer.normalizer = spaces
  tokenizer.decoder = tokenizers.decoders.Sequence(to_text)
  return tokenizer


def _end_of_turn_or(eos: str | None, template: str | None, vocabulary) -> str | None:
  """The end-of-turn token the chat template closes turns with, else `eos`."""
  for candidate in _END_OF_TURN_TOKENS:
    if template is not None and candidate in template and candidate in vocabulary:
      return candidate
  return eos


def _gguf_pre_tokenizer(pre: str | None) -> tokenizers.pre_tokenizers.PreTokenizer:
  """The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names."""
  byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  if pre == "smollm":  # SmolLM: digits one by one, then GPT-2's split
    return tokenizers.pre_tokenizers.Sequence(
      [tokenizers.pre_tokenizers.Digits(individual_digits=True), byte_level]
    )
  return byte_level


def _token_id(tokenizer: tokenizers.Tokenizer, token: str | None) -> int | None:
  return None if token is None else tokenizer.token_to_id(token)


def _token_text(value) -> str | None:
  """A tokenizer_config token: a string, or a dict with its `content`."""
  return value.get("content") if isinstance(value, dict) else value


def _default_template(value) -> str | None:
  """The template named "default" when the config lists several."""
  if isinstance(value, list):
    named = {entry["name"]: entry["template"] for entry in value}
    return named.get("default")
  return value


def _raise_exception(message: str):
  raise jinja2.TemplateError(message)


def _strftime_now(format_string: str) -> str:
  return datetime.datetime.now().strftime(format_string)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
  return json.dumps(
    value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
  )


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str) -> jinja2.Template:
  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  environment.filters["tojson"] = _tojson
  environment.globals["raise_exception"] = _raise_exception
  environment.globals["strftime_now"] = _strftime_now
  return environment.from_string(source)
