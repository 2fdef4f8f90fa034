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

  The relaxation can only empty columns, so it needs a start with enough of them. Starting from
  every local component (G = N = sum_j L_j) makes P and the cost matrix N x N, so time and
  memory grow like J^2 and more. The default start is instead one greedy pass of Hungarian
  assignments on eq. 9 with binary P (:func:`greedy_assign`: client by client, a local
  component joins the column whose KL plus L2,2,1 increment is smallest, or opens a new one at
  cost ``lambda``), refined by a few passes and given a margin of candidate columns; its G is
  about the number of distinct components, and P is N x G. The cost scale stays the std of all
  N x N pairwise KLs, computed in blocks of rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Sequence, cast

import numpy as np
from scipy.optimize import linear_sum_assignment
from tqdm.auto import tqdm

from bayesfuse.constraints import KEYS, NON_NEGATIVE, POSITIVE, Either, Interval, Options, validate_params
from bayesfuse.inference.expfam import ExpFamily, KLTerms, check_same_family, kl_matrix, kl_moments
from bayesfuse.inference.relaxed import ADMMState, Solver, relaxed_objective, solve_relaxed
from bayesfuse.inference.result import exporter, warn_not_converged

__all__ = ["KLFusionResult", "greedy_assign", "greedy_start", "kl_fuse"]

#: A global component whose column of P (all clients) carries less mass than this is unused
#: and dropped. Iterative solvers leave entries of order their tolerance in unused columns.
UNUSED = 1e-3
#: Largest ratio of two Gaussian variances :func:`kl_fuse` takes. Float64 carries 16 digits: the
#: moment-matched barycenters (E[x^2] - E[x]^2) lose a variance below 1e-16 of a larger one they
#: pool, and on small random federations whose variances were near 1 one variance 1e17-1e18 times
#: larger or smaller made the costs NaN ("matrix contains invalid numeric entries"); 1e15 keeps
#: a margin of 100 below that.
MAX_VARIANCE_RATIO = 1e15


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
    n_initial : int
        Number of global components the alternation started from.
    solver_iterations : list of int
        Iterations of the fast solver at each step (0 for cvxpy; empty in homogeneous mode). It
        is warm-started from the previous step's P (the greedy P at the first step), and from
        its duals too when that step left P in place (:data:`STILL`).
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
    n_initial: int = 0
    solver_iterations: list[int] = field(default_factory=list)

    def to_arviz(self, **options):
        """Independent draws of the fused components, their ``loc``/``scale``, the assignments and the
        solver as an ArviZ object; ``options`` (``units``, ``num_draws``, ``weight_names``, ``seed``)
        as in :func:`bayesfuse.analysis.klfusion_to_arviz`. Components of another family than
        diagonal Gaussians (a topic model's Dirichlets, an HMM's Normal-Wisharts) are drawn from
        their own family (:func:`bayesfuse.analysis.families.family_to_arviz`)."""
        return exporter("klfusion")(self, **options)

    @property
    def n_components(self) -> int:
        return len(self.components)

    @property
    def n_global(self) -> int:
        """Number of global components G (the :class:`~bayesfuse.inference.result.LayerResult` protocol)."""
        return len(self.components)

    def __repr__(self) -> str:
        sizes = [len(a) for a in self.assignments]
        return (
            f"KLFusionResult({len(sizes)} clients with {sum(sizes)} {self.components.name} components "
            f"-> {self.n_components} global, {len(self.objective)} steps, converged={self.converged}, "
            f"{self.seconds:.2f} s)"
        )


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

#: The fast solver's duals carry over to the next step only when the step moved no entry of
#: P by more than this: then the barycenters, hence the next costs, are (nearly) the same and
#: the duals nearly optimal (the greedy start's confirming step converges in one iteration).
#: Duals of a problem whose barycenters moved make ADMM's residual test pass early at a worse
#: point, so they are dropped then.
STILL = 1e-3


