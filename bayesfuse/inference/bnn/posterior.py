"""Mean-field posteriors of horseshoe BNNs as data: per-unit Gaussians, and back.

The guide of :class:`~bayesfuse.models.bnn.HorseshoeBNN` is one Gaussian per site of
:data:`~bayesfuse.inference.bnn.sites.SITES`, each in the space the guide's parameters live in
(weights and biases as they are, the horseshoe scales in log space). A hidden unit k is the
concatenation of its slices of the sites that have a unit axis, in the record's order:
``[w~_k (D), b~_k, log lambda_k, W_2[:, k] (K)]``. The other sites (``log_tau``, ``b2``) are
shared by all units and kept as one-component Gaussians. Packing and unpacking follow the
record, so a :class:`BNNPosterior` rebuilds exactly the same guide.

This module reads and writes state_dicts as NumPy arrays and does not import torch; only
:meth:`BNNPosterior.from_bnn` and :meth:`BNNPosterior.to_bnn` touch the torch module, whose
module (:data:`BNN_MODULE`, a layer above the algorithms) they import on first use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from bayesfuse.inference.bnn.sites import (
    GLOBAL_SITES,
    STATE_KEYS,
    UNIT_SITES,
    Prior,
    Site,
    layer_sites,
    read_prior,
    state_dims,
    state_keys,
    state_sizes,
)
from bayesfuse.inference.expfam import DiagNormal

__all__ = ["BNNPosterior", "HiddenLayer", "DeepBNNPosterior"]

#: The module of :class:`~bayesfuse.models.bnn.HorseshoeBNN` (Pyro and torch), imported by
#: :meth:`BNNPosterior.from_bnn` and :meth:`BNNPosterior.to_bnn` when called: the algorithms
#: import no module of the layers above them.
BNN_MODULE = "bayesfuse.models.bnn"


def _horseshoe_bnn() -> type[Any]:
    """The class :class:`~bayesfuse.models.bnn.HorseshoeBNN`, its module imported on first use."""
    return importlib.import_module(BNN_MODULE).HorseshoeBNN


#: The attribute of :class:`BNNPosterior` holding each site shared by all units.
_GLOBAL_FIELDS = {"b2": "out_bias", "log_tau": "log_tau"}
assert set(_GLOBAL_FIELDS) == {s.name for s in GLOBAL_SITES}


def _unit_axis(site: Site) -> int:
    """The axis a hidden unit indexes in ``site``, one of :data:`UNIT_SITES` (each has one)."""
    axis = site.unit_axis
    assert axis is not None, f"site {site.name} is shared by all units"
    return axis


def _unit_width(site: Site, D: int, K: int) -> int:
    """Number of columns a hidden unit's slice of ``site`` takes in :attr:`BNNPosterior.units`."""
    shape = list(site.shape(1, D, K))
    del shape[_unit_axis(site)]
    return int(np.prod(shape, dtype=np.int64))


def _pack(arrays: Mapping[str, np.ndarray], H: int) -> np.ndarray:
    """(H, D + 2 + K): per unit, its slices of the unit sites, unit axis first, flattened."""
    return np.hstack([np.moveaxis(arrays[s.name], _unit_axis(s), 0).reshape(H, -1) for s in UNIT_SITES])


