"""The fusion core: J clients' state_dicts in, one fused state_dict and its per-layer results out.

Every entry point is this core between an adapter in and an adapter out:

* :func:`bayesfuse.fuse`: modules -> state_dicts -> :func:`fuse_states` -> rebuilt module;
* ``bayesfuse fuse`` (:func:`bayesfuse.fuse_files.fuse_files`): files -> :func:`fuse_states` -> files;
* the Flower strategy (:class:`bayesfuse.integrations.flower.MatchedAveraging`): ArrayRecords ->
  :func:`fuse_states` -> ArrayRecord.

Hyper-parameters are resolved by :func:`bayesfuse.methods.resolve` from the one method table;
the algorithms are the plain functions of :mod:`bayesfuse.inference`.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from bayesfuse import methods
from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.inference.encodings import check_unfoldable, encoded_groups, fold_encodings, unfold_encodings
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.layerwise import check_states, class_share_matrix, match_layerwise
from bayesfuse.inference.matching import match_neurons
from bayesfuse.inference.otfusion import ot_fuse_layerwise
from bayesfuse.inference.spec import PermutationSpec, spec_for_state_dict
from bayesfuse.models.bnn_posterior import BNNPosterior
from bayesfuse.models.bnn_sites import is_bnn_state
from bayesfuse.models.bnn_units import effective_units, from_effective, informative_units

__all__ = ["StateFusion", "fuse_states", "input_kind"]

State = Mapping[str, Any]


@dataclass
class StateFusion:
    """What :func:`fuse_states` returns.

    Attributes
    ----------
    state : dict of str to ndarray
        The fused state_dict, in the first client's entry order (floating entries float64,
        except FedAvg's, which keep the clients' dtype; integer buffers keep theirs).
    layers : list of LayerResult
        One per fused layer (:class:`~bayesfuse.inference.result.LayerResult`): a
        ``MatchResult`` per hidden group, or the BNN's one ``MatchResult``/``KLFusionResult``.
    sizes : list of int
        Global width of each hidden group.
    groups : tuple of str
        The permutation group of each entry of ``layers`` (``("units",)`` for BNNs).
    posteriors : list of (mean, var)
        Each layer's global units as independent Gaussians, arrays (G, D): the atom
        posterior of a matching, or the fused BNN's unit posterior. For networks with position
        encodings (``spec.encodings``) the units are those of the plain network, encodings
        folded in (:mod:`bayesfuse.inference.encodings`, eq. F); ``state`` is for the
        position-aware network at the global widths.
    method, kind : str
        The method and the kind of input (``"network"`` or ``"bnn"``, :mod:`bayesfuse.methods`).
    hyper : dict
        Every hyper-parameter used, the method table's defaults filled in, and the seed.
    spec : PermutationSpec or None
        The architecture of point-estimate networks.
    seconds : float
    """

    state: dict
    layers: list
    sizes: list
    groups: tuple
    posteriors: list
    method: str
    kind: str
    hyper: dict = field(default_factory=dict)
    spec: PermutationSpec | None = None
    seconds: float = 0.0

    @property
    def converged(self) -> bool:
        """Whether every layer's matching or fusion converged."""
        return all(bool(getattr(layer, "converged", True)) for layer in self.layers)


def input_kind(states: Sequence[State]) -> str:
    """``"bnn"`` when every state_dict is a HorseshoeBNN's, ``"network"`` when none is."""
    flags = [is_bnn_state(sd) for sd in states]
    if any(flags) and not all(flags):
        raise TypeError("cannot fuse Bayesian (HorseshoeBNN) and point-estimate networks together")
    return "bnn" if flags and all(flags) else "network"


def warn_single(n_models: int, stacklevel: int = 3) -> None:
    """The one warning of fusing a single model (it comes back shrunk by the prior)."""
    if n_models == 1:
        warnings.warn("only one model: fusion returns it (its posterior, shrunk by the prior)", UserWarning,
                      stacklevel=stacklevel)


