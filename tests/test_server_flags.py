"""The tiny server starts, answers and stops with each flag that changes
its programs (slow: one warm-up per flag).

Each server must reach `/health`, answer a completion, stay under half of
Linux's `vm.max_map_count` memory mappings after its warm-up (XLA:CPU maps
every compiled program's code, and past the limit it dies in its next
compile), and exit 0 on SIGTERM with a stream in flight, which ends with an
error event (`RunningServer.stop_with_stream_in_flight`).
"""

import json
import os

import pytest

from tests.test_server import TINY_ARGS, _serve

BASE_ARGS = [arg for arg in TINY_ARGS if arg != "--async-scheduling"]
FLAGS = {
  "no-prefix-caching": ["--no-enable-prefix-caching"],
  "swap": ["--preemption-mode", "swap", "--swap-space", "0.01"],
  "int8-kv": ["--kv-cache-dtype", "int8"],
  "fp8-kv": ["--kv-cache-dtype", "fp8"],
  "int8-weights": ["--quantization", "int8"],
  "int4-weights": ["--quantization", "int4"],
  "async": ["--async-scheduling"],
  "one-step": ["--num-scheduler-steps", "1"],
  "ngram": [
    "--speculative-config",
    json.dumps(dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)),
  ],
  "draft": [
    "--speculative-config",
    json.dumps(dict(method="draft_model", model="tiny", num_speculative_tokens=2)),
  ],
  "tensor-parallel": ["--tensor-parallel-size", "2"],
  "data-parallel": ["--data-parallel-size", "2"],
}


def _max_map_count() -> int:
  with open("/proc/sys/vm/max_map_count") as limit:
    return int(limit.read())


def _num_mappings(pid: int) -> int:
  with open(f"/proc/{pid}/maps", "rb") as maps:
    return maps.read().count(b"\n")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/sys/vm/max_map_count"), reason="needs Linux procfs")
@pytest.mark.parametrize("flag", FLAGS)
def test_the_server_starts_answers_and_stops_with(flag, monkeypatch):
  if flag.endswith("parallel"):  # two host devices for the mesh
    flags = os.environ.get("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=2")
  with _serve(BASE_ARGS + FLAGS[flag], "tiny") as server:
    response = server.post(
      "/v1/completions", json=dict(model="tiny", prompt="LOVE, n. ", max_tokens=6, ignore_eos=True)
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 6
    assert _num_mappings(server.process.pid) < _max_map_count() // 2
