"""The pieces of the BBP model of neurons: coordinate groups, the prior, the atoms' posterior
statistics and moments, and the collapsed log posterior :func:`log_marginal_posterior`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from scipy import sparse
from scipy.special import gammaln

from bayesfuse._validation import finite_array
from bayesfuse.constraints import GAMMA0, validate_params
from bayesfuse.inference._backend import NUMPY, Backend, backend_of, ieee_float32, is_tensor, namespace, to_host
from bayesfuse.inference.lazy import GroupedColumns
from bayesfuse.inference.matching.checks import check_assignments, check_layers, client_variances, positive, widen

if TYPE_CHECKING:
    import torch


class Groups:
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
        self._runs: list[tuple[int, int, int]] | None = None
        if n_groups > 1 and len(starts) < 8:
            bounds = np.concatenate([[0], starts, [D]])
            self._runs = list(zip(bounds[:-1].tolist(), bounds[1:].tolist(), self.index[bounds[:-1]].tolist()))
        self._onehot: Any = None  # a dense or a scipy sparse (D, B) indicator
        self._index_on: torch.Tensor | None = None  # index as a tensor, for torch inputs
        if n_groups > 1 and not self.identity and self._runs is None:
            if n_groups <= 64:
                self._onehot = np.zeros((D, n_groups))
                self._onehot[np.arange(D), self.index] = 1.0
            else:
                self._onehot = sparse.csr_array((np.ones(D), (np.arange(D), self.index)), shape=(D, n_groups))

    @classmethod
    def single(cls, dim: int) -> "Groups":
        return cls(np.zeros(dim, dtype=np.int64), 1)

    @classmethod
    def each(cls, dim: int) -> "Groups":
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
        assert self._runs is not None  # called for coordinates in runs only
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
class Prior:
    h0: np.ndarray  # (D,)   mu0 / sigma0^2
    lam0: np.ndarray  # (B,)   1 / sigma0^2 per coordinate group
    gamma0: float
    n_clients: int
    dim: int
    groups: Groups

    @property
    def const_per_atom(self) -> float:
        """``-1/2 sum_d (log sigma0_d^2 + mu0_d^2 / sigma0_d^2)``: the atom normaliser."""
        hh0 = self.groups.sum_sq(self.h0[None, :])[0]
        return float(0.5 * np.log(self.lam0) @ self.groups.sizes - 0.5 * np.sum(hh0 / self.lam0))


def make_prior(prior_var, prior_mean, gamma0, J, D, width) -> Prior:
    """Prior natural parameters; ``lam0`` has shape (width,), width 1 (isotropic) or D."""
    v0 = positive(prior_var, "prior_var", ((D,),))
    mu0 = finite_array(prior_mean, "prior_mean")
    if mu0.ndim > 0 and mu0.shape != (D,):
        raise ValueError(f"prior_mean must be a scalar or have shape ({D},), got {mu0.shape}")
    lam0 = np.broadcast_to(1.0 / v0, (width,)).astype(np.float64)
    h0 = np.broadcast_to(mu0 * np.broadcast_to(1.0 / v0, (D,)), (D,)).astype(np.float64)
    groups = Groups.single(D) if width == 1 else Groups.each(D)
    return Prior(h0=h0, lam0=lam0, gamma0=float(gamma0), n_clients=J, dim=D, groups=groups)


def group_coordinates(prec: list[np.ndarray], prior: Prior) -> tuple[list[np.ndarray], Prior]:
    """Precisions per coordinate group (:class:`Groups`): coordinates whose prior precision and
    every client's precision agree share a group. Needs one precision row per client."""
    columns = np.vstack([prior.lam0[None, :], *prec])  # (J + 1, D)
    _, first, inverse = np.unique(columns, axis=1, return_index=True, return_inverse=True)
    if len(first) == prior.dim:
        return prec, prior
    groups = Groups(inverse.reshape(-1), len(first))
    return [p[:, first] for p in prec], replace(prior, lam0=prior.lam0[first], groups=groups)


