"""The assignment problems match_neurons reports to recording_assignments: solved again by
solve_assignment they give the recorded optima, and recording changes nothing."""

import numpy as np

from bayesfuse.inference.matching import match_neurons, recording_assignments, solve_assignment
from bayesfuse.models.bbp import simulate_federation


def _federation():
    return simulate_federation(4, 12, gamma0=6.0, prior_var=1.0, noise_var=0.05, seed=3)


def test_recorded_problems_solve_to_the_recorded_optima_and_change_nothing():
    fed = _federation()
    plain = match_neurons(fed.layers, seed=0)
    problems = []
    with recording_assignments(lambda v, R, a, steps: problems.append((v, R.copy(), a, steps))):
        recorded = match_neurons(fed.layers, seed=0)
    assert problems
    assert all(np.array_equal(x, y) for x, y in zip(plain.assignments, recorded.assignments))
    np.testing.assert_array_equal(plain.mean, recorded.mean)
    for v, R, a, steps in problems:
        assert R.shape == (R.shape[0], len(v)) and a.shape == (len(v),)
        again, _ = solve_assignment(R, steps)
        np.testing.assert_array_equal(again, a)


def test_no_callback_is_left_installed():
    fed = _federation()
    seen = []
    with recording_assignments(lambda *args: seen.append(1)):
        pass
    match_neurons(fed.layers, seed=0)
    assert seen == []
