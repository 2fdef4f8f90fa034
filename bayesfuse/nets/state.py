"""state_dicts between torch and NumPy: the arrays the algorithms of :mod:`bayesfuse.inference` read."""

from __future__ import annotations

import inspect
import math
from typing import Mapping

import numpy as np
import torch
from torch import nn

from bayesfuse._validation import as_input

__all__ = [
    "as_array",
    "numpy_state",
    "tensor_state",
    "floating_like",
    "model_input",
    "forward_error",
    "run_once",
    "load_state",
    "set_at",
    "tied_entries",
]

#: ``nn.RMSNorm`` (torch >= 2.4; none before): a LayerNorm without the mean, one scale per unit.
RMS_NORMS: tuple[type[nn.Module], ...] = tuple(getattr(nn, n) for n in ("RMSNorm",) if hasattr(nn, n))


def load_state(model: nn.Module, state: Mapping) -> nn.Module:
    """``model.load_state_dict(state)`` with the versions the model's own state_dict records (its
    ``_metadata``): a module that reads its version while loading (torchvision's MNASNet) refuses a
    plain dict. Returns ``model``."""
    own = model.state_dict()
    loaded = type(own)((k, torch.as_tensor(v)) for k, v in state.items())
    metadata = getattr(own, "_metadata", None)
    if metadata is not None:
        loaded._metadata = metadata  # type: ignore[attr-defined]
    model.load_state_dict(loaded)
    return model


def set_at(root: nn.Module, path: str, value) -> None:
    """Set what ``root`` holds at the dotted ``path`` (``"blocks.0.attn"``, ``"head.weight"``) to ``value``."""
    owner, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, leaf, value)


def tied_entries(model: nn.Module) -> list[list[str]]:
    """The names under which ``model``'s state_dict holds one tensor more than once, a list per
    tensor in the order :meth:`~torch.nn.Module.named_parameters` meets them: a weight tied to
    another layer's (``lm_head.weight = wte.weight``), a module held under two names."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is not None:
            names.setdefault(id(t), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def as_array(t: torch.Tensor) -> np.ndarray:
    """A tensor as a NumPy array on the CPU; bfloat16, which NumPy lacks, as float32 (exact)."""
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def numpy_state(source) -> dict[str, np.ndarray]:
    """The state_dict of a module (or a mapping of tensors) as NumPy arrays, on the CPU (bfloat16
    entries as float32, :func:`as_array`)."""
    state = source.state_dict() if isinstance(source, nn.Module) else source
    return {k: as_array(v) for k, v in state.items()}


def tensor_state(state: Mapping) -> dict[str, torch.Tensor]:
    """A NumPy state_dict as tensors, floating entries as float32 (torch's default)."""
    out = {}
    for k, v in state.items():
        a = np.asarray(v)
        out[k] = torch.as_tensor(a, dtype=torch.float32) if np.issubdtype(a.dtype, np.floating) else torch.as_tensor(a)
    return out


def floating_like(module: nn.Module) -> torch.Tensor | None:
    """The module's first floating-point parameter or buffer (its dtype and device), or None."""
    return next((t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()), None)


def model_input(x, module: nn.Module) -> torch.Tensor:
    """``x`` (NumPy or torch) as a tensor for ``module``, in the module's floating dtype
    (:func:`floating_like`; float32 without one); integers stay integers where the network reads
    ids (:func:`~bayesfuse._validation.as_input`)."""
    like = floating_like(module)
    return as_input(x, module, like.dtype if like is not None else torch.float32)


def forward_arguments(module: nn.Module, x) -> tuple:
    """The positional arguments that give ``module`` the input ``x``: the items of a tuple ``x``
    where ``forward`` requires several inputs (``forward(self, a, b)``, or takes ``*inputs``),
    else ``x`` alone (a ``forward(self, pair)`` or ``forward(self, pair, scale=1.0)`` reads its
    tuple whole)."""
    if not isinstance(x, tuple):
        return (x,)
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return (x,)
    required = [
        p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    several = len(required) > 1 or (not required and any(p.kind is p.VAR_POSITIONAL for p in parameters))
    return x if several else (x,)


def run_once(module: nn.Module, x) -> tuple[object, Exception | None]:
    """Run ``module`` once on ``x`` (eval mode, no gradients; its mode restored after): its
    output and None, or None and the exception its forward raised. A tuple ``x`` is the inputs
    of a ``forward`` of several (:func:`forward_arguments`)."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return module(*forward_arguments(module, x)), None
    except Exception as err:  # whatever the user's forward raises
        return None, err
    finally:
        module.train(was_training)


def saved_temperature(value: torch.Tensor, what: str) -> torch.Tensor:
    """``value``, a saved module's ``temperature`` buffer (:func:`bayesfuse.save`), refused in one
    line naming ``what`` unless it is one floating-point number, finite and > 0."""
    if value.shape != () or not value.is_floating_point() or not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{what}: the temperature must be one number > 0, got {value.tolist()}")
    return value


class OutputLogitsError(ValueError):
    """A ``forward`` that changes its output layer's logits after it (a scale, a second layer's
    logits added): an output-layer posterior cannot predict through it. No width is at fault."""


def forward_error(module: nn.Module, x) -> Exception | None:
    """The exception ``module``'s forward raises on ``x`` (:func:`run_once`), or None."""
    return run_once(module, x)[1]
