"""KL-fusion of mean-field posteriors (Claici, Yurochkin, Ghosh & Solomon, ICML 2020).

Each client j brings a mean-field posterior: a batch of L_j components of one exponential
family (:mod:`bayesfuse.inference.expfam`). The fused posterior has G components; assignment
matrices ``P_j`` (L_j x G) say which global component explains which local one.

* Homogeneous fusion (eq. 3): every client has the same L components, the ``P_j`` are
  permutations; alternate Hungarian assignments on ``KL(global_g || local_l)`` with KL
  barycenters (eq. 4: natural parameters averaged).
* Heterogeneous, nonparametric fusion (eq. 9): the ``P_j`` are relaxed to
  ``P >= 0``, rows summing to 1, columns summing to at most 1, and the L2,2,1 norm (eq. 8)

  .. math:: \\min_P \\sum_j \\langle C_j, P_j \\rangle
            + \\lambda \\sum_g \\Big(\\sum_j \\sum_l (P^j_{lg})^2\\Big)^{1/2}

  drives whole global components out of use; those are dropped, the components are updated as
  P-weighted barycenters, and the two steps alternate. The relaxed problem's solvers live in
  :mod:`bayesfuse.inference.relaxed`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment
from tqdm.auto import tqdm

from bayesfuse.inference.expfam import ExpFamily, _check_same_family
from bayesfuse.inference.relaxed import Solver, relaxed_objective, solve_relaxed
from bayesfuse.inference.result import warn_not_converged

__all__ = ["KLFusionResult", "kl_fuse"]

#: A global component whose column of P (all clients) carries less mass than this is unused
#: and dropped. Iterative solvers leave entries of order their tolerance in unused columns.
UNUSED = 1e-3


@dataclass
class KLFusionResult:
    """Outcome of :func:`kl_fuse`.

    Attributes
    ----------
    components : ExpFamily
        The G global components (the fused mean-field posterior).
    assignments : list of ndarray of int
        ``assignments[j][l]``: the global component of client j's component l (rounded).
    relaxed : list of ndarray
        The relaxed ``P_j`` (L_j x G) of the last step (one-hot in homogeneous mode).
    objective : list of float
        Objective after each alternation step: eq. 3 (homogeneous) or eq. 9 relaxed, with the
        costs scaled as used (heterogeneous).
    converged : bool
    solver : str
        What solved the relaxed problems ("hungarian", "fast" or "cvxpy:<NAME>").
    step_seconds : list of float
    seconds : float
    cost_scale : float
        The standard deviation the KL costs were divided by (1 in homogeneous mode).
    """

    components: ExpFamily
    assignments: list[np.ndarray]
    relaxed: list[np.ndarray]
    objective: list[float]
    converged: bool
    solver: str
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cost_scale: float = 1.0

    def to_arviz(self, *, num_draws: int = 1000, chains: int = 4, seed: int = 0):
        """Draws of the fused posterior and the assignments as an ArviZ object (see :mod:`bayesfuse.analysis`)."""
        from bayesfuse.analysis import klfusion_to_arviz

        return klfusion_to_arviz(self, num_draws=num_draws, chains=chains, seed=seed)

    @property
    def n_components(self) -> int:
        return len(self.components)

    @property
    def n_global(self) -> int:
        """Number of global components G (the :class:`~bayesfuse.inference.result.LayerResult` protocol)."""
        return len(self.components)

    def __repr__(self) -> str:
        sizes = [len(a) for a in self.assignments]
        return (f"KLFusionResult({len(sizes)} clients with {sum(sizes)} {self.components.name} components "
                f"-> {self.n_components} global, {len(self.objective)} steps, converged={self.converged}, "
                f"{self.seconds:.2f} s)")


# ------------------------------------------------------------------------ rounding the relaxed P


def _merge_duplicates(P_list: list[np.ndarray], costs: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Merge global components whose columns of P are proportional.

    Their barycenters would be identical, i.e. one component counted twice. The L2,2,1 norm
    cannot tell one column from its split into proportional copies (each copy's norm scales
    with its share), so the relaxation leaves such splits; merging removes the tie before
    rounding. Columns are compared after normalising to unit mass, to 3 decimals (the fast
    solver leaves entries of order 1e-5 of noise; distinct components have distinct supports).
    A merge that would give one client more than unit mass in the merged column is skipped.
    """
    stacked = np.vstack(P_list)
    unit = stacked / stacked.sum(0, keepdims=True)
    _, groups = np.unique(np.round(unit.T, 3), axis=0, return_inverse=True)
    groups = groups.ravel()
    if len(np.unique(groups)) == stacked.shape[1]:
        return P_list, costs
    per_client = np.vstack([p.sum(0) for p in P_list])  # (J, G)
    label = np.arange(stacked.shape[1])
    for k in np.unique(groups):
        members = np.flatnonzero(groups == k)
        if len(members) > 1 and (per_client[:, members].sum(1) <= 1 + 1e-6).all():
            label[members] = members[0]
    keep_cols, target = np.unique(label, return_inverse=True)
    merge = np.zeros((stacked.shape[1], len(keep_cols)))
    merge[np.arange(stacked.shape[1]), target.ravel()] = 1.0
    return [p @ merge for p in P_list], [c[:, keep_cols] for c in costs]


