import contextlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from bayesfuse.checkpoints import load_state_dict, save_state_dict
from bayesfuse.cli import main
from bayesfuse.data import dirichlet_partition, load_digits
from bayesfuse.fuse_files import fuse_files
from bayesfuse.models.bnn import BNNConfig, train_bnn
from bayesfuse.nets import MLP, predict_proba
from bayesfuse.train import TrainConfig, train_clients
from tests.helpers import DEVICES


@pytest.fixture(scope="module")
def split():
    return load_digits().standardize()


@pytest.fixture(scope="module")
def mlp_files(tmp_path_factory, split):
    d = tmp_path_factory.mktemp("mlps")
    part = dirichlet_partition(split.train.y, 3, 0.5, seed=0)
    models = train_clients(split.train, part, TrainConfig(hidden=(20,), epochs=3), shared_init=False, verbose=False)
    paths = []
    for j, m in enumerate(models):
        sd = {
            "fc1.weight": m.layers[0].weight,
            "fc1.bias": m.layers[0].bias,
            "fc2.weight": m.layers[1].weight,
            "fc2.bias": m.layers[1].bias,
        }
        paths.append(save_state_dict(sd, d / f"client{j}.pt"))
    return paths


@pytest.fixture(scope="module")
def bnn_files(tmp_path_factory, split):
    d = tmp_path_factory.mktemp("bnns")
    part = dirichlet_partition(split.train.y, 2, 0.8, seed=0)
    paths = []
    for j, idx in enumerate(part):
        bnn = train_bnn(split.train.x[idx], split.train.y[idx], 10, 8, BNNConfig(epochs=3, seed=j), verbose=False)
        paths.append(save_state_dict(bnn.state_dict(), d / f"bnn{j}.safetensors"))
    return paths


def _model(path):
    sd = load_state_dict(path)
    return MLP.from_state_dict(
        {
            "layers.0.weight": sd["fc1.weight"],
            "layers.0.bias": sd["fc1.bias"],
            "layers.1.weight": sd["fc2.weight"],
            "layers.1.bias": sd["fc2.bias"],
        }
    )


@pytest.mark.parametrize("method", ["pfnm", "nafi", "fedavg"])
def test_same_inputs_same_bytes_and_order_does_not_matter(mlp_files, tmp_path, method, split):
    a, b, c = tmp_path / "a.pt", tmp_path / "b.pt", tmp_path / "c.pt"
    fuse_files(mlp_files, method, a)
    fuse_files(mlp_files, method, b)
    fuse_files(mlp_files[::-1], method, c)
    assert a.read_bytes() == b.read_bytes() == c.read_bytes()
    report = json.loads((tmp_path / "a.pt.json").read_text())
    assert report["method"] == method and len(report["inputs"]) == 3 and report["global_sizes"][0] >= 20
    probs = predict_proba(_model(a), split.test.x)
    assert (probs.argmax(1) == split.test.y).mean() > 0.3


def test_kl_fusion_of_bnn_checkpoints(bnn_files, tmp_path, split):
    out = tmp_path / "fused.safetensors"
    assert main(["fuse", *map(str, bnn_files), "--method", "kl", "--out", str(out)]) == 0
    again = tmp_path / "again.safetensors"
    assert main(["fuse", *map(str, bnn_files[::-1]), "--method", "kl", "--out", str(again)]) == 0
    assert out.read_bytes() == again.read_bytes()
    sd = load_state_dict(out)
    assert set(sd) >= {"loc.w1", "log_scale.w1"}
    # the point-estimate heads' pool and smoothing are refused for BNNs, nothing written
    for extra in (["--pool", "log"], ["--pseudo-count", "0.5"]):
        other = tmp_path / "other.safetensors"
        assert main(["fuse", *map(str, bnn_files), "--method", "kl", "--out", str(other), *extra]) == 2
        assert not other.exists()


