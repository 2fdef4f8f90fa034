"""ArviZ export and exact summary (bayesfuse.analysis): size and speed, coordinates, attrs, draws,
BNN comparison."""

import contextlib
import json
import logging
import time
import tracemalloc
import warnings

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.special import logsumexp

from bayesfuse.analysis import (
    DEFAULT_CHAINS,
    DEFAULT_DRAWS,
    DEFAULT_UNITS,
    DEFAULT_WEIGHTS,
    bnn_to_arviz,
    fusion_to_arviz,
    gaussian_to_arviz,
    klfusion_to_arviz,
    local_to_arviz,
    match_to_arviz,
    summary,
    to_arviz,
)
from bayesfuse.analysis._common import _arviz
from bayesfuse.inference.expfam import Beta, DiagNormal, Dirichlet, Gamma, NormalWishart
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.matching import match_neurons
from bayesfuse.models.bbp import simulate_federation

N = 2000  # draws per chain of the small round trips (2 chains)


def _theta(idata) -> np.ndarray:
    return np.asarray(idata.posterior["theta"])


def _pooled(idata) -> np.ndarray:
    """The draws of every chain, (draws, units, weights)."""
    theta = _theta(idata)
    return theta.reshape(-1, *theta.shape[2:])


def _check_moments(idata, mean, var):
    draws = _pooled(idata).reshape(-1, *mean.shape)
    n = len(draws)
    # Sample mean: sd sqrt(var / n); sample variance: relative sd sqrt(2 / (n - 1)).
    # 5 sd bounds on each of <= 60 entries fail with probability < 1e-4 in all.
    assert (np.abs(draws.mean(0) - mean) < 5 * np.sqrt(var / n)).all()
    assert (np.abs(draws.var(0, ddof=1) / var - 1) < 5 * np.sqrt(2 / (n - 1))).all()


@pytest.fixture(scope="module")
def readme_match():
    """The README's 30-client, D = 794 matching (378 global atoms), the export users met."""
    fed = simulate_federation(30, 794, gamma0=100.0, prior_var=1.0, noise_var=0.01, seed=0)
    return match_neurons(fed.layers, noise_var=0.01, prior_var=1.0, gamma0=100.0, cost="marginal")


def _default_export(res, caplog=None):
    """The default export; with ``caplog``, checks the one line that says how to draw more."""
    if caplog is None:
        return match_to_arviz(res)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bayesfuse.analysis"):
        idata = match_to_arviz(res)
    lines = [r.getMessage() for r in caplog.records if r.name == "bayesfuse.analysis"]
    assert len(lines) == 1 and "units='all'" in lines[0] and "weights='all'" in lines[0]
    assert "8 of 378 units x 8 of 794 weights" in lines[0]
    return idata


# ------------------------------------------------------------------------------ size and speed


def test_default_export_of_the_readme_example_is_the_documented_subset(readme_match, caplog):
    """Before: 19,850 drawn scalars (25 units x 794 weights) that az.summary took 71 s over. The
    default is now the first DEFAULT_UNITS units x DEFAULT_WEIGHTS entries, 2 chains of
    DEFAULT_DRAWS; the exact posterior of every entry stays in constant_data. A return to
    exporting whole units, or every unit, fails on the shape and on the memory bound (one
    unit of 794 entries in 2 x 100 draws is 1.3 MB; all of them 480 MB)."""
    res = readme_match
    G, D = res.mean.shape
    match_to_arviz(res, units=[0], num_draws=2)  # imports (ArviZ, xarray) are not the export's cost
    start = time.perf_counter()
    _default_export(res)
    print(f"\ndefault export of the README's matching: {time.perf_counter() - start:.3f} s")
    tracemalloc.start()
    try:
        idata = _default_export(res, caplog)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 30e6  # constant_data (loc and scale of all 378 x 794 entries) is 4.8 MB of it
    theta = idata.posterior["theta"]
    assert theta.dims == ("chain", "draw", "global_unit", "weight")
    assert theta.shape == (DEFAULT_CHAINS, DEFAULT_DRAWS, DEFAULT_UNITS, DEFAULT_WEIGHTS) == (2, 100, 8, 8)
    assert list(idata.posterior.data_vars) == ["theta"]
    np.testing.assert_array_equal(idata.posterior["global_unit"], np.arange(DEFAULT_UNITS))
    assert list(idata.posterior["weight"].values) == [f"dim_{d}" for d in range(DEFAULT_WEIGHTS)]
    attrs = idata.posterior.attrs
    assert (attrs["drawn_units"], attrs["n_units"], attrs["drawn_weights"], attrs["n_weights"]) == (
        "0..7",
        G,
        "0..7",
        D,
    )
    assert attrs["chains"] == 2 and attrs["num_draws"] == DEFAULT_DRAWS
    # the exact posterior of every unit stays in constant_data
    np.testing.assert_array_equal(np.asarray(idata.constant_data["loc"]), res.mean)
    np.testing.assert_array_equal(np.asarray(idata.constant_data["scale"]), np.sqrt(res.var))
    assert idata.constant_data["loc"].dims == ("global_unit", "weight")
    np.testing.assert_array_equal(np.asarray(idata.constant_data["counts"]), res.counts)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@contextlib.contextmanager
def _everything_logged(az):
    """Every record logged, ArviZ's own included: ArviZ 0.2x logs through a logger of its own
    (``arviz._log``) that neither propagates to the root nor repeats a message it logged before,
    so its cache is emptied for the duration and a handler listens to it directly."""
    records = _Records()
    root, own = logging.getLogger(), getattr(az, "_log", None)
    listened = [root] + ([own] if isinstance(own, logging.Logger) and own is not root else [])
    cache = getattr(own, "cache", None)
    saved = list(cache) if isinstance(cache, list) else None
    level = root.level
    for logger in listened:
        logger.addHandler(records)
    root.setLevel(logging.DEBUG)
    if saved is not None:
        cache.clear()
    try:
        yield records.records
    finally:
        for logger in listened:
            logger.removeHandler(records)
        root.setLevel(level)
        if saved is not None:
            cache[:] = saved


def test_az_summary_and_forest_of_the_default_export_are_small_and_quiet(readme_match):
    """az.summary of the default export has DEFAULT_UNITS x DEFAULT_WEIGHTS rows with finite
    r_hat, and neither it nor az.plot_forest warns (no Python warning, nothing logged at WARNING:
    one chain made ArviZ log "Shape validation failed ... chains=2" and give NaN r_hat). The
    seconds are printed; their budget (under 2 s together) is kept by benchmarks/bench_arviz.py."""
    import matplotlib.pyplot as plt

    az = _arviz()
    idata = _default_export(readme_match)
    with warnings.catch_warnings(), _everything_logged(az) as records:
        warnings.simplefilter("error")
        start = time.perf_counter()
        table = az.summary(idata)
        middle = time.perf_counter()
        az.plot_forest(idata)
        end = time.perf_counter()
    plt.close("all")
    print(f"\naz.summary {middle - start:.2f} s ({len(table)} rows), az.plot_forest {end - middle:.2f} s")
    noisy = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert not noisy, noisy
    assert len(table) == DEFAULT_UNITS * DEFAULT_WEIGHTS == 64
    assert table["r_hat"].notna().all() and (table["r_hat"] < 1.1).all()
    assert (table["ess_bulk"] > 50).all()  # 200 independent draws each


