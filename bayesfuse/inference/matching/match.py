"""The entry point of BBP-MAP matching: :func:`match_neurons`."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from bayesfuse.constraints import MATCHING, POSITIVE_INT, validate_params
from bayesfuse.inference._backend import ieee_float32
from bayesfuse.inference.matching.checks import relative_weights
from bayesfuse.inference.matching.empirical_bayes import match_empirical_bayes, noise_matrix
from bayesfuse.inference.matching.result import MatchResult
from bayesfuse.inference.matching.sweeps import match_fixed


@validate_params(**MATCHING, rounds=POSITIVE_INT)
@ieee_float32()
def match_neurons(
    layers: Sequence,
    *,
    noise_var="auto",
    prior_var="auto",
    gamma0="auto",
    prior_mean=0.0,
    kl_weight: float = 0.0,
    cost: str = "auto",
    local_vars: Sequence | None = None,
    blocks: np.ndarray | None = None,
    relative_precision: np.ndarray | None = None,
    n_iter: int = 10,
    tol: float | None = None,
    seed: int | np.random.Generator | None = None,
    rounds: int = 100,
    init: Sequence[np.ndarray] | None = None,
    verbose: bool = False,
    capacity: int | None = None,
) -> MatchResult:
    """MAP matching of J clients' neurons to global atoms (PFNM; NAFI with ``kl_weight > 0``).

    Maximises over assignments ``B`` the log posterior of the Beta-Bernoulli process model
    (PFNM supplement eq. 1-8) by the alternation of PFNM: clients are visited in a random order
    each sweep; client j is removed, the others' atom posteriors (eq. 2; NAFI eq. 4) give the
    cost matrix of :func:`assignment_cost` over the ``G_{-j}`` existing atoms and ``L_j``
    possible new ones, and the Hungarian algorithm assigns client j's neurons. Atoms left
    without neurons are removed. The first sweep builds the atoms client by client.

    Parameters
    ----------
    layers : sequence of (L_j, D) arrays
        Neuron vectors of each client (rows): NumPy arrays (anything :func:`numpy.asarray`
        takes), matched in float64; or torch tensors, all of one device and one dtype (float32
        or float64), matched there: the atoms' natural parameters, the cost matrices
        (:func:`assignment_cost`) and the posterior means and variances are computed with torch
        on that device in that dtype, each assignment problem is solved on the host
        (``scipy.optimize.linear_sum_assignment``), and ``mean``/``var`` of the result are tensors
        on that device (assignments and counts stay NumPy). Float64 tensors give the NumPy
        result up to round-off; float32 ones compute every cost in float32 (relative error about
        ``D * 2^-24`` of the cost's terms), so assignments can differ only between options whose
        costs are that close. Empirical Bayes (``"auto"``) accumulates its statistics on the
        host from a float64 copy of the neurons.
    noise_var : "auto", float, sequence of J floats, (D,) or (J, D) array
        ``sigma_j^2``: how far a client's neuron may lie from its atom. ``"auto"`` (with
        ``prior_var``/``gamma0`` likewise): chosen from the neurons alone by empirical Bayes,
        one value per block of coordinates (:mod:`bayesfuse.inference.matching.empirical_bayes`).
    prior_var : "auto", float or (D,) array
        ``sigma_0^2``: spread of the atoms around ``prior_mean`` (PFNM uses 10).
    gamma0 : "auto" or float
        IBP mass: expected number of atoms per client; larger favours new atoms (PFNM uses 1).
    prior_mean : float or (D,) array
        ``mu_0`` (refitted per block when ``prior_var="auto"``).
    kl_weight : float
        NAFI's ``lambda`` (eq. 14); 0 gives PFNM.
    cost : {"auto", "pfnm", "marginal"}
        ``"pfnm"``: the paper's Prop. 2 cost as written, which drops the Occam terms of the
        marginal likelihood. ``"marginal"``: the exact change of the collapsed log posterior
        (:func:`log_marginal_posterior`), as in SPAHM (Yurochkin et al., NeurIPS 2019).
        ``"auto"``: ``"marginal"`` when a hyper-parameter is ``"auto"`` (empirical Bayes
        maximises that same marginal; with the PFNM cost its estimates merge nothing), else
        ``"pfnm"``.
    blocks : (D,) int array, optional
        ``"auto"`` only: the block of each coordinate (0..B-1); one block by default.
    relative_precision : (J, D) array, optional
        ``w_jd``: client j's noise variance on coordinate d is ``noise_var / w_jd`` (0: client
        j observes nothing there). Ones by default.
    rounds : int
        ``"auto"`` only: most rounds of one sweep and re-estimation (then a last matching of up
        to ``n_iter`` sweeps with the final values).
    init : sequence of J int arrays, optional
        Start from these assignments (atoms numbered 0..G-1) instead of building the atoms
        client by client in the first sweep; every sweep then refines them.
    local_vars : sequence of (L_j,) or (L_j, D) arrays, optional
        Per-neuron variances of local posteriors (Bayesian networks); neuron l of client j is
        then ``N(theta_i, noise_var_j + local_vars[j][l])``. Per-entry arrays take a slower
        path (no matrix-product form), in blocks of atoms.
    n_iter : int
        Maximum number of sweeps.
    tol : float, optional
        Also stop when a sweep raises the objective by less than ``tol`` nats per neuron
        (``tol * sum_j L_j`` in all): the sweeps' gains fall fast, then trail off in moves
        worth a fraction of a nat each (``hyper["stopped"]`` says whether it stopped so).
        None or 0: sweep until no neuron moves (or ``n_iter``). The ``"marginal"`` cost only:
        the ``"pfnm"`` cost does not climb the recorded objective, so there it is ignored.
    seed : int or Generator, optional
        Order of the clients in each sweep; the same seed gives the same result.
    verbose : bool
        Progress bar over sweeps.
    capacity : int, optional
        At most this many atoms: each client's neurons are assigned to the atoms and to as many
        new ones as there is room for (the same posterior, with the number of atoms held; the
        Hungarian method on the whole matrix, never the float32 screen). For a group whose
        width the network's forward fixes, ``capacity`` is that width: every client of that
        width fills the atoms one to one.

    Returns
    -------
    MatchResult
        With ``"auto"``, ``hyper`` holds the chosen values per block (``noise_var``,
        ``prior_var``, ``prior_mean``, ``gamma0``) and ``hyper["auto"]`` the keys chosen.

    Raises
    ------
    TypeError
        When the neurons mix torch tensors with other arrays, devices or dtypes, or are tensors
        of a dtype other than float32 and float64.

    Warns
    -----
    ConvergenceWarning
        When ``n_iter`` sweeps end with assignments still changing (and ``tol`` did not stop it).

    Notes
    -----
    The objective recorded after each sweep is :func:`log_marginal_posterior`, the exact log
    joint of neurons and assignments. The ``"marginal"`` cost is coordinate ascent on it, so
    with ``kl_weight=0`` its trace never decreases; the ``"pfnm"`` cost and the KL penalty
    optimise other criteria and their trace may dip.

    Where the IBM reference code departs from the paper, this follows the paper: the
    popularity term is ``2 log(m/(J-m))`` (the code uses 1x), counts are not capped at 10,
    and the number of new atoms is not capped.

    Choosing noise_var, prior_var, gamma0, kl_weight
    ------------------------------------------------
    * ``noise_var`` sets the matching radius: a neuron joins an atom when it is within a few
      ``sigma_j`` of it in every coordinate. Too small splits copies of one atom into many
      (large global model); too large merges different atoms (small model, blurred weights).
      With ``cost="marginal"`` the true noise variance recovers simulated atoms; the PFNM cost
      needs it over-stated (PFNM tunes it by validation; 1 is its usual start).
    * ``prior_var`` (PFNM: 10) is the spread of atoms; larger makes a new atom cheaper under
      the PFNM cost and dearer under the marginal one (its Occam factor).
    * ``gamma0`` (PFNM: 1) enters as ``log(gamma0 / J)`` per new atom: raise it for more atoms.
    * ``kl_weight`` (NAFI: 1e-3 to 0.5 work alike; 1 is too much) adds the KL between an
      atom's posterior before and after taking the neuron, which grows with the distance to
      the atom's mean; it discourages poor matches and so grows the global model slightly.
    """
    start = time.perf_counter()
    if capacity is not None:
        _check_capacity(capacity, layers, init)
    auto = tuple(
        k for k, v in (("noise_var", noise_var), ("prior_var", prior_var), ("gamma0", gamma0)) if isinstance(v, str)
    )
    if cost == "auto":
        cost = "marginal" if auto else "pfnm"
    if auto:
        return match_empirical_bayes(
            layers,
            auto,
            noise_var=noise_var,
            prior_var=prior_var,
            gamma0=gamma0,
            prior_mean=prior_mean,
            blocks=blocks,
            relative_precision=relative_precision,
            local_vars=local_vars,
            rounds=rounds,
            match=dict(
                kl_weight=kl_weight,
                cost=cost,
                local_vars=None,
                n_iter=n_iter,
                tol=tol,
                seed=seed,
                verbose=False,
                start=start,
                checked=True,
                capacity=capacity,
            ),
            verbose=verbose,
            start=start,
        )
    if relative_precision is not None:
        if np.ndim(noise_var) != 0:
            raise ValueError("relative_precision scales one noise variance: give noise_var as a number")
        noise_var = noise_matrix(
            np.array([float(noise_var)]),
            np.zeros(len(relative_precision[0]), dtype=int),
            relative_weights(relative_precision, len(layers), len(relative_precision[0])),
        )
    return match_fixed(
        layers,
        noise_var=noise_var,
        prior_var=prior_var,
        prior_mean=prior_mean,
        gamma0=gamma0,
        kl_weight=kl_weight,
        cost=cost,
        local_vars=local_vars,
        n_iter=n_iter,
        tol=tol,
        seed=seed,
        init=init,
        verbose=verbose,
        start=start,
        capacity=capacity,
    )


def _check_capacity(capacity: int, layers: Sequence, init: Sequence | None) -> None:
    """Refuse, up front, a ``capacity`` that a client's neurons or the warm start ``init`` exceed."""
    widest = max((len(v) for v in layers), default=0)
    if int(capacity) < widest:
        raise ValueError(
            f"capacity={capacity} is below the widest client's {widest} neurons: each needs an atom of its own"
        )
    atoms = max((int(np.max(a)) + 1 for a in init if len(a)), default=0) if init is not None else 0
    if atoms > int(capacity):
        raise ValueError(f"init has {atoms} atoms, more than capacity={capacity}")
