"""OT fusion (Singh & Jaggi 2020): permutation invariance, the plan against brute force, an
independent re-implementation with Hungarian matching, different widths, failure modes."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from bayesfuse.inference.layerwise import fold_batchnorm
from bayesfuse.inference.otfusion import OTFusionResult, choose_anchor, ot_fuse_layerwise, ot_plan
from bayesfuse.inference.result import ConvergenceWarning, LayerResult
from bayesfuse.inference.spec import chain, dense, permute, random_permutations
from bayesfuse.nets.arch import LSTMClassifier, make_cnn, rebuild
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.spec import spec_from_module
from bayesfuse.nets.state import numpy_state, tensor_state
from tests.helpers import randomise


def _copies(state, spec, n, seed=0):
    """The network itself, then ``n - 1`` copies with randomly permuted hidden units, and their permutations."""
    sizes = spec.sizes(state)
    perms = [{g: np.arange(s) for g, s in sizes.items()}]
    perms += [random_permutations(sizes, np.random.default_rng(seed + s)) for s in range(1, n)]
    return [permute(state, spec, p) for p in perms], perms


def _mlp():
    model = randomise(MLP(10, [9, 8], 4), 0)
    return numpy_state(model), model.permutation_spec()


def _cnn():
    model = randomise(make_cnn(64, 5, channels=(6, 4), hidden=(7,)), 1)
    x = torch.randn(2, 64)
    return model, spec_from_module(model, x)


def _assert_states_close(got, want, atol=1e-10):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(
            np.asarray(got[k], dtype=np.float64), np.asarray(want[k], dtype=np.float64), rtol=0, atol=atol, err_msg=k
        )


# --------------------------------------------------------------------------- invariances


def test_permuted_copies_of_an_mlp_fuse_back_to_the_anchor_and_plans_recover_the_permutations():
    state, spec = _mlp()
    copies, perms = _copies(state, spec, 4)
    res = ot_fuse_layerwise(copies, spec, anchor=0)
    assert isinstance(res, OTFusionResult) and res.anchor == 0
    _assert_states_close(res.state_dict, state)
    assert res.sizes == {"P1": 9, "P2": 8}
    for g in spec.groups:
        layer = res.layers[g]
        assert isinstance(layer, LayerResult) and layer.converged
        assert layer.n_global == spec.sizes(state)[g]
        # copy j's unit i is the original's unit perms[j][g][i]
        for j in range(4):
            np.testing.assert_array_equal(layer.assignments[j], perms[j][g])
            np.testing.assert_allclose(layer.plans[j] * layer.n_global, np.eye(layer.n_global)[perms[j][g]], atol=1e-12)
        assert layer.objective == [pytest.approx(0.0, abs=1e-9)]
        np.testing.assert_allclose(layer.var, 0.0, atol=1e-20)


def test_a_permuted_anchor_gives_the_permuted_network():
    state, spec = _mlp()
    copies, _ = _copies(state, spec, 3, seed=10)
    res = ot_fuse_layerwise(copies, spec, anchor=2)
    _assert_states_close(res.state_dict, copies[2])


def test_a_network_fused_with_itself_is_itself():
    state, spec = _mlp()
    _assert_states_close(ot_fuse_layerwise([state, state], spec).state_dict, state)
    _assert_states_close(ot_fuse_layerwise([state], spec).state_dict, state)


def test_permuted_copies_of_a_cnn_with_batch_norms_fuse_back_to_its_function():
    model, spec = _cnn()
    state = numpy_state(model)
    copies, _ = _copies(state, spec, 3, seed=20)
    res = ot_fuse_layerwise(copies, spec, anchor=1)  # a shuffled copy: the fused state is not the original's
    # entries: the anchor's, batch norms folded (and left as identities)
    _assert_states_close(res.state_dict, fold_batchnorm(copies[1], spec))
    fused = rebuild(model, tensor_state(res.state_dict)).eval()
    x = torch.randn(16, 64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-4)


def test_permuted_copies_of_an_lstm_fuse_back_to_its_function():
    """Hidden-to-hidden weights are mapped on both axes, A^T W_hh A."""
    model = randomise(LSTMClassifier(36, 3, hidden=8, num_layers=2), 2)
    spec = model.permutation_spec()
    copies, _ = _copies(numpy_state(model), spec, 3, seed=30)
    res = ot_fuse_layerwise(copies, spec, anchor=2)
    _assert_states_close(res.state_dict, copies[2])
    fused = rebuild(model, tensor_state(res.state_dict)).eval()
    x = torch.randn(8, 36)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


def test_client_order_changes_the_result_only_through_the_anchor():
    state, spec = _mlp()
    other = numpy_state(randomise(MLP(10, [9, 8], 4), 5))
    a = ot_fuse_layerwise([state, other], spec, anchor=0).state_dict
    b = ot_fuse_layerwise([other, state], spec, anchor=1).state_dict
    _assert_states_close(a, b, atol=1e-12)


# --------------------------------------------------------------------------- the plan


def test_exact_plan_with_equal_widths_is_the_hungarian_assignment():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 4))
    cost = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    plan, ok = ot_plan(cost)
    assert ok
    rows, cols = linear_sum_assignment(cost)
    want = np.zeros((6, 6))
    want[rows, cols] = 1.0 / 6
    np.testing.assert_allclose(plan, want, atol=1e-15)
    assert (plan * cost).sum() == pytest.approx(cost[rows, cols].sum() / 6, rel=1e-12)


def test_plan_between_different_widths_has_uniform_marginals_and_beats_any_permuted_plan():
    rng = np.random.default_rng(4)
    cost = rng.random((5, 7))
    plan, ok = ot_plan(cost)
    assert ok and (plan >= 0).all()
    np.testing.assert_allclose(plan.sum(1), np.full(5, 1 / 5), atol=1e-12)
    np.testing.assert_allclose(plan.sum(0), np.full(7, 1 / 7), atol=1e-12)
    best = (plan * cost).sum()
    for s in range(200):  # relabelling the columns of the optimal plan gives feasible plans
        other = plan[:, rng.permutation(7)]
        assert (other * cost).sum() >= best - 1e-12


def test_entropic_plan_is_the_gibbs_kernel_scaled_to_the_marginals():
    """Sinkhorn's optimality condition: T = diag(u) exp(-C / reg) diag(v), C the cost over its maximum."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(6, 4)), rng.normal(size=(7, 4))
    cost = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    reg = 0.05
    soft, ok = ot_plan(cost, reg=reg, n_iter=10_000)
    assert ok
    np.testing.assert_allclose(soft.sum(1), np.full(6, 1 / 6), atol=1e-8)
    np.testing.assert_allclose(soft.sum(0), np.full(7, 1 / 7), atol=1e-8)
    log_scaling = np.log(soft) + cost / cost.max() / reg  # log u_i + log v_j
    rank_one = log_scaling - log_scaling[:, :1] - log_scaling[:1, :] + log_scaling[0, 0]
    np.testing.assert_allclose(rank_one, 0.0, atol=1e-8)
    exact, _ = ot_plan(cost)
    assert (exact * cost).sum() <= (soft * cost).sum()


