"""Pyro generative models: the Beta-Bernoulli process over neurons (:mod:`.bbp`), horseshoe BNNs
(:mod:`.bnn`, their ELBO estimator :mod:`.bnn_elbo` and the fused network with the clients' heads
:mod:`.bnn_heads`) and mixture models (:mod:`.mixture`).

The BNN posteriors' fusion works on arrays and lives in :mod:`bayesfuse.inference.bnn`; the
former paths ``bayesfuse.models.bnn_sites``, ``bnn_posterior``, ``bnn_units`` and ``bnn_fusion``
re-export it. Only the BBP model's names are exported here.
"""

from __future__ import annotations

from bayesfuse._lazy import lazy_exports

#: Public name -> the module that defines it; imported on first use (PEP 562).
_EXPORTS = {
    "Federation": "bayesfuse.models.bbp",
    "log_joint": "bayesfuse.models.bbp",
    "simulate_federation": "bayesfuse.models.bbp",
}

__all__ = [
    "Federation",
    "log_joint",
    "simulate_federation",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
