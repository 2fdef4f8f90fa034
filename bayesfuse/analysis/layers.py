"""Fused and local layers as exact Gaussian summaries and ArviZ exports (:func:`to_arviz`,
:func:`summary`)."""

from __future__ import annotations

from statistics import NormalDist
from typing import Any, Mapping, Sequence

import numpy as np

from bayesfuse.analysis._common import (
    DEFAULT_CHAINS,
    DEFAULT_DRAWS,
    DEFAULT_HDI_PROB,
    Units,
    Weights,
    _assignment_data,
    _check_count,
    _combine,
    _draw_attrs,
    _drawn,
    _from_dict,
    _layer_attrs,
    _select_units,
    _select_weights,
)
from bayesfuse.nets.unit_posteriors import (
    LayerGaussians,
    check_names,
    is_gaussian_export,
    layer_gaussians,
)

# ------------------------------------------------------------------------------ draws of Gaussians


def _unit_draws(
    loc: np.ndarray, scale: np.ndarray, units: np.ndarray, weights: np.ndarray, chains: int, num_draws: int, seed: int
) -> np.ndarray:
    """(chains, draws, units, weights): chain c of the unit at position p draws all its entries from
    the stream ``(seed, p, c)``, of which the entries at ``weights`` are kept."""
    out = np.empty((chains, num_draws, len(units), len(weights)))
    stream = np.empty((num_draws, loc.shape[1]))
    for i, p in enumerate(units):
        for c in range(chains):
            np.random.default_rng([seed, int(p), c]).standard_normal(out=stream)
            out[c, :, i] = stream[:, weights]
    out *= scale[np.ix_(units, weights)]
    out += loc[np.ix_(units, weights)]
    return out


