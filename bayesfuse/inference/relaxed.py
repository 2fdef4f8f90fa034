"""The convex relaxation of heterogeneous KL-fusion (Claici et al., ICML 2020, eqs. 8-9).

For fixed global components, the assignment matrices ``P_j`` (L_j x G) of all clients solve

.. math:: \\min_P \\sum_j \\langle C_j, P_j \\rangle
          + \\lambda \\sum_g \\Big(\\sum_j \\sum_l (P^j_{lg})^2\\Big)^{1/2}
          \\quad \\text{s.t.}\\quad P_j \\ge 0,\\; P_j 1 = 1,\\; P_j^T 1 \\le 1,

whose L2,2,1 norm (eq. 8) drives whole global components out of use.
:func:`solve_relaxed` picks one of two solvers: cvxpy (an exact conic solve) or a consensus
ADMM with exact proximal steps that scales to large problems; it can be warm-started from a P
and from the duals of a previous solve (:class:`ADMMState`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Sequence, cast

import numpy as np

from bayesfuse.constraints import KEYS, NON_NEGATIVE, validate_params

__all__ = ["AUTO_CVXPY_MAX_ENTRIES", "ADMMState", "Solver", "relaxed_objective", "solve_relaxed"]

Solver = Literal["auto", "cvxpy", "fast"]
#: ``solver="auto"`` uses cvxpy when the relaxed problem has at most this many entries.
AUTO_CVXPY_MAX_ENTRIES = 20_000


@dataclass
class ADMMState:
    """The fast solver's scaled duals and penalty at its last iterate, for warm starts.

    Pass one to :func:`solve_relaxed` as ``state``: the fast solver starts from its ``dual``
    and ``rho`` when the dual's shape fits the problem (a nearby problem: the next alternation
    step of KL-fusion, whose barycenters moved little) and writes its own final ones back,
    with the number of iterations it took. ADMM converges from any start (the problem is
    convex), but from the duals of a distant problem its residual test can pass early at a less
    accurate point: pass a state only on to a problem close to the one that produced it.

    Attributes
    ----------
    dual : ndarray (3, N, G) or None
        Scaled duals ``U`` of the three copies of P (see :func:`_solve_admm`).
    rho : float
    iterations : int
    """

    dual: np.ndarray | None = None
    rho: float = 1.0
    iterations: int = 0


def relaxed_objective(costs: Sequence[np.ndarray], P: Sequence[np.ndarray], reg: float) -> float:
    """``sum_j <C_j, P_j> + reg * sum_g ||P[:, g]||_2`` with the clients' P stacked (eq. 8-9)."""
    stacked = np.vstack(P)
    return float(sum(np.sum(c * p) for c, p in zip(costs, P)) + reg * np.linalg.norm(stacked, axis=0).sum())


def _check_costs(costs: Sequence[np.ndarray]) -> list[np.ndarray]:
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


