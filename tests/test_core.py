"""The fusion core: state_dicts in, fused state_dict out; every entry point is an adapter around it."""

import warnings

import numpy as np
import pytest
import torch

from bayesfuse import fuse
from bayesfuse.client_order import canonical_order
from bayesfuse.core import fuse_states, input_kind
from bayesfuse.inference.result import ConvergenceWarning, LayerResult
from bayesfuse.models.bnn import HorseshoeBNN
from bayesfuse.nets import MLP
from bayesfuse.nets.spec import spec_from_module
from bayesfuse.nets.state import numpy_state
from tests.helpers import DEVICES


def _nets(n=3, hidden=(6, 5), seed=0):
    torch.manual_seed(seed)
    return [MLP(8, list(hidden), 3) for _ in range(n)]


def _bnns(n=3, seed=0):
    torch.manual_seed(seed)
    return [HorseshoeBNN(8, 5, 3) for _ in range(n)]


@pytest.mark.parametrize("method", ["pfnm", "nafi", "fedavg"])
def test_fuse_is_the_core_between_module_adapters(method):
    nets = _nets()
    counts = np.array([[5, 1, 0], [2, 2, 2], [0, 3, 9]])
    via_fuse = (
        fuse(nets, method, class_counts=counts, seed=1, n_iter=3)
        if method != "fedavg"
        else fuse(nets, method, class_counts=counts)
    )
    hyper = {"n_iter": 3} if method != "fedavg" else {}
    order = canonical_order(nets)  # fuse() fuses its inputs in this order (any order of the list gives it)
    core = fuse_states(
        [numpy_state(nets[j]) for j in order],
        method,
        spec=spec_from_module(nets[0]),
        class_counts=counts[order],
        seed=1,
        **hyper,
    )
    fused = via_fuse.model.state_dict()
    assert list(core.state) == list(fused)
    for k, v in fused.items():
        assert torch.equal(torch.as_tensor(core.state[k]).to(v.dtype), v), k
    assert core.sizes == via_fuse.sizes and core.groups == via_fuse.groups


def test_spec_is_derived_from_the_entries_when_not_given():
    nets = _nets()
    states = [numpy_state(m) for m in nets]
    a = fuse_states(states, "pfnm", seed=0)
    b = fuse_states(states, "pfnm", spec=spec_from_module(nets[0]), seed=0)
    assert all(np.array_equal(a.state[k], b.state[k]) for k in a.state)
    assert a.hyper["noise_var"] == "auto" and a.hyper["seed"] == 0 and a.kind == "network"
    chosen = a.hyper["chosen"]["P1"]  # the values the empirical Bayes chose, per block of the layer's units
    assert chosen["blocks"] == ["layers.0.weight", "layers.0.bias"] and len(chosen["noise_var"]) == 2
    assert chosen["noise_var"] == a.layers[0].hyper["noise_var"] and chosen["gamma0"] > 0


def test_names_that_leave_a_skip_possible_are_refused_with_fuse_states_own_arguments():
    """``fuse_states`` takes a spec, not ``arch=`` or ``like=``: its refusal says how to give one."""

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

        def forward(self, x):
            return self.net(x)

    torch.manual_seed(0)
    nets = [Wrapped() for _ in range(2)]
    states = [numpy_state(m) for m in nets]
    with pytest.raises(ValueError, match="skip connection possible") as err:
        fuse_states(states, "pfnm")
    message = str(err.value)
    assert "spec=spec_for_state_dict(state, arch='mlp')" in message and "spec=spec_from_module(model)" in message
    assert "like=" not in message
    fused = fuse_states(states, "pfnm", spec=spec_from_module(nets[0]))  # what it advises works
    assert fused.state["net.0.weight"].shape[1] == 8


def test_bnn_states_fuse_to_a_bnn_state():
    bnns = _bnns()
    core = fuse_states([bnns[j].state_dict() for j in canonical_order(bnns)], "kl")  # fuse()'s order
    assert core.kind == "bnn" and core.groups == ("units",)
    model = HorseshoeBNN.from_state_dict(core.state)
    via_fuse = fuse(bnns, "kl").model.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, via_fuse[k]), k
    mean, var = core.posteriors[0]
    assert mean.shape == var.shape and mean.shape[0] == core.sizes[0]


def test_layer_results_share_one_protocol():
    nets, bnns = _nets(), _bnns()
    results = [
        fuse_states([numpy_state(m) for m in nets], "nafi"),
        fuse_states([b.state_dict() for b in bnns], "kl"),
        fuse_states([b.state_dict() for b in bnns], "pfnm"),
    ]
    for res in results:
        for layer in res.layers:
            assert isinstance(layer, LayerResult)
            assert layer.n_global == sum(1 for _ in range(layer.n_global)) > 0


def test_input_kind_and_bad_inputs():
    nets, bnns = _nets(), _bnns()
    assert input_kind([numpy_state(m) for m in nets]) == "network"
    assert input_kind([b.state_dict() for b in bnns]) == "bnn"
    with pytest.raises(TypeError, match="cannot fuse Bayesian"):
        input_kind([numpy_state(nets[0]), bnns[0].state_dict()])
    with pytest.raises(ValueError, match="at least one"):
        fuse_states([])
    with pytest.raises(ValueError, match=r"data=\(train, partition\)"):
        fuse_states([numpy_state(m) for m in nets], "fedma")
    with pytest.raises(ValueError, match="method 'kl' fuses Bayesian"):
        fuse_states([numpy_state(m) for m in nets], "kl")
    with pytest.raises(ValueError, match=r"unknown hyper-parameters \['reg'\]"):
        fuse_states([numpy_state(m) for m in nets], "pfnm", reg=0.1)


