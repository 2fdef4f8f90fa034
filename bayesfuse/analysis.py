"""Fused and local posteriors as what they are: exact Gaussian summaries, and ArviZ exports.

Layers. A fused layer's global units are independent Gaussians, one per entry of a unit's vector
(incoming weights, bias, outgoing weights, ...):

.. math::

    \\theta_{g,d} \\sim \\mathcal{N}(\\mu_{g,d}, \\sigma^2_{g,d}),
    \\qquad g = 0..G-1, \\; d = 0..D-1.

The posterior is known in closed form, so :func:`summary` gives its table exactly: the mean
``mu``, the sd ``sigma`` and the highest-density interval ``mu +- z sigma`` with
``z = Phi^{-1}((1 + hdi_prob) / 2)``, for every entry of every unit, in milliseconds.
:func:`bayesfuse.plot.plot_posterior` draws the exact densities.

An export (:func:`to_arviz`, ``result.to_arviz()``) holds

* ``posterior.theta`` with dims ``(chain, draw, global_unit, weight)``: **independent** draws of
  that Gaussian, :data:`DEFAULT_CHAINS` chains of :data:`DEFAULT_DRAWS`. They are not MCMC
  draws: chains of independent draws have ``r_hat`` about 1 and ``ess`` about the number of
  draws by construction, so those columns of ``az.summary`` describe the draws, not a sampler;
  the chains are there because ArviZ's ``r_hat`` needs two (one chain makes it NaN, with a
  logged shape warning). ``mcse_mean`` is how far the draws' mean may lie from the exact one.
* ``constant_data``: ``loc`` and ``scale`` (dims ``global_unit``, ``weight``) of *every* entry of
  every unit, the exact posterior the draws come from (for KL-fusion the components'
  parameters); for every local unit (dim ``local_unit``) its ``client``, ``local_index`` and
  ``assigned_global_unit``; ``counts`` per global unit; the ``objective`` per sweep or step.
* attrs of ``posterior``: ``method``, ``hyper`` (a JSON string: ``json.loads`` gives the
  hyper-parameters back), ``converged`` (0 or 1), ``n_iterations``, ``objective``,
  ``sampling`` (``"independent"``), the seed and which units and weights were drawn. Everything
  is a string or a number, so ``to_netcdf`` writes it.

The ``weight`` coordinate names each entry (:func:`bayesfuse.nets.unit_posteriors.entry_names`):
the caller's ``weight_names``; for a fused horseshoe BNN ``in_0 .. in_{D-1}``, ``bias``,
``log_scale``, ``out_0 .. out_{K-1}``; for a matching whose ``hyper["blocks"]`` records the
entries (fused networks with ``"auto"`` hyper-parameters) the network's entry names,
``layers.0.weight[3]``, ``layers.0.bias``, ...; otherwise ``dim_0 .. dim_{D-1}``.

Size. ``az.summary`` costs a few milliseconds per scalar and ``az.plot_forest`` draws a line per
scalar and chain, so the default export draws the first :data:`DEFAULT_UNITS` units and their
first :data:`DEFAULT_WEIGHTS` entries (64 scalars: both finish in about a second), and says so in
one logged line and in ``posterior.attrs``. Pass ``units=[g, ...]`` (every entry of those units)
or ``units="all"``, and ``weights=[name or index, ...]`` or ``weights="all"``, for more. Unit
``g``'s chain ``c`` draws from its own random stream (``seed``, ``g``, ``c``), every entry, so
an export of some units, some weights or fewer draws holds exactly the corresponding draws of a
larger one.

BNNs. :func:`bnn_to_arviz` exports a :class:`~bayesfuse.models.bnn.HorseshoeBNN` (or the
:class:`~bayesfuse.fusion.FusionResult` holding a fused one) with test data: posterior draws of
the model's sites, the pointwise ``log_likelihood`` and ``posterior_predictive`` of the test
labels and ``observed_data``, so that ``az.loo`` and ``az.compare({"fused": ..., "local 0": ...})``
(LOO by default; ``ic="loo"`` in 0.2x) rank fused and local BNNs. It follows the size rules
above: :data:`DEFAULT_CHAINS` chains, the first :data:`DEFAULT_UNITS` units of every hidden
layer and :data:`DEFAULT_WEIGHTS` inputs by default (said in one logged line), ``units="all"``
and ``inputs="all"`` for the whole posterior; the log-likelihood is always the whole network's.

Everything is built with ``arviz.from_dict``, which exists in the 0.2x line
(``InferenceData``, Python 3.11) and in 1.x (``DataTree``, newer Pythons); groups with
different unit coordinates are built separately and joined (:func:`_combine`). Results are
read through what they share (:func:`~bayesfuse.nets.unit_posteriors.layer_gaussians`), so this
module imports no result class.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import warnings
from statistics import NormalDist
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from bayesfuse._text import warn_from_caller
from bayesfuse.inference.result import register_exporter
from bayesfuse.nets.unit_posteriors import (
    LayerGaussians,
    check_names,
    is_gaussian_export,
    layer_gaussians,
    select_layer,
)

__all__ = [
    "DEFAULT_DRAWS",
    "DEFAULT_CHAINS",
    "DEFAULT_UNITS",
    "DEFAULT_WEIGHTS",
    "summary",
    "to_arviz",
    "match_to_arviz",
    "klfusion_to_arviz",
    "fusion_to_arviz",
    "gaussian_to_arviz",
    "local_to_arviz",
    "bnn_to_arviz",
    "aligned_to_arviz",
    "compare",
    "compare_pointwise",
    "log_predictive_density",
    "HeldOutDataWarning",
]

_log = logging.getLogger(__name__)


class HeldOutDataWarning(UserWarning):
    """An export's log-likelihood is of held-out data (or of data it was not told about), where
    PSIS-LOO does not apply: compare models on held-out data with :func:`compare`."""


#: Draws per chain of an export unless the caller asks for another number.
DEFAULT_DRAWS = 100
#: Chains of independent draws: two, the fewest for which ArviZ computes ``r_hat``.
DEFAULT_CHAINS = 2
#: Units an export draws when ``units`` is not given (every unit of a smaller layer).
DEFAULT_UNITS = 8
#: Entries per unit an export draws when neither ``units`` nor ``weights`` is given.
DEFAULT_WEIGHTS = 8
#: Interval probability of :func:`summary` (ArviZ 0.2x's ``hdi_prob`` default).
DEFAULT_HDI_PROB = 0.94

#: What every export says about its draws (``posterior.attrs["sampling_note"]``).
SAMPLING_NOTE = (
    "independent draws from the exact Gaussian posterior N(loc, scale^2) of each entry, not MCMC: "
    "r_hat ~ 1 and ess ~ draws by construction; the exact mean and sd are loc and scale in "
    "constant_data (bayesfuse.analysis.summary gives the exact table)"
)

Units = Sequence[int] | np.ndarray | int | Literal["all"] | None
Weights = Sequence[str] | Sequence[int] | np.ndarray | str | int | None


# ------------------------------------------------------------------------------ ArviZ versions


def _arviz():
    with warnings.catch_warnings():
        # ArviZ 0.2x announces its 1.x refactor with a FutureWarning on import (once a day): only that one.
        warnings.filterwarnings(
            "ignore", message=r"\s*ArviZ is undergoing a major refactor", category=FutureWarning, module="arviz"
        )
        import arviz

    return arviz


def _major(az) -> int:
    return int(az.__version__.split(".")[0])


def _from_dict(groups: dict[str, dict], coords: dict, dims: dict, attrs: Mapping[str, dict] | None = None):
    """``arviz.from_dict`` for both lines: 1.x takes one dict of groups and per-group attrs, 0.2x
    one keyword per group. ``attrs`` maps a group to its attributes."""
    az = _arviz()
    if _major(az) >= 1:  # ArviZ 1.x: a DataTree
        return az.from_dict(groups, coords=coords, dims=dims, attrs=dict(attrs or {}))
    obj = az.from_dict(**groups, coords=coords, dims=dims)
    for group, values in (attrs or {}).items():
        getattr(obj, group).attrs.update(values)
    return obj


def _combine(first, *others):
    """The groups of ``others`` added to ``first`` (groups whose coordinates differ, such as a
    posterior of some units and constant data of all units, cannot share one ``from_dict``)."""
    if _major(_arviz()) >= 1:
        for other in others:
            for name, node in other.children.items():
                first[name] = node
        return first
    for other in others:
        first.extend(other)
    return first


# ------------------------------------------------------------------------------ attributes


def _jsonable(value: Any) -> Any:
    """``value`` as JSON-able Python: arrays and tuples as lists, NumPy scalars as Python ones,
    non-finite floats as the strings ``"inf"``, ``"-inf"``, ``"nan"``, anything else as its
    ``str``."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, str):
        return value
    return str(value)


