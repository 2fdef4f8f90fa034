"""bayesfuse.load: fused checkpoints come back as working modules."""

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

import bayesfuse
from bayesfuse.checkpoints import load_state_dict, save_state_dict
from bayesfuse.cli import main
from bayesfuse.models.bnn import HorseshoeBNN
from bayesfuse.nets.arch import LSTMClassifier, make_cnn
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.pans import PANConfig

#: a vague prior and unit noise: identical copies fuse back to the network itself
VAGUE = ["--hyper", "noise_var=1", "prior_var=1e8", "gamma0=1"]


def _fuse_copies(tmp_path, model, method="pfnm", hyper=VAGUE, copies=3, suffix=".pt"):
    """Fuse ``model`` and permuted copies of it (the same file twice is refused as the same client)."""
    from bayesfuse.inference.spec import permute, random_permutations
    from bayesfuse.nets.spec import spec_from_module

    spec, state = spec_from_module(model), model.state_dict()
    rng = np.random.default_rng(0)
    states = [state] + [
        {k: torch.as_tensor(v) for k, v in permute(state, spec, random_permutations(spec.sizes(state), rng)).items()}
        for _ in range(copies - 1)
    ]
    files = [save_state_dict(sd, tmp_path / f"client{j}{suffix}") for j, sd in enumerate(states)]
    out = tmp_path / f"fused{suffix}"
    assert main(["fuse", *map(str, files), "--method", method, *hyper, "--out", str(out)]) == 0
    return out


def _same_function(a: nn.Module, b: nn.Module, x: torch.Tensor, tol: float = 1e-4) -> None:
    with torch.no_grad():
        torch.testing.assert_close(a.eval()(x), b.eval()(x), rtol=tol, atol=tol)


def _same_tensors(model: nn.Module, path) -> None:
    stored = load_state_dict(path)
    state = model.state_dict()
    assert list(state) == list(stored)
    for k in state:
        torch.testing.assert_close(state[k], stored[k], rtol=0, atol=0)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_fused_mlp_loads_as_an_mlp_with_its_report(tmp_path, suffix):
    torch.manual_seed(0)
    model = MLP(12, [7, 5], 3)
    out = _fuse_copies(tmp_path, model, suffix=suffix)
    loaded = bayesfuse.load(out)
    assert isinstance(loaded, MLP) and not loaded.training
    _same_tensors(loaded, out)
    _same_function(loaded, model, torch.randn(20, 12))
    assert loaded.fusion_report["method"] == "pfnm" and loaded.fusion_report["global_sizes"] == [7, 5]


def test_a_fused_convnet_loads_with_its_input_size_read_off_its_weights(tmp_path):
    torch.manual_seed(0)
    model = make_cnn(64, 4, channels=(3, 5), hidden=(6,))
    x = torch.randn(32, 64)
    model.train()(x)  # batch norms with statistics of their own
    out = _fuse_copies(tmp_path, model.eval())
    with pytest.raises(ValueError, match=r"n_features=49 does not fit .* n_features=64 to 121\)$"):
        bayesfuse.load(out, n_features=49)
    for loaded in (bayesfuse.load(out), bayesfuse.load(out, n_features=64)):
        assert loaded[0].unflattened_size == (1, 8, 8)
        _same_tensors(loaded, out)
        _same_function(loaded, model, x)


def test_a_convnet_whose_poolings_round_down_loads_given_its_input_size(tmp_path):
    torch.manual_seed(0)
    model = make_cnn(100, 3, channels=(2, 2, 2), hidden=(4,), in_channels=1).eval()  # 10 -> 5 -> 2 -> 1
    path = tmp_path / "cnn.pt"
    torch.save(model.state_dict(), path)
    assert bayesfuse.load(path)[0].unflattened_size == (1, 8, 8)  # the side every pooling halves exactly
    _same_function(bayesfuse.load(path, n_features=100), model, torch.randn(5, 100))


def test_a_convnet_of_several_input_channels_loads(tmp_path):
    torch.manual_seed(0)
    model = make_cnn(3 * 16, 2, channels=(4,), hidden=(), in_channels=3).eval()
    path = tmp_path / "rgb.pt"
    torch.save(model.state_dict(), path)
    loaded = bayesfuse.load(path)
    assert loaded[0].unflattened_size == (3, 4, 4)
    _same_function(loaded, model, torch.randn(5, 48))
    with pytest.raises(ValueError, match="n_features=16 does not fit"):
        bayesfuse.load(path, n_features=16)


