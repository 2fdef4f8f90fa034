"""Moments pooled over clients: the batch-norm statistics of a fused network, from aggregates.

Client ``j`` reports, per channel ``c`` of a batch norm's input, the number of values ``n_j``
it saw, their mean ``m_jc`` and their mean square ``s_jc`` (:func:`bayesfuse.summaries.batchnorm_moments`).
The pooled data's moments follow exactly, without any example leaving a client:

.. math::

    \\mu_c = \\frac{\\sum_j n_j m_{jc}}{\\sum_j n_j}, \\qquad
    \\sigma_c^2 = \\frac{\\sum_j n_j s_{jc}}{\\sum_j n_j} - \\mu_c^2 ,

the population statistics a batch norm uses at test time (Ioffe & Szegedy 2015, section 3.1).
Re-estimating them after fusion undoes the shrinkage of averaged units, the variance collapse
of Jordan et al. (REPAIR, ICLR 2023): with the statistics of the fused network's own inputs,
every channel is normalised again before its learned scale and shift. Those REPAIR takes from
the members of each fused unit: a client's batch norm gives its channel, on the client's data,
mean ``beta`` and standard deviation ``|gamma|``, so the fused channel ``g`` takes the mean of its
members' (:func:`matched_mean`),

.. math::

    \\gamma_g = \\frac{1}{|M_g|} \\sum_{(j, l) \\in M_g} \\gamma_{jl}, \\qquad
    \\beta_g = \\frac{1}{|M_g|} \\sum_{(j, l) \\in M_g} \\beta_{jl},

``M_g`` the clients' units assigned to ``g``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["pool_moments", "matched_mean"]

Reply = Mapping[str, tuple[int, np.ndarray, np.ndarray]]


def pool_moments(
    replies: Sequence[Reply], names: Sequence[str] | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The pooled mean and (biased) variance per channel of every batch norm the clients report.

    Parameters
    ----------
    replies : sequence of dict
        One per client: ``{batch norm: (n, mean, mean_square)}``, as
        :func:`bayesfuse.summaries.batchnorm_moments` returns.
    names : sequence of str, optional
        How errors call the clients; ``"client j"`` by default.

    Returns
    -------
    dict
        ``{batch norm: (mean, variance)}``, float64 arrays of one value per channel.

    Raises
    ------
    ValueError
        One line naming the client: no replies, another set of batch norms, a count that is not
        positive, shapes that differ, values that are not finite, a mean square below the
        square of the mean.
    """
    if not replies:
        raise ValueError("no client sent batch-norm moments")
    names = list(names) if names is not None else [f"client {j}" for j in range(len(replies))]
    keys = sorted(replies[0])
    totals: dict[str, list] = {}
    for name, reply in zip(names, replies):
        if sorted(reply) != keys:
            raise ValueError(f"{name}: moments of batch norms {sorted(reply)}, the others sent {keys}")
        for key in keys:
            n, mean, square = reply[key]
            mean, square = np.asarray(mean, dtype=np.float64), np.asarray(square, dtype=np.float64)
            if not n > 0:
                raise ValueError(f"{name}: {key} has a count of {n}")
            if mean.ndim != 1 or mean.shape != square.shape:
                raise ValueError(f"{name}: {key}'s mean {mean.shape} and mean square {square.shape} differ in shape")
            if not (np.isfinite(mean).all() and np.isfinite(square).all()):
                raise ValueError(f"{name}: {key}'s moments are not finite (NaN or inf)")
            if (square < mean**2 - 1e-6 * np.maximum(1.0, square)).any():
                raise ValueError(f"{name}: {key}'s mean square is below its mean squared")
            acc = totals.setdefault(key, [0, np.zeros_like(mean), np.zeros_like(mean)])
            if acc[1].shape != mean.shape:
                raise ValueError(f"{name}: {key} has {mean.size} channels, the others {acc[1].size}")
            acc[0] += n
            acc[1] += n * mean
            acc[2] += n * square
    out = {}
    for key, (n, s1, s2) in totals.items():
        mean = s1 / n
        out[key] = (mean, np.maximum(s2 / n - mean**2, 0.0))
    return out


def matched_mean(
    values: Sequence[np.ndarray], assignments: Sequence[np.ndarray] | None, n_global: int, default: float
) -> np.ndarray:
    """The mean of each global unit's members' values (module docstring).

    Parameters
    ----------
    values : sequence of ndarray
        One per client: a value per unit of the client (e.g. its batch norm's ``weight``).
    assignments : sequence of ndarray, or None
        Per client, the global unit of each of its units; None: unit ``l`` of every client is
        global unit ``l`` (networks averaged without alignment, every client ``n_global`` wide).
    n_global : int
        The number of global units.
    default : float
        The value of a global unit no client's unit is assigned to.

    Returns
    -------
    ndarray (n_global,)
    """
    if assignments is None:
        assignments = [np.arange(len(v)) for v in values]
    total, count = np.zeros(n_global), np.zeros(n_global)
    for j, (v, a) in enumerate(zip(values, assignments)):
        v, a = np.asarray(v, dtype=np.float64), np.asarray(a)
        if v.shape != a.shape:
            raise ValueError(f"client {j} has {v.size} values for {a.size} assigned units")
        if a.size and (a.min() < 0 or a.max() >= n_global):
            raise ValueError(f"client {j}'s units are assigned outside the {n_global} global units")
        np.add.at(total, a, v)
        np.add.at(count, a, 1.0)
    return np.where(count > 0, total / np.maximum(count, 1.0), default)
