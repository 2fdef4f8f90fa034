"""The assignment step: the optimal assignment of one client's neurons to atoms or new ones, and
the hook that records the problems (:func:`recording_assignments`)."""

from __future__ import annotations

import contextlib

import numpy as np
from scipy.optimize import linear_sum_assignment

#: The callbacks :func:`recording_assignments` has installed (none outside its blocks).
RECORDERS: list = []


@contextlib.contextmanager
def recording_assignments(callback):
    """Within the block, call ``callback(v, R, assignment, steps)`` after each assignment problem
    :func:`match_neurons` solves with a dense cost matrix (the float32 screen's sparse problems
    are not reported): ``v`` (L, D), the client's neurons; ``R`` (G, L), what existing atom i
    costs neuron l beyond its cheapest new atom; ``assignment`` (L,), the optimum (an atom, or
    -1 for a new one); ``steps`` what the k-th new atom adds, or None. For benchmarks and
    diagnostics; :func:`match_neurons` runs the same without it.
    """
    RECORDERS.append(callback)
    try:
        yield
    finally:
        RECORDERS.remove(callback)


def solve_assignment(R: np.ndarray, steps: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """The optimum of an assignment problem as :func:`recording_assignments` reports it: each of
    the L neurons to an atom of ``R`` (G, L) or to a new atom (-1), and the number of candidate
    pairs, by the solver :func:`match_neurons` uses (``R`` is not modified)."""
    R = np.array(R, dtype=float)
    return assign(R, np.zeros(R.shape[1]), steps)


def assign(old: np.ndarray, new: np.ndarray, steps: np.ndarray | None) -> tuple[np.ndarray, int]:
    """Optimal assignment of L neurons to existing atoms or new ones; ``-1`` marks a new atom.
    Also returns the number of candidate pairs (atom, neuron) (``R < 0``, or ``R <= steps_L``).

    Solves the linear assignment problem of the (L, G + L) matrix that :func:`assignment_cost`
    builds from ``old`` (G, L), ``new`` and ``steps`` (:func:`cost_blocks`) without building
    it; ``old`` is overwritten. ``R_il = old_il - new_l`` is what atom i costs neuron l beyond
    its cheapest new atom (a shift per neuron, which changes no assignment's ranking).

    * The new atoms' block is ``new_l + steps_k`` with ``steps`` increasing (or zero), so the
      neurons that open new atoms pay ``sum new_l + sum_{k <= n} steps_k`` however they share
      the n cheapest new columns: only *which* neurons go new matters, and new atoms are
      numbered in neuron order.
    * Among the L new columns one is free in any assignment, so a neuron never takes an atom
      dearer than its dearest new column (``R_il > steps_L``: it would gain by moving there).
      Atoms no neuron can take are dropped, and neurons that can take no atom go new at once
      (taking the cheapest new columns, which leaves the others the next ones).
    * ``"marginal"`` (``steps`` None: every new column of a row costs ``new_l``): the optimum is
      the partial matching of neurons to atoms minimising ``sum R_il`` over its pairs, which uses
      only pairs with ``R_il < 0`` (any other pair moves to a free new column at no loss). That
      is the assignment problem of ``Z = min(R, 0)`` restricted to the atoms and neurons
      holding a negative entry: a matching of Z costs the sum of its negative entries, which
      form a partial matching, and any partial matching of negative pairs extends to a full
      one of Z (a rectangular problem matches min(rows, columns) pairs) through entries <= 0.
      Pairs matched at a zero entry go new. The pairs ``R_il < 0`` form a bipartite graph;
      its connected components are independent problems, and a component of one pair (the
      neuron's only candidate, which no other neuron wants) is solved by taking it, so only
      the rest goes to the Hungarian algorithm. The dense new-atom block is never formed.

    With no ties among the candidate assignments the optimum is unique and equals
    ``linear_sum_assignment`` of the full matrix, up to the numbering of the new atoms.
    """
    G, L = old.shape
    R = np.subtract(old, new[None, :], out=old)
    out = np.full(L, -1, dtype=np.int64)
    if steps is None:
        neg = R < 0
        per_atom, per_neuron = neg.sum(axis=1), neg.sum(axis=0)
        n_pairs = int(per_atom.sum())
        atoms = np.flatnonzero(per_atom == 1)  # single pairs: an atom of one candidate neuron ...
        neurons = neg[atoms].argmax(axis=1)
        alone = per_neuron[neurons] == 1  # ... which has no other candidate atom
        atoms, neurons = atoms[alone], neurons[alone]
        out[neurons] = atoms
        per_atom[atoms] = 0
        rest_atoms = np.flatnonzero(per_atom > 0)
        if len(rest_atoms):
            rest_neurons = np.flatnonzero((per_neuron > 0) & (out < 0))
            # rows gathered (a copy), columns only when some neurons drop out: a quarter of np.ix_'s time
            Z = R[rest_atoms]
            if len(rest_neurons) < L:
                Z = Z[:, rest_neurons]
            np.minimum(Z, 0.0, out=Z)
            r, c = linear_sum_assignment(Z)
            took = Z[r, c] < 0
            out[rest_neurons[c[took]]] = rest_atoms[r[took]]
        return out, n_pairs
    can = R <= steps[-1]
    atoms, neurons = np.flatnonzero(can.any(axis=1)), np.flatnonzero(can.any(axis=0))
    if len(neurons):
        n_forced, n = L - len(neurons), len(neurons)  # neurons that can only go new take the first new columns
        C = np.empty((n, len(atoms) + n))
        C[:, : len(atoms)] = R[np.ix_(atoms, neurons)].T
        C[:, len(atoms) :] = steps[None, n_forced : n_forced + n]
        r, c = linear_sum_assignment(C)
        took = c < len(atoms)
        out[neurons[r[took]]] = atoms[c[took]]
    return out, int(can.sum())


def assign_negative(
    atoms: np.ndarray,
    neurons: np.ndarray,
    R: np.ndarray,
    n_atoms: int,
    n_neurons: int,
) -> np.ndarray:
    """:func:`assign` for the ``"marginal"`` cost from the pairs with ``R < 0`` alone (as
    :func:`negative_pairs` gives them): single pairs are taken, the rest is the Hungarian
    problem of ``Z = min(R, 0)`` on the atoms and neurons left (zeros elsewhere)."""
    out = np.full(n_neurons, -1, dtype=np.int64)
    per_atom = np.bincount(atoms, minlength=n_atoms)
    per_neuron = np.bincount(neurons, minlength=n_neurons)
    single = (per_atom[atoms] == 1) & (per_neuron[neurons] == 1)
    out[neurons[single]] = atoms[single]
    rest = ~single
    if rest.any():
        rest_atoms, ia = np.unique(atoms[rest], return_inverse=True)
        rest_neurons, il = np.unique(neurons[rest], return_inverse=True)
        Z = np.zeros((len(rest_atoms), len(rest_neurons)))
        Z[ia, il] = R[rest]
        r, c = linear_sum_assignment(Z)
        took = Z[r, c] < 0
        out[rest_neurons[c[took]]] = rest_atoms[r[took]]
    return out


def assign_capped(old: np.ndarray, new: np.ndarray, steps: np.ndarray | None, room: int) -> tuple[np.ndarray, int]:
    """:func:`assign` with at most ``room`` new atoms: the optimal assignment of the L neurons to
    the G atoms of ``old`` (G, L) and ``room`` new ones (the k-th at ``new_l + steps_k``, or
    ``new_l``), by the Hungarian method on the whole (L, G + room) matrix. It is the assignment
    of the same posterior with the number of atoms held at ``G + room`` (a group whose width the
    network's forward fixes; every client then fills the atoms one to one). ``-1`` marks a new
    atom; also returns the number of pairs (atom, neuron), all of them."""
    G, L = old.shape
    room = min(max(int(room), 0), L)
    if G + room < L:
        raise ValueError(f"{L} units cannot take {G} atoms and {room} new ones one to one")
    C = np.empty((L, G + room))
    C[:, :G] = (old - new[None, :]).T
    C[:, G:] = 0.0 if steps is None else steps[None, :room]
    r, c = linear_sum_assignment(C)
    out = np.full(L, -1, dtype=np.int64)
    took = c < G
    out[r[took]] = c[took]
    return out, G * L
