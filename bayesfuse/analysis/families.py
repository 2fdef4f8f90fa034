"""KL-fusion results of any exponential family as ArviZ exports (:func:`family_to_arviz`).

The fused components of a KL-fusion are posteriors of their family: topics of an LDA are
Dirichlets over the vocabulary, an HMM's states Normal-Wisharts over a Gaussian's mean and
precision. Their export draws each component independently, as the Gaussian export does
(:func:`~bayesfuse.analysis.layers.gaussian_to_arviz`): chain ``c`` of the component at position
``p`` draws from the stream ``(seed, p, c)``, so that a component's draws do not depend on
which others are drawn.

* ``Dirichlet``: ``theta`` (component, weight) on the simplex, ``theta ~ Dir(concentration)``;
* ``Gamma``: ``theta ~ Gamma(shape, rate)`` per coordinate; ``Beta``: ``theta ~ Beta(a, b)``;
* ``NormalWishart``: ``Lambda ~ W(scale, dof)`` and ``mu | Lambda ~ N(mean, (kappa Lambda)^-1)``
  (Bishop 2006, eq. 10.59-10.63), exported as ``mu`` (component, dim) and the covariance
  ``cov = Lambda^-1`` (component, dim, dim_).

``constant_data`` holds the family's parameters, the assignments and the objective, as for
diagonal Gaussians.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from bayesfuse.analysis._common import (
    DEFAULT_CHAINS,
    DEFAULT_DRAWS,
    Units,
    Weights,
    _assignment_data,
    _check_count,
    _combine,
    _draw_attrs,
    _drawn,
    _from_dict,
    _layer_attrs,
)
from bayesfuse.nets.unit_posteriors import check_names

__all__ = ["family_to_arviz"]

#: A family's draws of one component: (rng, component position, number of draws) -> (draws, D)
#: for the per-coordinate families.
_Draw = Callable[[np.random.Generator, int, int], np.ndarray]


def _coordinate_family(comp) -> tuple[dict[str, np.ndarray], _Draw]:
    """The parameters (each (G, D)) and the draws of a Dirichlet, Gamma or Beta batch."""
    name = type(comp).__name__
    if name == "Dirichlet":
        alpha = np.asarray(comp.concentration, dtype=np.float64)
        return {"concentration": alpha}, lambda rng, p, n: rng.dirichlet(alpha[p], size=n)
    if name == "Gamma":
        shape, rate = (np.asarray(v, dtype=np.float64) for v in (comp.shape, comp.rate))
        return {"shape": shape, "rate": rate}, lambda rng, p, n: rng.gamma(
            shape[p], 1.0 / rate[p], size=(n, len(shape[p]))
        )
    if name == "Beta":
        a, b = (np.asarray(v, dtype=np.float64) for v in (comp.a, comp.b))
        return {"a": a, "b": b}, lambda rng, p, n: rng.beta(a[p], b[p], size=(n, len(a[p])))
    raise TypeError(f"no ArviZ export for {name} components")


def _normal_wishart_draws(comp, p: int, rng: np.random.Generator, n: int, dims: np.ndarray):
    """``n`` draws of component ``p``'s ``mu`` (n, d) and ``cov`` (n, d, d), on ``dims``."""
    from scipy.stats import wishart

    mean, kappa = np.asarray(comp.mean[p], dtype=np.float64), float(comp.kappa[p])
    precision = wishart(df=float(comp.dof[p]), scale=np.asarray(comp.scale[p], dtype=np.float64)).rvs(
        size=n, random_state=rng
    )
    precision = precision.reshape(n, len(mean), len(mean))
    chol = np.linalg.cholesky(kappa * precision)  # L L^T = kappa Lambda: mu = m + L^-T z
    z = rng.standard_normal((n, len(mean), 1))
    mu = mean + np.linalg.solve(np.swapaxes(chol, 1, 2), z)[..., 0]
    cov = np.linalg.inv(precision)
    return mu[:, dims], cov[:, dims][:, :, dims]


