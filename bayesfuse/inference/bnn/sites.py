"""The parameter space of :class:`~bayesfuse.models.bnn.HorseshoeBNN`'s guide, as a record of sites.

Like Pyro's ``AutoNormal``, the guide is one Gaussian per site, in the site's unconstrained
space: ``w1``, ``b1``, ``w2``, ``b2`` are Gaussian as they are; the scales ``lambda`` and
``tau`` are log-normal, so their sites ``log_lam`` and ``log_tau`` are Gaussians over the log.
Each site's axes are named by the network's sizes (``H`` hidden units, ``D`` inputs, ``K``
classes); the axis named ``H`` is the one a hidden unit indexes. The state_dict stores site
``s`` as ``loc.<s>`` and ``log_scale.<s>`` (the Gaussian's mean and log standard deviation),
next to ``prior_scales``, the prior (:class:`Prior`): ``[global_scale, weight_scale]`` for the
horseshoe, ``[scale, weight_scale, 1]`` for the Gaussian prior (its last entry the prior's index
in :data:`PRIORS`; a horseshoe's vector has none, so files written before there was a choice read
as they were).

Deeper networks (``hidden=(H1, H2, ...)``, :func:`deep_site_shapes`) keep these names for
their first hidden layer and number the others: hidden layer ``l >= 2`` has ``w<l>`` (H_l,
H_{l-1}), ``b<l>``, ``log_lam<l>`` and ``log_tau<l>``, and the output layer of a network of depth
L is ``w<L+1>``, ``b<L+1>``. A one-hidden-layer network is the record above exactly.

Everything here is plain Python and NumPy: it reads state_dicts without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from bayesfuse.inference.spec import PermutationSpec

__all__ = [
    "unit_group",
    "bnn_spec",
    "Site",
    "SITES",
    "UNIT_SITES",
    "GLOBAL_SITES",
    "STATE_KEYS",
    "HEAD_KEYS",
    "has_heads",
    "body_state",
    "LayerSites",
    "layer_sites",
    "deep_site_shapes",
    "state_keys",
    "state_depth",
    "state_sizes",
    "is_bnn_state",
    "prior_scales",
    "state_dims",
    "PRIORS",
    "DEFAULT_GLOBAL_SCALE",
    "Prior",
    "read_prior",
    "check_same_prior",
]

_SIZES = ("H", "D", "K")


@dataclass(frozen=True)
class Site:
    """One guide site: a Gaussian of shape ``shape(H, D, K)`` over the site's unconstrained value.

    Attributes
    ----------
    name : str
        The guide's parameter name, also the state_dict suffix (``loc.<name>``, ``log_scale.<name>``).
    axes : tuple of str or int
        Each axis's size: ``"H"``, ``"D"``, ``"K"`` or a fixed int.
    transform : {"identity", "log"}
        The space the Gaussian lives in: the value itself (weights, biases) or its log
        (horseshoe scales, whose guide is log-normal).
    """

    name: str
    axes: tuple[str | int, ...]
    transform: str = "identity"

    def __post_init__(self):
        if self.transform not in ("identity", "log"):
            raise ValueError(f"site {self.name}: transform must be 'identity' or 'log', got {self.transform!r}")
        if self.axes.count("H") > 1 or any(isinstance(a, str) and a not in _SIZES for a in self.axes):
            raise ValueError(f"site {self.name}: axes must be 'H' (at most once), 'D', 'K' or ints, got {self.axes}")

    def shape(self, H: int, D: int, K: int) -> tuple[int, ...]:
        """The site's shape for ``H`` hidden units, ``D`` inputs and ``K`` classes."""
        sizes = {"H": H, "D": D, "K": K}
        return tuple(sizes[a] if isinstance(a, str) else a for a in self.axes)

    @property
    def unit_axis(self) -> int | None:
        """The axis a hidden unit indexes, or ``None`` for a site shared by all units."""
        return self.axes.index("H") if "H" in self.axes else None


