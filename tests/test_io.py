import errno
import os
import re
import stat

import pytest

from bayesfuse._io import (
    JOURNAL_SUFFIX,
    atomic_write_bytes,
    atomic_write_files,
    atomic_write_text,
    check_output_dir,
    check_writable,
    prepare_output_dir,
)


def test_atomic_write_refuses_overwrite_and_leaves_no_temp(tmp_path):
    path = atomic_write_text(tmp_path / "a.txt", "one")
    with pytest.raises(FileExistsError):
        atomic_write_text(path, "two")
    assert path.read_text() == "one"
    atomic_write_text(path, "two", overwrite=True)
    assert path.read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


def test_prepare_output_dir(tmp_path):
    out = prepare_output_dir(tmp_path / "new" / "dir")
    assert out.is_dir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="--force"):
        prepare_output_dir(out)
    assert prepare_output_dir(out, force=True) == out
    assert (out / "keep.txt").read_text() == "user data"
    with pytest.raises(NotADirectoryError):
        prepare_output_dir(out / "keep.txt")


def test_new_files_get_the_permissions_the_umask_gives(tmp_path):
    old = os.umask(0o027)
    try:
        path = atomic_write_bytes(tmp_path / "a.bin", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_files_written_as_one_unit_all_or_none(tmp_path):
    # The second target exists: without overwrite nothing is written, the first target is not
    # left behind, the existing file is untouched and no temporary file remains.
    (tmp_path / "b.json").write_text("theirs")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        atomic_write_files([(tmp_path / "a.pt", b"model"), (tmp_path / "b.json", b"report")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]
    assert (tmp_path / "b.json").read_text() == "theirs"
    atomic_write_files([(tmp_path / "a.pt", b"model"), (tmp_path / "b.json", b"report")], overwrite=True)
    assert (tmp_path / "a.pt").read_bytes() == b"model" and (tmp_path / "b.json").read_bytes() == b"report"


def test_a_commit_that_loses_a_race_removes_only_its_own_files(tmp_path, monkeypatch):
    # Another writer creates the report between the checks and the commit: the hard-link commit
    # refuses it atomically, this call's model is removed again, the other writer's file stays.
    import bayesfuse._io as io_module

    real_commit = io_module._commit

    def racing_commit(tmp, path, overwrite):
        if path.name == "b.json":
            path.write_text("the other run's report")
        return real_commit(tmp, path, overwrite)

    monkeypatch.setattr(io_module, "_commit", racing_commit)
    with pytest.raises(FileExistsError):
        atomic_write_files([(tmp_path / "a.pt", b"model"), (tmp_path / "b.json", b"report")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]
    assert (tmp_path / "b.json").read_text() == "the other run's report"


def test_a_directory_target_is_refused_before_anything_is_replaced(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"old model")
    (tmp_path / "a.pt.json").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write_files([(tmp_path / "a.pt", b"new"), (tmp_path / "a.pt.json", b"{}")], overwrite=True)
    assert (tmp_path / "a.pt").read_bytes() == b"old model"


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_temporary_files_carry_the_writer_pid_and_host(tmp_path, monkeypatch):
    import bayesfuse._io as io_module

    seen = []
    real_commit = io_module._commit
    monkeypatch.setattr(
        io_module, "_commit", lambda tmp, path, overwrite: seen.append(tmp.name) or real_commit(tmp, path, overwrite)
    )
    atomic_write_bytes(tmp_path / "a.pt", b"x")
    assert re.fullmatch(rf"\.a\.pt\.{os.getpid()}-{io_module._HOST_TAG}\.[a-z0-9_]+\.tmp", seen[0])


@pytest.mark.catalogue
def test_stale_temporary_files_of_dead_writers_are_removed_and_only_those(tmp_path):
    import bayesfuse._io as io_module

    dead, host = _dead_pid(), io_module._HOST_TAG
    names = {
        f".a.pt.{dead}-{host}.abcd1234.tmp": False,  # a dead writer of a.pt: removed
        f".a.pt.{os.getpid()}-{host}.abcd1234.tmp": True,  # a live writer
        f".a.pt.{dead}-0123abcd.abcd1234.tmp": True,  # another host: its pid says nothing here
        f".b.pt.{dead}-{host}.abcd1234.tmp": True,  # another target
        ".a.pt.abcd1234.tmp": True,  # no pid
    }
    for name in names:
        (tmp_path / name).write_bytes(b"staged")
    atomic_write_bytes(tmp_path / "a.pt", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a.pt", *(n for n, kept in names.items() if kept)])


@pytest.mark.catalogue
def test_a_commit_that_fails_half_way_puts_the_replaced_files_back(tmp_path, monkeypatch):
    import bayesfuse._io as io_module

    atomic_write_files([(tmp_path / "a.pt", b"old model"), (tmp_path / "a.pt.json", b"old report")])
    real_commit, calls = io_module._commit, []

    def failing_commit(tmp, path, overwrite):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real_commit(tmp, path, overwrite)

    monkeypatch.setattr(io_module, "_commit", failing_commit)
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write_files([(tmp_path / "a.pt", b"new model"), (tmp_path / "a.pt.json", b"new report")], overwrite=True)
    assert (tmp_path / "a.pt").read_bytes() == b"old model" and (tmp_path / "a.pt.json").read_bytes() == b"old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "a.pt.json"]


@pytest.mark.catalogue
def test_files_removed_with_a_commit_go_with_it_or_come_back(tmp_path, monkeypatch):
    import bayesfuse._io as io_module

    def write_old():
        atomic_write_files(
            [
                (tmp_path / "a.pt", b"old model"),
                (tmp_path / "a.pt.json", b"old report"),
                (tmp_path / "a.pt.heads", b"h"),
            ],
            overwrite=True,
        )

    write_old()
    new = [(tmp_path / "a.pt", b"new model"), (tmp_path / "a.pt.json", b"new report")]
    with pytest.raises(ValueError, match="both written and removed"):
        atomic_write_files(new, overwrite=True, remove=[tmp_path / "a.pt"])
    real, calls = io_module._fsync_dirs, []

    def failing(entries):  # every file placed and the side file removed, then the commit fails
        calls.append(1)
        if len(calls) == 1:
            assert not (tmp_path / "a.pt.heads").exists()
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(entries)

    monkeypatch.setattr(io_module, "_fsync_dirs", failing)
    with pytest.raises(OSError, match="Input/output error"):
        atomic_write_files(new, overwrite=True, remove=[tmp_path / "a.pt.heads", tmp_path / "absent"])
    assert [(tmp_path / n).read_bytes() for n in ("a.pt", "a.pt.json", "a.pt.heads")] == [
        b"old model",
        b"old report",
        b"h",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "a.pt.heads", "a.pt.json"]
    monkeypatch.setattr(io_module, "_fsync_dirs", real)
    atomic_write_files(new, overwrite=True, remove=[tmp_path / "a.pt.heads", tmp_path / "absent"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "a.pt.json"]
    assert (tmp_path / "a.pt").read_bytes() == b"new model"
    atomic_write_files(
        [(tmp_path / "b.pt", b"b")], remove=[tmp_path / "a.pt.json"], overwrite=True
    )  # one file and a removal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt"]


@pytest.mark.catalogue
def test_a_write_error_names_the_target_and_removes_the_directories_it_created(tmp_path, monkeypatch):
    import bayesfuse._io as io_module

    def full(fd, data):
        os.close(fd)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io_module, "_write_synced", full)
    target = tmp_path / "new" / "sub" / "a.pt"
    with pytest.raises(OSError) as info:
        atomic_write_bytes(target, b"x")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.catalogue
def test_check_writable(tmp_path, monkeypatch):
    assert check_writable(tmp_path / "new" / "dir") == tmp_path  # created later: its parent is checked
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        check_writable(tmp_path / "file" / "dir")
    assert info.value.filename == str(tmp_path / "file")
    real_access = os.access

    def access(path, mode, **kwargs):
        return False if str(path) == str(tmp_path) else real_access(path, mode, **kwargs)

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(PermissionError) as info:
        check_writable(tmp_path / "new")
    assert info.value.errno == errno.EACCES and info.value.filename == str(tmp_path)
    with pytest.raises(PermissionError):
        atomic_write_bytes(tmp_path / "a.pt", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.catalogue
def test_check_output_dir_creates_nothing(tmp_path):
    assert check_output_dir(tmp_path / "new" / "out") == tmp_path / "new" / "out"
    assert not (tmp_path / "new").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        check_output_dir(tmp_path / "full")
    assert check_output_dir(tmp_path / "full", force=True) == tmp_path / "full"


@pytest.mark.catalogue
def test_an_unreadable_commit_journal_is_reported_not_guessed(tmp_path):
    (tmp_path / f".a.pt{JOURNAL_SUFFIX}").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable commit journal"):
        atomic_write_files([(tmp_path / "a.pt", b"m"), (tmp_path / "a.pt.json", b"r")])
    assert not (tmp_path / "a.pt").exists()
