"""Position encodings folded into the weights and out again, so that matching sees plain units.

Position-aware neurons (PANs, Li et al., CVPR 2022, eqs. 2-5) give unit ``j`` of a group of
``J`` units a fixed encoding of its position,

.. math::

    \\text{add:}\\quad h_j = f(z_j + e_j(J)),\\quad e_j(J) = A \\sin(2\\pi T j / J); \\qquad
    \\text{mul:}\\quad h_j = f(z_j\\, e_j(J)),\\quad e_j(J) = 1 + A \\sin(2\\pi T j / J),

where ``z = W h + b`` is the output of the module before the encoding (the group's layer, or
the batch norm after it: :class:`~bayesfuse.inference.spec.Encoding` ``after``). The encoding
depends on the unit's *position*, so a permutation of the units changes the function, and
matching, which moves units to new positions in a network of another width ``G``, would too.

The same function without the encoding (eq. F): a unit is the row ``w_j`` and bias ``b_j`` of
the module before the encoding, and

.. math::

    \\text{mul:}\\quad \\tilde w_j = e_j w_j,\\ \\tilde b_j = e_j b_j; \\qquad
    \\text{add:}\\quad \\tilde w_j = w_j,\\ \\tilde b_j = b_j + e_j                 \\qquad (F)

computes ``z_j e_j`` (``z_j + e_j``) with plain units, which permutations leave alone. Its
inverse at width ``G`` (eq. U) gives the weights that a position-aware network of width ``G``
needs to compute the plain function:

.. math::

    \\text{mul:}\\quad w_j = \\tilde w_j / e_j(G),\\ b_j = \\tilde b_j / e_j(G); \\qquad
    \\text{add:}\\quad b_j = \\tilde b_j - e_j(G)                                   \\qquad (U)

Eq. U divides by ``e_j(G)``, which lies in ``[1 - A, 1 + A]``: positive for ``A < 1``. For
``A >= 1`` some widths put a zero there, so :func:`check_unfoldable` refuses them.

Fusing position-aware networks is then: (F) on every client at its own widths, match the plain
networks, (U) on the fused network at the global widths. A batch norm between the layer and the
encoding is folded into by its own affine ``weight`` and ``bias`` (it normalises ``z`` first,
then the encoding acts), so its running statistics stay as they are.

Everything here takes and returns NumPy arrays.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from bayesfuse.inference.layerwise import folded_entries
from bayesfuse.inference.spec import Encoding, PermutationSpec

__all__ = ["position_encoding", "encoded_groups", "check_unfoldable", "fold_encodings", "unfold_encodings"]

State = Mapping[str, np.ndarray]


def position_encoding(n_units: int, encoding: Encoding) -> np.ndarray:
    """``e_j(J)`` for ``j = 0..J-1`` (PANs eq. 4, additive, or eq. 5, multiplicative).

    Parameters
    ----------
    n_units : int
        ``J``, the width of the group.
    encoding : Encoding

    Returns
    -------
    (J,) ndarray
        ``A sin(2 pi T j / J)`` (``"add"``) or ``1 + A sin(2 pi T j / J)`` (``"mul"``).
    """
    j = np.arange(int(n_units))
    wave = encoding.amplitude * np.sin(2 * np.pi * encoding.period * j / max(int(n_units), 1))
    return wave if encoding.mode == "add" else 1.0 + wave


def encoded_groups(spec: PermutationSpec) -> list[str]:
    """The groups whose encoding is not constant (``T != 0`` and ``A != 0``), in forward order."""
    return [g for g in spec.groups if g in spec.encodings and not spec.encodings[g].off]


def check_unfoldable(spec: PermutationSpec) -> None:
    """Raise ``ValueError`` when eq. U cannot hold at every width: ``mul`` with ``A >= 1``.

    Also checks that every encoded group has a module to fold into (:func:`fold_encodings`).
    """
    for g in encoded_groups(spec):
        _check_amplitude(g, spec.encodings[g])
        _targets(spec, g)


def _check_amplitude(group: str, e: Encoding) -> None:
    if e.mode == "mul" and not e.off and e.amplitude >= 1:
        raise ValueError(
            f"group {group!r} has multiplicative position encodings with amplitude A={e.amplitude} >= 1: "
            "e_j = 1 + A sin(2 pi T j / J) vanishes at some widths, so a fused network of another width "
            "cannot compute the matched function; use A < 1 (PANs use 0.1 .. 0.75), or method='fedavg'"
        )


def _targets(spec: PermutationSpec, group: str) -> tuple[str | None, str | None]:
    """The ``weight`` and ``bias`` entries of the module whose outputs ``group``'s encoding acts on."""
    enc = spec.encodings[group]
    prefix = enc.after
    if prefix is None:  # the layer that produces the group: its weight rows are the group's units
        bns = folded_entries(spec)
        layers = {
            k[: -len("weight")].rstrip(".")
            for k, v in spec.axes.items()
            if k.endswith("weight") and k not in bns and v and v[0] is not None and v[0].group == group
        }
        if len(layers) != 1:
            raise ValueError(
                f"the encoding of group {group!r} names no module ('after') and {len(layers)} layers "
                f"produce the group ({sorted(layers)}); name the one it follows"
            )
        prefix = layers.pop()
    keys = [f"{prefix}.{p}" if prefix else p for p in ("weight", "bias")]
    found: list[str | None] = []
    for k in keys:
        axes = spec.axes.get(k)
        if axes is None:
            found.append(None)
            continue
        a = axes[0] if axes else None
        if a is None or a.group != group or a.outer != 1 or a.inner != 1:
            raise ValueError(
                f"the encoding of group {group!r} acts on {prefix!r}, but the first axis of {k!r} "
                f"is {a!r}, not the group's units"
            )
        found.append(k)
    weight, bias = found
    if enc.mode == "add" and bias is None:
        raise ValueError(f"the additive encoding of group {group!r} needs a bias in {prefix!r} to fold into")
    if weight is None and bias is None:
        raise ValueError(
            f"the encoding of group {group!r} acts on {prefix!r}, which has no weight or bias entries "
            "to fold into (a batch norm without affine parameters?)"
        )
    return weight, bias


