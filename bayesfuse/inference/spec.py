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
:func:`bayesfuse.nets.tracing.spec_from_module` derives one from a torch module by tracing it.
:mod:`bayesfuse.inference.spec_io` reads specs off state_dicts (names and shapes) and JSON, and
writes them back; its functions are importable from here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from bayesfuse._lazy import lazy_exports

if TYPE_CHECKING:
    import torch

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
    "tie_stacked_recurrent",
    "spec_for_state_dict",  # noqa: F822 (bayesfuse.inference.spec_io, below)
    "entry_order",  # noqa: F822 (bayesfuse.inference.spec_io, below)
    "spec_to_dict",  # noqa: F822 (bayesfuse.inference.spec_io, below)
    "spec_from_dict",  # noqa: F822 (bayesfuse.inference.spec_io, below)
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
            raise ValueError(
                f"an encoding's period and amplitude are numbers, got {self.period!r}, {self.amplitude!r}"
            ) from None
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


def as_axis(a) -> Axis | None:
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
    heads : tuple of tuples of str
        Sets of exchangeable branches (the heads of one attention layer, whose outputs are
        summed): each set lists the module prefixes of its branches (``"blocks.0.attn.heads.0"``,
        ...). Every branch of a set has entries of the same names, each branch with hidden groups
        of its own; moving branch ``a``'s entries to branch ``b``'s names, for any permutation of
        the branches, keeps the function (:mod:`bayesfuse.inference.heads`). Empty for networks
        without attention.
    fixed : dict
        ``group -> why``: groups whose width the network's ``forward`` fixes (a split by a width
        written in the code, heads of a width written so, a scale computed from the width, a
        buffer with a number per unit). Permuting them keeps the function, so methods that keep
        the widths (OT, FedAvg) fuse such a network; those that change widths refuse it
        (:meth:`check_free_widths`).
    pieces : dict
        ``entry -> (dim, ((piece, length), ...))``: entries one of whose axes holds, side by
        side, the units of several groups or numbers no permutation moves (the layer reading
        ``torch.cat([x, h1, h2], 1)`` of streams of different widths, DenseNet's and
        Inception's concatenations). The spec describes such an entry by its pieces along
        ``dim``, each an entry of :attr:`axes` named ``piece`` (``"fc.weight@0"``, ...) whose
        axis ``dim`` is one group's or ``None``; ``length`` is an unpermuted piece's length
        (``None`` for a group's, whose length is its units'). :meth:`split` cuts a state_dict's
        entries into their pieces, which every matcher then reads as entries of their own, and
        :meth:`join` puts fused pieces back side by side.
    transposed : tuple of str
        The weights of transposed convolutions (``nn.ConvTranspose1d/2d/3d``, ``(C_in, C_out,
        *kernel)``): their units, the channels they write, are on axis 1, and the channels they
        read on axis 0 (:meth:`rows_dim`). Every other weight has its units on axis 0.
    widths : dict
        ``"module.attribute" -> Axis``: numbers a module holds that its ``forward`` reads as the
        length of an axis of units (torchvision's ViT reshapes by ``self.hidden_dim``, attention
        written by hand cuts heads of ``self.head_dim``): the attribute is ``axis.outer * n *
        axis.inner`` for the group's size ``n``, and a network rebuilt at other widths gets it at
        theirs (:meth:`held_widths`, :func:`bayesfuse.nets.arch.rebuild`), so that methods that
        change widths can fuse it. The attribute path is the module's name, a dot, the
        attribute's (``"attention.head_dim"``; ``"hidden_dim"`` for the network's own).
    tied : dict
        ``alias -> entry``: state_dict entries that are one tensor under two names (an embedding
        tied to the output layer, ``lm_head.weight = wte.weight``; one module held under two
        names). Both have the same axes; every method fuses them as it fuses any entry, then the
        fused ``alias`` is the fused ``entry`` (:meth:`retie`), so that the fused network ties
        them as the clients did. ``entry`` is the output layer's where one of them is.
    in_place : dict
        ``modules -> why``: units that the ``forward`` combines with numbers along them which no
        permutation moves (a rotary position embedding multiplies the queries and keys by
        ``cos`` and ``sin`` tables along their features; a position encoding computed in the
        forward). No group holds them: their axes are ``None``, so every method keeps their order
        and width and fuses them in place, as it fuses the classes of the output layer. The
        record says where and why, for reports.
    """

    axes: dict
    groups: tuple
    folds: dict = field(default_factory=dict)
    output: tuple = ()
    eps: dict = field(default_factory=dict)
    encodings: dict = field(default_factory=dict)
    heads: tuple = ()
    fixed: dict = field(default_factory=dict)
    pieces: dict = field(default_factory=dict)
    transposed: tuple = ()
    widths: dict = field(default_factory=dict)
    tied: dict = field(default_factory=dict)
    in_place: dict = field(default_factory=dict)
    _owners: dict = field(init=False, repr=False, compare=False)  # piece -> the entry it is a piece of

    def parts(self, entry: str) -> list[str]:
        """The names :attr:`axes` describes ``entry`` by: its pieces (:attr:`pieces`), or itself."""
        found = self.pieces.get(entry)
        return [name for name, _ in found[1]] if found else [entry]

    def rows_dim(self, entry: str) -> int:
        """The axis of ``entry`` (or of a piece of it) that holds the units it writes: 1 for a
        transposed convolution's weight (:attr:`transposed`), 0 for every other entry."""
        return 1 if self.whole(entry) in self.transposed else 0

    def whole(self, name: str) -> str:
        """The entry that piece ``name`` is a piece of (:attr:`pieces`), or ``name`` itself."""
        return self._owners.get(name, name)

    def split(self, state_dict: Mapping[str, Any]) -> dict:
        """``state_dict`` with every entry of :attr:`pieces` cut into its pieces along its
        ``dim`` (views, of NumPy arrays or tensors alike); as it is where the spec has no pieces
        or the entries are cut already. Raises ``ValueError`` naming an entry whose length is not
        its pieces'."""
        if not self.pieces or not any(k in state_dict for k in self.pieces):
            return dict(state_dict)
        sizes = self._whole_sizes(state_dict)
        out: dict = {}
        for k, value in state_dict.items():
            if k not in self.pieces:
                out[k] = value
                continue
            dim = self.pieces[k][0]
            for name, (start, length) in self._offsets(k, np.shape(value), sizes).items():
                out[name] = value[(slice(None),) * dim + (slice(start, start + length),)]
        return out

    def piece_offsets(self, state_dict: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
        """``piece -> (start, length)``: where each piece of :attr:`pieces` lies along its
        entry's ``dim`` in ``state_dict`` (whole entries, at any widths)."""
        sizes = self._whole_sizes(state_dict)
        out: dict[str, tuple[int, int]] = {}
        for k in self.pieces:
            if k in state_dict:
                out.update(self._offsets(k, np.shape(state_dict[k]), sizes))
        return out

    def _offsets(self, entry: str, shape: tuple, sizes: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """:meth:`piece_offsets` of one entry of shape ``shape``, given the groups' ``sizes``."""
        dim, pieces = self.pieces[entry]
        lengths = []
        for name, length in pieces:
            axis = self.axes[name][dim]
            if axis is not None:
                if axis.group not in sizes:
                    raise ValueError(f"the spec's group {axis.group} has no entry of its own to read its width off")
                length = axis.outer * sizes[axis.group] * axis.inner
            lengths.append(int(length))
        shape = tuple(shape)
        if len(shape) <= dim or shape[dim] != sum(lengths):
            raise ValueError(
                f"entry {entry!r} of shape {shape} does not hold its pieces of lengths {lengths} along dimension {dim}"
            )
        starts = np.cumsum([0, *lengths[:-1]])
        return {name: (int(s), n) for (name, _), s, n in zip(pieces, starts, lengths)}

    def join(self, state_dict: Mapping[str, Any]) -> dict:
        """Inverse of :meth:`split`: every entry of :attr:`pieces` whose pieces ``state_dict``
        holds (at any widths, a fused network's) put back together in the first piece's place."""
        if not self.pieces:
            return dict(state_dict)
        out: dict = {}
        for k, value in state_dict.items():
            entry = self._owners.get(k)
            if entry is None:
                out[k] = value
            elif entry not in out:
                dim, pieces = self.pieces[entry]
                values = [state_dict[name] for name, _ in pieces]
                if isinstance(values[0], np.ndarray):
                    out[entry] = np.concatenate(values, axis=dim)
                else:  # torch tensors, so torch is loaded already
                    import torch

                    out[entry] = torch.cat([torch.as_tensor(v) for v in values], dim)
        return out

    def _whole_sizes(self, state_dict: Mapping[str, Any]) -> dict[str, int]:
        """Each group's size, read off the entries that are no piece, and off the axes of pieces
        that are not cut (a layer reading streams side by side, its output's units: its rows)."""
        out: dict[str, int] = {}
        for k, v in self.axes.items():
            whole = self._owners.get(k)
            if (k if whole is None else whole) not in state_dict:
                continue
            shape = np.shape(state_dict[k if whole is None else whole])
            for d, a in enumerate(v):
                if a is not None and d < len(shape) and (whole is None or d != self.pieces[whole][0]):
                    out.setdefault(a.group, a.size(shape[d]))
        # a group read only where it is a piece (units split into pieces of different widths, the
        # queries and keys of qkv.split([dk, dk, dv])): its width is what the entry's length leaves
        # once its other pieces' are known
        found = True
        while found:
            found = False
            for entry, (dim, pieces) in self.pieces.items():
                if entry not in state_dict or len(np.shape(state_dict[entry])) <= dim:
                    continue
                left, unknown = int(np.shape(state_dict[entry])[dim]), dict[str, int]()
                for name, length in pieces:
                    a = self.axes[name][dim]
                    if a is None:
                        left -= int(length)
                    elif a.group in out:
                        left -= a.outer * out[a.group] * a.inner
                    else:
                        unknown[a.group] = unknown.get(a.group, 0) + a.outer * a.inner
                if len(unknown) == 1:
                    ((group, per),) = unknown.items()
                    if left > 0 and left % per == 0:
                        out[group], found = left // per, True
        return out

    def check_fixed_kept(self, method: str, clients: Mapping[str, int], fused: Mapping[str, int], renamed=None) -> None:
        """Refuse, in one line, a fusion by ``method`` that gave a group whose width the forward
        fixes (:attr:`fixed`) another width than the clients' (``clients``, ``fused``: sizes per
        group; ``renamed``: the group each fixed one was fused as, where layers were tied)."""
        renamed = renamed or {}
        for group in self.fixed:
            now = fused.get(renamed.get(group, group))
            if now != clients[group]:
                raise ValueError(
                    f"method={method!r} gave the units of {group} {now} units instead of {clients[group]}, and the "
                    f"network's forward fixes that width ({self.fixed[group]}): fuse it with a method that keeps the "
                    "widths (ot, fedavg)"
                )

    def check_free_widths(self, method: str) -> None:
        """Refuse, in one line, fusing with ``method`` (which changes widths) a network whose
        ``forward`` fixes the width of a group (:attr:`fixed`)."""
        if self.fixed:
            group, why = next(iter(self.fixed.items()))
            raise ValueError(
                f"method={method!r} gives the units of {group} another width, and the network's forward fixes that "
                f"width ({why}): fuse it with a method that keeps the widths (ot, fedavg), or make the forward "
                "read the width off its tensors"
            )

    def batchnorm_eps(self, name: str) -> float:
        """The ``eps`` of batch norm ``name`` (PyTorch's default unless the spec says otherwise)."""
        return float(self.eps.get(name, BATCHNORM_EPS))

    def output_layer(self, state: Mapping[str, Any]) -> tuple[str, str]:
        """The output layer's weight (2-D) and bias (1-D) entries of :attr:`output` in ``state``,
        whole (an output layer reading streams side by side, :attr:`pieces`, as one entry: a
        state_dict cut into pieces is refused)."""
        names = list(dict.fromkeys(self.whole(k) for k in self.output))
        cut = [k for k in names if k in self.pieces and k not in state]
        if cut:
            raise ValueError(f"the output layer's {cut[0]!r} is read whole: join its pieces first (spec.join)")
        weight, bias = [next((k for k in names if k in state and np.ndim(state[k]) == d), None) for d in (2, 1)]
        if weight is None or bias is None:
            shapes = {k: tuple(np.shape(state[k])) for k in self.output if k in state}
            raise ValueError(
                f"the output layer must be a Linear with a bias (a 2-D weight, a 1-D bias) for this; its entries "
                f"are {shapes or list(self.output)} (a convolution, or no bias?)"
            )
        return weight, bias

    def __post_init__(self) -> None:
        fixed = {k: tuple(as_axis(a) for a in v) for k, v in self.axes.items()}
        object.__setattr__(self, "axes", fixed)
        seen = {a.group for v in fixed.values() for a in v if a is not None}
        order = tuple(self.groups) if self.groups else tuple(sorted(seen))
        unknown = seen - set(order)
        if unknown:
            raise ValueError(f"groups {sorted(unknown)} are used by parameters but not listed in groups")
        object.__setattr__(self, "groups", order)
        object.__setattr__(self, "encodings", _encodings(self.encodings, order))
        aliases = self.tied if isinstance(self.tied, Mapping) else {}
        # an alias of a head's entries (an attention module held under two names) is no head's own
        object.__setattr__(self, "heads", _head_sets(self.heads, {k: v for k, v in fixed.items() if k not in aliases}))
        if not isinstance(self.fixed, Mapping) or not all(
            isinstance(g, str) and g in order and isinstance(why, str) for g, why in self.fixed.items()
        ):
            raise ValueError(f"a spec's 'fixed' maps groups it lists to why their widths are fixed, got {self.fixed!r}")
        object.__setattr__(self, "fixed", dict(self.fixed))
        object.__setattr__(self, "pieces", _pieces(self.pieces, fixed))
        object.__setattr__(self, "_owners", {name: k for k, (_, pieces) in self.pieces.items() for name, _ in pieces})
        object.__setattr__(self, "transposed", _transposed(self.transposed, fixed, self.pieces))
        object.__setattr__(self, "widths", _widths(self.widths, order))
        object.__setattr__(self, "tied", _tied(self.tied, fixed))
        if not isinstance(self.in_place, Mapping) or not all(
            isinstance(k, str) and isinstance(why, str) for k, why in self.in_place.items()
        ):
            raise ValueError(
                f"a spec's 'in_place' maps module names to why their units stay in place, got {self.in_place!r}"
            )
        object.__setattr__(self, "in_place", dict(self.in_place))

    def untied(self) -> PermutationSpec:
        """This spec without the aliases of :attr:`tied`: what matching reads, each tensor once."""
        if not self.tied:
            return self
        axes = {k: v for k, v in self.axes.items() if k not in self.tied}
        return replace(self, axes=axes, output=tuple(k for k in self.output if k not in self.tied), tied={})

    def with_ties(self, tied: Mapping[str, str]) -> PermutationSpec:
        """This spec with ``tied``'s aliases (``alias -> entry``) described as their entries:
        the inverse of :meth:`untied`, on a spec a method may have changed (groups it tied)."""
        axes = {**self.axes, **{alias: self.axes[entry] for alias, entry in tied.items()}}
        return replace(self, axes=axes, tied=dict(tied))

    def retie(self, state: Mapping[str, Any]) -> dict:
        """``state`` with each alias of :attr:`tied` set to its entry's value (a fused state, whose
        entries were fused one by one); as it is where it holds neither."""
        out = dict(state)
        for alias, entry in self.tied.items():
            if entry in out:
                out[alias] = out[entry]
        return out

    def held_widths(self, state_dict: Mapping[str, Any]) -> dict[str, int]:
        """``"module.attribute" -> value`` of :attr:`widths` at the widths of ``state_dict``."""
        if not self.widths:
            return {}
        sizes = self.sizes(state_dict)
        return {path: a.outer * sizes[a.group] * a.inner for path, a in self.widths.items()}

    def head_entries(self, prefix: str) -> list[str]:
        """The suffixes of the entries of branch ``prefix`` of a head set (``"q.weight"``, ...)."""
        return [k[len(prefix) + 1 :] for k in self.axes if k.startswith(prefix + ".")]

    def head_groups(self, prefix: str) -> list[str]:
        """The hidden groups that only branch ``prefix``'s entries use, in order of first use over
        its entries sorted by name (so that the branches of a set list theirs alike)."""
        return _private_groups({k: v for k, v in self.axes.items() if k not in self.tied}, prefix)

    def members(self, group: str) -> list[tuple[str, int]]:
        """``(name, dim)`` of every axis permuted by ``group``."""
        return [(k, d) for k, v in self.axes.items() for d, a in enumerate(v) if a is not None and a.group == group]

    def groups_of(self, name: str) -> list[str]:
        """The groups acting on entry ``name``, one per permuted axis."""
        return [a.group for a in self.axes[name] if a is not None]

    def sizes(self, state_dict: Mapping[str, np.ndarray]) -> dict[str, int]:
        """Size of each group in ``state_dict``; checks the spec against it."""
        state_dict = self.split(state_dict)
        self._check(state_dict, "state_dict")
        out: dict[str, int] = {}
        for k, v in self.axes.items():
            shape = np.shape(state_dict[k])
            for d, a in enumerate(v):
                if a is not None:
                    out.setdefault(a.group, a.size(shape[d]))
        return out

    def check(self, state_dict: Mapping[str, np.ndarray], name: str = "state_dict") -> None:
        """Raise ``ValueError`` naming the entry when ``state_dict`` does not fit the spec."""
        self._check(self.split(state_dict), name)

    def _check(self, state_dict: Mapping[str, np.ndarray], name: str) -> None:
        """:meth:`check` of a state_dict cut into the spec's pieces."""
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


def _pieces(data, axes: Mapping[str, tuple]) -> dict:
    """``data`` as ``{entry: (dim, ((piece, length), ...))}``, checked: every piece an entry of
    ``axes`` with that dimension, permuted by a group (length None) or by none (a length >= 1)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a spec's 'pieces' maps entries to (dim, pieces), got {data!r}")
    out = {}
    for entry, value in data.items():
        try:
            dim, pieces = value
            pieces = tuple((str(name), None if length is None else int(length)) for name, length in pieces)
            dim = int(dim)
        except (TypeError, ValueError):
            raise ValueError(
                f"the pieces of {entry!r} are (dim, [(piece, length or null), ...]), got {value!r}"
            ) from None
        if entry in axes or len(pieces) < 2:
            raise ValueError(f"entry {entry!r} is described by its pieces, at least two, and not as a whole")
        for name, length in pieces:
            if name not in axes or len(axes[name]) <= dim:
                raise ValueError(f"piece {name!r} of {entry!r} is no entry of the spec with a dimension {dim}")
            if (axes[name][dim] is None) != (length is not None) or (length is not None and length < 1):
                raise ValueError(
                    f"piece {name!r} of {entry!r}: a piece that no group permutes along {dim} has a length >= 1, "
                    "one that a group permutes has none"
                )
        out[str(entry)] = (dim, pieces)
    return out


def _transposed(data, axes: Mapping[str, tuple], pieces: Mapping[str, tuple]) -> tuple:
    """``data`` as a tuple of weights, checked: each an entry of ``axes`` (or held in
    ``pieces``) of at least 2 dimensions."""
    if isinstance(data, str) or not isinstance(data, (list, tuple)) or not all(isinstance(k, str) for k in data):
        raise ValueError(f"a spec's 'transposed' lists the weights of transposed convolutions, got {data!r}")
    named = {name for _, parts in pieces.values() for name, _ in parts}
    for k in data:
        if k in named:
            raise ValueError(f"a spec's 'transposed' names the piece {k!r}: name the weight it is a piece of")
        described = axes.get(k) if k in axes else axes.get(pieces[k][1][0][0]) if k in pieces else None
        if described is None or len(described) < 2:
            raise ValueError(
                f"a spec's 'transposed' names {k!r}, which is no weight of 2 or more dimensions it describes"
            )
    return tuple(dict.fromkeys(data))


def _tied(data, axes: Mapping[str, tuple]) -> dict:
    """``alias -> entry`` (:attr:`PermutationSpec.tied`): both entries of :attr:`axes`, with the
    same axes, the entry no alias itself."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a spec's 'tied' maps entries to the entries they are one tensor with, got {data!r}")
    out = {}
    for alias, entry in data.items():
        if not isinstance(alias, str) or not isinstance(entry, str) or alias == entry:
            raise ValueError(f"a spec's 'tied' maps an entry to another entry's name, got {alias!r}: {entry!r}")
        if alias not in axes or entry not in axes:
            raise ValueError(f"a spec ties {alias!r} to {entry!r}, and its axes do not describe both")
        if axes[alias] != axes[entry]:
            raise ValueError(
                f"a spec ties {alias!r} to {entry!r}, one tensor, but gives them different axes "
                f"({axes[alias]} and {axes[entry]})"
            )
        if entry in data:
            raise ValueError(f"a spec ties {alias!r} to {entry!r}, which is tied to another entry itself")
        out[alias] = entry
    return out


def _widths(data, groups: Sequence[str]) -> dict:
    """``"module.attribute" -> Axis`` (:attr:`PermutationSpec.widths`) from Axes or their
    dict form (``{"group": ..., "outer": ..., "inner": ...}`` or a group name), for known groups."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a spec's 'widths' maps module attributes to the axes whose length they hold, got {data!r}")
    out = {}
    for path, a in data.items():
        if isinstance(a, Mapping):
            try:
                a = Axis(str(a["group"]), int(a.get("outer", 1)), int(a.get("inner", 1)))
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"a spec's width {path!r} is no axis ({err}): {a!r}") from None
        a = as_axis(a) if isinstance(a, (str, Axis)) else a
        parts = path.split(".") if isinstance(path, str) else [""]
        named = parts[-1].isidentifier() and all(parts[:-1])  # a module's name: any key (an nn.ModuleDict's)
        if not named or not isinstance(a, Axis):
            raise ValueError(
                f"a spec's 'widths' maps module attributes (\"module.attribute\") to axes, got {path!r}: {a!r}"
            )
        if a.group not in groups:
            raise ValueError(f"the width {path!r} is given for group {a.group!r}, which is not among the groups")
        out[path] = a
    return out


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


def _private_groups(axes: Mapping[str, tuple], prefix: str) -> list[str]:
    """The groups that only the entries under ``prefix`` use, in order of first use over those
    entries sorted by name."""
    inside = sorted(k for k in axes if k.startswith(prefix + "."))
    outside = {a.group for k, v in axes.items() if not k.startswith(prefix + ".") for a in v if a is not None}
    found: list[str] = []
    for k in inside:
        for a in axes[k]:
            if a is not None and a.group not in outside and a.group not in found:
                found.append(a.group)
    return found


def _head_sets(data, axes: Mapping[str, tuple]) -> tuple:
    """``data`` as a tuple of tuples of prefixes, checked: the branches of a set hold entries of
    the same names; where one branch's entry has a group of its own (used by no entry outside the
    branch) every branch's has one, in one-to-one correspondence, with the same blocks; elsewhere
    they have the same shared group or none."""
    if not isinstance(data, (list, tuple)) or not all(
        isinstance(s, (list, tuple)) and all(isinstance(p, str) for p in s) for s in data
    ):
        raise ValueError(f"a spec's 'heads' is a list of lists of module prefixes, got {data!r}")
    sets = tuple(tuple(s) for s in data)
    for heads in sets:
        if not heads:
            raise ValueError("a set of heads in a spec's 'heads' is empty")
        entries = [sorted(k[len(p) + 1 :] for k in axes if k.startswith(p + ".")) for p in heads]
        for p, names in zip(heads, entries):
            if not names or names != entries[0]:
                raise ValueError(
                    f"head {p!r} has entries {names[:4]}, head {heads[0]!r} has {entries[0][:4]}: the heads "
                    "of one set must hold entries of the same names"
                )
        private = [set(_private_groups(axes, p)) for p in heads]
        for i, p in enumerate(heads[1:], start=1):
            pairs: dict[str, str] = {}
            for n in entries[0]:
                for a, b in zip(axes[f"{heads[0]}.{n}"], axes[f"{p}.{n}"]):
                    if a is None and b is None:
                        continue
                    own = a is not None and b is not None and a.group in private[0] and b.group in private[i]
                    shared = (
                        a is not None
                        and b is not None
                        and a.group == b.group
                        and a.group not in private[0]
                        and b.group not in private[i]
                    )
                    if not (own or shared) or (a.outer, a.inner) != (b.outer, b.inner):
                        raise ValueError(
                            f"entry {p}.{n} is not permuted like {heads[0]}.{n}: heads are exchangeable only "
                            "when each has groups of its own (used by no entry outside it) and shares the others"
                        )
                    if own and pairs.setdefault(a.group, b.group) != b.group:
                        raise ValueError(
                            f"head {p!r} does not tie its groups as head {heads[0]!r} does ({n}: {a.group} goes "
                            f"with {pairs[a.group]} and {b.group})"
                        )
            if len(set(pairs.values())) != len(pairs):
                raise ValueError(f"head {p!r} ties groups that head {heads[0]!r} keeps apart")
    return sets


def dense(name: str, in_group, out_group, *, bias: bool = True) -> PermutationSpec:
    """``nn.Linear``: ``weight`` is ``(out, in)``, ``bias`` is ``(out,)``."""
    axes: dict[str, tuple] = {f"{name}.weight": (out_group, in_group)}
    if bias:
        axes[f"{name}.bias"] = (out_group,)
    return PermutationSpec(axes, ())


def conv(
    name: str, in_group, out_group, *, bias: bool = True, ndim: int = 2, transposed: bool = False
) -> PermutationSpec:
    """``nn.Conv{ndim}d``: ``weight`` is ``(C_out, C_in, *kernel)``; channels are the units.
    ``transposed``: ``nn.ConvTranspose{ndim}d``, whose ``weight`` is ``(C_in, C_out, *kernel)``."""
    channels = (in_group, out_group) if transposed else (out_group, in_group)
    axes: dict[str, tuple] = {f"{name}.weight": (*channels, *([None] * ndim))}
    if bias:
        axes[f"{name}.bias"] = (out_group,)
    return PermutationSpec(axes, (), transposed=(f"{name}.weight",) if transposed else ())


def batchnorm(name: str, group, *, after: str | None = None, eps: float = 1e-5) -> PermutationSpec:
    """``nn.BatchNorm*d`` over the units of ``group``; ``after`` names the layer it follows and
    ``eps`` is the layer's (folding divides by ``sqrt(running_var + eps)``)."""
    if not (0.0 < eps < 1.0):
        raise ValueError(f"batch norm {name!r}: eps must lie in (0, 1) to fold it, got {eps}")
    axes: dict[str, tuple] = {f"{name}.{p}": (group,) for p in ("weight", "bias", "running_mean", "running_var")}
    axes[f"{name}.num_batches_tracked"] = ()
    return PermutationSpec(
        axes, (), folds={name: after} if after else {}, eps={name: float(eps)} if eps != BATCHNORM_EPS else {}
    )


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
    below = as_axis(in_group)  # a permuted input (an embedding's units) is a group of this spec too
    return PermutationSpec(axes, tuple(([below.group] if below is not None else []) + groups))


