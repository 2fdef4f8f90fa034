import numpy as np
import pytest

from bayesfuse import plot
from bayesfuse.inference.matching import match_neurons
from bayesfuse.models.bbp import simulate_federation


@pytest.fixture(scope="module")
def fed():
    return simulate_federation(5, 6, gamma0=4.0, prior_var=1.0, noise_var=0.05, seed=0)


@pytest.fixture(scope="module")
def res(fed):
    return match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=4.0, cost="marginal")


def _saved(fig, tmp_path, name):
    path = tmp_path / f"{name}.png"
    fig.savefig(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 2000
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_assignments_and_objective(res, fed, tmp_path):
    _saved(plot.plot_assignments(res, truth=fed.assignments), tmp_path, "assign")
    _saved(plot.plot_objective(res), tmp_path, "objective")


def test_size_sweep(fed, tmp_path):
    gammas, noises = [0.5, 4.0, 32.0], [0.01, 0.05]
    sizes = plot.size_sweep(fed.layers, gamma0=gammas, noise_var=noises, prior_var=1.0, cost="marginal")
    assert sizes.shape == (2, 3) and (sizes >= max(len(v) for v in fed.layers)).all()
    _saved(plot.plot_size_sweep(sizes, gammas, noises, truth=fed.n_atoms), tmp_path, "sweep")


def test_unit_posterior(res, fed, tmp_path):
    g = int(np.argmax(res.counts))
    members = [(v[a == g][0], np.full(v.shape[1], 0.05)) for v, a in zip(fed.layers, res.assignments) if (a == g).any()]
    fig = plot.plot_unit_posterior(res.mean[g], res.var[g], [m for m, _ in members], [v for _, v in members],
                                   weights=[0, 1, 2])
    _saved(fig, tmp_path, "unit")


def test_entropy_plots(tmp_path):
    rng = np.random.default_rng(0)
    h_in, h_out = rng.gamma(1, 0.3, 200), rng.gamma(3, 0.4, 100)
    _saved(plot.plot_entropy_hist(h_in, h_out), tmp_path, "hist")
    labels = np.arange(100) % 10
    _saved(plot.plot_centred_entropy({"a": (h_in, h_out), "b": (h_in * 2, h_out)}, labels), tmp_path, "centred")
    _saved(plot.plot_sorted_images(rng.random((30, 64)), rng.random(30), (8, 8), n=5), tmp_path, "sorted")
