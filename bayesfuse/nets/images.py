"""Images given flat: every dataset here feeds networks ``(N, side * side)`` greyscale rows (``(N, channels
* side * side)`` for images of several channels), and the convolutional ones
(:func:`~bayesfuse.nets.arch.make_cnn`, :mod:`bayesfuse.nets.resnet`) reshape them."""

from __future__ import annotations

import math

__all__ = ["image_shape"]


def image_shape(n_features: int, channels: int = 1) -> tuple[int, int, int]:
    """``(channels, side, side)`` for square images of ``channels`` channels flattened to ``n_features``."""
    side = math.isqrt(n_features // channels) if channels > 0 else 0
    if channels < 1 or channels * side * side != n_features:
        what = "greyscale" if channels == 1 else f"{channels}-channel"
        raise ValueError(f"{n_features} features are not a square {what} image; cnn, lstm and the ResNets need one")
    return (channels, side, side)
