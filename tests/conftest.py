import os

import pytest
import torch

from bayesfuse.data import load_digits

os.environ.setdefault("MPLBACKEND", "Agg")  # plots in tests never need a display


@pytest.fixture(scope="module")
def digits():
    """The embedded 8x8 digits, standardised (loaded once per test module)."""
    return load_digits().standardize()


@pytest.fixture
def float64():
    """torch's default dtype set to float64 for the test (exact comparisons of functions)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