def _to_json(value: Any) -> str:
    return json.dumps(_jsonable(value), allow_nan=False)


def _layer_attrs(layer, *, method: str, hyper: Mapping | None, layer_hyper: Mapping | None = None) -> dict:
    """Method, hyper-parameters (JSON) and convergence of one fused layer."""
    objective = list(getattr(layer, "objective", ()))
    attrs = {
        "method": method,
        "result": type(layer).__name__,
        "hyper": _to_json(hyper or {}),
        "converged": int(bool(getattr(layer, "converged", True))),
        "n_iterations": int(getattr(layer, "n_sweeps", None) or len(objective)),
        "seconds": float(getattr(layer, "seconds", 0.0)),
    }
    if layer_hyper is not None:
        attrs["layer_hyper"] = _to_json(layer_hyper)
    if objective and math.isfinite(float(objective[-1])):
        attrs["objective"] = float(objective[-1])
    return attrs


# ------------------------------------------------------------------------------ what to draw


def _check_count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _describe_ids(ids: np.ndarray) -> str:
    ids = np.asarray(ids)
    if len(ids) > 1 and np.issubdtype(ids.dtype, np.integer) and (ids == np.arange(ids[0], ids[0] + len(ids))).all():
        return f"{ids[0]}..{ids[-1]}"
    return str(ids.tolist())


