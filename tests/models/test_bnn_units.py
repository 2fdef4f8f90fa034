"""Units of BNN posteriors: pruning, the scale-free form, and the fused output layer."""

import numpy as np
import pytest
import torch

from bayesfuse.core import fuse_states
from bayesfuse.data import load_digits
from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.models.bnn import BNNConfig, train_bnn
from bayesfuse.models.bnn_posterior import BNNPosterior, DeepBNNPosterior
from bayesfuse.models.bnn_units import (
    effective_layer,
    effective_units,
    informative_units,
    split_effective,
    unit_information,
)
from tests.helpers import varied_bnn

pytestmark = pytest.mark.filterwarnings("ignore:only one model", "ignore:KL-fusion did not converge")


def _posterior(seed: int, H: int = 6, D: int = 5, K: int = 3, spread: float = 1.0) -> BNNPosterior:
    """A guide with varied means and variances (the initial guide is too uniform to test much)."""
    bnn = varied_bnn(D, H, K, seed=seed, spread=spread, scale_low=0.05, scale_span=0.3, global_scale=0.3)
    return BNNPosterior.from_bnn(bnn)


def _logits(post: BNNPosterior, x: np.ndarray) -> np.ndarray:
    """The network at its guide's means with every unit's scale at its median exp(E[log tau + log lambda])."""
    w1, b1, lam, w2 = (post.units.loc[:, post.columns(s)] for s in ("w1", "b1", "log_lam", "w2"))
    s = np.exp(lam[:, 0] + post.log_tau.loc[0, 0])
    h = np.maximum(s * (x @ w1.T + b1[:, 0]), 0.0)
    return h @ w2 + post.out_bias.loc[0]


def _rescaled(post: BNNPosterior, c: float, d: np.ndarray) -> BNNPosterior:
    """tau -> c tau, lambda_k -> d_k lambda_k, (w~_k, b~_k) -> (w~_k, b~_k) / (c d_k): the same function."""
    loc, var = post.units.loc.copy(), post.units.var.copy()
    for site in ("w1", "b1"):
        cols = post.columns(site)
        loc[:, cols] /= (c * d)[:, None]
        var[:, cols] /= ((c * d) ** 2)[:, None]
    loc[:, post.columns("log_lam")] += np.log(d)[:, None]
    tau = DiagNormal(loc=post.log_tau.loc + np.log(c), var=post.log_tau.var)
    return BNNPosterior(
        DiagNormal(loc=loc, var=var),
        post.out_bias,
        tau,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    )


def test_unit_information_is_the_kl_to_the_prior():
    post = _posterior(0)
    cols = slice(0, post.in_features + 1)
    q = torch.distributions.Normal(
        torch.as_tensor(post.units.loc[:, cols]), torch.as_tensor(post.units.var[:, cols]).sqrt()
    )
    p = torch.distributions.Normal(torch.zeros(()), torch.ones(()).double())
    expected = torch.distributions.kl_divergence(q, p).sum(1).numpy()
    np.testing.assert_allclose(unit_information(post), expected, rtol=1e-12)


def test_pruning_keeps_informative_units_and_at_least_one():
    post = _posterior(1)
    loc, var = post.units.loc.copy(), post.units.var.copy()
    prior_like = [1, 4]
    loc[prior_like, : post.in_features + 1], var[prior_like, : post.in_features + 1] = 0.0, 1.0  # KL exactly 0
    post = BNNPosterior(
        DiagNormal(loc=loc, var=var),
        post.out_bias,
        post.log_tau,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    )
    keep = informative_units(post, 1.0)
    assert keep.tolist() == [i not in prior_like for i in range(post.hidden)]
    assert informative_units(post, 0.0).all()
    only = informative_units(post, 1e9)  # nothing reaches it: the most informative unit stays
    assert only.sum() == 1 and only[np.argmax(unit_information(post))]
    with pytest.raises(ValueError, match="min_kl"):
        informative_units(post, -1.0)