def _apply(state: State, spec: PermutationSpec, inverse: bool) -> dict:
    """Eq. F (``inverse=False``) or eq. U on every encoded group, vectorised over its units."""
    out = dict(state)
    for g in encoded_groups(spec):
        enc = spec.encodings[g]
        weight, bias = _targets(spec, g)
        first = weight if weight is not None else bias
        assert first is not None  # _targets refuses a group with neither
        n = np.shape(state[first])[0]
        e = position_encoding(n, enc)
        if enc.mode == "mul":
            if inverse:
                _check_amplitude(g, enc)
            factor = 1.0 / e if inverse else e
            for k in (weight, bias):
                if k is not None:
                    a = np.asarray(state[k], dtype=np.float64)
                    out[k] = a * factor.reshape(-1, *([1] * (a.ndim - 1)))
        else:
            assert bias is not None  # _targets refuses an additive encoding without one
            out[bias] = np.asarray(state[bias], dtype=np.float64) + (-e if inverse else e)
    return out


def fold_encodings(state: State, spec: PermutationSpec) -> dict:
    """The plain network that computes what ``state`` computes with ``spec``'s encodings (eq. F).

    Parameters
    ----------
    state : mapping of str to arrays
        A state_dict of the position-aware network; each group's encoding is the one of the
        width the state has (its entries' shapes).
    spec : PermutationSpec
        With ``encodings``; groups without (or with constant ones) are left alone.

    Returns
    -------
    dict
        ``state`` with the rows and biases of each encoded group's module changed (float64);
        other entries are the same objects.
    """
    return _apply(state, spec, inverse=False)


def unfold_encodings(state: State, spec: PermutationSpec) -> dict:
    """The position-aware network that computes what the plain ``state`` computes (eq. U).

    The inverse of :func:`fold_encodings` at the widths ``state`` has: load the result into the
    position-aware network of those widths (e.g. a fused network, rebuilt at the global widths).

    Parameters
    ----------
    state : mapping of str to arrays
        A plain state_dict (encodings folded in, or matched from folded clients).
    spec : PermutationSpec

    Returns
    -------
    dict

    Raises
    ------
    ValueError
        For a multiplicative encoding with amplitude ``A >= 1`` (:func:`check_unfoldable`).
    """
    return _apply(state, spec, inverse=True)
