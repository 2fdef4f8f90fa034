"""Pyro generative models (Beta-Bernoulli process over neurons; BNNs and mixtures to come)."""

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
