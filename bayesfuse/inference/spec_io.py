"""Reading and writing permutation specs: a spec as JSON (:func:`spec_to_dict`,
:func:`spec_from_dict`), the forward order of a state_dict's entries (:func:`entry_order`), and
the spec of a plain feed-forward, convolutional or LSTM network read off its entries' names and
shapes (:func:`spec_for_state_dict`).

Pure like :mod:`bayesfuse.inference.spec` (names, shapes, arrays); the functions are also
importable from there.
"""

from __future__ import annotations

import math
import re
from typing import Mapping, Sequence

import numpy as np

from bayesfuse.inference.spec import Axis, PermutationSpec, as_axis, batchnorm, chain, conv, dense, lstm

__all__ = [
    "spec_for_state_dict",
    "spec_for_state_dict_or_advice",
    "entry_order",
    "spec_to_dict",
    "spec_from_dict",
    "possible_skip",
    "AmbiguousArchitectureError",
]


class AmbiguousArchitectureError(ValueError):
    """A state_dict whose entry names leave a skip connection possible: a plain chain read off them
    could fuse into a network that cannot run (:func:`possible_skip`)."""


def spec_to_dict(spec: PermutationSpec) -> dict:
    """A JSON-ready description: ``{"axes": {name: [null | "P1" | {"group", "outer", "inner"}]}, ...}``.

    Position encodings, where the spec has any, are ``"encodings": {group: {"mode", "period",
    "amplitude"[, "after"]}}`` (:class:`Encoding`); exchangeable heads ``"heads": [[prefix, ...], ...]``;
    entries held in pieces ``"pieces": {entry: [dim, [[piece, length or null], ...]]}``; the
    weights of transposed convolutions ``"transposed": [weight, ...]``; numbers modules hold
    that their forward reads as widths ``"widths": {"module.attribute": axis}``; entries that are
    one tensor under two names ``"tied": {alias: entry}``; units no permutation moves ``"in_place":
    {modules: why}``."""

    def axis(a):
        if a is None:
            return None
        if a.outer == 1 and a.inner == 1:
            return a.group
        return {"group": a.group, "outer": a.outer, "inner": a.inner}

    out = {
        "axes": {k: [axis(a) for a in v] for k, v in spec.axes.items()},
        "groups": list(spec.groups),
        "folds": dict(spec.folds),
        "output": list(spec.output),
        "eps": dict(spec.eps),
    }
    if spec.encodings:  # position-aware neurons (Encoding); plain networks' specs stay as they were
        out["encodings"] = {g: e.to_dict() for g, e in spec.encodings.items()}
    if spec.heads:  # exchangeable attention heads
        out["heads"] = [list(h) for h in spec.heads]
    if spec.fixed:  # groups whose width the forward fixes
        out["fixed"] = dict(spec.fixed)
    if spec.pieces:  # entries that hold several groups side by side, described by their pieces
        out["pieces"] = {k: [dim, [list(p) for p in pieces]] for k, (dim, pieces) in spec.pieces.items()}
    if spec.transposed:  # transposed convolutions: their units on axis 1
        out["transposed"] = list(spec.transposed)
    if spec.widths:  # numbers modules hold that their forward reads as widths
        out["widths"] = {k: axis(a) for k, a in spec.widths.items()}
    if spec.tied:  # entries that are one tensor under two names
        out["tied"] = dict(spec.tied)
    if spec.in_place:  # units no permutation moves, and why
        out["in_place"] = dict(spec.in_place)
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
        raise ValueError(
            f"spec entry {name!r}: an axis is null, a group name or {{'group', 'outer', 'inner'}}, got {a!r}"
        )

    axes = {}
    for name, v in data["axes"].items():
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"spec entry {name!r} must be a list with one axis per dimension, got {v!r}")
        axes[name] = tuple(axis(name, a) for a in v)
    groups = _names(data.get("groups", []), "'groups' lists the hidden permutation groups in forward order")
    used = {a if isinstance(a, str) else a.group for v in axes.values() for a in v if a is not None}
    if len(set(groups)) != len(groups) or (groups and set(groups) != used):
        raise ValueError(
            f"a spec's 'groups' must list each group its axes use exactly once, got {groups} for "
            f"the groups {sorted(used)}"
        )
    output = _names(data.get("output", []), "'output' lists the output layer's entries")
    folds = data.get("folds", {})
    if not isinstance(folds, Mapping) or not all(isinstance(v, str) for v in folds.values()):
        raise ValueError(
            f"a spec's 'folds' maps batch-norm names to the names of the layers before them, got {folds!r}"
        )
    eps = data.get("eps", {})
    if not isinstance(eps, Mapping) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1 for v in eps.values()
    ):
        raise ValueError(f"a spec's 'eps' maps batch-norm names to numbers in (0, 1), got {eps!r}")
    return PermutationSpec(
        axes,
        tuple(groups),
        dict(folds),
        tuple(output),
        {k: float(v) for k, v in eps.items()},
        data.get("encodings", {}),  # position encodings (Encoding), checked by the spec
        data.get("heads", ()),  # exchangeable heads, checked by the spec
        data.get("fixed", {}),  # groups whose width the forward fixes, checked by the spec
        data.get("pieces", {}),  # entries described by their pieces, checked by the spec
        data.get("transposed", ()),  # transposed convolutions' weights, checked by the spec
        data.get("widths", {}),  # numbers modules hold that their forward reads as widths, checked by the spec
        data.get("tied", {}),  # entries that are one tensor under two names, checked by the spec
        data.get("in_place", {}),  # units no permutation moves, and why, checked by the spec
    )


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
            raise ValueError(
                f"{name}: its Linear layers chain in no order (each layer's output width must be the "
                f"next layer's input width): {listing}"
            )
        raise ValueError(
            f"{name}: the file does not record the order of its layers, and their shapes chain in "
            f"{count} different orders ({listing}); give the architecture as a spec (spec_path=FILE), "
            "or use a file that records the order (.pt, or .safetensors saved by bayesfuse)"
        )
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


