"""Hidden units of a horseshoe BNN posterior as what they compute: pruning and the scale-free form.

A unit of :class:`~bayesfuse.models.bnn.HorseshoeBNN` computes
``W_2[:, k] relu(s_k (w~_k^T x + b~_k))`` with the scale ``s_k = tau lambda_k``. The split of
``s_k w~_k`` between the scale and the weights is not identified: multiplying ``tau`` by ``c``
and ``lambda_k`` by ``d_k`` while dividing ``w~_k, b~_k`` by ``c d_k`` leaves every unit's
function unchanged, and two clients trained apart settle on different splits (their ``tau``
differs by 10x on digits). Comparing the raw ``w~`` across clients therefore compares
parameterisations, not units. This module

* **prunes switched-off units** (:func:`informative_units`): under the horseshoe, a unit the
  data did not need is shrunk, ``s_k -> 0``, and its incoming weights stay at their prior
  ``N(0, I)``. The information the data put into unit k, ``KL(q(w~_k, b~_k) || N(0, I))`` in
  nats, separates the two kinds sharply (150-unit Fashion-MNIST clients: up to 170 nats for the
  20-40 units that carry the network, below 1 for the rest). The rule reads a converged guide:
  a unit still near the guide's initialisation (standard deviation 0.01) is far from the prior
  and counts as informative, so clients with a few hundred examples (digits: about 500 steps
  in 200 epochs) keep all their units. It is free of the
  scale split (a rescaled ``w~`` is no longer prior-like, but then its scale is not shrunk
  either: the rule reads the guide a client trained, which puts shrunk units at the prior) and
  needs no data. Pruned units' outputs are ``relu`` of a pre-activation times ``s_k ~ 1e-3``.
* **writes units in the scale-free form** (:func:`effective_units`): each unit as the Gaussian
  of its effective incoming weights and bias at its median scale, ``m_k = E[log s_k]``,
  ``e^{m_k} (w~_k, b~_k)`` (means times ``e^{m_k}``, variances times ``e^{2 m_k}``), followed by
  its outgoing weights; and, apart, the Gaussian of ``log s_k = log tau + log lambda_k`` (mean
  ``m_k``, variance ``var(log tau) + var(log lambda_k)``, exact for the mean-field guide). The
  effective weights are invariant to the split; fusion compares and averages them.
* **writes fused units back** (:func:`split_effective`): a global unit g with effective weights
  ``v_g`` and log-scale ``N(m_g, r_g)`` gets ``w~_g = e^{-m_g} v_g`` and
  ``log lambda_g ~ N(m_g - E[log tau], r_g - var(log tau))``, so that ``log tau + log lambda_g``
  has the fused mean and variance again (``var(log tau)`` becomes half the smallest ``r_g`` if
  it is not below all of them). One client fused alone comes back exactly
  (tests/models/test_bnn_units.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bayesfuse.constraints import KEYS, validate_params
from bayesfuse.inference.bnn.posterior import BNNPosterior, HiddenLayer
from bayesfuse.inference.expfam import DiagNormal

__all__ = [
    "EffectiveUnits",
    "unit_information",
    "informative_units",
    "effective_units",
    "incoming_information",
    "keep_informative",
    "effective_layer",
    "split_effective",
    "DEFAULT_PRUNE_KL",
    "DEFAULT_PRUNE_SHARE",
    "unit_contributions",
    "keep_contributing",
]

#: Default of ``prune_kl``: units whose incoming weights hold less than this many nats of
#: information (:func:`unit_information`) are dropped before fusion.
DEFAULT_PRUNE_KL = 1.0
#: Default of ``prune_share``: with the clients' unit moments, each client's least-contributing
#: units are dropped while together they carry at most this share of the layer's output
#: (:func:`keep_contributing`).
DEFAULT_PRUNE_SHARE = 1e-3


@dataclass(frozen=True)
class EffectiveUnits:
    """A posterior's hidden units in the scale-free form (module docstring).

    Attributes
    ----------
    weights : DiagNormal (H components of dimension D + 1 + K)
        Effective incoming weights ``e^{m_k} w~_k`` (D), bias ``e^{m_k} b~_k``, outgoing weights.
    log_scale : DiagNormal (H components of dimension 1)
        ``log s_k = log tau + log lambda_k``.
    """

    weights: DiagNormal
    log_scale: DiagNormal


def _incoming(post: BNNPosterior) -> slice:
    """Columns of ``post.units`` holding a unit's incoming weights and bias (``w1``, ``b1``)."""
    w1, b1 = post.columns("w1"), post.columns("b1")
    assert w1.stop == b1.start
    return slice(w1.start, b1.stop)


