"""Dead cells for projected LSTMs fused to as many projections as cells.

``nn.LSTM(proj_size=P)`` needs fewer projections than cells, ``P < H``. Matching gives the cells
and the projections a permutation, and a width, each; where the fused widths break that rule,
:func:`pad_projected_cells` adds cells that compute nothing, until ``H = P + 1``: zero rows in
each gate's block of ``weight_ih``, ``weight_hh`` and the biases, zero columns in ``weight_hr``.
Such a cell's gates are ``sigma(0) = 1/2`` and its candidate ``tanh(0) = 0``, so its state
``c_t = c_{t-1} / 2 + 0`` stays 0 from its zero start, its output ``o tanh(c) = 0``, and the
projection reads nothing from it: the network computes the same function, exactly.
"""

from __future__ import annotations

import re
from typing import Any, Collection, Mapping

import numpy as np

__all__ = ["pad_projected_cells"]

_PROJECTION = re.compile(r"(.*)\.weight_hr_l(\d+)(_reverse)?")
_GATED = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def pad_projected_cells(
    state: Mapping[str, Any], cells: Mapping[str, int] | None = None, *, only: Collection[str] | None = None
) -> tuple[dict, dict[str, tuple[int, int]]]:
    """``state`` with every projected LSTM whose projections are at least its cells given dead
    cells up to one more than its projections, and ``{module: (cells before, cells after)}``.

    Parameters
    ----------
    state : mapping of str to arrays
        A fused state_dict (NumPy arrays or tensors, every layer and direction of a module at one
        width, as :func:`bayesfuse.nets.arch.check_recurrent_widths` checks).
    cells : mapping of str to int, optional
        The cells each module named gets instead (at least those it has): dead cells added to
        any projected LSTM.
    only : collection of str, optional
        The modules that may be padded (default: every one). A network that reads an LSTM's
        cells elsewhere (its final ``c``) must not be: other layers would read the dead cells.

    Returns
    -------
    (dict, dict)
        The state (entries not padded are the given objects) and what was padded.
    """
    modules: dict[str, tuple[int, int]] = {}
    for key, value in state.items():
        found = _PROJECTION.fullmatch(key)
        if found and (only is None or found[1] in only):
            proj, have = np.shape(value)
            wide = int(cells[found[1]]) if cells is not None and found[1] in cells else int(proj) + 1
            if wide > have:
                modules[found[1]] = (int(have), wide)
    if not modules:
        return dict(state), {}
    out = dict(state)
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if module not in modules:
            continue
        have, wide = modules[module]
        gated = re.fullmatch(rf"({'|'.join(_GATED)})_l\d+(_reverse)?", leaf)
        if gated:  # (4 cells, ...): each gate's block of rows padded with zeros
            a = _numpy(value)
            blocks = a.reshape(4, have, *a.shape[1:])
            padding = [(0, 0), (0, wide - have)] + [(0, 0)] * (a.ndim - 1)
            out[key] = _like(np.pad(blocks, padding).reshape(4 * wide, *a.shape[1:]), value)
        elif _PROJECTION.fullmatch(key):  # (projections, cells): zero columns
            a = _numpy(value)
            out[key] = _like(np.pad(a, [(0, 0), (0, wide - have)]), value)
    return out, modules


def _numpy(value) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def _like(array: np.ndarray, value):
    """``array`` as the kind of ``value`` (a tensor of its dtype and device, or a NumPy array)."""
    if hasattr(value, "detach"):
        import torch  # a tensor was given, so torch is loaded already

        return torch.as_tensor(array, dtype=value.dtype, device=value.device)
    return array
