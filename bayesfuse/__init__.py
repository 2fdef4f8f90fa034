"""bayesfuse: Bayesian model fusion of separately trained models, in one shot, with uncertainty."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    "save": "bayesfuse.saving",
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
    "save",
    "summarize",
    "train_clients",
    "train_mlp",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

if TYPE_CHECKING:  # what type checkers see of the names above (py.typed): the real definitions
    from bayesfuse.baselines import Ensemble as Ensemble
    from bayesfuse.baselines import fedavg as fedavg
    from bayesfuse.baselines import fedavg_state_dicts as fedavg_state_dicts
    from bayesfuse.core import fuse_states as fuse_states
    from bayesfuse.fusion import FusionResult as FusionResult
    from bayesfuse.fusion import fuse as fuse
    from bayesfuse.inference.matching import MatchResult as MatchResult
    from bayesfuse.inference.matching import match_neurons as match_neurons
    from bayesfuse.loading import load as load
    from bayesfuse.nets.mlp import MLP as MLP
    from bayesfuse.saving import save as save
    from bayesfuse.summaries import ClientSummary as ClientSummary
    from bayesfuse.summaries import summarize as summarize
    from bayesfuse.train import TrainConfig as TrainConfig
    from bayesfuse.train import train_clients as train_clients
    from bayesfuse.train import train_mlp as train_mlp
