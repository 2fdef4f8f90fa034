"""Fusion of horseshoe BNN posteriors, over arrays (no torch, no Pyro).

:mod:`.sites` (the guide's parameter space as a record of sites), :mod:`.posterior` (mean-field
posteriors as per-unit Gaussians, and back to state_dicts), :mod:`.units` (pruning and the
scale-free form of hidden units), :mod:`.fusion` (:func:`~.fusion.fuse_bnn_posteriors`, layer by
layer). The Pyro model and its training are :mod:`bayesfuse.models.bnn`; the former paths
``bayesfuse.models.bnn_sites``, ``bnn_posterior``, ``bnn_units`` and ``bnn_fusion`` re-export
these modules.
"""