def test_the_exact_summary_is_the_closed_form_and_lines_up_with_az_summary(readme_match):
    """summary(result) lists every entry's exact mean, sd and central 94% interval (the HDI of a
    Gaussian), indexed as az.summary indexes the export; the draws' own summary agrees with it
    within its Monte Carlo error."""
    res = readme_match
    G, D = res.mean.shape
    exact = summary(res)
    assert len(exact) == G * D and list(exact.columns) == ["mean", "sd", "hdi_3%", "hdi_97%"]
    sd = np.sqrt(res.var)
    np.testing.assert_array_equal(exact["mean"].to_numpy(), res.mean.ravel())
    np.testing.assert_allclose(exact["sd"].to_numpy(), sd.ravel(), rtol=1e-15)
    lo, hi = stats.norm.interval(0.94, loc=res.mean, scale=sd)
    np.testing.assert_allclose(exact["hdi_3%"].to_numpy(), lo.ravel(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(exact["hdi_97%"].to_numpy(), hi.ravel(), rtol=1e-12, atol=1e-15)
    assert exact.index[D + 2] == "theta[1, dim_2]"

    idata = _default_export(res)
    drawn = _arviz().summary(idata, kind="stats", round_to="none")
    rows = exact.loc[drawn.index]  # every row of az.summary has its exact counterpart
    # 64 z-tests of the draws' mean at level 1e-4 / 64 each (Bonferroni): a wrong scale fails by far
    z = (drawn["mean"].to_numpy() - rows["mean"].to_numpy()) / (rows["sd"].to_numpy() / np.sqrt(200))
    assert np.abs(z).max() < stats.norm.isf(1e-4 / 128)
    # of an export: its constant_data, the same table; some units and entries, another interval
    np.testing.assert_array_equal(summary(idata).to_numpy(), exact.to_numpy())
    part = summary(res, units=[5, 2], weights=["dim_3", 0], hdi_prob=0.5)
    assert list(part.index) == ["theta[5, dim_3]", "theta[5, dim_0]", "theta[2, dim_3]", "theta[2, dim_0]"]
    assert list(part.columns) == ["mean", "sd", "hdi_25%", "hdi_75%"]
    np.testing.assert_allclose(part["hdi_75%"] - part["mean"], stats.norm.ppf(0.75) * part["sd"], rtol=1e-12)
    with pytest.raises(ValueError, match="hdi_prob"):
        summary(res, hdi_prob=1.0)
    with pytest.raises(ValueError, match="no weight 'bias'"):
        summary(res, weights=["bias"])


def test_default_draws_agree_with_the_posterior(readme_match):
    """Each entry's draws are N(loc, scale^2) (2 x 64 checks on the default export).

    With n draws, the sample mean's z = (mean - loc) / (scale / sqrt(n)) is exactly N(0, 1)
    and (n - 1) s^2 / scale^2 is exactly chi^2(n - 1). Each of the 2M checks (M entries) is
    two-sided at level alpha / (2M), so by Bonferroni a correct export fails with probability
    < alpha = 1e-4 over seeds (the seed is fixed, so the test is deterministic). A wrong scale
    (a variance used as a standard deviation would be off by 50x here) fails by far."""
    res = readme_match
    idata = _default_export(res)
    units = np.asarray(idata.posterior["global_unit"])
    columns = [int(w.split("_")[1]) for w in idata.posterior["weight"].values]
    draws = _pooled(idata)  # (draws, units, weights)
    n = draws.shape[0]
    loc, scale = res.mean[np.ix_(units, columns)], np.sqrt(res.var[np.ix_(units, columns)])
    m = loc.size
    level = 1e-4 / (2 * m)
    z = (draws.mean(0) - loc) / (scale / np.sqrt(n))
    assert np.abs(z).max() < stats.norm.isf(level / 2)
    ratio = draws.var(0, ddof=1) / scale**2
    lo, hi = stats.chi2.ppf([level / 2, 1 - level / 2], n - 1) / (n - 1)
    assert lo < ratio.min() and ratio.max() < hi


def test_subsets_and_fewer_draws_are_slices_of_the_full_export(readme_match, caplog):
    res = readme_match
    small = _default_export(res)  # units 0..7, weights 0..7, 2 chains of 100 draws
    some = match_to_arviz(res, units=[377, 0, 7, 200], num_draws=250)  # named units: all their weights
    np.testing.assert_array_equal(some.posterior["global_unit"], [377, 0, 7, 200])
    assert some.posterior.sizes["weight"] == res.mean.shape[1]
    for g in (0, 7):
        np.testing.assert_array_equal(
            some.posterior["theta"].sel(global_unit=g).isel(draw=slice(DEFAULT_DRAWS), weight=slice(DEFAULT_WEIGHTS)),
            small.posterior["theta"].sel(global_unit=g),
        )
    picked = match_to_arviz(res, units=[7], weights=["dim_5", 2], num_draws=10, chains=3)
    assert list(picked.posterior["weight"].values) == ["dim_5", "dim_2"] and picked.posterior.sizes["chain"] == 3
    np.testing.assert_array_equal(
        picked.posterior["theta"].isel(chain=slice(2)),
        small.posterior["theta"].sel(global_unit=[7], weight=["dim_5", "dim_2"]).isel(draw=slice(10)),
    )
    # units="all", weights="all" on a layer the default cuts; the default is a slice of it
    rng = np.random.default_rng(0)
    mean, var = rng.normal(size=(30, 12)), rng.uniform(0.5, 2, size=(30, 12))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bayesfuse.analysis"):
        default = gaussian_to_arviz(mean, var)
    assert "8 of 30 units x 8 of 12 weights" in caplog.text
    full = gaussian_to_arviz(mean, var, units="all", weights="all", num_draws=150)
    assert _theta(full).shape == (2, 150, 30, 12) and _theta(default).shape == (2, 100, 8, 8)
    np.testing.assert_array_equal(_theta(full)[:, :100, :8, :8], _theta(default))
    np.testing.assert_array_equal(np.asarray(full.constant_data["loc"]), np.asarray(default.constant_data["loc"]))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bayesfuse.analysis"):
        gaussian_to_arviz(mean[:8, :8], var[:8, :8])  # every unit and entry: nothing to say
        gaussian_to_arviz(mean, var, units="all", weights=[0, 1])  # asked for: nothing to say
    assert not caplog.records


# ------------------------------------------------------------------------------ round trips


def test_match_result_round_trip():
    fed = simulate_federation(4, 5, gamma0=3.0, prior_var=1.0, noise_var=0.05, seed=0)
    res = match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=3.0, cost="marginal")
    idata = match_to_arviz(res, num_draws=N)
    _check_moments(idata, res.mean, res.var)
    cd = idata.constant_data
    for j, a in enumerate(res.assignments):
        np.testing.assert_array_equal(np.asarray(cd["assigned_global_unit"])[np.asarray(cd["client"]) == j], a)
    np.testing.assert_array_equal(np.asarray(cd["counts"]), res.counts)
    np.testing.assert_allclose(np.asarray(cd["objective"]), res.objective)
    assert to_arviz(res, num_draws=10).posterior["theta"].shape == (2, 10, res.n_global, 5)


def test_klfusion_round_trip_and_arviz_tools():
    rng = np.random.default_rng(0)
    clients = [DiagNormal(loc=rng.normal(size=(3, 4)) * 3, var=rng.uniform(0.1, 0.3, size=(3, 4))) for _ in range(2)]
    res = kl_fuse(clients, reg=0.1)
    idata = klfusion_to_arviz(res, num_draws=N)
    _check_moments(idata, res.components.loc, res.components.var)
    # the components' parameters per dimension
    np.testing.assert_array_equal(np.asarray(idata.constant_data["loc"]), res.components.loc)
    np.testing.assert_allclose(np.asarray(idata.constant_data["scale"]), np.sqrt(res.components.var))
    assert list(idata.posterior["weight"].values) == ["dim_0", "dim_1", "dim_2", "dim_3"]
    az = _arviz()
    summary = az.summary(idata, var_names=["theta"], kind="stats")
    assert len(summary) == res.n_components * 4
    assert "theta[0, dim_2]" in summary.index
    az.plot_forest(idata, var_names=["theta"], coords={"global_unit": [0], "weight": ["dim_0", "dim_1"]})


def _dirichlet_fusion():
    rng = np.random.default_rng(3)
    alpha = rng.gamma(2.0, 1.0, size=(3, 5)) * 20
    clients = [Dirichlet(alpha[rng.permutation(3)] * rng.uniform(0.9, 1.1, size=(3, 5))) for _ in range(3)]
    return kl_fuse(clients, reg=0.1)


def test_dirichlet_gamma_and_beta_components_are_drawn_from_their_own_family():
    """A topic model's fused topics: draws on the simplex whose means are alpha / alpha_0 (within 5
    Monte Carlo standard errors, sd sqrt(m (1 - m) / (alpha_0 + 1)) over 2 x 2000 draws); Gamma and
    Beta coordinates likewise (sd sqrt(shape) / rate, sqrt(ab / (a + b + 1)) / (a + b))."""
    res = _dirichlet_fusion()
    words = ["w0", "w1", "w2", "w3", "w4"]
    idata = res.to_arviz(units="all", weights="all", num_draws=2000, weight_names=words)
    theta = np.asarray(idata.posterior["theta"])
    assert theta.shape == (2, 2000, res.n_components, 5) and list(idata.posterior["weight"].values) == words
    np.testing.assert_allclose(theta.sum(-1), 1.0, atol=1e-12)
    alpha = res.components.concentration
    mean = alpha / alpha.sum(1, keepdims=True)
    se = np.sqrt(mean * (1 - mean) / (alpha.sum(1, keepdims=True) + 1)) / np.sqrt(4000)
    assert (np.abs(theta.mean((0, 1)) - mean) < 5 * se).all()
    np.testing.assert_array_equal(np.asarray(idata.constant_data["concentration"]), alpha)
    assert len(idata.constant_data["assigned_global_unit"]) == 9
    assert idata.posterior.attrs["hyper"].count("Dirichlet") == 1
    one = res.to_arviz(units=[1], weights=["w3"], num_draws=2000, weight_names=words)  # the same stream
    np.testing.assert_array_equal(np.asarray(one.posterior["theta"])[:, :, 0, 0], theta[:, :, 1, 3])
    summary = _arviz().summary(res.to_arviz(num_draws=50), var_names=["theta"], kind="stats")
    assert len(summary) == res.n_components * 5
    rng = np.random.default_rng(4)
    for family, params in (
        (Gamma, dict(shape=np.full((2, 3), 4.0), rate=np.full((2, 3), 2.0))),
        (Beta, dict(a=np.full((2, 3), 2.0), b=np.full((2, 3), 6.0))),
    ):
        fused = kl_fuse(
            [family(**{k: v * rng.uniform(0.99, 1.01, v.shape) for k, v in params.items()}) for _ in range(2)]
        )
        draws = np.asarray(fused.to_arviz(num_draws=2000).posterior["theta"])
        c = fused.components
        if family is Gamma:
            exact, sd = c.shape / c.rate, np.sqrt(c.shape) / c.rate
        else:
            exact, sd = c.a / (c.a + c.b), np.sqrt(c.a * c.b / (c.a + c.b + 1)) / (c.a + c.b)
        assert (np.abs(draws.mean((0, 1)) - exact) < 5 * sd / np.sqrt(4000)).all(), family.__name__


def test_normal_wishart_states_export_their_means_and_covariances():
    """An HMM's fused states: E[mu] = mean, E[Lambda^-1] = scale^-1 / (dof - D - 1) (Bishop 2006,
    B.80), within 5 Monte Carlo standard errors: Var(mu_d) = E[(kappa Lambda)^-1]_dd, and the
    inverse Wishart's Var(Sigma_dd) = 2 E[Sigma_dd]^2 / (dof - D - 3)."""
    rng = np.random.default_rng(5)
    D, mean = 3, rng.normal(size=(2, 3)) * 3
    scale = np.stack([np.eye(D) * 0.1, np.eye(D) * 0.05])
    clients = [
        NormalWishart(mean + 0.01 * rng.normal(size=mean.shape), np.full(2, 50.0), np.full(2, 30.0), scale)
        for _ in range(3)
    ]
    res = kl_fuse(clients, reg=0.1)
    idata = res.to_arviz(num_draws=2000)
    mu, cov = np.asarray(idata.posterior["mu"]), np.asarray(idata.posterior["cov"])
    assert mu.shape == (2, 2000, 2, 3) and cov.shape == (2, 2000, 2, 3, 3)
    c = res.components
    expected_cov = np.linalg.inv(c.scale) / (c.dof - D - 1)[:, None, None]
    mu_se = np.sqrt(np.diagonal(expected_cov, axis1=1, axis2=2) / c.kappa[:, None] / 4000)
    assert (np.abs(mu.mean((0, 1)) - c.mean) < 5 * mu_se).all()
    diag = np.diagonal(expected_cov, axis1=1, axis2=2)
    cov_se = diag * np.sqrt(2 / (c.dof - D - 3))[:, None] / np.sqrt(4000)
    assert (np.abs(np.diagonal(cov.mean((0, 1)), axis1=-2, axis2=-1) - diag) < 5 * cov_se).all()
    assert np.allclose(cov, np.swapaxes(cov, -1, -2)) and (np.linalg.eigvalsh(cov) > 0).all()
    np.testing.assert_array_equal(np.asarray(idata.constant_data["dof"]), c.dof)
    summary = _arviz().summary(idata, var_names=["mu"], kind="stats")
    assert "mu[1, dim_2]" in summary.index


def test_chains_of_independent_draws_have_defined_diagnostics():
    """Two chains of independent draws: az.summary's r_hat is about 1 and ess about the number of
    draws, as independent draws give them; with chains=1 ArviZ cannot compute r_hat (NaN)."""
    rng = np.random.default_rng(2)
    idata = gaussian_to_arviz(rng.normal(size=(2, 3)), np.ones((2, 3)), num_draws=200)
    assert idata.posterior.sizes["chain"] == DEFAULT_CHAINS == 2 and idata.posterior.sizes["draw"] == 200
    assert idata.posterior.attrs["sampling"] == "independent"
    assert "not MCMC" in idata.posterior.attrs["sampling_note"]
    az = _arviz()
    table = az.summary(idata, kind="diagnostics")
    assert (np.abs(table["r_hat"] - 1) < 0.05).all() and (table["ess_bulk"] > 200).all()
    one = gaussian_to_arviz(rng.normal(size=(2, 3)), np.ones((2, 3)), num_draws=8, chains=1)
    assert one.posterior.sizes["chain"] == 1 and one.posterior.sizes["draw"] == 8


def test_local_exports_line_up_with_the_fused_one():
    rng = np.random.default_rng(1)
    base = DiagNormal(loc=rng.normal(size=(3, 4)) * 3, var=rng.uniform(0.1, 0.3, size=(3, 4)))
    perm = np.array([2, 0, 1])
    clients = [base, DiagNormal(loc=base.loc[perm] + 0.01, var=base.var[perm])]  # the same units, reordered
    res = kl_fuse(clients, reg=0.1)
    assert res.n_components == 3
    fused = klfusion_to_arviz(res, num_draws=400)
    names = list(fused.posterior["weight"].values)
    locals_ = [
        local_to_arviz(c.loc, c.var, a, num_draws=400, weight_names=names) for c, a in zip(clients, res.assignments)
    ]
    g = int(res.assignments[0][0])  # client 0's unit 0 and its match in client 1
    got = np.asarray(locals_[0].posterior["theta"].sel(global_unit=g)).reshape(800, 4).mean(0)
    assert (np.abs(got - clients[0].loc[0]) < 5 * np.sqrt(clients[0].var[0] / 800)).all()
    one = local_to_arviz(clients[1].loc, clients[1].var, res.assignments[1], units=[g], num_draws=400)
    np.testing.assert_array_equal(one.posterior["global_unit"], [g])
    az = _arviz()
    az.plot_forest(
        [fused, *locals_],
        model_names=["fused", "client 0", "client 1"],
        var_names=["theta"],
        coords={"global_unit": [g]},
        combined=True,
    )
    with pytest.raises(ValueError, match="distinct"):
        local_to_arviz(clients[0].loc, clients[0].var, [0, 0, 1])


def test_deep_fusion_exports_each_layer():
    import torch

    from bayesfuse import fuse
    from bayesfuse.nets.mlp import MLP

    torch.manual_seed(0)
    models = [MLP(6, [5, 4], 3) for _ in range(2)]
    for m in models:
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 1.0)
    res = fuse(models, "pfnm")
    for key, layer in (("P2", res.layers[1]), (1, res.layers[1]), (0, res.layers[0])):
        idata = fusion_to_arviz(res, layer=key, units="all", num_draws=N)
        _check_moments(idata, layer.mean, layer.var)
    with pytest.raises(ValueError, match=r"no layer 'P9'; the matched groups are \['P1', 'P2'\]"):
        fusion_to_arviz(res, layer="P9")
    with pytest.raises(ValueError, match="no matched layers"):
        fusion_to_arviz(fuse(models, "fedavg"))


