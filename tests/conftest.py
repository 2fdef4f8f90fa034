import os

import pytest
import torch

from bayesfuse.data import load_digits

os.environ.setdefault("MPLBACKEND", "Agg")  # plots in tests never need a display

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One torch thread per test process (and for the commands the tests start): with pytest -n,
    # the processes already fill the cores, and more threads only contend for them.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


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
