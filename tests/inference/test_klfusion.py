import re

import numpy as np
import pytest

from bayesfuse.inference import klfusion
from bayesfuse.inference.expfam import DiagNormal, Dirichlet, Gamma
from bayesfuse.inference.klfusion import _split, greedy_assign, greedy_start, kl_fuse
from bayesfuse.inference.relaxed import relaxed_objective, solve_relaxed
from tests.helpers import partition as _partition


def _clients(seed=0, n_true=8, sizes=(4, 5, 3), dim=6, noise=0.05, var_spread=0.0, with_truth=False):
    """Client j holds noisy copies of some of ``n_true`` Gaussians, variances times 1 + var_spread * j."""
    rng = np.random.default_rng(seed)
    loc = rng.normal(size=(n_true, dim)) * 2
    var = rng.uniform(0.05, 0.2, size=(n_true, dim))
    posteriors, truth = [], []
    for j, L in enumerate(sizes):
        idx = rng.choice(n_true, L, replace=False)
        posteriors.append(
            DiagNormal(loc=loc[idx] + noise * rng.normal(size=(L, dim)), var=var[idx] * (1 + var_spread * j))
        )
        truth.append(idx)
    return (posteriors, truth, loc, var) if with_truth else (posteriors, truth)


def _kl_diag_normal(loc_a, var_a, loc_b, var_b):
    """KL(N(loc_a, var_a) || N(loc_b, var_b)) of diagonal Gaussians, summed over coordinates."""
    return 0.5 * np.sum(var_a / var_b + (loc_b - loc_a) ** 2 / var_b - 1.0 + np.log(var_b / var_a), axis=-1)


@pytest.mark.catalogue
@pytest.mark.parametrize("solver", ["cvxpy", "fast"])
def test_recovers_the_shared_components(solver):
    noise, spread = 0.05, 0.5
    posteriors, truth, loc, var = _clients(noise=noise, var_spread=spread, with_truth=True)
    res = kl_fuse(posteriors, reg=0.1, solver=solver)
    assert res.converged
    # the assignment: local components of one true component, and only those, share a global one
    assert _partition(res.assignments) == _partition(truth)
    used = np.unique(np.concatenate(truth))
    assert res.n_components == len(used)
    true_of = {int(g): int(t) for a, idx in zip(res.assignments, truth) for g, t in zip(a, idx)}
    assert sorted(true_of.values()) == sorted(used.tolist())
    members = {g: [(j, l) for j, a in enumerate(res.assignments) for l in np.flatnonzero(a == g)] for g in true_of}
    for g, t in true_of.items():
        # the parameters: the KL barycenter of the members, in closed form (section 3.1, natural
        # parameters averaged): precision = mean precision, mean = precision-weighted mean
        prec = np.array([1.0 / posteriors[j].var[l] for j, l in members[g]])
        locs = np.array([posteriors[j].loc[l] for j, l in members[g]])
        np.testing.assert_allclose(res.components.var[g], 1.0 / prec.mean(0), rtol=1e-12)
        np.testing.assert_allclose(res.components.loc[g], (prec * locs).sum(0) / prec.sum(0), rtol=1e-12, atol=1e-12)
        # ... and the truth: client j's variances are the true ones times c_j = 1 + spread * j,
        # so the barycenter's are var / mean_j(1 / c_j); its mean is a weighted average of noisy
        # copies, each coordinate off by N(0, noise^2 sum w_j^2) with w_j = (1/c_j) / sum(1/c):
        # 5 standard deviations (two-sided 6e-7 per coordinate, 3e-5 over the 48 of them)
        inv_c = np.array([1.0 / (1 + spread * j) for j, _ in members[g]])
        np.testing.assert_allclose(res.components.var[g], var[t] / inv_c.mean(), rtol=1e-12)
        sd = noise * np.sqrt(np.sum((inv_c / inv_c.sum()) ** 2))
        assert np.abs(res.components.loc[g] - loc[t]).max() < 5 * sd
    # the objective (eq. 9) of the last step, against its closed form at the returned solution:
    # KL costs scaled by cost_scale plus reg * sum_g sqrt(m_g) (the L2,2,1 norm of binary P).
    costs = [
        _kl_diag_normal(res.components.loc[None], res.components.var[None], q.loc[:, None], q.var[:, None])
        / res.cost_scale
        for q in posteriors
    ]
    binary = [np.eye(res.n_components)[a] for a in res.assignments]
    closed = sum((c * b).sum() for c, b in zip(costs, binary)) + 0.1 * np.sqrt(np.vstack(binary).sum(0)).sum()
    # The solver's P is binary only to its tolerance. The barycenters minimise the objective in
    # the components (first-order change 0), so moving P-mass delta changes it by at most
    # (max cost + reg) * delta.
    delta = sum(np.abs(p - b).sum() for p, b in zip(res.relaxed, binary))
    assert abs(res.objective[-1] - closed) <= (max(c.max() for c in costs) + 0.1) * delta + 1e-12 * closed


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
        clients.append(
            DiagNormal(loc=loc[perm] + 0.01 * rng.normal(size=(L, dim)), var=np.full((L, dim), 0.1 * (j + 1)))
        )
    res = kl_fuse(clients, mode="homogeneous")
    assert res.n_components == L and res.solver == "hungarian"
    # Barycenter of matched Gaussians: precision-weighted mean, precisions averaged.
    comp = res.assignments[0][0]
    members = [c.loc[np.flatnonzero(a == comp)[0]] for c, a in zip(clients, res.assignments)]
    prec = np.array([1 / 0.1, 1 / 0.2, 1 / 0.3])
    np.testing.assert_allclose(res.components.loc[comp], (prec[:, None] * members).sum(0) / prec.sum(), rtol=1e-9)
    np.testing.assert_allclose(res.components.var[comp], 1 / prec.mean(), rtol=1e-9)
    assert np.all(np.diff(res.objective) <= 1e-9)