#: The guide's sites, in the order the guide draws them for prediction.
SITES: tuple[Site, ...] = (
    Site("w1", ("H", "D")),
    Site("b1", ("H",)),
    Site("log_lam", ("H",), "log"),
    Site("log_tau", (1,), "log"),
    Site("w2", ("K", "H")),
    Site("b2", ("K",)),
)
#: Sites with one slice per hidden unit, and sites shared by all units.
UNIT_SITES: tuple[Site, ...] = tuple(s for s in SITES if s.unit_axis is not None)
GLOBAL_SITES: tuple[Site, ...] = tuple(s for s in SITES if s.unit_axis is None)

#: Keys of a HorseshoeBNN state_dict, in its order: the buffer, then both ``nn.ParameterDict``s
#: (which keep a plain dict's keys sorted).
STATE_KEYS: tuple[str, ...] = ("prior_scales",) + tuple(
    f"{prefix}.{name}" for prefix in ("loc", "log_scale") for name in sorted(s.name for s in SITES)
)


#: Deepest network :func:`state_depth` looks for.
MAX_DEPTH = 16


@dataclass(frozen=True)
class LayerSites:
    """The site names of one hidden layer: incoming weights, bias, unit log-scales, global log-scale."""

    w: str
    b: str
    log_lam: str
    log_tau: str


def unit_group(layer: int) -> str:
    """The name of hidden layer ``layer``'s units (1-based) as a group: ``"units"``, ``"units2"``...,
    in fused results and in a BNN summary's moments."""
    return "units" if layer == 1 else f"units{layer}"


def layer_sites(layer: int) -> LayerSites:
    """Names of hidden layer ``layer`` (1-based): ``w1, b1, log_lam, log_tau``, then ``w2, b2, log_lam2,
    log_tau2``..."""
    if int(layer) != layer or layer < 1:
        raise ValueError(f"hidden layers are numbered from 1, got {layer}")
    tag = "" if layer == 1 else str(layer)
    return LayerSites(w=f"w{layer}", b=f"b{layer}", log_lam=f"log_lam{tag}", log_tau=f"log_tau{tag}")


def deep_site_shapes(hidden: tuple[int, ...], D: int, K: int) -> dict[str, tuple[int, ...]]:
    """Shape of every guide site of a network with hidden layers ``hidden``, in the guide's order.

    Per hidden layer ``l``: ``w<l>`` (H_l, H_{l-1}) with ``H_0 = D``, ``b<l>``, ``log_lam<l>`` (H_l,),
    ``log_tau<l>`` (1,); then the output layer ``w<L+1>`` (K, H_L), ``b<L+1>`` (K,). For one hidden
    layer these are :data:`SITES`' shapes, in its order.
    """
    sizes = (int(D),) + tuple(int(h) for h in hidden)
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in range(1, len(sizes)):
        names = layer_sites(layer)
        H = sizes[layer]
        shapes.update({names.w: (H, sizes[layer - 1]), names.b: (H,), names.log_lam: (H,), names.log_tau: (1,)})
    L = len(hidden)
    shapes.update({f"w{L + 1}": (int(K), sizes[-1]), f"b{L + 1}": (int(K),)})
    return shapes


def state_keys(depth: int) -> tuple[str, ...]:
    """Keys of the state_dict of a network with ``depth`` hidden layers (:data:`STATE_KEYS` for 1)."""
    names = deep_site_shapes((1,) * int(depth), 1, 1)
    return ("prior_scales",) + tuple(f"{prefix}.{name}" for prefix in ("loc", "log_scale") for name in sorted(names))


