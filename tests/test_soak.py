"""The soak of `benchmarks/soak_serve.py`, short, on the tiny server (with the
tiny server's engine config of tests/test_server.py, whose programs the
run's compilation cache then holds)."""

import asyncio
import json
import pathlib
import sys

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import soak_serve  # noqa: E402


def test_a_short_soak_leaks_nothing_and_answers_as_alone():
  args = ["--requests", "100", "--burst-every", "50", "--concurrency", "8"]
  args += ["--warm-up-requests", "8"]
  args += ["--max-waiting-requests", "12"]
  engine_config = ["--num-gpu-blocks-override", "96", "--async-scheduling"]
  report = soak_serve.soak(soak_serve.parse_args([*args, "--", *engine_config]))
  print(json.dumps(report))  # pytest shows it when the test fails
  # Among them: nothing compiled after the engine's warm-up (a program
  # compiled while serving kept 35 to 60 MiB of the tiny server's RSS in
  # malloc's arenas, failing the RSS check; benchmarks/RESULTS.md).
  assert report["failed_checks"] == [], report["failed_checks"]
  assert report["completed"] >= 80 and report["checked_alone"] > 0
  assert report["refused"] > 0 and report["statuses"] == [503]  # the bursts past the queue
  assert report["shutdown"]["streams_with_error_event"] > 0


def test_event_lines_split_at_cr_and_lf_only():
  # A token's text with U+2028 or U+0085 is sent raw in its event's JSON
  # (valid JSON and valid server-sent events): a client that splits there,
  # as httpx's aiter_lines does, reads half an event.
  event = 'data: {"text": "a\u2028b\x85c\u2029d"}'

  async def chunks():
    for piece in (event[:12], event[12:] + "\n\ndata: [DO", "NE]\r\n\r\n"):
      yield piece.encode()

  async def lines():
    response = httpx.Response(200, content=chunks())
    return [line async for line in soak_serve.event_lines(response)]

  assert asyncio.run(lines()) == [event, "", "data: [DONE]", ""]
