"""Helpers shared by the tests: random networks, hidden units of one-hidden-layer MLPs, co-assignments."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from bayesfuse.nets.mlp import MLP

#: Where the tests of the torch path run: the CPU, and CUDA where this machine has it.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def fused_both_ways(models, method: str):
    """``bayesfuse.fuse`` of ``models`` in the order given and in reverse (ConvergenceWarnings
    silenced): the two results of a client-order test."""
    import bayesfuse
    from bayesfuse.inference.result import ConvergenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return bayesfuse.fuse(models, method), bayesfuse.fuse(models[::-1], method)


def randomise(model: nn.Module, seed: int) -> nn.Module:
    """Every float entry ~ N(0, 0.25) (running variances made positive), in eval mode: units
    far enough apart that matching can tell them from one another."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
                if "running_var" in name:
                    t.abs_().add_(0.1)
    return model.eval()


def far_from_identity_norms(model: nn.Module) -> nn.Module:
    """Batch norms (running statistics and affine) and layer norms drawn far from the identity, in
    place, so that a test of folding or permuting them can fail."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
            if isinstance(m, nn.PReLU):  # a slope per channel, unlike each other
                m.weight.uniform_(0.0, 0.5)
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm, nn.InstanceNorm2d)) and m.weight is not None:  # affine
                m.weight.uniform_(0.5, 2)
                m.bias.uniform_(-1, 1)
    return model


def varied_bnn(
    in_features: int,
    hidden,
    n_classes: int,
    *,
    seed: int,
    spread: float,
    scale_low: float,
    scale_span: float,
    **model_kwargs,
):
    """A HorseshoeBNN whose guide has varied means and variances (the initial guide is too uniform
    to test much): every mean moved by ``spread`` x N(0, 1), every standard deviation drawn from
    ``scale_low + scale_span`` x U(0, 1)."""
    from bayesfuse.models.bnn import HorseshoeBNN

    torch.manual_seed(seed)
    bnn = HorseshoeBNN(in_features, hidden, n_classes, **model_kwargs)
    with torch.no_grad():
        for name in bnn.loc:
            bnn.loc[name].add_(spread * torch.randn_like(bnn.loc[name]))
            bnn.log_scale[name].copy_(torch.log(scale_low + scale_span * torch.rand_like(bnn.log_scale[name])))
    return bnn


def partition(assignments) -> list[tuple]:
    """The co-assignment structure of ``assignments[j][l] = global index``, independent of labels."""
    owner = {}
    for j, a in enumerate(assignments):
        for l, i in enumerate(a):
            owner.setdefault(int(i), []).append((j, l))
    return sorted(tuple(sorted(v)) for v in owner.values())


# --------------------------------------------------------------------------- one hidden layer
# A hidden unit l of a one-hidden-layer network is the vector ``[W1[l, :], b1[l], W2[:, l]]`` of
# its incoming weights, bias and outgoing weights (PFNM's ``v_jl``; NAFI's ``w_sj``).


@dataclass(frozen=True)
class OneHiddenLayer:
    """The parameters of a one-hidden-layer MLP as float64 arrays.

    Attributes
    ----------
    neurons : (L, D_in + 1 + K) hidden units as rows ``[W1[l], b1[l], W2[:, l]]``.
    out_bias : (K,) output bias.
    """

    neurons: np.ndarray
    out_bias: np.ndarray
    in_features: int

    @property
    def n_classes(self) -> int:
        return self.out_bias.shape[0]


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def one_hidden_layer(model: nn.Module) -> OneHiddenLayer:
    """Read the hidden units of a Linear-ReLU-Linear network (such as ``MLP(d, [L], K)``)."""
    linears = _linears(model)
    if len(linears) != 2:
        raise ValueError(
            f"expected a one-hidden-layer MLP (2 Linear layers), found {len(linears)}; "
            "deeper networks need layer-wise matching"
        )
    first, second = linears
    if second.in_features != first.out_features:
        raise ValueError(f"layer shapes do not chain: {first} then {second}")
    if first.bias is None or second.bias is None:
        raise ValueError("both Linear layers must have biases")
    with torch.no_grad():
        w1 = first.weight.double().cpu().numpy()
        b1 = first.bias.double().cpu().numpy()
        w2 = second.weight.double().cpu().numpy()
        b2 = second.bias.double().cpu().numpy()
    neurons = np.hstack([w1, b1[:, None], w2.T])
    if not np.isfinite(neurons).all() or not np.isfinite(b2).all():
        raise ValueError("model parameters contain NaN or infinite values")
    return OneHiddenLayer(neurons, b2, first.in_features)


def mlp_from_neurons(neurons: np.ndarray, out_bias: np.ndarray, in_features: int) -> MLP:
    """Build ``MLP(in_features, [G], K)`` whose hidden units are the rows of ``neurons``."""
    neurons = np.asarray(neurons, dtype=np.float64)
    k = len(out_bias)
    if neurons.ndim != 2 or neurons.shape[1] != in_features + 1 + k:
        raise ValueError(f"neurons must have shape (G, {in_features + 1 + k}), got {neurons.shape}")
    model = MLP(in_features, [neurons.shape[0]], k)
    with torch.no_grad():
        model.layers[0].weight.copy_(torch.from_numpy(neurons[:, :in_features]))
        model.layers[0].bias.copy_(torch.from_numpy(neurons[:, in_features]))
        model.layers[1].weight.copy_(torch.from_numpy(neurons[:, in_features + 1 :].T.copy()))
        model.layers[1].bias.copy_(torch.from_numpy(np.asarray(out_bias, dtype=np.float64)))
    return model


def library_randomised(model: nn.Module) -> nn.Module:
    """A network of a model library (torchvision, timm) in eval mode, with every vector parameter
    (norms' scales and shifts, layer scales, which torchvision starts at 1e-6, ConvNeXt-V2's
    response norms shaped ``(1, 1, 1, C)``, which start at 0) and batch-norm statistics drawn away
    from 1 and 0, in place, so that permuting them wrongly shows."""
    with torch.no_grad():
        for key, b in model.named_buffers():
            if key.endswith("running_mean"):
                b.normal_(0, 0.1)
            elif key.endswith("running_var"):
                b.uniform_(0.5, 1.5)
        for key, p in model.named_parameters():
            vector = p.dim() >= 1 and p.numel() == max(p.shape)
            if vector and key.endswith("weight") or "gamma" in key or "layer_scale" in key:
                p.uniform_(0.5, 1.5)
            elif vector:
                p.normal_(0, 0.1)
    return model.eval()


def permuted_copy(model: nn.Module, spec, *, seed: int) -> nn.Module:
    """A copy of ``model`` with every group of ``spec`` permuted at random (``seed``), loaded with
    the state_dict's own metadata (torchvision's MNASNet reads its version from it)."""
    from bayesfuse.inference.spec import permute, random_permutations

    state = model.state_dict()
    values = {k: v.detach().numpy() for k, v in state.items()}
    perms = random_permutations(spec.sizes(values), np.random.default_rng(seed))
    for k, v in permute(values, spec, perms).items():
        state[k] = torch.as_tensor(v)
    copy_ = copy.deepcopy(model)
    copy_.load_state_dict(state)
    return copy_


def assert_library_network_fuses(make, x: torch.Tensor) -> None:
    """``make(seed)``'s network: a permuted copy (every group of its traced spec) computes its
    function and fuses back to it by PFNM and OT (max abs logit difference under 1e-4, float32
    round-off on logits of order 1); three independent ones fuse by PFNM into a network that
    runs, of the same module classes."""
    import bayesfuse
    from bayesfuse.nets.graph_spec import spec_from_graph

    model = make(0)
    permuted = permuted_copy(model, spec_from_graph(model, x[:1]), seed=1)
    with torch.no_grad():
        reference = model(x)
        assert float((permuted(x) - reference).abs().max()) < 1e-4
        for method in ("pfnm", "ot"):
            fused = bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model
            assert float((fused(x) - reference).abs().max()) < 1e-4, method
        fused = bayesfuse.fuse([make(s) for s in (1, 2, 3)], "pfnm", example_input=x[:1]).model
        assert fused(x).shape == reference.shape
        assert {type(m) for m in fused.modules()} == {type(m) for m in model.modules()}