def test_kl_fusion_of_two_layer_bnn_checkpoints(tmp_path, split):
    from bayesfuse.loading import load
    from bayesfuse.models.bnn import HorseshoeBNN

    part = dirichlet_partition(split.train.y, 2, 0.8, seed=0)
    files = []
    for j, idx in enumerate(part):
        bnn = train_bnn(split.train.x[idx], split.train.y[idx], 10, (8, 6), BNNConfig(epochs=3, seed=j), verbose=False)
        files.append(str(save_state_dict(bnn.state_dict(), tmp_path / f"deep{j}.pt")))
    out = tmp_path / "fused.pt"
    assert main(["fuse", *files, "--method", "kl", "--out", str(out)]) == 0
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert len(report["global_sizes"]) == 2
    model = load(out)
    assert isinstance(model, HorseshoeBNN) and model.hidden == tuple(report["global_sizes"])
    assert np.isfinite(model.predict(split.test.x[:10], 4)).all()


def test_safetensors_round_trip(tmp_path):
    sd = {"a.weight": torch.randn(3, 2), "a.bias": torch.randn(3)}
    save_state_dict(sd, tmp_path / "m.safetensors")
    back = load_state_dict(tmp_path / "m.safetensors")
    for k in sd:
        assert torch.equal(back[k], sd[k])


@pytest.fixture(scope="module")
def deep_files(tmp_path_factory, split):
    """Checkpoints of three architectures, three clients each, saved under torch's own names."""
    d = tmp_path_factory.mktemp("deep")
    part = dirichlet_partition(split.train.y, 3, 0.5, seed=1)
    out = {}
    for arch, cfg in {
        "mlp": TrainConfig(hidden=(16, 12), epochs=2),
        "cnn": TrainConfig(arch="cnn", channels=(4, 6), hidden=(12,), epochs=2),
        "lstm": TrainConfig(arch="lstm", hidden=(10,), epochs=2),
    }.items():
        models = train_clients(split.train, part, cfg, shared_init=False, verbose=False)
        out[arch] = (
            models,
            [save_state_dict(m.state_dict(), d / f"{arch}{j}.safetensors") for j, m in enumerate(models)],
        )
    return out


@pytest.mark.parametrize("arch", ["mlp", "cnn", "lstm"])
def test_deep_checkpoints_fuse_like_the_library_and_are_order_free(deep_files, tmp_path, arch):
    from bayesfuse import fuse
    from bayesfuse.inference.spec import spec_for_state_dict
    from bayesfuse.nets.arch import rebuild

    models, paths = deep_files[arch]
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    report = fuse_files(paths, "nafi", a, arch=arch)
    fuse_files(paths[::-1], "nafi", b)  # auto-detected architecture, reversed order
    assert a.read_bytes() == b.read_bytes()
    fused = rebuild(models[0], load_state_dict(a))
    fused_sd = load_state_dict(a)
    sizes = spec_for_state_dict(fused_sd).sizes({k: v.numpy() for k, v in fused_sd.items()})
    assert report["global_sizes"] == list(sizes.values())
    # same as bayesfuse.fuse on the models in the files' canonical order
    order = [[str(p) for p in paths].index(p) for p in report["fused_order"]]
    lib = fuse([models[i] for i in order], "nafi")
    x = torch.randn(20, 64)
    with torch.no_grad():
        torch.testing.assert_close(fused.eval()(x), lib.model(x), rtol=1e-5, atol=1e-5)


def test_arch_spec_file(deep_files, tmp_path):
    from bayesfuse.inference.spec import spec_to_dict
    from bayesfuse.nets.spec import spec_from_module

    models, paths = deep_files["cnn"]
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec_to_dict(spec_from_module(models[0]))))
    out = tmp_path / "f.safetensors"
    assert main(["fuse", *map(str, paths), "--method", "pfnm", "--arch-spec", str(spec_file), "--out", str(out)]) == 0
    report = json.loads((tmp_path / "f.safetensors.json").read_text())
    assert report["architecture"]["groups"] == ["P1", "P2", "P3"]


def test_safetensors_keep_entry_order(tmp_path):
    from safetensors.torch import save

    names = ["10.weight", "2.weight", "1.weight"]
    sd = {k: torch.zeros(1) for k in names}
    save_state_dict(sd, tmp_path / "ours.safetensors")
    assert list(load_state_dict(tmp_path / "ours.safetensors")) == names
    (tmp_path / "plain.safetensors").write_bytes(save(sd))  # no order recorded: numeric name order
    assert list(load_state_dict(tmp_path / "plain.safetensors")) == ["1.weight", "2.weight", "10.weight"]


