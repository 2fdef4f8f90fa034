"""The dual certificate of benchmarks/bench_wide_floor.py (in benchmarks/common.py) against brute
force on tiny matchings."""

import itertools

import numpy as np
import pytest

from benchmarks.common import optimal_duals


def _best_matching(W: np.ndarray) -> tuple[float, np.ndarray]:
    """Every partial matching of neurons (columns) to atoms (rows), the heaviest one."""
    G, L = W.shape
    best, best_match = -1.0, None
    for match in itertools.product(range(-1, G), repeat=L):
        taken = [i for i in match if i >= 0]
        if len(taken) != len(set(taken)):
            continue
        value = sum(W[i, l] for l, i in enumerate(match) if i >= 0)
        if value > best:
            best, best_match = value, np.array(match)
    return best, best_match


def _worth(W, match):
    return W[match[match >= 0], np.flatnonzero(match >= 0)].sum()


@pytest.mark.parametrize("seed", range(40))
def test_duals_of_the_best_matching_are_feasible_and_worth_exactly_its_weight(seed):
    rng = np.random.default_rng(seed)
    G, L = rng.integers(1, 5, size=2)
    W = np.maximum(rng.normal(size=(G, L)), 0.0)
    best, match = _best_matching(W)
    u, w = optimal_duals(W, match)
    assert np.all(u >= 0) and np.all(w >= 0)
    assert np.all(u[None, :] + w[:, None] >= W - 1e-12)
    assert u.sum() + w.sum() == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_a_worse_matching_gets_no_certificate(seed):
    rng = np.random.default_rng(100 + seed)
    G, L = rng.integers(2, 5, size=2)
    W = rng.exponential(size=(G, L))  # every pair weighs something: the best matching has pairs
    best, match = _best_matching(W)
    worse = match.copy()
    worse[np.flatnonzero(match >= 0)[0]] = -1  # give up one pair of the best: strictly less weight
    try:
        u, w = optimal_duals(W, worse)
    except ValueError:
        return
    assert u.sum() + w.sum() > _worth(W, worse) + 1e-12
