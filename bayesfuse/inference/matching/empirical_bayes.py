"""Data-free hyper-parameters for BBP-MAP matching: empirical Bayes on the collapsed marginal.

The BBP model of neurons (PFNM eq. 1; supplement section 1), made diagonal per *block* of
coordinates (a unit's incoming weights, its bias, its outgoing weights: layers and blocks differ
by orders of magnitude in scale):

.. math::

    \\theta_{id} \\sim N(\\mu_{0b}, s_{0b}), \\qquad
    v_{jld} \\mid (j, l) \\to i \\sim N(\\theta_{id}, s_b / w_{jd}), \\qquad
    B \\sim \\mathrm{BBP/IBP}(\\gamma_0),

with ``b = b(d)`` the block of coordinate ``d`` and ``w_jd`` a relative precision (1; client
j's share ``f_jk`` of class k for an outgoing weight into class k; 0 where client j observes
nothing). No method of the papers sets ``s_0``, ``s`` and ``gamma_0`` without held-out data;
here they maximise the collapsed log joint ``log p(V, B | s_0, s, gamma_0)`` (type-II maximum
likelihood, what :func:`~bayesfuse.inference.matching.log_marginal_posterior` computes) jointly
with the assignments ``B``, by coordinate ascent:

1. ``B`` <- one Hungarian sweep with the exact marginal cost (``cost="marginal"``: each
   client's step raises the objective);
2. given ``B``, the hyper-parameters that maximise the objective (:func:`maximise_hyper`: the
   point the EM steps of :func:`em_step` climb towards, reached directly), all from the atoms'
   sufficient statistics (:func:`atom_statistics`: one pass over the neurons per round);
3. repeat until a sweep moves no neuron.

This module holds both the statistics and that loop (:func:`match_empirical_bayes`, which
:func:`~bayesfuse.inference.matching.match_neurons` runs when a hyper-parameter is ``"auto"``).

EM step given ``B`` (E-step: the atoms' Gaussian posteriors
``lambda_id = 1/s_0b + sum_{(j,l)->i} w_jd / s_b``,
``theta^_id = (mu_0b/s_0b + sum w_jd v_jld / s_b) / lambda_id``, ``V_id = 1/lambda_id``):

.. math::

    s_b = \\frac{\\sum_{j,l,d \\in b} w_{jd} [(v_{jld} - \\hat\\theta_{a_{jl} d})^2 + V_{a_{jl} d}]}
               {\\#\\{(j,l,d \\in b): w_{jd} > 0\\}}, \\quad
    s_{0b} = \\frac{\\sum_{i, d \\in b} (\\hat\\theta_{id} - \\mu_{0b})^2 + V_{id}}{K |b|}, \\quad
    \\mu_{0b} = \\overline{\\hat\\theta}_{\\cdot b}, \\quad
    \\gamma_0 = K / H_J,

``H_J = sum_{j<=J} 1/j`` (the IBP mass maximising ``K log gamma_0 - gamma_0 H_J``).

Start. ``s_0b`` = the block's variance of all clients' coordinates and ``s_b = s_0b / 2``. A
small start noise is a trap: with every atom holding one neuron only ``s_0 + s`` is identified,
EM drives ``s`` to 0 and nothing ever merges.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import minimize
from tqdm.auto import tqdm

from bayesfuse._validation import finite_array, positive_array
from bayesfuse.inference._backend import backend_of, to_host
from bayesfuse.inference.lazy import GroupedColumns
from bayesfuse.inference.matching.checks import check_layers, relative_weights, widen
from bayesfuse.inference.matching.model import neuron_squares
from bayesfuse.inference.matching.result import MatchResult
from bayesfuse.inference.matching.sweeps import NeuronCache, blas_threads, least_gain_for, match_fixed
from bayesfuse.inference.result import ConvergenceWarning, warn_not_converged

__all__ = [
    "BlockHyper",
    "AtomStatistics",
    "initial_hyper",
    "atom_statistics",
    "atom_posterior",
    "em_step",
    "em_update",
    "maximise_hyper",
    "noise_matrix",
    "match_empirical_bayes",
]

#: Smallest variance EM may return (constant coordinates would otherwise reach 0).
VARIANCE_FLOOR = 1e-8


@dataclass
class BlockHyper:
    """Hyper-parameters per block: ``prior_var`` (s_0b), ``noise_var`` (s_b), ``prior_mean``
    (mu_0b), each (B,), and ``gamma0``."""

    prior_var: np.ndarray
    noise_var: np.ndarray
    prior_mean: np.ndarray
    gamma0: float

    def expand(self, blocks: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(noise_var (J, D), prior_var (D,), prior_mean (D,))`` for :func:`match_neurons`."""
        return noise_matrix(self.noise_var, blocks, weights), self.prior_var[blocks], self.prior_mean[blocks]

    def as_dict(self) -> dict:
        return {
            "prior_var": self.prior_var.tolist(),
            "noise_var": self.noise_var.tolist(),
            "prior_mean": self.prior_mean.tolist(),
            "gamma0": float(self.gamma0),
        }


