"""Permutation specs of torch modules, by tracing.

:func:`spec_from_module` derives the :class:`~bayesfuse.inference.spec.PermutationSpec` of an
``nn.Sequential`` (or takes the one a module's ``permutation_spec()`` method gives) by running
one example input through it. The spec itself, its combinators and the array functions that
read it live in :mod:`bayesfuse.inference.spec`, beside the matchers.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import nn

from bayesfuse.inference.spec import Axis, Encoding, PermutationSpec, batchnorm, chain, conv, dense
from bayesfuse.nets.graph_spec import UnsupportedLayerError, spec_from_graph
from bayesfuse.nets.state import floating_like

__all__ = ["SUPPORTED", "UnsupportedLayerError", "spec_from_module", "spec_with_encodings"]


#: Modules that act within each unit (channel) and so pass a permutation through unchanged.
_PASSTHROUGH = (
    "ReLU",
    "LeakyReLU",
    "Tanh",
    "Sigmoid",
    "GELU",
    "ELU",
    "SiLU",
    "Dropout",
    "Dropout2d",
    "Identity",
    "MaxPool1d",
    "MaxPool2d",
    "AvgPool1d",
    "AvgPool2d",
    "AdaptiveAvgPool2d",
    "AdaptiveMaxPool2d",
)
SUPPORTED = (
    "Linear",
    "Conv1d",
    "Conv2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "Flatten",
    "Unflatten",
    "PositionAware",
) + _PASSTHROUGH


def _plain(m: nn.Module) -> bool:
    """Whether a supported leaf is of the kind the chain reads: an ungrouped convolution, a batch
    norm with a scale and running statistics (the chain folds it; the graph, any other), a layer
    whose weight the state_dict holds (the graph refuses one computed by weight_norm's hooks)."""
    if getattr(m, "weight", None) is not None and "weight" not in m.state_dict():
        return False
    if isinstance(m, nn.modules.conv._ConvNd):
        return m.groups == 1
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return bool(m.affine and m.track_running_stats)
    return True


def spec_from_module(model, example_input=None) -> PermutationSpec:
    """Derive the permutation spec of a network.

    A module with a ``permutation_spec()`` method (the LSTM classifier, :class:`MLP`) supplies
    its own. Any other module but an ``nn.Sequential`` is traced from its ``forward`` with
    ``torch.fx`` (:func:`~bayesfuse.nets.graph_spec.spec_from_graph`: residual streams, layer and
    group norms, embeddings). An ``nn.Sequential`` is traced: one forward pass of ``example_input`` records the
    shape entering each module; every Linear/Conv but the last opens a new group ``P1, P2, ...``,
    BatchNorm joins the group before it, ``Flatten`` turns channels into blocks of ``H*W`` inputs,
    and element-wise activations, pooling and dropout pass the group through. Anything else
    raises :class:`UnsupportedLayerError` naming the module and the supported types.

    Position-aware layers (:class:`~bayesfuse.nets.pans.PositionAware`, in an ``nn.Sequential``
    or in a module with ``permutation_spec()`` such as a PAN :class:`MLP`) are recorded as the
    ``encodings`` of the group they follow (:class:`~bayesfuse.inference.spec.Encoding`, with
    ``after`` the Linear/Conv layer or batch norm they directly follow, as traced), so that
    fusion can fold them into the weights. One on the output layer's classes needs nothing (no
    permutation moves them); one anywhere else (after an activation, say) raises
    :class:`UnsupportedLayerError`.
    """
    if hasattr(model, "permutation_spec"):
        spec = model.permutation_spec()
        if spec.encodings or not any(type(m).__name__ == "PositionAware" for m in model.modules()):
            return spec
        leaves = [(n, m) for n, m in model.named_modules() if len(list(m.children())) == 0]
        _, calls = _trace(model, leaves, _example_input(leaves, example_input))
        return replace(spec, encodings=_traced_encodings(spec, dict(leaves), calls))
    if not isinstance(model, nn.Sequential):
        return spec_from_graph(model, example_input)
    leaves = [(n, m) for n, m in model.named_modules() if len(list(m.children())) == 0]
    if any(type(m).__name__ not in SUPPORTED or not _plain(m) for _, m in leaves):
        return spec_from_graph(model, example_input)  # layer norms, embeddings, grouped convs...: the graph tells
    shapes, calls = _trace(model, leaves, _example_input(leaves, example_input))
    weighted = [n for n, m in leaves if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    if not weighted:
        raise ValueError("the network has no Linear or Conv layers")
    parts = []
    current: Axis | None = None  # the group of the feature axis of the current activations
    last_layer = None
    counter = 0
    previous = None  # the leaf before the current one
    for n, m in leaves:
        kind = type(m).__name__
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)):
            out = None
            if n != weighted[-1]:
                counter += 1
                out = f"P{counter}"
            if isinstance(m, nn.Linear):
                parts.append(dense(n, current, out, bias=m.bias is not None))
            else:
                if current is not None and (current.inner != 1 or current.outer != 1):
                    raise UnsupportedLayerError(f"layer {n!r}: a convolution after Flatten is not supported")
                parts.append(conv(n, current, out, bias=m.bias is not None, ndim=m.weight.dim() - 2))
            current = Axis(out) if out is not None else None
            last_layer = n
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            if current is None or current.inner != 1:
                raise UnsupportedLayerError(f"layer {n!r}: BatchNorm must follow a hidden Linear/Conv layer")
            if previous != last_layer:  # after an activation: no fold into the layer before; the graph tells
                return spec_from_graph(model, example_input)
            parts.append(batchnorm(n, current.group, after=last_layer, eps=float(m.eps)))
        elif kind == "Flatten":
            shape = shapes[n]
            if current is not None:
                if m.start_dim != 1 or len(shape) < 3:
                    raise UnsupportedLayerError(f"layer {n!r}: only Flatten(start_dim=1) of (N, C, ...) is supported")
                current = Axis(current.group, inner=int(np.prod(shape[2:])))
        elif kind == "Unflatten":
            if current is not None:
                raise UnsupportedLayerError(f"layer {n!r}: Unflatten is supported only before the first layer")
        # pass-through modules keep `current`; PositionAware layers are not permutation-invariant
        # by design (that is what they are for) and have no state_dict entries: the spec records
        # their encodings instead (below).
        previous = n
    spec = chain(
        *parts,
        output=tuple(k for k in (f"{weighted[-1]}.weight", f"{weighted[-1]}.bias") if k in dict(model.state_dict())),
    )
    encodings = _traced_encodings(spec, dict(leaves), calls)
    return replace(spec, encodings=encodings) if encodings else spec