def setup(layers, noise_var, prior_var, prior_mean, gamma0, local_vars=None, *, checked: bool = False):
    """Checked neurons, per-client precisions and the prior, in B coordinate groups.

    ``prec[j]`` has shape (1, B) when client j's neurons share one noise variance, or (L_j, B)
    when ``local_vars`` gives each neuron its own (added to ``noise_var``). B is 1 when every
    variance is isotropic; with one precision row per client, coordinates on which the prior
    and every client agree are grouped (:class:`Groups`); else B = D. ``checked``: the layers
    are already :func:`check_layers`'s output.
    """
    layers = layers if checked else check_layers(layers)
    J, D = len(layers), layers[0].shape[1]
    variances = list(client_variances(noise_var, J, D)[:, None, :])  # J x (1, 1|D)
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
    prior = make_prior(prior_var, prior_mean, gamma0, J, D, width)
    if width > 1 and all(p.shape[0] == 1 for p in prec):
        prec, prior = group_coordinates(prec, prior)
    return layers, prec, prior


def add_scaled(h, rows, v, p, groups: Groups, *, base=None, max_elements: int = 1 << 20) -> None:
    """``h[rows] += v * p``, or with ``base``, ``h[rows] = base - v * p``, in
    place, a block of rows at a time: client neurons ``v`` (L, D) times their precisions ``p`` (1 | L,
    B) on every coordinate, without the (L, D) products of a wide layer held whole. Each entry is
    the same operation as on all rows at once. ``rows`` are distinct atoms (L,)."""
    L, D = v.shape
    step = max(1, max_elements // max(D, 1))
    for start in range(0, L, step):
        r = slice(start, start + step)
        term = v[r] * groups.expand(p if p.shape[0] == 1 else p[r])
        if base is not None:
            h[rows[r]] = base[r] - term
        else:
            h[rows[r]] += term


def posterior_stats(layers, prec, assignments, n_atoms, prior: Prior, backend: Backend = NUMPY, *, out=None):
    """Natural parameters h (G, D), lambda (G, B) and counts m of the atoms given assignments
    (``h`` in ``backend``, the layers' backend; ``lambda`` and ``m`` on the host); ``out``, a
    (G, D) array of that backend that ``h`` is written into (its contents are not read)."""
    if out is None:
        h = backend.put(np.tile(prior.h0, (n_atoms, 1)))
    else:
        h = out
        h[:] = backend.put(prior.h0)
    lam = np.tile(prior.lam0, (n_atoms, 1))
    m = np.zeros(n_atoms, dtype=np.int64)
    for j, a in enumerate(assignments):
        if a is None:
            continue
        # a is injective within a client, so fancy-index += is a correct scatter-add.
        add_scaled(h, a, layers[j], backend.put(prec[j]), prior.groups)
        lam[a] += prec[j]
        m[a] += 1
    return h, lam, m


def posterior_moments(
    h,
    lam: np.ndarray,
    groups: Groups,
    backend: Backend = NUMPY,
    max_elements: int = 1 << 20,
    *,
    overwrite: bool = False,
):
    """The atoms' posterior means ``h / lambda`` and variances ``1 / lambda`` on every coordinate.

    Parameters
    ----------
    h : (G, D) array or tensor
        Natural parameters of the atoms, in ``backend``.
    lam : (G, B) ndarray
        Their precisions per coordinate group.
    groups : Groups
    backend : Backend
    max_elements : int
        NumPy: rows of atoms go through at most this many numbers at a time, so that besides
        the (G, D) means no (G, D) array is made (``lambda`` on every coordinate); each entry is
        the same division as over all rows at once.
    overwrite : bool
        NumPy: the means are written over ``h`` (which the caller no longer needs) and returned
        as ``h`` itself, so that only the variances are a new (G, D) array; the values are the same.

    Returns
    -------
    (mean, var) : two (G, D) arrays (tensors in ``backend`` for torch)
        NumPy: ``var`` is a :class:`~bayesfuse.inference.lazy.GroupedColumns` holding the (G, B)
        variances per group, which reads as the (G, D) array.
    """
    if backend.is_torch:
        lam_full = groups.expand(backend.put(lam))
        return h / lam_full, 1.0 / lam_full
    G, D = h.shape
    mean = h if overwrite and h.dtype == np.float64 and h.flags.writeable else np.empty((G, D))
    step = max(1, max_elements // max(D, 1))
    for start in range(0, G, step):
        rows = slice(start, start + step)
        np.divide(h[rows], groups.expand(lam[rows]), out=mean[rows])
    inverse = 1.0 / lam
    return mean, GroupedColumns(inverse, groups.index, max_elements=max_elements)


def log_ibp_structure(m: np.ndarray, n_clients: int, gamma0: float) -> float:
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


def atom_objective(h, lam, m, prior: Prior, hh: np.ndarray | None = None) -> float:
    """Atom terms of :func:`log_marginal_posterior` (with ``lambda`` constant on each group);
    ``hh``: the group sums ``sum_{d in b} h_id^2`` (G, B) on the host, if known."""
    groups = prior.groups
    hh = to_host(groups.sum_sq(h)) if hh is None else hh
    quad = 0.5 * np.sum(hh / lam)
    logdet = 0.5 * float(np.log(lam).sum(axis=0) @ groups.sizes)
    atoms = quad - logdet + len(m) * prior.const_per_atom
    return float(atoms + log_ibp_structure(m, prior.n_clients, prior.gamma0))


def data_constant(layers, prec, groups: Groups, squares: Sequence[np.ndarray] | None = None) -> float:
    """The neurons' terms of :func:`log_marginal_posterior`; ``squares[j]`` may give client j's
    ``sum_l v_jld^2`` (D,) (:func:`neuron_squares`)."""
    total = 0.0
    for j, v in enumerate(layers):
        v = widen(v) if (p_rows := prec[j].shape[0]) > 1 else v  # one row: only neuron_squares reads v
        p = np.broadcast_to(groups.expand(prec[j]), (p_rows, v.shape[1]))  # (1 | L, D)
        seen = p > 0  # a coordinate of precision 0 carries no information: no factor
        log_norm = np.sum(np.log(2 * np.pi / p[seen])) * (v.shape[0] if p.shape[0] == 1 else 1)
        if p.shape[0] == 1:
            quad = (neuron_squares([v])[0] if squares is None else squares[j]) @ p[0]
        elif is_tensor(v):
            quad = float((v * v * v.new_tensor(p)).sum())
        else:
            quad = np.sum(v * v * p)
        total += -0.5 * log_norm - 0.5 * quad - gammaln(v.shape[0] + 1)
    return float(total)


def neuron_squares(layers: Sequence) -> list[np.ndarray]:
    """``sum_l v_jld^2`` (D,) of each client, on the host: :func:`data_constant` of several
    matchings on the same neurons without a pass over them each time."""
    return [to_host(namespace(w).einsum("ld,ld->d", w, w)) for w in map(widen, layers)]


@validate_params(gamma0=GAMMA0)
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
    layers, prec, prior = setup(layers, noise_var, prior_var, prior_mean, gamma0, local_vars)
    assignments = check_assignments(assignments, layers)
    n_atoms = int(max(a.max() for a in assignments)) + 1
    h, lam, m = posterior_stats(layers, prec, assignments, n_atoms, prior, backend_of(layers))
    if (m == 0).any():
        raise ValueError("assignments leave some atom indices unused; number atoms 0..G-1")
    return atom_objective(h, lam, m, prior) + data_constant(layers, prec, prior.groups)


def partition_key(assignments: Sequence[np.ndarray]) -> bytes:
    """The partition of all neurons that ``assignments`` make, with atoms relabelled in order of
    first use (equal keys: the same matching up to atom labels)."""
    flat = np.concatenate(assignments)
    _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inverse].astype(np.int64).tobytes()
