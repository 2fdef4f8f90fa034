import copy
import io
import sys
import warnings

import numpy as np
import pytest
import torch

from bayesfuse import fedavg, fuse, summarize
from bayesfuse.data import dirichlet_partition
from bayesfuse.metrics import evaluate
from bayesfuse.nets import MLP, predict_proba
from bayesfuse.nets.graph_spec import UnsupportedLayerError
from bayesfuse.nets.state import numpy_state
from bayesfuse.train import TrainConfig, train_clients
from tests.helpers import DEVICES, mlp_from_neurons, one_hidden_layer, randomise

# Single-model cases are part of these tests; the warning they raise is expected.
pytestmark = pytest.mark.filterwarnings("ignore:only one model")


def _shuffled(model: MLP, seed: int) -> MLP:
    """The same function with its hidden units in another order."""
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(model.layers[0].out_features))
    out = copy.deepcopy(model)
    with torch.no_grad():
        out.layers[0].weight.copy_(model.layers[0].weight[perm])
        out.layers[0].bias.copy_(model.layers[0].bias[perm])
        out.layers[1].weight.copy_(model.layers[1].weight[:, perm])
    return out


def _net(seed=0, d=6, hidden=5, k=3):
    torch.manual_seed(seed)
    model = MLP(d, [hidden], k)
    with torch.no_grad():  # spread the units apart so that they are distinguishable
        for p in model.parameters():
            p.normal_(0, 1.0)
    return model


def test_neurons_round_trip():
    model = _net()
    part = one_hidden_layer(model)
    assert part.neurons.shape == (5, 6 + 1 + 3)
    back = mlp_from_neurons(part.neurons, part.out_bias, part.in_features)
    x = torch.randn(10, 6)
    torch.testing.assert_close(back(x), model(x))


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_shuffled_copies_fuse_back_to_the_network(method):
    model = _net()
    copies = [_shuffled(model, s) for s in range(4)]
    # A vague prior (variance 1e4) makes the posterior mean the plain average of the copies:
    # each weight is shrunk by the factor J/(J + sigma^2/sigma0^2) = 1 - 2.5e-5.
    res = fuse(copies, method, prior_var=1e4, noise_var=1.0)
    assert res.sizes == [5]
    x = torch.randn(50, 6)
    torch.testing.assert_close(res.model(x), model(x), rtol=1e-3, atol=1e-3)


def test_fused_weights_are_the_gaussian_posterior_mean():
    # Identical copies, PFNM's settings (prior N(mu0, 10), noise 1): theta = (mu0/10 + J v) / (1/10 + J).
    model = _net(1)
    J = 3
    res = fuse([_shuffled(model, s) for s in range(J)], "pfnm", noise_var=1.0, prior_var=10.0, gamma0=1.0)
    part = one_hidden_layer(model)
    mu0 = np.zeros(part.neurons.shape[1])
    mu0[6] = 0.1
    expected = (mu0 / 10 + J * part.neurons) / (1 / 10 + J)
    got = one_hidden_layer(res.model).neurons
    key = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731  (compare as sets of rows)
    np.testing.assert_allclose(key(got), key(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one_hidden_layer(res.model).out_bias, J * part.out_bias / (1 / 10 + J), rtol=1e-6)


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
def test_single_model_fuses_to_itself(method):
    """At the defaults too: with one client, empirical Bayes cannot tell the prior from the noise
    (it halved the weights), so the prior left to it is vague (ONE_NETWORK); a given one is kept."""
    model = _net(2)
    x = torch.randn(20, 6)
    for hyper in ({}, {"prior_var": 1e6} if method != "ot" else {}):
        res = fuse([model], method, **hyper)
        torch.testing.assert_close(res.model(x), model(x), rtol=1e-4, atol=1e-4)
    if method == "pfnm":  # a prior given is the caller's: the weights are shrunk by it
        small = fuse([model], method, prior_var=0.01, noise_var=1.0).model
        assert float((small(x) - model(x)).abs().max()) > 1e-2


def test_class_counts_weight_the_outgoing_weights():
    # A client that never saw class 2 has no say on the weights into class 2.
    a, b = _net(3), _net(3)
    with torch.no_grad():
        b.layers[1].weight[2] += 5.0
        b.layers[1].bias[2] += 5.0
    counts = np.array([[10, 10, 10], [10, 10, 0]])
    res = fuse([a, b], "pfnm", class_counts=counts, prior_var=1e6)
    # The units differ only where b has precision 0, so they match one to one ...
    assert res.sizes == [5]
    # ... and the fused network is a's: b's changes to class 2 carry no weight.
    x = torch.randn(30, 6)
    torch.testing.assert_close(res.model(x), a(x), rtol=1e-4, atol=1e-4)


def test_fusion_beats_fedavg_on_heterogeneous_digits():
    from bayesfuse import fedavg
    from bayesfuse.data import load_digits
    from bayesfuse.metrics import accuracy

    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, 5, 0.5, seed=0)
    models = train_clients(split.train, part, TrainConfig(hidden=(50,), epochs=5), shared_init=False, verbose=False)
    acc = lambda m: accuracy(predict_proba(m, split.test.x), split.test.y)  # noqa: E731
    local = np.mean([acc(m) for m in models])
    fused = acc(fuse(models, "pfnm", class_counts=part.counts).model)
    averaged = acc(fedavg(models, part.sizes))
    assert fused > averaged and fused > local


