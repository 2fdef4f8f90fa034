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

Arrays. NumPy neurons are matched in float64 on the host. When every client's neurons are torch
tensors of one device and dtype (float32 or float64), the atoms' natural parameters ``h``, the cost
matrices and the posterior means and variances are computed with torch on that device in that
dtype (:mod:`bayesfuse.inference._backend`); each assignment problem is then copied to the host
and solved by SciPy. Every cost matrix is a handful of matrix products
(``||a + b||^2 = ||a||^2 + 2 a.b + ||b||^2``), never a loop over neurons or atoms.

Computation. Precisions are kept per group of coordinates on which the prior and every client
agree (:class:`_Groups`; the blocks of empirical Bayes), so an atom's precision is (B,) instead
of (D,) and one (G, D) x (D, L) product per client visit carries the cost. The assignment never
forms the dense (L, L) block of new atoms (:func:`_assign`). With the ``"marginal"`` cost, when
few atoms beat a new one (well separated atoms), that product runs in float32 with a rigorous
error bound and only the pairs it cannot rule out are computed in float64
(:func:`_negative_pairs`; NumPy inputs only: with tensors the product runs in their dtype). A
client whose problem is the one it last solved (no other client's assignment changed since, the
hyper-parameters unchanged) keeps its assignment without a new product or solve. Each of these
is exact: the assignments are those of the dense float64 Hungarian step, up to the numbering of
new atoms (in neuron order) and round-off.
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import linear_sum_assignment
from scipy.special import gammaln
from tqdm.auto import tqdm

from bayesfuse._validation import finite_array, positive_array
from bayesfuse.inference._backend import NUMPY, Backend, backend_of, ieee_float32, is_tensor, namespace, to_host
from bayesfuse.inference.empirical_bayes import (
    atom_posterior,
    atom_statistics,
    initial_hyper,
    maximise_hyper,
    noise_matrix,
)
from bayesfuse.inference.result import ConvergenceWarning, warn_not_converged

__all__ = ["MatchResult", "match_neurons", "log_marginal_posterior", "assignment_cost", "recording_assignments",
           "solve_assignment"]

Cost = Literal["pfnm", "marginal"]


@dataclass
class MatchResult:
    """Outcome of :func:`match_neurons`.

    Attributes
    ----------
    assignments : list of ndarray of int
        ``assignments[j][l]`` is the global atom of client j's neuron l (NumPy, on the host).
    mean : ndarray or torch.Tensor (G, D)
        Posterior mean of each global atom, ``h_i / lambda_i`` (supplement eq. 2). A torch
        tensor on the inputs' device, in their dtype, when the neurons were given as tensors.
    var : ndarray or torch.Tensor (G, D)
        Posterior variance of each entry, ``1 / lambda_i`` (a tensor as ``mean``).
    counts : ndarray (G,)
        ``m_i``: number of clients using atom i.
    objective : list of float
        ``log p(neurons, assignments)`` with atoms integrated out (see
        :func:`log_marginal_posterior`) after each sweep.
    converged : bool
        True when a sweep changed no assignment, when the sweeps came back to an earlier
        matching (NAFI's penalty can make them cycle; ``hyper["cycle"]`` is then its period
        and more sweeps would only repeat it), or when a sweep gained less than ``tol`` nats per
        neuron (``hyper["stopped"]``).
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

    def to_arviz(self, **options):
        """Independent draws of the atoms' posterior, the assignments, method, hyper-parameters and
        convergence as an ArviZ object; ``options`` (``units``, ``num_draws``, ``weight_names``,
        ``seed``) as in :func:`bayesfuse.analysis.match_to_arviz`. A posterior held as torch
        tensors (neurons matched as tensors, on any device) is exported from a float64 host copy."""
        from bayesfuse.inference.result import exporter  # registered by bayesfuse.analysis

        host = self
        if is_tensor(self.mean) or is_tensor(self.var):
            host = replace(self, mean=to_host(self.mean), var=to_host(self.var))
        return exporter("match")(host, **options)

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


def _check_layers(layers: Sequence) -> list:
    """The clients' neurons, checked: NumPy float64 arrays, or the torch tensors as given when all
    are tensors of one device and dtype (:func:`~bayesfuse.inference._backend.backend_of`)."""
    if len(layers) == 0:
        raise ValueError("need at least one client's neurons")
    torch_inputs = backend_of(layers).is_torch
    out = []
    for j, w in enumerate(layers):
        if torch_inputs:
            a = w.detach()
            if not bool(a.isfinite().all()):
                raise ValueError(f"client {j}'s neurons contains NaN or infinite values")
        else:
            a = finite_array(w, f"client {j}'s neurons")
        if a.ndim != 2:
            raise ValueError(f"client {j}'s neurons must be a 2-D array (L_j, D), got shape {tuple(a.shape)}")
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


class _Groups:
    """Coordinates in groups on which the prior and every client have one precision.

    When ``lambda_0d`` and every client's ``p_jd`` are the same on all coordinates of a group,
    so is every atom's ``lambda_id = lambda_0d + sum_{(j,l) -> i} p_jd`` (supplement eq. 2),
    whatever the assignments: precisions are then stored per group, (G, B) instead of (G, D),
    and the sums over coordinates of the cost and the objective become sums over groups of
    per-group sums (``||h_i||^2`` restricted to a group, and so on). One group is the isotropic
    case; one group per coordinate the general one.

    Attributes
    ----------
    index : ndarray (D,) of int
        Group of each coordinate.
    sizes : ndarray (B,) of float
        Number of coordinates in each group.
    first : ndarray (B,) of int
        A coordinate of each group (its first).
    """

    def __init__(self, index: np.ndarray, n_groups: int):
        self.index = np.asarray(index, dtype=np.int64)
        self.sizes = np.bincount(self.index, minlength=n_groups).astype(np.float64)
        self.first = np.unique(self.index, return_index=True)[1]
        self.identity = n_groups == len(self.index) and bool(np.all(self.index == np.arange(n_groups)))
        D = len(self.index)
        # Runs of consecutive coordinates in one group (blocks of a unit's weights): when there
        # are few, sums go run by run; else through a (D, B) indicator, dense for a few groups.
        starts = np.flatnonzero(np.diff(self.index) != 0) + 1
        self._runs = None
        if n_groups > 1 and len(starts) < 8:
            bounds = np.concatenate([[0], starts, [D]])
            self._runs = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), self.index[bounds[:-1]].tolist()))
        self._onehot = None
        self._index_on = None  # index as a tensor, for torch inputs
        if n_groups > 1 and not self.identity and self._runs is None:
            if n_groups <= 64:
                self._onehot = np.zeros((D, n_groups))
                self._onehot[np.arange(D), self.index] = 1.0
            else:
                self._onehot = sparse.csr_array((np.ones(D), (np.arange(D), self.index)), shape=(D, n_groups))

    @classmethod
    def single(cls, dim: int) -> "_Groups":
        return cls(np.zeros(dim, dtype=np.int64), 1)

    @classmethod
    def each(cls, dim: int) -> "_Groups":
        return cls(np.arange(dim), dim)

    @property
    def n(self) -> int:
        """Number of groups B."""
        return len(self.sizes)

    def sum(self, x):
        """Sums of the rows of ``x`` (n, D) over each group: (n, B) (NumPy, or torch for a tensor)."""
        if self.n == 1:
            return x.sum(axis=1, keepdims=True)
        if self._runs is not None:
            return self._by_runs(lambda s, e: x[:, s:e].sum(axis=1), x)
        if self.identity:
            return x
        if is_tensor(x):
            index = self._device_index(x)
            return x.new_zeros((x.shape[0], self.n)).index_add_(1, index, x)
        return np.asarray(x @ self._onehot)

    def sum_sq(self, x):
        """``sum_{d in b} x_nd^2``: (n, B)."""
        xp = namespace(x)
        if self.n == 1:
            return xp.einsum("nd,nd->n", x, x)[:, None]
        if self._runs is not None:
            return self._by_runs(lambda s, e: xp.einsum("nd,nd->n", x[:, s:e], x[:, s:e]), x)
        return self.sum(x * x)

    def _by_runs(self, run_sum, x):
        out = x.new_zeros((x.shape[0], self.n)) if is_tensor(x) else np.zeros((x.shape[0], self.n))
        for start, end, group in self._runs:  # a few runs of coordinates
            out[:, group] += run_sum(start, end)
        return out

    def expand(self, y):
        """Per-group values ``y`` (n, B) on every coordinate: (n, D) (a broadcast view for one group)."""
        if self.n == 1:
            return namespace(y).broadcast_to(y, (y.shape[0], len(self.index)))
        if self.identity:
            return y
        return y[:, self._device_index(y)] if is_tensor(y) else y[:, self.index]

    def _device_index(self, x):
        """The coordinates' groups as an index tensor on ``x``'s device (made once per device)."""
        cached = self._index_on
        if cached is None or cached.device != x.device:
            import torch  # loaded already: x is a tensor

            cached = self._index_on = torch.as_tensor(self.index, device=x.device)
        return cached


@dataclass
class _Prior:
    h0: np.ndarray  # (D,)   mu0 / sigma0^2
    lam0: np.ndarray  # (B,)   1 / sigma0^2 per coordinate group
    gamma0: float
    n_clients: int
    dim: int
    groups: _Groups

    @property
    def const_per_atom(self) -> float:
        """``-1/2 sum_d (log sigma0_d^2 + mu0_d^2 / sigma0_d^2)``: the atom normaliser."""
        hh0 = self.groups.sum_sq(self.h0[None, :])[0]
        return float(0.5 * np.log(self.lam0) @ self.groups.sizes - 0.5 * np.sum(hh0 / self.lam0))


def _posterior_stats(layers, prec, assignments, n_atoms, prior: _Prior, backend: Backend = NUMPY):
    """Natural parameters h (G, D), lambda (G, B) and counts m of the atoms given assignments
    (``h`` in ``backend``, the layers' backend; ``lambda`` and ``m`` on the host)."""
    h = backend.put(np.tile(prior.h0, (n_atoms, 1)))
    lam = np.tile(prior.lam0, (n_atoms, 1))
    m = np.zeros(n_atoms, dtype=np.int64)
    for j, a in enumerate(assignments):
        if a is None:
            continue
        # a is injective within a client, so fancy-index += is a correct scatter-add.
        h[a] += layers[j] * prior.groups.expand(backend.put(prec[j]))
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


@ieee_float32()
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
    h, lam, m = _posterior_stats(layers, prec, assignments, n_atoms, prior, backend_of(layers))
    if (m == 0).any():
        raise ValueError("assignments leave some atom indices unused; number atoms 0..G-1")
    return _objective(h, lam, m, prior) + _data_constant(layers, prec, prior.groups)


def _partition_key(assignments: Sequence[np.ndarray]) -> bytes:
    """The partition of all neurons that ``assignments`` make, with atoms relabelled in order of
    first use (equal keys: the same matching up to atom labels)."""
    flat = np.concatenate(assignments)
    _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse].astype(np.int64).tobytes()


