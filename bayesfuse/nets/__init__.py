"""Torch plumbing: network definitions, neurons out of modules and fused modules back."""

from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.predict import predict_proba

__all__ = ["MLP", "predict_proba"]
