"""Plots for fused posteriors and OOD studies (matplotlib is imported only when this module is).

Every function returns the matplotlib ``Figure`` it drew on; those taking ``ax`` draw into it
when given one. Those that read a fused layer take a fusion (what :func:`bayesfuse.fuse`
returns: its ``layer``, the first by default) or a layer's result alike.
"""

from __future__ import annotations

from statistics import NormalDist
from typing import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np

from bayesfuse.nets.unit_posteriors import layer_gaussians, select_layer

__all__ = [
    "plot_assignments",
    "plot_objective",
    "plot_posterior",
    "size_sweep",
    "plot_size_sweep",
    "plot_unit_posterior",
    "plot_entropy_hist",
    "plot_centred_entropy",
    "plot_sorted_images",
]


def _axes(ax, figsize):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
        return fig, ax
    return ax.figure, ax


def plot_assignments(result, *, layer: int | str = 0, ax=None, truth: Sequence[np.ndarray] | None = None):
    """Client x global-unit matrix: which global units each client's units were matched to.

    Cells hold 1 where a client uses a global unit; with ``truth`` (the true atom of each local
    unit, as from a simulation) wrong matches are coloured apart: a local unit is counted as
    correct when its global unit's majority true atom is its own.

    ``result`` is a fusion (``layer``: index or group name of its matched layer) or a layer's
    result (a matching, a KL-fusion).
    """
    assignments = select_layer(result, layer)[1].assignments
    n_global = int(max(a.max() for a in assignments)) + 1
    mat = np.zeros((len(assignments), n_global))
    for j, a in enumerate(assignments):
        mat[j, a] = 1.0
    order = np.argsort(-mat.sum(0), kind="stable")
    if truth is not None:
        flat_g, flat_t = np.concatenate(assignments), np.concatenate(truth)
        majority = {g: np.bincount(flat_t[flat_g == g]).argmax() for g in np.unique(flat_g)}
        for j, (a, t) in enumerate(zip(assignments, truth)):
            wrong = np.array([majority[g] != tt for g, tt in zip(a, t)])
            mat[j, a[wrong]] = 2.0
    fig, ax = _axes(ax, (10, 0.35 * len(assignments) + 1.5))
    cmap = plt.matplotlib.colors.ListedColormap(["white", "#4c72b0", "#c44e52"][: int(mat.max()) + 1])
    ax.imshow(mat[:, order], aspect="auto", interpolation="nearest", cmap=cmap)
    ax.set_xlabel(f"global unit (sorted by number of clients; {n_global} in all)")
    ax.set_ylabel("client")
    ax.set_yticks(range(len(assignments)))
    title = "assignments" + (" (red: matched to another true atom)" if truth is not None else "")
    ax.set_title(title)
    return fig


def plot_objective(result, *, layer: int | str = 0, ax=None):
    """The objective after each sweep (matching) or alternation step (KL-fusion) of a fusion's
    ``layer`` or of a layer's result."""
    fused = select_layer(result, layer)[1]
    fig, ax = _axes(ax, (5, 3.2))
    ax.plot(np.arange(1, len(fused.objective) + 1), fused.objective, "o-")
    ax.set_xlabel("sweep" if hasattr(fused, "n_sweeps") else "step")
    ax.set_ylabel("objective")
    ax.set_title("objective trace")
    return fig


def size_sweep(layers, *, gamma0: Sequence[float], noise_var: Sequence[float], **match_kwargs) -> np.ndarray:
    """Global model size over a grid: ``sizes[i, k]`` for ``noise_var[i]`` and ``gamma0[k]``."""
    from bayesfuse.inference.matching import match_neurons

    sizes = np.zeros((len(noise_var), len(gamma0)), dtype=int)
    for i, nv in enumerate(noise_var):
        for k, g in enumerate(gamma0):
            sizes[i, k] = match_neurons(layers, noise_var=nv, gamma0=g, **match_kwargs).n_global
    return sizes


