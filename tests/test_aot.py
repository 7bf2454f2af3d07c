"""`python -m paged_jax aot`: the engine's programs compiled by libtpu for TPU
topologies on this host, and the tool's errors."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from paged_jax import aot

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(
  not HAS_LIBTPU, reason=f"libtpu is not installed ({aot.INSTALL_HINT})"
)


def test_missing_libtpu_says_how_to_install(monkeypatch):
  monkeypatch.setattr(aot.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(RuntimeError, match=r'pip install "jax\[tpu\]"'):
    aot.require_libtpu()


def test_heads_not_divisible_by_the_mesh_names_both():
  with pytest.raises(ValueError, match=r"num_q_heads \(12\).*\(8\)"):
    aot.check_mesh(12, 4, 8, 8)
  with pytest.raises(ValueError, match="--tensor-parallel-size 2 must equal the topology's 4"):
    aot.check_mesh(8, 8, 2, 4)


def test_too_large_for_hbm_names_the_bytes():
  assert aot.kv_blocks_per_chip(1000, 300, 100, 200) == 3
  with pytest.raises(ValueError, match="900 bytes of weights and 100 bytes of temporaries"):
    aot.kv_blocks_per_chip(1000, 900, 100, 200)


@needs_libtpu
def test_unknown_topology_names_it_and_known_ones():
  with pytest.raises(ValueError, match=r"'v9z:3x3'.*v5e:2x2"):
    aot.topology_devices("v9z:3x3")


def _run_tool(topology: str, tp: int, variants: list[str]) -> dict:
  # This process may hold libtpu already (the in-process tests).
  env = {**os.environ, "PYTHONPATH": os.getcwd(), "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
  args = ["--model", "tiny", "--topology", topology, "--tensor-parallel-size", str(tp), "--json"]
  args += [a for v in variants for a in ("--variant", v)]
  result = subprocess.run(
    [sys.executable, "-m", "paged_jax", "aot", *args],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def _check_report(report: dict, topology: str, variants) -> None:
  """Each variant compiled programs of its own (launches equal to an earlier
  variant's are compiled once)."""
  assert report["topology"] == topology
  names = [p["name"] for p in report["programs"]]
  for variant in variants:
    assert any(n.startswith(f"{variant}: ") for n in names), variant
  assert all(p["hbm_bytes"] > 0 and p["compile_s"] > 0 for p in report["programs"])
  assert report["kv_blocks_per_chip"] > 0


@needs_libtpu
@pytest.mark.parametrize(
  "topology, tp",
  [pytest.param("v5e:1x1", 1, marks=pytest.mark.slow), ("v5e:2x2", 4)],  # CI: tensor parallel
)
def test_tiny_engine_compiles_for_tpu(topology, tp):
  report = _run_tool(topology, tp, ["plain"])
  _check_report(report, topology, ["plain"])
  names = [p["name"] for p in report["programs"]]
  assert any(n.startswith("plain: decode_loop") for n in names)
  assert any(n.startswith("plain: ragged_step") for n in names)


@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("topology, tp", [("v5e:1x1", 1), ("v5e:2x2", 4)])
def test_tiny_engine_compiles_every_variant_for_tpu(topology, tp):
  report = _run_tool(topology, tp, list(aot.VARIANTS))
  _check_report(report, topology, aot.VARIANTS)
  names = [p["name"] for p in report["programs"]]
  assert any("ragged_step" in n for n in names)
  assert any(n.startswith("speculation: prefill") for n in names)
  assert any("continue_decoding" in n for n in names)


@needs_libtpu
def test_captured_launches_match_compiled_programs():
  """The capture records one launch per program shape `compiled_programs` lists."""
  from paged_jax.models import pretrained

  engine = aot.build_engine(pretrained.load_tiny(), 1)
  launches = []
  with aot.capture(launches):
    engine.warmup()
  listed = engine.compiled_programs()
  names = [launch.name for launch in launches]
  assert names.count("decode_loop") == sum("decode loop" in n for n in listed)
  assert names.count("ragged_step") == sum(n.startswith("ragged step") for n in listed)


@needs_libtpu
def test_decode_loop_uses_the_mosaic_kernels():
  from paged_jax.attention import target_platform
  from paged_jax.models import pretrained

  engine = aot.build_engine(pretrained.load_tiny(), 1)
  launches = []
  with aot.capture(launches):
    engine.warmup()
  launch = next(la for la in launches if la.name == "decode_loop")
  mesh = aot.jax_mesh(aot.topology_devices("v5e:1x1"), (1, 1))
  args, kwargs = aot.abstract((launch.args, launch.kwargs), mesh)
  with target_platform("tpu"):
    text = launch.fn.lower(*args, **kwargs).as_text()
  assert "tpu_custom_call" in text