@pytest.mark.catalogue
def test_other_families_fuse():
    rng = np.random.default_rng(6)
    topics = rng.gamma(2.0, size=(5, 30)) * 20
    held = ([0, 1, 2], [2, 3, 4], [4, 0, 3])
    factors = [rng.uniform(0.9, 1.1, size=(3, 30)) for _ in held]
    clients = [Dirichlet(concentration=topics[idx] * f) for idx, f in zip(held, factors)]
    res = kl_fuse(clients, reg=0.1)
    assert res.n_components == 5
    assert _partition(res.assignments) == _partition([np.array(idx) for idx in held])
    for g in range(5):
        members = [(j, l) for j, a in enumerate(res.assignments) for l in np.flatnonzero(a == g)]
        topic = held[members[0][0]][members[0][1]]
        # natural parameter alpha - 1 averaged (section 3.1): the members' concentrations averaged
        mean = np.mean([clients[j].concentration[l] for j, l in members], axis=0)
        np.testing.assert_allclose(res.components.concentration[g], mean, rtol=1e-12)
        # each member is the topic times factors in [0.9, 1.1], so their average is too
        ratio = res.components.concentration[g] / topics[topic]
        assert ((ratio >= 0.9) & (ratio <= 1.1)).all()


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


# ------------------------------------------------------------------ the greedy start (scale)


def _binary_objective(posteriors, assignments, reg, scale):
    """Eq. 9 at a binary assignment and its barycenters: sum_l KL(bar_g(l) || q_l) / scale
    + reg sum_g sqrt(m_g), each column's KL part by direct evaluation."""
    pooled = DiagNormal.concat(posteriors)
    used, flat = np.unique(np.concatenate(assignments), return_inverse=True)
    weights = np.zeros((len(used), len(flat)))
    weights[flat, np.arange(len(flat))] = 1.0
    bary = pooled.barycenter(weights)
    kl = _kl_diag_normal(bary.loc[flat], bary.var[flat], pooled.loc, pooled.var)
    return kl.sum() / scale + reg * np.sqrt(weights.sum(1)).sum()


def _random_clients(seed):
    """Small, ambiguous federations: 2-5 clients holding 1..n_true of 3-9 true Gaussians, means
    off by noise up to twice their spread."""
    rng = np.random.default_rng(seed)
    n_clients, n_true, dim = rng.integers(2, 6), rng.integers(3, 10), rng.integers(1, 5)
    noise = rng.choice([0.05, 0.3, 1.0, 2.0])
    loc = rng.normal(size=(n_true, dim)) * 2
    var = rng.uniform(0.05, 1.0, size=(n_true, dim))
    posteriors = []
    for _ in range(n_clients):
        size = rng.integers(1, n_true + 1)
        idx = rng.choice(n_true, size, replace=False)
        posteriors.append(
            DiagNormal(
                loc=loc[idx] + noise * rng.normal(size=(size, dim)),
                var=var[idx] * np.exp(0.3 * rng.normal(size=(size, dim))),
            )
        )
    return posteriors


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_assign_recovers_a_planted_partition(seed):
    # 6 clients of 3..8 noisy copies of 10 true components, far apart on the scale of the noise:
    # the greedy pass alone finds the truth, and so does kl_fuse from it (in one confirming step)
    posteriors, truth = _clients(seed=seed, n_true=10, sizes=(3, 8, 5, 8, 6, 4), noise=0.05, var_spread=0.3)
    pooled = DiagNormal.concat(posteriors)
    terms = pooled.kl_terms()
    scale = pooled.kl(pooled).std()
    assignments, cost = greedy_assign(DiagNormal, pooled.event_shape, terms, [len(q) for q in posteriors], 0.1, scale)
    assert _partition(assignments) == _partition(truth)
    assert (cost >= 0).all() and cost.max() < 0.1 * (2 - np.sqrt(2))  # every join cheaper than a new column
    res = kl_fuse(posteriors, reg=0.1)
    assert res.n_initial == len(np.unique(np.concatenate(truth))) == res.n_components
    assert _partition(res.assignments) == _partition(truth) and len(res.objective) == 2
    pooled_start = kl_fuse(posteriors, reg=0.1, init="pooled")
    assert pooled_start.n_initial == len(pooled)
    assert _partition(pooled_start.assignments) == _partition(truth)
    assert res.objective[-1] == pytest.approx(pooled_start.objective[-1], rel=1e-6)