def _round(P: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Nearest assignment to a relaxed P: the injective map l -> g of largest total P.

    Ties (a P that is not binary) are broken towards lower cost. When P is binary, as it is
    at small ``reg``, this returns P's own assignment.
    """
    rows, cols = linear_sum_assignment(-P + 1e-9 * cost)
    a = np.empty(P.shape[0], dtype=np.int64)
    a[rows] = cols
    return a


# ---------------------------------------------------------------------------- alternation


def _split(x: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    starts = np.cumsum([0, *sizes])
    return [x[a:b] for a, b in zip(starts[:-1], starts[1:])]


def kl_fuse(
    posteriors: Sequence[ExpFamily],
    *,
    mode: Literal["heterogeneous", "homogeneous"] = "heterogeneous",
    reg: float = 0.1,
    n_iter: int = 20,
    solver: Solver = "auto",
    init: ExpFamily | None = None,
    cost_scale: Literal["std"] | float = "std",
    verbose: bool = False,
) -> KLFusionResult:
    """Fuse J mean-field posteriors of one exponential family into one (KL-fusion, eq. 3 / 9).

    Parameters
    ----------
    posteriors : sequence of ExpFamily
        One batch of components per client, all of one family and event shape.
    mode : {"heterogeneous", "homogeneous"}
        Homogeneous: equal numbers of components, matched one to one (eq. 3). Heterogeneous:
        the nonparametric problem of eq. 9.
    reg : float
        ``lambda`` of eq. 9. The KL costs are first divided by their standard deviation (over
        all entries of the first step; kept fixed afterwards so that objectives compare), and
        the paper's advice is ``lambda = 0.1``. Larger values merge more.
    n_iter : int
        Maximum number of alternation steps.
    solver : {"auto", "cvxpy", "fast"}
        For the relaxed problem; see :func:`~bayesfuse.inference.relaxed.solve_relaxed`.
    cost_scale : "std" or float
        What the KL costs are divided by: their standard deviation over all entries of the
        first step ("Choosing lambda", the default), or a fixed number. The std makes
        ``reg`` relative to the spread of all KLs, so when a few pairs are very far apart
        (well separated components, many samples) it grows and ``reg = 0.1`` merges more.
    init : ExpFamily, optional
        Initial global components. Default: homogeneous, the first client's components;
        heterogeneous, all clients' components (G = sum_j L_j, an upper bound that the
        regulariser prunes).
    verbose : bool
        Progress bar over steps.

    Returns
    -------
    KLFusionResult

    Notes
    -----
    Costs are ``KL(global || local)`` (eq. 3), the direction the barycenter step minimises
    (eq. 4). In heterogeneous mode the barycenters are weighted by the relaxed P during the
    alternation (section 4.3), and global components whose column of P carries less than
    :data:`UNUSED` mass are dropped. The reported assignments round each P_j to the injective
    map of largest total weight (:func:`_round`), which is P itself when P is binary. The
    relaxation is not always binary: a local component may split its mass between two nearly
    equal global components. So the returned ``components`` are the barycenters of the
    *rounded* assignments (components no rounded assignment uses are dropped), which makes each
    of them exactly the KL barycenter of the local components assigned to it; ``relaxed``
    keeps the last relaxed P for those components. The alternation stops when the number of
    global components and the rounded assignments stop changing.
    """
    start = time.perf_counter()
    posteriors = list(posteriors)
    _check_same_family(posteriors)
    for j, q in enumerate(posteriors):
        if len(q) == 0:
            raise ValueError(f"client {j} has no components (empty client)")
    if not np.isfinite(reg) or reg < 0:
        raise ValueError(f"reg must be >= 0, got {reg}")
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    family = type(posteriors[0])
    sizes = [len(q) for q in posteriors]
    pooled = family.concat(posteriors)
    if init is not None:
        _check_same_family([posteriors[0], init])

    if mode == "homogeneous":
        if len(set(sizes)) != 1:
            raise ValueError(f"homogeneous fusion needs equal numbers of components, got {sizes}")
        return _homogeneous(posteriors, pooled, sizes, init or posteriors[0], n_iter, verbose, start)
    if mode != "heterogeneous":
        raise ValueError(f"mode must be 'heterogeneous' or 'homogeneous', got {mode!r}")

    glob = init if init is not None else pooled
    if len(glob) < max(sizes):
        raise ValueError(f"init has {len(glob)} components; client sizes go up to {max(sizes)}")
    objective, step_seconds, used_solver = [], [], ""
    assignments: list[np.ndarray] | None = None
    scale = None
    converged = False
    P_list: list[np.ndarray] = []
    bar = tqdm(range(n_iter), desc="KL-fusion", unit="step", disable=not verbose)
    for _ in bar:
        t0 = time.perf_counter()
        kl = glob.kl(pooled).T  # (N, G): KL(global_g || local_n)
        if scale is None:
            scale = (float(kl.std()) or 1.0) if cost_scale == "std" else float(cost_scale)
            if not scale > 0:
                raise ValueError(f"cost_scale must be 'std' or a positive number, got {cost_scale!r}")
        costs = _split(kl / scale, sizes)
        P_list, used_solver = solve_relaxed(costs, reg, solver=solver, init=P_list or None)
        objective.append(relaxed_objective(costs, P_list, reg))
        keep = np.vstack(P_list).sum(0) > UNUSED
        P_list = [p[:, keep] / p[:, keep].sum(1, keepdims=True) for p in P_list]
        costs = [c[:, keep] for c in costs]
        P_list, costs = _merge_duplicates(P_list, costs)
        new_assign = [_round(p, c) for p, c in zip(P_list, costs)]
        same = assignments is not None and len(glob) == int(keep.sum()) and all(
            np.array_equal(a, b) for a, b in zip(assignments, new_assign))
        assignments = new_assign
        glob = pooled.barycenter(np.vstack(P_list).T)  # (G', N) weights
        step_seconds.append(time.perf_counter() - t0)
        bar.set_postfix(components=len(glob), objective=f"{objective[-1]:.4g}")
        if same:
            converged = True
            break
    # The fused posterior: each global component the barycenter of the local components the
    # rounded assignments give it; components no rounded assignment uses are dropped.
    flat = np.concatenate(assignments)
    used, flat = np.unique(flat, return_inverse=True)
    weights = np.zeros((len(used), len(flat)))
    weights[flat, np.arange(len(flat))] = 1.0
    assignments = _split(flat, sizes)
    P_list = [p[:, used] for p in P_list]
    return _warned(KLFusionResult(pooled.barycenter(weights), assignments, P_list, objective, converged, used_solver,
                                  step_seconds, time.perf_counter() - start, scale))


def _homogeneous(posteriors, pooled, sizes, glob, n_iter, verbose, start) -> KLFusionResult:
    L = sizes[0]
    if len(glob) != L:
        raise ValueError(f"homogeneous init needs {L} components, got {len(glob)}")
    assignments = None
    objective, step_seconds = [], []
    converged = False
    for _ in tqdm(range(n_iter), desc="KL-fusion", unit="step", disable=not verbose):
        t0 = time.perf_counter()
        new, total = [], 0.0
        for q in posteriors:
            cost = glob.kl(q).T  # (L, G)
            rows, cols = linear_sum_assignment(cost)
            a = np.empty(L, dtype=np.int64)
            a[rows] = cols
            total += float(cost[rows, cols].sum())
            new.append(a)
        weights = np.zeros((L, len(pooled)))
        weights[np.concatenate(new), np.arange(len(pooled))] = 1.0
        glob = pooled.barycenter(weights)
        objective.append(float(sum(glob.kl(q)[a, np.arange(L)].sum() for q, a in zip(posteriors, new))))
        step_seconds.append(time.perf_counter() - t0)
        same = assignments is not None and all(np.array_equal(a, b) for a, b in zip(assignments, new))
        assignments = new
        if same:
            converged = True
            break
    relaxed = [np.eye(L)[a] for a in assignments]
    return _warned(KLFusionResult(glob, assignments, relaxed, objective, converged, "hungarian", step_seconds,
                                  time.perf_counter() - start, 1.0))


def _warned(result: KLFusionResult) -> KLFusionResult:
    warn_not_converged({"KL-fusion": result}, "KL-fusion", stacklevel=4)
    return result
