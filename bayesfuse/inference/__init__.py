"""Fusion algorithms over arrays: BBP-MAP matching (PFNM, NAFI), layer-wise matching, KL-fusion."""

from bayesfuse.inference.matching import MatchResult, assignment_cost, log_marginal_posterior, match_neurons

__all__ = ["MatchResult", "assignment_cost", "log_marginal_posterior", "match_neurons"]
