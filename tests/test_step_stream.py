"""Streaming decode steps: each step of a multi-step decode launch reaches
the caller while the launch runs, and the outputs equal those of an engine
that reads its launches back whole."""

import dataclasses
import gc
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paged_jax as pj
from paged_jax import kernel_choice, models
from paged_jax.engine import arrivals, step_stream
from paged_jax.sampling import Draw
from tests.tiny_models import BYTE_LLAMA, ENGINE_CFG

TOKENIZER = models.ByteTokenizer()
GREEDY = pj.SamplingParams(max_tokens=14, ignore_eos=True, output_kind="delta")
SAMPLED = pj.SamplingParams(
  max_tokens=14, temperature=0.9, top_k=50, seed=7, n=2, ignore_eos=True, logprobs=2
)
PROMPTS = {"greedy": "CAT, n. ", "sampled": "WAR", "stopped": "BORE, n. A person"}


@pytest.fixture(scope="module")
def model():
  return models.Llama(BYTE_LLAMA, rngs=nnx.Rngs(0))


def _engine(model, **kwargs):
  return pj.LLMEngine(model, TOKENIZER, ENGINE_CFG, num_decode_steps=4, **kwargs)


def _serve(engine, stop: str | None = None):
  """Runs the three requests ("stopped" with `stop` as a stop string) to
  their end. Returns `(joined, steps)`: per request and sample, its
  streamed deltas joined as `(text, token ids, logprobs)`, and per round
  `(outputs on_decode_step got, outputs step returned)`."""
  params = {
    "greedy": GREEDY,
    "sampled": dataclasses.replace(SAMPLED, output_kind="delta"),
    "stopped": dataclasses.replace(GREEDY, stop=[stop] if stop else []),
  }
  for request_id, prompt in PROMPTS.items():
    engine.add_request(request_id, prompt, params[request_id])
  joined, steps = {}, []
  while engine.has_unfinished_requests():
    partial = []
    returned = engine.step(on_decode_step=partial.append)
    steps.append((partial, returned))
    for out in [o for outs in partial for o in outs] + returned:
      for sample in out.outputs:
        text, ids, logprobs = joined.setdefault((out.request_id, sample.index), ("", [], []))
        joined[out.request_id, sample.index] = (
          text + sample.text,
          ids + sample.token_ids,
          logprobs + (sample.logprobs or []),
        )
  assert engine.num_free_gpu_blocks() == ENGINE_CFG.num_gpu_blocks
  return joined, steps


@pytest.fixture(scope="module")
def whole(model):
  """The outputs of an engine that reads each launch back whole, and a
  stop string that "stopped" completes in the middle of a launch."""
  joined, _ = _serve(_engine(model))
  stop = joined["stopped", 0][0][6:8]
  return _serve(_engine(model), stop)[0], stop


