"""Fusing horseshoe BNN posteriors of any depth, layer by layer from the bottom.

Each hidden layer is fused as in the one-hidden-layer case (:mod:`bayesfuse.inference.bnn.units`
says why each step is there):

1. **Pruning**. With the clients' unit moments (``moments``, from their summaries,
   :meth:`~bayesfuse.models.bnn.HorseshoeBNN.unit_moments`): each client's least-contributing
   units, which together put at most ``prune_share`` of the layer's output into the layer
   above on the client's own data, are dropped
   (:func:`~bayesfuse.inference.bnn.units.keep_contributing`; the share is of the units'
   mean-square contributions summed). The rule reads the function the
   client's network computes, so a briefly trained guide keeps the units it uses and drops the
   ones it does not, wherever its variances still are. Without moments (data-free): units whose
   incoming weights hold less than ``prune_kl`` nats of information
   (:func:`~bayesfuse.inference.bnn.units.incoming_information`, read in the client's own basis)
   are dropped: the horseshoe has switched them off, in a converged guide. Either way the layer
   above loses the dropped units' columns too.
2. **The matched basis below** (layers 2 and up; the network's permutation spec,
   :func:`~bayesfuse.inference.bnn.sites.bnn_spec`, walked bottom-up by the loop PFNM's, FedMA's
   and OT's layer-wise fusions share, :class:`~bayesfuse.inference.walk.GroupWalk`): a unit's
   incoming weights are indexed by the client's kept units of the layer below; the global units
   those were matched to give them their columns in the fused layer below. A global unit below
   that none of the client's units joined gets weight 0 (what the client's network computes: it
   has no such input), with the mean variance of the unit's own incoming weights, so that the KL
   cost and barycenter treat it as one more weight the client is about as sure of as of its
   others. After the fusion, a fused unit's weight from a unit below that none of its members
   reads is 0 with a variance of ~0 (``1e-12`` of the unit's mean incoming weight variance):
   what every member computes, in every Monte Carlo draw.
3. **Unit form** (``unit_form``): ``"effective"`` compares and averages units as their effective
   incoming weights ``tau_l lambda_{l,k} (w~_k, b~_k)`` at their median scale (invariant to how a
   client split the scale, :func:`~bayesfuse.inference.bnn.units.effective_layer`); the log-scale
   of each global unit is the KL barycenter of its members' and is split again against the
   fused ``tau_l``. Effective weights compose: a fused unit of layer l-1 computes what its
   members compute, so the layer above reads the same inputs. ``"raw"`` fuses the guide's own
   coordinates ``[w~_k, b~_k, log lambda_k]``.
4. **Fusion**: :func:`kl_units` (``"kl"``): :func:`~bayesfuse.inference.klfusion.kl_fuse`
   (heterogeneous, L2,2,1, Claici et al. eq. 9); :func:`matched_units` (``"pfnm"``/``"nafi"``):
   :func:`~bayesfuse.inference.matching.match_neurons` on the posterior means with the posterior
   variances as ``local_vars``.
5. **Outputs**: the top hidden layer's units carry their outgoing weights into the fusion (the
   classes are the same for every client). With ``average_outputs``, global unit g's outgoing
   weight to class k is ``c_gk`` times the moment-matched mixture of its members' weights, mixed
   by the clients' class shares (:func:`share_mixture`), and the output bias the class-share
   mixture: when units match, the fused logits are the class-share weighted average of the
   clients' logits. Otherwise the plain barycenters.

Each layer's ``tau_l`` is the equal-weight barycenter of the clients'. A network of one hidden
layer goes through the same steps.

6. **Client heads**: beside the one output layer, every client's own output layer is read off
   the fused top hidden layer (:func:`client_heads`): ``fuse(..., head="clients")`` builds a
   :class:`~bayesfuse.models.bnn_heads.HeadMixtureBNN`, whose predictive is the class-share
   mixture of the heads' softmaxes instead of one softmax of averaged logits. In the raw form a
   fused unit's median scale ``tau lambda`` is not its members' (``tau`` is the clients'
   barycenter), so each head's weights are rescaled by ``s_member / s_fused``: exact for the top
   layer; the layers below carry the raw form's own mismatch, as the shared head does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import numpy as np

from bayesfuse.constraints import KEYS, validate_params
from bayesfuse.inference.bnn.posterior import DeepBNNPosterior, HiddenLayer
from bayesfuse.inference.bnn.sites import HEAD_KEYS, bnn_spec, check_same_prior
from bayesfuse.inference.bnn.units import (
    DEFAULT_PRUNE_SHARE,
    effective_layer,
    incoming_information,
    keep_contributing,
    keep_informative,
    split_effective,
    unit_contributions,
)
from bayesfuse.inference.expfam import DiagNormal
from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.inference.layerwise import class_share_matrix
from bayesfuse.inference.matching import match_neurons
from bayesfuse.inference.walk import Basis, GroupWalk

__all__ = [
    "BNNFusion",
    "fuse_bnn_posteriors",
    "kl_units",
    "matched_units",
    "output_shares",
    "membership",
    "share_mixture",
    "client_heads",
    "HEAD_KEYS",
]


def client_heads(assignments, out_loc, out_var, bias_loc, bias_var, n_global: int) -> dict[str, np.ndarray]:
    """Each client's output layer on the fused hidden units, as :data:`HEAD_KEYS` arrays (without shares).

    Parameters
    ----------
    assignments : list of (L_j,) int arrays
        The global unit of each of client j's (kept) top hidden units.
    out_loc, out_var : list of (L_j, K) arrays
        Those units' outgoing weights (posterior means and variances).
    bias_loc, bias_var : list of (K,) arrays
        Each client's output bias.
    n_global : int

    Returns
    -------
    dict with ``heads.loc_w``, ``heads.scale_w`` (J, K, G) and ``heads.loc_b``, ``heads.scale_b``
    (J, K). A global unit holding several units of one client (none after a one-to-one
    assignment) gets their summed weights, as the client's network sums their outputs.
    """
    J, K = len(assignments), np.shape(out_loc[0])[1]
    loc_w, var_w = np.zeros((J, K, n_global)), np.zeros((J, K, n_global))
    for j, (a, m, v) in enumerate(zip(assignments, out_loc, out_var)):
        a = np.asarray(a, dtype=np.intp)
        np.add.at(loc_w[j].T, a, np.asarray(m))
        np.add.at(var_w[j].T, a, np.asarray(v))
    return {
        "heads.loc_w": loc_w,
        "heads.scale_w": np.sqrt(var_w),
        "heads.loc_b": np.stack([np.asarray(b, dtype=np.float64).reshape(K) for b in bias_loc]),
        "heads.scale_b": np.sqrt(np.stack([np.asarray(b, dtype=np.float64).reshape(K) for b in bias_var])),
    }


@dataclass
class BNNFusion:
    """What :func:`fuse_bnn_posteriors` returns.

    Attributes
    ----------
    posterior : DeepBNNPosterior
    layers : list
        The fusion result of each hidden layer (``KLFusionResult`` or ``MatchResult``); its
        assignments index each client's kept units.
    kept : list of list of ndarray
        Per hidden layer, per client: the indices of the units kept by pruning.
    units : list of (ndarray, ndarray)
        Per hidden layer, the global units' means and variances in the guide's coordinates:
        ``[w~ (one per unit below, or input), b~, log lambda]``, then the outgoing weights for the
        top layer (:class:`~bayesfuse.inference.bnn.posterior.BNNPosterior`'s layout for one layer).
    hyper : dict
    heads : dict of ndarray
        Every client's output layer on the fused top hidden layer and the class shares that mix
        them (:data:`HEAD_KEYS`, :func:`client_heads`; :mod:`bayesfuse.models.bnn_heads`).
    """

    posterior: DeepBNNPosterior
    layers: list
    kept: list[list[np.ndarray]]
    units: list[tuple[np.ndarray, np.ndarray]]
    hyper: dict[str, Any] = field(default_factory=dict)
    heads: dict[str, np.ndarray] = field(default_factory=dict)


def output_shares(class_counts, n_clients: int, n_classes: int) -> np.ndarray:
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


def membership(assignments: Sequence[np.ndarray], n_global: int) -> np.ndarray:
    """(G, L) 0/1 matrix: entry (g, l) is 1 when local unit l (clients' units stacked in order) joined g."""
    members = np.zeros((n_global, sum(len(a) for a in assignments)))
    columns = np.arange(members.shape[1])
    members[np.concatenate(assignments).astype(np.intp), columns] = 1.0
    return members


def share_mixture(
    members: np.ndarray, shares: np.ndarray, loc: np.ndarray, var: np.ndarray, *, floor: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _columns(d: DiagNormal, cols) -> DiagNormal:
    """The coordinates ``cols`` of every component of ``d``."""
    return DiagNormal(loc=d.loc[:, cols], var=d.var[:, cols])


def _in_basis(incoming: DiagNormal, below: np.ndarray | None, n_below: int) -> DiagNormal:
    """A client's units' incoming weights and bias with the weights' columns at the global units
    ``below`` (one per kept unit of the client's layer below) among ``n_below``; the columns of
    global units the client has no unit in are 0, with each unit's mean variance of its own weights."""
    if below is None:
        return incoming
    H = len(incoming)
    pad = incoming.var[:, :-1].mean(1, keepdims=True) if incoming.loc.shape[1] > 1 else np.ones((H, 1))
    loc, var = np.zeros((H, n_below + 1)), np.repeat(pad, n_below + 1, axis=1)
    loc[:, below], var[:, below] = incoming.loc[:, :-1], incoming.var[:, :-1]
    loc[:, -1], var[:, -1] = incoming.loc[:, -1], incoming.var[:, -1]
    return DiagNormal(loc=loc, var=var)


def _unread_inputs_off(units: DiagNormal, assignments, below, n_below: int) -> DiagNormal:
    """``units`` (G fused units of a layer above the first) with the weight from global unit u
    below set to 0, with a variance of ``1e-12`` times the mean variance of the unit's weights
    from the layer below (the padded ones included; the bias not), wherever
    none of g's members reads u (none of them has a unit below matched to u).

    :func:`_in_basis` gives such weights a variance so that costs and barycenters can compare
    units; every member computes 0 there, and so must the fused unit: with the padded variance
    each Monte Carlo draw would add noise from inputs no client's network has (tiny rather than 0
    so that the guide's log-scales stay finite).
    """
    read = np.zeros((len(units), n_below), dtype=bool)
    for a, b in zip(assignments, below):
        read[np.ix_(np.asarray(a, dtype=np.intp), np.asarray(b, dtype=np.intp))] = True
    loc, var = units.loc.copy(), units.var.copy()
    tiny = 1e-12 * var[:, :n_below].mean(1, keepdims=True)
    loc[:, :n_below] = np.where(read, loc[:, :n_below], 0.0)
    var[:, :n_below] = np.where(read, var[:, :n_below], tiny)
    return DiagNormal(loc=loc, var=var)


def _outgoing(above: HiddenLayer, n_units: int) -> DiagNormal:
    """Rows: a layer's units; columns: their effective weights into each unit of the layer ``above``."""
    weights, _ = effective_layer(above)
    return DiagNormal(loc=weights.loc[:, :n_units].T, var=weights.var[:, :n_units].T)


def kl_units(vectors: list[DiagNormal], hyper: dict, *, seed, verbose) -> tuple[Any, DiagNormal, dict]:
    """A layer's units KL-fused (:func:`~bayesfuse.inference.klfusion.kl_fuse`): the result, the
    fused units and what to record beside ``hyper`` (the solver used)."""
    result = kl_fuse(vectors, verbose=verbose, **hyper)
    return result, cast(DiagNormal, result.components), {"solver": result.solver}  # the family of its inputs


def matched_units(vectors: list[DiagNormal], hyper: dict, *, seed, verbose) -> tuple[Any, DiagNormal, dict]:
    """A layer's units matched (:func:`~bayesfuse.inference.matching.match_neurons`, PFNM or NAFI) on
    their posterior means with their posterior variances as ``local_vars``: the result, the
    global units and what to record beside ``hyper`` (the seed)."""
    result = match_neurons(
        [v.loc for v in vectors], local_vars=[v.var for v in vectors], seed=seed, verbose=verbose, **hyper
    )
    return result, DiagNormal(loc=np.asarray(result.mean), var=np.asarray(result.var)), {"seed": seed}


@validate_params(unit_form=KEYS["unit_form"], prune_kl=KEYS["prune_kl"], prune_share=KEYS["prune_share"])
def fuse_bnn_posteriors(
    posts: Sequence[DeepBNNPosterior],
    fuse_units: Callable,
    *,
    average_outputs: bool = True,
    unit_form: str = "effective",
    prune_kl: float = 1.0,
    prune_share: float = DEFAULT_PRUNE_SHARE,
    moments: Sequence[dict] | None = None,
    class_counts=None,
    seed=0,
    verbose: bool = False,
    names: Sequence[str] | None = None,
    **hyper,
) -> BNNFusion:
    """Fuse the posteriors ``posts`` (same depth, inputs and classes, and one prior) layer by layer
    (module docstring).

    ``fuse_units`` fuses each layer's units: :func:`kl_units` (KL-fusion) or :func:`matched_units`
    (PFNM, NAFI); ``hyper`` goes to it for every layer. Posteriors under different priors (the
    horseshoe and the Gaussian, or other scales) are refused with a ``ValueError`` naming two of
    them (``names``, ``"client j"`` by default; :func:`~bayesfuse.inference.bnn.sites.check_same_prior`):
    the fused network has one prior. The fused posterior has theirs.

    ``moments``, one per client (its summary's ``moments``: per hidden layer group ``"units"``,
    ``"units2"``, ..., the mean and variance of each unit's activation on its own data), prunes
    by what units contribute (``prune_share``) instead of by their information (``prune_kl``);
    ``hyper["pruning"]`` says which rule ran.
    """
    if moments is not None and len(moments) != len(posts):
        raise ValueError(f"{len(moments)} clients' moments for {len(posts)} posteriors")
    prior = check_same_prior([p.prior_spec for p in posts], names)
    ref = posts[0]
    J, K, depth = len(posts), ref.n_classes, len(ref.layers)
    layers, units_all, fused_layers = [], [], []
    kept_all: list[list[np.ndarray]] = []  # per hidden layer, per client: the units pruning kept
    walk: GroupWalk[Basis] = GroupWalk(bnn_spec(depth))
    shares = output_shares(class_counts, J, K)  # (J, K) class shares of the outputs
    used = dict(hyper)
    used["pruning"] = (
        f"information: units under prune_kl={prune_kl:g} nats dropped (no client moments)"
        if moments is None
        else f"function: the least-contributing units carrying at most prune_share={prune_share:g} of a layer's "
        "output on the client's data dropped"
    )
    for index, group in walk:
        top = index == depth - 1
        # the layer below: how each client's kept units of it map to its fused units (none for the first)
        below_group = next(iter(walk.reads(group)), None)
        basis = walk.fused[below_group] if below_group is not None else None
        n_below = ref.in_features if basis is None else basis.n_global
        kept, vectors, scales = [], [], []
        for j, post in enumerate(posts):
            layer = post.layers[index]
            if moments is None:
                keep = keep_informative(incoming_information(layer.incoming), prune_kl)
            else:
                if group not in moments[j]:
                    raise ValueError(f"the moments of client {j} have no group {group!r} (hidden layer {index + 1})")
                stats = moments[j][group]
                above = post.out_weights if top else _outgoing(post.layers[index + 1], len(layer.incoming))
                keep = keep_contributing(unit_contributions(stats["act_mean"], stats["act_var"], above), prune_share)
            kept.append(np.flatnonzero(keep))
            layer = layer.units(keep)
            below = None
            if basis is not None:  # the columns of the units kept below, then the bias
                cols = np.append(kept_all[-1][j], layer.incoming.loc.shape[1] - 1)  # kept below
                layer = HiddenLayer(
                    incoming=_columns(layer.incoming, cols), log_lam=layer.log_lam, log_tau=layer.log_tau
                )
                below = basis.assignments[j]
            if unit_form == "effective":
                weights, log_scale = effective_layer(layer)
                scales.append(log_scale)
                parts = [_in_basis(weights, below, n_below)]
            else:
                parts = [_in_basis(layer.incoming, below, n_below), layer.log_lam]
            if top:
                parts.append(post.out_weights[keep])
            vectors.append(DiagNormal(loc=np.hstack([p.loc for p in parts]), var=np.hstack([p.var for p in parts])))
        result, units, record = fuse_units(vectors, hyper, seed=seed, verbose=verbose)
        if basis is not None:
            units = _unread_inputs_off(units, result.assignments, basis.assignments, n_below)
        used.update(record)
        G = len(units)
        members = membership(result.assignments, G)
        n_in = n_below + 1
        if top:
            out = slice(units.loc.shape[1] - K, None)
            if average_outputs:
                unit_shares = np.repeat(shares, [len(a) for a in result.assignments], axis=0)
                stacked = DiagNormal.concat(vectors)
                covered, loc_out, var_out = share_mixture(
                    members, unit_shares, stacked.loc[:, out], stacked.var[:, out], floor=1e-12 * units.var[:, out]
                )
                loc, var = units.loc.copy(), units.var.copy()
                loc[:, out] = np.where(covered, loc_out, 0.0)
                var[:, out] = np.where(covered, var_out, units.var[:, out])  # no member: the unit's own variance
                units = DiagNormal(loc=loc, var=var)
        log_tau = DiagNormal.concat([p.layers[index].log_tau for p in posts]).barycenter(np.ones(J))
        incoming = _columns(units, slice(0, n_in))
        if unit_form == "effective":
            member_weights = members.copy()
            # a unit with no member (none in practice) takes the mean log-scale
            member_weights[member_weights.sum(1) == 0] = 1.0
            fused = split_effective(incoming, DiagNormal.concat(scales).barycenter(member_weights), log_tau)
        else:
            fused = HiddenLayer(incoming=incoming, log_lam=_columns(units, slice(n_in, n_in + 1)), log_tau=log_tau)
        fused_layers.append(fused)
        layers.append(result)
        kept_all.append(kept)
        parts = [fused.incoming, fused.log_lam] + ([_columns(units, slice(-K, None))] if top else [])
        units_all.append((np.hstack([p.loc for p in parts]), np.hstack([p.var for p in parts])))
        walk.record(group, Basis([np.asarray(a) for a in result.assignments], G))
    top_units = units_all[-1]
    out_weights = _columns(DiagNormal(loc=top_units[0], var=top_units[1]), slice(-K, None))
    if average_outputs:
        biases = DiagNormal.concat([p.out_bias for p in posts])
        _, bias_loc, bias_var = share_mixture(
            np.ones((1, J)), shares, biases.loc, biases.var, floor=biases.var.min(0, keepdims=True)
        )
        out_bias = DiagNormal(loc=bias_loc, var=bias_var)
    else:
        out_bias = DiagNormal.concat([p.out_bias for p in posts]).barycenter(np.ones(J))
    posterior = DeepBNNPosterior(
        layers=tuple(fused_layers),
        out_weights=out_weights,
        out_bias=out_bias,
        in_features=ref.in_features,
        n_classes=K,
        global_scale=prior.global_scale,
        weight_scale=prior.weight_scale,
        prior=prior.kind,
    )
    outgoing = [p.out_weights[k] for p, k in zip(posts, kept_all[-1])]
    if unit_form == "raw":  # a fused unit computes s_g / s_jl times its member's output (s: median unit scale)
        top_layer = fused_layers[-1]
        m_fused = top_layer.log_tau.loc[0, 0] + top_layer.log_lam.loc[:, 0]
        factors = [
            np.exp(p.layers[-1].log_tau.loc[0, 0] + p.layers[-1].log_lam.loc[k, 0] - m_fused[np.asarray(a)])
            for p, k, a in zip(posts, kept_all[-1], layers[-1].assignments)
        ]
        outgoing = [DiagNormal(loc=o.loc * c[:, None], var=o.var * (c**2)[:, None]) for o, c in zip(outgoing, factors)]
    heads = client_heads(
        layers[-1].assignments,
        [o.loc for o in outgoing],
        [o.var for o in outgoing],
        [p.out_bias.loc for p in posts],
        [p.out_bias.var for p in posts],
        len(out_weights),
    )
    heads["heads.shares"] = shares
    return BNNFusion(posterior=posterior, layers=layers, kept=kept_all, units=units_all, hyper=used, heads=heads)
