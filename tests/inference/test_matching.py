import itertools
import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats
from scipy.optimize import linear_sum_assignment

from bayesfuse.inference import matching
from bayesfuse.inference.empirical_bayes import BlockHyper, atom_posterior, atom_statistics
from bayesfuse.inference.matching import (
    _assign,
    _assign_negative,
    _cost_blocks,
    _data_constant,
    _Groups,
    _negative_pairs,
    _objective,
    _posterior_stats,
    _setup,
    assignment_cost,
    log_marginal_posterior,
    match_neurons,
)
from bayesfuse.models.bbp import simulate_federation
from tests.helpers import partition as _partition


def _kl_gauss_diag(mu_x, var_x, mu_y, var_y):
    """NAFI Lemma 5.1 with full matrices (independent of the vectorised code)."""
    sx, sy = np.diag(var_x), np.diag(var_y)
    sy_inv = np.linalg.inv(sy)
    d = mu_y - mu_x
    return 0.5 * (
        np.trace(sy_inv @ sx) + d @ sy_inv @ d - len(mu_x) + np.linalg.slogdet(sy)[1] - np.linalg.slogdet(sx)[1]
    )


def _loop_cost(v, p, h, lam, m, prior, J, cost, kl_weight):
    """The cost of PFNM supplement Prop. 2 / the marginal change / NAFI eq. 14, entry by entry."""
    L, D = v.shape
    G = len(m)
    atoms = [(h[i], np.broadcast_to(lam[i], (D,)), m[i]) for i in range(G)]
    h0, lam0 = prior.h0, np.broadcast_to(prior.lam0, (D,))
    out = np.zeros((L, G + L))
    for l in range(L):
        pd = np.broadcast_to(p[l if len(p) > 1 else 0], (D,))
        for col in range(G + L):
            hi, li, mi = atoms[col] if col < G else (h0, lam0, None)
            new_h, new_l = hi + pd * v[l], li + pd
            quad = np.sum(new_h**2 / new_l) - np.sum(hi**2 / li)
            if cost == "pfnm":
                prior_term = (
                    2 * math.log(mi / (J - mi))
                    if col < G
                    else 2 * math.log(prior.gamma0 / J) - 2 * math.log(col - G + 1)
                )
                score = quad + prior_term
            else:
                prior_term = math.log(mi / (J - mi)) if col < G else math.log(prior.gamma0 / J)
                score = 0.5 * quad - 0.5 * np.sum(np.log(new_l / li)) + prior_term
            kl = _kl_gauss_diag(hi / li, 1 / li, new_h / new_l, 1 / new_l)
            out[l, col] = -score + kl_weight * kl
    return out


@pytest.mark.parametrize("cost", ["pfnm", "marginal"])
@pytest.mark.parametrize("per_entry", [False, True])
@pytest.mark.parametrize("per_neuron", [False, True])
@pytest.mark.parametrize("kl_weight", [0.0, 0.7])
def test_cost_matrix_equals_loop_formula(cost, per_entry, per_neuron, kl_weight):
    rng = np.random.default_rng(0)
    J, D = 4, 5
    layers = [rng.normal(size=(L, D)) for L in (3, 4, 2, 3)]
    noise = rng.uniform(0.2, 2.0, size=(J, D)) if per_entry else [0.5, 1.0, 2.0, 0.7]
    prior_var = rng.uniform(1, 3, size=D) if per_entry else 2.0
    local_vars = None
    if per_neuron:  # each neuron's own variance: per entry, or one per neuron
        local_vars = [rng.uniform(0, 1, size=v.shape if per_entry else len(v)) for v in layers]
    layers_c, prec, prior = _setup(layers, noise, prior_var, rng.normal(size=D), 1.5, local_vars)
    others = [np.array([0, 1, 2]), np.array([2, 0, 3, 1]), None, np.array([4, 0, 1])]
    h, lam, m = _posterior_stats(layers_c, prec, others, 5, prior)
    got = assignment_cost(layers_c[2], prec[2], h, lam, m, prior, cost=cost, kl_weight=kl_weight)
    want = _loop_cost(layers_c[2], prec[2], h, lam, m, prior, J, cost, kl_weight)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def _candidates(n_neurons, n_existing):
    """Every way to give n neurons distinct existing atoms or new ones (-1)."""
    for choice in itertools.product(range(-1, n_existing), repeat=n_neurons):
        used = [c for c in choice if c >= 0]
        if len(used) == len(set(used)):
            yield choice


def _with_client(others, j, choice, n_existing):
    new = iter(range(n_existing, n_existing + len(choice)))
    a = np.array([c if c >= 0 else next(new) for c in choice])
    out = list(others)
    out[j] = a
    return out


def test_marginal_cost_is_the_exact_conditional_log_posterior():
    # For every possible assignment of client j, the summed cost equals minus the log
    # posterior up to one constant: the Hungarian step is exact coordinate ascent.
    rng = np.random.default_rng(1)
    layers = [rng.normal(size=(L, 2)) for L in (2, 3, 2)]
    hyper = dict(noise_var=0.3, prior_var=2.0, gamma0=1.3)
    others = [np.array([0, 1]), np.array([1, 2, 0]), None]
    layers_c, prec, prior = _setup(layers, hyper["noise_var"], hyper["prior_var"], 0.0, hyper["gamma0"])
    h, lam, m = _posterior_stats(layers_c, prec, others, 3, prior)
    C = assignment_cost(layers_c[2], prec[2], h, lam, m, prior, cost="marginal")
    diffs = []
    for choice in _candidates(2, 3):
        cols, k = [], 0
        for c in choice:
            cols.append(c if c >= 0 else 3 + k)
            k += c < 0
        total_cost = C[np.arange(2), cols].sum()
        logpost = log_marginal_posterior(layers, _with_client(others, 2, choice, 3), **hyper)
        diffs.append(total_cost + logpost)
    np.testing.assert_allclose(diffs, diffs[0], rtol=0, atol=1e-9)


