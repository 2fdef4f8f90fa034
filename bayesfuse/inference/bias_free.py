"""Batch norms after layers without a bias (``Conv2d(bias=False)``, then ``BatchNorm2d``, as
ResNets and VGGs are written), folded through a bias of zeros and given back to the batch norm.

Folding a batch norm into the layer before it (NAFI appendix E, eq. 47) writes
``b' = c (b - mu) + beta`` with ``c = gamma / sqrt(var + eps)``: the layer needs a bias. A layer
without one has ``b = 0``; :func:`with_zero_biases` gives it that bias (and an affine-free batch
norm its ``gamma = 1``, ``beta = 0``), so that every matcher folds, matches and fuses as for any
other layer. The fused batch norm is then the identity (weight 1, bias 0, mean 0, variance
``1 - eps``) after a layer with bias ``b'``; :func:`biases_into_batchnorms` moves ``b'`` into the
batch norm's running mean, exactly, in eval mode: ``gamma (z + b' - mu) / sqrt(var + eps) + beta``
is the batch norm of ``z`` with running mean ``mu - b'``. The fused state then has the clients'
entries and loads into their network.

With client summaries the zero bias is known exactly: its GGN diagonal is ``+inf``, so that the
folded bias's precision is the batch norm's ``beta``'s (``1 / (c^2 / inf + 1 / pi_beta)``); an
affine-free batch norm's ``gamma`` and ``beta`` get the prior's precision alone (a GGN of 0),
except after a layer with a bias of its own, where ``beta = 0`` is known exactly (a GGN of
``+inf``) and the folded bias keeps the layer's, ``pi_b / c^2``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from bayesfuse.inference.spec import PermutationSpec

__all__ = [
    "Added",
    "missing_biases",
    "with_bias_axes",
    "add_zero_biases",
    "with_zero_biases",
    "biases_into_batchnorms",
    "added_keys",
]


@dataclasses.dataclass(frozen=True)
class Added:
    """The entries :func:`with_zero_biases` added for one fold: the layer's bias where it has none
    (``bias``), and the batch norm's weight and bias where it has no affine part."""

    layer: str
    bn: str
    affine: bool
    bias: bool
    weight: str  # the layer's weight entry (its last piece, where it reads streams side by side)
    rows: int = 0  # the weight's axis of the layer's units (1: a transposed convolution)

    @property
    def keys(self) -> tuple[str, ...]:
        return ((f"{self.layer}.bias",) if self.bias else ()) + (
            () if self.affine else (f"{self.bn}.weight", f"{self.bn}.bias")
        )


def _inserted(state: Mapping[str, Any], after: str, new: Mapping[str, Any]) -> dict:
    """``state`` with the entries ``new`` placed right after ``after`` (entry order is forward
    order), or last where ``state`` has no ``after`` (a summary's precisions hold no buffers)."""
    out: dict = {}
    for k, v in state.items():
        out[k] = v
        if k == after:
            out.update(new)
    out.update({k: v for k, v in new.items() if k not in out})
    return out


def missing_biases(state: Mapping[str, Any], spec: PermutationSpec) -> list[Added]:
    """The folds of ``spec`` whose layer has no bias in ``state``, or whose batch norm no affine part."""
    return [
        Added(
            layer,
            bn,
            f"{bn}.weight" in state,
            f"{layer}.bias" not in state,
            spec.parts(f"{layer}.weight")[-1],
            spec.rows_dim(f"{layer}.weight"),
        )
        for bn, layer in spec.folds.items()
        if spec.parts(f"{layer}.weight")[-1] in state and (f"{layer}.bias" not in state or f"{bn}.weight" not in state)
    ]


def with_bias_axes(spec: PermutationSpec, added: Sequence[Added]) -> PermutationSpec:
    """``spec`` with the added entries permuted with their layer's units."""
    axes = dict(spec.axes)
    for a in added:
        units = spec.axes[a.weight][a.rows]
        axes.update({k: (units,) for k in a.keys})
    return dataclasses.replace(spec, axes=axes)


def add_zero_biases(state: Mapping[str, Any], added: Sequence[Added], *, ggn: bool = False) -> dict:
    """``state`` with the entries ``added``: zero biases, an affine-free batch norm's weight 1 and
    bias 0; with ``ggn``, a summary's GGN diagonal of them (module docstring: ``inf``, ``0``)."""
    out = dict(state)
    for a in added:
        like = np.asarray(state[a.weight])
        n = int(like.shape[a.rows])
        dtype = np.float64 if ggn else like.dtype
        if a.bias:
            bias = np.full(n, np.inf if ggn else 0.0, dtype=dtype)
            out = _inserted(out, a.weight, {f"{a.layer}.bias": bias})
        if not a.affine:
            # with summaries: after a layer of its own bias, beta's exact 0 (a GGN of inf) leaves the
            # folded bias the layer's, pi_b / c^2; after a zero bias (itself inf), the prior alone
            known = np.inf if ggn and not a.bias else 0.0
            gamma = np.full(n, 0.0 if ggn else 1.0, dtype=dtype)
            beta = np.full(n, known, dtype=dtype)
            out = _inserted(out, f"{a.bn}.running_var", {f"{a.bn}.weight": gamma, f"{a.bn}.bias": beta})
    return out


def with_zero_biases(
    states: Sequence[Mapping[str, Any]], spec: PermutationSpec, summaries: Sequence | None = None
) -> tuple[list[dict], PermutationSpec, list | None, list[Added]]:
    """States, spec and summaries in which every folded layer has a bias (module docstring).

    Returns
    -------
    states, spec, summaries, added
        The inputs with the zero biases (and an affine-free batch norm's unit weight and zero
        bias) added, and what was added, for :func:`biases_into_batchnorms`. Where nothing is
        missing, the inputs as they are and ``[]``.
    """
    added = missing_biases(states[0], spec)
    if not added:
        return [dict(sd) for sd in states], spec, None if summaries is None else list(summaries), []
    new_states = [add_zero_biases(sd, added) for sd in states]
    new_summaries = (
        None
        if summaries is None
        else [dataclasses.replace(s, precision=add_zero_biases(s.precision, added, ggn=True)) for s in summaries]
    )
    return new_states, with_bias_axes(spec, added), new_summaries, added


def biases_into_batchnorms(state: Mapping[str, Any], added: Sequence[Added], keys: Sequence[str]) -> dict:
    """The fused ``state`` with each added bias moved into its batch norm (module docstring) and
    the added entries removed, its entries in the order ``keys`` (the clients')."""
    out = dict(state)
    for a in added:
        if a.bias:  # a layer's own bias stays where it is
            bias = np.asarray(out.pop(f"{a.layer}.bias"))
            # BN(z + b) = gamma (z - (mu - b)) / sqrt(var + eps) + beta: exact whatever the batch norm holds
            out[f"{a.bn}.running_mean"] = np.asarray(out[f"{a.bn}.running_mean"]) - bias
        if not a.affine:
            out.pop(f"{a.bn}.weight")
            out.pop(f"{a.bn}.bias")
    return {k: out[k] for k in keys}


def added_keys(added: Sequence[Added]) -> set[str]:
    """Every entry :func:`with_zero_biases` added."""
    return {k for a in added for k in a.keys}