@pytest.mark.parametrize(
    "content, arch, message",
    [
        ("not json", None, "is not JSON"),
        ('{"layers": []}', None, "needs an 'axes' object"),
        ('{"axes": {"1.weight": "P1"}}', None, "must be a list"),
        ('{"axes": {"1.weight": [{"group": 3}]}}', None, "an axis is null, a group name"),
        ('{"axes": {"1.weight": ["P1", null, null, null]}}', None, "has entries"),
        (None, "mlp", "--arch mlp but the file holds convolutions"),
        (None, "lstm", "no LSTM entries"),
    ],
)
def test_bad_architecture_specs(deep_files, tmp_path, capsys, content, arch, message):
    _, paths = deep_files["cnn"]
    argv = ["fuse", *map(str, paths), "--method", "pfnm", "--out", str(tmp_path / "f.pt")]
    if content is not None:
        (tmp_path / "spec.json").write_text(content)
        argv += ["--arch-spec", str(tmp_path / "spec.json")]
    if arch is not None:
        argv += ["--arch", arch]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "f.pt").exists() and not (tmp_path / "f.pt.json").exists()


def test_report_records_every_hyper_parameter_and_the_chosen_values(mlp_files, tmp_path):
    report = fuse_files(mlp_files, "nafi", tmp_path / "auto.pt")
    saved = json.loads((tmp_path / "auto.pt.json").read_text())
    assert saved["hyper"]["noise_var"] == "auto" and saved["hyper_given"] == {}
    chosen = saved["hyper"]["chosen"][saved["architecture"]["groups"][0]]
    assert chosen["blocks"] == ["fc1.weight", "fc1.bias", "fc2.weight"]
    assert len(chosen["noise_var"]) == len(chosen["prior_var"]) == 3 and all(v > 0 for v in chosen["noise_var"])
    assert saved["converged"] is True and saved["layers"][0]["converged"] is True
    assert report["global_sizes"] == saved["global_sizes"]
    fixed = fuse_files(
        mlp_files, "pfnm", tmp_path / "fixed.pt", hyper={"noise_var": 2.0, "prior_var": 10.0, "gamma0": 1.0}
    )
    assert fixed["hyper"]["noise_var"] == 2.0 and "chosen" not in fixed["hyper"]


def test_force_never_destroys_the_old_model_when_the_report_cannot_be_written(mlp_files, tmp_path, capsys):
    out = tmp_path / "fused.pt"
    out.write_bytes(b"the old model")
    (tmp_path / "fused.pt.json").mkdir()
    assert main(["fuse", *map(str, mlp_files), "--method", "pfnm", "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a directory" in err
    assert out.read_bytes() == b"the old model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused.pt", "fused.pt.json"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hyper", "noise_var=2", "noise_var=3"], "noise_var given twice"),
        (["--seed", "-1"], "must be a non-negative integer"),
    ],
)
def test_ambiguous_options_are_refused(mlp_files, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) if "--seed" in argv else contextlib.nullcontext():  # argparse exits
        code = main(["fuse", *map(str, mlp_files), "--method", "pfnm", "--out", str(tmp_path / "f.pt"), *argv])
        assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "f.pt").exists()


def _counts_by_name(paths, split):
    part = dirichlet_partition(split.train.y, 3, 0.5, seed=0)  # the split mlp_files were trained on
    return {p.name: part.counts[j].tolist() for j, p in enumerate(paths)}


