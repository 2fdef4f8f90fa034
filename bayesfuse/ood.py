"""An out-of-distribution report in one call: AUROC with bootstrap intervals, ROC curves, entropy histograms.

Each model scores an input by the entropy of its predictive distribution,
``H[p(. | x)] = -sum_k p_k log p_k`` (:func:`~bayesfuse.metrics.predictive_entropy`; a BNN's and an
ensemble's Monte Carlo predictive, :func:`~bayesfuse.nets.predict.predictive_proba`), and is
judged by how well that score tells OOD inputs ``x_out`` from in-distribution ones ``x_in``: the
AUROC, the probability that a random OOD input scores higher than a random in-distribution one
(ties one half; :func:`~bayesfuse.metrics.ood_auroc`). Its uncertainty over the examples is a
bootstrap percentile interval: the in-distribution and the OOD examples are resampled with
replacement, each set apart, ``n_boot`` times, and the interval is the ``(1 - level) / 2`` and
``(1 + level) / 2`` quantiles of the resampled AUROCs
(:func:`~bayesfuse.metrics.bootstrap_ood_auroc`). Every model is resampled alike (the same
examples in each resample), so the report also gives each model's paired bootstrap difference
to the best one.

>>> table = report({"local 0": bnns[0], "ensemble": Ensemble(bnns), "fused": fused}, x_test, x_ood)  # doctest: +SKIP
>>> fig = plot_report(table)                                                                        # doctest: +SKIP

matplotlib is imported only by :func:`plot_report`, pandas by :func:`report`.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from bayesfuse.metrics import bootstrap_ood_auroc, ood_auroc, ood_roc_curve, predictive_entropy
from bayesfuse.nets.predict import predictive_proba

__all__ = ["report", "plot_report", "entropies"]


def entropies(model, x_in, x_out, *, num_samples: int = 100, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Predictive entropies of ``model`` at ``x_in`` and ``x_out``.

    ``model`` is anything :func:`~bayesfuse.nets.predict.predictive_proba` reads (a network, a
    BNN, an ensemble, a fusion result), or a pair ``(p_in, p_out)`` of predictive probabilities
    (arrays (n, K)) already computed.
    """
    if isinstance(model, tuple) and len(model) == 2 and all(isinstance(p, np.ndarray) for p in model):
        p_in, p_out = model
    else:
        p_in, p_out = (predictive_proba(model, x, num_samples=num_samples, seed=seed) for x in (x_in, x_out))
    return predictive_entropy(p_in), predictive_entropy(p_out)


