"""Token ids, checked the same way wherever they come in: prompts of the
engine, the dense decoder and `pj.generate`, a tokenizer's `decode`, and the
server's request fields."""

from __future__ import annotations

import numpy as np


def check_token_ids(
  ids, vocab_size: int | None, what: str, *, allow_empty: bool = False, flatten: bool = False
) -> np.ndarray:
  """`ids` as a 1-D int32 array, once they pass the rule.

  Args:
    ids: an integer array (NumPy or JAX) or a sequence of ints.
    vocab_size: every id must lie in `0 .. vocab_size - 1`; None: any int.
    what: the name of the argument or field, which every message starts with.
    allow_empty: accept no ids at all (a prompt needs one).
    flatten: accept any shape and flatten it (a tokenizer decodes any);
      otherwise `ids` must be 1-D.

  Raises:
    ValueError: "`what`: token ids must be integers", "`what`: must be a
      1-D array of token ids", "`what`: must not be empty", or "`what`:
      token id `i` is outside the vocabulary (0..`vocab_size - 1`)".
  """
  ids = np.asarray(ids)
  if ids.size and not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{what}: token ids must be integers, got dtype {ids.dtype}")
  if flatten:
    ids = ids.ravel()
  elif ids.ndim != 1:
    raise ValueError(f"{what}: must be a 1-D array of token ids, got shape {list(ids.shape)}")
  if not ids.size and not allow_empty:
    raise ValueError(f"{what}: must not be empty")
  if vocab_size is not None and ids.size:
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
      raise ValueError(
        f"{what}: token id {int(bad[0])} is outside the vocabulary (0..{vocab_size - 1})"
      )
  return ids.astype(np.int32)
