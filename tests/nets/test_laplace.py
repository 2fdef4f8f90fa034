"""The last-layer Laplace predictive: the probit rule by hand, sampling against quadrature."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bayesfuse.nets.laplace import LastLayerLaplace
from bayesfuse.nets.mlp import MLP
from tests.helpers import randomise


def network(k=3):
    return randomise(MLP(4, [5], k), 0).double()


def test_probit_logits_by_hand():
    net = network()
    rng = np.random.default_rng(1)
    wv, bv = rng.uniform(0, 2, size=(3, 5)), rng.uniform(0, 1, size=3)
    model = LastLayerLaplace(net, "layers.1", wv, bv)
    x = torch.randn(7, 4, dtype=torch.float64)
    with torch.no_grad():
        a = torch.relu(net.layers[0](x)).numpy()
        f = net(x).numpy()
        got = model(x).numpy()
    s2 = (a**2) @ wv.T + bv
    np.testing.assert_allclose(got, f / np.sqrt(1 + math.pi / 8 * s2), rtol=1e-12)
    np.testing.assert_allclose(model.mean_logits(x).detach().numpy(), f)
    model.temperature.fill_(2.0)
    np.testing.assert_allclose(model(x).detach().numpy(), got / 2.0, rtol=1e-12)


def test_zero_variance_is_the_network():
    net = network()
    model = LastLayerLaplace(net, "layers.1", np.zeros((3, 5)), np.zeros(3))
    x = torch.randn(6, 4, dtype=torch.float64)
    want = torch.softmax(net(x), -1).detach().numpy()
    np.testing.assert_allclose(model.predict(x), want, rtol=1e-12)
    np.testing.assert_allclose(model.predict(x, num_samples=3), want, rtol=1e-12)


def test_sampled_predictive_against_quadrature():
    # two classes: p_0 = E[sigmoid(f0 - f1)], f0 - f1 ~ N(m0 - m1, s0^2 + s1^2), by Gauss-Hermite.
    # 100,000 draws estimate it with sd <= 0.5 / sqrt(1e5) = 0.0016; the tolerance is 5 sd.
    net = network(k=2)
    model = LastLayerLaplace(net, "layers.1", np.full((2, 5), 0.3), np.full(2, 0.5))
    x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = model.predict(x, num_samples=100_000, seed=4)[:, 0]
    with torch.no_grad():
        f, s2 = model._logits_and_variance(x)
    mean, var = (f[:, 0] - f[:, 1]).numpy(), s2.sum(1).numpy()
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    want = [(weights * (1 / (1 + np.exp(-(m + np.sqrt(v) * nodes))))).sum() / weights.sum() for m, v in zip(mean, var)]
    np.testing.assert_allclose(got, want, atol=5 * 0.5 / np.sqrt(100_000))


def test_refusals():
    net = network()
    with pytest.raises(ValueError, match="nn.Linear"):
        LastLayerLaplace(net, "layers", np.zeros((3, 5)), np.zeros(3))
    with pytest.raises(ValueError, match="do not fit"):
        LastLayerLaplace(net, "layers.1", np.zeros((3, 4)), np.zeros(3))
    with pytest.raises(ValueError, match="non-negative"):
        LastLayerLaplace(net, "layers.1", -np.ones((3, 5)), np.zeros(3))
    model = LastLayerLaplace(net, "layers.1", np.zeros((3, 5)), np.zeros(3))
    with pytest.raises(ValueError, match="num_samples"):
        model.predict(np.zeros((2, 4)), num_samples=0)


def test_per_class_covariance_by_hand_and_its_diagonal():
    net = network()
    x = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rng = np.random.default_rng(0)
    g = net.layers[-1].in_features + 1
    roots = rng.normal(size=(3, g, g)) * 0.3
    cov = roots @ roots.transpose(0, 2, 1)
    lla = LastLayerLaplace(net, "layers.1", covariance=cov).double()
    with torch.no_grad():
        feats = torch.relu(net.layers[0](x)).numpy()
        logits = net(x).numpy()
    tilde = np.hstack([feats, np.ones((7, 1))])
    var = np.stack([[t @ cov[k] @ t for k in range(3)] for t in tilde])  # s_k^2 = a~^T Sigma_k a~
    with torch.no_grad():
        np.testing.assert_allclose(lla(x).numpy(), logits / np.sqrt(1 + math.pi * var / 8), rtol=1e-10)
    # a diagonal covariance is the independent-weights posterior
    diag = np.stack([np.diag(np.diag(c)) for c in cov])
    a = LastLayerLaplace(net, "layers.1", covariance=diag).double()
    b = LastLayerLaplace(net, "layers.1", np.diagonal(cov, axis1=1, axis2=2)[:, :-1], cov[:, -1, -1]).double()
    with torch.no_grad():
        np.testing.assert_allclose(a(x).numpy(), b(x).numpy(), rtol=1e-10)
    with pytest.raises(ValueError, match="does not fit"):
        LastLayerLaplace(net, "layers.1", covariance=cov[:, 1:, 1:])
    with pytest.raises(ValueError, match="semi-definite"):
        LastLayerLaplace(net, "layers.1", covariance=-cov)
    with pytest.raises(ValueError, match="or covariance"):
        LastLayerLaplace(net, "layers.1")


def _joint(net, seed=0, scale=0.3):
    g, k = net.layers[-1].in_features + 1, net.layers[-1].out_features
    root = np.random.default_rng(seed).normal(size=(g * k, g * k)) * scale / np.sqrt(g * k)
    return (root @ root.T).reshape(g, k, g, k)


def test_joint_covariance_by_hand_centred_probit_and_its_sampled_predictive():
    """S(x) = (I (x) a~)^T Sigma (I (x) a~) by hand; the probit of the centred logits by hand; and
    the sampled predictive (weight draws) against draws of the logits from N(f_bar, S(x)) made
    here: 200,000 draws each, so each probability's estimate has sd <= 0.5 / sqrt(2e5) ~ 0.0011,
    and the two differ by at most 5 sd of their difference, 5 * sqrt(2) * 0.0011."""
    net = network(k=3)
    cov = _joint(net)
    lla = LastLayerLaplace(net, "layers.1", covariance=cov).double()
    assert lla.joint
    x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feats = torch.relu(net.layers[0](x)).numpy()
        logits = net(x).numpy()
        mean, s = lla._logits_and_covariance(x)
    tilde = np.hstack([feats, np.ones((5, 1))])
    want = np.einsum("ng,gkhl,nh->nkl", tilde, cov, tilde)
    np.testing.assert_allclose(s.numpy(), want, rtol=1e-10)
    np.testing.assert_allclose(lla.weight_var.numpy(), np.einsum("gkgk->kg", cov)[:, :-1], rtol=1e-12)
    centre = np.eye(3) - 1 / 3
    sc = np.einsum("kl,nlm,mj->nkj", centre, want, centre)
    z = (logits @ centre) / np.sqrt(1 + math.pi / 8 * np.einsum("nkk->nk", sc))
    with torch.no_grad():
        np.testing.assert_allclose(lla(x).numpy(), z, rtol=1e-10)
    rng = np.random.default_rng(5)
    direct = np.stack(
        [
            torch.softmax(torch.as_tensor(rng.multivariate_normal(f, sn, size=200_000)), -1).mean(0).numpy()
            for f, sn in zip(logits, want)
        ]
    )
    sampled = lla.predict(x, num_samples=200_000, seed=4)
    np.testing.assert_allclose(sampled, direct, atol=5 * np.sqrt(2) * 0.5 / np.sqrt(200_000))


def test_variance_along_the_all_ones_direction_changes_no_prediction():
    """A common shift of every class's bias moves all logits together: the softmax ignores it,
    so the probit of the centred logits and the sampled predictive are the network's softmax."""
    net = network(k=3)
    g = net.layers[-1].in_features + 1
    shift = np.zeros((g, 3))
    shift[-1] = 1.0  # the biases, all classes together
    cov = 4.0 * np.einsum("gk,hl->gkhl", shift, shift)
    lla = LastLayerLaplace(net, "layers.1", covariance=cov).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    want = torch.softmax(net(x), -1).detach().numpy()
    np.testing.assert_allclose(lla.predict(x), want, rtol=1e-10)
    np.testing.assert_allclose(lla.predict(x, num_samples=50, seed=1), want, rtol=1e-10)
    per_class = LastLayerLaplace(net, "layers.1", covariance=np.stack([cov[:, c, :, c] for c in range(3)])).double()
    assert np.abs(per_class.predict(x) - want).max() > 1e-2  # the per-class rule reads it as uncertainty


