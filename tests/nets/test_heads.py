"""The clients' heads on a fused network (bayesfuse.nets.heads), by hand and from the refit round.

The body runs in float32 and the heads in float64 on its features, so a NumPy computation from
the same features agrees to float64 round-off."""

import dataclasses
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import bayesfuse
from bayesfuse.data import dirichlet_partition
from bayesfuse.inference.result import ConvergenceWarning
from bayesfuse.nets.heads import PSEUDO_COUNT, ClientHeads, class_shares, logit_variances, logits_and_features
from bayesfuse.nets.predict import predict_proba
from bayesfuse.summaries import output_features, output_fit
from bayesfuse.train import TrainConfig, train_clients


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _network(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).eval()


def _heads(rng, J: int = 3, K: int = 3, G: int = 4):
    weight, bias = rng.normal(size=(J, K, G)), rng.normal(size=(J, K))
    counts = rng.integers(0, 20, size=(J, K)).astype(float)
    counts[:, 0] = [7.0] + [0.0] * (J - 1)  # class 0 seen by client 0 alone
    return weight, bias, class_shares(counts)


def _pooled_by_hand(net, weight, bias, shares, x, pool: str) -> np.ndarray:
    """(N, K) unnormalised pool of the heads' softmaxes on ``net``'s features: the mixture's
    ``sum_j s_jk p_jk`` or the geometric ``prod_j p_jk^s_jk``."""
    features = net[1](net[0](x)).detach().double().numpy()
    p = np.stack([_softmax(features @ w.T + b) for w, b in zip(weight, bias)])  # (J, N, K)
    if pool == "linear":
        return np.einsum("jk,jnk->nk", shares, p)
    return np.exp(np.einsum("jk,jnk->nk", shares, np.log(p)))


def test_one_head_is_its_own_softmax():
    net = _network()
    rng = np.random.default_rng(0)
    weight, bias = rng.normal(size=(1, 3, 4)), rng.normal(size=(1, 3))
    x = torch.randn(6, 5)
    features = net[1](net[0](x)).detach().double().numpy()
    expected = _softmax(features @ weight[0].T + bias[0])
    for pool in ("linear", "log"):
        model = ClientHeads(net, "2", weight, bias, np.ones((1, 3)), pool=pool)
        assert np.allclose(predict_proba(model, x), expected, rtol=1e-10, atol=1e-12)  # heads in float64


@pytest.mark.parametrize("pool", ["linear", "log"])
def test_pools_by_hand(pool):
    net = _network()
    rng = np.random.default_rng(1)
    weight, bias, shares = _heads(rng)
    x = torch.randn(6, 5)
    pooled = _pooled_by_hand(net, weight, bias, shares, x, pool)
    expected = pooled / pooled.sum(1, keepdims=True)
    got = predict_proba(ClientHeads(net, "2", weight, bias, shares, pool=pool), x)
    assert np.allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_smoothing_is_the_dirichlet_posterior_mean_of_each_heads_predictive():
    """Head j's predictive becomes ``(n_j p + c) / (n_j + K c)`` (the module docstring), against
    the unsmoothed heads of the same weights; so no head puts less than ``c / (n_j + K c)`` on a
    class, however confidently wrong its softmax, and the log pool's veto is bounded by that."""
    net = _network()
    rng = np.random.default_rng(3)
    weight, bias, shares = _heads(rng)
    weight[1] *= 200.0  # head 1 is sure of itself: its softmax reaches e^-100 and below
    x = torch.randn(20, 5)
    n = np.array([40.0, 9.0, 120.0])
    plain = ClientHeads(net, "2", weight, bias, shares, pool="log")
    with torch.no_grad():
        raw = plain.head_log_probs(x).numpy()
    assert raw.min() < -100.0
    for c in (1.0, 0.25):
        model = ClientHeads(net, "2", weight, bias, shares, pool="log", examples=n, pseudo_count=c)
        with torch.no_grad():
            got = model.head_log_probs(x).numpy()
        expected = np.log((n[:, None, None] * np.exp(raw) + c) / (n[:, None, None] + 3 * c))
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
        floor = np.log(c / (n + 3 * c))
        assert (got >= floor[:, None, None] - 1e-12).all()
        # the geometric pool of the smoothed heads, by hand
        pooled = np.exp(np.einsum("jk,jnk->nk", shares, expected))
        np.testing.assert_allclose(predict_proba(model, x), pooled / pooled.sum(1, keepdims=True), rtol=1e-10)
    # c = 0, or no examples: the heads as they are
    off = ClientHeads(net, "2", weight, bias, shares, pool="log", examples=n, pseudo_count=0.0)
    np.testing.assert_array_equal(predict_proba(off, x), predict_proba(plain, x))
    model.pseudo_count = 0
    np.testing.assert_array_equal(predict_proba(model, x), predict_proba(plain, x))
    # a head with no examples knows nothing: uniform
    empty = ClientHeads(net, "2", weight, bias, shares, examples=[0.0, 9.0, 120.0])
    with torch.no_grad():
        np.testing.assert_allclose(empty.head_log_probs(x)[0].numpy(), np.log(1 / 3), rtol=1e-12)
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="pseudo_count must be a finite number >= 0"):
            ClientHeads(net, "2", weight, bias, shares, pseudo_count=bad)
    with pytest.raises(ValueError, match=r"examples must be 3 numbers \(each head's examples\), got shape \(2,\)"):
        ClientHeads(net, "2", weight, bias, shares, examples=[1.0, 2.0])
    for examples in ([1.0, -2.0, 3.0], [1.0, np.inf, 3.0]):
        with pytest.raises(ValueError, match="each head's examples must be a finite number >= 0, got"):
            ClientHeads(net, "2", weight, bias, shares, examples=examples)
    # NumPy numbers are numbers; a huge pseudo-count makes every head uniform, not NaN
    model.pseudo_count = np.float32(0.5)
    model.pseudo_count = np.int64(1)
    model.pseudo_count = 1e308
    with torch.no_grad():
        np.testing.assert_allclose(model.head_log_probs(x).numpy(), np.log(1 / 3), rtol=1e-9)


