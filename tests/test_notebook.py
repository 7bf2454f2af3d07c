"""Executes the notebooks in colab/ top to bottom on CPU, skipping the install cell.

The kernel is this interpreter (nbclient's `python3` kernel), so each runs on
the JAX the tests run on.
"""

import importlib.metadata
import pathlib
import re
import socket
import sys

import pytest

from pallas_kernels.paged_attention import cpu

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

COLAB = pathlib.Path(__file__).parent.parent / "colab"
VERSIONS = f"Python {sys.version.split()[0]}, JAX {importlib.metadata.version('jax')}"
# The C++ decode kernel wherever a compiler builds it (paged_jax.kernel_choice).
CPU_DECODE = "C++ (XLA FFI)" if cpu.find_compiler() else "chunked XLA"
CPU_KERNELS = f"backend cpu: decode attention = {CPU_DECODE}, prefill attention = chunked XLA"


def _run(name: str, monkeypatch, parameters: str = ""):
  """Executes `name`, with `parameters` appended to its `parameters` cell;
  returns (printed text, number of images)."""
  notebook = nbformat.read(COLAB / name, as_version=4)
  tagged = lambda tag: [cell for cell in notebook.cells if tag in cell.metadata.get("tags", [])]
  (install,) = tagged("install")
  # pip keeps the runtime's JAX: the install pins the versions it has.
  assert "pip install" in install.source and "{JAX_PINS}" in install.source
  notebook.cells.remove(install)
  if parameters:
    (cell,) = tagged("parameters")
    cell.source += "\n" + parameters
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("MPLBACKEND", raising=False)
  monkeypatch.setenv("PYTHONPATH", str(COLAB.parent))
  client = nbclient.NotebookClient(
    notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(COLAB)}}
  )
  client.execute()
  outputs = [
    output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
  ]
  text = "".join(output.get("text", "") for output in outputs)
  images = sum("image/png" in output.get("data", {}) for output in outputs)
  return text, images


@pytest.mark.slow
def test_quickstart_notebook_runs(monkeypatch):
  text, images = _run("quickstart.ipynb", monkeypatch)
  assert VERSIONS in text and CPU_KERNELS in text
  assert "copy-on-write plan: [(" in text
  # Full blocks of 4: 3 + 3 + 4 lookups; the second and third prompt hit
  # the 3 system-prefix blocks: 6 hits of 10.
  assert "prefix-cache hit rate 60%" in text
  assert "'LOVE, n. " in text and "GenerationStats(" in text
  assert "decode attention (2, 4, 32) lengths [21, 21] copies 1" in text
  assert images == 4  # one per show() call


@pytest.mark.slow
def test_engine_notebook_runs(monkeypatch):
  text, images = _run("engine.ipynb", monkeypatch)
  assert VERSIONS in text and CPU_KERNELS in text
  assert "finish: " in text
  assert "beam 0: " in text and "beam 2: " in text
  assert "blocks free at the end 24 of 24" in text
  assert images == 1


@pytest.mark.slow  # 32 s; CI checks the engine's training-loop calls in tests/test_rl.py
def test_rl_grpo_notebook_learns(monkeypatch):
  monkeypatch.setenv("GRPO_STEPS", "12")
  text, images = _run("rl_grpo.ipynb", monkeypatch)
  # Before training about 9% of the bytes are "e"; 32 completions of 24
  # bytes give a mean whose spread is about 0.01-0.03, and 12 steps at this
  # learning rate take it past 0.4: a rise of 0.2 is no accident.
  before, after = (float(x) for x in re.search(r"before (\S+) after (\S+)", text).groups())
  assert after > before + 0.2, text
  assert "after the first step: 0" in text
  assert "compiles on waking and rolling out again: 0" in text


@pytest.mark.slow
def test_serve_notebook_runs_the_tiny_model_on_cpu(monkeypatch):
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  text, images = _run("serve.ipynb", monkeypatch, parameters=f'MODEL = "tiny"\nPORT = {port}')
  assert f"{VERSIONS}, model tiny" in text
  assert CPU_KERNELS in text  # the server's log
  assert len(re.findall(r"^'[A-Z]+, n\. ' -> .* \((length|stop)\)$", text, re.M)) == 12
  peak = re.search(r"12 requests in [\d.]+ s; KV cache usage: peak (\d+)%, at the end 0%", text)
  assert peak and int(peak[1]) >= 25, text  # 40 blocks, 8 requests of up to 7 each
  assert "server exited with 0" in text
  assert images == 1
