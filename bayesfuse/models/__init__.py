"""Pyro generative models (Beta-Bernoulli process over neurons, horseshoe BNNs, mixtures)."""
