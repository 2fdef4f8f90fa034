"""Permutation specs: permuting every group leaves the network's function unchanged."""

import numpy as np
import pytest
import torch
from torch import nn

from bayesfuse.inference.spec import Axis, permute, random_permutations
from bayesfuse.nets.arch import LSTMClassifier, make_cnn, rebuild
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.spec import UnsupportedLayerError, spec_from_module
from tests.helpers import randomise


def _check_invariance(model: nn.Module, x: torch.Tensor, seed: int = 0) -> dict:
    spec = spec_from_module(model, x[:2])
    state = model.state_dict()
    sizes = spec.sizes({k: v.numpy() for k, v in state.items()})
    perms = random_permutations(sizes, np.random.default_rng(seed))
    assert all((p != np.arange(len(p))).any() for p in perms.values())
    shuffled = rebuild(model, permute(state, spec, perms)).eval()
    with torch.no_grad():
        torch.testing.assert_close(shuffled(x), model(x), rtol=1e-5, atol=1e-5)
        # the permutation really moved weights
        assert any(not torch.equal(shuffled.state_dict()[k], v) for k, v in state.items() if v.dim() > 0)
    return sizes


def test_mlp_permutation_invariance():
    model = randomise(MLP(12, [9, 7, 5], 4), 0)
    sizes = _check_invariance(model, torch.randn(20, 12))
    assert sizes == {"P1": 9, "P2": 7, "P3": 5}


def test_cnn_with_batchnorm_permutation_invariance():
    model = randomise(make_cnn(64, 10, channels=(6, 5), hidden=(7,)), 1)
    sizes = _check_invariance(model, torch.randn(16, 64))
    assert sizes == {"P1": 6, "P2": 5, "P3": 7}
    spec = spec_from_module(model, torch.zeros(2, 64))
    assert spec.axes["10.weight"][1] == Axis("P2", inner=4)  # 2x2 pixels per channel after two pools
    assert spec.folds == {"2": "1", "6": "5"}


def test_a_batchnorm_after_the_activation_is_not_folded_into_the_layer_before():
    """BatchNorm after a ReLU is an affine map of the activations, not of the layer's outputs:
    folding it backwards across the ReLU would change the function; it stays a norm on its group."""
    model = randomise(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 3)), 3)
    assert spec_from_module(model, torch.zeros(2, 6)).folds == {}
    _check_invariance(model, torch.randn(20, 6))
    # directly after its layer it is folded, as before
    direct = randomise(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)), 3)
    assert spec_from_module(direct, torch.zeros(2, 6)).folds == {"1": "0"}


def test_a_batchnorm_after_the_activation_fuses_permuted_copies_back():
    import warnings

    from bayesfuse import fuse
    from bayesfuse.nets.predict import predict_proba

    model = randomise(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 3)), 4)
    spec = spec_from_module(model, torch.zeros(2, 6))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    copies = [
        rebuild(model, permute(state, spec, random_permutations(spec.sizes(state), rng))).eval() for _ in range(3)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fused = fuse(copies, "pfnm").model
    x = np.random.default_rng(1).normal(size=(30, 6)).astype(np.float32)
    np.testing.assert_allclose(predict_proba(fused, x), predict_proba(model, x), atol=1e-6)


def test_lstm_permutation_invariance():
    model = randomise(LSTMClassifier(64, 10, hidden=11, num_layers=2), 2)
    sizes = _check_invariance(model, torch.randn(8, 64))
    assert sizes == {"H": 11, "H_1": 11}


def test_permutation_without_matching_groups_breaks_function():
    """Control: permuting only the rows of fc1 (not fc2's columns) changes the outputs."""
    model = randomise(MLP(6, [8], 3), 3)
    state = model.state_dict()
    bad = dict(state)
    p = torch.as_tensor(np.random.default_rng(0).permutation(8))
    bad["layers.0.weight"] = state["layers.0.weight"][p]
    bad["layers.0.bias"] = state["layers.0.bias"][p]
    broken = rebuild(model, bad)
    x = torch.randn(10, 6)
    with torch.no_grad():
        assert (broken(x) - model(x)).abs().max() > 1e-3


def test_unsupported_layer_is_named():
    model = nn.Sequential(nn.Linear(4, 5), nn.ZeroPad1d(1), nn.Linear(7, 2))  # padding adds units
    with pytest.raises(UnsupportedLayerError, match=r"1 \(_1\): ZeroPad1d acts on the units' axis"):
        spec_from_module(model)
    model = nn.Sequential(nn.Linear(4, 5), nn.RReLU(), nn.Linear(5, 2))
    with pytest.raises(UnsupportedLayerError, match=r"1 \(_1\): RReLU is not supported \(supported: Linear"):
        spec_from_module(model)
    with pytest.raises(UnsupportedLayerError, match="permutation_spec"):
        spec_from_module(nn.GRU(3, 4))
