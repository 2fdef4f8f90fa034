"""A catalogue of environment faults: unreadable inputs, unwritable or full outputs, limits, kills, Ctrl-C.

Each fault ends with one line on stderr and exit status 2 (130 for Ctrl-C), and leaves the
outputs as they were: no temporary files, no journal, never a model of one run beside the report
of another. Faults are injected (monkeypatch) or made for real in a subprocess: a file-size
limit, SIGKILL at each stage of a commit, a small tmpfs (full, or mounted read-only) where
``mount`` is allowed, file permissions (as root, in a process without the capabilities that
ignore them).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import bayesfuse
import bayesfuse._io as io_module
from bayesfuse._io import JOURNAL_SUFFIX, atomic_write_files, recover
from bayesfuse.checkpoints import save_state_dict
from bayesfuse.cli import main
from bayesfuse.data.datasets import load_mnist
from bayesfuse.fuse_files import fuse_files

pytestmark = pytest.mark.catalogue


# --------------------------------------------------------------------------- helpers


def _mlp_sd(seed: int, d: int = 64, h: int = 20, k: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(h, d, generator=g),
        "fc1.bias": torch.randn(h, generator=g),
        "fc2.weight": torch.randn(k, h, generator=g),
        "fc2.bias": torch.randn(k, generator=g),
    }


@pytest.fixture
def models(tmp_path: Path) -> list[Path]:
    """Two small MLP checkpoints (random weights: fusing them takes milliseconds)."""
    d = tmp_path / "in"
    d.mkdir()
    return [save_state_dict(_mlp_sd(s), d / f"m{s}.pt") for s in range(2)]


def _fuse_argv(models: list[Path], out: Path, *extra: str, method: str = "pfnm") -> list[str]:
    return ["fuse", *map(str, models), "--method", method, "--out", str(out), *extra]


def _one_line(err: str) -> str:
    """The single stderr line of a failure (no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _leftovers(directory: Path) -> list[str]:
    """Temporary files and commit journals in ``directory``."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp") or p.name.endswith(JOURNAL_SUFFIX))


def _old_outputs(out: Path) -> tuple[bytes, bytes]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"the old model")
    out.with_name(out.name + ".json").write_bytes(b'{"old": true}')
    return b"the old model", b'{"old": true}'


def _outputs(out: Path) -> tuple[bytes, bytes]:
    return out.read_bytes(), out.with_name(out.name + ".json").read_bytes()


def _python(script: str, *args: str, prefix: tuple[str, ...] = (), timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout
    )


def _without_permission_override() -> tuple[str, ...]:
    """A command prefix under which file permissions apply (root ignores them otherwise)."""
    if os.geteuid() != 0:
        return ()
    prefix = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--")
    if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("running as root without setpriv: file permissions cannot be made to apply")
    return prefix


CLI = "import sys\nfrom bayesfuse.cli import main\nsys.exit(main(sys.argv[1:]))\n"


@pytest.fixture
def tmpfs(tmp_path: Path):
    """``mount(name, size, read_only)``: a small tmpfs of its own (skips where mount is not allowed)."""
    mounted: list[Path] = []

    def mount(name: str, size: str = "128k", read_only: bool = False) -> Path:
        point = tmp_path / name
        point.mkdir()
        options = f"size={size},mode=0755" + (",ro" if read_only else "")
        if (
            shutil.which("mount") is None
            or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True
            ).returncode
        ):
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", str(point)], capture_output=True)


# --------------------------------------------------------------------------- exit status and messages


def test_an_unreadable_model_file_is_one_line(models, tmp_path, capsys, monkeypatch):
    import bayesfuse.fuse_files as ff

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(ff, "read_checkpoint", denied)
    assert main(_fuse_argv(models, tmp_path / "f.pt")) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("bayesfuse fuse: error: ") and str(models[0]) in line and "Permission denied" in line
    assert not (tmp_path / "f.pt").exists()


def test_an_unreadable_model_file_for_real(models, tmp_path):
    prefix = _without_permission_override()
    models[1].chmod(0)
    try:
        proc = _python(CLI, *_fuse_argv(models, tmp_path / "f.pt"), prefix=prefix)
    finally:
        models[1].chmod(0o644)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert str(models[1]) in line and "ermission denied" in line
    assert not (tmp_path / "f.pt").exists() and not _leftovers(tmp_path)


def test_a_file_too_large_for_memory_is_one_line(models, tmp_path, capsys, monkeypatch):
    import bayesfuse.fuse_files as ff

    def too_large(path, *args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(ff, "read_checkpoint", too_large)
    assert main(_fuse_argv(models, tmp_path / "f.pt")) == 2
    assert "out of memory" in _one_line(capsys.readouterr().err)


def test_out_an_existing_directory_with_force_is_one_line(models, tmp_path, capsys):
    (tmp_path / "f.pt").mkdir()
    assert main(_fuse_argv(models, tmp_path / "f.pt", "--force")) == 2
    assert "is a directory" in _one_line(capsys.readouterr().err)
    assert (tmp_path / "f.pt").is_dir() and not (tmp_path / "f.pt.json").exists()


@pytest.mark.parametrize("blocker", ["directory", "name too long"])
def test_a_blocked_report_path_is_one_line_and_writes_nothing(models, tmp_path, capsys, blocker):
    if blocker == "directory":
        out = tmp_path / "f.pt"
        (tmp_path / "f.pt.json").mkdir()
        (tmp_path / "f.pt.json" / "inside").write_text("x")
        expected = "is a directory"
    else:  # the model's name fits NAME_MAX (255 bytes), the report's does not
        out = tmp_path / ("x" * 250 + ".pt")
        expected = "File name too long"
    assert main(_fuse_argv(models, out, "--force")) == 2
    assert expected in _one_line(capsys.readouterr().err)
    assert not out.exists() and not _leftovers(tmp_path)


def test_a_file_size_limit_is_one_line_and_keeps_the_old_outputs(models, tmp_path):
    # RLIMIT_FSIZE below the model's size; SIGXFSZ ignored (as Python does), so write() fails with EFBIG.
    out = tmp_path / "f.pt"
    old = _old_outputs(out)
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n" + CLI
    )
    proc = _python(script, *_fuse_argv(models, out, "--force"))
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert str(out) in line and "File too large" in line and "ulimit -f" in line
    assert _outputs(out) == old and not _leftovers(tmp_path)


def test_ctrl_c_is_one_short_line_and_exit_130(models, tmp_path, capsys, monkeypatch):
    import bayesfuse.fuse_files as ff

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ff, "fuse_states", interrupted)
    assert main(_fuse_argv(models, tmp_path / "f.pt")) == 130
    assert capsys.readouterr().err == "bayesfuse fuse: interrupted\n"
    assert not (tmp_path / "f.pt").exists()


def test_ctrl_c_between_the_two_commits_puts_the_old_outputs_back(models, tmp_path, capsys, monkeypatch):
    out = tmp_path / "f.pt"
    old = _old_outputs(out)
    real_commit, calls = io_module._commit, []

    def commit(tmp, path, overwrite):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_commit(tmp, path, overwrite)

    monkeypatch.setattr(io_module, "_commit", commit)
    assert main(_fuse_argv(models, out, "--force")) == 130
    assert capsys.readouterr().err == "bayesfuse fuse: interrupted\n"
    assert _outputs(out) == old and not _leftovers(tmp_path)


def test_ctrl_c_in_the_demo_leaves_no_output_directory(tmp_path, capsys, monkeypatch):
    import bayesfuse.demo as demo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "train_clients", interrupted)
    assert main(["demo", "--clients", "2", "--epochs", "1", "--quiet", "--out", str(tmp_path / "o")]) == 130
    assert capsys.readouterr().err == "bayesfuse demo: interrupted\n"
    assert not (tmp_path / "o").exists()


def test_programming_errors_keep_their_traceback(models, tmp_path, monkeypatch):
    import bayesfuse.fuse_files as ff

    def bug(*args, **kwargs):
        raise IndexError("a bug")

    monkeypatch.setattr(ff, "fuse_states", bug)
    with pytest.raises(IndexError, match="a bug"):
        main(_fuse_argv(models, tmp_path / "f.pt"))


# --------------------------------------------------------------------------- read-only outputs, found first


def _deny_writes_to(monkeypatch, directory: Path) -> None:
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if Path(path).resolve() == directory.resolve() and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


def test_a_read_only_output_directory_fails_before_any_work(models, tmp_path, capsys, monkeypatch):
    import bayesfuse.fuse_files as ff

    ro = tmp_path / "ro"
    ro.mkdir()
    _deny_writes_to(monkeypatch, ro)
    read = []
    monkeypatch.setattr(ff, "read_checkpoint", lambda *a, **k: read.append(a) or pytest.fail("read the inputs"))
    assert main(_fuse_argv(models, ro / "sub" / "f.pt")) == 2  # a missing directory: its parent is checked
    line = _one_line(capsys.readouterr().err)
    assert str(ro) in line and "Permission denied" in line
    assert not read and list(ro.iterdir()) == []


def test_a_read_only_output_directory_for_real(models, tmp_path):
    prefix = _without_permission_override()
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        proc = _python(CLI, *_fuse_argv(models, ro / "f.pt"), prefix=prefix)
    finally:
        ro.chmod(0o755)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc.stderr)
    assert str(ro) in line and "Permission denied" in line and list(ro.iterdir()) == []


def test_a_read_only_file_system(models, tmpfs, capsys):
    ro = tmpfs("ro", read_only=True)
    assert main(_fuse_argv(models, ro / "f.pt")) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(ro) in line and "Read-only file system" in line


def test_the_demo_checks_a_read_only_output_before_loading_data(tmp_path, capsys, monkeypatch):
    import bayesfuse.demo as demo

    _deny_writes_to(monkeypatch, tmp_path)
    monkeypatch.setattr(demo, "load_dataset", lambda *a, **k: pytest.fail("loaded the data"))
    assert main(["demo", "--quiet", "--out", str(tmp_path / "o")]) == 2
    assert "Permission denied" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- a full disk


def test_a_full_disk_while_staging_is_one_line_and_keeps_the_old_outputs(models, tmp_path, capsys, monkeypatch):
    # ENOSPC on syncing the second staged file (the report): the model is staged already.
    out = tmp_path / "f.pt"
    old = _old_outputs(out)
    real_fsync, synced = os.fsync, []

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            synced.append(fd)
            if len(synced) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert main(_fuse_argv(models, out, "--force")) == 2
    line = _one_line(capsys.readouterr().err)
    assert "No space left on device" in line and f"{out}.json" in line
    assert _outputs(out) == old and not _leftovers(tmp_path)


def _fill(path: Path, leave: int) -> None:
    """Fill the file system of ``path`` with ``path``, then free ``leave`` bytes."""
    with open(path, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    os.truncate(path, max(0, path.stat().st_size - leave))


def test_a_full_tmpfs(models, tmpfs, capsys):
    disk = tmpfs("disk", size="128k")
    out = disk / "f.pt"
    old = _old_outputs(out)
    _fill(disk / "filler", leave=8192)  # less than the model needs
    assert main(_fuse_argv(models, out, "--force")) == 2
    line = _one_line(capsys.readouterr().err)
    assert "No space left on device" in line and str(out) in line
    assert _outputs(out) == old and not _leftovers(disk)


# --------------------------------------------------------------------------- SIGKILL and concurrent writers


def _pair(directory: Path, run: str) -> list[tuple[Path, bytes]]:
    """A model and its report, both naming ``run``."""
    return [
        (directory / "fused.pt", (f"model of run {run}\n" * 4000).encode()),
        (directory / "fused.pt.json", json.dumps({"run": run}).encode()),
    ]


def _state(directory: Path) -> tuple[bytes | None, bytes | None]:
    return tuple(
        (directory / n).read_bytes() if (directory / n).exists() else None  # type: ignore[return-value]
        for n in ("fused.pt", "fused.pt.json")
    )


def _as_state(pair: list[tuple[Path, bytes]] | None) -> tuple[bytes | None, bytes | None]:
    return (None, None) if pair is None else (pair[0][1], pair[1][1])


KILLED_WRITER = r"""
import json, os, signal, sys
from pathlib import Path
import bayesfuse._io as io

stage, directory, overwrite = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
name, when = {"staging": ("_write_synced", 2), "staged": ("_write_journal", 1), "journaled": ("_commit", 1),
              "between-commits": ("_commit", 2), "before-journal-removal": ("_remove_journal", 1)}[stage]
real, calls = getattr(io, name), []

def hook(*args, **kwargs):
    calls.append(1)
    if len(calls) == when:
        if name == "_write_synced":
            os.write(args[0], args[1][: len(args[1]) // 2])  # half a file, then the kill
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)

setattr(io, name, hook)
io.atomic_write_files([(directory / "fused.pt", ("model of run A\n" * 4000).encode()),
                       (directory / "fused.pt.json", json.dumps({"run": "A"}).encode())], overwrite=overwrite)
"""

#: Stages after which the killed commit is finished by the next writer (its journal is on disk).
ROLLED_FORWARD = {"journaled", "between-commits", "before-journal-removal"}


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "force"])
@pytest.mark.parametrize("stage", ["staging", "staged", "journaled", "between-commits", "before-journal-removal"])
def test_a_sigkill_at_any_stage_leaves_the_old_or_the_new_outputs(tmp_path, stage, overwrite):
    old = _pair(tmp_path, "old") if overwrite else None
    if old:
        atomic_write_files(old)
    proc = _python(KILLED_WRITER, stage, str(tmp_path), "1" if overwrite else "0")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert _leftovers(tmp_path)  # what the kill left: temporary files, or a journal

    # The next writer (no --force) first finishes or undoes the killed commit.
    expected = _pair(tmp_path, "A") if stage in ROLLED_FORWARD else old
    if expected is None:
        atomic_write_files(_pair(tmp_path, "B"))
        expected = _pair(tmp_path, "B")
    else:
        with pytest.raises(FileExistsError):
            atomic_write_files(_pair(tmp_path, "B"))
    assert _state(tmp_path) == _as_state(expected)
    assert _leftovers(tmp_path) == []
    atomic_write_files(_pair(tmp_path, "C"), overwrite=True)
    assert _state(tmp_path) == _as_state(_pair(tmp_path, "C")) and _leftovers(tmp_path) == []


@pytest.mark.parametrize("stage", ["staging", "between-commits"])
def test_recover_after_a_sigkill_removes_every_trace(tmp_path, stage):
    old = _pair(tmp_path, "old")
    atomic_write_files(old)
    proc = _python(KILLED_WRITER, stage, str(tmp_path), "1")
    assert proc.returncode == -signal.SIGKILL
    recover([tmp_path / "fused.pt", tmp_path / "fused.pt.json"])
    assert _state(tmp_path) == _as_state(_pair(tmp_path, "A") if stage in ROLLED_FORWARD else old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.pt", "fused.pt.json"]


def _fuse_killed_between_model_and_report(models, tmp_path) -> Path:
    """``bayesfuse fuse`` to ``f.pt``, killed (SIGKILL) after placing the model, before its report."""
    out = tmp_path / "f.pt"
    script = (
        "import os, signal\nimport bayesfuse._io as io\nreal, calls = io._commit, []\n"
        "def commit(*a):\n    calls.append(1)\n"
        "    if len(calls) == 2:\n        os.kill(os.getpid(), signal.SIGKILL)\n    return real(*a)\n"
        "io._commit = commit\n" + CLI
    )
    proc = _python(script, *_fuse_argv(models, out))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert out.exists() and not (tmp_path / "f.pt.json").exists()  # what the kill left
    return out


def test_a_sigkill_of_bayesfuse_fuse_between_model_and_report(models, tmp_path, capsys):
    # The bug: fused.pt without fused.pt.json for good, and every rerun refused. Now the rerun
    # completes the killed run's commit (so both files come from it) and then refuses to replace them.
    out = _fuse_killed_between_model_and_report(models, tmp_path)
    assert main(_fuse_argv(models, out)) == 2
    assert "exists" in _one_line(capsys.readouterr().err)
    reference = tmp_path / "ref" / "f.pt"
    fuse_files(models, "pfnm", reference)
    assert out.read_bytes() == reference.read_bytes()
    assert json.loads((tmp_path / "f.pt.json").read_text())["method"] == "pfnm"
    assert _leftovers(tmp_path) == []
    assert main(_fuse_argv(models, out, "--force")) == 0 and _leftovers(tmp_path) == []


KILLED_REMOVAL = r"""
import os, signal, sys
from pathlib import Path
import bayesfuse._io as io

directory, stage = Path(sys.argv[1]), sys.argv[2]
real = io._remove_journal if stage == "removed" else io._commit

def hook(*args):
    if stage == "removed" and (directory / "fused.pt.heads").exists():
        raise AssertionError("the removal was not placed before the journal's removal")
    os.kill(os.getpid(), signal.SIGKILL)

setattr(io, "_remove_journal" if stage == "removed" else "_commit", hook)
io.atomic_write_files([(directory / "fused.pt", b"new"), (directory / "fused.pt.json", b"new report")],
                      overwrite=True, remove=[directory / "fused.pt.heads"])
"""


@pytest.mark.parametrize("stage", ["journaled", "removed"])
def test_a_sigkill_during_a_commit_that_removes_a_file_leaves_one_fusion(tmp_path, stage):
    # --force over a fusion with a side file the new one has not: the side file goes with the new
    # files, never before them nor left beside them
    atomic_write_files(
        [
            (tmp_path / "fused.pt", b"old"),
            (tmp_path / "fused.pt.json", b"old report"),
            (tmp_path / "fused.pt.heads", b"h"),
        ]
    )
    proc = _python(KILLED_REMOVAL, str(tmp_path), stage)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    recover([tmp_path / "fused.pt", tmp_path / "fused.pt.json", tmp_path / "fused.pt.heads"])
    # the journal was on disk with every file staged: the commit is finished, removal included
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.pt", "fused.pt.json"]
    assert (tmp_path / "fused.pt").read_bytes() == b"new" and (tmp_path / "fused.pt.json").read_bytes() == b"new report"


class _Net(torch.nn.Module):
    """The network of :func:`_mlp_sd`'s entries."""

    def __init__(self, d: int = 64, h: int = 20, k: int = 10):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, h), torch.nn.Linear(h, k)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_load_finishes_a_fusion_write_a_kill_interrupted(models, tmp_path):
    # a model read beside the report of the fusion that wrote it, never beside another's or none
    out = _fuse_killed_between_model_and_report(models, tmp_path)
    loaded = bayesfuse.load(out, like=_Net())
    assert loaded.fusion_report is not None and loaded.fusion_report["method"] == "pfnm"
    assert loaded.fusion is not None and _leftovers(tmp_path) == []


CONCURRENT_WRITER = r"""
import json, sys, time
from pathlib import Path
import bayesfuse._io as io

directory, run, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
while not (directory / "go").exists():
    time.sleep(0.001)
for i in range(n):
    io.atomic_write_files([(directory / "fused.pt", (f"model of run {run}\n" * 4000).encode()),
                           (directory / "fused.pt.json", json.dumps({"run": run}).encode())], overwrite=True)
"""


def test_concurrent_overwriting_writers_leave_one_runs_pair(tmp_path):
    # Each writer's stale-file cleanup must spare the other's staged files (it is alive).
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_WRITER, str(tmp_path), run, "40"], stderr=subprocess.PIPE, text=True
        )
        for run in ("A", "B")
    ]
    (tmp_path / "go").touch()
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    assert _state(tmp_path) in (_as_state(_pair(tmp_path, "A")), _as_state(_pair(tmp_path, "B")))
    assert _leftovers(tmp_path) == []