def fuse_states(
    states: Sequence[State],
    method: str = "pfnm",
    *,
    spec: PermutationSpec | None = None,
    class_counts: np.ndarray | None = None,
    names: Sequence[str] | None = None,
    seed: int | None = 0,
    verbose: bool = False,
    **hyper,
) -> StateFusion:
    """Fuse the clients' state_dicts with ``method`` (any of :data:`bayesfuse.methods.METHODS`
    that needs no data).

    Parameters
    ----------
    states : sequence of mappings of str to arrays (NumPy or torch)
        Point-estimate networks of one architecture (hidden widths may differ), or HorseshoeBNN
        state_dicts (``loc.*``, ``log_scale.*``, ``prior_scales``).
    method : str
        ``"pfnm"``, ``"nafi"``, ``"fedavg"``, ``"ot"`` (networks) or ``"kl"`` (BNNs);
        ``"pfnm"``/``"nafi"`` also fuse BNNs. ``"fedma"`` retrains clients: :func:`bayesfuse.fuse` with ``data``.
    spec : PermutationSpec, optional
        Networks only: which axes each hidden permutation acts on; derived from the first
        state_dict's names and shapes when omitted (:func:`~bayesfuse.inference.spec.spec_for_state_dict`).
        Position-aware neurons (PANs) are fused correctly only when the spec records their
        ``encodings`` (:func:`bayesfuse.nets.spec.spec_from_module` does): matching methods
        then fold each client's encodings into its weights (at its own widths), match the
        plain networks and unfold the fused one at the global widths
        (:mod:`bayesfuse.inference.encodings`), so that the position-aware network rebuilt at
        those widths computes the fused function. FedAvg averages position-aware networks
        coordinate-wise as they are (what their encodings align them for).
    class_counts : (J, K) array, optional
        Examples of each class per client: weights the output layer by class shares (matching)
        or the clients by their sizes (FedAvg).
    names : sequence of str, optional
        How messages call the clients (file names); ``"client j"`` by default.
    seed : int, optional
        Seed of the matching.
    **hyper
        The method's hyper-parameters (:func:`bayesfuse.methods.resolve`; ``bayesfuse fuse
        --help`` lists them with their defaults).

    Returns
    -------
    StateFusion
    """
    start = time.perf_counter()
    if len(states) == 0:
        raise ValueError("fuse needs at least one model")
    m = methods.METHODS.get(method)
    if m is not None and m.needs_data:
        raise ValueError(f"method={method!r} retrains the clients between layers: pass data=(train, partition) with "
                         "each client's training data to bayesfuse.fuse, or fuse in one shot with pfnm or nafi")
    kind = input_kind(states)
    settings = methods.resolve(method, kind, hyper)
    names = list(names) if names is not None else [f"client {j}" for j in range(len(states))]
    warn_single(len(states), stacklevel=3)
    if kind == "bnn":
        fused = _fuse_bnn_states(states, names, method, settings, class_counts=class_counts, seed=seed,
                                 verbose=verbose)
    else:
        fused = _fuse_network_states(states, names, method, settings, spec=spec, class_counts=class_counts,
                                     seed=seed, verbose=verbose)
    fused.seconds = time.perf_counter() - start
    return fused


def _fuse_network_states(states, names, method, settings, *, spec, class_counts, seed, verbose) -> StateFusion:
    spec = spec if spec is not None else spec_for_state_dict(states[0], "auto", names[0])
    if not spec.groups:
        raise ValueError("the networks have no hidden units to match (no hidden layer)")
    if method == "fedavg":
        return _fedavg_states(states, names, spec, class_counts)
    if not encoded_groups(spec):
        return _match_network_states(states, names, method, settings, spec=spec, class_counts=class_counts,
                                     seed=seed, verbose=verbose)
    # position-aware neurons: match the plain networks (eq. F at each client's widths), then give the
    # fused network the weights that its encodings at the global widths turn into the plain ones (eq. U)
    check_unfoldable(spec)
    plain = [fold_encodings(sd, spec) for sd in check_states(states, spec, names)]
    fused = _match_network_states(plain, names, method, settings, spec=spec, class_counts=class_counts, seed=seed,
                                  verbose=verbose)
    unfolded = unfold_encodings(fused.state, spec)
    fused.state = {k: unfolded[k] for k in fused.state}
    return fused


