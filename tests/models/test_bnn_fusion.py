"""Fusing horseshoe BNNs of two hidden layers, layer by layer (bayesfuse.models.bnn_fusion)."""

import numpy as np
import pytest

from bayesfuse.core import fuse_states
from bayesfuse.data import load_digits
from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.models.bnn import BNNConfig, HorseshoeBNN, train_bnn
from bayesfuse.models.bnn_posterior import DeepBNNPosterior, HiddenLayer
from tests.helpers import varied_bnn

pytestmark = pytest.mark.filterwarnings("ignore:only one model", "ignore:KL-fusion did not converge")


def _posterior(seed: int, hidden=(5, 4), D: int = 6, K: int = 3, spread: float = 1.0) -> DeepBNNPosterior:
    """A deep guide with varied means and variances (the initial guide is too uniform to test much)."""
    bnn = varied_bnn(D, hidden, K, seed=seed, spread=spread, scale_low=0.05, scale_span=0.3, global_scale=0.3)
    return DeepBNNPosterior.from_state(bnn.state_dict())


def _logits(post: DeepBNNPosterior, x: np.ndarray) -> np.ndarray:
    """The network at its guide's means, every unit's scale at its median exp(E[log tau + log lambda])."""
    h = x
    for layer in post.layers:
        w, b = layer.incoming.loc[:, :-1], layer.incoming.loc[:, -1]
        s = np.exp(layer.log_lam.loc[:, 0] + layer.log_tau.loc[0, 0])
        h = np.maximum(s * (h @ w.T + b), 0.0)
    return h @ post.out_weights.loc + post.out_bias.loc[0]


def _fused(posts, method="kl", **hyper) -> tuple[DeepBNNPosterior, object]:
    res = fuse_states([p.to_state() for p in posts], method, **hyper)
    return DeepBNNPosterior.from_state(res.state), res


def _permuted(post: DeepBNNPosterior, perms) -> DeepBNNPosterior:
    """The same network with each hidden layer's units reordered by ``perms`` (outgoing weights follow)."""
    layers, below = [], None
    for layer, p in zip(post.layers, perms):
        inc = layer.incoming[p]
        if below is not None:  # column c reads the unit now at position c of the layer below: old unit below[c]
            cols = np.append(below, len(below))
            inc = DiagNormal(loc=inc.loc[:, cols], var=inc.var[:, cols])
        layers.append(HiddenLayer(incoming=inc, log_lam=layer.log_lam[p], log_tau=layer.log_tau))
        below = p
    return DeepBNNPosterior(
        tuple(layers),
        post.out_weights[perms[-1]],
        post.out_bias,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    )


def _rescaled(post: DeepBNNPosterior, index: int, c: float, d: np.ndarray) -> DeepBNNPosterior:
    """Hidden layer ``index``: tau -> c tau, lambda_k -> d_k lambda_k, (w~_k, b~_k) / (c d_k): the same function."""
    layer = post.layers[index]
    f = (c * d)[:, None]
    moved = HiddenLayer(
        incoming=DiagNormal(loc=layer.incoming.loc / f, var=layer.incoming.var / f**2),
        log_lam=DiagNormal(loc=layer.log_lam.loc + np.log(d)[:, None], var=layer.log_lam.var),
        log_tau=DiagNormal(loc=layer.log_tau.loc + np.log(c), var=layer.log_tau.var),
    )
    layers = list(post.layers)
    layers[index] = moved
    return DeepBNNPosterior(
        tuple(layers),
        post.out_weights,
        post.out_bias,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    )


X = np.random.default_rng(0).normal(size=(40, 6))


def test_one_client_fuses_to_its_own_function():
    post = _posterior(0)
    fused, res = _fused([post], prune_kl=0.0)
    assert res.sizes == [5, 4] and res.groups == ("units", "units2")
    np.testing.assert_allclose(_logits(fused, X), _logits(post, X), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["kl", "nafi"])
