"""What every export of :mod:`bayesfuse.analysis` shares: its sizes and defaults, the ArviZ
version in use, JSON attributes, and which units and weights to draw."""

from __future__ import annotations

import json
import logging
import math
import numbers
import warnings
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from bayesfuse._io import finite_json

_log = logging.getLogger("bayesfuse.analysis")


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


def _to_json(value: Any) -> str:
    return json.dumps(finite_json(value), allow_nan=False)


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


def _drawn(units: Units, weights: Weights, ids: np.ndarray, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the units and of the weights an export draws (:func:`_select_units`,
    :func:`_select_weights`), with the logged line where the defaults leave some out."""
    positions = _select_units(units, ids)
    columns = _select_weights(weights, names, default_subset=units is None)
    if units is None and (len(positions) < len(ids) or (weights is None and len(columns) < len(names))):
        _note_default_subset(len(ids), len(positions), len(names), len(columns))
    return positions, columns


def _draw_attrs(
    num_draws: int, chains: int, seed: int, ids: np.ndarray, positions: np.ndarray, width: int, columns: np.ndarray
) -> dict:
    """The ``posterior`` attributes of independent draws: how many, and of which units and weights."""
    n = len(ids)
    all_units = len(positions) == n and (positions == np.arange(n)).all()
    all_weights = len(columns) == width and (columns == np.arange(width)).all()
    return {
        "sampling": "independent",
        "sampling_note": SAMPLING_NOTE,
        "num_draws": num_draws,
        "chains": chains,
        "seed": seed,
        "n_units": n,
        "n_drawn_units": len(positions),
        "drawn_units": "all" if all_units else _describe_ids(ids[positions]),
        "n_weights": width,
        "n_drawn_weights": len(columns),
        "drawn_weights": "all" if all_weights else _describe_ids(columns),
    }
