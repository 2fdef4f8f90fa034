"""Fusion algorithms over arrays: BBP-MAP matching (PFNM, NAFI; :mod:`.matching`), its layer-wise
driver (:mod:`.layerwise`) and FedMA (:mod:`.fedma`), KL-fusion of mean-field posteriors
(:mod:`.klfusion`, :mod:`.relaxed`, :mod:`.expfam`), OT fusion (:mod:`.otfusion`), fusion of
horseshoe BNN posteriors (:mod:`.bnn`) and of Laplace posteriors from client summaries
(:mod:`.summary_fusion`); permutation specs (:mod:`.spec`, :mod:`.spec_io`) describe the networks.
The names below are imported on first use."""

from __future__ import annotations

from bayesfuse._lazy import lazy_exports

#: Public name -> the module that defines it; imported on first use (PEP 562).
_EXPORTS = {
    "KLFusionResult": "bayesfuse.inference.klfusion",
    "MatchResult": "bayesfuse.inference.matching",
    "assignment_cost": "bayesfuse.inference.matching",
    "expfam": "bayesfuse.inference.expfam",
    "kl_fuse": "bayesfuse.inference.klfusion",
    "log_marginal_posterior": "bayesfuse.inference.matching",
    "match_neurons": "bayesfuse.inference.matching",
    "solve_relaxed": "bayesfuse.inference.relaxed",
}

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
