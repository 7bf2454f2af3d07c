"""Executes the notebooks in colab/ top to bottom on CPU, skipping the install cell."""

import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

COLAB = pathlib.Path(__file__).parent.parent / "colab"


def _run(name: str, monkeypatch):
  """Executes `name`; returns (printed text, number of images)."""
  notebook = nbformat.read(COLAB / name, as_version=4)
  install = [cell for cell in notebook.cells if "install" in cell.metadata.get("tags", [])]
  assert len(install) == 1 and "pip install" in install[0].source
  notebook.cells = [cell for cell in notebook.cells if cell not in install]
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("MPLBACKEND", raising=False)
  monkeypatch.setenv("PYTHONPATH", str(COLAB.parent))
  client = nbclient.NotebookClient(
    notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(COLAB)}}
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
  assert "finish: " in text
  assert "beam 0: " in text and "beam 2: " in text
  assert "blocks free at the end 24 of 24" in text
  assert images == 1


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
  assert images == 1
