"""Execute every notebook in ``notebooks/`` top to bottom with nbclient; any cell error fails the test.

Each notebook runs in a fresh ``python3`` kernel with the notebooks directory as its working
directory, 300 s per cell. If no ``python3`` kernel spec is installed, one is registered for
this interpreter (``python -m ipykernel install --user``).
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the test extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="needs the test extra: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="needs the test extra: pip install -e '.[test]'")

NB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NB_DIR, "*.ipynb")))
KERNEL = "python3"
CELL_TIMEOUT_S = 300


def _ensure_kernel() -> None:
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec(KERNEL)
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user", "--name", KERNEL],
                       check=True, capture_output=True)


def test_notebooks_found():
    assert NOTEBOOKS, f"no notebooks in {NB_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs(path):
    _ensure_kernel()
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name=KERNEL,
                                     resources={"metadata": {"path": NB_DIR}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:  # the message holds the cell's traceback
        pytest.fail(f"{os.path.basename(path)} failed:\n{e}", pytrace=False)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{os.path.basename(path)}: error outputs {errors}"
