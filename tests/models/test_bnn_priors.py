"""A Gaussian prior beside the horseshoe: its model, training, files, and fusion refused across priors."""

import math

import numpy as np
import pyro
import pytest
import torch
from pyro.poutine.util import site_is_subsample

from bayesfuse import fuse
from bayesfuse.data import dirichlet_partition
from bayesfuse.inference.bnn.sites import PRIORS, Prior, read_prior
from bayesfuse.metrics import accuracy
from bayesfuse.models.bnn import BNNConfig, HorseshoeBNN, train_bnn
from bayesfuse.models.bnn_elbo import negative_elbo
from tests.helpers import varied_bnn


@pytest.fixture(scope="module")
def gaussian_clients(digits):
    part = dirichlet_partition(digits.train.y, 3, 0.8, seed=0)
    bnns = [
        train_bnn(
            digits.train.x[i], digits.train.y[i], 10, hidden=16, config=BNNConfig(epochs=40, seed=j), prior="gaussian"
        )
        for j, i in enumerate(part)
    ]
    return bnns, part


def test_the_prior_is_recorded_in_the_state_dict():
    assert PRIORS == ("horseshoe", "gaussian")
    horseshoe, gaussian = HorseshoeBNN(5, 3, 2), HorseshoeBNN(5, 3, 2, prior="gaussian", global_scale=0.5)
    # a horseshoe's vector is as before (files written before there was a choice read alike)
    assert horseshoe.prior_scales.tolist() == [0.1, 1.0] and horseshoe.prior == "horseshoe"
    assert gaussian.prior_scales.tolist() == [0.5, 1.0, 1.0] and gaussian.prior == "gaussian"
    assert HorseshoeBNN(5, 3, 2, prior="gaussian").global_scale == 1.0  # N(0, 1) by default
    back = HorseshoeBNN.from_state_dict(gaussian.state_dict())
    assert back.prior_spec == Prior("gaussian", 0.5, 1.0)
    assert str(back.prior_spec) == "gaussian(scale=0.5, weight_scale=1)"
    assert str(horseshoe.prior_spec) == "horseshoe(global_scale=0.1, weight_scale=1)"
    with pytest.raises(ValueError, match="prior must be one of 'horseshoe', 'gaussian'"):
        HorseshoeBNN(5, 3, 2, prior="laplace")


@pytest.mark.parametrize(
    "scales, message",
    [
        ([0.1, 1.0, 2.0], r"client\.pt: 'prior_scales' has shape \(3,\), expected \(2,\) for the horseshoe"),
        ([0.1, 1.0, 0.0], r"ending in 1 for the Gaussian prior"),
        ([0.1, 1.0, 1.0, 1.0], r"has shape \(4,\), expected \(2,\)"),
        ([-0.1, 1.0, 1.0], "two positive finite numbers"),
    ],
)
def test_bad_prior_vectors_are_refused(scales, message):
    with pytest.raises(ValueError, match=message) as info:
        read_prior(torch.tensor(scales, dtype=torch.float64), "client.pt")
    assert len(str(info.value).splitlines()) == 1


def test_a_gaussian_prior_has_no_scale_sites_in_the_model():
    bnn = varied_bnn(
        4, (3, 2), 3, seed=0, spread=0.5, scale_low=0.1, scale_span=0.3, prior="gaussian", global_scale=0.7
    )
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    trace = pyro.poutine.trace(bnn.model).get_trace(x, y)

    def sites(t):
        return {k for k, v in t.nodes.items() if v["type"] == "sample" and not site_is_subsample(v)}

    assert sites(trace) == {"w1", "b1", "w2", "b2", "w3", "b3", "y"}
    assert sites(pyro.poutine.trace(bnn.guide).get_trace(x, y)) == sites(trace) - {"y"}
    # effective hidden weights s_h w~ with w~ ~ N(0, 1): the prior N(0, s_h^2) of the module docstring
    w = trace.nodes["w1"]["fn"]
    assert float(w.base_dist.scale.unique()) == 1.0 and float(w.base_dist.loc.unique()) == 0.0
    # the scales are the guide's fixed means, in every draw
    draws = bnn.sample_params(5, torch.Generator().manual_seed(0))
    assert torch.equal(draws["log_tau"], bnn.loc["log_tau"].expand(5, 1))
    assert torch.equal(draws["log_lam2"], bnn.loc["log_lam2"].expand(5, 2))


def test_the_prior_changes_the_objective():
    # The same guide under the two priors: the horseshoe adds the KL terms of its scales and draws
    # them, so the mean -ELBO over R draws moves by many standard errors (the estimator's agreement
    # with Pyro's under either prior is in test_bnn_elbo.py).
    bnn = varied_bnn(
        3, 4, 3, seed=3, spread=0.5, scale_low=0.1, scale_span=0.5, global_scale=0.5, weight_scale=1.5, prior="gaussian"
    )
    horseshoe = HorseshoeBNN.from_state_dict({**bnn.state_dict(), "prior_scales": torch.tensor([0.5, 1.5])})
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 3, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)
    R = 1000
    with torch.no_grad():
        draws = {m.prior: np.array([negative_elbo(m, x, y, 40, g).item() for _ in range(R)]) for m in (bnn, horseshoe)}
    se = math.sqrt(sum(d.var() / R for d in draws.values()))
    assert abs(draws["horseshoe"].mean() - draws["gaussian"].mean()) > 10 * se