def test_two_clients_global_optimum_by_brute_force():
    # With J = 2 every structure is client 1's partial matching to client 0's neurons.
    rng = np.random.default_rng(2)
    atoms = rng.normal(size=(4, 3))
    layers = [atoms[[0, 1, 2]] + 0.3 * rng.normal(size=(3, 3)), atoms[[2, 3, 0]] + 0.3 * rng.normal(size=(3, 3))]
    hyper = dict(noise_var=0.1, prior_var=1.0, gamma0=1.0)
    best = max(
        log_marginal_posterior(layers, _with_client([np.arange(3), None], 1, c, 3), **hyper) for c in _candidates(3, 3)
    )
    res = match_neurons(layers, cost="marginal", seed=0, **hyper)
    assert res.objective[-1] == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("cost", ["marginal", "pfnm"])
def test_capped_two_clients_is_the_best_one_to_one_matching_by_brute_force(cost):
    """With ``capacity`` the clients' width, two clients of 4 units fill 4 atoms one to one (a
    width the network's forward fixes), though the free matching opens more atoms; with the
    marginal cost the result is the best of the 4! pairings under the collapsed log posterior
    (J = 2, so the pairings are every structure there is)."""
    rng = np.random.default_rng(5)
    atoms = rng.normal(size=(6, 3))
    layers = [atoms[[0, 1, 2, 3]] + 0.3 * rng.normal(size=(4, 3)), atoms[[2, 4, 5, 0]] + 0.3 * rng.normal(size=(4, 3))]
    hyper = dict(noise_var=0.1, prior_var=1.0, gamma0=1.0)
    pairings = [[np.arange(4), np.array(p)] for p in itertools.permutations(range(4))]
    best = max(pairings, key=lambda a: log_marginal_posterior(layers, a, **hyper))
    res = match_neurons(layers, cost=cost, seed=0, capacity=4, **hyper)
    assert res.n_global == 4 and res.hyper["capacity"] == 4 and match_neurons(layers, seed=0, **hyper).n_global > 4
    assert [sorted(a) for a in res.assignments] == [[0, 1, 2, 3]] * 2
    if cost == "marginal":  # coordinate ascent on that posterior; the PFNM cost optimises another criterion
        pairs = {(int(x), int(y)) for x, y in zip(np.argsort(res.assignments[0]), np.argsort(res.assignments[1]))}
        assert pairs == set(zip(best[0].tolist(), best[1].tolist()))
    auto = match_neurons(layers, seed=0, capacity=4)  # empirical Bayes holds the cap through its rounds
    assert auto.n_global == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_result_is_coordinatewise_optimal(seed):
    rng = np.random.default_rng(seed)
    layers = [rng.normal(size=(L, 2)) for L in (2, 3, 2, 2)]
    hyper = dict(noise_var=0.5, prior_var=1.0, gamma0=1.0)
    res = match_neurons(layers, cost="marginal", seed=seed, **hyper)
    final = log_marginal_posterior(layers, res.assignments, **hyper)
    assert final == pytest.approx(res.objective[-1], rel=1e-12)
    for j in range(len(layers)):
        others = [a.copy() for a in res.assignments]
        others[j] = None
        # relabel the others' atoms to 0..G'-1
        used = np.unique(np.concatenate([a for a in others if a is not None]))
        relabel = {int(u): i for i, u in enumerate(used)}
        others = [None if a is None else np.array([relabel[int(x)] for x in a]) for a in others]
        for choice in _candidates(len(layers[j]), len(used)):
            alt = log_marginal_posterior(layers, _with_client(others, j, choice, len(used)), **hyper)
            assert alt <= final + 1e-9


def test_objective_never_decreases_for_marginal_cost():
    fed = simulate_federation(8, 6, gamma0=4.0, prior_var=1.0, noise_var=0.3, seed=4)
    res = match_neurons(fed.layers, noise_var=0.3, prior_var=1.0, gamma0=4.0, cost="marginal", n_iter=20, seed=0)
    assert res.n_sweeps >= 3  # a real alternation happened
    assert np.all(np.diff(res.objective) >= -1e-9 * abs(res.objective[0]))


@pytest.mark.parametrize("cost, noise_var", [("marginal", 0.01), ("pfnm", 1.0)])
def test_recovers_simulated_atoms(cost, noise_var):
    fed = simulate_federation(10, 40, gamma0=8.0, prior_var=1.0, noise_var=0.01, seed=0)
    res = match_neurons(fed.layers, noise_var=noise_var, prior_var=1.0, gamma0=8.0, cost=cost, n_iter=5, seed=0)
    assert res.n_global == fed.n_atoms
    assert _partition(res.assignments) == _partition(fed.assignments)
    assert res.converged
    if cost == "marginal":
        # At the true noise the posterior means sit on the atoms: each entry's posterior sd
        # is at most 0.1 (one copy), so 0.5 is a 5-sd bound.
        for a_hat, a_true in zip(res.assignments, fed.assignments):
            np.testing.assert_allclose(res.mean[a_hat], fed.atoms[a_true], atol=0.5)


def test_pfnm_cost_oversplits_at_the_true_noise():
    # PFNM drops the Occam terms: at the true noise variance it opens too many atoms.
    fed = simulate_federation(10, 40, gamma0=8.0, prior_var=1.0, noise_var=0.01, seed=0)
    res = match_neurons(fed.layers, noise_var=0.01, prior_var=1.0, gamma0=8.0, cost="pfnm", n_iter=5, seed=0)
    assert res.n_global > 1.3 * fed.n_atoms


def test_permuting_a_client_permutes_only_its_assignment():
    fed = simulate_federation(5, 8, gamma0=4.0, prior_var=1.0, noise_var=0.05, seed=7)
    perm = np.random.default_rng(0).permutation(len(fed.layers[2]))
    shuffled = list(fed.layers)
    shuffled[2] = fed.layers[2][perm]
    a = match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=4.0, cost="marginal", seed=3)
    b = match_neurons(shuffled, noise_var=0.05, prior_var=1.0, gamma0=4.0, cost="marginal", seed=3)
    unshuffled = list(b.assignments)
    unshuffled[2] = b.assignments[2][np.argsort(perm)]
    assert _partition(unshuffled) == _partition(a.assignments)
    assert a.objective[-1] == pytest.approx(b.objective[-1], rel=1e-12)


