from dataclasses import fields

import numpy as np
import pytest
import torch
from scipy import stats
from torch.distributions import Beta as TBeta
from torch.distributions import Dirichlet as TDirichlet
from torch.distributions import Gamma as TGamma
from torch.distributions import MultivariateNormal, Normal, kl_divergence

from bayesfuse.inference.expfam import (
    Beta,
    DiagNormal,
    Dirichlet,
    FullNormal,
    Gamma,
    NormalWishart,
    kl_matrix,
    kl_moments,
)

RNG = np.random.default_rng(0)


def _spd(n, d, rng):
    a = rng.normal(size=(n, d, d))
    return a @ np.swapaxes(a, 1, 2) + d * np.eye(d)


def make(family, n, rng=RNG, d=3):
    if family is DiagNormal:
        return DiagNormal(loc=rng.normal(size=(n, d)), var=rng.uniform(0.2, 2, size=(n, d)))
    if family is FullNormal:
        return FullNormal(loc=rng.normal(size=(n, d)), cov=_spd(n, d, rng) / d)
    if family is NormalWishart:
        return NormalWishart(
            mean=rng.normal(size=(n, d)),
            kappa=rng.uniform(0.5, 3, n),
            dof=rng.uniform(d + 1, d + 6, n),
            scale=_spd(n, d, rng) / (3 * d),
        )
    if family is Gamma:
        return Gamma(shape=rng.uniform(0.5, 4, size=(n, d)), rate=rng.uniform(0.5, 3, size=(n, d)))
    if family is Beta:
        return Beta(a=rng.uniform(0.5, 4, size=(n, d)), b=rng.uniform(0.5, 4, size=(n, d)))
    return Dirichlet(concentration=rng.uniform(0.5, 5, size=(n, d + 1)))


def _torch(q, i):
    t = lambda x: torch.as_tensor(x[i])  # noqa: E731
    if isinstance(q, DiagNormal):
        return Normal(t(q.loc), t(q.var).sqrt())
    if isinstance(q, FullNormal):
        return MultivariateNormal(t(q.loc), covariance_matrix=t(q.cov))
    if isinstance(q, Gamma):
        return TGamma(t(q.shape), t(q.rate))
    if isinstance(q, Beta):
        return TBeta(t(q.a), t(q.b))
    return TDirichlet(t(q.concentration))


FAMILIES = [DiagNormal, FullNormal, NormalWishart, Gamma, Beta, Dirichlet]


@pytest.mark.parametrize("family", [DiagNormal, FullNormal, Gamma, Beta, Dirichlet])
def test_kl_matrix_matches_torch(family):
    qa, qb = make(family, 4), make(family, 5)
    got = qa.kl(qb, clip=False)  # the formula itself, not max(formula, 0)
    want = np.array([[kl_divergence(_torch(qa, i), _torch(qb, k)).sum().item() for k in range(5)] for i in range(4)])
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)


def _nw_logpdf(q, i, mu, lam):
    cov = np.linalg.inv(q.kappa[i] * lam)
    return stats.wishart.logpdf(lam, df=q.dof[i], scale=q.scale[i]) + stats.multivariate_normal.logpdf(
        mu, q.mean[i], cov
    )


def test_normal_wishart_kl_by_monte_carlo():
    # KL(a || b) = E_a[log a - log b]; 4000 draws. The tolerance is 4 Monte Carlo standard
    # errors of the mean, estimated from the same draws.
    rng = np.random.default_rng(1)
    qa, qb = make(NormalWishart, 1, rng, d=2), make(NormalWishart, 1, rng, d=2)
    lams = stats.wishart.rvs(df=qa.dof[0], scale=qa.scale[0], size=4000, random_state=2)
    diffs = []
    for lam in lams:
        mu = rng.multivariate_normal(qa.mean[0], np.linalg.inv(qa.kappa[0] * lam))
        diffs.append(_nw_logpdf(qa, 0, mu, lam) - _nw_logpdf(qb, 0, mu, lam))
    diffs = np.array(diffs)
    se = diffs.std() / np.sqrt(len(diffs))
    assert abs(qa.kl(qb, clip=False)[0, 0] - diffs.mean()) < 4 * se


