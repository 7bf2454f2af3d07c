"""Token ids: one rule (`paged_jax.token_ids.check_token_ids`) for every entry
point that takes them (the engine's and the dense decoder's prompts, a
tokenizer's `decode`, the server's fields). Host-side only: nothing compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj
from paged_jax.engine.input_processor import InputProcessor
from paged_jax.models.tokenizer import ByteTokenizer
from paged_jax.server.app import Server, ServerSettings
from paged_jax.server.bodies import APIError
from paged_jax.server.metrics import ServerMetrics
from paged_jax.token_ids import check_token_ids

VOCAB = 258

REFUSED = [
  ([1.0, 2.0], "token ids must be integers, got dtype float64"),
  (["a"], "token ids must be integers"),
  ([[1, 2]], r"must be a 1-D array of token ids, got shape \[1, 2\]"),
  (7, r"must be a 1-D array of token ids, got shape \[\]"),
  ([], "must not be empty"),
  ([1, 258, 300], r"token id 258 is outside the vocabulary \(0..257\)"),
  ([3, -1], r"token id -1 is outside the vocabulary \(0..257\)"),
]


@pytest.mark.parametrize(("ids", "message"), REFUSED)
def test_the_rule_refuses_naming_the_argument(ids, message):
  with pytest.raises(ValueError, match=f"^prompt: {message}"):
    check_token_ids(ids, VOCAB, "prompt")


@pytest.mark.parametrize(
  "ids", [[0, 257], np.array([5, 6], np.int64), jnp.array([5, 6], jnp.int32), np.uint8([9])]
)
def test_ids_that_pass_come_back_as_int32(ids):
  checked = check_token_ids(ids, VOCAB, "prompt")
  assert checked.dtype == np.int32 and checked.ndim == 1
  np.testing.assert_array_equal(checked, np.asarray(ids))


def test_empty_flattened_and_unbounded_ids_where_asked():
  assert check_token_ids([], VOCAB, "ids", allow_empty=True).shape == (0,)
  np.testing.assert_array_equal(check_token_ids([[1], [2]], VOCAB, "ids", flatten=True), [1, 2])
  np.testing.assert_array_equal(check_token_ids([10**6], None, "prompt"), [10**6])
  with pytest.raises(ValueError, match="^prompt: must not be empty"):
    check_token_ids([], None, "prompt")


def _server() -> Server:
  settings = ServerSettings("tiny", "tiny", 128, VOCAB, 4, 5, 2)
  return Server(None, ByteTokenizer(), settings, ServerMetrics("tiny"))


ENTRY_POINTS = {
  "engine prompt": lambda ids: InputProcessor(None, None, VOCAB, 128, 5, 4).group(
    "r", ids, pj.SamplingParams(), jax.random.key(0), 0
  ),
  "pj.Request": lambda ids: pj.Request(ids),
  "tokenizer decode": lambda ids: ByteTokenizer().decode(ids),
  "server field": lambda ids: _server().check_ids(ids, "prompt"),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_applies_the_rule(entry):
  with pytest.raises((ValueError, APIError), match=r"token ids must be integers") as refused:
    ENTRY_POINTS[entry]([1.5])
  if entry != "pj.Request":  # a dense prompt has no vocabulary to check against
    with pytest.raises((ValueError, APIError), match=r"token id 300 is outside the vocabulary"):
      ENTRY_POINTS[entry]([1, 300])
  if entry == "server field":
    assert refused.value.param == "prompt" and refused.value.status == 400
