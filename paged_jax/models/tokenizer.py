"""Byte-level tokenizer: token ids 0..255 are UTF-8 bytes, then BOS and EOS."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ByteTokenizer:
  """Encodes text as its UTF-8 bytes; needs no vocabulary file.

  Attributes:
    bos_id: id that starts a sequence (256).
    eos_id: id that ends a sequence (257).
    vocab_size: number of ids (258).
  """

  bos_id = 256
  eos_id = 257
  vocab_size = 258

  def encode(self, text: str, *, add_bos: bool = False,
             add_eos: bool = False) -> np.ndarray:
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
    return np.concatenate([np.asarray(prefix, np.int32), ids,
                           np.asarray(suffix, np.int32)])

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
    ids = np.asarray(ids)
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64).ravel()
    bad = ids[(ids < 0) | (ids >= self.vocab_size)]
    if bad.size:
      raise ValueError(
          f"token id {int(bad[0])} is outside 0..{self.vocab_size - 1}")
    data = ids[ids < 256].astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")
