"""Data-free ("auto") hyper-parameters: empirical Bayes on federations simulated from the BBP model."""

import numpy as np
import pytest

from bayesfuse.inference.empirical_bayes import (
    BlockHyper,
    _block_marginal,
    _summarise,
    atom_posterior,
    atom_statistics,
    em_step,
    em_update,
    initial_hyper,
    maximise_hyper,
)
from bayesfuse.inference.matching import _partition_key, log_marginal_posterior, match_neurons
from bayesfuse.metrics import assignment_accuracy
from bayesfuse.models.bbp import simulate_federation

# (J, D, gamma0, prior_var, noise_var, seed): small to moderate noise, one atom scale.
CASES = [
    (10, 40, 8.0, 1.0, 0.01, 0),
    (10, 40, 8.0, 1.0, 0.1, 1),
    (8, 20, 6.0, 1.0, 0.05, 2),
    (10, 100, 10.0, 2.0, 0.3, 3),
    (20, 30, 5.0, 1.0, 0.02, 4),
]


@pytest.mark.parametrize("case", CASES, ids=[f"J{c[0]}-D{c[1]}-s2={c[4]}" for c in CASES])
def test_auto_recovers_the_noise_variance_and_the_assignments(case):
    # Tolerance: given the true assignments the noise estimate pools n = sum_j L_j * D residual
    # coordinates (here n >= 2,000), so its relative sd is about sqrt(2 / n) <= 3%; 20% is more
    # than 6 sd from the truth, and exact recovery of the assignments is what makes it possible.
    J, D, gamma0, prior_var, noise_var, seed = case
    fed = simulate_federation(J, D, gamma0=gamma0, prior_var=prior_var, noise_var=noise_var, seed=seed)
    res = match_neurons(fed.layers, seed=0)  # every hyper-parameter "auto" by default
    assert res.hyper["auto"] == ["noise_var", "prior_var", "gamma0"]
    assert abs(res.hyper["noise_var"][0] / noise_var - 1) < 0.2
    assert assignment_accuracy(fed.assignments, res.assignments) == 1.0
    assert res.n_global == fed.n_atoms and res.converged


def test_blocks_of_different_scales_get_their_own_variances():
    # Two blocks of coordinates, noise 1e-3 and 0.1 (two orders of magnitude apart, as a
    # layer's incoming weights and its outgoing weights): each estimate lands within 20%.
    fed = simulate_federation(10, 60, gamma0=6.0, prior_var=1.0, noise_var=0.001, seed=5)
    rng = np.random.default_rng(5)
    layers = [v.copy() for v in fed.layers]
    for v in layers:
        v[:, 30:] += rng.normal(scale=np.sqrt(0.1 - 0.001), size=v[:, 30:].shape)
    blocks = np.repeat([0, 1], 30)
    res = match_neurons(layers, blocks=blocks, seed=0)
    est = np.array(res.hyper["noise_var"])
    assert np.all(np.abs(est / [0.001, 0.1] - 1) < 0.2), est
    assert assignment_accuracy(fed.assignments, res.assignments) == 1.0


def test_an_em_step_never_lowers_the_marginal_given_the_assignments():
    # EM's monotonicity, checked against the independent log_marginal_posterior.
    fed = simulate_federation(6, 12, gamma0=4.0, prior_var=1.0, noise_var=0.05, seed=7)
    J, D = len(fed.layers), fed.layers[0].shape[1]
    blocks = np.repeat([0, 1, 2], 4)
    weights = np.ones((J, D))
    hyper = initial_hyper(fed.layers, blocks, weights, np.zeros(D))

    def objective(h: BlockHyper) -> float:
        noise, prior, mean = h.expand(blocks, weights)
        return log_marginal_posterior(
            fed.layers, fed.assignments, noise_var=noise, prior_var=prior, prior_mean=mean, gamma0=h.gamma0
        )

    values = [objective(hyper)]
    for _ in range(6):
        hyper = em_step(fed.layers, fed.assignments, blocks, weights, hyper)
        values.append(objective(hyper))
    assert np.all(np.diff(values) >= -1e-8 * np.abs(values[:-1])), values


def test_fixed_values_stay_and_the_rest_is_estimated():
    fed = simulate_federation(8, 20, gamma0=5.0, prior_var=1.0, noise_var=0.05, seed=8)
    res = match_neurons(fed.layers, noise_var=0.05, gamma0=5.0, seed=0)
    assert res.hyper["auto"] == ["prior_var"] and res.hyper["noise_var"] == [0.05] and res.hyper["gamma0"] == 5.0
    assert abs(res.hyper["prior_var"][0] - 1.0) < 0.5  # sd of a variance from ~20 atoms x 20 coordinates