def spec_for_state_dict(
    state_dict: Mapping, arch: str = "auto", name: str = "state_dict", *, ordered: bool | None = None
) -> PermutationSpec:
    """Derive the spec of a plain feed-forward or LSTM network from its entries' names and shapes.

    Entries are read in order. ``"lstm"``: ``<p>.weight_ih_l<k>`` ... of one ``nn.LSTM`` then one
    dense output layer. ``"mlp"``/``"cnn"``: 4-D weights are convolutions, 2-D weights dense
    layers, each followed by its ``bias``; a batch norm (``weight``, ``bias``, ``running_mean``,
    ``running_var``, ``num_batches_tracked``) follows its layer; a dense layer after a
    convolution reads its channels flattened (``inner = in_features / channels``). The last
    weighted layer is the output. ``"auto"`` picks ``"lstm"`` when LSTM entries are present.

    A chain is all names can show. With ``"auto"``, a network where a skip connection is
    possible (:func:`possible_skip`: a hidden layer as wide as the input or an earlier one,
    outside an ``nn.Sequential``) is refused with :class:`AmbiguousArchitectureError`: fusing a
    residual network as a chain gives one that cannot run. ``"mlp"`` / ``"cnn"`` say the network
    is a plain chain.

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
    guessed = arch == "auto"  # a chain read off names alone: refused where a skip connection is possible
    if arch == "auto":
        arch = "lstm" if lstm_keys else ("cnn" if any(len(s) == 4 for s in shapes.values()) else "mlp")
    if arch == "lstm":
        if not lstm_keys:
            raise ValueError(f"{name}: no LSTM entries ('<name>.weight_ih_l0') found")
        prefix = lstm_keys[0].rsplit(".", 1)[0]
        n_layers = len(lstm_keys)
        hh = shapes.get(f"{prefix}.weight_hh_l0", ())
        if len(hh) != 2 or hh[0] != 4 * hh[1]:
            raise ValueError(
                f"{name}: {prefix!r} has recurrent weights of shape {hh}, not an LSTM's (4H, H) (a GRU's are "
                "(3H, H)), and entry names do not show how the network uses it; give the network itself "
                "(like=model)"
            )
        rest = [k for k in keys if not k.startswith(prefix + ".")]
        weights = [k for k in rest if len(shapes[k]) == 2]
        if len(weights) != 1 or not weights[0].endswith("weight"):
            raise ValueError(
                f"{name}: an LSTM read off entry names needs exactly one dense output layer after it (the LSTM "
                f"classifier's), found {weights}; give the network itself (like=model) "
                "to trace it"
            )
        head = weights[0][: -len("weight")]
        top = "H" if n_layers == 1 else f"H_{n_layers - 1}"
        parts = [
            lstm(prefix, None, "H", num_layers=n_layers, bias=f"{prefix}.bias_ih_l0" in shapes),
            dense(head.rstrip("."), top, None, bias=f"{head}bias" in shapes),
        ]
        spec = chain(*parts, output=tuple(k for k in (f"{head}weight", f"{head}bias") if k in shapes))
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
        elif k.endswith("weight") and len(s) > 4:
            raise ValueError(
                f"{name}: entry {k!r} {s} is a 3-d convolution's weight, which a chain read off entry names "
                "does not cover; give the network itself (like=model) or a spec"
            )
        elif k.endswith(("bias", "weight", "running_var", "num_batches_tracked")):
            pass
        else:
            raise ValueError(
                f"{name}: entry {k!r} {s} is neither a Linear/Conv weight, a bias nor batch-norm "
                "state; describe the architecture with a spec (spec_from_dict) for this network"
            )
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
                    raise ValueError(
                        f"{name}: dense layer {p!r} takes {shapes[w][1]} inputs, not a multiple of the "
                        f"{channels} channels before it, so its layers do not chain as a plain network (a "
                        "transposed convolution, say), and a state_dict cannot show how they connect; give the "
                        "network itself (like=model) or a spec"
                    )
                inp = Axis(current.group, inner=inner)
            parts.append(dense(p, inp, out, bias=has_bias))
            channels = None
        current = as_axis(out)
        last = p
    spec = chain(*parts, output=tuple(k for k in (f"{weighted[-1]}.weight", f"{weighted[-1]}.bias") if k in shapes))
    if arch == "mlp" and any(kind != "dense" for _, kind in layers):
        raise ValueError(f"{name}: arch='mlp' but the file holds convolutions or batch norms; use arch='cnn'")
    extra = [k for k in keys if k not in spec.axes]
    if extra:
        raise ValueError(
            f"{name}: entries {extra[:5]} are not a plain chain's (Linear/Conv weights and biases, batch "
            "norms), so its names cannot describe the network; give the network itself (like=model) "
            "or a spec"
        )
    try:
        spec.check(state_dict, name)
    except ValueError as err:
        if not guessed:
            raise
        raise ValueError(
            f"{err}: its layers do not chain as a plain network (a residual network's shortcut, say), "
            "and a state_dict cannot show how they connect; give the network itself (like=model) or a "
            "spec"
        ) from None
    skip = possible_skip(state_dict, spec) if guessed else None
    if skip is not None:
        kind = "cnn" if any(k != "dense" for _, k in layers) else "mlp"
        raise AmbiguousArchitectureError(
            f"{name}: its entry names leave a skip connection possible ({_layer(skip[0])} and {_layer(skip[1])} are "
            f"both {skip[2]} wide) and a state_dict cannot show one; if the network is a plain chain say so with "
            f"arch='{kind}', else give the network itself (like=model)"
        )
    return spec


def spec_for_state_dict_or_advice(state_dict: Mapping, name: str, *, like: str = "like=model") -> PermutationSpec:
    """:func:`spec_for_state_dict` (``"auto"``) for a caller that takes a spec, not ``arch=``: its
    refusals advise ``spec=spec_for_state_dict(state, arch=...)`` to confirm a plain chain, and
    ``like`` (the caller's argument) to give the network itself.

    Raises
    ------
    AmbiguousArchitectureError
        The names leave a skip connection possible.
    ValueError
        The names cannot describe the network.
    """
    try:
        return spec_for_state_dict(state_dict, name=name)
    except ValueError as err:
        message = re.sub(r"arch='(\w+)'", r"spec=spec_for_state_dict(state, arch='\1')", str(err))
        message = message.replace("(like=model)", f"({like})")
        raise (AmbiguousArchitectureError if isinstance(err, AmbiguousArchitectureError) else ValueError)(
            message
        ) from None


def _layer(name: str) -> str:
    return name if name == "the input" else f"layer {name!r}"


def possible_skip(state_dict: Mapping, spec: PermutationSpec) -> tuple[str, str, int] | None:
    """Two layers of a chain read off entry names that a residual connection could join, or None.

    A state_dict holds no graph: ``x + f(x)`` needs only that ``f`` outputs as many units as
    ``x`` has, so wherever a hidden layer is as wide as the input or as an earlier hidden layer,
    a skip connection between them is possible and a chain read off the names may be wrong
    (fusing the two as separate permutations gives widths the network cannot add). An
    ``nn.Sequential`` (top-level names ``0.weight``, ``3.bias``, ...) has no skips, so ``None``.

    Returns
    -------
    (earlier, later, width) or None
        The first pair found: ``earlier`` is ``"the input"`` or a layer's name.
    """
    if all(re.match(r"\d+\.", k) for k in state_dict):
        return None
    seen: list[tuple[str, int]] = []
    for k, axes in spec.axes.items():
        if not k.endswith("weight") or len(axes) < 2 or axes[0] is None or k.rpartition(".")[0] in spec.folds:
            continue
        shape = np.shape(state_dict[k])
        if not seen and axes[1] is None:
            seen.append(("the input", int(shape[1])))
        layer, width = k[: -len(".weight")], int(shape[0])
        match = next((name for name, w in seen if w == width), None)
        if match is not None:
            return match, layer, width
        seen.append((layer, width))
    return None
