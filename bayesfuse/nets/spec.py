"""Permutation specs of torch modules, by tracing.

:func:`spec_from_module` derives the :class:`~bayesfuse.inference.spec.PermutationSpec` of an
``nn.Sequential`` (or takes the one a module's ``permutation_spec()`` method gives) by running
one example input through it. The spec itself, its combinators and the array functions that
read it live in :mod:`bayesfuse.inference.spec`, beside the matchers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from bayesfuse.inference.spec import Axis, PermutationSpec, batchnorm, chain, conv, dense

__all__ = ["SUPPORTED", "UnsupportedLayerError", "spec_from_module"]


class UnsupportedLayerError(TypeError):
    """A module whose permutation symmetry bayesfuse does not know."""


#: Modules that act within each unit (channel) and so pass a permutation through unchanged.
_PASSTHROUGH = ("ReLU", "LeakyReLU", "Tanh", "Sigmoid", "GELU", "ELU", "SiLU", "Dropout", "Dropout2d", "Identity",
                "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d")
SUPPORTED = ("Linear", "Conv1d", "Conv2d", "BatchNorm1d", "BatchNorm2d", "Flatten", "Unflatten",
             "PositionAware") + _PASSTHROUGH


def spec_from_module(model, example_input=None) -> PermutationSpec:
    """Derive the permutation spec of a network.

    A module with a ``permutation_spec()`` method (the LSTM classifier, :class:`MLP`) supplies
    its own. An ``nn.Sequential`` is traced: one forward pass of ``example_input`` records the
    shape entering each module; every Linear/Conv but the last opens a new group ``P1, P2, ...``,
    BatchNorm joins the group before it, ``Flatten`` turns channels into blocks of ``H*W`` inputs,
    and element-wise activations, pooling and dropout pass the group through. Anything else
    raises :class:`UnsupportedLayerError` naming the module and the supported types.
    """
    if hasattr(model, "permutation_spec"):
        return model.permutation_spec()
    if not isinstance(model, nn.Sequential):
        raise UnsupportedLayerError(
            f"cannot derive a permutation spec for {type(model).__name__}: give an nn.Sequential of "
            f"{', '.join(SUPPORTED)}, or a module with a permutation_spec() method, or build one with "
            "bayesfuse.inference.spec.chain(dense(...), conv(...), ...)"
        )
    leaves = [(n, m) for n, m in model.named_modules() if len(list(m.children())) == 0]
    for n, m in leaves:
        if type(m).__name__ not in SUPPORTED:
            raise UnsupportedLayerError(
                f"layer {n!r} ({type(m).__name__}) is not supported for matching; supported: {', '.join(SUPPORTED)}"
            )
    shapes: dict[str, tuple] = {}
    if example_input is None:
        first = leaves[0][1] if leaves else None
        if isinstance(first, nn.Linear):
            example_input = torch.zeros(2, first.in_features)
        elif isinstance(first, nn.Unflatten):
            example_input = torch.zeros(2, int(np.prod(first.unflattened_size)))
        else:
            raise ValueError("give example_input to trace a network that starts with neither nn.Linear nor nn.Unflatten")
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=n: shapes.__setitem__(name, tuple(args[0].shape)))
             for n, m in leaves]
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(example_input)
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()
    weighted = [n for n, m in leaves if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    if not weighted:
        raise ValueError("the network has no Linear or Conv layers")
    parts = []
    current: Axis | None = None  # the group of the feature axis of the current activations
    last_layer = None
    counter = 0
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
        # by design (that is what they are for) and have no state_dict entries.
    spec = chain(*parts, output=tuple(k for k in (f"{weighted[-1]}.weight", f"{weighted[-1]}.bias")
                                      if k in dict(model.state_dict())))
    return spec

