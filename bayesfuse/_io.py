"""Safe file output: atomic writes that never replace a user's file by accident."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_files", "prepare_output_dir"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stage(path: Path, data: bytes) -> Path:
    """``data`` in a synced temporary file beside ``path``, with the permissions the user's umask
    gives new files (``mkstemp`` alone would make it 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _commit(tmp: Path, path: Path, overwrite: bool) -> None:
    """Move ``tmp`` to ``path``; without ``overwrite`` atomically refuse an existing ``path``
    (a hard link fails if the name exists, so two writers cannot both win)."""
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory")
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"{path} already exists; refusing to overwrite it (pass overwrite=True)") from None
    except OSError:  # a file system without hard links: check, then rename
        if path.exists():
            raise FileExistsError(f"{path} already exists; refusing to overwrite it (pass overwrite=True)") from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def atomic_write_files(files: Sequence[tuple[str | os.PathLike, bytes]], *, overwrite: bool = False) -> list[Path]:
    """Write several files as one unit: all of them, or (without ``overwrite``) none.

    Every file is first written and synced to a temporary file beside its target, so a full disk
    or any other write error changes nothing. Then, while holding a lock on each target's
    directory (so that two processes writing the same outputs do not interleave), the files are
    moved into place in order. Without ``overwrite`` an existing target (even one created by
    another process a moment before) stops the commit, and the files this call already placed
    are removed again: never a file another process wrote.

    Raises
    ------
    FileExistsError
        If a target exists and ``overwrite`` is false.
    IsADirectoryError
        If a target is a directory.
    """
    targets = [Path(p) for p, _ in files]
    for p in targets:
        if p.is_dir():
            raise IsADirectoryError(f"{p} is a directory")
        if p.exists() and not overwrite:
            raise FileExistsError(f"{p} already exists; refusing to overwrite it (pass overwrite=True)")
    staged: list[Path] = []
    try:
        for p, (_, data) in zip(targets, files):
            staged.append(_stage(p, data))
        with _locked({p.parent for p in targets}):
            placed: list[tuple[Path, int]] = []
            try:
                for tmp, p in zip(staged, targets):
                    inode = tmp.stat().st_ino
                    _commit(tmp, p, overwrite)
                    placed.append((p, inode))
            except BaseException:
                if not overwrite:
                    for p, inode in placed:
                        if p.exists() and p.stat().st_ino == inode:
                            p.unlink()
                raise
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
    return targets


@contextmanager
def _locked(directories) -> Iterator[None]:
    """Exclusive ``flock`` on each directory (where the platform has it), in a fixed order."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fds = []
    try:
        for d in sorted(str(Path(x).resolve()) for x in directories):
            fd = os.open(d, os.O_RDONLY)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # closing releases the lock


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write_files` with one file).

    A reader never sees a half-written file and a crash never leaves one in place of ``path``;
    the file gets the permissions the user's umask gives new files.

    Raises
    ------
    FileExistsError
        If ``path`` exists and ``overwrite`` is false.
    """
    return atomic_write_files([(path, data)], overwrite=overwrite)[0]


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
