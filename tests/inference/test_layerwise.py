"""Layer-wise matching of deep networks: recovery, invariances, batch-norm folding, missing units."""

import numpy as np
import pytest
import torch
from torch import nn

from bayesfuse import fuse
from bayesfuse.inference.layerwise import check_states, fold_batchnorm, match_layerwise, matched_average
from bayesfuse.inference.spec import chain, dense, permute, random_permutations
from bayesfuse.metrics import assignment_accuracy
from bayesfuse.models.bbp import simulate_deep_federation
from bayesfuse.nets.arch import LSTMClassifier, make_cnn, rebuild
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.spec import spec_from_module
from bayesfuse.nets.state import numpy_state as _np
from tests.helpers import randomise


def _shuffled_copies(model: nn.Module, x: torch.Tensor, n: int) -> list[nn.Module]:
    spec = spec_from_module(model, x[:2])
    sizes = spec.sizes(_np(model))
    copies = []
    for s in range(n):
        perms = random_permutations(sizes, np.random.default_rng(100 + s))
        copies.append(rebuild(model, permute(model.state_dict(), spec, perms)).eval())
    return copies


@pytest.mark.parametrize(
    "make, n_in",
    [
        (lambda: MLP(10, [9, 8, 7], 4), 10),
        (lambda: make_cnn(64, 5, channels=(6, 4), hidden=(7,)), 64),
        (lambda: LSTMClassifier(36, 3, hidden=8), 36),
    ],
)
@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_shuffled_copies_of_a_deep_net_fuse_back_to_its_function(make, n_in, method):
    model = randomise(make(), 0)
    x = torch.randn(32, n_in)
    copies = _shuffled_copies(model, x, 3)
    # A vague prior (variance 1e8) leaves each atom the plain average of its identical copies
    # (shrinkage J/(J + 1e-8)); batch norms are folded, which is exact in eval mode.
    res = fuse(copies, method, prior_var=1e8, noise_var=1.0)
    spec = spec_from_module(model, x[:2])
    assert res.sizes == list(spec.sizes(_np(model)).values())
    with torch.no_grad():
        torch.testing.assert_close(res.model(x), model(x), rtol=1e-4, atol=1e-4)


def test_batchnorm_folding_leaves_outputs_unchanged_in_eval_mode():
    model = randomise(make_cnn(64, 5, channels=(6, 4), hidden=(7,)), 1)
    x = torch.randn(16, 64)
    spec = spec_from_module(model, x[:2])
    folded = rebuild(model, {k: torch.as_tensor(v) for k, v in fold_batchnorm(_np(model), spec).items()}).eval()
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)
    bn = folded[2]
    assert torch.equal(bn.weight, torch.ones(6)) and torch.equal(bn.running_mean, torch.zeros(6))


@pytest.mark.parametrize("cost, noise_var", [("marginal", 0.01), ("pfnm", 1.0)])
def test_bottom_up_recovers_every_layer_of_a_simulated_deep_federation(cost, noise_var):
    fed = simulate_deep_federation(10, 100, 2, 10, gamma0=30.0, noise_var=0.01, seed=0)
    spec = MLP(1, [1, 1], 1).permutation_spec()
    # the simulation is the BBP model: a client's unit sees only its own inputs of the atom
    res = match_layerwise(
        fed.states,
        spec,
        cost=cost,
        noise_var=noise_var,
        prior_var=1.0,
        gamma0=30.0,
        bias_prior_mean=0.0,
        absent="unobserved",
    )
    for n, group in enumerate(spec.groups):
        true_atoms = fed.atoms[n].shape[0]
        acc = assignment_accuracy(fed.assignments[n], res.layers[group].assignments)
        assert acc >= 0.95, (group, acc, res.sizes[group], true_atoms)
        assert abs(res.sizes[group] - true_atoms) <= 0.05 * true_atoms


def test_tol_reaches_every_layer_and_zero_sweeps_to_the_fixed_point():
    # tol is passed to each group's matching; with 0 every group ends at a sweep that moves
    # nothing, and a larger one takes the same sweeps up to where it stops.
    fed = simulate_deep_federation(10, 40, 2, 10, gamma0=20.0, noise_var=0.05, seed=1)
    spec = MLP(1, [1, 1], 1).permutation_spec()
    runs = {
        tol: match_layerwise(fed.states, spec, tol=tol, absent="unobserved", bias_prior_mean=0.0) for tol in (0.0, 0.3)
    }
    for group in spec.groups:
        fixed, early = runs[0.0].layers[group], runs[0.3].layers[group]
        assert fixed.hyper["tol"] == 0.0 and early.hyper["tol"] == 0.3
        assert fixed.converged and not fixed.hyper["stopped"] and early.converged
        assert early.objective == fixed.objective[: len(early.objective)]