def test_default_cost_scale_is_the_std_of_all_pairwise_kls():
    # The greedy start needs the scale before any cost matrix exists: it is the std of
    # KL(pooled || pooled), streamed, i.e. what the pooled start's first (N x N) costs give.
    posteriors, _ = _clients(seed=2)
    pooled = DiagNormal.concat(posteriors)
    full = pooled.kl(pooled).std()
    assert kl_fuse(posteriors, reg=0.1).cost_scale == pytest.approx(full, rel=1e-12)
    assert kl_fuse(posteriors, reg=0.1, init="pooled").cost_scale == pytest.approx(full, rel=1e-12)
    # a user's init keeps its semantics: those components, the std of KL(init || local)
    init = pooled[np.array([0, 2, 4, 5, 7, 9, 11])]
    res = kl_fuse(posteriors, reg=0.1, init=init)
    assert res.n_initial == 7
    assert res.cost_scale == pytest.approx(init.kl(pooled).std(), rel=1e-12)
    assert kl_fuse(posteriors, reg=0.1, cost_scale=3.5).cost_scale == 3.5


@pytest.mark.parametrize("seed", range(4))
def test_first_step_from_the_greedy_start_is_no_worse_than_the_greedy_rounding(seed):
    # The greedy binary P is feasible for the relaxed problem on its own barycenters (margin
    # columns empty), and there it is worth exactly eq. 9 at that binary assignment.
    posteriors = _random_clients(seed)
    sizes = [len(q) for q in posteriors]
    pooled = DiagNormal.concat(posteriors)
    terms = pooled.kl_terms()
    scale = pooled.kl_std(pooled)
    for reg in (0.1, 0.5, 2.0):
        assignments, _ = greedy_assign(DiagNormal, pooled.event_shape, terms, sizes, reg, scale)
        glob, warm = greedy_start(pooled, terms, sizes, reg, scale)
        costs = _split(glob.kl(pooled).T / scale, sizes)
        greedy = _binary_objective(posteriors, assignments, reg, scale)
        assert relaxed_objective(costs, warm, reg) == pytest.approx(greedy, rel=1e-12)
        P, _ = solve_relaxed(costs, reg, solver="cvxpy")
        assert relaxed_objective(costs, P, reg) <= greedy * (1 + 1e-6)


def test_greedy_and_pooled_starts_on_random_instances():
    # How the two starts relate. The alternation is a local method and the rounding of a
    # fractional P a heuristic, so neither start dominates: on 100 federations of
    # _random_clients x reg in (0.1, 0.5, 2) the greedy start's answer was better (eq. 9 at the
    # returned binary assignment) in 115 cases, equal in 149 and worse in 36, by at most 10.1%
    # either way. The greedy start caps the number of components (the relaxation only empties
    # columns); in the 36 cases where the pooled start ended with more components than the
    # greedy one started with, the greedy answer was the better one every time (the extra
    # components were splits). Here: the first 10 of those federations.
    worse = better = 0
    for seed in range(10):
        posteriors = _random_clients(seed)
        for reg in (0.1, 0.5, 2.0):
            greedy = kl_fuse(posteriors, reg=reg)
            pooled = kl_fuse(posteriors, reg=reg, init="pooled")
            assert greedy.n_components <= greedy.n_initial <= sum(len(q) for q in posteriors)
            fg = _binary_objective(posteriors, greedy.assignments, reg, greedy.cost_scale)
            fp = _binary_objective(posteriors, pooled.assignments, reg, pooled.cost_scale)
            assert fg <= 1.1 * fp
            if pooled.n_components > greedy.n_initial:
                assert fg <= fp * (1 + 1e-9)
            worse += fg > fp * (1 + 1e-6)
            better += fp > fg * (1 + 1e-6)
    assert worse <= 30 // 4 and better >= worse


