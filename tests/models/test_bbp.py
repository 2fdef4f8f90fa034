import itertools
import math

import numpy as np
import pytest
import torch
from pyro import poutine
from scipy.stats import norm, poisson

from bayesfuse.inference.matching import log_marginal_posterior
from bayesfuse.models.bbp import (
    IBPSelection,
    UniformPermutation,
    default_truncation,
    federation_model,
    log_joint,
    simulate_federation,
)

HYPER = dict(gamma0=3.0, prior_var=2.0, noise_var=0.05)


def _closed_form_log_joint(layers, assignments, atoms, gamma0, prior_var, noise_var, prior_mean=0.0):
    """The log joint written out independently with scipy and math.lgamma."""
    K = atoms.shape[0]
    J = len(layers)
    total = norm.logpdf(atoms, prior_mean, math.sqrt(prior_var)).sum()
    for v, a in zip(layers, assignments):
        total += norm.logpdf(v, atoms[a], math.sqrt(noise_var)).sum()
        total -= math.lgamma(len(v) + 1)
    m = np.zeros(K)
    for a in assignments:
        m[a] += 1
    harmonic = sum(1 / j for j in range(1, J + 1))
    total += K * math.log(gamma0) - math.lgamma(K + 1) - gamma0 * harmonic
    total += sum(math.lgamma(mk) + math.lgamma(J - mk + 1) - math.lgamma(J + 1) for mk in m)
    return total


def test_log_joint_matches_closed_form():
    fed = simulate_federation(5, 4, seed=3, **HYPER)
    got = log_joint(fed.layers, fed.assignments, fed.atoms, **HYPER)
    want = _closed_form_log_joint(fed.layers, fed.assignments, fed.atoms, **HYPER)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-9)
    # A wrong assignment scores differently (the test can fail).
    swapped = [a.copy() for a in fed.assignments]
    j = next(j for j, a in enumerate(swapped) if len(a) >= 2)
    swapped[j][[0, 1]] = swapped[j][[1, 0]]
    assert log_joint(fed.layers, swapped, fed.atoms, **HYPER) < got


def test_collapsing_the_atoms_gives_the_matching_objective():
    # log p(V, partition) = log p(V, a, theta) - log p(theta | V, a) + log K!  for any theta;
    # at the posterior mean, log p(theta_hat | V, a) = sum_i (D/2) log(lambda_i / 2 pi).
    fed = simulate_federation(6, 3, seed=5, **HYPER)
    counts = np.zeros(fed.n_atoms)
    for a in fed.assignments:
        counts[a] += 1
    lam = 1 / HYPER["prior_var"] + counts / HYPER["noise_var"]
    h = np.zeros_like(fed.atoms)
    for v, a in zip(fed.layers, fed.assignments):
        h[a] += v / HYPER["noise_var"]
    theta_hat = h / lam[:, None]
    d = fed.atoms.shape[1]
    via_pyro = (
        log_joint(fed.layers, fed.assignments, theta_hat, **HYPER)
        - 0.5 * d * np.sum(np.log(lam / (2 * np.pi)))
        + math.lgamma(fed.n_atoms + 1)
    )
    assert log_marginal_posterior(fed.layers, fed.assignments, **HYPER) == pytest.approx(via_pyro, rel=1e-12)


@pytest.mark.parametrize("n_clients, max_atoms", [(2, 5), (3, 3)])
def test_ibp_closed_form_sums_to_poisson(n_clients, max_atoms):
    # Summed over every J x K binary matrix with no empty column, P(Z) must equal
    # Poisson(K; gamma0 H_J): the IBP's number of atoms. Brute force over all matrices.
    gamma0 = 1.7
    ibp_rate = gamma0 * sum(1 / j for j in range(1, n_clients + 1))
    columns = [c for c in itertools.product([0, 1], repeat=n_clients) if any(c)]
    for k in range(1, max_atoms + 1):
        total = 0.0
        for cols in itertools.product(columns, repeat=k):
            z = torch.tensor(cols, dtype=torch.float64).T
            total += math.exp(IBPSelection(gamma0, n_clients, k).log_prob(z))
        assert total == pytest.approx(poisson.pmf(k, ibp_rate), rel=1e-10)
    assert IBPSelection(gamma0, 2, 2).log_prob(torch.tensor([[1.0, 0.0], [1.0, 0.0]])) == -math.inf