def _select_units(units: Units, unit_ids: np.ndarray) -> np.ndarray:
    """Positions (into ``unit_ids``) of the units ``units`` asks for: ``None``, the first
    :data:`DEFAULT_UNITS`; ``"all"``; or the given ids, in their order."""
    n = len(unit_ids)
    if units is None:
        return np.arange(min(n, DEFAULT_UNITS))
    if isinstance(units, str):
        if units != "all":
            raise ValueError(f"units must be 'all', None or unit ids, got {units!r}")
        return np.arange(n)
    wanted = np.atleast_1d(np.asarray(units))
    if wanted.ndim != 1 or not (np.issubdtype(wanted.dtype, np.integer) or len(wanted) == 0):
        raise ValueError(f"units must be a sequence of integer unit ids, got {units!r}")
    position = {int(u): i for i, u in enumerate(unit_ids)}
    missing = [int(u) for u in wanted if int(u) not in position]
    if missing:
        raise ValueError(f"no unit {missing[0]}; the units are {_describe_ids(unit_ids)}")
    if len(set(wanted.tolist())) != len(wanted):
        raise ValueError("units must not repeat a unit")
    if len(wanted) == 0:
        raise ValueError("units is empty: ask for at least one unit")
    return np.array([position[int(u)] for u in wanted], dtype=np.int64)


def _select_weights(weights: Weights, names: Sequence[str], *, default_subset: bool) -> np.ndarray:
    """Positions of the entries ``weights`` asks for: ``None``, the first :data:`DEFAULT_WEIGHTS`
    when ``default_subset`` else all; ``"all"``; or names and positions, in their order."""
    width = len(names)
    if weights is None:
        return np.arange(min(width, DEFAULT_WEIGHTS) if default_subset else width)
    if isinstance(weights, str) and weights == "all":
        return np.arange(width)
    if isinstance(weights, (str, int, numbers.Integral)):
        wanted = [weights]
    else:
        wanted = weights.tolist() if isinstance(weights, np.ndarray) else list(weights)
    position = {name: i for i, name in enumerate(names)}
    out = []
    for w in wanted:
        if isinstance(w, (str, np.str_)):
            if w not in position:
                shown = ", ".join(names[:4]) + (", ..." if width > 4 else "")
                raise ValueError(f"no weight {w!r}; the weights are {shown} ({width} in all)")
            out.append(position[w])
        elif isinstance(w, numbers.Integral) and not isinstance(w, bool) and -width <= w < width:
            out.append(int(w) % width)
        else:
            raise ValueError(f"weights must be 'all', None, entry names or positions in 0..{width - 1}, got {w!r}")
    if not out:
        raise ValueError("weights is empty: ask for at least one entry")
    if len(set(out)) != len(out):
        raise ValueError("weights must not repeat an entry")
    return np.array(out, dtype=np.int64)


def _note_default_subset(n_units: int, drawn_units: int, width: int, drawn_weights: int) -> None:
    """The one line saying that the default export drew part of a layer, and how to draw more."""
    _log.warning(
        "to_arviz drew %d of %d units x %d of %d weights (the default, sized for az.summary and "
        "az.plot_forest); units='all' or [ids], weights='all' or [names] draw more, "
        "bayesfuse.analysis.summary(result) gives every entry's exact posterior",
        drawn_units,
        n_units,
        drawn_weights,
        width,
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
    positions = _select_units(units, ids)
    columns = _select_weights(weights, names, default_subset=units is None)
    if units is None and (len(positions) < G or (weights is None and len(columns) < D)):
        _note_default_subset(G, len(positions), D, len(columns))
    scale = np.sqrt(var)
    draws = _unit_draws(mean, scale, positions, columns, chains, num_draws, seed)
    drawn, drawn_names = ids[positions], [names[d] for d in columns]
    posterior_attrs = {
        "sampling": "independent",
        "sampling_note": SAMPLING_NOTE,
        "num_draws": num_draws,
        "chains": chains,
        "seed": seed,
        "n_units": G,
        "n_drawn_units": len(positions),
        "drawn_units": "all" if len(positions) == G and (positions == np.arange(G)).all() else _describe_ids(drawn),
        "n_weights": D,
        "n_drawn_weights": len(columns),
        "drawn_weights": "all" if len(columns) == D and (columns == np.arange(D)).all() else _describe_ids(columns),
        **(attrs or {}),
    }
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


def _assignment_data(assignments: Sequence[np.ndarray], n_global: int) -> tuple[dict, dict, dict]:
    client = np.concatenate([np.full(len(a), j) for j, a in enumerate(assignments)])
    local = np.concatenate([np.arange(len(a)) for a in assignments])
    glob = np.concatenate([np.asarray(a) for a in assignments])
    counts = np.bincount(glob, minlength=n_global)
    data = {"assigned_global_unit": glob, "client": client, "local_index": local, "counts": counts}
    coords = {"local_unit": np.arange(len(glob))}
    dims = {
        "assigned_global_unit": ["local_unit"],
        "client": ["local_unit"],
        "local_index": ["local_unit"],
        "counts": ["global_unit"],
    }
    return data, coords, dims


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
    """:class:`~bayesfuse.inference.klfusion.KLFusionResult` -> ArviZ (diagonal-Gaussian components).

    Same layout and parameters as :func:`match_to_arviz`: ``constant_data.loc`` and ``scale``
    are the components' parameters per dimension, ``objective`` is per alternation step, and
    ``hyper`` records the solver, the cost scale and the initial number of components.

    Raises
    ------
    TypeError
        For components that are not diagonal Gaussians (no ``loc`` and ``var`` of one shape).
    """
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
    ``in_0 ..``, ``bias``, ``log_scale``, ``out_0 ..``); for fused networks, the matching's atom
    posterior (the numbers that described each unit, named by the network's entries when the
    matching recorded them). ``posterior.attrs`` holds ``result.method``, ``result.hyper`` and the
    layer's own ``hyper`` (``layer_hyper``). Other parameters as in :func:`match_to_arviz`.

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