def test_client_order_does_not_matter():
    fed = simulate_federation(6, 8, gamma0=4.0, prior_var=1.0, noise_var=0.05, seed=8)
    order = [3, 0, 5, 1, 4, 2]
    a = match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=4.0, seed=0)
    b = match_neurons([fed.layers[j] for j in order], noise_var=0.05, prior_var=1.0, gamma0=4.0, seed=0)
    back = [None] * 6
    for pos, j in enumerate(order):
        back[j] = b.assignments[pos]
    assert _partition(back) == _partition(a.assignments)


def test_single_client_returns_itself():
    rng = np.random.default_rng(3)
    w = rng.normal(size=(7, 4))
    res = match_neurons([w], noise_var=0.5, prior_var=4.0, seed=0)
    assert res.n_global == 7 and res.converged
    # posterior mean of one observation: (0/4 + w/0.5) / (1/4 + 1/0.5)
    np.testing.assert_allclose(res.mean[res.assignments[0]], w * 2.0 / 2.25, rtol=1e-12)
    np.testing.assert_allclose(res.var, 1 / 2.25)


def test_same_seed_same_result():
    fed = simulate_federation(6, 5, gamma0=3.0, prior_var=1.0, noise_var=0.3, seed=2)
    a = match_neurons(fed.layers, noise_var=0.3, prior_var=1.0, gamma0=3.0, kl_weight=0.1, seed=11)
    b = match_neurons(fed.layers, noise_var=0.3, prior_var=1.0, gamma0=3.0, kl_weight=0.1, seed=11)
    for x, y in zip(a.assignments, b.assignments):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.mean, b.mean)
    assert a.objective == b.objective


def test_result_fields_are_consistent():
    fed = simulate_federation(4, 5, gamma0=3.0, prior_var=1.0, noise_var=0.05, seed=1)
    res = match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=3.0)
    counts = np.zeros(res.n_global, dtype=int)
    for j, a in enumerate(res.assignments):
        counts[a] += 1
        assert res.assignment_matrix(j).sum(0).tolist() == [1] * len(a)
    np.testing.assert_array_equal(res.counts, counts)
    assert res.mean.shape == res.var.shape == (res.n_global, 5)
    assert res.hyper["cost"] == "pfnm" and res.seconds > 0
    assert "global atoms" in repr(res)


@pytest.mark.parametrize("kind", ["fixed", "empirical-bayes", "empirical-bayes, then a last matching"])
def test_tol_stops_at_the_first_sweep_that_gains_less_than_tol_per_neuron(kind):
    # The same seed visits the clients in the same order, so the sweeps with tol are those run
    # to the fixed point, up to the first whose gain in log posterior is below tol nats per
    # neuron (481 neurons here; the full run takes 8 and 12 sweeps). With rounds=2 the
    # empirical-Bayes rounds run out and a last matching follows: its first sweep's gain counts
    # against the last round's objective.
    fed = simulate_federation(30, 6, gamma0=10.0, prior_var=1.0, noise_var=0.5, seed=1)
    kw = {
        "fixed": dict(noise_var=0.5, prior_var=1.0, gamma0=10.0, cost="marginal", n_iter=50, seed=0),
        "empirical-bayes": dict(seed=0),
        "empirical-bayes, then a last matching": dict(seed=0, rounds=2, n_iter=50),
    }[kind]
    full = match_neurons(fed.layers, tol=0, **kw)
    assert full.converged and not full.hyper["stopped"]
    # rounds=2: 0.05 is between the rounds' gain (0.27 per neuron) and the last matching's first (0.04)
    tol, n = 0.05 if "last" in kind else 0.01, sum(len(v) for v in fed.layers)
    first = int(np.argmax(np.diff(full.objective) < tol * n))  # the first gain below tol * n
    assert 0 < first < len(full.objective) - 2  # a real early stop
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stop by tol is no failure to converge
        early = match_neurons(fed.layers, tol=tol, **kw)
    assert early.objective == full.objective[: first + 2]
    assert early.n_sweeps == first + 2 and early.converged and early.hyper["stopped"]
    assert early.n_global == len(early.counts)


def test_a_fixed_point_reached_by_a_small_gain_is_no_stop_by_tol():
    # The empirical-Bayes rounds end at a sweep that moves nothing; a tol above that sweep's
    # gain must not call it a stop by tol (the run is the same, and it is the fixed point).
    fed = simulate_federation(30, 6, gamma0=10.0, prior_var=1.0, noise_var=0.5, seed=0)
    full = match_neurons(fed.layers, seed=0, tol=0)
    gains = np.diff(full.objective) / sum(len(v) for v in fed.layers)
    assert full.converged and gains[-1] < gains[:-1].min()
    tol = (gains[-1] + gains[:-1].min()) / 2  # only the last sweep gains less
    again = match_neurons(fed.layers, seed=0, tol=tol)
    assert again.objective == full.objective and again.converged and not again.hyper["stopped"]


def test_the_pfnm_cost_ignores_tol():
    # The PFNM cost does not climb the recorded log posterior, so a gain test on it means nothing.
    fed = simulate_federation(15, 8, gamma0=8.0, prior_var=1.0, noise_var=0.8, seed=1)
    kw = dict(noise_var=1.0, prior_var=1.0, gamma0=8.0, cost="pfnm", n_iter=50, seed=0)
    a, b = match_neurons(fed.layers, tol=None, **kw), match_neurons(fed.layers, tol=1e6, **kw)
    assert a.objective == b.objective and len(a.objective) > 1 and not b.hyper["stopped"]
    auto = dict(cost="pfnm", n_iter=50, seed=0)  # hyper-parameters by empirical Bayes, the PFNM cost
    a, b = match_neurons(fed.layers, tol=None, **auto), match_neurons(fed.layers, tol=1e6, **auto)
    assert a.objective == b.objective and len(a.objective) > 1 and not b.hyper["stopped"]


