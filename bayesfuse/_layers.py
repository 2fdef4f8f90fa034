"""Whether a module computes as torch's own layer computes: shared by the tracer (which reads such
a module as a leaf) and the curvature's layer path (whose formulas are torch's layers')."""

from __future__ import annotations

import inspect

from torch import nn

__all__ = ["torch_layer", "renamed_torch_layer"]


def torch_layer(m: nn.Module) -> bool:
    """Whether ``m`` is a layer of ``torch.nn``, or one renamed (:func:`renamed_torch_layer`)."""
    return type(m).__module__.startswith("torch.nn") or renamed_torch_layer(m)


def renamed_torch_layer(m: nn.Module) -> bool:
    """Whether ``m`` is a torch layer under a class name of one's own (``class MyNorm(nn.BatchNorm2d):
    pass``): it derives from a torch layer, its own classes define no method but ``__init__`` (a
    ``forward``, a ``_conv_forward`` that scales the filters), it holds no function of its own
    (``self.forward = ...``) and it has no hooks."""
    mro = type(m).__mro__
    own = [c for c in mro if not c.__module__.startswith("torch.") and c is not object]
    if not own or not any(c.__module__.startswith("torch.nn") and c is not nn.Module for c in mro):
        return False  # torch's own class, or a module of one's own on nn.Module
    methods = any(
        inspect.isfunction(v) or isinstance(v, (staticmethod, classmethod, property))
        for c in own
        for k, v in vars(c).items()
        if k != "__init__"
    )
    hooks = any(getattr(m, h, None) for h in ("_forward_hooks", "_forward_pre_hooks"))
    functions = any(callable(v) and not isinstance(v, nn.Module) for v in vars(m).values())
    return not (methods or hooks or functions)
