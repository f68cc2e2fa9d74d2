"""The notebooks in notebooks/ run from a clean kernel (CPU, deterministic) and assert their own
key numbers against independent references (closed forms, finite differences, a grid search);
the committed copies keep their outputs, so they render with their plots."""

import os
import pathlib
import re
import sys

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


# Each notebook and the least number of numbers it asserts (against dp-accounting,
# prv-accountant, closed forms, scipy root finds, central differences, the digests' values).
ASSERTED = {"accountants.ipynb": 20, "calibration.ipynb": 8, "group_privacy.ipynb": 10,
            "individual_accounting.ipynb": 10}


def test_each_notebook_asserts_its_key_numbers():
  """The four notebooks are there, and each asserts its key numbers (a notebook whose asserts
  were dropped, or a new one without any, fails here before it is run)."""
  assert {path.name for path in NOTEBOOKS} == set(ASSERTED)
  for path in NOTEBOOKS:
    code = "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells
                     if cell.cell_type == "code")
    asserts = len(re.findall(r"^\s*assert\s+(?!True\b|1\b|not False\b)\S", code, re.M))
    assert asserts >= ASSERTED[path.name], f"{path.name} asserts {asserts} numbers"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
  # The kernel is this interpreter's: its directory first on PATH (a kernelspec names "python").
  monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
  monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws the figures
  notebook = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()  # raises CellExecutionError on any failing cell or assert
  assert _images(notebook) == _images(nbformat.read(path, as_version=4))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_shows_its_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  code = [cell for cell in notebook.cells if cell.cell_type == "code"]
  assert all(cell.get("execution_count") for cell in code), "commit the notebook executed"
  assert not [o for cell in code for o in cell.outputs if o.output_type == "error"]
  shows = sum("plt.show()" in cell.source for cell in code)
  assert _images(notebook) == shows > 0


def _images(notebook):
  """How many PNG figures the notebook's outputs hold."""
  return sum("image/png" in output.get("data", {}) for cell in notebook.cells
             if cell.cell_type == "code" for output in cell.outputs)
