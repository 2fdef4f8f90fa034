"""The clients' heads on a fused network (bayesfuse.nets.heads), by hand and from the refit round.

The body runs in float32 and the heads in float64 on its features, so a NumPy computation from
the same features agrees to float64 round-off."""

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import bayesfuse
from bayesfuse.data import dirichlet_partition
from bayesfuse.inference.result import ConvergenceWarning
from bayesfuse.nets.heads import ClientHeads, class_shares
from bayesfuse.nets.predict import predict_proba
from bayesfuse.summaries import output_features, output_fit
from bayesfuse.train import TrainConfig, train_clients


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _network(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).eval()


def _heads(rng, J: int = 3, K: int = 3, G: int = 4):
    weight, bias = rng.normal(size=(J, K, G)), rng.normal(size=(J, K))
    counts = rng.integers(0, 20, size=(J, K)).astype(float)
    counts[:, 0] = [7.0] + [0.0] * (J - 1)  # class 0 seen by client 0 alone
    return weight, bias, class_shares(counts)


def test_one_head_is_its_own_softmax():
    net = _network()
    rng = np.random.default_rng(0)
    weight, bias = rng.normal(size=(1, 3, 4)), rng.normal(size=(1, 3))
    x = torch.randn(6, 5)
    features = net[1](net[0](x)).detach().double().numpy()
    expected = _softmax(features @ weight[0].T + bias[0])
    for pool in ("linear", "log"):
        model = ClientHeads(net, "2", weight, bias, np.ones((1, 3)), pool=pool)
        assert np.allclose(predict_proba(model, x), expected, rtol=1e-10, atol=1e-12)  # heads in float64


@pytest.mark.parametrize("pool", ["linear", "log"])
def test_pools_by_hand(pool):
    net = _network()
    rng = np.random.default_rng(1)
    weight, bias, shares = _heads(rng)
    x = torch.randn(6, 5)
    features = net[1](net[0](x)).detach().double().numpy()
    p = np.stack([_softmax(features @ w.T + b) for w, b in zip(weight, bias)])  # (J, N, K)
    if pool == "linear":
        pooled = np.einsum("jk,jnk->nk", shares, p)
    else:
        pooled = np.exp(np.einsum("jk,jnk->nk", shares, np.log(p)))
    expected = pooled / pooled.sum(1, keepdims=True)
    got = predict_proba(ClientHeads(net, "2", weight, bias, shares, pool=pool), x)
    assert np.allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_class_shares_and_refusals():
    shares = class_shares(np.array([[3.0, 0.0, 1.0], [1.0, 0.0, 3.0]]))
    assert np.allclose(shares, [[0.75, 0.5, 0.25], [0.25, 0.5, 0.75]])  # an unseen class: 1/J each
    net = _network()
    rng = np.random.default_rng(2)
    weight, bias, shares = _heads(rng)
    with pytest.raises(ValueError, match="sum to 1 over the clients"):
        ClientHeads(net, "2", weight, bias, shares * 2)
    with pytest.raises(ValueError, match=r"do not fit the output layer"):
        ClientHeads(net, "2", weight[:, :, :3], bias, shares)
    with pytest.raises(ValueError, match="must be an nn.Linear"):
        ClientHeads(net, "1", weight, bias, shares)
    with pytest.raises(ValueError, match="pool must be one of"):
        ClientHeads(net, "2", weight, bias, shares, pool="max")
    with pytest.raises(ValueError, match="must be finite"):
        ClientHeads(net, "2", np.full_like(weight, np.nan), bias, shares)
    with pytest.raises(ValueError, match="counts >= 0"):
        class_shares(np.array([[-1.0, 2.0]]))


@pytest.fixture(scope="module")
def federation(digits):
    part = dirichlet_partition(digits.train.y, 4, 0.5, seed=0)
    models = train_clients(digits.train, part, TrainConfig(hidden=(20,), epochs=5, seed=0), verbose=False)
    return digits, part, models


def test_the_refit_round_keeps_the_clients_fits_as_heads(federation):
    split, part, models = federation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        shared = bayesfuse.fuse(models, "pfnm", rounds=2, data=(split.train, part))
        heads = bayesfuse.fuse(models, "pfnm", rounds=2, data=(split.train, part), head="clients")
    model = heads.model
    assert isinstance(model, ClientHeads) and model.n_heads == 4
    assert "ClientHeads" in heads.hyper["predictive"]
    # the heads are the clients' replies: their fits on the fused features, recomputed here in the fused order
    lam = heads.hyper["second_round"]["fit_prior_precision"]
    order = heads.hyper["fused_order"]
    for j, c in enumerate(order):
        idx = part[c]
        fit = output_fit(model.network, model.output, split.train.x[idx], split.train.y[idx], lam, n_clients=4)
        assert np.allclose(model.weight[j].numpy(), fit.weight[:-1].T, atol=1e-8)
        assert np.allclose(model.bias[j].numpy(), fit.weight[-1], atol=1e-8)
    assert np.allclose(model.shares.numpy(), class_shares(np.asarray(part.counts)[order]))
    # the body is the same fused network as the probit model's
    x = split.test.x[:50]
    assert np.allclose(
        output_features(model.network, model.output, x), output_features(shared.model.network, "layers.1", x)
    )
    probs = predict_proba(model, split.test.x)
    assert np.allclose(probs.sum(1), 1.0) and (probs.argmax(1) == split.test.y).mean() > 0.8


def test_a_plain_list_partition_and_the_pool_setting(federation):
    split, part, models = federation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        given = bayesfuse.fuse(models, "pfnm", rounds=2, data=(split.train, part), head="clients")
        listed = bayesfuse.fuse(models, "pfnm", rounds=2, data=(split.train, list(part)), head="clients")
    assert torch.equal(given.model.shares, listed.model.shares)  # class counts from the labels
    assert np.array_equal(predict_proba(given.model, split.test.x), predict_proba(listed.model, split.test.x))
    listed.model.pool = "log"
    assert listed.model.pool == "log"
    with pytest.raises(ValueError, match="pool must be one of"):
        listed.model.pool = "max"


def test_heads_need_the_refit_round(federation):
    split, part, models = federation
    with pytest.raises(ValueError, match="head='clients' with rounds=2"):
        bayesfuse.fuse(models, "pfnm", head="clients")
    with pytest.raises(ValueError, match="head='clients' with rounds=2"):
        bayesfuse.fuse(models, "pfnm", rounds=2, second_round="temperature", data=(split.train, part), head="clients")
    with pytest.raises(ValueError, match="has one head"):
        bayesfuse.fuse(models, "fedma", data=(split.train, part), head="clients")
