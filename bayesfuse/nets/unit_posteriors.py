"""A fused layer's global units as named independent Gaussians: what the ArviZ export, the exact
summary (:mod:`bayesfuse.analysis`) and the plots (:mod:`bayesfuse.plot`) read.

A fused layer holds G global units; unit g is a vector of D entries (its incoming weights, bias,
outgoing weights, ...), each an independent Gaussian

.. math::

    \\theta_{g,d} \\sim \\mathcal{N}(\\mu_{g,d}, \\sigma^2_{g,d}).

:func:`layer_gaussians` reads ``mu`` and ``sigma^2`` from any result: a
:class:`~bayesfuse.fusion.FusionResult` (one of its ``layers``, as its ``posteriors`` give
them), a matching (``mean``, ``var``) or a KL-fusion (its diagonal-Gaussian ``components``),
and names the D entries (:func:`entry_names`). Results are read through what they share, so this
module imports no result class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

__all__ = [
    "LayerGaussians",
    "select_layer",
    "layer_gaussians",
    "entry_names",
    "check_names",
    "fused_state",
    "is_gaussian_export",
]


@dataclass
class LayerGaussians:
    """One layer's global units as independent Gaussians with named entries.

    Attributes
    ----------
    mean, var : ndarray (G, D)
        ``mu`` and ``sigma^2`` of every entry of every global unit.
    names : list of str
        The D entries' names (:func:`entry_names`).
    names_source : str
        Where the names come from: ``"given"``, ``"bnn"``, ``"blocks"`` or ``"index"``.
    layer : object
        The per-layer result (``assignments``, ``objective``, ...).
    method : str
        ``"pfnm"``, ``"nafi"``, ``"kl"`` or the fusion's method.
    hyper : dict
        The fusion's (or matching's) hyper-parameters.
    label : str or None
        The layer's group (``"P1"``) or index within a fusion; ``None`` for a lone layer result.
    layer_hyper : dict or None
        The layer's own hyper-parameters, within a fusion (``None`` when it has none).
    """

    mean: np.ndarray
    var: np.ndarray
    names: list[str]
    names_source: str
    layer: Any
    method: str
    hyper: dict = field(default_factory=dict)
    label: str | None = None
    layer_hyper: dict | None = None

    @property
    def n_units(self) -> int:
        """G, the number of global units."""
        return self.mean.shape[0]


def select_layer(result, layer: int | str = 0) -> tuple[int | None, Any]:
    """``(index, layer result)`` of ``result``: for a fusion (anything with ``layers``) the layer
    at index ``layer`` or of group name ``layer``; any other result is its own layer (index ``None``).

    Raises
    ------
    ValueError
        For a fusion without matched layers (FedAvg) or an unknown group name.
    IndexError
        For a layer index out of range.
    """
    layers = getattr(result, "layers", None)
    if layers is None:
        return None, result
    if not layers:
        raise ValueError(f"a {getattr(result, 'method', 'fusion')} result has no matched layers")
    if isinstance(layer, str):
        groups = list(getattr(result, "groups", ()))
        if layer not in groups:
            raise ValueError(f"no layer {layer!r}; the matched groups are {groups}")
        layer = groups.index(layer)
    if not -len(layers) <= layer < len(layers):
        raise IndexError(f"layer {layer} out of range: the result has {len(layers)} matched layers")
    return layer % len(layers), layers[layer]


def _matching_method(hyper: Mapping) -> str:
    return "nafi" if float(hyper.get("kl_weight") or 0) > 0 else "pfnm"


def layer_gaussians(result, layer: int | str = 0, *, weight_names: Sequence[str] | None = None) -> LayerGaussians:
    """One layer of ``result`` as named independent Gaussians.

    Parameters
    ----------
    result : FusionResult, MatchResult or KLFusionResult
        A fusion (its layer ``layer``, mean and variance from ``result.posteriors``), a matching
        (``mean``, ``var``; torch tensors are copied to the host) or a KL-fusion (diagonal
        Gaussian ``components``: ``loc``, ``var``).
    layer : int or str
        Index into a fusion's ``layers`` or group name (``"P2"``); ignored for a lone layer result.
    weight_names : sequence of str, optional
        Names of the D entries, instead of those :func:`entry_names` finds.

    Raises
    ------
    TypeError
        For KL-fusion components that are not diagonal Gaussians, or a result with none of the above.
    ValueError
        For a posterior that is not (units, weights), or bad ``weight_names``.
    """
    index, fused = select_layer(result, layer)
    state = None
    if index is not None:
        mean, var = result.posteriors[index]
        groups = tuple(getattr(result, "groups", ()))
        label = groups[index] if groups else str(index)
        method, hyper = str(result.method), dict(getattr(result, "hyper", None) or {})
        layer_hyper = getattr(fused, "hyper", None)
        state = fused_state(result)
    elif hasattr(fused, "components"):
        comp = fused.components
        mean, var = getattr(comp, "loc", None), getattr(comp, "var", None)
        if mean is None or var is None or np.shape(var) != np.shape(mean):
            raise TypeError(f"diagonal-Gaussian components are needed, got {type(comp).__name__}")
        hyper = {
            "solver": getattr(fused, "solver", None),
            "cost_scale": getattr(fused, "cost_scale", None),
            "n_initial": getattr(fused, "n_initial", None),
            "family": getattr(comp, "name", type(comp).__name__),
        }
        method, label, layer_hyper = "kl", None, None
    elif hasattr(fused, "mean") and hasattr(fused, "var"):
        mean, var = fused.mean, fused.var
        hyper = dict(getattr(fused, "hyper", None) or {})
        method, label, layer_hyper = _matching_method(hyper), None, None
    else:
        raise TypeError(f"expected a fusion, a matching or a KL-fusion result, got {type(result).__name__}")
    mean, var = _host(mean), _host(var)
    if mean.ndim != 2:
        raise ValueError(f"the layer's posterior mean must be (units, weights), got shape {mean.shape}")
    var = np.broadcast_to(var, mean.shape)
    names, source = entry_names(fused, mean.shape[1], mean.shape[0], state=state, given=weight_names)
    return LayerGaussians(mean, var, names, source, fused, method, hyper, label, layer_hyper)


def _host(values) -> np.ndarray:
    """A float64 NumPy copy of an array or a torch tensor (on any device)."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def is_gaussian_export(obj) -> bool:
    """Whether ``obj`` is an ArviZ export with the exact ``loc`` and ``scale`` in ``constant_data``."""
    try:
        data = obj.constant_data
        return "loc" in data and "scale" in data
    except (AttributeError, KeyError, TypeError):
        return False


