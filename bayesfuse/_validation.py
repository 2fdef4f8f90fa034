"""Checks shared by the public entry points: arrays that must be finite or positive."""

from __future__ import annotations

import numpy as np

__all__ = ["finite_array", "positive_array", "normalised_weights", "check_inputs", "check_num_samples", "as_input"]


def finite_array(x, name: str, *, allow_inf: bool = False) -> np.ndarray:
    """``x`` (NumPy or torch) as float64, refusing NaN (and infinities unless ``allow_inf``)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x, dtype=np.float64)
    bad = np.isnan(a) if allow_inf else ~np.isfinite(a)
    if bad.any():
        raise ValueError(f"{name} contains NaN{'' if allow_inf else ' or infinite'} values")
    return a


def positive_array(x, name: str, *, allow_inf: bool = False) -> np.ndarray:
    """:func:`finite_array` that also refuses entries <= 0."""
    a = finite_array(x, name, allow_inf=allow_inf)
    if (a <= 0).any():
        shown = f", got {float(a)}" if a.ndim == 0 else ""
        raise ValueError(f"{name} must be positive{shown}")
    return a


def normalised_weights(weights, n: int, *, what: str = "model") -> np.ndarray:
    """Weights of ``n`` models or clients summing to 1; uniform when ``weights`` is None."""
    if weights is None:
        return np.full(n, 1.0 / n)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,):
        raise ValueError(f"need one weight per {what} ({n}), got shape {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero, got {w}")
    return w / w.sum()


def check_inputs(x) -> None:
    """Refuse inputs to predict on that are empty or hold NaN or infinite values (NumPy or
    torch), naming the first such example: a prediction of NaN is never returned."""
    n = x.shape[0] if hasattr(x, "shape") and len(x.shape) else 0
    if n == 0:
        raise ValueError("cannot predict on 0 examples")
    finite = x.isfinite() if hasattr(x, "isfinite") else np.isfinite(np.asarray(x, dtype=np.float64))
    if not bool(finite.all()):
        rows = np.asarray(finite.reshape(n, -1).all(1) if hasattr(finite, "reshape") else finite)
        raise ValueError(f"x has NaN or infinite values (example {int(np.argmin(rows))} of {n})")


def check_num_samples(num_samples) -> int:
    """``num_samples`` as a positive int (draws of a Monte Carlo predictive), or a one-line ValueError."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    return int(num_samples)


def as_input(x, module, dtype, device=None):
    """``x`` (NumPy or torch) as a tensor to feed ``module``: in ``dtype`` (the network's floating
    type), on ``device`` when given; integer inputs stay integers only where the network reads
    ids (it holds an ``nn.Embedding`` or ``nn.EmbeddingBag``), since ids cast to a float type
    lose their value (float16 above 2048), while integer features (uint8 pixels) are numbers."""
    import torch

    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    ids = not t.is_floating_point() and any(
        isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) for m in module.modules()
    )
    return t.to(device=device, dtype=t.dtype if ids else dtype)