def _match_network_states(states, names, method, settings, *, spec, class_counts, seed, verbose) -> StateFusion:
    """PFNM/NAFI (:func:`match_layerwise`) or OT fusion (:func:`ot_fuse_layerwise`) of plain networks."""
    if method == "ot":
        weights = None if class_counts is None else np.asarray(class_counts, dtype=np.float64).sum(1)
        result = ot_fuse_layerwise(states, spec, weights=weights, names=names, **settings)
        layers = [result.layers[g] for g in spec.groups]
        return StateFusion(state={k: result.state_dict[k] for k in states[0]}, layers=layers,
                           sizes=[result.sizes[g] for g in spec.groups], groups=tuple(spec.groups),
                           posteriors=[(layer.mean, layer.var) for layer in layers], method=method, kind="network",
                           hyper={**settings, "anchor": result.anchor, "weights": "class_counts" if weights is not None
                                  else "uniform"}, spec=spec)
    result = match_layerwise(states, spec, class_counts=class_counts, seed=seed, names=names, verbose=verbose,
                             **settings)
    layers = [result.layers[g] for g in spec.groups]
    hyper = {**settings, "seed": seed}
    chosen = {g: chosen_hyper(layer) for g, layer in zip(spec.groups, layers) if "auto" in layer.hyper}
    if chosen:
        hyper["chosen"] = chosen
    return StateFusion(
        state={k: result.state_dict[k] for k in states[0]},
        layers=layers,
        sizes=[result.sizes[g] for g in spec.groups],
        groups=tuple(spec.groups),
        posteriors=[(layer.mean, layer.var) for layer in layers],
        method=method,
        kind="network",
        hyper=hyper,
        spec=spec,
    )


def chosen_hyper(layer) -> dict:
    """The hyper-parameters empirical Bayes chose for one layer, per block of its units' entries."""
    h = layer.hyper
    return {"blocks": h["blocks"], "noise_var": h["noise_var"], "prior_var": h["prior_var"],
            "prior_mean": h["prior_mean"], "gamma0": h["gamma0"], "rounds": h["rounds"]}


def _fedavg_states(states, names, spec, class_counts) -> StateFusion:
    import torch  # FedAvg alone needs torch here (the baselines' averaging)

    from bayesfuse.baselines import fedavg_state_dicts

    check_states(states, spec, names)  # architecture, NaN, integer or complex weights
    for sd, n in zip(states[1:], names[1:]):
        for k, t in sd.items():
            if tuple(t.shape) != tuple(states[0][k].shape):
                raise ValueError(f"{n}: fedavg needs identical widths, {k!r} has shape {tuple(t.shape)} and "
                                 f"{tuple(states[0][k].shape)} in {names[0]}")
    weights = None if class_counts is None else np.asarray(class_counts, dtype=np.float64).sum(1)
    tensors = [{k: v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for k, v in sd.items()}
               for sd in states]
    state = {k: v.numpy() for k, v in fedavg_state_dicts(tensors, weights).items()}
    sizes = spec.sizes(state)
    return StateFusion(state=state, layers=[], sizes=[sizes[g] for g in spec.groups], groups=tuple(spec.groups),
                       posteriors=[], method="fedavg", kind="network",
                       hyper={"weights": "class_counts" if weights is not None else "uniform"}, spec=spec)


def _output_shares(class_counts, n_clients: int, n_classes: int) -> np.ndarray:
    """(J, K) weights of each client's outgoing weights and output bias per class, summing to 1 per class.

    Client j's share of class k, ``n_jk / sum_j n_jk``, with class counts; ``1 / J`` without
    them and for classes no client saw.
    """
    if class_counts is None:
        return np.full((n_clients, n_classes), 1.0 / n_clients)
    shares = class_share_matrix(class_counts, n_clients, n_classes)
    unseen = shares.sum(0) == 0
    shares[:, unseen] = 1.0 / n_clients
    return shares