def test_tol_none_and_zero_sweep_to_the_fixed_point():
    fed = simulate_federation(15, 8, gamma0=8.0, prior_var=1.0, noise_var=0.8, seed=1)
    kw = dict(noise_var=0.8, prior_var=1.0, gamma0=8.0, cost="marginal", n_iter=50, seed=0)
    a, b = match_neurons(fed.layers, tol=None, **kw), match_neurons(fed.layers, tol=0.0, **kw)
    assert a.objective == b.objective and a.converged and np.diff(a.objective)[-1] == 0
    for bad in (-0.1, np.nan, np.inf, True, "0.1"):
        with pytest.raises(ValueError, match="tol must be"):
            match_neurons(fed.layers, tol=bad, **kw)


def test_bad_inputs():
    good = [np.ones((3, 4)), np.ones((2, 4))]
    with pytest.raises(ValueError, match="dimension 5"):
        match_neurons([np.ones((3, 4)), np.ones((2, 5))])
    with pytest.raises(ValueError, match="empty client"):
        match_neurons([np.ones((3, 4)), np.ones((0, 4))])
    for bad in (np.nan, np.inf):
        w = np.ones((3, 4))
        w[1, 2] = bad
        with pytest.raises(ValueError, match="NaN"):
            match_neurons([w, np.ones((2, 4))])
    for nv in (0.0, -1.0, [1.0, 0.0]):
        with pytest.raises(ValueError, match="noise_var must be positive"):
            match_neurons(good, noise_var=nv)
    with pytest.raises(ValueError, match="prior_var"):
        match_neurons(good, prior_var=0.0)
    with pytest.raises(ValueError, match="gamma0"):
        match_neurons(good, gamma0=-1.0)
    with pytest.raises(ValueError, match="cost"):
        match_neurons(good, cost="hungarian")
    with pytest.raises(ValueError, match="kl_weight"):
        match_neurons(good, kl_weight=-0.1)
    with pytest.raises(ValueError, match="at least one"):
        match_neurons([])
    with pytest.raises(ValueError, match="2-D"):
        match_neurons([np.ones(4)])


def test_local_vars_paths_agree():
    # Zero local variances change nothing, whether given per neuron or per entry (the latter
    # runs the blockwise path instead of the matrix-product one).
    fed = simulate_federation(5, 6, gamma0=3.0, prior_var=1.0, noise_var=0.05, seed=6)
    hyper = dict(noise_var=0.05, prior_var=1.0, gamma0=3.0, kl_weight=0.2, seed=0)
    base = match_neurons(fed.layers, **hyper)
    per_neuron = match_neurons(fed.layers, local_vars=[np.zeros(len(v)) for v in fed.layers], **hyper)
    per_entry = match_neurons(fed.layers, local_vars=[np.zeros_like(v) for v in fed.layers], **hyper)
    for res in (per_neuron, per_entry):
        assert _partition(res.assignments) == _partition(base.assignments)
        np.testing.assert_allclose(res.objective, base.objective, rtol=1e-12)
    with pytest.raises(ValueError, match="local_vars"):
        match_neurons(fed.layers, local_vars=[np.zeros(3)] * 5, **hyper)


def _log_joint_by_hand(layers, assignments, local_vars, *, noise_var, prior_var, gamma0):
    """``log p(V, B)`` of the BBP model from its definition, independently of the matching code.

    Given the assignments, coordinate d of the neurons merged into one atom is jointly Gaussian:
    ``v_jld = theta_id + e_jld``, ``theta_id ~ N(0, prior_var)``, ``e_jld ~ N(0, noise_var +
    local_vars[j][l(, d)])``, so their covariance is ``prior_var 11^T + diag(noise_var + local)``
    (PFNM supplement eq. 1-2 with the atoms integrated out). Plus the IBP structure
    ``K log gamma0 - gamma0 H_J + sum_k log((m_k - 1)! (J - m_k)! / J!)`` and ``-sum_j log L_j!``
    (each client's neurons in a uniform order).
    """
    J, D = len(layers), layers[0].shape[1]
    members: dict[int, list] = {}
    for j, a in enumerate(assignments):
        for l, i in enumerate(a):
            members.setdefault(int(i), []).append((j, l))
    total = 0.0
    for group in members.values():
        for d in range(D):
            x = np.array([layers[j][l, d] for j, l in group])
            local = np.array([np.broadcast_to(local_vars[j][l], (D,))[d] for j, l in group])
            cov = prior_var * np.ones((len(group), len(group))) + np.diag(noise_var + local)
            total += stats.multivariate_normal.logpdf(x, np.zeros(len(group)), cov)
    harmonic = sum(1.0 / j for j in range(1, J + 1))
    ibp = (
        len(members) * math.log(gamma0)
        - gamma0 * harmonic
        + sum(math.lgamma(len(g)) + math.lgamma(J - len(g) + 1) - math.lgamma(J + 1) for g in members.values())
    )
    return total + ibp - sum(math.lgamma(len(v) + 1) for v in layers)


@pytest.mark.catalogue
@pytest.mark.parametrize("per_entry", [False, True])
def test_local_vars_objective_is_the_brute_force_optimum(per_entry):
    # Two clients of three neurons: every structure is client 1's partial matching to client 0's
    # neurons (34 of them), so the optimum is known by brute force. The first sweep gives client 1
    # its exact best response to client 0 (marginal cost), which is that optimum.
    rng = np.random.default_rng(2)
    atoms = rng.normal(size=(4, 3))
    layers = [atoms[[0, 1, 2]] + 0.3 * rng.normal(size=(3, 3)), atoms[[2, 3, 0]] + 0.3 * rng.normal(size=(3, 3))]
    local = [rng.uniform(0.0, 0.5, size=(3, 3) if per_entry else 3) for _ in layers]
    hyper = dict(noise_var=0.1, prior_var=1.0, gamma0=1.0)
    structures = [_with_client([np.arange(3), None], 1, c, 3) for c in _candidates(3, 3)]
    by_hand = np.array([_log_joint_by_hand(layers, a, local, **hyper) for a in structures])
    # The objective sums about 40 terms of size <= 30, so float64 round-off is ~1e-14 relative;
    # rel=1e-12 is that with a margin, far below the 1.3 nats between the best two structures.
    coded = [log_marginal_posterior(layers, a, local_vars=local, **hyper) for a in structures]
    np.testing.assert_allclose(coded, by_hand, rtol=1e-12)
    best = int(np.argmax(by_hand))
    res = match_neurons(layers, cost="marginal", local_vars=local, seed=0, **hyper)
    assert res.objective[-1] == pytest.approx(by_hand[best], rel=1e-12)
    assert _partition(res.assignments) == _partition(structures[best])
    # the local variances matter: without them the optimum is another structure
    plain = np.array([_log_joint_by_hand(layers, a, [np.zeros(3)] * 2, **hyper) for a in structures])
    assert _partition(structures[int(np.argmax(plain))]) != _partition(structures[best])


