"""Optimal-transport fusion (OT fusion): align every client to an anchor network, then average.

The weight-based, data-free variant of Singh & Jaggi [1]_ (section 4, Algorithm 1), for any
network a :class:`~bayesfuse.inference.spec.PermutationSpec` describes and for ``J >= 1``
clients. One client, the *anchor*, fixes the global basis; the global width of every hidden
group is the anchor's.

The maths. For hidden group (layer) :math:`\\ell`, bottom-up, client :math:`j` with
:math:`n_j` units, the anchor with :math:`n` units, and :math:`T_j^{(\\ell-1)}` the plan of the
group below (the identity for the network's input):

1. Incoming weights in the anchor's basis of the layer below ("aligning incoming edge
   weights", [1]_ eq. (1)):

   .. math:: \\widehat W_j^{(\\ell,\\ell-1)} = W_j^{(\\ell,\\ell-1)}\\, T_j^{(\\ell-1)}
             \\operatorname{diag}(1/\\beta^{(\\ell-1)})

2. Ground cost between client unit :math:`l` (row :math:`\\hat w_{jl}` of
   :math:`\\widehat W_j`, bias appended) and anchor unit :math:`i`, one GEMM:

   .. math:: M_j[l, i] = \\lVert \\hat w_{jl} - w_{ai} \\rVert^2
             = \\lVert \\hat w_{jl}\\rVert^2 + \\lVert w_{ai}\\rVert^2 - 2\\,\\hat w_{jl}\\cdot w_{ai}

3. Exact OT between uniform measures on the units, :math:`\\alpha_j = \\mathbf 1/n_j`,
   :math:`\\beta = \\mathbf 1/n` (``ot.emd``; ``ot.sinkhorn`` with ``reg > 0``):

   .. math:: T_j^{(\\ell)} = \\arg\\min_{T \\ge 0,\\ T\\mathbf 1 = \\alpha_j,\\ T^\\top\\mathbf 1 = \\beta}
             \\langle T, M_j \\rangle

4. The aligned layer ("aligned weights", [1]_ eq. (2)): each anchor unit gets the barycentre of
   the client units transported to it,

   .. math:: \\widetilde W_j^{(\\ell,\\ell-1)} = \\operatorname{diag}(1/\\beta^{(\\ell)})\\,
             T_j^{(\\ell)\\top}\\, \\widehat W_j^{(\\ell,\\ell-1)}

5. The fused layer, the (weighted) average of the aligned layers ([1]_ eq. (3), for J models):
   :math:`W_F^{(\\ell,\\ell-1)} = \\sum_j \\omega_j \\widetilde W_j^{(\\ell,\\ell-1)}`,
   :math:`\\omega_j = 1/J` unless ``weights`` are given.

Steps 1 and 4 are one linear map: with :math:`A_j^{(\\ell)} = T_j^{(\\ell)}
\\operatorname{diag}(1/\\beta^{(\\ell)})` (shape :math:`n_j \\times n`, columns summing to 1),
every axis that group :math:`\\ell` permutes, in every state_dict entry, is contracted with
:math:`A_j^{(\\ell)}`: the rows of a layer (:math:`A^\\top W`, eq. 2), the columns of the next
one (:math:`W A`, eq. 1), biases, an LSTM's gate blocks, the flattened channels a dense layer
reads after a convolution, and both axes of an LSTM's hidden-to-hidden weights
(:math:`A^\\top W_{hh} A`, FedMA's :math:`\\Pi H \\Pi^\\top`). The output layer's classes are not
permuted: its weights are the average of the clients' aligned ones, its bias the average.

What describes a unit in the cost: the entries that the group permutes on their *first* axis
(a layer's weights into its units and its bias, an LSTM's input weights and biases) whose other
permuted axes belong to groups aligned already (see
:func:`~bayesfuse.inference.layerwise.unit_entries`); hidden-to-hidden weights (permuted twice)
and outgoing weights do not enter the cost, as in [1]_. Batch norms are folded into the layer
before them first (:func:`~bayesfuse.inference.layerwise.fold_batchnorm`) and come out as
identities.

Properties. With equal widths and exact OT, :math:`T_j = P_j / n` for a permutation matrix
:math:`P_j` (a vertex of the Birkhoff polytope), so :math:`A_j = P_j` and the aligned client
computes exactly its own function: permuted copies of one network fuse back to it. With
different widths the plan splits units; eq. (1) then averages (rather than sums) the outgoing
weights of a split unit, so an aligned client no longer computes its own function exactly.

References
----------
.. [1] S. P. Singh and M. Jaggi. Model Fusion via Optimal Transport. NeurIPS 2020
   (arXiv:1910.05653).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from bayesfuse._validation import normalised_weights
from bayesfuse.constraints import KEYS, NON_NEGATIVE, validate_params
from bayesfuse.inference.layerwise import (
    LayerwiseResult,
    State,
    _group_axis,
    _to_rows,
    check_states,
    fold_batchnorm,
    folded_entries,
    folded_eps,
    folded_units,
    identity_bn,
    unit_entries,
)
from bayesfuse.inference.result import warn_not_converged
from bayesfuse.inference.spec import Axis, PermutationSpec
from bayesfuse.inference.walk import GroupWalk

__all__ = ["OTLayer", "OTFusionResult", "ot_fuse_layerwise", "ot_plan", "choose_anchor"]

#: Iteration cap of the network simplex (``ot.emd``'s ``numItermax``); POT's default, 1e5,
#: stops short of optimality on layers of a few hundred units.
EMD_MAX_ITER = 10_000_000


@dataclass
class OTLayer:
    """OT alignment of one hidden group (satisfies :class:`~bayesfuse.inference.result.LayerResult`).

    Attributes
    ----------
    plans : list of ndarray
        ``plans[j]`` is client j's transport plan ``T_j`` of shape ``(L_j, G)``: rows sum to
        ``1/L_j``, columns to ``1/G``. The anchor's is ``I / G``.
    assignments : list of ndarray
        ``assignments[j][l]``: the anchor unit receiving most of client j's unit l,
        ``argmax_i T_j[l, i]`` (a permutation with equal widths and exact OT).
    costs : ndarray (J,)
        Each client's transport cost ``<T_j, M_j>`` (0 for the anchor).
    objective : list of float
        ``[sum_j <T_j, M_j>]``, one element: OT fusion does not iterate.
    mean : ndarray (G, D)
        The fused units as rows of the entries that described them (incoming weights in the
        global basis below, bias).
    var : ndarray (G, D)
        Weighted variance of the clients' aligned units around ``mean``: their spread, not a
        posterior.
    converged : bool
        Whether every client's OT solver reached optimality (``ot.emd``) or its tolerance
        (``ot.sinkhorn``).
    seconds : float
    """

    plans: list
    assignments: list
    costs: np.ndarray
    objective: list
    mean: np.ndarray
    var: np.ndarray
    converged: bool = True
    seconds: float = 0.0

    @property
    def n_global(self) -> int:
        """Global units G: the anchor's width."""
        return int(self.plans[0].shape[1])


