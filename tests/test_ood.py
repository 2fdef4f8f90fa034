"""The OOD report: AUROC against scikit-learn, bootstrap intervals against their theory, the table and the figure."""

import io

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import roc_auc_score

from bayesfuse.baselines import Ensemble
from bayesfuse.metrics import (
    bootstrap_ood_auroc,
    ood_auroc,
    ood_auroc_interval,
    ood_roc_curve,
    predictive_entropy,
)
from bayesfuse.nets import MLP, predict_proba
from bayesfuse.ood import plot_report, report
from tests.helpers import varied_bnn


def _scores(n_in, n_out, seed=0, shift=1.0, decimals=None):
    """In-distribution scores N(0, 1), OOD scores N(shift, 1): AUROC Phi(shift / sqrt 2) = 0.760 for shift 1."""
    rng = np.random.default_rng(seed)
    s_in, s_out = rng.normal(size=n_in), rng.normal(shift, 1.0, size=n_out)
    return (s_in, s_out) if decimals is None else (s_in.round(decimals), s_out.round(decimals))


def _delong_se(s_in, s_out) -> float:
    """DeLong et al. (1988): the AUROC's standard error from its structural components."""
    greater = (s_out[:, None] > s_in[None, :]) + 0.5 * (s_out[:, None] == s_in[None, :])  # (n_out, n_in)
    return float(np.sqrt(greater.mean(1).var(ddof=1) / len(s_out) + greater.mean(0).var(ddof=1) / len(s_in)))


@pytest.mark.parametrize("decimals", [None, 1])  # continuous scores, and scores with many ties
def test_auroc_and_roc_curve_are_sklearns(decimals):
    s_in, s_out = _scores(300, 200, decimals=decimals)
    expected = roc_auc_score(np.r_[np.zeros(300), np.ones(200)], np.r_[s_in, s_out])
    assert ood_auroc(s_in, s_out) == pytest.approx(expected, rel=1e-12)
    fpr, tpr = ood_roc_curve(s_in, s_out)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0.0, 0.0, 1.0, 1.0)
    assert (np.diff(fpr) >= 0).all() and (np.diff(tpr) >= 0).all()
    area = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))  # trapezoid rule: ties count one half
    assert area == pytest.approx(expected, rel=1e-12)


def test_the_interval_contains_the_estimate_and_shrinks_with_n():
    widths = {}
    for n in (50, 800):
        s_in, s_out = _scores(n, n, seed=n)
        low, high = ood_auroc_interval(s_in, s_out, n_boot=1000, seed=0)
        assert low < ood_auroc(s_in, s_out) < high
        widths[n] = high - low
        # the AUROC is asymptotically normal: a 95% interval is 2 x 1.96 standard errors (DeLong's);
        # 15% covers the Monte Carlo error of 2.5% quantiles from 1000 resamples (about 5% of the
        # width) and the skew of a small sample
        assert widths[n] == pytest.approx(2 * 1.96 * _delong_se(s_in, s_out), rel=0.15)
    # that standard error goes as sqrt(1/n_in + 1/n_out): 16 times the examples, about a quarter of
    # the width (the sample AUROCs differ, 0.83 and 0.75, and with them the variance: 3.3 here)
    assert widths[50] > 2.5 * widths[800]


def test_the_bootstrap_spread_is_the_delong_standard_error():
    # Both estimate the sampling standard deviation of the AUROC; they differ by O(1/n) relative
    # (3e-3 at n = 300) and the bootstrap's own Monte Carlo error with B = 2000 is sqrt(1 / 2B), 1.6%.
    s_in, s_out = _scores(300, 300, seed=3)
    draws = bootstrap_ood_auroc(s_in, s_out, n_boot=2000, seed=1)
    assert draws.std(ddof=1) == pytest.approx(_delong_se(s_in, s_out), rel=0.08)
    assert draws.mean() == pytest.approx(ood_auroc(s_in, s_out), abs=3 * draws.std() / np.sqrt(2000) + 5e-3)
    # the same seed gives the same resamples; another, other ones
    np.testing.assert_array_equal(bootstrap_ood_auroc(s_in, s_out, n_boot=2000, seed=1), draws)
    assert not np.array_equal(bootstrap_ood_auroc(s_in, s_out, n_boot=2000, seed=2), draws)
    # resampled in chunks or at once: the same AUROCs
    import bayesfuse.metrics as metrics

    old, metrics._BOOT_CHUNK = metrics._BOOT_CHUNK, 1000
    try:
        np.testing.assert_array_equal(bootstrap_ood_auroc(s_in, s_out, n_boot=2000, seed=1), draws)
    finally:
        metrics._BOOT_CHUNK = old


