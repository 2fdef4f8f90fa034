"""state_dicts between torch and NumPy: the arrays the algorithms of :mod:`bayesfuse.inference` read."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import nn

__all__ = ["numpy_state", "tensor_state"]


def numpy_state(source) -> dict[str, np.ndarray]:
    """The state_dict of a module (or a mapping of tensors) as NumPy arrays, on the CPU."""
    state = source.state_dict() if isinstance(source, nn.Module) else source
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


def tensor_state(state: Mapping) -> dict[str, torch.Tensor]:
    """A NumPy state_dict as tensors, floating entries as float32 (torch's default)."""
    out = {}
    for k, v in state.items():
        a = np.asarray(v)
        out[k] = torch.as_tensor(a, dtype=torch.float32) if np.issubdtype(a.dtype, np.floating) else torch.as_tensor(a)
    return out
