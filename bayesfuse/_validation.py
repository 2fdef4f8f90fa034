"""Checks shared by the public entry points: arrays that must be finite or positive."""

from __future__ import annotations

import numpy as np

__all__ = ["finite_array", "positive_array", "normalised_weights"]


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