@pytest.mark.parametrize("method", ["pfnm", "fedavg", "ot"])
def test_class_counts_of_the_wrong_shape_are_refused_by_every_method(method):
    states = [numpy_state(m) for m in _nets(hidden=(6,))]  # 3 clients of MLP(8, [6], 3): 3 classes
    n_classes = states[0]["layers.1.weight"].shape[0]
    with pytest.raises(ValueError, match=f"give 2 counts per client; the models have {n_classes} classes"):
        fuse_states(states, method, class_counts=np.ones((3, 2)))
    with pytest.raises(ValueError, match="one row per client"):
        fuse_states(states, method, class_counts=np.ones((2, n_classes)))


def test_a_matching_that_does_not_converge_warns_once_naming_its_layers():
    nets = _nets(n=6, hidden=(12, 10), seed=3)
    states = [numpy_state(m) for m in nets]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fuse_states(states, "pfnm", n_iter=1, noise_var=0.5, prior_var=10.0, gamma0=1.0)
    late = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert not res.converged
    assert len(late) == 1 and "P1" in str(late[0].message) and "n_iter" in str(late[0].message)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fuse_states(states, "pfnm", n_iter=50, noise_var=0.5, prior_var=10.0, gamma0=1.0).converged
    assert not [w for w in caught if issubclass(w.category, ConvergenceWarning)]


# --------------------------------------------------------------------------- where the matching runs


@pytest.mark.parametrize("device", DEVICES)
def test_a_torch_device_fuses_networks_as_the_host_and_returns_numpy(device):
    states = [numpy_state(m) for m in _nets()]
    host = fuse_states(states, "pfnm", seed=0)
    dev = fuse_states(states, "pfnm", seed=0, device=device)
    assert dev.sizes == host.sizes and list(dev.state) == list(host.state)
    for g, (a, b) in enumerate(zip(host.layers, dev.layers)):
        for x, y in zip(a.assignments, b.assignments):
            np.testing.assert_array_equal(x, y)
        assert isinstance(b.mean, np.ndarray) and isinstance(dev.posteriors[g][0], np.ndarray)
    for k, value in host.state.items():  # the same float64 arithmetic in torch's kernels: round-off only
        assert isinstance(dev.state[k], np.ndarray)
        np.testing.assert_allclose(dev.state[k], value, rtol=1e-10, atol=1e-12)
    assert "device" not in dev.hyper  # an execution option, not a hyper-parameter


def test_a_device_is_refused_by_methods_and_inputs_that_run_on_the_host():
    states = [numpy_state(m) for m in _nets()]
    bnn_states = [b.state_dict() for b in _bnns()]
    host_only = "runs on the host only; a device runs the matching of pfnm and nafi on point-estimate networks"
    for method in ("fedavg", "ot"):
        with pytest.raises(ValueError, match=f"device='cpu': method '{method}' {host_only}"):
            fuse_states(states, method, device="cpu")
    with pytest.raises(ValueError, match=f"device='cpu': method 'kl' {host_only}"):
        fuse_states(bnn_states, "kl", device="cpu")
    for method in ("pfnm", "nafi"):
        with pytest.raises(
            ValueError,
            match=rf"device='cpu': {method} on Bayesian networks \(HorseshoeBNN "
            rf"posteriors\) {host_only}",
        ):
            fuse_states(bnn_states, method, device="cpu")


def test_a_bad_client_is_named_by_pfnm_as_by_the_methods_that_keep_widths():
    """The check of the clients' widths held by their forward comes after the states are checked
    with their names: a file's extra entry is refused naming the file, by every method."""
    from bayesfuse.inference.spec import spec_for_state_dict

    rng = np.random.default_rng(0)

    def client(h):
        return {
            "fc1.weight": rng.normal(size=(h, 5)),
            "fc1.bias": rng.normal(size=h),
            "fc2.weight": rng.normal(size=(3, h)),
            "fc2.bias": rng.normal(size=3),
        }

    a, b = client(6), client(7)
    spec = spec_for_state_dict(a)
    for method in ("pfnm", "ot", "fedavg"):
        with pytest.raises(ValueError, match=r"^site_a\.pt has entries \['extra'\]"):
            fuse_states([{**a, "extra": np.zeros(2)}, b], method, spec=spec, names=["site_a.pt", "site_b.pt"])


def test_a_stacked_lstms_fixed_layer_holds_the_width_of_the_layers_tied():
    """A two-layer LSTM's layers are one group when matching gives them different widths
    (``tie_stacked_recurrent``); a width its forward fixes on the upper layer (a functional layer
    norm of a written width) is then the tied group's, matched at 8."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = torch.nn.LSTM(4, 8, num_layers=2, batch_first=True), torch.nn.Linear(8, 3)

        def forward(self, x):
            o, _ = self.rnn(x)
            return self.fc(torch.nn.functional.layer_norm(o[:, -1], (8,)))

    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(Net().eval())
    x = torch.zeros(2, 5, 4)
    fused = fuse(models, "pfnm", example_input=x)
    assert fused.sizes == [8] and fused.hyper["fixed"] and fused.model(x).shape == (2, 3)