def plot_size_sweep(
    sizes: np.ndarray, gamma0: Sequence[float], noise_var: Sequence[float], *, ax=None, truth: int | None = None
):
    """Lines of global size against gamma0, one per noise variance (from :func:`size_sweep`)."""
    fig, ax = _axes(ax, (5.5, 3.6))
    for i, nv in enumerate(noise_var):
        ax.plot(gamma0, sizes[i], "o-", label=f"noise_var={nv:g}")
    if truth is not None:
        ax.axhline(truth, color="black", ls="--", lw=1, label="true atoms")
    ax.set_xscale("log")
    ax.set_xlabel("gamma0")
    ax.set_ylabel("global units")
    ax.legend(fontsize=8)
    ax.set_title("global model size")
    return fig


def plot_unit_posterior(
    fused_mean,
    fused_var,
    local_means,
    local_vars,
    *,
    weights: Sequence[int],
    ax=None,
    labels: Sequence[str] | None = None,
):
    """Fused vs local posteriors of one unit: mean +- 2 sd for the chosen weights.

    ``local_means``/``local_vars``: one (D,) array per local unit assigned to the global unit.
    """
    fig, ax = _axes(ax, (6, 0.5 * len(weights) + 1.5))
    weights = list(weights)
    rows = [("fused", np.asarray(fused_mean), np.asarray(fused_var))]
    labels = labels or [f"local {i}" for i in range(len(local_means))]
    rows += [(lab, np.asarray(m), np.asarray(v)) for lab, m, v in zip(labels, local_means, local_vars)]
    n = len(rows)
    for r, (lab, m, v) in enumerate(rows):
        y = np.arange(len(weights)) + (r - (n - 1) / 2) * 0.8 / max(n, 1)
        ax.errorbar(
            m[weights],
            y,
            xerr=2 * np.sqrt(v[weights]),
            fmt="o",
            ms=4,
            capsize=2,
            label=lab,
            color="black" if r == 0 else None,
        )
    ax.set_yticks(range(len(weights)), [f"w[{w}]" for w in weights])
    ax.set_xlabel("value (mean +- 2 sd)")
    ax.legend(fontsize=7)
    ax.set_title("fused vs local posterior of one unit")
    return fig


def _pick(selection, available: Sequence, default: int, what: str) -> list[int]:
    """Positions in ``available`` of ``selection`` (values of ``available``, or for entries their
    positions); ``None``: the first ``default``."""
    if selection is None:
        return list(range(min(default, len(available))))
    wanted = [selection] if isinstance(selection, (str, int, np.integer)) else list(selection)
    where = {v: i for i, v in enumerate(available)}
    out = []
    for w in wanted:
        if w in where:
            out.append(where[w])
        elif what == "weight" and isinstance(w, (int, np.integer)) and 0 <= w < len(available):
            out.append(int(w))
        else:
            raise ValueError(f"no {what} {w!r}: there are {len(available)}")
    return out