# ------------------------------------------------------------------------------ BNNs aligned to the fused units


def _effective_units(post, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Hidden layer ``index`` (0-based) of a deep BNN posterior in the scale-free form: per unit
    the effective incoming weights and bias ``e^{m} (w~, b~)``, the log scale ``m = E[log tau +
    log lambda]`` and, for the top hidden layer, the outgoing weights; means and variances."""
    from bayesfuse.inference.bnn.units import effective_layer

    weights, log_scale = effective_layer(post.layers[index])
    loc, var = [weights.loc, log_scale.loc], [weights.var, log_scale.var]
    if index == len(post.layers) - 1:
        loc.append(post.out_weights.loc)
        var.append(post.out_weights.var)
    return np.hstack(loc), np.hstack(var)


def _aligned_names(index: int, n_below: int, n_classes: int, top: bool) -> list[str]:
    """Entry names of hidden layer ``index``'s units: ``in_<d>`` (layer 1) or ``unit<l>_<g>`` (the
    global unit g of the layer below, named as :func:`bnn_to_arviz` names its dim), ``bias``,
    ``log_scale`` and, for the top hidden layer, ``out_<k>``."""
    below = "in" if index == 0 else ("unit" if index == 1 else f"unit{index}")
    return (
        [f"{below}_{d}" for d in range(n_below)]
        + ["bias", "log_scale"]
        + ([f"out_{k}" for k in range(n_classes)] if top else [])
    )


def _kept(hyper: Mapping, depth: int, n_clients: int, widths: Sequence[Sequence[int]]) -> list[list[np.ndarray]]:
    """``kept[l][j]``: which of client j's units of hidden layer l the fusion kept (all where it records none)."""
    recorded = hyper.get("kept_units")
    if recorded is None:
        return [[np.arange(widths[j][l]) for j in range(n_clients)] for l in range(depth)]
    per_layer = [recorded] if depth == 1 else list(recorded)
    return [[np.asarray(k, dtype=np.int64) for k in layer] for layer in per_layer]


