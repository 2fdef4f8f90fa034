"""Pruning BNN units by what they contribute on the clients' data (client summaries), against the
data-free rule that reads how far a unit's guide sits from its prior."""

import numpy as np
import pytest
import torch

from bayesfuse import fuse, summarize
from bayesfuse.core import fuse_states
from bayesfuse.data import load_digits
from bayesfuse.inference.bnn.units import keep_contributing, unit_contributions
from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.models.bnn import BNNConfig, HorseshoeBNN, train_bnn
from bayesfuse.models.bnn_posterior import DeepBNNPosterior
from bayesfuse.summaries import STATS, SummaryError, load_summary, save_summary
from tests.helpers import varied_bnn

pytestmark = pytest.mark.filterwarnings("ignore:only one model", "ignore:KL-fusion did not converge")


def _bnn(seed: int, hidden=(5, 4), D: int = 6, K: int = 3) -> HorseshoeBNN:
    return varied_bnn(D, hidden, K, seed=seed, spread=1.0, scale_low=0.05, scale_span=0.3, global_scale=0.3)


def _hidden(bnn: HorseshoeBNN, x: np.ndarray, drop: tuple[int, int] | None = None) -> list[np.ndarray]:
    """Each layer's (pre-activation, activation) at the guide's means, written out in NumPy;
    ``drop=(layer, unit)`` sets that unit's activation to 0."""
    p = {k: v.detach().numpy() for k, v in bnn.loc.items()}
    h, out = x, []
    for layer in range(1, bnn.depth + 1):
        tag = "" if layer == 1 else str(layer)
        s = np.exp(p[f"log_tau{tag}"] + p[f"log_lam{tag}"])
        pre = (h @ p[f"w{layer}"].T + p[f"b{layer}"]) * s
        h = np.maximum(pre, 0.0)
        if drop is not None and drop[0] == layer:
            h = h.copy()
            h[:, drop[1]] = 0.0
        out.append((pre, h))
    logits = h @ p[f"w{bnn.depth + 1}"].T + p[f"b{bnn.depth + 1}"]
    return out + [(logits, None)]