def _split(x: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    starts = np.cumsum([0, *sizes])
    return [x[a:b] for a, b in zip(starts[:-1], starts[1:])]


# ------------------------------------------------------------------------ greedy initialisation


class _Columns:
    """Global columns for :func:`greedy_assign`: natural-parameter sums, member counts, and the
    KL terms of the current barycenters (sum / count). Storage grows by doubling; emptied
    columns are reused by the next opened ones."""

    def __init__(self, family: type[ExpFamily], event_shape: tuple[int, ...], n_params: int, capacity: int):
        self.family, self.event_shape, self.size = family, event_shape, 0
        self.eta_sum = np.zeros((capacity, n_params))
        self.count = np.zeros(capacity, dtype=np.int64)
        self.terms = KLTerms(
            np.zeros((capacity, n_params)), np.zeros((capacity, n_params)), np.zeros(capacity), np.zeros(capacity)
        )

    def active(self) -> np.ndarray:
        return np.flatnonzero(self.count[: self.size] > 0)

    def free(self, n: int) -> np.ndarray:
        """``n`` empty columns, emptied ones first, growing the storage when needed."""
        empty = np.flatnonzero(self.count[: self.size] == 0)[:n]
        fresh = self.size + np.arange(n - len(empty))
        need = self.size + len(fresh)
        if need > len(self.count):
            grow = max(need, 2 * len(self.count)) - len(self.count)
            self.eta_sum = np.vstack([self.eta_sum, np.zeros((grow, self.eta_sum.shape[1]))])
            self.count = np.concatenate([self.count, np.zeros(grow, dtype=np.int64)])
            t = self.terms
            self.terms = KLTerms(
                *(np.concatenate([x, np.zeros((grow, *x.shape[1:]))]) for x in (t.eta, t.mu, t.log_norm, t.self_dot))
            )
        self.size = need
        return np.concatenate([empty, fresh]).astype(np.int64)

    def update(self, cols: np.ndarray, eta: np.ndarray, sign: int) -> None:
        """Local components with natural parameters ``eta`` join (``sign`` 1) or leave (-1)
        the distinct columns ``cols``; the barycenters of the non-empty ones are recomputed."""
        self.eta_sum[cols] += sign * eta
        self.count[cols] += sign
        cols = cols[self.count[cols] > 0]
        if len(cols) == 0:
            return
        new = KLTerms.from_natural(self.family, self.eta_sum[cols] / self.count[cols, None], self.event_shape)
        for mine, theirs in zip(
            (self.terms.eta, self.terms.mu, self.terms.log_norm, self.terms.self_dot),
            (new.eta, new.mu, new.log_norm, new.self_dot),
        ):
            mine[cols] = theirs


@validate_params(sweeps=Interval(int, 0, None, "left"))
def greedy_assign(
    family: type[ExpFamily],
    event_shape: tuple[int, ...],
    terms: KLTerms,
    sizes: Sequence[int],
    reg: float,
    scale: float,
    *,
    sweeps: int = 3,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Binary assignments of eq. 9 by greedy Hungarian passes over the clients (the default
    start of heterogeneous :func:`kl_fuse`).

    With binary ``P`` the objective of eq. 9 is ``sum_l C_{l g(l)} / scale + reg sum_g
    sqrt(m_g)``, ``m_g`` the members of column g (the L2,2,1 norm of eq. 8 of a 0/1 tensor).
    Clients are visited largest first (ties in order); client j's components are placed by one
    Hungarian assignment on the increments of that objective: joining a column g that has
    ``k`` members costs ``KL(bar_g || q_l) / scale + reg (sqrt(k + 1) - sqrt(k))``, ``bar_g``
    the KL barycenter of its members (eq. 4: natural parameters averaged), and opening a new
    column costs ``reg`` (its barycenter is ``q_l`` itself, KL 0). Each column takes at most
    one component per client (the constraint ``P_j^T 1 <= 1``), and barycenters are updated as
    members join. ``KL(bar_g || q_l)`` bounds the increase of the KL part from above (the old
    barycenter is feasible for the new column), so the pass is a greedy rounding of the same
    objective. Up to ``sweeps`` further passes then take each client out in turn and place it
    again the same way (columns it leaves empty close), stopping early when a pass changes
    nothing: coordinate descent over the clients, as in PFNM's iterated matching.

    Parameters
    ----------
    family, event_shape : the components' family and event shape.
    terms : KLTerms
        Of all clients' components stacked (N = sum L_j rows), client by client.
    sizes : sequence of int
        L_j.
    reg, scale : ``lambda`` and the cost scale of eq. 9.
    sweeps : int
        Passes after the first.

    Returns
    -------
    assignments : list of (L_j,) int arrays
        Column of each local component, columns numbered 0..G-1.
    cost : (N,) array
        Each component's final scaled cost ``KL(bar_g || q_l) / scale`` in its column.
    """
    starts = np.cumsum([0, *sizes])
    cols = _Columns(family, event_shape, terms.eta.shape[1], 2 * max(sizes))
    assignments: list[np.ndarray | None] = [None] * len(sizes)
    order = np.argsort(-np.asarray(sizes), kind="stable")
    for _sweep in range(sweeps + 1):
        changed = False
        for j in order:
            local = terms[starts[j] : starts[j + 1]]
            old = assignments[j]
            if old is not None:
                cols.update(old, local.eta, -1)
            active = cols.active()
            bars = cols.terms[: cols.size] if len(active) == cols.size else cols.terms[active]
            join = kl_matrix(bars, local).T / scale  # (L_j, G)
            k = cols.count[active]
            join += reg * (np.sqrt(k + 1.0) - np.sqrt(k))[None, :]
            cost = np.hstack([join, np.full((len(local), len(local)), reg)])
            rows, chosen = linear_sum_assignment(cost)
            a = np.empty(len(local), dtype=np.int64)
            a[rows] = chosen
            opened = a >= len(active)
            a[~opened] = active[a[~opened]]
            a[opened] = cols.free(int(opened.sum()))
            cols.update(a, local.eta, 1)
            assignments[j] = a
            changed |= old is None or not np.array_equal(old, a)
        if not changed:
            break
    # every client is placed in the first pass (sweeps >= 0)
    used, flat = np.unique(np.concatenate(cast(list[np.ndarray], assignments)), return_inverse=True)
    bar = cols.terms[used[flat]]
    # KL(bar_g || q_l) row by row: A(eta_l) - A(eta_g) - <mu_g, eta_l> + <mu_g, eta_g>
    kl = terms.log_norm - bar.log_norm - np.einsum("np,np->n", bar.mu, terms.eta) + bar.self_dot
    return _split(flat, sizes), np.maximum(kl, 0.0) / scale


def greedy_start(
    pooled: ExpFamily, terms: KLTerms, sizes: Sequence[int], reg: float, scale: float
) -> tuple[ExpFamily, list[np.ndarray]]:
    """Initial global components for heterogeneous :func:`kl_fuse`: the barycenters of
    :func:`greedy_assign`, plus a margin, and the warm start ``P`` (one-hot on the greedy columns).

    The relaxation of eq. 9 can only empty (or merge) the columns it is given, never open one,
    so the margin offers a new column to every component the greedy rounding may have misplaced:
    each member of a column with ``k >= 2`` members whose final cost in it is at least
    ``reg (1 - (sqrt(k) - sqrt(k - 1)))`` -- leaving for a column of its own (cost ``reg``) would
    not increase eq. 9 at the final barycenters. Its own parameters are that column's start.
    Unused margin columns carry no mass after the first step and are dropped.
    """
    assignments, cost = greedy_assign(type(pooled), pooled.event_shape, terms, sizes, reg, scale)
    _, flat = np.unique(np.concatenate(assignments), return_inverse=True)
    g = int(flat.max()) + 1
    members = np.bincount(flat, minlength=g)[flat].astype(float)
    misplaced = np.flatnonzero((members >= 2) & (cost >= reg * (1.0 - (np.sqrt(members) - np.sqrt(members - 1.0)))))
    weights = np.zeros((g + len(misplaced), len(flat)))
    weights[flat, np.arange(len(flat))] = 1.0
    weights[g + np.arange(len(misplaced)), misplaced] = 1.0
    warm = np.zeros((len(flat), len(weights)))
    warm[np.arange(len(flat)), flat] = 1.0
    return pooled.barycenter(weights, natural=terms.eta), _split(warm, sizes)


def _check_variance_range(posteriors: Sequence[ExpFamily]) -> None:
    """Refuse diagonal Gaussians whose variances span more than :data:`MAX_VARIANCE_RATIO`,
    naming the client, component, coordinate and value of the one farthest from the median."""
    variances = [v for v in (getattr(q, "var", None) for q in posteriors) if isinstance(v, np.ndarray)]
    if len(variances) < len(posteriors):
        return  # other families carry no variance of their own to compare
    logs = [np.log10(v) for v in variances]
    low, high = min(float(a.min()) for a in logs), max(float(a.max()) for a in logs)
    if high - low <= np.log10(MAX_VARIANCE_RATIO):
        return
    median = float(np.median(np.concatenate([a.ravel() for a in logs])))
    j = max(range(len(logs)), key=lambda i: float(np.abs(logs[i] - median).max()))
    comp, coord = np.unravel_index(int(np.abs(logs[j] - median).argmax()), logs[j].shape)
    value = float(variances[j][comp, coord])
    side = "larger" if value > 10**median else "smaller"
    raise ValueError(
        f"client {j}'s variance {value:g} (component {comp}, coordinate {coord}) is "
        f"{10 ** abs(np.log10(value) - median):.1e} times {side} than the clients' median variance "
        f"{10**median:g}: kl_fuse needs all variances within a factor "
        f"{MAX_VARIANCE_RATIO:.0e} of each other (beyond it float64 loses the smaller ones); check that "
        "client's posterior"
    )


@validate_params(
    mode=Options(("heterogeneous", "homogeneous")),
    reg=NON_NEGATIVE,
    n_iter=KEYS["n_iter"],
    solver=KEYS["solver"],
    cost_scale=Either((Options(("std",)), POSITIVE)),
)
def kl_fuse(
    posteriors: Sequence[ExpFamily],
    *,
    mode: Literal["heterogeneous", "homogeneous"] = "heterogeneous",
    reg: float = 0.1,
    n_iter: int = 20,
    solver: Solver = "auto",
    init: ExpFamily | Literal["greedy", "pooled"] | None = None,
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
        ``lambda`` of eq. 9. The KL costs are first divided by their standard deviation (see
        ``cost_scale``; kept fixed over the steps so that objectives compare), and the paper's
        advice is ``lambda = 0.1``. Larger values merge more.
    n_iter : int
        Maximum number of alternation steps.
    solver : {"auto", "cvxpy", "fast"}
        For the relaxed problem; see :func:`~bayesfuse.inference.relaxed.solve_relaxed`.
    cost_scale : "std" or float
        What the KL costs are divided by: the standard deviation of all pairwise KLs between
        the clients' components, ``KL(q_a || q_b)`` over all N x N pairs (N = sum_j L_j;
        "Choosing lambda", the default), or a fixed number. The std makes ``reg`` relative
        to the spread of all KLs, so when a few pairs are very far apart (well separated
        components, many samples) it grows and ``reg = 0.1`` merges more. It is computed in
        blocks of rows (:meth:`~bayesfuse.inference.expfam.ExpFamily.kl_std`), never holding
        the N x N matrix. It is the std of the first step's cost matrix when the alternation
        starts from all components (``init="pooled"``); with ``init`` an ExpFamily the std of
        the first step's costs ``KL(init || local)`` is used instead.
    init : ExpFamily, "greedy" or "pooled", optional
        Initial global components. Homogeneous default: the first client's components.
        Heterogeneous: ``"greedy"`` (the default) the barycenters of greedy passes of
        Hungarian assignments on eq. 9 with binary P (:func:`greedy_assign`) plus a margin of
        candidate columns (:func:`greedy_start`), P warm-started from the greedy assignment;
        ``"pooled"`` all clients' components (G = sum_j L_j, an upper bound that the
        regulariser prunes; P and the costs are N x N, so time and memory grow at least like
        J^2); an ExpFamily: those components.
    verbose : bool
        Progress bar over steps.

    Returns
    -------
    KLFusionResult

    Notes
    -----
    Costs are ``KL(global || local)`` (eq. 3), the direction the barycenter step minimises
    (eq. 4). The relaxation can only empty columns, so the result has at most as many
    components as the start (``n_initial``). From the greedy start, the first step's relaxed
    objective is at most eq. 9 at the greedy binary assignment (that P is feasible and worth
    exactly that). Neither start dominates the other in the final eq. 9 (the alternation is a
    local method and the rounding of a fractional P a heuristic): on small ambiguous random
    federations the greedy start was better about three times as often as worse, and every time
    the pooled start ended with more components than the greedy one started with, the greedy
    start's answer was the better one (tests/inference/test_klfusion.py). In heterogeneous mode
    the barycenters are weighted by the relaxed P during the alternation (section 4.3), and global
    components whose column of P carries less than
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
    check_same_family(posteriors)
    for j, q in enumerate(posteriors):
        if len(q) == 0:
            raise ValueError(f"client {j} has no components (empty client)")
    _check_variance_range(posteriors)
    family = type(posteriors[0])
    sizes = [len(q) for q in posteriors]
    pooled = family.concat(posteriors)
    if isinstance(init, str):
        if mode != "heterogeneous" or init not in ("greedy", "pooled"):
            raise ValueError(f"init must be an ExpFamily, or 'greedy' or 'pooled' in heterogeneous mode, got {init!r}")
    elif init is not None:
        check_same_family([posteriors[0], init])

    if mode == "homogeneous":
        if len(set(sizes)) != 1:
            raise ValueError(f"homogeneous fusion needs equal numbers of components, got {sizes}")
        return _homogeneous(posteriors, pooled, sizes, init or posteriors[0], n_iter, verbose, start)

    terms = pooled.kl_terms()  # (N rows), reused by every step
    scale = None
    if cost_scale != "std":
        scale = float(cost_scale)
    P_list: list[np.ndarray] = []
    if init is None or (isinstance(init, str) and init == "greedy"):
        if scale is None:  # the std of KL(pooled || pooled), streamed: the pooled start's first costs
            scale = float(kl_moments(terms, terms)[2]) or 1.0
        glob, P_list = greedy_start(pooled, terms, sizes, reg, scale)
    else:
        glob = pooled if init == "pooled" else init
    if len(glob) < max(sizes):
        raise ValueError(f"init has {len(glob)} components; client sizes go up to {max(sizes)}")
    n_initial = len(glob)
    objective, step_seconds, iterations, used_solver = [], [], [], ""
    assignments: list[np.ndarray] | None = None
    converged = False
    state = ADMMState()
    bar = tqdm(range(n_iter), desc="KL-fusion", unit="step", disable=not verbose)
    for _ in bar:
        t0 = time.perf_counter()
        kl = kl_matrix(glob.kl_terms(), terms).T  # (N, G): KL(global_g || local_n)
        if scale is None:
            scale = float(kl.std()) or 1.0
        costs = _split(kl / scale, sizes)
        warm = P_list
        P_list, used_solver = solve_relaxed(costs, reg, solver=solver, init=warm or None, state=state)
        if not warm or max(float(np.abs(p - w).max()) for p, w in zip(P_list, warm)) > STILL:
            state.dual = None  # P moved, so will the barycenters: only P warm-starts the next step
        iterations.append(state.iterations)
        objective.append(relaxed_objective(costs, P_list, reg))
        keep = np.vstack(P_list).sum(0) > UNUSED
        P_list = [p[:, keep] / p[:, keep].sum(1, keepdims=True) for p in P_list]
        costs = [c[:, keep] for c in costs]
        P_list, costs = _merge_duplicates(P_list, costs)
        if costs[0].shape[1] != len(keep):  # columns dropped or merged: the duals no longer fit
            state.dual = None
        new_assign = [_round(p, c) for p, c in zip(P_list, costs)]
        same = (
            assignments is not None
            and len(glob) == int(keep.sum())
            and all(np.array_equal(a, b) for a, b in zip(assignments, new_assign))
        )
        assignments = new_assign
        glob = pooled.barycenter(np.vstack(P_list).T, natural=terms.eta)  # (G', N) weights
        step_seconds.append(time.perf_counter() - t0)
        bar.set_postfix(components=len(glob), objective=f"{objective[-1]:.4g}")
        if same:
            converged = True
            break
    assert assignments is not None and scale is not None  # n_iter >= 1 (validated): the loop ran
    # The fused posterior: each global component the barycenter of the local components the
    # rounded assignments give it; components no rounded assignment uses are dropped.
    flat = np.concatenate(assignments)
    used, flat = np.unique(flat, return_inverse=True)
    weights = np.zeros((len(used), len(flat)))
    weights[flat, np.arange(len(flat))] = 1.0
    assignments = _split(flat, sizes)
    P_list = [p[:, used] for p in P_list]
    return _warned(
        KLFusionResult(
            pooled.barycenter(weights, natural=terms.eta),
            assignments,
            P_list,
            objective,
            converged,
            used_solver,
            step_seconds,
            time.perf_counter() - start,
            scale,
            n_initial,
            iterations,
        )
    )


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
    assert assignments is not None  # n_iter >= 1 (validated): the loop ran
    relaxed = [np.eye(L)[a] for a in assignments]
    return _warned(
        KLFusionResult(
            glob,
            assignments,
            relaxed,
            objective,
            converged,
            "hungarian",
            step_seconds,
            time.perf_counter() - start,
            1.0,
            L,
        )
    )


def _warned(result: KLFusionResult) -> KLFusionResult:
    warn_not_converged({"KL-fusion": result}, "KL-fusion", stacklevel=5)
    return result