@pytest.mark.parametrize("method", ["pfnm", "fedavg"])
def test_class_counts_follow_their_files_into_the_fused_order(mlp_files, tmp_path, split, method):
    # The rows must reach fuse_states in the fused (canonical) order: fusing the state_dicts in
    # that order with the rows in that order gives the same network; the files' order, and
    # keying by path or by file name, change nothing.
    from bayesfuse.core import fuse_states

    by_name = _counts_by_name(mlp_files, split)
    report = fuse_files(mlp_files, method, tmp_path / "a.pt", class_counts=by_name)
    fuse_files(mlp_files[::-1], method, tmp_path / "b.pt", class_counts={str(p): by_name[p.name] for p in mlp_files})
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    rows = [by_name[Path(n).name] for n in report["fused_order"]]
    assert report["class_counts"] == rows
    states = [{k: v.double().numpy() for k, v in load_state_dict(n).items()} for n in report["fused_order"]]
    expected = fuse_states(states, method, class_counts=np.array(rows), seed=0)
    fused = load_state_dict(tmp_path / "a.pt")
    for k, v in expected.state.items():
        np.testing.assert_allclose(fused[k].double().numpy(), v, rtol=1e-6, atol=1e-6)
    fuse_files(mlp_files, method, tmp_path / "c.pt")
    plain = load_state_dict(tmp_path / "c.pt")
    assert not torch.equal(plain["fc2.bias"], fused["fc2.bias"])  # the shares reach the output layer


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: {k: v for k, v in list(c.items())[1:]}, "no entry for"),
        (lambda c: {**c, "other.pt": [1] * 10}, "not inputs: other.pt"),
        (lambda c: {k: v[:-1] if i == 0 else v for i, (k, v) in enumerate(c.items())}, "one count per class"),
        (lambda c: {k: [-1] + v[1:] for k, v in c.items()}, "finite and non-negative"),
        (lambda c: {k: ["a"] + v[1:] for k, v in c.items()}, "list of numbers"),
        (lambda c: {k: [True] + v[1:] for k, v in c.items()}, "list of numbers"),
        (lambda c: {k: [1e308] * len(v) for k, v in c.items()}, "sum to a finite number above 0"),
        (lambda c: {k: [0.1] * len(v) for k, v in c.items()}, "whole numbers of examples, not shares"),
        (lambda c: {k: [0] * len(v) if i == 1 else v for i, (k, v) in enumerate(c.items())}, "sum to a finite number"),
    ],
)
def test_bad_class_counts_are_named_and_nothing_is_written(mlp_files, tmp_path, capsys, split, edit, message):
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(edit(_counts_by_name(mlp_files, split))))
    out = tmp_path / "f.pt"
    code = main(["fuse", *map(str, mlp_files), "--method", "pfnm", "--out", str(out), "--class-counts", str(path)])
    assert code == 2 and message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    "content, message",
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"a.pt": 3}', "expected a JSON object"),
        ("{", "is not JSON"),
        (None, "does not exist"),
    ],
)
def test_class_counts_files_that_cannot_be_used_are_refused(mlp_files, tmp_path, capsys, content, message):
    path = tmp_path / "counts.json"
    if content is not None:
        path.write_text(content)
    code = main(
        ["fuse", *map(str, mlp_files), "--method", "pfnm", "--out", str(tmp_path / "f.pt"), "--class-counts", str(path)]
    )
    assert code != 0 and message in capsys.readouterr().err


def test_class_counts_keyed_by_any_spelling_of_a_path_or_by_path_objects(mlp_files, tmp_path, split, monkeypatch):
    by_name = _counts_by_name(mlp_files, split)
    fuse_files(mlp_files, "pfnm", tmp_path / "a.pt", class_counts=by_name)
    monkeypatch.chdir(mlp_files[0].parent.parent)
    relative = {f"./{p.parent.name}/../{p.parent.name}/{p.name}": by_name[p.name] for p in mlp_files}
    fuse_files(mlp_files, "pfnm", tmp_path / "b.pt", class_counts=relative)  # absolute inputs, relative keys
    as_paths = {p: by_name[p.name] for p in mlp_files}
    fuse_files([str(p) for p in mlp_files], "pfnm", tmp_path / "c.pt", class_counts=as_paths)
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes() == (tmp_path / "c.pt").read_bytes()


