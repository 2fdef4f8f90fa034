"""The Python blocks of README.md and of the user guide (docs/guide/*.md), and how a test runs one.

Blocks are run as written, in a fresh interpreter, except for the sizes in ``SMALL``: the
documented switch that keeps the suite fast (fewer epochs and samples; each replacement must
match, so an edit that drops one is noticed). A block that needs an optional extra is skipped
without it. ``tests/test_readme.py`` runs the README's blocks (``make test``);
``tests/docs/test_guide_blocks.py`` runs the guide's (``make docs-test``).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The user guide's (MyST) pages.
GUIDE = sorted((ROOT / "docs" / "guide").glob("*.md"))

#: (text in a block, what the suite runs instead): training lengths and sample counts only.
SMALL = {
    "TrainConfig(hidden=(100,), epochs=10)": "TrainConfig(hidden=(100,), epochs=1)",
    "hidden=150, config=BNNConfig(epochs=200, seed=j)": "hidden=20, config=BNNConfig(epochs=2, seed=j)",
    "num_samples=100": "num_samples=5",
    'arch="cnn", channels=(16, 32), hidden=(64,), epochs=10)': 'arch="cnn", channels=(4, 8), hidden=(16,), epochs=1)',
    "replace(cfg, epochs=5)": "replace(cfg, epochs=1)",
}
NEEDS = {"flwr": "flower"}


def blocks(pages) -> list[tuple[str, str]]:
    """(where, code) of every ```python block of ``pages``; where is ``PAGE:N``."""
    found = []
    for page in pages:
        code = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
        found += [(f"{page.relative_to(ROOT)}:{i + 1}", c) for i, c in enumerate(code)]
    return found


def run_block(where: str, code: str, tmp_path: Path) -> None:
    """Run one block in a fresh interpreter in ``tmp_path`` at the ``SMALL`` sizes; fail with its stderr."""
    for module, extra in NEEDS.items():
        if re.search(rf"^\s*(from|import) {module}\b", code, flags=re.M) and importlib.util.find_spec(module) is None:
            pytest.skip(f"needs the {extra} extra")
    for text, small in SMALL.items():
        code = code.replace(text, small)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"MPLBACKEND": "Agg", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, f"{where}:\n{code}\n--- stderr ---\n{proc.stderr[-3000:]}"