def _as_numpy(value) -> np.ndarray:
    """A float64 NumPy copy of a torch tensor or array-like."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.array(value, dtype=np.float64)


@dataclass(frozen=True)
class BNNPosterior:
    """The mean-field posterior of a one-hidden-layer horseshoe BNN.

    Attributes
    ----------
    units : DiagNormal (H components of dimension D + 2 + K)
        Per unit: incoming weights, bias, log-scale, outgoing weights; :meth:`unit_layout`
        gives each site's columns.
    out_bias : DiagNormal (1 component of dimension K)
    log_tau : DiagNormal (1 component of dimension 1)
    in_features, n_classes : int
    global_scale, weight_scale : float
        The prior's settings, carried to rebuilt networks.
    prior : {"horseshoe", "gaussian"}
        The prior of the hidden layer (:data:`~bayesfuse.inference.bnn.sites.PRIORS`).
    """

    units: DiagNormal
    out_bias: DiagNormal
    log_tau: DiagNormal
    in_features: int
    n_classes: int
    global_scale: float
    weight_scale: float
    prior: str = "horseshoe"

    @property
    def prior_spec(self) -> Prior:
        """The prior with its scales (:class:`~bayesfuse.inference.bnn.sites.Prior`)."""
        return Prior(self.prior, self.global_scale, self.weight_scale)

    @property
    def hidden(self) -> int:
        return len(self.units)

    # ------------------------------------------------------------------ layout of a unit
    def unit_layout(self) -> tuple[tuple[str, slice], ...]:
        """``(site name, columns of units)`` for each site with a unit axis, in the record's order.

        For ``D`` inputs and ``K`` classes: ``w1`` ``[0, D)``, ``b1`` ``[D, D+1)``, ``log_lam``
        ``[D+1, D+2)``, ``w2`` ``[D+2, D+2+K)``.
        """
        layout, start = [], 0
        for site in UNIT_SITES:
            width = _unit_width(site, self.in_features, self.n_classes)
            layout.append((site.name, slice(start, start + width)))
            start += width
        return tuple(layout)

    def columns(self, site: str) -> slice:
        """The columns of :attr:`units` that hold a unit's slice of ``site`` (e.g. ``"w2"``)."""
        layout = dict(self.unit_layout())
        if site not in layout:
            raise KeyError(f"site {site!r} has no unit axis; unit sites: {', '.join(layout)}")
        return layout[site]

    @property
    def out_slice(self) -> slice:
        """The columns of :attr:`units` holding a unit's outgoing weights (site ``w2``)."""
        return self.columns("w2")

    # ------------------------------------------------------------------ state_dicts
    @classmethod
    def from_state(cls, state: Mapping[str, object], name: str = "state_dict") -> BNNPosterior:
        """Read a HorseshoeBNN state_dict (values torch tensors or NumPy arrays).

        Keys and shapes are checked against :data:`~bayesfuse.inference.bnn.sites.SITES`; each
        site's variance is ``exp(2 log_scale)``. Raises ``ValueError`` naming ``name`` for
        missing or unexpected keys, wrong shapes, and NaN or infinite means or variances.
        """
        H, D, K = state_dims(state, name)
        arrays = {k: _as_numpy(state[k]) for k in STATE_KEYS}
        loc = {k[len("loc.") :]: v for k, v in arrays.items() if k.startswith("loc.")}
        var = {k[len("log_scale.") :]: np.exp(2 * v) for k, v in arrays.items() if k.startswith("log_scale.")}
        for site, arr in list(loc.items()) + list(var.items()):
            if not np.isfinite(arr).all():
                raise ValueError(f"{name}'s guide parameter '{site}' contains NaN or infinite values")
        prior = read_prior(arrays["prior_scales"], name)
        shared = {
            _GLOBAL_FIELDS[s.name]: DiagNormal(loc=loc[s.name].reshape(1, -1), var=var[s.name].reshape(1, -1))
            for s in GLOBAL_SITES
        }
        return cls(
            units=DiagNormal(loc=_pack(loc, H), var=_pack(var, H)),
            **shared,
            in_features=D,
            n_classes=K,
            global_scale=prior.global_scale,
            weight_scale=prior.weight_scale,
            prior=prior.kind,
        )

    def to_state(self) -> dict[str, np.ndarray]:
        """The HorseshoeBNN state_dict of this posterior: float64 arrays, in the state_dict's key order.

        ``log_scale = log(var) / 2``; ``HorseshoeBNN.from_state_dict(p.to_state())`` rebuilds the guide.
        """
        H, D, K = self.hidden, self.in_features, self.n_classes
        locs: dict[str, np.ndarray] = {}
        variances: dict[str, np.ndarray] = {}
        for site, (_, columns) in zip(UNIT_SITES, self.unit_layout()):
            per_unit = list(site.shape(H, D, K))
            del per_unit[_unit_axis(site)]
            for out, a in ((locs, self.units.loc), (variances, self.units.var)):
                out[site.name] = np.moveaxis(a[:, columns].reshape(H, *per_unit), 0, _unit_axis(site))
        for site in GLOBAL_SITES:
            family = getattr(self, _GLOBAL_FIELDS[site.name])
            locs[site.name] = family.loc[0].reshape(site.shape(H, D, K))
            variances[site.name] = family.var[0].reshape(site.shape(H, D, K))
        state = {"prior_scales": self.prior_spec.to_array()}
        for key in STATE_KEYS[1:]:
            prefix, name = key.split(".")
            if prefix == "loc":
                state[key] = np.ascontiguousarray(locs[name], dtype=np.float64)
            else:
                state[key] = 0.5 * np.log(np.ascontiguousarray(variances[name], dtype=np.float64))
        return state

    # ------------------------------------------------------------------ torch modules
    @classmethod
    def from_bnn(cls, bnn) -> BNNPosterior:
        """Read the guide of ``bnn`` (a :class:`~bayesfuse.models.bnn.HorseshoeBNN`, whose guide is mean-field)."""
        if not isinstance(bnn, _horseshoe_bnn()):
            raise TypeError(f"expected a HorseshoeBNN (mean-field guide), got {type(bnn).__name__}")
        return cls.from_state(bnn.state_dict(), name="the BNN")

    def to_bnn(self):
        """A :class:`~bayesfuse.models.bnn.HorseshoeBNN` with ``len(units)`` hidden units and this guide."""
        return _horseshoe_bnn().from_state_dict(self.to_state(), name="the posterior")