def test_the_heads_variants_keep_their_smoothing():
    """with_diagonal, with_scale and with_eigenvalues keep the examples and the pseudo-count."""
    net = _network()
    rng = np.random.default_rng(4)
    weight, bias, shares = _heads(rng)
    J, K, G = weight.shape
    a = rng.normal(size=(J, G + 1, G + 1))
    laplace = dict(
        gram=a @ a.transpose(0, 2, 1),
        curvature=np.tile(np.eye(K) - 1 / K, (J, 1, 1)),
        n=np.full(J, 10.0),
        prior_precision=1.0,
    )
    model = ClientHeads(net, "2", weight, bias, shares, laplace=laplace, examples=[5.0, 6.0, 7.0], pseudo_count=0.5)
    for twin in (
        model.with_diagonal(np.full((J, K, G + 1), 3.0)),
        model.with_scale(np.full(J, 2.0)),
        model.with_eigenvalues(np.ones((J, G + 1, K))),
    ):
        assert twin.pseudo_count == 0.5 and twin.examples.tolist() == [5.0, 6.0, 7.0]


def test_class_shares_and_refusals():
    shares = class_shares(np.array([[3.0, 0.0, 1.0], [1.0, 0.0, 3.0]]))
    assert np.allclose(shares, [[0.75, 0.5, 0.25], [0.25, 0.5, 0.75]])  # an unseen class: 1/J each
    net = _network()
    rng = np.random.default_rng(2)
    weight, bias, shares = _heads(rng)
    with pytest.raises(ValueError, match="sum to 1 over the clients"):
        ClientHeads(net, "2", weight, bias, shares * 2)
    with pytest.raises(ValueError, match=r"do not fit the output layer"):
        ClientHeads(net, "2", weight[:, :, :3], bias, shares)
    with pytest.raises(ValueError, match="must be an nn.Linear"):
        ClientHeads(net, "1", weight, bias, shares)
    with pytest.raises(ValueError, match="pool must be one of"):
        ClientHeads(net, "2", weight, bias, shares, pool="max")
    with pytest.raises(ValueError, match="must be finite"):
        ClientHeads(net, "2", np.full_like(weight, np.nan), bias, shares)
    with pytest.raises(ValueError, match="counts >= 0"):
        class_shares(np.array([[-1.0, 2.0]]))


@pytest.fixture(scope="module")
def federation(digits):
    part = dirichlet_partition(digits.train.y, 4, 0.5, seed=0)
    models = train_clients(digits.train, part, TrainConfig(hidden=(20,), epochs=5, seed=0), verbose=False)
    return digits, part, models


def test_the_refit_round_keeps_the_clients_fits_as_heads(federation):
    split, part, models = federation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        shared = bayesfuse.fuse(models, "pfnm", rounds=2, data=(split.train, part))
        heads = bayesfuse.fuse(models, "pfnm", rounds=2, data=(split.train, part), head="clients")
    model = heads.model
    assert isinstance(model, ClientHeads) and model.n_heads == 4
    assert "ClientHeads" in heads.hyper["predictive"]
    # the heads are the clients' replies: their fits on the fused features, recomputed here in the fused order
    lam = heads.hyper["second_round"]["fit_prior_precision"]
    order = heads.hyper["fused_order"]
    for j, c in enumerate(order):
        idx = part[c]
        fit = output_fit(model.network, model.output, split.train.x[idx], split.train.y[idx], lam, n_clients=4)
        assert np.allclose(model.weight[j].numpy(), fit.weight[:-1].T, atol=1e-8)
        assert np.allclose(model.bias[j].numpy(), fit.weight[-1], atol=1e-8)
    assert np.allclose(model.shares.numpy(), class_shares(np.asarray(part.counts)[order]))
    # the body is the same fused network as the probit model's
    x = split.test.x[:50]
    assert np.allclose(
        output_features(model.network, model.output, x), output_features(shared.model.network, "layers.1", x)
    )
    probs = predict_proba(model, split.test.x)
    assert np.allclose(probs.sum(1), 1.0) and (probs.argmax(1) == split.test.y).mean() > 0.8
    # each head is its fit's Laplace posterior, with the prior share the fit was made with
    assert model.predictive == "laplace" and torch.allclose(
        model.prior, torch.full((model.n_heads,), lam / 4, dtype=torch.float64)
    )
    assert torch.allclose(model.n, torch.as_tensor(np.asarray(part.counts)[order].sum(1), dtype=torch.float64))
    # each head smoothed by its client's examples (the class counts of its reply, summed), in the fused order
    examples = np.asarray(part.counts)[order].sum(1).astype(float)
    np.testing.assert_array_equal(model.examples.numpy(), examples)
    assert model.pseudo_count == 1.0 and "smoothed by its client's examples" in heads.hyper["predictive"]
    with torch.no_grad():
        smoothed = model.head_log_probs(torch.as_tensor(x, dtype=torch.float32)).numpy()
        model.pseudo_count = 0
        raw = model.head_log_probs(torch.as_tensor(x, dtype=torch.float32)).numpy()
        model.pseudo_count = 1.0
    n = examples[:, None, None]
    np.testing.assert_allclose(np.exp(smoothed), (n * np.exp(raw) + 1) / (n + raw.shape[-1]), rtol=1e-12)
    model.predictive = "map"
    assert not np.allclose(predict_proba(model, split.test.x), probs)


def test_a_plain_list_partition_and_the_pool_setting(federation):
    split, part, models = federation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        given = bayesfuse.fuse(models, "pfnm", rounds=2, data=(split.train, part), head="clients")
        listed = bayesfuse.fuse(models, "pfnm", rounds=2, data=(split.train, list(part)), head="clients")
    assert torch.equal(given.model.shares, listed.model.shares)  # class counts from the labels
    assert np.array_equal(predict_proba(given.model, split.test.x), predict_proba(listed.model, split.test.x))
    listed.model.pool = "log"
    assert listed.model.pool == "log"
    with pytest.raises(ValueError, match="pool must be one of"):
        listed.model.pool = "max"


