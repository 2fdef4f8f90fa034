"""The relaxed assignment problem of KL-fusion: the fast solver against cvxpy and brute force."""

import itertools

import numpy as np
import pytest

from bayesfuse.inference.relaxed import relaxed_objective, solve_relaxed


@pytest.mark.parametrize(
    "sizes, g, reg",
    [
        ((3, 4, 2), 6, 0.1),
        ((5, 5, 5), 10, 0.5),
        ((4, 6), 8, 1.0),
        ((10, 8, 12, 9), 25, 0.1),
        ((10, 8, 12, 9), 25, 1.0),
        ((1,), 3, 0.2),
    ],
)
def test_fast_solver_reaches_the_cvxpy_optimum(sizes, g, reg):
    rng = np.random.default_rng(len(sizes) * 100 + g)
    costs = [rng.exponential(size=(L, g)) for L in sizes]
    p_cvx, name = solve_relaxed(costs, reg, solver="cvxpy")
    p_fast, used = solve_relaxed(costs, reg, solver="fast")
    assert name.startswith("cvxpy:") and used == "fast"
    for p in p_fast:  # feasible
        assert (p >= 0).all()
        np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-8)
        assert (p.sum(0) <= 1 + 1e-8).all()
    oc, of = relaxed_objective(costs, p_cvx, reg), relaxed_objective(costs, p_fast, reg)
    assert abs(of - oc) <= 1e-3 * abs(oc)


def _binary_candidates(sizes, g):
    per_client = [list(itertools.permutations(range(g), L)) for L in sizes]
    return itertools.product(*per_client)


def test_relaxation_against_brute_force_over_binary_assignments():
    rng = np.random.default_rng(3)
    sizes, g, reg = (2, 2), 3, 0.05
    costs = [rng.exponential(size=(L, g)) for L in sizes]
    best = np.inf
    for choice in _binary_candidates(sizes, g):
        P = [np.eye(g)[list(c)] for c in choice]
        best = min(best, relaxed_objective(costs, P, reg))
    P, _ = solve_relaxed(costs, reg, solver="cvxpy")
    relaxed = relaxed_objective(costs, P, reg)
    assert relaxed <= best + 1e-6  # a relaxation never does worse
    # Here the relaxed optimum is binary and so is the brute-force optimum.
    assert np.allclose(np.vstack(P), np.round(np.vstack(P)), atol=1e-5)
    assert relaxed == pytest.approx(best, abs=1e-5)


@pytest.mark.parametrize("seed, reg", [(0, 0.1), (1, 0.5), (2, 2.0), (3, 0.1)])
def test_fast_solver_warm_started_from_the_greedy_start_reaches_the_cvxpy_optimum(seed, reg):
    # The path kl_fuse takes by default: N x G costs KL(greedy barycenters || local) / scale
    # with G < N (plus margin columns), the fast solver warm-started from the greedy one-hot P.
    from bayesfuse.inference.expfam import DiagNormal
    from bayesfuse.inference.klfusion import _split, greedy_start

    rng = np.random.default_rng(seed)
    n_true, dim = 12, 3
    loc, var = rng.normal(size=(n_true, dim)) * 2, rng.uniform(0.05, 0.5, size=(n_true, dim))
    clients = []
    for size in (6, 9, 4, 8, 7):
        idx = rng.choice(n_true, size, replace=False)
        clients.append(DiagNormal(loc=loc[idx] + 0.5 * rng.normal(size=(size, dim)), var=var[idx]))
    pooled = DiagNormal.concat(clients)
    sizes = [len(q) for q in clients]
    scale = pooled.kl_std(pooled)
    glob, warm = greedy_start(pooled, pooled.kl_terms(), sizes, reg, scale)
    assert len(glob) < len(pooled)
    costs = _split(glob.kl(pooled).T / scale, sizes)
    p_cvx, _ = solve_relaxed(costs, reg, solver="cvxpy")
    p_fast, used = solve_relaxed(costs, reg, solver="fast", init=warm)
    assert used == "fast"
    for p in p_fast:
        assert (p >= 0).all()
        np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-8)
        assert (p.sum(0) <= 1 + 1e-8).all()
    oc, of = relaxed_objective(costs, p_cvx, reg), relaxed_objective(costs, p_fast, reg)
    assert abs(of - oc) <= 1e-3 * abs(oc)


def test_client_column_projection_is_the_blockwise_projection():
    from bayesfuse.inference.relaxed import _project_client_columns, _project_rows_to_simplex

    rng = np.random.default_rng(4)
    sizes = [3, 1, 5, 4]
    starts = np.cumsum([0, *sizes])
    Y = rng.normal(0.2, 0.5, size=(sum(sizes), 6))
    X = _project_client_columns(Y, starts)
    for a, b in zip(starts[:-1], starts[1:]):
        block, want = Y[a:b], np.maximum(Y[a:b], 0.0)
        over = want.sum(0) > 1
        want[:, over] = _project_rows_to_simplex(block[:, over].T).T
        np.testing.assert_array_equal(X[a:b], want)
        assert (X[a:b] >= 0).all() and (X[a:b].sum(0) <= 1 + 1e-12).all()
    assert (X.sum(0) > 1).any()  # some columns were over capacity: the simplex branch ran
    # the projection: no feasible point is closer (random feasible points, per block)
    for a, b in zip(starts[:-1], starts[1:]):
        for _ in range(50):
            Z = rng.dirichlet(np.ones(b - a + 1), size=6).T[: b - a] * rng.uniform(0, 1, 6)
            assert np.sum((Y[a:b] - Z) ** 2) >= np.sum((Y[a:b] - X[a:b]) ** 2) - 1e-12


def test_warm_state_continues_the_solve():
    from bayesfuse.inference.relaxed import ADMMState

    rng = np.random.default_rng(8)
    costs = [rng.exponential(size=(L, 12)) for L in (5, 7, 6)]
    state = ADMMState()
    P, _ = solve_relaxed(costs, 0.3, solver="fast", state=state)
    assert state.dual.shape == (3, 18, 12) and state.iterations > 5
    again, _ = solve_relaxed(costs, 0.3, solver="fast", init=P, state=state)
    assert state.iterations <= 2  # already at the fixed point
    p_cvx, _ = solve_relaxed(costs, 0.3, solver="cvxpy", state=state)
    assert state.dual is None and state.iterations == 0
    oc = relaxed_objective(costs, p_cvx, 0.3)
    assert abs(relaxed_objective(costs, again, 0.3) - oc) <= 1e-3 * oc
