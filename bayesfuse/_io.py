"""Safe file output: atomic writes that never replace a user's file by accident and survive a kill.

Every file is first written and synced to a temporary file ``.NAME.<pid>-<host>.<random>.tmp``
beside its target (``<host>`` is a short hash of the host name). A commit of one or more files
runs under an ``flock`` on their directories and is recorded in a journal ``.NAME.bayesfuse-commit``
beside the first target: written atomically and synced before the first file is placed, removed
after the last one is. A process killed at any point leaves either temporary files only, or a
journal whose staged files are all synced; the next write to those targets (or :func:`recover`)
finishes that commit (every staged file is still there) or undoes it (one is missing), and
removes the temporary files of writers that no longer run. Holding the directory lock is what
proves a journal's writer dead: a writer holds it for as long as its journal exists. So the
files of one call are seen all old or all new, never a mix of two calls.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import numbers
import os
import re
import secrets
import socket
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

__all__ = [
    "jsonable",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_files",
    "check_output_dir",
    "check_output_file",
    "check_writable",
    "prepare_output_dir",
    "recover",
    "JOURNAL_SUFFIX",
]

#: Suffix of the commit journals (``.NAME.bayesfuse-commit`` beside a commit's first target).
JOURNAL_SUFFIX = ".bayesfuse-commit"
_JOURNAL_FORMAT = "bayesfuse-commit/1"
_HOST = socket.gethostname()
#: Temporary files carry this tag so that only this host's dead writers are judged by pid.
_HOST_TAG = hashlib.sha1(_HOST.encode("utf-8", "surrogateescape")).hexdigest()[:8]
_MAX_STEM_BYTES = 160  # leaves room for the pid, host tag and random part within NAME_MAX (255)


# --------------------------------------------------------------------------- checks


def check_writable(path: str | os.PathLike) -> Path:
    """Check that files can be created in the directory ``path``, or that it can be created.

    A missing directory is fine (it is created when the files are written) if its nearest
    existing ancestor is a directory this process can write to and enter.

    Parameters
    ----------
    path : path
        The output directory.

    Returns
    -------
    Path
        The nearest existing ancestor of ``path`` (``path`` itself when it exists).

    Raises
    ------
    NotADirectoryError
        The nearest existing ancestor is a file.
    PermissionError
        The ancestor cannot be written to (``errno.EACCES``) or lies on a read-only file system
        (``errno.EROFS``); ``filename`` names it.
    """
    existing = _nearest_existing(Path(os.path.abspath(path)))
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory, so no output can be written under it", str(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        if _on_read_only_fs(existing):
            raise PermissionError(errno.EROFS, os.strerror(errno.EROFS), str(existing))
        raise PermissionError(
            errno.EACCES, "Permission denied: no files can be created in this directory", str(existing)
        )
    return existing


def _nearest_existing(path: Path) -> Path:
    while not (path.exists() or path.is_symlink()) and path != path.parent:
        path = path.parent
    return path


def _on_read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & getattr(os, "ST_RDONLY", 1))
    except (OSError, AttributeError):  # pragma: no cover - no statvfs
        return False


def jsonable(value):
    """``value`` with NumPy arrays as lists, NumPy scalars as Python numbers and paths as
    strings, through nested dicts, lists and tuples: ready for ``json.dumps``."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # NumPy arrays and scalars
        return value.tolist()
    return value


