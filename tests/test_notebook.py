"""Executes colab/quickstart.ipynb top to bottom on CPU, skipping the install cell."""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = pathlib.Path(__file__).parent.parent / "colab" / "quickstart.ipynb"


def test_quickstart_notebook_runs(monkeypatch):
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  install = [cell for cell in notebook.cells
             if "install" in cell.metadata.get("tags", [])]
  assert len(install) == 1 and "pip install" in install[0].source
  notebook.cells = [cell for cell in notebook.cells if cell not in install]
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("MPLBACKEND", raising=False)
  monkeypatch.setenv("PYTHONPATH", str(NOTEBOOK.parent.parent))
  client = nbclient.NotebookClient(notebook, timeout=180, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()
  outputs = "".join(output.get("text", "") for cell in notebook.cells
                    if cell.cell_type == "code" for output in cell.outputs)
  assert "copy-on-write plan: [(" in outputs
  # Full blocks of 4: 3 + 3 + 4 lookups; the second and third prompt hit
  # the 3 system-prefix blocks: 6 hits of 10.
  assert "prefix-cache hit rate 60%" in outputs
  assert "GenerationStats(" in outputs
  images = sum("image/png" in output.get("data", {}) for cell in notebook.cells
               if cell.cell_type == "code" for output in cell.outputs)
  assert images == 4   # one per show() call