def test_relative_precision_zero_means_unobserved():
    # Client 0 observes nothing on the last coordinates: its values there must not matter.
    fed = simulate_federation(5, 10, gamma0=4.0, prior_var=1.0, noise_var=0.01, seed=9)
    w = np.ones((5, 10))
    w[0, 6:] = 0.0
    garbage = [v.copy() for v in fed.layers]
    garbage[0][:, 6:] = 1e3
    a = match_neurons(fed.layers, relative_precision=w, seed=0)
    b = match_neurons(garbage, relative_precision=w, seed=0)
    assert [x.tolist() for x in a.assignments] == [x.tolist() for x in b.assignments]
    np.testing.assert_allclose(a.mean, b.mean, rtol=1e-12)


def test_bad_settings():
    layers = [np.ones((2, 3)), np.zeros((2, 3))]
    with pytest.raises(ValueError, match="noise_var must be a number or one of 'auto'"):
        match_neurons(layers, noise_var="guess")
    with pytest.raises(ValueError, match="blocks must be"):
        match_neurons(layers, blocks=np.array([0, 2, 2]))
    with pytest.raises(ValueError, match="relative_precision must be"):
        match_neurons(layers, relative_precision=-np.ones((2, 3)))
    with pytest.raises(ValueError, match="local_vars=None"):
        match_neurons(layers, local_vars=[np.zeros(2)] * 2)


def _em_step_by_definition(layers, assignments, blocks, weights, hyper, fit):
    """The EM step of the module docstring, from the neurons directly (no sufficient statistics)."""
    J, D = len(layers), layers[0].shape[1]
    B, K = int(blocks.max()) + 1, int(max(a.max() for a in assignments)) + 1
    noise, prior0, mu0 = hyper.expand(blocks, weights)
    with np.errstate(divide="ignore"):
        prec = 1.0 / noise
    lam, h = np.tile(1.0 / prior0, (K, 1)), np.tile(mu0 / prior0, (K, 1))
    for j, a in enumerate(assignments):
        h[a] += layers[j] * prec[j]
        lam[a] += prec[j]
    mean, var = h / lam, 1.0 / lam
    out = BlockHyper(hyper.prior_var.copy(), hyper.noise_var.copy(), hyper.prior_mean.copy(), hyper.gamma0)
    if "noise_var" in fit:
        num, den = np.zeros(D), np.zeros(D)
        for j, a in enumerate(assignments):
            num += (weights[j] * ((layers[j] - mean[a]) ** 2 + var[a])).sum(0)
            den += (weights[j] > 0) * len(a)
        out.noise_var = np.maximum(np.bincount(blocks, num, B) / np.maximum(np.bincount(blocks, den, B), 1), 1e-8)
    if "prior_var" in fit:
        for b in range(B):
            cols = blocks == b
            out.prior_mean[b] = mean[:, cols].mean()
            out.prior_var[b] = max(
                np.sum((mean[:, cols] - out.prior_mean[b]) ** 2 + var[:, cols]) / (K * cols.sum()), 1e-8
            )
    if "gamma0" in fit:
        out.gamma0 = K / np.sum(1.0 / np.arange(1, J + 1))
    return out


@pytest.mark.parametrize("fit", [("noise_var", "prior_var", "gamma0"), ("noise_var",), ("prior_var",)])
def test_em_from_sufficient_statistics_equals_the_definition(fit):
    # Atoms far from the prior mean and clients with unequal (some zero) relative precisions:
    # the one-pass statistics about a shift, and about their own mean, give the direct EM step.
    rng = np.random.default_rng(20)
    J, D = 7, 11
    layers = [5.0 + rng.normal(size=(L, D)) for L in rng.integers(2, 6, size=J)]
    assignments = [rng.permutation(6)[: len(v)] for v in layers]
    used = np.unique(np.concatenate(assignments))
    assignments = [np.searchsorted(used, a) for a in assignments]
    blocks = np.repeat([0, 1, 2], [5, 4, 2])
    weights = rng.uniform(0.3, 2.0, size=(J, D))
    weights[1, :3] = 0.0
    weights[4] = 1.0
    hyper = BlockHyper(
        prior_var=np.array([2.0, 0.5, 1.0]),
        noise_var=np.array([0.3, 0.1, 0.02]),
        prior_mean=np.array([4.0, 5.5, 0.0]),
        gamma0=1.5,
    )
    want = _em_step_by_definition(layers, assignments, blocks, weights, hyper, fit)
    shift = rng.normal(size=(len(used), D)) + 5.0
    for stats in (atom_statistics(layers, assignments, weights), atom_statistics(layers, assignments, weights, shift)):
        got = em_update(stats, blocks, hyper, fit=fit)
        for key in ("noise_var", "prior_var", "prior_mean"):
            np.testing.assert_allclose(getattr(got, key), getattr(want, key), rtol=1e-12)
        assert got.gamma0 == pytest.approx(want.gamma0, rel=1e-14)
    got = em_step(layers, assignments, blocks, weights, hyper, fit=fit)
    np.testing.assert_allclose(got.noise_var, want.noise_var, rtol=1e-12)
    np.testing.assert_allclose(got.prior_var, want.prior_var, rtol=1e-12)


