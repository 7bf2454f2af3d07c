"""The Hugging Face tokenizer of a checkpoint folder: round trips, special
tokens, chat templates and their errors.
"""

import hypothesis
import jinja2
import numpy as np
import pytest
from hypothesis import strategies as st

from paged_jax import models
from tests.checkpoint_files import (
  FAMILIES,
  random_weights,
  write_hf,
)

# Tokenizers and chat templates.


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory, bpe):
  """The tokenizer of a Llama checkpoint folder (tokenizer.json and
  tokenizer_config.json with `CHAT_TEMPLATE`)."""
  hf = FAMILIES["llama_tied"]
  weights = random_weights(hf, np.random.default_rng(0))
  folder = write_hf(tmp_path_factory.mktemp("llama_tied"), hf, weights, bpe)
  return models.load_pretrained(folder, dtype="float32")[1]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.text())
def test_tokenizer_round_trips_any_text(hf_tokenizer, text):
  assert hf_tokenizer.decode(hf_tokenizer.encode(text)) == text


@pytest.mark.parametrize(
  "text",
  [
    "",
    " ",
    "  two  spaces ",
    "\t\ttabs\n\nnewlines\r\n",
    "naïve café 日本語 🙂",
    "\u200b zero width",
    "<|im_start|>user\nhi<|im_end|>",
  ],
)
def test_tokenizer_round_trips_unicode_and_whitespace(hf_tokenizer, text):
  ids = hf_tokenizer.encode(text)
  assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_encode_as_one_id(hf_tokenizer):
  ids = hf_tokenizer.encode("<|im_start|>hi<|im_end|>")
  assert ids[0] == hf_tokenizer.bos_token_id
  assert ids[-1] == hf_tokenizer.eos_token_id
  assert hf_tokenizer.decode(ids) == "hi"


def test_chat_template_renders_as_transformers_does(hf_tokenizer):
  messages = [
    dict(role="user", content="Hi!"),
    dict(role="assistant", content="Hello."),
    dict(role="user", content="2+2?"),
  ]
  assert hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == (
    "<|im_start|>system\nBe brief.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n"
    "<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
  )
  assert hf_tokenizer.apply_chat_template([dict(role="system", content="S")]) == (
    "<|im_start|>system\nS<|im_end|>\n"
  )


def test_chat_template_errors(hf_tokenizer):
  with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
    hf_tokenizer.apply_chat_template([dict(role="tool", content="x")])
  with pytest.raises(ValueError, match="no chat template"):
    models.PretrainedTokenizer(hf_tokenizer.tokenizer).apply_chat_template([])
  with pytest.raises(ValueError, match="has no chat template"):
    models.ByteTokenizer().apply_chat_template([])


def test_tokenizer_errors(hf_tokenizer):
  with pytest.raises(ValueError, match=r"token id 300 is outside the vocabulary \(0..299\)"):
    hf_tokenizer.decode([1, 300])
  with pytest.raises(ValueError, match="text must be a str"):
    hf_tokenizer.encode(b"bytes")
  with pytest.raises(ValueError, match="eos_token '<nope>' is not in the"):
    models.PretrainedTokenizer(hf_tokenizer.tokenizer, eos_token="<nope>")


def test_byte_tokenizer_has_the_same_special_token_names():
  tokenizer = models.ByteTokenizer()
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257)
