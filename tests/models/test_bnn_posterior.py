import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bayesfuse import fuse
from bayesfuse.data import load_digits
from bayesfuse.models.bnn import BNNConfig, HorseshoeBNN, train_bnn
from bayesfuse.models.bnn_posterior import BNNPosterior
from bayesfuse.models.bnn_sites import SITES, is_bnn_state
from bayesfuse.nets import MLP

# Single-model cases are part of these tests; the warning they raise is expected.
pytestmark = pytest.mark.filterwarnings("ignore:only one model")


@pytest.fixture(scope="module")
def data():
    return load_digits().standardize()


@pytest.fixture(scope="module")
def bnn(data):
    return train_bnn(data.train.x[:400], data.train.y[:400], 10, 12, BNNConfig(epochs=20, seed=3), verbose=False)


def _rows(a):
    return a[np.lexsort(a.T[::-1])]


def _shuffled(bnn: HorseshoeBNN, seed: int) -> HorseshoeBNN:
    post = BNNPosterior.from_bnn(bnn)
    perm = np.random.default_rng(seed).permutation(post.hidden)
    return BNNPosterior(
        post.units[perm],
        post.out_bias,
        post.log_tau,
        post.in_features,
        post.n_classes,
        post.global_scale,
        post.weight_scale,
    ).to_bnn()


