"""Baselines every fusion method is compared with: one-shot FedAvg, ensembles (of networks, of BNNs), local models.

FedAvg here is the one-shot coordinate-wise average of McMahan et al. (2017): parameter by
parameter, ``theta = sum_j w_j theta_j`` with ``w_j`` proportional to client j's data size.
It ignores the permutation invariance of hidden units, which is what matching methods fix.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Mapping, Sequence, TypeGuard

import numpy as np
import torch
from torch import nn

from bayesfuse._validation import check_inputs, check_num_samples, normalised_weights
from bayesfuse.metrics import evaluate
from bayesfuse.nets.predict import predict_proba
from bayesfuse.nets.state import load_state

if TYPE_CHECKING:
    from bayesfuse.models.bnn import HorseshoeBNN

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


def fedavg(models: Sequence[nn.Module], weights: Sequence[float] | np.ndarray | None = None) -> nn.Module:
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
    return load_state(copy.deepcopy(models[0]), avg)


class Ensemble(nn.Module):
    """Uniform (or weighted) mixture of classifiers' predictive distributions.

    .. math::

        p(y \\mid x) = \\sum_j w_j\\, p_j(y \\mid x), \\qquad \\sum_j w_j = 1,

    where ``p_j`` is member j's predictive: ``softmax(f_j(x))`` for a network, and for a Bayesian
    network (:class:`~bayesfuse.models.bnn.HorseshoeBNN`, a fused
    :class:`~bayesfuse.models.bnn_heads.HeadMixtureBNN`) its Monte Carlo posterior predictive
    ``(1/S) sum_s softmax(f(x; theta_s))``, ``theta_s ~ q_j``: ``member.predict(x, num_samples,
    seed=seed)``, every member with the same ``num_samples`` and ``seed``. An ensemble of BNNs is
    then the equal-weight mixture of their posterior predictives, the baseline a fused BNN is
    compared with; networks and BNNs may be mixed (each contributes its predictive).

    ``forward`` returns ``log p(y | x)``: log-probabilities, so the ensemble can be used wherever a
    logit model is (softmax of it is the mixture probability; :func:`~bayesfuse.nets.predict_proba`
    works). :meth:`predict` gives the probabilities in float64 from float64 inputs.

    Parameters
    ----------
    models : sequence of nn.Module
    weights : sequence of float, optional
        ``w_j`` up to a constant; uniform when omitted.
    num_samples : int
        Monte Carlo draws of each Bayesian member's predictive.
    seed : int
        Seed of those draws (the same draws at every call, as ``member.predict(..., seed=seed)``).
    """

    log_weights: torch.Tensor

    def __init__(
        self,
        models: Sequence[nn.Module],
        weights: Sequence[float] | np.ndarray | None = None,
        *,
        num_samples: int = 100,
        seed: int = 0,
    ):
        super().__init__()
        if len(models) == 0:
            raise ValueError("an ensemble needs at least one model")
        if isinstance(num_samples, bool) or int(num_samples) != num_samples or num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        self.members = nn.ModuleList(models)
        self.num_samples, self.seed = int(num_samples), int(seed)
        self.register_buffer("log_weights", torch.log(torch.as_tensor(normalised_weights(weights, len(models)))))

    def _member_log_probs(self, model: nn.Module, x: torch.Tensor, num_samples: int, seed: int) -> torch.Tensor:
        """(n, K) float64 ``log p_j(y | x)`` of one member: a BNN's Monte Carlo predictive from ``x``
        in float64, a network's log-softmax of ``model(x)``."""
        if _is_bnn(model):
            probs = model.predict(x.detach().cpu().double().numpy(), num_samples, seed=seed)
            with np.errstate(divide="ignore"):  # a class no draw gives any probability: log 0 = -inf
                return torch.from_numpy(np.log(probs)).to(x.device)
        return torch.log_softmax(model(x).double(), dim=-1)

    def _log_probs(self, x: torch.Tensor, num_samples: int, seed: int, *, own_dtype: bool = False) -> torch.Tensor:
        """``log p(y | x)`` of the mixture; with ``own_dtype`` each network sees ``x`` in its parameters' dtype."""
        logp = torch.stack(
            [self._member_log_probs(m, _in_dtype_of(m, x) if own_dtype else x, num_samples, seed) for m in self.members]
        )
        return torch.logsumexp(logp + self.log_weights.to(logp.device)[:, None, None], dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._log_probs(x, self.num_samples, self.seed)

    @torch.no_grad()
    def predict(self, x, num_samples: int | None = None, *, seed: int | None = None) -> np.ndarray:
        """The mixture's probabilities (n, K) in float64: BNN members read ``x`` in float64
        (``forward``, through :func:`~bayesfuse.nets.predict_proba`, hands them the float32 rounding
        of the inputs), networks in their own dtype. ``num_samples`` and ``seed`` default to the
        ensemble's."""
        x = torch.as_tensor(np.asarray(x, dtype=np.float64)) if not isinstance(x, torch.Tensor) else x.double()
        check_inputs(x)
        if num_samples is not None:
            check_num_samples(num_samples)
        was_training = self.training
        self.eval()
        try:
            logp = self._log_probs(
                x,
                self.num_samples if num_samples is None else int(num_samples),
                self.seed if seed is None else int(seed),
                own_dtype=True,
            )
        finally:
            self.train(was_training)
        return torch.softmax(logp, dim=-1).cpu().numpy()


def _in_dtype_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype of ``model``'s first floating-point parameter (as it is for a model without one)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), x.dtype)
    return x if _is_bnn(model) else x.to(dtype)


def _is_bnn(model: nn.Module) -> TypeGuard[HorseshoeBNN]:
    """Whether ``model`` is a Bayesian network whose predictive is ``model.predict`` (it has no ``forward``)."""
    from bayesfuse.models.bnn import HorseshoeBNN

    return isinstance(model, HorseshoeBNN)


def evaluate_locals(
    models: Sequence[nn.Module], x: np.ndarray, y: np.ndarray, *, num_samples: int = 100, seed: int = 0
) -> list[dict[str, float]]:
    """Metrics (see :func:`bayesfuse.metrics.evaluate`) of each local model on a global test set;
    a BNN's from its Monte Carlo predictive (``num_samples`` draws, ``seed``)."""
    return [evaluate(m.predict(x, num_samples, seed=seed) if _is_bnn(m) else predict_proba(m, x), y) for m in models]
