"""Torch plumbing: network definitions (the reference ResNets and vision transformer among them),
neurons out of modules and fused modules back."""

from __future__ import annotations

from bayesfuse._lazy import lazy_exports

#: Public name -> the module that defines it; imported on first use (PEP 562).
_EXPORTS = {
    "MLP": "bayesfuse.nets.mlp",
    "predict_proba": "bayesfuse.nets.predict",
    "predictive_proba": "bayesfuse.nets.predict",
    "resnet18": "bayesfuse.nets.resnet",
    "resnet20": "bayesfuse.nets.resnet",
    "vit": "bayesfuse.nets.attention",
    "split_heads": "bayesfuse.nets.attention",
    "merge_heads": "bayesfuse.nets.attention",
    "HeadAttention": "bayesfuse.nets.attention",
}

__all__ = [
    "MLP",
    "predict_proba",
    "predictive_proba",
    "resnet18",
    "resnet20",
    "vit",
    "split_heads",
    "merge_heads",
    "HeadAttention",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