def _membership(assignments: Sequence[np.ndarray], n_global: int) -> np.ndarray:
    """(G, L) 0/1 matrix: entry (g, l) is 1 when local unit l (clients' units stacked in order) joined g."""
    members = np.zeros((n_global, sum(len(a) for a in assignments)))
    columns = np.arange(members.shape[1])
    members[np.concatenate(assignments).astype(np.intp), columns] = 1.0
    return members


def _share_mixture(members: np.ndarray, shares: np.ndarray, loc: np.ndarray, var: np.ndarray, *,
                   floor: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``c`` times the moment-matched mixture of each row's members, mixed by their class shares.

    For row g and class k, ``c_gk = sum_l M_gl f_lk``; the mixture weights are ``f_lk / c_gk``;
    the result has mean ``sum_l M_gl f_lk mu_lk`` and variance
    ``c_gk^2 (E[W^2] - E[W]^2) = c_gk (sum_l M_gl f_lk (s2_lk + mu_lk^2)) - mean^2``, the
    mixture's variance taken at least ``floor`` (which only round-off reaches: it is at least
    its members' smallest). Returns ``(covered, mean, variance)``, ``covered = c > 0``; rows
    without members have mean 0 and variance ``floor``.
    """
    c = members @ shares
    mean = members @ (shares * loc)
    second = members @ (shares * (var + loc**2))
    covered = c > 0
    c_safe = np.where(covered, c, 1.0)
    return covered, mean, c_safe**2 * np.maximum(second / c_safe - (mean / c_safe) ** 2, floor)


def _fuse_bnn_states(states, names, method, settings, *, class_counts, seed, verbose) -> StateFusion:
    """Fuse horseshoe BNNs as mean-field posteriors.

    1. **Pruning** (``prune_kl``): each client's units whose incoming weights hold less than
       ``prune_kl`` nats of information are dropped: the horseshoe has switched them off
       (:func:`~bayesfuse.models.bnn_units.informative_units`).
    2. **Unit form** (``unit_form``): ``"effective"`` compares and averages units as effective
       weights ``tau lambda_k (w~_k, b~_k)`` at their median scale with their outgoing weights,
       invariant to how a client split the scale between ``tau``, ``lambda`` and ``w~``
       (:func:`~bayesfuse.models.bnn_units.effective_units`); each global unit's log-scale is
       the KL barycenter of its members' and is split again against the fused ``tau``.
       ``"raw"`` fuses the guide's own coordinates ``[w~_k, b~_k, log lambda_k, W_2[:, k]]``.
    3. **Matching**: ``"kl"``: :func:`~bayesfuse.inference.klfusion.kl_fuse` (heterogeneous,
       L2,2,1, ``reg``); each global unit is the KL barycenter of its local units.
       ``"pfnm"``/``"nafi"``: :func:`~bayesfuse.inference.matching.match_neurons` on the
       posterior means with the posterior variances as ``local_vars``; a global unit's Gaussian
       is the atom's posterior.
    4. **Outputs** (``average_outputs``): a local network's logits sum its own units'
       contributions; the fused network sums over every global unit. With ``average_outputs``
       the outgoing weight of global unit g to class k is ``sum_j f_jk W2_j[k, u_j(g)]`` over
       the clients whose unit ``u_j(g)`` merged into g, and the output bias ``sum_j f_jk b2_jk``
       (variances with ``f_jk^2``), where ``f_jk`` is client j's share of class k
       (``n_jk / sum_j n_jk`` given ``class_counts``, else ``1 / J``): when units match, the
       fused logit of class k is the class-share weighted average of the clients' logits, so a
       client that never saw class k has no say on it (the PFNM reference weights outgoing
       weights by class shares the same way). ``average_outputs=False`` keeps the plain
       barycenters of the outgoing weights and of the output bias.

    The global scale ``log tau`` is the equal-weight KL barycenter of the clients'. The
    layer's ``assignments`` index each client's kept units; ``hyper["kept_units"]`` lists which
    of its units those are.
    """
    posts = [BNNPosterior.from_state(sd, n) for sd, n in zip(states, names)]
    ref = posts[0]
    for n, p in zip(names, posts):
        if (p.in_features, p.n_classes) != (ref.in_features, ref.n_classes):
            raise ValueError(f"{n} maps {p.in_features} -> {p.n_classes}, {names[0]} maps "
                             f"{ref.in_features} -> {ref.n_classes}")
    J, K = len(posts), ref.n_classes
    hyper = dict(settings)
    average_outputs, unit_form, prune_kl = hyper.pop("average_outputs"), hyper.pop("unit_form"), hyper.pop("prune_kl")
    kept = [informative_units(p, prune_kl) for p in posts]
    posts = [replace(p, units=p.units[keep]) for p, keep in zip(posts, kept)]
    if unit_form == "effective":
        forms = [effective_units(p) for p in posts]
        vectors = [f.weights for f in forms]
    else:
        vectors = [p.units for p in posts]
    if method == "kl":
        layer = kl_fuse(vectors, verbose=verbose, **hyper)
        units = layer.components
        hyper["solver"] = layer.solver
    else:
        layer = match_neurons([v.loc for v in vectors], local_vars=[v.var for v in vectors], seed=seed,
                              verbose=verbose, **hyper)
        units = DiagNormal(loc=layer.mean, var=layer.var)
        hyper["seed"] = seed
    hyper.update(average_outputs=average_outputs, unit_form=unit_form, prune_kl=prune_kl,
                 kept_units=[np.flatnonzero(k).tolist() for k in kept])
    G = len(units)
    out = slice(units.loc.shape[1] - K, None)  # the outgoing weights close every unit, in either form
    members = _membership(layer.assignments, G)  # (G, all kept local units)
    if average_outputs:
        shares = _output_shares(class_counts, J, K)
        unit_shares = np.repeat(shares, [len(a) for a in layer.assignments], axis=0)  # each local unit's f_j.
        stacked = DiagNormal.concat(vectors)
        covered, loc_out, var_out = _share_mixture(members, unit_shares, stacked.loc[:, out], stacked.var[:, out],
                                                   floor=1e-12 * units.var[:, out])
        loc, var = units.loc.copy(), units.var.copy()
        loc[:, out] = np.where(covered, loc_out, 0.0)
        var[:, out] = np.where(covered, var_out, units.var[:, out])  # no member: the global unit's own variance
        units = DiagNormal(loc=loc, var=var)
        biases = DiagNormal.concat([p.out_bias for p in posts])
        _, bias_loc, bias_var = _share_mixture(np.ones((1, J)), shares, biases.loc, biases.var,
                                               floor=biases.var.min(0, keepdims=True))
        out_bias = DiagNormal(loc=bias_loc, var=bias_var)
    else:
        out_bias = DiagNormal.concat([p.out_bias for p in posts]).barycenter(np.ones(J))
    log_tau = DiagNormal.concat([p.log_tau for p in posts]).barycenter(np.ones(J))
    if unit_form == "effective":
        weights = members.copy()
        weights[weights.sum(1) == 0] = 1.0  # a unit with no member (none in practice) takes the mean log-scale
        scales = DiagNormal.concat([f.log_scale for f in forms])
        units, log_tau = from_effective(units, scales.barycenter(weights), log_tau, K)
    fused = BNNPosterior(units=units, out_bias=out_bias, log_tau=log_tau, in_features=ref.in_features, n_classes=K,
                         global_scale=ref.global_scale, weight_scale=ref.weight_scale)
    return StateFusion(state=fused.to_state(), layers=[layer], sizes=[G], groups=("units",),
                       posteriors=[(units.loc, units.var)], method=method, kind="bnn", hyper=hyper)
