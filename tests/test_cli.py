import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bayesfuse.cli import main

SMALL = ["demo", "--clients", "4", "--epochs", "2", "--hidden", "20", "--quiet"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    return out, main([*SMALL, "--out", str(out)])


def test_demo_writes_table_and_files(demo_run, capsys):
    out, code = demo_run
    assert code == 0
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    # the second round, and each client summarising its data (DemoConfig.summaries)
    with_summaries = [
        "2 rounds",
        "client heads",
        "+summaries",
        "+summaries 2 rounds",
        "+summaries temperature",
        "+summaries shared head",
    ]
    assert [r["method"] for r in rows] == [
        "local (mean of 4)",
        "ensemble",
        "fedavg",
        "pfnm",
        *(f"pfnm {s}" for s in with_summaries),
        "nafi",
        *(f"nafi {s}" for s in with_summaries),
    ]
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in rows)
    assert [int(r["hidden"]) for r in rows[:3]] == [20, 80, 20]
    # A matched model has at least the widest local layer and at most all units.
    assert all(20 <= int(r["hidden"]) <= 80 for r in rows[3:])
    assert {r["seed"] for r in rows} == {"0"}
    assert [int(w) for w in rows[3]["widths"].split("/")] == [int(rows[3]["hidden"])]
    report = json.loads((out / "results.json").read_text())
    run = report["runs"][0]
    assert report["config"]["n_clients"] == 4 and len(run["local_models"]) == 4
    # each client trained on all but the tenth it kept back for the temperature round
    held = np.array(run["client_held_out_counts"]).sum(1)
    trained = np.array(run["client_class_counts"]).sum(1)
    assert trained.sum() + held.sum() == report["data"]["n_train"] and (held >= 1).all()
    np.testing.assert_array_equal(held, np.maximum(np.rint(0.1 * (trained + held)), 1))
    pfnm = next(r for r in report["summary"] if r["method"] == "pfnm")
    assert pfnm["accuracy_sd"] == 0.0 and pfnm["hyper"]["noise_var"] == "auto" and "chosen" in pfnm["hyper"]
    rounds = {r["method"]: r["hyper"].get("second_round", {}).get("kind") for r in report["summary"]}
    assert rounds["pfnm +summaries temperature"] == "temperature" and rounds["pfnm +summaries 2 rounds"] == "refit"
    assert (out / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_over_seeds_reports_mean_and_sd_and_takes_hyper(tmp_path, capsys):
    out = tmp_path / "o"
    assert (
        main(
            [
                *SMALL,
                "--seeds",
                "0",
                "1",
                "--methods",
                "pfnm,nafi",
                "--hyper",
                "nafi.kl_weight=0.5",
                "n_iter=7",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "±" in capsys.readouterr().out
    report = json.loads((out / "results.json").read_text())
    assert report["seeds"] == [0, 1] and [r["seed"] for r in report["runs"]] == [0, 1]
    for i, row in enumerate(report["summary"]):
        values = [run["results"][i]["accuracy"] for run in report["runs"]]
        assert row["accuracy"] == pytest.approx(sum(values) / 2)
        assert row["accuracy_sd"] == pytest.approx(abs(values[0] - values[1]) / 2**0.5)
    hyper = {r["method"]: r["hyper"] for r in report["summary"]}
    assert hyper["nafi"]["kl_weight"] == 0.5 and hyper["pfnm"]["kl_weight"] == 0.0
    assert hyper["nafi"]["n_iter"] == hyper["pfnm"]["n_iter"] == 7
    with open(out / "results.csv") as fh:
        # per seed: local, ensemble, fedavg, then pfnm and nafi each data-free, 2 rounds, client heads,
        # +summaries, +summaries 2 rounds, +summaries temperature, +summaries shared head
        assert [r["seed"] for r in csv.DictReader(fh)] == ["0"] * 17 + ["1"] * 17


@pytest.mark.catalogue
@pytest.mark.parametrize(
    "args, message",
    [
        (["--hyper", "sigma=1"], "no method run (pfnm, nafi) has a key 'sigma'"),
        (["--hyper", "fedma.noise_var=1"], "'fedma' is not among the fusion methods run"),
        (["--hyper", "noise_var"], "key=value"),
        (["--hyper", "nafi.kl_weight=-1"], "kl_weight"),
        (["--hyper", "n_iter=2", "pfnm.n_iter=3"], "pfnm.n_iter twice"),
    ],
)
def test_demo_refuses_bad_hyper_before_any_work(tmp_path, capsys, args, message):
    assert main([*SMALL, *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "o").exists()


def test_demo_refuses_non_empty_out_without_force(demo_run, capsys):
    out, _ = demo_run
    before = (out / "results.json").read_bytes()
    (out / "notes.txt").write_text("mine")
    assert main([*SMALL, "--seed", "1", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "results.json").read_bytes() == before
    assert main([*SMALL, "--seed", "1", "--out", str(out), "--force"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == 1
    assert (out / "notes.txt").read_text() == "mine"


def test_a_demo_that_fails_writing_leaves_the_last_run_s_three_files(demo_run, capsys, monkeypatch):
    # the table, the report and the figure of one run: never one run's table beside another's figure
    import bayesfuse.demo as demo

    out, _ = demo_run
    before = {name: (out / name).read_bytes() for name in ("results.csv", "results.json", "summary.png")}

    def no_figure(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(demo, "_figure_png", no_figure)
    assert main([*SMALL, "--seed", "2", "--out", str(out), "--force"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {name: (out / name).read_bytes() for name in before} == before


def test_demo_prints_the_table(tmp_path, capsys):
    assert main([*SMALL, "--out", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    for word in ("method", "accuracy", "nll", "hidden", "seconds", "ensemble", "fedavg", "pfnm", "nafi"):
        assert word in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--alpha", "0"], "alpha must be a positive"),
        (["--holdout", "1"], "holdout must be in [0, 1), got 1.0"),
        (["--clients", "5000"], "more clients than examples"),
        (["--dataset", "fashion-mnist", "--data-path", "/nonexistent/fmnist"], "/nonexistent/fmnist"),
    ],
)
def test_demo_bad_inputs_exit_cleanly(tmp_path, capsys, args, message):
    assert main([*SMALL, *args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_console_entry_point_help():
    out = subprocess.run(
        [sys.executable, "-m", "bayesfuse.cli", "demo", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--clients" in out and "--force" in out


@pytest.mark.parametrize("arch, extra", [("cnn", ["--channels", "4,6"]), ("lstm", []), ("mlp", ["--hidden", "20,16"])])
def test_demo_deep_architectures_with_fedma(tmp_path, arch, extra):
    out = tmp_path / "o"
    argv = [
        *SMALL,
        "--arch",
        arch,
        *extra,
        "--methods",
        "pfnm,fedma,fedavg-rounds",
        "--retrain-epochs",
        "1",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    with open(out / "results.csv") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    groups = {"cnn": 3, "lstm": 1, "mlp": 2}[arch]
    assert int(rows["fedma"]["rounds"]) == groups + 1
    assert rows[f"fedavg x{groups + 1} rounds"]["rounds"] == str(groups + 1)
    assert rows["pfnm"]["rounds"] == "1" and rows["local (mean of 4)"]["rounds"] == "0"
    assert rows["pfnm 2 rounds"]["rounds"] == "2"  # the output refit, on every architecture
    assert ("pfnm +summaries" in rows) == (arch in ("mlp", "cnn"))  # summaries: MLPs and ConvNets
    if arch == "cnn":  # the default with summaries keeps the clients' Kronecker heads on the conv body
        summary = json.loads((out / "results.json").read_text())["summary"]
        assert next(r for r in summary if r["method"] == "pfnm +summaries")["hyper"]["head"] == "clients"
    assert ("pfnm client heads" in rows) == (arch in ("mlp", "cnn"))  # an output layer that reads units
    if arch != "lstm":
        assert rows["pfnm client heads"]["rounds"] == "1"


def test_demo_vit(tmp_path):
    """The vision transformer in the demo: one-shot PFNM (heads aligned first) and the refit round."""
    out = tmp_path / "o"
    assert main([*SMALL, "--arch", "vit", "--width", "0.5", "--methods", "pfnm", "--out", str(out)]) == 0
    with open(out / "results.csv") as fh:
        rows = {r["method"]: r for r in csv.DictReader(fh)}
    assert rows["pfnm"]["rounds"] == "1" and rows["pfnm 2 rounds"]["rounds"] == "2"
    assert len(rows["pfnm"]["widths"].split("/")) == 19  # the stream, 2 blocks x (4 heads x (qk, v) + MLP)
    report = json.loads((out / "results.json").read_text())
    pfnm = next(r for r in report["summary"] if r["method"] == "pfnm")
    assert len(pfnm["hyper"]["head_orders"]) == 4  # one per client


def test_demo_with_position_aware_neurons(tmp_path):
    out = tmp_path / "o"
    assert main([*SMALL, "--pan", "mul,1,0.1", "--methods", "fedavg-rounds", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["config"]["pan"] == {"mode": "mul", "period": 1.0, "amplitude": 0.1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--pan", "mul,1"], "expected MODE,T,A"),
        (["--pan", "sideways,1,0.1"], "PAN mode must be 'add' or 'mul'"),
        (["--methods", "pfnm,magic"], "unknown methods ['magic']"),
    ],
)
def test_demo_bad_options_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL, *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.catalogue
@pytest.mark.parametrize(
    "args",
    [
        ["--dataset", "mnist", "--data-path", "/nonexistent"],
        ["--dataset", "fashion-mnist", "--data-path", "/nonexistent/fmnist"],
        ["--alpha", "0"],
    ],
)
def test_a_failing_demo_leaves_no_output_directory(tmp_path, capsys, args):
    out = tmp_path / "o"
    assert main([*SMALL, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


@pytest.mark.catalogue
def test_file_system_errors_are_one_line_naming_the_path(tmp_path, capsys, monkeypatch):
    import errno
    import os

    import bayesfuse.cli as cli

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "o" / "results.csv"))

    monkeypatch.setattr(cli, "_run_demo", full)
    assert main([*SMALL, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"bayesfuse demo: error: {tmp_path / 'o' / 'results.csv'}: No space left on device "
        "(free some space or write elsewhere)\n"
    )


def test_help_documents_the_exit_status():
    out = subprocess.run(
        [sys.executable, "-m", "bayesfuse.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "exit status" in out and "130" in out


# --------------------------------------------------------------------------- errors that say what to do, at once

#: Run main() in a fresh interpreter: its exit status, whether torch was imported, and the seconds it took.
_MAIN_IN_A_FRESH_PROCESS = """
import sys, time
start = time.perf_counter()
from bayesfuse.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print(code, "torch" in sys.modules, f"{time.perf_counter() - start:.3f}")
"""


@pytest.mark.catalogue
@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "nope"], "unknown method 'nope'"),
        (["--method", "pfmn"], "(did you mean 'pfnm'?)"),
        (["--method", "fedma"], "needs the clients' data"),
        (["--method", "pfnm", "--hyper", "noise_vr=1"], "(did you mean 'noise_var'?)"),
        (["--method", "pfnm", "--hyper", "noise_var=-1"], "noise_var must be positive"),
        (["--method", "pfnm", "--seed", "-1"], "argument --seed: must be a non-negative integer, got -1"),
        (["--method", "pfnm", "--only-one"], "one model file given"),
        (["--method", "pfnm", "--out-dir"], "is a directory; give a file name for it"),
    ],
)
def test_fuse_argument_errors_are_one_line_before_torch_is_imported(tmp_path, args, message):
    models = ["a.pt"] if "--only-one" in args else ["a.pt", "b.pt"]  # never read: the arguments are refused first
    out = str(tmp_path) if "--out-dir" in args else str(tmp_path / "fused.pt")
    args = [a for a in args if a not in ("--only-one", "--out-dir")]
    proc = subprocess.run(
        [sys.executable, "-c", _MAIN_IN_A_FRESH_PROCESS, "fuse", *models, *args, "--out", out],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    )
    code, torch_imported, seconds = proc.stdout.split()
    err = proc.stderr.strip()
    print(f"{' '.join(args)}: {float(seconds):.2f} s to the error")
    assert (code, torch_imported) == ("2", "False"), (proc.stdout, err)
    assert len(err.splitlines()) == 1 and err.startswith("bayesfuse fuse: error: ") and message in err, err


def test_fuse_help_fits_a_screen_with_examples_and_lists_no_refused_method():
    from bayesfuse import methods

    out = subprocess.run(
        [sys.executable, "-m", "bayesfuse.cli", "fuse", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "80"},
    ).stdout
    lines = out.splitlines()
    print(f"bayesfuse fuse --help: {len(lines)} lines at 80 columns")
    assert len(lines) <= 40 and max(map(len, lines)) <= 80, out
    assert "examples:" in out and sum(line.strip().startswith("bayesfuse fuse ") for line in lines) >= 2
    assert "bayesfuse methods" in out and "exit status" in out
    assert all(name in out for name in methods.names(needs_data=False))
    assert not any(name in out for name in methods.names(needs_data=True))
    assert max(map(len, lines)) <= 90


def test_methods_given_in_any_case_and_checkpoint_dicts_are_fused(tmp_path, capsys):
    import torch

    from bayesfuse.checkpoints import load_state_dict
    from bayesfuse.nets import MLP

    states = [MLP(6, [5], 3).state_dict() for _ in range(2)]
    torch.save(states[0], tmp_path / "a.pt")
    torch.save(states[1], tmp_path / "b.pt")
    torch.save(
        {"model_state_dict": states[1], "epoch": 60, "optimizer_state_dict": {"lr": 0.1}}, tmp_path / "b_ckpt.pt"
    )
    assert (
        main(
            [
                "fuse",
                str(tmp_path / "a.pt"),
                str(tmp_path / "b.pt"),
                "--method",
                "pfnm",
                "--out",
                str(tmp_path / "plain.pt"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        main(
            [
                "fuse",
                str(tmp_path / "a.pt"),
                str(tmp_path / "b_ckpt.pt"),
                "--method",
                "PFNM",
                "--out",
                str(tmp_path / "dict.pt"),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.startswith("fused 2 models with pfnm ")
    assert (
        f"note: a checkpoint dict: fused the state_dict in {tmp_path / 'b_ckpt.pt'}['model_state_dict'] "
        f"(state_dict_key in {tmp_path / 'dict.pt'}.json)"
    ) in captured.err.splitlines()
    report = json.loads((tmp_path / "dict.pt.json").read_text())
    assert report["method"] == "pfnm"
    keys = {Path(f["path"]).name: f["state_dict_key"] for f in report["inputs"]}
    assert keys == {"a.pt": None, "b_ckpt.pt": "model_state_dict"}
    plain, from_dict = load_state_dict(tmp_path / "plain.pt"), load_state_dict(tmp_path / "dict.pt")
    assert all(torch.equal(plain[k], from_dict[k]) for k in plain)  # the same tensors, the same fusion


def test_demo_scores_the_temperature_round_on_the_held_out_examples(monkeypatch):
    """The temperature round reads the examples the clients kept back, the refit round those they
    trained on; with ``holdout=0`` (or no temperature row) nothing is kept back."""
    import bayesfuse.demo as demo

    seen = []
    real = demo.fuse

    def recording(*args, **kwargs):
        if "data" in kwargs:
            seen.append((kwargs.get("second_round", "refit"), [np.asarray(i) for i in kwargs["data"][1]]))
        return real(*args, **kwargs)

    monkeypatch.setattr(demo, "fuse", recording)
    config = demo.DemoConfig(n_clients=3, epochs=1, hidden=(12,), methods=("pfnm",))
    run = demo.run_demo(config, verbose=False).runs[0]
    assert run.held is not None and {kind for kind, _ in seen} == {"refit", "temperature"}
    for kind, parts in seen:
        want = run.held if kind == "temperature" else run.partition
        assert all(np.array_equal(a, b) for a, b in zip(parts, want))
    for trained, held in zip(run.partition, run.held):
        assert not np.intersect1d(trained, held).size
    seen.clear()
    whole = demo.run_demo(demo.DemoConfig(n_clients=3, epochs=1, hidden=(12,), methods=("pfnm",), holdout=0.0))
    assert whole.runs[0].held is None and {kind for kind, _ in seen} == {"refit", "temperature"}
    assert all(np.array_equal(a, b) for _, parts in seen for a, b in zip(parts, whole.runs[0].partition))
    assert demo.run_demo(demo.DemoConfig(n_clients=3, epochs=1, hidden=(12,), methods=("ot",))).runs[0].held is None


def test_python_dash_m_bayesfuse_is_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "bayesfuse", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: bayesfuse")


def test_a_reader_that_goes_away_ends_the_command_quietly():
    proc = subprocess.run(
        f"{sys.executable} -m bayesfuse methods | head -c 10", shell=True, capture_output=True, text=True
    )
    assert proc.stdout == "fusion met" and "Broken pipe" not in proc.stderr and "Traceback" not in proc.stderr


def test_an_architecture_spec_and_an_arch_are_not_both_taken(tmp_path, capsys):
    argv = ["fuse", "a.pt", "b.pt", "--method", "pfnm", "--arch", "cnn", "--arch-spec", "s.json"]
    assert main([*argv, "--out", str(tmp_path / "f.pt")]) == 2
    assert "--arch-spec gives the architecture; --arch cnn would be ignored" in capsys.readouterr().err