@pytest.mark.parametrize("method", ["pfnm", "fedavg"])
def test_class_counts_that_cannot_fit_the_models_are_refused(mlp_files, tmp_path, split, method):
    by_name = _counts_by_name(mlp_files, split)
    with pytest.raises(ValueError, match="give 3 counts per client; the models have 10 classes"):
        fuse_files(mlp_files, method, tmp_path / "f.pt", class_counts={k: v[:3] for k, v in by_name.items()})
    with pytest.raises(ValueError, match="must map each model file"):
        fuse_files(mlp_files, method, tmp_path / "f.pt", class_counts=list(by_name.values()))
    twice = {**by_name, str(mlp_files[0]): by_name[mlp_files[0].name]}
    with pytest.raises(ValueError, match="is given twice"):
        fuse_files(mlp_files, method, tmp_path / "f.pt", class_counts=twice)
    assert not (tmp_path / "f.pt").exists()


def test_a_file_name_shared_by_two_inputs_must_be_keyed_by_path(mlp_files, tmp_path):
    twin = tmp_path / "twin" / mlp_files[0].name
    twin.parent.mkdir()
    other = {k: v + 0.01 if v.is_floating_point() else v for k, v in load_state_dict(mlp_files[1]).items()}
    save_state_dict(other, twin)  # another client's network under the first one's file name
    paths = [mlp_files[0], twin, mlp_files[2]]
    counts = {mlp_files[0].name: [1.0] * 10, mlp_files[2].name: [1.0] * 10}
    with pytest.raises(ValueError, match="names 2 inputs; key them by path"):
        fuse_files(paths, "pfnm", tmp_path / "f.pt", class_counts=counts)
    by_path = {str(p): [1.0 + j] * 10 for j, p in enumerate(paths)}
    assert fuse_files(paths, "pfnm", tmp_path / "f.pt", class_counts=by_path)["class_counts"] is not None


def test_the_same_file_twice_is_refused(mlp_files, tmp_path):
    with pytest.raises(ValueError, match="is given twice"):
        fuse_files([mlp_files[0], mlp_files[1], mlp_files[0]], "pfnm", tmp_path / "f.pt")
    # a copy under another name, or the same tensors in another format, is the same client
    copy = tmp_path / "copy.safetensors"
    save_state_dict(load_state_dict(mlp_files[1]), copy)
    with pytest.raises(ValueError, match=r"holds the same tensors as .* \(the same client twice\?\)"):
        fuse_files([mlp_files[0], mlp_files[1], copy], "fedavg", tmp_path / "f.pt")
    assert not (tmp_path / "f.pt").exists()


def _named_mlp(widths, seed):
    """An MLP state_dict with layers named input, hidden, ..., output (name order is not forward order)."""
    g = torch.Generator().manual_seed(seed)
    names = ["input", *[f"hidden{i}" if i else "hidden" for i in range(len(widths) - 3)], "output"]
    sd = {}
    for name, d, h in zip(names, widths[:-1], widths[1:]):
        sd[f"{name}.weight"] = torch.randn(h, d, generator=g) / d**0.5
        sd[f"{name}.bias"] = torch.randn(h, generator=g) / 10
    return sd


def _without_paths(report):
    """A report without what depends on file names and bytes (paths, file hashes) or on time."""
    inputs = [{k: v for k, v in f.items() if k not in ("path", "sha256", "order_recorded")} for f in report["inputs"]]
    record = report.get("fusion_record") and {k: v for k, v in report["fusion_record"].items() if k != "file"}
    return {
        **{k: v for k, v in report.items() if k not in ("seconds", "fused_order")},
        "inputs": inputs,
        "fusion_record": record,
    }


@pytest.mark.catalogue
def test_safetensors_from_other_tools_fuse_like_pt(tmp_path):
    """Without order metadata a plain MLP's layer order comes from its shapes, when they chain one way."""
    from safetensors.torch import save_file

    sds = [_named_mlp([64, 20, 16, 10], seed) for seed in range(3)]
    pts = [save_state_dict(sd, tmp_path / f"c{j}.pt") for j, sd in enumerate(sds)]
    theirs = []
    for j, sd in enumerate(sds):
        save_file(sd, tmp_path / f"c{j}.safetensors")  # no order recorded: sorted by name in the file
        theirs.append(tmp_path / f"c{j}.safetensors")
    a = fuse_files(pts, "pfnm", tmp_path / "from_pt.pt")
    b = fuse_files(theirs, "pfnm", tmp_path / "from_safetensors.pt")
    assert (tmp_path / "from_pt.pt").read_bytes() == (tmp_path / "from_safetensors.pt").read_bytes()
    assert list(load_state_dict(tmp_path / "from_safetensors.pt")) == list(sds[0])
    assert [f["order_recorded"] for f in b["inputs"]] == [False] * 3
    assert _without_paths(a) == _without_paths(b)