def test_two_concurrent_bayesfuse_fuse_force_runs(models, tmp_path):
    out = tmp_path / "f.pt"
    _old_outputs(out)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLI, *_fuse_argv(models, out, "--force", method=m)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in ("pfnm", "fedavg")
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.communicate()[1]
    method = json.loads((tmp_path / "f.pt.json").read_text())["method"]
    reference = tmp_path / "ref" / f"{method}.pt"
    fuse_files(models, method, reference)
    assert out.read_bytes() == reference.read_bytes()  # the model of the run that wrote the report
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- damaged MNIST .npz


def _mnist_npz(path: Path) -> bytes:
    rng = np.random.default_rng(0)
    np.savez(
        path,
        x_train=rng.integers(0, 255, (40, 28, 28), dtype=np.uint8),
        y_train=np.arange(40) % 10,
        x_test=rng.integers(0, 255, (10, 28, 28), dtype=np.uint8),
        y_test=np.arange(10),
    )
    return path.read_bytes()


def _damaged(raw: bytes, how: str) -> bytes:
    if how == "truncated":
        return raw[: len(raw) // 2]
    if how == "corrupt":  # bytes inside the first array changed: its CRC no longer matches
        damaged = bytearray(raw)
        damaged[200:240] = b"\xff" * 40
        return bytes(damaged)
    if how == "not a zip":
        return b"these are not the arrays you are looking for" * 10
    return b""  # empty


@pytest.mark.parametrize("how", ["truncated", "corrupt", "not a zip", "empty"])
def test_a_damaged_mnist_npz_is_one_clear_error(tmp_path, how):
    path = tmp_path / "mnist.npz"
    raw = _mnist_npz(path)
    assert len(load_mnist(path).train) == 40  # intact, it loads
    path.write_bytes(_damaged(raw, how))
    with pytest.raises(ValueError) as info:
        load_mnist(path)
    message = str(info.value)
    assert str(path) in message and "x_train, y_train, x_test, y_test" in message
    assert "pickle" not in message and not isinstance(info.value.__cause__, zipfile.BadZipFile)


def test_a_damaged_mnist_npz_in_the_demo(tmp_path, capsys):
    path = tmp_path / "mnist.npz"
    path.write_bytes(_damaged(_mnist_npz(path), "truncated"))
    assert main(["demo", "--dataset", "mnist", "--data-path", str(path), "--quiet", "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "not a readable MNIST .npz" in line and str(path) in line
    assert not (tmp_path / "o").exists()
