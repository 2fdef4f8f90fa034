"""Batch norms after layers without a bias (bayesfuse.inference.bias_free): folded through a zero
bias and given back to the batch norm, the same function to float32 round-off (1e-5 on logits
of order 1), on every path that folds: one-shot matching, summaries, FedMA, files."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import bayesfuse
from bayesfuse.checkpoints import save_state_dict
from bayesfuse.cli import main
from bayesfuse.data import dirichlet_partition, load_digits
from bayesfuse.inference.bias_free import biases_into_batchnorms, with_zero_biases
from bayesfuse.inference.layerwise import fold_batchnorm
from bayesfuse.inference.result import ConvergenceWarning
from bayesfuse.nets.tracing import spec_from_module
from bayesfuse.train import TrainConfig
from tests.helpers import far_from_identity_norms
from tests.nets.user_nets import BiasFreeCNN, BiasFreePlainNormCNN


def _random(cls, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = far_from_identity_norms(cls())
    with torch.no_grad():  # affine-free batch norms too: statistics far from the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    return model.eval()


def _gap(a: nn.Module, b: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


@pytest.mark.parametrize("cls", [BiasFreeCNN, BiasFreePlainNormCNN])
def test_folding_through_a_zero_bias_and_back_keeps_the_function(cls):
    model = _random(cls, 0)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    states, spec, _, added = with_zero_biases([state], spec_from_module(model))
    assert [(a.layer, a.bn) for a in added] == [("c1", "bn1"), ("c2", "bn2")]
    assert np.all(states[0]["c1.bias"] == 0) and "c1.bias" not in state  # the caller's state unchanged
    folded = fold_batchnorm(states[0], spec)  # the batch norms are identities now, the biases b'
    assert np.abs(folded["c1.bias"]).max() > 0.1
    back = biases_into_batchnorms(folded, added, list(state))
    assert list(back) == list(state)
    copy = cls()
    copy.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in back.items()})
    assert _gap(model, copy.eval(), torch.randn(8, 64)) < 1e-5


def test_a_network_without_conv_biases_keeps_its_entries_and_one_client_fuses_to_itself():
    model = _random(BiasFreeCNN, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fusing one model: said once
        fused = bayesfuse.fuse([model], "pfnm")
    assert set(fused.model.state_dict()) == set(model.state_dict()) and fused.model.c1.bias is None
    assert _gap(model, fused.model, torch.randn(8, 64)) < 1e-5


def test_a_dense_layer_without_a_bias_before_a_batch_norm_fuses_back_from_a_permuted_copy():
    """It was refused ("cannot fold batch norm '1': layer '0' has no bias")."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 5, bias=False), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
        model[1].weight.uniform_(0.5, 2)
        model[1].bias.uniform_(-1, 1)
    model.eval()
    order = torch.tensor([3, 0, 4, 1, 2])
    copy = nn.Sequential(nn.Linear(4, 5, bias=False), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2)).eval()
    state = model.state_dict()
    permuted = {k: (v[order] if k.startswith(("0.", "1.")) and v.dim() > 0 else v) for k, v in state.items()}
    permuted["3.weight"] = state["3.weight"][:, order]
    copy.load_state_dict(permuted)
    x = torch.randn(8, 4)
    assert _gap(model, copy, x) < 1e-5
    fused = bayesfuse.fuse([model, copy], "pfnm")
    assert _gap(model, fused.model, x) < 1e-5 and fused.model[0].bias is None


@pytest.fixture(scope="module")
def trained():
    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, 3, 1.0, seed=0)
    models = []
    for j, idx in enumerate(part):
        torch.manual_seed(j)
        model = BiasFreeCNN()
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        x, y = torch.as_tensor(split.train.x[idx], dtype=torch.float32), torch.as_tensor(split.train.y[idx])
        for _ in range(30):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        models.append(model.eval())
    return split, part, models


def test_summaries_and_fedma_fuse_networks_without_conv_biases(trained):
    split, part, models = trained
    summaries = [bayesfuse.summarize(m, split.train.x[idx], split.train.y[idx]) for m, idx in zip(models, part)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        laplace = bayesfuse.fuse(models, "pfnm", summaries=summaries)
        fedma = bayesfuse.fuse(models, "fedma", data=(split.train, part), retrain=TrainConfig(epochs=1))
    for result in (laplace, fedma):
        network = getattr(result.model, "network", result.model)
        assert network.c1.bias is None and set(network.state_dict()) == set(models[0].state_dict())
        assert np.isfinite(bayesfuse.nets.predict_proba(result.model, split.test.x[:50])).all()
    states = [{k: v.numpy() for k, v in m.state_dict().items()} for m in models]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fused = bayesfuse.fuse_states(states, "pfnm", spec=spec_from_module(models[0]), summaries=summaries)
    assert list(fused.state) == list(states[0]) and set(fused.precision) <= set(states[0])
    assert fused.spec.axes.keys() == states[0].keys()  # the caller's spec, without the zero biases


def test_files_of_networks_without_conv_biases_fuse_with_the_network_given(trained, tmp_path):
    _, _, models = trained
    paths = [str(save_state_dict(m.state_dict(), tmp_path / f"c{j}.pt")) for j, m in enumerate(models)]
    out = tmp_path / "fused.pt"
    assert (
        main(["fuse", *paths, "--method", "pfnm", "--model", "tests.nets.user_nets:BiasFreeCNN", "--out", str(out)])
        == 0
    )
    loaded = bayesfuse.load(out, like=BiasFreeCNN())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        python = bayesfuse.fuse(models, "pfnm").model
    assert _gap(loaded, python, torch.randn(8, 64)) < 1e-5


def test_an_affine_free_batch_norm_after_a_biased_layer_folds_and_keeps_the_layers_bias_precision():
    """Its beta is exactly 0: the folded bias's precision is the layer's own over c^2 (NAFI eq. 47
    with 1 / pi_beta = 0), above the prior where the data say so, and the function is kept."""
    from bayesfuse.inference.bias_free import add_zero_biases, missing_biases
    from bayesfuse.inference.summary_fusion import laplace_precisions
    from tests.nets.user_nets import PlainNormMLP

    model = far_from_identity_norms(PlainNormMLP()).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    spec = spec_from_module(model)
    state = {k: v.double().numpy() for k, v in model.state_dict().items()}
    added = missing_biases(state, spec)
    assert [(a.layer, a.bn, a.affine, a.bias) for a in added] == [("fc", "bn", False, False)]
    ggn = {k: np.full(np.shape(v), 5.0) for k, v in state.items() if not k.startswith("bn.")}
    states, spec2, _, _ = with_zero_biases([state], spec)
    pi = laplace_precisions(states[0], add_zero_biases(ggn, added, ggn=True), 1.0, spec2)
    c2 = 1.0 / (state["bn.running_var"] + 1e-5)
    np.testing.assert_allclose(pi["fc.bias"], 6.0 / c2)
    back = biases_into_batchnorms(fold_batchnorm(states[0], spec2), added, list(state))
    copy = PlainNormMLP()
    copy.load_state_dict({k: torch.as_tensor(v, dtype=torch.float32) for k, v in back.items()})
    assert _gap(model, copy.eval(), torch.randn(8, 64)) < 1e-5