def test_a_fusion_with_summaries_exports_the_posterior_the_network_is_the_mean_of(digits):
    """With client summaries the fused network is a posterior: the export's loc is the network's
    own weights (every entry of every unit), its scale one over their fused precision, and the
    entries are named by the network's, whatever module holds the network (ClientHeads here)."""
    from bayesfuse import fuse, summarize
    from bayesfuse.data import dirichlet_partition
    from bayesfuse.train import TrainConfig, train_clients

    part = dirichlet_partition(digits.train.y, 3, 1.0, seed=0)
    models = train_clients(digits.train, part, TrainConfig(hidden=(12,), epochs=3), verbose=False)
    summaries = [summarize(m, digits.train.x[i], digits.train.y[i]) for m, i in zip(models, part)]
    res = fuse(models, "pfnm", summaries=summaries)
    idata = fusion_to_arviz(res, units="all", weights="all")
    net = res.model.network
    w, b, out = (net.layers[0].weight, net.layers[0].bias, net.layers[1].weight)
    held = torch.cat([w, b[:, None], out.T], 1).detach().double().numpy()
    np.testing.assert_allclose(idata.constant_data["loc"].values, held, rtol=1e-6, atol=1e-7)
    names = [str(n) for n in idata.posterior["theta"].coords["weight"].values]
    assert names[0] == "layers.0.weight[0]" and names[64] == "layers.0.bias" and names[-1] == "layers.1.weight[9]"
    # the scale, from the core's fusion of the same states: one over the root of the fused precision
    from bayesfuse.core import fuse_states
    from bayesfuse.nets.state import numpy_state

    fused = fuse_states([numpy_state(m) for m in models], "pfnm", summaries=summaries)
    p = fused.precision
    want = np.hstack([p["layers.0.weight"], p["layers.0.bias"][:, None], p["layers.1.weight"].T]) ** -0.5
    np.testing.assert_allclose(fusion_to_arviz(fused, units="all", weights="all").constant_data["scale"].values, want)