def test_pruning_a_trained_bnn_keeps_its_predictions():
    # Units the horseshoe switched off have scales ~1e-3 and prior-like weights: dropping them
    # leaves the network's test accuracy where it was (within 1 of 450 test images here).
    data = load_digits().standardize()
    bnn = train_bnn(data.train.x, data.train.y, 10, 60, BNNConfig(epochs=60, seed=0), verbose=False)
    post = BNNPosterior.from_bnn(bnn)
    keep = informative_units(post)
    assert 0 < keep.sum() < post.hidden  # the horseshoe did switch some off
    pruned = BNNPosterior(
        post.units[keep],
        post.out_bias,
        post.log_tau,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    )
    full, cut = _logits(post, data.test.x), _logits(pruned, data.test.x)
    changed = np.sum(full.argmax(1) != cut.argmax(1))
    assert changed <= 1
    assert np.abs(full - cut).max() < 0.05 * np.abs(full).max()


def test_effective_form_round_trips_one_client_exactly():
    post = _posterior(2)
    layer = DeepBNNPosterior.from_state(post.to_state()).layers[0]
    back = split_effective(*effective_layer(layer), layer.log_tau)
    for got, want in ((back.incoming, layer.incoming), (back.log_lam, layer.log_lam)):
        np.testing.assert_allclose(got.loc, want.loc, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(got.var, want.var, rtol=1e-12)
    np.testing.assert_array_equal(back.log_tau.loc, post.log_tau.loc)


def test_effective_form_is_invariant_to_the_scale_split():
    post = _posterior(3)
    moved = _rescaled(post, 7.0, np.linspace(0.2, 5.0, post.hidden))
    x = np.random.default_rng(0).normal(size=(20, post.in_features))
    np.testing.assert_allclose(_logits(moved, x), _logits(post, x), rtol=1e-10, atol=1e-12)  # the same function
    a, b = effective_units(post), effective_units(moved)
    np.testing.assert_allclose(b.weights.loc, a.weights.loc, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(b.weights.var, a.weights.var, rtol=1e-12)
    np.testing.assert_allclose(b.log_scale.var, a.log_scale.var, rtol=1e-12)


@pytest.mark.parametrize("method", ["kl", "nafi"])
def test_a_rescaled_client_fuses_to_the_same_function(method):
    # Two clients; the second's scales are split differently (tau x 7, lambdas x 0.2..5, weights
    # divided to match). In the effective form the fused network computes the same function.
    # In the raw form it does not: the test can tell the two apart.
    a, b = _posterior(4), _posterior(5)
    moved = _rescaled(b, 7.0, np.linspace(0.2, 5.0, b.hidden))
    x = np.random.default_rng(1).normal(size=(30, a.in_features))
    extra = {} if method == "kl" else {"noise_var": 1.0}

    def fused(p, q, form):
        res = fuse_states([p.to_state(), q.to_state()], method, unit_form=form, prune_kl=0.0, **extra)
        return _logits(BNNPosterior.from_state(res.state), x)

    np.testing.assert_allclose(fused(a, moved, "effective"), fused(a, b, "effective"), rtol=1e-8, atol=1e-10)
    assert np.abs(fused(a, moved, "raw") - fused(a, b, "raw")).max() > 1e-3


def test_one_client_fuses_to_its_own_function():
    post = _posterior(6)
    x = np.random.default_rng(2).normal(size=(25, post.in_features))
    res = fuse_states([post.to_state()], "kl", prune_kl=0.0)
    np.testing.assert_allclose(_logits(BNNPosterior.from_state(res.state), x), _logits(post, x), rtol=1e-9, atol=1e-12)


def _disjoint_clients():
    """Two clients whose units point in opposite directions: KL-fusion at a tiny reg merges none."""
    a = _posterior(7, H=3, spread=0.3)
    b = _posterior(8, H=4, spread=0.3)
    loc = b.units.loc.copy()
    loc[:, : b.in_features] += 8.0  # far from every unit of a
    b = BNNPosterior(
        DiagNormal(loc=loc, var=b.units.var),
        b.out_bias,
        b.log_tau,
        b.in_features,
        b.n_classes,
        b.global_scale,
        b.weight_scale,
    )
    return a, b


@pytest.mark.parametrize("counts", [None, np.array([[30.0, 0.0, 10.0], [10.0, 20.0, 0.0]])])
def test_average_outputs_averages_the_clients_logits_by_class_share(counts):
    # With no unit merged, every fused unit is one client's own, and the fused logit of class k
    # is sum_j f_jk logit_jk with f_jk = n_jk / sum_j n_jk (1/2 each without counts).
    a, b = _disjoint_clients()
    x = np.random.default_rng(3).normal(size=(40, a.in_features))
    # (the effective form keeps each unit's scale; the raw form would move it with the fused tau)
    res = fuse_states([a.to_state(), b.to_state()], "kl", class_counts=counts, reg=1e-6, prune_kl=0.0)
    assert res.sizes == [a.hidden + b.hidden]
    shares = np.full((2, 3), 0.5) if counts is None else counts / counts.sum(0)
    expected = shares[0] * _logits(a, x) + shares[1] * _logits(b, x)
    fused = BNNPosterior.from_state(res.state)
    np.testing.assert_allclose(_logits(fused, x), expected, rtol=1e-9, atol=1e-9)
    # without average_outputs the fused network adds every unit in full: the logits sum, not average
    plain = BNNPosterior.from_state(
        fuse_states(
            [a.to_state(), b.to_state()], "kl", class_counts=counts, reg=1e-6, prune_kl=0.0, average_outputs=False
        ).state
    )
    bias = DiagNormal.concat([a.out_bias, b.out_bias]).barycenter(np.ones(2)).loc[0]  # the biases' KL barycenter
    summed = _logits(a, x) - a.out_bias.loc[0] + _logits(b, x) - b.out_bias.loc[0] + bias
    np.testing.assert_allclose(_logits(plain, x), summed, rtol=1e-9, atol=1e-9)


def test_merged_outgoing_weights_are_the_scaled_mixture_of_their_members():
    # Two copies of one client whose outgoing weights differ: each global unit merges one unit of
    # each; its outgoing weight to class k is c_gk times the moment-matched mixture of the two
    # (weights f_jk / c_gk), c_gk = f_0k + f_1k = 1: mean f0 m0 + f1 m1, variance
    # f0 (v0 + m0^2) + f1 (v1 + m1^2) - mean^2.
    a = _posterior(9, H=4)
    loc = a.units.loc.copy()
    out = a.columns("w2")
    loc[:, out] += 0.3
    b = BNNPosterior(
        DiagNormal(loc=loc, var=a.units.var * 1.5),
        a.out_bias,
        a.log_tau,
        a.in_features,
        a.n_classes,
        a.global_scale,
        a.weight_scale,
    )
    counts = np.array([[5.0, 1.0, 2.0], [1.0, 3.0, 2.0]])
    res = fuse_states([a.to_state(), b.to_state()], "kl", class_counts=counts, reg=10.0, prune_kl=0.0, unit_form="raw")
    assert res.sizes == [a.hidden]
    layer = res.layers[0]
    f = counts / counts.sum(0)
    fused = BNNPosterior.from_state(res.state)
    for u in range(a.hidden):
        g0, g1 = layer.assignments[0][u], layer.assignments[1][u]
        assert g0 == g1
        m0, m1 = a.units.loc[u, out], b.units.loc[u, out]
        v0, v1 = a.units.var[u, out], b.units.var[u, out]
        mean = f[0] * m0 + f[1] * m1
        np.testing.assert_allclose(fused.units.loc[g0, out], mean, rtol=1e-10)
        np.testing.assert_allclose(
            fused.units.var[g0, out], f[0] * (v0 + m0**2) + f[1] * (v1 + m1**2) - mean**2, rtol=1e-8
        )
