"""Digits rendered in the fonts that ship with matplotlib: an honest out-of-distribution set.

Typeset digits are still digits, but their strokes, widths and serifs differ from handwriting,
so a model trained on handwritten digits should be less sure of them. Each glyph is scaled to
fit a box like the training images (MNIST centres digits in a 20x20 box inside 28x28; the 8x8
digits fill nearly the whole frame), jittered by a small random scale and shift, and rasterised
with anti-aliasing by supersampling: a pixel's value is the fraction of its sub-pixel centres
that fall inside the glyph outline (even-odd rule, so the holes of 0, 4, 6, 8, 9 stay empty).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from bayesfuse.data.datasets import Dataset

__all__ = ["DEFAULT_FONTS", "available_fonts", "load_font_digits"]

#: Text fonts shipped in ``matplotlib/mpl-data/fonts/ttf`` whose digits are ordinary figures.
DEFAULT_FONTS: tuple[str, ...] = (
    "DejaVuSans",
    "DejaVuSans-Bold",
    "DejaVuSans-Oblique",
    "DejaVuSans-BoldOblique",
    "DejaVuSansMono",
    "DejaVuSansMono-Bold",
    "DejaVuSansMono-Oblique",
    "DejaVuSansMono-BoldOblique",
    "DejaVuSerif",
    "DejaVuSerif-Bold",
    "DejaVuSerif-Italic",
    "DejaVuSerif-BoldItalic",
    "STIXGeneral",
    "STIXGeneralBol",
    "STIXGeneralItalic",
    "STIXGeneralBolIta",
    "cmr10",
    "cmb10",
    "cmss10",
    "cmtt10",
    "cmti10",
)

#: Fraction of the image side taken by the glyph's height, per image size.
_BOX_FRACTION = {8: 0.95, 28: 20.0 / 28.0}
_SUPERSAMPLE = 6


def _font_dir() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def available_fonts() -> list[str]:
    """Names (file stems) of the matplotlib fonts in :data:`DEFAULT_FONTS` found on this system."""
    d = _font_dir()
    return [name for name in DEFAULT_FONTS if (d / f"{name}.ttf").is_file()]


def _glyph(char: str, font_file: Path):
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath

    path = TextPath((0.0, 0.0), char, size=1.0, prop=FontProperties(fname=str(font_file)))
    ext = path.get_extents()
    if ext.width <= 0 or ext.height <= 0:
        raise ValueError(f"font {font_file.name} has no outline for {char!r}")
    return path, ext


def _rasterise(path, ext, size: int, scale: float, shift: np.ndarray) -> np.ndarray:
    """Coverage of ``path`` on a ``size x size`` grid after fitting its box and jittering."""
    from matplotlib.path import Path as MplPath

    height = _BOX_FRACTION[size] * size * scale
    k = height / ext.height
    # Glyph centre goes to the image centre plus the shift; image y grows downwards.
    cx, cy = (ext.x0 + ext.x1) / 2.0, (ext.y0 + ext.y1) / 2.0
    sub = (np.arange(size * _SUPERSAMPLE) + 0.5) / _SUPERSAMPLE  # sub-pixel centres, pixel units
    u, v = np.meshgrid(sub, sub)  # u: column, v: row
    gx = (u - size / 2.0 - shift[0]) / k + cx
    gy = -(v - size / 2.0 - shift[1]) / k + cy
    points = np.column_stack([gx.ravel(), gy.ravel()])
    # Even-odd rule over the glyph's closed contours: a point inside an outer contour and a
    # hole is outside. (Path.contains_points on the compound path would fill the holes.)
    inside = np.zeros(len(points), dtype=bool)
    for polygon in path.to_polygons(closed_only=True):
        inside ^= MplPath(polygon).contains_points(points)
    cover = inside.reshape(size, _SUPERSAMPLE, size, _SUPERSAMPLE).mean(axis=(1, 3))
    return cover.astype(np.float32)


def load_font_digits(
    size: int = 8,
    fonts: Sequence[str] | None = None,
    *,
    n_per_font: int = 5,
    max_shift: float | None = None,
    scale_range: tuple[float, float] = (0.85, 1.0),
    seed: int = 0,
) -> Dataset:
    """Digits 0-9 typeset in matplotlib's fonts, shaped like the training images.

    Parameters
    ----------
    size : {8, 28}
        Image side: 8 matches ``load_digits``, 28 matches MNIST / Fashion-MNIST.
    fonts : sequence of str, optional
        Font file stems from ``matplotlib/mpl-data/fonts/ttf`` (see :func:`available_fonts`);
        default: all of :data:`DEFAULT_FONTS`, so that the set is the same on every machine
        (matplotlib >= 3.11 bundles them all; with an older one, pass ``fonts=available_fonts()``
        for the ones it has).
    n_per_font : int
        Jittered copies of each digit per font.
    max_shift : float, optional
        Largest shift in pixels along each axis (uniform); default ``size / 14`` (2 px at 28,
        about 0.6 px at 8).
    scale_range : (float, float)
        Range of the uniform random scale of the glyph box.
    seed : int
        Seed of the jitter; the same seed gives the same images.

    Returns
    -------
    Dataset
        ``x`` of shape ``(10 * n_fonts * n_per_font, size * size)`` in [0, 1], ``y`` the digit.
    """
    if size not in _BOX_FRACTION:
        raise ValueError(f"size must be 8 or 28, got {size}")
    if n_per_font < 1:
        raise ValueError(f"n_per_font must be >= 1, got {n_per_font}")
    lo, hi = scale_range
    if not 0.0 < lo <= hi <= 1.2:
        raise ValueError(f"scale_range must satisfy 0 < low <= high <= 1.2, got {scale_range}")
    names = list(DEFAULT_FONTS if fonts is None else fonts)
    if not names:
        raise ValueError("no fonts to render digits with")
    font_dir = _font_dir()
    missing = [n for n in names if not (font_dir / f"{n}.ttf").is_file()]
    if missing:
        import matplotlib

        hint = (
            f"matplotlib {matplotlib.__version__} lacks default fonts (matplotlib >= 3.11 bundles them all: "
            "pip install -U matplotlib), or pass fonts=available_fonts() for a smaller set"
            if fonts is None
            else f"available: {available_fonts()}"
        )
        raise FileNotFoundError(f"fonts {missing} not found in {font_dir}; {hint}")
    max_shift = size / 14.0 if max_shift is None else float(max_shift)
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for name in names:
        for digit in range(10):
            path, ext = _glyph(str(digit), font_dir / f"{name}.ttf")
            for _ in range(n_per_font):
                scale = rng.uniform(lo, hi)
                shift = rng.uniform(-max_shift, max_shift, size=2)
                images.append(_rasterise(path, ext, size, scale, shift).ravel())
                labels.append(digit)
    return Dataset(
        np.stack(images),
        np.asarray(labels, dtype=np.int64),
        10,
        name=f"font-digits-{size}",
        image_shape=(size, size),
        class_names=tuple(str(d) for d in range(10)),
    )