def test_top_down_describes_upper_units_by_few_numbers_and_merges_them():
    """PFNM Algorithm 1 matches the top layer on its 10 outgoing weights and bias only."""
    fed = simulate_deep_federation(10, 100, 2, 10, gamma0=30.0, noise_var=0.01, seed=0)
    spec = MLP(1, [1, 1], 1).permutation_spec()
    kw = dict(cost="pfnm", noise_var=1.0, prior_var=1.0, gamma0=30.0, bias_prior_mean=0.0, absent="unobserved")
    up = match_layerwise(fed.states, spec, direction="bottom-up", **kw)
    down = match_layerwise(fed.states, spec, direction="top-down", **kw)
    acc = lambda r: assignment_accuracy(fed.assignments[1], r.layers["P2"].assignments)  # noqa: E731
    assert down.order == ("P2", "P1")
    assert acc(down) < acc(up)


def test_absent_inputs_in_the_cost_and_in_the_global_weights():
    """Client 1 lacks lower unit 2: its upper units' weights from it are unobserved in the cost."""
    spec = chain(dense("a", None, "P"), dense("b", "P", "Q"), dense("c", "Q", None), output=("c.weight", "c.bias"))
    rng = np.random.default_rng(0)
    a_w, a_b = rng.normal(size=(3, 4)) * 3, rng.normal(size=3) * 3
    b_w, b_b = rng.normal(size=(2, 3)) * 3, rng.normal(size=2) * 3
    b_w[:, 2] *= 0.1  # small enough that reading client 1's absent weights as 0 still matches
    c_w, c_b = rng.normal(size=(2, 2)), rng.normal(size=2)
    full = {"a.weight": a_w, "a.bias": a_b, "b.weight": b_w, "b.bias": b_b, "c.weight": c_w, "c.bias": c_b}
    part = {
        "a.weight": a_w[:2],
        "a.bias": a_b[:2],
        "b.weight": b_w[:, :2] + 0.5,
        "b.bias": b_b,
        "c.weight": c_w,
        "c.bias": c_b,
    }
    res = match_layerwise([full, part], spec, prior_var=1e8, noise_var=1.0, bias_prior_mean=0.0, absent="unobserved")
    assert res.sizes == {"P": 3, "Q": 2}
    p_order = np.argsort(res.layers["P"].assignments[0])  # global P unit -> client 0's unit
    q_order = np.argsort(res.layers["Q"].assignments[0])
    got = res.state_dict["b.weight"][np.ix_(np.argsort(q_order), np.argsort(p_order))]
    # unit 2's column: only client 0 saw it; the others average the two clients
    np.testing.assert_allclose(got[:, 2], b_w[:, 2], rtol=1e-6)
    np.testing.assert_allclose(got[:, :2], b_w[:, :2] + 0.25, rtol=1e-6)
    # absent="zero" (the default): client 1's network has no weight from unit 2, i.e. 0, so
    # the merged units average b_w[:, 2] with 0 and their pre-activation is the clients' mean
    zero = match_layerwise([full, part], spec, prior_var=1e8, noise_var=1.0, bias_prior_mean=0.0)
    assert zero.sizes == {"P": 3, "Q": 2}  # the same units merge, under other labels
    p_order = np.argsort(zero.layers["P"].assignments[0])
    q_order = np.argsort(zero.layers["Q"].assignments[0])
    assert (zero.layers["Q"].assignments[1] == zero.layers["Q"].assignments[0]).all()
    got = zero.state_dict["b.weight"][np.ix_(np.argsort(q_order), np.argsort(p_order))]
    np.testing.assert_allclose(got[:, 2], b_w[:, 2] / 2, rtol=1e-6)
    np.testing.assert_allclose(got[:, :2], b_w[:, :2] + 0.25, rtol=1e-6)


