"""Predictions of torch classifiers as NumPy probabilities."""

from __future__ import annotations

import inspect

import numpy as np
import torch
from torch import nn

from bayesfuse._validation import check_inputs
from bayesfuse.nets.state import model_input

__all__ = ["predict_proba", "predictive_proba"]


@torch.no_grad()
def predict_proba(model: nn.Module, x: np.ndarray | torch.Tensor, *, batch_size: int = 8192) -> np.ndarray:
    """Class probabilities ``softmax(model(x))`` as a float64 array of shape (n, n_classes).

    ``model`` must return logits (or log-probabilities, which softmax leaves unchanged); a fusion
    result (what :func:`bayesfuse.fuse` returns) stands for its ``.model``. A Bayesian network
    without a ``forward`` (a BNN) is refused, pointing to its Monte Carlo predictive.
    """
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
        model = model.model
    if not isinstance(model, nn.Module):
        raise TypeError(f"predict_proba needs a network (an nn.Module) or a fusion result, got {type(model).__name__}")
    if type(model).forward is nn.Module.forward and callable(getattr(model, "predict", None)):
        raise TypeError(
            f"a {type(model).__name__} predicts by its Monte Carlo predictive, not one forward pass: use "
            "model.predict(x, num_samples=...) or bayesfuse.nets.predictive_proba(model, x)"
        )
    x = model_input(x, model)  # floats in the network's own dtype (float64 for a float64 network); ids as they are
    check_inputs(x)
    modes = [(m, m.training) for m in model.modules()]  # each module's own (an ensemble's members')
    model.eval()
    try:
        chunks = [torch.softmax(model(x[i : i + batch_size]).double(), dim=-1) for i in range(0, len(x), batch_size)]
    finally:
        for m, training in modes:
            m.training = training
    return torch.cat(chunks).numpy()


def predictive_proba(model, x: np.ndarray, *, num_samples: int = 100, seed: int = 0) -> np.ndarray:
    """The predictive probabilities (n, K) of any classifier: Bayesian ones by their Monte Carlo predictive.

    A model with ``predict(x, num_samples=, seed=)`` (a BNN, a fused BNN with client heads, the
    clients' heads of a fused network (:class:`~bayesfuse.nets.heads.ClientHeads`), an
    :class:`~bayesfuse.baselines.Ensemble`, a last-layer Laplace network) gives
    ``model.predict(x, num_samples=num_samples, seed=seed)``; any other network
    ``softmax(model(x))`` (:func:`predict_proba`). A fusion result (what :func:`bayesfuse.fuse`
    returns) stands for its ``.model``.
    """
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
        model = model.model
    predict = getattr(model, "predict", None)
    if callable(predict) and {"num_samples", "seed"} <= set(inspect.signature(predict).parameters):
        return np.asarray(predict(x, num_samples=num_samples, seed=seed), dtype=np.float64)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"cannot get predictive probabilities from a {type(model).__name__}: give a network, a "
            "model with predict(x, num_samples=, seed=) or a fusion result"
        )
    return predict_proba(model, x)