def test_number_of_atoms_matches_the_ibp():
    # Stick-breaking (truncated) and the buffet both give K ~ Poisson(gamma0 H_J):
    # E[K] = 2 * (1 + 1/2 + 1/3 + 1/4) = 4.167, sd 2.04. Over 1000 draws the mean's sd is
    # 0.065; 4 sd (0.26) is exceeded with probability < 1e-4. Truncation loses < J * 1e-3.
    gamma0, J, n = 2.0, 4, 1000
    expected = gamma0 * sum(1 / j for j in range(1, J + 1))
    torch.manual_seed(0)
    k_sticks, k_buffet, sizes = [], [], []
    for _ in range(n):
        tr = poutine.trace(federation_model).get_trace(J, 1, gamma0=gamma0)
        z = tr.nodes["z"]["value"]
        k_sticks.append(int((z.sum(0) > 0).sum()))
        sizes.append(float(z.sum(1).mean()))
        k_buffet.append(IBPSelection(gamma0, J).sample().shape[1])
    assert abs(np.mean(k_sticks) - expected) < 0.26
    assert abs(np.mean(k_buffet) - expected) < 0.26
    # Each client selects Poisson(gamma0) atoms on average (sd of the mean well below 0.15).
    assert abs(np.mean(sizes) - gamma0) < 0.15


def test_simulation_ground_truth_is_consistent():
    noise = 0.04
    fed = simulate_federation(8, 50, gamma0=5.0, prior_var=1.0, noise_var=noise, seed=0)
    assert len(fed.layers) == 8 and all(len(v) == len(a) for v, a in zip(fed.layers, fed.assignments))
    used = np.unique(np.concatenate(fed.assignments))
    np.testing.assert_array_equal(used, np.arange(fed.n_atoms))
    # Residuals are N(0, noise): sum of squares / noise ~ chi2(n); n >= 1000 entries here, so
    # the ratio's sd is sqrt(2/n) < 0.045 and 0.2 is > 4 sd.
    resid = np.concatenate([(v - fed.atoms[a]).ravel() for v, a in zip(fed.layers, fed.assignments)])
    assert resid.size >= 1000
    assert abs(np.mean(resid**2) / noise - 1) < 0.2


def test_simulation_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = simulate_federation(3, 4, seed=9, **HYPER)
    assert torch.equal(torch.get_rng_state(), before)
    b = simulate_federation(3, 4, seed=9, **HYPER)
    c = simulate_federation(3, 4, seed=10, **HYPER)
    for x, y in zip(a.layers, b.layers):
        np.testing.assert_array_equal(x, y)
    assert not all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a.layers, c.layers))


def test_uniform_permutation():
    d = UniformPermutation(4)
    assert d.log_prob(torch.tensor([2, 0, 3, 1])).item() == pytest.approx(-math.log(24))
    assert d.log_prob(torch.tensor([0, 0, 1, 2])).item() == -math.inf
    assert sorted(d.sample().tolist()) == [0, 1, 2, 3]


def test_truncation_and_bad_inputs():
    assert default_truncation(1.0) == 10  # 2 * 0.5^(T+1) < 1e-3
    with pytest.raises(ValueError, match="noise_var"):
        simulate_federation(2, 3, noise_var=-1.0)
    with pytest.raises(ValueError, match="gamma0"):
        simulate_federation(2, 3, gamma0=0.0)
    fed = simulate_federation(3, 2, seed=1, **HYPER)
    with pytest.raises(ValueError, match="distinct atom"):
        log_joint(fed.layers, [np.zeros(len(v), dtype=int) + 99 for v in fed.layers], fed.atoms, **HYPER)
