import numpy as np
import pytest
from scipy.special import softmax

from bayesfuse.calibration import auroc_at_ece, calibration_frontier, fit_temperature, tempered
from bayesfuse.metrics import negative_log_likelihood


def _labels(probs, rng):
    """One label per row drawn from that row's distribution (inverse CDF)."""
    u = rng.random(len(probs))[:, None]
    return np.minimum((probs.cumsum(axis=1) < u).sum(axis=1), probs.shape[1] - 1)


def test_tempering_is_the_softmax_of_scaled_logits_and_keeps_the_top_class():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(50, 4)) * 3
    p = softmax(z, axis=1)
    np.testing.assert_allclose(tempered(p, 1.0), p, rtol=1e-12)
    np.testing.assert_allclose(tempered(p, 0.5), softmax(2 * z, axis=1), rtol=1e-10)
    np.testing.assert_allclose(tempered(p, 4.0), softmax(z / 4, axis=1), rtol=1e-10)
    assert (tempered(p, 0.3).argmax(axis=1) == p.argmax(axis=1)).all()
    zero = np.array([[0.5, 0.5, 0.0]])  # a class of probability 0 stays at 0
    np.testing.assert_allclose(tempered(zero, 2.0), zero)


def test_fit_temperature_recovers_the_temperature_of_an_overconfident_model():
    # Labels drawn from softmax(z); the model reports softmax(2 z), overconfident by T = 2. The
    # maximum-likelihood T is consistent; over 20 seeds of this size its sd was 0.014, so 0.07 is 5 sd.
    rng = np.random.default_rng(1)
    z = rng.normal(size=(20000, 5)) * 2
    y = _labels(softmax(z, axis=1), rng)
    assert fit_temperature(softmax(2 * z, axis=1), y) == pytest.approx(2.0, abs=0.07)
    assert fit_temperature(softmax(z / 3, axis=1), y) == pytest.approx(1 / 3, abs=0.07 / 6)


def test_fit_temperature_finds_the_minimum_of_the_held_out_nll():
    # against a brute-force grid of the same objective (metrics.negative_log_likelihood)
    rng = np.random.default_rng(2)
    z = rng.normal(size=(3000, 10)) * 2
    y = _labels(softmax(1.4 * z, axis=1), rng)
    p = softmax(z, axis=1)
    t = fit_temperature(p, y)
    grid = np.exp(np.linspace(np.log(0.2), np.log(5), 2001))
    nll = [negative_log_likelihood(tempered(p, g), y) for g in grid]
    assert negative_log_likelihood(tempered(p, t), y) <= min(nll) + 1e-9
    assert t == pytest.approx(grid[int(np.argmin(nll))], rel=2e-3)  # the grid's spacing is 1.6e-3


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperatures_are_refused(bad):
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        tempered(np.full((2, 2), 0.5), bad)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="bounds must be"):
        fit_temperature(np.full((2, 2), 0.5), np.array([0, 1]), bounds=(2.0, 1.0))
    with pytest.raises(ValueError, match="y must have shape"):
        fit_temperature(np.full((2, 2), 0.5), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="probability distributions"):
        tempered(np.array([[0.7, 0.7]]), 1.0)


def _scores_at(probs, y, probs_ood, t):
    """ECE, NLL and the entropy AUROC of one temperature, computed from their definitions."""
    from bayesfuse.metrics import expected_calibration_error, ood_auroc, predictive_entropy

    logits, logits_ood = np.log(probs) / t, np.log(probs_ood) / t
    p, q = softmax(logits, axis=1), softmax(logits_ood, axis=1)
    h_in, h_out = predictive_entropy(p), predictive_entropy(q)
    # AUROC as the share of (in, out) pairs ordered right, ties half
    pairs = (h_out[None, :] > h_in[:, None]).mean() + 0.5 * (h_out[None, :] == h_in[:, None]).mean()
    assert ood_auroc(h_in, h_out) == pytest.approx(pairs, abs=1e-12)
    return expected_calibration_error(p, y), negative_log_likelihood(p, y), pairs


def test_calibration_frontier_scores_every_temperature_and_reads_the_best_auroc_under_an_ece():
    rng = np.random.default_rng(3)
    probs = softmax(3.0 * rng.normal(size=(300, 4)), axis=1)
    y = _labels(probs, rng)
    probs_ood = softmax(1.0 * rng.normal(size=(200, 4)), axis=1)
    temperatures = [0.25, 0.5, 1.0, 2.0, 4.0]
    frontier = calibration_frontier(probs, y, probs_ood, temperatures)
    np.testing.assert_array_equal(frontier["temperature"], temperatures)
    for i, t in enumerate(temperatures):
        ece, nll, auroc = _scores_at(probs, y, probs_ood, t)
        assert frontier["ece"][i] == pytest.approx(ece, abs=1e-12)
        assert frontier["nll"][i] == pytest.approx(nll, abs=1e-12)
        assert frontier["auroc"][i] == pytest.approx(auroc, abs=1e-12)
    bound = float(np.sort(frontier["ece"])[2])  # three temperatures qualify
    auroc, t = auroc_at_ece(frontier, bound)
    ok = frontier["ece"] <= bound
    assert auroc == frontier["auroc"][ok].max() and t in frontier["temperature"][ok]
    assert np.isnan(auroc_at_ece(frontier, -1.0)).all()
    with pytest.raises(ValueError, match="probs has 4 classes and probs_ood 3"):
        calibration_frontier(probs, y, probs_ood[:, :3] / probs_ood[:, :3].sum(1, keepdims=True))