def incoming_information(incoming: DiagNormal) -> np.ndarray:
    """``KL(q || N(0, I))`` per row of ``incoming`` (a unit's ``w~`` and ``b~``), in nats.

    The prior of ``w~`` and ``b~`` is ``N(0, 1)`` per entry (:class:`~bayesfuse.models.bnn.HorseshoeBNN`,
    every hidden layer); the KL of a diagonal Gaussian to it is ``sum (var + loc^2 - 1 - log var) / 2``.
    """
    loc, var = incoming.loc, incoming.var
    return 0.5 * np.sum(var + loc**2 - 1.0 - np.log(var), axis=1)


@validate_params(min_kl=KEYS["prune_kl"])
def keep_informative(information: np.ndarray, min_kl: float = DEFAULT_PRUNE_KL) -> np.ndarray:
    """Boolean mask ``information >= min_kl``, keeping at least the most informative unit."""
    keep = information >= min_kl
    if not keep.any():
        keep[np.argmax(information)] = True
    return keep


def unit_contributions(act_mean: np.ndarray, act_var: np.ndarray, outgoing: DiagNormal) -> np.ndarray:
    """What each unit puts into the layer above, on a client's data: ``E_x[h_k^2] sum_i (loc_ik^2 + var_ik)``.

    ``h_k`` is unit k's activation (its mean and variance over the client's inputs,
    :meth:`~bayesfuse.models.bnn.HorseshoeBNN.unit_moments`), ``v_ik`` its weight into unit or
    class ``i`` of the layer above (rows of ``outgoing`` are the units: for a hidden layer below
    another, the columns of that layer's effective incoming weights ``tau lambda_i w~_ik``; for
    the top hidden layer, the output weights, as :func:`effective_layer` gives them: at the
    median scale of the unit above), with ``loc^2 + var`` the second moment of a weight under the
    guide. It is the mean square over the data and the weights of unit k's term ``v_ik h_k``
    summed over ``i``: what dropping the unit alone takes out of the next pre-activations,
    whether or not the guide has converged.
    """
    second = np.asarray(act_var, dtype=np.float64) + np.asarray(act_mean, dtype=np.float64) ** 2
    weight = np.sum(outgoing.loc**2 + outgoing.var, axis=1)
    if second.shape != weight.shape:
        raise ValueError(f"moments of {second.shape[0]} units for {weight.shape[0]} units' outgoing weights")
    return second * weight


@validate_params(share=KEYS["prune_share"])
def keep_contributing(contributions: np.ndarray, share: float = DEFAULT_PRUNE_SHARE) -> np.ndarray:
    """Boolean mask keeping all units but the least-contributing ones whose
    :func:`unit_contributions` sum to at most ``share`` of the layer's total.

    Units are dropped in increasing order of contribution while the running sum stays at or below
    ``share * sum(contributions)``. The threshold is on the sum of the units' mean squares: the
    terms of correlated units add up, so the next pre-activations can move by more (their root mean
    square by at most the sum of the dropped units' root-mean-square terms, the triangle
    inequality), and a dropped unit's mean ``v_ik E[h_k]`` goes with it.
    ``benchmarks/bench_bnn_pruning.py`` measures what the predictions move. ``share=0`` keeps
    every unit; at least one unit (the largest) is always kept.
    """
    c = np.asarray(contributions, dtype=np.float64)
    keep = np.ones(len(c), dtype=bool)
    if share == 0:
        return keep
    order = np.argsort(c, kind="stable")
    dropped = np.cumsum(c[order]) <= share * c.sum()
    keep[order[dropped]] = False
    if not keep.any():
        keep[np.argmax(c)] = True
    return keep