@dataclass
class OTFusionResult(LayerwiseResult):
    """Outcome of :func:`ot_fuse_layerwise`.

    Attributes
    ----------
    state_dict : dict of str to ndarray
        The fused network (float64; integer buffers are the anchor's; folded batch norms are
        identities).
    layers : dict of str to OTLayer
        The alignment of each hidden group.
    order : tuple of str
        Groups in the order they were aligned (bottom-up).
    sizes : dict of str to int
        Global units per group (the anchor's widths).
    anchor : int
        Index of the anchor client.
    hyper : dict
    seconds : float
    """

    anchor: int = 0


# --------------------------------------------------------------------------- one plan


def ot_plan(cost: np.ndarray, *, reg: float = 0.0, n_iter: int = 1000) -> tuple[np.ndarray, bool]:
    """Transport plan between uniform measures on the rows and columns of ``cost``.

    ``reg == 0``: exact OT, ``ot.emd`` (network simplex). ``reg > 0``: entropic OT,
    ``ot.sinkhorn(..., method="sinkhorn_log")`` on ``cost / max(cost)``, so that ``reg`` is
    relative to the largest cost, with at most ``n_iter`` iterations.

    Returns the plan ``(n_rows, n_cols)`` and whether the solver converged.
    """
    import ot  # POT loads its torch backend when torch is installed: keep it off `import bayesfuse.inference`

    cost = np.ascontiguousarray(cost, dtype=np.float64)
    n, m = cost.shape
    a = np.full(n, 1.0 / n)
    b = np.full(m, 1.0 / m)
    if reg == 0:
        plan, log = ot.emd(a, b, cost, numItermax=EMD_MAX_ITER, log=True)
        return np.asarray(plan), log["result_code"] == 1
    top = cost.max()
    scaled = cost / top if top > 0 else cost
    stop = 1e-9
    with np.errstate(over="ignore"):  # exp of the log-scalings POT also returns (u, v); the plan stays finite
        plan, log = ot.sinkhorn(
            a, b, scaled, reg, method="sinkhorn_log", numItermax=n_iter, stopThr=stop, warn=False, log=True
        )
    plan = np.asarray(plan)
    if not np.isfinite(plan).all():
        raise FloatingPointError(f"Sinkhorn with reg={reg} gave a non-finite plan; raise reg")
    errors = log.get("err", [])
    return plan, bool(len(errors) and errors[-1] < stop)