def _roundoff_bound(qa, qb):
    """Bound on the float64 error of ``qa.kl(qb, clip=False)``, pair by pair.

    The KL is computed as a sum of 2P + 2 terms: A(eta_b), -A(eta_a) and the P products of
    <mu_a, eta_b> and of <mu_a, eta_a>. Summing n terms in floating point errs by at most
    gamma_n * sum |term| with gamma_n ~ n u, u = eps / 2 (Higham 2002, eq. 3.4), each product
    adds u, and A and mu enter with the few-ulp relative errors of their closed forms (well
    conditioned here: covariances are SPD + d I). (2P + 2) * eps * sum |term| is that bound
    with the factor 2 of eps = 2u left for the inputs' own errors.
    """
    eta_a, eta_b = qa.natural(), qb.natural()
    mu_a = np.abs(qa.mean_params(eta_a, qa.event_shape))
    size = (
        np.abs(qb.log_normalizer(eta_b, qb.event_shape))[None, :]
        + np.abs(qa.log_normalizer(eta_a, qa.event_shape))[:, None]
        + mu_a @ np.abs(eta_b).T
        + (mu_a * np.abs(eta_a)).sum(1)[:, None]
    )
    return (2 * eta_a.shape[1] + 2) * np.finfo(float).eps * size