def report(
    models: Mapping[str, object],
    x_in,
    x_out,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
    num_samples: int = 100,
):
    """AUROC of the predictive entropy at telling ``x_out`` from ``x_in``, per model, with bootstrap intervals.

    Parameters
    ----------
    models : mapping of str to model
        Name -> a network, a BNN, an :class:`~bayesfuse.baselines.Ensemble`, a fusion result, or a
        pair ``(p_in, p_out)`` of predictive probabilities; typically the local models, their
        ensemble and the fused model. Rows keep this order.
    x_in, x_out : arrays
        In-distribution (test) inputs and OOD inputs. Ignored for models given as probabilities.
    n_boot : int
        Bootstrap resamples (module docstring).
    seed : int
        Seed of the resamples and of the Monte Carlo predictives (``predict(..., seed=seed)``).
    level : float
        Confidence of the percentile interval.
    num_samples : int
        Monte Carlo draws of Bayesian models' predictives.

    Returns
    -------
    pandas.DataFrame
        Indexed by model name: ``auroc``, ``ci_low``, ``ci_high`` (the percentile interval),
        ``se`` (standard deviation of the resampled AUROCs), ``diff_to_best`` and ``diff_ci_low``,
        ``diff_ci_high`` (the paired bootstrap interval of the AUROC minus the best model's),
        ``entropy_in`` and ``entropy_out`` (mean entropies, nats), ``n_in``, ``n_out``. ``attrs``
        holds the settings and, under ``"entropy"``, every model's entropies ``(h_in, h_out)``,
        which :func:`plot_report` draws.
    """
    import pandas as pd

    if not isinstance(models, Mapping):
        raise TypeError(
            f"report takes a mapping of names to models, e.g. {{'fused': result, 'ensemble': ensemble}}; got a "
            f"{type(models).__name__}"
        )
    if not models:
        raise ValueError("report needs at least one model")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    scores = {str(name): entropies(m, x_in, x_out, num_samples=num_samples, seed=seed) for name, m in models.items()}
    sizes = {(len(h_in), len(h_out)) for h_in, h_out in scores.values()}
    if len(sizes) > 1:
        raise ValueError(
            f"the models were scored on different numbers of examples {sorted(sizes)}: give every "
            "model the same x_in and x_out"
        )
    draws = {name: bootstrap_ood_auroc(h_in, h_out, n_boot=n_boot, seed=seed) for name, (h_in, h_out) in scores.items()}
    point = {name: ood_auroc(h_in, h_out) for name, (h_in, h_out) in scores.items()}
    best = max(point, key=point.__getitem__)
    q = [(1 - level) / 2, (1 + level) / 2]
    rows = {}
    for name, (h_in, h_out) in scores.items():
        low, high = np.quantile(draws[name], q)
        d_low, d_high = np.quantile(draws[name] - draws[best], q)
        se = float(np.std(draws[name], ddof=1)) if n_boot > 1 else float("nan")
        rows[name] = {
            "auroc": point[name],
            "ci_low": low,
            "ci_high": high,
            "se": se,
            "diff_to_best": point[name] - point[best],
            "diff_ci_low": d_low,
            "diff_ci_high": d_high,
            "entropy_in": float(h_in.mean()),
            "entropy_out": float(h_out.mean()),
            "n_in": len(h_in),
            "n_out": len(h_out),
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "model"
    table.attrs.update(
        n_boot=int(n_boot),
        level=float(level),
        seed=int(seed),
        num_samples=int(num_samples),
        score="predictive entropy",
        best=best,
        entropy=scores,
    )
    return table


def plot_report(table, *, columns: int = 3, bins: int = 30):
    """ROC curves of every model and, beside them, each model's entropy histograms in and out of distribution.

    ``table`` is what :func:`report` returns (its ``attrs["entropy"]``). The ROC panel's legend
    gives each model's AUROC and interval; a histogram panel per model, ``columns`` to a row,
    shares the entropy axis. Returns the matplotlib ``Figure``.
    """
    import matplotlib.pyplot as plt

    scores = getattr(table, "attrs", {}).get("entropy")
    if not scores:
        raise ValueError(
            "plot_report draws what report() returns: a table whose attrs hold the entropies; "
            f"got a {type(table).__name__}"
        )
    names = list(table.index)
    rows = -(-len(names) // columns)
    fig = plt.figure(figsize=(4.2 + 2.6 * min(columns, len(names)), max(3.6, 2.2 * rows)), layout="constrained")
    grid = fig.add_gridspec(rows, 1 + min(columns, len(names)), width_ratios=[1.6] + [1] * min(columns, len(names)))
    roc = fig.add_subplot(grid[:, 0])
    level = table.attrs.get("level", 0.95)
    for name in names:
        fpr, tpr = ood_roc_curve(*scores[name])
        r = table.loc[name]
        roc.plot(fpr, tpr, lw=1.5, label=f"{name}: {r['auroc']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]")
    roc.plot([0, 1], [0, 1], color="0.6", lw=0.8, ls="--")
    roc.set(
        xlim=(0, 1),
        ylim=(0, 1.01),
        xlabel="false positive rate (in-distribution flagged)",
        ylabel="true positive rate (OOD flagged)",
        title=f"ROC of predictive entropy (AUROC, {level:.0%} interval)",
    )
    roc.set_aspect("equal")
    roc.legend(loc="lower right", fontsize="small")
    top = max(max(h_in.max(), h_out.max()) for h_in, h_out in scores.values())
    edges = np.linspace(0.0, top + 1e-9, bins + 1)
    first = None
    for i, name in enumerate(names):
        ax = fig.add_subplot(grid[i // columns, 1 + i % columns], sharex=first)
        first = first or ax
        h_in, h_out = scores[name]
        # matplotlib's stub takes no array for bins (a sequence, an int or a name); it reads one
        ax.hist(h_in, bins=edges, density=True, alpha=0.6, label="in distribution")  # type: ignore[arg-type]
        ax.hist(h_out, bins=edges, density=True, alpha=0.6, label="out of distribution")  # type: ignore[arg-type]
        ax.set_title(f"{name} (AUROC {table.loc[name, 'auroc']:.3f})", fontsize="medium")
        ax.set_xlabel("predictive entropy (nats)")
        if i % columns == 0:
            ax.set_ylabel("density")
        if i == 0:
            ax.legend(fontsize="small")
    return fig