def noise_matrix(noise_var: np.ndarray, blocks: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(J, D) noise variances ``s_b(d) / w_jd``; infinite (precision 0) where ``w_jd = 0``."""
    s = np.asarray(noise_var, dtype=np.float64)[blocks][None, :]
    seen = weights > 0
    return np.where(seen, s / np.where(seen, weights, 1.0), np.inf)


def _n_blocks(blocks: np.ndarray) -> int:
    return int(blocks.max()) + 1


def initial_hyper(
    layers: Sequence[np.ndarray],
    blocks: np.ndarray,
    weights: np.ndarray,
    prior_mean: np.ndarray,
    *,
    noise_fraction: float = 0.5,
    gamma0: float = 1.0,
) -> BlockHyper:
    """Start values from the neurons alone: ``s_0b`` = precision-weighted variance of block b's
    coordinates around the prior mean, ``s_b = noise_fraction * s_0b``."""
    B = _n_blocks(blocks)
    centred = bool(np.any(prior_mean))
    num_d, den_d = np.zeros(blocks.shape), np.zeros(blocks.shape)
    for v, w in zip(layers, weights):
        d = v - prior_mean if centred else widen(v)
        num_d += w * np.einsum("ld,ld->d", d, d)
        den_d += (w > 0) * len(v)
    num, den = np.bincount(blocks, num_d, minlength=B), np.bincount(blocks, den_d, minlength=B)
    s0 = np.maximum(num / np.maximum(den, 1), VARIANCE_FLOOR)
    mu0 = np.array([prior_mean[blocks == b].mean() for b in range(B)])
    return BlockHyper(prior_var=s0, noise_var=noise_fraction * s0, prior_mean=mu0, gamma0=float(gamma0))


@dataclass
class AtomStatistics:
    """What EM needs of the neurons given the assignments: per atom i and coordinate d,
    ``weight_id = W_id = sum_{(j,l) -> i} w_jd`` (a :class:`~bayesfuse.inference.lazy.GroupedColumns`:
    one column per distinct column of the clients' weights) and ``mean_id = c_id = sum w_jd
    v_jld / W_id`` (0 where ``W_id = 0``), each (K, D); ``scatter_d = sum_i Q_id`` (D,), the within-atom scatter
    ``Q_id = sum w_jd (v_jld - c_id)^2`` summed over the atoms (all that the M-step reads of it:
    one (K, D) array fewer); ``counts`` (K,), the neurons of each atom; ``n_seen`` (D,), the number
    of observed neuron coordinates ``#{(j, l): w_jd > 0}``; and the number of clients."""

    weight: GroupedColumns
    mean: np.ndarray
    scatter: np.ndarray | None  # None once spent (match_empirical_bayes frees it)
    counts: np.ndarray
    n_seen: np.ndarray
    n_clients: int


def atom_weights(assignments: Sequence[np.ndarray], n_atoms: int, weights: np.ndarray) -> GroupedColumns:
    """``W_id = sum_{(j, l) -> i} w_jd``: the total weight (precision) the clients' neurons give each
    atom's coordinates (``assignments`` injective within a client), held as one column per
    distinct column of ``weights`` (J, D) (a few: ones, and the class shares of the outgoing
    weights), not as a (K, D) array."""
    sizes = [len(a) for a in assignments]
    members = np.zeros((len(assignments), n_atoms))  # client j has a neuron on atom i (at most one)
    members[np.repeat(np.arange(len(assignments)), sizes), np.concatenate(assignments)] = 1.0
    pattern, index = np.unique(weights, axis=1, return_inverse=True)
    return GroupedColumns(members.T @ pattern, index.reshape(-1))


def atom_statistics(
    layers: Sequence[np.ndarray],
    assignments: Sequence[np.ndarray],
    weights: np.ndarray,
    shift: np.ndarray | None = None,
    *,
    max_elements: int = 1 << 20,
    overwrite_shift: bool = False,
) -> AtomStatistics:
    """:class:`AtomStatistics` of the neurons given the assignments.

    One pass over the neurons accumulates, about a reference ``r_i`` per atom, ``W``,
    ``S_id = sum w_jd (v_jld - r_id)`` and ``T_id = sum w_jd (v_jld - r_id)^2``; then
    ``c = r + S / W`` and ``Q = T - S^2 / W`` (the shifted-data formulas, exact in exact
    arithmetic). ``shift`` (K, D) gives ``r``: any values near each atom's mean keep the
    subtraction free of cancellation, e.g. the atoms' posterior means, which lie within a
    posterior standard deviation of ``c``. Without it a first pass computes ``c`` itself.

    The sums run over blocks of coordinates of at most ``max_elements`` (K x block) numbers:
    besides the (K, D) means only such blocks are held (the weights are one column per distinct
    column of ``weights``). Every coordinate's sums are
    those of all coordinates at once (the same operations, clients in the same order). With
    ``overwrite_shift`` (a float64 (K, D) ``shift`` the caller no longer needs) the means are
    written over ``shift``, block by block once its block is spent: one (K, D) array fewer.
    """
    J, D = len(layers), layers[0].shape[1]
    K = int(max(int(a.max()) for a in assignments)) + 1
    sizes = np.array([len(a) for a in assignments])
    weight = atom_weights(assignments, K, weights)
    counts = np.bincount(np.concatenate(assignments), minlength=K).astype(np.int64)  # a is injective
    n_seen = (weights > 0).T @ sizes.astype(np.float64)
    plain = (weights == 1).all(axis=1)  # clients whose weights are all 1 need no product
    writable = shift is not None and shift.dtype == np.float64 and shift.shape == (K, D) and shift.flags.writeable
    mean = shift if overwrite_shift and writable and shift is not None else np.empty((K, D))
    scatter = np.empty(D)
    step = max(1, max_elements // max(K, 1))
    for start in range(0, D, step):
        cols = slice(start, min(start + step, D))
        W = weight[:, cols]
        seen = W > 0
        if shift is None:
            total = np.zeros(W.shape)
            for v, a, w, one in zip(layers, assignments, weights, plain):
                # a is injective within a client, so fancy-index += is a correct scatter-add.
                total[a] += v[:, cols] if one else v[:, cols] * w[cols]
            r = np.divide(total, W, out=np.zeros_like(total), where=seen)
        else:
            r = shift[:, cols]
        dev, dev_sq = np.zeros(W.shape), np.zeros(W.shape)
        for v, a, w, one in zip(layers, assignments, weights, plain):
            d = v[:, cols] - r[a]
            wd = d if one else w[cols] * d
            dev[a] += wd
            dev_sq[a] += wd * d
        mean_dev = np.divide(dev, W, out=np.zeros_like(dev), where=seen)
        np.maximum(dev_sq - dev * mean_dev, 0.0, out=dev_sq).sum(axis=0, out=scatter[cols])
        block = np.add(r, mean_dev, out=mean[:, cols])
        block[~seen] = 0.0  # mean = where(seen, r + mean_dev, 0)
    return AtomStatistics(weight=weight, mean=mean, scatter=scatter, counts=counts, n_seen=n_seen, n_clients=J)


def em_step(
    layers: Sequence[np.ndarray],
    assignments: Sequence[np.ndarray],
    blocks: np.ndarray,
    weights: np.ndarray,
    hyper: BlockHyper,
    *,
    fit: Sequence[str] = ("noise_var", "prior_var", "gamma0"),
) -> BlockHyper:
    """One EM step on the block hyper-parameters given the assignments (module docstring).

    ``fit`` names those to update (the others stay as given); the prior mean is refitted with
    the prior variance. Several steps on the same assignments: :func:`atom_statistics` once,
    then :func:`em_update` each step.
    """
    return em_update(atom_statistics(layers, assignments, weights), blocks, hyper, fit=fit)


def atom_posterior(
    stats: AtomStatistics,
    blocks: np.ndarray,
    hyper: BlockHyper,
    *,
    overwrite: bool = False,
    max_elements: int = 1 << 20,
) -> tuple[np.ndarray, GroupedColumns]:
    """Natural parameters ``(h, lambda)``, each (K, D), of the atoms' Gaussian posteriors under
    ``hyper`` (the E-step of :func:`em_update`; PFNM supplement eq. 2 with ``p_jd = w_jd / s_b``):
    ``lambda_id = 1/s_0b + W_id / s_b`` and ``h_id = mu_0b / s_0b + W_id c_id / s_b``.

    ``lambda`` is constant on the coordinates that share a block and a column of the weights, and
    comes back as a :class:`~bayesfuse.inference.lazy.GroupedColumns` over them. ``overwrite``:
    ``h`` is written over ``stats.mean`` (the statistics are spent), so no (K, D) array is made;
    the values are the same. ``h`` is computed over blocks of at most ``max_elements`` numbers.
    """
    s, s0, mu0 = hyper.noise_var[blocks], hyper.prior_var[blocks], hyper.prior_mean[blocks]
    W = stats.weight
    h = stats.mean if overwrite else stats.mean.copy()
    K, D = h.shape
    step = max(1, max_elements // max(K, 1))
    for start in range(0, D, step):
        cols = slice(start, min(start + step, D))
        block = h[:, cols]
        np.multiply(W[:, cols], block, out=block)
        block /= s[cols]
        block += mu0[cols] / s0[cols]  # (W c / s) + mu0 / s0
    # one column of lambda per (column of W, block) pair that occurs
    _, first, pair = np.unique(W.index * (int(blocks.max()) + 1) + blocks, return_index=True, return_inverse=True)
    lam = W.values[:, W.index[first]] / s[first]
    lam += 1.0 / s0[first]
    return h, GroupedColumns(lam, pair.reshape(-1))


def em_update(
    stats: AtomStatistics,
    blocks: np.ndarray,
    hyper: BlockHyper,
    *,
    fit: Sequence[str] = ("noise_var", "prior_var", "gamma0"),
) -> BlockHyper:
    """:func:`em_step` from the assignments' :class:`AtomStatistics` (no pass over the neurons).

    E-step: :func:`atom_posterior` (``W = stats.weight``, ``c = stats.mean``); posterior mean
    ``theta^ = h / lambda`` and variance ``V = 1 / lambda``. The noise numerator of the module
    docstring is, per atom and coordinate,

    .. math::

        \\sum_{(j,l) \\to i} w_{jd} [(v_{jld} - \\hat\\theta_{id})^2 + V_{id}]
            = Q_{id} + W_{id} [(c_{id} - \\hat\\theta_{id})^2 + V_{id}]

    (``sum_i Q_id = stats.scatter``; the cross term vanishes as ``c`` is the weighted mean).
    """
    B = _n_blocks(blocks)
    K = stats.weight.shape[0]
    h, lam = atom_posterior(stats, blocks, hyper)
    mean, var = h / lam, 1.0 / lam
    out = BlockHyper(hyper.prior_var.copy(), hyper.noise_var.copy(), hyper.prior_mean.copy(), hyper.gamma0)
    if "noise_var" in fit:
        assert stats.scatter is not None  # statistics not yet spent
        num = stats.scatter + (stats.weight * ((stats.mean - mean) ** 2 + var)).sum(0)
        nb, db = np.zeros(B), np.zeros(B)
        np.add.at(nb, blocks, num)
        np.add.at(db, blocks, stats.n_seen)
        out.noise_var = np.maximum(nb / np.maximum(db, 1), VARIANCE_FLOOR)
    if "prior_var" in fit:
        for b in range(B):
            cols = blocks == b
            out.prior_mean[b] = mean[:, cols].mean()
            out.prior_var[b] = max(
                float(np.sum((mean[:, cols] - out.prior_mean[b]) ** 2 + var[:, cols])) / (K * cols.sum()),
                VARIANCE_FLOOR,
            )
    if "gamma0" in fit:
        out.gamma0 = float(K / np.sum(1.0 / np.arange(1, stats.n_clients + 1)))
    return out


@dataclass
class _BlockSummary:
    """What the collapsed marginal of one block needs (:func:`maximise_hyper`): ``n_within =
    sum_{i,d} (n_id - 1)`` over observed atom coordinates (``n_id`` neurons observe atom i's
    coordinate d), ``scatter = sum Q_id``; and, grouped by the distinct values ``W_u`` of
    ``W_id > 0``, the count ``n_u`` and the sums ``s1_u = sum c_id``, ``s2_u = sum c_id^2``."""

    n_within: float
    scatter: float
    weight: np.ndarray
    count: np.ndarray
    s1: np.ndarray
    s2: np.ndarray


def _summarise(stats: AtomStatistics, cols: np.ndarray) -> _BlockSummary:
    assert stats.scatter is not None  # statistics not yet spent
    index: np.ndarray | slice = cols
    if len(cols) and cols[-1] - cols[0] + 1 == len(cols):  # consecutive coordinates: views, not (K, |b|) copies
        index = slice(int(cols[0]), int(cols[-1]) + 1)
    scatter = float(stats.scatter[index].sum())
    c = stats.mean[:, index]
    patterns = stats.weight.columns(index)
    if len(patterns) == 1:  # one weight per atom in this block (every client sees all of it)
        w = stats.weight.values[:, patterns[0]]
        rows = w > 0
        n_within = float(stats.n_seen[index].sum() - int(rows.sum()) * c.shape[1])
        values, inverse = np.unique(w[rows], return_inverse=True)
        n_u = np.bincount(inverse, minlength=len(values)) * float(c.shape[1])
        s1 = np.bincount(inverse, c.sum(axis=1)[rows], minlength=len(values))
        s2 = np.bincount(inverse, np.einsum("kd,kd->k", c, c)[rows], minlength=len(values))
    else:
        W = stats.weight[:, index]
        seen = W > 0
        n_within = float(stats.n_seen[index].sum() - seen.sum())
        values, inverse = np.unique(W[seen], return_inverse=True)
        n_u = np.bincount(inverse, minlength=len(values)).astype(np.float64)
        s1 = np.bincount(inverse, c[seen], minlength=len(values))
        s2 = np.bincount(inverse, c[seen] ** 2, minlength=len(values))
    return _BlockSummary(n_within, scatter, values, n_u, s1, s2)


def _block_marginal(
    x: np.ndarray, free: np.ndarray, fixed: np.ndarray, summary: _BlockSummary, mean: float | None
) -> tuple[float, np.ndarray, float]:
    """Minus the block's collapsed log marginal (constants dropped) at ``log (s, s0)`` (the entries
    of ``free`` from ``x``, the others from ``fixed``), its gradient in ``x``, and the prior mean
    used (``mean``, or the maximiser when None):

    .. math::

        f = -\\tfrac12 N_w \\log s - \\frac{Q}{2s}
            - \\sum_u \\Big[\\tfrac12 n_u \\log t_u + \\frac{s2_u - 2\\mu_0 s1_u + n_u \\mu_0^2}{2 t_u}\\Big],
        \\qquad t_u = s_0 + s / W_u.
    """
    logs = fixed.copy()
    logs[free] = x
    s, s0 = np.exp(logs)
    t = s0 + s / summary.weight
    if mean is None:
        mean = float(np.sum(summary.s1 / t) / np.sum(summary.count / t))
    e = summary.s2 - 2 * mean * summary.s1 + summary.count * mean * mean
    value = (
        -0.5 * summary.n_within * logs[0]
        - 0.5 * summary.scatter / s
        - 0.5 * np.sum(summary.count * np.log(t))
        - 0.5 * np.sum(e / t)
    )
    dt = -0.5 * summary.count / t + 0.5 * e / t**2  # d value / d t_u
    grad = np.array(
        [
            s * (-0.5 * summary.n_within / s + 0.5 * summary.scatter / s**2 + np.sum(dt / summary.weight)),
            s0 * np.sum(dt),
        ]
    )
    return -value, -grad[free], mean


def maximise_hyper(
    stats: AtomStatistics,
    blocks: np.ndarray,
    hyper: BlockHyper,
    *,
    fit: Sequence[str] = ("noise_var", "prior_var", "gamma0"),
) -> BlockHyper:
    """The hyper-parameters maximising ``log p(V, B | s_0, s, mu_0, gamma_0)`` given the
    assignments: the point EM steps (:func:`em_update`) climb towards, reached directly.

    The collapsed marginal splits over blocks and, within a block, over atom coordinates
    ``(i, d)``. With ``n_id`` neurons observing coordinate d of atom i (total weight ``W_id``,
    weighted mean ``c_id`` and scatter ``Q_id``: :class:`AtomStatistics`), integrating the atom
    out of ``prod_k N(v_k | theta, s / w_k) N(theta | mu_0, s_0)`` gives

    .. math::

        -\\tfrac12 (n_{id} - 1) \\log s - \\frac{Q_{id}}{2 s}
        + \\log N\\big(c_{id} \\mid \\mu_0, s_0 + s / W_{id}\\big) + \\text{const},

    so a block needs only ``sum (n_id - 1)``, ``sum Q_id`` and, per distinct ``W``, the count,
    sum and sum of squares of the ``c_id``. The prior mean has the closed form
    ``mu_0 = sum_u (s1_u / t_u) / sum_u (n_u / t_u)``; ``log s`` and ``log s_0`` are found by
    L-BFGS-B (between ``VARIANCE_FLOOR`` and 1e6 times the block's mean square) from the
    current values and from the moments, keeping the better end (the marginal has a second,
    degenerate maximum at ``s_0 -> 0``), and ``gamma_0 =
    K / H_J`` (the IBP term ``K log gamma_0 - gamma_0 H_J``).

    A block with no atom holding two observations of a coordinate (``N_w = 0``) identifies only
    ``s_0 + s`` (module docstring: the trap of a small noise): its noise variance is then kept
    and only the prior is fitted.
    """
    out = BlockHyper(hyper.prior_var.copy(), hyper.noise_var.copy(), hyper.prior_mean.copy(), hyper.gamma0)
    floor = np.log(VARIANCE_FLOOR)
    # two-variable searches: several BLAS threads only wait on each other (10x slower on a loaded machine)
    with blas_threads(1):
        for b in range(_n_blocks(blocks)):
            summary = _summarise(stats, np.flatnonzero(blocks == b))
            if not len(summary.weight):
                continue
            free = np.array(["noise_var" in fit and summary.n_within > 0, "prior_var" in fit])
            mean = None if free[1] else float(hyper.prior_mean[b])
            fixed = np.log([hyper.noise_var[b], hyper.prior_var[b]])
            if free.any():
                # Above: 1e6 times the block's mean square (any variance there explains the data no
                # better than a smaller one, and the bound keeps the line search's trial steps finite).
                n = summary.count.sum()
                spread = (summary.s2.sum() + summary.scatter) / n
                ceiling = max(np.log(max(spread, VARIANCE_FLOOR) * 1e6), fixed[free].max())
                # The marginal is not concave in (log s, log s0): s0 -> 0 with all spread taken as
                # noise is a local maximum whose basin holds a variance at the floor. So the search
                # also starts from the moments (s: the pooled within-atom scatter, s0: the spread of
                # the atom means beyond their noise), and the higher end point is kept.
                s_moment = summary.scatter / summary.n_within if summary.n_within > 0 else np.exp(fixed[0])
                c_var = summary.s2.sum() / n - (summary.s1.sum() / n) ** 2
                moments = np.log(
                    np.maximum(
                        [s_moment, c_var - s_moment * np.sum(summary.count / summary.weight) / n], VARIANCE_FLOOR
                    )
                )
                ends = [
                    minimize(
                        lambda x: _block_marginal(x, free, fixed, summary, mean)[:2],  # noqa: B023 (run here)
                        np.clip(x0, floor, ceiling),
                        jac=True,
                        method="L-BFGS-B",
                        bounds=[(floor, ceiling)] * int(free.sum()),
                        options=dict(ftol=1e-15, gtol=1e-9, maxiter=500),
                    )
                    for x0 in (fixed[free], moments[free])
                ]
                fixed[free] = min(ends, key=lambda res: res.fun).x
            if free[0]:
                out.noise_var[b] = np.exp(fixed[0])
            if free[1]:
                out.prior_var[b] = np.exp(fixed[1])
                out.prior_mean[b] = _block_marginal(fixed[free], free, fixed, summary, None)[2]
    if "gamma0" in fit:
        out.gamma0 = float(stats.weight.shape[0] / np.sum(1.0 / np.arange(1, stats.n_clients + 1)))
    return out


def match_empirical_bayes(
    layers,
    auto,
    *,
    noise_var,
    prior_var,
    gamma0,
    prior_mean,
    blocks,
    relative_precision,
    local_vars,
    rounds,
    match,
    verbose,
    start,
) -> MatchResult:
    """:func:`match_neurons` with the ``auto`` hyper-parameters chosen by empirical Bayes.

    Coordinate ascent on ``F(B, theta) = log p(V, B | theta)``: each round is one sweep over
    the clients (the marginal cost: every client's Hungarian step raises F given theta), then
    the hyper-parameters that maximise F given the assignments
    (:func:`maximise_hyper`). F never decreases; the
    rounds stop when a sweep moves no neuron, where the assignments are a fixed point of the
    sweeps under the hyper-parameters they were matched with, and those hyper-parameters the
    maximiser for these assignments; or, with ``tol``, when a round's sweep raised F by less
    than ``tol`` nats per neuron (the result is then that sweep's, under the hyper-parameters
    it was matched with). If ``rounds`` run out first, a last matching (up to
    ``n_iter`` sweeps) with the final values makes result and hyper-parameters agree.
    """
    if local_vars is not None:
        raise ValueError("'auto' hyper-parameters need local_vars=None (give numbers with local posterior variances)")
    layers = check_layers(layers)
    backend = backend_of(layers)
    # the statistics run on the host (NumPy neurons as they are: float32 ones widen where used)
    host_layers = [backend.host(v) for v in layers] if backend.is_torch else layers
    J, D = len(layers), layers[0].shape[1]
    blocks = np.zeros(D, dtype=np.int64) if blocks is None else to_host(blocks, None)
    if (
        blocks.shape != (D,)
        or not np.issubdtype(blocks.dtype, np.integer)
        or blocks.min() < 0
        or set(np.unique(blocks)) != set(range(int(blocks.max()) + 1))
    ):
        raise ValueError(f"blocks must be ({D},) integers numbering blocks 0..B-1, each used")
    weights = np.ones((J, D)) if relative_precision is None else relative_weights(relative_precision, J, D)
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
    squares, cache = neuron_squares(host_layers), NeuronCache(J)
    sweeps, least_gain = 0, least_gain_for(match["tol"], host_layers, match["cost"])
    settled = stopped = False
    bar = tqdm(range(int(rounds)), desc="empirical Bayes", unit="round", disable=not verbose)
    with warnings.catch_warnings():  # one sweep per round never "converges": the rounds' end is what counts
        warnings.simplefilter("ignore", ConvergenceWarning)
        for r in bar:
            noise, prior0, mean0 = hyper.expand(blocks, weights)
            result = match_fixed(
                layers,
                noise_var=noise,
                prior_var=prior0,
                prior_mean=mean0,
                gamma0=hyper.gamma0,
                init=assignments,
                init_atoms=init_atoms,
                squares=squares,
                cache=cache,
                **dict(match, n_iter=1),
            )
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
            stats = atom_statistics(host_layers, assignments, weights, shift=shift, overwrite_shift=True)
            del shift
            hyper = maximise_hyper(stats, blocks, hyper, fit=auto)
            # the next sweep's start, written over the spent statistics; a list: match_fixed takes the
            # (K, D) arrays out of it, and they go once its atoms hold them
            stats.scatter = None
            init_atoms = [*atom_posterior(stats, blocks, hyper, overwrite=True), stats.counts]
            del stats
        objective = [t["objective"] for t in trace]
        if not (settled or stopped):
            noise, prior0, mean0 = hyper.expand(blocks, weights)
            result = match_fixed(
                layers,
                noise_var=noise,
                prior_var=prior0,
                prior_mean=mean0,
                gamma0=hyper.gamma0,
                init=assignments,
                init_atoms=init_atoms,
                squares=squares,
                cache=cache,
                baseline=objective[-1],
                **match,
            )
            sweeps += result.n_sweeps
            objective += result.objective
            stopped = result.hyper["stopped"]
    assert result is not None  # the last round's matching, or the one after the rounds
    result.n_sweeps, result.objective, result.converged = sweeps, objective, result.converged or stopped
    result.hyper = dict(
        result.hyper,
        **hyper.as_dict(),
        auto=list(auto),
        blocks=blocks.tolist(),
        rounds=len(trace),
        trace=trace,
        stopped=stopped,
    )
    result.seconds = time.perf_counter() - start
    warn_not_converged({"matching": result}, "matching", stacklevel=4)
    return result
