"""The layer-wise loop that every layer-wise fusion shares.

Multilayer PFNM/NAFI (:func:`~bayesfuse.inference.layerwise.match_layerwise`), FedMA
(:func:`~bayesfuse.inference.fedma.fedma_steps`), OT fusion
(:func:`~bayesfuse.inference.otfusion.ot_fuse_layerwise`) and the fusion of BNN posteriors
(:func:`~bayesfuse.inference.bnn.fusion.fuse_bnn_posteriors`) all do the same thing around
their own step: visit the hidden groups of a :class:`~bayesfuse.inference.spec.PermutationSpec`
one at a time (FedMA eq. 4, bottom-up; PFNM supplement Algorithm 1, top-down), describe each
group's units with the axes of the groups fused before it written in the fused basis, fuse
them, and keep how each client's units of the group map to the fused ones for the groups that
follow. :class:`GroupWalk` is that loop and that record; what a *basis* is belongs to the
method: an assignment of units to global units (:class:`Basis`, the matchers, the BNNs) or a
transport plan per client (OT).

No arithmetic on arrays here: the walk only holds what each method records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Iterator, Literal, Mapping, TypeVar

import numpy as np

from bayesfuse.inference.spec import PermutationSpec

__all__ = ["Basis", "GroupWalk"]

B = TypeVar("B")


@dataclass
class Basis:
    """How the clients' units of one group map to its global units.

    Attributes
    ----------
    assignments : list of (L_j,) int arrays
        The global unit of each of client j's units.
    n_global : int
        The group's fused width.
    """

    assignments: list[np.ndarray]
    n_global: int

    @classmethod
    def identity(cls, n_clients: int, n_global: int) -> Basis:
        """Every client holds the global units themselves, in their order (after FedMA's retraining)."""
        return cls([np.arange(n_global)] * n_clients, n_global)


class GroupWalk(Generic[B]):
    """Visit the hidden groups of ``spec`` in order, holding the basis of every group fused so far.

    Iterating yields ``(i, group)``; the caller fuses ``group`` and calls :meth:`record` with its
    basis before asking for the next one (a group left unrecorded is an error, not a silent skip).

    Parameters
    ----------
    spec : PermutationSpec
    direction : {"bottom-up", "top-down"}
        ``spec.groups`` in forward order (FedMA eq. 4, OT fusion, the BNNs), or reversed (PFNM
        supplement Algorithm 1).

    Examples
    --------
    >>> from bayesfuse.inference.spec import chain, dense
    >>> spec = chain(dense("fc1", None, "P1"), dense("fc2", "P1", "P2"), dense("fc3", "P2", None))
    >>> walk = GroupWalk(spec)
    >>> for i, group in walk:
    ...     print(i, group, walk.reads(group))
    ...     walk.record(group, Basis.identity(2, 4))
    0 P1 []
    1 P2 ['P1']
    >>> sorted(walk.fused)
    ['P1', 'P2']
    """

    def __init__(self, spec: PermutationSpec, direction: Literal["bottom-up", "top-down"] = "bottom-up") -> None:
        if direction not in ("bottom-up", "top-down"):
            raise ValueError(f"direction must be 'bottom-up' or 'top-down', got {direction!r}")
        self.spec = spec
        self.order: tuple[str, ...] = tuple(spec.groups) if direction == "bottom-up" else tuple(reversed(spec.groups))
        self._fused: dict[str, B] = {}

    def __iter__(self) -> Iterator[tuple[int, str]]:
        for i, group in enumerate(self.order):
            yield i, group
            if group not in self._fused:
                raise RuntimeError(f"group {group!r} was visited but its basis was not recorded")

    @property
    def fused(self) -> Mapping[str, B]:
        """The basis of every group fused so far, by group."""
        return self._fused

    def record(self, group: str, basis: B) -> None:
        """Keep ``basis``, how each client's units of ``group`` map to the fused ones."""
        if group not in self.order:
            raise ValueError(f"{group!r} is not a group of the walk's spec ({list(self.order)})")
        self._fused[group] = basis

    def rebase(self, bases: Mapping[str, B]) -> None:
        """Replace the bases of fused groups: after FedMA's retraining the clients hold the global
        units themselves (:meth:`Basis.identity`)."""
        unknown = set(bases) - set(self._fused)
        if unknown:
            raise ValueError(f"groups {sorted(unknown)} have not been fused")
        self._fused.update(bases)

    def reads(self, group: str) -> list[str]:
        """The fused groups that ``group``'s units read: the other permuted axes of the entries that
        ``group`` permutes once (a layer's inputs, bottom-up; its outputs, top-down), in the order
        of the walk."""
        seen: set[str] = set()
        for name in self.spec.axes:
            groups = self.spec.groups_of(name)
            if groups.count(group) == 1:
                seen.update(g for g in groups if g != group and g in self._fused)
        return [g for g in self.order if g in seen]