def family_to_arviz(
    result,
    *,
    units: Units = None,
    weights: Weights = None,
    num_draws: int = DEFAULT_DRAWS,
    chains: int = DEFAULT_CHAINS,
    weight_names: Sequence[str] | None = None,
    seed: int = 0,
):
    """A :class:`~bayesfuse.inference.klfusion.KLFusionResult` of Dirichlet, Gamma, Beta or
    Normal-Wishart components -> ArviZ (module docstring).

    Parameters as in :func:`~bayesfuse.analysis.layers.klfusion_to_arviz`: ``units`` picks the
    components drawn (the first 8 by default), ``weights`` their coordinates (words of a topic,
    dimensions of a state's mean; the first 8 by default), ``weight_names`` names every
    coordinate (a topic model's vocabulary).

    Returns
    -------
    arviz.InferenceData (ArviZ 0.2x) or xarray.DataTree (ArviZ 1.x)

    Raises
    ------
    TypeError
        For components of another family.
    ValueError
        For bad ``units``, ``weights``, ``weight_names`` or counts.
    """
    comp = result.components
    family = type(comp).__name__
    num_draws, chains = _check_count(num_draws, "num_draws"), _check_count(chains, "chains")
    seed = int(np.random.SeedSequence().entropy % 2**63) if seed is None else int(seed)
    n_units, width = len(comp), int(comp.event_shape[0])
    ids = np.arange(n_units)
    names = [f"dim_{d}" for d in range(width)] if weight_names is None else check_names(weight_names, width)
    positions, columns = _drawn(units, weights, ids, names)
    drawn_names = [names[d] for d in columns]
    dims = {"global_unit": ids[positions], "weight": drawn_names}
    if family == "NormalWishart":
        mu = np.empty((chains, num_draws, len(positions), len(columns)))
        cov = np.empty((chains, num_draws, len(positions), len(columns), len(columns)))
        for i, p in enumerate(positions):
            for c in range(chains):
                mu[c, :, i], cov[c, :, i] = _normal_wishart_draws(
                    comp, int(p), np.random.default_rng([seed, int(p), c]), num_draws, columns
                )
        variables = {"mu": mu, "cov": cov}
        var_dims = {"mu": ["global_unit", "weight"], "cov": ["global_unit", "weight", "weight_"]}
        dims["weight_"] = drawn_names
        params = {k: np.asarray(getattr(comp, k), dtype=np.float64) for k in ("mean", "kappa", "dof", "scale")}
        param_dims = {
            "mean": ["global_unit", "weight"],
            "kappa": ["global_unit"],
            "dof": ["global_unit"],
            "scale": ["global_unit", "weight", "weight_"],
        }
    else:
        params, draw = _coordinate_family(comp)
        theta = np.empty((chains, num_draws, len(positions), len(columns)))
        for i, p in enumerate(positions):
            for c in range(chains):
                theta[c, :, i] = draw(np.random.default_rng([seed, int(p), c]), int(p), num_draws)[:, columns]
        variables, var_dims = {"theta": theta}, {"theta": ["global_unit", "weight"]}
        param_dims = {k: ["global_unit", "weight"] for k in params}
    attrs = _layer_attrs(
        result,
        method="kl",
        hyper={
            "solver": getattr(result, "solver", None),
            "cost_scale": getattr(result, "cost_scale", None),
            "n_initial": getattr(result, "n_initial", None),
            "family": getattr(comp, "name", family),
        },
    )
    attrs.update(_draw_attrs(num_draws, chains, seed, ids, positions, width, columns))
    post = _from_dict({"posterior": variables}, dims, var_dims, attrs={"posterior": attrs})
    data, coords, data_dims = _assignment_data(result.assignments, n_units)
    data.update(params)
    data["objective"] = np.asarray(result.objective, dtype=np.float64)
    coords.update(
        {"global_unit": ids, "weight": names, "weight_": names, "step": np.arange(1, len(result.objective) + 1)}
    )
    data_dims.update(param_dims)
    data_dims["objective"] = ["step"]
    return _combine(post, _from_dict({"constant_data": data}, coords, data_dims))