# ------------------------------------------------------------------------------ names and attrs


def test_weight_coordinates_name_the_entries():
    import torch

    from bayesfuse import fuse
    from bayesfuse.models.bnn import HorseshoeBNN
    from bayesfuse.nets.mlp import MLP

    fed = simulate_federation(4, 5, gamma0=3.0, prior_var=1.0, noise_var=0.05, seed=0)
    plain = match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=3.0)
    idata = match_to_arviz(plain)
    assert list(idata.posterior["weight"].values) == [f"dim_{d}" for d in range(5)]
    assert idata.posterior.attrs["weight_names"] == "index"
    given = ["a", "b", "c", "d", "bias"]
    assert list(match_to_arviz(plain, weight_names=given).posterior["weight"].values) == given
    with pytest.raises(ValueError, match="all 5 entries"):
        match_to_arviz(plain, weight_names=given[:4])
    with pytest.raises(ValueError, match="distinct"):
        match_to_arviz(plain, weight_names=["a"] * 5)
    # empirical Bayes per block records each entry's block
    blocks = match_neurons(fed.layers, noise_var="auto", prior_var=1.0, gamma0=3.0, blocks=np.array([0, 0, 1, 2, 2]))
    assert list(match_to_arviz(blocks).posterior["weight"].values) == [
        "block0[0]",
        "block0[1]",
        "block1",
        "block2[0]",
        "block2[1]",
    ]

    # fused networks: the matching recorded its entries, the fused network gives their widths
    torch.manual_seed(0)
    models = [MLP(6, [5, 4], 3) for _ in range(2)]
    net = fuse(models, "pfnm")
    G1 = net.sizes[0]
    p1 = fusion_to_arviz(net, layer="P1", weights="all").posterior
    assert list(p1["weight"].values) == [f"layers.0.weight[{i}]" for i in range(6)] + ["layers.0.bias"]
    p2 = fusion_to_arviz(net, layer="P2", weights="all").posterior
    assert list(p2["weight"].values) == (
        [f"layers.1.weight[{i}]" for i in range(G1)] + ["layers.1.bias"] + [f"layers.2.weight[{k}]" for k in range(3)]
    )
    assert p2.attrs["weight_names"] == "blocks" and p2.attrs["layer"] == "P2"
    # entries the fused state_dict does not hold as such: the pieces of a layer reading streams
    # side by side, a zero bias added to fold a batch norm through (they were named dim_0, ...)
    from tests.nets.user_nets import UpConvUNet

    torch.manual_seed(0)
    unet = fuse([UpConvUNet().eval() for _ in range(2)], "pfnm")
    sizes = dict(zip(unet.groups, unet.sizes))
    dec = list(fusion_to_arviz(unet, layer="P4", weights="all").posterior["weight"].values)
    assert dec == (
        [f"dec.weight@0[{i}]" for i in range(sizes["P1"] * 9)]
        + [f"dec.weight@1[{i}]" for i in range(sizes["P3"] * 9)]
        + ["dec.bias"]
    )
    mid = list(fusion_to_arviz(unet, layer="P2", weights="all").posterior["weight"].values)
    assert mid[-1] == "mid.bias" and mid[0] == "mid.weight[0]"

    # fused BNNs: incoming weights, bias, log scale, outgoing weights
    torch.manual_seed(0)
    bnns = [HorseshoeBNN(8, 5, 3) for _ in range(2)]
    expected = [f"in_{d}" for d in range(8)] + ["bias", "log_scale"] + [f"out_{k}" for k in range(3)]
    for method in ("kl", "pfnm"):
        fused = fuse(bnns, method)
        idata = fusion_to_arviz(fused, num_draws=10)
        assert list(idata.constant_data["weight"].values) == expected
        assert list(idata.posterior["weight"].values) == expected[:8]
        mean, var = fused.posteriors[0]
        np.testing.assert_array_equal(np.asarray(idata.constant_data["loc"]), mean)
        np.testing.assert_allclose(np.asarray(idata.constant_data["scale"]) ** 2, var)


