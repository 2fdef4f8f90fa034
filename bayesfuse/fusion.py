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
their :class:`~bayesfuse.inference.spec.PermutationSpec` describes
(:func:`bayesfuse.inference.layerwise.match_layerwise`); ``method="fedma"`` retrains the
clients between layers (FedMA, :mod:`bayesfuse.federated`).

:func:`fuse` is an adapter around the one fusion core, :func:`bayesfuse.core.fuse_states`:
modules -> state_dicts -> core -> rebuilt module. Its hyper-parameters and their defaults come
from the method table, :mod:`bayesfuse.methods`.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence, cast

import numpy as np
import torch
from torch import nn

from bayesfuse import methods
from bayesfuse._runtime import progress
from bayesfuse._text import first_line, warn_from_caller
from bayesfuse.client_order import canonical_order, to_callers, to_canonical
from bayesfuse.core import fuse_states
from bayesfuse.inference._backend import check_device
from bayesfuse.inference.client_heads import default_pool, heads_refused, kronecker_variants
from bayesfuse.inference.spec import PermutationSpec
from bayesfuse.nets.arch import check_runs, rebuild
from bayesfuse.nets.attention import SPLIT_NOTE, merged_where_possible, multihead_modules, split_heads
from bayesfuse.nets.graph_spec import UnsupportedLayerError, check_example_runs, untraceable
from bayesfuse.nets.spec import spec_with_encodings
from bayesfuse.nets.state import as_array, numpy_state, run_once

__all__ = ["FusionResult", "fuse"]


@dataclass
class FusionResult:
    """What :func:`fuse` returns.

    Attributes
    ----------
    model : nn.Module
        The fused network (a :class:`~bayesfuse.models.bnn.HorseshoeBNN` for BNNs; with
        ``head="clients"`` a :class:`~bayesfuse.models.bnn_heads.HeadMixtureBNN`). Fused with
        client summaries by PFNM or NAFI in one shot, by default a
        :class:`~bayesfuse.nets.heads.ClientHeads` (the clients' own output layers as Laplace
        posteriors on the fused network, ``model.network``); with ``head="shared"`` (or the
        refit round) a :class:`~bayesfuse.nets.laplace.LastLayerLaplace`: the network at its
        posterior mean (``model.network``) with the Gaussian posterior of its output layer, whose
        ``forward`` gives the probit predictive's logits and ``predict(x, num_samples=...)`` the
        sampled one.
    layers : list of LayerResult
        One per matched hidden layer (:class:`~bayesfuse.inference.result.LayerResult`: a
        ``MatchResult``, or a ``KLFusionResult`` for KL-fused BNNs); ``assignments[j]`` is the
        j-th model's as :func:`fuse` was given them (:mod:`bayesfuse.client_order`).
    sizes : list of int
        Global width of each hidden layer.
    method : str
    hyper : dict
        Every hyper-parameter used (the method table's defaults filled in).
    seconds : float
    groups : tuple of str
        The permutation group of each entry of ``layers`` (see :mod:`bayesfuse.inference.spec`).
    posteriors : list of (mean, var)
        Each matched layer's global units as independent Gaussians (G, D).
    example_input : Tensor or None
        The input ``fuse`` was given to trace and run the networks on (its first two rows), which
        :func:`bayesfuse.save` records for :func:`bayesfuse.load` to run the network on again.
    """

    model: nn.Module
    layers: list
    sizes: list[int]
    method: str
    hyper: dict = field(default_factory=dict)
    seconds: float = 0.0
    groups: tuple = ()
    posteriors: list = field(default_factory=list)
    example_input: Any = field(default=None, repr=False, compare=False)

    @property
    def converged(self) -> bool:
        """Whether every layer's matching or fusion converged."""
        return all(bool(getattr(layer, "converged", True)) for layer in self.layers)

    def to_arviz(self, *, layer: int | str = 0, **options):
        """Independent draws of one layer's fused posterior, its assignments, the method,
        hyper-parameters and convergence as an ArviZ object; ``options`` (``units``,
        ``num_draws``, ``weight_names``, ``seed``) as in :func:`bayesfuse.analysis.fusion_to_arviz`.
        For a fused BNN with test data (``az.loo``, ``az.compare``) see
        :func:`bayesfuse.analysis.bnn_to_arviz`."""
        from bayesfuse.analysis import fusion_to_arviz

        return fusion_to_arviz(self, layer=layer, **options)


def _check_modules(models: Sequence) -> None:
    """Refuse state_dicts, pointing to :func:`~bayesfuse.core.fuse_states`, file paths, pointing to
    :func:`bayesfuse.load` and :func:`~bayesfuse.fuse_files.fuse_files`, and anything else that is
    not an ``nn.Module`` (``TypeError``)."""
    if isinstance(models, (str, os.PathLike, nn.Module)) or not isinstance(models, Sequence):
        raise TypeError(f"fuse takes a list of models, got a {type(models).__name__}")
    for j, model in enumerate(models):
        if isinstance(model, Mapping):
            raise TypeError(
                f"model {j} is a state_dict ({type(model).__name__}), not an nn.Module: fuse state_dicts "
                "with bayesfuse.fuse_states(states, method) (it returns the fused state_dict), or load "
                "each into its network first (model.load_state_dict(state))"
            )
        if isinstance(model, (str, os.PathLike)):
            raise TypeError(
                f"model {j} is a path ({str(model)!r}), not an nn.Module: load each with bayesfuse.load(path, "
                "like=network), or fuse the files with bayesfuse.fuse_files.fuse_files(paths, method, out)"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"model {j} is not an nn.Module (a network or a HorseshoeBNN): got {type(model).__name__}")


def _is_bnn(model) -> bool:
    from bayesfuse.models.bnn import HorseshoeBNN

    return isinstance(model, HorseshoeBNN)