@dataclass(frozen=True)
class HiddenLayer:
    """One hidden layer's mean-field posterior, per unit.

    Attributes
    ----------
    incoming : DiagNormal (H components of dimension n_in + 1)
        Per unit: incoming weights ``w~`` (one per unit of the layer below, or input), then bias ``b~``.
    log_lam : DiagNormal (H components of dimension 1)
    log_tau : DiagNormal (1 component of dimension 1)
    """

    incoming: DiagNormal
    log_lam: DiagNormal
    log_tau: DiagNormal

    @property
    def width(self) -> int:
        return len(self.incoming)

    def units(self, keep: np.ndarray) -> "HiddenLayer":
        """The layer restricted to the units ``keep`` (a boolean mask or indices)."""
        return HiddenLayer(incoming=self.incoming[keep], log_lam=self.log_lam[keep], log_tau=self.log_tau)


@dataclass(frozen=True)
class DeepBNNPosterior:
    """The mean-field posterior of a horseshoe BNN of any depth, layer by layer.

    Hidden layer ``l`` holds the sites ``w<l>``, ``b<l>``, ``log_lam<l>``, ``log_tau<l>``
    (:func:`~bayesfuse.inference.bnn.sites.layer_sites`); the output layer's weights are stored per
    unit of the top hidden layer, ``out_weights[k] = W_out[:, k]``.

    Attributes
    ----------
    layers : tuple of HiddenLayer
    out_weights : DiagNormal (H_L components of dimension K)
    out_bias : DiagNormal (1 component of dimension K)
    in_features, n_classes : int
    global_scale, weight_scale : float
    prior : {"horseshoe", "gaussian"}
        The prior of every hidden layer (:data:`~bayesfuse.inference.bnn.sites.PRIORS`).
    """

    layers: tuple[HiddenLayer, ...]
    out_weights: DiagNormal
    out_bias: DiagNormal
    in_features: int
    n_classes: int
    global_scale: float
    weight_scale: float
    prior: str = "horseshoe"

    @property
    def prior_spec(self) -> Prior:
        """The prior with its scales (:class:`~bayesfuse.inference.bnn.sites.Prior`)."""
        return Prior(self.prior, self.global_scale, self.weight_scale)

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        return tuple(layer.width for layer in self.layers)

    @classmethod
    def from_state(cls, state: Mapping[str, object], name: str = "state_dict") -> "DeepBNNPosterior":
        """Read a HorseshoeBNN state_dict of any depth (checked as
        :func:`~bayesfuse.inference.bnn.sites.state_sizes` does).

        Variances are ``exp(2 log_scale)``; raises ``ValueError`` naming ``name`` for a state_dict
        that is not a HorseshoeBNN's and for NaN or infinite means or variances.
        """
        hidden, D, K = state_sizes(state, name)
        arrays = {k: _as_numpy(v) for k, v in state.items()}
        for key, arr in arrays.items():
            if key != "prior_scales" and not np.isfinite(arr).all():
                raise ValueError(f"{name}'s guide parameter '{key.split('.', 1)[1]}' contains NaN or infinite values")
        prior = read_prior(arrays["prior_scales"], name)

        def normal(site: str, rows: int) -> DiagNormal:
            return DiagNormal(
                loc=arrays[f"loc.{site}"].reshape(rows, -1),
                var=np.exp(2 * arrays[f"log_scale.{site}"]).reshape(rows, -1),
            )

        layers = []
        for layer, H in enumerate(hidden, 1):
            n = layer_sites(layer)
            w, b = normal(n.w, H), normal(n.b, H)
            layers.append(
                HiddenLayer(
                    incoming=DiagNormal(loc=np.hstack([w.loc, b.loc]), var=np.hstack([w.var, b.var])),
                    log_lam=normal(n.log_lam, H),
                    log_tau=normal(n.log_tau, 1),
                )
            )
        out = len(hidden) + 1
        w_out = normal(f"w{out}", K)
        return cls(
            layers=tuple(layers),
            out_weights=DiagNormal(loc=w_out.loc.T.copy(), var=w_out.var.T.copy()),
            out_bias=normal(f"b{out}", 1),
            in_features=D,
            n_classes=K,
            global_scale=prior.global_scale,
            weight_scale=prior.weight_scale,
            prior=prior.kind,
        )

    def to_state(self) -> dict[str, np.ndarray]:
        """The HorseshoeBNN state_dict (float64 arrays, keys in the state_dict's order); inverse of
        :meth:`from_state`."""
        depth = len(self.layers)
        widths = (self.in_features,) + self.hidden_sizes
        for layer, (below, hl) in enumerate(zip(widths, self.layers), 1):
            if hl.incoming.loc.shape[1] != below + 1:
                raise ValueError(
                    f"hidden layer {layer} has {hl.incoming.loc.shape[1] - 1} incoming weights per unit, "
                    f"the layer below has {below} units"
                )
        if self.out_weights.loc.shape != (widths[-1], self.n_classes):
            raise ValueError(f"out_weights must be ({widths[-1]}, {self.n_classes}), got {self.out_weights.loc.shape}")
        loc, var = {}, {}
        for layer, hl in enumerate(self.layers, 1):
            n = layer_sites(layer)
            loc[n.w], var[n.w] = hl.incoming.loc[:, :-1], hl.incoming.var[:, :-1]
            loc[n.b], var[n.b] = hl.incoming.loc[:, -1], hl.incoming.var[:, -1]
            loc[n.log_lam], var[n.log_lam] = hl.log_lam.loc[:, 0], hl.log_lam.var[:, 0]
            loc[n.log_tau], var[n.log_tau] = hl.log_tau.loc[0], hl.log_tau.var[0]
        loc[f"w{depth + 1}"], var[f"w{depth + 1}"] = self.out_weights.loc.T, self.out_weights.var.T
        loc[f"b{depth + 1}"], var[f"b{depth + 1}"] = self.out_bias.loc[0], self.out_bias.var[0]
        state = {"prior_scales": self.prior_spec.to_array()}
        for key in state_keys(depth)[1:]:
            prefix, site = key.split(".")
            value = loc[site] if prefix == "loc" else 0.5 * np.log(var[site])
            state[key] = np.ascontiguousarray(value, dtype=np.float64)
        return state
