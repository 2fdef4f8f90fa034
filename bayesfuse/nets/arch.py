"""Architectures used in federation simulations, and rebuilding a network at new widths.

* :func:`make_cnn`: a small ConvNet (conv-BN-ReLU-maxpool blocks, then dense layers) as an
  ``nn.Sequential`` taking flat images, so every dataset here feeds it unchanged.
* :class:`LSTMClassifier`: reads an image row by row (FedMA's LSTM case, section 2.2).
* :func:`make_model`: ``"mlp" | "cnn" | "lstm" | "resnet20" | "resnet18" | "vit"`` by name (the
  ResNets in :mod:`bayesfuse.nets.resnet`, the vision transformer in :mod:`bayesfuse.nets.attention`).
* :func:`rebuild`: a copy of a network whose layers take the shapes of a (fused, wider)
  state_dict, loaded with it.
"""

from __future__ import annotations

import copy
import re
from typing import Callable, Mapping, Sequence, cast

import numpy as np
import torch
from torch import nn

from bayesfuse._text import first_line
from bayesfuse.inference.spec import PermutationSpec, chain, dense, lstm
from bayesfuse.nets.attention import vit
from bayesfuse.nets.images import image_shape
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.pans import PANConfig, PositionAware
from bayesfuse.nets.resnet import resnet18, resnet20
from bayesfuse.nets.state import (
    RMS_NORMS,
    OutputLogitsError,
    floating_like,
    forward_error,
    load_state,
    set_at,
    tied_entries,
)

__all__ = [
    "ARCHITECTURES",
    "make_cnn",
    "LSTMClassifier",
    "make_model",
    "rebuild",
    "check_runs",
    "check_recurrent_widths",
    "image_shape",
]

ARCHITECTURES = ("mlp", "cnn", "lstm", "resnet20", "resnet18", "vit")
# the reference nets scaled by ``width``
_WIDTHS: dict[str, Callable[..., nn.Module]] = {"resnet20": resnet20, "resnet18": resnet18, "vit": vit}


def make_cnn(
    n_features: int,
    n_classes: int,
    *,
    channels: Sequence[int] = (16, 32),
    hidden: Sequence[int] = (64,),
    batchnorm: bool = True,
    pan: PANConfig | None = None,
    in_channels: int = 1,
) -> nn.Sequential:
    """``Unflatten -> [Conv3x3 (+BN) (+PAN) -> ReLU -> MaxPool2]* -> Flatten -> [Linear -> ReLU]* -> Linear``.

    Takes flat square images of ``in_channels`` channels: ``n_features = in_channels * side * side``.
    """
    shape = image_shape(n_features, in_channels)
    layers: list[nn.Module] = [nn.Unflatten(1, shape)]
    c_in, side = shape[0], shape[1]
    for c in channels:
        layers.append(nn.Conv2d(c_in, int(c), 3, padding=1))
        if batchnorm:
            layers.append(nn.BatchNorm2d(int(c)))
        if pan is not None:
            layers.append(PositionAware(int(c), pan))
        layers += [nn.ReLU(), nn.MaxPool2d(2)]
        c_in, side = int(c), side // 2
        if side < 1:
            raise ValueError(f"{len(channels)} pooling blocks shrink a {shape[1]}-pixel image to nothing")
    layers.append(nn.Flatten())
    width = c_in * side * side
    for h in hidden:
        layers.append(nn.Linear(width, int(h)))
        if pan is not None:
            layers.append(PositionAware(int(h), pan))
        layers.append(nn.ReLU())
        width = int(h)
    layers.append(nn.Linear(width, n_classes))
    return nn.Sequential(*layers)


