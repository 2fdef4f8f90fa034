"""Safe file output: atomic writes that never replace a user's file by accident."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_text", "prepare_output_dir"]


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically.

    The bytes go to a temporary file in the same directory, which is flushed, synced and then
    renamed over ``path``, so a reader never sees a half-written file and a crash never leaves
    one behind.

    Raises
    ------
    FileExistsError
        If ``path`` exists and ``overwrite`` is false.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; refusing to overwrite it (pass overwrite=True)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> Path:
    """Atomic UTF-8 text counterpart of :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode("utf-8"), overwrite=overwrite)


def prepare_output_dir(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Create an output directory, refusing a non-empty one unless ``force``.

    With ``force`` the directory is reused: files written there replace same-named files
    (atomically); other files in it are left alone.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output path {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise FileExistsError(
            f"output directory {path} exists and is not empty; choose another one "
            "or replace the files written there with force=True (--force on the command line)"
        )
    path.mkdir(parents=True, exist_ok=True)
    return path