def test_a_file_whose_dense_layer_reads_no_square_maps_says_what_to_pass(tmp_path):
    state = make_cnn(64, 2, channels=(4,), hidden=()).state_dict()
    state["6.weight"] = torch.zeros(2, 60)  # 60 inputs: not 4 square maps
    path = tmp_path / "odd.pt"
    torch.save(state, path)
    with pytest.raises(ValueError, match=r"reads 60 inputs, not 4 square feature maps .*; give like=model$"):
        bayesfuse.load(path)


def test_convnets_trained_on_digits_load_and_fuse_from_their_files_alone(tmp_path, digits):
    from bayesfuse.data.partition import homogeneous_partition
    from bayesfuse.nets.predict import predict_proba
    from bayesfuse.train import TrainConfig, train_clients

    config = TrainConfig(arch="cnn", channels=(4, 8), hidden=(16,), epochs=2, seed=0)
    parts = homogeneous_partition(digits.train.y, 2, seed=0)
    models = train_clients(digits.train, parts, config, verbose=False)
    files = []
    for j, model in enumerate(models):
        files.append(tmp_path / f"cnn{j}.pt")
        torch.save(model.state_dict(), files[-1])
    x = torch.as_tensor(digits.test.x, dtype=torch.float32)
    for model, path in zip(models, files):
        _same_function(bayesfuse.load(path), model, x)
    out = tmp_path / "fused.pt"
    assert main(["fuse", *map(str, files), "--method", "pfnm", "--out", str(out)]) == 0
    fused = bayesfuse.load(out)
    _same_tensors(fused, out)
    accuracy = (predict_proba(fused, digits.test.x).argmax(1) == digits.test.y).mean()
    assert accuracy > 0.5  # two epochs each: the fused network is far above chance (0.1)


def test_a_fused_lstm_loads(tmp_path):
    torch.manual_seed(0)
    model = LSTMClassifier(64, 3, hidden=5, num_layers=2)
    out = _fuse_copies(tmp_path, model)
    loaded = bayesfuse.load(out)
    assert isinstance(loaded, LSTMClassifier) and loaded.lstm.num_layers == 2
    _same_tensors(loaded, out)
    _same_function(loaded, model, torch.randn(10, 64))


def test_a_fused_bnn_loads_with_its_posterior(tmp_path):
    torch.manual_seed(0)
    bnns = [HorseshoeBNN(10, 6, 3) for _ in range(2)]
    files = [save_state_dict(b.state_dict(), tmp_path / f"bnn{j}.pt") for j, b in enumerate(bnns)]
    out = tmp_path / "fused.pt"
    assert main(["fuse", *map(str, files), "--method", "kl", "--out", str(out)]) == 0
    loaded = bayesfuse.load(out)
    assert isinstance(loaded, HorseshoeBNN)
    _same_tensors(loaded, out)  # means and log-scales of every site: the fused posterior
    assert loaded.fusion_report["method"] == "kl"


def test_other_networks_load_through_a_template(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 2))
    out = _fuse_copies(tmp_path, model)
    # a state_dict holds no activations: without the network, ReLU is assumed and said so
    with pytest.warns(UserWarning, match="holds no activations; read as an nn.Sequential of Linear layers with ReLU"):
        guessed = bayesfuse.load(out)
    assert isinstance(guessed[1], nn.ReLU)
    with pytest.raises(ValueError, match="fit no network bayesfuse builds.*like=model"):
        bayesfuse.load(save_state_dict({"encoder.weight": model[0].weight.detach()}, tmp_path / "named.pt"))
    loaded = bayesfuse.load(out, like=nn.Sequential(nn.Linear(8, 99), nn.Tanh(), nn.Linear(99, 2)))
    _same_tensors(loaded, out)
    _same_function(loaded, model, torch.randn(10, 8))
    with pytest.raises(ValueError, match="do not fit the template"):
        bayesfuse.load(out, like=nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)))


def test_position_aware_networks_load_through_a_template(tmp_path):
    torch.manual_seed(0)
    model = MLP(8, [6], 3, pan=PANConfig("mul", 1.0, 0.1))
    state = {k: v + 0.0 for k, v in model.state_dict().items()}
    path = save_state_dict(state, tmp_path / "pan.pt")
    loaded = bayesfuse.load(path, like=copy.deepcopy(model))
    assert loaded.pans is not None
    _same_function(loaded, model, torch.randn(10, 8), tol=0)


