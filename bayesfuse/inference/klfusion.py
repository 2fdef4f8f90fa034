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
  P-weighted barycenters, and the two steps alternate.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment
from tqdm.auto import tqdm

from bayesfuse.inference.expfam import ExpFamily, _check_same_family

__all__ = ["KLFusionResult", "kl_fuse", "solve_relaxed", "relaxed_objective"]

Solver = Literal["auto", "cvxpy", "fast"]
#: ``solver="auto"`` uses cvxpy when the relaxed problem has at most this many entries.
AUTO_CVXPY_MAX_ENTRIES = 20_000
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

    def __repr__(self) -> str:
        sizes = [len(a) for a in self.assignments]
        return (f"KLFusionResult({len(sizes)} clients with {sum(sizes)} {self.components.name} components "
                f"-> {self.n_components} global, {len(self.objective)} steps, converged={self.converged}, "
                f"{self.seconds:.2f} s)")


# ------------------------------------------------------------------------ relaxed problem


def relaxed_objective(costs: Sequence[np.ndarray], P: Sequence[np.ndarray], reg: float) -> float:
    """``sum_j <C_j, P_j> + reg * sum_g ||P[:, g]||_2`` with the clients' P stacked (eq. 8-9)."""
    stacked = np.vstack(P)
    return float(sum(np.sum(c * p) for c, p in zip(costs, P)) + reg * np.linalg.norm(stacked, axis=0).sum())


def _check_costs(costs: Sequence[np.ndarray], reg: float) -> list[np.ndarray]:
    if not np.isfinite(reg) or reg < 0:
        raise ValueError(f"reg must be >= 0, got {reg}")
    costs = [np.asarray(c, dtype=np.float64) for c in costs]
    if not costs:
        raise ValueError("need at least one client")
    g = costs[0].shape[1]
    for j, c in enumerate(costs):
        if c.ndim != 2 or c.shape[1] != g:
            raise ValueError(f"cost {j} must be (L_j, {g}), got {c.shape}")
        if c.shape[0] > g:
            raise ValueError(f"client {j} has {c.shape[0]} components but only {g} global ones can take them")
        if not np.isfinite(c).all():
            raise ValueError(f"cost {j} contains NaN or infinite values")
    return costs


def solve_relaxed(
    costs: Sequence[np.ndarray],
    reg: float,
    *,
    solver: Solver = "auto",
    tol: float = 1e-5,
    max_iter: int = 20_000,
    init: Sequence[np.ndarray] | None = None,
) -> tuple[list[np.ndarray], str]:
    """Solve the convex relaxation of eq. 9 for fixed global components.

    Parameters
    ----------
    costs : list of (L_j, G) arrays
        ``C_j[l, g]`` (scaled) cost of giving local component l to global component g.
    reg : float
        ``lambda`` of the L2,2,1 norm.
    solver : {"auto", "cvxpy", "fast"}
        ``"cvxpy"``: one stacked variable, whole-matrix expressions, Clarabel (ECOS first when
        installed, SCS last); each solver's status is checked and a failed or inaccurate solve
        falls back to the next with a warning. ``"fast"``: consensus ADMM with exact proximal
        steps (see :func:`_solve_admm`). ``"auto"``: cvxpy up to
        :data:`AUTO_CVXPY_MAX_ENTRIES` entries, fast beyond.
    tol, max_iter : fast solver's stopping rule.
    init : list of (L_j, G) arrays, optional
        Warm start for the fast solver (the previous step's P).

    Returns
    -------
    P : list of (L_j, G) arrays
    used : str
        The solver that produced P.
    """
    costs = _check_costs(costs, reg)
    entries = sum(c.size for c in costs)
    if solver == "auto":
        solver = "cvxpy" if entries <= AUTO_CVXPY_MAX_ENTRIES else "fast"
    if solver == "cvxpy":
        return _solve_cvxpy(costs, reg)
    if solver == "fast":
        x0 = None if init is None else np.vstack(init)
        return _solve_admm(costs, reg, tol=tol, max_iter=max_iter, x0=x0), "fast"
    raise ValueError(f"solver must be 'auto', 'cvxpy' or 'fast', got {solver!r}")


def _solve_cvxpy(costs: list[np.ndarray], reg: float) -> tuple[list[np.ndarray], str]:
    import cvxpy as cp

    sizes = [c.shape[0] for c in costs]
    n, g = sum(sizes), costs[0].shape[1]
    C = np.vstack(costs)
    block = np.zeros((len(costs), n))  # block[j] sums client j's rows
    for j, (start, size) in enumerate(zip(np.cumsum([0, *sizes[:-1]]), sizes)):
        block[j, start : start + size] = 1.0
    P = cp.Variable((n, g), nonneg=True)
    objective = cp.sum(cp.multiply(C, P)) + reg * cp.sum(cp.norm(P, 2, axis=0))
    problem = cp.Problem(cp.Minimize(objective), [cp.sum(P, axis=1) == 1, block @ P <= 1])
    order = [s for s in ("ECOS", "CLARABEL", "SCS") if s in cp.installed_solvers()]
    failures = []
    for name in order:
        try:
            problem.solve(solver=name)
        except cp.SolverError as err:
            failures.append(f"{name}: {err}")
            continue
        if problem.status == cp.OPTIMAL:
            if failures:
                warnings.warn(f"cvxpy fell back to {name} after: {'; '.join(failures)}", RuntimeWarning, stacklevel=3)
            value = np.clip(P.value, 0.0, 1.0)
            starts = np.cumsum([0, *sizes])
            return [value[a:b] for a, b in zip(starts[:-1], starts[1:])], f"cvxpy:{name}"
        failures.append(f"{name}: status {problem.status}")
    raise RuntimeError(
        f"no cvxpy solver solved the relaxed assignment ({n} x {g} = {n * g} entries): {'; '.join(failures)}; "
        "try solver='fast'"
    )