def test_unit_moments_are_the_moments_of_each_layer_written_out():
    bnn = _bnn(0)
    x = np.random.default_rng(0).normal(size=(50, 6))
    moments = bnn.unit_moments(x, batch_size=7)  # several batches
    assert sorted(moments) == ["units", "units2"]
    for group, (pre, act) in zip(("units", "units2"), _hidden(bnn, x)):
        np.testing.assert_allclose(moments[group]["pre_mean"], pre.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(moments[group]["pre_var"], pre.var(0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(moments[group]["act_mean"], act.mean(0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(moments[group]["act_var"], act.var(0), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"x must be \(n, 6\)"):
        bnn.unit_moments(x[:, :5])


@pytest.mark.parametrize("layer", [1, 2])
def test_a_units_contribution_is_what_dropping_it_takes_out_of_the_layer_above(layer):
    """At the guide's means (variances 0) the contribution of unit k is exactly the mean square
    change of the next pre-activations (or logits) when unit k's activation is set to 0."""
    bnn = _bnn(1)
    x = np.random.default_rng(1).normal(size=(200, 6))
    post = DeepBNNPosterior.from_state(bnn.state_dict())
    above = post.out_weights if layer == 2 else post.layers[1]
    if layer == 2:
        outgoing = DiagNormal(loc=above.loc, var=np.full_like(above.var, 1e-300))  # ~0: DiagNormal needs var > 0
    else:
        from bayesfuse.models.bnn_units import effective_layer

        eff, _ = effective_layer(above)
        outgoing = DiagNormal(loc=eff.loc[:, :5].T, var=np.full((5, eff.loc.shape[0]), 1e-300))
    stats = bnn.unit_moments(x)["units" if layer == 1 else "units2"]
    c = unit_contributions(stats["act_mean"], stats["act_var"], outgoing)
    full = _hidden(bnn, x)[layer][0]  # the next layer's pre-activations (or the logits)
    for k in range(len(c)):
        cut = _hidden(bnn, x, drop=(layer, k))[layer][0]
        np.testing.assert_allclose(c[k], np.mean(np.sum((full - cut) ** 2, axis=1)), rtol=1e-10, atol=1e-14)
    # the weights' variances add E[h_k^2] sum_i var_ik
    noisy = DiagNormal(loc=outgoing.loc, var=np.full_like(outgoing.loc, 0.5))
    second = stats["act_var"] + stats["act_mean"] ** 2
    np.testing.assert_allclose(
        unit_contributions(stats["act_mean"], stats["act_var"], noisy) - c, second * 0.5 * outgoing.loc.shape[1]
    )


def test_keep_contributing_drops_the_smallest_units_under_the_share():
    rng = np.random.default_rng(2)
    for _ in range(50):
        c = rng.exponential(size=12) ** 3
        share = rng.uniform(0.0, 0.5)
        keep = keep_contributing(c, share)
        dropped, kept = c[~keep], c[keep]
        assert dropped.sum() <= share * c.sum()
        if (~keep).any():
            assert dropped.max() <= kept.min()  # only the smallest go
        # one more unit (the smallest kept) would reach the share
        assert dropped.sum() + kept.min() > share * c.sum() or keep.sum() == 1
    assert keep_contributing(c, 0.0).all()
    assert keep_contributing(c, 0.999999).sum() == 1 and keep_contributing(c, 0.999999)[np.argmax(c)]
    assert keep_contributing(np.zeros(4), 0.5).sum() == 1  # dead units go, but one unit stays
    with pytest.raises(ValueError, match="share"):
        keep_contributing(c, 1.0)


def _unused_unit_client() -> tuple[HorseshoeBNN, np.ndarray]:
    """A one-layer client whose unit 2 is still at a guide's start (means of order 1/sqrt(D),
    standard deviation 0.01: far from the prior N(0, 1)) but whose outgoing weights are 0: the
    network does not use it."""
    bnn = _bnn(3, hidden=6)
    with torch.no_grad():
        bnn.loc["w1"][2].normal_(0.0, 6**-0.5)
        bnn.log_scale["w1"][2].fill_(np.log(0.01))
        bnn.log_scale["b1"][2].fill_(np.log(0.01))
        bnn.loc["w2"][:, 2] = 0.0
        bnn.log_scale["w2"][:, 2] = np.log(1e-3)
    return bnn, np.random.default_rng(3).normal(size=(100, 6))


def test_function_pruning_drops_a_unit_the_network_does_not_use_wherever_its_guide_is():
    bnn, x = _unused_unit_client()
    other = _bnn(4, hidden=6)
    y = np.arange(100) % 3
    states = [bnn.state_dict(), other.state_dict()]
    data_free = fuse_states(states, "kl", prune_kl=1.0)
    assert data_free.hyper["kept_units"][0] == list(range(6))  # far from the prior: "informative"
    summaries = [summarize(b, x, y) for b in (bnn, other)]
    by_function = fuse_states(states, "kl", summaries=summaries)
    assert 2 not in by_function.hyper["kept_units"][0]
    assert by_function.hyper["pruning"].startswith("function")
    assert by_function.hyper["summaries"]["used"] is True
    # prune_share=0 keeps every unit, as prune_kl=0 does
    everything = fuse_states(states, "kl", summaries=summaries, prune_share=0.0)
    assert everything.hyper["kept_units"] == [list(range(6)), list(range(6))]


def test_one_client_with_its_summary_fuses_to_its_own_function():
    bnn = _bnn(5)
    x = np.random.default_rng(5).normal(size=(80, 6))
    summary = summarize(bnn, x, np.arange(80) % 3)
    res = fuse_states([bnn.state_dict()], "kl", summaries=[summary], prune_share=0.0)
    fused = DeepBNNPosterior.from_state(res.state)
    original = DeepBNNPosterior.from_state(bnn.state_dict())
    for a, b in zip(fused.layers, original.layers):
        np.testing.assert_allclose(
            a.incoming.loc * np.exp(a.log_lam.loc + a.log_tau.loc),
            b.incoming.loc * np.exp(b.log_lam.loc + b.log_tau.loc),
            rtol=1e-6,
            atol=1e-9,
        )


def test_bnn_summaries_are_checked_and_saved(tmp_path):
    bnn = _bnn(6)
    x = np.random.default_rng(6).normal(size=(40, 6))
    summary = summarize(bnn, x, np.arange(40) % 3)
    assert summary.precision == {} and sorted(summary.moments) == ["units", "units2"]
    assert all(sorted(s) == sorted(STATS) for s in summary.moments.values())
    assert summary.nbytes == 4 * 4 * (5 + 4) + 8 * 3  # four floats per unit and the class counts
    back = load_summary(save_summary(summary, tmp_path / "c.summary.safetensors"))
    res = fuse_states(
        [bnn.state_dict(), _bnn(7).state_dict()], "kl", summaries=[back, summarize(_bnn(7), x, np.arange(40) % 3)]
    )
    assert res.hyper["pruning"].startswith("function")
    broken = summarize(bnn, x, np.arange(40) % 3)
    broken.moments["units2"]["act_var"] = np.ones(3)
    with pytest.raises(SummaryError, match="b: moment act_var of 'units2' has shape"):
        fuse_states([bnn.state_dict()], "kl", summaries=[broken], names=["b"])
    del broken.moments["units2"]
    with pytest.raises(SummaryError, match="no moments .* of hidden layer 2"):
        fuse_states([bnn.state_dict()], "kl", summaries=[broken], names=["b"])
    with pytest.raises(SummaryError, match="the summary is of another network"):
        fuse_states([_bnn(7).state_dict()], "kl", summaries=[summary])
    with pytest.raises(ValueError, match="output_pool='counts' is for point-estimate networks"):
        fuse_states([bnn.state_dict()], "kl", summaries=[summary], output_pool="counts")
    with pytest.raises(ValueError, match="spec= is for point-estimate networks"):
        summarize(bnn, x, np.arange(40) % 3, spec=object())


def test_briefly_trained_bnns_fuse_with_their_summaries_in_any_order():
    data = load_digits(seed=0).standardize()
    x, y = data.train.x[:600], data.train.y[:600]
    parts = [np.arange(0, 300), np.arange(300, 600)]
    bnns = [train_bnn(x[i], y[i], 10, 40, BNNConfig(epochs=5, seed=j)) for j, i in enumerate(parts)]
    summaries = [summarize(b, x[i], y[i]) for b, i in zip(bnns, parts)]
    res = fuse(bnns, "kl", summaries=summaries)
    flipped = fuse(bnns[::-1], "kl", summaries=summaries[::-1])
    np.testing.assert_array_equal(res.model.predict(data.test.x, 20), flipped.model.predict(data.test.x, 20))
    kept = res.hyper["kept_units"]
    # every unit kept carries more than any dropped one, on its own client's data
    assert 1 <= len(kept[0]) <= 40 and res.hyper["pruning"].startswith("function")