def aligned_to_arviz(
    fused,
    bnns: Sequence,
    *,
    layer: int = 0,
    units: Units = None,
    weights: Weights = None,
    num_draws: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    seed: int = 0,
    names: Sequence[str] | None = None,
) -> dict:
    """A fused BNN's hidden units and the local BNNs' units they merged, in one ``global_unit`` coordinate.

    Each unit is shown in the scale-free form the fusion compares: with
    :math:`m_k = \\mathrm{E}[\\log\\tau + \\log\\lambda_k]`, its effective incoming weights and bias
    :math:`e^{m_k}(\\tilde w_k, \\tilde b_k)` (the same whatever split of the scale between
    :math:`\\tau` and :math:`\\lambda_k` a client settled on), its log scale :math:`m_k` and, in the top
    hidden layer, its outgoing weights; all independent Gaussians. Client j's kept unit l is
    placed at the global unit it was assigned (``fused.layers[layer].assignments[j][l]``); units
    the fusion pruned are left out. Above the first layer, a unit's incoming weights are written
    in the global basis of the layer below (client j's weight from its unit matched to global
    unit g below stands at ``unit_<g>``; where it has no unit matched to g, 0 with variance 0:
    that unit contributes nothing to it), as the fusion matched them. So, with ``members =
    {k: e for k, e in exports.items() if g in e.posterior.global_unit}`` (ArviZ plots only
    coordinates every model has), ``az.plot_forest(list(members.values()),
    model_names=list(members), var_names=["theta"], coords={"global_unit": [g]}, combined=True)``
    compares global unit g with the local units merged into it.

    Parameters
    ----------
    fused : FusionResult
        ``fuse(bnns, method)`` of horseshoe BNNs with one output layer (``head="shared"``).
    bnns : sequence of HorseshoeBNN
        The local BNNs, in the order they were fused.
    layer : int
        Hidden layer, 0-based (``layer=1``: the second).
    units : None, "all", int or sequence of int
        Global units: ``None``, the first :data:`DEFAULT_UNITS`; ``"all"``; or the given ones. A
        client's export holds those of them it has a unit in; a client with none is left out.
    weights : None, "all", str, int or sequence of them
        Entries (names as in the returned exports' ``weight`` coordinate, or positions):
        ``None``, the first :data:`DEFAULT_WEIGHTS` when ``units`` is ``None`` too, else all.
    num_draws, chains, seed
        As in :func:`gaussian_to_arviz`; every export draws from its own streams.
    names : sequence of str, optional
        Names of the local models (``"client 0"``, ... by default).

    Returns
    -------
    dict of str to ArviZ object
        ``"fused"`` then one entry per client, each as :func:`gaussian_to_arviz` builds it:
        ``posterior.theta`` (chain, draw, global_unit, weight) and ``constant_data`` ``loc`` /
        ``scale`` of every unit it holds; attrs ``form="effective"``, ``layer`` (1-based),
        ``model`` and ``method``.

    Raises
    ------
    TypeError
        For a fusion that holds no HorseshoeBNN, or one with client heads.
    ValueError
        For a number of BNNs or names that does not match the fusion, or bad ``units`` / ``weights``.
    """
    from bayesfuse.inference.bnn.posterior import DeepBNNPosterior
    from bayesfuse.models.bnn import HorseshoeBNN
    from bayesfuse.models.bnn_sites import has_heads

    model = getattr(fused, "model", None)
    if not isinstance(model, HorseshoeBNN):
        raise TypeError(f"expected the fusion of horseshoe BNNs, got {type(fused).__name__}")
    if has_heads(model.state_dict()):
        raise TypeError("a fusion with client heads has no one output layer to align; align head='shared'")
    index, fused_layer = select_layer(fused, layer)
    assert index is not None  # a FusionResult has layers, so the layer has an index
    assignments = [np.asarray(a) for a in fused_layer.assignments]
    if len(bnns) != len(assignments):
        raise ValueError(f"the fusion has {len(assignments)} clients, got {len(bnns)} BNNs")
    names = [f"client {j}" for j in range(len(bnns))] if names is None else [str(n) for n in names]
    if len(names) != len(bnns) or len(set(names) | {"fused"}) != len(names) + 1:
        raise ValueError("names must name every BNN once, and none of them 'fused'")
    depth = model.depth
    posts = [DeepBNNPosterior.from_state(b.state_dict(), n) for b, n in zip(bnns, names)]
    kept = _kept(fused.hyper, depth, len(bnns), [p.hidden_sizes for p in posts])
    below = model.in_features if index == 0 else model.hidden_sizes[index - 1]
    entries = _aligned_names(index, below, model.n_classes, index == depth - 1)

    loc, var = _effective_units(DeepBNNPosterior.from_state(model.state_dict(), "the fused BNN"), index)
    chosen = np.arange(len(loc))[_select_units(units, np.arange(len(loc)))]
    columns = _select_weights(weights, entries, default_subset=units is None)
    if units is None and (len(chosen) < len(loc) or (weights is None and len(columns) < len(entries))):
        _note_default_subset(len(loc), len(chosen), len(entries), len(columns))
    options: dict[str, Any] = dict(weights=columns, num_draws=num_draws, chains=chains, seed=seed, weight_names=entries)
    attrs = {"form": "effective", "layer": index + 1, "method": str(fused.method)}
    exports = {"fused": gaussian_to_arviz(loc, var, units=chosen, **options, attrs={**attrs, "model": "fused"})}
    for j, (post, name) in enumerate(zip(posts, names)):
        loc, var = _effective_units(post, index)
        if index > 0:  # incoming weights from the client's kept units below, placed at their global units
            basis_loc, basis_var = np.zeros((len(loc), below)), np.zeros((len(loc), below))
            placed = np.asarray(fused.layers[index - 1].assignments[j])
            basis_loc[:, placed], basis_var[:, placed] = loc[:, kept[index - 1][j]], var[:, kept[index - 1][j]]
            loc = np.hstack([basis_loc, loc[:, post.hidden_sizes[index - 1] :]])
            var = np.hstack([basis_var, var[:, post.hidden_sizes[index - 1] :]])
        rows, at = kept[index][j], assignments[j]
        present = [int(g) for g in chosen if g in set(at.tolist())]
        if not present:
            continue
        order = np.argsort(at)
        exports[name] = gaussian_to_arviz(
            loc[rows][order],
            var[rows][order],
            units=present,
            unit_ids=at[order],
            **options,
            attrs={**attrs, "model": name},
        )
    return exports


# ------------------------------------------------------------------------------ BNNs with test data

