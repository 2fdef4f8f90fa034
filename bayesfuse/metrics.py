"""Predictive metrics over arrays of class probabilities.

All functions take ``probs`` of shape (n, K) whose rows are distributions and integer labels
``y`` of shape (n,). Logarithms are natural (nats).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.stats import rankdata

__all__ = [
    "accuracy",
    "negative_log_likelihood",
    "predictive_entropy",
    "expected_calibration_error",
    "ood_auroc",
    "evaluate",
    "assignment_accuracy",
    "pair_scores",
    "partition_labels",
]

#: Probabilities are clipped below at this value inside the log of the NLL, so a single
#: confidently wrong prediction costs at most -log(1e-12) = 27.6 nats instead of infinity.
PROB_FLOOR = 1e-12


def check_probs(probs: np.ndarray, y: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] == 0:
        raise ValueError(f"probs must be a non-empty 2-D array (n, n_classes), got shape {p.shape}")
    if not np.isfinite(p).all():
        raise ValueError("probs contain NaN or infinite values")
    if (p < -1e-9).any() or not np.allclose(p.sum(axis=1), 1.0, atol=1e-4):
        raise ValueError("rows of probs must be probability distributions (non-negative, summing to 1)")
    if y is None:
        return p, None
    y = np.asarray(y)
    if y.shape != (p.shape[0],):
        raise ValueError(f"y must have shape ({p.shape[0]},) to match probs, got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= p.shape[1]:
        raise ValueError(f"labels must be integers in 0..{p.shape[1] - 1}")
    return p, y


def accuracy(probs: np.ndarray, y: np.ndarray) -> float:
    """Fraction of examples whose most probable class is the label."""
    p, y = check_probs(probs, y)
    return float(np.mean(p.argmax(axis=1) == y))


def negative_log_likelihood(probs: np.ndarray, y: np.ndarray) -> float:
    """Mean ``-log p(y_i | x_i)`` (probabilities floored at :data:`PROB_FLOOR`)."""
    p, y = check_probs(probs, y)
    return float(-np.mean(np.log(np.maximum(p[np.arange(len(y)), y], PROB_FLOOR))))


def predictive_entropy(probs: np.ndarray) -> np.ndarray:
    """Entropy ``H[p] = -sum_k p_k log p_k`` of each row, with ``0 log 0 = 0``; shape (n,)."""
    p, _ = check_probs(probs)
    p = np.clip(p, 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log(p), 0.0)
    return -terms.sum(axis=1)


def expected_calibration_error(probs: np.ndarray, y: np.ndarray, *, n_bins: int = 15) -> float:
    """Expected calibration error with equal-width confidence bins.

    .. math:: \\mathrm{ECE} = \\sum_b \\frac{|B_b|}{n} \\left| \\mathrm{acc}(B_b) - \\mathrm{conf}(B_b) \\right|

    where ``B_b`` holds the examples whose confidence ``max_k p_k`` lies in
    ``((b-1)/n_bins, b/n_bins]`` (Guo et al., 2017).
    """
    p, y = check_probs(probs, y)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    conf = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    bins = np.clip(np.ceil(conf * n_bins).astype(np.int64) - 1, 0, n_bins - 1)
    count = np.bincount(bins, minlength=n_bins)
    gap = np.abs(np.bincount(bins, correct, n_bins) - np.bincount(bins, conf, n_bins))
    return float(gap.sum() / count.sum())


def ood_auroc(score_in: np.ndarray, score_out: np.ndarray) -> float:
    """AUROC of telling out-of-distribution from in-distribution examples by a score.

    Higher scores should mean "more likely OOD" (predictive entropy, say). Equals the
    probability that a random OOD example scores higher than a random in-distribution one,
    ties counting one half (the Mann-Whitney U statistic divided by ``n_in * n_out``).
    """
    s_in = np.asarray(score_in, dtype=np.float64).ravel()
    s_out = np.asarray(score_out, dtype=np.float64).ravel()
    if s_in.size == 0 or s_out.size == 0:
        raise ValueError("ood_auroc needs at least one in-distribution and one OOD score")
    if not (np.isfinite(s_in).all() and np.isfinite(s_out).all()):
        raise ValueError("scores contain NaN or infinite values")
    ranks = rankdata(np.concatenate([s_in, s_out]))
    u = ranks[s_in.size :].sum() - s_out.size * (s_out.size + 1) / 2.0
    return float(u / (s_in.size * s_out.size))


def evaluate(probs: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Accuracy, NLL, ECE and mean predictive entropy in one dict."""
    return {
        "accuracy": accuracy(probs, y),
        "nll": negative_log_likelihood(probs, y),
        "ece": expected_calibration_error(probs, y),
        "entropy": float(predictive_entropy(probs).mean()),
    }


def assignment_accuracy(truth: Sequence[np.ndarray], found: Sequence[np.ndarray]) -> float:
    """Fraction of units assigned to their true atom, under the best one-to-one atom labelling.

    Found atoms are paired with true atoms by the Hungarian algorithm on their contingency
    table (maximum total overlap); a unit counts as correct when its found atom is paired with
    its true atom. Split or merged atoms lose the units outside the paired part.
    """
    from scipy.optimize import linear_sum_assignment

    if len(truth) != len(found):
        raise ValueError(f"truth has {len(truth)} clients, found has {len(found)}")
    t = np.concatenate([np.asarray(a, dtype=np.int64) for a in truth])
    f = np.concatenate([np.asarray(a, dtype=np.int64) for a in found])
    if t.shape != f.shape:
        raise ValueError(f"truth labels {t.shape[0]} units, found labels {f.shape[0]}")
    table = np.zeros((t.max() + 1, f.max() + 1))
    np.add.at(table, (t, f), 1)
    rows, cols = linear_sum_assignment(table, maximize=True)
    return float(table[rows, cols].sum() / len(t))


def pair_scores(truth: Sequence[np.ndarray], found: Sequence[np.ndarray]) -> tuple[float, float]:
    """Pairwise co-assignment precision and recall of a matching against the true one.

    Over all units of all clients (``truth[j]`` and ``found[j]``: the atom labels of client j's
    units), a pair of units is *found* when ``found`` puts both on one atom and *true* when
    ``truth`` does. Precision is the share of found pairs that are true, recall the share of
    true pairs that are found; both are 1 exactly when the two partitions agree (whatever the
    labels). Counted from the contingency table: with ``n_tf`` units on true atom t and found
    atom f, the pairs found and true are ``sum C(n_tf, 2)``. With no found (true) pair the
    precision (recall) is 0.

    Returns
    -------
    (precision, recall) : floats in [0, 1].
    """
    t, f = np.concatenate(truth), np.concatenate(found)
    _, n_tf = np.unique(np.stack([t, f]), axis=1, return_counts=True)
    pairs = lambda n: float(np.sum(n * (n - 1) / 2))  # noqa: E731
    tp = pairs(n_tf)
    found_pairs = pairs(np.unique(f, return_counts=True)[1])
    true_pairs = pairs(np.unique(t, return_counts=True)[1])
    return tp / max(found_pairs, 1.0), tp / max(true_pairs, 1.0)


def partition_labels(assignments: Sequence[np.ndarray]) -> np.ndarray:
    """The partition of all units that ``assignments`` make (one array of atom labels per
    client, concatenated), with atoms relabelled 0, 1, ... in order of first use: two matchings
    give equal arrays exactly when they group the units alike, whatever their atom labels.

    >>> partition_labels([np.array([5, 2]), np.array([2, 7])]).tolist()
    [0, 1, 1, 2]
    """
    flat = np.concatenate(assignments)
    _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse].astype(np.int64)