# With a launch running ahead: the slow tier (its programs compile apart),
# and in CI the tiny server's streams (tests/test_server.py).
@pytest.mark.parametrize("async_scheduling", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_each_decode_step_reaches_the_caller_before_its_launch_is_read_back(
  model, whole, async_scheduling
):
  expected, stop = whole
  engine = _engine(model, stream_steps=True, async_scheduling=async_scheduling)
  joined, steps = _serve(engine, stop)
  assert joined == expected
  streamed = [outs for partial, _ in steps for outs in partial]
  assert len(streamed) >= 6
  for outs in streamed:  # one token per sample of each request that drew
    for out in outs:
      assert not out.finished
      assert all(len(sample.token_ids) <= 1 for sample in out.outputs)
      assert sum(len(sample.token_ids) for sample in out.outputs) >= 1
  # "stopped" ends in a launch's middle: its end comes once, when read back.
  finals = [out for _, returned in steps for out in returned if out.request_id == "stopped"]
  assert [out.finished for out in finals][-1] and sum(out.finished for out in finals) == 1
  assert finals[-1].outputs[0].stop_reason == stop


def test_a_step_is_handed_on_before_the_launch_ends(model):
  # A launch of 4 steps on every slot (the decode loop with the beam state):
  # while the caller holds the first step's outputs, the launch has not
  # been read back (its steps are not counted yet).
  engine = _engine(model, stream_steps=True)
  num_slots = ENGINE_CFG.max_seqs
  for i in range(num_slots):
    engine.add_request(str(i), "CAT", dataclasses.replace(GREEDY, max_tokens=12))
  for _ in range(3):  # a ragged step, then launches of 1 and 2 steps
    engine.step()
  assert engine.runner._decode_row_slots() is None  # every slot
  counted_before = engine.stats.decode_steps
  seen = []
  outputs = engine.step(
    on_decode_step=lambda outs: seen.append((engine.stats.decode_steps, len(outs)))
  )
  assert seen == [(counted_before, num_slots)] * 4
  assert engine.stats.decode_steps == counted_before + 4
  assert outputs == []  # every token went out step by step


def test_the_cpu_channel_takes_steps_in_order_and_names_bad_input(monkeypatch):
  stream = step_stream.StepStream()
  assert stream.mode == "ffi"
  rows, k = 3, 2
  draw = Draw(
    tokens=jnp.arange(rows, dtype=jnp.int32) + 10,
    logprob=-jnp.arange(rows, dtype=jnp.float32),
    top_ids=jnp.arange(rows * k, dtype=jnp.int32).reshape(rows, k),
    top_logprobs=jnp.ones((rows, k), jnp.float32),
  )
  drew = jnp.array([True, False, True])

  @jax.jit
  def two_steps(channel, draw, drew):
    passed = step_stream.publish_step(channel, "ffi", 0, draw, drew, jnp.bool_(True))
    passed = step_stream.publish_step(channel, "ffi", 1, draw, ~drew, passed)
    return passed, step_stream.end_launch(channel, "ffi", passed.astype(jnp.int32) + 1)

  passed, steps = two_steps(stream.operands[1], draw, drew)
  assert bool(passed) and int(steps) == 2
  assert stream.take(0, rows, k, 0.0) == []  # the other channel
  first, second, end = stream.take(1, rows, k, 1.0)
  assert (first.column, second.column, end.column) == (0, 1, step_stream.ENDED)
  np.testing.assert_array_equal(first.tokens, [10, 11, 12])
  np.testing.assert_array_equal(first.top_ids, np.asarray(draw.top_ids))
  np.testing.assert_array_equal(first.drew, [True, False, True])
  np.testing.assert_array_equal(second.drew, [False, True, False])
  two_steps(stream.operands[1], draw, drew)
  with pytest.raises(ValueError, match="is not 4 rows by 2"):
    stream.take(1, 4, k, 1.0)
  stream.clear(1)
  assert stream.take(1, rows, k, 0.0) == []
  jax.block_until_ready(two_steps(stream.operands[1], draw, drew))  # left there
  held = stream.id
  del stream
  gc.collect()
  monkeypatch.setattr(step_stream._ids, "free", [held])
  again = step_stream.StepStream()  # the same id: its channels start empty
  assert again.id == held and again.take(1, rows, k, 0.0) == []
  with pytest.raises(ValueError, match="step stream channel out of range"):
    out_of_range = jnp.int32(step_stream.MAX_CHANNELS)
    jax.block_until_ready(two_steps(out_of_range, draw, drew))


def test_a_launch_that_ended_without_its_mark_ends_the_wait(model):
  # A failed launch publishes no end mark: once its outputs are ready and
  # its channel is empty, the read stops waiting (reading it back raises).
  engine = _engine(model, stream_steps=True)
  failed = types.SimpleNamespace(step=jnp.int32(0))
  taken = []
  engine.runner.step_stream.clear(0)
  engine.runner._stream(failed, None, 0, lambda *step: taken.append(step))
  assert taken == []


def test_the_host_callback_channel_and_other_platforms():
  stream = step_stream.StepStream(mode="callback")
  channel = stream.channels[0]
  tokens, logprob = np.array([5, 6], np.int32), np.zeros(2, np.float32)
  top_ids, top_logprobs = np.zeros((2, 1), np.int32), np.zeros((2, 1), np.float32)
  assert step_stream._publish_on_host(
    channel, 3, tokens, logprob, top_ids, top_logprobs, np.array([True, False]), np.bool_(True)
  )
  assert step_stream._end_on_host(channel, np.int32(4)) == 4
  published, end = stream.take(0, 2, 1, 1.0)
  assert published.column == 3 and end.column == step_stream.ENDED
  np.testing.assert_array_equal(published.tokens, tokens)
  step_stream._publish_on_host(channel, 0, tokens, logprob, top_ids, top_logprobs, tokens > 0, 1)
  with pytest.raises(ValueError, match=r"has \(2, 1\), not \(2, 3\)"):
    stream.take(0, 2, 3, 1.0)
  # A program traced for TPU calls back, even from a CPU engine.
  draw = Draw(jnp.asarray(tokens), jnp.asarray(logprob), jnp.asarray(top_ids), top_logprobs)
  trace = lambda: str(
    jax.make_jaxpr(
      lambda c: step_stream.publish_step(c, "ffi", 0, draw, draw.tokens > 0, jnp.bool_(True))
    )(stream.operands[0])
  )
  assert "ffi_call" in trace()
  with kernel_choice.target_platform("tpu"):
    traced = trace()
  assert "io_callback" in traced and "ffi_call" not in traced


def test_streaming_options_fail_clearly(model):
  with pytest.raises(ValueError, match="stream_steps must be a bool, got 1"):
    _engine(model, stream_steps=1)
  with pytest.raises(ValueError, match="stream_steps=True needs one device, not 2"):
    step_stream.check_streaming(True, 2)
  assert not step_stream.check_streaming(False, 2)
  assert _engine(model).runner.step_stream is None  # off by default


@pytest.mark.parametrize(
  "holder, ids, what",
  [
    (step_stream.StepStream, step_stream._ids, "engines stream their decode steps"),
    (arrivals.ArrivalWatch, arrivals._ids, "engines check for arrivals"),
  ],
)
def test_channel_and_watch_ids_are_reused_once_their_engine_is_gone_and_run_out_clearly(
  holder, ids, what, monkeypatch
):
  held = holder().id
  gc.collect()  # the holder is gone: its id is free again
  assert held in ids.free
  kept = holder()
  assert kept.id not in ids.free
  monkeypatch.setattr(ids, "free", [])
  with pytest.raises(RuntimeError, match=f"more than 4096 {what} at once"):
    holder()


# Its decode loop compiles apart (host callbacks): `slow`.
@pytest.mark.slow
def test_streaming_through_host_callbacks_gives_the_same_outputs(model, whole, monkeypatch):
  monkeypatch.setattr(step_stream, "preferred_mode", lambda: "callback")
  expected, stop = whole
  engine = _engine(model, stream_steps=True)
  assert engine.runner.step_stream.mode == "callback"
  joined, steps = _serve(engine, stop)
  assert joined == expected
  assert sum(len(partial) for partial, _ in steps) >= 6
