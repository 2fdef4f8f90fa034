"""A fused file loads as it was saved: its matched layers' posteriors beside it
(bayesfuse.fusion_record), read back by bayesfuse.load as model.fusion."""

import json
import warnings

import arviz as az
import numpy as np
import pytest
import torch
from torch import nn

import bayesfuse
from bayesfuse.checkpoints import save_state_dict
from bayesfuse.cli import main
from bayesfuse.fusion_record import fusion_path
from bayesfuse.models.bnn import BNNConfig, train_bnn
from tests.nets.test_graph_spec import _random
from tests.nets.user_nets import ResMLP


def _sequentials(n=3):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(64, 30), nn.ReLU(), nn.Linear(30, 10)).eval() for _ in range(n)]


def _fuse_files(tmp_path, models, *extra, name="f.pt"):
    stem = name.partition(".")[0]
    paths = [str(save_state_dict(m.state_dict(), tmp_path / f"{stem}_c{j}.pt")) for j, m in enumerate(models)]
    assert main(["fuse", *paths, "--out", str(tmp_path / name), *extra]) == 0
    return tmp_path / name


def test_a_sequential_mlp_file_loads_without_a_template_and_says_what_it_assumed(tmp_path):
    models = _sequentials()
    out = _fuse_files(tmp_path, models, "--method", "pfnm")
    with pytest.warns(
        UserWarning, match="holds no activations; read as an nn.Sequential of Linear layers with ReLU at 1"
    ):
        loaded = bayesfuse.load(out)
    fresh = bayesfuse.fuse(models, "pfnm")
    x = torch.randn(8, 64)
    with torch.no_grad():
        np.testing.assert_allclose(loaded(x).numpy(), fresh.model(x).numpy(), atol=1e-5)


def test_the_loaded_fusion_is_the_fresh_one(tmp_path):
    """Means, variances, counts, assignments and objective round-trip exactly (float64 on disk)."""
    models = _sequentials()
    out = _fuse_files(tmp_path, models, "--method", "nafi")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = bayesfuse.load(out).fusion
    fresh = bayesfuse.fuse(models, "nafi")
    assert loaded.method == "nafi" and loaded.sizes == fresh.sizes and loaded.groups == fresh.groups
    for (m0, v0), (m1, v1) in zip(loaded.posteriors, fresh.posteriors):
        np.testing.assert_array_equal(m0, np.asarray(m1))
        np.testing.assert_array_equal(v0, np.broadcast_to(np.asarray(v1), np.shape(m1)))
    a, b = loaded.layers[0], fresh.layers[0]
    np.testing.assert_array_equal(a.counts, b.counts)
    # a file's record lists clients in the report's fused_order; the fresh result in the caller's
    fused_order = fresh.hyper["fused_order"]
    assert [x.tolist() for x in a.assignments] == [np.asarray(b.assignments[j]).tolist() for j in fused_order]
    np.testing.assert_allclose(a.objective, b.objective)
    assert a.converged == b.converged and a.n_global == b.n_global
    # and the export of the loaded file is the export of the fresh result
    from bayesfuse.analysis import to_arviz

    for idata in (to_arviz(loaded), loaded.to_arviz()):
        reference = fresh.to_arviz()
        np.testing.assert_array_equal(idata.posterior["theta"].values, reference.posterior["theta"].values)
    assert len(az.summary(loaded.to_arviz())) == len(az.summary(fresh.to_arviz()))


def test_fedavg_writes_no_record_and_force_removes_a_stale_one(tmp_path):
    models = _sequentials()
    out = _fuse_files(tmp_path, models, "--method", "pfnm")
    assert fusion_path(out).is_file()
    paths = [str(tmp_path / f"f_c{j}.pt") for j in range(3)]
    assert main(["fuse", *paths, "--method", "fedavg", "--out", str(out), "--force"]) == 0
    assert not fusion_path(out).exists()
    assert json.loads((tmp_path / "f.pt.json").read_text())["fusion_record"] is None


