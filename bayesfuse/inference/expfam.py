"""Exponential families over batches of components, for KL-fusion (Claici et al., ICML 2020).

A family object holds L components (the mean-field factors of one local posterior) in their
standard parameters, e.g. ``DiagNormal(loc=[L, D], var=[L, D])``. Each family knows its natural
parameters ``eta`` (flattened to ``[L, P]``), log-normaliser ``A(eta)`` and mean parameters
``mu = grad A(eta) = E[T(x)]``. From those, everything KL-fusion needs is generic:

* KL between every pair of components of two batches, one matrix product:

  .. math:: \\mathrm{KL}(q_a \\| q_b) = A(\\eta_b) - A(\\eta_a) - \\langle \\eta_b - \\eta_a, \\mu_a \\rangle

  The per-component terms (``eta``, ``mu``, ``A``, ``<mu, eta>``) are computed once
  (:class:`KLTerms`); :func:`kl_matrix` forms any block of the matrix from them, and
  :func:`kl_moments` the mean and standard deviation of all its entries block by block, without
  holding the matrix (KL-fusion's cost scale over N x N pairs).
* the weighted KL barycenter ``argmin_q sum_i w_i KL(q || q_i)``, whose natural parameter is
  the weighted average ``sum_i w_i eta_i / sum_i w_i`` (section 3.1, Banerjee et al. 2005).

All arithmetic is NumPy float64. Constants of ``A`` that do not depend on the parameters
(``D/2 log 2 pi`` and the like) are dropped: they cancel in every KL.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import ClassVar, Sequence, TypeVar

import numpy as np
from scipy.special import digamma, gammaln, multigammaln

from bayesfuse._validation import finite_array, positive_array

__all__ = [
    "ExpFamily",
    "KLTerms",
    "kl_matrix",
    "kl_moments",
    "DiagNormal",
    "FullNormal",
    "NormalWishart",
    "Gamma",
    "Beta",
    "Dirichlet",
]

F = TypeVar("F", bound="ExpFamily")


def _logdet(m: np.ndarray) -> np.ndarray:
    sign, logdet = np.linalg.slogdet(m)
    if (sign <= 0).any():
        raise ValueError("matrix is not positive definite")
    return logdet


@dataclass(frozen=True)
class ExpFamily:
    """Base class: a batch of L components of one exponential family (see module docstring)."""

    name: ClassVar[str] = "family"

    # --- what each family provides -------------------------------------------------------
    def natural(self) -> np.ndarray:
        """Natural parameters, shape (L, P)."""
        raise NotImplementedError

    @classmethod
    def from_natural(cls: type[F], eta: np.ndarray, event_shape: tuple[int, ...]) -> F:
        raise NotImplementedError

    @classmethod
    def log_normalizer(cls, eta: np.ndarray, event_shape: tuple[int, ...]) -> np.ndarray:
        """``A(eta)`` for each row, shape (L,)."""
        raise NotImplementedError

    @classmethod
    def mean_params(cls, eta: np.ndarray, event_shape: tuple[int, ...]) -> np.ndarray:
        """``E[T(x)] = grad A(eta)``, shape (L, P)."""
        raise NotImplementedError

    @property
    def event_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    # --- generic -------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(getattr(self, fields(self)[0].name))

    def __getitem__(self: F, index) -> F:
        """The components at ``index`` (integer array, slice or boolean mask)."""
        index = np.atleast_1d(np.arange(len(self))[index])
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self)})

    @classmethod
    def concat(cls: type[F], parts: Sequence[F]) -> F:
        """One batch holding the components of ``parts`` in order."""
        check_same_family(parts)
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(parts[0])})

    def kl(self, other: ExpFamily, *, clip: bool = True) -> np.ndarray:
        """``KL(self[a] || other[b])`` for every pair, shape (len(self), len(other)).

        The formula subtracts terms of the size of ``A(eta)``, so for (nearly) equal components
        round-off can leave it slightly below 0; ``clip`` (default) returns ``max(KL, 0)``,
        ``clip=False`` the value as computed.
        """
        check_same_family([self, other])
        return kl_matrix(self.kl_terms(), other.kl_terms(), clip=clip)

    def kl_terms(self) -> KLTerms:
        """The per-component terms of the KL formula (module docstring), computed once."""
        return KLTerms.from_natural(type(self), self.natural(), self.event_shape)

    def kl_std(self, other: ExpFamily, *, block_bytes: int = 2**26) -> float:
        """Standard deviation of all entries of ``self.kl(other)``, without forming the matrix.

        Rows of the KL matrix are computed in blocks of about ``block_bytes`` and their moments
        merged (Chan, Golub & LeVeque 1983: counts, means and sums of squared deviations of
        two parts combine exactly), so memory is one block, and the result is the population
        standard deviation (``np.std``, ddof 0) of the full matrix up to round-off.
        """
        check_same_family([self, other])
        return kl_moments(self.kl_terms(), other.kl_terms(), block_bytes=block_bytes)[2]

    def barycenter(self: F, weights: np.ndarray, *, natural: np.ndarray | None = None) -> F:
        """Weighted KL barycenters: row g of ``weights`` (G, L) defines component g.

        ``argmin_q sum_l w_gl KL(q || q_l)`` has natural parameter ``sum_l w_gl eta_l / sum_l w_gl``.
        ``natural``: ``self.natural()`` when the caller holds it already (e.g. ``KLTerms.eta``).
        """
        w = finite_array(weights, "weights")
        if w.ndim == 1:
            w = w[None, :]
        if w.shape[1] != len(self) or (w < 0).any():
            raise ValueError(f"weights must be non-negative with shape (G, {len(self)}), got {w.shape}")
        total = w.sum(1, keepdims=True)
        if (total <= 0).any():
            raise ValueError("every barycenter needs a positive total weight")
        eta = self.natural() if natural is None else natural
        if eta.shape[0] != len(self):
            raise ValueError(f"natural must have one row per component ({len(self)}), got {eta.shape}")
        return self.from_natural((w / total) @ eta, self.event_shape)


@dataclass(frozen=True)
class KLTerms:
    """What ``KL(q_a || q_b)`` needs of a batch of components, each computed once.

    With ``KL(q_a || q_b) = A(eta_b) - A(eta_a) - <mu_a, eta_b> + <mu_a, eta_a>`` (module
    docstring): natural parameters ``eta`` (L, P), mean parameters ``mu`` (L, P), ``log_norm``
    ``A(eta)`` (L,) and ``self_dot`` ``<mu, eta>`` (L,). A KL matrix between two batches is then
    one matrix product (:func:`kl_matrix`), and a block of rows is a slice (``terms[rows]``).
    """

    eta: np.ndarray
    mu: np.ndarray
    log_norm: np.ndarray
    self_dot: np.ndarray

    @classmethod
    def from_natural(cls, family: type[ExpFamily], eta: np.ndarray, event_shape: tuple[int, ...]) -> KLTerms:
        """Terms of the components of ``family`` with natural parameters ``eta`` (L, P)."""
        mu = family.mean_params(eta, event_shape)
        return cls(eta, mu, family.log_normalizer(eta, event_shape), np.einsum("lp,lp->l", mu, eta))

    def __len__(self) -> int:
        return len(self.eta)

    def __getitem__(self, index) -> KLTerms:
        return KLTerms(self.eta[index], self.mu[index], self.log_norm[index], self.self_dot[index])


def kl_matrix(a: KLTerms, b: KLTerms, *, clip: bool = True) -> np.ndarray:
    """``KL(a_i || b_k)`` for every pair (module docstring), shape (len(a), len(b)); see :meth:`ExpFamily.kl`."""
    cross = a.mu @ b.eta.T - a.self_dot[:, None]
    raw = b.log_norm[None, :] - a.log_norm[:, None] - cross
    return np.maximum(raw, 0.0, out=raw) if clip else raw


def kl_moments(a: KLTerms, b: KLTerms, *, block_bytes: int = 2**26) -> tuple[int, float, float]:
    """Count, mean and standard deviation (ddof 0) of the entries of ``kl_matrix(a, b)``, streamed.

    Blocks of rows of at most ``block_bytes`` (at least one row) are formed one at a time; each
    block's mean and sum of squared deviations (two passes over the block, as ``np.std``) are
    merged into the running ones by the pairwise update of Chan, Golub & LeVeque (1983):
    ``M2 = M2_a + M2_b + delta^2 n_a n_b / (n_a + n_b)`` with ``delta`` the difference of the
    means. Memory is one block; the cost is the full ``len(a) x len(b) x P`` matrix product.
    """
    rows = max(1, int(block_bytes // (8 * max(len(b), 1))))
    count, mean, m2 = 0, 0.0, 0.0
    for start in range(0, len(a), rows):
        block = kl_matrix(a[start : start + rows], b)
        n_b = block.size
        mean_b = float(block.mean())
        block -= mean_b
        m2_b = float(np.einsum("ij,ij->", block, block))
        total = count + n_b
        delta = mean_b - mean
        mean += delta * n_b / total
        m2 += m2_b + delta * delta * count * n_b / total
        count = total
    if count == 0:
        raise ValueError("the KL matrix is empty")
    return count, mean, float(np.sqrt(m2 / count))


def check_same_family(parts: Sequence[ExpFamily]) -> None:
    if len(parts) == 0:
        raise ValueError("need at least one batch of components")
    for j, p in enumerate(parts):
        if not isinstance(p, ExpFamily):
            raise TypeError(
                f"item {j} is a {type(p).__name__}, not a batch of exponential-family components: give each "
                "client's as DiagNormal, FullNormal, Dirichlet, NormalWishart, ... (bayesfuse.inference.expfam)"
            )
    kind, shape = type(parts[0]), parts[0].event_shape
    for j, p in enumerate(parts):
        if type(p) is not kind:
            raise TypeError(f"cannot mix families: {kind.__name__} and {type(p).__name__} (item {j})")
        if p.event_shape != shape:
            raise ValueError(f"item {j} has event shape {p.event_shape}, item 0 has {shape}")


# ------------------------------------------------------------------------------ Gaussians


@dataclass(frozen=True)
class DiagNormal(ExpFamily):
    """Gaussians with diagonal covariance: ``loc`` (L, D), ``var`` (L, D).

    ``T(x) = (x, x^2)``, ``eta = (loc / var, -1 / (2 var))``,
    ``A = sum_d [loc^2 / (2 var) + log(var) / 2]``.
    """

    loc: np.ndarray
    var: np.ndarray
    name: ClassVar[str] = "diagonal Gaussian"

    def __post_init__(self):
        loc, var = finite_array(self.loc, "loc"), positive_array(self.var, "var")
        if loc.ndim != 2 or loc.shape != var.shape:
            raise ValueError(f"loc and var must both have shape (L, D), got {loc.shape} and {var.shape}")
        object.__setattr__(self, "loc", loc)
        object.__setattr__(self, "var", var)

    @property
    def event_shape(self):
        return (self.loc.shape[1],)

    def natural(self):
        return np.hstack([self.loc / self.var, -0.5 / self.var])

    @classmethod
    def from_natural(cls, eta, event_shape):
        (d,) = event_shape
        e1, e2 = eta[:, :d], eta[:, d:]
        var = -0.5 / e2
        return cls(loc=e1 * var, var=var)

    @classmethod
    def log_normalizer(cls, eta, event_shape):
        (d,) = event_shape
        e1, e2 = eta[:, :d], eta[:, d:]
        return np.sum(-(e1**2) / (4 * e2) - 0.5 * np.log(-2 * e2), axis=1)

    @classmethod
    def mean_params(cls, eta, event_shape):
        (d,) = event_shape
        var = -0.5 / eta[:, d:]
        loc = eta[:, :d] * var
        return np.hstack([loc, loc**2 + var])


@dataclass(frozen=True)
class FullNormal(ExpFamily):
    """Gaussians with full covariance: ``loc`` (L, D), ``cov`` (L, D, D).

    ``T(x) = (x, x x^T)``, ``eta = (Sigma^{-1} mu, -Sigma^{-1} / 2)``,
    ``A = mu^T Sigma^{-1} mu / 2 + log|Sigma| / 2``.
    """

    loc: np.ndarray
    cov: np.ndarray
    name: ClassVar[str] = "Gaussian"

    def __post_init__(self):
        loc, cov = finite_array(self.loc, "loc"), finite_array(self.cov, "cov")
        if loc.ndim != 2 or cov.shape != (*loc.shape, loc.shape[1]):
            raise ValueError(f"loc must be (L, D) and cov (L, D, D), got {loc.shape} and {cov.shape}")
        if not np.allclose(cov, np.swapaxes(cov, 1, 2)):
            raise ValueError("cov must be symmetric")
        if (np.linalg.eigvalsh(cov) <= 0).any():
            raise ValueError("cov must be positive definite")
        object.__setattr__(self, "loc", loc)
        object.__setattr__(self, "cov", cov)

    @property
    def event_shape(self):
        return (self.loc.shape[1],)

    def natural(self):
        prec = np.linalg.inv(self.cov)
        return np.hstack([np.einsum("lij,lj->li", prec, self.loc), (-0.5 * prec).reshape(len(self), -1)])

    @staticmethod
    def _split(eta, d):
        return eta[:, :d], eta[:, d:].reshape(-1, d, d)

    @classmethod
    def from_natural(cls, eta, event_shape):
        (d,) = event_shape
        e1, e2 = cls._split(eta, d)
        cov = np.linalg.inv(-2 * e2)
        cov = 0.5 * (cov + np.swapaxes(cov, 1, 2))
        return cls(loc=np.einsum("lij,lj->li", cov, e1), cov=cov)

    @classmethod
    def log_normalizer(cls, eta, event_shape):
        (d,) = event_shape
        e1, e2 = cls._split(eta, d)
        prec = -2 * e2
        mu = np.linalg.solve(prec, e1[..., None])[..., 0]
        return 0.5 * np.einsum("li,li->l", e1, mu) - 0.5 * _logdet(prec)

    @classmethod
    def mean_params(cls, eta, event_shape):
        (d,) = event_shape
        q = cls.from_natural(eta, event_shape)
        second = q.cov + np.einsum("li,lj->lij", q.loc, q.loc)
        return np.hstack([q.loc, second.reshape(len(q), -1)])


@dataclass(frozen=True)
class NormalWishart(ExpFamily):
    """Normal-Wishart over a Gaussian's mean and precision (Bishop 2006, eq. 10.59-10.63).

    ``Lambda ~ Wishart(scale, dof)``, ``mu | Lambda ~ N(mean, (kappa Lambda)^{-1})`` with
    ``mean`` (L, D), ``kappa`` (L,), ``dof`` (L,) > D - 1, ``scale`` (L, D, D).
    Sufficient statistics ``T = (Lambda mu, -mu^T Lambda mu / 2, -Lambda / 2, log|Lambda| / 2)``
    and natural parameters ``eta = (kappa m, kappa, W^{-1} + kappa m m^T, dof - D)``;
    ``A = -D/2 log kappa + dof/2 (D log 2 + log|W|) + log Gamma_D(dof / 2)``.
    """

    mean: np.ndarray
    kappa: np.ndarray
    dof: np.ndarray
    scale: np.ndarray
    name: ClassVar[str] = "Normal-Wishart"

    def __post_init__(self):
        mean = finite_array(self.mean, "mean")
        kappa, dof = positive_array(self.kappa, "kappa"), finite_array(self.dof, "dof")
        scale = finite_array(self.scale, "scale")
        if mean.ndim != 2 or kappa.shape != (len(mean),) or dof.shape != (len(mean),):
            raise ValueError("mean must be (L, D); kappa and dof (L,)")
        d = mean.shape[1]
        if scale.shape != (len(mean), d, d):
            raise ValueError(f"scale must be (L, {d}, {d}), got {scale.shape}")
        if (dof <= d - 1).any():
            raise ValueError(f"dof must exceed D - 1 = {d - 1}")
        if (np.linalg.eigvalsh(0.5 * (scale + np.swapaxes(scale, 1, 2))) <= 0).any():
            raise ValueError("scale must be positive definite")
        for k, v in dict(mean=mean, kappa=kappa, dof=dof, scale=scale).items():
            object.__setattr__(self, k, v)

    @property
    def event_shape(self):
        return (self.mean.shape[1],)

    def natural(self):
        d = self.mean.shape[1]
        e3 = np.linalg.inv(self.scale) + self.kappa[:, None, None] * np.einsum("li,lj->lij", self.mean, self.mean)
        return np.hstack(
            [self.kappa[:, None] * self.mean, self.kappa[:, None], e3.reshape(len(self), -1), (self.dof - d)[:, None]]
        )

    @staticmethod
    def _split(eta, d):
        return eta[:, :d], eta[:, d], eta[:, d + 1 : d + 1 + d * d].reshape(-1, d, d), eta[:, -1]

    @classmethod
    def from_natural(cls, eta, event_shape):
        (d,) = event_shape
        e1, kappa, e3, e4 = cls._split(eta, d)
        mean = e1 / kappa[:, None]
        w_inv = e3 - kappa[:, None, None] * np.einsum("li,lj->lij", mean, mean)
        scale = np.linalg.inv(w_inv)
        return cls(mean=mean, kappa=kappa, dof=e4 + d, scale=0.5 * (scale + np.swapaxes(scale, 1, 2)))

    @classmethod
    def log_normalizer(cls, eta, event_shape):
        (d,) = event_shape
        q = cls.from_natural(eta, event_shape)
        return (
            -0.5 * d * np.log(q.kappa)
            + 0.5 * q.dof * (d * np.log(2.0) + _logdet(q.scale))
            + multigammaln_vec(0.5 * q.dof, d)
        )

    @classmethod
    def mean_params(cls, eta, event_shape):
        (d,) = event_shape
        q = cls.from_natural(eta, event_shape)
        e_lam = q.dof[:, None, None] * q.scale
        lam_mu = np.einsum("lij,lj->li", e_lam, q.mean)
        quad = -0.5 * (d / q.kappa + np.einsum("li,li->l", q.mean, lam_mu))
        e_logdet = digamma(0.5 * (q.dof[:, None] - np.arange(d)[None, :])).sum(1) + d * np.log(2.0) + _logdet(q.scale)
        return np.hstack([lam_mu, quad[:, None], (-0.5 * e_lam).reshape(len(q), -1), 0.5 * e_logdet[:, None]])


def multigammaln_vec(a: np.ndarray, d: int) -> np.ndarray:
    """``log Gamma_d(a)`` elementwise (scipy's multigammaln takes scalars only)."""
    return np.array([multigammaln(x, d) for x in np.atleast_1d(a)])


# ------------------------------------------------------------------------ positive families


@dataclass(frozen=True)
class Gamma(ExpFamily):
    """Independent Gammas: ``shape`` (L, D), ``rate`` (L, D).

    ``T(x) = (log x, x)``, ``eta = (shape - 1, -rate)``, ``A = sum_d [lgamma(shape) - shape log rate]``.
    """

    shape: np.ndarray
    rate: np.ndarray
    name: ClassVar[str] = "Gamma"

    def __post_init__(self):
        a, b = positive_array(self.shape, "shape"), positive_array(self.rate, "rate")
        if a.ndim != 2 or a.shape != b.shape:
            raise ValueError(f"shape and rate must both be (L, D), got {a.shape} and {b.shape}")
        object.__setattr__(self, "shape", a)
        object.__setattr__(self, "rate", b)

    @property
    def event_shape(self):
        return (self.shape.shape[1],)

    def natural(self):
        return np.hstack([self.shape - 1, -self.rate])

    @classmethod
    def from_natural(cls, eta, event_shape):
        (d,) = event_shape
        return cls(shape=eta[:, :d] + 1, rate=-eta[:, d:])

    @classmethod
    def log_normalizer(cls, eta, event_shape):
        (d,) = event_shape
        a, b = eta[:, :d] + 1, -eta[:, d:]
        return np.sum(gammaln(a) - a * np.log(b), axis=1)

    @classmethod
    def mean_params(cls, eta, event_shape):
        (d,) = event_shape
        a, b = eta[:, :d] + 1, -eta[:, d:]
        return np.hstack([digamma(a) - np.log(b), a / b])


@dataclass(frozen=True)
class Beta(ExpFamily):
    """Independent Betas: ``a`` (L, D), ``b`` (L, D).

    ``T(x) = (log x, log(1 - x))``, ``eta = (a - 1, b - 1)``, ``A = sum_d log B(a, b)``.
    """

    a: np.ndarray
    b: np.ndarray
    name: ClassVar[str] = "Beta"

    def __post_init__(self):
        a, b = positive_array(self.a, "a"), positive_array(self.b, "b")
        if a.ndim != 2 or a.shape != b.shape:
            raise ValueError(f"a and b must both be (L, D), got {a.shape} and {b.shape}")
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "b", b)

    @property
    def event_shape(self):
        return (self.a.shape[1],)

    def natural(self):
        return np.hstack([self.a - 1, self.b - 1])

    @classmethod
    def from_natural(cls, eta, event_shape):
        (d,) = event_shape
        return cls(a=eta[:, :d] + 1, b=eta[:, d:] + 1)

    @classmethod
    def log_normalizer(cls, eta, event_shape):
        (d,) = event_shape
        a, b = eta[:, :d] + 1, eta[:, d:] + 1
        return np.sum(gammaln(a) + gammaln(b) - gammaln(a + b), axis=1)

    @classmethod
    def mean_params(cls, eta, event_shape):
        (d,) = event_shape
        a, b = eta[:, :d] + 1, eta[:, d:] + 1
        return np.hstack([digamma(a) - digamma(a + b), digamma(b) - digamma(a + b)])


@dataclass(frozen=True)
class Dirichlet(ExpFamily):
    """Dirichlets (topics, mixture weights): ``concentration`` (L, K).

    ``T(x) = log x``, ``eta = concentration - 1``, ``A = sum_k lgamma(alpha_k) - lgamma(sum_k alpha_k)``.
    """

    concentration: np.ndarray
    name: ClassVar[str] = "Dirichlet"

    def __post_init__(self):
        c = positive_array(self.concentration, "concentration")
        if c.ndim != 2 or c.shape[1] < 2:
            raise ValueError(f"concentration must be (L, K) with K >= 2, got {c.shape}")
        object.__setattr__(self, "concentration", c)

    @property
    def event_shape(self):
        return (self.concentration.shape[1],)

    def natural(self):
        return self.concentration - 1

    @classmethod
    def from_natural(cls, eta, event_shape):
        return cls(concentration=eta + 1)

    @classmethod
    def log_normalizer(cls, eta, event_shape):
        a = eta + 1
        return gammaln(a).sum(1) - gammaln(a.sum(1))

    @classmethod
    def mean_params(cls, eta, event_shape):
        a = eta + 1
        return digamma(a) - digamma(a.sum(1, keepdims=True))
