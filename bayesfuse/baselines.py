"""Baselines every fusion method is compared with: one-shot FedAvg, ensembles, local models.

FedAvg here is the one-shot coordinate-wise average of McMahan et al. (2017): parameter by
parameter, ``theta = sum_j w_j theta_j`` with ``w_j`` proportional to client j's data size.
It ignores the permutation invariance of hidden units, which is what matching methods fix.
"""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from bayesfuse._validation import normalised_weights
from bayesfuse.metrics import evaluate
from bayesfuse.nets.predict import predict_proba

__all__ = ["fedavg", "fedavg_state_dicts", "Ensemble", "evaluate_locals"]

StateDict = Mapping[str, torch.Tensor]


def fedavg_state_dicts(
    state_dicts: Sequence[StateDict], weights: Sequence[float] | np.ndarray | None = None
) -> dict[str, torch.Tensor]:
    """Weighted coordinate-wise average of state_dicts with identical keys and shapes.

    Floating-point entries are averaged in float64 and cast back; integer entries (BatchNorm's
    ``num_batches_tracked``) are taken from the first model.

    Raises
    ------
    ValueError
        On an empty list, mismatched keys or shapes, or NaN/infinite parameters.
    """
    if len(state_dicts) == 0:
        raise ValueError("fedavg needs at least one model")
    w = normalised_weights(weights, len(state_dicts))
    keys = list(state_dicts[0].keys())
    for j, sd in enumerate(state_dicts):
        if list(sd.keys()) != keys:
            diff = set(sd.keys()) ^ set(keys)
            raise ValueError(f"model {j} has different parameters from model 0: {sorted(diff)}")
        for k in keys:
            if sd[k].shape != state_dicts[0][k].shape:
                raise ValueError(
                    f"model {j}: '{k}' has shape {tuple(sd[k].shape)}, model 0 has "
                    f"{tuple(state_dicts[0][k].shape)}; FedAvg needs identical architectures"
                )
            if sd[k].is_floating_point() and not torch.isfinite(sd[k]).all():
                raise ValueError(f"model {j}: '{k}' contains NaN or infinite values")
    out = {}
    for k in keys:
        ref = state_dicts[0][k]
        if not ref.is_floating_point():
            out[k] = ref.clone()
            continue
        stacked = torch.stack([sd[k].detach().to(torch.float64) for sd in state_dicts])
        avg = torch.tensordot(torch.as_tensor(w, dtype=torch.float64), stacked, dims=1)
        out[k] = avg.to(ref.dtype)
    return out


def fedavg(
    models: Sequence[nn.Module], weights: Sequence[float] | np.ndarray | None = None
) -> nn.Module:
    """One-shot FedAvg of modules: a copy of ``models[0]`` holding the weighted average.

    Parameters
    ----------
    models : sequence of nn.Module
        Same architecture.
    weights : sequence of float, optional
        Typically client data sizes; uniform when omitted.
    """
    if len(models) == 0:
        raise ValueError("fedavg needs at least one model")
    avg = fedavg_state_dicts([m.state_dict() for m in models], weights)
    fused = copy.deepcopy(models[0])
    fused.load_state_dict(avg)
    return fused


class Ensemble(nn.Module):
    """Uniform (or weighted) mixture of classifiers' predictive distributions.

    ``forward`` returns ``log sum_j w_j softmax(f_j(x))``: log-probabilities, so the ensemble
    can be used wherever a logit model is (softmax of it is the mixture probability).
    """

    def __init__(self, models: Sequence[nn.Module], weights: Sequence[float] | np.ndarray | None = None):
        super().__init__()
        if len(models) == 0:
            raise ValueError("an ensemble needs at least one model")
        self.members = nn.ModuleList(models)
        self.register_buffer("log_weights", torch.log(torch.as_tensor(normalised_weights(weights, len(models)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logp = torch.stack([torch.log_softmax(m(x).double(), dim=-1) for m in self.members])
        return torch.logsumexp(logp + self.log_weights[:, None, None], dim=0)


def evaluate_locals(models: Sequence[nn.Module], x: np.ndarray, y: np.ndarray) -> list[dict[str, float]]:
    """Metrics (see :func:`bayesfuse.metrics.evaluate`) of each local model on a global test set."""
    return [evaluate(predict_proba(m, x), y) for m in models]