def test_round_trip_gives_identical_predictive(bnn, data):
    back = BNNPosterior.from_bnn(bnn).to_bnn()
    for site in bnn.loc:
        assert torch.equal(back.loc[site], bnn.loc[site])
        torch.testing.assert_close(back.log_scale[site], bnn.log_scale[site], rtol=0, atol=1e-15)
    np.testing.assert_allclose(
        back.predict(data.test.x, 20, seed=4), bnn.predict(data.test.x, 20, seed=4), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("method", ["kl", "nafi"])
def test_fusing_one_bnn_returns_it(bnn, method):
    res = fuse([bnn], method, **({} if method == "kl" else {"prior_var": 1e8}))  # kl has no prior_var
    post, fused = BNNPosterior.from_bnn(bnn), BNNPosterior.from_bnn(res.model)
    assert res.sizes == [bnn.hidden]
    if method == "kl":  # the barycenter of one Gaussian is itself
        np.testing.assert_allclose(_rows(fused.units.loc), _rows(post.units.loc), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_rows(fused.units.var), _rows(post.units.var), rtol=1e-10)
    else:  # one noisy observation of each atom, prior N(0, 1e8): the mean moves by < 1e-6
        np.testing.assert_allclose(_rows(fused.units.loc), _rows(post.units.loc), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(fused.out_bias.loc, post.out_bias.loc, rtol=1e-12)
    np.testing.assert_allclose(fused.log_tau.var, post.log_tau.var, rtol=1e-12)


def test_fusing_shuffled_copies_returns_the_same_predictive(bnn, data):
    copies = [_shuffled(bnn, s) for s in range(3)]
    res = fuse(copies, "kl")
    assert res.sizes == [bnn.hidden]
    post, fused = BNNPosterior.from_bnn(bnn), BNNPosterior.from_bnn(res.model)
    np.testing.assert_allclose(_rows(fused.units.loc), _rows(post.units.loc), rtol=1e-9, atol=1e-12)
    # Same posterior, units in another order, so Monte Carlo draws differ: with S = 4000 each
    # predictive probability has sd <= 0.5 / sqrt(S) = 0.008, a difference of two <= 0.011;
    # 0.06 is over 5 sd for each of the 500 entries compared.
    x = data.test.x[:50]
    np.testing.assert_allclose(res.model.predict(x, 4000, seed=0), bnn.predict(x, 4000, seed=1), atol=0.06)


def test_bad_inputs(bnn, data):
    other = train_bnn(data.train.x[:50, :32], data.train.y[:50], 10, 4, BNNConfig(epochs=1), verbose=False)
    with pytest.raises(ValueError, match="maps 64 -> 10"):
        fuse([bnn, other], "kl")
    with pytest.raises(TypeError, match="Bayesian and point-estimate"):
        fuse([bnn, MLP(64, [5], 10)], "kl")
    with pytest.raises(TypeError, match="HorseshoeBNN"):
        BNNPosterior.from_bnn(MLP(64, [5], 10))
    broken = BNNPosterior.from_bnn(bnn).to_bnn()
    with torch.no_grad():
        broken.loc["w1"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fuse([bnn, broken], "kl")
    with pytest.raises(ValueError, match="method"):
        fuse([bnn], "fedavg")


# ---------------------------------------------------------------------- state_dicts and the site record
def test_state_round_trip_is_exact(bnn, data):
    # Prepare
    state = bnn.state_dict()
    # Execute
    post = BNNPosterior.from_state(state, "bnn.pt")
    out = post.to_state()
    back = HorseshoeBNN.from_state_dict(out, "bnn.pt")
    # Assert: the same keys in the same order, float64 arrays; the rebuilt guide is the original.
    # loc and prior_scales are copied; log_scale goes through var = exp(2 s) and log(var) / 2,
    # which gives these trained scales back exactly.
    assert list(out) == list(state) == list(back.state_dict())
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float64 for v in out.values())
    for key, value in back.state_dict().items():
        assert torch.equal(value, state[key]), key
        assert torch.equal(value, torch.from_numpy(out[key])), key
    assert np.array_equal(back.predict(data.test.x, 20, seed=4), bnn.predict(data.test.x, 20, seed=4))


def test_from_state_reads_arrays_and_tensors_alike(bnn):
    from_tensors = BNNPosterior.from_state(bnn.state_dict())
    from_arrays = BNNPosterior.from_state(from_tensors.to_state())
    from_module = BNNPosterior.from_bnn(bnn)
    for post in (from_arrays, from_module):
        for field in ("units", "out_bias", "log_tau"):
            assert np.array_equal(getattr(post, field).loc, getattr(from_tensors, field).loc)
            np.testing.assert_allclose(getattr(post, field).var, getattr(from_tensors, field).var, rtol=1e-15)
        assert (post.in_features, post.n_classes, post.hidden) == (64, 10, 12)
        assert (post.global_scale, post.weight_scale) == (bnn.global_scale, bnn.weight_scale)


def test_unit_layout_follows_the_record(bnn):
    post = BNNPosterior.from_bnn(bnn)
    D, K = post.in_features, post.n_classes
    layout = dict(post.unit_layout())
    assert list(layout) == [s.name for s in SITES if s.unit_axis is not None] == ["w1", "b1", "log_lam", "w2"]
    assert layout == {
        "w1": slice(0, D),
        "b1": slice(D, D + 1),
        "log_lam": slice(D + 1, D + 2),
        "w2": slice(D + 2, D + 2 + K),
    }
    assert post.out_slice == post.columns("w2") and post.out_slice.start == D + 2
    assert post.units.loc.shape == (bnn.hidden, D + 2 + K)
    with torch.no_grad():
        assert np.array_equal(post.units.loc[:, post.columns("w1")], bnn.loc["w1"].numpy())
        assert np.array_equal(post.units.loc[:, post.columns("log_lam")][:, 0], bnn.loc["log_lam"].numpy())
        assert np.array_equal(post.units.loc[:, post.out_slice], bnn.loc["w2"].numpy().T)
    with pytest.raises(KeyError, match="no unit axis"):
        post.columns("b2")


def test_site_record_describes_the_guide(bnn):
    shapes = bnn.site_shapes()
    assert list(shapes) == [s.name for s in SITES] == ["w1", "b1", "log_lam", "log_tau", "w2", "b2"]
    for site in SITES:
        assert tuple(bnn.loc[site.name].shape) == tuple(bnn.log_scale[site.name].shape) == shapes[site.name]
    assert {s.name for s in SITES if s.transform == "log"} == {"log_lam", "log_tau"}
    assert {s.name: s.unit_axis for s in SITES} == {
        "w1": 0,
        "b1": 0,
        "log_lam": 0,
        "log_tau": None,
        "w2": 1,
        "b2": None,
    }
    params = bnn.sample_params(3, torch.Generator().manual_seed(0))
    assert list(params) == [s.name for s in SITES]


def test_is_state_dict(bnn):
    state = bnn.state_dict()
    assert HorseshoeBNN.is_state_dict(state) and is_bnn_state(state)
    assert HorseshoeBNN.is_state_dict(BNNPosterior.from_bnn(bnn).to_state())
    assert not HorseshoeBNN.is_state_dict({k: v for k, v in state.items() if k != "prior_scales"})
    assert not HorseshoeBNN.is_state_dict({**state, "extra": torch.zeros(1)})
    assert not HorseshoeBNN.is_state_dict(MLP(64, [5], 10).state_dict())


def _broken_states(bnn):
    state = BNNPosterior.from_bnn(bnn).to_state()
    missing = {k: v for k, v in state.items() if k != "log_scale.b1"}
    wrong_shape = {**state, "loc.w2": state["loc.w2"][:, :-1]}
    nan = {k: v.copy() for k, v in state.items()}
    nan["loc.w1"][3, 5] = np.nan
    inf = {k: v.copy() for k, v in state.items()}
    inf["loc.b2"][0] = np.inf
    return {
        "missing": (missing, "missing log_scale.b1"),
        "wrong shape": (wrong_shape, "'loc.w2' has shape"),
        "NaN": (nan, "guide parameter 'w1' contains NaN"),
        "Inf": (inf, "guide parameter 'b2' contains NaN"),
    }


@pytest.mark.parametrize("case", ["missing", "wrong shape", "NaN", "Inf"])
def test_from_state_names_the_file(bnn, case):
    state, message = _broken_states(bnn)[case]
    with pytest.raises(ValueError, match=f"client_7.pt.*{message}"):
        BNNPosterior.from_state(state, "client_7.pt")


@pytest.mark.parametrize("case", ["missing", "wrong shape"])
def test_from_state_dict_names_the_file(bnn, case):
    state, message = _broken_states(bnn)[case]
    with pytest.raises(ValueError, match=f"client_7.pt: .*{message}"):
        HorseshoeBNN.from_state_dict(state, "client_7.pt")
    with pytest.raises(ValueError, match="client_7.pt: not a consistent HorseshoeBNN"):
        HorseshoeBNN.from_state_dict({**bnn.state_dict(), "prior_scales": torch.tensor([0.1, -1.0])}, "client_7.pt")


def test_bnn_posterior_module_does_not_need_torch():
    # ``import bayesfuse`` loads torch (the package re-exports fusion and training), so the
    # parent packages are stand-ins that skip their __init__; torch itself is blocked.
    root = Path(__file__).resolve().parents[2] / "bayesfuse"
    code = f"""
import sys, types
sys.modules["torch"] = None
for name, path in [("bayesfuse", {str(root)!r}), ("bayesfuse.models", {str(root / "models")!r}),
                   ("bayesfuse.inference", {str(root / "inference")!r})]:
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
import numpy as np
from bayesfuse.models.bnn_posterior import BNNPosterior
from bayesfuse.models.bnn_sites import STATE_KEYS
H, D, K = 3, 4, 2
shapes = {{"w1": (H, D), "b1": (H,), "log_lam": (H,), "log_tau": (1,), "w2": (K, H), "b2": (K,)}}
state = {{"prior_scales": np.array([0.1, 1.0])}}
for key in STATE_KEYS[1:]:
    state[key] = np.full(shapes[key.split(".")[1]], -1.0 if key.startswith("log_scale") else 0.5)
post = BNNPosterior.from_state(state)
out = post.to_state()
assert list(out) == list(STATE_KEYS) and all(np.array_equal(out[k], state[k]) for k in state)
print("ok", sorted(m for m, module in sys.modules.items() if module and m.split(".")[0] in ("torch", "pyro")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok []", out.stderr


@pytest.mark.catalogue
@pytest.mark.parametrize("scales", [[1.0, -1.0], [float("nan"), 1.0], [0.0, 1.0]])
def test_bad_prior_scales_are_refused_by_the_posterior_too(scales):
    state = {k: np.asarray(v) for k, v in HorseshoeBNN(4, 3, 2).state_dict().items()}
    state["prior_scales"] = np.asarray(scales)
    with pytest.raises(ValueError, match="client 7.*prior_scales"):
        BNNPosterior.from_state(state, "client 7")
