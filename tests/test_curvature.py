"""The GGN diagonal against independent computations: the closed form of a linear-softmax model,
full per-example Jacobians (torch.autograd.functional.jacobian) and, where installed, BackPACK."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from bayesfuse.curvature import diag_ggn
from bayesfuse.nets.arch import make_cnn
from bayesfuse.nets.mlp import MLP
from tests.helpers import randomise


def brute_force_ggn(model: nn.Module, x: torch.Tensor) -> dict[str, np.ndarray]:
    """sum_n diag(J_n^T (diag p_n - p_n p_n^T) J_n) with each example's full Jacobian."""
    model.eval()
    names = [k for k, _ in model.named_parameters()]
    params = tuple(p.detach() for _, p in model.named_parameters())
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for xi in x:

        def logits(*ps):
            return torch.func.functional_call(model, dict(zip(names, ps)), (xi.unsqueeze(0),)).squeeze(0)

        jac = torch.autograd.functional.jacobian(logits, params)
        p = torch.softmax(logits(*params), -1).double()
        lam = torch.diag(p) - torch.outer(p, p)
        for i, j in enumerate(jac):
            j = j.double().reshape(p.shape[0], -1)
            total[i] += torch.einsum("ki,kl,li->i", j, lam, j).reshape(params[i].shape)
    return dict(zip(names, (t.numpy() for t in total)))


def _running_statistics(model: nn.Module) -> None:
    """Every batch norm's running statistics drawn away from 0 and 1, in place (torch's generator)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)


def assert_exact(model: nn.Module, x: torch.Tensor, batch_size: int) -> None:
    """``diag_ggn`` equals the full Jacobians' GGN diagonal to float64 round-off, entry by entry."""
    got = diag_ggn(model, x, batch_size=batch_size)
    want = brute_force_ggn(model, x)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-14, err_msg=k)


def test_linear_softmax_closed_form():
    # logits W x + b: diag GGN of W[k, d] is sum_n p_nk (1 - p_nk) x_nd^2, of b[k] sum_n p_nk (1 - p_nk)
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    x = torch.randn(40, 5, dtype=torch.float64)
    g = diag_ggn(model, x)
    p = torch.softmax(model(x), -1).detach().numpy()
    np.testing.assert_allclose(g["weight"], (p * (1 - p)).T @ (x.numpy() ** 2), rtol=1e-12)
    np.testing.assert_allclose(g["bias"], (p * (1 - p)).sum(0), rtol=1e-12)


@pytest.mark.parametrize("batch_size", [7, 1024])
def test_mlp_against_full_jacobians(batch_size):
    model = randomise(MLP(6, [5, 4], 3), 1).double()
    x = torch.randn(30, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = diag_ggn(model, x, batch_size=batch_size)
    want = brute_force_ggn(model, x)
    assert got.keys() == want.keys()
    for k in want:  # float64 throughout: agreement to round-off
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-14, err_msg=k)


def test_cnn_with_batch_norm_against_full_jacobians():
    model = randomise(make_cnn(16, 3, channels=(2, 3), hidden=(4,)), 3).double()
    x = torch.randn(6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    got = diag_ggn(model, x, batch_size=4)
    want = brute_force_ggn(model, x)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-14, err_msg=k)


class Scaled(nn.Module):
    """A user's own class: a Linear, a functional relu, and a parameter no layer owns."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.gain = nn.Parameter(torch.tensor([1.5, 0.5, 2.0]))
        self.b = nn.Linear(3, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.gain)


def test_own_class_with_free_parameter():
    torch.manual_seed(5)
    model = Scaled().double()
    x = torch.randn(12, 4, dtype=torch.float64)
    got = diag_ggn(model, x)
    want = brute_force_ggn(model, x)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-14, err_msg=k)


class _CalledTwice(nn.Module):
    """A Linear and a Conv1d each called twice, weights shared: their gradients sum over calls."""

    def __init__(self):
        super().__init__()
        self.a, self.c, self.out = nn.Linear(6, 6), nn.Conv1d(2, 2, 3, padding=1), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.a(x))))
        return self.out(self.c(self.c(h.view(-1, 2, 3))).flatten(1))


class _Keywords(nn.Module):
    """Layers called with keyword arguments: ``conv(input=...)``, ``up(h, output_size=[16])``."""

    def __init__(self):
        super().__init__()
        self.a, self.up = nn.Conv1d(4, 6, 3, padding=1), nn.ConvTranspose1d(6, 3, 3, stride=2, padding=1)
        self.out = nn.Linear(48, 3)

    def forward(self, x):
        return self.out(self.up(torch.tanh(self.a(input=x.view(-1, 4, 8))), output_size=[16]).flatten(1))


def _odd_layer(kind: str) -> nn.Module:
    from torch.nn.utils import parametrizations

    if kind == "keywords":
        return _Keywords()
    if kind == "weight_norm":
        conv: nn.Module = parametrizations.weight_norm(nn.Conv1d(4, 3, 3))
        return nn.Sequential(nn.Unflatten(1, (4, 8)), conv, nn.Tanh(), nn.Flatten(), nn.Linear(18, 3))
    if kind == "linear, ReLU(inplace)":
        return nn.Sequential(nn.Linear(32, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))
    if kind == "batch norm, ReLU(inplace)":
        return nn.Sequential(nn.Linear(32, 6), nn.BatchNorm1d(6), nn.ReLU(inplace=True), nn.Linear(6, 3))
    shape, conv = ((4, 8), nn.Conv1d(4, 3, 3)) if kind == "conv1d, ReLU(inplace)" else ((2, 4, 4), nn.Conv2d(2, 3, 3))
    return nn.Sequential(
        nn.Unflatten(1, shape), conv, nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(18 - 6 * (len(shape) - 2), 3)
    )


@pytest.mark.parametrize(
    "kind",
    [
        "conv1d, ReLU(inplace)",
        "conv2d, ReLU(inplace)",
        "linear, ReLU(inplace)",
        "batch norm, ReLU(inplace)",
        "keywords",
        "weight_norm",
    ],
)
def test_layers_the_layer_path_cannot_read_take_the_general_one(kind):
    """The layer path reads a layer's input and the gradient at its output: an in-place operation
    after it (ReLU(inplace=True), as torchvision writes it) made that the gradient after the
    operation (0.4-0.8 off); a call with keyword arguments gave it no input (an IndexError), or
    none of them (output_size=); a weight computed by a parametrization is no parameter of the
    model's. Each goes to the general path, exact."""
    torch.manual_seed(9)
    model = _odd_layer(kind).double().eval()
    _running_statistics(model)
    assert_exact(model, torch.randn(6, 32, dtype=torch.float64), batch_size=4)


