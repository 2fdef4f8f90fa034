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

1. ``B`` <- Hungarian sweeps with the exact marginal cost (``cost="marginal"``: each sweep
   raises the objective);
2. given ``B``, EM steps on the hyper-parameters (:func:`em_step`, closed form);
3. repeat until the number of atoms and the variances stop moving.

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

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["BlockHyper", "initial_hyper", "em_step", "noise_matrix"]

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
        return {"prior_var": self.prior_var.tolist(), "noise_var": self.noise_var.tolist(),
                "prior_mean": self.prior_mean.tolist(), "gamma0": float(self.gamma0)}


def noise_matrix(noise_var: np.ndarray, blocks: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(J, D) noise variances ``s_b(d) / w_jd``; infinite (precision 0) where ``w_jd = 0``."""
    s = np.asarray(noise_var, dtype=np.float64)[blocks][None, :]
    seen = weights > 0
    return np.where(seen, s / np.where(seen, weights, 1.0), np.inf)


def _n_blocks(blocks: np.ndarray) -> int:
    return int(blocks.max()) + 1


def initial_hyper(layers: Sequence[np.ndarray], blocks: np.ndarray, weights: np.ndarray,
                  prior_mean: np.ndarray, *, noise_fraction: float = 0.5, gamma0: float = 1.0) -> BlockHyper:
    """Start values from the neurons alone: ``s_0b`` = precision-weighted variance of block b's
    coordinates around the prior mean, ``s_b = noise_fraction * s_0b``."""
    B = _n_blocks(blocks)
    num, den = np.zeros(B), np.zeros(B)
    for v, w in zip(layers, weights):
        np.add.at(num, blocks, (w * (v - prior_mean) ** 2).sum(0))
        np.add.at(den, blocks, (w > 0) * len(v))
    s0 = np.maximum(num / np.maximum(den, 1), VARIANCE_FLOOR)
    mu0 = np.array([prior_mean[blocks == b].mean() for b in range(B)])
    return BlockHyper(prior_var=s0, noise_var=noise_fraction * s0, prior_mean=mu0, gamma0=float(gamma0))


def em_step(layers: Sequence[np.ndarray], assignments: Sequence[np.ndarray], blocks: np.ndarray,
            weights: np.ndarray, hyper: BlockHyper, *, fit: Sequence[str] = ("noise_var", "prior_var", "gamma0"),
            ) -> BlockHyper:
    """One EM step on the block hyper-parameters given the assignments (module docstring).

    ``fit`` names those to update (the others stay as given); the prior mean is refitted with
    the prior variance.
    """
    J, D = len(layers), layers[0].shape[1]
    B = _n_blocks(blocks)
    K = int(max(int(a.max()) for a in assignments)) + 1
    noise, prior0, mu0 = hyper.expand(blocks, weights)
    with np.errstate(divide="ignore"):
        prec = 1.0 / noise  # (J, D), 0 where unobserved
    lam = np.tile(1.0 / prior0, (K, 1))
    h = np.tile(mu0 / prior0, (K, 1))
    counts = np.zeros(K, dtype=np.int64)
    for j, a in enumerate(assignments):
        h[a] += layers[j] * prec[j]
        lam[a] += prec[j]
        counts[a] += 1
    mean, var = h / lam, 1.0 / lam
    out = BlockHyper(hyper.prior_var.copy(), hyper.noise_var.copy(), hyper.prior_mean.copy(), hyper.gamma0)
    if "noise_var" in fit:
        num, den = np.zeros(D), np.zeros(D)
        for j, a in enumerate(assignments):
            w = weights[j]
            num += (w * ((layers[j] - mean[a]) ** 2 + var[a])).sum(0)
            den += (w > 0) * len(a)
        nb, db = np.zeros(B), np.zeros(B)
        np.add.at(nb, blocks, num)
        np.add.at(db, blocks, den)
        out.noise_var = np.maximum(nb / np.maximum(db, 1), VARIANCE_FLOOR)
    if "prior_var" in fit:
        for b in range(B):
            cols = blocks == b
            out.prior_mean[b] = mean[:, cols].mean()
            out.prior_var[b] = max(float(np.sum((mean[:, cols] - out.prior_mean[b]) ** 2 + var[:, cols]))
                                   / (K * cols.sum()), VARIANCE_FLOOR)
    if "gamma0" in fit:
        out.gamma0 = float(K / np.sum(1.0 / np.arange(1, J + 1)))
    return out