#: The posterior variables of :func:`bnn_to_arviz` (the Pyro model's sample sites) and their dims.
BNN_SITE_DIMS = {
    "tau": [],
    "lam": ["unit"],
    "w1": ["unit", "input"],
    "b1": ["unit"],
    "w_out": ["class", "unit"],
    "b_out": ["class"],
}


def _bnn_site_dims(depth: int) -> dict[str, list[str]]:
    """The posterior's variables and their dims for ``depth`` hidden layers (:data:`BNN_SITE_DIMS` for one).

    Names are stable across depths: hidden layer l is ``w<l>``, ``b<l>`` (``unit<l>``; layer 1's
    dim is ``unit``) with scales ``tau<l>``, ``lam<l>`` (layer 1's ``tau``, ``lam``), and the
    output layer is ``w_out``, ``b_out`` at every depth."""
    dims: dict[str, list[str]] = {}
    below = "input"
    for layer in range(1, depth + 1):
        tag = "" if layer == 1 else str(layer)
        unit = f"unit{tag}"
        dims.update({f"tau{tag}": [], f"lam{tag}": [unit], f"w{layer}": [unit, below], f"b{layer}": [unit]})
        below = unit
    dims.update({"w_out": ["class", below], "b_out": ["class"]})
    return dims


def _bnn_site(name: str, depth: int) -> str:
    """The Pyro site behind an exported variable (``w_out`` is ``w<depth + 1>``)."""
    return {"w_out": f"w{depth + 1}", "b_out": f"b{depth + 1}"}.get(name, name)


def _bnn_selection(model, units: Units, inputs: Weights) -> dict[str, np.ndarray]:
    """Positions kept along each dim of a BNN export: ``unit`` (and ``unit2``, ...) of every hidden
    layer by ``units``, ``input`` by ``inputs`` (the first :data:`DEFAULT_WEIGHTS` by default when
    ``units`` is the default too), every class."""
    keep: dict[str, np.ndarray] = {}
    for layer, width in enumerate(model.hidden_sizes, 1):
        dim = "unit" if layer == 1 else f"unit{layer}"
        try:
            keep[dim] = _select_units(units, np.arange(width))
        except ValueError as err:
            raise ValueError(f"hidden layer {layer}: {err}") from None
    names = [f"in_{d}" for d in range(model.in_features)]
    keep["input"] = _select_weights(inputs, names, default_subset=units is None)
    keep["class"] = np.arange(model.n_classes)
    return keep


def _note_bnn_subset(model, keep: Mapping[str, np.ndarray]) -> None:
    """The one line saying that the default BNN export drew part of the network, and how to draw more."""
    widths = list(model.hidden_sizes)
    drawn = [len(keep["unit" if layer == 1 else f"unit{layer}"]) for layer in range(1, len(widths) + 1)]
    if drawn == widths and len(keep["input"]) == model.in_features:
        return
    _log.warning(
        "bnn_to_arviz drew %s of %s units x %d of %d inputs (the default, sized for az.summary and "
        "az.plot_forest); units='all' or [ids], inputs='all' or [names] draw more",
        "+".join(map(str, drawn)),
        "+".join(map(str, widths)),
        len(keep["input"]),
        model.in_features,
    )


def _describe_drawn(positions: np.ndarray, n: int) -> str:
    """``"all"`` when ``positions`` are ``0 .. n-1`` in order, else which they are."""
    return "all" if len(positions) == n and (positions == np.arange(n)).all() else _describe_ids(positions)


def _bnn_posterior(
    values: Mapping[str, np.ndarray], site_dims: Mapping[str, list[str]], keep: Mapping[str, np.ndarray], chains: int
) -> dict[str, np.ndarray]:
    """``values`` (draws first) as ``(chain, draw, ...)`` arrays, sliced to the positions ``keep`` of each dim."""
    out = {}
    for name, value in values.items():
        value = value.reshape(chains, -1, *value.shape[1:])
        for axis, dim in enumerate(site_dims[name], 2):
            value = np.take(value, keep[dim], axis=axis)
        out[name] = value
    return out


