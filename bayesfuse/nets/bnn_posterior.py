"""Mean-field posteriors of horseshoe BNNs as data: per-unit Gaussians, and back.

A hidden unit k of :class:`~bayesfuse.models.bnn.HorseshoeBNN` is described by the guide's
independent Gaussians over ``[w~_k (D), b~_k, log lambda_k, W_2[:, k] (K)]``: incoming weights
and bias in the non-centred space, the unit's log-scale (its log-normal factor is Gaussian in
log space) and its outgoing weights. These are the spaces the guide's parameters live in, so a
:class:`BNNPosterior` rebuilds exactly the same guide.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.models.bnn import HorseshoeBNN

__all__ = ["BNNPosterior"]


@dataclass(frozen=True)
class BNNPosterior:
    """The mean-field posterior of a one-hidden-layer horseshoe BNN.

    Attributes
    ----------
    units : DiagNormal (H components of dimension D + 2 + K)
        Per unit: incoming weights, bias, log-scale, outgoing weights.
    out_bias : DiagNormal (1 component of dimension K)
    log_tau : DiagNormal (1 component of dimension 1)
    in_features, n_classes : int
    global_scale, weight_scale : float
        The prior's settings, carried to rebuilt networks.
    """

    units: DiagNormal
    out_bias: DiagNormal
    log_tau: DiagNormal
    in_features: int
    n_classes: int
    global_scale: float
    weight_scale: float

    @property
    def hidden(self) -> int:
        return len(self.units)

    @classmethod
    def from_bnn(cls, bnn: HorseshoeBNN) -> BNNPosterior:
        """Read the guide of ``bnn`` (a :class:`HorseshoeBNN`, whose guide is mean-field)."""
        if not isinstance(bnn, HorseshoeBNN):
            raise TypeError(f"expected a HorseshoeBNN (mean-field guide), got {type(bnn).__name__}")
        with torch.no_grad():
            loc = {k: v.numpy().copy() for k, v in bnn.loc.items()}
            var = {k: np.exp(2 * v.numpy()) for k, v in bnn.log_scale.items()}
        for name, arr in list(loc.items()) + list(var.items()):
            if not np.isfinite(arr).all():
                raise ValueError(f"the BNN's guide parameter '{name}' contains NaN or infinite values")

        def stack(d):
            return np.hstack([d["w1"], d["b1"][:, None], d["log_lam"][:, None], d["w2"].T])

        return cls(
            units=DiagNormal(loc=stack(loc), var=stack(var)),
            out_bias=DiagNormal(loc=loc["b2"][None, :], var=var["b2"][None, :]),
            log_tau=DiagNormal(loc=loc["log_tau"][None, :], var=var["log_tau"][None, :]),
            in_features=bnn.in_features,
            n_classes=bnn.n_classes,
            global_scale=bnn.global_scale,
            weight_scale=bnn.weight_scale,
        )

    def to_bnn(self) -> HorseshoeBNN:
        """A :class:`HorseshoeBNN` with ``len(units)`` hidden units whose guide is this posterior."""
        D, K = self.in_features, self.n_classes
        bnn = HorseshoeBNN(D, self.hidden, K, global_scale=self.global_scale, weight_scale=self.weight_scale)

        def split(a):
            return {"w1": a[:, :D], "b1": a[:, D], "log_lam": a[:, D + 1], "w2": a[:, D + 2 :].T}

        locs = {**split(self.units.loc), "b2": self.out_bias.loc[0], "log_tau": self.log_tau.loc[0]}
        variances = {**split(self.units.var), "b2": self.out_bias.var[0], "log_tau": self.log_tau.var[0]}
        with torch.no_grad():
            for site in locs:
                bnn.loc[site].copy_(torch.from_numpy(np.ascontiguousarray(locs[site])))
                bnn.log_scale[site].copy_(torch.from_numpy(0.5 * np.log(np.ascontiguousarray(variances[site]))))
        return bnn
