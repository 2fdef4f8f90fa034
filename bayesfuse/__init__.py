"""bayesfuse: Bayesian model fusion of separately trained models, in one shot, with uncertainty."""

__version__ = "0.1.0.dev0"

from bayesfuse.baselines import Ensemble, fedavg, fedavg_state_dicts
from bayesfuse.fusion import FusionResult, fuse
from bayesfuse.inference.matching import MatchResult, match_neurons
from bayesfuse.nets.mlp import MLP
from bayesfuse.train import TrainConfig, train_clients, train_mlp

__all__ = [
    "__version__",
    "Ensemble",
    "FusionResult",
    "MLP",
    "MatchResult",
    "TrainConfig",
    "fedavg",
    "fedavg_state_dicts",
    "fuse",
    "match_neurons",
    "train_clients",
    "train_mlp",
]