def test_one_hidden_layer_is_the_same_in_both_directions():
    fed = simulate_deep_federation(4, 20, 1, 3, gamma0=5.0, noise_var=0.01, seed=3)
    spec = MLP(1, [1], 1).permutation_spec()
    up = match_layerwise(fed.states, spec, direction="bottom-up")
    down = match_layerwise(fed.states, spec, direction="top-down")
    for k in up.state_dict:
        np.testing.assert_array_equal(up.state_dict[k], down.state_dict[k])


def test_mismatched_architectures_are_named():
    a = _np(MLP(6, [5, 4], 3))
    b = _np(make_cnn(36, 3, channels=(2,), hidden=(4,)))
    spec = MLP(6, [5, 4], 3).permutation_spec()
    with pytest.raises(ValueError, match="client 1 lacks entries"):
        match_layerwise([a, b], spec)
    nan = dict(a, **{"layers.1.weight": np.full((4, 5), np.nan)})
    with pytest.raises(ValueError, match=r"client 1\['layers.1.weight'\].*NaN"):
        match_layerwise([a, nan], spec)


# --------------------------------------------------------------------------- calibration, estimators, NAFI scaling


def _logits_without_bias(state: dict, spec, x: np.ndarray) -> np.ndarray:
    """Forward pass of a dense ReLU chain (entries P-ordered), output bias left out."""
    h = x
    weights = [k for k in state if k.endswith("weight")]
    for i, k in enumerate(weights):
        h = h @ np.asarray(state[k]).T
        if i < len(weights) - 1:
            h = np.maximum(h + np.asarray(state[k[:-6] + "bias"]), 0.0)
    return h


def test_average_outputs_makes_unmatched_units_average_the_clients_logits():
    # Three unrelated networks and a tiny noise variance: no unit merges, so each global unit is
    # one client's unit; with m_g / J scaling (and the matched average, no prior shrinkage) the
    # fused logits are exactly the mean of the clients' logits; without it, their sum.
    nets = [randomise(MLP(6, [5], 3), s) for s in range(3)]
    spec = spec_from_module(nets[0])
    states = [_np(m) for m in nets]
    x = np.random.default_rng(0).normal(size=(20, 6))
    local = np.stack([_logits_without_bias(sd, spec, x) for sd in states])
    hyper = dict(noise_var=1e-10, prior_var=10.0, gamma0=1.0, global_weights="average")
    fused = match_layerwise(states, spec, average_outputs=True, **hyper)
    assert fused.sizes["P1"] == 15
    np.testing.assert_allclose(_logits_without_bias(fused.state_dict, spec, x), local.mean(0), rtol=1e-10, atol=1e-12)
    summed = match_layerwise(states, spec, average_outputs=False, **hyper)
    np.testing.assert_allclose(_logits_without_bias(summed.state_dict, spec, x), local.sum(0), rtol=1e-10, atol=1e-12)


def test_average_outputs_leaves_fully_merged_units_alone():
    # Permuted copies merge completely (m_g = J): scaling by m_g / J changes nothing.
    model = randomise(MLP(10, [9, 8], 4), 1)
    copies = _shuffled_copies(model, torch.randn(4, 10), 3)
    spec = spec_from_module(model)
    states = [_np(m) for m in copies]
    hyper = dict(noise_var=1.0, prior_var=1e8, gamma0=1.0)
    on = match_layerwise(states, spec, average_outputs=True, **hyper).state_dict
    off = match_layerwise(states, spec, average_outputs=False, **hyper).state_dict
    for k in on:
        np.testing.assert_array_equal(on[k], off[k])


def test_matched_average_is_the_plain_mean_of_matched_units():
    model = randomise(MLP(10, [9, 8], 4), 2)
    copies = _shuffled_copies(model, torch.randn(4, 10), 3)
    spec = spec_from_module(model)
    res = match_layerwise(
        [_np(m) for m in copies], spec, noise_var=1.0, prior_var=0.5, gamma0=1.0, global_weights="average"
    )
    ref = _np(model)
    # identical copies: the average is the original whatever the prior (the posterior mean would shrink it)
    for k in ("layers.0.weight", "layers.0.bias", "layers.1.weight"):
        got = res.state_dict[k]
        assert sorted(np.round(got.ravel(), 10)) == sorted(np.round(np.asarray(ref[k], float).ravel(), 10))


