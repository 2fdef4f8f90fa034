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
    fig = plot.plot_unit_posterior(
        res.mean[g], res.var[g], [m for m, _ in members], [v for _, v in members], weights=[0, 1, 2]
    )
    _saved(fig, tmp_path, "unit")


def test_entropy_plots(tmp_path):
    rng = np.random.default_rng(0)
    h_in, h_out = rng.gamma(1, 0.3, 200), rng.gamma(3, 0.4, 100)
    _saved(plot.plot_entropy_hist(h_in, h_out), tmp_path, "hist")
    labels = np.arange(100) % 10
    _saved(plot.plot_centred_entropy({"a": (h_in, h_out), "b": (h_in * 2, h_out)}, labels), tmp_path, "centred")
    _saved(plot.plot_sorted_images(rng.random((30, 64)), rng.random(30), (8, 8), n=5), tmp_path, "sorted")


@pytest.fixture(scope="module")
def fusion():
    """A two-hidden-layer PFNM fusion (what bayesfuse.fuse returns)."""
    import torch

    from bayesfuse import fuse
    from bayesfuse.nets.mlp import MLP

    torch.manual_seed(0)
    return fuse([MLP(6, [5, 4], 3) for _ in range(2)], "pfnm")


def _image(fig) -> np.ndarray:
    return np.asarray(fig.axes[0].images[0].get_array())


def test_layer_plots_take_a_fusion_or_a_layer(fusion, res, tmp_path):
    """plot_assignments and plot_objective draw a fusion's layer (the first by default, or by
    index or group name) as they draw that layer's own result."""
    import matplotlib.pyplot as plt

    for key, layer in ((0, fusion.layers[0]), ("P2", fusion.layers[1]), (1, fusion.layers[1])):
        np.testing.assert_array_equal(
            _image(plot.plot_assignments(fusion, layer=key)), _image(plot.plot_assignments(layer))
        )
        got = plot.plot_objective(fusion, layer=key).axes[0].lines[0].get_ydata()
        np.testing.assert_array_equal(got, layer.objective)
    np.testing.assert_array_equal(
        _image(plot.plot_assignments(fusion)), _image(plot.plot_assignments(fusion.layers[0]))
    )
    assert _image(plot.plot_assignments(fusion, layer="P2")).shape[1] == fusion.sizes[1]
    plt.close("all")
    _saved(plot.plot_assignments(fusion), tmp_path, "fusion_assign")
    with pytest.raises(ValueError, match=r"no layer 'P9'; the matched groups are \['P1', 'P2'\]"):
        plot.plot_assignments(fusion, layer="P9")
    with pytest.raises(IndexError, match="out of range"):
        plot.plot_objective(fusion, layer=2)


def test_plot_posterior_draws_the_exact_gaussian_density(fusion, res, tmp_path):
    """Each panel is the density of N(mu, sigma^2) itself, its 94% interval shaded, titled as
    az.summary names the entry; entries are picked by name or position."""
    from scipy import stats

    fig = plot.plot_posterior(fusion, layer="P1", units=[1], weights=["layers.0.bias", 0])
    mean, var = fusion.posteriors[0]
    axes = [ax for ax in fig.axes if ax.lines]
    assert [ax.get_title() for ax in axes] == ["theta[1, layers.0.bias]", "theta[1, layers.0.weight[0]]"]
    for ax, d in zip(axes, (6, 0)):
        x, y = ax.lines[0].get_data()
        mu, sd = mean[1, d], np.sqrt(var[1, d])
        np.testing.assert_allclose(y, stats.norm.pdf(x, mu, sd), rtol=1e-12)
        assert x.min() == pytest.approx(mu - 4 * sd) and x.max() == pytest.approx(mu + 4 * sd)
        shaded = ax.collections[0].get_paths()[0].vertices[:, 0]
        lo, hi = stats.norm.interval(0.94, mu, sd)
        assert shaded.min() == pytest.approx(lo, rel=1e-12) and shaded.max() == pytest.approx(hi, rel=1e-12)
    _saved(fig, tmp_path, "posterior")
    default = plot.plot_posterior(res)  # a matching: unit 0, its first 6 entries
    assert [ax.get_title() for ax in default.axes if ax.lines] == [f"theta[0, dim_{d}]" for d in range(6)]
    _saved(default, tmp_path, "posterior_default")
    with pytest.raises(ValueError, match="no weight 'bias'"):
        plot.plot_posterior(res, weights=["bias"])