class LSTMClassifier(nn.Module):
    """Reads a flat ``side x side`` image as ``side`` steps of ``side`` features; classifies the last hidden state."""

    def __init__(self, n_features: int, n_classes: int, hidden: int = 64, num_layers: int = 1) -> None:
        super().__init__()
        _, self.steps, self.step_features = image_shape(n_features)
        self.lstm = nn.LSTM(self.step_features, int(hidden), num_layers=int(num_layers), batch_first=True)
        self.fc = nn.Linear(int(hidden), n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.lstm(x.reshape(len(x), self.steps, self.step_features))
        return self.fc(h[-1])

    def permutation_spec(self) -> PermutationSpec:
        n = self.lstm.num_layers
        top = "H" if n == 1 else f"H_{n - 1}"
        return chain(lstm("lstm", None, "H", num_layers=n), dense("fc", top, None), output=("fc.weight", "fc.bias"))


def make_model(
    arch: str,
    n_features: int,
    n_classes: int,
    *,
    hidden: Sequence[int] = (100,),
    channels: Sequence[int] = (16, 32),
    pan: PANConfig | None = None,
    width: float = 1.0,
) -> nn.Module:
    """A fresh network by name: ``"mlp"`` (:class:`MLP`), ``"cnn"`` (:func:`make_cnn`), ``"lstm"``, or
    ``"resnet20"`` / ``"resnet18"`` (:mod:`bayesfuse.nets.resnet`) or ``"vit"``
    (:func:`~bayesfuse.nets.attention.vit`), ``width`` their width multiplier; ``hidden`` and
    ``channels`` are the other architectures')."""
    if arch in _WIDTHS:
        if pan is not None:
            raise ValueError(f"position-aware neurons are not defined for {arch} here")
        return _WIDTHS[arch](n_features, n_classes, width=width)
    if arch == "mlp":
        return MLP(n_features, hidden, n_classes, pan=pan)
    if arch == "cnn":
        return make_cnn(n_features, n_classes, channels=channels, hidden=hidden, pan=pan)
    if arch == "lstm":
        if pan is not None:
            raise ValueError("position-aware neurons are not defined for the LSTM here")
        return LSTMClassifier(n_features, n_classes, hidden=hidden[0] if hidden else 64, num_layers=max(len(hidden), 1))
    raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")


#: The layers :func:`_resized` re-creates at new widths, copies of a class of one's own included.
_RESIZED = (
    nn.Linear,
    nn.Bilinear,
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    *RMS_NORMS,
    nn.GroupNorm,
    nn.Embedding,
    nn.EmbeddingBag,
)


def _at_widths(
    module: nn.Module, attributes: Mapping, parameters: Mapping, buffers: Mapping | None = None
) -> nn.Module:
    """``module`` itself, a layer of the rebuilt copy (of the user's class, which keeps its forward:
    timm's ``Linear``, ConvNeXt's ``LayerNorm2d``), with ``attributes`` set and each of
    ``parameters`` it holds made anew at its shape (``buffers``: given values); the values are
    loaded after."""
    for name, value in attributes.items():
        setattr(module, name, value)
    for name, size in parameters.items():
        if getattr(module, name, None) is not None:
            setattr(module, name, nn.Parameter(torch.empty(size)))
    for name, value in (buffers or {}).items():
        if getattr(module, name, None) is not None:
            setattr(module, name, value)
    return module


def _resized(module: nn.Module, prefix: str, shapes: Mapping[str, tuple]) -> nn.Module:
    """A module of ``module``'s type and settings with the parameter shapes in ``shapes``: the
    layers of :data:`_RESIZED` changed in place (:func:`_at_widths`), others made anew."""

    def shape(name):
        return tuple(shapes[f"{prefix}{name}"])

    if isinstance(module, nn.Linear):
        out, inp = shape("weight")
        return _at_widths(module, {"in_features": inp, "out_features": out}, {"weight": (out, inp), "bias": (out,)})
    if isinstance(module, nn.Bilinear):
        out, in1, in2 = shape("weight")
        return nn.Bilinear(in1, in2, out, bias=module.bias is not None)
    if isinstance(module, nn.modules.conv._ConvTransposeNd):  # weight (C_in, C_out / groups, *kernel)
        w = shape("weight")
        groups = w[0] if module.groups != 1 and module.groups == module.in_channels else module.groups  # depthwise
        out = w[1] * groups
        widths = {"groups": groups, "in_channels": w[0], "out_channels": out}
        return _at_widths(module, widths, {"weight": w, "bias": (out,)})
    if isinstance(module, nn.modules.conv._ConvNd):
        w = shape("weight")
        groups = module.groups
        if groups != 1 and groups == module.in_channels:  # depthwise, k filters per channel
            groups = w[0] // (module.out_channels // module.in_channels)
        widths = {"groups": groups, "in_channels": w[1] * groups, "out_channels": w[0]}
        return _at_widths(module, widths, {"weight": w, "bias": (w[0],)})
    if isinstance(module, nn.modules.batchnorm._NormBase):  # batch and instance norms: per channel
        held = next((k for k in ("weight", "running_mean") if f"{prefix}{k}" in shapes), None)  # affine, tracking
        if held is None:  # nothing of its own: it normalises whatever width it is given
            return module
        n = int(shape(held)[0])
        stats = {"running_mean": torch.zeros(n), "running_var": torch.ones(n)}
        return _at_widths(module, {"num_features": n}, {"weight": (n,), "bias": (n,)}, stats)
    if isinstance(module, (nn.LayerNorm, *RMS_NORMS)):  # an RMSNorm has a LayerNorm's attributes, no bias
        width = tuple(int(n) for n in shape("weight"))  # with its scale: resized only where it has entries
        return _at_widths(module, {"normalized_shape": width}, {"weight": width, "bias": width})
    if isinstance(module, nn.GroupNorm):
        channels = int(shape("weight")[0])
        groups = channels if module.num_groups == module.num_channels else module.num_groups  # per channel, or g
        return _at_widths(
            module, {"num_channels": channels, "num_groups": groups}, {"weight": (channels,), "bias": (channels,)}
        )
    if isinstance(module, nn.Embedding):
        n, dim = shape("weight")
        return nn.Embedding(n, dim, padding_idx=module.padding_idx)
    if isinstance(module, nn.EmbeddingBag):
        n, dim = shape("weight")
        return nn.EmbeddingBag(n, dim, mode=module.mode, padding_idx=module.padding_idx)
    if isinstance(module, nn.PReLU):
        return nn.PReLU(shape("weight")[0]) if module.num_parameters > 1 else module
    if isinstance(module, (nn.LSTM, nn.GRU, nn.RNN)):
        hidden = shape("weight_hh_l0")[1]
        inp = shape("weight_ih_l0")[1]
        options = {"nonlinearity": module.nonlinearity} if isinstance(module, nn.RNN) else {}
        if isinstance(module, nn.LSTM) and module.proj_size > 0:  # weight_hr (proj, hidden)
            proj, hidden = shape("weight_hr_l0")
            options = {"proj_size": proj}
        return type(module)(
            inp,
            hidden,
            num_layers=module.num_layers,
            bias=module.bias,
            batch_first=module.batch_first,
            dropout=module.dropout,
            bidirectional=module.bidirectional,
            **options,
        )
    if isinstance(module, PositionAware):
        return module  # re-created from the next layer's width below
    return module


def check_recurrent_widths(state: Mapping[str, torch.Tensor] | Mapping[str, np.ndarray]) -> None:
    """Refuse, in one line, a state whose stacked ``nn.LSTM`` / ``nn.GRU`` layers have different
    widths: the module keeps one hidden size for all its layers, and matching gives each layer's
    units a permutation, and a width, of its own."""
    widths: dict[tuple[str, str], dict[int, int]] = {}
    for key, value in state.items():  # the layers' outputs, and a projected LSTM's cells (weight_hr)
        found = re.fullmatch(r"(.*)\.weight_h([hr])_l(\d+)", key)
        if found and f"{found[1]}.weight_hh_l0" in state and f"{found[1]}.weight_ih_l0" in state:
            widths.setdefault((found[1], found[2]), {})[int(found[3])] = int(np.shape(value)[1])
    for (name, part), layers in widths.items():
        if part == "r" and (name, "h") in widths and widths[(name, "h")][0] >= layers[0]:
            raise ValueError(
                f"{name!r} is a projected nn.LSTM, which needs fewer projections than cells, and this fusion gives "
                f"it {widths[(name, 'h')][0]} projections and {layers[0]} cells; fuse it with a method that keeps "
                "the widths (fedavg, ot)"
            )
        if len(set(layers.values())) > 1:
            cells = np.shape(state[f"{name}.weight_hr_l0"])[1] if f"{name}.weight_hr_l0" in state else layers[0]
            blocks = np.shape(state[f"{name}.weight_hh_l0"])[0] // cells
            kind = {4: "LSTM", 3: "GRU"}.get(blocks, "RNN")
            listed = ", ".join(str(layers[k]) for k in sorted(layers))
            what = "cells" if part == "r" else "projections" if f"{name}.weight_hr_l0" in state else "units"
            raise ValueError(
                f"{name!r} is an nn.{kind} of {len(layers)} layers, which keeps one width for all of them, "
                f"and this fusion gives each layer's {what} a width of its own ({listed}); fuse it with a method "
                "that keeps the widths (fedavg, ot), or write its layers as one-layer modules"
            )


def rebuild(model: nn.Module, state_dict: Mapping[str, torch.Tensor], spec: PermutationSpec | None = None) -> nn.Module:
    """A copy of ``model`` whose layers have ``state_dict``'s shapes, loaded with it.

    Linear, Conv, BatchNorm, LayerNorm, GroupNorm, Embedding and LSTM layers are re-created at
    the new widths, and parameters a module holds itself (a class token) at their new shapes;
    position-aware layers get the encoding of their new width. The numbers modules hold that
    ``spec`` (``model``'s traced spec) records as widths (``self.hidden_dim``,
    :attr:`~bayesfuse.inference.spec.PermutationSpec.widths`) are set to the new ones. A
    network whose ``forward`` reads another width of its own still has the old one: run it once
    (:func:`check_runs`) before trusting it.
    """
    check_recurrent_widths(state_dict)
    shapes = {k: tuple(v.shape) for k, v in state_dict.items()}
    new = copy.deepcopy(model)
    paths: dict[int, list[str]] = {}  # a module held under several names is replaced under each
    for name, module in new.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(name)
    previous_width = None
    for name, module in list(new.named_modules()):
        if name == "" or len(list(module.children())) > 0 and not isinstance(module, _RESIZED):
            continue  # a container; a layer of one's own holding modules (timm's BatchNormAct2d its activation) is not
        prefix = f"{name}."
        replacement: nn.Module
        ref = floating_like(module)  # read before _resized changes the layer in place
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        if isinstance(module, PositionAware):
            if previous_width is None:
                raise ValueError(f"position-aware layer {name!r} follows no weighted layer")
            replacement = PositionAware(previous_width, module.config)
        elif any(k.startswith(prefix) for k in shapes):
            replacement = _resized(module, prefix, shapes)
            if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):  # a transposed one's units: axis 1
                previous_width = shapes[f"{prefix}weight"][int(isinstance(module, nn.modules.conv._ConvTransposeNd))]
        else:
            continue
        if ref is not None:  # the user's dtype and device (a float64 network stays float64)
            replacement = replacement.to(device=ref.device, dtype=ref.dtype)
        for n, p in replacement.named_parameters():  # a frozen layer stays frozen, in its mode
            p.requires_grad_(n not in frozen)
        replacement.train(module.training)
        for path in paths[id(module)]:
            set_at(new, path, replacement)
    for name, value in list(new.named_parameters()):  # parameters held by the module itself (a class token)
        if name in shapes and tuple(value.shape) != shapes[name]:
            empty = torch.empty(shapes[name], dtype=value.dtype, device=value.device)
            set_at(new, name, nn.Parameter(empty, value.requires_grad))
    if isinstance(new, MLP) and new.pans is not None:
        pan = new.pan
        assert pan is not None  # an MLP has pans only with a PANConfig
        new.pans = nn.ModuleList(
            PositionAware(layer.out_features, pan) for layer in cast(Sequence[nn.Linear], new.layers[:-1])
        )
    if spec is not None:
        for path, width in spec.held_widths(state_dict).items():
            owner, _, attr = path.rpartition(".")
            try:
                module = new.get_submodule(owner) if owner else new
            except AttributeError:
                module = None
            if module is None or type(getattr(module, attr, None)) is not int:
                raise ValueError(f"the spec's width {path!r} is no int attribute of {type(model).__name__}'s modules")
            setattr(module, attr, width)
    new = load_state(new, state_dict)
    _retie(new, tied_entries(model), spec)
    return new