@pytest.mark.catalogue
def test_safetensors_whose_shapes_chain_two_ways_need_a_spec(tmp_path, capsys):
    """8 inputs and 8 hidden units: input and hidden layer could swap. Refused; a spec settles it."""
    from safetensors.torch import save_file

    from bayesfuse.inference.spec import spec_for_state_dict, spec_to_dict

    sds = [_named_mlp([8, 8, 8, 3], seed) for seed in range(3)]
    pts = [str(save_state_dict(sd, tmp_path / f"c{j}.pt")) for j, sd in enumerate(sds)]
    theirs = []
    for j, sd in enumerate(sds):
        save_file(sd, tmp_path / f"c{j}.safetensors")
        theirs.append(str(tmp_path / f"c{j}.safetensors"))
    out = tmp_path / "f.safetensors"
    assert main(["fuse", *theirs, "--method", "pfnm", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "chain in 2 different orders" in err and "--arch-spec FILE" in err, err
    assert not out.exists() and not (tmp_path / "f.safetensors.json").exists()

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(spec_to_dict(spec_for_state_dict(sds[0], "mlp"))))
    assert main(["fuse", *theirs, "--method", "pfnm", "--arch-spec", str(spec), "--out", str(out)]) == 0
    assert main(["fuse", *pts, "--method", "pfnm", "--arch", "mlp", "--out", str(tmp_path / "g.safetensors")]) == 0
    assert out.read_bytes() == (tmp_path / "g.safetensors").read_bytes()
    assert list(load_state_dict(out)) == list(sds[0])


@pytest.mark.catalogue
def test_file_names_formats_and_order_do_not_change_the_result(tmp_path):
    """Files are ordered by their tensors: torch.save stores the file's name, which must not matter."""
    sds = [_named_mlp([64, 20, 16, 10], seed) for seed in range(4)]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    paths_a = []
    for name, sd in zip(["alice", "bob", "carol", "dave"], sds):
        torch.save(sd, first / f"{name}.pt")
        paths_a.append(first / f"{name}.pt")
    torch.save(sds[0], second / "zoe.pt")
    save_state_dict(sds[1], second / "yann.safetensors")
    torch.save(sds[2], second / "xu.pt")
    torch.save(sds[3], second / "wim.pth")
    paths_b = [second / n for n in ("wim.pth", "xu.pt", "yann.safetensors", "zoe.pt")]  # another order
    a = fuse_files(paths_a, "pfnm", tmp_path / "a.pt")
    b = fuse_files(paths_b, "pfnm", tmp_path / "b.pt")
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    assert _without_paths(a) == _without_paths(b)
    assert json.loads((tmp_path / "b.pt.json").read_text())["inputs"] == b["inputs"]
    assert [f["path"] for f in b["inputs"]] == b["fused_order"]  # inputs listed in canonical order
    c = fuse_files(paths_a[::-1], "pfnm", tmp_path / "c.pt")
    assert c["inputs"] == a["inputs"]


# --------------------------------------------------------------------------- where the matching runs


@pytest.mark.parametrize("device", DEVICES)
def test_a_device_fuses_as_the_host_and_the_report_records_it(mlp_files, tmp_path, capsys, device):
    host = fuse_files(mlp_files, "pfnm", tmp_path / "host.pt")
    assert host["device"] is None and host["dtype"] == "float64"
    for dtype in ("float64", "float32"):
        out = tmp_path / f"{dtype}.pt"
        assert (
            main(
                [
                    "fuse",
                    *map(str, mlp_files),
                    "--method",
                    "pfnm",
                    "--out",
                    str(out),
                    "--device",
                    device,
                    "--dtype",
                    dtype,
                ]
            )
            == 0
        )
        report = json.loads((tmp_path / f"{dtype}.pt.json").read_text())
        assert report["device"] == device and report["dtype"] == dtype and "device" not in report["hyper"]
        assert report["global_sizes"] == host["global_sizes"]
        assert [layer["assignments"] for layer in report["layers"]] == [
            layer["assignments"] for layer in host["layers"]
        ]
        want, got = load_state_dict(tmp_path / "host.pt"), load_state_dict(out)
        # float32 files: float64 results equal to round-off round to one float32 or to neighbours
        # (2^-23 relative); float32 results are within a few float32 round-offs of the weights'
        # magnitude (the bound of tests/test_fusion.py, 2 gamma_{J+4} max|w| < 1e-5 here).
        atol = 0.0 if dtype == "float64" else 1e-5
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=2.0**-22, atol=atol)
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--method", "fedavg", "--device", "cpu"],
            "--device 'cpu': method 'fedavg' runs on the host only; a device runs the matching of pfnm and nafi",
        ),
        (["--method", "ot", "--device", "cuda"], "--device 'cuda': method 'ot' runs on the host only"),
        (["--method", "pfnm", "--device", "cuda"], "device 'cuda': no CUDA device is available to this torch"),
        (["--method", "nafi", "--device", "gpu"], "device 'gpu' is not a torch device"),
        (["--method", "pfnm", "--dtype", "float32"], "--dtype 'float32' is for the torch path: give a device too"),
    ],
)
def test_device_errors_are_one_line_before_any_file_is_read(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    absent = [str(tmp_path / "absent0.pt"), str(tmp_path / "absent1.pt")]  # never opened
    assert main(["fuse", *absent, *argv, "--out", str(tmp_path / "f.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not (tmp_path / "f.pt").exists() and not (tmp_path / "f.pt.json").exists()


def test_a_device_is_refused_for_bnn_checkpoints(bnn_files, tmp_path, capsys):
    assert (
        main(["fuse", *map(str, bnn_files), "--method", "nafi", "--device", "cpu", "--out", str(tmp_path / "f.pt")])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "nafi on Bayesian networks (HorseshoeBNN posteriors) runs on the host only" in err, err
    assert not (tmp_path / "f.pt").exists()


@pytest.mark.parametrize(
    "files, method, message",
    [
        ("mlp", "kl", "method 'kl' fuses HorseshoeBNN checkpoints (mean-field posteriors); these are point estimates"),
        ("bnn", "fedavg", "method 'fedavg' is for point-estimate networks; use kl, nafi or pfnm for BNNs"),
        ("bnn", "ot", "method 'ot' is for point-estimate networks; use kl, nafi or pfnm for BNNs"),
    ],
)
def test_a_method_that_does_not_take_the_files_kind_is_refused(mlp_files, bnn_files, tmp_path, files, method, message):
    paths = mlp_files if files == "mlp" else bnn_files
    with pytest.raises(ValueError, match=re.escape(message)):
        fuse_files(paths, method, tmp_path / "f.pt")
    assert not (tmp_path / "f.pt").exists()


@pytest.mark.catalogue
def test_the_fused_dtype_is_the_widest_input_s_whatever_the_order(mlp_files, tmp_path):
    # a float16 client and float32 ones: float32, whichever file comes first in the fused order
    half = tmp_path / "half.pt"
    save_state_dict({k: v.half() for k, v in load_state_dict(mlp_files[0]).items()}, half)
    for j, inputs in enumerate(([half, *mlp_files[1:]], [*mlp_files[1:], half])):
        out = tmp_path / f"f{j}.pt"
        fuse_files(inputs, "fedavg", out)
        assert {t.dtype for t in load_state_dict(out).values()} == {torch.float32}


@pytest.mark.catalogue
def test_force_removes_the_old_fusion_s_side_files_with_its_commit(mlp_files, tmp_path, split):
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps(_counts_by_name(mlp_files, split)))
    out = tmp_path / "f.pt"
    argv = ["fuse", *map(str, mlp_files), "--method", "pfnm", "--out", str(out), "--class-counts", str(counts)]
    assert main([*argv, "--head", "clients"]) == 0 and (tmp_path / "f.pt.heads.safetensors").exists()
    assert main([*argv, "--head", "shared", "--force"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counts.json", "f.pt", "f.pt.fusion.safetensors", "f.pt.json"]