def test_bad_inputs():
    with pytest.raises(ValueError, match="method"):
        fuse([_net()], "bogus")
    with pytest.raises(ValueError, match=r"data=\(train, partition\)"):
        fuse([_net(), _net(1)], "fedma")
    # the clients are fused in their canonical order (bayesfuse.client_order): either may be the one compared with
    with pytest.raises(ValueError, match="client [01] has [34] classes in 'layers.1.weight', client [01] has [34]"):
        fuse([_net(), _net(d=6, k=4)])
    with pytest.raises(
        ValueError,
        match=r"client [01]\['layers.0.weight'\] has shape \(5, [67]\).*differ beyond hidden "
        "widths",
    ):
        fuse([_net(), MLP(7, [5], 3)])
    with pytest.raises(ValueError, match="no hidden units"):
        fuse([MLP(6, [], 3)])
    with pytest.raises(ValueError, match="class_counts"):
        fuse([_net(), _net(1)], class_counts=np.ones((3, 3)))
    with pytest.raises(ValueError, match="nafi"):
        fuse([_net()], "pfnm", kl_weight=0.1)
    broken = _net()
    with torch.no_grad():
        broken.layers[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fuse([_net(), broken])


@pytest.fixture(scope="module")
def digits_federation(digits):
    part = dirichlet_partition(digits.train.y, 5, 0.5, seed=0)
    models = train_clients(
        digits.train, part, TrainConfig(hidden=(50,), epochs=5, seed=0), shared_init=False, verbose=False
    )
    return digits, part, models


@pytest.mark.parametrize("global_weights", ["posterior", "average"])
def test_each_output_calibration_on_a_real_split(digits_federation, global_weights):
    # Every choice fuses into a network better than the clients and than one-shot FedAvg. Their
    # confidence orders as their construction says: scaling the outgoing weights of global
    # units merged from m_g < J clients by m_g / J shrinks logits, so average_outputs=True
    # predicts with more entropy; the posterior mean shrinks weights towards the prior, the
    # matched average does not, so "average" is the more confident. (On this 5-client split
    # the less confident choices are under-confident: see bench_fidelity.py for Fashion-MNIST,
    # where averaging the outputs is what brings the NLL down.)
    split, part, models = digits_federation
    x, y = split.test.x, split.test.y
    local = max(evaluate(predict_proba(m, x), y)["accuracy"] for m in models)
    averaged = evaluate(predict_proba(fedavg(models, part.sizes), x), y)["accuracy"]
    scores = {}
    for outputs in (True, False):
        res = fuse(models, "pfnm", class_counts=part.counts, global_weights=global_weights, average_outputs=outputs)
        scores[outputs] = evaluate(predict_proba(res.model, x), y)
        assert res.hyper["average_outputs"] is outputs and res.hyper["global_weights"] == global_weights
        assert scores[outputs]["accuracy"] > max(local, averaged)
    assert scores[True]["entropy"] > scores[False]["entropy"]


def test_the_matched_average_is_more_confident_than_the_posterior_mean(digits_federation):
    split, part, models = digits_federation
    entropy = {
        gw: evaluate(
            predict_proba(fuse(models, "pfnm", class_counts=part.counts, global_weights=gw).model, split.test.x),
            split.test.y,
        )["entropy"]
        for gw in ("posterior", "average")
    }
    assert entropy["average"] < entropy["posterior"]


# --------------------------------------------------------------------------- position-aware neurons


def _pan_mlp(mode, seed=0):
    from bayesfuse.nets.pans import PANConfig

    return randomise(MLP(8, [12, 10], 4, pan=PANConfig(mode, 1.0, 0.1)), seed)


def _pan_cnn(mode, seed=0):
    from bayesfuse.nets.arch import make_cnn
    from bayesfuse.nets.pans import PANConfig

    return randomise(make_cnn(64, 4, channels=(6, 5), hidden=(7,), pan=PANConfig(mode, 1.0, 0.1)), seed)


def _same_function_at_other_positions(model, n_clients, seed=0):
    """Clients computing ``model``'s function with their units (and so their encodings) in other
    positions: fold the encodings at the model's positions, permute, unfold at the new ones."""
    from bayesfuse.inference.encodings import fold_encodings, unfold_encodings
    from bayesfuse.inference.spec import permute, random_permutations
    from bayesfuse.nets.arch import rebuild
    from bayesfuse.nets.spec import spec_from_module

    spec = spec_from_module(model)
    plain = fold_encodings(numpy_state(model), spec)
    rng = np.random.default_rng(seed)
    states = [
        unfold_encodings(permute(plain, spec, random_permutations(spec.sizes(plain), rng)), spec)
        for _ in range(n_clients)
    ]
    return [rebuild(model, {k: torch.as_tensor(v) for k, v in sd.items()}).eval() for sd in states]


#: vague prior: the posterior mean of identical units is the unit (shrunk by 1e-8 / J)
_VAGUE = {"pfnm": dict(prior_var=1e8, noise_var=1.0), "nafi": dict(prior_var=1e8, noise_var=1.0), "ot": {}}


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
@pytest.mark.parametrize("mode", ["mul", "add"])
def test_identical_pan_copies_fuse_back_to_the_network(float64, mode, method):
    """Matching keeps identical copies' units where they are; folding and unfolding must too."""
    model = _pan_mlp(mode)
    res = fuse([copy.deepcopy(model) for _ in range(3)], method, **_VAGUE[method])
    assert res.sizes == [12, 10]
    x = torch.randn(50, 8)
    torch.testing.assert_close(res.model(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.catalogue
@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
@pytest.mark.parametrize("mode", ["mul", "add"])
def test_pan_networks_with_units_at_other_positions_fuse_back_to_their_function(float64, mode, method):
    """Matching moves units to new positions: their encodings must not come along."""
    model = _pan_mlp(mode)
    clients = _same_function_at_other_positions(model, 3)
    x = torch.randn(50, 8)
    for c in clients:  # one function, three PAN networks
        torch.testing.assert_close(c(x), model(x), rtol=1e-10, atol=1e-10)
    res = fuse(clients, method, **_VAGUE[method])
    assert res.sizes == [12, 10]
    torch.testing.assert_close(res.model(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.catalogue
@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
@pytest.mark.parametrize("mode", ["mul", "add"])
def test_pan_convnets_with_batch_norm_fuse_back_to_their_function(float64, mode, method):
    """Conv -> BatchNorm -> PAN: the encodings act on the batch norms' outputs."""
    model = _pan_cnn(mode)
    clients = [copy.deepcopy(model), *_same_function_at_other_positions(model, 2, seed=1)]
    res = fuse(clients, method, **_VAGUE[method])
    assert res.sizes == [6, 5, 7]
    x = torch.randn(30, 64)
    torch.testing.assert_close(res.model(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.catalogue
def test_pan_fusion_through_a_spec_file_keeps_the_function(float64):
    """``bayesfuse fuse --spec``: a JSON spec carries the encodings to the core."""
    import json

    from bayesfuse.core import fuse_states
    from bayesfuse.inference.spec import spec_from_dict, spec_to_dict
    from bayesfuse.nets.arch import rebuild
    from bayesfuse.nets.spec import spec_from_module

    model = _pan_cnn("mul")
    clients = _same_function_at_other_positions(model, 3)
    spec = spec_from_dict(json.loads(json.dumps(spec_to_dict(spec_from_module(model)))))
    fused = fuse_states([numpy_state(c) for c in clients], "pfnm", spec=spec, **_VAGUE["pfnm"])
    net = rebuild(model, {k: torch.as_tensor(v) for k, v in fused.state.items()}).eval()
    x = torch.randn(30, 64)
    torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.catalogue
@pytest.mark.parametrize("mode, passes", [("mul", 1), ("add", 1), ("mul", 2)])
def test_fedma_on_pan_networks_keeps_their_function(digits, mode, passes):
    """FedMA's clients retrain PAN networks at the global widths (and, with communication, at their
    own widths cut out of the global network): with a vanishing learning rate the layers handed
    back and forth must keep the function."""
    from bayesfuse.nets.pans import PANConfig

    model = randomise(MLP(digits.n_features, [12, 10], digits.n_classes, pan=PANConfig(mode, 1.0, 0.1)), 0)
    clients = _same_function_at_other_positions(model, 3)
    part = dirichlet_partition(digits.train.y, 3, 0.5, seed=0)
    res = fuse(
        clients,
        "fedma",
        data=(digits.train, part),
        retrain=TrainConfig(hidden=(12, 10), epochs=1, lr=1e-12),
        prior_var=1e8,
        noise_var=1.0,
        passes=passes,
    )
    assert res.sizes == [12, 10]
    x = torch.as_tensor(digits.test.x[:100])
    torch.testing.assert_close(res.model(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.catalogue
def test_pan_fusion_refuses_what_it_cannot_do():
    from dataclasses import replace

    from bayesfuse.nets.pans import PANConfig
    from bayesfuse.nets.spec import spec_from_module

    big = randomise(MLP(8, [12], 4, pan=PANConfig("mul", 1.0, 1.0)), 0)  # e_j = 1 + sin(...) has zeros
    with pytest.raises(ValueError, match="amplitude A=1.0 >= 1"):
        fuse([big, copy.deepcopy(big)], "pfnm")
    fuse([big, copy.deepcopy(big)], "fedavg")  # position-aligned averaging needs no unfolding
    model = _pan_mlp("add")
    with pytest.raises(ValueError, match="records no encodings"):
        fuse([model, copy.deepcopy(model)], "pfnm", spec=replace(spec_from_module(model), encodings={}))


def test_fedavg_on_pan_networks_averages_coordinate_wise():
    """Position-aligned averaging is what PANs are for: FedAvg leaves the encodings alone."""
    models = [_pan_mlp("mul", seed=s) for s in range(3)]
    res = fuse(models, "fedavg")
    for k, v in res.model.state_dict().items():
        torch.testing.assert_close(v, torch.stack([m.state_dict()[k] for m in models]).mean(0))


# --------------------------------------------------------------------------- where the matching runs

U32 = 2.0**-24  # unit round-off of float32


def _gamma32(n: int) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)`` for float32: the relative error bound of n roundings."""
    return n * U32 / (1 - n * U32)


def _same_assignments(a, b):
    assert a.sizes == b.sizes
    for x, y in zip(a.layers, b.layers):
        for p, q in zip(x.assignments, y.assignments):
            np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "method, hyper", [("pfnm", {}), ("nafi", {}), ("pfnm", dict(noise_var=1.0, prior_var=10.0, gamma0=1.0))]
)
def test_float64_on_a_torch_device_fuses_as_on_the_host(digits_federation, method, hyper, device):
    _, part, models = digits_federation
    host = fuse(models, method, class_counts=part.counts, **hyper)
    dev = fuse(models, method, class_counts=part.counts, device=device, **hyper)
    _same_assignments(host, dev)
    (mean, var), (want_mean, want_var) = dev.posteriors[0], host.posteriors[0]
    assert isinstance(mean, np.ndarray) and mean.dtype == np.float64 and isinstance(var, np.ndarray)
    # The same float64 operations in torch's kernels: round-off only.
    np.testing.assert_allclose(mean, want_mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(var, want_var, rtol=1e-12)
    # The fused module holds float32 weights: values that agree to round-off round to the same
    # float32 or to neighbours, one float32 ulp (<= 2^-23 of the value) apart.
    want_state = host.model.state_dict()
    for k, v in dev.model.state_dict().items():
        torch.testing.assert_close(v, want_state[k], rtol=2.0**-22, atol=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_float32_on_a_torch_device_fuses_within_float32_round_off(digits_federation, device):
    _, part, models = digits_federation
    host = fuse(models, "pfnm", class_counts=part.counts)
    dev = fuse(models, "pfnm", class_counts=part.counts, device=device, dtype="float32")
    # The assignments agree: a float32 cost is off by about D u (D = 75 here) of its terms'
    # magnitudes, far below the gaps between the options of these units.
    _same_assignments(host, dev)
    # With the same assignments and hyper-parameters (empirical Bayes runs on the host from the
    # float32 weights, exact in float64), an atom's mean is h_id / lambda_id with
    # h_id = h0_d + sum_{(j,l) -> i} p_jd v_jld: one rounding per product, at most J + 1 for the
    # sum (or one for h computed on the host and put on the device), one for lambda and one for
    # the division, so |mean32 - mean64| <= gamma_{J+4} (|h0_d| + sum p_jd |v_jld|) / lambda_id.
    # That ratio is a weighted average of |mu0_d| (prior weight lambda0) and the members' |v_jld|
    # (weights p_jd), so at most M = max(|mu0|, |every client weight|); twice that bound is used.
    J = len(models)
    M = max(0.1, max(float(p.detach().abs().max()) for m in models for p in m.parameters()))
    bound = 2 * _gamma32(J + 4) * M
    (mean, var), (want_mean, want_var) = dev.posteriors[0], host.posteriors[0]
    assert mean.dtype == np.float64  # a float64 host copy of the float32 result
    assert np.max(np.abs(mean - want_mean)) <= bound
    assert np.max(np.abs(mean - want_mean)) > 0  # the matching did run in float32
    np.testing.assert_allclose(var, want_var, rtol=2 * _gamma32(2), atol=0.0)  # 1 / lambda: lambda rounded, divided
    # The module's weights: the means (outgoing weights scaled by m_g / J <= 1), rounded to float32.
    want_state = host.model.state_dict()
    for k, v in dev.model.state_dict().items():
        torch.testing.assert_close(v, want_state[k], rtol=2.0**-22, atol=bound)


def test_a_device_is_refused_where_it_cannot_serve_before_any_work(monkeypatch):
    nets = [_net(0), _net(1)]

    def started(*args, **kwargs):
        raise AssertionError("the fusion started")

    monkeypatch.setattr("bayesfuse.fusion.fuse_states", started)
    for method in ("fedavg", "ot", "fedma"):
        with pytest.raises(
            ValueError,
            match=f"device='cpu': method '{method}' runs on the host only; a device "
            "runs the matching of pfnm and nafi on point-estimate networks",
        ):
            fuse(nets, method, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA
    with pytest.raises(
        ValueError,
        match=r"device 'cuda': no CUDA device is available to this torch .* use "
        r"device='cpu', or no device for NumPy",
    ):
        fuse(nets, "pfnm", device="cuda")
    with pytest.raises(ValueError, match="device 'gpu' is not a torch device"):
        fuse(nets, "nafi", device="gpu")
    with pytest.raises(ValueError, match="device 'meta' holds no values"):
        fuse(nets, "pfnm", device="meta")
    with pytest.raises(ValueError, match="dtype='float32' is for the torch path: give a device too"):
        fuse(nets, "pfnm", dtype="float32")
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'float64', got 'float16'"):
        fuse(nets, "pfnm", device="cpu", dtype="float16")


def test_a_method_name_in_any_case_fuses_as_the_table_s_name():
    torch.manual_seed(0)
    nets = [MLP(6, [5], 3) for _ in range(2)]
    lower, upper = fuse(nets, "nafi", seed=1), fuse(nets, " NAFI ", seed=1)
    assert upper.method == lower.method == "nafi" and upper.hyper == lower.hyper
    x = torch.randn(4, 6)
    assert torch.equal(upper.model(x), lower.model(x))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_show_on_a_terminal_and_not_in_logs(monkeypatch):
    """verbose=None (the default): bars where stderr is a terminal, nothing where it is a file or pipe."""
    torch.manual_seed(0)
    models = [MLP(6, [5], 3) for _ in range(2)]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    fuse(models, "pfnm")
    assert "empirical Bayes" in terminal.getvalue()  # tqdm's bar of the data-free matching's rounds
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    fuse(models, "pfnm")
    fuse(models, "pfnm", verbose=False)
    assert log.getvalue() == ""
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    fuse(models, "pfnm", verbose=False)
    assert quiet.getvalue() == ""


@pytest.mark.catalogue
@pytest.mark.parametrize(
    "method, options",
    [("pfnm", {"rounds": 2}), ("pfnm", {"rounds": 2, "head": "clients"}), ("fedma", {})],
)
def test_data_of_another_federation_or_an_empty_client_is_refused(digits_federation, method, options):
    split, part, models = digits_federation
    more = dirichlet_partition(split.train.y, len(models) + 1, 0.5, seed=1)
    with pytest.raises(ValueError, match=f"{len(models)} models but {len(models) + 1} clients in the partition"):
        fuse(models, method, data=(split.train, more), **options)
    for j in (0, 3):  # named in the caller's order, whatever order the fusion works in
        indices = [np.array([], dtype=np.int64) if i == j else p for i, p in enumerate(part)]
        with pytest.raises(ValueError, match=rf"clients \[{j}\] hold no examples"):
            fuse(models, method, data=(split.train, indices), **options)


def test_the_temperature_round_refuses_data_of_another_federation(digits_federation):
    split, part, models = digits_federation
    fewer = dirichlet_partition(split.train.y, len(models) - 1, 0.5, seed=1)
    with pytest.raises(ValueError, match="clients in the partition"):
        fuse(models, "pfnm", rounds=2, second_round="temperature", class_counts=part.counts, data=(split.train, fewer))


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_a_stacked_lstms_layers_are_matched_as_one_group_where_their_widths_differ(method):
    """nn.LSTM keeps one width for its layers. Copies permuted layer by layer fuse back with a
    permutation per layer (equal widths); independent networks, whose layers match to different
    widths, are matched again with one permutation for all layers (one group), which fuses copies
    permuted by that symmetry back to the network. FedAvg and OT keep the widths."""
    from bayesfuse.core import fuse_states
    from bayesfuse.inference.spec import permute, random_permutations, tie_stacked_recurrent
    from bayesfuse.nets.arch import LSTMClassifier, rebuild
    from bayesfuse.nets.spec import spec_from_module

    model = randomise(LSTMClassifier(16, 3, hidden=5, num_layers=2), seed=0)
    spec, state = spec_from_module(model), numpy_state(model)
    x = torch.randn(20, 16)
    rng = np.random.default_rng(0)

    def copies(by):
        perms = [random_permutations(by.sizes(state), rng) for _ in range(2)]
        return [state] + [permute(state, by, p) for p in perms]

    res = fuse([rebuild(model, {k: torch.as_tensor(v) for k, v in sd.items()}) for sd in copies(spec)], method)
    assert res.sizes == [5, 5] and "tied_layers" not in res.hyper
    with torch.no_grad():
        torch.testing.assert_close(res.model(x), model(x), rtol=1e-5, atol=1e-5)
    tied, layers = tie_stacked_recurrent(spec, state)
    assert tied.groups == ("H",) and layers == {"lstm": ["H", "H_1"]}
    one = fuse_states(copies(tied), method, spec=tied, **_VAGUE[method])  # the tied matching alone
    with torch.no_grad():
        back = rebuild(model, {k: torch.as_tensor(v) for k, v in one.state.items()}).eval()
        torch.testing.assert_close(back(x), model(x), rtol=1e-5, atol=1e-5)
    others = [randomise(LSTMClassifier(16, 3, hidden=5, num_layers=2), seed) for seed in (1, 2)]
    assert fuse([model, *others], "fedavg").sizes == fuse([model, *others], "ot").sizes == [5, 5]
    independent = fuse([model, *others], method)
    assert independent.hyper["tied_layers"] == {"lstm": ["H", "H_1"]} and len(independent.sizes) == 1
    assert independent.model.lstm.hidden_size == independent.sizes[0] and independent.model(x).shape == (20, 3)


def test_fedma_on_a_stacked_lstm_matches_its_layers_as_one_group(digits):
    from bayesfuse.nets.arch import LSTMClassifier

    part = dirichlet_partition(digits.train.y, 2, 1.0, seed=0)
    torch.manual_seed(0)
    models = [LSTMClassifier(64, 10, hidden=6, num_layers=2).eval() for _ in range(2)]
    res = fuse(models, "fedma", data=(digits.train, part), retrain=TrainConfig(epochs=1))
    assert len(res.sizes) == 1 and res.model.lstm.num_layers == 2 and res.hyper["rounds"] == 2


class _DoubleConvNet(torch.nn.Module):
    """A user's class, made float64 with ``.double()``: conv, batch norm, dense layers."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        self.fc = torch.nn.Linear(6 * 8 * 8, 12)
        self.out = torch.nn.Linear(12, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x.view(-1, 1, 8, 8))))
        return self.out(torch.relu(self.fc(h.flatten(1))))

    def example_input(self):
        return torch.zeros(2, 64)  # float32, as users write it: traced in the network's own dtype


@pytest.mark.parametrize("method", ["pfnm", "ot", "fedavg"])
def test_a_float64_network_fuses_in_float64(method):
    """A float64 network (``model.double()``) is traced with float64 inputs and rebuilt in float64:
    permuted copies fuse back to its function within float64 round-off, which a float32 rebuild
    (relative error ~1e-7) could not meet."""
    from bayesfuse.inference.spec import permute, random_permutations
    from bayesfuse.nets.arch import rebuild
    from bayesfuse.nets.spec import spec_from_module

    model = randomise(_DoubleConvNet().double(), seed=0)
    spec = spec_from_module(model)
    rng = np.random.default_rng(0)
    state = numpy_state(model)
    copies = [state] if method == "fedavg" else [permute(state, spec, random_permutations(spec.sizes(state), rng))] * 3
    clients = [rebuild(model, {k: torch.as_tensor(v) for k, v in sd.items()}).eval() for sd in copies]
    assert all(p.dtype == torch.float64 for c in clients for p in c.parameters())
    res = fuse(clients, method, **_VAGUE.get(method, {}))
    assert all(p.dtype == torch.float64 for p in res.model.parameters())
    x = torch.randn(20, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(res.model(x), want, rtol=0, atol=1e-6 * want.abs().max().item())
    p = predict_proba(res, x.numpy())  # NumPy inputs come in the network's dtype
    np.testing.assert_allclose(p, torch.softmax(want, -1).numpy(), atol=1e-9)


@pytest.mark.parametrize("method", ["pfnm", "fedavg"])
def test_a_bfloat16_network_fuses_and_summarises_in_bfloat16(method):
    """NumPy has no bfloat16: its entries are read as float32 (exact), fused, and written back in
    bfloat16; permuted copies fuse back to the network's function, with and without summaries.
    The fused weights are the network's own bfloat16 values, in another unit order: the logits
    differ by the rounding of bfloat16 sums taken in another order, each hidden activation and
    logit rounded once to 8 significant bits (relative 2^-8), hence 4 * 2^-8 of the largest logit."""
    from bayesfuse.inference.spec import permute, random_permutations
    from bayesfuse.nets.arch import rebuild
    from bayesfuse.nets.spec import spec_from_module

    model = randomise(MLP(64, [16], 3), seed=0).to(torch.bfloat16).eval()
    spec, state = spec_from_module(model), numpy_state(model)
    assert state["layers.0.weight"].dtype == np.float32
    rng = np.random.default_rng(0)
    copies = [permute(state, spec, random_permutations(spec.sizes(state), rng)) for _ in range(2)]
    clients = [model] + [rebuild(model, {k: torch.as_tensor(v) for k, v in sd.items()}).eval() for sd in copies]
    if method == "fedavg":  # FedAvg of permuted copies is another network: two copies, averaged in bfloat16
        clients = [model, rebuild(model, {k: torch.as_tensor(v) for k, v in state.items()}).eval()]
    x, y = np.random.default_rng(1).normal(size=(30, 64)).astype(np.float32), np.arange(30) % 3
    xt = torch.as_tensor(x, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(xt).float()
    for summaries in (None, [summarize(c, x, y) for c in clients]) if method == "pfnm" else (None,):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # FedAvg's two copies: the same client twice
            res = fuse(clients, method, summaries=summaries, **_VAGUE.get(method, {}))
        assert all(p.dtype == torch.bfloat16 for p in res.model.parameters())
        net = res.model if summaries is None else res.model.network  # with summaries: under the clients' heads
        with torch.no_grad():
            torch.testing.assert_close(net(xt).float(), want, rtol=0, atol=4 * 2**-8 * want.abs().max().item())


def test_fedma_trains_a_float64_network_in_float64(digits):
    part = dirichlet_partition(digits.train.y, 2, 1.0, seed=0)
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10)).double()
        for _ in range(2)
    ]
    singles = [copy.deepcopy(m).float() for m in models]
    res = fuse(models, "fedma", data=(digits.train, part), retrain=TrainConfig(epochs=1))
    assert all(p.dtype == torch.float64 for p in res.model.parameters())
    # the same run in float32 (same weights, same seeds) takes the same steps, up to float32 round-off
    ref = fuse(singles, "fedma", data=(digits.train, part), retrain=TrainConfig(epochs=1))
    assert res.sizes == ref.sizes
    p64, p32 = predict_proba(res.model, digits.test.x), predict_proba(ref.model, digits.test.x)
    assert np.abs(p64 - p32).max() < 1e-3


def test_fedma_traces_with_the_example_input_it_is_given(digits):
    from tests.nets.user_nets import FlatCNN

    part = dirichlet_partition(digits.train.y, 2, 1.0, seed=0)
    torch.manual_seed(0)
    models = [FlatCNN().eval() for _ in range(2)]
    data = (digits.train, part)
    with pytest.raises(ValueError, match="give an example input"):
        fuse(models, "fedma", data=data, retrain=TrainConfig(epochs=1))
    res = fuse(models, "fedma", data=data, retrain=TrainConfig(epochs=1), example_input=torch.zeros(2, 64))
    assert isinstance(res.model, FlatCNN) and res.model(torch.zeros(3, 64)).shape == (3, 10)


class _ArgmaxMLP(torch.nn.Module):
    """A branch's largest unit's place beside the other's units: no spec the tracer can follow."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = torch.nn.Linear(8, 5), torch.nn.Linear(8, 4), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.cat([torch.relu(self.a(x)), torch.tanh(self.b(x)).argmax(1, keepdim=True).float()], 1))


class _FunctionalMLP(torch.nn.Module):
    """Weights applied by ``torch.tensordot``: the tracer sees no layer."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.zeros(6))
        self.w2, self.b2 = torch.nn.Parameter(torch.randn(3, 6)), torch.nn.Parameter(torch.zeros(3))

    def forward(self, x):
        h = torch.relu(torch.tensordot(x, self.w1, dims=([1], [1])) + self.b1)
        return torch.tensordot(h, self.w2, dims=([1], [1])) + self.b2


class _RolledLSTM(torch.nn.Module):
    """Its units rolled along their axis: no permutation follows them."""

    def __init__(self):
        super().__init__()
        self.rnn, self.fc = torch.nn.LSTM(4, 5, batch_first=True), torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.fc(torch.roll(self.rnn(x.view(-1, 2, 4))[0][:, -1], 1, -1))


@pytest.mark.parametrize("cls", [_ArgmaxMLP, _FunctionalMLP, _RolledLSTM])
def test_fedavg_averages_networks_the_tracer_cannot_follow_as_they_are(cls):
    torch.manual_seed(0)
    models = [cls().eval() for _ in range(3)]
    counts = np.array([[5, 0, 1], [2, 2, 2], [0, 1, 9]])
    with pytest.warns(UserWarning, match="fedavg: no units traced .*; every entry averaged as it is"):
        res = fuse(models, "fedavg", class_counts=counts)
    expected = fedavg(models, weights=counts.sum(1))  # bayesfuse.fedavg: every entry, no spec
    for k, v in expected.state_dict().items():
        torch.testing.assert_close(res.model.state_dict()[k], v)
    assert type(res.model) is cls and res.sizes == [] and res.hyper["spec"].startswith("none, every entry averaged")
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(res.model(x), expected(x))
    # matching needs the units: refused in one line, naming what the tracer could not follow
    with pytest.raises(
        (ValueError, UnsupportedLayerError),
        match="argmax over the units|applies the network's own weight 'w1'|roll on a permuted axis",
    ):
        fuse(models, "pfnm", example_input=torch.zeros(2, 8))
    # the user's own mistakes are not averaged over: counts of other clients, or of another width
    # (checked where the network runs on a guessed input, as _ArgmaxMLP's first nn.Linear allows, or a given one)
    for given in [None] if cls is _ArgmaxMLP else [torch.zeros(2, 8)]:
        with pytest.raises(ValueError, match="class counts give 4 counts per client; the models have 3 classes"):
            fuse(models, "fedavg", class_counts=np.ones((3, 4)), example_input=given)
    with pytest.raises(ValueError, match=r"class_counts must have one row per client, shape \(3, 3\)"):
        fuse(models, "fedavg", class_counts=counts[:2])


def test_fedavg_does_not_hide_an_example_input_that_does_not_run():
    models = [_ArgmaxMLP().eval() for _ in range(2)]
    with pytest.raises(ValueError, match=r"the example input of shape \(2, 5\) does not run through the network"):
        fuse(models, "fedavg", example_input=torch.zeros(2, 5))
