import os
import stat

import pytest

from bayesfuse._io import atomic_write_bytes, atomic_write_files, atomic_write_text, prepare_output_dir


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