def test_atom_statistics_are_the_weighted_moments():
    rng = np.random.default_rng(21)
    layers = [rng.normal(size=(3, 4)), rng.normal(size=(2, 4)), rng.normal(size=(3, 4))]
    assignments = [np.array([0, 1, 2]), np.array([2, 0]), np.array([1, 3, 0])]
    weights = rng.uniform(0.5, 2.0, size=(3, 4))
    weights[2, 1] = 0.0
    stats = atom_statistics(layers, assignments, weights, shift=rng.normal(size=(4, 4)))
    scatter = np.zeros(4)
    for i in range(4):
        rows = [(layers[j][l], weights[j]) for j, a in enumerate(assignments) for l, k in enumerate(a) if k == i]
        v, w = np.array([r for r, _ in rows]), np.array([w for _, w in rows])
        total = w.sum(0)
        mean = np.where(total > 0, (w * v).sum(0) / np.where(total > 0, total, 1), 0.0)
        np.testing.assert_allclose(stats.weight[i], total, rtol=1e-14)
        np.testing.assert_allclose(stats.mean[i], mean, rtol=1e-12, atol=1e-15)
        scatter += (w * (v - mean) ** 2).sum(0)
        assert stats.counts[i] == len(rows)
    np.testing.assert_allclose(stats.scatter, scatter, rtol=1e-10, atol=1e-15)  # summed over the atoms
    np.testing.assert_array_equal(stats.n_seen, ((weights > 0) * [[3], [2], [3]]).sum(0))


def _weighted_federation(seed: int):
    """Atoms away from the prior mean, clients with unequal (some zero) relative precisions, three blocks."""
    rng = np.random.default_rng(seed)
    J, D, K = 6, 9, 7
    atoms = 3.0 + rng.normal(size=(K, D))
    assignments = [np.sort(rng.permutation(K)[: rng.integers(2, 6)]) for _ in range(J)]
    layers = [atoms[a] + 0.3 * rng.normal(size=(len(a), D)) for a in assignments]
    used = np.unique(np.concatenate(assignments))
    assignments = [np.searchsorted(used, a) for a in assignments]
    blocks = np.repeat([0, 1, 2], [4, 3, 2])
    weights = rng.uniform(0.3, 2.0, size=(J, D))
    weights[1, :3] = 0.0
    weights[:, 4:7] = 1.0  # block 1: one weight per atom (the fast grouping path)
    weights[2, 4:7] = 0.0
    return layers, assignments, blocks, weights


def _log_marginal(layers, assignments, blocks, weights, hyper: BlockHyper) -> float:
    noise, prior, mean = hyper.expand(blocks, weights)
    return log_marginal_posterior(
        layers, assignments, noise_var=noise, prior_var=prior, prior_mean=mean, gamma0=hyper.gamma0
    )


