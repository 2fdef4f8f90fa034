import numpy as np
import pytest

from bayesfuse.data import DEFAULT_FONTS, available_fonts, load_digits, load_font_digits


def test_all_default_fonts_ship_with_matplotlib():
    assert available_fonts() == list(DEFAULT_FONTS)


def test_a_missing_default_font_is_named_not_skipped(monkeypatch, tmp_path):
    """An older matplotlib lacks a default font: the OOD set would silently shrink (and every
    AUROC on it move), so the loader refuses and says how to get the fonts."""
    import bayesfuse.data.fonts as fonts

    for name in DEFAULT_FONTS[:-1]:
        (tmp_path / f"{name}.ttf").write_bytes(b"")
    monkeypatch.setattr(fonts, "_font_dir", lambda: tmp_path)
    with pytest.raises(FileNotFoundError, match=r"\['cmti10'\] not found .*matplotlib >= 3\.11 bundles them all"):
        load_font_digits(28)


@pytest.mark.parametrize("size", [8, 28])
def test_shape_range_and_classes(size):
    ds = load_font_digits(size, n_per_font=2)
    n_fonts = len(DEFAULT_FONTS)
    assert ds.x.shape == (10 * n_fonts * 2, size * size)
    assert ds.image_shape == (size, size)
    assert ds.x.min() >= 0.0 and ds.x.max() <= 1.0
    np.testing.assert_array_equal(ds.class_counts(), np.full(10, n_fonts * 2))
    ink = ds.x.sum(1)
    assert ink.min() > 0.05 * size  # no blank images
    # Anti-aliased: edge pixels take intermediate values.
    assert ((ds.x > 0.05) & (ds.x < 0.95)).any()


def test_glyph_holes_stay_empty():
    # The centre of a typeset "0" is background, the ring around it is ink.
    ds = load_font_digits(28, fonts=["DejaVuSans"], n_per_font=1, max_shift=0, scale_range=(1, 1))
    zero = ds.x[ds.y == 0][0].reshape(28, 28)
    assert zero[13:15, 13:15].max() < 0.05
    assert zero[4:24, 8:20].max() > 0.95


def test_similar_footprint_to_digits():
    # The OOD set must look like the training images: same grid, comparable ink.
    digits = load_digits().train.x
    fonts = load_font_digits(8, n_per_font=1).x
    assert 0.5 < fonts.mean() / digits.mean() < 2.0


def test_deterministic_and_seeded():
    a = load_font_digits(8, fonts=["cmr10"], seed=3)
    b = load_font_digits(8, fonts=["cmr10"], seed=3)
    c = load_font_digits(8, fonts=["cmr10"], seed=4)
    np.testing.assert_array_equal(a.x, b.x)
    assert not np.array_equal(a.x, c.x)


def test_bad_arguments():
    with pytest.raises(ValueError, match="8 or 28"):
        load_font_digits(16)
    with pytest.raises(FileNotFoundError, match="Comic"):
        load_font_digits(8, fonts=["ComicSans"])
    with pytest.raises(ValueError, match="n_per_font"):
        load_font_digits(8, n_per_font=0)