def test_a_permuted_copy_fuses_back_to_the_network(method):
    post = _posterior(1)
    copy = _permuted(post, [np.array([3, 0, 4, 1, 2]), np.array([2, 3, 1, 0])])
    np.testing.assert_allclose(_logits(copy, X), _logits(post, X), rtol=1e-12)  # the same function
    extra = {} if method == "kl" else {"noise_var": 1.0}
    fused, res = _fused([post, copy], method, prune_kl=0.0, **extra)
    assert res.sizes == [5, 4]
    # layer 2's units were matched in the basis of the fused layer 1: each pairs a unit with its copy
    a, b = res.layers[1].assignments
    np.testing.assert_array_equal(b, a[np.array([2, 3, 1, 0])])  # the copy's unit i is the network's unit p[i]
    np.testing.assert_allclose(_logits(fused, X), _logits(post, X), rtol=1e-7, atol=1e-9)


def test_a_client_rescaled_in_its_second_layer_fuses_to_the_same_function():
    # In the effective form, splitting layer 2's scale differently changes nothing; in the raw form it does.
    a, b = _posterior(2), _posterior(3)
    moved = _rescaled(b, 1, 7.0, np.linspace(0.2, 5.0, 4))
    np.testing.assert_allclose(_logits(moved, X), _logits(b, X), rtol=1e-10, atol=1e-12)

    def fused(q, form):
        return _logits(_fused([a, q], unit_form=form, prune_kl=0.0)[0], X)

    np.testing.assert_allclose(fused(moved, "effective"), fused(b, "effective"), rtol=1e-8, atol=1e-10)
    assert np.abs(fused(moved, "raw") - fused(b, "raw")).max() > 1e-3


@pytest.mark.parametrize("counts", [None, np.array([[30.0, 0.0, 10.0], [10.0, 20.0, 0.0]])])
def test_disjoint_clients_fuse_to_the_class_share_average_of_their_logits(counts):
    # No unit merges in either layer (b's first-layer units are far from a's, and its second-layer
    # units read other global units): each fused unit of layer 2 reads only its own client's units
    # below, with weight 0 on the other client's (the matched basis), so the fused logits are
    # sum_j f_jk logit_jk exactly.
    a = _posterior(4, hidden=(3, 2), spread=0.3)
    b = _posterior(5, hidden=(4, 3), spread=0.3)
    first = b.layers[0]
    far = HiddenLayer(
        incoming=DiagNormal(loc=first.incoming.loc + 8.0, var=first.incoming.var),
        log_lam=first.log_lam,
        log_tau=first.log_tau,
    )
    b = DeepBNNPosterior(
        (far, b.layers[1]), b.out_weights, b.out_bias, b.in_features, b.n_classes, b.global_scale, b.weight_scale
    )
    fused, res = _fused([a, b], class_counts=counts, reg=1e-6, prune_kl=0.0)
    assert res.sizes == [7, 5]
    shares = np.full((2, 3), 0.5) if counts is None else counts / counts.sum(0)
    np.testing.assert_allclose(
        _logits(fused, X), shares[0] * _logits(a, X) + shares[1] * _logits(b, X), rtol=1e-9, atol=1e-9
    )
    # the second layer's weights from the other client's first-layer units are 0, with a variance
    # of ~0 (1e-12 of the unit's others), so that no Monte Carlo draw reads an input the unit's
    # client lacks; the weights it reads keep their variances
    g1_a, g1_b = res.layers[0].assignments
    g2_a, g2_b = res.layers[1].assignments
    w, v = fused.layers[1].incoming.loc[:, :-1], fused.layers[1].incoming.var[:, :-1]
    for own, own_below, other_below in ((g2_a, g1_a, g1_b), (g2_b, g1_b, g1_a)):
        np.testing.assert_array_equal(w[np.ix_(own, other_below)], 0.0)
        assert np.abs(w[np.ix_(own, own_below)]).min() > 0
        read = v[np.ix_(own, own_below)]
        assert (v[np.ix_(own, other_below)] <= 1e-11 * read.max(1, keepdims=True)).all()
        assert read.min() > 1e-6 * read.max()


