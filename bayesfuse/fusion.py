"""``bayesfuse.fuse``: one global network from J local ones, by BBP-MAP matching.

For one-hidden-layer MLPs (PFNM main text section 3, supplement section 1): each hidden unit is
the vector of its incoming weights, bias and outgoing weights; units are matched across clients
by :func:`bayesfuse.inference.matching.match_neurons`; the fused network has one hidden unit per
global atom, with the atom's posterior mean as its weights.

Outgoing weights and output bias follow the PFNM reference: when the clients' class counts are
known, the outgoing weight to class k of client j's units has noise variance
``noise_var / f_jk`` where ``f_jk = n_jk / sum_j n_jk`` is client j's share of class k, so a
client that saw few examples of a class has little say on the weights into it (and none when it
saw none: precision 0). The output bias of class k is the Gaussian posterior mean with the same
precisions and prior ``N(0, prior_var)``. Hidden biases have prior mean 0.1, the initial bias of
PFNM Table 1; weights have prior mean 0.

Deeper networks, ConvNets (with batch norms folded in) and LSTMs are matched layer by layer as
their :class:`~bayesfuse.nets.spec.PermutationSpec` describes
(:func:`bayesfuse.inference.layerwise.match_layerwise`); ``method="fedma"`` retrains the
clients between layers (FedMA, :mod:`bayesfuse.federated`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np
import torch
from torch import nn

from bayesfuse.inference.layerwise import match_layerwise
from bayesfuse.inference.matching import MatchResult, match_neurons
from bayesfuse.nets.arch import numpy_state, rebuild
from bayesfuse.nets.spec import PermutationSpec, spec_from_module

__all__ = ["FusionResult", "fuse"]

#: Default hyper-parameters. PFNM: sigma0^2 = 10, gamma0 = 1, sigma^2 tuned (1 to start).
#: NAFI reports lambda in 1e-3 .. 0.5 behaving alike with its code's KL; with the full Gaussian
#: KL (trace and log-det terms, which charge every new atom about D/2 (10 - log 11) nats at
#: these settings) 0.01 did best on Fashion-MNIST (benchmarks/bench_baselines.py).
DEFAULTS = {
    "pfnm": dict(noise_var=1.0, prior_var=10.0, gamma0=1.0, kl_weight=0.0),
    "nafi": dict(noise_var=1.0, prior_var=10.0, gamma0=1.0, kl_weight=0.01),
}
#: Every method ``fuse`` knows for point-estimate networks.
METHODS = ("pfnm", "nafi", "fedma", "fedavg")


@dataclass
class FusionResult:
    """What :func:`fuse` returns.

    Attributes
    ----------
    model : nn.Module
        The fused network.
    layers : list of MatchResult
        One per matched hidden layer.
    sizes : list of int
        Global width of each hidden layer.
    method : str
    hyper : dict
    seconds : float
    groups : tuple of str
        The permutation group of each entry of ``layers`` (see :mod:`bayesfuse.nets.spec`).
    """

    model: nn.Module
    layers: list[MatchResult]
    sizes: list[int]
    method: str
    hyper: dict = field(default_factory=dict)
    seconds: float = 0.0
    groups: tuple = ()

    def to_arviz(self, *, layer: int | str = 0, num_draws: int = 1000, chains: int = 4, seed: int = 0):
        """Draws of one layer's fused posterior and its assignments as an ArviZ object (see
        :func:`bayesfuse.analysis.fusion_to_arviz`)."""
        from bayesfuse.analysis import fusion_to_arviz

        return fusion_to_arviz(self, layer=layer, num_draws=num_draws, chains=chains, seed=seed)


def _warn_single(models, stacklevel: int = 3) -> None:
    if len(models) == 1:
        warnings.warn("only one model: fusion returns it (its posterior, shrunk by the prior)", UserWarning,
                      stacklevel=stacklevel)


def resolve_hyper(method: str, **given) -> dict:
    """``DEFAULTS[method]`` with the given values (``None`` keeps the default) as floats.

    Every entry point (``fuse``, ``bayesfuse fuse``, the Flower strategy) resolves its
    matching hyper-parameters here. Raises when PFNM is given a KL penalty.
    """
    if method not in DEFAULTS:
        raise ValueError(f"method must be one of {sorted(DEFAULTS)} for matching, got {method!r}")
    hyper = dict(DEFAULTS[method])
    unknown = set(given) - set(hyper)
    if unknown:
        raise ValueError(f"unknown hyper-parameters {sorted(unknown)}; known: {sorted(hyper)}")
    hyper.update({k: float(v) for k, v in given.items() if v is not None})
    if method == "pfnm" and hyper["kl_weight"] != 0.0:
        raise ValueError("method='pfnm' has no KL penalty; use method='nafi' for kl_weight > 0")
    return hyper


def fuse(
    models: Sequence[nn.Module],
    method: Literal["pfnm", "nafi", "fedma", "fedavg", "kl"] = "pfnm",
    *,
    class_counts: np.ndarray | None = None,
    noise_var: float | None = None,
    prior_var: float | None = None,
    gamma0: float | None = None,
    kl_weight: float | None = None,
    cost: Literal["pfnm", "marginal"] = "pfnm",
    reg: float = 0.1,
    solver: str = "auto",
    average_outputs: bool = True,
    n_iter: int = 10,
    seed: int | None = 0,
    verbose: bool = False,
    spec: PermutationSpec | None = None,
    direction: Literal["bottom-up", "top-down"] = "bottom-up",
    data: tuple | None = None,
    retrain=None,
) -> FusionResult:
    """Fuse networks into one by matching their hidden units, layer by layer.

    Point-estimate MLPs are fused by PFNM or NAFI. Horseshoe BNNs
    (:class:`~bayesfuse.models.bnn.HorseshoeBNN`) are fused as posteriors: ``"kl"`` runs
    KL-fusion on the units' mean-field Gaussians (Claici et al. 2020, section 5.4);
    ``"pfnm"``/``"nafi"`` match the units' posterior means with their posterior variances as
    per-neuron noise (``local_vars``); either way the result is a BNN whose guide is the fused
    posterior (see :func:`_fuse_bnns`).

    Parameters
    ----------
    models : sequence of nn.Module
        Networks of one architecture (hidden widths may differ): :class:`MLP` of any depth,
        ``nn.Sequential`` ConvNets/MLPs (:func:`~bayesfuse.nets.arch.make_cnn`), the LSTM
        classifier, anything ``spec`` describes; or HorseshoeBNNs (one hidden layer).
    method : {"pfnm", "nafi", "fedma", "fedavg", "kl"}
        PFNM (Yurochkin et al. 2019), NAFI (PFNM cost plus ``kl_weight`` x KL penalty), FedMA
        (Wang et al. 2020; needs ``data``), one-shot FedAvg (same widths; weighted by client
        sizes from ``class_counts``), or KL-fusion (BNNs only).
    reg, solver : KL-fusion's ``lambda`` and solver (``method="kl"``).
    average_outputs : bool
        BNNs only: scale each global unit's outgoing weights by ``m_g / J`` (the share of
        clients whose units it merges), so that the fused logits average the clients' logits
        instead of summing them (see :func:`_fuse_bnns`).
    class_counts : (J, K) array, optional
        Examples of each class per client (``Partition.counts``); weights outgoing weights and
        output biases by class shares as the PFNM reference does. Uniform when omitted.
    noise_var, prior_var, gamma0, kl_weight : float, optional
        See :func:`~bayesfuse.inference.matching.match_neurons`; defaults in ``DEFAULTS``.
    cost : {"pfnm", "marginal"}
    n_iter, seed, verbose
        Passed to :func:`~bayesfuse.inference.matching.match_neurons`.
    spec : PermutationSpec, optional
        Which axes each hidden permutation acts on; derived from ``models[0]`` when omitted
        (:func:`~bayesfuse.nets.spec.spec_from_module`).
    direction : {"bottom-up", "top-down"}
        Order of the layers (:func:`~bayesfuse.inference.layerwise.match_layerwise`):
        bottom-up expresses each layer's incoming weights in the matched layer below;
        top-down is PFNM supplement Algorithm 1. One hidden layer: the same.
    data : (Dataset, partition), optional
        ``method="fedma"`` only: the clients' training data, for the retraining between
        layers (:func:`bayesfuse.federated.run_fedma`); ``retrain`` is its
        :class:`~bayesfuse.train.TrainConfig`. ``kl_weight > 0`` matches with NAFI's penalty.
    """
    start = time.perf_counter()
    if len(models) == 0:
        raise ValueError("fuse needs at least one model")
    from bayesfuse.models.bnn import HorseshoeBNN

    n_bnn = sum(isinstance(m, HorseshoeBNN) for m in models)
    if 0 < n_bnn < len(models):
        raise TypeError("cannot fuse Bayesian and point-estimate networks together")
    if n_bnn:
        return _fuse_bnns(models, method, noise_var=noise_var, prior_var=prior_var, gamma0=gamma0,
                          kl_weight=kl_weight, cost=cost, reg=reg, solver=solver, n_iter=n_iter,
                          seed=seed, verbose=verbose, start=start, average_outputs=average_outputs)
    if method == "fedavg":
        return _fuse_fedavg(models, class_counts, start)
    if method == "fedma":
        return _fuse_fedma(models, data, retrain, class_counts=class_counts, noise_var=noise_var,
                           prior_var=prior_var, gamma0=gamma0, kl_weight=kl_weight, spec=spec, seed=seed,
                           verbose=verbose, start=start)
    if data is not None:
        raise ValueError(f"method={method!r} fuses the models alone; data is used by method='fedma' only")
    if method not in DEFAULTS:
        raise ValueError(f"method must be one of {sorted(METHODS)} for point-estimate networks, got {method!r}")
    _warn_single(models)
    hyper = resolve_hyper(method, noise_var=noise_var, prior_var=prior_var, gamma0=gamma0, kl_weight=kl_weight)
    spec = spec if spec is not None else spec_from_module(models[0])
    states = [numpy_state(m) for m in models]
    if not spec.groups:
        raise ValueError("the networks have no hidden units to match (no hidden layer)")
    result = match_layerwise(states, spec, direction=direction, class_counts=class_counts, cost=cost, n_iter=n_iter,
                             seed=seed, verbose=verbose, **hyper)
    model = rebuild(models[0], {k: torch.as_tensor(v) for k, v in result.state_dict.items()}).eval()
    return FusionResult(
        model=model,
        layers=[result.layers[g] for g in spec.groups],
        sizes=[result.sizes[g] for g in spec.groups],
        method=method,
        hyper={**hyper, "cost": cost, "n_iter": n_iter, "seed": seed, "direction": direction},
        seconds=time.perf_counter() - start,
        groups=tuple(spec.groups),
    )


def _fuse_fedavg(models, class_counts, start) -> FusionResult:
    from bayesfuse.baselines import fedavg

    _warn_single(models)
    weights = None if class_counts is None else np.asarray(class_counts, dtype=np.float64).sum(1)
    model = fedavg(models, weights).eval()
    spec = spec_from_module(models[0])
    sizes = spec.sizes(numpy_state(model))
    return FusionResult(model=model, layers=[], sizes=[sizes[g] for g in spec.groups], method="fedavg",
                        hyper={"weights": "class_counts" if weights is not None else "uniform"},
                        seconds=time.perf_counter() - start, groups=tuple(spec.groups))


def _fuse_fedma(models, data, retrain, *, class_counts, noise_var, prior_var, gamma0, kl_weight, spec, seed,
                verbose, start) -> FusionResult:
    from bayesfuse.federated import run_fedma

    if data is None:
        raise ValueError("method='fedma' retrains the clients between layers: pass data=(train, partition) with "
                         "each client's training data")
    train, partition = data
    if class_counts is not None:
        raise ValueError("method='fedma' takes the class counts from data; do not pass class_counts")
    method = "nafi" if kl_weight else "pfnm"
    hyper = resolve_hyper(method, noise_var=noise_var, prior_var=prior_var, gamma0=gamma0, kl_weight=kl_weight)
    run = run_fedma(models, train, partition, retrain, method=method, noise_var=hyper["noise_var"],
                    prior_var=hyper["prior_var"], gamma0=hyper["gamma0"], kl_weight=kl_weight or None, spec=spec,
                    seed=seed or 0, verbose=verbose)
    r = run.result
    return FusionResult(model=run.model, layers=[r.layers[g] for g in run.spec.groups], sizes=run.sizes,
                        method="fedma", hyper={**r.hyper, "rounds": r.rounds, "bytes_up": r.bytes_up,
                                               "bytes_down": r.bytes_down},
                        seconds=time.perf_counter() - start, groups=tuple(run.spec.groups))


#: Defaults for BNN units matched by PFNM/NAFI: the units' own posterior variances carry most
#: of the noise, so the extra noise variance is small.
BNN_MATCH_DEFAULTS = dict(noise_var=0.01, prior_var=10.0, gamma0=1.0)


def _fuse_bnns(bnns, method, *, noise_var, prior_var, gamma0, kl_weight, cost, reg, solver, n_iter, seed,
               verbose, start, average_outputs: bool = True) -> FusionResult:
    """Fuse horseshoe BNNs as mean-field posteriors.

    Hidden units are the (D + 2 + K)-dimensional Gaussians of
    :class:`~bayesfuse.nets.bnn_posterior.BNNPosterior` (incoming weights, bias, log-scale,
    outgoing weights), so the output layer is fused through the same assignment. ``"kl"``:
    :func:`~bayesfuse.inference.klfusion.kl_fuse` (heterogeneous, L2,2,1, ``reg``); each global
    unit is the KL barycenter of its local units. ``"pfnm"``/``"nafi"``:
    :func:`~bayesfuse.inference.matching.match_neurons` on the posterior means with the
    posterior variances as ``local_vars``; a global unit's Gaussian is the atom's posterior.
    The output bias and the global scale ``log tau`` are the equal-weight KL barycenters of the
    clients' (natural parameters averaged).

    Output scale. A local network's logits sum its own units' contributions; the fused network
    sums over every global unit, so units that only one client has would count fully next to
    units averaged over all clients, and the fused logits would approach the *sum* of the
    clients' logits (over-confident where clients disagree). With ``average_outputs`` the
    outgoing weights of global unit g are multiplied by ``m_g / J`` (``m_g`` clients' units
    merged into it; their variances by ``(m_g / J)^2``), which makes the fused logits the
    average of the local ones when units match. On the 5-client Dirichlet(0.8) studies this
    lifted Fashion-MNIST from 76.1% to 79.1% accuracy and the font-digit AUROC from 0.88 to
    0.97 (benchmarks/bench_bnn_fusion.py); ``average_outputs=False`` keeps the plain
    barycenters.
    """
    from bayesfuse.inference.expfam import DiagNormal
    from bayesfuse.inference.klfusion import kl_fuse
    from bayesfuse.nets.bnn_posterior import BNNPosterior

    posts = [BNNPosterior.from_bnn(b) for b in bnns]
    ref = posts[0]
    for j, p in enumerate(posts):
        if (p.in_features, p.n_classes) != (ref.in_features, ref.n_classes):
            raise ValueError(f"BNN {j} maps {p.in_features} -> {p.n_classes}, BNN 0 maps "
                             f"{ref.in_features} -> {ref.n_classes}")
    if method == "kl":
        layer = kl_fuse([p.units for p in posts], reg=reg, solver=solver, n_iter=max(n_iter, 20), verbose=verbose)
        units = layer.components
        hyper = {"reg": reg, "solver": layer.solver}
    elif method in ("pfnm", "nafi"):
        hyper = dict(BNN_MATCH_DEFAULTS, kl_weight=DEFAULTS[method]["kl_weight"])
        for key, value in dict(noise_var=noise_var, prior_var=prior_var, gamma0=gamma0, kl_weight=kl_weight).items():
            if value is not None:
                hyper[key] = float(value)
        layer = match_neurons([p.units.loc for p in posts], local_vars=[p.units.var for p in posts],
                              cost=cost, n_iter=n_iter, seed=seed, verbose=verbose, **hyper)
        units = DiagNormal(loc=layer.mean, var=layer.var)
        hyper["cost"] = cost
    else:
        raise ValueError(f"method must be 'kl', 'pfnm' or 'nafi' for BNNs, got {method!r}")
    _warn_single(bnns)
    equal = np.ones(len(posts))
    if average_outputs:
        counts = np.zeros(len(units))
        for a in layer.assignments:
            counts[a] += 1
        share = counts / len(posts)
        d_out = ref.in_features + 2
        loc, var = units.loc.copy(), units.var.copy()
        loc[:, d_out:] *= share[:, None]
        var[:, d_out:] *= share[:, None] ** 2
        units = DiagNormal(loc=loc, var=var)
    hyper["average_outputs"] = average_outputs
    fused = BNNPosterior(
        units=units,
        out_bias=DiagNormal.concat([p.out_bias for p in posts]).barycenter(equal),
        log_tau=DiagNormal.concat([p.log_tau for p in posts]).barycenter(equal),
        in_features=ref.in_features, n_classes=ref.n_classes,
        global_scale=ref.global_scale, weight_scale=ref.weight_scale,
    )
    return FusionResult(model=fused.to_bnn(), layers=[layer], sizes=[len(units)], method=method, hyper=hyper,
                        seconds=time.perf_counter() - start)
