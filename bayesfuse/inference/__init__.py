"""Fusion algorithms over arrays: BBP-MAP matching (PFNM, NAFI) and KL-fusion of mean-field posteriors."""

from bayesfuse.inference import expfam
from bayesfuse.inference.klfusion import KLFusionResult, kl_fuse, solve_relaxed
from bayesfuse.inference.matching import MatchResult, assignment_cost, log_marginal_posterior, match_neurons

__all__ = [
    "KLFusionResult",
    "MatchResult",
    "assignment_cost",
    "expfam",
    "kl_fuse",
    "log_marginal_posterior",
    "match_neurons",
    "solve_relaxed",
]
