"""Permutation specs: which axes of which parameters each hidden permutation acts on.

A network's hidden units (neurons of a dense layer, channels of a convolution, hidden states
of an LSTM) can be reordered without changing its function, provided every parameter that
touches them is reordered the same way (FedMA section 2.2, eqs. 4-6; PANs eq. 1). A
:class:`PermutationSpec` names these permutation *groups* and says, for every entry of a
state_dict, which group permutes each of its axes::

    spec = chain(dense("fc1", None, "P1"), dense("fc2", "P1", "P2"), dense("fc3", "P2", None))
    spec.axes["fc2.weight"]  # (Axis("P2"), Axis("P1"))

An axis may hold a permuted group in blocks (:class:`Axis` ``outer``/``inner``): the input of a
dense layer after ``Flatten`` holds channel c's ``H*W`` pixels contiguously (``inner=H*W``); an
LSTM's ``weight_ih`` stacks the four gates' rows (``outer=4``).

Everything here is pure: names, shapes and arrays (NumPy arrays, or any array with ``shape``
and ``reshape`` such as torch tensors, which :func:`permute` keeps as they are). The matchers
of :mod:`bayesfuse.inference.layerwise` and :mod:`bayesfuse.inference.fedma` read these specs;
:func:`bayesfuse.nets.spec.spec_from_module` derives one from a torch module by tracing it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

__all__ = [
    "Axis",
    "Encoding",
    "PermutationSpec",
    "dense",
    "conv",
    "batchnorm",
    "lstm",
    "chain",
    "permute",
    "to_global_basis",
    "random_permutations",
    "spec_for_state_dict",
    "entry_order",
    "spec_to_dict",
    "spec_from_dict",
]

#: PyTorch's default batch-norm ``eps``: what a state_dict alone implies (it does not store eps).
BATCHNORM_EPS = 1e-5


@dataclass(frozen=True)
class Axis:
    """An axis of length ``outer * n * inner`` permuted by group ``group`` of size ``n``.

    Index ``(o, i, k)`` (row-major) holds unit ``i``; a permutation moves the middle index.
    """

    group: str
    outer: int = 1
    inner: int = 1

    def __post_init__(self) -> None:
        if self.outer < 1 or self.inner < 1:
            raise ValueError(f"outer and inner must be >= 1, got {self.outer}, {self.inner}")

    def size(self, length: int) -> int:
        """Number of units ``n`` given the axis length."""
        n, rest = divmod(length, self.outer * self.inner)
        if rest:
            raise ValueError(f"axis of length {length} is not {self.outer} x n x {self.inner}")
        return n


AxisLike = "Axis | str | None"


@dataclass(frozen=True)
class Encoding:
    """A fixed position encoding of a group's units (position-aware neurons, Li et al. 2022, eqs. 4-5).

    Unit ``j`` of a group of ``J`` units gets, where the network computes it,

    .. math::

        \\text{add:}\\quad z_j + e_j,\\quad e_j = A \\sin(2\\pi T j / J); \\qquad
        \\text{mul:}\\quad z_j\\, e_j,\\quad e_j = 1 + A \\sin(2\\pi T j / J)

    with ``T = period`` and ``A = amplitude``. ``z`` is the output of the module named
    ``after`` (the prefix of its ``weight`` and ``bias`` entries: the group's Linear/Conv
    layer, or the batch norm that follows it); ``None`` means the layer whose weight rows the
    group permutes. The encoding depends on ``J`` and is no parameter, so state_dicts do not
    hold it: the spec records it, and :mod:`bayesfuse.inference.encodings` folds it into the
    weights for matching and out again at the fused widths.
    """

    mode: str = "mul"
    period: float = 1.0
    amplitude: float = 0.1
    after: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("add", "mul"):
            raise ValueError(f"an encoding's mode is 'add' or 'mul', got {self.mode!r}")
        try:
            period, amplitude = float(self.period), float(self.amplitude)
        except (TypeError, ValueError):
            raise ValueError(f"an encoding's period and amplitude are numbers, got {self.period!r}, "
                             f"{self.amplitude!r}") from None
        if not (np.isfinite(period) and np.isfinite(amplitude)) or amplitude < 0:
            raise ValueError(f"an encoding's period must be finite and amplitude >= 0, got T={period}, A={amplitude}")
        if self.after is not None and not isinstance(self.after, str):
            raise ValueError(f"an encoding's 'after' names a module (a string) or is null, got {self.after!r}")
        object.__setattr__(self, "period", period)
        object.__setattr__(self, "amplitude", amplitude)

    @property
    def off(self) -> bool:
        """True when the encoding is constant (``T = 0`` or ``A = 0``), so permutations commute with it."""
        return self.period == 0 or self.amplitude == 0

    def to_dict(self) -> dict:
        """JSON-ready: ``{"mode", "period", "amplitude"}``, and ``"after"`` when set."""
        out = {"mode": self.mode, "period": self.period, "amplitude": self.amplitude}
        return out if self.after is None else {**out, "after": self.after}


def _axis(a) -> Axis | None:
    if a is None or isinstance(a, Axis):
        return a
    if isinstance(a, str):
        return Axis(a)
    raise TypeError(f"an axis is None, a group name or an Axis, got {a!r}")


@dataclass(frozen=True)
class PermutationSpec:
    """Permutation groups of a network and the parameter axes they act on.

    Attributes
    ----------
    axes : dict
        ``name -> tuple`` with one entry per dimension of the state_dict entry: ``None``
        (not permuted) or an :class:`Axis`.
    groups : tuple of str
        The hidden permutation groups in forward order (input to output).
    folds : dict
        ``batchnorm name -> name of the layer before it`` (a Linear/Conv whose output it
        normalises), for batch-norm folding (NAFI appendix E).
    output : tuple of str
        The output layer's entries (``weight``, ``bias``): their first axis is the classes.
    eps : dict
        ``batchnorm name -> its eps`` where it is not PyTorch's default ``1e-5``
        (:data:`BATCHNORM_EPS`); folding must use the layer's own.
    encodings : dict
        ``group -> Encoding``: the position encodings of groups with position-aware neurons
        (:class:`Encoding`); empty for plain networks.
    """

    axes: dict
    groups: tuple
    folds: dict = field(default_factory=dict)
    output: tuple = ()
    eps: dict = field(default_factory=dict)
    encodings: dict = field(default_factory=dict)

    def batchnorm_eps(self, name: str) -> float:
        """The ``eps`` of batch norm ``name`` (PyTorch's default unless the spec says otherwise)."""
        return float(self.eps.get(name, BATCHNORM_EPS))

    def __post_init__(self) -> None:
        fixed = {k: tuple(_axis(a) for a in v) for k, v in self.axes.items()}
        object.__setattr__(self, "axes", fixed)
        seen = {a.group for v in fixed.values() for a in v if a is not None}
        order = tuple(self.groups) if self.groups else tuple(sorted(seen))
        unknown = seen - set(order)
        if unknown:
            raise ValueError(f"groups {sorted(unknown)} are used by parameters but not listed in groups")
        object.__setattr__(self, "groups", order)
        object.__setattr__(self, "encodings", _encodings(self.encodings, order))

    def members(self, group: str) -> list[tuple[str, int]]:
        """``(name, dim)`` of every axis permuted by ``group``."""
        return [(k, d) for k, v in self.axes.items() for d, a in enumerate(v) if a is not None and a.group == group]

    def groups_of(self, name: str) -> list[str]:
        """The groups acting on entry ``name``, one per permuted axis."""
        return [a.group for a in self.axes[name] if a is not None]

    def sizes(self, state_dict: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Size of each group in ``state_dict``; checks the spec against it."""
        self.check(state_dict)
        out: dict[str, int] = {}
        for k, v in self.axes.items():
            shape = np.shape(state_dict[k])
            for d, a in enumerate(v):
                if a is not None:
                    out.setdefault(a.group, a.size(shape[d]))
        return out

    def check(self, state_dict: Mapping[str, np.ndarray], name: str = "state_dict") -> None:
        """Raise ``ValueError`` naming the entry when ``state_dict`` does not fit the spec."""
        missing = [k for k in self.axes if k not in state_dict]
        if missing:
            raise ValueError(f"{name} lacks entries {missing[:5]} that the architecture spec describes")
        extra = [k for k in state_dict if k not in self.axes]
        if extra:
            raise ValueError(f"{name} has entries {extra[:5]} that the architecture spec does not describe")
        sizes: dict[str, tuple[int, str]] = {}
        for k, v in self.axes.items():
            shape = np.shape(state_dict[k])
            if len(shape) != len(v):
                raise ValueError(f"{name}[{k!r}] has {len(shape)} dimensions, the spec describes {len(v)}")
            for d, a in enumerate(v):
                if a is None:
                    continue
                try:
                    n = a.size(shape[d])
                except ValueError as err:
                    raise ValueError(f"{name}[{k!r}] dimension {d}: {err}") from None
                if a.group in sizes and sizes[a.group][0] != n:
                    other_n, other = sizes[a.group]
                    raise ValueError(
                        f"{name}: group {a.group} has {n} units in {k!r} (shape {shape}) but {other_n} in {other!r}"
                    )
                sizes.setdefault(a.group, (n, k))


def _encodings(data, groups: Sequence[str]) -> dict:
    """``group -> Encoding`` from Encodings or their :meth:`Encoding.to_dict` form, for known groups."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a spec's 'encodings' maps group names to encodings, got {data!r}")
    out = {}
    for g, e in data.items():
        if g not in groups:
            raise ValueError(f"an encoding is given for group {g!r}, which is not among the groups {list(groups)}")
        if isinstance(e, Mapping):
            unknown = set(e) - {"mode", "period", "amplitude", "after"}
            if unknown:
                raise ValueError(f"the encoding of group {g!r} has unknown keys {sorted(unknown)}")
            e = Encoding(**e)
        elif not isinstance(e, Encoding):
            raise ValueError(f"the encoding of group {g!r} must be an Encoding or a mapping, got {e!r}")
        out[g] = e
    return out


def dense(name: str, in_group, out_group, *, bias: bool = True) -> PermutationSpec:
    """``nn.Linear``: ``weight`` is ``(out, in)``, ``bias`` is ``(out,)``."""
    axes = {f"{name}.weight": (out_group, in_group)}
    if bias:
        axes[f"{name}.bias"] = (out_group,)
    return PermutationSpec(axes, ())


def conv(name: str, in_group, out_group, *, bias: bool = True, ndim: int = 2) -> PermutationSpec:
    """``nn.Conv{ndim}d``: ``weight`` is ``(C_out, C_in, *kernel)``; channels are the units."""
    axes = {f"{name}.weight": (out_group, in_group, *([None] * ndim))}
    if bias:
        axes[f"{name}.bias"] = (out_group,)
    return PermutationSpec(axes, ())


def batchnorm(name: str, group, *, after: str | None = None, eps: float = 1e-5) -> PermutationSpec:
    """``nn.BatchNorm*d`` over the units of ``group``; ``after`` names the layer it follows and
    ``eps`` is the layer's (folding divides by ``sqrt(running_var + eps)``)."""
    if not (0.0 < eps < 1.0):
        raise ValueError(f"batch norm {name!r}: eps must lie in (0, 1) to fold it, got {eps}")
    axes = {f"{name}.{p}": (group,) for p in ("weight", "bias", "running_mean", "running_var")}
    axes[f"{name}.num_batches_tracked"] = ()
    return PermutationSpec(axes, (), folds={name: after} if after else {},
                           eps={name: float(eps)} if eps != BATCHNORM_EPS else {})


def lstm(name: str, in_group, hidden_group: str, *, num_layers: int = 1, bias: bool = True) -> PermutationSpec:
    """``nn.LSTM`` (unidirectional): gates stacked as 4 blocks of the hidden units.

    Layer k's input is layer k-1's hidden state, so each layer gets its own group
    ``f"{hidden_group}_{k}"`` for k > 0 (FedMA section 2.2: deep LSTMs layer by layer).
    """
    axes: dict = {}
    groups = []
    prev = in_group
    for k in range(num_layers):
        h = hidden_group if k == 0 else f"{hidden_group}_{k}"
        gates = Axis(h, outer=4)
        axes[f"{name}.weight_ih_l{k}"] = (gates, prev)
        axes[f"{name}.weight_hh_l{k}"] = (gates, Axis(h))
        if bias:
            axes[f"{name}.bias_ih_l{k}"] = (gates,)
            axes[f"{name}.bias_hh_l{k}"] = (gates,)
        groups.append(h)
        prev = h
    return PermutationSpec(axes, tuple(groups))


def chain(*parts: PermutationSpec, groups: Sequence[str] | None = None, output: Sequence[str] = ()) -> PermutationSpec:
    """Combine specs in forward order; groups are ordered by first appearance unless given."""
    axes: dict = {}
    folds: dict = {}
    eps: dict = {}
    encodings: dict = {}
    order: list[str] = []
    for part in parts:
        for k, v in part.axes.items():
            if k in axes:
                raise ValueError(f"entry {k!r} described twice")
            axes[k] = v
            for a in v:
                if a is not None and a.group not in order:
                    order.append(a.group)
        for g in part.groups:
            if g not in order:
                order.append(g)
        folds.update(part.folds)
        eps.update(part.eps)
        encodings.update(part.encodings)
    return PermutationSpec(axes, tuple(groups) if groups is not None else tuple(order), folds, tuple(output), eps,
                           encodings)


# --------------------------------------------------------------------------- arrays


def permute(state_dict: Mapping[str, np.ndarray], spec: PermutationSpec, perms: Mapping[str, np.ndarray]) -> dict:
    """Reorder units: new unit ``i`` of group ``g`` is old unit ``perms[g][i]``.

    Groups missing from ``perms`` stay as they are. Arrays keep their type (NumPy or torch).
    """
    out = {}
    for k, value in state_dict.items():
        a = value
        for d, axis in enumerate(spec.axes.get(k, ())):
            if axis is not None and axis.group in perms:
                a = _take_any(a, d, axis, np.asarray(perms[axis.group]))
        out[k] = a
    return out


def _take_any(a, dim: int, axis: Axis, index: np.ndarray):
    """Units ``index`` of axis ``dim`` (NumPy array or torch tensor, which stays one)."""
    n = axis.size(a.shape[dim])
    shape = tuple(a.shape)
    blocks = a.reshape(*shape[:dim], axis.outer, n, axis.inner, *shape[dim + 1 :])
    if isinstance(a, np.ndarray):
        out = np.take(blocks, index, axis=dim + 1)
    else:  # a torch tensor, so torch is loaded already
        import torch

        out = torch.index_select(blocks, dim + 1, torch.as_tensor(index, dtype=torch.long))
    return out.reshape(*shape[:dim], axis.outer * len(index) * axis.inner, *shape[dim + 1 :])


def to_global_basis(a: np.ndarray, dim: int, axis: Axis, assignment: np.ndarray, n_global: int,
                    fill: float = np.nan) -> np.ndarray:
    """Place local unit ``l`` of an axis at global position ``assignment[l]``.

    Positions of global units the client does not have hold ``fill`` (NaN marks them as
    unobserved; FedMA pads with zero "dummy" units, ``fill=0``).
    """
    a = np.asarray(a, dtype=np.float64)
    n = axis.size(a.shape[dim])
    assignment = np.asarray(assignment)
    if assignment.shape != (n,):
        raise ValueError(f"assignment has shape {assignment.shape}, the axis has {n} units")
    shape = a.shape
    blocks = a.reshape(*shape[:dim], axis.outer, n, axis.inner, *shape[dim + 1 :])
    out_shape = list(blocks.shape)
    out_shape[dim + 1] = n_global
    out = np.full(out_shape, fill, dtype=np.float64)
    index = [slice(None)] * out.ndim
    index[dim + 1] = assignment
    out[tuple(index)] = blocks
    return out.reshape(*shape[:dim], axis.outer * n_global * axis.inner, *shape[dim + 1 :])


def random_permutations(sizes: Mapping[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One uniformly random permutation per group."""
    return {g: rng.permutation(n) for g, n in sizes.items()}


# --------------------------------------------------------------------------- files and state_dicts


def spec_to_dict(spec: PermutationSpec) -> dict:
    """A JSON-ready description: ``{"axes": {name: [null | "P1" | {"group", "outer", "inner"}]}, ...}``.

    Position encodings, where the spec has any, are ``"encodings": {group: {"mode", "period",
    "amplitude"[, "after"]}}`` (:class:`Encoding`)."""
    def axis(a):
        if a is None:
            return None
        if a.outer == 1 and a.inner == 1:
            return a.group
        return {"group": a.group, "outer": a.outer, "inner": a.inner}

    out = {"axes": {k: [axis(a) for a in v] for k, v in spec.axes.items()}, "groups": list(spec.groups),
           "folds": dict(spec.folds), "output": list(spec.output), "eps": dict(spec.eps)}
    if spec.encodings:  # position-aware neurons (Encoding); plain networks' specs stay as they were
        out["encodings"] = {g: e.to_dict() for g, e in spec.encodings.items()}
    return out


def spec_from_dict(data: Mapping) -> PermutationSpec:
    """Inverse of :func:`spec_to_dict`; raises ``ValueError`` naming what is malformed."""
    if not isinstance(data, Mapping) or "axes" not in data or not isinstance(data["axes"], Mapping):
        raise ValueError("an architecture spec needs an 'axes' object mapping parameter names to lists of axes")

    def axis(name, a):
        if a is None or isinstance(a, str):
            return a
        if isinstance(a, Mapping) and isinstance(a.get("group"), str):
            try:
                return Axis(a["group"], int(a.get("outer", 1)), int(a.get("inner", 1)))
            except (TypeError, ValueError) as err:
                raise ValueError(f"spec entry {name!r}: bad axis {a!r} ({err})") from None
        raise ValueError(f"spec entry {name!r}: an axis is null, a group name or {{'group', 'outer', 'inner'}}, got {a!r}")

    axes = {}
    for name, v in data["axes"].items():
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"spec entry {name!r} must be a list with one axis per dimension, got {v!r}")
        axes[name] = tuple(axis(name, a) for a in v)
    groups = _names(data.get("groups", []), "'groups' lists the hidden permutation groups in forward order")
    used = {a if isinstance(a, str) else a.group for v in axes.values() for a in v if a is not None}
    if len(set(groups)) != len(groups) or (groups and set(groups) != used):
        raise ValueError(f"a spec's 'groups' must list each group its axes use exactly once, got {groups} for "
                         f"the groups {sorted(used)}")
    output = _names(data.get("output", []), "'output' lists the output layer's entries")
    folds = data.get("folds", {})
    if not isinstance(folds, Mapping) or not all(isinstance(v, str) for v in folds.values()):
        raise ValueError(f"a spec's 'folds' maps batch-norm names to the names of the layers before them, "
                         f"got {folds!r}")
    eps = data.get("eps", {})
    if not isinstance(eps, Mapping) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1 for v in eps.values()):
        raise ValueError(f"a spec's 'eps' maps batch-norm names to numbers in (0, 1), got {eps!r}")
    return PermutationSpec(axes, tuple(groups), dict(folds), tuple(output), {k: float(v) for k, v in eps.items()},
                           data.get("encodings", {}))  # position encodings (Encoding), checked by the spec


def _names(value, what: str) -> list[str]:
    """``value`` as a list of names, or ``ValueError`` saying ``what`` it should be."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"a spec's {what}: a list of names, got {value!r}")
    return list(value)


def entry_order(keys, shapes: Mapping[str, Sequence[int]] | None = None, name: str = "state_dict") -> list[str]:
    """The entries in forward order as far as names (or, given ``shapes``, shapes) tell.

    A state_dict saved by torch lists entries in module order; keep it. Formats that sort
    names (safetensors) lose it: then sort numerically-aware, so that ``"10.weight"`` follows
    ``"9.weight"`` (the order of ``nn.Sequential`` and ``nn.ModuleList`` children).

    ``shapes`` (name -> shape) says that the order is lost (a safetensors file written without
    bayesfuse's order metadata). Names then prove nothing, so a plain MLP's layers (2-D
    ``<p>weight`` entries, each with an optional 1-D ``<p>bias``) are put in the one order in
    which each layer's output width is the next layer's input width; other networks get the
    numerically-aware name order.

    Raises
    ------
    ValueError
        Given ``shapes``, when a plain MLP's layers chain in no order or in several (e.g. two
        layers of one shape, or as many inputs as hidden units): the file cannot say which
        network it holds.
    """
    keys = list(keys)
    natural = lambda k: [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", k)]  # noqa: E731
    if shapes is None:
        return keys if keys != sorted(keys) else sorted(keys, key=natural)
    keys = sorted(keys, key=natural)
    layers = _dense_layers(keys, {k: tuple(int(n) for n in shapes[k]) for k in keys})
    if layers is None:
        return keys
    widths = [(shapes[w][1], shapes[w][0]) for w, _ in layers]
    count, trail = _chains(widths)
    if count != 1:
        listing = ", ".join(f"{w} {tuple(shapes[w])}" for w, _ in layers)
        if count == 0:
            raise ValueError(f"{name}: its Linear layers chain in no order (each layer's output width must be the "
                             f"next layer's input width): {listing}")
        raise ValueError(f"{name}: the file does not record the order of its layers, and their shapes chain in "
                         f"{count} different orders ({listing}); give the architecture as a spec (spec_path=FILE), "
                         "or use a file that records the order (.pt, or .safetensors saved by bayesfuse)")
    return [k for i in trail for k in layers[i] if k is not None]


def _dense_layers(keys: list[str], shapes: Mapping[str, tuple]) -> list[tuple[str, str | None]] | None:
    """``(weight, bias or None)`` of each layer when ``keys`` are exactly a plain MLP's, else ``None``."""
    weights = [k for k in keys if len(shapes[k]) == 2]
    if not weights or not all(w.endswith("weight") for w in weights):
        return None
    biases = {w: w[: -len("weight")] + "bias" for w in weights}
    layers = [(w, b if shapes.get(b) == shapes[w][:1] else None) for w, b in biases.items()]
    if {k for layer in layers for k in layer if k is not None} != set(keys):
        return None  # convolutions, batch norms, LSTMs, mismatched biases: not a plain MLP
    return layers


def _chains(edges: list[tuple[int, int]]) -> tuple[int, list[int]]:
    """How many orders of the layers ``(in width, out width)`` chain, and one of them.

    The orders that chain are the Eulerian trails of the multigraph whose vertices are widths
    and whose edges are the layers; the BEST theorem counts them (van Aardenne-Ehrenfest and de
    Bruijn 1951): ``t_w * prod_v (outdeg(v) - 1)!`` Eulerian circuits, ``t_w`` the number of
    spanning arborescences (a minor of the Laplacian). A trail from ``s`` to ``t`` is a circuit
    through an added edge ``t -> s``; a circuit (inputs as wide as outputs) starts at any of its
    ``m`` edges. Returns ``(0, [])`` when none chains, the trail (layer indices) of the first
    one found otherwise.
    """
    vertices = sorted({v for e in edges for v in e})
    index = {v: i for i, v in enumerate(vertices)}
    balance = np.zeros(len(vertices), dtype=int)
    for u, v in edges:
        balance[index[u]] += 1
        balance[index[v]] -= 1
    starts, ends = np.flatnonzero(balance == 1), np.flatnonzero(balance == -1)
    if np.abs(balance).max() > 1 or len(starts) > 1 or len(ends) > 1:
        return 0, []
    start = vertices[starts[0]] if len(starts) else edges[0][0]
    closed = edges + [(vertices[ends[0]], start)] if len(starts) else edges
    adjacency = np.zeros((len(vertices), len(vertices)))
    for u, v in closed:
        adjacency[index[u], index[v]] += 1
    out_degree = adjacency.sum(1)
    laplacian = np.diag(out_degree) - adjacency
    trees = int(round(np.linalg.det(laplacian[1:, 1:])))
    if trees < 1:  # not connected
        return 0, []
    count = trees * math.prod(math.factorial(int(d) - 1) for d in out_degree)
    return (count if len(starts) else count * len(edges)), _euler_trail(edges, start)


def _euler_trail(edges: list[tuple[int, int]], start: int) -> list[int]:
    """Hierholzer's algorithm: the edges of an Eulerian trail from ``start`` (one exists)."""
    pending: dict[int, list[int]] = {}
    for i in reversed(range(len(edges))):
        pending.setdefault(edges[i][0], []).append(i)
    stack, trail = [(start, -1)], []
    while stack:
        vertex, via = stack[-1]
        if pending.get(vertex):
            i = pending[vertex].pop()
            stack.append((edges[i][1], i))
        else:
            stack.pop()
            if via >= 0:
                trail.append(via)
    return trail[::-1]


def spec_for_state_dict(state_dict: Mapping, arch: str = "auto", name: str = "state_dict", *,
                        ordered: bool | None = None) -> PermutationSpec:
    """Derive the spec of a plain feed-forward or LSTM network from its entries' names and shapes.

    Entries are read in order. ``"lstm"``: ``<p>.weight_ih_l<k>`` ... of one ``nn.LSTM`` then one
    dense output layer. ``"mlp"``/``"cnn"``: 4-D weights are convolutions, 2-D weights dense
    layers, each followed by its ``bias``; a batch norm (``weight``, ``bias``, ``running_mean``,
    ``running_var``, ``num_batches_tracked``) follows its layer; a dense layer after a
    convolution reads its channels flattened (``inner = in_features / channels``). The last
    weighted layer is the output. ``"auto"`` picks ``"lstm"`` when LSTM entries are present.

    ``ordered`` says what the order of ``state_dict`` is worth: ``True``, the forward order;
    ``False``, none (a safetensors file from another tool: a plain MLP's order then comes from
    its shapes, see :func:`entry_order`); ``None`` (default), guess from the names.
    """
    if ordered is None:
        keys = entry_order(state_dict)
    elif ordered:
        keys = list(state_dict)
    else:
        keys = entry_order(state_dict, {k: np.shape(v) for k, v in state_dict.items()}, name)
    shapes = {k: tuple(np.shape(state_dict[k])) for k in keys}
    lstm_keys = [k for k in keys if re.search(r"\.weight_ih_l\d+$", k)]
    if arch not in ("auto", "mlp", "cnn", "lstm"):
        raise ValueError(f"unknown architecture {arch!r}; known: auto, mlp, cnn, lstm")
    if arch == "auto":
        arch = "lstm" if lstm_keys else ("cnn" if any(len(s) == 4 for s in shapes.values()) else "mlp")
    if arch == "lstm":
        if not lstm_keys:
            raise ValueError(f"{name}: no LSTM entries ('<name>.weight_ih_l0') found")
        prefix = lstm_keys[0].rsplit(".", 1)[0]
        n_layers = len(lstm_keys)
        rest = [k for k in keys if not k.startswith(prefix + ".")]
        weights = [k for k in rest if len(shapes[k]) == 2]
        if len(weights) != 1 or not weights[0].endswith("weight"):
            raise ValueError(f"{name}: an LSTM spec needs exactly one dense output layer after the LSTM, found {weights}")
        out = weights[0][: -len("weight")]
        top = "H" if n_layers == 1 else f"H_{n_layers - 1}"
        parts = [lstm(prefix, None, "H", num_layers=n_layers, bias=f"{prefix}.bias_ih_l0" in shapes),
                 dense(out.rstrip("."), top, None, bias=f"{out}bias" in shapes)]
        spec = chain(*parts, output=tuple(k for k in (f"{out}weight", f"{out}bias") if k in shapes))
        spec.check(state_dict, name)
        return spec
    layers: list[tuple[str, str]] = []  # (prefix, kind)
    i = 0
    while i < len(keys):
        k = keys[i]
        s = shapes[k]
        if k.endswith("weight") and len(s) in (2, 3, 4):
            layers.append((k[: -len("weight")].rstrip("."), "dense" if len(s) == 2 else "conv"))
        elif k.endswith("running_mean"):
            layers.append((k[: -len("running_mean")].rstrip("."), "bn"))
        elif k.endswith(("bias", "weight", "running_var", "num_batches_tracked")):
            pass
        else:
            raise ValueError(f"{name}: entry {k!r} {s} is neither a Linear/Conv weight, a bias nor batch-norm "
                             "state; describe the architecture with a spec (spec_from_dict) for this network")
        i += 1
    weighted = [p for p, kind in layers if kind != "bn"]
    if not weighted:
        raise ValueError(f"{name}: no Linear or Conv weights found")
    parts = []
    current: Axis | None = None
    channels = None
    counter = 0
    last = None
    for p, kind in layers:
        w = f"{p}.weight" if p else "weight"
        if kind == "bn":
            if current is None:
                raise ValueError(f"{name}: batch norm {p!r} does not follow a hidden layer")
            parts.append(batchnorm(p, current.group, after=last))
            continue
        out = None
        if p != weighted[-1]:
            counter += 1
            out = f"P{counter}"
        has_bias = f"{p}.bias" in shapes
        if kind == "conv":
            parts.append(conv(p, current, out, bias=has_bias, ndim=len(shapes[w]) - 2))
            channels = shapes[w][0]
        else:
            inp = current
            if current is not None and channels is not None:
                inner, rest = divmod(shapes[w][1], channels)
                if rest or inner == 0:
                    raise ValueError(f"{name}: dense layer {p!r} takes {shapes[w][1]} inputs, not a multiple of the "
                                     f"{channels} channels before it")
                inp = Axis(current.group, inner=inner)
            parts.append(dense(p, inp, out, bias=has_bias))
            channels = None
        current = _axis(out)
        last = p
    spec = chain(*parts, output=tuple(k for k in (f"{weighted[-1]}.weight", f"{weighted[-1]}.bias") if k in shapes))
    if arch == "mlp" and any(kind != "dense" for _, kind in layers):
        raise ValueError(f"{name}: arch='mlp' but the file holds convolutions or batch norms; use arch='cnn'")
    spec.check(state_dict, name)
    return spec
