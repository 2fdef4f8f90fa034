"""Predictions of torch classifiers as NumPy probabilities."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["predict_proba"]


@torch.no_grad()
def predict_proba(model: nn.Module, x: np.ndarray | torch.Tensor, *, batch_size: int = 8192) -> np.ndarray:
    """Class probabilities ``softmax(model(x))`` as a float64 array of shape (n, n_classes).

    ``model`` must return logits (or log-probabilities, which softmax leaves unchanged).
    """
    x = torch.as_tensor(np.asarray(x, dtype=np.float32)) if not isinstance(x, torch.Tensor) else x.float()
    if len(x) == 0:
        raise ValueError("cannot predict on 0 examples")
    was_training = model.training
    model.eval()
    try:
        chunks = [torch.softmax(model(x[i : i + batch_size]).double(), dim=-1) for i in range(0, len(x), batch_size)]
    finally:
        model.train(was_training)
    return torch.cat(chunks).numpy()
