"""GGUF files: every tensor type loads with the reference's logits, the
vocabularies (byte-level BPE and SentencePiece) tokenize as llama.cpp does,
and what the loader refuses is named.
"""

import gguf
import numpy as np
import pytest

from paged_jax import models
from tests.checkpoint_files import (
  CHAT_TEMPLATE,
  CORPUS,
  GGUF_HF,
  GGUF_TYPES,
  TOKEN_IDS,
  T,
  _config,
  _forward,
  random_weights,
  reference_logits,
  write_gguf,
)

# GGUF.


@pytest.fixture(scope="module")
def gguf_checkpoint(tmp_path_factory, bpe):
  rng = np.random.default_rng(2)
  weights = random_weights(GGUF_HF, rng)
  path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
  return path, write_gguf(path, GGUF_HF, weights, bpe, GGUF_TYPES, rng)


def test_gguf_logits_match_the_reference_for_every_tensor_type(gguf_checkpoint):
  path, meant = gguf_checkpoint
  model, _ = models.load_pretrained(path, dtype="float32")
  assert not model.config.tie_embeddings
  logits, _ = _forward(model, TOKEN_IDS[None])
  # llama.cpp stores Q and K rows so that its RoPE turns adjacent pairs.
  expected = reference_logits(GGUF_HF, meant, TOKEN_IDS, interleaved=True)
  np.testing.assert_allclose(np.asarray(logits[0]), expected, atol=1e-4, rtol=1e-4)


def test_gguf_tokenizer_matches_its_tokenizer_json(gguf_checkpoint, bpe):
  path, _ = gguf_checkpoint
  _, tokenizer = models.load_pretrained(path, dtype="float32")
  for text in CORPUS[:4] + ["<|im_start|>user\n42 apples<|im_end|>\n"]:
    assert tokenizer.encode(text) == bpe.encode(text).ids
  assert tokenizer.bos_token_id == bpe.token_to_id("<|im_start|>")
  # The chat template closes turns with <|im_end|>: that is where replies end.
  assert tokenizer.eos_token_id == bpe.token_to_id("<|im_end|>")
  assert tokenizer.chat_template == CHAT_TEMPLATE


# SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama 2, Mistral, Gemma).

SPM_SPECIALS = {"<unk>": 2, "<s>": 3, "</s>": 3, "<start_of_turn>": 3, "<end_of_turn>": 3}
# As in a vocabulary SentencePiece trains, every character of a piece is a piece.
SPM_PIECES = ["▁", "a", "b", "c", "d", "e", "é", "▁a", "ab", "bc", "abc", "▁ab", "▁abc"]
SPM_PIECES += ["cd", "dd", "▁d", "ca", "bca", "▁b", "▁▁", "ée"]