def _project_rows_to_simplex(Y: np.ndarray) -> np.ndarray:
    """Euclidean projection of each row onto the probability simplex (sort-based, exact)."""
    u = -np.sort(-Y, axis=1)
    css = np.cumsum(u, axis=1) - 1.0
    k = np.arange(1, Y.shape[1] + 1)
    rho = np.count_nonzero(u - css / k > 0, axis=1)
    theta = css[np.arange(len(Y)), rho - 1] / rho
    return np.maximum(Y - theta[:, None], 0.0)


def _project_capped_columns(Y: np.ndarray) -> np.ndarray:
    """Projection of each column onto ``{x >= 0, sum x <= 1}`` (exact)."""
    X = np.maximum(Y, 0.0)
    over = X.sum(0) > 1.0
    if over.any():
        X[:, over] = _project_rows_to_simplex(Y[:, over].T).T
    return X


def _group_shrink(Y: np.ndarray, t: float) -> np.ndarray:
    """Prox of ``t * sum_g ||Y[:, g]||_2``: shrink each column's norm by t."""
    norms = np.linalg.norm(Y, axis=0)
    return Y * np.maximum(0.0, 1.0 - t / np.maximum(norms, 1e-300))[None, :]


def _solve_admm(costs: list[np.ndarray], reg: float, *, tol: float, max_iter: int, rho: float = 1.0,
                x0: np.ndarray | None = None) -> list[np.ndarray]:
    """Consensus ADMM for the relaxed eq. 9, every proximal step exact.

    Splits the objective into three functions of copies of the stacked P (N x G):
    ``<C, P1> + [rows of P1 on the simplex]``, ``[P2 >= 0, each client's columns sum <= 1]`` and
    ``reg * sum_g ||P3[:, g]||``; ADMM drives the copies to agreement (Boyd et al. 2011,
    section 7.1) with residual balancing of ``rho``. Stops when the primal and dual residuals
    fall below ``tol`` (scaled by sqrt of the number of entries). Returns the row-feasible copy
    with each client's columns projected to capacity, i.e. a feasible point.
    """
    sizes = [c.shape[0] for c in costs]
    starts = np.cumsum([0, *sizes])
    C = np.vstack(costs)
    n, g = C.shape
    X = np.full((n, g), 1.0 / g) if x0 is None or x0.shape != (n, g) else x0.copy()
    U = np.zeros((3, n, g))
    scale = np.sqrt(n * g)

    def capped(Y):
        return np.vstack([_project_capped_columns(Y[a:b]) for a, b in zip(starts[:-1], starts[1:])])

    for it in range(max_iter):
        P1 = _project_rows_to_simplex(X - U[0] - C / rho)
        P2 = capped(X - U[1])
        P3 = _group_shrink(X - U[2], reg / rho)
        X_old = X
        X = (P1 + P2 + P3 + U.sum(0)) / 3.0
        U[0] += P1 - X
        U[1] += P2 - X
        U[2] += P3 - X
        primal = np.sqrt(sum(np.sum((P - X) ** 2) for P in (P1, P2, P3))) / scale
        dual = rho * np.sqrt(3.0) * np.linalg.norm(X - X_old) / scale
        if primal < tol and dual < tol:
            break
        if it % 10 == 9:  # residual balancing (Boyd et al. 2011, eq. 3.13)
            if primal > 10 * dual:
                rho *= 2.0
                U /= 2.0
            elif dual > 10 * primal:
                rho /= 2.0
                U *= 2.0
    # A feasible answer: rows on the simplex, then client columns within capacity, alternated
    # a few times from the consensus point (both sets convex; this polishes tiny violations).
    P = X
    for _ in range(50):
        P = _project_rows_to_simplex(capped(P))
        if (np.vstack([P[a:b].sum(0) for a, b in zip(starts[:-1], starts[1:])]) <= 1 + 1e-9).all():
            break
    return [P[a:b] for a, b in zip(starts[:-1], starts[1:])]


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
        For the relaxed problem; see :func:`solve_relaxed`.
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
    return KLFusionResult(pooled.barycenter(weights), assignments, P_list, objective, converged, used_solver,
                          step_seconds, time.perf_counter() - start, scale)


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
    return KLFusionResult(glob, assignments, relaxed, objective, converged, "hungarian", step_seconds,
                          time.perf_counter() - start, 1.0)