def fuse(
    models: Sequence[nn.Module],
    method: str = "pfnm",
    *,
    class_counts: np.ndarray | None = None,
    spec: PermutationSpec | None = None,
    data: tuple | None = None,
    retrain=None,
    seed: int | None = 0,
    verbose: bool | None = None,
    device=None,
    dtype: str = "float64",
    summaries: Sequence | None = None,
    output_pool: str = "precision",
    rounds: int = 1,
    second_round: str | None = None,
    output_prior_precision: float | None = None,
    example_input=None,
    head: str | None = None,
    pool: str | None = None,
    pseudo_count: float | None = None,
    **hyper,
) -> FusionResult:
    """Fuse networks into one by matching their hidden units, layer by layer.

    Point-estimate networks are fused by PFNM or NAFI (or averaged by FedAvg, or fused by
    FedMA with their data). Horseshoe BNNs (:class:`~bayesfuse.models.bnn.HorseshoeBNN`) are
    fused as posteriors: ``"kl"`` runs KL-fusion on the units' mean-field Gaussians (Claici et
    al. 2020, section 5.4); ``"pfnm"``/``"nafi"`` match the units' posterior means with their
    posterior variances as per-neuron noise; either way the result is a BNN whose guide is the
    fused posterior (:func:`bayesfuse.core.fuse_states`).

    Parameters
    ----------
    models : sequence of nn.Module
        Networks of one architecture (hidden widths may differ): :class:`MLP` of any depth,
        ``nn.Sequential`` ConvNets/MLPs (:func:`~bayesfuse.nets.arch.make_cnn`), the LSTM
        classifier, anything ``spec`` describes; or HorseshoeBNNs (any depth). Their order does
        not matter: they are fused in the canonical order of the command line (by the digest of
        their tensors, :mod:`bayesfuse.client_order`), and what the result holds per client
        (each layer's ``assignments``, ``hyper["kept_units"]``...) comes back in the order given;
        ``hyper["fused_order"]`` lists the models' indices in the order they were fused.
    method : str
        One of :data:`bayesfuse.methods.METHODS`: ``"pfnm"`` (Yurochkin et al. 2019), ``"nafi"``
        (PFNM cost plus ``kl_weight`` x KL penalty), ``"fedma"`` (Wang et al. 2020; needs
        ``data``), one-shot ``"fedavg"`` (same widths; weighted by client sizes from
        ``class_counts``), ``"ot"`` (OT fusion, Singh & Jaggi 2020) or ``"kl"`` (KL-fusion, BNNs only).
    class_counts : (J, K) array, optional
        Examples of each class per client (``Partition.counts``); weights outgoing weights and
        output biases by class shares as the PFNM reference does. Uniform when omitted. Counts,
        not shares: their totals smooth the clients' own heads (``head="clients"``,
        :class:`~bayesfuse.nets.heads.ClientHeads`).
    spec : PermutationSpec, optional
        Which axes each hidden permutation acts on; derived from ``models[0]`` when omitted
        (:func:`~bayesfuse.nets.spec.spec_from_module`). For networks with position-aware
        neurons it records their encodings, which matching folds into the weights and out
        again at the fused widths (:func:`bayesfuse.core.fuse_states`): the fused network,
        rebuilt with its encodings at the global widths, computes the matched function. A
        given spec without the encodings of such a network is refused (except by FedAvg).
    data : (Dataset, partition), optional
        ``method="fedma"`` only: the clients' training data, for the retraining between
        layers (:func:`bayesfuse.federated.run_fedma`); ``retrain`` is its
        :class:`~bayesfuse.train.TrainConfig`. ``kl_weight > 0`` matches with NAFI's penalty.
    seed : int, optional
        Seed of the matching.
    verbose : bool, optional
        Progress bars: None (default) shows them where stderr is a terminal and stays quiet in
        logs, pipes and notebooks; True or False forces them on or off.
    device : None, str or torch.device
        Where ``"pfnm"``/``"nafi"`` on point-estimate networks compute their cost products and
        posterior means: None (default), NumPy on the host; a torch device (``"cpu"``,
        ``"cuda"``...), torch there in ``dtype`` (:func:`bayesfuse.core.fuse_states`). The
        result is the same up to round-off. Other methods and BNNs refuse a device.
    dtype : {"float64", "float32"}
        With ``device``: the dtype of that arithmetic.
    summaries : sequence of ClientSummary, optional
        One per model (:func:`bayesfuse.summarize`, computed by each client on its own data):
        PFNM and NAFI then fuse the networks as their Laplace posteriors
        (:func:`bayesfuse.core.fuse_states`). In one shot the fused model then keeps every
        client's own output layer as its Laplace posterior and pools them geometrically (``head``
        is ``"clients"`` and ``pool`` ``"log"`` by default, a
        :class:`~bayesfuse.nets.heads.ClientHeads`) where the output layer reads hidden units;
        with ``head="shared"`` (and where it reads the inputs or positions, as
        ``hyper["head"]`` then says) it predicts with the fused posterior of its output layer
        (:class:`~bayesfuse.nets.laplace.LastLayerLaplace`). ``hyper["summaries"]`` says what
        was used.
    output_pool : {"precision", "counts"}
        With summaries: how the clients' logits are pooled (:func:`bayesfuse.core.fuse_states`).
    example_input : Tensor, optional
        A batch of inputs for tracing a network of your own class with ``torch.fx``
        (:func:`~bayesfuse.nets.graph_spec.spec_from_graph`) when its first layer is not
        ``nn.Linear`` (or set an ``example_input`` attribute on the module); the fused network
        is run on it once before it is returned.
    head : {"shared", "clients"}, optional
        For BNNs, the method's ``head`` (``"clients"``: a
        :class:`~bayesfuse.models.bnn_heads.HeadMixtureBNN`). For point-estimate networks in one
        shot (PFNM, NAFI; the default with ``summaries``): ``"clients"`` keeps every client's own
        output layer, each weight moved to the global unit its hidden unit was matched to, and
        predicts with their class-share pool on the fused features (``pool``;
        :class:`~bayesfuse.nets.heads.ClientHeads`; nothing more is sent); with ``summaries`` each
        head is its client's Laplace posterior of its own output layer, Kronecker-factored where the
        summaries carry the layer's factors (:mod:`bayesfuse.inference.client_heads`). The heads are
        in the canonical client order (:mod:`bayesfuse.client_order`), which the mixture does not
        depend on. With the refit round: ``"clients"`` keeps every client's refitted output layer
        (its reply) and predicts with their class-share mixture, each head its fit's Laplace
        posterior (:class:`~bayesfuse.nets.heads.ClientHeads`; ``ClientHeads.predictive = "map"``:
        the fits' means), instead of the product's probit (``"shared"``, default). With the
        temperature round and summaries (PFNM, NAFI): the clients' one-shot heads are among its
        candidates by default, ``"clients"`` makes them the only one, ``"shared"`` leaves them out.
    pool : {"linear", "log"}, optional
        With ``head="clients"``: how the heads are pooled, their class-share mixture
        (``"linear"``) or geometric pool (``"log"``; ``ClientHeads.pool`` may be set later). By
        default ``"log"`` for one-shot heads with summaries, ``"linear"`` otherwise.
    rounds : {1, 2, 3}
        2: one more round after the one-shot fusion, simulated with ``data=(train, partition)``;
        no example leaves a client. ``hyper["second_round"]`` says what it did and what it cost.
        For the temperature round, ``partition`` should hold examples each client kept back from
        its local training (:func:`bayesfuse.data.holdout_partition`): on the examples it was
        trained on, a client's own head looks better than it is, and the choice leans to
        over-confident candidates.
        3 (with ``second_round="batchnorm"`` only): the batch-norm round, then the refit round
        (``hyper["third_round"]``).
        ``method="fedma"`` runs its own rounds; ``rounds=2`` then adds the refit round after them
        (``second_round="refit"``): the clients fit the output layer on the FedMA network's
        features and the server multiplies their Laplace fits in place of FedMA's class-share
        average, and returns its ``LastLayerLaplace`` (``hyper["rounds"]`` counts it), or with
        ``head="clients"`` the clients' fits as heads.
    second_round : {"refit", "temperature", "batchnorm"}, optional
        What the second round does (with ``rounds=2`` or ``3``; refused with ``rounds=1``, where
        there is none). ``"refit"`` (the default): the server sends the fused network;
        each client fits its output layer on the fused features of its own data and returns the
        fit and its K-FAC curvature (:func:`bayesfuse.summaries.output_fit`); the server
        multiplies the clients' Laplace posteriors into the output layer and its covariance
        (:mod:`bayesfuse.inference.output_fusion`), and the model predicts with the probit rule
        (:class:`~bayesfuse.nets.laplace.LastLayerLaplace`). The prior precision is
        ``output_prior_precision`` if given; else the clients fit with ``1 / mean(w^2)`` of their
        own output weights, scaled by the fused layer's fan-in over theirs, and the server takes
        the precision that maximises the evidence of their replies
        (:func:`~bayesfuse.inference.output_fusion.evidence_precision`). ``"temperature"``:
        the server sends the candidate fused networks (with summaries, the shared head by each
        ``output_pool`` and, for PFNM and NAFI where the output layer reads hidden units, unless
        ``head="shared"``, the one-shot default: the clients' own heads,
        :class:`~bayesfuse.nets.heads.ClientHeads`, on the body of ``output_pool``, and where the
        heads are Kronecker-factored the same heads with each one's curvature scaled to the exact
        GGN's trace, :func:`~bayesfuse.inference.client_heads.trace_ratios`, one number more per
        client, and, where every summary has the output layer's GGN eigenvalues (version 3 or later), with
        them (EKFAC, :func:`~bayesfuse.inference.client_heads.ekfac_eigenvalues`, (G+1) K numbers
        more per client), and each its client's diagonal Laplace posterior from the summary's GGN
        diagonal (K (G+1) numbers more per client); with ``head="clients"`` those alone: they
        carry every client's output layer, its Kronecker factors and its GGN diagonal to every
        client, as the one-shot default model does the first two), each client returns its
        summed negative log-likelihood under each at each candidate temperature, on examples it
        kept back from training
        (:func:`bayesfuse.summaries.temperature_nll`), and the server keeps the best pair
        (:func:`~bayesfuse.inference.summary_fusion.best_candidate`); ``hyper["second_round"]``
        names it (``output_pool``: ``"precision"``, ``"counts"``, ``"client heads"``, ``"client
        heads, trace-matched"``, ``"client heads, EKFAC"`` or ``"client heads, diagonal"``). ``"batchnorm"``, for
        networks with batch norms: the server sends the fused network, each client returns the
        count, mean and mean square of every batch norm's input per channel over its own data
        (:func:`bayesfuse.summaries.batchnorm_moments`), and the server sets the batch norms'
        statistics to the pooled moments (:func:`~bayesfuse.inference.moments.pool_moments`):
        after fusion the batch norms are identities (folded into the layers before them), and
        averaged units shrink the activations from layer to layer; normalising them again with the
        fused network's own statistics undoes that (Jordan et al., REPAIR, ICLR 2023).
    output_prior_precision : float, optional
        The refit's prior precision ``lambda`` of the output weights, for the clients' fits and the
        product. None (default): the clients fit with ``1 / mean(w^2)`` of their own output
        weights times the fused layer's fan-in over theirs
        (:func:`~bayesfuse.inference.output_fusion.prior_precision_from_weights`), and the server
        chooses ``lambda`` for the product by the evidence of the replies
        (:func:`~bayesfuse.inference.output_fusion.evidence_precision`): no data on the server,
        nothing chosen on held-out data. ``hyper["second_round"]`` reports both.
    **hyper
        The method's hyper-parameters, by kind of input; ``None`` keeps a default. See
        :data:`bayesfuse.methods.METHODS` (``print(bayesfuse.methods.describe())``): e.g.
        ``noise_var``, ``prior_var``, ``gamma0``, ``kl_weight``, ``cost``, ``n_iter``,
        ``direction`` for PFNM/NAFI; ``reg``, ``solver``, ``n_iter``, ``average_outputs`` for
        KL-fusion.

    Warns
    -----
    ConvergenceWarning
        Once, naming the layers whose matching stopped at ``n_iter`` before it converged.
    """
    start = time.perf_counter()
    verbose = progress(verbose)
    _check_modules(models)
    if len(models) == 0:
        raise ValueError("fuse needs at least one model")
    if class_counts is not None:
        counts = np.asarray(class_counts, dtype=np.float64)
        if np.isfinite(counts).all() and not np.array_equal(counts, np.round(counts)):
            raise ValueError(
                "class_counts must be whole numbers of examples per client and class, not shares or "
                "weights (the heads are smoothed by them: shares would read as clients of one example)"
            )
    method = methods.canonical(method)
    methods.check_keys(method, hyper, caller=fuse)
    if second_round is not None and rounds == 1:
        raise ValueError(
            f"second_round={second_round!r} is what a second round does: give rounds=2 (or rounds=3 with "
            "second_round='batchnorm')"
        )
    second_round = second_round or "refit"
    if output_prior_precision is not None:
        from bayesfuse.inference.output_fusion import checked_prior_precision

        checked_prior_precision(output_prior_precision)
        if not (rounds == 2 and second_round == "refit" or rounds == 3):
            raise ValueError(
                "output_prior_precision is the refit round's prior: give rounds=2 (second_round='refit') or rounds=3"
            )
    row = methods.METHODS.get(method)  # an unknown method is fuse_states' to refuse
    if retrain is not None and not (row is not None and row.needs_data):
        using = " and ".join(f"method={n!r}" for n in methods.names(needs_data=True))
        raise ValueError(f"retrain= is the local training of {using} between layers; method={method!r} trains nothing")
    if pseudo_count is not None:
        from bayesfuse.nets.heads import checked_pseudo_count

        pseudo_count = checked_pseudo_count(pseudo_count)
        if head == "shared" or rounds == 2 and second_round == "temperature":
            raise ValueError(
                "pseudo_count smooths the clients' own heads (head='clients', the default with summaries in one "
                "shot, or the refit round's); "
                + (
                    "head='shared' keeps one output layer"
                    if head == "shared"
                    else "the temperature round chooses among heads at their smoothing: set model.pseudo_count after"
                )
            )
    methods.check_execution(method, None, device)  # a method that cannot use a device, or a device this
    check_device(device, dtype)  # machine lacks: refused before anything is trained or converted
    _check_data(data, len(models))
    order = canonical_order(models)  # any order of the same models gives the same fusion (client_order)
    models, class_counts, summaries, data, hyper = to_canonical(order, models, class_counts, summaries, data, hyper)
    template = models[0]  # the caller's architecture, nn.MultiheadAttention included
    if any(multihead_modules(m) for m in models):  # fused as HeadAttention, whose heads can change width
        check_example_runs(template, example_input)  # the caller's network runs, before it is rewritten
        models = [split_heads(m) for m in models]
    if row is not None and row.needs_data:
        if rounds not in (1, 2) or isinstance(rounds, bool) or second_round != "refit":
            raise ValueError(
                f"method={method!r} runs its own rounds (one per layer, passes=P for more); rounds=2 adds one "
                "more, the refit round of the output layer (second_round='refit'), and nothing else is offered"
            )
        if head not in (None, "shared") and not (head == "clients" and rounds == 2):
            raise ValueError(
                f"head={head!r} is for one-shot pfnm and nafi, their temperature round, and the refit round of "
                f"pfnm, nafi, ot, fedavg and fedma (rounds=2); {method} without it has one head"
            )
        if pool is not None and (pool not in ("linear", "log") or head != "clients"):
            raise ValueError(f"pool={pool!r}: the clients' heads are pooled 'linear' or 'log', with head='clients'")
        result = _fuse_fedma(
            models,
            data,
            retrain,
            class_counts=class_counts,
            spec=spec,
            seed=seed,
            verbose=verbose,
            start=start,
            refit=rounds == 2,
            head=head or "shared",
            pool=pool,
            output_prior_precision=output_prior_precision,
            example_input=example_input,
            **hyper,
        )
        return to_callers(_with_multihead(result, template), order)
    if rounds not in (1, 2, 3) or isinstance(rounds, bool):
        raise ValueError(f"rounds must be 1 (one shot), 2 or 3 (more rounds on the clients' data), got {rounds!r}")
    if rounds > 1 and data is None:
        raise ValueError(f"rounds={rounds} simulates rounds on the clients' own data: pass data=(train, partition)")
    if rounds == 3 and second_round != "batchnorm":
        raise ValueError("rounds=3 is the batch-norm round then the refit round: give second_round='batchnorm'")
    if data is not None and rounds == 1:
        using = " and ".join(f"method={n!r}" for n in methods.names(needs_data=True))
        raise ValueError(f"method={method!r} fuses the models alone; data is used by {using} only, or with rounds=2")
    bnn = [_is_bnn(m) for m in models]
    if any(bnn) and not all(bnn):
        raise TypeError("cannot fuse Bayesian and point-estimate networks together")
    explicit_head = head == "clients"
    auto_heads = False  # the clients' heads by default (networks, one shot, with summaries)
    tempers = heads_candidate = False  # the temperature round with summaries; its heads candidate
    if any(bnn):
        if head is not None:  # a BNN's heads are the method's hyper-parameter (bayesfuse.core.fuse_states)
            hyper["head"] = head
        head = "shared"
    else:  # networks: the clients' own heads (one shot) or the refit round's
        # with summaries, one shot, the clients' own heads are the default where the method allows them
        auto_heads = head is None and summaries is not None and rounds == 1 and method in ONE_SHOT_HEADS
        refits = rounds == 2 and second_round == "refit" or rounds == 3
        tempers = rounds == 2 and second_round == "temperature" and summaries is not None
        # with summaries the temperature round scores the one-shot heads too, where the method keeps them
        heads_candidate = tempers and method in ONE_SHOT_HEADS and head in (None, "clients")
        head = (
            ("clients" if auto_heads or heads_candidate else "shared") if head is None else head
        )  # resolved once fused
        if head not in ("shared", "clients") or head == "clients" and not (refits or rounds == 1 or tempers):
            raise ValueError(
                f"head={head!r}: point-estimate networks keep the clients' heads in one shot (rounds=1), "
                "from the refit round (rounds=2, second_round='refit'; or rounds=3), or, with summaries, "
                "from the temperature round (rounds=2, second_round='temperature')"
            )
        if pool is not None and (pool not in ("linear", "log") or head != "clients"):
            raise ValueError(f"pool={pool!r}: the clients' heads are pooled 'linear' or 'log', with head='clients'")
        if head == "clients" and (rounds == 1 or tempers) and method not in ONE_SHOT_HEADS:
            raise ValueError(
                f"head='clients' in one shot (and in the temperature round) reads each client's output layer "
                "through the matching's "
                f"assignments: method must be one of {', '.join(ONE_SHOT_HEADS)}, got {method!r}"
            )
    if second_round not in ("refit", "temperature", "batchnorm"):
        raise ValueError(f"second_round must be 'refit', 'temperature' or 'batchnorm', got {second_round!r}")
    if rounds > 1 and any(bnn):
        raise ValueError(f"rounds={rounds} is for point-estimate networks; fused BNNs carry their own posterior")
    if not any(bnn) and (spec is None or row is None or row.aligns_units):
        try:
            spec = spec_with_encodings(models[0], spec, example_input)  # position encodings (PANs) are folded out
        except (UnsupportedLayerError, ValueError) as err:
            # FedAvg needs no units: a network the tracer cannot follow is averaged as it is; not a
            # given example input that does not run (the user's error), nor anything but FedAvg
            as_is = row is not None and not row.aligns_units and spec is None and rounds == 1
            if (
                not (as_is and untraceable(err, models[0], example_input))
                or head == "clients"
                or summaries is not None
                or template is not models[0]
            ):
                raise
            return to_callers(
                _averaged_as_is(models, class_counts, method, first_line(err), start, example_input), order
            )
    states = [numpy_state(m) for m in models]
    # the temperature round with summaries scores both output pools (with head="clients": the heads alone)
    pools = ["precision", "counts"] if tempers and not (heads_candidate and explicit_head) else [output_pool]
    candidates = []
    for logit_pool in pools:
        fused = fuse_states(
            states,
            method,
            spec=spec,
            class_counts=class_counts,
            seed=seed,
            verbose=verbose,
            names=[f"client {j}" for j in order],
            device=device,
            dtype=dtype,
            summaries=summaries,
            output_pool=logit_pool,
            **hyper,
        )
        candidates.append((fused, _fused_model(models[0], fused, all(bnn))))
        if not any(bnn):
            _check_fused_runs(candidates[-1][1], models[0], example_input)
    if rounds == 1:
        fused, model = candidates[0]
        if not (auto_heads and _heads_refused([fused], pool)) and head == "clients":
            model = _own_heads(fused, model, states, class_counts, summaries, pool)
    elif second_round == "batchnorm":
        fused, model = _batchnorm_round(*candidates[0], data, states)
        if rounds == 3:
            fused, model = _refit_round(
                fused,
                model,
                models,
                data,
                prior_precision=output_prior_precision,
                key="third_round",
                head=head,
                pool=pool,
            )
    elif second_round == "refit":
        fused, model = _refit_round(
            *candidates[0], models, data, prior_precision=output_prior_precision, head=head, pool=pool
        )
    else:
        from bayesfuse.nets.heads import ClientHeads

        labels = list(pools)
        if heads_candidate:  # the one-shot default: the clients' heads on the body of output_pool
            body, network = candidates[pools.index(output_pool)]
            if explicit_head and (refused := heads_refused(body.spec, body.state)):
                raise ValueError(f"head='clients': {refused}")
            if not _heads_refused([fused for fused, _ in candidates], pool):
                own = replace(body, hyper=dict(body.hyper))
                heads = _own_heads(own, network, states, class_counts, summaries, pool)
                if explicit_head:  # head="clients": the heads are the only candidates
                    candidates, labels = [], []
                candidates.append((own, heads))
                labels.append("client heads")
                if isinstance(heads, ClientHeads) and heads.form == "kronecker":
                    # and the same heads, each one's curvature at the exact trace, and, where the
                    # summaries measured them, with the exact GGN's eigenvalues, and each the
                    # diagonal posterior of its summary's GGN diagonal
                    assignments = {g: layer.assignments for g, layer in zip(own.groups, own.layers)}
                    width = int(heads.weight.shape[2])
                    ratios, eigenvalues, diagonal = kronecker_variants(
                        cast(PermutationSpec, own.spec), states, assignments, width, summaries
                    )
                    kronecker = own.hyper["predictive"]
                    variants = [
                        (
                            "client heads, trace-matched",
                            heads.with_scale(ratios),
                            kronecker[:-1] + f", {TRACE_MATCHED})",
                        )
                    ]
                    if eigenvalues is not None:
                        variants.append(
                            ("client heads, EKFAC", heads.with_eigenvalues(eigenvalues), kronecker[:-1] + f", {EKFAC})")
                        )
                    variants.append(
                        (
                            "client heads, diagonal",
                            heads.with_diagonal(diagonal),
                            kronecker.replace("Kronecker-factored", "diagonal"),
                        )
                    )
                    for label, variant, predictive in variants:
                        fused_variant = replace(own, hyper=dict(own.hyper))
                        fused_variant.hyper["predictive"] = predictive
                        candidates.append((fused_variant, variant))
                        labels.append(label)
        fused, model = _second_round(candidates, data, labels, like=models[0])
    if pseudo_count is not None:
        _smoothed(model, fused.hyper, pseudo_count)
    result = FusionResult(
        model=model,
        layers=fused.layers,
        sizes=fused.sizes,
        method=method,
        hyper=fused.hyper,
        seconds=time.perf_counter() - start,
        groups=fused.groups if not all(bnn) else (),
        posteriors=fused.posteriors,
        example_input=_kept_input(example_input),
    )
    return to_callers(_with_multihead(result, template), order)