def bnn_spec(depth: int) -> PermutationSpec:
    """The permutation spec of a HorseshoeBNN state_dict with ``depth`` hidden layers.

    Hidden layer ``l`` is group :func:`unit_group(l) <unit_group>`. Its units index the first
    axis of ``w<l>`` (whose second axis is the layer below's group, or the unpermuted inputs),
    ``b<l>`` and ``log_lam<l>``, both for the guide's means (``loc.``) and log standard deviations
    (``log_scale.``); ``log_tau<l>`` and ``prior_scales`` are shared by all units; the output
    layer ``w<depth+1>`` reads the top group on its second axis. Permuting a posterior's units
    by this spec (:func:`~bayesfuse.inference.spec.permute`) keeps the network's distribution
    over functions, so BNN posteriors are walked layer by layer like any network
    (:class:`~bayesfuse.inference.walk.GroupWalk`).

    Examples
    --------
    >>> spec = bnn_spec(2)
    >>> spec.groups
    ('units', 'units2')
    >>> spec.axes["loc.w2"]
    (Axis(group='units2', outer=1, inner=1), Axis(group='units', outer=1, inner=1))
    """
    depth = int(depth)
    if depth < 1:
        raise ValueError(f"a BNN has at least 1 hidden layer, got {depth}")
    groups = [unit_group(layer) for layer in range(1, depth + 1)]
    sites: dict[str, tuple] = {}
    for layer, group in enumerate(groups, start=1):
        names = layer_sites(layer)
        sites[names.w] = (group, groups[layer - 2] if layer > 1 else None)
        sites[names.b] = (group,)
        sites[names.log_lam] = (group,)
        sites[names.log_tau] = (None,)
    sites[f"w{depth + 1}"] = (None, groups[-1])
    sites[f"b{depth + 1}"] = (None,)
    axes: dict[str, tuple] = {"prior_scales": (None,)}
    for prefix in ("loc", "log_scale"):
        axes.update({f"{prefix}.{name}": value for name, value in sorted(sites.items())})
    return PermutationSpec(axes, tuple(groups), output=(f"loc.w{depth + 1}", f"loc.b{depth + 1}"))


def state_depth(state: Mapping[str, object]) -> int | None:
    """The number of hidden layers whose state_dict has exactly ``state``'s keys, or ``None``."""
    keys = set(state)
    depth = sum(1 for k in keys if isinstance(k, str) and k.startswith("loc.w")) - 1
    if 1 <= depth <= MAX_DEPTH and keys == set(state_keys(depth)):
        return depth
    return None


def is_bnn_state(state: Mapping[str, object]) -> bool:
    """Whether ``state`` has exactly the keys of a HorseshoeBNN state_dict (any depth, :func:`state_keys`)."""
    return state_depth(state) is not None


def state_sizes(state: Mapping[str, object], name: str = "state_dict") -> tuple[tuple[int, ...], int, int]:
    """``(hidden sizes, D, K)`` of a HorseshoeBNN state_dict of any depth, its shapes checked.

    Raises ``ValueError`` naming ``name`` when the keys are no HorseshoeBNN's or a shape does not
    fit :func:`deep_site_shapes`.
    """
    depth = state_depth(state)
    if depth is None:
        state_dims(state, name)  # raises, naming the missing and unexpected keys
    assert depth is not None  # state_dims raised otherwise
    return _checked_sizes(state, name, depth)


def _checked_sizes(state: Mapping[str, object], name: str, depth: int) -> tuple[tuple[int, ...], int, int]:
    """``(hidden sizes, D, K)`` of a state_dict with the keys of ``depth`` hidden layers, every
    shape checked against :func:`deep_site_shapes`."""
    weights = [_shape(state[f"loc.w{layer}"]) for layer in range(1, depth + 2)]
    if any(len(w) != 2 for w in weights):
        names = ", ".join(f"'loc.w{layer}'" for layer in range(1, depth + 2))
        raise ValueError(f"{name}: {names} must be 2-D, got shapes {', '.join(map(str, weights))}")
    hidden, D, K = tuple(w[0] for w in weights[:-1]), weights[0][1], weights[-1][0]
    sizes = f"H={hidden[0]} hidden units" if depth == 1 else f"hidden layers {hidden}"
    for site, expected in deep_site_shapes(hidden, D, K).items():
        for key in (f"loc.{site}", f"log_scale.{site}"):
            if _shape(state[key]) != expected:
                raise ValueError(
                    f"{name}: '{key}' has shape {_shape(state[key])}, expected {expected} "
                    f"for {sizes}, D={D} inputs, K={K} classes"
                )
    read_prior(state["prior_scales"], name)
    return hidden, D, K