def test_sinkhorn_that_stops_early_warns():
    state, spec = _mlp()
    other = numpy_state(randomise(MLP(10, [9, 8], 4), 6))
    with pytest.warns(ConvergenceWarning, match="P1"):
        res = ot_fuse_layerwise([state, other], spec, reg=1e-4, n_iter=2)
    assert not res.layers["P1"].converged


# --------------------------------------------------------------------------- an independent implementation


def _by_hand(states, weights):
    """OT fusion of 784-free two-hidden-layer MLPs with Hungarian matching, written out for two clients."""
    s0, s1 = states
    w = np.asarray(weights, dtype=float) / np.sum(weights)
    # layer 1: units [W1 | b1]
    u0 = np.hstack([s0["layers.0.weight"], s0["layers.0.bias"][:, None]])
    u1 = np.hstack([s1["layers.0.weight"], s1["layers.0.bias"][:, None]])
    r, c = linear_sum_assignment(((u1[:, None] - u0[None]) ** 2).sum(-1))
    p1 = np.empty(len(c), dtype=int)
    p1[c] = r  # anchor unit i <- client unit p1[i]
    # layer 2: incoming weights in the anchor's basis of layer 1
    w2 = s1["layers.1.weight"][:, p1]
    u0 = np.hstack([s0["layers.1.weight"], s0["layers.1.bias"][:, None]])
    u1 = np.hstack([w2, s1["layers.1.bias"][:, None]])
    r, c = linear_sum_assignment(((u1[:, None] - u0[None]) ** 2).sum(-1))
    p2 = np.empty(len(c), dtype=int)
    p2[c] = r
    aligned = {
        "layers.0.weight": s1["layers.0.weight"][p1],
        "layers.0.bias": s1["layers.0.bias"][p1],
        "layers.1.weight": w2[p2],
        "layers.1.bias": s1["layers.1.bias"][p2],
        "layers.2.weight": s1["layers.2.weight"][:, p2],
        "layers.2.bias": s1["layers.2.bias"],
    }
    return {k: w[0] * s0[k] + w[1] * aligned[k] for k in s0}