def chain(*parts: PermutationSpec, groups: Sequence[str] | None = None, output: Sequence[str] = ()) -> PermutationSpec:
    """Combine specs in forward order; groups are ordered by first appearance unless given."""
    axes: dict = {}
    folds: dict = {}
    eps: dict = {}
    encodings: dict = {}
    heads: list = []
    transposed: list = []
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
        heads += part.heads
        transposed += part.transposed
    return PermutationSpec(
        axes,
        tuple(groups) if groups is not None else tuple(order),
        folds,
        tuple(output),
        eps,
        encodings,
        tuple(heads),
        transposed=tuple(transposed),
    )


# --------------------------------------------------------------------------- arrays


def permute(state_dict: Mapping[str, np.ndarray], spec: PermutationSpec, perms: Mapping[str, np.ndarray]) -> dict:
    """Reorder units: new unit ``i`` of group ``g`` is old unit ``perms[g][i]``.

    Groups missing from ``perms`` stay as they are. Arrays keep their type (NumPy or torch), and
    entries held in pieces (:attr:`PermutationSpec.pieces`) their form, whole or cut.
    """
    if any(k in state_dict for k in spec.pieces):  # entries held whole: permuted piece by piece, kept whole
        return spec.join(permute(spec.split(state_dict), spec, perms))
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
    out: np.ndarray | torch.Tensor
    if isinstance(a, np.ndarray):
        out = np.take(blocks, index, axis=dim + 1)
    else:  # a torch tensor, so torch is loaded already
        import torch

        out = torch.index_select(blocks, dim + 1, torch.as_tensor(index, dtype=torch.long))
    return out.reshape(*shape[:dim], axis.outer * len(index) * axis.inner, *shape[dim + 1 :])


