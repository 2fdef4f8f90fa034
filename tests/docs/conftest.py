"""The documentation site, built once per session (``make docs-test`` runs these tests).

Building executes the notebooks (cached in ``docs/_build/.jupyter_cache``), minutes on a cold
cache, so ``make test`` leaves these tests out: they skip unless ``BAYESFUSE_DOCS_TESTS=1``,
which ``make docs-test`` sets.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
HTML = DOCS / "_build" / "html"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("BAYESFUSE_DOCS_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="the documentation tests run with `make docs-test` (BAYESFUSE_DOCS_TESTS=1)")
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def site() -> Path:
    """The built site: ``sphinx -W`` (warnings are errors) into ``docs/_build/html``, as ``make docs``."""
    pytest.importorskip("sphinx", reason="needs the docs extra: pip install -e '.[docs]'")
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(HTML)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, f"sphinx -W failed:\n{proc.stderr[-5000:]}"
    return HTML