def _retie(model: nn.Module, tied: list[list[str]], spec: PermutationSpec | None) -> None:
    """Hold each parameter of ``tied`` (names of one tensor in the network rebuilt from) once
    again: layers re-created at new widths hold their own, so each alias gets its entry's (the
    spec's :attr:`~bayesfuse.inference.spec.PermutationSpec.tied` entry, else the first name)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for names in tied:
        if not all(n in params for n in names):
            continue  # buffers held twice: a module held twice is one module again
        aliases = spec.tied if spec is not None else {}
        entry = next((n for n in names if n not in aliases), names[0])
        for n in names:
            if n != entry and params[n] is not params[entry]:
                set_at(model, n, params[entry])


def check_runs(model: nn.Module, example_input: torch.Tensor, *, what: str = "the fused network") -> None:
    """Run ``model`` once on ``example_input`` (eval mode, no gradients); a ``ValueError`` in one
    line if it fails, so that no network is handed over that cannot run.

    A rebuilt network can fail where its ``forward`` keeps a width of its own (``x.view(-1,
    64)``; one a module holds follows where the spec records it,
    :attr:`~bayesfuse.inference.spec.PermutationSpec.widths`) or a module ties two widths that
    fusion set apart.
    """
    err = forward_error(model, example_input)
    if isinstance(err, OutputLogitsError):  # its own line: a forward the posterior cannot read, not a width
        raise ValueError(f"{what}: {first_line(err)}")
    if err is not None:
        raise ValueError(
            f"{what} does not run at its fused widths ({type(err).__name__}: {first_line(err)}); its forward may "
            "keep a width of its own (e.g. x.view(-1, 64), or a number a hand-written spec does not list in its "
            "'widths'): read widths off the layers, or give a spec that keeps that width"
        )
