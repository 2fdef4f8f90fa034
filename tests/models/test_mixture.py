import numpy as np
import pytest

from bayesfuse.inference.expfam import NormalWishart
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.models.mixture import fit_local_posterior, hausdorff_polytopes, simulate_mixture_federation


def test_simulation_shapes_and_seed():
    fed = simulate_mixture_federation(n_clients=4, n_components=6, dim=3, components_per_client=2,
                                      n_per_component=50, seed=1)
    assert fed.means.shape == (6, 3) and fed.covariances.shape == (6, 3, 3)
    assert all(x.shape == (100, 3) for x in fed.datasets)
    assert all(len(c) == 2 for c in fed.components)
    again = simulate_mixture_federation(n_clients=4, n_components=6, dim=3, components_per_client=2,
                                        n_per_component=50, seed=1)
    np.testing.assert_array_equal(fed.datasets[2], again.datasets[2])
    with pytest.raises(ValueError, match="exceeds"):
        simulate_mixture_federation(n_components=3, components_per_client=4)


def test_local_posterior_recovers_components():
    rng = np.random.default_rng(0)
    means = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 3.0]])
    cov = np.array([[0.2, 0.05], [0.05, 0.1]])
    x = np.vstack([rng.multivariate_normal(m, cov, size=400) for m in means])
    q = fit_local_posterior(x, max_components=8)
    assert isinstance(q, NormalWishart) and len(q) == 3
    order = np.argsort(q.mean[:, 0] + 10 * q.mean[:, 1])
    # 400 points per component: the posterior mean is within a few standard errors (~0.02).
    np.testing.assert_allclose(q.mean[order], means[np.argsort(means[:, 0] + 10 * means[:, 1])], atol=0.1)
    # E[Lambda] = dof * W, so the implied covariance (dof W)^{-1} estimates cov.
    implied = np.linalg.inv(q.dof[:, None, None] * q.scale)
    np.testing.assert_allclose(implied, np.broadcast_to(cov, implied.shape), atol=0.05)


def test_hausdorff_by_hand():
    square = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert hausdorff_polytopes(square, square[::-1]) == pytest.approx(0.0, abs=1e-9)
    # The centre lies inside the square (distance 0); the corners are sqrt(1/2) from it.
    assert hausdorff_polytopes(square, [[0.5, 0.5]]) == pytest.approx(np.sqrt(0.5), rel=1e-6)
    # A point 2 above the top edge: distance 2 to the hull, and the hull's far corner
    # (0, 0) or (1, 0) is sqrt(0.25 + 9) from it... the Hausdorff distance is the larger.
    assert hausdorff_polytopes(square, [[0.5, 3.0]]) == pytest.approx(np.sqrt(0.25 + 9.0), rel=1e-6)
    # Points on a segment: an interior point of the hull is at distance 0, not to the vertices.
    seg = np.array([[0.0, 0.0], [2.0, 0.0]])
    assert hausdorff_polytopes(seg, [[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]]) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="dimensions"):
        hausdorff_polytopes(square, np.zeros((2, 3)))


def test_kl_fusion_of_local_mixture_posteriors():
    fed = simulate_mixture_federation(n_clients=5, n_components=4, components_per_client=2,
                                      separation=3.0, noise=0.02, n_per_component=200, seed=3)
    posts = [fit_local_posterior(x, max_components=6, seed=0) for x in fed.datasets]
    assert [len(p) for p in posts] == [2] * 5
    # KLs between posteriors of one true component are at most ~1.2e3 here, between different
    # ones at least ~1e4; a cost scale of 5e4 puts reg = 0.1 between the two. (The paper's
    # std scaling is dominated by the 1e6-sized KLs of far-apart pairs here and merges two
    # neighbouring components; see benchmarks/bench_mixture_fusion.py.)
    res = kl_fuse(posts, reg=0.1, cost_scale=5e4)
    used = len(np.unique(np.concatenate(fed.components)))
    assert res.n_components == used
    assert hausdorff_polytopes(fed.means[np.unique(np.concatenate(fed.components))], res.components.mean) < 0.1