@pytest.mark.parametrize("pool", ["linear", "log"])
def test_a_temperature_tempers_the_pool_by_hand(pool):
    net = _network()
    weight, bias, shares = _heads(np.random.default_rng(2))
    x = torch.randn(6, 5)
    tempered = _pooled_by_hand(net, weight, bias, shares, x, pool) ** (1 / 2.5)  # p(k | x) proportional to pool_k^(1/T)
    model = ClientHeads(net, "2", weight, bias, shares, pool=pool)
    model.temperature.fill_(2.5)
    got = predict_proba(model, x)
    assert np.allclose(got, tempered / tempered.sum(1, keepdims=True), rtol=1e-10, atol=1e-12)
    assert float(model.state_dict()["temperature"]) == 2.5


def test_heads_need_one_shot_matching_or_the_refit_round(federation):
    split, part, models = federation
    with pytest.raises(ValueError, match="with summaries, from the temperature round"):
        bayesfuse.fuse(models, "pfnm", rounds=2, second_round="temperature", data=(split.train, part), head="clients")
    with pytest.raises(ValueError, match="has one head"):
        bayesfuse.fuse(models, "fedma", data=(split.train, part), head="clients")
    for method in ("ot", "fedavg"):
        with pytest.raises(ValueError, match="method must be one of pfnm, nafi"):
            bayesfuse.fuse(models, method, head="clients")


# --------------------------------------------------------------------------- one shot: the clients' own heads


