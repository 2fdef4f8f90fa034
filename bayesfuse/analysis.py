"""Export fused and local posteriors to ArviZ.

Draws from a Gaussian posterior (independent draws, split into chains) go into an ArviZ
object's ``posterior`` group with named dimensions; ``constant_data`` ties each global unit to
the local units assigned to it and carries usage counts and the objective trace. Everything is
built with ``arviz.from_dict``, which exists in the 0.2x line (``InferenceData``, Python 3.11)
and in 1.x (``DataTree``, newer Pythons), so ``az.summary``, ``az.plot_forest`` and ArviZ's
diagnostics work on the result with whichever ArviZ pip installed.

Results are read through what they share (:class:`~bayesfuse.inference.result.LayerResult`:
``assignments``, ``objective``, ...; a fusion's ``posteriors``), so this module imports no
result class.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np

__all__ = ["to_arviz", "match_to_arviz", "klfusion_to_arviz", "fusion_to_arviz", "gaussian_to_arviz", "local_to_arviz"]


def _arviz():
    with warnings.catch_warnings():
        # ArviZ 0.2x announces its 1.x refactor with a FutureWarning on import: only that one.
        warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")
        import arviz

    return arviz


def _from_dict(groups: dict[str, dict], coords: dict, dims: dict):
    az = _arviz()
    if int(az.__version__.split(".")[0]) >= 1:  # ArviZ 1.x: one dict of groups
        return az.from_dict(groups, coords=coords, dims=dims)
    return az.from_dict(**groups, coords=coords, dims=dims)


def _draws(mean: np.ndarray, var: np.ndarray, num_draws: int, chains: int, seed: int) -> np.ndarray:
    """Independent Gaussian draws shaped (chains, draws per chain, *mean.shape)."""
    if num_draws % chains:
        raise ValueError(f"num_draws={num_draws} must be a multiple of chains={chains}")
    rng = np.random.default_rng(seed)
    eps = rng.standard_normal((chains, num_draws // chains, *mean.shape))
    return mean + np.sqrt(var) * eps


def gaussian_to_arviz(
    mean: np.ndarray,
    var: np.ndarray,
    *,
    var_name: str = "theta",
    unit_dim: str = "global_unit",
    num_draws: int = 1000,
    chains: int = 4,
    seed: int = 0,
    constant_data: dict | None = None,
    extra_coords: dict | None = None,
    extra_dims: dict | None = None,
    weight_names: Sequence[str] | None = None,
):
    """ArviZ object with draws of independent Gaussians ``N(mean, var)`` of shape (units, weights)."""
    mean, var = np.asarray(mean, float), np.broadcast_to(np.asarray(var, float), np.shape(mean))
    if mean.ndim != 2:
        raise ValueError(f"mean must be (units, weights), got shape {mean.shape}")
    if (var < 0).any() or not np.isfinite(mean).all():
        raise ValueError("variances must be non-negative and means finite")
    coords = {unit_dim: np.arange(mean.shape[0]),
              "weight": list(weight_names) if weight_names is not None else np.arange(mean.shape[1])}
    coords.update(extra_coords or {})
    dims = {var_name: [unit_dim, "weight"], **(extra_dims or {})}
    groups = {"posterior": {var_name: _draws(mean, var, num_draws, chains, seed)}}
    if constant_data:
        groups["constant_data"] = constant_data
    return _from_dict(groups, coords, dims)


def _assignment_data(assignments: Sequence[np.ndarray], n_global: int) -> tuple[dict, dict, dict]:
    client = np.concatenate([np.full(len(a), j) for j, a in enumerate(assignments)])
    local = np.concatenate([np.arange(len(a)) for a in assignments])
    glob = np.concatenate(assignments)
    counts = np.bincount(glob, minlength=n_global)
    data = {"assigned_global_unit": glob, "client": client, "local_index": local, "counts": counts}
    coords = {"local_unit": np.arange(len(glob))}
    dims = {"assigned_global_unit": ["local_unit"], "client": ["local_unit"], "local_index": ["local_unit"],
            "counts": ["global_unit"]}
    return data, coords, dims


def _layer_to_arviz(layer, mean, var, *, num_draws, chains, seed, weight_names=None):
    """A layer result (the :class:`~bayesfuse.inference.result.LayerResult` protocol) and its
    global units' Gaussians ``N(mean, var)`` -> ArviZ."""
    data, coords, dims = _assignment_data(layer.assignments, len(mean))
    data["objective"] = np.asarray(layer.objective)
    step = "sweep" if hasattr(layer, "n_sweeps") else "step"
    coords[step] = np.arange(1, len(layer.objective) + 1)
    dims["objective"] = [step]
    return gaussian_to_arviz(mean, var, num_draws=num_draws, chains=chains, seed=seed,
                             constant_data=data, extra_coords=coords, extra_dims=dims, weight_names=weight_names)