def test_nafi_penalty_is_per_coordinate():
    # match_group hands match_neurons kl_weight / D: the same rows matched directly with that
    # weight give the same assignments.
    from bayesfuse.inference.layerwise import match_group
    from bayesfuse.inference.matching import match_neurons

    fed = simulate_deep_federation(4, 12, 1, 3, gamma0=3.0, noise_var=0.05, seed=3)
    spec = chain(
        dense("layers.0", None, "P1"), dense("layers.1", "P1", None), output=["layers.1.weight", "layers.1.bias"]
    )
    result, _ = match_group(
        fed.states,
        spec,
        "P1",
        {},
        noise_var=0.05,
        prior_var=1.0,
        gamma0=3.0,
        kl_weight=5.0,
        bias_prior_mean=0.0,
        seed=0,
    )
    rows = [
        np.hstack([sd["layers.0.weight"], sd["layers.0.bias"][:, None], sd["layers.1.weight"].T]) for sd in fed.states
    ]
    D = rows[0].shape[1]
    direct = match_neurons(rows, noise_var=0.05, prior_var=1.0, gamma0=3.0, kl_weight=5.0 / D, seed=0)
    assert [a.tolist() for a in result.assignments] == [a.tolist() for a in direct.assignments]


@pytest.mark.catalogue
def test_a_numeric_noise_var_beside_auto_keys_is_the_noise_variance():
    # With any key "auto", match_group hands match_neurons relative precisions; a numeric
    # noise_var must then be the variance itself (not also folded into the precisions, which
    # matched at noise_var squared): the same rows matched directly agree in value and result.
    from bayesfuse.inference.layerwise import match_group
    from bayesfuse.inference.matching import match_neurons

    fed = simulate_deep_federation(4, 12, 1, 3, gamma0=3.0, noise_var=0.05, seed=3)
    spec = chain(
        dense("layers.0", None, "P1"), dense("layers.1", "P1", None), output=["layers.1.weight", "layers.1.bias"]
    )
    result, _ = match_group(
        fed.states, spec, "P1", {}, noise_var=0.05, prior_var="auto", gamma0="auto", bias_prior_mean=0.0, seed=0
    )
    rows = [
        np.hstack([sd["layers.0.weight"], sd["layers.0.bias"][:, None], sd["layers.1.weight"].T]) for sd in fed.states
    ]
    d_in, k = fed.states[0]["layers.0.weight"].shape[1], fed.states[0]["layers.1.weight"].shape[0]
    blocks = np.repeat([0, 1, 2], [d_in, 1, k])
    direct = match_neurons(rows, noise_var=0.05, prior_var="auto", gamma0="auto", blocks=blocks, seed=0)
    assert [a.tolist() for a in result.assignments] == [a.tolist() for a in direct.assignments]
    np.testing.assert_allclose(result.objective[-1], direct.objective[-1], rtol=1e-10)


# --------------------------------------------------------------------------- batch-norm eps, weight dtypes


@pytest.mark.parametrize("eps", [1e-5, 1e-2, 0.3])
def test_batch_norms_fold_with_their_own_eps(eps):
    # Folding divides by sqrt(running_var + eps): with the layer's own eps, permuted copies of a
    # ConvNet fuse back to its function whatever eps is (a fixed 1e-5 was off by up to 333 at 1e-2).
    model = make_cnn(64, 5, channels=(6, 4), hidden=(7,))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eps = eps
    model = randomise(model, 4)
    x = torch.randn(16, 64)
    copies = _shuffled_copies(model, x, 3)
    spec = spec_from_module(model, x[:2])
    assert all(spec.batchnorm_eps(bn) == eps for bn in spec.folds)
    fused = match_layerwise(
        [_np(m) for m in copies], spec, noise_var=1.0, prior_var=1e8, gamma0=1.0, global_weights="average"
    )
    net = rebuild(model, {k: torch.as_tensor(v) for k, v in fused.state_dict.items()}).eval()
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-5)


def test_weights_that_are_not_real_floats_are_refused():
    spec = chain(dense("a", None, "P"), dense("b", "P", None), output=("b.weight", "b.bias"))
    good = {"a.weight": np.ones((3, 2)), "a.bias": np.zeros(3), "b.weight": np.ones((2, 3)), "b.bias": np.zeros(2)}
    for bad in (good["a.weight"].astype(np.int64), good["a.weight"].astype(np.complex128)):
        with pytest.raises(ValueError, match=r"client 1\['a.weight'\] holds .* weights must be real floating point"):
            match_layerwise([good, dict(good, **{"a.weight": bad})], spec)
    from bayesfuse.core import fuse_states

    with pytest.raises(ValueError, match="weights must be real floating point"):
        fuse_states([good, dict(good, **{"a.weight": good["a.weight"].astype(np.int64)})], "fedavg", spec=spec)