@pytest.mark.parametrize("joint", [False, True])
def test_a_sampled_prediction_does_not_depend_on_the_rest_of_the_batch(joint):
    net = network(k=3)
    lla = (
        LastLayerLaplace(net, "layers.1", covariance=_joint(net))
        if joint
        else LastLayerLaplace(net, "layers.1", np.full((3, 5), 0.3), np.full(3, 0.5))
    ).double()
    x = torch.randn(9, 4, dtype=torch.float64)
    whole = lla.predict(x, num_samples=200, seed=2)
    np.testing.assert_allclose(lla.predict(x[3:4], num_samples=200, seed=2), whole[3:4], rtol=1e-12)
    np.testing.assert_allclose(lla.predict(x, num_samples=np.int64(200), seed=2), whole, rtol=0)


class _After(torch.nn.Module):
    """``network`` with ``how`` done to its output layer's logits."""

    def __init__(self, network, how):
        super().__init__()
        self.layers, self.how = network.layers, how

    def forward(self, x):
        f = self.layers[1](torch.relu(self.layers[0](x)))
        return torch.log_softmax(f, -1) if self.how == "log_softmax" else 2.0 * f


@pytest.mark.parametrize("joint", [False, True])
def test_a_log_softmax_after_the_output_layer_predicts_as_the_logits_do_and_a_scale_is_refused(joint):
    """The posterior is the output layer's: a forward that returns log_softmax of its logits (the
    same softmax) predicts exactly as one returning the logits, probit and sampled; one that
    scales them would be read wrongly by both, and is refused in one line."""
    net = network()
    cov = dict(covariance=_joint(net)) if joint else dict(weight_var=np.full((3, 5), 0.4), bias_var=np.full(3, 0.2))
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    plain = LastLayerLaplace(net, "layers.1", **cov)
    logged = LastLayerLaplace(_After(net, "log_softmax"), "layers.1", **cov)
    for kw in ({}, {"num_samples": 50}):
        np.testing.assert_allclose(logged.predict(x, **kw), plain.predict(x, **kw), rtol=1e-12)
    scaled = LastLayerLaplace(_After(net, "scale"), "layers.1", **cov)
    for kw in ({}, {"num_samples": 50}):
        with pytest.raises(ValueError, match=r"_After's forward changes the logits of its output layer 'layers.1'"):
            scaled.predict(x, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_logits_check_holds_in_low_precision_and_on_empty_batches(dtype):
    """A scale of 1.1 after the output layer is refused in every dtype (bfloat16's rounding is a
    shift's, 8 eps of the logits, not a softmax's); log_softmax passes with logits of order 30;
    an empty batch predicts nothing; an output layer applied twice is refused as such."""
    from bayesfuse.nets.heads import logits_and_features

    class Scaled(torch.nn.Module):
        def __init__(self, how):
            super().__init__()
            self.fc1, self.fc2, self.how = torch.nn.Linear(4, 8), torch.nn.Linear(8, 5), how
            with torch.no_grad():
                self.fc2.weight.mul_(5.0)  # logits of order 30

        def forward(self, x):
            f = self.fc2(torch.relu(self.fc1(x)))
            if self.how == "twice":
                return (f + self.fc2(torch.relu(self.fc1(-x)))) / 2
            return 1.1 * f if self.how == "scale" else torch.log_softmax(f, -1)

    torch.manual_seed(0)
    x = (10 * torch.randn(64, 4)).to(dtype)
    for how, refused in (("scale", "changes the logits"), ("log_softmax", None), ("twice", "2 times per batch")):
        net = Scaled(how).to(dtype)
        if refused:
            with pytest.raises(ValueError, match=refused):
                logits_and_features(net, "fc2", x)
        else:
            logits, _ = logits_and_features(net, "fc2", x)
            assert float(logits.abs().amax()) > 20
    logits, features = logits_and_features(Scaled("scale").to(dtype), "fc2", x[:0])
    assert logits.shape == (0, 5) and features.shape == (0, 8)
