"""The soak of `benchmarks/soak_serve.py`, short, on the tiny server (with the
tiny server's engine config of tests/test_server.py, whose programs the
run's compilation cache then holds)."""

import json
import pathlib
import sys

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
