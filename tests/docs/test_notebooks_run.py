"""Every notebook runs top to bottom (with CI=1: small sizes): ``make docs-test``."""

import nbformat
import pytest
from nbclient import NotebookClient

from tests.test_notebooks import NOTEBOOKS, missing


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    if reason := missing(path):
        pytest.skip(reason)
    monkeypatch.setenv("CI", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