def _one_shot(models, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return bayesfuse.fuse(models, "pfnm", head="clients", **kwargs)


def test_one_shot_heads_are_the_clients_output_layers_moved_to_their_global_units(federation):
    split, part, models = federation
    res = _one_shot(models, class_counts=part.counts)
    model = res.model
    assert isinstance(model, ClientHeads) and model.predictive == "map" and model.n_heads == 4
    assert "one shot" in res.hyper["predictive"]
    body = model.network
    x = torch.as_tensor(split.test.x[:50], dtype=torch.float32)
    h = torch.relu(body.layers[0](x)).detach().double().numpy()  # the fused features
    logs = []
    for j, (m, a) in enumerate(zip(models, res.layers[0].assignments)):  # in the callers' order
        w = m.layers[1].weight.detach().double().numpy()
        b = m.layers[1].bias.detach().double().numpy()
        z = sum(np.outer(h[:, g], w[:, l]) for l, g in enumerate(np.asarray(a))) + b  # unit l sits at global g
        # smoothed by the client's examples: (n_j p + c) / (n_j + K c), c = 1 (Laplace's rule)
        n = part.counts[j].sum()
        logs.append(np.log((n * _softmax(z) + 1.0) / (n + z.shape[1])))
    assert model.pseudo_count == PSEUDO_COUNT == 1.0
    # the class-share mixture of those heads, in any client order
    shares = class_shares(part.counts)
    mixture = sum(shares[j] * np.exp(logs[j]) for j in range(4))
    np.testing.assert_allclose(
        predict_proba(model, split.test.x[:50]), mixture / mixture.sum(1, keepdims=True), rtol=1e-5, atol=1e-7
    )
    flipped = _one_shot(models[::-1], class_counts=part.counts[::-1])
    np.testing.assert_array_equal(predict_proba(flipped.model, split.test.x), predict_proba(model, split.test.x))


def test_permuted_copies_with_one_shot_heads_fuse_back_to_the_network(federation):
    from bayesfuse.inference.spec import permute, random_permutations
    from bayesfuse.nets.arch import rebuild
    from bayesfuse.nets.spec import spec_from_module
    from bayesfuse.nets.state import numpy_state

    _, _, models = federation
    net = models[0]
    spec = spec_from_module(net)
    state = numpy_state(net.state_dict())
    rng = np.random.default_rng(0)
    copies = [
        rebuild(
            net,
            {
                k: torch.as_tensor(v)
                for k, v in permute(state, spec, random_permutations(spec.sizes(state), rng)).items()
            },
        )
        for _ in range(3)
    ]
    res = _one_shot(copies)
    x = np.random.default_rng(1).normal(size=(40, net.layers[0].in_features))
    np.testing.assert_allclose(predict_proba(res.model, x), predict_proba(net, x), atol=1e-5)


# --------------------------------------------------------------------------- heads as Laplace posteriors


def _laplace_factors(rng, J: int, K: int, G: int):
    """Factors as a fit makes them: the Gram of features with a bias column, the mean softmax Hessian."""
    grams, curvatures = [], []
    for _ in range(J):
        a = np.hstack([rng.normal(size=(30, G)), np.ones((30, 1))])
        p = _softmax(rng.normal(size=(30, K)) * 2)
        grams.append(a.T @ a / 30)
        curvatures.append(np.diag(p.mean(0)) - p.T @ p / 30)
    return dict(gram=np.stack(grams), curvature=np.stack(curvatures), n=rng.integers(5, 50, size=J).astype(float))


def _laplace_heads(seed: int, prior_precision: float):
    """A network, three heads on it and their Laplace factors."""
    rng = np.random.default_rng(seed)
    weight, bias, shares = _heads(rng)
    J, K, G = weight.shape
    return rng, _network(), weight, bias, shares, dict(_laplace_factors(rng, J, K, G), prior_precision=prior_precision)


def _logit_covariance(A, S, n: float, lam: float, a: np.ndarray, V: np.ndarray) -> np.ndarray:
    """``V^T Cov(f) V`` for features ``a`` (bias included), from the posterior written out: the
    precision ``n A (x) S + lambda I`` over vec(W), W (G+1, K) in row-major order (index g K + k)."""
    K = len(S)
    cov_w = np.linalg.inv(n * np.kron(A, S) + lam * np.eye(len(A) * K))
    M = np.kron(a[None, :], np.eye(K))  # f = M vec(W)
    return V.T @ M @ cov_w @ M.T @ V


def test_logit_variances_are_the_kfac_posteriors():
    """Against the posterior written out: precision n A (x) S + lambda I over vec(W), W (G+1, K)."""
    rng = np.random.default_rng(1)
    K, G, lam = 3, 4, 0.7
    f = _laplace_factors(rng, 1, K, G)
    A, S, n = f["gram"][0], f["curvature"][0], f["n"][0]
    x = np.hstack([rng.normal(size=(6, G)), np.ones((6, 1))])
    c, V = np.linalg.eigh(S)
    b, U = np.linalg.eigh(A)
    got = logit_variances(*(torch.as_tensor(t) for t in (x, U, b, c)), n, lam).numpy()
    for i, a in enumerate(x):
        rotated = _logit_covariance(A, S, n, lam, a, V)
        assert np.allclose(np.diag(rotated), got[i], rtol=1e-10)
        assert np.allclose(rotated - np.diag(np.diag(rotated)), 0.0, atol=1e-10 * np.abs(rotated).max())


def test_laplace_heads_predict_the_mixture_of_mean_softmaxes_over_their_draws():
    rng, net, weight, bias, shares, factors = _laplace_heads(2, 0.5)
    J, K, _ = weight.shape
    model = ClientHeads(net, "2", weight, bias, shares, laplace=factors, samples=16).eval()
    x = rng.normal(size=(7, 5)).astype(np.float32)
    features = np.hstack([output_features(net, "2", x).astype(np.float64), np.ones((7, 1))])
    expected = np.zeros((7, K))
    for j in range(J):
        W = np.vstack([weight[j].T, bias[j]])
        A, S, n = factors["gram"][j], factors["curvature"][j], factors["n"][j]
        V = np.linalg.eigh(S)[1]
        p = np.zeros((7, K))
        for i, a in enumerate(features):
            sd = np.sqrt(np.clip(np.diag(_logit_covariance(A, S, n, 0.5, a, V)), 0, None))
            draws = model.draws[j].numpy() * sd  # the heads' fixed draws, in V's basis
            p[i] = _softmax(a @ W + draws @ V.T).mean(0)
        expected += shares[j] * p
    expected /= expected.sum(1, keepdims=True)
    assert np.allclose(predict_proba(model, x), expected, atol=1e-8)
    # the same input gives the same prediction in any batch
    assert np.allclose(predict_proba(model, x[:3]), predict_proba(model, x)[:3], atol=1e-12)
    # a prior that pins the weights: the heads' means
    pinned = ClientHeads(net, "2", weight, bias, shares, laplace=dict(factors, prior_precision=1e12)).eval()
    plain = ClientHeads(net, "2", weight, bias, shares).eval()
    assert plain.predictive == "map"
    assert np.allclose(predict_proba(pinned, x), predict_proba(plain, x), atol=1e-5)


def test_predict_draws_afresh_from_num_samples_and_seed():
    """predict(num_samples=, seed=) makes its own draws (the heads' fixed ones are those of seed 0),
    the same for every input; more draws bring it to the predictive: with 20,000 draws per head
    each probability's Monte Carlo sd is under 0.5 / sqrt(2e4) ~ 0.0035, and 64 draws' under
    0.5 / 8 = 0.0625, so they differ by less than 5 sd of the larger."""
    rng, net, weight, bias, shares, factors = _laplace_heads(2, 0.5)
    model = ClientHeads(net, "2", weight, bias, shares, laplace=factors, samples=64).eval()
    x = rng.normal(size=(7, 5)).astype(np.float32)
    fixed = model.predict(x)
    np.testing.assert_array_equal(fixed, predict_proba(model, x))
    np.testing.assert_allclose(model.predict(x, num_samples=64, seed=0), fixed, rtol=1e-12)
    other = model.predict(x, num_samples=64, seed=1)
    assert np.abs(other - fixed).max() > 1e-4  # another seed, other draws
    np.testing.assert_allclose(model.predict(x[2:3], num_samples=64, seed=1), other[2:3], rtol=1e-12)
    many = model.predict(x, num_samples=np.int64(20_000), seed=3)
    assert np.abs(many - fixed).max() < 5 * 0.0625
    np.testing.assert_array_equal(model.predict(x), fixed)  # the heads' own draws are kept
    with pytest.raises(ValueError, match="give x as a batch of inputs"):
        model.predict(x[0])
    with pytest.raises(ValueError, match="num_samples must be a positive integer"):
        model.predict(x, num_samples=0)


def test_the_predictive_taken_in_pieces_is_the_same(monkeypatch):
    """ClientHeads takes inputs _ROWS at a time; no input's result depends on another's, so the
    pieces change nothing but round-off (matrix kernels group the same sums differently by the
    number of rows: a few units in the last place, Kronecker and diagonal heads)."""
    import bayesfuse.nets.heads as heads_module

    rng, net, weight, bias, shares, factors = _laplace_heads(5, 0.5)
    J, K, G = weight.shape
    diagonal = dict(precision=rng.uniform(0.5, 3.0, size=(J, K, G + 1)))
    x = rng.normal(size=(10, 5)).astype(np.float32)
    for laplace in (factors, diagonal):
        model = ClientHeads(net, "2", weight, bias, shares, laplace=laplace, samples=8).eval()
        whole = predict_proba(model, x)
        monkeypatch.setattr(heads_module, "_ROWS", 3)
        np.testing.assert_allclose(predict_proba(model, x), whole, rtol=1e-13, atol=1e-15)
        monkeypatch.undo()


def test_laplace_factors_are_checked():
    _, net, weight, bias, shares, good = _laplace_heads(3, 1.0)
    J, K, _ = weight.shape
    with pytest.raises(ValueError, match=r"missing \['prior_precision'\]"):
        ClientHeads(net, "2", weight, bias, shares, laplace={k: v for k, v in good.items() if k != "prior_precision"})
    with pytest.raises(ValueError, match="do not fit 3 heads"):
        ClientHeads(net, "2", weight, bias, shares, laplace=dict(good, gram=good["gram"][:, :-1, :-1]))
    with pytest.raises(ValueError, match="positive semi-definite"):
        ClientHeads(net, "2", weight, bias, shares, laplace=dict(good, curvature=-good["curvature"] - np.eye(K)))
    with pytest.raises(ValueError, match="n > 0"):
        ClientHeads(net, "2", weight, bias, shares, laplace=dict(good, n=np.zeros(J)))
    with pytest.raises(ValueError, match="prior precision > 0"):
        ClientHeads(net, "2", weight, bias, shares, laplace=dict(good, prior_precision=0.0))
    with pytest.raises(ValueError, match="samples must be"):
        ClientHeads(net, "2", weight, bias, shares, laplace=good, samples=0)
    plain = ClientHeads(net, "2", weight, bias, shares)
    with pytest.raises(ValueError, match="no posteriors"):
        plain.predictive = "laplace"
    with pytest.raises(ValueError, match="predictive must be one of"):
        plain.predictive = "probit"


# --------------------------------------------------------------------------- diagonal posteriors (one shot)


def test_diagonal_laplace_heads_predict_the_mean_softmax_of_independent_logits():
    rng = np.random.default_rng(4)
    weight, bias, shares = _heads(rng)
    J, K, G = weight.shape
    precision = rng.uniform(0.5, 5.0, size=(J, K, G + 1))
    precision[1, :, 2] = np.inf  # head 1 has no weight from feature 2
    net = _network()
    model = ClientHeads(net, "2", weight, bias, shares, laplace={"precision": precision}, samples=16).eval()
    assert model.predictive == "laplace"
    x = rng.normal(size=(7, 5))
    with torch.no_grad():
        a = torch.relu(net[0](torch.as_tensor(x, dtype=torch.float32))).double().numpy()
    a1 = np.hstack([a, np.ones((7, 1))])
    draws = model.draws.numpy()
    mixture = 0.0
    for j in range(J):
        mean = a @ weight[j].T + bias[j]
        sd = np.sqrt(np.einsum("ng,kg->nk", a1**2, 1.0 / precision[j]))  # Var f_k = sum_g a_g^2 / P_kg
        p = np.mean([_softmax(mean + sd * e) for e in draws[j]], axis=0)
        mixture = mixture + shares[j] * p
    np.testing.assert_allclose(predict_proba(model, x), mixture / mixture.sum(1, keepdims=True), rtol=1e-9)
    # precisions that pin every weight give the means
    pinned = ClientHeads(net, "2", weight, bias, shares, laplace={"precision": np.full((J, K, G + 1), np.inf)})
    means = ClientHeads(net, "2", weight, bias, shares)
    np.testing.assert_allclose(predict_proba(pinned.eval(), x), predict_proba(means.eval(), x), rtol=1e-12)
    for bad, message in (
        ({"precision": precision[:, :, :-1]}, "does not fit 3 heads"),
        ({"precision": -precision}, "must be positive"),
        ({"precision": np.full_like(precision, np.nan)}, "must be positive"),
        ({"precision": precision, "n": np.ones(J)}, "takes precision alone"),
    ):
        with pytest.raises(ValueError, match=message):
            ClientHeads(net, "2", weight, bias, shares, laplace=bad)


def test_one_shot_heads_with_summaries_are_the_clients_diagonal_laplace_posteriors(federation):
    """Summaries without the output layer's Kronecker factors (version 1): diagonal posteriors."""
    from dataclasses import replace

    from bayesfuse import summarize

    split, part, models = federation
    summaries = [
        replace(summarize(m, split.train.x[i], split.train.y[i]), output_factors=None, version=1)
        for m, i in zip(models, part)
    ]
    res = _one_shot(models, summaries=summaries)
    model = res.model
    assert model.predictive == "laplace" and model.form == "diagonal"
    assert "diagonal Laplace" in res.hyper["predictive"]
    inv = model.inv_precision.numpy()
    G = inv.shape[2] - 1
    for m, s, a in zip(models, summaries, res.layers[0].assignments):  # the callers' order
        j = next(
            i for i in range(4) if np.array_equal(model.bias[i].numpy(), m.layers[1].bias.detach().double().numpy())
        )
        expected = np.zeros_like(inv[j])  # no weight, no variance
        expected[:, np.asarray(a)] = 1.0 / (s.precision["layers.1.weight"] + s.prior_precision)
        expected[:, G] = 1.0 / (s.precision["layers.1.bias"] + s.prior_precision)
        np.testing.assert_allclose(inv[j], expected, rtol=1e-12)
    probs = predict_proba(model, split.test.x)
    assert np.isfinite(probs).all() and np.allclose(probs.sum(1), 1)


def test_one_shot_heads_need_an_output_layer_that_reads_units():
    from bayesfuse.nets.arch import make_cnn
    from bayesfuse.nets.spec import spec_from_module
    from bayesfuse.nets.state import numpy_state

    cnn = make_cnn(784, 10, channels=(4,), hidden=()).eval()  # the output layer reads channels x positions
    spec = spec_from_module(cnn, torch.zeros(2, 784))
    state = numpy_state(cnn.state_dict())
    with pytest.raises(ValueError, match="reads one hidden group unit by unit.*with positions"):
        ClientHeads.from_clients(cnn, spec, [state], {g: [np.arange(4)] for g in spec.groups})


def test_one_shot_kronecker_heads_are_the_clients_kfac_posteriors_on_their_matched_units(federation):
    """Each head's logit covariance on fused features equals the covariance under its client's own
    Kronecker-factored Laplace posterior, ``(n A (x) S + delta I)^-1`` over its own output weights,
    computed here with full matrices on the fused features at the client's matched columns: the
    global units the client has no unit in add nothing."""
    from bayesfuse import summarize
    from bayesfuse.nets.heads import logit_variances, logits_and_features

    split, part, models = federation
    summaries = [summarize(m, split.train.x[i], split.train.y[i]) for m, i in zip(models, part)]
    res = _one_shot(models, summaries=summaries)
    model = res.model
    assert model.form == "kronecker" and "Kronecker-factored Laplace" in res.hyper["predictive"]
    x = torch.as_tensor(split.test.x[:7])
    with torch.no_grad():
        _, features = logits_and_features(model.network, model.output, x)
    a_fused = torch.cat([features.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    G = a_fused.shape[1] - 1
    for m, s, a in zip(models, summaries, res.layers[0].assignments):
        j = next(
            i for i in range(4) if np.array_equal(model.bias[i].numpy(), m.layers[1].bias.detach().double().numpy())
        )
        gram, curv = s.output_factors["gram"], s.output_factors["curvature"]
        K, H1 = len(curv), len(gram)
        precision = s.n_examples * np.kron(gram, curv) + s.prior_precision * np.eye(H1 * K)  # index (g, k)
        cov_w = np.linalg.inv(precision)
        own = a_fused[:, np.append(np.asarray(a), G)].numpy()  # the client's features, bias last
        var = logit_variances(
            a_fused * model.support[j],
            model.gram_vecs[j],
            model.gram_vals[j],
            model.curv_vals[j],
            float(model.n[j]),
            float(model.prior[j]),
        ).numpy()
        V = model.curv_vecs[j].numpy()
        for n in range(len(x)):
            design = np.kron(own[n][None, :], np.eye(K))  # f = (a~^T (x) I_K) vec(W)
            cov_f = design @ cov_w @ design.T
            np.testing.assert_allclose(V.T @ cov_f @ V, np.diag(var[n]), atol=1e-9 * np.abs(cov_f).max())
    probs = predict_proba(model, split.test.x)
    assert np.isfinite(probs).all() and np.allclose(probs.sum(1), 1)


def test_ekfac_one_shot_heads_are_the_clients_ekfac_posteriors_on_their_matched_units(federation):
    """With ``ekfac`` each head's logit covariance on fused features equals the covariance under
    its client's own EKFAC posterior, ``sum_ik (Lambda_ik + delta) (u_i (x) v_k)(u_i (x) v_k)^T``
    over its own output weights, built here with full matrices from the client's own summary (its
    own eigenbases, in its own unit order), where the head decomposes the Gram placed at the fused
    units again: the eigenvalues must follow their eigenpairs there."""
    from bayesfuse import summarize
    from bayesfuse.inference.client_heads import ekfac_eigenvalues
    from bayesfuse.nets.heads import logits_and_features
    from bayesfuse.nets.spec import spec_from_module

    split, part, models = federation
    summaries = [summarize(m, split.train.x[i], split.train.y[i]) for m, i in zip(models, part)]
    matched = _one_shot(models, summaries=summaries)
    assignments = {g: layer.assignments for g, layer in zip(matched.groups, matched.layers)}
    spec, states = spec_from_module(models[0]), [{k: v.numpy() for k, v in m.state_dict().items()} for m in models]
    network = matched.model.network
    heads = ClientHeads.from_clients(network, spec, states, assignments, summaries=summaries, pool="log", ekfac=True)
    x = torch.as_tensor(split.test.x[:7])
    with torch.no_grad():
        _, features = logits_and_features(network, heads.output, x)
    a_fused = torch.cat([features.double(), torch.ones(len(x), 1, dtype=torch.float64)], 1)
    G = a_fused.shape[1] - 1
    for j, (s, a) in enumerate(zip(summaries, matched.layers[0].assignments)):  # head j is client j
        _, U = np.linalg.eigh(s.output_factors["gram"])
        _, V = np.linalg.eigh(s.output_factors["curvature"])
        K, H1 = V.shape[0], U.shape[0]
        basis = np.kron(U, V)  # column i K + k: u_i (x) v_k, in the weights' (g, k) order
        eigenvalues = s.output_factors["eigenvalues"].ravel() + s.prior_precision
        cov_w = basis @ np.diag(1.0 / eigenvalues) @ basis.T
        own = a_fused[:, np.append(np.asarray(a), G)].numpy()  # the client's features, bias last
        variances, rotation = heads._logit_variances(j)
        var, R = variances(a_fused).numpy(), rotation.numpy()
        for n in range(len(x)):
            design = np.kron(own[n][None, :], np.eye(K))
            cov_f = design @ cov_w @ design.T
            np.testing.assert_allclose(R.T @ cov_f @ R, np.diag(var[n]), atol=1e-9 * np.abs(cov_f).max())
        assert H1 == len(a) + 1
    # with_eigenvalues on the K-FAC heads gives the same heads; and they are not K-FAC's
    plain = ClientHeads.from_clients(network, spec, states, assignments, summaries=summaries, pool="log")
    width = network.layers[1].in_features
    twin = plain.with_eigenvalues(ekfac_eigenvalues(spec, states, assignments, width, summaries))
    assert twin.network is plain.network and not hasattr(plain, "eigenvalues")
    xs = split.test.x[:50]
    np.testing.assert_allclose(predict_proba(twin, xs), predict_proba(heads, xs), rtol=1e-12, atol=1e-12)
    assert np.abs(predict_proba(heads, xs) - predict_proba(plain, xs)).max() > 1e-4
    # refusals: eigenvalues that do not fit, are negative, or lie off a head's support
    good = heads.eigenvalues.numpy()
    off = good.copy()
    off[0][heads.support[0].numpy() == 0] = 1.0
    for bad, match in (
        (good[:, :-1], "do not fit: need"),
        (-good - 1.0, "finite and >= 0"),
        (off, "outside their head's support"),
    ):
        with pytest.raises(ValueError, match=match):
            plain.with_eigenvalues(bad)
    point = ClientHeads(network, "layers.1", *(t.numpy() for t in (plain.weight, plain.bias, plain.shares)))
    with pytest.raises(ValueError, match="Kronecker-factored heads; these are 'map'"):
        point.with_eigenvalues(good)
    # EKFAC's trace is the exact one: no trace scale on top of it, whichever comes first
    with pytest.raises(ValueError, match="trace_match and ekfac both"):
        ClientHeads.from_clients(network, spec, states, assignments, summaries=summaries, trace_match=True, ekfac=True)
    with pytest.raises(ValueError, match="EKFAC eigenvalues, whose trace is the exact GGN's: no scale"):
        heads.with_scale(np.ones(4))
    with pytest.raises(ValueError, match="curvature is scaled"):
        plain.with_scale(np.full(4, 0.5)).with_eigenvalues(good)
    with pytest.raises(ValueError, match="do not fit 4 clients"):  # a column off the fused units
        bad_columns = {g: [np.asarray(a) + width for a in cols] for g, cols in assignments.items()}
        ekfac_eigenvalues(spec, states, bad_columns, width, summaries)
    with pytest.raises(ValueError, match="3 summaries for 4 clients"):
        ekfac_eigenvalues(spec, states, assignments, width, summaries[:3])
    with pytest.raises(ValueError, match="ekfac needs the clients' summaries"):
        ClientHeads.from_clients(network, spec, states, assignments, ekfac=True)
    diagonal = [dataclasses.replace(s, output_factors=None) for s in summaries]
    with pytest.raises(ValueError, match="ekfac needs every summary's output factors"):
        ClientHeads.from_clients(network, spec, states, assignments, summaries=diagonal, ekfac=True)
    # a version 2 summary (no eigenvalues): none for the heads, and EKFAC heads refused by name
    old = [
        dataclasses.replace(s, output_factors={k: s.output_factors[k] for k in ("gram", "curvature")})
        for s in summaries
    ]
    assert ekfac_eigenvalues(spec, states, assignments, width, old) is None
    with pytest.raises(ValueError, match="client 0's summary has no output eigenvalues"):
        ClientHeads.from_clients(network, spec, states, assignments, summaries=old, ekfac=True)


def test_trace_matched_one_shot_heads_have_the_exact_ggn_trace(federation):
    """Against the GGN written out from each client's own network: ``sum_n ||a~_n||^2 tr(S_n)``,
    ``S_n = diag(p_n) - p_n p_n^T`` its softmax Hessian at example n and ``a~_n`` the features its
    output layer reads, bias last; the Kronecker trace ``n tr(A) tr(S)`` from the head's own
    buffers (its count and eigenvalues). Both sides come from float32 forward passes (relative
    error ~1e-7 per term, summed over a few hundred examples): 1e-5 is ample and far below the
    scales' spread from 1."""
    from bayesfuse import summarize
    from bayesfuse.nets.spec import spec_from_module

    split, part, models = federation
    # float32 summaries (version 4): their eigenvalues are the exact GGN's to float32 round-off
    # (bfloat16's, version 6, keep the trace within 2^-8: tests/test_fusion_summaries.py)
    summaries = [summarize(m, split.train.x[i], split.train.y[i], precisions="float32") for m, i in zip(models, part)]
    matched = _one_shot(models, summaries=summaries)
    assignments = {g: layer.assignments for g, layer in zip(matched.groups, matched.layers)}
    heads = ClientHeads.from_clients(
        matched.model.network,
        spec_from_module(models[0]),
        [{k: v.numpy() for k, v in m.state_dict().items()} for m in models],
        assignments,
        summaries=summaries,
        pool="log",
        trace_match=True,
    )
    for j, (m, idx) in enumerate(zip(models, part)):
        logits, features = (
            t.detach().double().numpy() for t in logits_and_features(m, "layers.1", torch.as_tensor(split.train.x[idx]))
        )
        p = _softmax(logits)
        exact = float(((features**2).sum(1) + 1.0) @ (1.0 - (p**2).sum(1)))
        kfac = float(heads.n[j]) * float(heads.gram_vals[j].sum()) * float(heads.curv_vals[j].sum())
        assert float(heads.n[j]) == len(idx)  # head j is client j: the states were given in that order
        assert float(heads.scale[j]) * kfac == pytest.approx(exact, rel=1e-5)
    assert not np.allclose(heads.scale.numpy(), 1.0, atol=0.05)  # the correction is not a no-op here
    # the scaled head is the Kronecker posterior of n scale A (x) S + delta I: the same as n scale given as n
    folded = ClientHeads(
        heads.network,
        heads.output,
        *(t.numpy() for t in (heads.weight, heads.bias, heads.shares)),
        pool="log",
        laplace=_laplace_of(heads, n=heads.n * heads.scale),
        examples=heads.examples.numpy(),
    ).eval()
    x = split.test.x[:50]
    np.testing.assert_allclose(predict_proba(heads, x), predict_proba(folded, x), rtol=1e-12, atol=1e-12)
    plain = _one_shot(models, summaries=summaries).model
    assert not hasattr(plain, "scale") and np.abs(predict_proba(heads, x) - predict_proba(plain, x)).max() > 1e-4
    # with_scale: the same heads on the same network, the scale set, nothing else moved
    scale = heads.scale.numpy()[_order(plain, heads)]
    twin = plain.with_scale(scale)
    assert twin.network is plain.network and not hasattr(plain, "scale")
    built = ClientHeads(
        plain.network,
        plain.output,
        *(t.numpy() for t in (plain.weight, plain.bias, plain.shares)),
        pool="log",
        laplace=_laplace_of(plain, scale=scale),
        examples=plain.examples.numpy(),
    ).eval()
    np.testing.assert_allclose(predict_proba(twin, x), predict_proba(built, x), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="Kronecker-factored heads; these are 'map'"):
        ClientHeads(
            plain.network, "layers.1", *(t.numpy() for t in (plain.weight, plain.bias, plain.shares))
        ).with_scale(np.ones(4))
    for bad in (np.zeros(4), np.full(4, np.inf), np.ones(3)):
        with pytest.raises(ValueError, match="laplace scale must be 4 finite numbers > 0"):
            ClientHeads(
                heads.network,
                "layers.1",
                *(t.numpy() for t in (heads.weight, heads.bias, heads.shares)),
                laplace=_laplace_of(heads, scale=bad),
            )


def _order(these: ClientHeads, those: ClientHeads) -> list[int]:
    """For each of ``these`` heads, the index of the head of ``those`` with its bias (its client)."""
    return [int(np.argmin(np.abs(those.bias.numpy() - b).sum(1))) for b in these.bias.numpy()]


def _laplace_of(heads: ClientHeads, **change) -> dict:
    """The Kronecker ``laplace=`` argument that rebuilds ``heads`` (factors from their eigenbases), with ``change``."""
    gram = heads.gram_vecs @ torch.diag_embed(heads.gram_vals) @ heads.gram_vecs.transpose(1, 2)
    curvature = heads.curv_vecs @ torch.diag_embed(heads.curv_vals) @ heads.curv_vecs.transpose(1, 2)
    laplace = dict(gram=gram * heads.support[:, :, None] * heads.support[:, None, :], curvature=curvature)
    laplace.update(n=heads.n, prior_precision=heads.prior, support=heads.support)
    return {k: np.asarray(v) for k, v in {**laplace, **change}.items()}


def test_kronecker_laplace_refuses_bad_priors_and_supports(federation):
    split, part, models = federation
    net = models[0]
    J, K, G = 2, 10, net.layers[1].in_features
    weight, bias, shares = np.zeros((J, K, G)), np.zeros((J, K)), np.full((J, K), 0.5)
    good = dict(gram=np.tile(np.eye(G + 1), (J, 1, 1)), curvature=np.tile(np.eye(K), (J, 1, 1)), n=np.ones(J))
    heads = ClientHeads(net, "layers.1", weight, bias, shares, laplace={**good, "prior_precision": [1.0, 2.0]})
    assert heads.prior.tolist() == [1.0, 2.0] and heads.support.sum().item() == J * (G + 1)
    for bad, message in (
        ({"prior_precision": [1.0, 2.0, 3.0]}, "do not fit 2 heads"),
        ({"prior_precision": [1.0, -1.0]}, "prior precision > 0"),
        ({"prior_precision": 1.0, "support": np.full((J, G + 1), 0.5)}, "0 and 1 only"),
        ({"prior_precision": 1.0, "support": np.ones((J, G))}, "do not fit 2 heads"),
        ({"prior_precision": 1.0, "mask": np.ones((J, G + 1))}, "takes gram, curvature"),
    ):
        with pytest.raises(ValueError, match=message):
            ClientHeads(net, "layers.1", weight, bias, shares, laplace={**good, **bad})


def test_with_summaries_one_shot_keeps_the_clients_heads_where_the_output_layer_reads_units(federation):
    """The default with summaries: the clients' heads (geometric pool); the shared head where the
    output layer reads positions, and ``hyper["head"]`` says why."""
    from bayesfuse import summarize
    from bayesfuse.nets.arch import make_cnn
    from bayesfuse.nets.laplace import LastLayerLaplace
    from tests.helpers import randomise

    split, part, models = federation
    summaries = [summarize(m, split.train.x[i], split.train.y[i]) for m, i in zip(models, part)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        default = bayesfuse.fuse(models, "pfnm", summaries=summaries)
        shared = bayesfuse.fuse(models, "pfnm", summaries=summaries, head="shared")
    assert isinstance(default.model, ClientHeads) and default.model.pool == "log" and default.model.form == "kronecker"
    assert isinstance(shared.model, LastLayerLaplace) and shared.hyper.get("head") is None
    x = np.random.default_rng(0).normal(size=(12, 64)).astype(np.float32)
    cnns = [randomise(make_cnn(64, 10, channels=(3,), hidden=()), j) for j in range(2)]
    cnn_summaries = [summarize(m, x, np.arange(12) % 10) for m in cnns]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fused = bayesfuse.fuse(cnns, "pfnm", summaries=cnn_summaries)
    assert not isinstance(fused.model, ClientHeads)
    assert fused.hyper["head"].startswith("shared (the clients' own heads need an output layer that reads one")
    # the temperature round, likewise: the shared head's candidates alone, and why; a pool or
    # head="clients" asked for is refused, as in one shot
    data = (SimpleNamespace(x=x, y=np.arange(12) % 10), [np.arange(6), np.arange(6, 12)])
    tempered = dict(summaries=cnn_summaries, rounds=2, second_round="temperature", data=data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fused = bayesfuse.fuse(cnns, "pfnm", **tempered)
        assert set(fused.hyper["second_round"]["nll"]) == {"precision", "counts"}
        assert fused.hyper["head"].startswith("shared (the clients' own heads need an output layer that reads one")
        with pytest.raises(ValueError, match="pool='log' is for the clients' own heads, and"):
            bayesfuse.fuse(cnns, "pfnm", pool="log", **tempered)
        with pytest.raises(ValueError, match="head='clients': the clients' own heads need an output layer"):
            bayesfuse.fuse(cnns, "pfnm", head="clients", **tempered)


def test_kronecker_heads_take_factors_sent_in_float32():
    """Summaries carry their factors in float32 (files, Flower records): the softmax Hessian's exact
    zero eigenvalue then lands a little below zero, which is round-off, not an indefinite factor."""
    from bayesfuse.inference.client_heads import one_shot_heads
    from bayesfuse.nets.mlp import MLP
    from bayesfuse.nets.spec import spec_from_module
    from bayesfuse.nets.state import numpy_state
    from bayesfuse.summaries import summarize, summary_arrays, summary_from_arrays
    from tests.helpers import randomise

    gen = np.random.default_rng(0)
    for seed in range(60):
        model = randomise(MLP(6, [5], 4), seed)
        x, y = gen.normal(size=(30, 6)).astype(np.float32), gen.integers(0, 4, size=30)
        s = summarize(model, x, y)
        sent = summary_from_arrays(
            summary_arrays(s), "c", version=s.version, n_examples=s.n_examples, prior_precision=1.0, fingerprint=""
        )
        spec = spec_from_module(model)
        heads = one_shot_heads(spec, [numpy_state(model.state_dict())], {"P1": [np.arange(5)]}, 5, summaries=[sent])
        model_heads = ClientHeads.from_arrays(model, heads)
        assert model_heads.form == "kronecker" and (model_heads.curv_vals >= 0).all()