@pytest.mark.catalogue
def test_files_that_are_not_networks_are_named(tmp_path):
    with pytest.raises(FileNotFoundError):
        bayesfuse.load(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"junk")
    with pytest.raises(ValueError, match="junk.pt"):
        bayesfuse.load(tmp_path / "junk.pt")
    bad = MLP(4, [3], 2).state_dict()
    bad["layers.1.weight"] = torch.zeros(2, 5)
    path = save_state_dict(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="bad.pt: not an MLP state_dict"):
        bayesfuse.load(path)
    state = MLP(4, [3], 2).state_dict()
    for i, (key, value) in enumerate(state.items()):  # an MLP's entry names, not its companions or shapes
        save_state_dict({k: v for k, v in state.items() if k != key}, tmp_path / f"part{i}.pt")
        with pytest.raises(ValueError, match=f"part{i}.pt: "):
            bayesfuse.load(tmp_path / f"part{i}.pt")
    save_state_dict(
        {"0.weight": torch.zeros(3, 4), "0.bias": torch.zeros(3), "2.bias": torch.zeros(2)}, tmp_path / "s.pt"
    )
    with pytest.raises(ValueError, match=r"s\.pt: .*KeyError: .*2\.weight"):
        bayesfuse.load(tmp_path / "s.pt")
    conv = {
        "0.weight": torch.zeros(0, 1, 3, 3),
        "0.bias": torch.zeros(0),
        "3.weight": torch.zeros(2, 4),
        "3.bias": torch.zeros(2),
    }
    save_state_dict(conv, tmp_path / "c.pt")
    with pytest.raises(ValueError, match=r"c\.pt: .*ZeroDivisionError"):
        bayesfuse.load(tmp_path / "c.pt")


@pytest.mark.catalogue
def test_a_json_file_that_is_no_report_is_left_alone(tmp_path, capsys):
    # a user's own notes beside a checkpoint: warned about, never in the way
    path = save_state_dict(MLP(4, [3], 2).state_dict(), tmp_path / "x.pt")
    for notes in ("{not json", '{"trained": "2024"}', "[1, 2]"):
        (tmp_path / "x.pt.json").write_text(notes)
        with pytest.warns(UserWarning, match="x.pt.json: not a bayesfuse fusion report"):
            assert bayesfuse.load(path).fusion_report is None


@pytest.mark.catalogue
def test_a_report_never_runs_code_and_malformed_ones_are_refused(tmp_path):
    import os

    state = {"enc.weight": torch.zeros(3, 4), "enc.bias": torch.zeros(3), "head.weight": torch.zeros(2, 3)}
    path = save_state_dict(state, tmp_path / "m.pt")
    report = tmp_path / "m.pt.json"
    versions = {"versions": {"bayesfuse": "0"}}
    for network in ("builtins:exit", "os:abort", "os:getpid", "builtins:input"):  # callables, but no networks
        report.write_text(json.dumps({**versions, "architecture": {"network": network}}))
        with pytest.raises(ValueError, match=f"fused from your network {network}: import it, or load with like="):
            bayesfuse.load(path)
    assert os.getpid() > 0  # still here
    for architecture in ("mlp", {"network": 3}, [1]):
        report.write_text(json.dumps({**versions, "architecture": architecture}))
        with pytest.raises(ValueError, match=r"m\.pt\.json: its architecture is not what bayesfuse fuse writes"):
            bayesfuse.load(path)


@pytest.mark.catalogue
def test_a_report_of_another_model_is_refused(tmp_path):
    copies = _fuse_copies(tmp_path, MLP(4, [3], 2), method="fedavg", hyper=())
    fused = tmp_path / "fused.pt"
    assert bayesfuse.load(fused).fusion_report["method"] == "fedavg"
    save_state_dict(MLP(4, [5], 2).state_dict(), fused, overwrite=True)  # replaced, its report left
    with pytest.raises(ValueError, match=r"fused\.pt\.json: this report was written for other tensors"):
        bayesfuse.load(fused)
    with pytest.warns(UserWarning, match="written for other tensors"):  # the network alone needs no report
        assert bayesfuse.load(fused, posterior=False).fusion_report is None
    assert copies


def test_an_example_input_given_for_a_network_load_recognises_is_run(tmp_path):
    path = save_state_dict(MLP(64, [20], 10).state_dict(), tmp_path / "c0.pt")
    assert isinstance(bayesfuse.load(path, example_input=torch.zeros(2, 64)), MLP)
    with pytest.raises(ValueError, match=rf"{path}: MLP: the example input of shape \(2, 5\) does not run"):
        bayesfuse.load(path, example_input=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=rf"{path}: MLP: the example input of type str does not run"):
        bayesfuse.load(path, example_input="abc")