def finite_json(value):
    """``value`` as JSON in one pass, ready for ``json.dumps(..., allow_nan=False)``: mappings with
    string keys, arrays, tuples and sets as lists, NumPy scalars as Python numbers, numbers that
    are not finite as the strings ``"inf"``, ``"-inf"``, ``"nan"`` (FedMA's noise variance of a
    constant pixel is ``inf``; JSON has none), paths as strings, anything else as its ``str``."""
    if isinstance(value, Mapping):
        return {str(k): finite_json(v) for k, v in value.items()}
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # NumPy arrays and scalars
        return finite_json(value.tolist())
    if isinstance(value, (list, tuple, set, frozenset)):
        return [finite_json(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def check_output_dir(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Check, without creating anything, that ``path`` can become an output directory.

    Raises
    ------
    NotADirectoryError
        ``path`` (or an ancestor) is a file.
    FileExistsError
        ``path`` is a non-empty directory and ``force`` is false.
    PermissionError
        See :func:`check_writable`.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"output path {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise FileExistsError(
            f"output directory {path} exists and is not empty; choose another one "
            "or replace the files written there with force=True (--force on the command line)"
        )
    check_writable(path)
    return path


def check_output_file(path: str | os.PathLike, example: str = "fused.pt") -> Path:
    """Refuse an existing directory as an output file's name (``IsADirectoryError``), suggesting
    ``example`` inside it."""
    path = Path(path)
    if os.fspath(path) not in ("", ".") and path.is_dir():
        raise IsADirectoryError(
            f"the output {os.fspath(path)} is a directory; give a file name for it, such as {path / example}"
        )
    return path


def prepare_output_dir(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Create an output directory, refusing a non-empty one unless ``force``.

    With ``force`` the directory is reused: files written there replace same-named files
    (atomically); other files in it are left alone. See :func:`check_output_dir` for the errors.
    """
    path = check_output_dir(path, force=force)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_targets(targets: Sequence[Path], overwrite: bool) -> None:
    for p in targets:
        if p.is_dir():
            raise IsADirectoryError(f"{p} is a directory")
        if p.exists() and not overwrite:
            raise FileExistsError(f"{p} already exists; refusing to overwrite it (pass overwrite=True)")
    for directory in {p.parent for p in targets}:
        check_writable(directory)


# --------------------------------------------------------------------------- temporary files


def _umask() -> int:
    """The process's umask, read where the system shows it (Linux: ``/proc/self/status``) rather
    than set and restored, which would leave other threads creating files under umask 0 a moment."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0)  # pragma: no cover - systems without /proc
    os.umask(mask)
    return mask


def _tmp_stem(name: str) -> str:
    """``name``, or a shortened unique form of it when a temporary name would be too long."""
    if len(os.fsencode(name)) <= _MAX_STEM_BYTES:
        return name
    return name[:40] + "~" + hashlib.sha1(os.fsencode(name)).hexdigest()[:12]


def _tmp_prefix(name: str) -> str:
    return f".{_tmp_stem(name)}.{os.getpid()}-{_HOST_TAG}."


def _tmp_pattern(name: str) -> re.Pattern[str]:
    """Names of the temporary files of target ``name``; groups: pid, host tag."""
    return re.compile(rf"\.{re.escape(_tmp_stem(name))}\.(\d+)-([0-9a-f]{{8}})\.[a-z0-9_]+\.tmp")


def _naming(err: OSError, path: Path) -> OSError:
    """``err`` about a temporary file, told about its target ``path`` instead."""
    if err.errno is None:
        return err
    return OSError(err.errno, err.strerror, str(path))


def _write_synced(fd: int, data: bytes) -> None:
    """Write ``data`` to the new file ``fd`` with the umask's permissions, sync and close it."""
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o666 & ~_umask())  # mkstemp alone would give 0600
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _stage(path: Path, data: bytes) -> Path:
    """``data`` in a synced temporary file beside ``path``; errors name ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=_tmp_prefix(path.name), suffix=".tmp")
    except OSError as err:
        raise _naming(err, path) from err
    try:
        _write_synced(fd, data)
    except OSError as err:
        Path(name).unlink(missing_ok=True)
        raise _naming(err, path) from err
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def _missing_dirs(directories: Iterable[Path]) -> list[Path]:
    """The directories (and ancestors) that do not exist yet, deepest first."""
    missing: set[Path] = set()
    for d in directories:
        while not _lexists(d) and d != d.parent:
            missing.add(d)
            d = d.parent
    return sorted(missing, key=lambda d: len(Path(os.path.abspath(d)).parts), reverse=True)


def _remove_empty_dirs(directories: Sequence[Path]) -> None:
    """Remove ``directories`` (deepest first) where still empty: a failed write leaves none."""
    for d in directories:
        with contextlib.suppress(OSError):
            d.rmdir()


def _discard(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a process we may not signal counts)."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _remove_stale_tmps(targets: Sequence[Path]) -> None:
    """Remove temporary files of ``targets`` (and of their journals) left by dead writers."""
    by_dir: dict[Path, set[str]] = {}
    for t in targets:
        by_dir.setdefault(t.parent, set()).update((t.name, _journal_path(t).name))
    for directory, names in by_dir.items():
        patterns = [_tmp_pattern(n) for n in names]
        with contextlib.suppress(FileNotFoundError), os.scandir(directory) as it:
            for entry in it:
                if any(_is_stale(p.fullmatch(entry.name)) for p in patterns):
                    _discard(Path(entry.path))


def _is_stale(match: re.Match[str] | None) -> bool:
    return match is not None and match.group(2) == _HOST_TAG and not _alive(int(match.group(1)))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - unreadable directory
        return
    try:
        os.fsync(fd)
    except OSError as err:  # some file systems cannot sync a directory
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- journal


@dataclass(frozen=True)
class _Entry:
    """One file of a commit: staged ``tmp`` (inode ``inode``) goes to ``target``; or, without
    ``tmp``, the file ``target`` (inode ``inode``) is removed."""

    tmp: Path | None
    target: Path
    inode: int
    overwrite: bool
    existed: bool
    backup: Path | None  # a hard link to the replaced (or removed) file, to undo the commit

    def placed(self) -> bool:
        if self.tmp is None:
            return _inode(self.target) != self.inode
        return _inode(self.target) == self.inode

    def staged(self) -> bool:
        return self.tmp is not None and _inode(self.tmp) == self.inode

    def placeable(self) -> bool:
        if self.tmp is None:
            return True
        return self.staged() and (self.overwrite or not _lexists(self.target))

    def place(self) -> None:
        if self.tmp is None:
            self.target.unlink(missing_ok=True)
        else:
            _commit(self.tmp, self.target, self.overwrite)


def _inode(path: Path) -> int | None:
    try:
        return os.lstat(path).st_ino
    except (FileNotFoundError, NotADirectoryError):
        return None


def _lexists(path: Path) -> bool:
    return os.path.lexists(path)


def _journal_path(first_target: Path) -> Path:
    return first_target.parent / f".{_tmp_stem(first_target.name)}{JOURNAL_SUFFIX}"


def _journals_in(directory: Path) -> list[Path]:
    try:
        with os.scandir(directory) as it:
            return sorted(Path(e.path) for e in it if e.name.startswith(".") and e.name.endswith(JOURNAL_SUFFIX))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _backup(target: Path) -> Path | None:
    """A hard link to the file at ``target`` beside it; None without one (or without hard links)."""
    if not _lexists(target):
        return None
    for _ in range(100):
        candidate = target.parent / f"{_tmp_prefix(target.name)}{secrets.token_hex(4)}.tmp"
        try:
            os.link(target, candidate, follow_symlinks=False)
        except FileExistsError:
            continue
        except OSError:  # a file system without hard links: an overwrite cannot be undone there
            return None
        return candidate
    raise FileExistsError(f"cannot find a free temporary name beside {target}")  # pragma: no cover


def _new_entry(tmp: Path, target: Path, overwrite: bool) -> _Entry:
    existed = overwrite and _lexists(target)
    return _Entry(tmp, target, tmp.stat().st_ino, overwrite, existed, _backup(target) if existed else None)


def _removal(target: Path) -> _Entry:
    """The entry that removes the existing file ``target``, with a hard link to put it back."""
    return _Entry(None, target, os.lstat(target).st_ino, True, True, _backup(target))


def _write_journal(journal: Path, entries: Sequence[_Entry]) -> None:
    """Record ``entries`` in ``journal``, atomically and synced."""
    base = journal.parent

    def rel(p: Path | None) -> str | None:
        return None if p is None else os.path.relpath(p, base)

    record = {
        "format": _JOURNAL_FORMAT,
        "pid": os.getpid(),
        "host": _HOST,
        "entries": [
            {
                "tmp": rel(e.tmp),
                "target": rel(e.target),
                "inode": e.inode,
                "overwrite": e.overwrite,
                "existed": e.existed,
                "backup": rel(e.backup),
            }
            for e in entries
        ],
    }
    tmp = _stage(journal, (json.dumps(record, indent=1) + "\n").encode("utf-8"))
    try:
        os.replace(tmp, journal)
    except BaseException:
        _discard(tmp)
        raise
    _fsync_dir(base)


def _read_journal(journal: Path) -> list[_Entry]:
    base = journal.parent
    try:
        record = json.loads(journal.read_text(encoding="utf-8"))
        if record.get("format") != _JOURNAL_FORMAT:
            raise ValueError(f"unknown format {record.get('format')!r}")
        return [
            _Entry(
                None if e["tmp"] is None else base / e["tmp"],
                base / e["target"],
                int(e["inode"]),
                bool(e["overwrite"]),
                bool(e["existed"]),
                None if e["backup"] is None else base / e["backup"],
            )
            for e in record["entries"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"{journal}: unreadable commit journal of an interrupted write ({err}); check the "
            "files it names, then remove it"
        ) from None


def _remove_journal(journal: Path) -> None:
    journal.unlink()
    _fsync_dir(journal.parent)


def _fsync_dirs(entries: Sequence[_Entry]) -> None:
    for directory in {e.target.parent for e in entries}:
        _fsync_dir(directory)


# --------------------------------------------------------------------------- commit and recovery


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


def _roll_forward(entries: Sequence[_Entry]) -> None:
    """Place every entry not placed yet (all are placeable), then drop leftovers."""
    for e in entries:
        if not e.placed():
            e.place()
    for e in entries:
        if e.staged():
            _discard(e.tmp)
        _discard(e.backup)


def _roll_back(entries: Sequence[_Entry]) -> None:
    """Undo the placed entries: restore the replaced file, or remove a file that was new."""
    for e in reversed(entries):
        if e.placed():
            if e.backup is not None and _lexists(e.backup):
                os.replace(e.backup, e.target)
            elif not e.existed:
                e.target.unlink()
        if e.staged():
            _discard(e.tmp)
        _discard(e.backup)


def _resolve_journal(journal: Path, held: set[str]) -> None:
    """Finish or undo the commit recorded in ``journal`` (its writer is dead: we hold its locks)."""
    entries = _read_journal(journal)
    outside = {os.path.realpath(e.target.parent) for e in entries} - held
    if outside:
        raise RuntimeError(
            f"{journal}: an interrupted write also wrote to {', '.join(sorted(outside))} "
            "while this one started; run it again"
        )
    if all(e.placed() or e.placeable() for e in entries):
        _roll_forward(entries)
    else:
        _roll_back(entries)
    _fsync_dirs(entries)
    _remove_journal(journal)


def _lock_set(directories: Iterable[Path]) -> set[Path]:
    """Existing ``directories`` plus those that their interrupted commits' journals name."""
    dirs = {d for d in directories if d.is_dir()}
    for d in list(dirs):
        for journal in _journals_in(d):
            with contextlib.suppress(ValueError, OSError):
                dirs.update(e.target.parent for e in _read_journal(journal) if e.target.parent.is_dir())
    return dirs


def _recover_locked(targets: Sequence[Path], held: set[str]) -> None:
    for directory in sorted({t.parent for t in targets}):
        for journal in _journals_in(directory):
            _resolve_journal(journal, held)
    _remove_stale_tmps(targets)


def recover(paths: Iterable[str | os.PathLike]) -> None:
    """Repair what killed writers left at ``paths``: finish or undo interrupted commits.

    Under the locks of the paths' directories, every commit journal found there is resolved
    (its writer is dead, since it would hold the lock): rolled forward when all its staged
    files are still there, rolled back otherwise. Then temporary files of ``paths`` whose
    writer (a process of this host) no longer runs are removed. :func:`atomic_write_files`
    calls this first; call it before checking whether outputs exist.

    Raises
    ------
    ValueError
        A journal cannot be read.
    OSError
        A file cannot be placed, restored or removed.
    """
    targets = [Path(p) for p in paths]
    directories = _lock_set(t.parent for t in targets)
    if not directories:
        return
    with _locked(directories) as held:
        _recover_locked([t for t in targets if t.parent in directories], held)


def _commit_all(staged: Sequence[Path], targets: Sequence[Path], overwrite: bool, remove: Sequence[Path] = ()) -> None:
    """Journal, place and un-journal ``staged`` at ``targets``, and remove the files ``remove``
    that exist (the caller holds the locks).

    One file needs no journal: a rename or hard link is atomic by itself.
    """
    remove = [p for p in remove if _lexists(p)]
    if len(targets) == 1 and not remove:
        _commit(staged[0], targets[0], overwrite)
        _fsync_dir(targets[0].parent)
        return
    journal = _journal_path(targets[0])
    entries: list[_Entry] = []
    try:
        for tmp, p in zip(staged, targets):
            entries.append(_new_entry(tmp, p, overwrite))
        for p in remove:
            entries.append(_removal(p))
        _write_journal(journal, entries)
    except BaseException:
        for e in entries:
            _discard(e.backup)
        raise
    try:
        for e in entries:
            e.place()
        _fsync_dirs(entries)
    except BaseException:
        with contextlib.suppress(OSError):  # what cannot be undone now, the next write undoes
            _roll_back(entries)
            _fsync_dirs(entries)
            _remove_journal(journal)
        raise
    _remove_journal(journal)
    for e in entries:
        _discard(e.backup)


def atomic_write_files(
    files: Sequence[tuple[str | os.PathLike, bytes]],
    *,
    overwrite: bool = False,
    remove: Sequence[str | os.PathLike] = (),
) -> list[Path]:
    """Write several files as one unit: all of them, or none.

    Every file is first written and synced to a temporary file beside its target, so a full disk
    or any other write error changes nothing. Then, while holding a lock on each target's
    directory (so that two processes writing the same outputs do not interleave), the commit is
    journaled and the files are moved into place in order. Without ``overwrite`` an existing
    target (even one created by another process a moment before) stops the commit, and the files
    this call already placed are removed again: never a file another process wrote. With
    ``overwrite``, a commit that fails half-way puts the replaced files back. A commit
    interrupted by a kill is finished or undone by the next call for these targets (see
    :func:`recover`), which also removes dead writers' temporary files. The files ``remove``
    names that exist (another fusion's files that no longer belong beside the new ones) are
    removed in the same commit: with the new files, or not at all.

    Raises
    ------
    FileExistsError
        If a target exists and ``overwrite`` is false.
    IsADirectoryError
        If a target is a directory.
    PermissionError
        If a target's directory cannot be written (see :func:`check_writable`).
    OSError
        Any other write error (a full disk, a file-size limit), naming the target.
    """
    targets = [Path(p) for p, _ in files]
    removed = [Path(p) for p in remove]
    if not targets:
        return []
    if {os.path.realpath(p) for p in removed} & {os.path.realpath(p) for p in targets}:
        raise ValueError("a file cannot be both written and removed in one commit")
    recover(targets + removed)
    _check_targets(targets, overwrite)
    created = _missing_dirs(p.parent for p in targets)
    staged: list[Path] = []
    try:
        for p, (_, data) in zip(targets, files):
            staged.append(_stage(p, data))
        with _locked(_lock_set(p.parent for p in targets + removed)) as held:
            _recover_locked(targets + removed, held)
            _commit_all(staged, targets, overwrite, removed)
    except BaseException:
        _remove_empty_dirs(created)
        raise
    finally:
        for tmp in staged:
            _discard(tmp)
    return targets


@contextmanager
def _locked(directories: Iterable[Path]) -> Iterator[set[str]]:
    """Exclusive ``flock`` on each directory (where the platform has it), in a fixed order;
    yields the real paths of the directories held."""
    held = sorted({os.path.realpath(d) for d in directories})
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield set(held)
        return
    fds = []
    try:
        for d in held:
            fd = os.open(d, os.O_RDONLY)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield set(held)
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
