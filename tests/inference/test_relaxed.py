"""The relaxed assignment problem of KL-fusion: the fast solver against cvxpy and brute force."""

import itertools

import numpy as np
import pytest

from bayesfuse.inference.relaxed import relaxed_objective, solve_relaxed


@pytest.mark.parametrize("sizes, g, reg", [((3, 4, 2), 6, 0.1), ((5, 5, 5), 10, 0.5), ((4, 6), 8, 1.0),
                                           ((10, 8, 12, 9), 25, 0.1), ((10, 8, 12, 9), 25, 1.0), ((1,), 3, 0.2)])
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
