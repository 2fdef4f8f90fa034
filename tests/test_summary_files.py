"""Client summaries on files: `bayesfuse summarize`, `bayesfuse fuse --summaries`, and the fused
output layer's posterior that `bayesfuse.load` reads back."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

import bayesfuse
from bayesfuse.checkpoints import heads_path, load_state_dict, posterior_path
from bayesfuse.cli import main
from bayesfuse.core import fuse_states
from bayesfuse.data import dirichlet_partition, load_digits
from bayesfuse.fuse_files import fuse_files
from bayesfuse.nets.heads import ClientHeads
from bayesfuse.nets.laplace import LastLayerLaplace
from bayesfuse.nets.predict import predict_proba
from bayesfuse.summaries import SUMMARY_VERSION, load_summary, summary_path
from bayesfuse.train import TrainConfig, train_clients


@pytest.fixture(scope="module")
def client_files(tmp_path_factory):
    """Three digits clients: ``clientJ.pt``, ``clientJ.npz`` (x, y) and the test set."""
    d = tmp_path_factory.mktemp("clients")
    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, 3, 0.5, seed=0)
    models = train_clients(split.train, part, TrainConfig(hidden=(20,), epochs=3), shared_init=False, verbose=False)
    models_, data = [], []
    for j, (m, idx) in enumerate(zip(models, part)):
        torch.save(m.state_dict(), d / f"client{j}.pt")
        np.savez(d / f"client{j}.npz", x=split.train.x[idx], y=split.train.y[idx])
        models_.append(d / f"client{j}.pt")
        data.append(d / f"client{j}.npz")
    return d, models_, data, split


@pytest.fixture
def clients(client_files, tmp_path):
    """A fresh copy of the client files with every summary written by `bayesfuse summarize`."""
    src, models, data, split = client_files
    for p in [*models, *data]:
        shutil.copy(p, tmp_path / p.name)
    models = [tmp_path / p.name for p in models]
    data = [tmp_path / p.name for p in data]
    for m, x in zip(models, data):
        assert main(["summarize", str(m), "--data", str(x)]) == 0
    return models, data, split


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# --------------------------------------------------------------------------- bayesfuse summarize


def test_summarize_writes_the_summary_beside_the_model_and_says_its_size(clients, capsys):
    models, data, split = clients
    capsys.readouterr()
    assert main(["summarize", str(models[0]), "--data", str(data[0]), "--force"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    size = summary_path(models[0]).stat().st_size
    model_size = sum(t.numel() * t.element_size() for t in load_state_dict(models[0]).values())  # its tensors
    assert len(out) == 1 and out[0].startswith(
        f"wrote {summary_path(models[0])}: {size:,} bytes, {size / model_size:.2f}x the model's {model_size:,}; "
    )
    assert out[0].endswith(" s")
    summary = load_summary(summary_path(models[0]))
    y = np.load(data[0])["y"]
    assert summary.n_examples == len(y) and summary.class_counts.tolist() == np.bincount(y, minlength=10).tolist()
    assert set(summary.precision) == set(load_state_dict(models[0]))
    # as bayesfuse.summarize computes it on the loaded network (bfloat16 on disk, version 6)
    direct = bayesfuse.summarize(bayesfuse.load(models[0]), np.load(data[0])["x"], y)
    assert summary.version == direct.version == SUMMARY_VERSION
    for k, v in direct.precision.items():
        np.testing.assert_array_equal(summary.precision[k], v)
    for k in ("gram", "eigenvalues"):  # bfloat16 (the Gram through its factor) on disk: read back exactly
        np.testing.assert_array_equal(summary.output_factors[k], direct.output_factors[k])
    np.testing.assert_array_equal(summary.gram_factor, direct.gram_factor)
    # --float32: a version 4 file, the precisions as float32, each within bfloat16's 2^-8 of the above
    assert main(["summarize", str(models[0]), "--data", str(data[0]), "--force", "--float32"]) == 0
    wide = load_summary(summary_path(models[0]))
    exact = bayesfuse.summarize(bayesfuse.load(models[0]), np.load(data[0])["x"], y, precisions="float32")
    assert wide.version == exact.version == 4 and summary_path(models[0]).stat().st_size > size
    for k, v in exact.precision.items():
        np.testing.assert_array_equal(wide.precision[k], v)
        np.testing.assert_allclose(summary.precision[k], v, rtol=2**-8, atol=0)
    assert main(["summarize", str(models[0]), "--data", str(data[0]), "--force"]) == 0


def test_summarize_keeps_an_existing_summary_unless_forced(clients, capsys):
    models, data, _ = clients
    path = summary_path(models[0])
    before = path.read_bytes()
    assert main(["summarize", str(models[0]), "--data", str(data[1])]) == 2
    assert _error(capsys) == f"bayesfuse summarize: error: {path} exists; replace it with --force"
    assert path.read_bytes() == before
    assert main(["summarize", str(models[0]), "--data", str(data[1]), "--force", "--prior-precision", "3"]) == 0
    assert load_summary(path).prior_precision == 3.0 and load_summary(path).n_examples == len(np.load(data[1])["y"])


def test_summarize_reads_the_model_file_once(clients, tmp_path, monkeypatch):
    from bayesfuse import checkpoints, loading, summary_files

    models, data, _ = clients
    read = []
    original = checkpoints.read_checkpoint
    for module in (checkpoints, loading, summary_files):  # wherever it is called from
        monkeypatch.setattr(module, "read_checkpoint", lambda path: read.append(path) or original(path))
    report = summary_files.summarize_file(models[0], data[0], out=tmp_path / "s.safetensors")
    assert read == [models[0]] and report["state_dict_key"] is None


def test_summarize_writes_where_asked(clients, tmp_path):
    models, data, _ = clients
    out = tmp_path / "elsewhere" / "s.safetensors"
    (tmp_path / "elsewhere").mkdir()
    assert main(["summarize", str(models[0]), "--data", str(data[0]), "--out", str(out)]) == 0
    assert load_summary(out).n_examples == load_summary(summary_path(models[0])).n_examples


@pytest.mark.parametrize(
    "arrays, message",
    [
        (None, "data file {data} does not exist (a .npz with arrays x and y)"),
        ({"x": np.zeros((3, 64))}, "data file {data} has no array 'y' (it holds 'x'); save the inputs as x"),
        (
            {"inputs": np.zeros((3, 64)), "labels": np.zeros(3, int)},
            "has no array 'x' and no array 'y' (it holds 'inputs', 'labels')",
        ),
        ({"x": np.zeros((3, 64)), "y": np.zeros(3)}, "y must be a 1-D array of integer labels, got float64"),
        ({"x": np.zeros((4, 64)), "y": np.zeros(3, int)}, "x must hold one row of real inputs per label (3 labels)"),
        (
            {"x": np.zeros((3, 64)), "y": np.array([0, 1, 10])},
            "on data file {data}: labels must lie in 0..9, got 0..10",
        ),
        ({"x": np.zeros((0, 64)), "y": np.zeros(0, int)}, "data file {data}: it holds no examples"),
        (
            {"x": np.zeros((3, 50)), "y": np.zeros(3, int)},
            "on data file {data}: the network cannot run on x of shape (3, 50) (RuntimeError: mat1",
        ),
    ],
)
def test_summarize_refuses_bad_data_in_one_line(clients, tmp_path, capsys, arrays, message):
    models, _, _ = clients
    data = tmp_path / "bad.npz"
    if arrays is not None:
        np.savez(data, **arrays)
    before = summary_path(models[0]).read_bytes()
    assert main(["summarize", str(models[0]), "--data", str(data), "--force"]) == 2
    assert message.format(data=data) in _error(capsys)
    assert summary_path(models[0]).read_bytes() == before


def test_summarize_refuses_a_npy_file_in_one_line(clients, tmp_path, capsys):
    models, _, _ = clients
    np.save(tmp_path / "plain.npy", np.zeros((3, 64)))
    assert main(["summarize", str(models[0]), "--data", str(tmp_path / "plain.npy"), "--force"]) == 2
    assert "plain.npy is not a NumPy .npz archive (it holds one array of shape (3, 64)" in _error(capsys)


def test_summarize_leaves_a_user_s_own_json_beside_the_model_alone(clients, capsys):
    models, data, _ = clients
    notes = models[0].with_name(models[0].name + ".json")
    notes.write_text('{"trained": "2024", ')  # not even JSON
    assert main(["summarize", str(models[0]), "--data", str(data[0]), "--force"]) == 0
    note = capsys.readouterr().err.strip()  # the warning, as the command line says it: one line
    assert note.startswith("bayesfuse summarize: note: ") and "not a bayesfuse fusion report" in note
    assert "\n" not in note
    assert notes.read_text() == '{"trained": "2024", '


def test_summarize_refuses_networks_it_cannot_rebuild_and_bad_options(clients, tmp_path, capsys):
    models, data, _ = clients
    sd = load_state_dict(models[0])
    odd = tmp_path / "odd.pt"
    torch.save({k.replace("layers.", "fc"): v for k, v in sd.items()}, odd)
    assert main(["summarize", str(odd), "--data", str(data[0])]) == 2
    err = _error(capsys)
    assert "its entry names fit no network bayesfuse builds" in err and "bayesfuse.summarize(model, x, y)" in err
    assert not summary_path(odd).exists()
    assert main(["summarize", str(models[0]), "--data", str(data[0]), "--out", str(tmp_path / "s.json")]) == 2
    assert "a summary is a .safetensors file" in _error(capsys)
    with pytest.raises(SystemExit) as exit_:
        main(["summarize", str(models[0]), "--data", str(data[0]), "--prior-precision", "-1"])
    assert exit_.value.code == 2 and "must be a positive number" in capsys.readouterr().err
    assert main(["summarize", str(tmp_path / "none.pt"), "--data", str(data[0])]) == 2
    assert "model file not found" in _error(capsys)


# --------------------------------------------------------------------------- bayesfuse fuse --summaries


def test_fuse_uses_the_summaries_and_writes_the_output_posterior(clients, tmp_path, capsys):
    models, _, split = clients
    out = tmp_path / "fused.pt"
    args = ["fuse", *map(str, models[::-1]), "--method", "pfnm", "--out", str(out), "--head", "shared"]
    assert main(args) == 0
    assert "(with their client summaries)" in capsys.readouterr().out
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    order = report["fused_order"]
    used = report["summaries"]
    assert used["used"] and used["files"] == [str(summary_path(n)) for n in order]  # aligned with the canonical order
    summaries = [load_summary(summary_path(n)) for n in order]
    assert used["bytes"] == [s.nbytes for s in summaries] and used["examples"] == [s.n_examples for s in summaries]
    assert used["file_bytes"] == [summary_path(n).stat().st_size for n in order]
    assert report["posterior"]["file"] == str(posterior_path(out))
    assert report["posterior"]["entries"] == ["layers.1.weight", "layers.1.bias"]

    # the round trip: the file and its posterior are fuse_states' result on the canonical order
    states = [{k: v.double().numpy() for k, v in load_state_dict(n).items()} for n in order]
    fused = fuse_states(states, "pfnm", names=order, summaries=summaries)
    model = bayesfuse.load(out)
    assert isinstance(model, LastLayerLaplace) and model.fusion_report == report
    for k, v in model.network.state_dict().items():
        np.testing.assert_allclose(v.numpy(), fused.state[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(model.weight_var.numpy(), 1 / fused.precision["layers.1.weight"], rtol=1e-6)
    np.testing.assert_allclose(model.bias_var.numpy(), 1 / fused.precision["layers.1.bias"], rtol=1e-6)
    probs = model.predict(split.test.x)
    assert np.isfinite(probs).all() and np.allclose(probs.sum(1), 1)
    assert type(bayesfuse.load(out, posterior=False)).__name__ == "MLP"


def test_fuse_without_summaries_is_data_free_and_drops_a_stale_posterior(clients, tmp_path, capsys):
    models, _, _ = clients
    out = tmp_path / "fused.safetensors"
    assert main(["fuse", *map(str, models), "--method", "nafi", "--out", str(out)]) == 0
    assert posterior_path(out).is_file()
    assert main(["fuse", *map(str, models), "--method", "nafi", "--out", str(out), "--summaries", "none"]) == 2
    assert f"{out} exists; replace it with --force" in _error(capsys)
    assert (
        main(["fuse", *map(str, models), "--method", "nafi", "--out", str(out), "--summaries", "none", "--force"]) == 0
    )
    assert "(data-free)" in capsys.readouterr().out
    report = json.loads((tmp_path / "fused.safetensors.json").read_text())
    assert report["summaries"] == {"used": False, "path": "data-free", "reason": "summaries='none'"}
    assert report["posterior"] is None and not posterior_path(out).exists()
    assert type(bayesfuse.load(out)).__name__ == "MLP"
    # a method that reads no summaries fuses data-free, and says why
    report = fuse_files(models, "fedavg", tmp_path / "avg.pt")
    assert (
        report["summaries"]["path"] == "data-free"
        and "fedavg reads no client summaries" in report["summaries"]["reason"]
    )


def test_fuse_keeps_the_clients_heads_beside_the_model_as_fuse_does(clients, tmp_path, capsys):
    """With summaries `bayesfuse fuse` keeps the clients' heads by default and writes them beside the
    model; `bayesfuse.load` predicts with them as `bayesfuse.fuse` does (its default too) on the
    same models and summaries."""
    models, _, split = clients
    out = tmp_path / "fused.pt"
    assert main(["fuse", *map(str, models[::-1]), "--method", "pfnm", "--out", str(out)]) == 0
    assert f", {heads_path(out)} and {out}.fusion.safetensors (" in capsys.readouterr().out
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["heads"]["file"] == str(heads_path(out)) and report["heads"]["form"] == "kronecker"
    assert report["heads"]["pool"] == "log" and report["heads"]["clients"] == 3
    loaded = bayesfuse.load(out)
    assert isinstance(loaded, ClientHeads) and loaded.form == "kronecker" and loaded.pool == "log"
    nets = [bayesfuse.load(m) for m in models]
    summaries = [load_summary(summary_path(m)) for m in models]
    direct = bayesfuse.fuse(nets, "pfnm", summaries=summaries)
    assert isinstance(direct.model, ClientHeads) and direct.model.pool == "log" and direct.hyper["head"] == "clients"
    np.testing.assert_allclose(
        predict_proba(loaded, split.test.x), predict_proba(direct.model, split.test.x), atol=1e-5
    )
    # each head smoothed by its client's examples, in the file as in fuse()
    assert "smooths its predictive" in report["heads"]["stores"] and loaded.pseudo_count == 1.0
    assert sorted(loaded.examples.tolist()) == sorted(direct.model.examples.tolist())
    assert sorted(loaded.examples.tolist()) == sorted(float(s.n_examples) for s in summaries)
    assert "smoothed by its client's examples" in direct.hyper["predictive"]
    assert report["heads"]["pseudo_count"] == 1.0
    # another pseudo-count is written in the file and read back: the same predictive as fuse()'s at it
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out), "--pseudo-count", "0.1",
                 "--force"]) == 0  # fmt: skip
    tenth = bayesfuse.load(out)
    assert (
        tenth.pseudo_count == 0.1
        and json.loads((tmp_path / "fused.pt.json").read_text())["heads"]["pseudo_count"] == 0.1
    )
    direct.model.pseudo_count = 0.1
    np.testing.assert_allclose(predict_proba(tenth, split.test.x), predict_proba(direct.model, split.test.x), atol=1e-5)
    assert not np.allclose(predict_proba(tenth, split.test.x), predict_proba(loaded, split.test.x), atol=1e-5)
    # a heads file written before the pseudo-count was recorded was smoothed with 1
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(str(heads_path(out)), framework="numpy") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(heads_path(out)))
    save_file(tensors, str(heads_path(out)), metadata={k: v for k, v in meta.items() if k != "pseudo_count"})
    assert bayesfuse.load(out).pseudo_count == 1.0
    from bayesfuse.checkpoints import read_heads

    fused_state = bayesfuse.load(out, posterior=False).state_dict()
    assert read_heads(heads_path(out), fused_state, "fused.pt")[0]["pseudo_count"] == 1.0  # the reader's, not a default
    for bad in ("-2", "nan", ""):
        save_file(tensors, str(heads_path(out)), metadata={**meta, "pseudo_count": bad})
        with pytest.raises(ValueError, match=f"heads.safetensors: the heads' pseudo_count '{bad}' is not a finite"):
            bayesfuse.load(out)
    # 0: unsmoothed, and the report says so
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out), "--pseudo-count", "0",
                 "--force"]) == 0  # fmt: skip
    zero = json.loads((tmp_path / "fused.pt.json").read_text())["heads"]
    assert zero["pseudo_count"] == 0.0 and "unsmoothed" in zero["stores"] and bayesfuse.load(out).pseudo_count == 0
    # data-free: the heads' means, mixed; and the linear pool on request
    assert main(["fuse", *map(str, models), "--method", "nafi", "--out", str(out), "--head", "clients",
                 "--summaries", "none", "--pool", "log", "--force"]) == 0  # fmt: skip
    loaded = bayesfuse.load(out)
    assert loaded.form == "map" and loaded.pool == "log" and not posterior_path(out).exists()
    # a fusion without heads over it removes the stale heads file; posterior=False gives the network
    assert type(bayesfuse.load(out, posterior=False)).__name__ == "MLP"
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out), "--head", "shared", "--force"]) == 0
    assert not heads_path(out).exists() and isinstance(bayesfuse.load(out), LastLayerLaplace)


def test_a_pool_or_pseudo_count_for_the_shared_head_is_refused_before_fusing(clients, tmp_path, capsys, monkeypatch):
    """Without summaries, or by a method that keeps no client heads, the shared head is known before
    fusing: the refusal comes before any fusion runs."""
    import bayesfuse.fuse_files as fuse_files_module

    def no_fusion(*args, **kwargs):
        raise AssertionError("fused before refusing")

    monkeypatch.setattr(fuse_files_module, "fuse_states", no_fusion)
    models, _, _ = clients
    out = tmp_path / "fused.pt"
    for extra in (
        ["--method", "pfnm", "--summaries", "none", "--pool", "log"],
        ["--method", "fedavg", "--pseudo-count", "0.5"],
    ):
        assert main(["fuse", *map(str, models), "--out", str(out), *extra]) == 2
        assert "these networks are fused with the shared head" in _error(capsys) and not out.exists()


def test_fuse_refuses_heads_it_cannot_keep_and_heads_of_other_tensors(clients, tmp_path, capsys):
    models, _, _ = clients
    out = tmp_path / "fused.pt"
    for extra, message in (
        (["--method", "fedavg", "--head", "clients"], "method must be one of pfnm, nafi, got 'fedavg'"),
        (["--method", "pfnm", "--head", "shared", "--pool", "log"], "not with the shared head (--head shared"),
        (
            ["--method", "pfnm", "--summaries", "none", "--pool", "log"],
            "fused with the shared head: without summaries the shared head is the default: ask for --head clients",
        ),
        (
            ["--method", "fedavg", "--pool", "log"],
            "fused with the shared head: fedavg keeps no client heads (pfnm, nafi do)",
        ),
        (
            ["--method", "pfnm", "--head", "shared", "--pseudo-count", "1"],
            "pseudo_count (--pseudo-count) smooths the clients' own heads: not with the shared head (--head shared",
        ),
        (["--method", "pfnm", "--pseudo-count", "-1"], "pseudo_count must be a finite number >= 0, got -1.0"),
        (
            ["--method", "pfnm", "--summaries", "none", "--pseudo-count", "1"],
            "these networks are fused with the shared head: without summaries the shared head is the default: give the "
            "clients' summaries, or their class counts with --head clients",
        ),
        (
            ["--method", "pfnm", "--summaries", "none", "--head", "clients", "--pseudo-count", "1"],
            "these heads know none (give the clients' summaries or class counts)",
        ),
    ):
        assert main(["fuse", *map(str, models), "--out", str(out), *extra]) == 2
        assert message in _error(capsys)
        assert not out.exists() and not heads_path(out).exists()
    fuse_files(models, "pfnm", out)
    other = tmp_path / "other.pt"
    fuse_files(models, "pfnm", other, seed=1, hyper={"noise_var": 3.0})
    shutil.copy(heads_path(other), heads_path(out))
    with pytest.raises(ValueError, match="written for other tensors than"):
        bayesfuse.load(out)
    heads_path(out).write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable safetensors heads"):
        bayesfuse.load(out)


def test_fuse_refuses_inputs_of_which_only_some_have_a_summary(clients, tmp_path, capsys):
    models, _, _ = clients
    summary_path(models[1]).unlink()
    out = tmp_path / "fused.pt"
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out)]) == 2
    err = _error(capsys)
    assert f"none for {models[1]} (expected {summary_path(models[1]).name})" in err and "--summaries none" in err
    assert not out.exists()
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out), "--summaries", "none"]) == 0


def test_fuse_refuses_a_summary_of_another_model_or_version(clients, tmp_path, capsys):
    models, _, _ = clients
    out = tmp_path / "fused.pt"
    saved = summary_path(models[1]).read_bytes()
    shutil.copy(summary_path(models[0]), summary_path(models[1]))
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out)]) == 2
    assert f"{summary_path(models[1])} (the summary of {models[1]}): the summary is of another network" in _error(
        capsys
    )
    summary_path(models[1]).write_bytes(saved.replace(f'"version":"{SUMMARY_VERSION}"'.encode(), b'"version":"9"'))
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out)]) == 2
    assert f"{summary_path(models[1]).name}: summary version 9 is not one this bayesfuse reads" in _error(capsys)
    assert not out.exists() and not posterior_path(out).exists()


def test_load_refuses_a_posterior_of_other_tensors(clients, tmp_path):
    models, _, _ = clients
    out = tmp_path / "fused.pt"
    fuse_files(models, "pfnm", out, head="shared")
    other = tmp_path / "other.pt"
    fuse_files(models, "pfnm", other, seed=1, hyper={"noise_var": 3.0}, head="shared")
    shutil.copy(posterior_path(other), posterior_path(out))
    with pytest.raises(ValueError, match="written for other tensors than"):
        bayesfuse.load(out)
    posterior_path(out).write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a readable safetensors posterior"):
        bayesfuse.load(out)


def test_bnn_files_are_summarised_and_fused_pruning_by_function(tmp_path, capsys):
    from bayesfuse.models.bnn import BNNConfig, train_bnn

    data = load_digits(seed=0).standardize()
    files = []
    for j, idx in enumerate((np.arange(0, 250), np.arange(250, 500))):
        bnn = train_bnn(data.train.x[idx], data.train.y[idx], 10, 20, BNNConfig(epochs=3, seed=j))
        torch.save(bnn.state_dict(), tmp_path / f"b{j}.pt")
        np.savez(tmp_path / f"b{j}.npz", x=data.train.x[idx], y=data.train.y[idx])
        assert main(["summarize", str(tmp_path / f"b{j}.pt"), "--data", str(tmp_path / f"b{j}.npz")]) == 0
        files.append(tmp_path / f"b{j}.pt")
    assert "0.04x the model's" in capsys.readouterr().out  # 4 floats per unit against a 20-unit BNN
    out = tmp_path / "fused.pt"
    assert main(["fuse", *map(str, files), "--method", "kl", "--out", str(out)]) == 0
    assert "(with their client summaries)" in capsys.readouterr().out
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["summaries"]["used"] and report["hyper"]["pruning"].startswith("function")
    states = [load_state_dict(n) for n in report["fused_order"]]
    summaries = [load_summary(summary_path(n)) for n in report["fused_order"]]
    fused = fuse_states(states, "kl", names=report["fused_order"], summaries=summaries)
    assert report["hyper"]["kept_units"] == fused.hyper["kept_units"]
    assert (
        main(["fuse", *map(str, files), "--method", "kl", "--out", str(tmp_path / "free.pt"), "--summaries", "none"])
        == 0
    )
    free = json.loads((tmp_path / "free.pt.json").read_text())
    assert free["hyper"]["pruning"].startswith("information")


def test_load_refuses_a_model_whose_side_files_are_gone(clients, tmp_path):
    # a user who copies fused.pt and its report but not the heads: refused, not another predictor
    models, _, _ = clients
    out = tmp_path / "fused.pt"
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out)]) == 0
    assert isinstance(bayesfuse.load(out), ClientHeads)
    for side in (heads_path(out), posterior_path(out)):
        side.rename(side.with_name(side.name + ".away"))
        with pytest.raises(ValueError, match=f"its report names .* {side.name}, which is not there"):
            bayesfuse.load(out)
        assert type(bayesfuse.load(out, posterior=False)).__name__ == "MLP"
        side.with_name(side.name + ".away").rename(side)


def test_fuse_never_writes_over_what_it_reads(clients, tmp_path, capsys):
    models, _, split = clients
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({m.name: [1] * 10 for m in models}))
    kept = {p: p.read_bytes() for p in (summary_path(models[0]), counts)}
    for out, extra in ((summary_path(models[0]), []), (counts, ["--class-counts", str(counts), "--format", "pt"])):
        argv = ["fuse", *map(str, models), "--method", "pfnm", "--out", str(out), "--force", *extra]
        assert main(argv) == 2
        assert f"the output {out} is also an input" in _error(capsys)
    assert {p: p.read_bytes() for p in kept} == kept
    own = tmp_path / "own.json"  # the summaries' own counts, with the default head: fused as without them
    own.write_text(json.dumps({m.name: load_summary(summary_path(m)).class_counts.tolist() for m in models}))
    argv = ["fuse", *map(str, models), "--method", "pfnm", "--class-counts", str(own), "--out", str(tmp_path / "o.pt")]
    assert main(argv) == 0 and heads_path(tmp_path / "o.pt").exists()
    out = tmp_path / "fused.pt"  # counts that are not the summaries' own
    assert main(["fuse", *map(str, models), "--method", "pfnm", "--out", str(out), "--class-counts", str(counts)]) == 2
    assert re.search(r"class counts of .*client\d\.pt: \[1(, 1){9}\] are not its summary's \[", _error(capsys))
    assert not out.exists()


def test_summarize_with_the_network_names_the_data_file_its_inputs_do_not_fit(tmp_path, capsys):
    from bayesfuse.checkpoints import save_state_dict
    from tests.nets.user_nets import StepEncoder

    path = save_state_dict(StepEncoder(k=3).state_dict(), tmp_path / "c0.pt")
    data = tmp_path / "wide.npz"
    np.savez(data, x=np.zeros((30, 60), dtype=np.float32), y=np.arange(30) % 3)  # 60 features, not 4 x 16
    assert main(["summarize", str(path), "--data", str(data), "--model", "tests.nets.user_nets:StepEncoder"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path} on data file {data}: " in err and "(2, 60)" in err, err
    assert not summary_path(path).exists()


def test_summarize_reads_token_ids_as_ids_and_integer_pixels_as_numbers(tmp_path, capsys):
    from bayesfuse.checkpoints import save_state_dict
    from bayesfuse.nets.mlp import MLP
    from tests.nets.user_nets import BagOfWords

    rng = np.random.default_rng(0)
    ids = tmp_path / "ids.npz"
    np.savez(ids, x=rng.integers(0, 40, size=(30, 12)), y=np.arange(30) % 10)
    bag = save_state_dict(BagOfWords().state_dict(), tmp_path / "bag.pt")
    assert main(["summarize", str(bag), "--data", str(ids), "--model", "tests.nets.user_nets:BagOfWords"]) == 0, (
        capsys.readouterr().err
    )
    pixels = tmp_path / "pixels.npz"
    np.savez(pixels, x=rng.integers(0, 17, size=(30, 64), dtype=np.uint8), y=np.arange(30) % 10)
    mlp = save_state_dict(MLP(64, [8], 10).state_dict(), tmp_path / "mlp.pt")
    assert main(["summarize", str(mlp), "--data", str(pixels)]) == 0, capsys.readouterr().err
    assert load_summary(summary_path(bag)).n_examples == load_summary(summary_path(mlp)).n_examples == 30
