import json

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
        sd = {"fc1.weight": m.layers[0].weight, "fc1.bias": m.layers[0].bias,
              "fc2.weight": m.layers[1].weight, "fc2.bias": m.layers[1].bias}
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
    return MLP.from_state_dict({"layers.0.weight": sd["fc1.weight"], "layers.0.bias": sd["fc1.bias"],
                                "layers.1.weight": sd["fc2.weight"], "layers.1.bias": sd["fc2.bias"]})


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


def test_safetensors_round_trip(tmp_path):
    sd = {"a.weight": torch.randn(3, 2), "a.bias": torch.randn(3)}
    save_state_dict(sd, tmp_path / "m.safetensors")
    back = load_state_dict(tmp_path / "m.safetensors")
    for k in sd:
        assert torch.equal(back[k], sd[k])
