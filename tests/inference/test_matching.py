import itertools
import math

import numpy as np
import pytest
from scipy import stats

from bayesfuse.inference.matching import (
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
    return 0.5 * (np.trace(sy_inv @ sx) + d @ sy_inv @ d - len(mu_x)
                  + np.linalg.slogdet(sy)[1] - np.linalg.slogdet(sx)[1])


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
                prior_term = 2 * math.log(mi / (J - mi)) if col < G else 2 * math.log(prior.gamma0 / J) - 2 * math.log(col - G + 1)
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
        log_marginal_posterior(layers, _with_client([np.arange(3), None], 1, c, 3), **hyper)
        for c in _candidates(3, 3)
    )
    res = match_neurons(layers, cost="marginal", seed=0, **hyper)
    assert res.objective[-1] == pytest.approx(best, rel=1e-12)


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
    ibp = len(members) * math.log(gamma0) - gamma0 * harmonic + sum(
        math.lgamma(len(g)) + math.lgamma(J - len(g) + 1) - math.lgamma(J + 1) for g in members.values())
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
