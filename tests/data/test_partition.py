import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bayesfuse.data import dirichlet_partition, holdout_partition, homogeneous_partition


def _assert_exact_cover(partition, n):
    allidx = np.concatenate(list(partition))
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(
    labels=st.lists(st.integers(0, 6), min_size=20, max_size=300),
    n_clients=st.integers(1, 8),
    alpha=st.floats(0.05, 50.0),
    seed=st.integers(0, 2**31),
)
def test_dirichlet_covers_every_index_once(labels, n_clients, alpha, seed):
    y = np.array(labels)
    p = dirichlet_partition(y, n_clients, alpha, seed=seed, min_size=0)
    assert len(p) == n_clients
    _assert_exact_cover(p, len(y))
    np.testing.assert_array_equal(p.counts.sum(0), np.bincount(y, minlength=p.counts.shape[1]))


@settings(max_examples=40, deadline=None)
@given(
    labels=st.lists(st.integers(0, 6), min_size=10, max_size=300),
    n_clients=st.integers(1, 10),
    seed=st.integers(0, 2**31),
)
def test_homogeneous_covers_and_balances(labels, n_clients, seed):
    y = np.array(labels)
    if n_clients > len(y):
        return
    p = homogeneous_partition(y, n_clients, seed=seed)
    _assert_exact_cover(p, len(y))
    assert np.ptp(p.counts, axis=0).max() <= 1  # each class split within one example
    assert np.ptp(p.sizes) <= 1  # remainders dealt in rotation


@pytest.mark.parametrize("alpha", [0.1, 0.5, 1.0, 10.0])
def test_dirichlet_shares_follow_alpha(alpha):
    # For p ~ Dir_J(alpha), H = sum_j p_j^2 has E[H] = (alpha + 1) / (J alpha + 1).
    # H lies in [1/J, 1], so by Hoeffding the mean of K = 1000 independent classes deviates
    # from E[H] by more than t = 0.05 with probability <= 2 exp(-2 K t^2 / (1 - 1/J)^2) < 1e-3.
    # Rounding shares to whole examples (n_k = 200) moves each H by at most ~2/n_k = 0.01.
    # min_size=0 so that no draw is rejected (rejection would bias the shares).
    n_clients, n_classes, per_class = 5, 1000, 200
    y = np.repeat(np.arange(n_classes), per_class)
    p = dirichlet_partition(y, n_clients, alpha, seed=7, min_size=0)
    shares = p.counts / per_class  # (J, K)
    herfindahl = (shares**2).sum(0).mean()
    expected = (alpha + 1) / (n_clients * alpha + 1)
    assert abs(herfindahl - expected) < 0.06


def test_small_alpha_is_skewed_large_alpha_is_even():
    y = np.repeat(np.arange(10), 500)
    skewed = dirichlet_partition(y, 10, 0.1, seed=0, min_size=0)
    even = dirichlet_partition(y, 10, 100.0, seed=0, min_size=0)
    # With alpha = 0.1 most clients miss several classes; with alpha = 100 none does.
    assert (skewed.counts == 0).sum() > 30
    assert (even.counts == 0).sum() == 0
    assert skewed.proportions.max(1).mean() > 0.5 > even.proportions.max(1).mean()


def test_min_size_is_enforced_and_seed_reproduces():
    y = np.repeat(np.arange(10), 100)
    a = dirichlet_partition(y, 20, 0.3, seed=1, min_size=20)
    b = dirichlet_partition(y, 20, 0.3, seed=1, min_size=20)
    assert a.sizes.min() >= 20
    for ia, ib in zip(a, b):
        np.testing.assert_array_equal(ia, ib)


def test_bad_inputs():
    y = np.repeat(np.arange(3), 10)
    for alpha in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            dirichlet_partition(y, 3, alpha)
    with pytest.raises(ValueError, match="more clients than examples"):
        dirichlet_partition(y, 31, 1.0)
    with pytest.raises(ValueError, match="more clients than examples"):
        homogeneous_partition(y, 31)
    with pytest.raises(ValueError, match="min_size"):
        dirichlet_partition(y, 5, 1.0, min_size=7)
    with pytest.raises(RuntimeError, match="raise alpha"):
        dirichlet_partition(y, 6, 0.01, min_size=5, max_tries=5)
    with pytest.raises(TypeError):
        dirichlet_partition(y.astype(float), 3, 1.0)
    with pytest.raises(ValueError, match="positive integer"):
        dirichlet_partition(y, 0, 1.0)


def test_summary_lists_clients():
    p = homogeneous_partition(np.repeat(np.arange(3), 4), 2)
    text = p.summary()
    assert text.splitlines()[0].startswith("client") and len(text.splitlines()) == 3


@settings(max_examples=40, deadline=None)
@given(
    labels=st.lists(st.integers(0, 4), min_size=20, max_size=200),
    n_clients=st.integers(1, 6),
    fraction=st.floats(0.01, 0.99),
    seed=st.integers(0, 2**31),
)
def test_holdout_splits_every_client_in_two(labels, n_clients, fraction, seed):
    y = np.array(labels)
    part = dirichlet_partition(y, n_clients, 1.0, seed=seed, min_size=2)
    train, held = holdout_partition(part, y, fraction, seed=seed)
    for j, idx in enumerate(part):
        assert np.intersect1d(train[j], held[j]).size == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([train[j], held[j]])), idx)
        # round(fraction n), kept between 1 and n - 1
        assert held[j].size == min(max(round(fraction * idx.size), 1), idx.size - 1)
    np.testing.assert_array_equal(train.counts + held.counts, part.counts)
    np.testing.assert_array_equal(held.counts[0], np.bincount(y[held[0]], minlength=part.counts.shape[1]))
    again = holdout_partition(part, y, fraction, seed=seed)[1]
    assert all(np.array_equal(a, b) for a, b in zip(again, held))


def test_holdout_refuses_what_it_cannot_split():
    y = np.array([0, 1, 0, 1, 1])
    part = dirichlet_partition(y, 2, 1.0, seed=0, min_size=0)
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        holdout_partition(part, y, 1.0)
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        holdout_partition(part, y, 0.0)
    tiny = homogeneous_partition(np.array([0, 1, 0]), 3)
    with pytest.raises(ValueError, match="client 0 has 1 example"):
        holdout_partition(tiny, np.array([0, 1, 0]), 0.5)