# --------------------------------------------------------------------------- fast paths against dense ones


def _per_coordinate(prec, prior):
    """The same model with one group per coordinate: the reference for the grouped arrays."""
    groups = prior.groups
    full = _Groups.each(prior.dim)
    return [np.ascontiguousarray(groups.expand(p)) for p in prec], replace(
        prior, lam0=np.ascontiguousarray(groups.expand(prior.lam0[None, :])[0]), groups=full
    )


def _grouped_setup(rng, J, D, kind):
    """Neurons and precisions whose coordinates fall in a few groups (``kind``: contiguous runs,
    scattered, or with coordinates a client does not observe)."""
    layers = [rng.normal(size=(L, D)) for L in rng.integers(2, 6, size=J)]
    if kind == "runs":
        block = np.repeat([0, 1, 2], [D - 4, 1, 3])
    else:
        block = rng.integers(0, 3, size=D)
    noise = rng.uniform(0.2, 2.0, size=3)[block][None, :] * rng.uniform(0.5, 2.0, size=(J, 1))
    if kind == "unobserved":
        noise[1, block == 2] = np.inf
    prior_var = rng.uniform(1, 3, size=3)[block]
    return layers, _setup(layers, noise, prior_var, rng.normal(size=D), 1.5)


def test_groups_sums_and_expansions_match_the_definition():
    rng = np.random.default_rng(10)
    D = 30
    x = rng.normal(size=(7, D))
    for index in (
        np.zeros(D, int),
        np.repeat([1, 0, 2], [10, 5, 15]),
        rng.integers(0, 4, size=D),
        rng.permutation(np.arange(D) % 25),
        np.arange(D),
        rng.integers(0, 70, size=D),
    ):
        index = np.unique(index, return_inverse=True)[1].reshape(-1)  # groups 0..B-1, each used
        groups = _Groups(index, int(index.max()) + 1)
        want = np.stack([x[:, index == b].sum(1) for b in range(groups.n)], axis=1)
        np.testing.assert_allclose(groups.sum(x), want, rtol=1e-13)
        want_sq = np.stack([(x[:, index == b] ** 2).sum(1) for b in range(groups.n)], axis=1)
        np.testing.assert_allclose(groups.sum_sq(x), want_sq, rtol=1e-13)
        y = rng.normal(size=(7, groups.n))
        np.testing.assert_array_equal(groups.expand(y), y[:, index])
        np.testing.assert_array_equal(groups.sizes, np.bincount(index))
        assert np.all(index[groups.first] == np.arange(groups.n))


@pytest.mark.parametrize("kind", ["runs", "scattered", "unobserved"])
@pytest.mark.parametrize("cost", ["pfnm", "marginal"])
@pytest.mark.parametrize("kl_weight", [0.0, 0.7])
def test_grouped_cost_equals_the_per_coordinate_cost(kind, cost, kl_weight):
    # Coordinates on which the prior and every client share one precision are one group: the
    # cost from (G, B) precisions equals the one from (G, D) precisions and the loop formula.
    rng = np.random.default_rng(11)
    J, D = 5, 12
    layers, (layers_c, prec, prior) = _grouped_setup(rng, J, D, kind)
    assert 1 < prior.groups.n < D and all(p.shape == (1, prior.groups.n) for p in prec)
    others = [rng.permutation(6)[: len(v)] for v in layers]
    others[2] = None
    used = np.unique(np.concatenate([a for a in others if a is not None]))  # atoms 0..G-1, each used
    others = [None if a is None else np.searchsorted(used, a) for a in others]
    full_prec, full_prior = _per_coordinate(prec, prior)
    h, lam, m = _posterior_stats(layers_c, prec, others, len(used), prior)
    hf, lamf, mf = _posterior_stats(layers_c, full_prec, others, len(used), full_prior)
    np.testing.assert_allclose(h, hf, rtol=1e-13)
    np.testing.assert_allclose(prior.groups.expand(lam), lamf, rtol=1e-13)
    got = assignment_cost(layers_c[2], prec[2], h, lam, m, prior, cost=cost, kl_weight=kl_weight)
    dense = assignment_cost(layers_c[2], full_prec[2], hf, lamf, mf, full_prior, cost=cost, kl_weight=kl_weight)
    loop = _loop_cost(layers_c[2], full_prec[2], hf, lamf, mf, full_prior, J, cost, kl_weight)
    np.testing.assert_allclose(got, dense, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got, loop, rtol=1e-10, atol=1e-10)
    # and the objective
    assert _objective(h, lam, m, prior) == pytest.approx(_objective(hf, lamf, mf, full_prior), rel=1e-12)
    assert _data_constant(layers_c, prec, prior.groups) == pytest.approx(
        _data_constant(layers_c, full_prec, full_prior.groups), rel=1e-12
    )


def _dense_solution(C, n_existing):
    """``linear_sum_assignment`` of the full matrix: each neuron's atom, -1 for a new one."""
    rows, cols = linear_sum_assignment(C)
    out = np.full(C.shape[0], -1)
    out[rows] = np.where(cols < n_existing, cols, -1)
    return out, C[rows, cols].sum()


def _cost_of(out, old, new, steps):
    n_new = int((out < 0).sum())
    return (
        old[out[out >= 0], np.flatnonzero(out >= 0)].sum()
        + new[out < 0].sum()
        + (0.0 if steps is None else steps[:n_new].sum())
    )