@validate_params(reg=NON_NEGATIVE, solver=KEYS["solver"])
def solve_relaxed(
    costs: Sequence[np.ndarray],
    reg: float,
    *,
    solver: Solver = "auto",
    tol: float = 1e-5,
    max_iter: int = 20_000,
    init: Sequence[np.ndarray] | None = None,
    state: ADMMState | None = None,
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
    state : ADMMState, optional
        Warm start of the fast solver's duals, updated in place with its final ones (see
        :class:`ADMMState`); ignored by cvxpy (``state.iterations`` is set to 0).

    Returns
    -------
    P : list of (L_j, G) arrays
    used : str
        The solver that produced P.
    """
    costs = _check_costs(costs)
    entries = sum(c.size for c in costs)
    if solver == "auto":
        solver = "cvxpy" if entries <= AUTO_CVXPY_MAX_ENTRIES else "fast"
    if solver == "cvxpy":
        if state is not None:
            state.dual, state.iterations = None, 0
        return _solve_cvxpy(costs, reg)
    x0 = None if init is None else np.vstack(init)  # "fast"
    return _solve_admm(costs, reg, tol=tol, max_iter=max_iter, x0=x0, state=state), "fast"


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
                warnings.warn(f"cvxpy fell back to {name} after: {'; '.join(failures)}", RuntimeWarning, stacklevel=4)
            value = np.clip(cast(np.ndarray, P.value), 0.0, 1.0)  # set at an optimum
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


def _project_client_columns(Y: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Projection onto ``{P >= 0, each client's columns sum to at most 1}`` (exact).

    Client j's rows are ``starts[j]:starts[j+1]``. The set is a product over (client, column)
    pairs of ``{x >= 0, sum x <= 1}``, whose projection is ``max(y, 0)`` when that sums to at
    most 1 and the projection onto the simplex otherwise. The column sums of all clients come
    from one ``np.add.reduceat``; only the pairs over capacity are projected onto the simplex.
    """
    X = np.maximum(Y, 0.0)
    nonempty = np.flatnonzero(np.diff(starts) > 0)
    sums = np.add.reduceat(X, starts[nonempty], axis=0)  # (clients with rows, G)
    for k in np.flatnonzero((sums > 1.0).any(1)):
        a, b = starts[nonempty[k]], starts[nonempty[k] + 1]
        over = sums[k] > 1.0
        X[a:b, over] = _project_rows_to_simplex(Y[a:b, over].T).T
    return X


def _group_shrink(Y: np.ndarray, t: float) -> np.ndarray:
    """Prox of ``t * sum_g ||Y[:, g]||_2``: shrink each column's norm by t."""
    norms = np.linalg.norm(Y, axis=0)
    return Y * np.maximum(0.0, 1.0 - t / np.maximum(norms, 1e-300))[None, :]


def _solve_admm(
    costs: list[np.ndarray],
    reg: float,
    *,
    tol: float,
    max_iter: int,
    rho: float = 1.0,
    x0: np.ndarray | None = None,
    state: ADMMState | None = None,
) -> list[np.ndarray]:
    """Consensus ADMM for the relaxed eq. 9, every proximal step exact.

    Splits the objective into three functions of copies of the stacked P (N x G):
    ``<C, P1> + [rows of P1 on the simplex]``, ``[P2 >= 0, each client's columns sum <= 1]`` and
    ``reg * sum_g ||P3[:, g]||``; ADMM drives the copies to agreement (Boyd et al. 2011,
    section 7.1) with residual balancing of ``rho``. Stops when the primal and dual residuals
    fall below ``tol`` (scaled by sqrt of the number of entries). Returns the row-feasible copy
    with each client's columns projected to capacity, i.e. a feasible point. ``x0`` warm-starts
    the consensus P, ``state`` (:class:`ADMMState`) the duals and ``rho``, and receives the
    final ones.
    """
    sizes = [c.shape[0] for c in costs]
    starts = np.cumsum([0, *sizes])
    C = np.vstack(costs)
    n, g = C.shape
    X = np.full((n, g), 1.0 / g) if x0 is None or x0.shape != (n, g) else x0.copy()
    U = np.zeros((3, n, g))
    if state is not None and state.dual is not None and state.dual.shape == U.shape:
        U[:] = state.dual
        rho = state.rho
    scale = np.sqrt(n * g)
    it = -1
    for it in range(max_iter):
        P1 = _project_rows_to_simplex(X - U[0] - C / rho)
        P2 = _project_client_columns(X - U[1], starts)
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
    if state is not None:
        state.dual, state.rho, state.iterations = U, rho, it + 1
    # A feasible answer: rows on the simplex, then client columns within capacity, alternated
    # a few times from the consensus point (both sets convex; this polishes tiny violations).
    P = X
    for _ in range(50):
        P = _project_rows_to_simplex(_project_client_columns(P, starts))
        if (np.vstack([P[a:b].sum(0) for a, b in zip(starts[:-1], starts[1:])]) <= 1 + 1e-9).all():
            break
    return [P[a:b] for a, b in zip(starts[:-1], starts[1:])]