def gaussian_to_arviz(
    mean: np.ndarray,
    var: np.ndarray,
    *,
    units: Units = None,
    weights: Weights = None,
    num_draws: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    seed: int = 0,
    var_name: str = "theta",
    unit_dim: str = "global_unit",
    unit_ids: Sequence[int] | np.ndarray | None = None,
    weight_names: Sequence[str] | None = None,
    constant_data: dict | None = None,
    extra_coords: dict | None = None,
    extra_dims: dict | None = None,
    attrs: Mapping[str, Any] | None = None,
):
    """ArviZ object with independent draws of Gaussians ``N(mean, var)`` of shape (units, weights).

    Parameters
    ----------
    mean, var : array (G, D)
        Means and variances (``var`` broadcasts to ``mean``'s shape).
    units : None, "all", int or sequence of int
        Which units (values of the unit coordinate) get draws: ``None``, the first
        :data:`DEFAULT_UNITS`; ``"all"``; or the given ones, in the given order.
    weights : None, "all", str, int or sequence of them
        Which entries of those units get draws: ``None``, the first :data:`DEFAULT_WEIGHTS` when
        ``units`` is ``None`` too, else all; ``"all"``; or the given names (values of the
        ``weight`` coordinate) or positions, in the given order. When the defaults leave
        something out, one line is logged (logger ``bayesfuse.analysis``) saying how to draw more.
    num_draws : int
        Draws per chain.
    chains : int
        Chains of independent draws (:data:`DEFAULT_CHAINS`: ArviZ's ``r_hat`` needs two; with
        one, ``az.summary`` logs a shape warning and gives NaN).
    seed : int
        Chain ``c`` of the unit at position ``p`` of ``mean`` draws from the stream ``(seed, p, c)``.
    var_name, unit_dim : str
        Name of the posterior variable and of the unit dimension.
    unit_ids : sequence of int, optional
        Values of the unit coordinate (``0 .. G-1`` by default).
    weight_names : sequence of str, optional
        Values of the ``weight`` coordinate (``dim_0 ..`` by default).
    constant_data : dict, optional
        More ``constant_data`` variables (``loc`` and ``scale`` of every entry of every unit are
        always there); ``extra_coords`` and ``extra_dims`` give their coordinates and dims.
    attrs : mapping, optional
        Attributes of the ``posterior`` group, next to ``sampling`` and the draw settings.

    Returns
    -------
    arviz.InferenceData (ArviZ 0.2x) or xarray.DataTree (ArviZ 1.x)
        ``posterior[var_name]`` with dims ``(chain, draw, unit_dim, weight)``;
        ``constant_data`` with ``loc``, ``scale`` (dims ``unit_dim``, ``weight``) and the given
        variables.

    Raises
    ------
    ValueError
        For a ``mean`` that is not 2-D, non-finite means, negative variances, bad ``units``,
        ``weights``, ``weight_names`` or counts.
    """
    mean = np.asarray(mean, dtype=np.float64)
    if mean.ndim != 2:
        raise ValueError(f"mean must be (units, weights), got shape {mean.shape}")
    var = np.broadcast_to(np.asarray(var, dtype=np.float64), mean.shape)
    if not np.isfinite(mean).all() or not (var >= 0).all() or not np.isfinite(var).all():
        raise ValueError("variances must be non-negative and finite, and means finite")
    num_draws = _check_count(num_draws, "num_draws")
    chains = _check_count(chains, "chains")
    seed = int(np.random.SeedSequence().entropy % 2**63) if seed is None else int(seed)
    G, D = mean.shape
    ids = np.arange(G) if unit_ids is None else np.asarray(unit_ids)
    if ids.shape != (G,):
        raise ValueError(f"unit_ids must give one id per unit ({G}), got shape {ids.shape}")
    names = [f"dim_{d}" for d in range(D)] if weight_names is None else check_names(weight_names, D)
    positions, columns = _drawn(units, weights, ids, names)
    scale = np.sqrt(var)
    draws = _unit_draws(mean, scale, positions, columns, chains, num_draws, seed)
    drawn, drawn_names = ids[positions], [names[d] for d in columns]
    posterior_attrs = {**_draw_attrs(num_draws, chains, seed, ids, positions, D, columns), **(attrs or {})}
    post = _from_dict(
        {"posterior": {var_name: draws}},
        {unit_dim: drawn, "weight": drawn_names},
        {var_name: [unit_dim, "weight"]},
        attrs={"posterior": posterior_attrs},
    )
    data = {"loc": mean, "scale": np.array(scale), **(constant_data or {})}
    coords = {unit_dim: ids, "weight": names, **(extra_coords or {})}
    dims = {"loc": [unit_dim, "weight"], "scale": [unit_dim, "weight"], **(extra_dims or {})}
    return _combine(post, _from_dict({"constant_data": data}, coords, dims))


# ------------------------------------------------------------------------------ the exact posterior


