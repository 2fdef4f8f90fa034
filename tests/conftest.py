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


@pytest.fixture(scope="module")
def summarised_federation():
    """Three digits clients of a Dirichlet(0.5) split, their 64-32-10 MLPs and their summaries:
    ``(split, partition, models, summaries)``, made once per test module."""
    from bayesfuse import summarize
    from bayesfuse.data import dirichlet_partition
    from bayesfuse.train import TrainConfig, train_clients

    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, n_clients=3, alpha=0.5, seed=0)
    models = train_clients(split.train, part, TrainConfig(hidden=(32,), epochs=5, seed=0))
    summaries = [summarize(m, split.train.x[idx], split.train.y[idx]) for m, idx in zip(models, part)]
    return split, part, models, summaries


@pytest.fixture
def float64():
    """torch's default dtype set to float64 for the test (exact comparisons of functions)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