def test_block_marginal_differences_are_those_of_the_log_marginal_posterior():
    # The summarised objective drops only terms free of (s, s0, mu0): moving one block's
    # values changes it by exactly what log_marginal_posterior (atoms integrated out from the
    # neurons themselves) changes by. Round-off: a few ulps of |log p| ~ 1e2.
    layers, assignments, blocks, weights = _weighted_federation(30)
    stats = atom_statistics(layers, assignments, weights)
    base = BlockHyper(
        prior_var=np.array([1.0, 0.5, 2.0]),
        noise_var=np.array([0.1, 0.2, 0.05]),
        prior_mean=np.array([3.0, 2.5, 0.0]),
        gamma0=2.0,
    )
    rng = np.random.default_rng(31)
    both = np.array([True, True])
    for b in range(3):
        summary = _summarise(stats, np.flatnonzero(blocks == b))
        for _ in range(4):
            moved = BlockHyper(base.prior_var.copy(), base.noise_var.copy(), base.prior_mean.copy(), base.gamma0)
            moved.noise_var[b] *= rng.uniform(0.3, 3.0)
            moved.prior_var[b] *= rng.uniform(0.3, 3.0)
            moved.prior_mean[b] += rng.normal()
            f = [
                -_block_marginal(
                    np.log([h.noise_var[b], h.prior_var[b]]), both, np.zeros(2), summary, float(h.prior_mean[b])
                )[0]
                for h in (base, moved)
            ]
            want = _log_marginal(layers, assignments, blocks, weights, moved) - _log_marginal(
                layers, assignments, blocks, weights, base
            )
            assert f[1] - f[0] == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_block_marginal_gradient_is_the_derivative():
    layers, assignments, blocks, weights = _weighted_federation(32)
    stats = atom_statistics(layers, assignments, weights)
    both = np.array([True, True])
    for b in range(3):
        summary = _summarise(stats, np.flatnonzero(blocks == b))
        x = np.log([0.07, 0.8])
        grad = _block_marginal(x, both, np.zeros(2), summary, 2.0)[1]
        # central differences: truncation O(eps^2) ~ 1e-12, round-off ~ 1e-16 |f| / eps ~ 1e-8
        eps = 1e-6
        fd = [
            (
                _block_marginal(x + e, both, np.zeros(2), summary, 2.0)[0]
                - _block_marginal(x - e, both, np.zeros(2), summary, 2.0)[0]
            )
            / (2 * eps)
            for e in np.eye(2) * eps
        ]
        np.testing.assert_allclose(grad, fd, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fit", [("noise_var", "prior_var", "gamma0"), ("noise_var",), ("prior_var",)])
def test_maximise_hyper_is_where_em_converges_and_no_em_step_climbs_higher(fit):
    # EM's fixed points are the stationary points of the marginal: 3000 EM steps from the same
    # start reach the direct maximiser (EM's remaining error decays geometrically; 1e-4 is far
    # above what is left after 3000 steps here and far below the moves EM makes early on), and
    # one more EM step from the maximiser cannot raise the marginal.
    layers, assignments, blocks, weights = _weighted_federation(33)
    stats = atom_statistics(layers, assignments, weights)
    start = BlockHyper(
        prior_var=np.array([2.0, 0.5, 1.0]),
        noise_var=np.array([0.3, 0.1, 0.02]),
        prior_mean=np.array([2.0, 2.5, 0.0]),
        gamma0=1.5,
    )
    best = maximise_hyper(stats, blocks, start, fit=fit)
    em = start
    for _ in range(3000):
        em = em_update(stats, blocks, em, fit=fit)
    for key in ("noise_var", "prior_var", "prior_mean"):
        np.testing.assert_allclose(getattr(best, key), getattr(em, key), rtol=1e-4)
    assert best.gamma0 == pytest.approx(em.gamma0, rel=1e-14)
    top = _log_marginal(layers, assignments, blocks, weights, best)
    assert _log_marginal(layers, assignments, blocks, weights, em_update(stats, blocks, best, fit=fit)) <= top + 1e-9
    assert _log_marginal(layers, assignments, blocks, weights, start) < top
    if "noise_var" not in fit:
        np.testing.assert_array_equal(best.noise_var, start.noise_var)
    if "prior_var" not in fit:
        np.testing.assert_array_equal(best.prior_var, start.prior_var)
        np.testing.assert_array_equal(best.prior_mean, start.prior_mean)


def test_maximise_hyper_keeps_the_noise_when_no_atom_has_two_neurons():
    # Singleton atoms identify only s0 + s: the noise stays where it was (no slide to 0).
    rng = np.random.default_rng(34)
    layers = [rng.normal(size=(3, 5)), rng.normal(size=(2, 5))]
    assignments = [np.array([0, 1, 2]), np.array([3, 4])]
    weights = np.ones((2, 5))
    blocks = np.zeros(5, dtype=np.int64)
    start = initial_hyper(layers, blocks, weights, np.zeros(5))
    best = maximise_hyper(atom_statistics(layers, assignments, weights), blocks, start)
    assert best.noise_var[0] == start.noise_var[0]
    assert best.prior_var[0] != start.prior_var[0]


def test_auto_rounds_climb_and_end_at_a_fixed_point():
    # Coordinate ascent on log p(V, B | theta): the objective after each round's sweep never
    # falls (each Hungarian step and each maximisation raise it; 1e-9 relative allows the
    # round-off of sums of ~1e3 terms), and at the end the reported hyper-parameters are the
    # maximiser for the final assignments (to the optimiser's tolerance), which a sweep under
    # them leaves unchanged.
    fed = simulate_federation(10, 30, gamma0=6.0, prior_var=1.0, noise_var=0.2, seed=11)
    blocks = np.repeat([0, 1], 15)
    res = match_neurons(fed.layers, blocks=blocks, seed=0)
    assert res.converged and res.n_sweeps == len(res.objective) == res.hyper["rounds"]
    obj = np.array(res.objective)
    assert np.all(np.diff(obj) >= -1e-9 * np.abs(obj[:-1])), obj
    weights = np.ones((10, 30))
    hyper = BlockHyper(
        np.array(res.hyper["prior_var"]),
        np.array(res.hyper["noise_var"]),
        np.array(res.hyper["prior_mean"]),
        res.hyper["gamma0"],
    )
    again = maximise_hyper(atom_statistics(fed.layers, res.assignments, weights), blocks, hyper)
    for key in ("noise_var", "prior_var", "prior_mean"):
        np.testing.assert_allclose(getattr(again, key), getattr(hyper, key), rtol=1e-5, atol=1e-9)
    assert again.gamma0 == pytest.approx(hyper.gamma0, rel=1e-12)
    noise, prior, mean = hyper.expand(blocks, weights)
    fixed = match_neurons(
        fed.layers,
        noise_var=noise,
        prior_var=prior,
        prior_mean=mean,
        gamma0=hyper.gamma0,
        cost="marginal",
        init=res.assignments,
        seed=1,
    )
    assert fixed.n_sweeps == 1 and _partition_key(fixed.assignments) == _partition_key(res.assignments)


def test_blocked_statistics_and_in_place_posterior_are_the_same_numbers():
    # Blocks of coordinates run the same operations per coordinate, so the results are equal
    # bit for bit, with and without a shift; overwrite=True writes the same h and lambda.
    layers, assignments, blocks, weights = _weighted_federation(35)
    K, D = int(max(a.max() for a in assignments)) + 1, layers[0].shape[1]
    shift = 3.0 + np.random.default_rng(36).normal(size=(K, D))
    for s in (None, shift):
        whole = atom_statistics(layers, assignments, weights, s)
        for max_elements in (1, K * 2, K * 4 + 1):
            part = atom_statistics(layers, assignments, weights, s, max_elements=max_elements)
            for key in ("weight", "mean", "scatter", "counts", "n_seen"):
                np.testing.assert_array_equal(getattr(part, key), getattr(whole, key))
    hyper = BlockHyper(
        prior_var=np.array([2.0, 0.5, 1.0]),
        noise_var=np.array([0.3, 0.1, 0.02]),
        prior_mean=np.array([2.0, 2.5, 0.0]),
        gamma0=1.5,
    )
    want = atom_posterior(atom_statistics(layers, assignments, weights), blocks, hyper)
    got = atom_posterior(atom_statistics(layers, assignments, weights), blocks, hyper, overwrite=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_maximise_hyper_from_the_variance_floor_stays_finite():
    # A prior variance at the floor sits in the basin of the degenerate maximum s0 -> 0 (all
    # spread as noise) and puts a steep gradient on log s0: the search is bounded above, so no
    # trial step overflows, and its second start (the moments) finds what a start at 1 finds.
    layers, assignments, blocks, weights = _weighted_federation(37)
    stats = atom_statistics(layers, assignments, weights)
    start = BlockHyper(
        prior_var=np.full(3, 1e-8), noise_var=np.array([0.3, 0.1, 0.02]), prior_mean=np.zeros(3), gamma0=1.5
    )
    best = maximise_hyper(stats, blocks, start)
    other = maximise_hyper(stats, blocks, BlockHyper(np.ones(3), np.full(3, 0.1), np.zeros(3), 1.5))
    assert np.all(np.isfinite(best.prior_var)) and np.all(np.isfinite(best.noise_var))
    for key in ("noise_var", "prior_var", "prior_mean"):
        np.testing.assert_allclose(getattr(best, key), getattr(other, key), rtol=1e-4)
