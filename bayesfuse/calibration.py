"""Temperature scaling of predictive distributions (Guo et al., ICML 2017, section 4.2).

A distribution ``p`` over K classes is tempered by ``T > 0`` as

.. math::

    p^{(T)}_k = \\frac{p_k^{1/T}}{\\sum_j p_j^{1/T}} = \\mathrm{softmax}_k\\Big(\\frac{\\log p}{T}\\Big),

which for a softmax output is the softmax of the logits divided by ``T``: ``T < 1`` sharpens,
``T > 1`` flattens, the most probable class never changes (accuracy is kept). One ``T`` is
fitted by the log-likelihood of held-out data; the negative log-likelihood is convex in
``1/T`` (a log-sum-exp of terms linear in ``1/T`` minus a linear term), so the bounded
one-dimensional search finds its minimum.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp, softmax

from bayesfuse.metrics import (
    PROB_FLOOR,
    check_probs,
    expected_calibration_error,
    negative_log_likelihood,
    ood_auroc,
    predictive_entropy,
)

__all__ = ["tempered", "fit_temperature", "calibration_frontier", "auroc_at_ece", "FRONTIER_TEMPERATURES"]


def _log_probs(probs: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):  # a class of probability 0 stays at 0 at any temperature
        return np.log(probs)


def _check_temperature(temperature) -> float:
    t = float(temperature)
    if not np.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    return t


def tempered(probs: np.ndarray, temperature: float) -> np.ndarray:
    """``probs`` (n, K) tempered by ``temperature``: ``softmax(log p / T)`` per row (module docstring)."""
    p, _ = check_probs(probs)
    t = _check_temperature(temperature)
    return softmax(_log_probs(p) / t, axis=1)


def fit_temperature(probs: np.ndarray, y: np.ndarray, *, bounds: tuple[float, float] = (0.05, 20.0)) -> float:
    """The temperature in ``bounds`` that maximises the log-likelihood of labels ``y`` under
    :func:`tempered` ``probs`` (held-out data: never the data the result is judged on).

    The likelihood floors probabilities at :data:`~bayesfuse.metrics.PROB_FLOOR`, as
    :func:`~bayesfuse.metrics.negative_log_likelihood` does; the search runs over ``1/T``, in
    which the unfloored negative log-likelihood is convex.
    """
    p, y = check_probs(probs, y)
    low, high = (_check_temperature(b) for b in bounds)
    if not low < high:
        raise ValueError(f"bounds must be (low, high) with low < high, got {bounds!r}")
    log_p = _log_probs(p)

    def nll(beta: float) -> float:
        logits = beta * log_p
        log_q = logits[np.arange(len(y)), y] - logsumexp(logits, axis=1)
        return float(-np.mean(np.maximum(log_q, np.log(PROB_FLOOR))))

    best = minimize_scalar(nll, bounds=(1.0 / high, 1.0 / low), method="bounded", options={"xatol": 1e-6})
    return float(1.0 / best.x)


#: Temperatures of :func:`calibration_frontier` by default: 2^(k/8) for k = -32..16, from 1/16 to 4.
FRONTIER_TEMPERATURES = 2.0 ** (np.arange(-32, 17) / 8.0)


def calibration_frontier(
    probs: np.ndarray, y: np.ndarray, probs_ood: np.ndarray, temperatures=FRONTIER_TEMPERATURES
) -> dict[str, np.ndarray]:
    """How calibration and out-of-distribution detection trade along one temperature.

    For each ``T`` in ``temperatures``: the ECE and NLL of :func:`tempered` ``probs`` on labels
    ``y``, and the AUROC of predictive entropy for telling ``probs_ood``'s inputs (tempered by the
    same ``T``) from ``probs``'s (:func:`~bayesfuse.metrics.ood_auroc`); the accuracy does not
    change. Flattening (``T > 1``) raises every entropy, and where in-distribution predictions are
    confident it raises them less than the uncertain out-of-distribution ones, so an
    under-confident predictive (an ensemble of clients that disagree) gains AUROC and loses
    calibration. Comparing two predictives at the same ECE (:func:`auroc_at_ece`) separates what
    each knows from how confident it is. The frontier is read on labelled data: a diagnostic,
    not a way to choose ``T`` (:func:`fit_temperature` on held-out data does that).

    Returns
    -------
    dict
        ``temperature``, ``ece``, ``nll``, ``auroc``: arrays of ``len(temperatures)``.
    """
    p, y = check_probs(probs, y)
    q, _ = check_probs(probs_ood)
    if q.shape[1] != p.shape[1]:
        raise ValueError(f"probs has {p.shape[1]} classes and probs_ood {q.shape[1]}")
    ts = np.array([_check_temperature(t) for t in np.atleast_1d(temperatures)], dtype=np.float64)
    out: dict[str, list[float]] = {"ece": [], "nll": [], "auroc": []}
    for t in ts:
        pt, qt = tempered(p, t), tempered(q, t)
        out["ece"].append(expected_calibration_error(pt, y))
        out["nll"].append(negative_log_likelihood(pt, y))
        out["auroc"].append(ood_auroc(predictive_entropy(pt), predictive_entropy(qt)))
    return {"temperature": ts, **{k: np.asarray(v) for k, v in out.items()}}


def auroc_at_ece(frontier: dict[str, np.ndarray], max_ece: float = 0.03) -> tuple[float, float]:
    """The highest AUROC of ``frontier`` (:func:`calibration_frontier`) among the temperatures
    whose ECE is at most ``max_ece``, and that temperature; ``(nan, nan)`` where none is."""
    ok = np.flatnonzero(np.asarray(frontier["ece"]) <= max_ece)
    if len(ok) == 0:
        return float("nan"), float("nan")
    best = ok[np.argmax(np.asarray(frontier["auroc"])[ok])]
    return float(frontier["auroc"][best]), float(frontier["temperature"][best])
