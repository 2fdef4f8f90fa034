"""BBP-MAP matching of neurons: PFNM (Yurochkin et al., 2019) and NAFI (Xiao & Cheng).

Model (PFNM eq. 1 of the main text; supplement section 1). Global atoms
``theta_i ~ N(mu0, diag(sigma0^2))``; a Beta-Bernoulli process (the IBP with mass ``gamma0``)
decides which atoms each of the J clients uses; client j observes each selected atom once, in a
random order, as ``v_jl ~ N(theta_i, diag(sigma_j^2))``. Given the assignments the atoms have a
Gaussian posterior (supplement eq. 2, NAFI eq. 4 / Prop. 2) with natural parameters

.. math::

    \\lambda_i = 1/\\sigma_0^2 + \\sum_{(j,l) \\to i} 1/\\sigma_{jl}^2, \\qquad
    h_i = \\mu_0/\\sigma_0^2 + \\sum_{(j,l) \\to i} v_{jl}/\\sigma_{jl}^2, \\qquad
    \\hat\\theta_i = h_i / \\lambda_i .

MAP over assignments alternates over clients: remove client j, build the cost of giving each of
its neurons to each atom used by the others or to a new atom, solve that linear assignment
problem (Hungarian, ``scipy.optimize.linear_sum_assignment``), put client j back.

All arrays are NumPy float64; torch tensors are accepted and converted. Every cost matrix is a
handful of matrix products (``||a + b||^2 = ||a||^2 + 2 a.b + ||b||^2``), never a loop over
neurons or atoms.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.special import gammaln
from tqdm.auto import tqdm

from bayesfuse._validation import finite_array, positive_array
from bayesfuse.inference.empirical_bayes import em_step, initial_hyper, noise_matrix
from bayesfuse.inference.result import ConvergenceWarning, warn_not_converged

__all__ = ["MatchResult", "match_neurons", "log_marginal_posterior", "assignment_cost"]

#: EM steps on the hyper-parameters between two matchings (``"auto"``).
EM_STEPS = 5

Cost = Literal["pfnm", "marginal"]


@dataclass
class MatchResult:
    """Outcome of :func:`match_neurons`.

    Attributes
    ----------
    assignments : list of ndarray of int
        ``assignments[j][l]`` is the global atom of client j's neuron l.
    mean : ndarray (G, D)
        Posterior mean of each global atom, ``h_i / lambda_i`` (supplement eq. 2).
    var : ndarray (G, D)
        Posterior variance of each entry, ``1 / lambda_i``.
    counts : ndarray (G,)
        ``m_i``: number of clients using atom i.
    objective : list of float
        ``log p(neurons, assignments)`` with atoms integrated out (see
        :func:`log_marginal_posterior`) after each sweep.
    converged : bool
        True when a sweep changed no assignment, or when the sweeps came back to an earlier
        matching (NAFI's penalty can make them cycle; ``hyper["cycle"]`` is then its period
        and more sweeps would only repeat it).
    n_sweeps : int
    hyper : dict
        The hyper-parameters used.
    seconds : float
        Wall time of the whole matching.
    """

    assignments: list[np.ndarray]
    mean: np.ndarray
    var: np.ndarray
    counts: np.ndarray
    objective: list[float]
    converged: bool
    n_sweeps: int
    hyper: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_arviz(self, *, num_draws: int = 1000, chains: int = 4, seed: int = 0):
        """Draws of the fused posterior and the assignments as an ArviZ object (see :mod:`bayesfuse.analysis`)."""
        from bayesfuse.analysis import match_to_arviz

        return match_to_arviz(self, num_draws=num_draws, chains=chains, seed=seed)

    @property
    def n_global(self) -> int:
        """Number of global atoms G."""
        return self.mean.shape[0]

    def assignment_matrix(self, j: int) -> np.ndarray:
        """Binary matrix ``B^j`` of shape (G, L_j) with ``B[i, l] = 1`` iff neuron l -> atom i."""
        a = self.assignments[j]
        b = np.zeros((self.n_global, len(a)), dtype=np.int8)
        b[a, np.arange(len(a))] = 1
        return b

    def __repr__(self) -> str:
        sizes = [len(a) for a in self.assignments]
        return (
            f"MatchResult({len(sizes)} clients with {sum(sizes)} neurons -> {self.n_global} global atoms, "
            f"{self.n_sweeps} sweeps, converged={self.converged}, {self.seconds:.2f} s)"
        )


# --------------------------------------------------------------------------- inputs


def _check_layers(layers: Sequence) -> list[np.ndarray]:
    if len(layers) == 0:
        raise ValueError("need at least one client's neurons")
    out = []
    for j, w in enumerate(layers):
        a = finite_array(w, f"client {j}'s neurons")
        if a.ndim != 2:
            raise ValueError(f"client {j}'s neurons must be a 2-D array (L_j, D), got shape {a.shape}")
        if a.shape[0] == 0:
            raise ValueError(f"client {j} has no neurons (empty client)")
        if out and a.shape[1] != out[0].shape[1]:
            raise ValueError(
                f"client {j}'s neurons have dimension {a.shape[1]}, client 0's have {out[0].shape[1]}"
            )
        out.append(a)
    return out


def _positive(value, name: str, shape_ok: tuple[int, ...], allow_inf: bool = False) -> np.ndarray:
    a = positive_array(value, name, allow_inf=allow_inf)
    if a.ndim > 0 and a.shape not in shape_ok:
        raise ValueError(f"{name} must be a scalar or have shape {' or '.join(map(str, shape_ok))}, got {a.shape}")
    return a


def _client_variances(noise_var, n_clients: int, dim: int) -> np.ndarray:
    """Noise variances ``sigma_j^2``: (J, 1) when isotropic per client, else (J, D).

    An infinite variance (precision 0) says a client carries no information on a coordinate.
    """
    v = _positive(noise_var, "noise_var", ((n_clients,), (n_clients, dim)), allow_inf=True)
    if np.isinf(v).all(axis=-1).any() if v.ndim == 2 else np.isinf(v).any():
        raise ValueError("noise_var is infinite on every coordinate of some client")
    if v.ndim == 0:
        v = np.full((n_clients, 1), float(v))
    elif v.ndim == 1:
        v = v[:, None]
    return v


# --------------------------------------------------------------------------- model pieces


@dataclass
class _Prior:
    h0: np.ndarray  # (D,)   mu0 / sigma0^2
    lam0: np.ndarray  # (1,) or (D,)   1 / sigma0^2
    gamma0: float
    n_clients: int
    dim: int

    @property
    def const_per_atom(self) -> float:
        """``-1/2 sum_d (log sigma0_d^2 + mu0_d^2 / sigma0_d^2)``: the atom normaliser."""
        lam0 = np.broadcast_to(self.lam0, (self.dim,))
        return float(0.5 * np.sum(np.log(lam0)) - 0.5 * np.sum(self.h0**2 / lam0))


def _posterior_stats(layers, prec, assignments, n_atoms, prior: _Prior):
    """Natural parameters (h, lambda) and counts m of the atoms given assignments."""
    h = np.tile(prior.h0, (n_atoms, 1))
    lam = np.tile(prior.lam0, (n_atoms, 1))
    m = np.zeros(n_atoms, dtype=np.int64)
    for j, a in enumerate(assignments):
        if a is None:
            continue
        # a is injective within a client, so fancy-index += is a correct scatter-add.
        h[a] += layers[j] * prec[j]
        lam[a] += prec[j]
        m[a] += 1
    return h, lam, m


def _log_ibp_structure(m: np.ndarray, n_clients: int, gamma0: float) -> float:
    """log P(structure) of the IBP, counted over partitions of the neurons (atoms unlabelled).

    For J clients and K atoms used m_1..m_K times (Griffiths & Ghahramani 2011, eq. 14, times
    the K! labelings that distinct atoms admit once each carries distinct neurons):

    .. math:: K \\log\\gamma_0 - \\gamma_0 H_J + \\sum_k \\log\\frac{(m_k - 1)!\\,(J - m_k)!}{J!}

    Its conditional for one client given the others is PFNM supplement eq. (8) without the
    ``-log k`` of the k-th new atom (that term counts new atoms as ordered).
    """
    harmonic = float(np.sum(1.0 / np.arange(1, n_clients + 1)))
    k = len(m)
    return float(
        k * math.log(gamma0)
        - gamma0 * harmonic
        + np.sum(gammaln(m) + gammaln(n_clients - m + 1) - gammaln(n_clients + 1))
    )


def log_marginal_posterior(
    layers: Sequence,
    assignments: Sequence[np.ndarray],
    *,
    noise_var=1.0,
    prior_var=1.0,
    prior_mean=0.0,
    gamma0: float = 1.0,
    local_vars: Sequence | None = None,
) -> float:
    """``log p(neurons, assignments)`` under the BBP model, atoms integrated out.

    .. math::

        \\sum_i \\Big[\\tfrac12 \\sum_d \\frac{h_{id}^2}{\\lambda_{id}}
            - \\tfrac12 \\sum_d \\log(\\sigma_{0d}^2 \\lambda_{id})
            - \\tfrac12 \\sum_d \\frac{\\mu_{0d}^2}{\\sigma_{0d}^2}\\Big]
        + \\log P_{\\mathrm{IBP}}(\\text{structure}) - \\sum_j \\log L_j!
        - \\tfrac12 \\sum_{j,l,d} \\Big[\\log(2\\pi\\sigma_{jd}^2) + \\frac{v_{jld}^2}{\\sigma_{jd}^2}\\Big]

    The first sum is the collapsed Gaussian marginal (the PFNM supplement eq. 4 with the
    Occam terms ``log(sigma0^2 lambda_i)`` it drops); ``-log L_j!`` is the uniform order of
    each client's neurons. Assignments count as partitions: relabelling atoms changes nothing.
    """
    layers, prec, prior = _setup(layers, noise_var, prior_var, prior_mean, gamma0, local_vars)
    assignments = _check_assignments(assignments, layers)
    n_atoms = int(max(a.max() for a in assignments)) + 1
    h, lam, m = _posterior_stats(layers, prec, assignments, n_atoms, prior)
    if (m == 0).any():
        raise ValueError("assignments leave some atom indices unused; number atoms 0..G-1")
    return _objective(h, lam, m, prior) + _data_constant(layers, prec)


def _partition_key(assignments: Sequence[np.ndarray]) -> bytes:
    """The partition of all neurons that ``assignments`` make, with atoms relabelled in order of
    first use (equal keys: the same matching up to atom labels)."""
    flat = np.concatenate(assignments)
    _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse].astype(np.int64).tobytes()


def _check_assignments(assignments: Sequence, layers: Sequence[np.ndarray]) -> list[np.ndarray]:
    if len(assignments) != len(layers):
        raise ValueError(f"need one assignment array per client ({len(layers)}), got {len(assignments)}")
    out = [np.asarray(a, dtype=np.int64) for a in assignments]
    for j, (a, v) in enumerate(zip(out, layers)):
        if a.shape != (v.shape[0],) or len(np.unique(a)) != len(a) or (a < 0).any():
            raise ValueError(f"client {j}: assignments must give each of its {v.shape[0]} neurons a distinct atom")
    return out


def _objective(h, lam, m, prior: _Prior) -> float:
    d = prior.dim
    lam_full = np.broadcast_to(lam, h.shape)
    quad = 0.5 * np.sum(h * h / lam_full)
    logdet = 0.5 * np.sum(np.log(lam_full)) if lam.shape[1] == d else 0.5 * d * np.sum(np.log(lam))
    atoms = quad - logdet + len(m) * prior.const_per_atom
    return float(atoms + _log_ibp_structure(m, prior.n_clients, prior.gamma0))


def _data_constant(layers, prec) -> float:
    total = 0.0
    for j, v in enumerate(layers):
        p = np.broadcast_to(prec[j], (prec[j].shape[0], v.shape[1]))  # (1 | L, D)
        seen = p > 0  # a coordinate of precision 0 carries no information: no factor
        log_norm = np.sum(np.log(2 * np.pi / p[seen])) * (v.shape[0] if p.shape[0] == 1 else 1)
        quad = (v * v).sum(0) @ p[0] if p.shape[0] == 1 else np.sum(v * v * p)
        total += -0.5 * log_norm - 0.5 * quad - gammaln(v.shape[0] + 1)
    return float(total)


def _make_prior(prior_var, prior_mean, gamma0, J, D, width) -> _Prior:
    """Prior natural parameters; ``lam0`` has shape (width,), width 1 (isotropic) or D."""
    v0 = _positive(prior_var, "prior_var", ((D,),))
    mu0 = finite_array(prior_mean, "prior_mean")
    if mu0.ndim > 0 and mu0.shape != (D,):
        raise ValueError(f"prior_mean must be a scalar or have shape ({D},), got {mu0.shape}")
    if not np.isfinite(gamma0) or gamma0 <= 0:
        raise ValueError(f"gamma0 must be positive, got {gamma0}")
    lam0 = np.broadcast_to(1.0 / v0, (width,)).astype(np.float64)
    h0 = np.broadcast_to(mu0 * np.broadcast_to(1.0 / v0, (D,)), (D,)).astype(np.float64)
    return _Prior(h0=h0, lam0=lam0, gamma0=float(gamma0), n_clients=J, dim=D)


def _setup(layers, noise_var, prior_var, prior_mean, gamma0, local_vars=None):
    """Checked neurons, per-client precisions and the prior, all of one width (1 or D).

    ``prec[j]`` has shape (1, width) when client j's neurons share one noise variance, or
    (L_j, width) when ``local_vars`` gives each neuron its own (added to ``noise_var``).
    """
    layers = _check_layers(layers)
    J, D = len(layers), layers[0].shape[1]
    variances = list(_client_variances(noise_var, J, D)[:, None, :])  # J x (1, 1|D)
    if local_vars is not None:
        if len(local_vars) != J:
            raise ValueError(f"local_vars needs one array per client ({J}), got {len(local_vars)}")
        for j, (lv, v) in enumerate(zip(local_vars, layers)):
            lv = finite_array(lv, f"local_vars[{j}]")
            if lv.shape not in ((v.shape[0],), v.shape):
                raise ValueError(f"local_vars[{j}] must have shape ({v.shape[0]},) or {v.shape}, got {lv.shape}")
            if (lv < 0).any():
                raise ValueError(f"local_vars[{j}] must be non-negative")
            variances[j] = variances[j] + (lv[:, None] if lv.ndim == 1 else lv)
    width = 1 if (all(x.shape[1] == 1 for x in variances) and np.ndim(prior_var) == 0) else D
    with np.errstate(divide="ignore"):  # infinite variance -> precision 0
        prec = [np.broadcast_to(1.0 / x, (x.shape[0], width)).copy() for x in variances]
    return layers, prec, _make_prior(prior_var, prior_mean, gamma0, J, D, width)


# --------------------------------------------------------------------------- cost


def _gain_terms(h, lam, v, p, with_kl: bool):
    """Per (atom, neuron): ``Delta`` (G, L), ``sum_d log(1 + p_d/lam_id)`` (G, 1|L), KL (G, L) or None.

    ``p`` is (1, width) (one precision for the client's neurons) or (L, width) (per neuron).
    """
    D = v.shape[1]
    if lam.shape[1] == 1:  # isotropic: one GEMM serves every term
        lam_i, pp = lam[:, :1], p[:, 0][None, :]  # (G, 1), (1, 1|L)
        hv = h @ v.T
        hh = np.einsum("gd,gd->g", h, h)[:, None]
        vv = np.einsum("ld,ld->l", v, v)[None, :]
        a = 1.0 / (lam_i + pp)
        delta = a * (hh + 2 * pp * hv + pp * pp * vv) - hh / lam_i
        log_ratio = D * np.log1p(pp / lam_i)
        kl = None
        if with_kl:
            sq = vv - 2 * hv / lam_i + hh / lam_i**2  # ||v - mu_i||^2
            kl = 0.5 * D * (pp / lam_i - np.log1p(pp / lam_i)) + 0.5 * pp * pp * a * sq
        return delta, log_ratio, kl
    lam_d = np.broadcast_to(lam, h.shape)
    if p.shape[0] > 1:
        return _gain_terms_per_neuron(h, lam_d, v, p, with_kl)
    pd = p[0]
    a = 1.0 / (lam_d + pd)
    v2 = v * v
    delta = (
        np.einsum("gd,gd->g", a * h, h)[:, None]
        + 2 * (a * h * pd) @ v.T
        + (a * pd * pd) @ v2.T
        - np.einsum("gd,gd->g", h / lam_d, h)[:, None]
    )
    log_ratio = np.log1p(pd / lam_d).sum(1)[:, None]
    kl = None
    if with_kl:
        b = pd * pd * a
        mu = h / lam_d
        sq = b @ v2.T - 2 * (b * mu) @ v.T + np.einsum("gd,gd->g", b * mu, mu)[:, None]
        kl = 0.5 * (pd / lam_d - np.log1p(pd / lam_d)).sum(1)[:, None] + 0.5 * sq
    return delta, log_ratio, kl


def _gain_terms_per_neuron(h, lam_d, v, p, with_kl: bool, max_elements: int = 1 << 22):
    """:func:`_gain_terms` when every neuron has its own per-entry precision (no GEMM form).

    Works on blocks of atoms so that a block's (atoms, L, D) array stays below ``max_elements``.
    """
    G, (L, D) = h.shape[0], v.shape
    pv = p * v
    base = np.einsum("gd,gd->g", h / lam_d, h)
    delta, log_ratio = np.empty((G, L)), np.empty((G, L))
    kl = np.empty((G, L)) if with_kl else None
    step = max(1, max_elements // (L * D))
    for s in range(0, G, step):
        hc, lc = h[s : s + step, None, :], lam_d[s : s + step, None, :]
        den = lc + p[None]
        delta[s : s + step] = ((hc + pv[None]) ** 2 / den).sum(-1) - base[s : s + step, None]
        ratio = p[None] / lc
        log_ratio[s : s + step] = np.log1p(ratio).sum(-1)
        if with_kl:
            sq = p[None] ** 2 / den * (v[None] - hc / lc) ** 2
            kl[s : s + step] = 0.5 * (ratio - np.log1p(ratio) + sq).sum(-1)
    return delta, log_ratio, kl


def assignment_cost(
    v: np.ndarray,
    p: np.ndarray,
    h: np.ndarray,
    lam: np.ndarray,
    m: np.ndarray,
    prior: _Prior,
    *,
    cost: Cost = "pfnm",
    kl_weight: float = 0.0,
) -> np.ndarray:
    """Cost matrix (L, G + L) of giving client neuron l to existing atom i < G or new atom G + k.

    Parameters
    ----------
    v : (L, D) the client's neurons. p : (1, 1|D) their precision ``1/sigma_j^2``, or
        (L, 1|D) one per neuron.
    h, lam, m : natural parameters (G, D), (G, 1|D) and counts (G,) of the atoms of the
        other clients (all counts >= 1).

    With ``Delta_il = ||h_i + p v_l||^2_{A} - ||h_i||^2_{1/lam_i}`` (weighted norms,
    ``A = 1/(lam_i + p)``), the PFNM cost (supplement, Prop. 2, end of section 1) is

    .. math::

        C_{li} = -\\Delta_{il} - 2 \\log\\frac{m_i}{J - m_i}, \\quad i \\le G; \\qquad
        C_{l,G+k} = -\\Delta_{0l} - 2 \\log\\frac{\\gamma_0}{J} + 2 \\log k,

    where ``Delta_0l`` uses the prior ``(mu0/sigma0^2, 1/sigma0^2)`` in place of atom i.
    The ``"marginal"`` cost is minus the exact change of :func:`log_marginal_posterior`:
    ``-Delta/2 + 1/2 sum_d log((lam_id + p_d)/lam_id) - log(m_i / (J - m_i))`` and for new atoms
    ``... - log(gamma0 / J)`` (no ``log k``: atoms are unordered). NAFI adds
    ``kl_weight * KL(p(theta_i | others) || p(theta_i | others, v_l))`` (NAFI eq. 14; the full
    Gaussian KL of Lemma 5.1, trace and log-determinant terms included):

    .. math::

        \\mathrm{KL}_{il} = \\tfrac12 \\sum_d \\Big[\\frac{p_d}{\\lambda_{id}}
            - \\log\\Big(1 + \\frac{p_d}{\\lambda_{id}}\\Big)
            + \\frac{p_d^2}{\\lambda_{id} + p_d} (v_{ld} - \\mu_{id})^2\\Big].
    """
    J, L = prior.n_clients, v.shape[0]
    # The existing atoms, and the prior as the "atom" a new neuron starts from.
    delta, log_ratio, kl = _gain_terms(h, lam, v, p, bool(kl_weight))
    delta0, log_ratio0, kl0 = _gain_terms(prior.h0[None, :], prior.lam0[None, :], v, p, bool(kl_weight))
    popularity = np.log(m / (J - m))
    new_prior = math.log(prior.gamma0 / J)
    if cost == "pfnm":
        score_old = delta + 2 * popularity[:, None]
        # row k-1: opening the k-th new atom
        score_new = delta0 + 2 * new_prior - 2 * np.log(np.arange(1, L + 1))[:, None]
    elif cost == "marginal":
        score_old = 0.5 * delta - 0.5 * log_ratio + popularity[:, None]
        score_new = np.broadcast_to(0.5 * delta0 - 0.5 * log_ratio0 + new_prior, (L, L))
    else:
        raise ValueError(f"cost must be 'pfnm' or 'marginal', got {cost!r}")
    G = len(m)
    out = np.empty((L, G + L))
    out[:, :G] = -score_old.T
    out[:, G:] = -score_new.T
    if kl_weight:
        out[:, :G] += kl_weight * kl.T
        out[:, G:] += kl_weight * kl0.T
    return out


# --------------------------------------------------------------------------- alternation


def _solve_assignment(C: np.ndarray, n_existing: int) -> tuple[np.ndarray, np.ndarray]:
    """Hungarian solution of the (L, G + L) cost, skipping atoms no neuron can take.

    Among the L new-atom columns at least one is free in any assignment, so a neuron never
    takes an existing atom that costs more than its dearest new column: such atoms (most of
    them, once atoms are well separated) are dropped before solving. Exact.
    """
    worst_new = C[:, n_existing:].max(axis=1, keepdims=True)
    keep = np.flatnonzero((C[:, :n_existing] <= worst_new).any(axis=0))
    cols_kept = np.concatenate([keep, np.arange(n_existing, C.shape[1])])
    rows, cols = linear_sum_assignment(C[:, cols_kept])
    return rows, cols_kept[cols]


class _AtomBuffer:
    """Natural parameters of the atoms in growable arrays; ``h``, ``lam``, ``m`` are views."""

    def __init__(self, dim: int, width: int, capacity: int):
        self._h = np.zeros((capacity, dim))
        self._lam = np.zeros((capacity, width))
        self._m = np.zeros(capacity, dtype=np.int64)
        self.n = 0

    @property
    def h(self) -> np.ndarray:
        return self._h[: self.n]

    @property
    def lam(self) -> np.ndarray:
        return self._lam[: self.n]

    @property
    def m(self) -> np.ndarray:
        return self._m[: self.n]

    def _reserve(self, size: int) -> None:
        if size > len(self._m):
            cap = max(2 * len(self._m), size)
            for name in ("_h", "_lam", "_m"):
                old = getattr(self, name)
                new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)

    def grow(self, k: int, prior: _Prior) -> None:
        """Append k atoms holding only the prior."""
        self._reserve(self.n + k)
        self._h[self.n : self.n + k] = prior.h0
        self._lam[self.n : self.n + k] = prior.lam0
        self._m[self.n : self.n + k] = 0
        self.n += k

    def compact(self, keep: np.ndarray) -> np.ndarray:
        """Drop atoms where ``keep`` is false by moving the last live atoms into the holes.

        Copies only as many rows as are dropped. Returns the old -> new index map (-1: dropped).
        """
        n_keep = int(keep.sum())
        dead = np.flatnonzero(~keep)
        holes = dead[dead < n_keep]
        movers = np.flatnonzero(keep[n_keep:]) + n_keep
        remap = np.arange(self.n)
        remap[dead] = -1
        remap[movers] = holes
        for arr in (self._h, self._lam, self._m):
            arr[holes] = arr[movers]
        self.n = n_keep
        return remap

    def reset(self, h: np.ndarray, lam: np.ndarray, m: np.ndarray) -> None:
        """Replace the contents by freshly computed statistics."""
        self._reserve(len(m))
        self.n = len(m)
        self._h[: self.n], self._lam[: self.n], self._m[: self.n] = h, lam, m


def match_neurons(
    layers: Sequence,
    *,
    noise_var="auto",
    prior_var="auto",
    gamma0="auto",
    prior_mean=0.0,
    kl_weight: float = 0.0,
    cost: str = "auto",
    local_vars: Sequence | None = None,
    blocks: np.ndarray | None = None,
    relative_precision: np.ndarray | None = None,
    n_iter: int = 10,
    tol: float | None = None,
    seed: int | np.random.Generator | None = None,
    rounds: int = 10,
    init: Sequence[np.ndarray] | None = None,
    verbose: bool = False,
) -> MatchResult:
    """MAP matching of J clients' neurons to global atoms (PFNM; NAFI with ``kl_weight > 0``).

    Maximises over assignments ``B`` the log posterior of the Beta-Bernoulli process model
    (PFNM supplement eq. 1-8) by the alternation of PFNM: clients are visited in a random order
    each sweep; client j is removed, the others' atom posteriors (eq. 2; NAFI eq. 4) give the
    cost matrix of :func:`assignment_cost` over the ``G_{-j}`` existing atoms and ``L_j``
    possible new ones, and the Hungarian algorithm assigns client j's neurons. Atoms left
    without neurons are removed. The first sweep builds the atoms client by client.

    Parameters
    ----------
    layers : sequence of (L_j, D) arrays
        Neuron vectors of each client (rows), torch tensors or NumPy arrays.
    noise_var : "auto", float, sequence of J floats, (D,) or (J, D) array
        ``sigma_j^2``: how far a client's neuron may lie from its atom. ``"auto"`` (with
        ``prior_var``/``gamma0`` likewise): chosen from the neurons alone by empirical Bayes,
        one value per block of coordinates (:mod:`bayesfuse.inference.empirical_bayes`).
    prior_var : "auto", float or (D,) array
        ``sigma_0^2``: spread of the atoms around ``prior_mean`` (PFNM uses 10).
    gamma0 : "auto" or float
        IBP mass: expected number of atoms per client; larger favours new atoms (PFNM uses 1).
    prior_mean : float or (D,) array
        ``mu_0`` (refitted per block when ``prior_var="auto"``).
    kl_weight : float
        NAFI's ``lambda`` (eq. 14); 0 gives PFNM.
    cost : {"auto", "pfnm", "marginal"}
        ``"pfnm"``: the paper's Prop. 2 cost as written, which drops the Occam terms of the
        marginal likelihood. ``"marginal"``: the exact change of the collapsed log posterior
        (:func:`log_marginal_posterior`), as in SPAHM (Yurochkin et al., NeurIPS 2019).
        ``"auto"``: ``"marginal"`` when a hyper-parameter is ``"auto"`` (empirical Bayes
        maximises that same marginal; with the PFNM cost its estimates merge nothing), else
        ``"pfnm"``.
    blocks : (D,) int array, optional
        ``"auto"`` only: the block of each coordinate (0..B-1); one block by default.
    relative_precision : (J, D) array, optional
        ``w_jd``: client j's noise variance on coordinate d is ``noise_var / w_jd`` (0: client
        j observes nothing there). Ones by default.
    rounds : int
        ``"auto"`` only: most alternations of matching and re-estimation.
    init : sequence of J int arrays, optional
        Start from these assignments (atoms numbered 0..G-1) instead of building the atoms
        client by client in the first sweep; every sweep then refines them.
    local_vars : sequence of (L_j,) or (L_j, D) arrays, optional
        Per-neuron variances of local posteriors (Bayesian networks); neuron l of client j is
        then ``N(theta_i, noise_var_j + local_vars[j][l])``. Per-entry arrays take a slower
        path (no matrix-product form), in blocks of atoms.
    n_iter : int
        Maximum number of sweeps.
    tol : float, optional
        Also stop when a sweep raises the objective by less than ``tol``.
    seed : int or Generator, optional
        Order of the clients in each sweep; the same seed gives the same result.
    verbose : bool
        Progress bar over sweeps.

    Returns
    -------
    MatchResult
        With ``"auto"``, ``hyper`` holds the chosen values per block (``noise_var``,
        ``prior_var``, ``prior_mean``, ``gamma0``) and ``hyper["auto"]`` the keys chosen.

    Warns
    -----
    ConvergenceWarning
        When ``n_iter`` sweeps end with assignments still changing (and ``tol`` did not stop it).

    Notes
    -----
    The objective recorded after each sweep is :func:`log_marginal_posterior`, the exact log
    joint of neurons and assignments. The ``"marginal"`` cost is coordinate ascent on it, so
    with ``kl_weight=0`` its trace never decreases; the ``"pfnm"`` cost and the KL penalty
    optimise other criteria and their trace may dip.

    Where the IBM reference code departs from the paper, this follows the paper: the
    popularity term is ``2 log(m/(J-m))`` (the code uses 1x), counts are not capped at 10,
    and the number of new atoms is not capped.

    Choosing noise_var, prior_var, gamma0, kl_weight
    ------------------------------------------------
    * ``noise_var`` sets the matching radius: a neuron joins an atom when it is within a few
      ``sigma_j`` of it in every coordinate. Too small splits copies of one atom into many
      (large global model); too large merges different atoms (small model, blurred weights).
      With ``cost="marginal"`` the true noise variance recovers simulated atoms; the PFNM cost
      needs it over-stated (PFNM tunes it by validation; 1 is its usual start).
    * ``prior_var`` (PFNM: 10) is the spread of atoms; larger makes a new atom cheaper under
      the PFNM cost and dearer under the marginal one (its Occam factor).
    * ``gamma0`` (PFNM: 1) enters as ``log(gamma0 / J)`` per new atom: raise it for more atoms.
    * ``kl_weight`` (NAFI: 1e-3 to 0.5 work alike; 1 is too much) adds the KL between an
      atom's posterior before and after taking the neuron, which grows with the distance to
      the atom's mean; it discourages poor matches and so grows the global model slightly.
    """
    start = time.perf_counter()
    auto = tuple(k for k, v in (("noise_var", noise_var), ("prior_var", prior_var), ("gamma0", gamma0))
                 if isinstance(v, str))
    for k in auto:
        if locals()[k] != "auto":
            raise ValueError(f"{k} must be a number or 'auto', got {locals()[k]!r}")
    if cost == "auto":
        cost = "marginal" if auto else "pfnm"
    if cost not in ("pfnm", "marginal"):
        raise ValueError(f"cost must be 'auto', 'pfnm' or 'marginal', got {cost!r}")
    if auto:
        return _match_empirical_bayes(
            layers, auto, noise_var=noise_var, prior_var=prior_var, gamma0=gamma0, prior_mean=prior_mean,
            blocks=blocks, relative_precision=relative_precision, local_vars=local_vars, rounds=rounds,
            match=dict(kl_weight=kl_weight, cost=cost, n_iter=n_iter, tol=tol, seed=seed), verbose=verbose,
            start=start)
    if relative_precision is not None:
        if np.ndim(noise_var) != 0:
            raise ValueError("relative_precision scales one noise variance: give noise_var as a number")
        noise_var = noise_matrix(np.array([float(noise_var)]), np.zeros(len(relative_precision[0]), dtype=int),
                                 _weights(relative_precision, len(layers), len(relative_precision[0])))
    layers, prec, prior = _setup(layers, noise_var, prior_var, prior_mean, gamma0, local_vars)
    J, D = len(layers), layers[0].shape[1]
    if not np.isfinite(kl_weight) or kl_weight < 0:
        raise ValueError(f"kl_weight must be >= 0, got {kl_weight}")
    if int(n_iter) != n_iter or n_iter < 1:
        raise ValueError(f"n_iter must be a positive integer, got {n_iter}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    data_const = _data_constant(layers, prec)
    weighted = [v * prec[j] for j, v in enumerate(layers)]  # v / sigma_j^2, added to h

    assignments: list[np.ndarray | None] = [None] * J
    atoms = _AtomBuffer(D, prec[0].shape[1], capacity=max(len(v) for v in layers) * 2)
    if init is not None:  # warm start: atoms from the given assignments, then refining sweeps
        assignments = _check_assignments(init, layers)
        atoms.reset(*_posterior_stats(layers, prec, assignments, int(max(a.max() for a in assignments)) + 1, prior))
        if (atoms.m == 0).any():
            raise ValueError("init leaves some atom indices unused; number atoms 0..G-1")
    objective: list[float] = []
    converged = stopped = False
    seen: dict[bytes, int] = {}  # partitions after each sweep, to detect cycles
    cycle = 0
    bar = tqdm(range(int(n_iter)), desc="matching", unit="sweep", disable=not verbose)
    sweeps = 0
    for sweep in bar:
        changed = 0
        for j in rng.permutation(J):
            v, p, vp = layers[j], prec[j], weighted[j]
            old = assignments[j]
            if old is not None:  # take client j out
                atoms.h[old] -= vp
                atoms.lam[old] -= p
                atoms.m[old] -= 1
                keep = atoms.m > 0
                old_kept = old
                if not keep.all():
                    remap = atoms.compact(keep)
                    old_kept = remap[old]
                    for k in range(J):
                        if k != j and assignments[k] is not None:
                            assignments[k] = remap[assignments[k]]
            g = atoms.n
            C = assignment_cost(v, p, atoms.h, atoms.lam, atoms.m, prior, cost=cost, kl_weight=kl_weight)
            rows, cols = _solve_assignment(C, g)
            new_cols = np.sort(cols[cols >= g])
            index = np.arange(C.shape[1])
            index[new_cols] = g + np.arange(len(new_cols))
            a = np.empty(v.shape[0], dtype=np.int64)
            a[rows] = index[cols]
            if old is not None:
                changed += int(np.any(np.where(a < g, a, -1) != old_kept))
            atoms.grow(len(new_cols), prior)  # put client j back
            atoms.h[a] += vp
            atoms.lam[a] += p
            atoms.m[a] += 1
            assignments[j] = a
        sweeps = sweep + 1
        # Recompute from the assignments: removes round-off accumulated by the updates.
        h, lam, m = _posterior_stats(layers, prec, assignments, atoms.n, prior)
        atoms.reset(h, lam, m)
        objective.append(_objective(h, lam, m, prior) + data_const)
        bar.set_postfix(atoms=len(m), objective=f"{objective[-1]:.1f}")
        if (sweep > 0 or init is not None) and changed == 0:
            converged = True
            break
        if tol is not None and sweep > 0 and objective[-1] - objective[-2] < tol:
            stopped = True
            break
        state = _partition_key(assignments)
        if state in seen:  # the sweeps came back to an earlier partition: more would repeat the cycle
            cycle = sweep - seen[state]
            converged = True
            break
        seen[state] = sweep
    h, lam, m = atoms.h, atoms.lam, atoms.m
    lam_full = np.broadcast_to(lam, h.shape)
    result = MatchResult(
        assignments=[np.asarray(a) for a in assignments],
        mean=h / lam_full,
        var=np.array(1.0 / lam_full),
        counts=m.copy(),
        objective=objective,
        converged=converged,
        n_sweeps=sweeps,
        hyper=dict(noise_var=noise_var if np.ndim(noise_var) == 0 else np.asarray(noise_var).tolist(),
                   prior_var=prior_var if np.ndim(prior_var) == 0 else np.asarray(prior_var).tolist(),
                   prior_mean=prior_mean if np.ndim(prior_mean) == 0 else np.asarray(prior_mean).tolist(),
                   gamma0=gamma0, kl_weight=kl_weight, cost=cost, n_iter=n_iter, local_vars=local_vars is not None,
                   seed=None if isinstance(seed, np.random.Generator) else seed, cycle=cycle),
        seconds=time.perf_counter() - start,
    )
    if not stopped:
        warn_not_converged({"matching": result}, "matching")
    return result


def _weights(relative_precision, J: int, D: int) -> np.ndarray:
    w = finite_array(relative_precision, "relative_precision")
    if w.shape != (J, D) or (w < 0).any():
        raise ValueError(f"relative_precision must be a non-negative ({J}, {D}) array, got shape {w.shape}")
    return w


def _match_empirical_bayes(layers, auto, *, noise_var, prior_var, gamma0, prior_mean, blocks, relative_precision,
                           local_vars, rounds, match, verbose, start) -> MatchResult:
    """:func:`match_neurons` with the ``auto`` hyper-parameters chosen by empirical Bayes.

    Alternates matching (the marginal cost, each sweep raising ``log p(V, B)``) with EM on the
    block hyper-parameters given the assignments (:mod:`bayesfuse.inference.empirical_bayes`),
    until the number of atoms and the variances settle (or ``rounds``), then matches once more
    with the final values so that result and hyper-parameters agree.
    """
    if local_vars is not None:
        raise ValueError("'auto' hyper-parameters need local_vars=None (give numbers with local posterior variances)")
    if int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds}")
    layers = _check_layers(layers)
    J, D = len(layers), layers[0].shape[1]
    blocks = np.zeros(D, dtype=np.int64) if blocks is None else np.asarray(blocks)
    if blocks.shape != (D,) or not np.issubdtype(blocks.dtype, np.integer) or blocks.min() < 0 or \
            set(np.unique(blocks)) != set(range(int(blocks.max()) + 1)):
        raise ValueError(f"blocks must be ({D},) integers numbering blocks 0..B-1, each used")
    weights = np.ones((J, D)) if relative_precision is None else _weights(relative_precision, J, D)
    mu0 = np.broadcast_to(finite_array(prior_mean, "prior_mean"), (D,)).astype(np.float64)
    hyper = initial_hyper(layers, blocks, weights, mu0)
    n_blocks = len(hyper.prior_var)
    for key, value in (("noise_var", noise_var), ("prior_var", prior_var)):
        if key not in auto:
            value = positive_array(value, key)
            if np.ndim(value) != 0:
                raise ValueError(f"with 'auto' hyper-parameters, {key} must be a number or 'auto'")
            setattr(hyper, key, np.full(n_blocks, float(value)))
    if "gamma0" not in auto:
        hyper.gamma0 = float(gamma0)
    trace, result = [], None
    bar = tqdm(range(int(rounds)), desc="empirical Bayes", unit="round", disable=not verbose)
    with warnings.catch_warnings():  # the final matching's convergence is what counts
        warnings.simplefilter("ignore", ConvergenceWarning)
        for r in bar:
            noise, prior0, mean0 = hyper.expand(blocks, weights)
            result = match_neurons(layers, noise_var=noise, prior_var=prior0, prior_mean=mean0, gamma0=hyper.gamma0,
                                   init=None if result is None else result.assignments, **match)
            new = hyper
            for _ in range(EM_STEPS):
                new = em_step(layers, result.assignments, blocks, weights, new, fit=auto)
            moved = max(np.max(np.abs(np.log(new.noise_var / hyper.noise_var))),
                        np.max(np.abs(np.log(new.prior_var / hyper.prior_var))),
                        abs(math.log(new.gamma0 / hyper.gamma0)))
            trace.append(dict(n_global=result.n_global, objective=result.objective[-1], **new.as_dict()))
            bar.set_postfix(atoms=result.n_global)
            settled = r > 0 and result.n_global == trace[-2]["n_global"] and moved < 0.01
            hyper = new
            if settled:
                break
        noise, prior0, mean0 = hyper.expand(blocks, weights)
        result = match_neurons(layers, noise_var=noise, prior_var=prior0, prior_mean=mean0, gamma0=hyper.gamma0,
                               init=result.assignments, **match)
    result.hyper = dict(result.hyper, **hyper.as_dict(), auto=list(auto), blocks=blocks.tolist(), rounds=len(trace),
                        trace=trace)
    result.seconds = time.perf_counter() - start
    if not result.converged:
        warn_not_converged({"matching": result}, "matching", stacklevel=4)
    return result