def match_to_arviz(result, *, num_draws: int = 1000, chains: int = 4, seed: int = 0, weight_names=None):
    """:class:`~bayesfuse.inference.matching.MatchResult` -> ArviZ.

    ``posterior.theta`` (chain, draw, global_unit, weight): draws of the atoms' Gaussian
    posterior ``N(mean, var)``. ``constant_data``: for every local unit (dim ``local_unit``) its
    ``client``, ``local_index`` and ``assigned_global_unit``; ``counts`` per global unit; the
    ``objective`` per sweep.
    """
    return _layer_to_arviz(result, result.mean, result.var, num_draws=num_draws, chains=chains, seed=seed,
                           weight_names=weight_names)


def klfusion_to_arviz(result, *, num_draws: int = 1000, chains: int = 4, seed: int = 0, weight_names=None):
    """:class:`~bayesfuse.inference.klfusion.KLFusionResult` -> ArviZ (diagonal-Gaussian components).

    Same layout as :func:`match_to_arviz`, with ``objective`` per alternation step.
    """
    comp = result.components
    loc, var = getattr(comp, "loc", None), getattr(comp, "var", None)
    if loc is None or var is None or np.shape(var) != np.shape(loc):
        raise TypeError(f"ArviZ export supports diagonal-Gaussian components, got {type(comp).__name__}")
    return _layer_to_arviz(result, loc, var, num_draws=num_draws, chains=chains, seed=seed,
                           weight_names=weight_names)


def fusion_to_arviz(result, *, layer: int | str = 0, num_draws: int = 1000, chains: int = 4, seed: int = 0):
    """:class:`~bayesfuse.fusion.FusionResult` (or :class:`~bayesfuse.core.StateFusion`) -> ArviZ,
    for one matched hidden layer.

    ``layer`` is an index into ``result.layers`` or a group name of ``result.groups``
    (``"P2"``: the second hidden layer of a deep MLP). The draws are of the layer's global units
    as ``result.posteriors`` gives them: for a fused BNN its guide's unit posterior (incoming
    weights, bias, log scale, outgoing weights); for fused networks, the matching's atom
    posterior (the numbers that described each unit).
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
    return _layer_to_arviz(result.layers[layer], mean, var, num_draws=num_draws, chains=chains, seed=seed)


def to_arviz(result, *, layer: int | str = 0, num_draws: int = 1000, chains: int = 4, seed: int = 0):
    """Any result -> ArviZ: a fusion (one ``layer`` of it), a matching or a KL-fusion."""
    if hasattr(result, "posteriors"):
        return fusion_to_arviz(result, layer=layer, num_draws=num_draws, chains=chains, seed=seed)
    if hasattr(result, "components"):
        return klfusion_to_arviz(result, num_draws=num_draws, chains=chains, seed=seed)
    return match_to_arviz(result, num_draws=num_draws, chains=chains, seed=seed)


def local_to_arviz(mean, var, assignment, *, num_draws: int = 1000, chains: int = 4, seed: int = 0):
    """One client's local posterior (units as rows) labelled by the global units they were assigned.

    The ``global_unit`` coordinate of local unit l is ``assignment[l]``, so the result lines
    up with the fused export: ``az.plot_forest([fused, local_0, local_1], coords={"global_unit":
    [g]})`` compares a global unit with the local units merged into it.
    """
    mean = np.asarray(mean, float)
    assignment = np.asarray(assignment)
    if assignment.shape != (mean.shape[0],) or len(np.unique(assignment)) != len(assignment):
        raise ValueError("assignment must give each local unit a distinct global unit")
    order = np.argsort(assignment)
    return gaussian_to_arviz(mean[order], np.broadcast_to(np.asarray(var, float), mean.shape)[order],
                             num_draws=num_draws, chains=chains, seed=seed,
                             extra_coords={"global_unit": assignment[order]})
