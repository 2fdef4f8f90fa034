"""Held-out comparison of fused and local models: pointwise log predictive densities and their
differences with standard errors."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from bayesfuse.analysis._common import (
    DEFAULT_DRAWS,
    _check_count,
)

# ------------------------------------------------------------------------------ held-out comparison


def log_predictive_density(model, x, y, *, num_samples: int = DEFAULT_DRAWS, seed: int = 0) -> np.ndarray:
    """Pointwise held-out log predictive density of a model.

    .. math::

        \\mathrm{lpd}_i = \\log p(y_i \\mid x_i) =
        \\log \\frac{1}{S} \\sum_{s=1}^S p(y_i \\mid x_i, \\theta_s), \\qquad \\theta_s \\sim q,

    for a Bayesian model its Monte Carlo predictive (``model.predict(x, num_samples=S,
    seed=seed)``), for a network ``softmax(f(x))_{y_i}``, for a mixture the mixture's.

    Parameters
    ----------
    model : HorseshoeBNN, Ensemble, network, FusionResult or array (n, K)
        Anything with ``predict(x, num_samples=, seed=)``, a network (logits), a result whose
        ``.model`` is one of those (:func:`~bayesfuse.nets.predict.predictive_proba`), or the
        predictive probabilities themselves.
    x : array (n, D)
        Held-out inputs.
    y : array (n,) of int
        Held-out labels.
    num_samples, seed : int
        Monte Carlo draws of a Bayesian model's predictive, and their seed.

    Returns
    -------
    ndarray (n,)
        ``lpd_i``; ``-inf`` where the model gives ``y_i`` probability 0.

    Raises
    ------
    TypeError
        For a model none of those.
    ValueError
        For labels that are not integers in ``0 .. K-1`` or probabilities of the wrong shape.
    """
    from bayesfuse.nets.predict import predictive_proba

    x = np.asarray(x)
    y = np.asarray(y)
    num_samples = _check_count(num_samples, "num_samples")
    probs = (
        np.asarray(model, dtype=np.float64)
        if isinstance(model, np.ndarray)
        else predictive_proba(model, x, num_samples=num_samples, seed=int(seed))
    )
    if probs.ndim != 2 or len(probs) != len(y):
        raise ValueError(f"expected ({len(y)}, K) probabilities, got shape {probs.shape}")
    K = probs.shape[1]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= K:
        raise ValueError(f"y must be ({len(probs)},) integer labels in 0..{K - 1}")
    with np.errstate(divide="ignore"):
        return np.log(probs[np.arange(len(y)), y])


def _se(values: np.ndarray) -> float:
    """``sqrt(n Var(values))``, the standard error of a sum of n pointwise terms (sample variance)."""
    return float(np.sqrt(len(values) * np.var(values, ddof=1))) if len(values) > 1 else float("nan")


def compare_pointwise(lpd: Mapping[str, np.ndarray]):
    """The comparison table of :func:`compare` from pointwise log predictive densities.

    Parameters
    ----------
    lpd : mapping of str to array (n,)
        Each model's ``lpd_i`` on the same n held-out points.

    Returns
    -------
    pandas.DataFrame
        As :func:`compare`.
    """
    import pandas as pd

    lpd = {str(name): np.asarray(v, dtype=np.float64) for name, v in lpd.items()}
    if not lpd:
        raise ValueError("nothing to compare: give at least one model")
    n = {len(v) for v in lpd.values()}
    if len(n) != 1 or 0 in n or any(v.ndim != 1 for v in lpd.values()):
        raise ValueError("every model's pointwise log predictive density must cover the same held-out points")
    elpd = {name: float(v.sum()) for name, v in lpd.items()}
    order = sorted(lpd, key=lambda name: -elpd[name])
    best = lpd[order[0]]
    rows = {
        name: {
            "rank": rank,
            "elpd": elpd[name],
            "se": _se(lpd[name]),
            "elpd_diff": elpd[order[0]] - elpd[name],
            "dse": 0.0 if rank == 0 else _se(best - lpd[name]),
        }
        for rank, name in enumerate(order)
    }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "model"
    table.attrs.update({"elpd": "held-out log predictive density, sum over points", "n": n.pop()})
    return table


def compare(models: Mapping[str, Any], x, y, *, num_samples: int = DEFAULT_DRAWS, seed: int = 0, pairs: bool = False):
    """Rank models by their held-out log predictive density, with standard errors.

    Model m's expected log predictive density on n held-out points is estimated by their sum,

    .. math::

        \\widehat{\\mathrm{elpd}}_m = \\sum_{i=1}^n \\mathrm{lpd}_{m,i}, \\qquad
        \\mathrm{se}_m = \\sqrt{n\\, \\widehat{\\mathrm{Var}}_i(\\mathrm{lpd}_{m,i})},

    (:func:`log_predictive_density`), and the difference between two models on the same
    points by the sum of the pointwise differences, whose standard error is paired,

    .. math::

        \\Delta_{ab} = \\sum_i (\\mathrm{lpd}_{a,i} - \\mathrm{lpd}_{b,i}), \\qquad
        \\mathrm{se}(\\Delta_{ab}) = \\sqrt{n\\, \\widehat{\\mathrm{Var}}_i(\\mathrm{lpd}_{a,i} - \\mathrm{lpd}_{b,i})}

    (Vehtari, Gelman and Gabry 2017, eqs. 23-24, with held-out terms in place of LOO ones;
    sample variances). This is the valid comparison on test data; ``az.loo`` / ``az.compare``
    are for the data a posterior was fitted to (:func:`bnn_to_arviz`).

    Parameters
    ----------
    models : mapping of str to model
        Names to models: HorseshoeBNNs, fused results (``fuse(bnns, "kl")``), ensembles
        (``Ensemble(bnns)``), networks, or (n, K) arrays of predictive probabilities.
    x : array (n, D)
        Held-out inputs.
    y : array (n,) of int
        Held-out labels.
    num_samples, seed : int
        Monte Carlo draws of each Bayesian model's predictive, and their seed.
    pairs : bool
        Also return every pair's difference.

    Returns
    -------
    pandas.DataFrame
        ArviZ's ``compare`` table: one row per model, best first (index ``model``), columns
        ``rank`` (0 the best), ``elpd``, ``se``, ``elpd_diff`` (the best model's elpd minus this
        one's, >= 0) and ``dse`` (its paired standard error; 0 for the best). ``attrs["n"]`` is
        the number of held-out points.
    pandas.DataFrame, with ``pairs=True``
        One row per pair ``(a, b)`` with ``a`` ranked above ``b``: ``elpd_diff`` (a's elpd
        minus b's) and ``dse``.

    Raises
    ------
    ValueError
        For no models, or labels or probabilities that do not fit (:func:`log_predictive_density`).
    """
    if not isinstance(models, Mapping):
        raise TypeError(
            f"compare takes a mapping of names to models, e.g. {{'fused': result, 'ensemble': ensemble}}; got a "
            f"{type(models).__name__}"
        )
    n_labels, n_inputs = len(np.asarray(y).reshape(-1)), len(x)
    if np.ndim(y) != 1 or n_labels != n_inputs:
        raise ValueError(
            f"y must hold one label per example: {n_labels} labels (shape {np.shape(y)}) for {n_inputs} examples"
        )
    lpd = {name: log_predictive_density(m, x, y, num_samples=num_samples, seed=seed) for name, m in models.items()}
    table = compare_pointwise(lpd)
    if not pairs:
        return table
    import pandas as pd

    names = list(table.index)
    rows = [
        {"a": a, "b": b, "elpd_diff": float((lpd[a] - lpd[b]).sum()), "dse": _se(lpd[a] - lpd[b])}
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    ]
    return table, pd.DataFrame(rows, columns=["a", "b", "elpd_diff", "dse"]).set_index(["a", "b"])
