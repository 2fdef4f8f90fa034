"""Gaussian mixtures for the KL-fusion experiments (Claici et al. 2020, section 5.1).

* :func:`simulate_mixture_federation` draws a global mixture and J local datasets, each from a
  random subset of the global components whose means are moved by Gaussian noise.
* :func:`fit_local_posterior` runs mean-field variational inference on one dataset
  (scikit-learn's ``BayesianGaussianMixture``, a truncated Dirichlet-process mixture with
  Normal-Wishart factors, Bishop 2006 section 10.2) and returns its components as a
  :class:`~bayesfuse.inference.expfam.NormalWishart` batch.
* :func:`hausdorff_polytopes` scores estimated means against the truth by the Hausdorff distance
  between the convex polytopes they span (Nguyen 2013), as the paper does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from bayesfuse.inference.expfam import NormalWishart

__all__ = [
    "MixtureFederation",
    "simulate_mixture_federation",
    "random_covariances",
    "fit_local_posterior",
    "hausdorff_polytopes",
]


@dataclass
class MixtureFederation:
    """Local datasets drawn from one global Gaussian mixture.

    Attributes
    ----------
    datasets : list of (n_j, D) arrays
    means : (K, D) true global means
    covariances : (K, D, D) true covariances
    components : list of int arrays
        The global components each client's data come from.
    """

    datasets: list[np.ndarray]
    means: np.ndarray
    covariances: np.ndarray
    components: list[np.ndarray]


def random_covariances(rng: np.random.Generator, n: int, dim: int, scale: float, *, low: float) -> np.ndarray:
    """``n`` random (dim, dim) covariances ``Q diag(s)^2 Q^T``: ``Q`` a random rotation (QR of a
    Gaussian matrix), axis scales ``s ~ scale * U(low, 1)``; drawn per matrix in that order."""
    covs = np.empty((n, dim, dim))
    for k in range(n):
        q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
        covs[k] = (q * (scale * rng.uniform(low, 1.0, size=dim)) ** 2) @ q.T
    return covs


def simulate_mixture_federation(
    n_clients: int = 10,
    n_components: int = 8,
    dim: int = 2,
    *,
    separation: float = 1.0,
    noise: float = 0.1,
    components_per_client: int | None = None,
    n_per_component: int = 100,
    component_scale: float = 0.15,
    seed: int = 0,
) -> MixtureFederation:
    """Draw a heterogeneous federation of Gaussian-mixture datasets.

    Global means ``mu_k ~ N(0, separation^2 I)``; covariances with random orientation and
    axis scales ``component_scale * U(0.3, 1)`` (elongated ellipses, so that covariances carry
    information means lack). Client j picks ``components_per_client`` components at random
    (default K/2), moves each mean by ``N(0, noise^2 I)``, and draws ``n_per_component`` points
    from each.
    """
    if n_clients < 1 or n_components < 1 or dim < 1:
        raise ValueError("n_clients, n_components and dim must be positive")
    if separation <= 0 or noise < 0 or component_scale <= 0:
        raise ValueError("separation and component_scale must be positive, noise non-negative")
    m = components_per_client or max(1, n_components // 2)
    if m > n_components:
        raise ValueError(f"components_per_client={m} exceeds n_components={n_components}")
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, separation, size=(n_components, dim))
    covs = random_covariances(rng, n_components, dim, component_scale, low=0.3)
    datasets, components = [], []
    for _ in range(n_clients):
        idx = np.sort(rng.choice(n_components, m, replace=False))
        local_means = means[idx] + rng.normal(0.0, noise, size=(m, dim)) if noise > 0 else means[idx]
        x = np.vstack([rng.multivariate_normal(mu, covs[k], size=n_per_component) for mu, k in zip(local_means, idx)])
        datasets.append(rng.permutation(x))
        components.append(idx)
    return MixtureFederation(datasets, means, covs, components)


def fit_local_posterior(
    x: np.ndarray,
    max_components: int = 10,
    *,
    weight_threshold: float = 0.02,
    seed: int = 0,
    finite: bool = False,
) -> NormalWishart:
    """Mean-field VI for a Gaussian mixture on ``x``; the used components as Normal-Wishart factors.

    scikit-learn keeps ``covariances_ = W^{-1} / dof``, so the Wishart scale is
    ``W = (dof * covariances_)^{-1}``; ``mean_precision_`` is kappa. Components whose mixture
    weight is below ``weight_threshold`` are dropped (the truncated DP leaves them empty).
    ``finite=True`` uses a finite Dirichlet prior with exactly ``max_components`` components
    (the pooled "oracle" of section 5.1, given the true number of components).
    """
    from sklearn.mixture import BayesianGaussianMixture

    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) < 2:
        raise ValueError(f"x must be (n, D) with n >= 2, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("x contains NaN or infinite values")
    bgm = BayesianGaussianMixture(
        n_components=max_components,
        covariance_type="full",
        weight_concentration_prior_type="dirichlet_distribution" if finite else "dirichlet_process",
        max_iter=1000,
        n_init=1 if finite else 3,
        random_state=seed,
    ).fit(x)
    keep = np.ones(max_components, dtype=bool) if finite else bgm.weights_ > weight_threshold
    dof = bgm.degrees_of_freedom_[keep]
    scale = np.linalg.inv(bgm.covariances_[keep] * dof[:, None, None])
    return NormalWishart(
        mean=bgm.means_[keep], kappa=bgm.mean_precision_[keep], dof=dof, scale=0.5 * (scale + np.swapaxes(scale, 1, 2))
    )


def _distance_to_hull(point: np.ndarray, vertices: np.ndarray) -> float:
    """``min_{w in simplex} ||vertices^T w - point||`` by NNLS with the sum-to-one row weighted."""
    weight = 1e3 * (1.0 + np.abs(vertices).max() + np.abs(point).max())
    a = np.vstack([vertices.T, weight * np.ones(len(vertices))])
    b = np.concatenate([point, [weight]])
    w, _ = nnls(a, b)
    w = w / w.sum()
    return float(np.linalg.norm(vertices.T @ w - point))


def hausdorff_polytopes(a: np.ndarray, b: np.ndarray) -> float:
    """Hausdorff distance between the convex hulls of the rows of ``a`` and of ``b``.

    The distance to a convex set is convex, so its largest value over a polytope sits at a
    vertex: ``max(max_{a_i} d(a_i, conv b), max_{b_k} d(b_k, conv a))``.
    """
    a, b = np.atleast_2d(np.asarray(a, float)), np.atleast_2d(np.asarray(b, float))
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"point sets live in different dimensions: {a.shape[1]} and {b.shape[1]}")
    return max(max(_distance_to_hull(p, b) for p in a), max(_distance_to_hull(p, a) for p in b))