def bnn_to_arviz(
    model,
    x,
    y,
    *,
    data: Literal["train", "held-out"] | None = None,
    num_samples: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    units: Units = None,
    inputs: Weights = None,
    seed: int = 0,
    sites: Sequence[str] | None = None,
    batch_size: int = 4096,
):
    """A horseshoe BNN and data -> ArviZ: its posterior draws and the pointwise log-likelihood of ``y``.

    PSIS-LOO (``az.loo``, ``az.compare``) estimates the out-of-sample fit of a posterior from
    the pointwise log-likelihood of the data it was fitted to, by leaving each point out in
    turn. On held-out data there is nothing to leave out: the held-out log predictive density
    :math:`\\sum_i \\log \\frac{1}{S}\\sum_s p(y_i \\mid x_i, \\theta_s)` is itself the estimate,
    and LOO's correction of it is wrong (on 450 test digits a fused BNN's ``elpd_loo`` was
    -1936 with 100 draws and -3200 with 1000, against -230.5 held out). So say which data
    ``x``, ``y`` are: ``data="train"`` for the data the posterior was fitted to (for a fused BNN,
    the clients' data together), the export that ``az.loo`` is for; ``data="held-out"``
    for test data, an export that carries its pointwise log-likelihood but says, in its attrs
    and in a :class:`HeldOutDataWarning`, that LOO does not apply and that
    :func:`compare` is the comparison for it. Without ``data`` the same warning asks which.

    Parameters
    ----------
    model : HorseshoeBNN or FusionResult
        A :class:`~bayesfuse.models.bnn.HorseshoeBNN`, or a result whose ``.model`` is one
        (``fuse(bnns, "kl")``; its method and hyper-parameters go into the attrs).
    x : array (n, D)
        Inputs.
    y : array (n,) of int
        Labels.
    data : "train" or "held-out"
        Whether ``x``, ``y`` are the data the posterior was fitted to (``az.loo`` applies) or
        held-out data (it does not: use :func:`compare`). Recorded as ``data`` in the attrs of
        ``posterior`` and ``log_likelihood``, with a ``loo`` note.
    num_samples : int
        Independent draws per chain from the mean-field guide. The ``chains * num_samples``
        draws, chain after chain, are those of ``model.predict(x, chains * num_samples,
        seed=seed)``: the mean of ``exp(log_likelihood)`` over all draws is its probability of ``y``.
    chains : int
        Chains of independent draws (:data:`DEFAULT_CHAINS`: ArviZ's ``r_hat`` needs two; with
        one, ``az.summary`` logs a shape warning and gives NaN).
    units : None, "all" or sequence of int
        Which units of every hidden layer the posterior holds: ``None``, the first
        :data:`DEFAULT_UNITS`; ``"all"``; or the given ids, in the given order. The
        log-likelihood is always the whole network's.
    inputs : None, "all", str, int or sequence of them
        Which inputs of ``w1`` the posterior holds: ``None``, the first :data:`DEFAULT_WEIGHTS`
        when ``units`` is ``None`` too, else all; ``"all"``; or names (``in_3``) or positions.
        When the defaults leave something out, one line is logged (logger
        ``bayesfuse.analysis``) saying how to draw more. Any selection is an exact slice of
        the full export.
    seed : int
        Seed of the guide's draws (as ``predict``) and of the posterior predictive labels.
    sites : sequence of str, optional
        Posterior variables to keep, of ``tau``, ``lam``, ``w1``, ``b1`` (and ``tau2``, ``lam2``,
        ``w2``, ``b2``, ... for deeper networks), ``w_out``, ``b_out`` (all by default; ``w1``
        takes ``num_samples * hidden * D`` numbers).
    batch_size : int
        Test points per forward pass.

    Returns
    -------
    arviz.InferenceData (ArviZ 0.2x) or xarray.DataTree (ArviZ 1.x)
        ``posterior``: the model's sites (``tau``, ``lam`` (unit), ``w1`` (unit, input), ``b1``
        (unit); ``tau2``, ``lam2`` (unit2), ``w2`` (unit2, unit), ``b2`` (unit2) and so on for
        deeper networks; the output layer ``w_out`` (class, unit of the top hidden layer),
        ``b_out`` (class), named alike at every depth), ``chains`` chains of independent draws,
        of the units and inputs selected; ``log_likelihood.y`` and ``posterior_predictive.y``
        (chain, draw, obs); ``observed_data.y`` (obs). ``az.loo``'s relative efficiency of
        such draws is about 1, as it should be for independent draws.

    Warns
    -----
    HeldOutDataWarning
        With ``data="held-out"`` (LOO does not apply), or without ``data``.

    Raises
    ------
    TypeError
        When ``model`` is not a HorseshoeBNN and holds none.
    ValueError
        For inputs of the wrong shape, non-finite inputs, labels outside ``0 .. K-1``, unknown
        ``sites`` or ``data``, bad ``units`` or ``inputs``, or non-positive counts.
    """
    import torch

    from bayesfuse.models.bnn import HorseshoeBNN, forward_logits
    from bayesfuse.models.bnn_sites import has_heads

    result = None
    if not isinstance(model, HorseshoeBNN):
        inner = getattr(model, "model", None)
        if not isinstance(inner, HorseshoeBNN):
            raise TypeError(f"expected a HorseshoeBNN or a result holding one, got {type(model).__name__}")
        result, model = model, inner
    if has_heads(model.state_dict()):  # a HeadMixtureBNN
        raise TypeError(
            "a HeadMixtureBNN predicts a mixture of its clients' heads, whose log-likelihood per "
            "draw this export does not compute; export the shared-head fusion (head='shared')"
        )
    num_samples = _check_count(num_samples, "num_samples")
    chains = _check_count(chains, "chains")
    batch_size = _check_count(batch_size, "batch_size")
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y)
    D, K, H = model.in_features, model.n_classes, model.hidden
    if x.ndim != 2 or x.shape[1] != D or len(x) == 0:
        raise ValueError(f"x must be (n, {D}) with n > 0, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x contains NaN or infinite values")
    if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= K:
        raise ValueError(f"y must be ({len(x)},) integer labels in 0..{K - 1}")
    loo_note = _loo_note(data)
    site_dims = _bnn_site_dims(model.depth)
    keep = list(site_dims) if sites is None else list(sites)
    unknown = sorted(set(keep) - set(site_dims))
    if unknown:
        raise ValueError(f"unknown sites {unknown}; the sites are {list(site_dims)}")
    keep_at = _bnn_selection(model, units, inputs)
    if units is None:
        _note_bnn_subset(model, keep_at)

    total = chains * num_samples
    p = model.sample_params(total, torch.Generator().manual_seed(int(seed)))  # as model.predict draws them
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    rng = np.random.default_rng(int(seed))
    loglik = np.empty((total, len(x)))
    y_rep = np.empty((total, len(x)), dtype=np.int64)
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = forward_logits(xt[i : i + batch_size], p, model.depth)  # (S, b, K)
            logp = torch.log_softmax(logits, -1)
            b = logp.shape[1]
            loglik[:, i : i + b] = logp.gather(-1, yt[i : i + b].expand(total, b)[..., None])[..., 0].numpy()
            cdf = logp.exp().cumsum(-1).numpy()
            y_rep[:, i : i + b] = np.minimum((cdf < rng.random((total, b, 1))).sum(-1), K - 1)
    values = {}
    for k in site_dims:  # the scales as themselves, from the guide's log-scale sites
        if k.startswith(("tau", "lam")):
            log = p["log_" + k]
            values[k] = torch.exp(log[:, 0] if k.startswith("tau") else log)
        else:
            values[k] = p[_bnn_site(k, model.depth)]
    posterior = _bnn_posterior({k: values[k].numpy() for k in keep}, site_dims, keep_at, chains)
    attrs = {
        "method": str(result.method) if result is not None else "local",
        "hyper": _to_json(getattr(result, "hyper", None) or {}),
        "sampling": "independent",
        "sampling_note": (
            "independent draws from the BNN's mean-field guide (tau and lam log-normal, the rest "
            "Gaussian), not MCMC: r_hat ~ 1 and ess ~ draws by construction"
        ),
        "num_draws": num_samples,
        "chains": chains,
        "seed": int(seed),
        "hidden": H if model.depth == 1 else list(model.hidden_sizes),
        "data": data or "unstated",
        "loo": loo_note,
        "drawn_units": _describe_drawn(keep_at["unit"], model.hidden_sizes[0]),
        "n_drawn_inputs": len(keep_at["input"]),
        "drawn_inputs": _describe_drawn(keep_at["input"], D),
    }
    if result is not None:
        attrs["converged"] = int(bool(getattr(result, "converged", True)))
    coords = {
        "unit": keep_at["unit"],
        "input": [f"in_{d}" for d in keep_at["input"]],
        "class": np.arange(K),
        "obs": np.arange(len(x)),
        **{f"unit{layer}": keep_at[f"unit{layer}"] for layer in range(2, model.depth + 1)},
    }
    dims = {**{k: site_dims[k] for k in keep}, "y": ["obs"]}
    groups = {
        "posterior": posterior,
        "log_likelihood": {"y": loglik.reshape(chains, num_samples, -1)},
        "posterior_predictive": {"y": y_rep.reshape(chains, num_samples, -1)},
        "observed_data": {"y": y},
    }
    return _from_dict(
        groups,
        coords,
        dims,
        attrs={"posterior": attrs, "log_likelihood": {"data": data or "unstated", "loo": loo_note}},
    )


