"""Execute the notebooks at full size and save the figure of each cell tagged "docs-figure".

Usage: python docs/make_figures.py [NOTEBOOK_STEM ...]   (or `make docs-figures`); writes
docs/<notebook>.png for every notebook, or for the named ones.
"""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bayesfuse._io import atomic_write_bytes  # noqa: E402


def main() -> int:
    env_ci = os.environ.pop("CI", None)  # full sizes, not the smoke test
    try:
        wanted = set(sys.argv[1:])
        for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
            if wanted and path.stem not in wanted:
                continue
            nb = nbformat.read(path, as_version=4)
            NotebookClient(
                nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
            ).execute()
            tagged = [c for c in nb.cells if "docs-figure" in c.get("metadata", {}).get("tags", [])]
            images = [
                o["data"]["image/png"] for c in tagged for o in c.get("outputs", []) if "image/png" in o.get("data", {})
            ]
            if not images:
                print(f"{path.name}: no tagged figure", file=sys.stderr)
                return 1
            out = atomic_write_bytes(ROOT / "docs" / f"{path.stem}.png", base64.b64decode(images[0]), overwrite=True)
            print(f"wrote {out.relative_to(ROOT)}")
    finally:
        if env_ci is not None:
            os.environ["CI"] = env_ci
    return 0


if __name__ == "__main__":
    sys.exit(main())