@pytest.mark.parametrize("cls", ["SharedBlocks", "_CalledTwice"])
def test_layers_called_more_than_once_against_full_jacobians(cls):
    """A layer called more than once (a siamese encoder, a block shared in a loop) has the GGN of
    all its calls; the layer path, which reads one call's input and output, leaves it to the
    general path (it kept the last call's alone)."""
    from tests.nets import user_nets

    torch.manual_seed(8)
    model = (_CalledTwice() if cls == "_CalledTwice" else getattr(user_nets, cls)()).double().eval()
    assert_exact(model, torch.randn(6, 6 if cls == "_CalledTwice" else 64, dtype=torch.float64), batch_size=4)


@pytest.mark.parametrize("cls", ["UpConvUNet", "UpConv1d", "VolumeCNN"])
def test_transposed_and_3d_convolutions_against_full_jacobians(cls):
    """Transposed convolutions and 3-d layers take the layer path, each example's gradient from
    the layer alone: the same sums."""
    from tests.nets import user_nets

    torch.manual_seed(7)
    model = randomise(getattr(user_nets, cls)(), 2).double().eval()
    assert_exact(model, torch.randn(5, 64, dtype=torch.float64), batch_size=3)


@pytest.mark.parametrize("cls", ["TimmStyleCNN", "_GainNet"])
def test_layers_of_classes_of_ones_own_against_full_jacobians(cls):
    """Layers whose class changes what torch's layer computes take the general path: timm's
    ``BatchNormAct2d`` applies its activation after the batch norm (the layer path's formula would
    read the gradient after it as the one at the norm's output), and a convolution whose
    ``_conv_forward`` scales its filters by a gain keeps torch's ``forward`` (the layer path read
    it as a plain convolution: every entry of its weight off)."""
    from tests.nets import test_graph_spec, user_nets

    torch.manual_seed(6)
    model = randomise((getattr(user_nets, cls, None) or getattr(test_graph_spec, cls))(), 3).double().eval()
    _running_statistics(model)
    assert_exact(model, torch.randn(5, 64, dtype=torch.float64), batch_size=3)


@pytest.mark.parametrize("cls", ["MyGRU", "MyLSTM"])
def test_recurrent_networks_against_full_jacobians(cls):
    """A GRU has no vmap batching rule: its examples are taken one at a time, the same sums."""
    from tests.nets import user_nets

    torch.manual_seed(6)
    model = getattr(user_nets, cls)(h=5).double().eval()
    x = torch.randn(7, 64, dtype=torch.float64)
    got = diag_ggn(model, x)
    want = brute_force_ggn(model, x)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-14, err_msg=k)


def test_backpack_agrees_on_a_sequential():
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import DiagGGNExact

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)).double()
    x = torch.randn(25, 5, dtype=torch.float64)
    got = diag_ggn(model, x)
    extended = backpack.extend(model)
    loss = backpack.extend(nn.CrossEntropyLoss(reduction="sum"))(extended(x), torch.zeros(25, dtype=torch.long))
    with backpack.backpack(DiagGGNExact()):
        loss.backward()
    for k, p in extended.named_parameters():
        np.testing.assert_allclose(got[k], p.diag_ggn_exact.numpy(), rtol=1e-10, atol=1e-14, err_msg=k)


def test_refuses_bad_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        diag_ggn(nn.Linear(2, 2), np.zeros((3, 2), dtype=np.float32), batch_size=0)