def test_attrs_record_method_hyper_and_convergence(tmp_path):
    import torch

    from bayesfuse import fuse
    from bayesfuse.nets.mlp import MLP

    fed = simulate_federation(4, 5, gamma0=3.0, prior_var=1.0, noise_var=0.05, seed=0)
    res = match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=3.0, kl_weight=0.5, seed=3)
    idata = match_to_arviz(res, num_draws=20, seed=7)
    attrs = idata.posterior.attrs
    assert attrs["method"] == "nafi" and attrs["result"] == "MatchResult"
    assert json.loads(attrs["hyper"]) == json.loads(json.dumps(res.hyper))
    assert attrs["converged"] == int(res.converged) and attrs["n_iterations"] == res.n_sweeps
    assert attrs["objective"] == res.objective[-1]
    assert (attrs["sampling"], attrs["num_draws"], attrs["seed"]) == ("independent", 20, 7)

    kl = kl_fuse([DiagNormal(loc=np.eye(3), var=np.ones((3, 3)))] * 2, reg=0.1)
    kl_attrs = klfusion_to_arviz(kl, num_draws=5).posterior.attrs
    assert kl_attrs["method"] == "kl" and json.loads(kl_attrs["hyper"])["solver"] == kl.solver

    torch.manual_seed(0)
    net = fuse([MLP(6, [5, 4], 3) for _ in range(2)], "pfnm")
    fused_attrs = fusion_to_arviz(net, layer="P2", num_draws=5).posterior.attrs
    assert fused_attrs["method"] == "pfnm" and json.loads(fused_attrs["hyper"])["noise_var"] == "auto"
    assert json.loads(fused_attrs["layer_hyper"])["blocks"] == ["layers.1.weight", "layers.1.bias", "layers.2.weight"]

    # everything survives netCDF
    path = tmp_path / "fused.nc"
    idata.to_netcdf(str(path))
    back = _arviz().from_netcdf(str(path))
    for key in ("method", "hyper", "converged", "sampling", "drawn_units"):
        assert back.posterior.attrs[key] == attrs[key]
    np.testing.assert_array_equal(_theta(back), _theta(idata))
    assert list(back.posterior["weight"].values) == list(idata.posterior["weight"].values)


# ------------------------------------------------------------------------------ fused and local BNNs


@pytest.fixture(scope="module")
def bnn_federation(digits):
    """Two tiny horseshoe BNNs on halves of the digits (3 epochs), their KL-fusion and the halves."""
    from bayesfuse import fuse
    from bayesfuse.models.bnn import BNNConfig, train_bnn

    halves = np.array_split(np.random.default_rng(0).permutation(len(digits.train.y)), 2)
    bnns = [
        train_bnn(digits.train.x[i], digits.train.y[i], 10, 8, BNNConfig(epochs=3, seed=j), verbose=False)
        for j, i in enumerate(halves)
    ]
    return bnns, fuse(bnns, "kl"), halves


