"""Pyro generative models (Beta-Bernoulli process over neurons; BNNs and mixtures to come)."""

from bayesfuse.models.bbp import Federation, log_joint, simulate_federation

__all__ = ["Federation", "log_joint", "simulate_federation"]