def to_global_basis(
    a: np.ndarray, dim: int, axis: Axis, assignment: np.ndarray, n_global: int, fill: float = np.nan
) -> np.ndarray:
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
    index: list[slice | np.ndarray] = [slice(None)] * out.ndim
    index[dim + 1] = assignment
    out[tuple(index)] = blocks
    return out.reshape(*shape[:dim], axis.outer * n_global * axis.inner, *shape[dim + 1 :])


def tie_stacked_recurrent(
    spec: PermutationSpec, state_dict: Mapping[str, Any], *, only: Sequence[str] | None = None
) -> tuple[PermutationSpec, dict]:
    """``spec`` with the hidden groups of every stacked ``nn.LSTM`` / ``nn.GRU`` (of the modules
    ``only``, when given) made one group, and ``{module: [its layers' groups]}`` for each module
    tied (empty: ``spec`` unchanged).

    A stacked recurrent module keeps one hidden size for all its layers, so a fusion that sets each
    group's width (PFNM, NAFI, FedMA) must give its layers one width. Permuting every layer's
    units by one permutation is still a symmetry of the network (the special case of a
    permutation per layer where all are equal), so matching the layers as one group, each global
    unit the concatenation of one unit of every layer, keeps the function of a permuted copy. It
    aligns less than one permutation per layer would: a layer's unit ``i`` is matched together with
    unit ``i`` of the others, whatever they compute.
    """
    layers: dict[str, dict[int, str]] = {}
    for key in state_dict:  # the layers' outputs (a projected LSTM's projections), and a projected LSTM's cells
        found = re.fullmatch(r"(.*)\.weight_h([hr])_l(\d+)", key)
        axes = spec.axes.get(key)
        if found and axes is not None and len(axes) == 2 and axes[1] is not None:
            module = found[1] if found[2] == "h" else f"{found[1]} (cells)"
            layers.setdefault(module, {})[int(found[3])] = axes[1].group
    rename: dict[str, str] = {}
    tied: dict[str, list[str]] = {}
    for module, groups in layers.items():
        names = [groups[k] for k in sorted(groups)]
        if len(set(names)) > 1 and (only is None or module in only):
            tied[module] = names
            rename.update({g: names[0] for g in names[1:]})
    if not rename or any(g in spec.encodings for g in rename):  # position-aware LSTM units: not tied
        return spec, {}
    axes = {
        k: tuple(None if a is None else replace(a, group=rename.get(a.group, a.group)) for a in v)
        for k, v in spec.axes.items()
    }
    widths = {path: replace(a, group=rename.get(a.group, a.group)) for path, a in spec.widths.items()}
    kept = tuple(g for g in spec.groups if g not in rename)
    fixed: dict[str, str] = {}  # a layer's fixed width is the tied group's
    for g, why in spec.fixed.items():
        fixed.setdefault(rename.get(g, g), why)
    return replace(spec, axes=axes, groups=kept, widths=widths, fixed=fixed), tied


def random_permutations(sizes: Mapping[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One uniformly random permutation per group."""
    return {g: rng.permutation(n) for g, n in sizes.items()}


# Reading specs off state_dicts, files and JSON lives in bayesfuse.inference.spec_io, which builds
# on this module; its functions stay importable from here, loaded on first use (PEP 562).
_EXPORTS = {
    name: "bayesfuse.inference.spec_io"
    for name in ("spec_for_state_dict", "entry_order", "spec_to_dict", "spec_from_dict")
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
