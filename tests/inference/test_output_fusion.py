"""The output layer fused as a product of the clients' Laplace fits, against independent computations."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import softmax

from bayesfuse.constraints import InvalidParameterError
from bayesfuse.inference.output_fusion import (
    OutputFit,
    _quadratic_model,
    class_blocks,
    evidence_precision,
    fit_output_layer,
    fuse_output_fits,
    output_posterior,
    prior_precision_from_weights,
)


def _client(seed: int, n: int = 300, g: int = 4, k: int = 3, shift: float = 0.0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, g)) + shift
    w = rng.normal(size=(g, k))
    y = np.array([rng.choice(k, p=p) for p in softmax(x @ w, axis=1)])
    return x, y


def test_fit_is_the_map_of_the_penalised_likelihood():
    from sklearn.linear_model import LogisticRegression

    x, y = _client(0)
    lam, j = 6.0, 3
    fit = fit_output_layer(x, y, 3, lam, n_clients=j, tol=1e-10)
    # scikit-learn's multinomial objective 1/2 |W|^2 + C sum NLL is ours (NLL + lam/(2J) |W|^2) with
    # C = J / lam; a column of ones as a feature puts the bias under the prior as ours is
    xb = np.hstack([x, np.ones((len(x), 1))])
    ref = LogisticRegression(C=j / lam, fit_intercept=False, tol=1e-12, max_iter=10_000).fit(xb, y)
    np.testing.assert_allclose(fit.weight, ref.coef_.T, atol=1e-5)
    p = softmax(xb @ fit.weight, axis=1)
    direct = np.mean([np.diag(q) - np.outer(q, q) for q in p], axis=0)
    np.testing.assert_allclose(fit.curvature, direct, atol=1e-12)
    np.testing.assert_allclose(fit.gram, xb.T @ xb / len(x), atol=1e-12)
    assert fit.n == 300 and fit.nbytes == 4 * (15 + 15 + 9) + 8  # float32, the Gram's upper triangle


def _random_fit(seed: int, g: int = 3, k: int = 2) -> OutputFit:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(g, g))
    p = rng.dirichlet(np.ones(k))
    return OutputFit(
        weight=rng.normal(size=(g, k)),
        gram=a @ a.T / g + np.eye(g),
        curvature=np.diag(p) - np.outer(p, p),
        n=int(rng.integers(10, 50)),
    )


def test_product_minimises_the_sum_of_the_clients_quadratics():
    fits = [_random_fit(s) for s in range(3)]
    lam = 2.0
    mean, cov = fuse_output_fits(fits, lam)

    # independently: the minimiser of sum_j 1/2 (w - w_j)^T H_j (w - w_j), by a generic optimiser,
    # with H_j = n_j A_j (x) S_j + lam/J written out entry by entry
    def h(f):
        g, k = f.weight.shape
        out = np.zeros((g, k, g, k))
        for i in range(g):
            for a in range(k):
                for i2 in range(g):
                    for b in range(k):
                        out[i, a, i2, b] = f.n * f.gram[i, i2] * f.curvature[a, b]
        return out.reshape(g * k, g * k) + lam / len(fits) * np.eye(g * k)

    hs = [h(f) for f in fits]

    def objective(w):
        d = [w - f.weight.ravel() for f in fits]
        return 0.5 * sum(x @ hh @ x for x, hh in zip(d, hs)), sum(hh @ x for x, hh in zip(d, hs))

    ref = minimize(objective, np.zeros(6), jac=True, method="BFGS", options=dict(gtol=1e-12)).x
    np.testing.assert_allclose(mean.ravel(), ref, atol=1e-6)
    full = np.linalg.inv(sum(hs)).reshape(3, 2, 3, 2)
    np.testing.assert_allclose(cov, np.stack([full[:, c, :, c] for c in range(2)]), atol=1e-12)


def test_one_client_and_identical_clients_fuse_to_the_client_and_order_does_not_matter():
    x, y = _client(1)
    one = fit_output_layer(x, y, 3, 4.0, n_clients=1, tol=1e-10)
    mean, _ = fuse_output_fits([one], 4.0)
    np.testing.assert_allclose(mean, one.weight, atol=1e-10)
    # J copies of a client, each with its J-th of the prior: the product is the same posterior mode
    share = fit_output_layer(x, y, 3, 4.0, n_clients=3, tol=1e-10)
    mean3, _ = fuse_output_fits([share] * 3, 4.0)
    np.testing.assert_allclose(mean3, share.weight, atol=1e-10)
    fits = [fit_output_layer(*_client(s, shift=s), 3, 4.0, n_clients=3) for s in range(3)]
    a, ca = fuse_output_fits(fits, 4.0)
    b, cb = fuse_output_fits(fits[::-1], 4.0)
    np.testing.assert_allclose(a, b, atol=1e-10)
    np.testing.assert_allclose(ca, cb, atol=1e-12)


def test_a_class_a_client_never_saw_is_decided_by_the_others():
    x, y = _client(2, n=600)
    seen = y != 2
    lacking = fit_output_layer(x[seen], y[seen], 3, 4.0, n_clients=2)
    full = fit_output_layer(x, y, 3, 4.0, n_clients=2)
    mean, _ = fuse_output_fits([lacking, full], 4.0)
    # the client without class 2 has little curvature for it (its prior share keeps p_2 off zero): the
    # product's class-2 logits (relative to the others') lie far closer to the client that saw it
    # than the plain average of the two fits does
    xb = np.hstack([x, np.ones((len(x), 1))])

    def class2(w):
        z = xb @ w
        return z[:, 2] - z.mean(1)

    average = (lacking.weight + full.weight) / 2
    assert lacking.curvature[2, 2] < 0.2 * full.curvature[2, 2]
    gap = np.mean((class2(mean) - class2(full.weight)) ** 2)
    assert gap < 0.25 * np.mean((class2(average) - class2(full.weight)) ** 2)


def _fits_of_clients(lam0: float, j: int = 3) -> list[OutputFit]:
    return [fit_output_layer(*_client(s, n=200, shift=0.3 * s), 3, lam0, n_clients=j, tol=1e-10) for s in range(j)]


def test_the_product_at_another_precision_is_the_quadratic_models_posterior():
    lam0 = 4.0
    fits = _fits_of_clients(lam0)
    # at lambda_0 it is the exact product
    for a, b in zip(fuse_output_fits(fits, lam0), fuse_output_fits(fits, lam0, posterior_precision=lam0)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    # elsewhere: the minimiser of sum_j [-(lambda_0/J W_hat_j)^T W + 1/2 (W - W_hat_j)^T L_j (W - W_hat_j)]
    # + lambda/2 |W|^2, written entry by entry and minimised generically
    lam = 0.7
    g, k = fits[0].weight.shape

    def objective(v):
        total = 0.5 * lam * v @ v
        for f in fits:
            h = f.n * np.kron(f.gram, f.curvature)
            d = v - f.weight.ravel()
            total += -(lam0 / len(fits)) * f.weight.ravel() @ v + 0.5 * d @ h @ d
        return total

    ref = minimize(objective, np.zeros(g * k), method="BFGS", options={"gtol": 1e-10}).x
    mean, _ = fuse_output_fits(fits, lam0, posterior_precision=lam)
    np.testing.assert_allclose(mean.ravel(), ref, atol=1e-5)


def test_output_posterior_is_the_product_at_the_evidences_precision():
    # one quadratic model for both steps: the same numbers as the two public functions apart
    lam0 = 4.0
    fits = _fits_of_clients(lam0)[:2]
    for by_evidence, n_clients in ((True, None), (True, 3), (False, 3)):
        mean, cov, lam = output_posterior(fits, lam0, by_evidence=by_evidence, n_clients=n_clients)
        want = evidence_precision(fits, lam0, n_clients=n_clients) if by_evidence else lam0
        assert lam == want
        ref_mean, ref_cov = fuse_output_fits(fits, lam0, posterior_precision=want, n_clients=n_clients)
        np.testing.assert_array_equal(mean, ref_mean)
        np.testing.assert_allclose(class_blocks(cov), ref_cov, rtol=1e-12, atol=1e-15)
        # the joint covariance is the whole inverse of the product's precision, cross-class blocks included
        curvature, _ = _quadratic_model(fits, lam0, n_clients)
        g, k = mean.shape
        direct = np.linalg.inv(curvature + lam * np.eye(g * k)).reshape(g, k, g, k)
        np.testing.assert_allclose(cov, direct, rtol=1e-8, atol=1e-12)


def test_a_lost_clients_share_of_the_prior_is_put_back():
    # three fits made with lambda_0 / 3 each; one reply lost: with n_clients=3 the product of the two
    # left has the prior once, the minimiser of their quadratic models plus lambda_0/2 |W|^2
    lam0 = 4.0
    fits = _fits_of_clients(lam0)[:2]
    g, k = fits[0].weight.shape

    def objective(v):
        total = 0.5 * lam0 * v @ v
        for f in fits:
            h = f.n * np.kron(f.gram, f.curvature)
            d = v - f.weight.ravel()
            total += -(lam0 / 3) * f.weight.ravel() @ v + 0.5 * d @ h @ d
        return total

    ref = minimize(objective, np.zeros(g * k), method="BFGS", options={"gtol": 1e-10}).x
    mean, _ = fuse_output_fits(fits, lam0, n_clients=3)
    np.testing.assert_allclose(mean.ravel(), ref, atol=1e-5)
    # without it, two thirds of the prior: another product
    assert not np.allclose(fuse_output_fits(fits, lam0)[0], mean, atol=1e-4)
    assert evidence_precision(fits, lam0, n_clients=3) > 0
    with pytest.raises(ValueError, match="n_clients must be at least the 2 fits"):
        fuse_output_fits(fits, lam0, n_clients=1)


def test_the_evidence_precision_is_mackays_fixed_point_and_the_brute_force_maximum():
    lam0 = 4.0
    fits = _fits_of_clients(lam0)
    lam = evidence_precision(fits, lam0)
    g, k = fits[0].weight.shape
    d = g * k
    curvature = sum(f.n * np.kron(f.gram, f.curvature) for f in fits)
    target = sum((f.n * np.kron(f.gram, f.curvature) + lam0 / len(fits) * np.eye(d)) @ f.weight.ravel() for f in fits)

    def log_evidence(v):  # with slogdet and solve, no eigendecomposition
        p = curvature + v * np.eye(d)
        return 0.5 * d * np.log(v) - 0.5 * np.linalg.slogdet(p)[1] + 0.5 * target @ np.linalg.solve(p, target)

    # MacKay (1992): at the maximum lambda |m|^2 = d - lambda tr(P^-1), the number of well-determined weights
    p_inv = np.linalg.inv(curvature + lam * np.eye(d))
    m = p_inv @ target
    assert lam * m @ m == pytest.approx(d - lam * np.trace(p_inv), rel=1e-4)
    # and no value on a fine grid of the brute-force evidence is higher
    grid = lam0 * np.logspace(-3, 3, 601)
    assert log_evidence(lam) >= max(log_evidence(v) for v in grid) - 1e-8
    # the search is bounded: lambda_0 * span at most
    assert evidence_precision(fits, lam0, span=1.0) == pytest.approx(lam0)


def test_prior_precision_from_weights():
    assert prior_precision_from_weights([np.full((2, 3), 0.5), np.full((1, 3), -0.5)]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="all zero"):
        prior_precision_from_weights([np.zeros((2, 2))])


def test_prior_precision_keeps_the_logits_prior_variance_at_the_fused_fan_in():
    # clients of 2 and 4 inputs (mean fan-in 3), every weight +-1: the unscaled precision is 1, and
    # a fused layer of 6 inputs halves each weight's prior variance (precision 6 / 3 = 2)
    weights = [np.ones((2, 2)), -np.ones((2, 4))]
    assert prior_precision_from_weights(weights) == pytest.approx(1.0)
    lam = prior_precision_from_weights(weights, fan_in=6)
    assert lam == pytest.approx(2.0)
    # the prior variance of a logit over unit features, fan_in / lambda, is the clients' mean, 3 / 1
    assert 6 / lam == pytest.approx(np.mean([w.shape[1] for w in weights]) / 1.0)
    # one client, fused to itself: no scaling
    assert prior_precision_from_weights([np.full((3, 5), 0.5)], fan_in=5) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="fan_in"):
        prior_precision_from_weights(weights, fan_in=0)


def test_bad_inputs_are_refused():
    x, y = _client(3)
    with pytest.raises(InvalidParameterError, match="prior_precision"):
        fit_output_layer(x, y, 3, -1.0)
    with pytest.raises(ValueError, match="labels must be"):
        fit_output_layer(x, y + 5, 3, 1.0)
    with pytest.raises(ValueError, match="NaN"):
        fit_output_layer(np.full_like(x, np.nan), y, 3, 1.0)
    with pytest.raises(ValueError, match="differ in shape"):
        fuse_output_fits([_random_fit(0), _random_fit(1, g=4)], 1.0)
    with pytest.raises(ValueError, match="at least one"):
        fuse_output_fits([], 1.0)


def test_a_wide_layer_is_multiplied_by_conjugate_gradients(monkeypatch):
    # Above MAX_JOINT the product is not built as one d x d matrix: its mean must still be the
    # joint solve's (conjugate gradients to 1e-10), and each class's covariance the inverse of the
    # precision's class block, which is never wider than the joint inverse's block (the other
    # classes' coupling adds variance: P^{-1}_kk - (P_kk)^{-1} is positive semi-definite).
    from bayesfuse.inference import output_fusion as of

    rng = np.random.default_rng(7)
    G, K, J = 6, 4, 3
    fits = []
    for _ in range(J):
        a = rng.normal(size=(40, G))
        p = np.exp(rng.normal(size=(40, K)))
        p /= p.sum(1, keepdims=True)
        feats = np.hstack([a, np.ones((40, 1))])
        curvature = (np.einsum("nk,kl->nkl", p, np.eye(K)) - np.einsum("nk,nl->nkl", p, p)).mean(0)
        fits.append(
            of.OutputFit(weight=rng.normal(size=(G + 1, K)), gram=feats.T @ feats / 40, curvature=curvature, n=40)
        )
    joint_mean, joint_cov = of.fuse_output_fits(fits, 0.5)
    curvature, target = of._quadratic_model(fits, 0.5)
    precision = curvature + 0.5 * np.eye(len(target))
    monkeypatch.setattr(of, "MAX_JOINT", 10)
    assert not of.solved_jointly((G + 1, K))
    mean, cov = of.fuse_output_fits(fits, 0.5)
    np.testing.assert_allclose(mean, joint_mean, rtol=1e-8, atol=1e-10)
    for c in range(K):
        idx = np.arange(G + 1) * K + c  # class c's weights in weight.ravel() order
        np.testing.assert_allclose(cov[c], np.linalg.inv(precision[np.ix_(idx, idx)]), rtol=1e-10, atol=1e-12)
        assert np.linalg.eigvalsh(joint_cov[c] - cov[c]).min() > -1e-12
    wide_mean, wide_cov, chosen = of.output_posterior(fits, 0.5)  # no evidence search: lambda_0
    assert chosen == 0.5
    np.testing.assert_allclose(wide_mean, joint_mean, rtol=1e-8, atol=1e-10)
