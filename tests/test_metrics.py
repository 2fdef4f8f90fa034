import itertools

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from bayesfuse.metrics import (
    accuracy,
    evaluate,
    expected_calibration_error,
    negative_log_likelihood,
    ood_auroc,
    pair_scores,
    partition_labels,
    predictive_entropy,
)

P = np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
Y = np.array([0, 2, 0, 2])


def test_accuracy_by_hand():
    # argmax: 0, 1, 0, 2 -> correct, wrong, correct, correct
    assert accuracy(P, Y) == 0.75


def test_nll_by_hand():
    expected = -(np.log(0.7) + np.log(0.3) + np.log(0.5) + np.log(0.6)) / 4
    assert negative_log_likelihood(P, Y) == pytest.approx(expected, rel=1e-12)


def test_nll_of_impossible_label_is_floored_not_infinite():
    # a probability that underflowed to 0 costs -log of the smallest normal float64, 708.4 nats
    assert negative_log_likelihood(np.array([[1.0, 0.0]]), np.array([1])) == pytest.approx(708.396, abs=1e-3)


def test_nll_counts_every_representable_probability_in_full():
    # a confident error at p = e^-100 costs 100 nats, not a capped 27.6
    p = np.array([[1.0 - np.exp(-100.0), np.exp(-100.0)], [0.5, 0.5]])
    assert negative_log_likelihood(p, np.array([1, 0])) == pytest.approx((100.0 + np.log(2)) / 2, rel=1e-12)


def test_entropy_by_hand():
    h = predictive_entropy(np.array([[1 / 3, 1 / 3, 1 / 3], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]))
    np.testing.assert_allclose(h, [np.log(3), 0.0, np.log(2)], rtol=1e-12, atol=1e-15)


def test_ece_by_hand():
    # 3 bins of width 1/3. Confidences 0.7, 0.6, 0.5, 0.6 all fall in bin (1/3, 2/3] except
    # 0.7 in (2/3, 1]. Bin 2: {0.7} correct -> |1 - 0.7| = 0.3, weight 1/4.
    # Bin 1: {0.6 wrong, 0.5 right, 0.6 right} -> acc 2/3, conf 1.7/3 -> gap 0.3/3 = 0.1, weight 3/4.
    assert expected_calibration_error(P, Y, n_bins=3) == pytest.approx(0.25 * 0.3 + 0.75 * 0.1)


def test_ece_of_calibrated_predictor_is_small():
    # Labels drawn from the predicted distributions: calibrated by construction. With n = 20000
    # and 10 bins, the binned gaps are sampling noise of order sqrt(p(1-p)/n_b) ~ 0.01.
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(20000, 4)) * 2
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    y = np.array([rng.choice(4, p=row) for row in p])
    assert expected_calibration_error(p, y, n_bins=10) < 0.02
    # The same predictions made overconfident are clearly miscalibrated.
    sharp = np.exp(2 * logits) / np.exp(2 * logits).sum(1, keepdims=True)
    assert expected_calibration_error(sharp, y, n_bins=10) > 0.08


def test_auroc_matches_sklearn_with_ties():
    rng = np.random.default_rng(1)
    s_in = rng.integers(0, 5, 200).astype(float)
    s_out = rng.integers(1, 7, 150).astype(float)
    labels = np.r_[np.zeros(200), np.ones(150)]
    assert ood_auroc(s_in, s_out) == pytest.approx(roc_auc_score(labels, np.r_[s_in, s_out]), rel=1e-12)


def test_auroc_by_hand():
    assert ood_auroc([0.1, 0.2], [0.3, 0.4]) == 1.0
    assert ood_auroc([0.3, 0.4], [0.1, 0.2]) == 0.0
    assert ood_auroc([0.5], [0.5]) == 0.5
    # pairs (in, out): (1,2) > ; (1,0) < ; (3,2) < ; (3,0) < -> 1/4
    assert ood_auroc([1, 3], [2, 0]) == 0.25


def test_evaluate_keys():
    assert set(evaluate(P, Y)) == {"accuracy", "nll", "ece", "entropy"}


def test_bad_inputs():
    with pytest.raises(ValueError, match="distributions"):
        accuracy(np.array([[0.5, 0.6]]), np.array([0]))
    with pytest.raises(ValueError, match="NaN"):
        accuracy(np.array([[np.nan, 1.0]]), np.array([0]))
    with pytest.raises(ValueError, match="labels"):
        accuracy(P, np.array([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="shape"):
        accuracy(P, Y[:3])
    with pytest.raises(ValueError, match="at least one"):
        ood_auroc([], [1.0])


def _pairs_by_brute_force(truth, found):
    """Precision and recall by listing every pair of units."""
    t, f = np.concatenate(truth), np.concatenate(found)
    together = [(t[a] == t[b], f[a] == f[b]) for a, b in itertools.combinations(range(len(t)), 2)]
    tp = sum(1 for same_t, same_f in together if same_t and same_f)
    n_found = sum(1 for _, same_f in together if same_f)
    n_true = sum(1 for same_t, _ in together if same_t)
    return tp / max(n_found, 1), tp / max(n_true, 1)


@pytest.mark.parametrize("seed", range(20))
def test_pair_scores_equal_counting_every_pair(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5, size=rng.integers(1, 4))
    truth = [rng.integers(0, 4, size=n) for n in sizes]
    found = [rng.integers(0, 5, size=n) + 10 for n in sizes]  # labels need not overlap the truth's
    assert pair_scores(truth, found) == pytest.approx(_pairs_by_brute_force(truth, found), abs=1e-12)


def test_pair_scores_of_a_relabelled_partition_are_one_and_of_singletons_zero():
    truth = [np.array([0, 1, 1]), np.array([0, 2])]
    assert pair_scores(truth, [np.array([7, 3, 3]), np.array([7, 9])]) == (1.0, 1.0)
    assert pair_scores(truth, [np.array([0, 1, 2]), np.array([3, 4])]) == (0.0, 0.0)


def test_partition_labels_are_equal_exactly_for_the_same_grouping():
    a = [np.array([4, 2, 2]), np.array([9, 4])]
    same = [np.array([0, 1, 1]), np.array([2, 0])]
    other = [np.array([0, 1, 1]), np.array([0, 2])]
    assert partition_labels(a).tolist() == [0, 1, 1, 2, 0]
    assert np.array_equal(partition_labels(a), partition_labels(same))
    assert not np.array_equal(partition_labels(a), partition_labels(other))