@pytest.mark.parametrize("cost", ["pfnm", "marginal"])
@pytest.mark.parametrize("seed", range(6))
def test_pruned_assignment_equals_the_dense_hungarian(cost, seed):
    # Random (L, G + L) problems, without ties, from a neuron that takes every atom to atoms that
    # no neuron can take; the blocks give the same neurons to the same atoms and the same
    # neurons to new atoms as linear_sum_assignment of the full matrix, at the same cost.
    rng = np.random.default_rng(seed)
    for L, G in [(1, 0), (1, 3), (4, 0), (5, 2), (6, 6), (8, 20), (30, 12), (25, 60)]:
        for spread in (0.3, 1.0, 3.0):  # few to many atoms cheaper than a new one
            old = rng.normal(scale=spread, size=(G, L)) + rng.normal(size=(G, 1))
            new = rng.normal(size=L)
            steps = 2 * np.log(np.arange(1, L + 1)) if cost == "pfnm" else None
            full = np.empty((L, G + L))
            full[:, :G] = old.T
            full[:, G:] = new[:, None] + (0.0 if steps is None else steps[None, :])
            want, best = _dense_solution(full, G)
            got, _ = _assign(old.copy(), new, steps)
            np.testing.assert_array_equal(got, want)
            assert _cost_of(got, old, new, steps) == pytest.approx(best, rel=1e-12, abs=1e-12)
            if cost == "marginal":  # the same from the negative pairs alone
                R = old - new[None, :]
                atoms, neurons = np.nonzero(R < 0)
                np.testing.assert_array_equal(_assign_negative(atoms, neurons, R[atoms, neurons], G, L), want)


def _separated(rng, J, L, D, noise=0.01):
    """J clients each observing L of 2L well separated atoms: (neurons, their atoms)."""
    atoms = rng.normal(size=(2 * L, D))
    truth = [rng.choice(2 * L, L, replace=False) for _ in range(J)]
    return [atoms[t] + np.sqrt(noise) * rng.normal(size=(L, D)) for t in truth], truth


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("separated", [True, False])
def test_float32_screen_finds_exactly_the_negative_pairs(grouped, separated, monkeypatch):
    # The screen's pairs are the dense cost's pairs with R < 0, with R there (an upper bound < 0
    # for a pair alone in its atom and its neuron), and they give the dense assignment.
    monkeypatch.setattr(matching, "SCREEN_DENSITY", 1.0)  # however many pairs pass
    rng = np.random.default_rng(12)
    J, L, D = 8, 12, 40
    layers, truth = _separated(rng, J, L, D)
    if not separated:
        layers = [rng.normal(size=(L, D)) for _ in range(J)]
    scale = 0.01 if separated else 3.0  # crowded: many atoms beat a new one for many neurons
    noise = scale * (np.where(np.arange(D) < 30, 1.0, 3.0)[None, :] * np.ones((J, 1)) if grouped else 1.0)
    if grouped:
        noise[3, 35:] = np.inf
    layers_c, prec, prior = _setup(layers, noise, 1.0, 0.0, 2.0)
    assert prior.groups.n == (3 if grouped else 1)
    others = [None] + truth[1:]  # every atom is used by some client but client 0
    h, lam, m = _posterior_stats(layers_c, prec, others, 2 * L, prior)
    v, p = layers_c[0], prec[0]
    old, new, _ = _cost_blocks(v, p, h, lam, m, prior, cost="marginal", kl_weight=0.0)
    R = old - new[None, :]
    atoms, neurons, values = _negative_pairs(v, p, h, lam, m, prior)
    want = set(zip(*np.nonzero(R < 0)))
    assert set(zip(atoms.tolist(), neurons.tolist())) == want
    assert L <= len(want) < 3 * L if separated else len(want) > 10 * L
    alone = (np.bincount(atoms, minlength=len(m))[atoms] == 1) & (np.bincount(neurons, minlength=L)[neurons] == 1)
    np.testing.assert_allclose(values[~alone], R[atoms[~alone], neurons[~alone]], rtol=1e-10)
    assert np.all(values[alone] >= R[atoms[alone], neurons[alone]] - 1e-9) and np.all(values < 0)
    np.testing.assert_array_equal(
        _assign_negative(atoms, neurons, values, len(m), L), _assign(old.copy(), new, None)[0]
    )


def test_float32_screen_bound_holds_for_adversarial_magnitudes(monkeypatch):
    # Large and tiny entries, many coordinates: every pair the screen drops has R >= 0.
    monkeypatch.setattr(matching, "SCREEN_DENSITY", 1.0)
    rng = np.random.default_rng(13)
    for scale in (1e-20, 1e-3, 1.0, 1e6, 1e12):
        layers = [scale * rng.normal(size=(6, 300)) for _ in range(4)]
        layers_c, prec, prior = _setup(layers, (0.05 * scale) ** 2, scale**2, 0.0, 1.0)
        h, lam, m = _posterior_stats(layers_c, prec, [None, np.arange(6), np.arange(6), np.arange(6)], 6, prior)
        old, new, _ = _cost_blocks(layers_c[0], prec[0], h, lam, m, prior, cost="marginal", kl_weight=0.0)
        pairs = _negative_pairs(layers_c[0], prec[0], h, lam, m, prior)
        if pairs is not None:
            R = old - new[None, :]
            assert set(zip(*np.nonzero(R < 0))) == set(zip(pairs[0].tolist(), pairs[1].tolist()))


def test_screened_and_dense_matchings_agree(monkeypatch):
    # The whole empirical-Bayes matching with the float32 screen and without it (dense path).
    rng = np.random.default_rng(14)
    layers, _ = _separated(rng, 30, 10, 60)
    screened = match_neurons(layers, seed=0)
    monkeypatch.setattr(matching, "SCREEN_DENSITY", -1.0)  # the screen never pays: dense path
    dense = match_neurons(layers, seed=0)
    assert _partition(screened.assignments) == _partition(dense.assignments)
    np.testing.assert_allclose(screened.objective, dense.objective, rtol=1e-12)
    np.testing.assert_allclose(screened.hyper["noise_var"], dense.hyper["noise_var"], rtol=1e-12)
    assert screened.n_global == 20 and screened.converged


