"""Predictive metrics over arrays of class probabilities.

All functions take ``probs`` of shape (n, K) whose rows are distributions and integer labels
``y`` of shape (n,). Logarithms are natural (nats).
"""

from __future__ import annotations

from typing import Sequence, overload

import numpy as np
from scipy.stats import rankdata

__all__ = [
    "accuracy",
    "negative_log_likelihood",
    "predictive_entropy",
    "expected_calibration_error",
    "ood_auroc",
    "ood_roc_curve",
    "bootstrap_ood_auroc",
    "ood_auroc_interval",
    "evaluate",
    "assignment_accuracy",
    "pair_scores",
    "partition_labels",
]

#: Probabilities are clipped below at this value inside the log of the NLL: the smallest normal
#: float64, so only a probability below 2.2e-308 (one that underflowed to 0, or a subnormal) is
#: clipped, and costs 708 nats instead of up to infinity; every larger one counts in full. A
#: larger floor (1e-12, 27.6 nats, is common) flatters exactly the predictives that are sometimes
#: confidently wrong: a geometric pool of heads gives the true class log-probabilities of -100
#: and below on a few test inputs.
PROB_FLOOR = float(np.finfo(np.float64).tiny)


@overload
def check_probs(probs: np.ndarray, y: None = None) -> tuple[np.ndarray, None]: ...
@overload
def check_probs(probs: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
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


def _scores(score_in: np.ndarray, score_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both samples of scores as flat float64 arrays, checked as :func:`ood_auroc` checks them."""
    s_in = np.asarray(score_in, dtype=np.float64).ravel()
    s_out = np.asarray(score_out, dtype=np.float64).ravel()
    if s_in.size == 0 or s_out.size == 0:
        raise ValueError("ood_auroc needs at least one in-distribution and one OOD score")
    if not (np.isfinite(s_in).all() and np.isfinite(s_out).all()):
        raise ValueError("scores contain NaN or infinite values")
    return s_in, s_out


def ood_auroc(score_in: np.ndarray, score_out: np.ndarray) -> float:
    """AUROC of telling out-of-distribution from in-distribution examples by a score.

    Higher scores should mean "more likely OOD" (predictive entropy, say). Equals the
    probability that a random OOD example scores higher than a random in-distribution one,
    ties counting one half (the Mann-Whitney U statistic divided by ``n_in * n_out``).
    """
    s_in, s_out = _scores(score_in, score_out)
    ranks = rankdata(np.concatenate([s_in, s_out]))
    u = ranks[s_in.size :].sum() - s_out.size * (s_out.size + 1) / 2.0
    return float(u / (s_in.size * s_out.size))


def ood_roc_curve(score_in: np.ndarray, score_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ROC curve of flagging as OOD every example that scores at least ``t``, over every threshold.

    For each distinct score ``t`` (descending), the false positive rate
    ``FPR(t) = #{in >= t} / n_in`` and the true positive rate ``TPR(t) = #{out >= t} / n_out``,
    after the point (0, 0). The area under the curve by the trapezoid rule is :func:`ood_auroc`
    (a tie between an in- and an OOD score is a diagonal step, which counts one half).

    Returns
    -------
    (fpr, tpr) : float64 arrays from 0 to 1.
    """
    s_in, s_out = _scores(score_in, score_out)
    thresholds = np.unique(np.concatenate([s_in, s_out]))[::-1]
    fpr = (len(s_in) - np.searchsorted(np.sort(s_in), thresholds, side="left")) / len(s_in)
    tpr = (len(s_out) - np.searchsorted(np.sort(s_out), thresholds, side="left")) / len(s_out)
    return np.concatenate([[0.0], fpr]), np.concatenate([[0.0], tpr])


#: Most ranks :func:`bootstrap_ood_auroc` holds at once (resamples times scores), about 16 MB.
_BOOT_CHUNK = 2_000_000


def bootstrap_ood_auroc(
    score_in: np.ndarray, score_out: np.ndarray, *, n_boot: int = 1000, seed: int = 0
) -> np.ndarray:
    """:func:`ood_auroc` of ``n_boot`` bootstrap resamples of the scores.

    Each resample draws ``n_in`` in-distribution and ``n_out`` OOD scores with replacement, each
    sample from its own (the two sets were collected apart, so their sizes stay fixed: a
    stratified bootstrap). The resamples depend only on ``seed``, ``n_boot`` and the two sizes,
    so models scored on the same examples with the same seed are resampled alike (paired).

    Returns
    -------
    ndarray (n_boot,)
    """
    s_in, s_out = _scores(score_in, score_out)
    if isinstance(n_boot, bool) or int(n_boot) != n_boot or n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer, got {n_boot!r}")
    rng = np.random.default_rng(seed)
    idx_in = rng.integers(0, len(s_in), size=(int(n_boot), len(s_in)))
    idx_out = rng.integers(0, len(s_out), size=(int(n_boot), len(s_out)))
    n = len(s_in) + len(s_out)
    step = max(1, _BOOT_CHUNK // n)
    out = np.empty(int(n_boot))
    for i in range(0, int(n_boot), step):
        ranks = rankdata(np.hstack([s_in[idx_in[i : i + step]], s_out[idx_out[i : i + step]]]), axis=1)
        u = ranks[:, len(s_in) :].sum(1) - len(s_out) * (len(s_out) + 1) / 2.0
        out[i : i + step] = u / (len(s_in) * len(s_out))
    return out


def ood_auroc_interval(
    score_in: np.ndarray, score_out: np.ndarray, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Bootstrap percentile interval of :func:`ood_auroc` at confidence ``level``: the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of :func:`bootstrap_ood_auroc`."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    draws = bootstrap_ood_auroc(score_in, score_out, n_boot=n_boot, seed=seed)
    low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


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
