"""The notebooks are committed without outputs; ``tests/docs/test_notebooks_run.py`` runs each top to
bottom with CI=1 (small sizes) in ``make docs-test``, which also executes them for the site."""

import importlib.util
from pathlib import Path

import nbformat

from bayesfuse.data.wheel_data import DATA_FILES, data_dir

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


# notebook -> (files of the data directory, optional modules) it needs beyond the package's dependencies
NEEDS = {"05_topics_and_hmms": (sorted(DATA_FILES), ["hmmlearn"])}


def missing(path):
    """Why the notebook at ``path`` cannot run here (its data or an optional module is missing), or None."""
    files, modules = NEEDS.get(path.stem, ((), ()))
    absent = [f for f in files if not (data_dir() / f).is_file()]
    if absent:
        return f"{', '.join(absent)} not in {data_dir()}: `make data`"
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if absent:
        return f"{', '.join(absent)} not installed: pip install 'bayesfuse[apps]'"
    return None


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


def test_notebooks_are_committed_without_outputs():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
            f"{path.name}: commit it without outputs"
        )
