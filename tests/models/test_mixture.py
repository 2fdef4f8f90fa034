import numpy as np
import pytest

from bayesfuse.inference.expfam import NormalWishart
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.models.mixture import fit_local_posterior, hausdorff_polytopes, simulate_mixture_federation
from tests.helpers import partition as _partition


def test_simulation_shapes_and_seed():
    fed = simulate_mixture_federation(
        n_clients=4, n_components=6, dim=3, components_per_client=2, n_per_component=50, seed=1
    )
    assert fed.means.shape == (6, 3) and fed.covariances.shape == (6, 3, 3)
    assert all(x.shape == (100, 3) for x in fed.datasets)
    assert all(len(c) == 2 for c in fed.components)
    again = simulate_mixture_federation(
        n_clients=4, n_components=6, dim=3, components_per_client=2, n_per_component=50, seed=1
    )
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


@pytest.mark.catalogue
def test_kl_fusion_of_local_mixture_posteriors():
    reg, noise, n = 0.1, 0.02, 200
    fed = simulate_mixture_federation(
        n_clients=5, n_components=4, components_per_client=2, separation=3.0, noise=noise, n_per_component=n, seed=3
    )
    posts = [fit_local_posterior(x, max_components=6, seed=0) for x in fed.datasets]
    assert [len(p) for p in posts] == [2] * 5
    # The cost scale. Normal-Wishart posteriors of n = 200 points have kappa ~ dof ~ n, so their
    # KLs grow like n/2 times the squared Mahalanobis distance: ~1e4 between neighbouring
    # components, ~1e6 between far ones (means spread 3, component sd <= 0.15). The paper's
    # scale, the std of all KLs ("Choosing lambda", section 4.3), is set by the far pairs here
    # (2.3e5) and then merges neighbours (on 4 of 12 seeds of this federation).
    # Derived instead. The alternation starts from every local component as a global one, so
    # its first step weighs pairwise KLs: with binary P, local b joins the column of local a
    # (cost KL(a || b) / scale) when that turns two columns of norm 1 into one of norm sqrt 2
    # (eqs. 8-9), i.e. when KL(a || b) < (2 - sqrt 2) * reg * scale. Two components that one
    # client's own fit keeps apart are distinct; merge only what is closer than half the closest
    # such pair: a quarter of its KL, the KL growing with the squared distance of the means.
    apart = min(p.kl(p)[~np.eye(len(p), dtype=bool)].min() for p in posts)
    scale = apart / 4 / ((2 - np.sqrt(2)) * reg)
    res = kl_fuse(posts, reg=reg, cost_scale=scale)
    assert res.converged and res.cost_scale == scale
    # the truth: each local component's nearest true mean, which must be what the client was given
    labels = [np.array([np.argmin(((fed.means - m) ** 2).sum(1)) for m in p.mean]) for p in posts]
    assert [sorted(lab) for lab in labels] == [sorted(c) for c in fed.components]
    used = np.unique(np.concatenate(fed.components))
    assert res.n_components == len(used)
    assert _partition(res.assignments) == _partition(labels)
    for g in range(res.n_components):
        members = [posts[j][l] for j, a in enumerate(res.assignments) for l in np.flatnonzero(a == g)]
        kappa = np.array([q.kappa[0] for q in members])
        means = np.array([q.mean[0] for q in members])
        # KL barycenter in closed form (section 3.1; eta = (kappa m, kappa, W^-1 + kappa m m^T, dof - D)
        # averaged): kappa and dof averaged, the mean kappa-weighted, W^-1 from the averaged third part
        bary_mean = (kappa[:, None] * means).sum(0) / kappa.sum()
        third = np.mean([np.linalg.inv(q.scale[0]) + q.kappa[0] * np.outer(q.mean[0], q.mean[0]) for q in members], 0)
        np.testing.assert_allclose(res.components.kappa[g], kappa.mean(), rtol=1e-12)
        np.testing.assert_allclose(res.components.dof[g], np.mean([q.dof[0] for q in members]), rtol=1e-12)
        np.testing.assert_allclose(res.components.mean[g], bary_mean, rtol=1e-10)
        np.testing.assert_allclose(
            np.linalg.inv(res.components.scale[g]), third - kappa.mean() * np.outer(bary_mean, bary_mean), rtol=1e-8
        )
        # against the true mean: a local posterior mean is the component's sample mean (off by the
        # client's shift N(0, noise^2) plus N(0, cov / n)) pulled towards the client's data mean
        # by 1 / (1 + n) (scikit-learn's prior, one pseudo-observation there); the barycenter's is a
        # weighted average of those. 5 sd per coordinate plus the largest pull bounds it.
        (k,) = {int(lab[l]) for lab, a in zip(labels, res.assignments) for l in np.flatnonzero(a == g)}
        pull = np.max(
            [np.abs(x.mean(0) - fed.means[k]) / (1 + n) for x, c in zip(fed.datasets, fed.components) if k in c], axis=0
        )
        bound = 5 * np.sqrt(noise**2 + np.diag(fed.covariances[k]) / n) + pull
        assert (np.abs(res.components.mean[g] - fed.means[k]) < bound).all(), (g, k)
    assert hausdorff_polytopes(fed.means[used], res.components.mean) < 0.1
