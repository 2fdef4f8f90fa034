import os

import pytest

from bayesfuse.data import load_digits

os.environ.setdefault("MPLBACKEND", "Agg")  # plots in tests never need a display


@pytest.fixture(scope="module")
def digits():
    """The embedded 8x8 digits, standardised (loaded once per test module)."""
    return load_digits().standardize()