@pytest.mark.catalogue
@pytest.mark.parametrize("family", FAMILIES)
def test_raw_kl_is_zero_on_itself_and_nonnegative(family):
    # The unclipped KL (kl(clip=False)): the clip of kl() cannot hide a wrong sign here.
    rng = np.random.default_rng(7)
    q = make(family, 6, rng)
    raw = q.kl(q, clip=False)
    bound = _roundoff_bound(q, q)
    assert (np.abs(np.diag(raw)) <= np.diag(bound)).all(), np.diag(raw) / np.diag(bound)
    off = ~np.eye(6, dtype=bool)
    assert (raw[off] > bound[off]).all()  # distinct components: clearly positive, not round-off
    # Near-copies (natural parameters scaled by 1 + 1e-7 z, which keeps every family's domain):
    # the exact KL is O(1e-14), the size of the round-off, so the raw value can dip below 0,
    # but by no more than the round-off bound.
    for scale in (1e-7, 1e-9):
        near = family.from_natural(q.natural() * (1 + scale * rng.normal(size=(6, 1))), q.event_shape)
        raw = q.kl(near, clip=False)
        assert (raw >= -_roundoff_bound(q, near)).all()
        assert (q.kl(near) >= 0).all() and (q.kl(near) == np.maximum(raw, 0)).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_natural_round_trip(family):
    q = make(family, 5)
    back = family.from_natural(q.natural(), q.event_shape)
    for f in fields(q):
        np.testing.assert_allclose(getattr(back, f.name), getattr(q, f.name), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_mean_params_are_the_gradient_of_the_log_normalizer(family):
    q = make(family, 1)
    eta = q.natural()
    grad = q.mean_params(eta, q.event_shape)[0]
    num = np.empty(eta.shape[1])
    for p in range(eta.shape[1]):  # central differences
        e = np.zeros_like(eta)
        e[0, p] = 1e-6
        num[p] = (q.log_normalizer(eta + e, q.event_shape) - q.log_normalizer(eta - e, q.event_shape))[0] / 2e-6
    if family in (FullNormal, NormalWishart):
        # A symmetric matrix parameter: the gradient wrt entry (i, j) of the flattened
        # matrix equals the mean parameter when both (i, j) and (j, i) are perturbed
        # together, so compare symmetrised numerical gradients.
        d = q.event_shape[0]
        off = d if family is FullNormal else d + 1
        block = num[off : off + d * d].reshape(d, d)
        num[off : off + d * d] = (0.5 * (block + block.T)).ravel()
    np.testing.assert_allclose(num, grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_barycenter_minimises_weighted_kl(family):
    q = make(family, 4)
    w = np.array([0.1, 0.4, 0.3, 0.2])
    bary = q.barycenter(w)
    objective = lambda c: float((c.kl(q)[0] * w).sum())  # noqa: E731
    best = objective(bary)
    rng = np.random.default_rng(5)
    for _ in range(20):
        eta = bary.natural() + 1e-3 * rng.normal(size=bary.natural().shape)
        if family in (FullNormal, NormalWishart):  # keep matrix parameters symmetric
            d = q.event_shape[0]
            off = d if family is FullNormal else d + 1
            m = eta[0, off : off + d * d].reshape(d, d)
            eta[0, off : off + d * d] = (0.5 * (m + m.T)).ravel()
        assert objective(family.from_natural(eta, q.event_shape)) >= best - 1e-12


def test_gaussian_barycenter_closed_form():
    q = make(DiagNormal, 3)
    w = np.array([[1.0, 2.0, 1.0], [0.0, 1.0, 3.0]])
    bary = q.barycenter(w)
    wn = w / w.sum(1, keepdims=True)
    prec = wn @ (1 / q.var)
    np.testing.assert_allclose(bary.var, 1 / prec, rtol=1e-12)
    np.testing.assert_allclose(bary.loc, (wn @ (q.loc / q.var)) / prec, rtol=1e-12)


def test_indexing_and_concat():
    q = make(Dirichlet, 5)
    both = Dirichlet.concat([q[:2], q[2:]])
    np.testing.assert_array_equal(both.concentration, q.concentration)
    assert len(q[np.array([True, False, True, False, False])]) == 2


def test_bad_inputs():
    with pytest.raises(ValueError, match="var must be positive"):
        DiagNormal(loc=np.zeros((2, 3)), var=-np.ones((2, 3)))
    with pytest.raises(ValueError, match="shape"):
        DiagNormal(loc=np.zeros((2, 3)), var=np.ones((2, 4)))
    with pytest.raises(ValueError, match="positive definite"):
        FullNormal(loc=np.zeros((1, 2)), cov=np.array([[[1.0, 2.0], [2.0, 1.0]]]))
    with pytest.raises(ValueError, match="dof"):
        NormalWishart(mean=np.zeros((1, 3)), kappa=[1.0], dof=[1.5], scale=np.eye(3)[None])
    with pytest.raises(TypeError, match="cannot mix"):
        make(Gamma, 2).kl(make(Beta, 2))
    with pytest.raises(ValueError, match="event shape"):
        make(DiagNormal, 2, d=3).kl(make(DiagNormal, 2, d=4))
    with pytest.raises(ValueError, match="NaN"):
        Dirichlet(concentration=[[1.0, np.nan]])


@pytest.mark.parametrize("family", [DiagNormal, Gamma, Dirichlet])
def test_streamed_kl_std_is_the_full_matrix_std(family):
    # kl_moments merges blocks of rows (Chan, Golub & LeVeque): count, mean and std of all
    # entries equal those of the full matrix, whatever the block size (1 row, a few, all).
    rng = np.random.default_rng(11)
    qa, qb = make(family, 37, rng), make(family, 23, rng)
    full = qa.kl(qb)
    for block_bytes in (1, 8 * 23 * 5, 8 * 23 * 36, 2**26):
        count, mean, std = kl_moments(qa.kl_terms(), qb.kl_terms(), block_bytes=block_bytes)
        assert count == full.size
        assert mean == pytest.approx(full.mean(), rel=1e-12)
        assert std == pytest.approx(full.std(), rel=1e-12)
    assert qa.kl_std(qa, block_bytes=8 * 37 * 4) == pytest.approx(qa.kl(qa).std(), rel=1e-12)
    # the terms reproduce kl() entry for entry (same arithmetic), blocks of rows included
    np.testing.assert_array_equal(kl_matrix(qa.kl_terms()[5:9], qb.kl_terms()), full[5:9])


def test_barycenter_from_given_natural_parameters():
    q = make(Gamma, 4)
    w = np.array([[0.1, 0.4, 0.3, 0.2], [1.0, 0.0, 0.0, 1.0]])
    want = q.barycenter(w)
    got = q.barycenter(w, natural=q.kl_terms().eta)
    np.testing.assert_array_equal(got.shape, want.shape)
    np.testing.assert_array_equal(got.rate, want.rate)
    with pytest.raises(ValueError, match="one row per component"):
        q.barycenter(w, natural=q.natural()[:3])