# ------------------------------------------------------------------------------ entry names


#: How a fused BNN's unit sites are named in the ``weight`` coordinate.
_BNN_ENTRY = {"w1": "in", "b1": "bias", "log_lam": "log_scale", "w2": "out"}


def _bnn_entry_names(state: Mapping, width: int) -> list[str] | None:
    """``in_0 .., bias, log_scale, out_0 ..`` when ``state`` is a horseshoe BNN's state_dict whose
    units have ``width`` entries (:class:`~bayesfuse.models.bnn_posterior.BNNPosterior`'s layout)."""
    from bayesfuse.models.bnn_sites import UNIT_SITES, body_state, state_depth, state_dims

    state = body_state(state)  # a HeadMixtureBNN's names are its body's
    if state_depth(state) != 1:  # deeper networks' units are named by position
        return None
    _, D, K = state_dims(state, "the fused BNN")
    names = []
    for site in UNIT_SITES:
        shape = list(site.shape(1, D, K))
        axis = site.unit_axis
        assert axis is not None  # every unit site has a unit axis
        del shape[axis]
        n = int(np.prod(shape, dtype=np.int64))
        base = _BNN_ENTRY.get(site.name, site.name)
        names += [base] if n == 1 else [f"{base}_{i}" for i in range(n)]
    return names if len(names) == width else None


def _block_entry_names(blocks: Sequence, width: int, n_units: int, state: Mapping | None) -> list[str] | None:
    """Entry names from ``hyper["blocks"]``: one label per entry, or one state_dict entry per
    block whose width (numbers per unit) comes from the fused ``state``."""
    blocks = list(blocks)
    if len(blocks) == width:  # one block label per entry
        labels = [b if isinstance(b, str) else f"block{b}" for b in blocks]
        sizes = {b: labels.count(b) for b in labels}
        seen: dict[str, int] = {}
        names = []
        for b in labels:
            names.append(b if sizes[b] == 1 else f"{b}[{seen.get(b, 0)}]")
            seen[b] = seen.get(b, 0) + 1
        return names
    if state is None or not all(isinstance(b, str) and b in state for b in blocks):
        return None
    names = []
    for k in blocks:
        numel = int(np.prod(np.shape(state[k]), dtype=np.int64))
        if numel % n_units:
            return None
        n = numel // n_units
        names += [k] if n == 1 else [f"{k}[{i}]" for i in range(n)]
    return names if len(names) == width else None


def check_names(names: Sequence, width: int) -> list[str]:
    """``names`` as strings, when they name all ``width`` entries once each."""
    names = [str(n) for n in names]
    if len(names) != width:
        raise ValueError(f"weight_names must name all {width} entries of a unit, got {len(names)} names")
    if len(set(names)) != width:
        raise ValueError("weight_names must be distinct")
    return names


def entry_names(
    layer, width: int, n_units: int, *, state: Mapping | None = None, given: Sequence[str] | None = None
) -> tuple[list[str], str]:
    """Names of a unit's ``width`` entries and where they came from.

    ``given`` names (``"given"``); for a fused horseshoe BNN (``state`` its state_dict)
    ``in_0 .. in_{D-1}``, ``bias``, ``log_scale``, ``out_0 .. out_{K-1}`` (``"bnn"``); for a
    matching whose ``hyper["blocks"]`` records the entries the network's entry names,
    ``layers.0.weight[3]``, ``layers.0.bias``, ... (``"blocks"``); otherwise ``dim_0 ..
    dim_{D-1}`` (``"index"``).
    """
    if given is not None:
        return check_names(given, width), "given"
    if state is not None:
        names = _bnn_entry_names(state, width)
        if names is not None:
            return names, "bnn"
    hyper = getattr(layer, "hyper", None) or {}
    blocks, widths = hyper.get("blocks"), hyper.get("block_widths")
    if blocks is not None and widths is not None and len(widths) == len(blocks) and sum(widths) == width:
        # each block's numbers per unit as the matching laid them out: entries the fused state_dict
        # holds otherwise (a piece of a weight reading streams side by side, a bias added to fold through)
        return [str(k) if n == 1 else f"{k}[{i}]" for k, n in zip(blocks, widths) for i in range(n)], "blocks"
    if blocks is not None:
        names = _block_entry_names(blocks, width, n_units, state)
        if names is not None:
            return names, "blocks"
    return [f"dim_{d}" for d in range(width)], "index"


def fused_state(result) -> Mapping | None:
    """The fused network's state_dict: ``result.model``'s (the network under a posterior's or the
    clients' heads, ``model.network``), or a StateFusion's ``state``."""
    model = getattr(result, "model", None)
    model = getattr(model, "network", model)
    if model is not None and hasattr(model, "state_dict"):
        return model.state_dict()
    state = getattr(result, "state", None)
    return state if isinstance(state, Mapping) else None
