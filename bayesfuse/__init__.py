"""bayesfuse: Bayesian model fusion of separately trained models, in one shot, with uncertainty."""

from __future__ import annotations

from bayesfuse._lazy import lazy_exports

__version__ = "0.1.0.dev0"

#: Public name -> the module that defines it; imported on first use (PEP 562), so that
#: ``import bayesfuse`` loads neither torch nor Pyro until a name that needs them is used.
_EXPORTS = {
    "ClientSummary": "bayesfuse.summaries",
    "Ensemble": "bayesfuse.baselines",
    "FusionResult": "bayesfuse.fusion",
    "MLP": "bayesfuse.nets.mlp",
    "MatchResult": "bayesfuse.inference.matching",
    "TrainConfig": "bayesfuse.train",
    "fedavg": "bayesfuse.baselines",
    "fedavg_state_dicts": "bayesfuse.baselines",
    "fuse": "bayesfuse.fusion",
    "fuse_states": "bayesfuse.core",
    "load": "bayesfuse.loading",
    "match_neurons": "bayesfuse.inference.matching",
    "summarize": "bayesfuse.summaries",
    "train_clients": "bayesfuse.train",
    "train_mlp": "bayesfuse.train",
}

__all__ = [
    "__version__",
    "ClientSummary",
    "Ensemble",
    "FusionResult",
    "MLP",
    "MatchResult",
    "TrainConfig",
    "fedavg",
    "fedavg_state_dicts",
    "fuse",
    "fuse_states",
    "load",
    "match_neurons",
    "summarize",
    "train_clients",
    "train_mlp",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