def test_the_initial_atoms_from_em_statistics_are_the_posterior():
    # What the empirical-Bayes rounds hand to the next matching equals _posterior_stats.
    rng = np.random.default_rng(15)
    J, D = 6, 9
    layers = [rng.normal(size=(L, D)) for L in (3, 4, 2, 3, 5, 4)]
    assignments = [rng.permutation(7)[: len(v)] for v in layers]
    assignments[0] = np.array([0, 1, 2])
    used = np.unique(np.concatenate(assignments))
    assignments = [np.searchsorted(used, a) for a in assignments]
    blocks = np.repeat([0, 1], [6, 3])
    weights = rng.uniform(0.5, 2.0, size=(J, D))
    weights[2, 7:] = 0.0
    hyper = BlockHyper(
        prior_var=np.array([1.5, 0.7]), noise_var=np.array([0.2, 0.05]), prior_mean=np.array([0.1, -0.3]), gamma0=2.0
    )
    stats = atom_statistics(layers, assignments, weights)
    h, lam = atom_posterior(stats, blocks, hyper)
    noise, prior_var, prior_mean = hyper.expand(blocks, weights)
    layers_c, prec, prior = _setup(layers, noise, prior_var, prior_mean, hyper.gamma0)
    want_h, want_lam, want_m = _posterior_stats(layers_c, prec, assignments, len(used), prior)
    np.testing.assert_allclose(h, want_h, rtol=1e-12)
    np.testing.assert_allclose(lam, prior.groups.expand(want_lam), rtol=1e-12)
    np.testing.assert_array_equal(stats.counts, want_m)


def test_assignment_checks_name_the_first_bad_client():
    layers = [np.zeros((3, 2)), np.zeros((2, 2)), np.zeros((2, 2))]
    for bad, j in [
        ([[0, 1, 1], [1, 0], [0, 1]], 0),
        ([[0, 1, 2], [1, 1], [0, 0]], 1),
        ([[0, 1, 2], [0, -1], [0, 1]], 1),
        ([[0, 1], [0, 1], [0, 1]], 0),
        ([[0, 1, 2], [0, 1], [3, 3]], 2),
    ]:
        with pytest.raises(ValueError, match=f"client {j}: assignments must give"):
            log_marginal_posterior(layers, bad)


def test_blocked_posterior_moments_are_the_whole_division():
    # Rows of atoms at a time divide each entry as the whole-array expression does: equal bit for bit.
    rng = np.random.default_rng(40)
    groups = matching._Groups(np.repeat([0, 1, 2], [5, 3, 4]), 3)
    h, lam = rng.normal(size=(9, 12)), rng.uniform(0.5, 3.0, size=(9, 3))
    full = groups.expand(lam)
    for max_elements in (1, 12, 25, 1 << 22):
        mean, var = matching._posterior_moments(h, lam, groups, max_elements=max_elements)
        np.testing.assert_array_equal(mean, h / full)
        np.testing.assert_array_equal(var, 1.0 / full)
        spent = h.copy()  # overwrite: the same means, written over h, and no other (G, D) array for them
        mean, var = matching._posterior_moments(spent, lam, groups, max_elements=max_elements, overwrite=True)
        assert mean is spent
        np.testing.assert_array_equal(mean, h / full)
        np.testing.assert_array_equal(var, 1.0 / full)


def test_an_atom_buffer_adopts_the_callers_spent_means_and_grows_from_them():
    # reset(adopt=True) keeps the caller's (G, D) array as the buffer (no second copy of the largest
    # array of a wide layer's matching); the contents are those a copying reset gives, and growing
    # afterwards keeps them.
    from bayesfuse.inference.matching.sweeps import _AtomBuffer

    rng = np.random.default_rng(41)
    groups = matching._Groups(np.repeat([0, 1], [3, 4]), 2)
    h, lam, m = rng.normal(size=(5, 7)), rng.uniform(1.0, 2.0, size=(5, 2)), np.arange(1, 6)
    copied, adopted = _AtomBuffer(7, groups, capacity=2), _AtomBuffer(7, groups, capacity=2)
    copied.reset(h.copy(), lam, m)
    given = h.copy()
    adopted.reset(given, lam, m, adopt=True)
    assert adopted.h.base is given or adopted.h is given
    for a in (copied, adopted):
        np.testing.assert_array_equal(a.h, h)
        np.testing.assert_array_equal(a.lam, lam)
        np.testing.assert_array_equal(a.hh, copied.hh)
    adopted._reserve(9)  # growing reallocates and keeps the rows
    np.testing.assert_array_equal(adopted.h, h)
    assert len(adopted._h) >= 9 and adopted.n == 5
    adopted.tighten()  # exactly the live atoms again, the spare rows released
    assert adopted.tight and len(adopted._h) == len(adopted._lam) == len(adopted._m) == 5
    np.testing.assert_array_equal(adopted.h, h)
    frozen = h.copy()
    frozen.flags.writeable = False  # not the caller's to give up: copied, not adopted
    kept = _AtomBuffer(7, groups, capacity=2)
    kept.reset(frozen, lam, m, adopt=True)
    assert kept.h.base is not frozen and kept.h is not frozen
    np.testing.assert_array_equal(kept.h, h)