def test_bnn_export_of_the_fitted_data_is_for_loo(digits, bnn_federation):
    """Exported with the data each posterior was fitted to (a local BNN its half, a fusion all of
    it), the pointwise log-likelihood is predict's, az.loo runs, and az.compare ranks fusions of
    the same data."""
    from bayesfuse import fuse

    bnns, fused, halves = bnn_federation
    S = 200
    x, y = digits.train.x, digits.train.y
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the training data: nothing to warn about
        fid = bnn_to_arviz(fused, x, y, data="train", num_samples=S, seed=1)
        local = bnn_to_arviz(bnns[0], x[halves[0]], y[halves[0]], data="train", num_samples=S, seed=1)
    n, H = len(y), fused.model.hidden
    assert fid.log_likelihood["y"].shape == (2, S, n) and fid.log_likelihood["y"].dims == ("chain", "draw", "obs")
    assert fid.log_likelihood.attrs["data"] == "train" and fid.log_likelihood.attrs["loo"].startswith("applies")
    np.testing.assert_array_equal(np.asarray(fid.observed_data["y"]), y)
    y_rep = np.asarray(fid.posterior_predictive["y"])
    assert y_rep.shape == (2, S, n) and y_rep.min() >= 0 and y_rep.max() <= 9
    assert fid.posterior["w1"].dims == ("chain", "draw", "unit", "input") and fid.posterior["w1"].shape[2:] == (
        min(H, 8),
        8,
    )
    assert fid.posterior["w_out"].dims == ("chain", "draw", "class", "unit") and "w2" not in fid.posterior
    assert (np.asarray(fid.posterior["tau"]) > 0).all()
    assert fid.posterior.attrs["method"] == "kl" and local.posterior.attrs["method"] == "local"
    # the draws, chain after chain, are predict's: the mean likelihood over draws is its probability of the label
    ll = np.asarray(fid.log_likelihood["y"]).reshape(2 * S, n)
    p = fused.model.predict(x, 2 * S, seed=1)
    np.testing.assert_allclose(logsumexp(ll, axis=0) - np.log(2 * S), np.log(p[np.arange(n), y]), rtol=1e-10)

    az = _arviz()
    exports = {"kl": fid, "pfnm": bnn_to_arviz(fuse(bnns, "pfnm"), x, y, data="train", num_samples=S, seed=1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Pareto k warnings of barely trained networks
        loo = az.loo(local, pointwise=True)
        table = az.compare(exports, ic="loo")
    assert np.isfinite(loo["elpd_loo"]) and np.isfinite(loo["p_loo"]) and np.isfinite(np.asarray(loo["loo_i"])).all()
    assert set(table.index) == set(exports) and sorted(table["rank"]) == [0, 1]
    assert np.isfinite(table["elpd_loo"].to_numpy()).all() and (np.diff(table["elpd_loo"].to_numpy()) <= 0).all()


def test_loo_fed_held_out_data_warns_and_says_so(digits, bnn_federation):
    """An export of held-out data says that LOO does not apply, in a warning and in its attrs,
    and points to compare(); so does one that was not told which data it holds."""
    from bayesfuse.analysis import HeldOutDataWarning

    _, fused, _ = bnn_federation
    x, y = digits.test.x[:50], digits.test.y[:50]
    with pytest.warns(HeldOutDataWarning, match=r"LOO does not apply .* bayesfuse.analysis.compare\(models, x, y\)"):
        held = bnn_to_arviz(fused, x, y, data="held-out", num_samples=20)
    for group in (held.posterior, held.log_likelihood):
        assert group.attrs["data"] == "held-out" and group.attrs["loo"].startswith("does not apply")
        assert "compare(models, x, y)" in group.attrs["loo"]
    with pytest.warns(HeldOutDataWarning, match="say which data x, y are"):
        unstated = bnn_to_arviz(fused, x, y, num_samples=20)
    assert unstated.log_likelihood.attrs["data"] == "unstated"
    with pytest.raises(ValueError, match="data must be 'train' or 'held-out'"):
        bnn_to_arviz(fused, x, y, data="test")


def test_compare_is_the_held_out_log_predictive_density(digits, bnn_federation):
    """compare() against a direct computation: each model's lpd_i = log p(y_i | x_i) from its own
    predictive (BNNs' Monte Carlo predictive, a network's softmax, given probabilities), elpd
    its sum, se = sqrt(n var(lpd_i)), and the paired differences to the best and between all pairs."""
    from bayesfuse.analysis import compare, log_predictive_density
    from bayesfuse.nets.mlp import MLP
    from bayesfuse.nets.predict import predict_proba

    bnns, fused, _ = bnn_federation
    x, y = digits.test.x, digits.test.y
    n, S = len(y), 50
    torch.manual_seed(0)
    net = MLP(64, [16], 10)
    probs = {
        "fused": fused.model.predict(x, S, seed=3),
        "local 0": bnns[0].predict(x, S, seed=3),
        "local 1": bnns[1].predict(x, S, seed=3),
        "network": predict_proba(net, x),
    }
    probs["mixture"] = (probs["local 0"] + probs["local 1"]) / 2
    models = {"fused": fused, "local 0": bnns[0], "local 1": bnns[1], "network": net, "mixture": probs["mixture"]}
    table, pairs = compare(models, x, y, num_samples=S, seed=3, pairs=True)

    lpd = {name: np.log(p[np.arange(n), y]) for name, p in probs.items()}
    for name, m in models.items():
        np.testing.assert_allclose(log_predictive_density(m, x, y, num_samples=S, seed=3), lpd[name], rtol=1e-6)
    elpd = {name: v.sum() for name, v in lpd.items()}
    order = sorted(elpd, key=elpd.get, reverse=True)
    assert list(table.index) == order and list(table["rank"]) == list(range(5))
    assert list(table.columns) == ["rank", "elpd", "se", "elpd_diff", "dse"] and table.attrs["n"] == n
    best = order[0]
    for name in order:
        row = table.loc[name]
        assert row["elpd"] == pytest.approx(elpd[name], rel=1e-6)
        assert row["se"] == pytest.approx(np.sqrt(n * np.var(lpd[name], ddof=1)), rel=1e-6)
        assert row["elpd_diff"] == pytest.approx(elpd[best] - elpd[name], rel=1e-6, abs=1e-9)
        want = 0.0 if name == best else np.sqrt(n * np.var(lpd[best] - lpd[name], ddof=1))
        assert row["dse"] == pytest.approx(want, rel=1e-6)
    assert len(pairs) == 10 and (pairs["elpd_diff"] >= 0).all()
    a, b = order[1], order[3]
    assert pairs.loc[(a, b), "elpd_diff"] == pytest.approx(elpd[a] - elpd[b], rel=1e-6)
    assert pairs.loc[(a, b), "dse"] == pytest.approx(np.sqrt(n * np.var(lpd[a] - lpd[b], ddof=1)), rel=1e-6)
    with pytest.raises(ValueError, match="labels in 0..9"):
        compare({"fused": fused}, x, y + 10, num_samples=2)
    with pytest.raises(TypeError, match="cannot get predictive probabilities from a str"):
        log_predictive_density("fused", x, y)
    with pytest.raises(ValueError, match="at least one model"):
        compare({}, x, y)


def test_bnn_export_rejects_bad_inputs(digits, bnn_federation):
    bnns, _, _ = bnn_federation
    x, y = digits.test.x[:5], digits.test.y[:5]
    only = bnn_to_arviz(bnns[0], x, y, num_samples=4, sites=["tau", "b_out"], data="train")
    assert sorted(only.posterior.data_vars) == ["b_out", "tau"]
    with pytest.raises(ValueError, match=r"x must be \(n, 64\)"):
        bnn_to_arviz(bnns[0], x[:, :10], y, data="train")
    with pytest.raises(ValueError, match="labels in 0..9"):
        bnn_to_arviz(bnns[0], x, y + 10, data="train")
    with pytest.raises(ValueError, match="unknown sites"):
        bnn_to_arviz(bnns[0], x, y, sites=["w3"], data="train")
    with pytest.raises(TypeError, match="HorseshoeBNN"):
        bnn_to_arviz(object(), x, y)
    with pytest.raises(TypeError, match="bnn_to_arviz"):
        to_arviz(bnns[0])


# ------------------------------------------------------------------------------ inputs and API


def test_bad_inputs():
    with pytest.raises(ValueError, match="chains must be a positive integer"):
        gaussian_to_arviz(np.zeros((2, 2)), np.ones((2, 2)), chains=0)
    with pytest.raises(ValueError, match="non-negative"):
        gaussian_to_arviz(np.zeros((2, 2)), -np.ones((2, 2)))
    with pytest.raises(ValueError, match="num_draws must be a positive integer"):
        gaussian_to_arviz(np.zeros((2, 2)), np.ones((2, 2)), num_draws=0)
    with pytest.raises(ValueError, match="no unit 5; the units are 0..1"):
        gaussian_to_arviz(np.zeros((2, 2)), np.ones((2, 2)), units=[5])
    with pytest.raises(ValueError, match="repeat"):
        gaussian_to_arviz(np.zeros((2, 2)), np.ones((2, 2)), units=[1, 1])
    with pytest.raises(ValueError, match="'all'"):
        gaussian_to_arviz(np.zeros((2, 2)), np.ones((2, 2)), units="some")


def test_bad_weights():
    mean, var = np.zeros((2, 3)), np.ones((2, 3))
    with pytest.raises(ValueError, match=r"no weight 'bias'; the weights are dim_0, dim_1, dim_2 \(3 in all\)"):
        gaussian_to_arviz(mean, var, weights=["bias"])
    with pytest.raises(ValueError, match="positions in 0..2"):
        gaussian_to_arviz(mean, var, weights=[3])
    with pytest.raises(ValueError, match="repeat"):
        gaussian_to_arviz(mean, var, weights=["dim_1", 1])
    with pytest.raises(ValueError, match="empty"):
        gaussian_to_arviz(mean, var, weights=[])
    one = gaussian_to_arviz(mean, var, weights="dim_2", num_draws=3)
    assert list(one.posterior["weight"].values) == ["dim_2"] and one.posterior.attrs["drawn_weights"] == "[2]"


def test_result_methods_delegate_to_the_analysis_functions():
    """``to_arviz`` of MatchResult, KLFusionResult and FusionResult pass their options through."""
    import torch

    from bayesfuse import fuse
    from bayesfuse.nets.mlp import MLP

    fed = simulate_federation(4, 5, gamma0=3.0, prior_var=1.0, noise_var=0.05, seed=0)
    res = match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=3.0)
    kl = kl_fuse([DiagNormal(loc=np.eye(3), var=np.ones((3, 3)))] * 2, reg=0.1)
    torch.manual_seed(0)
    net = fuse([MLP(6, [5, 4], 3) for _ in range(2)], "pfnm")
    pairs = (
        (res.to_arviz(units=[1], num_draws=7, seed=2), match_to_arviz(res, units=[1], num_draws=7, seed=2)),
        (kl.to_arviz(num_draws=7), klfusion_to_arviz(kl, num_draws=7)),
        (net.to_arviz(layer="P2", units=[0], num_draws=7), fusion_to_arviz(net, layer="P2", units=[0], num_draws=7)),
    )
    for got, want in pairs:
        np.testing.assert_array_equal(_theta(got), _theta(want))
        assert got.posterior.sizes["chain"] == DEFAULT_CHAINS
    assert res.to_arviz().posterior.sizes["draw"] == DEFAULT_DRAWS
    picked = net.to_arviz(layer="P1", units=[1], weights=["layers.0.bias"], num_draws=4)
    assert list(picked.posterior["weight"].values) == ["layers.0.bias"]


def test_bnn_export_of_a_two_layer_bnn_names_every_layers_sites(digits):
    from bayesfuse.models.bnn import HorseshoeBNN

    torch.manual_seed(0)
    bnn = HorseshoeBNN(64, (6, 4), 10)
    x, y = digits.test.x[:20], digits.test.y[:20]
    idata = bnn_to_arviz(bnn, x, y, num_samples=7, seed=2, data="train")
    post = idata.posterior
    # the same names as at one hidden layer, and w2 is the second hidden layer (the output is w_out at every depth)
    assert set(post.data_vars) == {"tau", "lam", "w1", "b1", "tau2", "lam2", "w2", "b2", "w_out", "b_out"}
    assert post["w2"].dims == ("chain", "draw", "unit2", "unit") and post["w2"].shape[2:] == (4, 6)
    assert post["w_out"].dims == ("chain", "draw", "class", "unit2") and post["lam2"].shape[2:] == (4,)
    b3 = bnn.sample_params(14, torch.Generator().manual_seed(2))["b3"].numpy()
    np.testing.assert_array_equal(np.asarray(post["b_out"]), b3.reshape(2, 7, 10))
    assert (np.asarray(post["tau2"]) > 0).all() and post.attrs["hidden"] is not None
    ll = np.asarray(idata.log_likelihood["y"]).reshape(14, 20)
    p = bnn.predict(x, 14, seed=2)  # the same draws as predict's, chain after chain
    np.testing.assert_allclose(logsumexp(ll, axis=0) - np.log(14), np.log(p[np.arange(20), y]), rtol=1e-10)


def test_bnn_export_is_sized_for_az_summary_and_draws_more_on_request(digits, caplog):
    """As to_arviz of a fused layer: two chains (finite r_hat, no shape warning), the first
    DEFAULT_UNITS units and DEFAULT_WEIGHTS inputs said in one logged line and in the attrs, and
    units='all', inputs='all' give the whole posterior, of which the default is an exact slice."""
    from bayesfuse.analysis import DEFAULT_UNITS, DEFAULT_WEIGHTS
    from bayesfuse.models.bnn import HorseshoeBNN

    torch.manual_seed(0)
    bnn = HorseshoeBNN(64, (12, 10), 10)
    x, y = digits.train.x[:30], digits.train.y[:30]
    with caplog.at_level(logging.WARNING, logger="bayesfuse.analysis"):
        small = bnn_to_arviz(bnn, x, y, num_samples=20, seed=3, data="train")
    assert [r.getMessage() for r in caplog.records] == [
        "bnn_to_arviz drew 8+8 of 12+10 units x 8 of 64 inputs (the default, sized for az.summary and az.plot_forest); "
        "units='all' or [ids], inputs='all' or [names] draw more"
    ]
    post = small.posterior
    assert post.sizes["chain"] == DEFAULT_CHAINS and post.sizes["draw"] == 20
    assert post["w1"].shape[2:] == (DEFAULT_UNITS, DEFAULT_WEIGHTS) and post["w2"].shape[2:] == (8, 8)
    assert post["w_out"].shape[2:] == (10, 8) and post.attrs["chains"] == 2
    assert post.attrs["drawn_units"] == "0..7" and post.attrs["drawn_inputs"] == "0..7"
    full = bnn_to_arviz(bnn, x, y, num_samples=20, seed=3, data="train", units="all", inputs="all")
    assert full.posterior["w1"].shape[2:] == (12, 64) and full.posterior.attrs["drawn_units"] == "all"
    for name, values in post.data_vars.items():
        np.testing.assert_array_equal(values, full.posterior[name].sel({d: values[d] for d in values.dims[2:]}))
    np.testing.assert_array_equal(small.log_likelihood["y"], full.log_likelihood["y"])
    picked = bnn_to_arviz(bnn, x, y, num_samples=5, data="train", units=[3, 1], inputs=["in_9"], sites=["w1"])
    assert picked.posterior["w1"].shape[2:] == (2, 1) and list(picked.posterior["unit"].values) == [3, 1]
    table = _arviz().summary(small)
    assert len(table) == sum(int(np.prod(v.shape[2:])) for v in post.data_vars.values())
    assert np.isfinite(table["r_hat"]).all()
    with pytest.raises(ValueError, match="hidden layer 2: no unit 11; the units are 0..9"):
        bnn_to_arviz(bnn, x, y, data="train", units=[11])
    with pytest.raises(ValueError, match="chains must be a positive integer"):
        bnn_to_arviz(bnn, x, y, data="train", chains=0)


# ------------------------------------------------------------------------------ BNNs aligned to the fused units


def _effective(state, layer: int):
    """Effective incoming weights and bias exp(m) (w, b) and m = loc(log tau) + loc(log lam) of
    hidden layer ``layer`` (1-based), read straight from a HorseshoeBNN's state_dict."""
    tag = "" if layer == 1 else str(layer)
    loc = {k[4:]: v.double().numpy() for k, v in state.items() if k.startswith("loc.")}
    m = loc[f"log_tau{tag}"].reshape(-1)[0] + loc[f"log_lam{tag}"].reshape(-1)
    return np.exp(m)[:, None] * np.hstack([loc[f"w{layer}"], loc[f"b{layer}"][:, None]]), m


def test_aligned_exports_place_local_units_at_their_global_units(bnn_federation):
    bnns, fused, _ = bnn_federation
    from bayesfuse.analysis import aligned_to_arviz

    exports = aligned_to_arviz(fused, bnns, units="all", num_draws=10)
    assert list(exports) == ["fused", "client 0", "client 1"]
    names = list(exports["fused"].posterior["weight"].values)
    assert names == [f"in_{d}" for d in range(64)] + ["bias", "log_scale"] + [f"out_{k}" for k in range(10)]
    layer, kept = fused.layers[0], fused.hyper["kept_units"]
    # the fused units, in the scale-free form, at their own ids
    eff, m = _effective(fused.model.state_dict(), 1)
    cd = exports["fused"].constant_data
    np.testing.assert_allclose(np.asarray(cd["loc"])[:, :65], eff, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(cd["loc"])[:, 65], m, rtol=1e-10)
    np.testing.assert_array_equal(cd["global_unit"], np.arange(fused.sizes[0]))
    for j, bnn in enumerate(bnns):
        state = bnn.state_dict()
        eff, m = _effective(state, 1)
        out = state["loc.w2"].double().numpy().T  # (H, K)
        export = exports[f"client {j}"]
        placed = np.asarray(export.constant_data["global_unit"])
        np.testing.assert_array_equal(np.sort(placed), np.sort(layer.assignments[j]))
        for local, g in zip(kept[j], layer.assignments[j]):  # each kept unit where it was matched
            row = np.asarray(export.constant_data["loc"].sel(global_unit=g))
            np.testing.assert_allclose(row, np.concatenate([eff[local], [m[local]], out[local]]), rtol=1e-10)
        assert export.posterior.attrs["form"] == "effective" and export.posterior.attrs["model"] == f"client {j}"
    # a global unit and its members side by side
    g = int(np.argmax(np.bincount(np.concatenate(layer.assignments))))
    import matplotlib.pyplot as plt

    members = {name: e for name, e in exports.items() if g in e.posterior["global_unit"].values}
    assert len(members) == 1 + int(np.bincount(np.concatenate(layer.assignments))[g])
    _arviz().plot_forest(
        list(members.values()),
        model_names=list(members),
        var_names=["theta"],
        coords={"global_unit": [g], "weight": ["bias", "log_scale", "out_0"]},
        combined=True,
    )
    plt.close("all")
    # the default: the first 8 global units; a client holds those it has
    small = aligned_to_arviz(fused, bnns)
    assert list(small["fused"].posterior["global_unit"].values) == list(range(8))
    for j in range(2):
        name, want = f"client {j}", set(range(8)) & set(layer.assignments[j].tolist())
        held = set(small[name].posterior["global_unit"].values.tolist()) if name in small else set()
        assert held == want  # a client with none of them is left out
    with pytest.raises(ValueError, match="has 2 clients, got 1"):
        aligned_to_arviz(fused, bnns[:1])
    with pytest.raises(TypeError, match="horseshoe BNNs"):
        aligned_to_arviz(object(), bnns)


def test_aligned_exports_of_a_second_hidden_layer_use_the_global_basis_below(digits):
    from bayesfuse import fuse
    from bayesfuse.analysis import aligned_to_arviz
    from bayesfuse.models.bnn import HorseshoeBNN

    torch.manual_seed(0)
    bnns = [HorseshoeBNN(8, (5, 4), 3) for _ in range(2)]
    fused = fuse(bnns, "kl")
    exports = aligned_to_arviz(fused, bnns, layer=1, units="all", num_draws=4)
    G1 = fused.sizes[0]
    names = list(exports["fused"].constant_data["weight"].values)
    assert names == [f"unit_{g}" for g in range(G1)] + ["bias", "log_scale"] + [f"out_{k}" for k in range(3)]
    below, here = fused.layers[0], fused.layers[1]
    kept = fused.hyper["kept_units"]
    for j, bnn in enumerate(bnns):
        eff, _ = _effective(bnn.state_dict(), 2)  # (H2, H1 + 1) in the client's own basis
        loc = exports[f"client {j}"].constant_data["loc"]
        for local, g in zip(kept[1][j], here.assignments[j]):
            row = np.asarray(loc.sel(global_unit=g))[:G1]
            want = np.zeros(G1)
            want[below.assignments[j]] = eff[local, kept[0][j]]
            np.testing.assert_allclose(row, want, rtol=1e-10)


def test_compare_takes_names_for_its_models():
    from bayesfuse.analysis import compare

    with pytest.raises(TypeError, match="compare takes a mapping of names to models.*got a list"):
        compare([object(), object()], np.zeros((2, 3)), np.zeros(2, dtype=int))