def _kept_input(example_input):
    """The first two rows of a tensor ``example_input``, detached, on the CPU; else None."""
    return example_input[:2].detach().cpu() if isinstance(example_input, torch.Tensor) else None


def _smoothed(model: nn.Module, hyper: dict, pseudo_count: float) -> None:
    """The clients' heads of ``model`` smoothed by ``pseudo_count``, and the report's predictive
    saying so; refused in one line where the fusion kept one output layer."""
    from bayesfuse.nets.heads import ClientHeads

    if not isinstance(model, ClientHeads):
        why = hyper.get("head", "one output layer")
        raise ValueError(
            f"pseudo_count smooths the clients' own heads; this fusion kept one shared output layer ({why}): "
            "fuse with client summaries, or head='clients'"
        )
    before = _smoothing(model)
    model.pseudo_count = pseudo_count
    if "predictive" in hyper and before:
        hyper["predictive"] = hyper["predictive"].replace(before, _smoothing(model))
    hyper["pseudo_count"] = pseudo_count


def _check_data(data, n_models: int) -> None:
    """Refuse, in the caller's order of the clients, ``data`` that is not ``(train, partition)``
    with one client of examples per model."""
    if data is None:
        return
    if not (isinstance(data, tuple) and len(data) == 2):
        raise ValueError(f"data must be (train, partition), got a {type(data).__name__}")
    parts = [np.asarray(p) for p in data[1]]
    if len(parts) != n_models:
        raise ValueError(f"{n_models} models but {len(parts)} clients in the partition: give one client per model")
    empty = [j for j, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(f"clients {empty} hold no examples (the models' order); each client needs its own data")
    n = len(data[0].y) if hasattr(data[0], "y") else None
    for j, p in enumerate(parts):
        if n is not None and (not np.issubdtype(p.dtype, np.integer) or p.min() < 0 or p.max() >= n):
            raise ValueError(
                f"client {j}'s examples are not indices into the {n} examples of data[0] (range "
                f"{p.min()}..{p.max()}): the partition indexes the training set it was made from"
            )


def _with_multihead(result: FusionResult, template: nn.Module) -> FusionResult:
    """``result`` of networks whose ``nn.MultiheadAttention`` were split into heads to be fused
    (:func:`~bayesfuse.nets.attention.split_heads`): its model with ``nn.MultiheadAttention``
    again where the fused heads allow (:func:`~bayesfuse.nets.attention.merge_heads`), and
    ``hyper["attention"]`` saying which."""
    if not multihead_modules(template):
        return result
    if type(result.model) is not type(template):
        result.hyper["attention"] = f"{SPLIT_NOTE}; kept as HeadAttention in {type(result.model).__name__}"
        return result
    result.model, why = merged_where_possible(result.model, template)
    result.hyper["attention"] = (
        f"{SPLIT_NOTE}, then merged back (the fused heads have its widths)"
        if why is None
        else f"{SPLIT_NOTE}; kept as HeadAttention, which computes the same function ({why})"
    )
    return result


#: Candidate temperatures of the second round: 2^(k/8) for k = -32..32, from 1/16 to 16, 1 among them.
TEMPERATURES = 2.0 ** (np.arange(-32, 33) / 8.0)


def _last_layer_posterior(model: nn.Module, fused) -> nn.Module:
    """The fused network with its output layer's Laplace posterior
    (:class:`~bayesfuse.nets.laplace.LastLayerLaplace`)."""
    from bayesfuse.nets.laplace import LastLayerLaplace

    weight, bias = fused.spec.output_layer(fused.state)
    return LastLayerLaplace(
        model, weight.rpartition(".")[0], 1.0 / fused.precision[weight], 1.0 / fused.precision[bias]
    ).eval()


def _check_fused_runs(model: nn.Module, like: nn.Module, example_input) -> None:
    """Run the fused network once, so that none is returned that cannot run (:func:`check_runs`)."""
    from bayesfuse.nets.graph_spec import example_input_for

    try:
        x = example_input_for(like, example_input)
    except ValueError:  # no input to be had: the known architectures, rebuilt by rebuild(), run
        return
    check_runs(model, x)  # a stacked LSTM of layers fused to different widths is refused by rebuild


def _averaged_as_is(models, class_counts, method: str, why: str, start: float, example_input=None) -> FusionResult:
    """One-shot FedAvg of networks whose units cannot be traced: every entry averaged as it is
    (:func:`~bayesfuse.baselines.fedavg`), weighted by the clients' examples when their class
    counts are given; ``hyper["spec"]`` says why no spec was traced."""
    from bayesfuse.baselines import fedavg
    from bayesfuse.inference.layerwise import class_share_matrix

    weights = None
    if class_counts is not None:
        counts = np.asarray(class_counts, dtype=np.float64)
        classes = _output_width(models[0], example_input)
        class_share_matrix(counts, len(models), classes if classes is not None else int(np.shape(counts)[-1]))
        weights = counts.sum(1)
    warn_from_caller(f"{method}: no units traced ({why}); every entry averaged as it is")
    model = fedavg(models, weights)
    hyper = {
        "weights": "class_counts" if weights is not None else "uniform",
        "spec": f"none, every entry averaged as it is (not traced: {why})",
    }
    return FusionResult(
        model=model.eval(), layers=[], sizes=[], method=method, hyper=hyper, seconds=time.perf_counter() - start
    )


def _output_width(model: nn.Module, example_input=None) -> int | None:
    """The width of ``model``'s output on its own or a guessed example input, or None where it
    does not run on one (the class counts' width is then not checked)."""
    from bayesfuse.nets.graph_spec import example_input_for

    try:
        x = example_input_for(model, example_input)
    except ValueError:
        return None
    out, _ = run_once(model, x)
    return int(out.shape[-1]) if isinstance(out, torch.Tensor) and out.dim() >= 1 else None


def _fused_model(like: nn.Module, fused, bnn: bool) -> nn.Module:
    """The module of a fused state: a BNN, the network, or with precisions its last-layer posterior."""
    if bnn:
        from bayesfuse.models.bnn_heads import bnn_from_state

        return bnn_from_state(fused.state)
    model = rebuild(like, {k: torch.as_tensor(v) for k, v in fused.state.items()}, fused.spec).eval()
    if fused.precision is not None:
        model = _last_layer_posterior(model, fused)
        fused.hyper["predictive"] = "probit, last-layer Laplace (LastLayerLaplace)"
    return model


def _second_round(candidates, data, labels, *, like: nn.Module):
    """The second round, simulated: every client scores each candidate's predictive at each
    temperature on its own data; the server keeps the best pair (the temperature folded into the
    output layer of a plain network, the ``temperature`` of a :class:`~bayesfuse.nets.laplace.LastLayerLaplace`
    or of the clients' heads, :class:`~bayesfuse.nets.heads.ClientHeads`). ``labels`` name the
    candidates in the report (their output pools, or ``"client heads"``, ``"client heads,
    trace-matched"``, ``"client heads, EKFAC"`` and ``"client heads, diagonal"``)."""
    from bayesfuse.inference.summary_fusion import best_candidate, fold_temperature
    from bayesfuse.nets.heads import ClientHeads
    from bayesfuse.nets.laplace import LastLayerLaplace
    from bayesfuse.summaries import temperature_nll

    train, partition = data
    start = time.perf_counter()
    # (J, C, T): client j's summed NLL of candidate c at temperature t
    nll = np.stack(
        [
            np.stack([temperature_nll(m, train.x[idx], train.y[idx], TEMPERATURES) for _, m in candidates])
            for idx in partition
        ]
    )
    choice, t = best_candidate(nll)
    temperature = float(TEMPERATURES[t])
    sent = _numbers_sent([m for _, m in candidates])
    fused, model = candidates[choice]
    if isinstance(model, (LastLayerLaplace, ClientHeads)):
        model.temperature.fill_(temperature)
    else:
        fused.state = fold_temperature(fused.state, fused.spec, temperature)
        model = rebuild(like, {k: torch.as_tensor(v) for k, v in fused.state.items()}, fused.spec).eval()
    fused.hyper["second_round"] = {
        "kind": "temperature",
        "temperature": temperature,
        "output_pool": labels[choice],
        "candidates": int(nll[0].size),
        "at_edge": bool(temperature in (TEMPERATURES[0], TEMPERATURES[-1])),
        "nll": {p: float(nll[:, c].sum(0).min()) for c, p in enumerate(labels)},
        "bytes_up": int(nll.size * 8),
        "bytes_down": int(len(nll) * sent * 4),
        "seconds": time.perf_counter() - start,
    }
    return fused, model


def _numbers_sent(models: Sequence[nn.Module]) -> int:
    """How many numbers the server sends each client in the temperature round: every candidate's
    tensors, its posterior's (variances, heads and their factors) included, an entry two
    candidates share (the same name and values: a body, the heads' weights and factors) once, and
    not the heads' fixed draws, which a client makes itself (the same seed)."""
    seen: set[tuple] = set()
    total = 0
    for model in models:
        for key, tensor in model.state_dict().items():
            values = tensor.detach().cpu().contiguous()
            same = (key, str(values.dtype), tuple(values.shape), hashlib.sha256(as_array(values).tobytes()).hexdigest())
            if key == "draws" or same in seen:
                continue
            seen.add(same)
            total += tensor.numel()
    return total


def _batchnorm_round(fused, model: nn.Module, data, states):
    """The batch-norm round, simulated. The server gives each fused channel the mean scale and
    shift of its members in ``states`` (the clients' own batch norms, REPAIR's targets;
    :func:`~bayesfuse.inference.moments.matched_mean`) and sends the network; every client
    measures the moments of each batch norm's input in it on its own data
    (:func:`bayesfuse.summaries.batchnorm_moments`), so that a layer's statistics are those of the
    layers below as the network will run; the server pools them
    (:func:`~bayesfuse.inference.moments.pool_moments`) into the running statistics. Both in the
    module and in ``fused.state``."""
    from bayesfuse.inference.moments import matched_mean, pool_moments
    from bayesfuse.nets.laplace import LastLayerLaplace
    from bayesfuse.summaries import batchnorm_moments

    train, partition = data
    start = time.perf_counter()
    network = model.network if isinstance(model, LastLayerLaplace) else model
    norms = {n: m for n, m in network.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    if not norms:
        raise ValueError("second_round='batchnorm' re-estimates batch norms; the fused network has none")
    layers = dict(zip(fused.groups, fused.layers))

    def write(name: str, values: dict) -> None:
        norm = norms[name]
        with torch.no_grad():
            for entry, value in values.items():
                getattr(norm, entry).copy_(torch.as_tensor(value, dtype=getattr(norm, entry).dtype))
                key = f"{name}.{entry}"
                fused.state[key] = value.astype(np.asarray(fused.state[key]).dtype)

    spec = fused.spec
    pieces, clients = spec.split(fused.state), [spec.split(sd) for sd in states]  # a norm of streams side by side

    def members_mean(key: str, default: float) -> np.ndarray:
        """The mean of the members of each fused channel of entry ``key``, piece by piece."""
        out = []
        for piece in spec.parts(key):
            axis = spec.axes[piece][0]
            group = axis.group if axis is not None else None  # a norm of the input's channels: no group
            assignments = layers[group].assignments if group in layers else None
            outer, inner = (axis.outer, axis.inner) if axis is not None else (1, 1)
            # a group's units in blocks (a stream read twice side by side, cut into heads): each block alike
            values = [np.asarray(sd[piece], dtype=np.float64).reshape(outer, -1, inner) for sd in clients]
            n = len(pieces[piece]) // (outer * inner)
            means = [
                [matched_mean([v[o, :, i] for v in values], assignments, n, default) for i in range(inner)]
                for o in range(outer)
            ]
            out.append(np.asarray(means).transpose(0, 2, 1).reshape(-1))
        return np.concatenate(out)

    for name, norm in norms.items():  # the members' scale and shift, in the global basis
        if norm.affine:
            write(
                name,
                {
                    param: members_mean(f"{name}.{param}", default)
                    for param, default in (("weight", 1.0), ("bias", 0.0))
                },
            )
    client_seconds = time.perf_counter()
    replies = [batchnorm_moments(network, train.x[idx]) for idx in partition]
    client_seconds = (time.perf_counter() - client_seconds) / len(partition)
    pooled = pool_moments(replies)
    for name, (mean, var) in pooled.items():
        write(name, {"running_mean": mean, "running_var": var})
    n_weights = sum(np.size(v) for v in fused.state.values())
    fused.hyper["second_round"] = {
        "kind": "batchnorm",
        "batch_norms": len(pooled),
        "statistics": "pooled moments of the clients' data in the fused network, with the scales and shifts set",
        "affine": "the members' mean scale and shift (REPAIR's targets)",
        "bytes_up": int(sum(8 + 2 * 4 * mean.size for mean, _ in pooled.values())),
        "bytes_down": int(n_weights * 4),
        "client_seconds": client_seconds,
        "seconds": time.perf_counter() - start,
    }
    return fused, model


ONE_SHOT_HEADS = methods.ONE_SHOT_HEADS  # the table's (methods.Method.own_heads)


def _heads_refused(candidates: Sequence, pool: str | None) -> str | None:
    """Why the clients' heads cannot be kept on the fused networks ``candidates`` (one spec), or
    None: where they cannot, each says so in ``hyper["head"]`` (the shared head, and why) and a
    ``pool`` asked for is refused."""
    refused = heads_refused(candidates[0].spec, candidates[0].state)
    if refused and pool is not None:
        raise ValueError(f"pool={pool!r} is for the clients' own heads, and {refused}")
    for fused in candidates if refused else ():
        fused.hyper["head"] = f"shared ({refused})"
    return refused


#: How the report names the trace-matched heads' posterior (:func:`~bayesfuse.inference.client_heads.trace_ratios`).
TRACE_MATCHED = "its curvature scaled to the exact GGN's trace"
#: ... and the EKFAC heads' (:func:`~bayesfuse.inference.client_heads.ekfac_eigenvalues`).
EKFAC = "its curvature's eigenvalues the exact GGN's in the Kronecker eigenbasis (EKFAC)"


def _own_heads(fused, model: nn.Module, states, class_counts, summaries=None, pool: str | None = None) -> nn.Module:
    """The one-shot fusion ``fused`` (its ``model``) with every client's own output layer kept as a
    head on the fused features (:meth:`~bayesfuse.nets.heads.ClientHeads.from_clients`)."""
    from bayesfuse.nets.heads import ClientHeads
    from bayesfuse.nets.laplace import LastLayerLaplace

    network = model.network if isinstance(model, LastLayerLaplace) else model
    assignments = {g: layer.assignments for g, layer in zip(fused.groups, fused.layers)}
    pool = pool or default_pool(summaries)
    heads = ClientHeads.from_clients(network, fused.spec, states, assignments, class_counts, summaries, pool=pool)
    form = {"kronecker": "Kronecker-factored", "diagonal": "diagonal"}.get(heads.form)
    fused.hyper["predictive"] = (
        f"class-share {_pooled(heads)} of the clients' own output layers on the fused features (ClientHeads, one shot"
        + (f", each its client's {form} Laplace posterior" if form else "")
        + _smoothing(heads)
        + ")"
    )
    fused.hyper["head"] = "clients"
    fused.hyper["pool"] = pool
    return heads


def _pooled(heads) -> str:
    """How :class:`~bayesfuse.nets.heads.ClientHeads` pool their heads, in words for a report."""
    return "geometric pool" if heads.pool == "log" else "mixture"


def _smoothing(heads) -> str:
    """``", smoothed by ..."`` where the heads smooth their predictive by their examples, else ``""``."""
    if not hasattr(heads, "examples") or heads.pseudo_count == 0:
        return ""
    return f", smoothed by its client's examples, pseudo-count {heads.pseudo_count:g} per class"


def _refit_round(
    fused,
    model: nn.Module,
    models: Sequence[nn.Module],
    data,
    *,
    prior_precision=None,
    key: str = "second_round",
    head: str = "shared",
    pool: str | None = None,
):
    """The second round that refits the output layer, simulated: every client fits it on the fused
    network's features of its own data (:func:`bayesfuse.summaries.output_fit`); the server
    multiplies the fits (:func:`~bayesfuse.inference.output_fusion.output_posterior`) into a
    :class:`~bayesfuse.nets.laplace.LastLayerLaplace` with the fused output layer's covariance,
    or with ``head="clients"`` keeps them as the heads of a :class:`~bayesfuse.nets.heads.ClientHeads`
    (the fused network's own output layer still holds the product's mean)."""
    from bayesfuse.inference.output_fusion import output_posterior, prior_precision_from_weights, product_report
    from bayesfuse.nets.laplace import LastLayerLaplace
    from bayesfuse.summaries import output_fit

    train, partition = data
    start = time.perf_counter()
    network = model.network if isinstance(model, LastLayerLaplace) else model
    output = fused.spec.output_layer(fused.state)[0].rpartition(".")[0]
    by_evidence = prior_precision is None
    if by_evidence:
        prior_precision = prior_precision_from_weights(
            [as_array(cast(nn.Linear, m.get_submodule(output)).weight) for m in models],
            fan_in=cast(nn.Linear, network.get_submodule(output)).weight.shape[1],
        )
    client_seconds = time.perf_counter()
    fits = [
        output_fit(network, output, train.x[idx], train.y[idx], prior_precision, n_clients=len(partition))
        for idx in partition
    ]
    client_seconds = (time.perf_counter() - client_seconds) / len(partition)
    mean, covariance, chosen = output_posterior(fits, prior_precision, by_evidence=by_evidence)
    layer = cast(nn.Linear, network.get_submodule(output))
    with torch.no_grad():
        layer.weight.copy_(torch.as_tensor(mean[:-1].T, dtype=layer.weight.dtype))
        layer.bias.copy_(torch.as_tensor(mean[-1], dtype=layer.bias.dtype))
    fused.state[output + ".weight"] = mean[:-1].T.astype(fused.state[output + ".weight"].dtype)
    fused.state[output + ".bias"] = mean[-1].astype(fused.state[output + ".bias"].dtype)
    if head == "clients":
        from bayesfuse.nets.heads import ClientHeads

        K = cast(nn.Linear, network.get_submodule(output)).out_features
        counts = np.stack([np.bincount(np.asarray(train.y)[idx], minlength=K) for idx in partition])
        model = ClientHeads.from_fits(
            network, output, fits, counts, pool=pool or "linear", prior_precision=prior_precision / len(partition)
        )
        fused.hyper["predictive"] = (
            f"class-share {_pooled(model)} of the clients' refitted output layers, each its fit's Laplace "
            f"posterior{_smoothing(model)} (ClientHeads)"
        )
    else:
        model = LastLayerLaplace(network, output, covariance=covariance).eval()
        fused.hyper["predictive"] = (
            "probit of the centred logits, last-layer Laplace (LastLayerLaplace, joint covariance)"
            if model.joint
            else "probit, last-layer Laplace (LastLayerLaplace, per-class covariance)"
        )
    n_weights = sum(np.size(v) for v in fused.state.values())
    fused.hyper[key] = {
        "kind": "refit",
        "output_layer": "product of the clients' Laplace fits on the fused features (K-FAC)"
        + ("; the fits themselves predict, as heads" if head == "clients" else ""),
        "prior_precision": float(chosen),
        "fit_prior_precision": float(prior_precision),
        **product_report(mean.shape, by_evidence),
        "bytes_up": int(fits[0].nbytes),
        "bytes_down": int(n_weights * 4),
        "client_seconds": client_seconds,
        "seconds": time.perf_counter() - start,
    }
    return fused, model


def _fuse_fedma(
    models,
    data,
    retrain,
    *,
    class_counts,
    spec,
    seed,
    verbose,
    start,
    refit: bool = False,
    head: str = "shared",
    pool: str | None = None,
    output_prior_precision: float | None = None,
    example_input=None,
    **hyper,
) -> FusionResult:
    """FedMA on the clients' data; with ``refit``, one more round refits its output layer
    (:func:`_refit_round`): every client fits it on the FedMA body's features of its own data and
    the server multiplies the fits in place of FedMA's class-share average (FedMA Alg. 1, last line);
    ``head="clients"`` keeps the fits as heads."""
    from types import SimpleNamespace

    from bayesfuse.federated import run_fedma

    if data is None:
        raise ValueError(
            "method='fedma' retrains the clients between layers: pass data=(train, partition) with "
            "each client's training data"
        )
    train, partition = data
    if class_counts is not None:
        raise ValueError("method='fedma' takes the class counts from data; do not pass class_counts")
    methods.resolve("fedma", "network", hyper)  # unknown keys and bad values fail before any training
    spec = spec_with_encodings(models[0], spec, example_input)
    head_orders = None
    if spec.heads:  # attention heads: aligned once, before the first group is matched
        models, head_orders = _aligned_heads(models, spec)
    run = run_fedma(models, train, partition, retrain, method=None, spec=spec, seed=seed or 0, verbose=verbose, **hyper)
    r = run.result
    layers = [r.layers[g] for g in run.spec.groups]
    hyper = {
        **r.hyper,
        "passes": len(run.passes),
        "rounds": run.rounds,
        "bytes_up": run.bytes_up,
        "bytes_down": run.bytes_down,
        **({"head_orders": head_orders} if head_orders is not None else {}),
    }
    model: nn.Module = run.model
    _check_fused_runs(model, models[0], example_input)
    if refit:  # the run's spec and state: the output layer is found without tracing the network again
        fused = SimpleNamespace(spec=run.spec, state=dict(r.state_dict), hyper=hyper)
        _, model = _refit_round(
            fused, run.model, models, data, prior_precision=output_prior_precision, head=head, pool=pool
        )
        hyper["rounds"] += 1
        hyper["bytes_up"] += hyper["second_round"]["bytes_up"] * len(partition)
        hyper["bytes_down"] += hyper["second_round"]["bytes_down"] * len(partition)
    return FusionResult(
        model=model,
        layers=layers,
        sizes=run.sizes,
        method="fedma",
        hyper=hyper,
        seconds=time.perf_counter() - start,
        groups=tuple(run.spec.groups),
        posteriors=[(layer.mean, layer.var) for layer in layers],
        example_input=_kept_input(example_input),
    )


def _aligned_heads(models, spec: PermutationSpec) -> tuple[list[nn.Module], list[dict]]:
    """Copies of ``models`` with their attention heads in the order that aligns them
    (:func:`~bayesfuse.inference.heads.align_heads`), and each client's orders for the report."""
    from bayesfuse.inference.heads import align_heads, orders_report, rename_heads

    states = [numpy_state(m) for m in models]
    orders = align_heads(states, spec)
    aligned = []
    for m, sd, o in zip(models, states, orders):
        renamed = rename_heads(sd, spec, o)
        aligned.append(rebuild(m, {k: torch.as_tensor(v) for k, v in renamed.items()}))
    return aligned, orders_report(spec, orders)