def test_two_different_mlps_fuse_as_a_hungarian_reimplementation_says():
    spec = MLP(10, [9, 8], 4).permutation_spec()
    s0 = numpy_state(randomise(MLP(10, [9, 8], 4), 11))
    s1 = numpy_state(randomise(MLP(10, [9, 8], 4), 12))
    s0 = {k: v.astype(np.float64) for k, v in s0.items()}
    s1 = {k: v.astype(np.float64) for k, v in s1.items()}
    res = ot_fuse_layerwise([s0, s1], spec, anchor=0, weights=[3.0, 1.0])
    _assert_states_close(res.state_dict, _by_hand([s0, s1], [3.0, 1.0]), atol=1e-12)
    assert res.hyper["weights"] == [0.75, 0.25]


# --------------------------------------------------------------------------- different widths


def _one_hidden(n_hidden, seed):
    rng = np.random.default_rng(seed)
    return {
        "fc1.weight": rng.normal(size=(n_hidden, 3)),
        "fc1.bias": rng.normal(size=n_hidden),
        "fc2.weight": rng.normal(size=(2, n_hidden)),
        "fc2.bias": rng.normal(size=2),
    }


SPEC1 = chain(dense("fc1", None, "H"), dense("fc2", "H", None), output=("fc2.weight", "fc2.bias"))


@pytest.mark.parametrize("anchor, width", [(0, 5), (1, 7), ("widest", 7), ("median", 5)])
def test_widths_5_and_7_fuse_to_the_anchors_width(anchor, width):
    states = [_one_hidden(5, 0), _one_hidden(7, 1)]
    res = ot_fuse_layerwise(states, SPEC1, anchor=anchor)
    assert res.sizes == {"H": width}
    assert res.state_dict["fc1.weight"].shape == (width, 3) and res.state_dict["fc2.weight"].shape == (2, width)
    layer = res.layers["H"]
    for j, n in enumerate((5, 7)):
        assert layer.plans[j].shape == (n, width)
        np.testing.assert_allclose(layer.plans[j].sum(1), 1 / n, atol=1e-12)
        np.testing.assert_allclose(layer.plans[j].sum(0), 1 / width, atol=1e-12)
        assert layer.assignments[j].shape == (n,) and layer.assignments[j].max() < width
    assert all(np.isfinite(v).all() for v in res.state_dict.values())


