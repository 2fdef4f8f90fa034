"""Matching with torch tensors: the cost products and atom posteriors run on the tensors' device
and dtype; assignments come from the same host solver as the NumPy path."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from bayesfuse.inference.layerwise import match_layerwise
from bayesfuse.inference.matching import (
    _gain_terms,
    _posterior_stats,
    _setup,
    assignment_cost,
    log_marginal_posterior,
    match_neurons,
)
from bayesfuse.models.bbp import simulate_deep_federation, simulate_federation
from bayesfuse.nets.mlp import MLP
from tests.helpers import DEVICES

U32 = 2.0**-24  # unit round-off of float32


def _gamma(n: int) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` for float32: the relative error bound of a sum or
    dot product of n terms, whatever the order of summation."""
    return n * U32 / (1 - n * U32)


def _federation(seed=3):
    return simulate_federation(8, 30, gamma0=6.0, prior_var=1.0, noise_var=0.05, seed=seed)


def _rng_layers(rng, J, D):
    return [rng.normal(size=(L, D)) for L in rng.integers(3, 9, size=J)]


CASES = {
    "pfnm": lambda fed, rng: dict(noise_var=0.5, prior_var=1.0, gamma0=6.0, cost="pfnm"),
    "marginal": lambda fed, rng: dict(noise_var=0.05, prior_var=1.0, gamma0=6.0, cost="marginal"),
    "nafi": lambda fed, rng: dict(noise_var=0.5, prior_var=1.0, gamma0=6.0, kl_weight=0.3),
    "per-entry noise": lambda fed, rng: dict(
        noise_var=0.05
        * np.where(np.arange(fed.layers[0].shape[1]) < 5, 1.0, 2.0)[None, :]
        * rng.uniform(0.5, 2.0, size=(len(fed.layers), 1)),
        prior_var=1.0,
        gamma0=6.0,
        cost="marginal",
    ),
    "local vars": lambda fed, rng: dict(
        noise_var=0.05,
        prior_var=1.0,
        gamma0=6.0,
        cost="marginal",
        local_vars=[rng.uniform(0, 0.02, size=len(v)) for v in fed.layers],
    ),
    "local vars per entry": lambda fed, rng: dict(
        noise_var=0.05,
        prior_var=1.0,
        gamma0=6.0,
        kl_weight=0.2,
        local_vars=[rng.uniform(0, 0.02, size=v.shape) for v in fed.layers],
    ),
    "auto": lambda fed, rng: dict(),
    "auto blocks": lambda fed, rng: dict(
        blocks=(np.arange(fed.layers[0].shape[1]) >= 4).astype(int),
        relative_precision=rng.uniform(0.5, 2.0, size=(len(fed.layers), fed.layers[0].shape[1])),
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_float64_tensors_give_the_numpy_matching(case, device):
    fed = _federation()
    hyper = CASES[case](fed, np.random.default_rng(0))
    want = match_neurons(fed.layers, seed=0, **hyper)
    got = match_neurons([torch.as_tensor(v, device=device) for v in fed.layers], seed=0, **hyper)
    assert isinstance(got.mean, torch.Tensor) and got.mean.dtype == torch.float64 and got.mean.device.type == device
    assert isinstance(got.var, torch.Tensor) and got.var.dtype == torch.float64
    for a, b in zip(want.assignments, got.assignments):
        assert isinstance(b, np.ndarray)
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(want.counts, got.counts)
    # The same float64 operations in another library's kernels: round-off only.
    np.testing.assert_allclose(got.mean.cpu().numpy(), want.mean, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got.var.cpu().numpy(), want.var, rtol=1e-12)
    np.testing.assert_allclose(got.objective, want.objective, rtol=1e-12)
    assert got.n_sweeps == want.n_sweeps and got.converged == want.converged
    if "auto" in case:
        for key in ("noise_var", "prior_var", "gamma0"):
            np.testing.assert_allclose(got.hyper[key], want.hyper[key], rtol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_log_marginal_posterior_of_tensors_is_the_numpy_one(device):
    fed = _federation()
    hyper = dict(noise_var=0.05, prior_var=1.0, gamma0=6.0)
    want = log_marginal_posterior(fed.layers, fed.assignments, **hyper)
    got = log_marginal_posterior([torch.as_tensor(v, device=device) for v in fed.layers], fed.assignments, **hyper)
    assert got == pytest.approx(want, rel=1e-12)


def _float32_cost_bound(v, p, h, lam, m, prior, J):
    """A bound on ``|C32 - C64|`` for the isotropic marginal cost (:func:`assignment_cost`), from
    the float64 quantities.

    Every term of ``C_il = -1/2 [a (HH_i + 2 p h_i.v_l + p^2 VV_l) - HH_i/lam_i]
    + D/2 log(1 + p/lam_i) - log(m_i/(J - m_i))`` is a dot product of at most D terms followed by
    at most 8 roundings (products, quotients, the log, the sums of terms), so its float32 value
    is within ``gamma_{D+8}`` of the exact value of the float32 inputs, relative to the sum of
    the terms' magnitudes (``|h_i.v_l| <= ||h_i|| ||v_l||``); the inputs (``lam``, ``m``
    and ``p`` are exact in float64, rounded once to float32) add at most a few ``u`` to each term,
    covered by the 8. Twice that is used.
    """
    D = v.shape[1]
    pp, lam_i = p[0, 0], lam[:, 0][:, None]
    a = 1.0 / (lam_i + pp)
    HH = np.einsum("gd,gd->g", h, h)[:, None]
    VV = np.einsum("ld,ld->l", v, v)[None, :]
    hv = np.sqrt(HH) * np.sqrt(VV)
    size = (
        0.5 * (a * (HH + 2 * pp * hv + pp * pp * VV) + HH / lam_i)
        + 0.5 * D * np.log1p(pp / lam_i)
        + np.abs(np.log(m / (J - m)))[:, None]
    )
    new = (
        0.5 * (pp * pp / (prior.lam0[0] + pp) * VV)
        + 0.5 * D * np.log1p(pp / prior.lam0[0])
        + abs(math.log(prior.gamma0 / J))
    )
    return 2 * _gamma(D + 8) * np.concatenate([size.T, np.broadcast_to(new.T, (v.shape[0], v.shape[0]))], axis=1)


@pytest.fixture
def matmul_precision():
    """Sets torch's float32 matrix-product precision for a test, and puts the old one back."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def _cost_case():
    rng = np.random.default_rng(1)
    J, D = 5, 300
    layers = [rng.normal(size=(L, D)).astype(np.float32).astype(np.float64) for L in (6, 7, 5, 6, 4)]
    layers_c, prec, prior = _setup(layers, 0.05, 1.0, 0.0, 2.0)
    others = [np.arange(6), np.arange(7), None, np.arange(6), np.arange(4)]
    h, lam, m = _posterior_stats(layers_c, prec, others, 7, prior)
    return J, layers_c[2], prec[2], h, lam, m, prior


def _float32_cost(device, v, p, h, lam, m, prior):
    return assignment_cost(
        torch.as_tensor(v, dtype=torch.float32, device=device),
        p,
        torch.as_tensor(h, dtype=torch.float32, device=device),
        lam,
        m,
        prior,
        cost="marginal",
    )


@pytest.mark.parametrize("device", DEVICES)
def test_float32_cost_matrix_is_within_its_derived_bound(device):
    J, v, p, h, lam, m, prior = _cost_case()
    want = assignment_cost(v, p, h, lam, m, prior, cost="marginal")
    got = _float32_cost(device, v, p, h, lam, m, prior)
    bound = _float32_cost_bound(v, p, h, lam, m, prior, J)
    err = np.abs(got - want)
    assert np.all(err <= bound), float(np.max(err / bound))
    assert np.max(err) > 0  # the float32 path did run in float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["high", "medium"])
def test_float32_products_ignore_a_lower_matmul_precision(device, precision, matmul_precision):
    # "high" lets CUDA run float32 products in TF32 and "medium" in bfloat16: on an H100 the cost
    # matrix's error then grows 100-fold (0.0034 to 0.35 of the bound above), and "medium" changes
    # CPU products too where the CPU has bfloat16 passes. The matching computes in float32
    # whatever the user set, so it gives the bits it gives at "highest", and leaves the setting
    # as it was. Without that, this fails on CUDA at both settings and on such CPUs at "medium".
    case = _cost_case()[1:]
    matmul_precision("highest")
    want = _float32_cost(device, *case)
    matmul_precision(precision)
    got = _float32_cost(device, *case)
    assert torch.get_float32_matmul_precision() == precision
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_tensors_give_the_same_matching_within_float32_round_off(device):
    # Well separated atoms: the cost of the right atom beats the next option by about
    # p ||theta_i - theta_k||^2 / 4 ~ 20 * 2 D / 4 = 200 nats, while a float32 cost is off by at
    # most gamma_{D+8} times its terms' magnitudes (~ 3e-6 * 1e4 ~ 0.03, as the bound above):
    # the assignments are those of float64.
    fed = _federation()
    layers32 = [v.astype(np.float32) for v in fed.layers]
    hyper = dict(noise_var=0.05, prior_var=1.0, gamma0=6.0, cost="marginal")
    want = match_neurons([v.astype(np.float64) for v in layers32], seed=0, **hyper)
    got = match_neurons([torch.from_numpy(v).to(device) for v in layers32], seed=0, **hyper)
    assert got.mean.dtype == torch.float32 and got.var.dtype == torch.float32 and got.mean.device.type == device
    for a, b in zip(want.assignments, got.assignments):
        np.testing.assert_array_equal(a, b)
    # h_i = h0 + sum over its m_i neurons of p v: at most J + 1 float32 roundings of the sum and
    # one of each product, then h / lambda with lambda rounded to float32 (2 more): each mean is
    # within gamma_{J+4} (|h0| + sum p |v|) / lambda of the float64 one.
    layers_c, prec, prior = _setup([v.astype(np.float64) for v in layers32], 0.05, 1.0, 0.0, 6.0)
    p = prec[0][0, 0]
    magnitude = np.tile(np.abs(prior.h0), (want.n_global, 1))
    for v, a in zip(layers_c, want.assignments):
        magnitude[a] += p * np.abs(v)
    bound = _gamma(len(fed.layers) + 4) * magnitude / (1.0 / want.var)
    err = np.abs(got.mean.double().cpu().numpy() - want.mean)
    assert np.all(err <= bound), float(np.max(err / bound))
    # var = 1 / lambda: lambda rounded to float32, then one division
    np.testing.assert_allclose(got.var.double().cpu().numpy(), want.var, rtol=_gamma(2), atol=0)


def test_float32_gain_terms_run_in_float32():
    rng = np.random.default_rng(2)
    layers_c, prec, prior = _setup(_rng_layers(rng, 3, 6), 0.5, 1.0, 0.0, 1.0)
    h, lam, m = _posterior_stats(layers_c, prec, [np.arange(len(layers_c[0])), None, None], len(layers_c[0]), prior)
    t = lambda x: torch.as_tensor(x, dtype=torch.float32)  # noqa: E731
    delta, log_ratio, _ = _gain_terms(t(h), t(lam), t(layers_c[1]), t(prec[1]), prior.groups, False)
    assert delta.dtype == torch.float32 and log_ratio.dtype == torch.float32


def test_mixed_inputs_are_refused_with_a_clear_error():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(3, 4)), rng.normal(size=(2, 4))
    with pytest.raises(TypeError, match="client 1's neurons are not a torch tensor while client 0's"):
        match_neurons([torch.as_tensor(a), b], noise_var=1.0, prior_var=1.0, gamma0=1.0)
    with pytest.raises(TypeError, match="client 0's neurons are not a torch tensor while client 1's"):
        match_neurons([a, torch.as_tensor(b)], noise_var=1.0, prior_var=1.0, gamma0=1.0)
    with pytest.raises(TypeError, match="client 1's neurons are torch.float32 on cpu, client 0's torch.float64"):
        match_neurons([torch.as_tensor(a), torch.as_tensor(b, dtype=torch.float32)])
    with pytest.raises(
        TypeError, match="client 1's neurons are torch.float64 on meta, client 0's torch.float64 on cpu"
    ):
        match_neurons([torch.as_tensor(a), torch.zeros(2, 4, dtype=torch.float64, device="meta")])
    for dtype in (torch.float16, torch.int64):
        with pytest.raises(TypeError, match=f"{dtype} tensor; give float32 or float64 tensors"):
            match_neurons([torch.ones(3, 4, dtype=dtype), torch.ones(2, 4, dtype=dtype)])
    bad = torch.as_tensor(a)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="client 0's neurons contains NaN"):
        match_neurons([bad, torch.as_tensor(b)], noise_var=1.0, prior_var=1.0, gamma0=1.0)
    with pytest.raises(ValueError, match="dimension 5"):
        match_neurons([torch.ones(3, 4, dtype=torch.float64), torch.ones(2, 5, dtype=torch.float64)])


@pytest.mark.parametrize("device", DEVICES)
def test_layerwise_matching_on_a_torch_device_gives_the_numpy_network(device):
    fed = simulate_deep_federation(5, 20, 2, 6, gamma0=10.0, noise_var=0.01, seed=1)
    spec = MLP(1, [1, 1], 1).permutation_spec()
    hyper = dict(cost="marginal", noise_var=0.01, prior_var=1.0, gamma0=10.0, bias_prior_mean=0.0)
    want = match_layerwise(fed.states, spec, **hyper)
    got = match_layerwise(fed.states, spec, device=device, **hyper)
    assert got.sizes == want.sizes and got.hyper["device"] == device
    for g in spec.groups:
        for a, b in zip(want.layers[g].assignments, got.layers[g].assignments):
            np.testing.assert_array_equal(a, b)
        assert isinstance(got.layers[g].mean, np.ndarray)
    for k, value in want.state_dict.items():
        assert isinstance(got.state_dict[k], np.ndarray)
        np.testing.assert_allclose(got.state_dict[k], value, rtol=1e-10, atol=1e-12)
    auto_want = match_layerwise(fed.states, spec)
    auto_got = match_layerwise(fed.states, spec, device=device)
    assert auto_got.sizes == auto_want.sizes
    for k, value in auto_want.state_dict.items():
        np.testing.assert_allclose(auto_got.state_dict[k], value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_to_arviz_of_a_tensor_result_exports_a_host_copy(dtype, device):
    fed = _federation()
    got = match_neurons(
        [torch.as_tensor(v, dtype=dtype, device=device) for v in fed.layers],
        seed=0,
        noise_var=0.05,
        prior_var=1.0,
        gamma0=6.0,
        cost="marginal",
    )
    idata = got.to_arviz(units=[0, 2], num_draws=5, seed=1)
    assert isinstance(got.mean, torch.Tensor) and got.mean.dtype == dtype  # the result keeps its tensors
    host = replace(got, mean=got.mean.double().cpu().numpy(), var=got.var.double().cpu().numpy())
    want = host.to_arviz(units=[0, 2], num_draws=5, seed=1)
    np.testing.assert_array_equal(np.asarray(idata.posterior["theta"]), np.asarray(want.posterior["theta"]))
    np.testing.assert_array_equal(np.asarray(idata.constant_data["loc"]), host.mean)
    np.testing.assert_array_equal(np.asarray(idata.constant_data["scale"]), np.sqrt(host.var))


def test_the_users_matmul_precision_comes_back_after_an_error(matmul_precision):
    matmul_precision("high")
    with pytest.raises(ValueError, match="n_iter"):
        match_neurons([torch.ones(3, 4), torch.ones(2, 4)], noise_var=1.0, prior_var=1.0, gamma0=1.0, n_iter=0)
    assert torch.get_float32_matmul_precision() == "high"