FLOAT32_CASES = [
    dict(),  # empirical Bayes, the marginal cost
    dict(dim=9000),  # wider than NumPy's 8192-element buffers (einsum of float64 and float32 sums in them)
    dict(blocks=np.repeat([0, 1], [14, 10])),
    dict(relative_precision="drawn"),
    dict(noise_var=0.02, prior_var=1.0, gamma0=1.0),  # the PFNM cost
    dict(noise_var=0.02, prior_var=1.0, gamma0=1.0, cost="marginal"),
    dict(noise_var=0.02, prior_var=1.0, gamma0=1.0, kl_weight=0.1),
    dict(noise_var=0.02, prior_var=1.0, gamma0=1.0, cost="marginal", local_vars="drawn"),
]


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=lambda c: "-".join(c) or "auto")
def test_float32_neurons_match_exactly_as_their_float64_copies(case):
    # Float32 neurons stay float32 inside the matching (half a wide layer's memory) and are widened
    # wherever they enter arithmetic. Every float32 number is a float64 number, so the matching must
    # be that of the float64 copies bit for bit: a computation left in float32 (a sum of squares,
    # a product of two neuron arrays) would move the objective, which is compared exactly.
    rng = np.random.default_rng(17)
    case = dict(case)
    dim = case.pop("dim", 24)
    atoms = rng.normal(size=(20, dim))
    layers = [
        (atoms[rng.choice(20, 9, replace=False)] + 0.1 * rng.normal(size=(9, dim))).astype(np.float32) for _ in range(4)
    ]
    if case.get("relative_precision") == "drawn":
        case["relative_precision"] = rng.uniform(0.5, 2.0, size=(4, 24))
    if case.get("local_vars") == "drawn":
        case["local_vars"] = [rng.uniform(0.001, 0.01, size=9) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        narrow = match_neurons(layers, seed=0, **case)
        wide = match_neurons([v.astype(np.float64) for v in layers], seed=0, **case)
    assert all(v.dtype == np.float32 for v in layers)  # the caller's arrays are not converted
    for a, b in zip(narrow.assignments, wide.assignments):
        np.testing.assert_array_equal(a, b)
    assert narrow.objective == wide.objective
    np.testing.assert_array_equal(narrow.mean, wide.mean)
    np.testing.assert_array_equal(np.asarray(narrow.var), np.asarray(wide.var))
    assert narrow.hyper.get("noise_var") == wide.hyper.get("noise_var")


def test_float32_neurons_are_checked_like_any_others():
    v = np.ones((3, 4), dtype=np.float32)
    bad = v.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="client 1's neurons contains NaN"):
        match_neurons([v, bad], noise_var=1.0, prior_var=1.0, gamma0=1.0)


def test_an_atom_buffer_grows_and_shrinks_where_it_stands():
    # Growing a wide layer's buffer by copying holds old and new at once (1.8x its memory at the
    # peak); resized in place, the allocator moves its pages instead. The rows must survive either
    # way, and a buffer that something else refers to must be copied, not resized under it.
    from bayesfuse.inference.matching.sweeps import _AtomBuffer

    rng = np.random.default_rng(5)
    groups = matching._Groups(np.repeat([0, 1], [3, 4]), 2)
    h, lam, m = rng.normal(size=(5, 7)), rng.uniform(1.0, 2.0, size=(5, 2)), np.arange(1, 6)
    buffer = _AtomBuffer(7, groups, capacity=2)
    buffer.reset(h, lam, m)
    buffer._reserve(40)
    assert len(buffer._h) == len(buffer._lam) == len(buffer._m) == 40 and buffer._h.flags.owndata
    np.testing.assert_array_equal(buffer.h, h)
    np.testing.assert_array_equal(buffer._h[5:], 0.0)  # new rows are zero, as a fresh buffer's
    buffer.tighten()
    assert buffer.tight and len(buffer._h) == 5
    np.testing.assert_array_equal(buffer.h, h)
    np.testing.assert_array_equal(buffer.lam, lam)
    held = buffer._h  # a caller's name for the array: it must not be resized under it
    buffer._reserve(50)
    assert buffer._h is not held and len(held) == 5
    np.testing.assert_array_equal(held, h)
    np.testing.assert_array_equal(buffer.h, h)


def test_the_float32_copy_for_the_screen_is_kept_only_for_small_clients():
    from bayesfuse.inference.matching.sweeps import KEPT_FLOAT32, NeuronCache

    cache = NeuronCache(3)
    small, large = np.ones((4, 5)), np.ones((2, KEPT_FLOAT32 // 2 + 1))
    assert cache.v32(0, small) is cache.v32(0, small) and cache.v32(0, small).dtype == np.float32
    assert cache.v32(1, large) is not cache.v32(1, large)  # made at each visit
    given = np.ones((4, 5), dtype=np.float32)
    assert cache.v32(2, given) is given


def test_a_matching_result_pickles():
    import pickle

    rng = np.random.default_rng(2)
    res = match_neurons([rng.normal(size=(4, 6)) for _ in range(3)], noise_var=0.5, prior_var=1.0, gamma0=1.0)
    back = pickle.loads(pickle.dumps(res))
    np.testing.assert_array_equal(np.asarray(back.var), np.asarray(res.var))
    np.testing.assert_array_equal(back.mean, res.mean)


def test_the_screen_reads_float32_neurons_as_their_float64_copies(monkeypatch):
    # The screen's exact values for its candidate pairs are dot products of float64 atoms with the
    # neurons; NumPy sums a float64 x float32 einsum in 8192-element buffers, in another order than
    # float64 x float64. The neurons are widened first, so wide layers' values are the same, bit for bit.
    monkeypatch.setattr(matching, "SCREEN_DENSITY", 1.0)
    rng = np.random.default_rng(4)
    J, L, D = 3, 6, 9000
    layers = [rng.normal(size=(L, D)).astype(np.float32) for _ in range(J)]
    layers_c, prec, prior = _setup([v.astype(np.float64) for v in layers], 3.0, 1.0, 0.0, 2.0)
    others = [None] + [np.arange(L) for _ in range(J - 1)]
    h, lam, m = _posterior_stats(layers_c, prec, others, L, prior)
    wide = _negative_pairs(layers_c[0], prec[0], h, lam, m, prior)
    narrow = _negative_pairs(layers[0], prec[0], h, lam, m, prior, vv=prior.groups.sum_sq(layers_c[0]))
    assert wide is not None and narrow is not None and len(wide[0]) > 2  # pairs whose values are computed
    for a, b in zip(wide, narrow):
        np.testing.assert_array_equal(a, b)


def test_a_capacity_below_a_client_or_its_warm_start_is_refused_up_front():
    rng = np.random.default_rng(0)
    layers = [rng.normal(size=(4, 3)) for _ in range(3)]
    with pytest.raises(ValueError, match="capacity=3 is below the widest client's 4 neurons"):
        match_neurons(layers, capacity=3, noise_var=0.1, prior_var=1.0, gamma0=1.0)
    with pytest.raises(ValueError, match="init has 12 atoms, more than capacity=4"):
        match_neurons(layers, capacity=4, init=[np.arange(4) + 4 * j for j in range(3)], noise_var=0.1, prior_var=1.0)
