import numpy as np
import pytest

from bayesfuse.analysis import _arviz, gaussian_to_arviz
from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.matching import match_neurons
from bayesfuse.models.bbp import simulate_federation

N = 4000  # draws


def _check_moments(idata, mean, var):
    draws = np.asarray(idata.posterior["theta"]).reshape(N, *mean.shape)
    # Sample mean: sd sqrt(var / N); sample variance: relative sd sqrt(2 / (N - 1)).
    # 5 sd bounds on each of <= 60 entries fail with probability < 1e-4 in all.
    assert (np.abs(draws.mean(0) - mean) < 5 * np.sqrt(var / N)).all()
    assert (np.abs(draws.var(0, ddof=1) / var - 1) < 5 * np.sqrt(2 / (N - 1))).all()


def test_match_result_round_trip():
    fed = simulate_federation(4, 5, gamma0=3.0, prior_var=1.0, noise_var=0.05, seed=0)
    res = match_neurons(fed.layers, noise_var=0.05, prior_var=1.0, gamma0=3.0, cost="marginal")
    idata = res.to_arviz(num_draws=N)
    _check_moments(idata, res.mean, res.var)
    cd = idata.constant_data
    for j, a in enumerate(res.assignments):
        np.testing.assert_array_equal(np.asarray(cd["assigned_global_unit"])[np.asarray(cd["client"]) == j], a)
    np.testing.assert_array_equal(np.asarray(cd["counts"]), res.counts)
    np.testing.assert_allclose(np.asarray(cd["objective"]), res.objective)


def test_klfusion_round_trip_and_arviz_tools():
    rng = np.random.default_rng(0)
    clients = [DiagNormal(loc=rng.normal(size=(3, 4)) * 3, var=rng.uniform(0.1, 0.3, size=(3, 4))) for _ in range(2)]
    res = kl_fuse(clients, reg=0.1)
    idata = res.to_arviz(num_draws=N)
    _check_moments(idata, res.components.loc, res.components.var)
    az = _arviz()
    summary = az.summary(idata, var_names=["theta"])
    assert len(summary) == res.n_components * 4
    az.plot_forest(idata, var_names=["theta"], coords={"global_unit": [0]})


def test_local_exports_line_up_with_the_fused_one():
    from bayesfuse.analysis import local_to_arviz

    rng = np.random.default_rng(1)
    base = DiagNormal(loc=rng.normal(size=(3, 4)) * 3, var=rng.uniform(0.1, 0.3, size=(3, 4)))
    perm = np.array([2, 0, 1])
    clients = [base, DiagNormal(loc=base.loc[perm] + 0.01, var=base.var[perm])]  # the same units, reordered
    res = kl_fuse(clients, reg=0.1)
    assert res.n_components == 3
    fused = res.to_arviz(num_draws=400)
    locals_ = [local_to_arviz(c.loc, c.var, a, num_draws=400) for c, a in zip(clients, res.assignments)]
    g = int(res.assignments[0][0])  # client 0's unit 0 and its match in client 1
    got = np.asarray(locals_[0].posterior["theta"].sel(global_unit=g)).reshape(400, 4).mean(0)
    assert (np.abs(got - clients[0].loc[0]) < 5 * np.sqrt(clients[0].var[0] / 400)).all()
    az = _arviz()
    az.plot_forest([fused, *locals_], model_names=["fused", "client 0", "client 1"], var_names=["theta"],
                   coords={"global_unit": [g]}, combined=True)
    with pytest.raises(ValueError, match="distinct"):
        local_to_arviz(clients[0].loc, clients[0].var, [0, 0, 1])


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple"):
        gaussian_to_arviz(np.zeros((2, 2)), np.ones((2, 2)), num_draws=10, chains=4)
    with pytest.raises(ValueError, match="non-negative"):
        gaussian_to_arviz(np.zeros((2, 2)), -np.ones((2, 2)))


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
        idata = res.to_arviz(layer=key, num_draws=N)
        _check_moments(idata, layer.mean, layer.var)
    with pytest.raises(ValueError, match=r"no layer 'P9'; the matched groups are \['P1', 'P2'\]"):
        res.to_arviz(layer="P9")
    with pytest.raises(ValueError, match="no matched layers"):
        fuse(models, "fedavg").to_arviz()
