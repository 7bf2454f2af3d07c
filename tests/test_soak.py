"""The soak of `benchmarks/soak_serve.py`, short, on the tiny server (with the
tiny server's engine config of tests/test_server.py, whose programs the
run's compilation cache then holds)."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import soak_serve  # noqa: E402


def test_a_short_soak_leaks_nothing_and_answers_as_alone():
  args = ["--requests", "100", "--burst-every", "50", "--concurrency", "8"]
  # Without structured outputs: their rows' programs compile at first use
  # (the engine's warm-up leaves them out), which a short warm-up mix does
  # not cover, so RSS would grow by compiled code (benchmarks/RESULTS.md).
  args += ["--warm-up-requests", "8", "--structured-share", "0"]
  args += ["--max-waiting-requests", "12"]
  engine_config = ["--num-gpu-blocks-override", "96", "--async-scheduling"]
  report = soak_serve.soak(soak_serve.parse_args([*args, "--", *engine_config]))
  assert report["failed_checks"] == [], report
  assert report["completed"] >= 80 and report["checked_alone"] > 0
  assert report["refused"] > 0 and report["statuses"] == [503]  # the bursts past the queue
  assert report["shutdown"]["streams_with_error_event"] > 0