def _loo_note(data: str | None) -> str:
    """What an export of ``data`` says of LOO; warns where LOO does not apply or the data are unstated."""
    if data == "train":
        return "applies: the pointwise log-likelihood is of the data the posterior was fitted to"
    if data == "held-out":
        warn_from_caller(
            "LOO does not apply to held-out data: az.loo and az.compare estimate out-of-sample fit from "
            "the data the posterior was fitted to, and on held-out data their elpd_loo is not a valid "
            "estimate; the held-out log predictive density is: bayesfuse.analysis.compare(models, x, y)",
            HeldOutDataWarning,
        )
        return (
            "does not apply: the log-likelihood is of held-out data; compare models with "
            "bayesfuse.analysis.compare(models, x, y), the held-out log predictive density"
        )
    if data is None:
        warn_from_caller(
            "say which data x, y are: data='train' for the data the posterior was fitted to (az.loo "
            "applies), data='held-out' for test data (LOO does not apply: compare models with "
            "bayesfuse.analysis.compare(models, x, y))",
            HeldOutDataWarning,
        )
        return "unknown: the export was not told whether x, y are the data the posterior was fitted to"
    raise ValueError(f"data must be 'train' or 'held-out', got {data!r}")


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


# the results' to_arviz() conveniences (bayesfuse.inference.result.exporter) call these
register_exporter("match", match_to_arviz)
register_exporter("klfusion", klfusion_to_arviz)