@pytest.fixture(scope="module")
def study():
    """Three small BNNs, their ensemble and a network; in-distribution inputs near the data, OOD ones far."""
    bnns = [varied_bnn(6, 8, 4, seed=s, spread=0.7, scale_low=0.05, scale_span=0.2) for s in range(3)]
    torch.manual_seed(0)
    net = MLP(6, [8], 4)
    rng = np.random.default_rng(0)
    return bnns, net, rng.normal(size=(120, 6)), rng.normal(0.0, 4.0, size=(90, 6))


def test_report_scores_every_model_by_its_predictive_entropy(study):
    bnns, net, x_in, x_out = study
    models = {"local 0": bnns[0], "local 1": bnns[1], "ensemble": Ensemble(bnns, num_samples=30), "network": net}
    table = report(models, x_in, x_out, n_boot=200, seed=0, num_samples=30)
    assert list(table.index) == list(models)
    h_in, h_out = (predictive_entropy(bnns[0].predict(x, 30, seed=0)) for x in (x_in, x_out))
    assert table.loc["local 0", "auroc"] == pytest.approx(ood_auroc(h_in, h_out), rel=1e-12)
    h_in, h_out = (predictive_entropy(predict_proba(net, x)) for x in (x_in, x_out))
    assert table.loc["network", "auroc"] == pytest.approx(ood_auroc(h_in, h_out), rel=1e-12)
    low, high = ood_auroc_interval(h_in, h_out, n_boot=200, seed=0)
    assert (table.loc["network", "ci_low"], table.loc["network", "ci_high"]) == pytest.approx((low, high))
    assert ((table.ci_low <= table.auroc) & (table.auroc <= table.ci_high)).all()
    best = table.auroc.idxmax()
    assert table.attrs["best"] == best and table.loc[best, "diff_to_best"] == 0.0
    assert table.loc[best, "diff_ci_low"] == table.loc[best, "diff_ci_high"] == 0.0  # paired: itself minus itself
    assert (table[["n_in", "n_out"]] == [120, 90]).all().all()
    assert table.attrs["n_boot"] == 200 and set(table.attrs["entropy"]) == set(models)


def test_report_takes_probabilities_and_refuses_bad_input(study):
    bnns, _, x_in, x_out = study
    probs = (bnns[0].predict(x_in, 30, seed=0), bnns[0].predict(x_out, 30, seed=0))
    table = report({"given": probs, "computed": bnns[0]}, x_in, x_out, n_boot=50, num_samples=30)
    assert table.loc["given", "auroc"] == table.loc["computed", "auroc"]
    with pytest.raises(ValueError, match="at least one model"):
        report({}, x_in, x_out)
    with pytest.raises(ValueError, match="different numbers of examples"):
        report({"a": probs, "b": (probs[0][:10], probs[1])}, x_in, x_out)
    with pytest.raises(ValueError, match="level"):
        report({"a": probs}, x_in, x_out, level=1.5)


def test_plot_report_draws_roc_curves_and_histograms(study):
    import matplotlib.pyplot as plt

    bnns, net, x_in, x_out = study
    models = {f"local {j}": b for j, b in enumerate(bnns)} | {"ensemble": Ensemble(bnns, num_samples=20), "net": net}
    table = report(models, x_in, x_out, n_boot=50, num_samples=20)
    fig = plot_report(table)
    roc, *hists = fig.axes
    assert len(hists) == len(models)
    assert len(roc.get_lines()) == len(models) + 1  # one curve per model and the diagonal
    assert all(len(ax.patches) == 2 * 30 for ax in hists)  # in and out of distribution, 30 bins each
    assert "AUROC" in hists[0].get_title()
    fig.savefig(io.BytesIO(), format="png")  # conftest.py sets the Agg backend
    plt.close(fig)
    with pytest.raises(ValueError, match="report"):
        plot_report(pd.DataFrame())


def test_a_fusion_result_is_read_by_its_model(study):
    from bayesfuse import fuse

    bnns, _, x_in, x_out = study
    fused = fuse(bnns, "kl")
    table = report({"result": fused, "model": fused.model}, x_in, x_out, n_boot=20, num_samples=20)
    assert table.loc["result", "auroc"] == table.loc["model", "auroc"]
    with pytest.raises(TypeError, match="cannot get predictive probabilities from a str"):
        report({"bad": "model.pt"}, x_in, x_out)
