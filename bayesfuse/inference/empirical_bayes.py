"""Empirical Bayes for BBP-MAP matching, kept at its former path: the statistics and the loop
that uses them now live together in :mod:`bayesfuse.inference.matching.empirical_bayes`."""

from bayesfuse.inference.matching.empirical_bayes import (  # noqa: F401
    VARIANCE_FLOOR,
    AtomStatistics,
    BlockHyper,
    __all__,  # noqa: F401
    _block_marginal,
    _summarise,
    atom_posterior,
    atom_statistics,
    em_step,
    em_update,
    initial_hyper,
    match_empirical_bayes,
    maximise_hyper,
    noise_matrix,
)
