import pytest

from bayesfuse._io import atomic_write_text, prepare_output_dir


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