def test_a_record_beside_another_model_is_refused(tmp_path):
    models = _sequentials()
    out = _fuse_files(tmp_path, models, "--method", "pfnm")
    other = _fuse_files(tmp_path, models[:2], "--method", "pfnm", name="g.pt")
    fusion_path(out).write_bytes(fusion_path(other).read_bytes())
    with pytest.raises(ValueError, match="written for other tensors"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        bayesfuse.load(out)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda record, tensors: record.pop("sizes"), "KeyError: 'sizes'"),
        (lambda record, tensors: record.pop("groups"), "KeyError: 'groups'"),
        (lambda record, tensors: tensors.update({"layer0/mean": np.full((3, 3), np.nan)}), r"mean \(3, 3\)"),
        (lambda record, tensors: tensors.update({"layer0/var": -tensors["layer0/var"]}), "negative variances"),
        (lambda record, tensors: tensors.update({"layer0/counts": np.ones(2)}), r"counts \(2,\)"),
        (lambda record, tensors: tensors.update({"layer0/assignment1": np.array([10**6])}), "client 1's assignment"),
    ],
)
def test_a_malformed_record_is_refused_in_one_line(tmp_path, edit, message):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    out = _fuse_files(tmp_path, _sequentials(), "--method", "pfnm")
    path = fusion_path(out)
    with safe_open(str(path), "np") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    record = json.loads(meta["record"])
    edit(record, tensors)
    save_file(tensors, str(path), metadata={**meta, "record": json.dumps(record)})
    with pytest.raises(ValueError, match=f"f.pt.fusion.safetensors: a malformed fusion record .*{message}"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            bayesfuse.load(out)


def test_a_file_fused_from_the_users_network_loads_when_its_module_is_imported(tmp_path, monkeypatch):
    models = [_random(ResMLP, s) for s in range(2)]
    out = _fuse_files(tmp_path, models, "--method", "pfnm", "--model", "tests.nets.user_nets:ResMLP")
    report = json.loads((tmp_path / "f.pt.json").read_text())
    assert report["architecture"]["network"] == "tests.nets.user_nets:ResMLP"
    loaded = bayesfuse.load(out)  # the module is imported (by this test): the network is rebuilt from it
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), bayesfuse.load(out, like=ResMLP())(x))
    import sys

    monkeypatch.delitem(sys.modules, "tests.nets.user_nets")  # not imported: named, never imported for the file
    with pytest.raises(
        ValueError,
        match=r"fused from your network tests.nets.user_nets:ResMLP: import it, or load "
        r"with like=.*like=ResMLP\(\)",
    ):
        bayesfuse.load(out)
    assert "tests.nets.user_nets" not in sys.modules


def test_fused_bnn_files_keep_their_layer_record(tmp_path):
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    bnns = [
        train_bnn(x[j::2][:400], y[j::2][:400], 10, 8, BNNConfig(epochs=2, seed=j), verbose=False) for j in range(2)
    ]
    out = _fuse_files(tmp_path, bnns, "--method", "kl", name="b.safetensors")
    loaded = bayesfuse.load(out)
    assert loaded.fusion is not None and loaded.fusion.method == "kl"
    assert loaded.fusion.posteriors[0][0].shape[0] == loaded.fusion.sizes[0]


def test_a_loaded_fusion_reports_its_clients_and_heads_as_the_report_does(tmp_path):
    """The record's hyper is the report's: the files in the order its assignments list them
    (``fused_order``), and the kept heads' ``head`` and ``pool``."""
    models = _sequentials()
    out = _fuse_files(tmp_path, models, "--method", "pfnm", "--head", "clients", "--pool", "log")
    report = json.loads((tmp_path / "f.pt.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        loaded = bayesfuse.load(out)
    hyper = loaded.fusion.hyper
    assert hyper["fused_order"] == report["fused_order"] and len(set(hyper["fused_order"])) == 3
    assert hyper["head"] == report["hyper"]["head"] == "clients"
    assert hyper["pool"] == report["hyper"]["pool"] == loaded.pool == "log"
    # client j of the record is the file fused_order[j]: its assignment is that file's own
    fresh = bayesfuse.fuse(models, "pfnm")
    files = [str(tmp_path / f"f_c{j}.pt") for j in range(3)]
    for j, name in enumerate(hyper["fused_order"]):
        np.testing.assert_array_equal(
            loaded.fusion.layers[0].assignments[j], fresh.layers[0].assignments[files.index(name)]
        )
