"""Tensor and data parallel serving on CPU meshes, and over two processes.

The mesh checks run in subprocesses (tests/sharding_worker.py) with forced
host devices, so the rest of the suite keeps one device: one process with 8
devices for the meshes (1, 2), (1, 4), (2, 2), (2, 4), (8, 1), and two
processes of 4 devices on localhost for one (2, 4) mesh over both.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax as pj
from paged_jax import sharding
from paged_jax.block_manager import manager
from paged_jax.models import LlamaConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESHES = ("1x2", "1x4", "2x2", "2x4", "8x1")
TIMEOUT_S = 600
# -O0 halves XLA:CPU compile time; every result is compared within one run.
FAST_COMPILE = "--xla_backend_optimization_level=0"


def _env(num_devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={num_devices} "
                      f"{FAST_COMPILE}")
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _worker(out, *extra):
  return [sys.executable, "-m", "tests.sharding_worker", str(out), *extra]


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
  """What the 8-device run saw on every mesh."""
  out = tmp_path_factory.mktemp("sharding") / "meshes.json"
  result = subprocess.run(_worker(out), cwd=ROOT, env=_env(8),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-4000:]
  return json.loads(out.read_text())


def test_every_mesh_gives_the_single_device_tokens(meshes):
  for name in MESHES:
    assert meshes[name]["tokens"] == meshes["reference"], name


def test_every_tensor_parallel_layout_gives_the_single_device_logits(meshes):
  for name in ("1x2", "1x4", "2x4", "8x1"):
    for got, want in zip(meshes[name]["logits"], meshes["reference_logits"]):
      np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=name)


def test_each_device_holds_its_share_of_the_cache(meshes):
  full = meshes["unsharded_bytes"]
  # The tiny model has 2 KV heads: 2 shards split them, 4 shards store each
  # head twice and hold one head each, so a device holds half either way.
  for name, tp in (("1x2", 2), ("1x4", 4), ("2x2", 2), ("2x4", 4),
                   ("8x1", 1)):
    share = max(1, 2 // tp) / 2 if tp > 1 else 1
    for kind in ("device", "host"):
      per_device = meshes[name]["bytes"][kind]
      assert len(per_device) == tp, (name, kind)
      assert per_device == [full[kind][0] * share] * tp, (name, kind)


def test_no_step_moves_a_cache_between_devices(meshes):
  # Pages are [heads, 48 blocks, 8, 32]; no collective may carry one.
  page = re.compile(r"\[\d+,48,8,32\]")
  for name in ("1x2", "1x4"):
    steps = meshes[name]["collectives"]
    for step, ops in steps.items():
      assert not [op for op in ops if page.search(op[1])], (name, step, ops)
    # Tensor parallel for real: the row-split projections all-reduce.
    assert any(op == "all-reduce" for op, _ in steps["decode"]), name


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_give_the_one_process_tokens(meshes, tmp_path):
  port = _free_port()
  procs = [subprocess.Popen(
      _worker(tmp_path / f"{i}.json", "--port", str(port), "--process_id",
              str(i)),
      cwd=ROOT, env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True) for i in range(2)]
  try:
    logs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  for proc, log in zip(procs, logs):
    assert proc.returncode == 0, log[-4000:]
  for i in range(2):
    seen = json.loads((tmp_path / f"{i}.json").read_text())
    assert seen["process_index"] == i
    assert (seen["devices"], seen["local_devices"]) == (8, 4)
    assert seen["tokens"] == meshes["reference"]