def test_a_negative_running_variance_is_refused():
    model = randomise(make_cnn(64, 5, channels=(3,), hidden=(4,)), 5)
    spec = spec_from_module(model, torch.randn(2, 64))
    state = _np(model)
    bn = next(iter(spec.folds))
    state[f"{bn}.running_var"] = -np.abs(state[f"{bn}.running_var"])
    with pytest.raises(ValueError, match="negative running_var"):
        match_layerwise([state, _np(model)], spec)


# --------------------------------------------------------------------------- memory: no float64 copies, sums by blocks


@pytest.mark.parametrize("max_elements", [1, 5, 64, 1 << 22])
def test_matched_average_by_blocks_of_coordinates_is_the_average_in_one_pass(max_elements):
    rng = np.random.default_rng(0)
    J, D, G = 4, 13, 6
    rows = [rng.normal(size=(n, D)) for n in (3, 5, 2, 4)]
    assignments = [rng.permutation(G)[: len(r)] for r in rows]
    full = rng.uniform(0.1, 2.0, size=(J, D))
    full[1, :4] = 0.0  # client 1 observes nothing there
    full[:, 7] = 0.0  # nobody observes coordinate 7
    for precision in (full, rng.uniform(0.1, 2.0, size=(J, 1))):
        num, den = np.zeros((G, D)), np.zeros((G, D))
        for j, a in enumerate(assignments):
            w = np.broadcast_to(precision[j], (D,))
            num[a] += w * rows[j]
            den[a] += w
        expected = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
        got = matched_average(rows, precision, assignments, G, max_elements=max_elements)
        np.testing.assert_array_equal(got, expected)


def test_float32_networks_are_read_as_they_are_and_fold_to_the_same_values():
    model = randomise(make_cnn(64, 5, channels=(6, 4), hidden=(7,)), 6)
    spec = spec_from_module(model, torch.randn(2, 64))
    state = _np(model)  # float32 views of the tensors
    before = {k: v.copy() for k, v in state.items()}
    (read,) = check_states([state], spec, as_float64=False)
    assert all(read[k] is state[k] for k in state)  # no copies
    (copied,) = check_states([state], spec)
    assert all(copied[k].dtype == np.float64 for k in state if state[k].dtype.kind == "f")
    lean, full = fold_batchnorm(read, spec, copy=False), fold_batchnorm(copied, spec)
    for k in state:
        np.testing.assert_array_equal(lean[k], full[k])
        assert np.array_equal(state[k], before[k])  # the given arrays are left alone
    touched = {f"{layer}.{p}" for layer in spec.folds.values() for p in ("weight", "bias")}
    touched |= {f"{bn}.{p}" for bn in spec.folds for p in ("weight", "bias", "running_mean", "running_var")}
    assert all(lean[k].dtype == np.float64 for k in touched)
    assert all(lean[k] is state[k] for k in state if k not in touched)
    key = next(k for k in state if state[k].ndim == 4)  # the first convolution's weight
    infinite = state[key].copy()
    infinite.flat[0] = np.inf
    bad = dict(state, **{key: infinite})
    with pytest.raises(ValueError, match=rf"client 0\['{key}'\] contains NaN or infinite values"):
        check_states([bad], spec, as_float64=False)


