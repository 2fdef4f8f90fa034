"""Export fused and local posteriors to ArviZ.

Layers. A fused layer's global units are independent Gaussians ``N(loc, scale^2)``, one per
entry of a unit's vector (incoming weights, bias, outgoing weights, ...). Their export holds

* ``posterior.theta`` with dims ``(chain, draw, global_unit, weight)``: **independent** draws
  of that Gaussian, in one chain. They are not MCMC draws: there is nothing for ``r_hat`` to
  diagnose (ArviZ reports it as NaN for one chain, with a logged shape warning) and the
  effective sample size is the number of draws. Summarise them with
  ``az.summary(idata, kind="stats")``.
* ``constant_data``: ``loc`` and ``scale`` (dims ``global_unit``, ``weight``) of *every* unit,
  the exact posterior the draws come from (for KL-fusion the components' parameters); for
  every local unit (dim ``local_unit``) its ``client``, ``local_index`` and
  ``assigned_global_unit``; ``counts`` per global unit; the ``objective`` per sweep or step.
* attrs of ``posterior``: ``method``, ``hyper`` (a JSON string: ``json.loads`` gives the
  hyper-parameters back), ``converged`` (0 or 1), ``n_iterations``, ``objective``,
  ``sampling`` (``"independent"``), the seed and which units were drawn. Everything is a
  string or a number, so ``to_netcdf`` writes it.

The ``weight`` coordinate names each entry: the caller's ``weight_names``; for a fused
horseshoe BNN ``in_0 .. in_{D-1}``, ``bias``, ``log_scale``, ``out_0 .. out_{K-1}``; for a
matching whose ``hyper["blocks"]`` records the entries (fused networks with ``"auto"``
hyper-parameters) the network's entry names, ``layers.0.weight[3]``, ``layers.0.bias``, ...;
otherwise ``dim_0 .. dim_{D-1}``.

Size. Draws cost ``num_draws x units x weights`` numbers. The default is
:data:`DEFAULT_DRAWS` draws of as many units as fit in :data:`DRAW_BUDGET` numbers (every unit
of a small layer; the first ones of a large layer, with a warning): the 30-client, D = 794
matching of the README exports in well under a second and a few tens of MB. Pass ``units=[g,
...]`` for the units you want, ``units="all"`` for every unit. Unit ``g``'s draws come from
their own random stream (``seed``, ``g``), so an export of some units or fewer draws holds
exactly the corresponding draws of a larger one.

BNNs. :func:`bnn_to_arviz` exports a :class:`~bayesfuse.models.bnn.HorseshoeBNN` (or the
:class:`~bayesfuse.fusion.FusionResult` holding a fused one) with test data: posterior draws of
the model's sites, the pointwise ``log_likelihood`` and ``posterior_predictive`` of the test
labels and ``observed_data``, so that ``az.loo`` and ``az.compare({"fused": ..., "local 0": ...})``
(LOO by default; ``ic="loo"`` in 0.2x) rank fused and local BNNs.

Everything is built with ``arviz.from_dict``, which exists in the 0.2x line
(``InferenceData``, Python 3.11) and in 1.x (``DataTree``, newer Pythons); groups with
different unit coordinates are built separately and joined (:func:`_combine`). Results are
read through what they share (:class:`~bayesfuse.inference.result.LayerResult`:
``assignments``, ``objective``, ...; a fusion's ``posteriors``), so this module imports no
result class.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import warnings
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from bayesfuse.inference.result import register_exporter

__all__ = [
    "DEFAULT_DRAWS",
    "DRAW_BUDGET",
    "to_arviz",
    "match_to_arviz",
    "klfusion_to_arviz",
    "fusion_to_arviz",
    "gaussian_to_arviz",
    "local_to_arviz",
    "bnn_to_arviz",
]

#: Draws per unit of an export unless the caller asks for another number.
DEFAULT_DRAWS = 100
#: Numbers (draws x units x weights) the default export draws at most; ``units="all"`` or an
#: explicit ``units`` list is not limited.
DRAW_BUDGET = 2_000_000

#: What every export says about its draws (``posterior.attrs["sampling_note"]``).
SAMPLING_NOTE = ("independent draws from the Gaussian posterior N(loc, scale^2) of each entry, not MCMC: one "
                 "chain, no autocorrelation, r_hat undefined; summarise with az.summary(idata, kind='stats')")

Units = Sequence[int] | np.ndarray | int | Literal["all"] | None


# ------------------------------------------------------------------------------ ArviZ versions


def _arviz():
    with warnings.catch_warnings():
        # ArviZ 0.2x announces its 1.x refactor with a FutureWarning on import (once a day): only that one.
        warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing a major refactor",
                                category=FutureWarning, module="arviz")
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


def _warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` pointing at the first caller outside the bayesfuse package (the user's
    line, however many of the package's functions lie between)."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


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


# ------------------------------------------------------------------------------ draws of Gaussians


def _check_count(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _select_units(units: Units, unit_ids: np.ndarray, num_draws: int, width: int, what: str) -> np.ndarray:
    """Positions (into ``unit_ids``) of the units whose draws are exported."""
    n = len(unit_ids)
    if units is None:
        fit = max(1, DRAW_BUDGET // max(1, num_draws * width))
        if fit >= n:
            return np.arange(n)
        _warn(f"{what}: {n} units x {width} weights x {num_draws} draws exceed the default draw budget of "
              f"{DRAW_BUDGET:,} numbers; exported the draws of the first {fit} units (loc and scale of all {n} are "
              f"in constant_data). Pass units=[...] for the units you want, units='all' for every unit.",
              UserWarning)
        return np.arange(fit)
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
        raise ValueError(f"no unit {missing[0]} to export; the units are {_describe_ids(unit_ids)}")
    if len(set(wanted.tolist())) != len(wanted):
        raise ValueError("units must not repeat a unit")
    if len(wanted) == 0:
        raise ValueError("units is empty: ask for at least one unit")
    return np.array([position[int(u)] for u in wanted], dtype=np.int64)


def _describe_ids(ids: np.ndarray) -> str:
    ids = np.asarray(ids)
    if len(ids) and (ids == np.arange(ids[0], ids[0] + len(ids))).all():
        return f"{ids[0]}..{ids[-1]}"
    return str(ids.tolist())


def _unit_draws(loc: np.ndarray, scale: np.ndarray, positions: np.ndarray, num_draws: int, seed: int) -> np.ndarray:
    """(units, draws, weights): unit at position p of the layer draws from its own stream ``(seed, p)``."""
    out = np.empty((len(positions), num_draws, loc.shape[1]))
    for i, p in enumerate(positions):
        np.random.default_rng([seed, int(p)]).standard_normal(out=out[i])
    out *= scale[positions][:, None, :]
    out += loc[positions][:, None, :]
    return out


def _check_weight_names(names: Sequence, width: int) -> list[str]:
    names = [str(n) for n in names]
    if len(names) != width:
        raise ValueError(f"weight_names must name all {width} entries of a unit, got {len(names)} names")
    if len(set(names)) != width:
        raise ValueError("weight_names must be distinct")
    return names


def gaussian_to_arviz(
    mean: np.ndarray,
    var: np.ndarray,
    *,
    units: Units = None,
    num_draws: int = DEFAULT_DRAWS,
    seed: int = 0,
    var_name: str = "theta",
    unit_dim: str = "global_unit",
    unit_ids: Sequence[int] | None = None,
    weight_names: Sequence[str] | None = None,
    constant_data: dict | None = None,
    extra_coords: dict | None = None,
    extra_dims: dict | None = None,
    attrs: Mapping[str, Any] | None = None,
    chains: int = 1,
):
    """ArviZ object with independent draws of Gaussians ``N(mean, var)`` of shape (units, weights).

    Parameters
    ----------
    mean, var : array (G, D)
        Means and variances (``var`` broadcasts to ``mean``'s shape).
    units : None, "all", int or sequence of int
        Which units (values of the unit coordinate) get draws: ``None``, every unit when
        ``num_draws * G * D`` fits in :data:`DRAW_BUDGET`, else the first ones that fit (with a
        warning); ``"all"``; or the given ones, in the given order.
    num_draws : int
        Draws per unit.
    seed : int
        Unit ``p`` (its position in ``mean``) draws from the stream ``(seed, p)``.
    var_name, unit_dim : str
        Name of the posterior variable and of the unit dimension.
    unit_ids : sequence of int, optional
        Values of the unit coordinate (``0 .. G-1`` by default).
    weight_names : sequence of str, optional
        Values of the ``weight`` coordinate (``dim_0 ..`` by default).
    constant_data : dict, optional
        More ``constant_data`` variables (``loc`` and ``scale`` of all units are always there);
        ``extra_coords`` and ``extra_dims`` give their coordinates and dims.
    attrs : mapping, optional
        Attributes of the ``posterior`` group, next to ``sampling`` and the draw settings.
    chains : int
        Deprecated: split the draws into this many groups. They are independent draws, not
        Markov chains, so anything but 1 only makes ``r_hat`` and ``ess`` look like diagnostics.

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
        ``weight_names`` or counts.
    """
    mean = np.asarray(mean, dtype=np.float64)
    if mean.ndim != 2:
        raise ValueError(f"mean must be (units, weights), got shape {mean.shape}")
    var = np.broadcast_to(np.asarray(var, dtype=np.float64), mean.shape)
    if not np.isfinite(mean).all() or not (var >= 0).all() or not np.isfinite(var).all():
        raise ValueError("variances must be non-negative and finite, and means finite")
    num_draws = _check_count(num_draws, "num_draws")
    chains = _check_count(chains, "chains")
    if num_draws % chains:
        raise ValueError(f"num_draws={num_draws} must be a multiple of chains={chains}")
    if chains != 1:
        _warn("chains is deprecated: the draws are independent, not Markov chains; splitting them makes r_hat and "
              "ess look like diagnostics of a sampler that never ran", FutureWarning)
    seed = int(np.random.SeedSequence().entropy % 2**63) if seed is None else int(seed)
    G, D = mean.shape
    ids = np.arange(G) if unit_ids is None else np.asarray(unit_ids)
    if ids.shape != (G,):
        raise ValueError(f"unit_ids must give one id per unit ({G}), got shape {ids.shape}")
    names = [f"dim_{d}" for d in range(D)] if weight_names is None else _check_weight_names(weight_names, D)
    positions = _select_units(units, ids, num_draws, D, f"{var_name} ({G} {unit_dim}s)")
    scale = np.sqrt(var)
    draws = _unit_draws(mean, scale, positions, num_draws, seed)  # (units, draws, weights)
    draws = np.moveaxis(draws.reshape(len(positions), chains, num_draws // chains, D), 0, 2)
    drawn = ids[positions]
    posterior_attrs = {
        "sampling": "independent",
        "sampling_note": SAMPLING_NOTE,
        "num_draws": num_draws,
        "seed": seed,
        "n_units": G,
        "n_drawn_units": len(positions),
        "drawn_units": "all" if len(positions) == G and (positions == np.arange(G)).all() else _describe_ids(drawn),
        **(attrs or {}),
    }
    post = _from_dict({"posterior": {var_name: draws}}, {unit_dim: drawn, "weight": names},
                      {var_name: [unit_dim, "weight"]}, attrs={"posterior": posterior_attrs})
    data = {"loc": mean, "scale": np.array(scale), **(constant_data or {})}
    coords = {unit_dim: ids, "weight": names, **(extra_coords or {})}
    dims = {"loc": [unit_dim, "weight"], "scale": [unit_dim, "weight"], **(extra_dims or {})}
    return _combine(post, _from_dict({"constant_data": data}, coords, dims))


# ------------------------------------------------------------------------------ fused layers


def _assignment_data(assignments: Sequence[np.ndarray], n_global: int) -> tuple[dict, dict, dict]:
    client = np.concatenate([np.full(len(a), j) for j, a in enumerate(assignments)])
    local = np.concatenate([np.arange(len(a)) for a in assignments])
    glob = np.concatenate([np.asarray(a) for a in assignments])
    counts = np.bincount(glob, minlength=n_global)
    data = {"assigned_global_unit": glob, "client": client, "local_index": local, "counts": counts}
    coords = {"local_unit": np.arange(len(glob))}
    dims = {"assigned_global_unit": ["local_unit"], "client": ["local_unit"], "local_index": ["local_unit"],
            "counts": ["global_unit"]}
    return data, coords, dims


#: How a fused BNN's unit sites are named in the ``weight`` coordinate.
_BNN_ENTRY = {"w1": "in", "b1": "bias", "log_lam": "log_scale", "w2": "out"}


def _bnn_weight_names(state: Mapping, width: int) -> list[str] | None:
    """``in_0 .., bias, log_scale, out_0 ..`` when ``state`` is a horseshoe BNN's state_dict whose
    units have ``width`` entries (:class:`~bayesfuse.models.bnn_posterior.BNNPosterior`'s layout)."""
    from bayesfuse.models.bnn_sites import UNIT_SITES, body_state, state_depth, state_dims

    state = body_state(state)  # a HeadMixtureBNN's names are its body's
    if state_depth(state) != 1:  # deeper networks' units are named by position
        return None
    _, D, K = state_dims(state, "the fused BNN")
    names = []
    for site in UNIT_SITES:
        shape = list(site.shape(1, D, K))
        del shape[site.unit_axis]
        n = int(np.prod(shape, dtype=np.int64))
        base = _BNN_ENTRY.get(site.name, site.name)
        names += [base] if n == 1 else [f"{base}_{i}" for i in range(n)]
    return names if len(names) == width else None


def _block_weight_names(blocks: Sequence, width: int, n_units: int, state: Mapping | None) -> list[str] | None:
    """Entry names from ``hyper["blocks"]``: one label per entry, or one state_dict entry per
    block whose width (numbers per unit) comes from the fused ``state``."""
    blocks = list(blocks)
    if len(blocks) == width:  # one block label per entry
        labels = [b if isinstance(b, str) else f"block{b}" for b in blocks]
        sizes = {b: labels.count(b) for b in labels}
        seen: dict[str, int] = {}
        names = []
        for b in labels:
            names.append(b if sizes[b] == 1 else f"{b}[{seen.get(b, 0)}]")
            seen[b] = seen.get(b, 0) + 1
        return names
    if state is None or not all(isinstance(b, str) and b in state for b in blocks):
        return None
    names = []
    for k in blocks:
        numel = int(np.prod(np.shape(state[k]), dtype=np.int64))
        if numel % n_units:
            return None
        n = numel // n_units
        names += [k] if n == 1 else [f"{k}[{i}]" for i in range(n)]
    return names if len(names) == width else None


def _weight_names(layer, width: int, n_units: int, *, state: Mapping | None = None,
                  given: Sequence[str] | None = None) -> tuple[list[str], str]:
    """Names of a unit's entries and where they came from (``posterior.attrs["weight_names"]``):
    ``"given"``, ``"bnn"``, ``"blocks"`` or ``"index"``."""
    if given is not None:
        return _check_weight_names(given, width), "given"
    if state is not None:
        names = _bnn_weight_names(state, width)
        if names is not None:
            return names, "bnn"
    blocks = (getattr(layer, "hyper", None) or {}).get("blocks")
    if blocks is not None:
        names = _block_weight_names(blocks, width, n_units, state)
        if names is not None:
            return names, "blocks"
    return [f"dim_{d}" for d in range(width)], "index"


def _fused_state(result) -> Mapping | None:
    """The fused network's state_dict: ``result.model``'s, or a StateFusion's ``state``."""
    model = getattr(result, "model", None)
    if model is not None and hasattr(model, "state_dict"):
        return model.state_dict()
    state = getattr(result, "state", None)
    return state if isinstance(state, Mapping) else None


def _layer_to_arviz(layer, mean, var, *, attrs: dict, state: Mapping | None = None, weight_names=None,
                    units: Units, num_draws: int, seed: int, chains: int):
    """A layer result (the :class:`~bayesfuse.inference.result.LayerResult` protocol) and its
    global units' Gaussians ``N(mean, var)`` -> ArviZ."""
    mean = np.asarray(mean, dtype=np.float64)
    if mean.ndim != 2:
        raise ValueError(f"the layer's posterior mean must be (units, weights), got shape {mean.shape}")
    names, source = _weight_names(layer, mean.shape[1], mean.shape[0], state=state, given=weight_names)
    data, coords, dims = _assignment_data(layer.assignments, len(mean))
    data["objective"] = np.asarray(layer.objective, dtype=np.float64)
    step = "sweep" if hasattr(layer, "n_sweeps") else "step"
    coords[step] = np.arange(1, len(layer.objective) + 1)
    dims["objective"] = [step]
    return gaussian_to_arviz(mean, var, units=units, num_draws=num_draws, seed=seed, chains=chains,
                             weight_names=names, constant_data=data, extra_coords=coords, extra_dims=dims,
                             attrs={**attrs, "weight_names": source})


def _matching_method(hyper: Mapping) -> str:
    return "nafi" if float(hyper.get("kl_weight") or 0) > 0 else "pfnm"


def match_to_arviz(result, *, units: Units = None, num_draws: int = DEFAULT_DRAWS,
                   weight_names: Sequence[str] | None = None, seed: int = 0, chains: int = 1):
    """:class:`~bayesfuse.inference.matching.MatchResult` -> ArviZ.

    ``posterior.theta`` (chain, draw, global_unit, weight): independent draws of the atoms'
    Gaussian posterior ``N(mean, var)``; ``constant_data``: ``loc``/``scale`` of every atom, the
    assignments, ``counts`` and the ``objective`` per sweep; method, hyper-parameters and
    convergence in ``posterior.attrs`` (module docstring).

    Parameters
    ----------
    result : MatchResult
    units : None, "all", int or sequence of int
        Global units to draw: ``None`` (default) as many as fit in :data:`DRAW_BUDGET`
        numbers, ``"all"``, or the given ones.
    num_draws : int
        Draws per unit (:data:`DEFAULT_DRAWS`).
    weight_names : sequence of str, optional
        Names of an atom's D entries; by default from ``result.hyper["blocks"]`` when it labels
        each entry, else ``dim_0 ..``.
    seed : int
        Atom g draws from the stream ``(seed, g)``.
    chains : int
        Deprecated (see :func:`gaussian_to_arviz`).
    """
    hyper = dict(getattr(result, "hyper", None) or {})
    attrs = _layer_attrs(result, method=_matching_method(hyper), hyper=hyper)
    return _layer_to_arviz(result, result.mean, result.var, attrs=attrs, weight_names=weight_names, units=units,
                           num_draws=num_draws, seed=seed, chains=chains)


def klfusion_to_arviz(result, *, units: Units = None, num_draws: int = DEFAULT_DRAWS,
                      weight_names: Sequence[str] | None = None, seed: int = 0, chains: int = 1):
    """:class:`~bayesfuse.inference.klfusion.KLFusionResult` -> ArviZ (diagonal-Gaussian components).

    Same layout and parameters as :func:`match_to_arviz`: ``constant_data.loc`` and ``scale``
    are the components' parameters per dimension, ``objective`` is per alternation step, and
    ``hyper`` records the solver, the cost scale and the initial number of components.

    Raises
    ------
    TypeError
        For components that are not diagonal Gaussians (no ``loc`` and ``var`` of one shape).
    """
    comp = result.components
    loc, var = getattr(comp, "loc", None), getattr(comp, "var", None)
    if loc is None or var is None or np.shape(var) != np.shape(loc):
        raise TypeError(f"ArviZ export supports diagonal-Gaussian components, got {type(comp).__name__}")
    hyper = {"solver": getattr(result, "solver", None), "cost_scale": getattr(result, "cost_scale", None),
             "n_initial": getattr(result, "n_initial", None), "family": getattr(comp, "name", type(comp).__name__)}
    attrs = _layer_attrs(result, method="kl", hyper=hyper)
    return _layer_to_arviz(result, loc, var, attrs=attrs, weight_names=weight_names, units=units,
                           num_draws=num_draws, seed=seed, chains=chains)


def fusion_to_arviz(result, *, layer: int | str = 0, units: Units = None, num_draws: int = DEFAULT_DRAWS,
                    weight_names: Sequence[str] | None = None, seed: int = 0, chains: int = 1):
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
    if not result.layers:
        raise ValueError(f"a {result.method} result has no matched layers to export")
    if isinstance(layer, str):
        groups = list(getattr(result, "groups", ()))
        if layer not in groups:
            raise ValueError(f"no layer {layer!r}; the matched groups are {groups}")
        layer = groups.index(layer)
    if not -len(result.layers) <= layer < len(result.layers):
        raise IndexError(f"layer {layer} out of range: the result has {len(result.layers)} matched layers")
    mean, var = result.posteriors[layer]
    fused = result.layers[layer]
    attrs = _layer_attrs(fused, method=str(result.method), hyper=getattr(result, "hyper", None),
                         layer_hyper=getattr(fused, "hyper", None))
    groups = tuple(getattr(result, "groups", ()))
    attrs["layer"] = groups[layer] if groups else str(layer)
    return _layer_to_arviz(fused, mean, var, attrs=attrs, state=_fused_state(result), weight_names=weight_names,
                           units=units, num_draws=num_draws, seed=seed, chains=chains)


def to_arviz(result, *, layer: int | str = 0, **options):
    """Any result -> ArviZ: a fusion (one ``layer`` of it), a matching or a KL-fusion.

    ``options`` (``units``, ``num_draws``, ``weight_names``, ``seed``) as in
    :func:`match_to_arviz`. A :class:`~bayesfuse.models.bnn.HorseshoeBNN` with test data goes
    to :func:`bnn_to_arviz`.
    """
    if hasattr(result, "posteriors"):
        return fusion_to_arviz(result, layer=layer, **options)
    if hasattr(result, "components"):
        return klfusion_to_arviz(result, **options)
    if hasattr(result, "sample_params"):
        raise TypeError("a BNN exports with its test data: bnn_to_arviz(model, x, y)")
    return match_to_arviz(result, **options)


def local_to_arviz(mean, var, assignment, *, units: Units = None, num_draws: int = DEFAULT_DRAWS,
                   weight_names: Sequence[str] | None = None, seed: int = 0, chains: int = 1):
    """One client's local posterior (units as rows) labelled by the global units they were assigned.

    The ``global_unit`` coordinate of local unit l is ``assignment[l]``, so the result lines
    up with the fused export: ``az.plot_forest([fused, local_0, local_1], coords={"global_unit":
    [g]})`` compares a global unit with the local units merged into it. ``units`` selects by
    global unit; pass the fused export's ``weight_names`` (``fused.posterior.weight.values``) to
    name the entries alike. Other parameters as in :func:`gaussian_to_arviz`.

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
    return gaussian_to_arviz(mean[order], var[order], units=units, num_draws=num_draws, seed=seed, chains=chains,
                             unit_ids=assignment[order], weight_names=weight_names,
                             attrs={"method": "local", "weight_names": source})


# ------------------------------------------------------------------------------ BNNs with test data

#: The posterior variables of :func:`bnn_to_arviz` (the Pyro model's sample sites) and their dims.
BNN_SITE_DIMS = {"tau": [], "lam": ["unit"], "w1": ["unit", "input"], "b1": ["unit"], "w2": ["class", "unit"],
                 "b2": ["class"]}


def _bnn_site_dims(depth: int) -> dict[str, list[str]]:
    """The posterior's variables and their dims for ``depth`` hidden layers (:data:`BNN_SITE_DIMS` for one):
    hidden layer l >= 2 adds ``tau<l>``, ``lam<l>`` (``unit<l>``), ``w<l>`` (``unit<l>``, ``unit<l-1>``), ``b<l>``."""
    if depth == 1:
        return dict(BNN_SITE_DIMS)
    dims: dict[str, list[str]] = {}
    below = "input"
    for layer in range(1, depth + 1):
        tag = "" if layer == 1 else str(layer)
        unit = f"unit{tag}"
        dims.update({f"tau{tag}": [], f"lam{tag}": [unit], f"w{layer}": [unit, below], f"b{layer}": [unit]})
        below = unit
    dims.update({f"w{depth + 1}": ["class", below], f"b{depth + 1}": ["class"]})
    return dims


def bnn_to_arviz(model, x, y, *, num_samples: int = DEFAULT_DRAWS, seed: int = 0,
                 sites: Sequence[str] | None = None, batch_size: int = 4096):
    """A horseshoe BNN and test data -> ArviZ, for ``az.loo`` and ``az.compare``.

    Parameters
    ----------
    model : HorseshoeBNN or FusionResult
        A :class:`~bayesfuse.models.bnn.HorseshoeBNN`, or a result whose ``.model`` is one
        (``fuse(bnns, "kl")``; its method and hyper-parameters go into the attrs).
    x : array (n, D)
        Test inputs.
    y : array (n,) of int
        Test labels.
    num_samples : int
        Independent draws from the mean-field guide. They are the draws of
        ``model.predict(x, num_samples, seed=seed)``: the mean of ``exp(log_likelihood)`` over
        draws is its probability of ``y``.
    seed : int
        Seed of the guide's draws (as ``predict``) and of the posterior predictive labels.
    sites : sequence of str, optional
        Posterior variables to keep, of ``tau``, ``lam``, ``w1``, ``b1``, ``w2``, ``b2`` (all
        by default; ``w1`` takes ``num_samples * hidden * D`` numbers).
    batch_size : int
        Test points per forward pass.

    Returns
    -------
    arviz.InferenceData (ArviZ 0.2x) or xarray.DataTree (ArviZ 1.x)
        ``posterior``: the model's sites (``tau``, ``lam`` (unit), ``w1`` (unit, input), ``b1``
        (unit), ``w2`` (class, unit), ``b2`` (class)), one chain of independent draws;
        ``log_likelihood.y`` and ``posterior_predictive.y`` (chain, draw, obs);
        ``observed_data.y`` (obs). ``az.loo`` needs no relative efficiency for them (one chain:
        ``reff = 1``, right for independent draws).

    Raises
    ------
    TypeError
        When ``model`` is not a HorseshoeBNN and holds none.
    ValueError
        For inputs of the wrong shape, non-finite inputs, labels outside ``0 .. K-1``, unknown
        ``sites`` or non-positive counts.
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
        raise TypeError("a HeadMixtureBNN predicts a mixture of its clients' heads, whose log-likelihood per "
                        "draw this export does not compute; export the shared-head fusion (head='shared')")
    num_samples = _check_count(num_samples, "num_samples")
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
    site_dims = _bnn_site_dims(model.depth)
    keep = list(site_dims) if sites is None else list(sites)
    unknown = sorted(set(keep) - set(site_dims))
    if unknown:
        raise ValueError(f"unknown sites {unknown}; the sites are {list(site_dims)}")

    p = model.sample_params(num_samples, torch.Generator().manual_seed(int(seed)))  # as model.predict draws them
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))
    rng = np.random.default_rng(int(seed))
    loglik = np.empty((num_samples, len(x)))
    y_rep = np.empty((num_samples, len(x)), dtype=np.int64)
    with torch.no_grad():
        for i in range(0, len(x), batch_size):
            logits = forward_logits(xt[i : i + batch_size], p, model.depth)  # (S, b, K)
            logp = torch.log_softmax(logits, -1)
            b = logp.shape[1]
            loglik[:, i : i + b] = logp.gather(-1, yt[i : i + b].expand(num_samples, b)[..., None])[..., 0].numpy()
            cdf = logp.exp().cumsum(-1).numpy()
            y_rep[:, i : i + b] = np.minimum((cdf < rng.random((num_samples, b, 1))).sum(-1), K - 1)
    values = {}
    for k in site_dims:  # the scales as themselves, from the guide's log-scale sites
        if k.startswith(("tau", "lam")):
            log = p["log_" + k]
            values[k] = torch.exp(log[:, 0] if k.startswith("tau") else log)
        else:
            values[k] = p[k]
    posterior = {k: values[k].numpy()[None] for k in keep}
    attrs = {
        "method": str(result.method) if result is not None else "local",
        "hyper": _to_json(getattr(result, "hyper", None) or {}),
        "sampling": "independent",
        "sampling_note": ("independent draws from the BNN's mean-field guide (tau and lam log-normal, the rest "
                          "Gaussian), not MCMC: one chain; summarise with az.summary(idata, kind='stats')"),
        "num_draws": num_samples,
        "seed": int(seed),
        "hidden": H if model.depth == 1 else list(model.hidden_sizes),
    }
    if result is not None:
        attrs["converged"] = int(bool(getattr(result, "converged", True)))
    coords = {"unit": np.arange(model.hidden_sizes[0]), "input": [f"in_{d}" for d in range(D)],
              "class": np.arange(K), "obs": np.arange(len(x)),
              **{f"unit{layer}": np.arange(h) for layer, h in enumerate(model.hidden_sizes[1:], 2)}}
    dims = {**{k: site_dims[k] for k in keep}, "y": ["obs"]}
    groups = {"posterior": posterior, "log_likelihood": {"y": loglik[None]},
              "posterior_predictive": {"y": y_rep[None]}, "observed_data": {"y": y}}
    return _from_dict(groups, coords, dims, attrs={"posterior": attrs})


# the results' to_arviz() conveniences (bayesfuse.inference.result.exporter) call these
register_exporter("match", match_to_arviz)
register_exporter("klfusion", klfusion_to_arviz)