def _check_assignments(assignments: Sequence, layers: Sequence[np.ndarray]) -> list[np.ndarray]:
    if len(assignments) != len(layers):
        raise ValueError(f"need one assignment array per client ({len(layers)}), got {len(assignments)}")
    out = [to_host(a, np.int64) for a in assignments]
    shaped = [a.shape == (v.shape[0],) for a, v in zip(out, layers)]
    bad = [j for j, ok in enumerate(shaped) if not ok]
    clients = np.flatnonzero(shaped)
    if len(clients):  # negative or repeated atoms: one sort of (client, atom) keys for all clients
        owner = np.repeat(clients, [len(out[j]) for j in clients])
        flat = np.concatenate([out[j] for j in clients])
        bad += owner[flat < 0].tolist()
        owner, flat = owner[flat >= 0], flat[flat >= 0]
        if len(flat):
            size = int(flat.max()) + 1
            key = np.sort(owner * size + flat)
            bad += (key[1:][key[1:] == key[:-1]] // size).tolist()
    if len(bad):
        j = int(np.min(bad))
        raise ValueError(f"client {j}: assignments must give each of its {layers[j].shape[0]} neurons a distinct atom")
    return out


def _objective(h, lam, m, prior: _Prior, hh: np.ndarray | None = None) -> float:
    """Atom terms of :func:`log_marginal_posterior` (with ``lambda`` constant on each group);
    ``hh``: the group sums ``sum_{d in b} h_id^2`` (G, B) on the host, if known."""
    groups = prior.groups
    hh = to_host(groups.sum_sq(h)) if hh is None else hh
    quad = 0.5 * np.sum(hh / lam)
    logdet = 0.5 * float(np.log(lam).sum(axis=0) @ groups.sizes)
    atoms = quad - logdet + len(m) * prior.const_per_atom
    return float(atoms + _log_ibp_structure(m, prior.n_clients, prior.gamma0))


def _data_constant(layers, prec, groups: _Groups, squares: Sequence[np.ndarray] | None = None) -> float:
    """The neurons' terms of :func:`log_marginal_posterior`; ``squares[j]`` may give client j's
    ``sum_l v_jld^2`` (D,) (:func:`_squares`)."""
    total = 0.0
    for j, v in enumerate(layers):
        p = np.broadcast_to(groups.expand(prec[j]), (prec[j].shape[0], v.shape[1]))  # (1 | L, D)
        seen = p > 0  # a coordinate of precision 0 carries no information: no factor
        log_norm = np.sum(np.log(2 * np.pi / p[seen])) * (v.shape[0] if p.shape[0] == 1 else 1)
        if p.shape[0] == 1:
            quad = (_squares([v])[0] if squares is None else squares[j]) @ p[0]
        elif is_tensor(v):
            quad = float((v * v * v.new_tensor(p)).sum())
        else:
            quad = np.sum(v * v * p)
        total += -0.5 * log_norm - 0.5 * quad - gammaln(v.shape[0] + 1)
    return float(total)


def _squares(layers: Sequence) -> list[np.ndarray]:
    """``sum_l v_jld^2`` (D,) of each client, on the host: :func:`_data_constant` of several
    matchings on the same neurons without a pass over them each time."""
    return [to_host(namespace(v).einsum("ld,ld->d", v, v)) for v in layers]


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
    groups = _Groups.single(D) if width == 1 else _Groups.each(D)
    return _Prior(h0=h0, lam0=lam0, gamma0=float(gamma0), n_clients=J, dim=D, groups=groups)


def _group_coordinates(prec: list[np.ndarray], prior: _Prior) -> tuple[list[np.ndarray], _Prior]:
    """Precisions per coordinate group (:class:`_Groups`): coordinates whose prior precision and
    every client's precision agree share a group. Needs one precision row per client."""
    columns = np.vstack([prior.lam0[None, :], *prec])  # (J + 1, D)
    _, first, inverse = np.unique(columns, axis=1, return_index=True, return_inverse=True)
    if len(first) == prior.dim:
        return prec, prior
    groups = _Groups(inverse.reshape(-1), len(first))
    return [p[:, first] for p in prec], replace(prior, lam0=prior.lam0[first], groups=groups)


def _setup(layers, noise_var, prior_var, prior_mean, gamma0, local_vars=None, *, checked: bool = False):
    """Checked neurons, per-client precisions and the prior, in B coordinate groups.

    ``prec[j]`` has shape (1, B) when client j's neurons share one noise variance, or (L_j, B)
    when ``local_vars`` gives each neuron its own (added to ``noise_var``). B is 1 when every
    variance is isotropic; with one precision row per client, coordinates on which the prior
    and every client agree are grouped (:class:`_Groups`); else B = D. ``checked``: the layers
    are already :func:`_check_layers`'s output.
    """
    layers = layers if checked else _check_layers(layers)
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
    prior = _make_prior(prior_var, prior_mean, gamma0, J, D, width)
    if width > 1 and all(p.shape[0] == 1 for p in prec):
        prec, prior = _group_coordinates(prec, prior)
    return layers, prec, prior


# --------------------------------------------------------------------------- cost


def _gain_terms(h, lam, v, p, groups: _Groups, with_kl: bool, hh=None, vv=None):
    """Per (atom, neuron): ``Delta`` (G, L), ``sum_d log(1 + p_d/lam_id)`` (G, 1|L), KL (G, L) or None.

    ``lam`` is (G, B) and ``p`` (1, B) (one precision row for the client's neurons) or (L, B)
    (per neuron), in the coordinate groups ``groups`` (:class:`_Groups`). With one precision
    row, ``a_ib = 1 / (lambda_ib + p_b)`` and the group sums ``HH_ib = sum_{d in b} h_id^2``,
    ``VV_lb = sum_{d in b} v_ld^2``, the quadratic gain of the module docstring is

    .. math::

        \\Delta_{il} = \\sum_b \\Big[a_{ib} (HH_{ib} + p_b^2 VV_{lb}) - \\frac{HH_{ib}}{\\lambda_{ib}}\\Big]
            + 2 \\sum_d a_{i b(d)} p_{b(d)} h_{id} v_{ld},

    one (G, D) x (D, L) product (none more than that for the atoms' other terms, which are
    (G, B) arrays); the KL of :func:`assignment_cost` likewise, with ``mu_i = h_i / lambda_i``.
    ``hh``, ``vv``: the atoms' ``HH`` (G, B) and the neurons' ``VV`` (L, B), if known. Every
    array is of one backend (NumPy, or torch tensors of one device and dtype), and so is the result.
    """
    xp = namespace(v)
    sizes = groups.sizes if xp is np else v.new_tensor(groups.sizes)
    if groups.n == 1:  # isotropic: one GEMM serves every term
        D = float(groups.sizes[0])
        lam_i, pp = lam[:, :1], p[:, 0][None, :]  # (G, 1), (1, 1|L)
        hv = h @ v.T
        hh = groups.sum_sq(h) if hh is None else hh
        vv = (groups.sum_sq(v) if vv is None else vv).T
        a = 1.0 / (lam_i + pp)
        delta = a * (hh + 2 * pp * hv + pp * pp * vv) - hh / lam_i
        log_ratio = D * xp.log1p(pp / lam_i)
        kl = None
        if with_kl:
            sq = vv - 2 * hv / lam_i + hh / lam_i**2  # ||v - mu_i||^2
            kl = 0.5 * D * (pp / lam_i - xp.log1p(pp / lam_i)) + 0.5 * pp * pp * a * sq
        return delta, log_ratio, kl
    if p.shape[0] > 1:
        return _gain_terms_per_neuron(h, groups.expand(lam), v, groups.expand(p), with_kl)
    pb = p[0]
    a = 1.0 / (lam + pb)  # (G, B)
    ap = a * pb
    hh = groups.sum_sq(h) if hh is None else hh
    vv = groups.sum_sq(v) if vv is None else vv  # (L, B)
    delta = (h * groups.expand(2 * ap)) @ v.T
    delta += (ap * pb) @ vv.T
    delta += (a * hh - hh / lam).sum(axis=1)[:, None]
    ratio = pb / lam
    log_ratio = (xp.log1p(ratio) @ sizes)[:, None]
    kl = None
    if with_kl:
        b = ap * pb  # p^2 / (lambda + p)
        b_mu = b / lam  # sum_d b_d (v_d - mu_d)^2 = b.v^2 - 2 (b / lam) h.v + (b / lam^2) h.h
        sq = b @ vv.T - 2 * (h * groups.expand(b_mu)) @ v.T + (b_mu / lam * hh).sum(axis=1)[:, None]
        kl = 0.5 * ((ratio - xp.log1p(ratio)) @ sizes)[:, None] + 0.5 * sq
    return delta, log_ratio, kl


def _gain_terms_per_neuron(h, lam_d, v, p, with_kl: bool, max_elements: int = 1 << 22):
    """:func:`_gain_terms` when every neuron has its own per-entry precision (no GEMM form).

    Works on blocks of atoms so that a block's (atoms, L, D) array stays below ``max_elements``.
    """
    xp = namespace(v)
    G, (L, D) = h.shape[0], v.shape
    pv = p * v
    base = xp.einsum("gd,gd->g", h / lam_d, h)
    empty = (lambda: v.new_empty((G, L))) if xp is not np else (lambda: np.empty((G, L)))
    delta, log_ratio = empty(), empty()
    kl = empty() if with_kl else None
    step = max(1, max_elements // (L * D))
    for s in range(0, G, step):
        hc, lc = h[s : s + step, None, :], lam_d[s : s + step, None, :]
        den = lc + p[None]
        delta[s : s + step] = ((hc + pv[None]) ** 2 / den).sum(-1) - base[s : s + step, None]
        ratio = p[None] / lc
        log_ratio[s : s + step] = xp.log1p(ratio).sum(-1)
        if with_kl:
            sq = p[None] ** 2 / den * (v[None] - hc / lc) ** 2
            kl[s : s + step] = 0.5 * (ratio - xp.log1p(ratio) + sq).sum(-1)
    return delta, log_ratio, kl


@ieee_float32()
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
    v : (L, D) the client's neurons. p : (1, B) their precision ``1/sigma_j^2`` in the prior's
        B coordinate groups, or (L, B) one per neuron.
    h, lam, m : natural parameters (G, D), (G, B) and counts (G,) of the atoms of the
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
    old, new, steps = _cost_blocks(v, p, h, lam, m, prior, cost=cost, kl_weight=kl_weight)
    old, new = to_host(old), to_host(new)
    G, L = old.shape
    out = np.empty((L, G + L))
    out[:, :G] = old.T
    out[:, G:] = new[:, None] + (0.0 if steps is None else steps[None, :])
    return out


def _cost_blocks(v, p, h, lam, m, prior: _Prior, *, cost: Cost, kl_weight: float, hh=None, vv=None):
    """:func:`assignment_cost` in its parts: ``old`` (G, L), the cost of each existing atom
    (transposed); ``new`` (L,), the cost of a first new atom; ``steps`` (L,), what the k-th new
    atom adds (``2 log k`` for the PFNM cost) or None (``"marginal"``: every new atom costs
    ``new``).

    ``old`` and ``new`` are of the neurons' backend (NumPy, or torch on ``v``'s device and dtype):
    the other arrays are moved there (``lam``, ``p``, ``m`` and ``hh`` may be host arrays).
    """
    J, L = prior.n_clients, v.shape[0]
    groups = prior.groups
    put = backend_of([v]).put
    p = put(p)
    # The existing atoms, and the prior as the "atom" a new neuron starts from (one row).
    delta, log_ratio, kl = _gain_terms(put(h), put(lam), v, p, groups, bool(kl_weight),
                                       None if hh is None else put(hh), vv)
    delta0, log_ratio0, kl0 = _gain_terms(put(prior.h0[None, :]), put(prior.lam0[None, :]), v, p, groups,
                                          bool(kl_weight), vv=vv)
    popularity = put(np.log(m / (J - m)))
    new_prior = math.log(prior.gamma0 / J)
    if cost == "pfnm":
        delta *= -1.0
        delta -= 2 * popularity[:, None]
        new = -(delta0[0] + 2 * new_prior)
        steps = 2 * np.log(np.arange(1, L + 1))
    elif cost == "marginal":
        delta *= -0.5
        delta += 0.5 * log_ratio - popularity[:, None]
        new = -(0.5 * delta0 - 0.5 * log_ratio0 + new_prior)[0]
        steps = None
    else:
        raise ValueError(f"cost must be 'pfnm' or 'marginal', got {cost!r}")
    if kl_weight:
        delta += kl_weight * kl
        new = new + kl_weight * kl0[0]
    return delta, namespace(delta).broadcast_to(new, (L,)), steps


# --------------------------------------------------------------------------- alternation

#: The callbacks :func:`recording_assignments` has installed (none outside its blocks).
_RECORDERS: list = []


@contextlib.contextmanager
def recording_assignments(callback):
    """Within the block, call ``callback(v, R, assignment, steps)`` after each assignment problem
    :func:`match_neurons` solves with a dense cost matrix (the float32 screen's sparse problems
    are not reported): ``v`` (L, D), the client's neurons; ``R`` (G, L), what existing atom i
    costs neuron l beyond its cheapest new atom; ``assignment`` (L,), the optimum (an atom, or
    -1 for a new one); ``steps`` what the k-th new atom adds, or None. For benchmarks and
    diagnostics; :func:`match_neurons` runs the same without it.
    """
    _RECORDERS.append(callback)
    try:
        yield
    finally:
        _RECORDERS.remove(callback)


def solve_assignment(R: np.ndarray, steps: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """The optimum of an assignment problem as :func:`recording_assignments` reports it: each of
    the L neurons to an atom of ``R`` (G, L) or to a new atom (-1), and the number of candidate
    pairs, by the solver :func:`match_neurons` uses (``R`` is not modified)."""
    R = np.array(R, dtype=float)
    return _assign(R, np.zeros(R.shape[1]), steps)


def _assign(old: np.ndarray, new: np.ndarray, steps: np.ndarray | None) -> tuple[np.ndarray, int]:
    """Optimal assignment of L neurons to existing atoms or new ones; ``-1`` marks a new atom.
    Also returns the number of candidate pairs (atom, neuron) (``R < 0``, or ``R <= steps_L``).

    Solves the linear assignment problem of the (L, G + L) matrix that :func:`assignment_cost`
    builds from ``old`` (G, L), ``new`` and ``steps`` (:func:`_cost_blocks`) without building
    it; ``old`` is overwritten. ``R_il = old_il - new_l`` is what atom i costs neuron l beyond
    its cheapest new atom (a shift per neuron, which changes no assignment's ranking).

    * The new atoms' block is ``new_l + steps_k`` with ``steps`` increasing (or zero), so the
      neurons that open new atoms pay ``sum new_l + sum_{k <= n} steps_k`` however they share
      the n cheapest new columns: only *which* neurons go new matters, and new atoms are
      numbered in neuron order.
    * Among the L new columns one is free in any assignment, so a neuron never takes an atom
      dearer than its dearest new column (``R_il > steps_L``: it would gain by moving there).
      Atoms no neuron can take are dropped, and neurons that can take no atom go new at once
      (taking the cheapest new columns, which leaves the others the next ones).
    * ``"marginal"`` (``steps`` None: every new column of a row costs ``new_l``): the optimum is
      the partial matching of neurons to atoms minimising ``sum R_il`` over its pairs, which uses
      only pairs with ``R_il < 0`` (any other pair moves to a free new column at no loss). That
      is the assignment problem of ``Z = min(R, 0)`` restricted to the atoms and neurons
      holding a negative entry: a matching of Z costs the sum of its negative entries, which
      form a partial matching, and any partial matching of negative pairs extends to a full
      one of Z (a rectangular problem matches min(rows, columns) pairs) through entries <= 0.
      Pairs matched at a zero entry go new. The pairs ``R_il < 0`` form a bipartite graph;
      its connected components are independent problems, and a component of one pair (the
      neuron's only candidate, which no other neuron wants) is solved by taking it, so only
      the rest goes to the Hungarian algorithm. The dense new-atom block is never formed.

    With no ties among the candidate assignments the optimum is unique and equals
    ``linear_sum_assignment`` of the full matrix, up to the numbering of the new atoms.
    """
    G, L = old.shape
    R = np.subtract(old, new[None, :], out=old)
    out = np.full(L, -1, dtype=np.int64)
    if steps is None:
        neg = R < 0
        per_atom, per_neuron = neg.sum(axis=1), neg.sum(axis=0)
        n_pairs = int(per_atom.sum())
        atoms = np.flatnonzero(per_atom == 1)  # single pairs: an atom of one candidate neuron ...
        neurons = neg[atoms].argmax(axis=1)
        alone = per_neuron[neurons] == 1  # ... which has no other candidate atom
        atoms, neurons = atoms[alone], neurons[alone]
        out[neurons] = atoms
        per_atom[atoms] = 0
        rest_atoms = np.flatnonzero(per_atom > 0)
        if len(rest_atoms):
            rest_neurons = np.flatnonzero((per_neuron > 0) & (out < 0))
            # rows gathered (a copy), columns only when some neurons drop out: a quarter of np.ix_'s time
            Z = R[rest_atoms]
            if len(rest_neurons) < L:
                Z = Z[:, rest_neurons]
            np.minimum(Z, 0.0, out=Z)
            r, c = linear_sum_assignment(Z)
            took = Z[r, c] < 0
            out[rest_neurons[c[took]]] = rest_atoms[r[took]]
        return out, n_pairs
    can = R <= steps[-1]
    atoms, neurons = np.flatnonzero(can.any(axis=1)), np.flatnonzero(can.any(axis=0))
    if len(neurons):
        n_forced, n = L - len(neurons), len(neurons)  # neurons that can only go new take the first new columns
        C = np.empty((n, len(atoms) + n))
        C[:, : len(atoms)] = R[np.ix_(atoms, neurons)].T
        C[:, len(atoms) :] = steps[None, n_forced : n_forced + n]
        r, c = linear_sum_assignment(C)
        took = c < len(atoms)
        out[neurons[r[took]]] = atoms[c[took]]
    return out, int(can.sum())


#: Share of (atom, neuron) pairs that may be candidates for the float32 screen of
#: :func:`_negative_pairs` to pay (rechecking a pair in float64 costs about as much as 50 of
#: the pairs a float64 product computes); above it the dense float64 path runs.
SCREEN_DENSITY = 0.02


def _negative_pairs(v, p, h, lam, m, prior: _Prior, hh: np.ndarray | None = None, vv: np.ndarray | None = None,
                    v32: np.ndarray | None = None):
    """The pairs (atom i, neuron l) with ``R_il < 0`` under the ``"marginal"`` cost without KL
    (``R`` as in :func:`_assign`: ``old_il - new_l``), found through a float32 product.

    ``p`` is one precision row (1, B); ``hh``, ``vv`` and ``v32`` the atoms' ``HH``, the
    neurons' ``VV`` and ``v`` in float32, if known. With the terms of :func:`_gain_terms`,

    .. math::

        R_{il} = r_i + c_l - \\tfrac12 \\sum_b a_{ib} p_b^2 VV_{lb} - \\kappa_i\\, x_i \\cdot v_l,

    ``r_i = 1/2 sum_b [|b| log(1 + p_b/lambda_ib) - a_ib HH_ib + HH_ib/lambda_ib] - log(m_i/(J - m_i))``,
    ``c_l = -new_l``, and ``x_i = h_i`` with ``kappa_i = a_i p`` for one group, else
    ``x_id = a_{i b(d)} p_{b(d)} h_id`` with ``kappa_i = 1``. Only the product ``x . v`` is
    costly; in float32 its error is at most ``gamma_{D+2} ||x_i|| ||v_l||`` with
    ``gamma_n = n u / (1 - n u)``, ``u = 2^-24`` (rounding of both factors and any order of
    summation; Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 3.5), plus
    ``2^-126 (sqrt(D) (||x_i|| + ||v_l||) + D)`` for underflow; twice that, with the largest
    ``||x_i||``, is used. A pair whose lower bound on ``R`` is not negative cannot be negative:
    it enters the optimum of :func:`_assign` as a zero and needs no exact value. A pair alone
    among the candidates of its atom and of its neuron, with a negative upper bound, is taken
    in any optimum (:func:`_assign`: a component of one pair): its value is not needed either.
    The others (few, when atoms are well separated) get ``x_i . v_l`` in float64.

    Returns
    -------
    (atoms, neurons, R) : the pairs with ``R < 0`` and ``R`` there (for a pair alone in its
    atom and its neuron, an upper bound < 0), or None when more than ``SCREEN_DENSITY`` of
    all pairs pass the screen (the dense path is then cheaper), or when float32 could overflow.
    """
    groups = prior.groups
    J, (L, D), G = prior.n_clients, v.shape, len(m)
    empty = np.zeros(0, dtype=np.int64)
    if G == 0:
        return empty, empty, np.zeros(0)
    pb, sizes = p[0], groups.sizes
    a = 1.0 / (lam + pb)
    ap = a * pb
    hh = groups.sum_sq(h) if hh is None else hh
    vv = groups.sum_sq(v) if vv is None else vv
    row = 0.5 * (np.log1p(pb / lam) @ sizes - np.sum(a * hh - hh / lam, axis=1)) - np.log(m / (J - m))
    # c_l = -new_l: Delta_0l and the log ratio of the prior "atom" (as in _gain_terms, one row)
    a0, hh0 = 1.0 / (prior.lam0 + pb), groups.sum_sq(prior.h0[None, :])[0]
    delta0 = (np.sum(a0 * hh0 - hh0 / prior.lam0) + vv @ (a0 * pb * pb)
              + v @ (prior.h0 * groups.expand(2 * a0[None] * pb)[0]))
    col = 0.5 * delta0 - 0.5 * (np.log1p(pb / prior.lam0) @ sizes) + math.log(prior.gamma0 / J)
    if groups.n == 1:
        kappa, x_norm = ap[:, 0], np.sqrt(hh[:, 0])
    else:
        kappa, x_norm = np.ones(G), np.sqrt(np.sum(ap * ap * hh, axis=1))

    def x(rows):  # rows of x, made when needed (one group: rows of h)
        return h[rows] if groups.n == 1 else h[rows] * groups.expand(ap[rows])

    v_norm = np.sqrt(vv.sum(axis=1))
    if x_norm.max() * v_norm.max() * D > 1e36:  # float32 sums could overflow
        return None
    n = D + 2
    eps = 2 * n * 2.0**-24 / (1 - n * 2.0**-24)
    tiny = 2 * 2.0**-126 * (math.sqrt(D) * (x_norm.max() + v_norm.max()) + D)  # underflow, for every pair
    err = eps * x_norm.max() * v_norm + tiny  # (L,): bounds the float32 error of x_i . v_l for every i
    shift = err + (0.5 * pb[0] * vv[:, 0] if groups.n == 1 else 0.0)  # one group: kappa_i factors the VV term
    v32 = v.astype(np.float32) if v32 is None else v32
    if groups.n == 1:
        x32 = h.astype(np.float32)
    else:  # x in float32, a block of atoms at a time: no (G, D) float64 array besides h
        x32 = np.empty((G, D), dtype=np.float32)
        step = max(1, (1 << 22) // max(D, 1))
        for start in range(0, G, step):
            x32[start : start + step] = x(slice(start, start + step))
    bound = np.add(x32 @ v32.T, shift[None, :], dtype=np.float64)
    del x32
    bound *= -kappa[:, None]
    bound += row[:, None]
    bound += col[None, :]
    if groups.n > 1:
        bound -= (0.5 * ap * pb) @ vv.T  # now bound <= R_il
    atoms, neurons = np.nonzero(bound < 0)
    if len(atoms) > SCREEN_DENSITY * G * L:
        return None
    # A pair alone in its atom's and its neuron's candidates, surely negative, is taken whatever
    # its value; the others get R exactly.
    upper = bound[atoms, neurons] + 2 * kappa[atoms] * err[neurons]  # >= R_il
    alone = (np.bincount(atoms, minlength=G)[atoms] == 1) & (np.bincount(neurons, minlength=L)[neurons] == 1)
    check = ~(alone & (upper < 0))
    ia, il = atoms[check], neurons[check]
    dots = np.einsum("kd,kd->k", x(ia), v[il])
    R = upper
    R[check] = row[ia] + col[il] - 0.5 * np.einsum("kb,kb->k", (ap * pb)[ia], vv[il]) - kappa[ia] * dots
    keep = R < 0
    return atoms[keep], neurons[keep], R[keep]


def _assign_negative(atoms: np.ndarray, neurons: np.ndarray, R: np.ndarray, n_atoms: int, n_neurons: int,
                     ) -> np.ndarray:
    """:func:`_assign` for the ``"marginal"`` cost from the pairs with ``R < 0`` alone (as
    :func:`_negative_pairs` gives them): single pairs are taken, the rest is the Hungarian
    problem of ``Z = min(R, 0)`` on the atoms and neurons left (zeros elsewhere)."""
    out = np.full(n_neurons, -1, dtype=np.int64)
    per_atom = np.bincount(atoms, minlength=n_atoms)
    per_neuron = np.bincount(neurons, minlength=n_neurons)
    single = (per_atom[atoms] == 1) & (per_neuron[neurons] == 1)
    out[neurons[single]] = atoms[single]
    rest = ~single
    if rest.any():
        rest_atoms, ia = np.unique(atoms[rest], return_inverse=True)
        rest_neurons, il = np.unique(neurons[rest], return_inverse=True)
        Z = np.zeros((len(rest_atoms), len(rest_neurons)))
        Z[ia, il] = R[rest]
        r, c = linear_sum_assignment(Z)
        took = Z[r, c] < 0
        out[rest_neurons[c[took]]] = rest_atoms[r[took]]
    return out


#: Largest per-client cost product (atoms x neurons x coordinates, multiply-adds) that
#: :func:`match_neurons` runs on one BLAS thread (J = 1000 clients of 100 neurons in 794
#: dimensions, 2 cores shared with other work: 5 s on one thread, 10 to 27 s on two).
SINGLE_THREAD_PRODUCT = 5e7


@functools.lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl's view of the loaded BLAS libraries (looked up once), or None without it."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - scikit-learn brings it
        return None
    return ThreadpoolController()


def _blas_threads(limit: int | None, backend: Backend = NUMPY):
    """Context running BLAS on at most ``limit`` threads (threadpoolctl; unchanged when None or
    when threadpoolctl is missing), and torch's CPU operations too for a torch backend on the
    CPU. The limit is process-wide while it lasts."""
    stack = contextlib.ExitStack()
    if limit is None:
        return stack
    controller = _blas_controller()
    if controller is not None:
        stack.enter_context(controller.limit(limits=limit, user_api="blas"))
    if backend.is_torch and backend.device.type == "cpu":
        torch, before = backend.torch, backend.torch.get_num_threads()
        if limit < before:
            torch.set_num_threads(limit)
            stack.callback(torch.set_num_threads, before)
    return stack


class _NeuronCache:
    """Per-client quantities of the neurons that no hyper-parameter changes, each computed at
    the first visit and kept across sweeps and matchings (:func:`_match_empirical_bayes`):
    the neurons in float32 for the screen of :func:`_negative_pairs` (half the neurons' memory)
    and their group sums ``VV`` (L_j, B) for one coordinate grouping at a time (when B is at
    most D / 8), in the neurons' backend."""

    def __init__(self, n_clients: int):
        self._v32: list[np.ndarray | None] = [None] * n_clients
        self._vv: list = [None] * n_clients
        self._grouping: bytes | None = None
        #: Share of candidate pairs at the last client visited, kept across the matchings of
        #: empirical Bayes: whether the next one tries the float32 screen.
        self.density = 0.0

    def v32(self, j: int, v: np.ndarray) -> np.ndarray:
        if self._v32[j] is None:
            self._v32[j] = v.astype(np.float32)
        return self._v32[j]

    def vv(self, j: int, v, groups: _Groups):
        if 8 * groups.n > len(groups.index):  # hardly smaller than the neurons: not kept
            return groups.sum_sq(v)
        key = groups.index.tobytes()
        if key != self._grouping:
            self._vv, self._grouping = [None] * len(self._vv), key
        if self._vv[j] is None:
            self._vv[j] = groups.sum_sq(v)
        return self._vv[j]


class _AtomBuffer:
    """Natural parameters of the atoms in growable arrays; ``h``, ``lam``, ``m`` are views, and
    ``hh`` (G, B) holds the group sums ``sum_{d in b} h_id^2`` of :func:`_gain_terms`, kept up
    to date by whoever writes rows of ``h`` (:meth:`refresh`). ``h`` lives in ``backend`` (the
    neurons'); ``lam``, ``hh`` and ``m``, (G, B) and (G,), on the host in float64."""

    def __init__(self, dim: int, groups: _Groups, capacity: int, backend: Backend = NUMPY):
        self.groups = groups
        self.backend = backend
        self._h = backend.zeros((capacity, dim))
        self._lam = np.zeros((capacity, groups.n))
        self._hh = np.zeros((capacity, groups.n))
        self._m = np.zeros(capacity, dtype=np.int64)
        self.n = 0

    @property
    def h(self):
        return self._h[: self.n]

    @property
    def lam(self) -> np.ndarray:
        return self._lam[: self.n]

    @property
    def hh(self) -> np.ndarray:
        return self._hh[: self.n]

    @property
    def m(self) -> np.ndarray:
        return self._m[: self.n]

    def refresh(self, rows: np.ndarray) -> None:
        """Recompute ``hh`` on ``rows`` after writing them in ``h``."""
        self._hh[rows] = self.backend.host(self.groups.sum_sq(self._h[rows]))

    def _reserve(self, size: int) -> None:
        if size > len(self._m):
            cap = max(2 * len(self._m), size)
            for name in ("_h", "_lam", "_hh", "_m"):
                old = getattr(self, name)
                new = self.backend.zeros((cap, *old.shape[1:])) if name == "_h" else \
                    np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
                new[: self.n] = old[: self.n]
                setattr(self, name, new)

    def grow(self, k: int, prior: _Prior) -> None:
        """Append k atoms holding only the prior."""
        self._reserve(self.n + k)
        self._h[self.n : self.n + k] = self.backend.put(prior.h0)
        self._lam[self.n : self.n + k] = prior.lam0
        self._hh[self.n : self.n + k] = self.groups.sum_sq(prior.h0[None, :])
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
        for arr in (self._h, self._lam, self._hh, self._m):
            arr[holes] = arr[movers]
        self.n = n_keep
        return remap

    def reset(self, h, lam: np.ndarray, m: np.ndarray) -> None:
        """Replace the contents by freshly computed statistics (``h`` on the host or in the backend)."""
        self._reserve(len(m))
        self.n = len(m)
        self._h[: self.n], self._lam[: self.n], self._m[: self.n] = self.backend.put(h), lam, m
        self._hh[: self.n] = self.backend.host(self.groups.sum_sq(self.h))


@ieee_float32()
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
    rounds: int = 100,
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
        Neuron vectors of each client (rows): NumPy arrays (anything :func:`numpy.asarray`
        takes), matched in float64; or torch tensors, all of one device and one dtype (float32
        or float64), matched there: the atoms' natural parameters, the cost matrices
        (:func:`assignment_cost`) and the posterior means and variances are computed with torch
        on that device in that dtype, each assignment problem is solved on the host
        (``scipy.optimize.linear_sum_assignment``), and ``mean``/``var`` of the result are tensors
        on that device (assignments and counts stay NumPy). Float64 tensors give the NumPy
        result up to round-off; float32 ones compute every cost in float32 (relative error about
        ``D * 2^-24`` of the cost's terms), so assignments can differ only between options whose
        costs are that close. Empirical Bayes (``"auto"``) accumulates its statistics on the
        host from a float64 copy of the neurons.
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
        ``"auto"`` only: most rounds of one sweep and re-estimation (then a last matching of up
        to ``n_iter`` sweeps with the final values).
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
        Also stop when a sweep raises the objective by less than ``tol`` nats per neuron
        (``tol * sum_j L_j`` in all): the sweeps' gains fall fast, then trail off in moves
        worth a fraction of a nat each (``hyper["stopped"]`` says whether it stopped so).
        None or 0: sweep until no neuron moves (or ``n_iter``). The ``"marginal"`` cost only:
        the ``"pfnm"`` cost does not climb the recorded objective, so there it is ignored.
    seed : int or Generator, optional
        Order of the clients in each sweep; the same seed gives the same result.
    verbose : bool
        Progress bar over sweeps.

    Returns
    -------
    MatchResult
        With ``"auto"``, ``hyper`` holds the chosen values per block (``noise_var``,
        ``prior_var``, ``prior_mean``, ``gamma0``) and ``hyper["auto"]`` the keys chosen.

    Raises
    ------
    TypeError
        When the neurons mix torch tensors with other arrays, devices or dtypes, or are tensors
        of a dtype other than float32 and float64.

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
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not math.isfinite(tol)
                            or tol < 0):
        raise ValueError(f"tol must be a finite number >= 0 (nats per neuron) or None, got {tol!r}")
    if cost == "auto":
        cost = "marginal" if auto else "pfnm"
    if cost not in ("pfnm", "marginal"):
        raise ValueError(f"cost must be 'auto', 'pfnm' or 'marginal', got {cost!r}")
    if auto:
        return _match_empirical_bayes(
            layers, auto, noise_var=noise_var, prior_var=prior_var, gamma0=gamma0, prior_mean=prior_mean,
            blocks=blocks, relative_precision=relative_precision, local_vars=local_vars, rounds=rounds,
            match=dict(kl_weight=kl_weight, cost=cost, local_vars=None, n_iter=n_iter, tol=tol, seed=seed,
                       verbose=False, start=start, checked=True), verbose=verbose, start=start)
    if relative_precision is not None:
        if np.ndim(noise_var) != 0:
            raise ValueError("relative_precision scales one noise variance: give noise_var as a number")
        noise_var = noise_matrix(np.array([float(noise_var)]), np.zeros(len(relative_precision[0]), dtype=int),
                                 _weights(relative_precision, len(layers), len(relative_precision[0])))
    return _match(layers, noise_var=noise_var, prior_var=prior_var, prior_mean=prior_mean, gamma0=gamma0,
                  kl_weight=kl_weight, cost=cost, local_vars=local_vars, n_iter=n_iter, tol=tol, seed=seed, init=init,
                  verbose=verbose, start=start)


def _match(layers, *, noise_var, prior_var, prior_mean, gamma0, kl_weight, cost, local_vars, n_iter, tol, seed, init,
           verbose, start, checked: bool = False, init_atoms=None, squares=None,
           cache: _NeuronCache | None = None, baseline: float | None = None) -> MatchResult:
    """:func:`match_neurons` with numeric hyper-parameters.

    For repeated matchings of the same neurons (:func:`_match_empirical_bayes`): ``checked``,
    the layers are :func:`_check_layers`'s output and ``init`` assignments of an earlier
    matching (no checks; ``hyper`` leaves array values out, the caller records its own);
    ``init_atoms``, the atoms' ``(h (G, D), lambda (G, D), m)`` under these hyper-parameters
    for ``init``, computed elsewhere (from the statistics of EM); given as a list, it is emptied
    once the atoms are built (the caller then holds no (G, D) array through the sweeps); ``squares``,
    :func:`_squares` of the layers; ``cache``, a :class:`_NeuronCache` of the layers;
    ``baseline``, the objective before the first sweep (``tol`` then applies to that sweep too).
    """
    layers, prec, prior = _setup(layers, noise_var, prior_var, prior_mean, gamma0, local_vars, checked=checked)
    backend = backend_of(layers)
    groups = prior.groups
    J, D = len(layers), layers[0].shape[1]
    if not np.isfinite(kl_weight) or kl_weight < 0:
        raise ValueError(f"kl_weight must be >= 0, got {kl_weight}")
    if int(n_iter) != n_iter or n_iter < 1:
        raise ValueError(f"n_iter must be a positive integer, got {n_iter}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    least_gain = _least_gain(tol, layers, cost)
    data_const = _data_constant(layers, prec, groups, squares)
    cache = _NeuronCache(J) if cache is None else cache
    prec_on = [backend.put(p) for p in prec]  # the precisions where the neurons are

    assignments: list[np.ndarray | None] = [None] * J
    atoms = _AtomBuffer(D, groups, capacity=max(len(v) for v in layers) * 2, backend=backend)
    if init is not None:  # warm start: atoms from the given assignments, then refining sweeps
        assignments = [np.asarray(a) for a in init] if checked else _check_assignments(init, layers)
        if init_atoms is None:
            atoms.reset(*_posterior_stats(layers, prec, assignments, int(max(a.max() for a in assignments)) + 1,
                                          prior, backend))
        else:  # lambda is constant on each coordinate group: keep one value per group
            h0, lam0, m0 = init_atoms
            if isinstance(init_atoms, list):  # the caller's (K, D) arrays go once the atoms hold them
                init_atoms.clear()
            atoms.reset(h0, lam0[:, groups.first], m0)
            del h0, lam0, m0
        if (atoms.m == 0).any():
            raise ValueError("init leaves some atom indices unused; number atoms 0..G-1")
    objective: list[float] = []
    converged = stopped = False
    seen: dict[bytes, int] = {}  # partitions after each sweep, to detect cycles
    cycle = 0
    bar = tqdm(range(int(n_iter)), desc="matching", unit="sweep", disable=not verbose)
    sweeps = 0
    screen = (not backend.is_torch and cost == "marginal" and not kl_weight
              and all(x.shape[0] == 1 for x in prec))
    density = cache.density  # share of candidate pairs at the last client: whether the float32 screen pays
    # Whether client j's problem may differ from the one it last solved: it does not when no
    # other client's assignment changed since (the atoms it sees are the same, up to labels and
    # round-off), and its solution would be its current assignment again.
    stale = np.ones(J, dtype=bool)
    # Small per-client products gain little from several BLAS threads and, on a shared machine, lose
    # much waiting for a busy core at every product: run them on one.
    largest = max(len(v) for v in layers) * D * max(atoms.n, max(len(v) for v in layers))
    with _blas_threads(1 if largest <= SINGLE_THREAD_PRODUCT else None, backend):
        for sweep in bar:
            changed, relabelled = 0, False
            # Whether the atoms are those _posterior_stats gives for the assignments at the start of the sweep.
            exact = assignments[0] is not None
            for j in rng.permutation(J):
                if not stale[j]:
                    continue
                v, p, p_on = layers[j], prec[j], prec_on[j]
                vp = v * groups.expand(p_on)  # v / sigma_j^2, added to h
                old = assignments[j]
                if old is not None:  # take client j out, keeping its atoms' rows to put back unchanged
                    kept_h, kept_lam, kept_hh = atoms.h[old], atoms.lam[old], atoms.hh[old]
                    atoms.h[old] = kept_h - vp
                    atoms.refresh(old)
                    atoms.lam[old] = kept_lam - p
                    atoms.m[old] -= 1
                    keep = atoms.m > 0
                    old_kept = old
                    if not keep.all():
                        relabelled = True
                        remap = atoms.compact(keep)
                        old_kept = remap[old]
                        for k in range(J):
                            if k != j and assignments[k] is not None:
                                assignments[k] = remap[assignments[k]]
                g = atoms.n
                pairs = None
                if screen and density <= SCREEN_DENSITY:  # a float32 product finds the few candidate pairs
                    pairs = _negative_pairs(v, p, atoms.h, atoms.lam, atoms.m, prior, atoms.hh,
                                            cache.vv(j, v, groups), cache.v32(j, v))
                if pairs is None:
                    old_cost, new_cost, steps = _cost_blocks(
                        v, p_on, atoms.h, atoms.lam, atoms.m, prior, cost=cost, kl_weight=kl_weight, hh=atoms.hh,
                        vv=None if p.shape[0] > 1 else cache.vv(j, v, groups))
                    old_cost, new_cost = backend.host(old_cost), backend.host(new_cost)
                    R = old_cost - new_cost[None, :] if _RECORDERS else None  # before _assign overwrites old_cost
                    a, n_pairs = _assign(old_cost, new_cost, steps)
                    for record in _RECORDERS:
                        record(v, R, a.copy(), steps)
                else:
                    a, n_pairs = _assign_negative(*pairs, g, v.shape[0]), len(pairs[0])  # -1: a new atom
                density = n_pairs / max(g * v.shape[0], 1)
                same = old is not None and not np.any(a != old_kept)
                changed += int(old is not None and not same)
                stale[j] = False
                if not same:
                    stale[:j], stale[j + 1 :] = True, True
                fresh = a < 0
                a[fresh] = g + np.arange(int(fresh.sum()))
                atoms.grow(int(fresh.sum()), prior)  # put client j back
                if same and old_kept is old:  # the same atoms, not relabelled: their rows as they were
                    atoms.h[a], atoms.lam[a], atoms.hh[a] = kept_h, kept_lam, kept_hh
                else:
                    atoms.h[a] += vp
                    atoms.refresh(a)
                    atoms.lam[a] += p
                atoms.m[a] += 1
                assignments[j] = a
            sweeps = sweep + 1
            # With no assignment changed and no atom relabelled, every client visited put back the rows
            # it took out as they were (kept_h, kept_lam, kept_hh): the atoms are, bit for bit, those
            # of the start of the sweep. Else recompute them from the assignments, which removes the
            # round-off accumulated by the updates.
            if not (exact and changed == 0 and not relabelled):
                atoms.reset(*_posterior_stats(layers, prec, assignments, atoms.n, prior, backend))
            objective.append(_objective(atoms.h, atoms.lam, atoms.m, prior, atoms.hh) + data_const)
            bar.set_postfix(atoms=atoms.n, objective=f"{objective[-1]:.1f}")
            if (sweep > 0 or init is not None) and changed == 0:
                converged = True
                break
            before = objective[-2] if sweep > 0 else baseline
            if least_gain is not None and before is not None and objective[-1] - before < least_gain:
                stopped = converged = True
                break
            state = _partition_key(assignments)
            if state in seen:  # the sweeps came back to an earlier partition: more would repeat the cycle
                cycle = sweep - seen[state]
                converged = True
                break
            seen[state] = sweep
    cache.density = density
    mean, var = _posterior_moments(atoms.h, atoms.lam, groups, backend)
    result = MatchResult(
        assignments=[np.asarray(a) for a in assignments],
        mean=mean,
        var=var,
        counts=atoms.m.copy(),
        objective=objective,
        converged=converged,
        n_sweeps=sweeps,
        hyper=dict(noise_var=_listed(noise_var, checked), prior_var=_listed(prior_var, checked),
                   prior_mean=_listed(prior_mean, checked),
                   gamma0=gamma0, kl_weight=kl_weight, cost=cost, n_iter=n_iter, local_vars=local_vars is not None,
                   seed=None if isinstance(seed, np.random.Generator) else seed, cycle=cycle, tol=tol,
                   stopped=stopped),
        seconds=time.perf_counter() - start,
    )
    warn_not_converged({"matching": result}, "matching")
    return result


def _least_gain(tol: float | None, layers, cost: str) -> float | None:
    """The gain in nats below which a sweep ends the matching: ``tol`` per neuron of ``layers``;
    None (no such stop) without ``tol`` or with the PFNM cost, whose sweeps do not climb the
    recorded log posterior (its trace may dip)."""
    if not tol or cost != "marginal":
        return None
    return float(tol) * sum(int(v.shape[0]) for v in layers)


def _posterior_moments(h, lam: np.ndarray, groups: _Groups, backend: Backend = NUMPY,
                       max_elements: int = 1 << 22):
    """The atoms' posterior means ``h / lambda`` and variances ``1 / lambda`` on every coordinate.

    Parameters
    ----------
    h : (G, D) array or tensor
        Natural parameters of the atoms, in ``backend``.
    lam : (G, B) ndarray
        Their precisions per coordinate group.
    groups : _Groups
    backend : Backend
    max_elements : int
        NumPy: rows of atoms go through at most this many numbers at a time, so that besides
        the two (G, D) results no (G, D) array is made (``lambda`` on every coordinate, ``1 /
        lambda`` before its copy); each entry is the same division as over all rows at once.

    Returns
    -------
    (mean, var) : two (G, D) arrays (tensors in ``backend`` for torch)
    """
    if backend.is_torch:
        lam_full = groups.expand(backend.put(lam))
        return h / lam_full, 1.0 / lam_full
    G, D = h.shape
    mean, var = np.empty((G, D)), np.empty((G, D))
    inverse = 1.0 / lam
    step = max(1, max_elements // max(D, 1))
    for start in range(0, G, step):
        rows = slice(start, start + step)
        np.divide(h[rows], groups.expand(lam[rows]), out=mean[rows])
        var[rows] = groups.expand(inverse[rows])
    return mean, var


def _listed(value, internal: bool):
    """A hyper-parameter for ``MatchResult.hyper``: numbers as given, arrays as lists (None for
    the internal matchings of :func:`_match_empirical_bayes`, which records its own)."""
    if np.ndim(value) == 0:
        return value
    return None if internal else np.asarray(value).tolist()


def _weights(relative_precision, J: int, D: int) -> np.ndarray:
    w = finite_array(relative_precision, "relative_precision")
    if w.shape != (J, D) or (w < 0).any():
        raise ValueError(f"relative_precision must be a non-negative ({J}, {D}) array, got shape {w.shape}")
    return w


def _match_empirical_bayes(layers, auto, *, noise_var, prior_var, gamma0, prior_mean, blocks, relative_precision,
                           local_vars, rounds, match, verbose, start) -> MatchResult:
    """:func:`match_neurons` with the ``auto`` hyper-parameters chosen by empirical Bayes.

    Coordinate ascent on ``F(B, theta) = log p(V, B | theta)``: each round is one sweep over
    the clients (the marginal cost: every client's Hungarian step raises F given theta), then
    the hyper-parameters that maximise F given the assignments
    (:func:`~bayesfuse.inference.empirical_bayes.maximise_hyper`). F never decreases; the
    rounds stop when a sweep moves no neuron, where the assignments are a fixed point of the
    sweeps under the hyper-parameters they were matched with, and those hyper-parameters the
    maximiser for these assignments; or, with ``tol``, when a round's sweep raised F by less
    than ``tol`` nats per neuron (the result is then that sweep's, under the hyper-parameters
    it was matched with). If ``rounds`` run out first, a last matching (up to
    ``n_iter`` sweeps) with the final values makes result and hyper-parameters agree.
    """
    if local_vars is not None:
        raise ValueError("'auto' hyper-parameters need local_vars=None (give numbers with local posterior variances)")
    if int(rounds) != rounds or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds}")
    layers = _check_layers(layers)
    backend = backend_of(layers)
    host_layers = [backend.host(v) for v in layers]  # the statistics run on the host
    J, D = len(layers), layers[0].shape[1]
    blocks = np.zeros(D, dtype=np.int64) if blocks is None else to_host(blocks, None)
    if blocks.shape != (D,) or not np.issubdtype(blocks.dtype, np.integer) or blocks.min() < 0 or \
            set(np.unique(blocks)) != set(range(int(blocks.max()) + 1)):
        raise ValueError(f"blocks must be ({D},) integers numbering blocks 0..B-1, each used")
    weights = np.ones((J, D)) if relative_precision is None else _weights(relative_precision, J, D)
    mu0 = np.broadcast_to(finite_array(prior_mean, "prior_mean"), (D,)).astype(np.float64)
    hyper = initial_hyper(host_layers, blocks, weights, mu0)
    n_blocks = len(hyper.prior_var)
    for key, value in (("noise_var", noise_var), ("prior_var", prior_var)):
        if key not in auto:
            value = positive_array(value, key)
            if np.ndim(value) != 0:
                raise ValueError(f"with 'auto' hyper-parameters, {key} must be a number or 'auto'")
            setattr(hyper, key, np.full(n_blocks, float(value)))
    if "gamma0" not in auto:
        hyper.gamma0 = float(gamma0)
    trace, result, init_atoms, assignments = [], None, None, None
    squares, cache = _squares(host_layers), _NeuronCache(J)
    sweeps, least_gain = 0, _least_gain(match["tol"], host_layers, match["cost"])
    settled = stopped = False
    bar = tqdm(range(int(rounds)), desc="empirical Bayes", unit="round", disable=not verbose)
    with warnings.catch_warnings():  # one sweep per round never "converges": the rounds' end is what counts
        warnings.simplefilter("ignore", ConvergenceWarning)
        for r in bar:
            noise, prior0, mean0 = hyper.expand(blocks, weights)
            result = _match(layers, noise_var=noise, prior_var=prior0, prior_mean=mean0, gamma0=hyper.gamma0,
                            init=assignments, init_atoms=init_atoms, squares=squares, cache=cache,
                            **dict(match, n_iter=1))
            assignments, init_atoms = result.assignments, None
            sweeps += result.n_sweeps
            trace.append(dict(n_global=result.n_global, objective=result.objective[-1], **hyper.as_dict()))
            bar.set_postfix(atoms=result.n_global, objective=f"{result.objective[-1]:.1f}")
            gain = math.inf if r == 0 else trace[-1]["objective"] - trace[-2]["objective"]
            settled = result.converged  # no neuron moved
            stopped = not settled and least_gain is not None and gain < least_gain
            if settled or stopped:
                break
            # one pass over the neurons serves the M-step and the next sweep's start; of this sweep's
            # result, only the assignments and the posterior means (the statistics' shift) are used
            shift, result = backend.host(result.mean), None
            stats = atom_statistics(host_layers, assignments, weights, shift=shift)
            del shift
            hyper = maximise_hyper(stats, blocks, hyper, fit=auto)
            # the next sweep's start, written over the spent statistics; a list: _match takes the
            # (K, D) arrays out of it, and they go once its atoms hold them
            stats.scatter = None
            init_atoms = [*atom_posterior(stats, blocks, hyper, overwrite=True), stats.counts]
            del stats
        objective = [t["objective"] for t in trace]
        if not (settled or stopped):
            noise, prior0, mean0 = hyper.expand(blocks, weights)
            result = _match(layers, noise_var=noise, prior_var=prior0, prior_mean=mean0, gamma0=hyper.gamma0,
                            init=assignments, init_atoms=init_atoms, squares=squares, cache=cache,
                            baseline=objective[-1], **match)
            sweeps += result.n_sweeps
            objective += result.objective
            stopped = result.hyper["stopped"]
    result.n_sweeps, result.objective, result.converged = sweeps, objective, result.converged or stopped
    result.hyper = dict(result.hyper, **hyper.as_dict(), auto=list(auto), blocks=blocks.tolist(), rounds=len(trace),
                        trace=trace, stopped=stopped)
    result.seconds = time.perf_counter() - start
    warn_not_converged({"matching": result}, "matching", stacklevel=4)
    return result