def spec_with_encodings(model: nn.Module, spec: PermutationSpec | None = None, example_input=None) -> PermutationSpec:
    """``spec``, or the one traced from ``model``; refuses a spec that misses ``model``'s position encodings.

    Matching a network with position-aware layers needs their encodings in the spec (they are
    folded into the weights, :mod:`bayesfuse.inference.encodings`); a spec built by hand
    without them would fuse the networks into a different function.
    """
    if spec is None:
        return spec_from_module(model, example_input)
    pans = [n for n, m in model.named_modules() if type(m).__name__ == "PositionAware" and not m.config.off]
    if pans and not spec.encodings:
        raise ValueError(
            f"the network has position-aware layers ({', '.join(pans[:3])}) but the spec records no encodings, so "
            "matching would change the function; pass spec=None to trace it, or give the spec its encodings "
            "(bayesfuse.nets.tracing.spec_from_module(model) records them)"
        )
    return spec


def _example_input(leaves: list, example_input):
    """``example_input``, or zeros for a network that starts with ``nn.Linear`` or ``nn.Unflatten``,
    in the dtype of the network's first floating-point leaf (a float64 network, float64 zeros)."""
    like = next((t for _, m in leaves if (t := floating_like(m)) is not None), None)
    dtype = like.dtype if like is not None else None
    if example_input is not None:
        if dtype is not None and isinstance(example_input, torch.Tensor) and example_input.is_floating_point():
            return example_input.to(dtype)
        return example_input
    first = leaves[0][1] if leaves else None
    if isinstance(first, nn.Linear):
        return torch.zeros(2, first.in_features, dtype=dtype)
    if isinstance(first, nn.Unflatten):
        return torch.zeros(2, int(np.prod(first.unflattened_size)), dtype=dtype)
    raise ValueError("give example_input to trace a network that starts with neither nn.Linear nor nn.Unflatten")


def _trace(model: nn.Module, leaves: list, example_input) -> tuple[dict[str, tuple], list[str]]:
    """One forward pass in eval mode: the shape entering each leaf module, and the leaves in call order."""
    shapes: dict[str, tuple] = {}
    calls: list[str] = []

    def record(name, args):
        shapes[name] = tuple(args[0].shape)
        calls.append(name)

    hooks = [m.register_forward_pre_hook(lambda mod, args, name=n: record(name, args)) for n, m in leaves]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(example_input)
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    return shapes, calls


def _traced_encodings(spec: PermutationSpec, modules: dict, calls: list[str]) -> dict[str, Encoding]:
    """``group -> Encoding`` of each position-aware layer called in the trace, with the module it follows.

    A position-aware layer acts on the outputs of the leaf called just before it, which must be
    a hidden Linear/Conv layer or a batch norm of one (whose ``weight`` and ``bias`` its encoding
    folds into, :mod:`bayesfuse.inference.encodings`).
    """
    out: dict[str, Encoding] = {}
    for i, name in enumerate(calls):
        module = modules[name]
        if type(module).__name__ != "PositionAware":
            continue
        before = calls[i - 1] if i > 0 else None
        if not isinstance(modules.get(before), (nn.Linear, nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d)):
            raise UnsupportedLayerError(
                f"position-aware layer {name!r} follows {before!r}: to be matched it must directly follow a hidden "
                "Linear/Conv layer or its batch norm"
            )
        axes = next(
            (spec.axes[f"{before}.{p}"] for p in ("weight", "running_mean") if f"{before}.{p}" in spec.axes), None
        )
        if axes is None:
            raise UnsupportedLayerError(
                f"position-aware layer {name!r} follows {before!r}, which the spec does not describe"
            )
        if not axes or axes[0] is None:  # on the classes: no permutation moves them, every network has the same
            continue
        group = axes[0].group
        if group in out:
            raise UnsupportedLayerError(f"position-aware layer {name!r}: group {group} has two position encodings")
        c = module.config
        out[group] = Encoding(c.mode, c.period, c.amplitude, after=before)
    return out