def unit_information(post: BNNPosterior) -> np.ndarray:
    """``KL(q(w~_k, b~_k) || N(0, I))`` per hidden unit, in nats: what the data taught the unit
    (:func:`incoming_information` of the units' incoming weights and bias)."""
    cols = _incoming(post)
    return incoming_information(DiagNormal(loc=post.units.loc[:, cols], var=post.units.var[:, cols]))


def informative_units(post: BNNPosterior, min_kl: float = DEFAULT_PRUNE_KL) -> np.ndarray:
    """Boolean mask of the units that carry information: :func:`unit_information` ``>= min_kl``.

    At least one unit is kept (the most informative), so a network never loses all of them.
    ``min_kl=0`` keeps every unit.
    """
    return keep_informative(unit_information(post), min_kl)


def effective_layer(layer: HiddenLayer) -> tuple[DiagNormal, DiagNormal]:
    """A hidden layer's units in the scale-free form (module docstring), any layer of any depth.

    Returns the effective incoming weights and bias ``e^{m_k} (w~_k, b~_k)`` (means times
    ``e^{m_k}``, variances times ``e^{2 m_k}``) and the Gaussian of ``log s_k = log tau + log lambda_k``
    (mean ``m_k``, variance ``var(log tau) + var(log lambda_k)``).
    """
    m = layer.log_lam.loc + layer.log_tau.loc[0]  # (H, 1)
    r = layer.log_lam.var + layer.log_tau.var[0]
    weights = DiagNormal(loc=layer.incoming.loc * np.exp(m), var=layer.incoming.var * np.exp(2 * m))
    return weights, DiagNormal(loc=m, var=r)


def split_effective(incoming: DiagNormal, log_scale: DiagNormal, log_tau: DiagNormal) -> HiddenLayer:
    """The hidden layer whose scale-free form is ``(incoming, log_scale)``, split against ``log_tau``.

    ``w~_g = e^{-m_g} v_g`` and ``log lambda_g ~ N(m_g - E[log tau], r_g - var(log tau))``, so
    ``log tau + log lambda_g`` has mean ``m_g`` and variance ``r_g`` again; if ``var(log tau)`` is
    not below every ``r_g`` it is set to half the smallest, so that every ``log lambda_g`` keeps
    a positive variance.
    """
    G = len(incoming)
    if log_scale.loc.shape != (G, 1) or log_tau.loc.shape != (1, 1):
        raise ValueError(
            f"need log_scale (G, 1) and log_tau (1, 1) for G={G} units, "
            f"got {log_scale.loc.shape} and {log_tau.loc.shape}"
        )
    m, r = log_scale.loc, log_scale.var
    tau_var = float(log_tau.var[0, 0])
    if not tau_var < float(r.min()):
        tau_var = 0.5 * float(r.min())
    tau = DiagNormal(loc=log_tau.loc.copy(), var=np.array([[tau_var]]))
    return HiddenLayer(
        incoming=DiagNormal(loc=incoming.loc * np.exp(-m), var=incoming.var * np.exp(-2 * m)),
        log_lam=DiagNormal(loc=m - tau.loc[0], var=r - tau_var),
        log_tau=tau,
    )


def _layer(post: BNNPosterior) -> HiddenLayer:
    """The hidden layer of a one-hidden-layer posterior."""
    cols, lam = _incoming(post), post.columns("log_lam")
    return HiddenLayer(
        incoming=DiagNormal(loc=post.units.loc[:, cols], var=post.units.var[:, cols]),
        log_lam=DiagNormal(loc=post.units.loc[:, lam], var=post.units.var[:, lam]),
        log_tau=post.log_tau,
    )


def effective_units(post: BNNPosterior) -> EffectiveUnits:
    """The units of ``post`` in the scale-free form (module docstring; :func:`effective_layer`),
    followed by their outgoing weights."""
    weights, log_scale = effective_layer(_layer(post))
    out = post.columns("w2")
    loc = np.hstack([weights.loc, post.units.loc[:, out]])
    var = np.hstack([weights.var, post.units.var[:, out]])
    return EffectiveUnits(weights=DiagNormal(loc=loc, var=var), log_scale=log_scale)