# --------------------------------------------------------------------------- helpers


@validate_params(anchor=KEYS["anchor"])
def choose_anchor(states: Sequence[State], spec: PermutationSpec, anchor: int | str = "widest") -> int:
    """Index of the anchor client.

    ``int``: that client. ``"widest"``: the client with the most hidden units in all (the fused
    network keeps them all); ``"median"``: the client whose total hidden width is the (lower)
    median. Ties go to the lowest index, so equal widths give client 0.
    """
    J = len(states)
    if isinstance(anchor, int):
        if not anchor < J:
            raise ValueError(f"anchor must be a client index in [0, {J}), got {anchor}")
        return anchor
    widths = np.array([sum(spec.sizes(sd).values()) for sd in states])
    if anchor == "widest":
        return int(np.argmax(widths))  # first maximum
    order = np.argsort(widths, kind="stable")
    return int(order[(J - 1) // 2])


def _apply(a: np.ndarray, d: int, axis: Axis, A: np.ndarray) -> np.ndarray:
    """Contract the units of axis ``d`` with ``A`` (n, G): new unit i is ``sum_l A[l, i] * unit l``."""
    n, g = A.shape
    shape = a.shape
    if axis.size(shape[d]) != n:
        raise ValueError(f"axis of {axis.size(shape[d])} units, alignment map for {n}")
    blocks = a.reshape(*shape[:d], axis.outer, n, axis.inner, *shape[d + 1 :])
    moved = np.moveaxis(blocks, d + 1, -1) @ A
    out = np.moveaxis(moved, -1, d + 1)
    return out.reshape(*shape[:d], axis.outer * g * axis.inner, *shape[d + 1 :])


def _aligned(
    a: np.ndarray, spec: PermutationSpec, name: str, maps: Mapping[str, np.ndarray | None], keep: str | None = None
) -> np.ndarray:
    """Entry ``name`` with every axis of an aligned group (except ``keep``) in the anchor's basis.

    ``maps[g]`` is the client's ``A = T diag(1/beta)`` for group g, ``None`` for the anchor (identity).
    """
    a = np.asarray(a, dtype=np.float64)
    for d, axis in enumerate(spec.axes[name]):
        if axis is not None and axis.group != keep and axis.group in maps and (m := maps[axis.group]) is not None:
            a = _apply(a, d, axis, m)
    return a


def _maps(walk: GroupWalk[list[np.ndarray | None]], j: int) -> dict[str, np.ndarray | None]:
    """Client j's alignment map of every group aligned so far."""
    return {g: maps[j] for g, maps in walk.fused.items()}


def _describing(spec: PermutationSpec, group: str, aligned: Mapping[str, object]) -> list[tuple[str, int, Axis]]:
    """``(entry, dim, axis)`` of the entries that describe ``group``'s units in the cost.

    Those :func:`unit_entries` gives (the group once, other groups aligned), restricted to
    those with the group on their rows' axis (incoming weights, biases: axis 0, a transposed
    convolution's axis 1, ``spec.rows_dim``); all of them when none has (a spec whose units are
    only described by outgoing weights). Where those are vectors alone (a residual stream that
    only norms write on their rows: a language model's, whose embedding writes it), the tables
    whose every other axis no permutation moves (the embeddings, ``(tokens, units)``, and layers
    that read the units into units held in place; not the output layer, whole or in pieces)
    describe the units too: else the norms' weights alone, all 1 at initialisation, would decide
    the plan.
    """
    entries = unit_entries(spec, group, aligned, folded_entries(spec))
    if not entries:
        raise ValueError(f"no parameter describes the units of group {group!r}")
    located = [(k, *_group_axis(spec, k, group)) for k in entries]
    incoming = [e for e in located if e[1] == spec.rows_dim(e[0])]
    if incoming and all(len(spec.axes[k]) == 1 for k, _, _ in incoming):
        incoming += [
            e
            for e in located
            if e not in incoming
            and e[0] not in spec.output
            and all(a is None for d, a in enumerate(spec.axes[e[0]]) if d != e[1])
        ]
    return incoming or located


def _sq_distances(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``||x_l - y_i||^2`` for all rows, as one GEMM; clipped at 0 against rounding."""
    d = (x * x).sum(1)[:, None] + (y * y).sum(1)[None, :] - 2.0 * (x @ y.T)
    return np.maximum(d, 0.0)


# --------------------------------------------------------------------------- fusion


@validate_params(anchor=KEYS["anchor"], reg=NON_NEGATIVE, n_iter=KEYS["n_iter"])
def ot_fuse_layerwise(
    states: Sequence[State],
    spec: PermutationSpec,
    *,
    anchor: int | str = "widest",
    weights: Sequence[float] | None = None,
    reg: float = 0.0,
    n_iter: int = 1000,
    names: Sequence[str] | None = None,
) -> OTFusionResult:
    """Fuse networks by optimal transport of their units onto an anchor's (Singh & Jaggi, section 4).

    Every hidden group is aligned bottom-up: each client's units (incoming weights already in
    the anchor's basis of the group below, bias) are transported onto the anchor's units with
    uniform marginals and a squared-Euclidean ground cost; each client's network is mapped into
    the anchor's basis with its plans and the aligned networks are averaged. See the module
    docstring for the equations.

    Parameters
    ----------
    states : sequence of dict
        The clients' state_dicts (NumPy arrays or tensors), one architecture, hidden widths free.
    spec : PermutationSpec
    anchor : int, "widest" or "median"
        The client whose basis and widths the fused network takes (:func:`choose_anchor`).
        ``"widest"`` (default) keeps the most units; with equal widths it is client 0.
    weights : sequence of float, optional
        Weight of each client in the average (e.g. its number of examples); uniform by default.
    reg : float
        0 (default): exact OT (``ot.emd``), the paper's choice. ``> 0``: entropic OT
        (``ot.sinkhorn``) with this regularisation relative to the largest ground cost; the
        plan then spreads each unit over several anchor units.
    n_iter : int
        Iteration cap of Sinkhorn (``reg > 0`` only).
    names : sequence of str, optional
        How error messages call the clients; ``"client j"`` by default.

    Returns
    -------
    OTFusionResult

    Warns
    -----
    ConvergenceWarning
        Once, naming the groups where an OT solver stopped before optimality / tolerance.

    Examples
    --------
    >>> import numpy as np
    >>> from bayesfuse.inference.spec import chain, dense, permute
    >>> spec = chain(dense("fc1", None, "P1"), dense("fc2", "P1", None), output=("fc2.weight", "fc2.bias"))
    >>> rng = np.random.default_rng(0)
    >>> net = {"fc1.weight": rng.normal(size=(4, 3)), "fc1.bias": rng.normal(size=4),
    ...        "fc2.weight": rng.normal(size=(2, 4)), "fc2.bias": rng.normal(size=2)}
    >>> shuffled = permute(net, spec, {"P1": np.array([2, 0, 3, 1])})
    >>> res = ot_fuse_layerwise([net, shuffled], spec, anchor=0)
    >>> bool(np.allclose(res.state_dict["fc2.weight"], net["fc2.weight"]))
    True
    >>> res.layers["P1"].assignments[1]
    array([2, 0, 3, 1])
    """
    start = time.perf_counter()
    arrays = check_states(states, spec, names)
    if spec.folds:
        arrays = [fold_batchnorm(sd, spec) for sd in arrays]
    J = len(arrays)
    omega = normalised_weights(weights, J, what="client")
    a_idx = choose_anchor(arrays, spec, anchor)
    # a group's basis: each client's map A_j = T_j diag(1/beta) onto the anchor's units (None: the anchor)
    walk: GroupWalk[list[np.ndarray | None]] = GroupWalk(spec)
    layers: dict[str, OTLayer] = {}
    for _, group in walk:
        t0 = time.perf_counter()
        described = _describing(spec, group, walk.fused)
        rows = []
        for j, sd in enumerate(arrays):
            maps_j = _maps(walk, j)
            rows.append(
                np.hstack([_to_rows(_aligned(sd[k], spec, k, maps_j, keep=group), d, axis) for k, d, axis in described])
            )
        target = rows[a_idx]
        G = target.shape[0]
        maps: list[np.ndarray | None] = []
        plans, costs, converged = [], np.zeros(J), True
        for j, r in enumerate(rows):
            if j == a_idx:
                plan, ok = np.eye(G) / G, True
                maps.append(None)
            else:
                cost = _sq_distances(r, target)
                plan, ok = ot_plan(cost, reg=reg, n_iter=n_iter)
                costs[j] = float((plan * cost).sum())
                maps.append(plan * G)  # T diag(1/beta), beta = 1/G
            plans.append(plan)
            converged &= bool(ok)
        walk.record(group, maps)
        aligned_rows = np.stack([r if (m := maps[j]) is None else m.T @ r for j, r in enumerate(rows)])
        mean = np.tensordot(omega, aligned_rows, axes=1)
        var = np.tensordot(omega, (aligned_rows - mean) ** 2, axes=1)
        layers[group] = OTLayer(
            plans=plans,
            assignments=[p.argmax(1) for p in plans],
            costs=costs,
            objective=[float(costs.sum())],
            mean=mean,
            var=var,
            converged=converged,
            seconds=time.perf_counter() - t0,
        )
    warn_not_converged(layers, "the optimal transport of hidden layers", stacklevel=2)
    sizes = {g: layers[g].n_global for g in spec.groups}
    folded = folded_entries(spec)
    state = {}
    client_maps = [_maps(walk, j) for j in range(J)]
    for k in spec.axes:
        ref = arrays[a_idx][k]
        if k in folded:
            bn, _, what = k.rpartition(".")
            state[k] = identity_bn(folded_units(spec, k, sizes, ref), folded_eps(arrays[a_idx], bn))[what]
        elif not np.issubdtype(np.asarray(ref).dtype, np.floating):
            state[k] = np.asarray(ref).copy()
        else:
            state[k] = sum(w * _aligned(sd[k], spec, k, m) for w, sd, m in zip(omega, arrays, client_maps))
    return OTFusionResult(
        state_dict=state,
        layers=layers,
        order=tuple(spec.groups),
        sizes=sizes,
        anchor=a_idx,
        hyper=dict(anchor=anchor, weights=None if weights is None else omega.tolist(), reg=reg, n_iter=int(n_iter)),
        seconds=time.perf_counter() - start,
    )