def test_a_unit_split_over_two_anchor_units_is_averaged_in_and_copied_out():
    """Eqs. (1)-(2) by hand: the anchor has every unit of a 5-unit client twice (outgoing halved);
    each client unit then sends half its mass to each copy, so A = T diag(1/beta) holds 1 there:
    copies get the client's incoming weights and its *full* outgoing weights."""
    small = _one_hidden(5, 2)
    big = {
        "fc1.weight": np.repeat(small["fc1.weight"], 2, axis=0),
        "fc1.bias": np.repeat(small["fc1.bias"], 2),
        "fc2.weight": np.repeat(small["fc2.weight"], 2, axis=1) / 2,
        "fc2.bias": small["fc2.bias"] + 1.0,
    }
    res = ot_fuse_layerwise([small, big], SPEC1)  # "widest": the 10-unit network
    assert res.anchor == 1
    np.testing.assert_allclose(res.layers["H"].plans[0], np.repeat(np.eye(5), 2, axis=1) / 10, atol=1e-15)
    np.testing.assert_allclose(res.state_dict["fc1.weight"], big["fc1.weight"], atol=1e-12)
    np.testing.assert_allclose(res.state_dict["fc1.bias"], big["fc1.bias"], atol=1e-12)
    np.testing.assert_allclose(
        res.state_dict["fc2.weight"], 0.75 * np.repeat(small["fc2.weight"], 2, axis=1), atol=1e-12
    )
    np.testing.assert_allclose(res.state_dict["fc2.bias"], small["fc2.bias"] + 0.5, atol=1e-12)


def test_choose_anchor():
    states = [_one_hidden(5, 0), _one_hidden(9, 1), _one_hidden(7, 2), _one_hidden(9, 3)]
    assert choose_anchor(states, SPEC1, "widest") == 1
    assert choose_anchor(states, SPEC1, "median") == 2
    assert choose_anchor(states, SPEC1, 3) == 3
    assert choose_anchor([_one_hidden(4, s) for s in range(3)], SPEC1, "widest") == 0


# --------------------------------------------------------------------------- failure modes


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(anchor=2), "anchor must be a client index in"),
        (dict(anchor="largest"), "anchor must be a non-negative integer or one of 'widest', 'median'"),
        (dict(reg=-1.0), "reg must be non-negative"),
        (dict(n_iter=0), "n_iter must be a positive integer"),
        (dict(weights=[1.0]), "one weight per client"),
        (dict(weights=[1.0, -1.0]), "non-negative"),
        (dict(weights=[0.0, 0.0]), "not all zero"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    states = [_one_hidden(5, 0), _one_hidden(5, 1)]
    with pytest.raises(ValueError, match=match):
        ot_fuse_layerwise(states, SPEC1, **kwargs)


def test_bad_inputs_raise_naming_the_client():
    good = _one_hidden(5, 0)
    three_classes = dict(_one_hidden(5, 1), **{"fc2.weight": np.ones((3, 5)), "fc2.bias": np.ones(3)})
    with pytest.raises(ValueError, match="b.pt has 3 classes"):
        ot_fuse_layerwise([good, three_classes], SPEC1, names=["a.pt", "b.pt"])
    nan = dict(good, **{"fc1.bias": np.full(5, np.nan)})
    with pytest.raises(ValueError, match="NaN"):
        ot_fuse_layerwise([good, nan], SPEC1)
    with pytest.raises(ValueError, match="at least one"):
        ot_fuse_layerwise([], SPEC1)


def test_importing_the_module_loads_no_torch():
    code = "import bayesfuse.inference.otfusion, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_a_stream_only_norms_write_is_aligned_by_its_embedding():
    """A language model's residual stream is written on its rows by norm weights alone, all 1 at
    initialisation: the embedding table (tokens x units), whose token axis no permutation moves,
    describes its units too, so a permuted copy fuses back (the norms alone tie every plan)."""
    import bayesfuse
    from bayesfuse.nets.graph_spec import spec_from_graph
    from tests.helpers import permuted_copy
    from tests.nets.user_nets import RotaryLM

    torch.manual_seed(0)
    model = RotaryLM().eval()
    assert all(float(p.min()) == 1.0 for p in model.parameters() if p.dim() == 1)  # the norms at 1
    permuted = permuted_copy(model, spec_from_graph(model), seed=1)
    x = torch.randint(0, 12, (3, 8))
    with torch.no_grad():
        fused = bayesfuse.fuse([model, permuted], "ot").model
        assert float((fused(x) - model(x)).abs().max()) < 1e-4
