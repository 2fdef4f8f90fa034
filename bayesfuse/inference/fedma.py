"""Federated matched averaging (FedMA, Wang et al., ICLR 2020): the server's protocol.

The server matches one permutation group at a time with
:func:`~bayesfuse.inference.layerwise.match_group` (BBP-MAP; NAFI's KL penalty when
``kl_weight > 0``), sends the clients the global layers so far, and lets them retrain the
layers above through a ``client_update`` callback before matching the next group (FedMA
Algorithm 1). Units, bases and batch-norm folding follow :mod:`bayesfuse.inference.layerwise`.

Everything here takes and returns NumPy arrays; :func:`fedma` reaches torch (or a federated
runtime) only through the ``client_update`` function it is given.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Generator, Mapping, Sequence

import numpy as np

from bayesfuse.constraints import MATCHING, validate_params
from bayesfuse.inference.bias_free import Added, add_zero_biases, biases_into_batchnorms
from bayesfuse.inference.encodings import fold_encodings, unfold_encodings
from bayesfuse.inference.layerwise import (
    HIDDEN_BIAS_PRIOR_MEAN,
    State,
    check_states,
    class_share_matrix,
    fold_batchnorm,
    folded_entries,
    folded_eps,
    folded_length,
    global_entries,
    group_seed,
    identity_bn,
    in_basis,
    match_group,
    unit_entries,
)
from bayesfuse.inference.matching import MatchResult
from bayesfuse.inference.result import ConvergenceWarning, warn_not_converged
from bayesfuse.inference.spec import PermutationSpec, permute
from bayesfuse.inference.walk import Basis, GroupWalk

__all__ = [
    "ClientUpdate",
    "FedMAResult",
    "FedMASteps",
    "fedma",
    "fedma_steps",
    "restart_states",
    "state_bytes",
    "matched_form",
    "network_form",
]


@dataclass
class FedMAResult:
    """Outcome of :func:`fedma`.

    Attributes
    ----------
    state_dict : dict
        The global network.
    layers : dict of str to MatchResult
        The matching of each hidden group.
    sizes : dict of str to int
    rounds : int
        Communication rounds (one per group, plus one for the output layer).
    bytes_up, bytes_down : int
        Bytes the clients sent and received (float32 entries).
    history : list of dict
        Per round: the group, global width, seconds, clients dropped.
    dropped : list of int
        Clients (indices into the input) dropped after failing to retrain.
    """

    state_dict: dict
    layers: dict
    sizes: dict
    rounds: int
    bytes_up: int
    bytes_down: int
    history: list = field(default_factory=list)
    hyper: dict = field(default_factory=dict)
    seconds: float = 0.0
    dropped: list = field(default_factory=list)


ClientUpdate = Callable[[list, set], list]
#: :func:`fedma_steps`: yields ``(jobs, frozen)``, is sent the retrained states, returns the result.
FedMASteps = Generator[tuple[list, set], list, "FedMAResult"]


def fedma(states: Sequence[State], spec: PermutationSpec, client_update: ClientUpdate, **options) -> FedMAResult:
    """Federated matched averaging (FedMA Algorithm 1; NAFI Algorithm 2 with ``kl_weight > 0``),
    with the clients' retraining done by ``client_update``.

    Drives :func:`fedma_steps`: each round's ``(jobs, frozen)`` goes to ``client_update(jobs,
    frozen)``, whose states are sent back in. ``options`` are :func:`fedma_steps`' keywords.
    """
    steps = fedma_steps(states, spec, **options)
    try:
        request = next(steps)
        while True:
            request = steps.send(client_update(*request))
    except StopIteration as stop:
        return stop.value


@validate_params(**{k: MATCHING[k] for k in ("noise_var", "prior_var", "gamma0", "kl_weight", "cost", "n_iter")})
def fedma_steps(
    states: Sequence[State],
    spec: PermutationSpec,
    *,
    class_counts: np.ndarray | None = None,
    noise_var: float = 1.0,
    prior_var: float = 10.0,
    gamma0: float = 1.0,
    kl_weight: float = 0.0,
    cost: str = "pfnm",
    n_iter: int = 10,
    seed: int | None = 0,
    bias_prior_mean: float = HIDDEN_BIAS_PRIOR_MEAN,
    verbose: bool = False,
) -> FedMASteps:
    """Federated matched averaging (FedMA Algorithm 1; NAFI Algorithm 2 with ``kl_weight > 0``),
    one round at a time: a generator that yields each round's retraining jobs and is sent the
    clients' retrained states, so that a federated runtime drives it from its own callbacks
    (:class:`bayesfuse.integrations.flower.FedMA`) and :func:`fedma` from a function.

    For each group ``g`` in forward order: the server matches the clients' units of ``g``
    (:func:`~bayesfuse.inference.layerwise.match_group`, BBP-MAP with the PFNM cost, plus NAFI's KL
    penalty) and forms the global layer ``W_n = 1/J sum_j W_{j,n} Pi_j^T`` (as the atoms' posterior means); each client
    receives the global layers so far, maps its next layer's inputs onto the global units
    (``W_{j,n+1} <- Pi_j W_{j,n+1}``, zero for global units it lacks) and retrains every entry
    not yet matched with the matched ones frozen. The output layer is
    finally the class-proportion weighted average ``W_N = sum_j p_jk W_{j,N}`` (FedMA Alg. 1).

    Yields ``(jobs, frozen)`` and is sent the retrained states (what :func:`fedma`'s
    ``client_update`` returns); its return value (``StopIteration.value``) is the result.
    ``jobs`` is a list of ``(j, state_dict)``: client j (its index in ``states``) is to retrain
    its network from ``state_dict`` (NumPy arrays, global widths below and at the matched group,
    its own above) keeping the entries in ``frozen`` fixed; batch norms that were folded are
    identities and must stay in eval mode. The states sent back come in the same order, or
    ``None`` for a client that failed or timed out: it is dropped from the later rounds and
    reported in ``history``/``dropped``. All clients of a round come in one request, so a
    federated runtime can train them at once.

    Parameters
    ----------
    states : sequence of dict
        The clients' trained state_dicts.
    class_counts : (J, K) array, optional
        Examples of each class per client: the output layer's weights ``p_jk``.
    noise_var, prior_var, gamma0, kl_weight, cost, n_iter, seed
        BBP-MAP settings (FedMA appendix D.2 uses sigma0^2 = 1, sigma^2 = 1, gamma0 in 1e-3..7).

    Returns
    -------
    FedMAResult
    """
    start = time.perf_counter()
    arrays = check_states(states, spec)
    J = len(arrays)
    n_classes = arrays[0][spec.output[0]].shape[0] if spec.output else 0
    shares = class_share_matrix(class_counts, J, n_classes)
    clients = list(range(J))  # original indices of the clients still taking part
    dropped: list[int] = []
    walk: GroupWalk[Basis] = GroupWalk(spec)
    layers: dict[str, MatchResult] = {}
    frozen_values: dict[str, np.ndarray] = {}
    history: list[dict] = []
    bytes_up = bytes_down = 0
    for i, group in walk:
        t0 = time.perf_counter()
        # fold the batch norms of this group (their layer is being matched now)
        bns = {bn: layer for bn, layer in spec.folds.items() if spec.axes[f"{bn}.weight"][0].group == group}
        if bns:
            sub = replace(spec, folds=bns)
            arrays = [fold_batchnorm(sd, sub) for sd in arrays]
        # an alias of a tensor held twice (spec.tied) is matched once, as its entry: it takes its value below
        skip = folded_entries(spec) | set(frozen_values) | set(spec.tied)
        entries = unit_entries(spec, group, walk.fused, skip)
        bytes_up += sum(4 * int(np.prod(sd[k].shape)) for sd in arrays for k in entries)
        sub_spec = PermutationSpec(  # the groups whose width the forward fixes: matched at it
            {k: spec.axes[k] for k in spec.axes if k not in skip or k in entries},
            spec.groups,
            {},
            spec.output,
            fixed=dict(spec.fixed),
        )
        with warnings.catch_warnings():  # one warning for all groups, at the end
            warnings.simplefilter("ignore", ConvergenceWarning)
            result, vals = match_group(
                arrays,
                sub_spec,
                group,
                walk.fused,
                class_shares=shares,
                noise_var=noise_var,
                prior_var=prior_var,
                gamma0=gamma0,
                kl_weight=kl_weight,
                cost=cost,
                n_iter=n_iter,
                tol=0.0,
                seed=group_seed(seed, i),
                bias_prior_mean=bias_prior_mean,
                verbose=verbose,
            )
        layers[group] = result
        for k in spec.output:  # the output layer is retrained in the global basis, then averaged
            vals.pop(k, None)
        G = result.n_global
        # entries permuted twice by this group (LSTM hidden-to-hidden): averaged in the new basis
        walk.record(group, Basis(result.assignments, G))
        basis = walk.fused
        twice = [
            k
            for k in spec.axes
            if k not in skip and spec.groups_of(k).count(group) == 2 and all(g in basis for g in spec.groups_of(k))
        ]
        vals.update(
            global_entries(
                arrays,
                PermutationSpec({k: spec.axes[k] for k in twice}, spec.groups),
                basis,
                set(),
                class_shares=None,
                noise_var=noise_var,
                prior_var=prior_var,
            )
        )
        for bn in bns:
            for p, value in identity_bn(folded_length(spec, bn, G), folded_eps(arrays[0], bn)).items():
                vals[f"{bn}.{p}"] = value
        bytes_down += J * sum(4 * int(np.prod(v.shape)) for v in vals.values())
        vals.update({alias: vals[entry] for alias, entry in spec.tied.items() if entry in vals})  # one tensor
        frozen_values.update(vals)
        # clients: global entries so far, next layers mapped onto the global units, retrain the rest
        jobs = []
        for j, sd in enumerate(arrays):
            local = {}
            for k in spec.axes:
                if k in frozen_values:
                    local[k] = frozen_values[k]
                else:
                    local[k] = (
                        in_basis(sd[k], spec, k, j, {group: basis[group]}, fill=0.0)
                        if group in spec.groups_of(k)
                        else np.asarray(sd[k])
                    )
            jobs.append((clients[j], local))
        updated = list((yield jobs, set(frozen_values)))
        if len(updated) != len(jobs):
            raise ValueError(f"client_update returned {len(updated)} states for {len(jobs)} clients")
        keep = [j for j, u in enumerate(updated) if u is not None]
        lost = [clients[j] for j, u in enumerate(updated) if u is None]
        if not keep:
            raise RuntimeError(f"every client failed to retrain after matching group {group!r}")
        dropped += lost
        arrays = check_states([updated[j] for j in keep], spec, [f"client {clients[j]}" for j in keep])
        clients, shares = [clients[j] for j in keep], shares[keep]
        if class_counts is not None and lost:
            shares = class_share_matrix(np.asarray(class_counts)[clients], len(clients), n_classes)
        J = len(clients)
        walk.rebase({g: Basis.identity(J, b.n_global) for g, b in basis.items()})
        history.append(dict(group=group, n_global=G, seconds=time.perf_counter() - t0, dropped=lost))
    # the output layer: class-proportion weighted average of the retrained clients' entries
    t0 = time.perf_counter()
    rest = [k for k in spec.axes if k not in frozen_values and k not in spec.tied]  # an alias: its entry's, below
    bytes_up += sum(4 * int(np.prod(sd[k].shape)) for sd in arrays for k in rest)
    weights = shares if class_counts is not None else np.full((J, n_classes), 1.0 / J)
    final = dict(frozen_values)
    for k in rest:
        stacked = np.stack([np.asarray(sd[k]) for sd in arrays])
        if not np.issubdtype(stacked.dtype, np.floating):
            final[k] = stacked[0]
        elif k in spec.output:
            w = weights.reshape(J, n_classes, *([1] * (stacked.ndim - 2)))
            final[k] = (w * stacked).sum(0)
        else:
            final[k] = stacked.mean(0)
    bytes_down += J * sum(4 * int(np.prod(final[k].shape)) for k in rest)
    final = spec.retie(final)  # an alias of the output layer's weight (a tied embedding): one value
    history.append(dict(group="output", n_global=n_classes, seconds=time.perf_counter() - t0))
    warn_not_converged(layers, "FedMA's matching", stacklevel=3)
    return FedMAResult(
        state_dict={k: final[k] for k in spec.axes},
        layers=layers,
        sizes={g: layers[g].n_global for g in spec.groups},
        rounds=len(history),
        bytes_up=int(bytes_up),
        bytes_down=int(bytes_down),
        history=history,
        hyper=dict(
            noise_var=noise_var,
            prior_var=prior_var,
            gamma0=gamma0,
            kl_weight=kl_weight,
            cost=cost,
            n_iter=n_iter,
            seed=seed,
            **({"fixed": dict(spec.fixed)} if spec.fixed else {}),
            **({"in_place": dict(spec.in_place)} if spec.in_place else {}),
        ),
        seconds=time.perf_counter() - start,
        dropped=dropped,
    )


def restart_states(
    result: FedMAResult, spec: PermutationSpec, n_clients: int, state: State | None = None
) -> list[tuple[int, dict]]:
    """FedMA with communication (FedMA section 2.3): each client's network of its original widths,
    cut out of the global one, to start the next layer-wise pass from.

    For every client ``j`` a pass did not drop, global unit ``a_j[l]`` of each group becomes its
    local unit ``l`` (``a_j`` its assignments in that group's matching), so that the global model
    does not snowball from pass to pass.

    Parameters
    ----------
    result : FedMAResult
        The pass that ended.
    spec : PermutationSpec
    n_clients : int
        The clients the pass started with (``result.dropped`` indexes them).
    state : dict, optional
        The global network in the basis ``spec`` permutes (``result.state_dict`` by default).

    Returns
    -------
    list of (int, dict)
        ``(j, state)`` for each client still in the run, in order.
    """
    state = result.state_dict if state is None else state
    alive = list(range(n_clients))
    position: dict[str, dict[int, int]] = {}
    for entry in result.history:  # the groups in the order they were matched, then the output layer
        if entry["group"] in result.layers:
            position[entry["group"]] = {c: i for i, c in enumerate(alive)}  # index in that group's matching
            alive = [c for c in alive if c not in entry.get("dropped", [])]
    return [
        (c, permute(state, spec, {g: result.layers[g].assignments[position[g][c]] for g in spec.groups})) for c in alive
    ]


def matched_form(state: Mapping[str, np.ndarray], spec: PermutationSpec, added: Sequence[Added]) -> dict:
    """A client's network as FedMA matches it: entries reading streams side by side as their
    pieces (``spec.split``), position encodings folded into the weights (eq. F,
    :func:`~bayesfuse.inference.encodings.fold_encodings`), and the zero biases ``added`` of
    layers without one before a batch norm (:mod:`bayesfuse.inference.bias_free`)."""
    return add_zero_biases(fold_encodings(spec.split(state), spec), added)


def network_form(
    state: Mapping[str, np.ndarray], spec: PermutationSpec, added: Sequence[Added], keys: Sequence[str]
) -> dict:
    """Inverse of :func:`matched_form` at any widths: the added biases moved into their batch
    norms (the entries in the clients' order ``keys``, cut into pieces), the encodings unfolded
    (eq. U), the pieces put back together."""
    if added:
        state = biases_into_batchnorms(state, added, keys)
    return spec.join(unfold_encodings(state, spec))


def state_bytes(state: Mapping[str, object]) -> int:
    """Bytes of a network's floating entries sent as float32, as FedMA counts its communication
    (NumPy arrays or torch tensors)."""
    total = 0
    for v in state.values():
        a = v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
        if np.issubdtype(a.dtype, np.floating):
            total += 4 * int(a.size)
    return total
