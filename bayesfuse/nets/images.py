"""Images given flat: every dataset here feeds networks ``(N, side * side)`` greyscale rows, and the
convolutional ones (:func:`~bayesfuse.nets.arch.make_cnn`, :mod:`bayesfuse.nets.resnet`) reshape them."""

from __future__ import annotations

import math

__all__ = ["image_shape"]


def image_shape(n_features: int) -> tuple[int, int, int]:
    """``(1, side, side)`` for square greyscale images flattened to ``n_features``."""
    side = math.isqrt(n_features)
    if side * side != n_features:
        raise ValueError(f"{n_features} features are not a square greyscale image; cnn, lstm and the ResNets need one")
    return (1, side, side)
