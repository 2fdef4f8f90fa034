"""The alternation over clients with fixed hyper-parameters (:func:`match_fixed`) and the state it
keeps across sweeps."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import cast

import numpy as np
from tqdm.auto import tqdm

import bayesfuse.inference.matching.cost as costs
from bayesfuse.inference._backend import NUMPY, Backend, TorchBackend, backend_of
from bayesfuse.inference.matching.assignment import RECORDERS, assign, assign_capped, assign_negative
from bayesfuse.inference.matching.checks import check_assignments, widen
from bayesfuse.inference.matching.cost import cost_blocks, negative_pairs
from bayesfuse.inference.matching.model import (
    Groups,
    Prior,
    add_scaled,
    atom_objective,
    data_constant,
    partition_key,
    posterior_moments,
    posterior_stats,
    setup,
)
from bayesfuse.inference.matching.result import MatchResult
from bayesfuse.inference.result import warn_not_converged

#: Largest per-client cost product (atoms x neurons x coordinates, multiply-adds) that
#: :func:`match_neurons` runs on one BLAS thread; see docs/decisions.md#single-thread-product
SINGLE_THREAD_PRODUCT = 5e7


@functools.lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl's view of the loaded BLAS libraries (looked up once), or None without it."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - scikit-learn brings it
        return None
    return ThreadpoolController()


def blas_threads(limit: int | None, backend: Backend = NUMPY):
    """Context running BLAS on at most ``limit`` threads (threadpoolctl; unchanged when None or
    when threadpoolctl is missing), and torch's CPU operations too for a torch backend on the
    CPU. The limit is process-wide while it lasts."""
    stack = contextlib.ExitStack()
    if limit is None:
        return stack
    controller = _blas_controller()
    if controller is not None:
        stack.enter_context(controller.limit(limits=limit, user_api="blas"))
    if isinstance(backend, TorchBackend) and backend.device.type == "cpu":
        torch, before = backend.torch, backend.torch.get_num_threads()
        if limit < before:
            torch.set_num_threads(limit)
            stack.callback(torch.set_num_threads, before)
    return stack


#: The most entries of one client's neurons whose float32 copy :class:`NeuronCache` keeps (16 MiB).
KEPT_FLOAT32 = 1 << 22


class NeuronCache:
    """Per-client quantities of the neurons that no hyper-parameter changes, each computed at
    the first visit and kept across sweeps and matchings (:func:`match_empirical_bayes`):
    the neurons in float32 for the screen of :func:`negative_pairs` (half the neurons' memory)
    and their group sums ``VV`` (L_j, B) for one coordinate grouping at a time (when B is at
    most D / 8), in the neurons' backend."""

    def __init__(self, n_clients: int):
        self._v32: list[np.ndarray | None] = [None] * n_clients
        self._vv: list = [None] * n_clients
        self._grouping: bytes | None = None
        #: Share of candidate pairs at the last client visited, kept across the matchings of
        #: empirical Bayes: whether the next one tries the float32 screen.
        self.density = 0.0

    def v32(self, j: int, v: np.ndarray) -> np.ndarray:
        """Client j's neurons in float32: ``v`` itself when it is float32; a copy kept across
        visits when it has at most :data:`KEPT_FLOAT32` entries, else made at each visit (a wide
        layer's copies would hold half the neurons' memory again, for a conversion that costs
        about 1/G of the screen's product)."""
        if v.dtype == np.float32:
            return v
        cached = self._v32[j]
        if cached is None:
            cached = v.astype(np.float32)
            if v.size <= KEPT_FLOAT32:
                self._v32[j] = cached
        return cached

    def vv(self, j: int, v, groups: Groups):
        if 8 * groups.n > len(groups.index):  # hardly smaller than the neurons: not kept
            return groups.sum_sq(widen(v))
        key = groups.index.tobytes()
        if key != self._grouping:
            self._vv, self._grouping = [None] * len(self._vv), key
        if self._vv[j] is None:
            self._vv[j] = groups.sum_sq(widen(v))
        return self._vv[j]


class _AtomBuffer:
    """Natural parameters of the atoms in growable arrays; ``h``, ``lam``, ``m`` are views, and
    ``hh`` (G, B) holds the group sums ``sum_{d in b} h_id^2`` of :func:`gain_terms`, kept up
    to date by whoever writes rows of ``h`` (:meth:`refresh`). ``h`` lives in ``backend`` (the
    neurons'); ``lam``, ``hh`` and ``m``, (G, B) and (G,), on the host in float64."""

    def __init__(self, dim: int, groups: Groups, capacity: int, backend: Backend = NUMPY):
        self.groups = groups
        self.backend = backend
        self._h = backend.zeros((capacity, dim))
        self._lam = np.zeros((capacity, groups.n))
        self._hh = np.zeros((capacity, groups.n))
        self._m = np.zeros(capacity, dtype=np.int64)
        self.n = 0

    @property
    def h(self):
        return self._h[: self.n]

    @property
    def lam(self) -> np.ndarray:
        return self._lam[: self.n]

    @property
    def hh(self) -> np.ndarray:
        return self._hh[: self.n]

    @property
    def m(self) -> np.ndarray:
        return self._m[: self.n]

    @property
    def tight(self) -> bool:
        """Whether the memory behind ``h`` holds exactly the live atoms (no spare rows, no larger
        array it is a view of): then ``h`` can be handed out without keeping more alive."""
        h = self._h
        owner = h.base if isinstance(h, np.ndarray) and h.base is not None else h
        return isinstance(h, np.ndarray) and np.shape(owner)[:1] == (self.n,) and np.ndim(owner) == 2

    def tighten(self) -> None:
        """Hold ``h`` (NumPy) in an array of exactly the live atoms, releasing a larger buffer."""
        if isinstance(self._h, np.ndarray) and not self.tight:
            for name in ("_h", "_lam", "_hh", "_m"):  # one capacity for all four, as _reserve keeps it
                if not _resized_in_place(self, name, self.n):
                    setattr(self, name, getattr(self, name)[: self.n].copy())

    def refresh(self, rows: np.ndarray) -> None:
        """Recompute ``hh`` on ``rows`` after writing them in ``h`` (a block of rows at a time)."""
        step = max(1, (1 << 20) // max(self._h.shape[1], 1))
        for start in range(0, len(rows), step):
            block = rows[start : start + step]
            self._hh[block] = self.backend.host(self.groups.sum_sq(self._h[block]))

    def _reserve(self, size: int) -> None:
        if size <= len(self._m):
            return
        # Resized where it stands, the allocator moves pages, not rows: grow by what is needed (and
        # a few rows), so that the spare rows are no wide layer's hundreds of MB. Copied, old and
        # new are both held while the rows are copied: a quarter more, not double, and as few
        # copies as growing by a quarter makes. One capacity for all four arrays.
        cap = max(len(self._m) + 16, size)
        if not _resized_in_place(self, "_h", cap):
            cap = max(len(self._m) + max(len(self._m) // 4, 16), size)
            self._h = self._copied(self._h, cap, self.backend.zeros)
        for name in ("_lam", "_hh", "_m"):
            if not _resized_in_place(self, name, cap):
                setattr(self, name, self._copied(getattr(self, name), cap))

    def _copied(self, old, cap: int, zeros=None):
        """``old``'s live rows in a new zero array of ``cap`` rows (``zeros(shape)``, or NumPy's in
        ``old``'s dtype)."""
        shape = (cap, *old.shape[1:])
        new = zeros(shape) if zeros is not None else np.zeros(shape, dtype=old.dtype)
        new[: self.n] = old[: self.n]
        return new

    def grow(self, k: int, prior: Prior) -> None:
        """Append k atoms holding only the prior."""
        self._reserve(self.n + k)
        self._h[self.n : self.n + k] = self.backend.put(prior.h0)
        self._lam[self.n : self.n + k] = prior.lam0
        self._hh[self.n : self.n + k] = self.groups.sum_sq(prior.h0[None, :])
        self._m[self.n : self.n + k] = 0
        self.n += k

    def compact(self, keep: np.ndarray) -> np.ndarray:
        """Drop atoms where ``keep`` is false by moving the last live atoms into the holes.

        Copies only as many rows as are dropped. Returns the old -> new index map (-1: dropped).
        """
        n_keep = int(keep.sum())
        dead = np.flatnonzero(~keep)
        holes = dead[dead < n_keep]
        movers = np.flatnonzero(keep[n_keep:]) + n_keep
        remap = np.arange(self.n)
        remap[dead] = -1
        remap[movers] = holes
        step = max(1, (1 << 20) // max(self._h.shape[1], 1))  # a wide layer's rows, a block at a time
        for start in range(0, len(holes), step):
            to, frm = holes[start : start + step], movers[start : start + step]
            for arr in (self._h, self._lam, self._hh, self._m):
                arr[to] = arr[frm]
        self.n = n_keep
        return remap

    def recompute(self, layers, prec, assignments, prior: Prior) -> None:
        """The live atoms' statistics recomputed from the assignments, written over ``h`` in place
        (:func:`posterior_stats`: the same numbers, without a second (G, D) array)."""
        h, lam, m = posterior_stats(layers, prec, assignments, self.n, prior, self.backend, out=self.h)
        self._lam[: self.n], self._m[: self.n] = lam, m
        self._hh[: self.n] = self.backend.host(self.groups.sum_sq(h))

    def reset(self, h, lam: np.ndarray, m: np.ndarray, *, adopt: bool = False) -> None:
        """Replace the contents by freshly computed statistics (``h`` on the host or in the backend).

        ``adopt``: ``h`` is the caller's to give up; a float64 NumPy array of the buffer's width
        becomes the buffer itself instead of being copied into one (one (G, D) array fewer)."""
        n = len(m)
        if adopt and not self.backend.is_torch and isinstance(h, np.ndarray) and h.dtype == np.float64:
            if h.shape == (n, self._h.shape[1]) and h.flags.writeable and h.flags.c_contiguous:
                self._h = h
                for name in ("_lam", "_hh", "_m"):  # the small arrays, at the same capacity
                    old = getattr(self, name)
                    setattr(self, name, np.zeros((n, *old.shape[1:]), dtype=old.dtype))
        self._reserve(n)
        self.n = n
        if self._h is not h:
            self._h[:n] = self.backend.put(h)
        self._lam[:n], self._m[:n] = lam, m
        self._hh[:n] = self.backend.host(self.groups.sum_sq(self.h))


def _resized_in_place(buffer: _AtomBuffer, name: str, rows: int) -> bool:
    """Resize the NumPy array ``buffer.<name>`` to ``rows`` rows where it stands (new rows zero),
    if it owns its memory and nothing else refers to it; whether it did. A large array's memory is
    then grown or shrunk by the allocator (``mremap`` on Linux) instead of being copied into a new
    one while the old is still held: a wide layer's (G, D) atoms are not held twice."""
    a = getattr(buffer, name)
    if not isinstance(a, np.ndarray) or a.base is not None or not a.flags.c_contiguous or not a.flags.owndata:
        return False
    shape = (rows, *a.shape[1:])
    del a  # a name more would make the reference check refuse
    try:
        getattr(buffer, name).resize(shape, refcheck=True)
    except ValueError:  # referred to elsewhere (a view, a caller's name): copy instead
        return False
    return True


def match_fixed(
    layers,
    *,
    noise_var,
    prior_var,
    prior_mean,
    gamma0,
    kl_weight,
    cost,
    local_vars,
    n_iter,
    tol,
    seed,
    init,
    verbose,
    start,
    checked: bool = False,
    init_atoms=None,
    squares=None,
    cache: NeuronCache | None = None,
    baseline: float | None = None,
    capacity: int | None = None,
) -> MatchResult:
    """:func:`match_neurons` with numeric hyper-parameters.

    For repeated matchings of the same neurons (:func:`match_empirical_bayes`): ``checked``,
    the layers are :func:`check_layers`'s output and ``init`` assignments of an earlier
    matching (no checks; ``hyper`` leaves array values out, the caller records its own);
    ``init_atoms``, the atoms' ``(h (G, D), lambda (G, D), m)`` under these hyper-parameters
    for ``init``, computed elsewhere (from the statistics of EM); given as a list, it is emptied
    once the atoms are built (the caller then holds no (G, D) array through the sweeps); ``squares``,
    :func:`neuron_squares` of the layers; ``cache``, a :class:`NeuronCache` of the layers;
    ``baseline``, the objective before the first sweep (``tol`` then applies to that sweep too).
    ``capacity``: at most that many atoms (:func:`assign_capped`).
    """
    layers, prec, prior = setup(layers, noise_var, prior_var, prior_mean, gamma0, local_vars, checked=checked)
    backend = backend_of(layers)
    groups = prior.groups
    J, D = len(layers), layers[0].shape[1]
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    least_gain = least_gain_for(tol, layers, cost)
    data_const = data_constant(layers, prec, groups, squares)
    cache = NeuronCache(J) if cache is None else cache
    prec_on = [backend.put(p) for p in prec]  # the precisions where the neurons are

    assignments: list[np.ndarray | None] = [None] * J
    atoms = _AtomBuffer(D, groups, capacity=max(len(v) for v in layers) * 2, backend=backend)
    if init is not None:  # warm start: atoms from the given assignments, then refining sweeps
        given = [np.asarray(a) for a in init] if checked else check_assignments(init, layers)
        assignments = list(given)
        if init_atoms is None:
            atoms.reset(
                *posterior_stats(layers, prec, assignments, int(max(a.max() for a in given)) + 1, prior, backend)
            )
        else:  # lambda is constant on each coordinate group: keep one value per group
            h0, lam0, m0 = init_atoms
            if isinstance(init_atoms, list):  # the caller's (K, D) arrays go once the atoms hold them
                init_atoms.clear()
            atoms.reset(h0, lam0[:, groups.first], m0, adopt=isinstance(init_atoms, list))
            del h0, lam0, m0
        if (atoms.m == 0).any():
            raise ValueError("init leaves some atom indices unused; number atoms 0..G-1")
    objective: list[float] = []
    converged = stopped = False
    seen: dict[bytes, int] = {}  # partitions after each sweep, to detect cycles
    cycle = 0
    bar = tqdm(range(int(n_iter)), desc="matching", unit="sweep", disable=not verbose)
    sweeps = 0
    screen = not backend.is_torch and cost == "marginal" and not kl_weight and all(x.shape[0] == 1 for x in prec)
    density = cache.density  # share of candidate pairs at the last client: whether the float32 screen pays
    # Whether client j's problem may differ from the one it last solved: it does not when no
    # other client's assignment changed since (the atoms it sees are the same, up to labels and
    # round-off), and its solution would be its current assignment again.
    stale = np.ones(J, dtype=bool)
    # Small per-client products gain little from several BLAS threads and, on a shared machine, lose
    # much waiting for a busy core at every product: run them on one.
    largest = max(len(v) for v in layers) * D * max(atoms.n, max(len(v) for v in layers))
    with blas_threads(1 if largest <= SINGLE_THREAD_PRODUCT else None, backend):
        for sweep in bar:
            changed, relabelled = 0, False
            # Whether the atoms are those posterior_stats gives for the assignments at the start of the sweep.
            exact = assignments[0] is not None
            for j in rng.permutation(J):
                if not stale[j]:
                    continue
                # float32 neurons stay so (the screen's products widen them), and are widened for the
                # dense costs only: a wide layer's float64 copy is not held through the visit
                v, p, p_on = layers[j], prec[j], prec_on[j]
                old = assignments[j]
                if old is not None:  # take client j out, keeping its atoms' rows to put back unchanged
                    kept_h, kept_lam, kept_hh = atoms.h[old], atoms.lam[old], atoms.hh[old]
                    add_scaled(atoms.h, old, layers[j], p_on, groups, base=kept_h)
                    atoms.refresh(old)
                    atoms.lam[old] = kept_lam - p
                    atoms.m[old] -= 1
                    keep = atoms.m > 0
                    old_kept = old
                    if not keep.all():
                        relabelled = True
                        remap = atoms.compact(keep)
                        old_kept = remap[old]
                        for k in range(J):
                            if k != j and assignments[k] is not None:
                                assignments[k] = remap[assignments[k]]
                g = atoms.n
                pairs = None
                if (
                    capacity is None and screen and density <= costs.SCREEN_DENSITY
                ):  # a float32 product finds the few candidate pairs
                    pairs = negative_pairs(
                        v, p, atoms.h, atoms.lam, atoms.m, prior, atoms.hh, cache.vv(j, v, groups), cache.v32(j, v)
                    )
                if pairs is None:
                    old_cost, new_cost, steps = cost_blocks(
                        widen(v),
                        p_on,
                        atoms.h,
                        atoms.lam,
                        atoms.m,
                        prior,
                        cost=cost,
                        kl_weight=kl_weight,
                        hh=atoms.hh,
                        vv=None if p.shape[0] > 1 else cache.vv(j, v, groups),
                    )
                    old_cost, new_cost = backend.host(old_cost), backend.host(new_cost)
                    R = old_cost - new_cost[None, :] if RECORDERS else None  # before assign overwrites old_cost
                    a, n_pairs = (
                        assign(old_cost, new_cost, steps)
                        if capacity is None
                        else assign_capped(old_cost, new_cost, steps, capacity - g)
                    )
                    for record in RECORDERS:
                        record(widen(v), R, a.copy(), steps)
                else:
                    a, n_pairs = assign_negative(*pairs, g, v.shape[0]), len(pairs[0])  # -1: a new atom
                density = n_pairs / max(g * v.shape[0], 1)
                same = old is not None and not np.any(a != old_kept)
                changed += int(old is not None and not same)
                stale[j] = False
                if not same:
                    stale[:j], stale[j + 1 :] = True, True
                fresh = a < 0
                a[fresh] = g + np.arange(int(fresh.sum()))
                atoms.grow(int(fresh.sum()), prior)  # put client j back
                if same and old_kept is old:  # the same atoms, not relabelled: their rows as they were
                    atoms.h[a], atoms.lam[a], atoms.hh[a] = kept_h, kept_lam, kept_hh
                else:
                    add_scaled(atoms.h, a, layers[j], p_on, groups)  # v / sigma_j^2
                    atoms.refresh(a)
                    atoms.lam[a] += p
                atoms.m[a] += 1
                assignments[j] = a
                del v  # a wide layer's rows: not held into the next client, or the recompute
                if old is not None:
                    del kept_h
            sweeps = sweep + 1
            # With no assignment changed and no atom relabelled, every client visited put back the rows
            # it took out as they were (kept_h, kept_lam, kept_hh): the atoms are, bit for bit, those
            # of the start of the sweep. Else recompute them from the assignments, which removes the
            # round-off accumulated by the updates.
            if not (exact and changed == 0 and not relabelled):
                atoms.recompute(layers, prec, assignments, prior)
            objective.append(atom_objective(atoms.h, atoms.lam, atoms.m, prior, atoms.hh) + data_const)
            bar.set_postfix(atoms=atoms.n, objective=f"{objective[-1]:.1f}")
            if (sweep > 0 or init is not None) and changed == 0:
                converged = True
                break
            before = objective[-2] if sweep > 0 else baseline
            if least_gain is not None and before is not None and objective[-1] - before < least_gain:
                stopped = converged = True
                break
            state = partition_key(cast(list[np.ndarray], assignments))  # every client placed in the first sweep
            if state in seen:  # the sweeps came back to an earlier partition: more would repeat the cycle
                cycle = sweep - seen[state]
                converged = True
                break
            seen[state] = sweep
    cache.density = density
    # the atoms are spent: their natural parameters become the means (one (K, D) array fewer at the
    # peak), in an array of exactly the live atoms so that the returned means keep no spare rows alive
    atoms.tighten()
    mean, var = posterior_moments(atoms.h, atoms.lam, groups, backend, overwrite=atoms.tight)
    result = MatchResult(
        assignments=[np.asarray(a) for a in assignments],
        mean=mean,
        var=var,
        counts=atoms.m.copy(),
        objective=objective,
        converged=converged,
        n_sweeps=sweeps,
        hyper=dict(
            noise_var=_listed(noise_var, checked),
            prior_var=_listed(prior_var, checked),
            prior_mean=_listed(prior_mean, checked),
            gamma0=gamma0,
            kl_weight=kl_weight,
            cost=cost,
            n_iter=n_iter,
            local_vars=local_vars is not None,
            seed=None if isinstance(seed, np.random.Generator) else seed,
            cycle=cycle,
            tol=tol,
            stopped=stopped,
            **({"capacity": int(capacity)} if capacity is not None else {}),
        ),
        seconds=time.perf_counter() - start,
    )
    warn_not_converged({"matching": result}, "matching")
    return result


def least_gain_for(tol: float | None, layers, cost: str) -> float | None:
    """The gain in nats below which a sweep ends the matching: ``tol`` per neuron of ``layers``;
    None (no such stop) without ``tol`` or with the PFNM cost, whose sweeps do not climb the
    recorded log posterior (its trace may dip)."""
    if not tol or cost != "marginal":
        return None
    return float(tol) * sum(int(v.shape[0]) for v in layers)


def _listed(value, internal: bool):
    """A hyper-parameter for ``MatchResult.hyper``: numbers as given, arrays as lists (None for
    the internal matchings of :func:`match_empirical_bayes`, which records its own)."""
    if np.ndim(value) == 0:
        return value
    return None if internal else np.asarray(value).tolist()