def plot_posterior(
    result,
    *,
    layer: int | str = 0,
    units=None,
    weights=None,
    hdi_prob: float = 0.94,
    weight_names: Sequence[str] | None = None,
    ncols: int = 3,
    fig=None,
):
    """The exact posterior density of chosen entries of a fused layer's units, one panel each.

    Entry d of global unit g is :math:`\\mathcal{N}(\\mu_{g,d}, \\sigma^2_{g,d})`; each panel
    draws that density (not a kernel estimate from draws), shades its highest-density interval
    :math:`\\mu \\pm \\Phi^{-1}((1 + p)/2)\\,\\sigma` of probability ``hdi_prob`` and marks the mean,
    as ``az.plot_posterior`` lays out a panel.

    Parameters
    ----------
    result : FusionResult, MatchResult or KLFusionResult
        A fusion (``layer``: index or group name) or a layer's result.
    units : int or sequence of int, optional
        Global units (the first by default).
    weights : str, int or sequence of them, optional
        Entries by name (``"bias"``, ``"layers.0.weight[3]"``) or position (the first 6 by default).
    hdi_prob : float
        Probability of the shaded interval.
    weight_names : sequence of str, optional
        Names for the entries instead of the result's own.
    ncols : int
        Panels per row.
    fig : matplotlib Figure, optional
        Drawn into when given.
    """
    g = layer_gaussians(result, layer, weight_names=weight_names)
    rows = _pick(units, range(g.n_units), 1, "unit")
    cols = _pick(weights, g.names, 6, "weight")
    panels = [(u, d) for u in rows for d in cols]
    ncols = max(1, min(ncols, len(panels)))
    nrows = -(-len(panels) // ncols)
    if fig is None:
        fig = plt.figure(figsize=(3.2 * ncols, 2.3 * nrows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols)).ravel()
    z = NormalDist().inv_cdf((1 + hdi_prob) / 2)
    for ax, (u, d) in zip(axes, panels):
        mu, sigma = g.mean[u, d], np.sqrt(g.var[u, d])
        _draw_gaussian(ax, mu, sigma, z, hdi_prob)
        ax.set_title(f"theta[{u}, {g.names[d]}]", fontsize=9)
    for ax in axes[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"exact posterior ({g.method}{'' if g.label is None else ', layer ' + g.label})", fontsize=10)
    return fig


def _draw_gaussian(ax, mu: float, sigma: float, z: float, hdi_prob: float) -> None:
    """The density of N(mu, sigma^2) on ``ax``, its central interval mu +- z sigma shaded, the mean marked."""
    if sigma == 0:
        ax.axvline(mu, color="C0")
        ax.set_yticks([])
        ax.set_xlabel(f"mean {mu:.3g} (point mass)", fontsize=8)
        return
    x = np.union1d(np.linspace(mu - 4 * sigma, mu + 4 * sigma, 201), [mu - z * sigma, mu + z * sigma])
    density = np.exp(-0.5 * ((x - mu) / sigma) ** 2) / (sigma * np.sqrt(2 * np.pi))
    ax.plot(x, density, color="C0")
    inside = (x >= mu - z * sigma) & (x <= mu + z * sigma)
    ax.fill_between(x[inside], density[inside], color="C0", alpha=0.2)
    ax.axvline(mu, color="C0", ls="--", lw=1)
    ax.set_yticks([])
    ax.set_xlabel(f"mean {mu:.3g}, {hdi_prob:.0%} HDI [{mu - z * sigma:.3g}, {mu + z * sigma:.3g}]", fontsize=8)


def plot_entropy_hist(h_in: np.ndarray, h_out: np.ndarray, *, ax=None, labels=("test", "out of distribution")):
    """Histograms of predictive entropy in and out of distribution."""
    fig, ax = _axes(ax, (5.5, 3.5))
    bins = np.linspace(0, max(np.max(h_in), np.max(h_out)) + 1e-9, 30)
    ax.hist(h_in, bins=bins, alpha=0.6, density=True, label=labels[0])
    ax.hist(h_out, bins=bins, alpha=0.6, density=True, label=labels[1])
    ax.set_xlabel("predictive entropy (nats)")
    ax.set_ylabel("density")
    ax.legend()
    return fig


def plot_centred_entropy(
    entropies: Mapping[str, tuple[np.ndarray, np.ndarray]], ood_labels: np.ndarray, *, ax=None, n_classes: int = 10
):
    """Per-class mean OOD entropy minus each model's mean in-distribution entropy (KL-fusion Fig. 5).

    ``entropies[name] = (entropy on the test set, entropy on the OOD set)``.
    """
    fig, ax = _axes(ax, (10, 3.8))
    names = list(entropies)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        h_in, h_out = entropies[name]
        centred = [h_out[ood_labels == k].mean() - h_in.mean() for k in range(n_classes)]
        ax.bar(np.arange(n_classes) + (i - len(names) / 2 + 0.5) * width, centred, width, label=name)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(n_classes))
    ax.set_xlabel("OOD class")
    ax.set_ylabel("OOD entropy - mean test entropy")
    ax.legend(fontsize=7, ncols=4)
    return fig


def plot_sorted_images(images: np.ndarray, entropy: np.ndarray, image_shape, *, n: int = 10, fig=None):
    """The n lowest- and n highest-entropy images (KL-fusion Fig. 1), with their entropies."""
    order = np.argsort(entropy)
    picks = np.concatenate([order[:n], order[-n:]])
    if fig is None:
        fig = plt.figure(figsize=(n * 0.9, 2.4), layout="constrained")
    axes = fig.subplots(2, n)
    for a, k in zip(axes.ravel(), picks):
        a.imshow(np.asarray(images[k]).reshape(image_shape), cmap="gray_r")
        a.set_title(f"H={entropy[k]:.2f}", fontsize=7)
        a.axis("off")
    fig.suptitle("most certain (top) and least certain (bottom)", fontsize=9)
    return fig