def _shape(value) -> tuple[int, ...]:
    return tuple(int(n) for n in np.shape(value))


def state_dims(state: Mapping[str, object], name: str = "state_dict") -> tuple[int, int, int]:
    """``(H, D, K)`` of a HorseshoeBNN state_dict, after checking its keys and shapes against :data:`SITES`.

    Reads ``H, D`` from ``loc.w1`` and ``K`` from ``loc.w2``. Raises ``ValueError`` naming
    ``name`` (e.g. the file the state_dict came from) for missing or unexpected keys and for
    shapes that do not fit the record; a deeper network's state_dict is refused with a pointer
    to :func:`state_sizes`.
    """
    depth = state_depth(state)
    if depth is not None and depth > 1:
        raise ValueError(
            f"{name}: a HorseshoeBNN with {depth} hidden layers; this reads one-hidden-layer "
            f"networks (state_sizes reads any depth)"
        )
    missing = [k for k in STATE_KEYS if k not in state]
    unexpected = [k for k in state if k not in STATE_KEYS]
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"unexpected {', '.join(map(str, unexpected))}"] if unexpected else []
        )
        raise ValueError(f"{name}: not a HorseshoeBNN state_dict ({'; '.join(parts)})")
    (H,), D, K = _checked_sizes(state, name, 1)
    return H, D, K


#: The priors of a BNN's hidden layers (:class:`~bayesfuse.models.bnn.HorseshoeBNN`), by their
#: index in ``prior_scales``: the node-wise horseshoe (scales ``tau ~ C+(0, global_scale)`` and
#: ``lambda_k ~ C+(0, 1)``), or a Gaussian prior (scales fixed, ``tau = scale`` and ``lambda_k = 1``:
#: every hidden weight and bias ``~ N(0, scale^2)``).
PRIORS = ("horseshoe", "gaussian")

#: ``global_scale`` of each prior when none is given: the horseshoe's ``b_g``, the Gaussian's standard deviation.
DEFAULT_GLOBAL_SCALE = {"horseshoe": 0.1, "gaussian": 1.0}


@dataclass(frozen=True)
class Prior:
    """A BNN's prior: which one (:data:`PRIORS`) and its scales.

    Attributes
    ----------
    kind : {"horseshoe", "gaussian"}
    global_scale : float
        The horseshoe's ``b_g`` (``tau ~ C+(0, b_g)``), or the Gaussian's standard deviation of the
        hidden weights and biases.
    weight_scale : float
        Standard deviation of the output layer's Gaussian prior (both priors).
    """

    kind: str
    global_scale: float
    weight_scale: float

    def __post_init__(self):
        if self.kind not in PRIORS:
            raise ValueError(f"prior must be one of {', '.join(map(repr, PRIORS))}, got {self.kind!r}")
        if not (
            np.isfinite(self.global_scale)
            and np.isfinite(self.weight_scale)
            and self.global_scale > 0
            and self.weight_scale > 0
        ):
            raise ValueError("global_scale and weight_scale must be positive")

    def to_array(self) -> np.ndarray:
        """The ``prior_scales`` entry of a state_dict: ``[global_scale, weight_scale]`` (horseshoe),
        ``[global_scale, weight_scale, index]`` (the others), float64."""
        index = PRIORS.index(self.kind)
        return np.array([self.global_scale, self.weight_scale] + ([float(index)] if index else []), dtype=np.float64)

    def __str__(self) -> str:
        scale = "global_scale" if self.kind == "horseshoe" else "scale"
        return f"{self.kind}({scale}={self.global_scale:g}, weight_scale={self.weight_scale:g})"

    def same_as(self, other: "Prior") -> bool:
        """The same prior: the same kind and scales (to 1e-12 relative, float64 round-off of a setting)."""
        return self.kind == other.kind and bool(
            np.allclose(
                [self.global_scale, self.weight_scale], [other.global_scale, other.weight_scale], rtol=1e-12, atol=0.0
            )
        )