def test_gaussian_bnns_train_and_keep_their_scales_fixed(gaussian_clients, digits):
    bnns, part = gaussian_clients
    for bnn in bnns:
        assert bnn.prior == "gaussian"
        assert float(bnn.loc["log_tau"]) == 0.0 and not bnn.loc["log_lam"].any()  # log 1 and 0: untouched
        assert bnn.elbo_history[-1] < bnn.elbo_history[0]
    # the largest client (about 500 digits, 40 epochs) well above chance (0.1)
    largest = int(np.argmax(part.sizes))
    assert accuracy(bnns[largest].predict(digits.test.x, 50), digits.test.y) > 0.7


def test_a_saved_gaussian_bnn_loads_with_its_prior(gaussian_clients, digits, tmp_path):
    from bayesfuse import load

    bnn = gaussian_clients[0][0]
    torch.save(bnn.state_dict(), tmp_path / "client.pt")
    back = load(tmp_path / "client.pt")
    assert back.prior == "gaussian" and back.fixed_sites() == ("log_tau", "log_lam")
    np.testing.assert_array_equal(back.predict(digits.test.x[:30], 20), bnn.predict(digits.test.x[:30], 20))


@pytest.mark.parametrize("method", ["kl", "nafi"])
def test_gaussian_bnns_fuse_into_a_gaussian_bnn(gaussian_clients, digits, method):
    bnns, part = gaussian_clients
    fused = fuse(bnns, method, class_counts=part.counts)
    assert fused.model.prior_spec == Prior("gaussian", 1.0, 1.0)
    draws = fused.model.sample_params(3)
    # the fused scales are the clients' fixed ones, up to the round-off of a barycentre of equal values
    np.testing.assert_allclose(draws["log_tau"].numpy(), 0.0, atol=1e-12)
    np.testing.assert_allclose(draws["log_lam"].numpy(), 0.0, atol=1e-12)
    assert accuracy(fused.model.predict(digits.test.x, 50), digits.test.y) > 0.5


def test_fusing_different_priors_is_refused_in_one_line(gaussian_clients, digits):
    gaussian = gaussian_clients[0][0]
    horseshoe = train_bnn(digits.train.x[:200], digits.train.y[:200], 10, hidden=16, config=BNNConfig(epochs=2))
    wider = train_bnn(
        digits.train.x[:200], digits.train.y[:200], 10, hidden=16, config=BNNConfig(epochs=2), global_scale=0.3
    )
    for models, first, second in [
        ([horseshoe, gaussian], "horseshoe(global_scale=0.1, weight_scale=1)", "gaussian(scale=1, weight_scale=1)"),
        (
            [horseshoe, wider],
            "horseshoe(global_scale=0.1, weight_scale=1)",
            "horseshoe(global_scale=0.3, weight_scale=1)",
        ),
    ]:
        for method in ("kl", "pfnm"):
            with pytest.raises(ValueError, match="cannot fuse BNNs trained with different priors") as info:
                fuse(models, method)
            message = str(info.value)
            assert len(message.splitlines()) == 1
            # both priors are named, each beside its client (the caller's indices, whatever order they are fused in)
            assert f"client 0 has {first}" in message and f"client 1 has {second}" in message


def test_the_command_line_refuses_different_priors_naming_the_files(gaussian_clients, digits, tmp_path, capsys):
    from bayesfuse.cli import main

    horseshoe = train_bnn(digits.train.x[:200], digits.train.y[:200], 10, hidden=16, config=BNNConfig(epochs=2))
    torch.save(horseshoe.state_dict(), tmp_path / "site_a.pt")
    torch.save(gaussian_clients[0][0].state_dict(), tmp_path / "site_b.pt")
    assert (
        main(
            [
                "fuse",
                str(tmp_path / "site_a.pt"),
                str(tmp_path / "site_b.pt"),
                "--method",
                "kl",
                "--out",
                str(tmp_path / "fused.pt"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "different priors" in err
    assert "site_a.pt has horseshoe(global_scale=0.1, weight_scale=1)" in err
    assert "site_b.pt has gaussian(scale=1, weight_scale=1)" in err
    assert not (tmp_path / "fused.pt").exists()


def test_the_command_line_fuses_gaussian_bnns_into_one(gaussian_clients, tmp_path):
    from bayesfuse import load
    from bayesfuse.fuse_files import fuse_files

    paths = []
    for j, bnn in enumerate(gaussian_clients[0]):
        paths.append(tmp_path / f"client{j}.pt")
        torch.save(bnn.state_dict(), paths[-1])
    fuse_files(paths, "kl", tmp_path / "fused.pt")
    assert load(tmp_path / "fused.pt").prior_spec == Prior("gaussian", 1.0, 1.0)
