import numpy as np
import pytest

from bayesfuse.inference.expfam import Dirichlet, DiagNormal, Gamma
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.relaxed import solve_relaxed
from tests.helpers import partition as _partition


def _clients(seed=0, n_true=8, sizes=(4, 5, 3), dim=6, noise=0.05):
    rng = np.random.default_rng(seed)
    loc = rng.normal(size=(n_true, dim)) * 2
    var = rng.uniform(0.05, 0.2, size=(n_true, dim))
    posteriors, truth = [], []
    for L in sizes:
        idx = rng.choice(n_true, L, replace=False)
        posteriors.append(DiagNormal(loc=loc[idx] + noise * rng.normal(size=(L, dim)), var=var[idx]))
        truth.append(idx)
    return posteriors, truth


@pytest.mark.parametrize("solver", ["cvxpy", "fast"])
def test_recovers_the_shared_components(solver):
    posteriors, truth = _clients()
    res = kl_fuse(posteriors, reg=0.1, solver=solver)
    assert _partition(res.assignments) == _partition(truth)
    assert res.n_components == len(np.unique(np.concatenate(truth)))
    assert res.converged


def test_identical_posteriors_fuse_to_themselves():
    posteriors, _ = _clients(sizes=(5,))
    q = posteriors[0]
    res = kl_fuse([q, q, q], reg=0.1)
    assert res.n_components == 5
    order = res.assignments[0]
    np.testing.assert_allclose(res.components.loc[order], q.loc, rtol=1e-9)
    np.testing.assert_allclose(res.components.var[order], q.var, rtol=1e-9)
    homo = kl_fuse([q, q[np.array([3, 1, 4, 0, 2])]], mode="homogeneous")
    np.testing.assert_allclose(homo.components.loc[homo.assignments[0]], q.loc, rtol=1e-9)


def test_client_order_and_component_order_do_not_matter():
    posteriors, truth = _clients(seed=4)
    base = kl_fuse(posteriors, reg=0.1)
    rev = kl_fuse(posteriors[::-1], reg=0.1)
    assert _partition(rev.assignments[::-1]) == _partition(base.assignments)
    perm = np.random.default_rng(0).permutation(len(posteriors[1]))
    shuffled = list(posteriors)
    shuffled[1] = posteriors[1][perm]
    res = kl_fuse(shuffled, reg=0.1)
    back = list(res.assignments)
    back[1] = res.assignments[1][np.argsort(perm)]
    assert _partition(back) == _partition(base.assignments)


def test_homogeneous_mode_matches_permuted_copies_and_averages():
    rng = np.random.default_rng(5)
    dim, L = 4, 6
    loc = rng.normal(size=(L, dim)) * 3
    clients = []
    for j in range(3):
        perm = rng.permutation(L)
        clients.append(DiagNormal(loc=loc[perm] + 0.01 * rng.normal(size=(L, dim)),
                                  var=np.full((L, dim), 0.1 * (j + 1))))
    res = kl_fuse(clients, mode="homogeneous")
    assert res.n_components == L and res.solver == "hungarian"
    # Barycenter of matched Gaussians: precision-weighted mean, precisions averaged.
    comp = res.assignments[0][0]
    members = [c.loc[np.flatnonzero(a == comp)[0]] for c, a in zip(clients, res.assignments)]
    prec = np.array([1 / 0.1, 1 / 0.2, 1 / 0.3])
    np.testing.assert_allclose(res.components.loc[comp], (prec[:, None] * members).sum(0) / prec.sum(), rtol=1e-9)
    np.testing.assert_allclose(res.components.var[comp], 1 / prec.mean(), rtol=1e-9)
    assert np.all(np.diff(res.objective) <= 1e-9)


def test_other_families_fuse():
    rng = np.random.default_rng(6)
    topics = rng.gamma(2.0, size=(5, 30)) * 20
    clients = [Dirichlet(concentration=topics[idx] * rng.uniform(0.9, 1.1, size=(3, 30)))
               for idx in ([0, 1, 2], [2, 3, 4], [4, 0, 3])]
    res = kl_fuse(clients, reg=0.1)
    assert res.n_components == 5


def test_bad_inputs():
    posteriors, _ = _clients()
    with pytest.raises(TypeError, match="cannot mix"):
        kl_fuse([posteriors[0], Gamma(shape=np.ones((2, 6)), rate=np.ones((2, 6)))])
    with pytest.raises(ValueError, match="event shape"):
        kl_fuse([posteriors[0], DiagNormal(loc=np.zeros((2, 5)), var=np.ones((2, 5)))])
    with pytest.raises(ValueError, match="var must be positive"):
        DiagNormal(loc=np.zeros((2, 6)), var=-np.ones((2, 6)))
    with pytest.raises(ValueError, match="empty client"):
        kl_fuse([posteriors[0], posteriors[1][np.zeros(5, dtype=bool)]])
    with pytest.raises(ValueError, match="reg"):
        kl_fuse(posteriors, reg=-0.1)
    with pytest.raises(ValueError, match="equal numbers"):
        kl_fuse(posteriors, mode="homogeneous")
    with pytest.raises(ValueError, match="solver"):
        solve_relaxed([np.ones((2, 3))], 0.1, solver="gurobi")