def read_prior(value, name: str = "state_dict") -> Prior:
    """The :class:`Prior` a state_dict's ``prior_scales`` holds (module docstring).

    Raises ``ValueError`` naming ``name`` for a shape other than (2,) or (3,), a last entry of a
    (3,) vector that names no prior other than the horseshoe, and scales that are not positive
    finite numbers.
    """
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu()
        value = value.double() if value.is_floating_point() else value
    try:
        scales = np.asarray(value)
    except (TypeError, ValueError, RuntimeError):
        scales = np.asarray(None)
    numeric = scales.dtype != bool and np.issubdtype(scales.dtype, np.number) and not np.iscomplexobj(scales)
    if numeric and scales.shape == (3,) and float(scales[2]) not in [float(i) for i in range(1, len(PRIORS))]:
        raise ValueError(
            f"{name}: 'prior_scales' has shape (3,), expected (2,) for the horseshoe (global_scale, "
            f"weight_scale) or (3,) ending in 1 for the Gaussian prior (scale, weight_scale, 1); got "
            f"{scales.tolist()}"
        )
    if numeric and scales.shape not in ((2,), (3,)):
        raise ValueError(f"{name}: 'prior_scales' has shape {scales.shape}, expected (2,)")
    if not numeric or not (np.isfinite(scales[:2]).all() and (scales[:2] > 0).all()):
        shown = value if scales.dtype == object else scales.tolist()
        raise ValueError(
            f"{name}: not a consistent HorseshoeBNN state_dict ('prior_scales' must hold two positive "
            f"finite numbers, the prior's global_scale and weight_scale; got {shown!r})"
        )
    kind = PRIORS[int(scales[2])] if len(scales) == 3 else "horseshoe"
    return Prior(kind, float(scales[0]), float(scales[1]))


def prior_scales(value, name: str = "state_dict") -> tuple[float, float]:
    """``(global_scale, weight_scale)`` of a state_dict's ``prior_scales`` (:func:`read_prior`)."""
    prior = read_prior(value, name)
    return prior.global_scale, prior.weight_scale


def check_same_prior(priors: Sequence[Prior], names: Sequence[str] | None = None) -> Prior:
    """The one prior of networks to be fused; ``ValueError`` naming the first two that differ.

    Fusing posteriors under different priors would give the fused network one of them while its
    units were fitted under another, so it is refused rather than resolved silently.
    """
    names = list(names) if names is not None else [f"client {j}" for j in range(len(priors))]
    for name, prior in zip(names[1:], priors[1:]):
        if not prior.same_as(priors[0]):
            raise ValueError(
                f"cannot fuse BNNs trained with different priors: {name} has {prior}, {names[0]} has "
                f"{priors[0]}; train them with one prior (train_bnn(..., prior=, global_scale=, "
                "weight_scale=))"
            )
    return priors[0]


#: The entries a :class:`~bayesfuse.models.bnn_heads.HeadMixtureBNN` state_dict holds beside a
#: HorseshoeBNN's: per client j, the head's weights (J, K, H) and bias (J, K) as means and standard
#: deviations, and the class shares (J, K) that mix the heads.
HEAD_KEYS = ("heads.loc_w", "heads.scale_w", "heads.loc_b", "heads.scale_b", "heads.shares")


def has_heads(state: Mapping[str, object]) -> bool:
    """Whether ``state`` holds any of the :data:`HEAD_KEYS` (a fused BNN with client heads, whole or damaged)."""
    return any(k in state for k in HEAD_KEYS)


def body_state(state: Mapping[str, object]) -> dict:
    """``state`` without the :data:`HEAD_KEYS`: a HeadMixtureBNN's shared-head HorseshoeBNN."""
    return {k: v for k, v in state.items() if k not in HEAD_KEYS}