def _spm_fields(tmp_path, add_space_prefix=None):
  """A SentencePiece vocabulary's GGUF fields, written by the gguf package
  and read back as the loader reads them: special tokens, the 256 byte
  pieces, then normal pieces with distinct random scores."""
  tokens = list(SPM_SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
  types = list(SPM_SPECIALS.values()) + [6] * 256 + [1] * len(SPM_PIECES)
  scores = [0.0] * (len(tokens) - len(SPM_PIECES))
  scores += np.random.default_rng(7).permutation(len(SPM_PIECES)).astype(float).tolist()
  writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
  writer.add_tokenizer_model("llama")
  writer.add_token_list(tokens)
  writer.add_token_scores(scores)
  writer.add_token_types(types)
  writer.add_unk_token_id(0)
  writer.add_bos_token_id(1)
  writer.add_eos_token_id(2)
  if add_space_prefix is not None:
    writer.add_add_space_prefix(add_space_prefix)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.close()
  reader = gguf.GGUFReader(str(tmp_path / "spm.gguf"))
  return {key: field.contents() for key, field in reader.fields.items()}


def _spm_reference(fields, text: str) -> list[int]:
  """llama.cpp's SentencePiece tokenization, written out: split at special
  tokens; put a space before each other part that follows a special token
  or starts the text (with add_space_prefix); spaces to "▁"; merge the
  adjacent pair whose join is the best-scoring normal piece (leftmost on a
  tie) until none is; then each symbol is its piece or its bytes' pieces."""
  tokens, scores = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.scores"]
  types = fields["tokenizer.ggml.token_type"]
  normal = {t: (i, scores[i]) for i, t in enumerate(tokens) if types[i] == 1}
  specials = {t: i for i, t in enumerate(tokens) if types[i] == 3}
  space_prefix = fields.get("tokenizer.ggml.add_space_prefix", True)
  parts, rest = [], text
  while rest:
    at = [(rest.find(t), -len(t), t) for t in specials if t in rest]
    if not at:
      parts.append(rest)
      break
    start, _, special = min(at)
    parts += [rest[:start], specials[special]] if start else [specials[special]]
    rest = rest[start + len(special) :]
  ids, after_special = [], True
  for part in parts:
    if isinstance(part, int):
      ids.append(part)
      after_special = True
      continue
    symbols = list(((" " if space_prefix and after_special else "") + part).replace(" ", "▁"))
    while True:
      pairs = enumerate(zip(symbols, symbols[1:]))
      joins = [(normal[a + b][1], -i) for i, (a, b) in pairs if a + b in normal]
      if not joins:
        break
      i = -max(joins)[1]  # the best score, then the leftmost
      symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    for symbol in symbols:
      if symbol in normal:
        ids.append(normal[symbol][0])
      else:
        ids += [tokens.index(f"<0x{b:02X}>") for b in symbol.encode()]
    after_special = False
  return ids


SPM_TEXTS = ["abc", "a bc d", "abcd dd", "bca  ab", " lead", "éeé", "日本 a", "ab<start_of_turn>ca"]


@pytest.mark.parametrize("add_space_prefix", [None, False])
def test_gguf_sentencepiece_vocabulary_tokenizes_as_llama_cpp(tmp_path, add_space_prefix):
  fields = _spm_fields(tmp_path, add_space_prefix)
  tokenizer = models.PretrainedTokenizer.from_gguf_fields(fields)
  for text in SPM_TEXTS + ["<s>a<end_of_turn>", ""]:
    assert tokenizer.encode(text) == _spm_reference(fields, text), text
  for text in SPM_TEXTS[:-1]:  # a special token adds a space after it
    assert tokenizer.decode(tokenizer.encode(text)) == text
  assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


@pytest.mark.parametrize(
  "kind, missing, message",
  [
    ("llama", "tokenizer.ggml.scores", "no tokenizer.ggml.scores field"),
    ("llama", "tokenizer.ggml.tokens", "no tokenizer.ggml.tokens field"),
    ("gpt2", "tokenizer.ggml.merges", "no tokenizer.ggml.merges field"),
  ],
)
def test_gguf_vocabulary_fields_missing_are_named(tmp_path, kind, missing, message):
  fields = dict(_spm_fields(tmp_path), **{"tokenizer.ggml.model": kind})
  fields.pop(missing, None)  # the SentencePiece fields have no merges
  with pytest.raises(ValueError, match=f"my.gguf: {message}"):
    models.PretrainedTokenizer.from_gguf_fields(fields, source="my.gguf")


def test_gguf_sentencepiece_scores_of_another_length_are_refused(tmp_path):
  fields = dict(_spm_fields(tmp_path), **{"tokenizer.ggml.scores": [0.0]})
  with pytest.raises(ValueError, match=r"282 tokens, 1 scores and 282 token types"):
    models.PretrainedTokenizer.from_gguf_fields(fields)


@pytest.fixture(scope="module")
def small_gguf_weights():
  return random_weights(_config(hidden_size=32), np.random.default_rng(4))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(arch="gpt2"), "GGUF architecture 'gpt2' is not supported"),
    (dict(types=[T.Q2_K]), "tensor token_embd.weight has GGUF type Q2_K"),
    (dict(tokenizer_model="bert"), "tokenizer.ggml.model 'bert' is not supported"),
    (
      dict(extra={"blk.0.attn_output.bias": np.ones(32, np.float32)}),
      r"unexpected tensor\(s\) blk.0.attn_output.bias",
    ),
    (dict(rope_dims=4), r"partial RoPE \(4 of 8 features\)"),
    (dict(rope_scaling="yarn"), "RoPE scaling 'yarn' is not supported"),
  ],
)
def test_gguf_errors_are_named(tmp_path, bpe, small_gguf_weights, kwargs, message):
  kwargs = dict(dict(types=[T.F32]), **kwargs)
  hf = _config()
  weights = small_gguf_weights
  if kwargs["types"] == [T.Q2_K]:  # K-quant blocks need rows of 256
    hf = GGUF_HF
    weights = random_weights(GGUF_HF, np.random.default_rng(5))
  path = tmp_path / "bad.gguf"
  write_gguf(path, hf, weights, bpe, rng=np.random.default_rng(6), **kwargs)
  with pytest.raises(ValueError, match=message) as error:
    models.load_pretrained(path, dtype="float32")
  assert str(path) in str(error.value)


def test_gguf_misshapen_tensor_is_named(tmp_path, bpe, small_gguf_weights):
  weights = dict(small_gguf_weights)
  weights["model.layers.0.mlp.up_proj.weight"] = np.ones((40, 32), np.float32)
  path = tmp_path / "bad.gguf"
  write_gguf(path, _config(), weights, bpe, [T.F32], np.random.default_rng(7))
  with pytest.raises(
    ValueError,
    match=r"tensor blk.0.ffn_up.weight has shape "
    r"\(40, 32\), the config needs \(48, 32\)",
  ):
    models.load_pretrained(path)