@pytest.mark.parametrize("method, hyper", [("kl", {}), ("kl", {"unit_form": "raw"}), ("pfnm", {}), ("nafi", {})])
def test_a_fused_unit_reads_only_the_units_below_that_some_member_reads(method, hyper):
    # Three clients of three hidden layers, units merged and pruned as the defaults do: a fused unit
    # g of layer l >= 2 reads global unit u below exactly when one of its members' clients has a
    # kept unit matched to u (the union over members, computed here from the assignments alone);
    # every other weight is 0 with a variance of ~0 (1e-12 of the row's mean).
    posts = [_posterior(seed, hidden=(6, 5, 4), spread=0.3) for seed in (1, 2, 3)]
    fused, res = _fused(posts, method, **hyper)
    layers = [r.assignments for r in res.layers]
    for index in range(1, 3):
        incoming = fused.layers[index].incoming
        n_below = incoming.loc.shape[1] - 1
        read = np.zeros((len(incoming), n_below), dtype=bool)
        for j in range(3):
            for g in np.asarray(layers[index][j]):
                read[g, np.asarray(layers[index - 1][j])] = True
        w, v = incoming.loc[:, :-1], incoming.var[:, :-1]
        assert (~read).any() and read.any()
        np.testing.assert_array_equal(w[~read], 0.0)
        tiny = (v <= 1e-11 * v.mean(1, keepdims=True)) & (v > 0)
        np.testing.assert_array_equal(tiny, ~read)


def test_pruning_reads_each_layer_and_drops_the_columns_of_pruned_units_below():
    post = _posterior(6)
    other = _posterior(7)
    # switch off unit 1 of layer 1 and unit 2 of layer 2 of `post`: incoming weights at the prior
    layers = list(post.layers)
    for index, unit in ((0, 1), (1, 2)):
        inc = layers[index].incoming
        loc, var = inc.loc.copy(), inc.var.copy()
        loc[unit], var[unit] = 0.0, 1.0
        layers[index] = HiddenLayer(DiagNormal(loc=loc, var=var), layers[index].log_lam, layers[index].log_tau)
    post = DeepBNNPosterior(
        tuple(layers),
        post.out_weights,
        post.out_bias,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    )
    _, res = _fused([post, other], prune_kl=1.0)
    kept = res.hyper["kept_units"]
    assert kept[0][0] == [0, 2, 3, 4] and kept[1][0] == [0, 1, 3]
    assert [len(a) for a in res.layers[0].assignments] == [4, len(kept[0][1])]


def test_pfnm_fuses_deep_bnns_too():
    fused, res = _fused([_posterior(8), _posterior(9)], "pfnm")
    assert len(fused.layers) == 2 and res.sizes == list(fused.hidden_sizes)
    assert np.isfinite(_logits(fused, X)).all()


def test_fused_two_layer_bnns_on_digits_beat_their_average_client():
    data = load_digits().standardize()
    rng = np.random.default_rng(0)
    parts = np.array_split(rng.permutation(len(data.train.x)), 3)
    bnns, counts = [], []
    for i, p in enumerate(parts):
        bnns.append(
            train_bnn(data.train.x[p], data.train.y[p], 10, (40, 30), BNNConfig(epochs=80, seed=i), verbose=False)
        )
        counts.append(np.bincount(data.train.y[p], minlength=10))
    local = [(b.predict(data.test.x, 30).argmax(1) == data.test.y).mean() for b in bnns]
    res = fuse_states([b.state_dict() for b in bnns], "kl", class_counts=np.array(counts))
    fused = HorseshoeBNN.from_state_dict(res.state)
    acc = (fused.predict(data.test.x, 30).argmax(1) == data.test.y).mean()
    # (clients of 600 examples keep every unit: pruning reads a converged guide, bnn_units)
    assert res.sizes[0] <= sum(b.hidden_sizes[0] for b in bnns)
    assert acc > np.mean(local), (acc, local)