def test_float32_clients_fuse_as_their_float64_copies():
    # match_layerwise reads float32 entries where it uses them; float32 -> float64 is exact, so the
    # result is the one of float64 copies, bit for bit
    model = randomise(make_cnn(64, 5, channels=(6, 4), hidden=(7,)), 7)
    x = torch.randn(16, 64)
    spec = spec_from_module(model, x[:2])
    rng = np.random.default_rng(3)
    states = []
    for s in range(3):
        perms = random_permutations(spec.sizes(_np(model)), np.random.default_rng(200 + s))
        states.append(
            {
                k: (v + 0.05 * rng.normal(size=v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v
                for k, v in permute(_np(model), spec, perms).items()
            }
        )
    assert all(v.dtype == np.float32 for sd in states for v in sd.values() if v.dtype.kind == "f")
    as64 = [{k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in sd.items()} for sd in states]
    for options in (dict(), dict(global_weights="posterior"), dict(absent="unobserved")):
        a = match_layerwise(states, spec, **options)
        b = match_layerwise(as64, spec, **options)
        assert a.sizes == b.sizes
        for k in b.state_dict:
            assert a.state_dict[k].dtype == b.state_dict[k].dtype
            np.testing.assert_array_equal(a.state_dict[k], b.state_dict[k])


def test_units_held_in_float32_fuse_as_units_held_in_float64(monkeypatch):
    # match_group holds a client's units in float32 where that is exact (a float32 network's weights,
    # permuted and padded with zeros: half a wide layer's memory); the matching widens them where
    # it computes, so the fusion must be the one of float64 units, bit for bit. Batch-normed layers
    # fold to float64 values that float32 does not hold: those stay float64.
    from bayesfuse.inference import layerwise

    held = []
    narrowed = layerwise._narrowed
    monkeypatch.setattr(layerwise, "_narrowed", lambda r: held.append(narrowed(r).dtype) or narrowed(r))
    model = randomise(make_cnn(64, 5, channels=(6, 4), hidden=(7,)), 8)
    x = torch.randn(16, 64)
    copies = _shuffled_copies(model, x, 3)
    states = [_np(m) for m in copies]
    for sd in states:  # noisy copies, in float32
        for k, v in sd.items():
            if v.dtype.kind == "f" and v.ndim > 1:
                v += np.random.default_rng(len(k)).normal(scale=0.05, size=v.shape).astype(np.float32)
    spec = spec_from_module(model, x[:2])
    for options in (dict(), dict(global_weights="posterior")):
        held.clear()
        narrow = match_layerwise(states, spec, **options)
        assert np.float32 in held and np.float64 in held  # the dense layer narrowed, the folded convolutions not
        monkeypatch.setattr(layerwise, "_narrowed", lambda r: r)
        wide = match_layerwise(states, spec, **options)
        monkeypatch.setattr(layerwise, "_narrowed", lambda r: held.append(narrowed(r).dtype) or narrowed(r))
        assert narrow.sizes == wide.sizes
        for k in wide.state_dict:
            np.testing.assert_array_equal(narrow.state_dict[k], wide.state_dict[k])
        for g in spec.groups:
            np.testing.assert_array_equal(narrow.layers[g].mean, wide.layers[g].mean)
            assert narrow.layers[g].objective == wide.layers[g].objective


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(class_counts="drawn"),
        dict(absent="unobserved"),
        dict(noise_var=0.05, prior_var=1.0, gamma0=1.0),
        dict(noise_var=1e8, prior_var=1.0, gamma0=1.0),  # the prior dominates: the share must not cancel
    ],
    ids=lambda o: "-".join(o) or "auto",
)
def test_means_read_off_the_average_are_the_posterior_means(options):
    # Fused by the matched average, a layer's posterior means are computed from that average when
    # read (no (G, D) array of their own); they must be the matching's h / lambda, which the
    # posterior mode returns, to rounding (1e-12: a formula that cancels where the prior dominates
    # is off by 1e-8 in the last case).
    from bayesfuse.inference.lazy import LazyRows

    model = randomise(MLP(12, [9, 7], 4), 9)
    x = torch.randn(16, 12)
    states = [_np(m) for m in _shuffled_copies(model, x, 3)]
    rng = np.random.default_rng(1)
    for sd in states:
        for v in sd.values():
            v += rng.normal(scale=0.1, size=v.shape).astype(v.dtype)
    options = dict(options)
    if options.get("class_counts") == "drawn":
        options["class_counts"] = rng.integers(0, 30, size=(3, 4))
    spec = spec_from_module(model, x[:2])
    lazy = match_layerwise(states, spec, global_weights="average", **options)
    dense = match_layerwise(states, spec, global_weights="posterior", **options)
    for g in spec.groups:
        got, want = lazy.layers[g].mean, dense.layers[g].mean
        assert isinstance(got, LazyRows) and isinstance(want, np.ndarray)
        for a, b in zip(lazy.layers[g].assignments, dense.layers[g].assignments):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-15 * np.abs(want).max())