def test_margin_offers_a_column_to_a_misplaced_component(monkeypatch):
    # The relaxation can only empty columns, never open one. Plant a bad greedy rounding: the
    # component that only client 2 holds (true component 4) put into the column of another
    # true component (2, which client 2 does not hold), its own column gone. Without the margin
    # the alternation has no column for it; the margin offers it one (its own parameters).
    posteriors, truth = _clients(seed=0, n_true=6, sizes=(4, 4, 4), noise=0.05)
    assert truth[2][0] == 4 and (np.concatenate(truth) == 4).sum() == 1 and 2 not in truth[2]
    pooled = DiagNormal.concat(posteriors)
    sizes = [len(q) for q in posteriors]
    scale = pooled.kl_std(pooled)
    good, _ = greedy_assign(DiagNormal, pooled.event_shape, pooled.kl_terms(), sizes, 0.1, scale)
    assert _partition(good) == _partition(truth)
    bad = [a.copy() for a in good]
    bad[2][0] = good[0][list(truth[0]).index(2)]
    planted = [np.unique(np.concatenate(bad), return_inverse=True)[1][a:b] for a, b in ((0, 4), (4, 8), (8, 12))]

    def fuse(cost):
        monkeypatch.setattr(klfusion, "greedy_assign", lambda *args, **kw: (planted, cost))
        res = kl_fuse(posteriors, reg=0.1)
        glob, warm = greedy_start(pooled, pooled.kl_terms(), sizes, 0.1, scale)
        monkeypatch.undo()
        return res, glob, warm

    cost = np.zeros(12)  # scaled KL to its column, as greedy_assign reports it: the planted one far
    cost[8] = 1e3
    res, glob, warm = fuse(cost)
    assert len(glob) == 5 + 1 and np.vstack(warm)[:, -1].sum() == 0  # one margin column, empty at first
    np.testing.assert_allclose(glob.loc[-1], posteriors[2].loc[0], rtol=1e-14)  # via natural parameters
    assert _partition(res.assignments) == _partition(truth)
    res, glob, _ = fuse(np.zeros(12))  # no margin: the merge stays
    assert len(glob) == 5 and res.n_components == 5 and _partition(res.assignments) != _partition(truth)


def test_init_options():
    posteriors, _ = _clients()
    with pytest.raises(ValueError, match="init must be"):
        kl_fuse(posteriors, init="random")
    same = [posteriors[0], posteriors[0]]
    with pytest.raises(ValueError, match="init must be"):
        kl_fuse(same, mode="homogeneous", init="greedy")
    with pytest.raises(ValueError, match="init has 2 components"):
        kl_fuse(posteriors, init=posteriors[0][:2])


@pytest.mark.filterwarnings("ignore:KL-fusion did not converge")
@pytest.mark.parametrize("value", [1e14, 1e-14])
def test_variances_within_the_supported_range_fuse_to_finite_components(value):
    rng = np.random.default_rng(0)
    clients = [DiagNormal(loc=rng.normal(size=(4, 5)), var=rng.uniform(0.9, 1.0, size=(4, 5))) for _ in range(3)]
    var = clients[1].var.copy()
    var[2, 3] = value
    clients[1] = DiagNormal(loc=clients[1].loc, var=var)
    result = kl_fuse(clients)
    assert np.isfinite(result.components.var).all() and np.isfinite(result.components.loc).all()


@pytest.mark.parametrize("value", [1e18, 1e300, 1e-18])
def test_variances_beyond_it_are_refused_naming_client_component_and_value(value):
    # unchecked, 1e18 or 1e-18 beside variances near 1 ended in "matrix contains invalid numeric entries"
    clients = [DiagNormal(loc=np.zeros((4, 5)), var=np.ones((4, 5))) for _ in range(3)]
    var = np.ones((4, 5))
    var[2, 3] = value
    clients[1] = DiagNormal(loc=np.zeros((4, 5)), var=var)
    with pytest.raises(
        ValueError,
        match=rf"client 1's variance {re.escape(f'{value:g}')} \(component 2, coordinate 3\) is "
        rf".* than the clients' median variance 1: kl_fuse needs",
    ):
        kl_fuse(clients)
    assert klfusion.MAX_VARIANCE_RATIO == 1e15


def test_greedy_assign_refuses_a_negative_number_of_sweeps():
    posteriors, _ = _clients(seed=0, n_true=3, sizes=(3, 3), noise=0.05, var_spread=0.3)
    pooled = DiagNormal.concat(posteriors)
    with pytest.raises(ValueError, match="sweeps must be"):
        greedy_assign(DiagNormal, pooled.event_shape, pooled.kl_terms(), [3, 3], 0.1, 1.0, sweeps=-1)