def _exact(
    result, layer: int | str, weight_names: Sequence[str] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """``(mean, sd, unit ids, entry names)`` of a result's layer, or of an export's ``constant_data``."""
    if is_gaussian_export(result):
        data = result.constant_data
        loc, scale = data["loc"], data["scale"]
        unit_dim, weight_dim = loc.dims[-2:]
        names = [str(n) for n in np.asarray(loc[weight_dim])]
        if weight_names is not None:
            names = check_names(weight_names, len(names))
        return np.asarray(loc, dtype=np.float64), np.asarray(scale, dtype=np.float64), np.asarray(loc[unit_dim]), names
    g = layer_gaussians(result, layer, weight_names=weight_names)
    return g.mean, np.sqrt(g.var), np.arange(g.n_units), g.names


def summary(
    result,
    *,
    layer: int | str = 0,
    units: Units = "all",
    weights: Weights = "all",
    hdi_prob: float = DEFAULT_HDI_PROB,
    weight_names: Sequence[str] | None = None,
    var_name: str = "theta",
):
    """The exact posterior of a fused layer's units as a table, in the shape of ``az.summary``.

    Each entry is Gaussian, :math:`\\theta_{g,d} \\sim \\mathcal{N}(\\mu_{g,d}, \\sigma^2_{g,d})`,
    so its mean is :math:`\\mu`, its sd :math:`\\sigma` and its highest-density interval of
    probability :math:`p` the central one,

    .. math::

        \\left[\\mu - z \\sigma, \\; \\mu + z \\sigma\\right], \\qquad
        z = \\Phi^{-1}\\!\\left(\\tfrac{1 + p}{2}\\right),

    computed, not estimated from draws: no Monte Carlo error, no chains, every entry of a
    400 x 800 layer in well under a second.

    Parameters
    ----------
    result : FusionResult, MatchResult, KLFusionResult or an export
        What :func:`layer_gaussians <bayesfuse.nets.unit_posteriors.layer_gaussians>` reads (a
        fusion, a layer of one, a matching, a KL-fusion), or an ArviZ export of this module
        (its ``constant_data`` ``loc`` and ``scale``).
    layer : int or str
        A fusion's layer: index into ``result.layers`` or group name (``"P2"``).
    units : "all", None, int or sequence of int
        Units to list (``"all"`` by default; ``None``: the export's default, the first
        :data:`DEFAULT_UNITS`).
    weights : "all", None, str, int or sequence of them
        Entries to list, by name or position (``"all"`` by default).
    hdi_prob : float
        Probability of the interval, in (0, 1).
    weight_names : sequence of str, optional
        Names for the entries instead of the result's own.
    var_name : str
        The variable named in the index, as in the export.

    Returns
    -------
    pandas.DataFrame
        One row per entry, indexed as ``az.summary`` indexes the export (``"theta[3, bias]"``,
        unit then entry), with columns ``mean``, ``sd``, ``hdi_<lower>%`` and ``hdi_<upper>%``
        (``hdi_3%``, ``hdi_97%`` at the default ``hdi_prob`` of 0.94).

    Raises
    ------
    ValueError
        For ``hdi_prob`` outside (0, 1), bad ``units`` or ``weights``.
    """
    import pandas as pd

    hdi_prob = float(hdi_prob)
    if not 0.0 < hdi_prob < 1.0:
        raise ValueError(f"hdi_prob must lie in (0, 1), got {hdi_prob}")
    mean, sd, ids, names = _exact(result, layer, weight_names)
    rows = _select_units(units, ids)
    columns = _select_weights(weights, names, default_subset=units is None)
    mu, sigma = mean[np.ix_(rows, columns)].ravel(), sd[np.ix_(rows, columns)].ravel()
    z = NormalDist().inv_cdf((1.0 + hdi_prob) / 2.0)
    alpha = 1.0 - hdi_prob
    index = [f"{var_name}[{u}, {names[d]}]" for u in ids[rows].tolist() for d in columns]
    return pd.DataFrame(
        {
            "mean": mu,
            "sd": sigma,
            f"hdi_{100 * alpha / 2:g}%": mu - z * sigma,
            f"hdi_{100 * (1 - alpha / 2):g}%": mu + z * sigma,
        },
        index=index,
    )


# ------------------------------------------------------------------------------ fused layers


def _layer_to_arviz(g: LayerGaussians, *, units: Units, weights: Weights, num_draws: int, chains: int, seed: int):
    """A layer's named Gaussians, its assignments, objective and settings -> ArviZ."""
    layer = g.layer
    attrs = _layer_attrs(layer, method=g.method, hyper=g.hyper, layer_hyper=g.layer_hyper)
    if g.label is not None:
        attrs["layer"] = g.label
    data, coords, dims = _assignment_data(layer.assignments, g.n_units)
    data["objective"] = np.asarray(layer.objective, dtype=np.float64)
    step = "sweep" if hasattr(layer, "n_sweeps") else "step"
    coords[step] = np.arange(1, len(layer.objective) + 1)
    dims["objective"] = [step]
    return gaussian_to_arviz(
        g.mean,
        g.var,
        units=units,
        weights=weights,
        num_draws=num_draws,
        chains=chains,
        seed=seed,
        weight_names=g.names,
        constant_data=data,
        extra_coords=coords,
        extra_dims=dims,
        attrs={**attrs, "weight_names": g.names_source},
    )


def match_to_arviz(
    result,
    *,
    units: Units = None,
    weights: Weights = None,
    num_draws: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    weight_names: Sequence[str] | None = None,
    seed: int = 0,
):
    """:class:`~bayesfuse.inference.matching.MatchResult` -> ArviZ.

    ``posterior.theta`` (chain, draw, global_unit, weight): independent draws of the atoms'
    Gaussian posterior ``N(mean, var)``; ``constant_data``: ``loc``/``scale`` of every atom, the
    assignments, ``counts`` and the ``objective`` per sweep; method, hyper-parameters and
    convergence in ``posterior.attrs`` (module docstring).

    Parameters
    ----------
    result : MatchResult
    units : None, "all", int or sequence of int
        Global units to draw: ``None`` (default), the first :data:`DEFAULT_UNITS`; ``"all"``;
        or the given ones.
    weights : None, "all", str, int or sequence of them
        Entries to draw, by name or position: ``None`` (default), the first
        :data:`DEFAULT_WEIGHTS` when ``units`` is ``None``, else all; ``"all"``; or the given ones.
    num_draws : int
        Draws per chain (:data:`DEFAULT_DRAWS`).
    chains : int
        Chains of independent draws (:data:`DEFAULT_CHAINS`).
    weight_names : sequence of str, optional
        Names of an atom's D entries; by default from ``result.hyper["blocks"]`` when it labels
        each entry, else ``dim_0 ..``.
    seed : int
        Chain c of atom g draws from the stream ``(seed, g, c)``.
    """
    return _layer_to_arviz(
        layer_gaussians(result, weight_names=weight_names),
        units=units,
        weights=weights,
        num_draws=num_draws,
        chains=chains,
        seed=seed,
    )


def klfusion_to_arviz(
    result,
    *,
    units: Units = None,
    weights: Weights = None,
    num_draws: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    weight_names: Sequence[str] | None = None,
    seed: int = 0,
):
    """:class:`~bayesfuse.inference.klfusion.KLFusionResult` -> ArviZ.

    Same layout and parameters as :func:`match_to_arviz`: ``constant_data.loc`` and ``scale``
    are the components' parameters per dimension, ``objective`` is per alternation step, and
    ``hyper`` records the solver, the cost scale and the initial number of components.

    Dirichlet, Gamma, Beta and Normal-Wishart components (a topic model's topics, an HMM's
    states) are exported by :func:`~bayesfuse.analysis.families.family_to_arviz`: draws of
    their own family, and their parameters in ``constant_data``.

    Raises
    ------
    TypeError
        For components of no family above.
    """
    if type(result.components).__name__ in ("Dirichlet", "Gamma", "Beta", "NormalWishart"):
        from bayesfuse.analysis.families import family_to_arviz

        return family_to_arviz(
            result,
            units=units,
            weights=weights,
            num_draws=num_draws,
            chains=chains,
            weight_names=weight_names,
            seed=seed,
        )
    return _layer_to_arviz(
        layer_gaussians(result, weight_names=weight_names),
        units=units,
        weights=weights,
        num_draws=num_draws,
        chains=chains,
        seed=seed,
    )


def fusion_to_arviz(
    result,
    *,
    layer: int | str = 0,
    units: Units = None,
    weights: Weights = None,
    num_draws: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    weight_names: Sequence[str] | None = None,
    seed: int = 0,
):
    """:class:`~bayesfuse.fusion.FusionResult` (or :class:`~bayesfuse.core.StateFusion`) -> ArviZ,
    for one matched hidden layer.

    ``layer`` is an index into ``result.layers`` or a group name of ``result.groups``
    (``"P2"``: the second hidden layer of a deep MLP). The draws are of the layer's global units
    as ``result.posteriors`` gives them: for a fused BNN its guide's unit posterior (weights
    ``in_0 ..``, ``bias``, ``log_scale``, ``out_0 ..``); for networks fused with client
    summaries, the posterior the network is the mean of (its own weights, variance one over
    their fused Laplace precision); for networks fused data-free, the matching's atom posterior
    (the numbers that described each unit), which the network holds up to its output averaging
    (the outgoing weights of a unit merged from ``m`` of ``J`` clients times ``m / J``) and, in
    deeper networks, the members' plain average (``global_weights="average"``). Entries are
    named by the network's (``layers.0.weight[3]``, ...) when the matching recorded them.
    ``posterior.attrs`` holds ``result.method``, ``result.hyper`` and the layer's own ``hyper``
    (``layer_hyper``). Other parameters as in :func:`match_to_arviz`.

    Raises
    ------
    ValueError
        For a result without matched layers (FedAvg) or an unknown group name.
    IndexError
        For a layer index out of range.
    """
    if not getattr(result, "layers", None):
        raise ValueError(f"a {result.method} result has no matched layers to export")
    return _layer_to_arviz(
        layer_gaussians(result, layer, weight_names=weight_names),
        units=units,
        weights=weights,
        num_draws=num_draws,
        chains=chains,
        seed=seed,
    )


def to_arviz(result, *, layer: int | str = 0, **options):
    """Any result -> ArviZ: a fusion (one ``layer`` of it), a matching or a KL-fusion.

    ``options`` (``units``, ``weights``, ``num_draws``, ``chains``, ``weight_names``, ``seed``)
    as in :func:`match_to_arviz`. A :class:`~bayesfuse.models.bnn.HorseshoeBNN` with test data
    goes to :func:`bnn_to_arviz`.
    """
    if hasattr(result, "posteriors"):
        return fusion_to_arviz(result, layer=layer, **options)
    if hasattr(result, "sample_params"):
        raise TypeError("a BNN exports with its test data: bnn_to_arviz(model, x, y)")
    return match_to_arviz(result, **options)


def local_to_arviz(
    mean,
    var,
    assignment,
    *,
    units: Units = None,
    weights: Weights = None,
    num_draws: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    weight_names: Sequence[str] | None = None,
    seed: int = 0,
):
    """One client's local posterior (units as rows) labelled by the global units they were assigned.

    The ``global_unit`` coordinate of local unit l is ``assignment[l]``, so the result lines
    up with the fused export: ``az.plot_forest([fused, local_0, local_1], coords={"global_unit":
    [g]})`` compares a global unit with the local units merged into it. ``units`` selects by
    global unit; pass the fused export's ``weight_names`` (``fused.constant_data.weight.values``)
    to name the entries alike. Other parameters as in :func:`gaussian_to_arviz`.

    Raises
    ------
    ValueError
        When ``assignment`` does not give each local unit a distinct global unit.
    """
    mean = np.asarray(mean, dtype=np.float64)
    assignment = np.asarray(assignment)
    if mean.ndim != 2 or assignment.shape != (mean.shape[0],) or len(np.unique(assignment)) != len(assignment):
        raise ValueError("assignment must give each local unit a distinct global unit")
    order = np.argsort(assignment)
    var = np.broadcast_to(np.asarray(var, dtype=np.float64), mean.shape)
    source = "given" if weight_names is not None else "index"
    return gaussian_to_arviz(
        mean[order],
        var[order],
        units=units,
        weights=weights,
        num_draws=num_draws,
        chains=chains,
        seed=seed,
        unit_ids=assignment[order],
        weight_names=weight_names,
        attrs={"method": "local", "weight_names": source},
    )
