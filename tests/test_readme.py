"""Every Python block of README.md and of the user guide (docs/guide/*.md) runs on its own, in a
fresh interpreter.

Blocks are run as written except for the sizes in ``SMALL``: the documented switch that keeps
the suite fast (fewer epochs and samples; each replacement must match, so a README edit that
drops one is noticed). A block that needs an optional extra is skipped without it.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The pages whose Python blocks run: the README and the user guide's (MyST) pages.
PAGES = [README, *sorted((ROOT / "docs" / "guide").glob("*.md"))]

#: (text in a block, what the suite runs instead): training lengths and sample counts only.
SMALL = {
    "TrainConfig(hidden=(100,), epochs=10)": "TrainConfig(hidden=(100,), epochs=1)",
    "hidden=150, config=BNNConfig(epochs=200, seed=j)": "hidden=20, config=BNNConfig(epochs=2, seed=j)",
    "num_samples=100": "num_samples=5",
    'arch="cnn", channels=(16, 32), hidden=(64,), epochs=10)': 'arch="cnn", channels=(4, 8), hidden=(16,), epochs=1)',
    "replace(cfg, epochs=5)": "replace(cfg, epochs=1)",
}
NEEDS = {"flwr": "flower"}


def blocks() -> list[tuple[str, str]]:
    """(where, code) of every ```python block of :data:`PAGES`; where is ``PAGE:N``."""
    found = []
    for page in PAGES:
        code = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
        found += [(f"{page.relative_to(ROOT)}:{i + 1}", c) for i, c in enumerate(code)]
    return found


def test_the_readme_and_guide_have_python_blocks_and_every_small_size_is_used():
    text = "".join(code for _, code in blocks())
    assert len(blocks()) >= 7
    assert any(where.startswith("README.md:") for where, _ in blocks()), "the README has no Python example"
    unused = [k for k in SMALL if k not in text]
    assert not unused, f"README and guide no longer contain {unused}: update SMALL in {__file__}"


@pytest.mark.slow
@pytest.mark.parametrize("where,code", blocks(), ids=[where for where, _ in blocks()])
def test_a_readme_block_runs_on_its_own(where, code, tmp_path):
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
