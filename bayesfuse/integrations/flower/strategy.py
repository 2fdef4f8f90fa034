""":class:`MatchedAveraging`, and what both strategies share: the reading of replies and the
refit round (:mod:`bayesfuse.integrations.flower`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, Callable, Iterable, Iterator, Mapping, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from torch import nn

from bayesfuse import methods
from bayesfuse.core import StateFusion, fuse_states
from bayesfuse.inference.client_heads import default_pool, heads_refused, kronecker_variants, one_shot_heads
from bayesfuse.inference.output_fusion import (
    checked_prior_precision,
    output_posterior,
    prior_precision_from_weights,
    product_report,
)
from bayesfuse.inference.spec import PermutationSpec
from bayesfuse.inference.spec_io import spec_for_state_dict_or_advice as strategy_spec
from bayesfuse.integrations.flower.records import (
    CLIENT_HEADS,
    COUNTS_ARRAYS_KEY,
    COUNTS_POSTERIOR_KEY,
    DIAGONAL_HEADS,
    EKFAC_HEADS,
    HEADS_KEY,
    OUTPUT_FIT,
    OUTPUT_FIT_KEY,
    OUTPUT_FIT_META_KEY,
    ROUND_KEY,
    SHARED,
    SHARED_COUNTS,
    SHARED_POSTERIOR_KEY,
    SUMMARY_KEY,
    SUMMARY_META_KEY,
    TEMPERATURE,
    TEMPERATURE_NLL_KEY,
    TRACE_MATCHED,
    _metric_record,
    heads_to_record,
    record_to_state,
    records_to_output_fit,
    records_to_summary,
    state_digest,
    state_to_record,
    temperature_candidates,
)
from bayesfuse.models.bnn_posterior import BNNPosterior
from bayesfuse.models.bnn_sites import is_bnn_state
from bayesfuse.nets.arch import rebuild
from bayesfuse.nets.heads import ClientHeads, checked_pseudo_count, unsmoothable
from bayesfuse.nets.laplace import LastLayerLaplace
from bayesfuse.nets.state import tensor_state
from bayesfuse.nets.tracing import spec_from_module
from bayesfuse.summaries import (
    ClientSummary,
    SummaryError,
    check_summary,
)


def _posterior_record(fusion: StateFusion, weight_key: str, bias_key: str) -> ArrayRecord:
    """A fusion's output layer's posterior variances (``weight_var``, ``bias_var``; float64), as
    the temperature round sends them."""
    precision = cast(dict, fusion.precision)
    variances = {"weight_var": 1.0 / precision[weight_key], "bias_var": 1.0 / precision[bias_key]}
    return ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v, dtype=np.float64)) for k, v in variances.items()})


@dataclass
class _Reply:
    node: int
    state: dict
    num_examples: float
    class_counts: np.ndarray | None
    summary: ClientSummary | None = None


def initial_spec(spec: PermutationSpec | None, state: Mapping) -> PermutationSpec:
    """The spec of the strategy's ``initial_arrays`` (``state``): the strategy's own, which they
    must fit, or read off their names (refused where a skip connection is possible), in one line
    naming ``initial_arrays``, before any node trains."""
    if spec is None:
        return strategy_spec(state, "initial_arrays")
    spec.check(state, "initial_arrays (the network the strategy was given as spec= or like=)")
    return spec


def _chosen_spec(spec: PermutationSpec | None, like: nn.Module | None, example_input: Any) -> PermutationSpec | None:
    """The strategy's spec: ``spec``, else traced from ``like`` (never both), else None."""
    if like is None:
        if example_input is not None:
            raise ValueError("example_input= is for tracing like=model; give the network too, or leave it out")
        return spec
    if spec is not None:
        raise ValueError("give the clients' architecture once: spec= or like=, not both")
    if not isinstance(like, nn.Module):
        raise TypeError(f"like= takes the clients' network (a torch.nn.Module), got {type(like).__name__}")
    return spec_from_module(like, example_input)


class _Fusion(FedAvg):
    """What both strategies share: reading, checking and ordering the clients' replies."""

    kind = "network"

    def __init__(
        self,
        *,
        spec: PermutationSpec | None = None,
        like: nn.Module | None = None,
        example_input: Any = None,
        class_counts_key: str = "class-counts",
        seed: int = 0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.spec = _chosen_spec(spec, like, example_input)
        self.class_counts_key = class_counts_key
        self.seed = seed
        self.rejected: list[tuple[int, str]] = []
        self.failed: list[tuple[int, str]] = []

    def _answered(self, replies: Iterable[Message]) -> Iterator[tuple[int, Message]]:
        """``(node, reply)`` for each reply without an error, by node id; the failed ones go to
        ``self.failed``, logged."""
        for msg in sorted(replies, key=lambda m: m.metadata.src_node_id):
            node = msg.metadata.src_node_id
            if msg.has_error():
                self.failed.append((node, str(msg.error.reason)))
                log(WARNING, "node %d: reply skipped (%s)", node, msg.error.reason)
                continue
            yield node, msg

    def _none_left(self, server_round: int, what: str) -> None:
        """Log that a bayesfuse round got no valid ``what``, and that the fused network stays."""
        log(
            WARNING,
            "round %d: no valid %s (%d failed, %d rejected); the fused network stays",
            server_round,
            what,
            len(self.failed),
            len(self.rejected),
        )

    def _collect(self, replies: Iterable[Message]) -> list[_Reply]:
        """The replies that carry arrays, in the order of their contents' hashes; failed ones go
        to ``self.failed``, ones without arrays to ``self.rejected``."""
        collected, failed_before = [], len(self.failed)
        for node, msg in self._answered(replies):
            content = msg.content
            record = content.array_records.get(self.arrayrecord_key)
            if record is None:
                self._reject(node, f"no ArrayRecord under {self.arrayrecord_key!r}")
                continue
            metrics = _metric_record(content) or MetricRecord()
            counts = metrics.get(self.class_counts_key)
            summary_arrays = content.array_records.get(SUMMARY_KEY)
            summary = None
            if summary_arrays is not None:
                try:
                    summary = records_to_summary(
                        summary_arrays, content.config_records.get(SUMMARY_META_KEY), f"node {node}"
                    )
                except SummaryError as err:
                    self._reject(node, str(err))
                    continue
            collected.append(
                _Reply(
                    node,
                    record_to_state(record),
                    float(cast(float, metrics.get(self.weighted_by_key, 1.0))),
                    None if counts is None else np.asarray(counts, dtype=np.float64),
                    summary,
                )
            )
        log(
            INFO,
            "aggregate_train: Received %s results and %s failures",
            len(collected),
            len(self.failed) - failed_before,
        )
        return sorted(collected, key=_digest)

    def _check_contents(self, r: _Reply, n_classes: int) -> None:
        """Refuse, naming the node, a reply of the right architecture whose contents cannot be
        fused: NaN or infinite weights, a weight (``num-examples``) that is not a positive number,
        class counts that are not ``n_classes`` finite numbers >= 0 (0: any number) summing to
        more than 0. (Summaries are checked where they are read, :meth:`_summaries`.)"""
        where = f"node {r.node}"
        bad = next(
            (
                k
                for k, v in r.state.items()
                if np.issubdtype(np.asarray(v).dtype, np.floating) and not np.isfinite(v).all()
            ),
            None,
        )
        if bad is not None:
            raise ValueError(f"{where}: entry {bad!r} has NaN or infinite values")
        if not (np.isfinite(r.num_examples) and r.num_examples > 0):
            raise ValueError(f"{where}: {self.weighted_by_key} must be a finite number > 0, got {r.num_examples:g}")
        counts = r.class_counts
        if counts is not None and (
            counts.ndim != 1
            or (n_classes and len(counts) != n_classes)
            or not np.isfinite(counts).all()
            or (counts < 0).any()
            or counts.sum() <= 0
        ):
            raise ValueError(
                f"{where}: {self.class_counts_key} must be {n_classes or 'one per class'} finite counts >= 0 "
                f"summing to more than 0, got {np.array2string(counts, threshold=12)}"
            )

    def _nothing_fused(self) -> MetricRecord:
        """A round's metrics when no reply was fused: how many failed and were rejected (the
        reasons are in ``failed`` and ``rejected``, and logged)."""
        return MetricRecord(
            {"fused-replies": 0, "failed-replies": len(self.failed), "rejected-replies": len(self.rejected)}
        )

    def _reject(self, node: int, reason: str) -> None:
        self.rejected.append((node, reason))
        log(WARNING, "node %d: reply rejected: %s", node, reason)

    def _check(
        self, replies: list[_Reply], spec: PermutationSpec | None
    ) -> tuple[PermutationSpec | None, list[_Reply]]:
        """Replies that fit the architecture: ``spec``, or else the one most nodes share (a
        single odd node cannot reject all the others by arriving first)."""
        if self.kind == "bnn":
            good = []
            for r in replies:
                try:
                    if not is_bnn_state(r.state):
                        raise ValueError(
                            f"node {r.node}: not a HorseshoeBNN state_dict (keys {sorted(r.state)[:4]}...)"
                        )
                    posterior = BNNPosterior.from_state(r.state, f"node {r.node}")
                    self._check_contents(r, posterior.n_classes)
                    good.append(r)
                except (ValueError, TypeError) as err:
                    self._reject(r.node, str(err))
            return None, good
        specs = {}
        for r in replies:
            try:
                own = spec or strategy_spec(r.state, f"node {r.node}")
                own.check(r.state, f"node {r.node}")
                specs[r.node] = (own, _signature(own, r.state))
            except (ValueError, TypeError) as err:
                self._reject(r.node, str(err))
        if not specs:
            return spec, []
        signatures = [sig for _, sig in specs.values()]
        common = max(signatures, key=signatures.count)  # ties: the first in canonical order
        n_common = signatures.count(common)
        good = []
        for r in replies:
            if r.node not in specs:
                continue
            if specs[r.node][1] == common:
                try:
                    own = specs[r.node][0]
                    self._check_contents(
                        r, int(np.shape(r.state[own.output_layer(r.state)[0]])[0]) if own.output else 0
                    )
                except (ValueError, TypeError) as err:
                    self._reject(r.node, str(err))
                    continue
                good.append(r)
            else:
                self._reject(
                    r.node,
                    f"node {r.node}: a different architecture from the one {n_common} of "
                    f"{len(specs)} nodes share ({_difference(specs[r.node][1], common)})",
                )
        return specs[good[0].node][0], good


class _RefitRound(_Fusion):
    """The refit round both strategies end with when asked (``second_round="refit"``): the server
    sends the global network, each node fits its output layer on the global features of its own
    data (:func:`~bayesfuse.integrations.flower.records.output_fit_reply`), and the server
    multiplies the fits (:func:`~bayesfuse.inference.output_fusion.output_posterior`).

    A subclass calls :meth:`configure_output_fit` and :meth:`aggregate_output_fit` in the round it
    makes the refit, and fills ``_output_weights`` (the nodes' output weights of an earlier round,
    for the prior precision) and ``_class_counts`` (each node's, for :meth:`_refit_heads`).
    """

    def __init__(
        self, *, output_prior_precision: float | None = None, pseudo_count: float | None = None, **kwargs
    ) -> None:
        if output_prior_precision is not None:
            checked_prior_precision(output_prior_precision)
        self.pseudo_count = pseudo_count  # checked by the setter
        super().__init__(**kwargs)
        self.output_prior_precision = output_prior_precision
        self._forget_refit()

    @property
    def pseudo_count(self) -> float | None:
        """The clients' heads' smoothing (:attr:`~bayesfuse.nets.heads.ClientHeads.pseudo_count`);
        None: the heads' own default."""
        return self._pseudo_count

    @pseudo_count.setter
    def pseudo_count(self, value: float | None) -> None:
        self._pseudo_count = None if value is None else checked_pseudo_count(value)

    def _smoothed(self, heads: ClientHeads) -> ClientHeads:
        """``heads`` with the strategy's ``pseudo_count``, where one is set; refused for heads that
        know no examples (nothing to smooth by)."""
        if self.pseudo_count is not None:
            if not hasattr(heads, "examples"):
                raise unsmoothable("the nodes sent no summaries and not every one its class counts")
            heads.pseudo_count = self.pseudo_count
        return heads

    def _forget_refit(self) -> None:
        """Forget an earlier run's refit: nothing of it may pair with a new run's arrays."""
        self.output_covariance: np.ndarray | None = None
        self.second_round_report: dict | None = None
        self._pending_refit: dict | None = None  # what configure_output_fit sent
        self._output_weights: list[np.ndarray] = []  # the nodes' output weights of the round before
        self._class_counts: dict[int, np.ndarray | None] = {}  # each node's class counts, for the heads
        self._refitted: dict | None = None  # the refitted state, its output layer's name, the fits

    def _after_refit(self, refitted: dict, keys: tuple[str, str]) -> None:
        """What a subclass updates once the output layer ``keys`` is refitted (nothing here)."""

    # ------------------------------------------------------------------ the refit round

    def configure_output_fit(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        nodes: list[int] | None = None,
    ) -> list[Message]:
        """The refit round's messages: the fused network ``arrays`` to each sampled node (as FedAvg
        samples), with ``config`` and ``"bayesfuse-round": "output_fit"``, ``output-layer``,
        ``prior-precision`` and ``n-clients`` (the number of nodes sampled). :meth:`aggregate_train`
        of the same round then reads the replies as output fits.

        Parameters
        ----------
        server_round : int
        arrays : ArrayRecord
            The fused network.
        config : ConfigRecord
        grid : Grid
        nodes : list of int, optional
            The nodes to send it to, instead of FedAvg's sample (FedMA: the nodes still in its run).

        Returns
        -------
        list of Message
        """
        state = record_to_state(arrays)
        output = _output_layer(state)
        if output is None:
            raise ValueError(
                "the refit round refits the output layer, a Linear layer's 2-D weight and bias; the "
                f"fused network has none (entries {list(state)[:4]}...)"
            )
        if self.output_prior_precision is not None:
            prior = float(self.output_prior_precision)
        elif self._output_weights:
            prior = prior_precision_from_weights(self._output_weights, fan_in=state[output + ".weight"].shape[1])
        else:
            raise ValueError(
                "the refit round needs a round before it whose replies held the clients' output "
                "weights (they give the prior precision), or output_prior_precision"
            )
        if nodes is None:
            sampled = list(super().configure_train(server_round, arrays, ConfigRecord(dict(config)), grid))
            nodes = [m.metadata.dst_node_id for m in sampled]
        self._pending_refit = {
            "round": server_round,
            "state": state,
            "output": output,
            "prior": prior,
            "nodes": nodes,
            "bytes_down": int(sum(np.asarray(v).nbytes for v in state.values())),
        }
        if not nodes:
            return []
        round_config = {
            **dict(config),
            "server-round": server_round,
            ROUND_KEY: OUTPUT_FIT,
            "output-layer": output,
            "prior-precision": prior,
            "n-clients": len(nodes),
        }
        log(
            INFO,
            "configure_train: %d nodes fit the output layer %r on the fused features (prior precision %.4g)",
            len(nodes),
            output,
            prior,
        )
        return self._round_messages({self.arrayrecord_key: arrays}, round_config, nodes)

    def _round_messages(self, content: dict, config: dict, nodes: list[int]) -> list[Message]:
        """One training message per node of a bayesfuse round: ``content`` and the round's ``config``."""
        return [
            Message(
                content=RecordDict({**content, self.configrecord_key: ConfigRecord(dict(config))}),
                message_type="train",
                dst_node_id=node,
            )
            for node in nodes
        ]

    def aggregate_output_fit(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The product of the nodes' output fits: the fused network with its output layer refitted.

        Parameters
        ----------
        server_round : int
        replies : iterable of Message
            Replies to :meth:`configure_output_fit`'s messages
            (:func:`~bayesfuse.integrations.flower.records.output_fit_reply`).

        Returns
        -------
        tuple of (ArrayRecord or None, MetricRecord or None)
            The refitted network (``None`` when no valid fit came: the fused network stays) and
            ``num-examples``, ``output-fit-replies``, ``failed-replies``, ``rejected-replies``,
            ``prior-precision``, ``bytes-up`` and ``bytes-down`` (per node).
        """
        pending, self._pending_refit = self._pending_refit, None
        if pending is None:
            raise ValueError("aggregate_output_fit: no refit round was configured (configure_output_fit)")
        start = time.perf_counter()
        failed_before, rejected_before = len(self.failed), len(self.rejected)  # the strategy says what they cover
        state, output, prior = pending["state"], pending["output"], pending["prior"]
        weight_key, bias_key = output + ".weight", output + ".bias"
        shape = (state[weight_key].shape[1] + 1, state[weight_key].shape[0])
        fits, sizes, nodes = [], [], []
        for node, msg in self._answered(replies):
            record = msg.content.array_records.get(OUTPUT_FIT_KEY)
            if record is None:
                self._reject(
                    node, f"node {node}: no output fit under {OUTPUT_FIT_KEY!r} in its reply to the refit round"
                )
                continue
            try:
                fit = records_to_output_fit(
                    record,
                    msg.content.config_records.get(OUTPUT_FIT_META_KEY),
                    f"node {node}",
                    shape=shape,
                    prior_precision=prior,
                    n_clients=len(pending["nodes"]),
                )
            except ValueError as err:
                self._reject(node, str(err))
                continue
            fits.append(fit)
            nodes.append(node)
            sizes.append(int(sum(record[k].numpy().nbytes for k in record.keys())))
        log(
            INFO,
            "aggregate_train: Received %s output fits and %s failures",
            len(fits),
            len(self.failed) - failed_before,
        )
        metrics = {
            "num-examples": float(sum(f.n for f in fits)),
            "output-fit-replies": len(fits),
            "failed-replies": len(self.failed) - failed_before,
            "rejected-replies": len(self.rejected) - rejected_before,
            "prior-precision": float(prior),
            "bytes-up": max(sizes, default=0),
            "bytes-down": pending["bytes_down"],
        }
        if not fits:
            self._none_left(server_round, "output fit")
            return None, MetricRecord(metrics)
        by_digest = sorted(range(len(fits)), key=lambda i: _fit_digest(fits[i]))
        fits, nodes = [fits[i] for i in by_digest], [nodes[i] for i in by_digest]  # the order replies came in is lost
        # fits made for every sampled node: a refused or lost one's share of the prior is put back
        mean, covariance, chosen = output_posterior(
            fits, prior, by_evidence=self.output_prior_precision is None, n_clients=len(pending["nodes"])
        )
        refitted = dict(state)
        refitted[weight_key] = mean[:-1].T.astype(state[weight_key].dtype)
        refitted[bias_key] = mean[-1].astype(state[bias_key].dtype)
        self.output_covariance = covariance
        self._refitted = {
            "state": refitted,
            "output": output,
            "fits": fits,
            "nodes": nodes,
            "fit_prior": prior / len(pending["nodes"]),  # the prior share each node fitted with
        }
        self.second_round_report = {
            "kind": "refit",
            "output_layer": "product of the clients' Laplace fits on the fused features (K-FAC)",
            "prior_precision": float(chosen),
            "fit_prior_precision": float(prior),
            **product_report(mean.shape, by_evidence=self.output_prior_precision is None),
            "bytes_up": metrics["bytes-up"],
            "bytes_down": pending["bytes_down"],
            "replies": len(fits),
            "seconds": time.perf_counter() - start,
        }
        self._after_refit(refitted, (weight_key, bias_key))
        log(INFO, "\t└──> refitted output layer %r from %d output fits", output, len(fits))
        return state_to_record(refitted), MetricRecord(metrics)

    def laplace(self, like: nn.Module) -> LastLayerLaplace:
        """The refitted network with its output layer's posterior: a
        :class:`~bayesfuse.nets.laplace.LastLayerLaplace` (probit predictive; joint covariance, or per
        class for a layer too wide to solve jointly).

        Parameters
        ----------
        like : nn.Module
            A network of the clients' architecture; rebuilt at the fused widths
            (:func:`bayesfuse.nets.arch.rebuild`) and loaded with the refitted arrays.

        Returns
        -------
        LastLayerLaplace
        """
        if self._refitted is None or self.output_covariance is None:
            raise ValueError("no refit round has run: make the strategy with second_round='refit' and run it")
        network = rebuild(like, tensor_state(self._refitted["state"]), self.spec)
        return LastLayerLaplace(network, self._refitted["output"], covariance=self.output_covariance).eval()

    def _refit_heads(self, like: nn.Module, pool: str, otherwise: str) -> ClientHeads:
        """The refitted network predicting with the nodes' own output fits
        (:meth:`~bayesfuse.nets.heads.ClientHeads.from_fits`), mixed by their class counts;
        ``otherwise`` ends the error raised when no refit round has run."""
        if self._refitted is None:
            raise ValueError(
                f"no refit round has run: make the strategy with second_round='refit' and run it, {otherwise}"
            )
        nodes, fits = self._refitted["nodes"], self._refitted["fits"]
        counts = [self._class_counts.get(n) for n in nodes]
        missing = [n for n, c in zip(nodes, counts) if c is None]
        if missing:
            raise ValueError(
                f"node(s) {missing} reported no class counts ({self.class_counts_key!r} in their metrics): "
                "the heads are mixed by each node's share of each class"
            )
        network = rebuild(like, tensor_state(self._refitted["state"]), self.spec)
        return self._smoothed(
            ClientHeads.from_fits(
                network,
                self._refitted["output"],
                fits,
                np.stack(cast(list[np.ndarray], counts)),
                pool=pool,
                prior_precision=self._refitted["fit_prior"],
            )
        )


class MatchedAveraging(_RefitRound):
    """FedAvg whose aggregation is bayesfuse's matched (or KL) fusion.

    Parameters
    ----------
    method : str
        A one-shot method of :mod:`bayesfuse.methods` other than FedAvg (flwr's own strategy):
        ``"pfnm"`` / ``"nafi"`` layer-wise matching, ``"ot"`` fusion, or ``"kl"`` (KL-fusion of
        HorseshoeBNN state_dicts).
    kind : {"network", "bnn"}, optional
        What the clients send: point-estimate networks or HorseshoeBNN state_dicts. Default: the
        first kind of input the method's row lists (networks for PFNM, NAFI and OT; BNNs for KL).
    spec : PermutationSpec, optional
        The clients' architecture; derived from the entries' names when omitted
        (:func:`~bayesfuse.inference.spec.spec_for_state_dict`): :meth:`start` refuses, before
        any round, ``initial_arrays`` whose names cannot describe the network or leave a skip
        connection possible (a hidden layer as wide as the input, outside a top-level
        ``nn.Sequential``), saying what to give instead.
    like : torch.nn.Module, optional
        The clients' network (any instance of their class), instead of ``spec``: the spec is
        traced from it (:func:`~bayesfuse.nets.tracing.spec_from_module`), never guessed.
    example_input : tensor, optional
        An input batch for tracing ``like`` where its input shape cannot be inferred.
    hyper : dict, optional
        The method's hyper-parameters (:mod:`bayesfuse.methods`): ``noise_var``, ``prior_var``,
        ``gamma0``, ``kl_weight``, ``cost``, ``n_iter``, ``direction`` for PFNM/NAFI; ``reg``,
        ``solver``, ``n_iter``, ``average_outputs`` for ``"kl"``. Checked when the strategy is made.
    class_counts_key : str
        Key of a reply's per-class example counts in its MetricRecord.
    seed : int
        Matching seed. Replies are put in the order of their contents' hashes first, so neither
        the arrival order nor the node ids (drawn afresh in each simulation) change the result.
    summaries : {"auto", "none"}
        ``"auto"``: when the method reads client summaries (PFNM, NAFI on networks) and every
        fused reply carries one (:func:`summary_to_records`), fuse the networks as Laplace
        posteriors (:func:`bayesfuse.core.fuse_states` with ``summaries``); a reply whose
        summary is malformed or of another network is rejected, naming its node; when only
        some replies carry one, the round is fused data-free and the nodes without are logged.
        ``"none"``: ignore them. The round's metrics say which (``summaries-used``,
        ``summary-bytes``).
    second_round : {None, "refit", "temperature"}
        ``"refit"``: the last round of :meth:`start` (``num_rounds >= 2``; ``num_rounds=2`` is the
        one-shot fusion and the refit) refits the fused network's output layer, as
        ``bayesfuse.fuse(..., rounds=2, second_round="refit")`` simulates it. The server sends the
        fused network in a training message whose ConfigRecord has ``"bayesfuse-round":
        "output_fit"`` (:data:`~bayesfuse.integrations.flower.records.ROUND_KEY`), the
        ``output-layer``, the ``prior-precision`` and ``n-clients``; each client answers with
        :func:`~bayesfuse.integrations.flower.records.output_fit_reply`, its Laplace fit of that
        layer on the fused features of its own data; the server multiplies the fits
        (:func:`~bayesfuse.inference.output_fusion.output_posterior`) into the output layer, which
        is the round's ArrayRecord (so ``Result.arrays``), and keeps its covariance
        (:attr:`output_covariance`, :meth:`laplace`). A reply that is malformed, not finite or of
        another shape is rejected with its node named; with none left the fused network stays.
        ``"temperature"``: the last round of :meth:`start` chooses the fused model's predictive
        and its temperature by the clients' NLL on examples they kept back from their local
        training (:func:`bayesfuse.data.holdout_partition`; the client app decides which), as
        ``bayesfuse.fuse(..., second_round="temperature")`` simulates it. Its candidates
        (:func:`~bayesfuse.integrations.flower.records.temperature_candidates`) are the fused
        network's shared output layer (``SHARED``: with summaries its last-layer Laplace from the
        fusion's precisions, sent as ArrayRecord ``SHARED_POSTERIOR_KEY``; without, the network as
        it is) and, after PFNM or NAFI with every node's summary, where the output layer reads
        hidden units, the nodes' own one-shot heads on it (:meth:`client_heads`; ``CLIENT_HEADS``,
        ArrayRecord ``HEADS_KEY``) and, where they are Kronecker-factored, the same heads each
        with its curvature trace-matched to the exact GGN (``TRACE_MATCHED``) and, where every
        summary has the output layer's GGN eigenvalues (version 3 or later), with them (``EKFAC_HEADS``,
        EKFAC), and each its client's diagonal Laplace posterior (``DIAGONAL_HEADS``, the
        summaries' GGN diagonal); with summaries
        also the fusion with the output layer pooled by class counts (``SHARED_COUNTS``, its
        entries that differ and its output layer's variances as ArrayRecords
        ``COUNTS_ARRAYS_KEY``, ``COUNTS_POSTERIOR_KEY``): ``fuse``'s candidates. A node rebuilds
        them all from the message alone. The server sends them with the
        fused network and a ConfigRecord with ``"bayesfuse-round": "temperature"``, the
        ``candidates`` and the ``temperatures``; each node answers with
        :func:`~bayesfuse.integrations.flower.records.temperature_reply`; the server keeps the
        pair of least summed NLL. Where a plain network wins, the round's ArrayRecord is the
        fused network with the temperature folded into its output layer; otherwise the fused
        network as it was (the counts-pooled one where that won, then also :attr:`last_fusion`),
        and :meth:`tempered` gives the model. A
        reply of another shape or not finite is rejected with its node named; with none left the
        fused network stays. Point-estimate networks only. ``None`` (default): every round fuses.
    output_prior_precision : float, optional
        The refit's prior precision ``lambda``, for the clients' fits and the product. None
        (default): the clients fit with ``1 / mean(w^2)`` of the output weights they sent in the
        last fusion round, times the fused layer's fan-in over theirs
        (:func:`~bayesfuse.inference.output_fusion.prior_precision_from_weights`), and the server
        takes the product's ``lambda`` that maximises the evidence of their replies
        (:func:`~bayesfuse.inference.output_fusion.evidence_precision`).
    pseudo_count : float, optional
        The clients' heads' smoothing (:attr:`~bayesfuse.nets.heads.ClientHeads.pseudo_count`,
        as ``bayesfuse fuse --pseudo-count``): of :meth:`client_heads`, of the temperature
        round's heads candidates (sent to the nodes with it, so they score what the server
        predicts with) and of :meth:`tempered`. None (default): the heads' own, 1; 0 turns it off.
    **kwargs
        Passed to ``flwr.serverapp.strategy.FedAvg`` (sampling, record keys).

    Attributes
    ----------
    last_fusion : FusionResult or None
        The last fusion's result (:func:`bayesfuse.fuse_states`); after a refit its state has the
        refitted output layer and ``hyper["second_round"]`` says what the round did and cost.
    output_covariance : ndarray (G+1, K, G+1, K), (K, G+1, G+1) or None
        After a refit, the posterior covariance of the output layer's weights and bias (the bias
        as the last row): joint, or per class for a layer too wide to solve jointly
        (:func:`~bayesfuse.inference.output_fusion.output_posterior`).
    second_round_report : dict or None
        After a refit: ``kind``, ``prior_precision``, ``bytes_up`` (per client), ``bytes_down``
        (per client), ``replies``, ``seconds``. After the temperature round: ``kind``,
        ``candidate`` (the chosen one's name), ``temperature``, ``at_edge``, ``nll`` (each
        candidate's least summed NLL), ``candidates`` (pairs scored), ``bytes_up``, ``bytes_down``,
        ``replies``, ``seconds``.
    """

    def __init__(
        self,
        method: str = "pfnm",
        *,
        kind: str | None = None,
        spec: PermutationSpec | None = None,
        like: nn.Module | None = None,
        example_input: Any = None,
        hyper: dict | None = None,
        class_counts_key: str = "class-counts",
        seed: int = 0,
        summaries: str = "auto",
        second_round: str | None = None,
        output_prior_precision: float | None = None,
        **kwargs,
    ) -> None:
        choices = methods.names(needs_data=False, baseline=False)
        if method not in choices:
            raise ValueError(
                f"unknown method {method!r}; choose one of {', '.join(choices)} (FedAvg is flwr's "
                "own strategy; FedMA is the FedMA strategy)"
            )
        self.kind = kind if kind is not None else methods.METHODS[method].kinds[0]
        methods.resolve(method, self.kind, hyper)  # a kind the method does not take, bad keys: refused here
        if (hyper or {}).get("head", "shared") != "shared":
            raise ValueError(
                "head='clients' builds a fused model with one output layer per client, which the "
                "clients' HorseshoeBNN cannot take; the strategy sends back the shared head"
            )
        if summaries not in ("auto", "none"):
            raise ValueError(f"unknown summaries={summaries!r}; choose auto or none")
        if second_round not in (None, "refit", "temperature"):
            raise ValueError(f"unknown second_round={second_round!r}; choose None, 'refit' or 'temperature'")
        if second_round is not None and self.kind == "bnn":
            raise ValueError(
                f"second_round={second_round!r} is for point-estimate networks; fused BNNs carry their own posterior"
            )
        if kwargs.get("pseudo_count") is not None and self.kind == "bnn":
            raise ValueError("pseudo_count smooths the clients' own heads of point-estimate networks; these are BNNs")
        if kwargs.get("pseudo_count") is not None and method not in methods.ONE_SHOT_HEADS and second_round != "refit":
            raise ValueError(
                f"pseudo_count smooths the clients' own heads, which {method} keeps none of "
                f"({', '.join(methods.ONE_SHOT_HEADS)} do, and every method with second_round='refit')"
            )
        if like is not None and self.kind == "bnn":
            raise ValueError("like= traces a point-estimate network; KL-fusion reads HorseshoeBNN state_dicts")
        super().__init__(
            spec=spec,
            like=like,
            example_input=example_input,
            class_counts_key=class_counts_key,
            seed=seed,
            output_prior_precision=output_prior_precision,
            **kwargs,
        )
        self.method = method
        self.hyper = dict(hyper or {})
        self.summaries = summaries
        self.second_round = second_round
        self.last_fusion: StateFusion | None = None
        self._refit_round: int | None = None  # the round start() makes the refit
        self._pending_temperature: dict | None = None  # what configure_temperature sent
        self._tempered: dict | None = None  # the temperature round's choice
        self._one_shot: dict | None = None  # the last fusion's inputs, for its one-shot client heads

    def summary(self) -> None:
        """Log the strategy's settings (Flower's, then the fusion's)."""
        super().summary()
        log(INFO, "\t└──> bayesfuse %s fusion, hyper-parameters %s", self.method, self.hyper)
        if self.second_round is not None:
            what = "refits the output layer" if self.second_round == "refit" else "chooses a predictive and temperature"
            log(INFO, "\t└──> the last round %s (second_round=%r)", what, self.second_round)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start``; with ``second_round`` its last round is the refit or the
        temperature round. What an earlier call fused is forgotten first.

        Parameters
        ----------
        grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config, evaluate_fn
            As ``flwr.serverapp.strategy.FedAvg.start``. With ``second_round``, ``num_rounds``
            counts the second round: ``num_rounds - 1`` fusion rounds, then that round.

        Returns
        -------
        Result
        """
        if self.second_round is not None and num_rounds < 2:
            raise ValueError(
                f"second_round={self.second_round!r} needs num_rounds >= 2 (the fusion rounds, then "
                f"the {self.second_round} round); got num_rounds={num_rounds}"
            )
        if self.kind == "network":  # refused now, not in every node's reply
            initial_spec(self.spec, record_to_state(initial_arrays))
        self._refit_round = num_rounds if self.second_round is not None else None  # checked: this run's
        # a new run: nothing of an earlier one may pair with this run's arrays
        self._forget_refit()
        self.last_fusion, self._one_shot = None, None
        self._tempered = self._pending_temperature = None
        try:
            return super().start(
                grid=grid,
                initial_arrays=initial_arrays,
                num_rounds=num_rounds,
                timeout=timeout,
                train_config=train_config,
                evaluate_config=evaluate_config,
                evaluate_fn=evaluate_fn,
            )
        finally:
            self._refit_round = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """FedAvg's training messages; in the last round of :meth:`start` with ``second_round``,
        the refit round's (:meth:`configure_output_fit`) or the temperature round's
        (:meth:`configure_temperature`).

        Parameters
        ----------
        server_round : int
        arrays : ArrayRecord
        config : ConfigRecord
        grid : Grid

        Returns
        -------
        list of Message
        """
        if self.second_round == "temperature" and server_round == self._refit_round:
            return self.configure_temperature(server_round, arrays, config, grid)
        if self.second_round is not None and server_round == self._refit_round:
            return self.configure_output_fit(server_round, arrays, config, grid)
        self._pending_refit = self._pending_temperature = None
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Fuse the valid replies; ``(None, None)`` when none is left.

        Parameters
        ----------
        server_round : int
        replies : iterable of Message

        Returns
        -------
        tuple of (ArrayRecord or None, MetricRecord or None)
            The fused arrays and ``num-examples``, ``global-sizes``, ``objective``, the
            counts of fused, failed and rejected replies, and ``summaries-used`` (1 or 0) and
            ``summary-bytes``. In the refit round, :meth:`aggregate_output_fit`'s; in the
            temperature round, :meth:`aggregate_temperature`'s.
        """
        self.rejected, self.failed = [], []  # this round's skips only
        if self._pending_refit is not None and self._pending_refit["round"] == server_round:
            return self.aggregate_output_fit(server_round, replies)
        if self._pending_temperature is not None and self._pending_temperature["round"] == server_round:
            return self.aggregate_temperature(server_round, replies)
        self.output_covariance, self.second_round_report, self._refitted = None, None, None
        self._tempered = None
        spec, good = self._check(self._collect(replies), self.spec)
        summaries, good = self._summaries(good)
        if not good:
            log(
                WARNING,
                "round %d: no valid replies to fuse (%d failed, %d rejected)",
                server_round,
                len(self.failed),
                len(self.rejected),
            )
            return None, self._nothing_fused()
        counts = None
        if all(r.class_counts is not None for r in good):
            counts = np.stack(cast(list[np.ndarray], [r.class_counts for r in good]))
        result = fuse_states(
            [r.state for r in good],
            self.method,
            spec=spec,
            class_counts=counts,
            seed=self.seed,
            names=[f"node {r.node}" for r in good],
            summaries=summaries,
            **self.hyper,
        )
        fused, sizes = result.state, result.sizes
        objective = [float(layer.objective[-1]) for layer in result.layers]
        self.last_fusion = result
        self._one_shot = {  # client_heads() and the temperature round's candidates
            "states": [r.state for r in good],
            "counts": counts,
            "summaries": summaries,
            "names": [f"node {r.node}" for r in good],
        }
        if self.second_round is not None:
            output = _output_layer(good[0].state)
            self._output_weights = [] if output is None else [r.state[output + ".weight"] for r in good]
            self._class_counts = {r.node: r.class_counts for r in good}  # for client_heads()
        metrics = MetricRecord(
            {
                "num-examples": float(sum(r.num_examples for r in good)),
                "global-sizes": [int(s) for s in sizes],
                "objective": objective,
                "fused-replies": len(good),
                "failed-replies": len(self.failed),
                "rejected-replies": len(self.rejected),
                "summaries-used": int(summaries is not None),
                "summary-bytes": int(sum(s.nbytes for s in summaries or ())),
            }
        )
        ref = good[0].state
        return state_to_record({k: np.asarray(fused[k]).astype(ref[k].dtype) for k in ref}), metrics

    def _after_refit(self, refitted: dict, keys: tuple[str, str]) -> None:
        """The last fusion's result gets the refitted output layer and the round's report."""
        if self.last_fusion is not None:
            for key in keys:
                if key in self.last_fusion.state:
                    self.last_fusion.state[key] = refitted[key].copy()
            self.last_fusion.hyper["predictive"] = (
                "probit of the centred logits, last-layer Laplace (LastLayerLaplace, joint covariance)"
                if self.output_covariance is not None and np.ndim(self.output_covariance) == 4
                else "probit, last-layer Laplace (LastLayerLaplace, per-class covariance)"
            )
            self.last_fusion.hyper["second_round"] = self.second_round_report

    # ------------------------------------------------------------------ the temperature round

    def configure_temperature(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        """The temperature round's messages: the fused network ``arrays`` to each sampled node (as
        FedAvg samples); with summaries its output layer's posterior variances
        (:data:`SHARED_POSTERIOR_KEY`) and the fusion pooled by class counts
        (:data:`COUNTS_ARRAYS_KEY`, :data:`COUNTS_POSTERIOR_KEY`); the nodes' own heads on it where
        they are candidates (:data:`HEADS_KEY`); and ``config`` with ``"bayesfuse-round":
        "temperature"``, the ``candidates``, the ``temperatures`` and the ``output-layer``, with
        heads also their ``heads-form`` and ``pool``.
        :meth:`aggregate_train` of the same round then reads the replies as NLL sums.

        Parameters
        ----------
        server_round : int
        arrays : ArrayRecord
            The fused network.
        config : ConfigRecord
        grid : Grid

        Returns
        -------
        list of Message
        """
        from bayesfuse.fusion import TEMPERATURES
        from bayesfuse.methods import ONE_SHOT_HEADS

        state = record_to_state(arrays)
        if self.last_fusion is None or self._one_shot is None:
            log(WARNING, "round %d: no fusion round had valid replies; no temperature round", server_round)
            self._pending_temperature = None
            return []
        result, inputs = self.last_fusion, self._one_shot
        names = [SHARED]
        records: dict[str, ArrayRecord] = {}
        round_config: dict[str, Any] = {}
        spec = result.spec
        if spec is not None and result.precision is not None:  # the shared head's Laplace, as fuse() scores it
            weight_key, bias_key = spec.output_layer(state)
            records[SHARED_POSTERIOR_KEY] = _posterior_record(result, weight_key, bias_key)
            round_config["output-layer"] = weight_key.rpartition(".")[0]
            if inputs["summaries"] is not None:  # the same fusion, the output layer pooled by class counts
                counts = self._counts_fusion(state, spec)
                names.append(SHARED_COUNTS)
                records[COUNTS_ARRAYS_KEY] = counts["entries"]
                records[COUNTS_POSTERIOR_KEY] = counts["posterior"]
        if (
            inputs["summaries"] is not None
            and self.method in ONE_SHOT_HEADS
            and spec is not None
            and not heads_refused(spec, state)
        ):
            assignments = {g: layer.assignments for g, layer in zip(result.groups, result.layers)}
            width = int(np.shape(state[spec.output_layer(state)[0]])[1])
            heads = one_shot_heads(spec, inputs["states"], assignments, width, inputs["counts"], inputs["summaries"])
            if self.pseudo_count is not None and heads.get("examples") is not None:
                heads["pseudo_count"] = self.pseudo_count  # the nodes score the heads the server predicts with
            scale = eigenvalues = diagonal = None
            if heads["form"] == "kronecker":
                scale, eigenvalues, diagonal = kronecker_variants(
                    spec, inputs["states"], assignments, width, inputs["summaries"]
                )
            names += [CLIENT_HEADS] + ([TRACE_MATCHED] if scale is not None else [])
            names += [EKFAC_HEADS] if eigenvalues is not None else []
            names += [DIAGONAL_HEADS] if diagonal is not None else []
            records[HEADS_KEY] = heads_to_record(heads, scale, eigenvalues, diagonal)
            round_config.update(
                {
                    "output-layer": heads["output"],
                    "heads-form": heads["form"],
                    "pool": default_pool(inputs["summaries"]),
                }
            )
        sampled = list(super().configure_train(server_round, arrays, ConfigRecord(dict(config)), grid))
        nodes = [m.metadata.dst_node_id for m in sampled]
        alternative = counts["fusion"] if SHARED_COUNTS in names else None
        round_config = {
            "server-round": server_round,
            ROUND_KEY: TEMPERATURE,
            "candidates": names,
            "temperatures": [float(t) for t in TEMPERATURES],
            **round_config,
        }
        sent = [arrays, *records.values()]
        self._pending_temperature = {
            "round": server_round,
            "fusion": result,
            "state": state,
            "counts-fusion": alternative,
            "names": names,
            "records": records,
            "config": round_config,
            "nodes": nodes,
            "bytes_down": int(sum(record[k].numpy().nbytes for record in sent for k in record.keys())),
        }
        if not nodes:
            return []
        log(
            INFO,
            "configure_train: %d nodes score %d candidates (%s) at %d temperatures",
            len(nodes),
            len(names),
            "; ".join(names),
            len(TEMPERATURES),
        )
        return self._round_messages({self.arrayrecord_key: arrays, **records}, {**dict(config), **round_config}, nodes)

    def _counts_fusion(self, state: dict, spec: PermutationSpec) -> dict:
        """The last fusion again with the output layer pooled by class counts (``output_pool=
        "counts"``, ``fuse``'s other shared candidate), and what the nodes need of it: the entries
        of its network that differ from ``state`` (the fused network sent; its output layer always)
        and its output layer's posterior variances."""
        inputs = cast(dict, self._one_shot)
        fusion = fuse_states(
            inputs["states"],
            self.method,
            spec=spec,
            class_counts=inputs["counts"],
            seed=self.seed,
            names=inputs["names"],
            summaries=inputs["summaries"],
            **{**self.hyper, "output_pool": "counts"},
        )
        weight_key, bias_key = spec.output_layer(fusion.state)
        sent = {k: np.asarray(v) for k, v in state.items()}
        differs = {
            k: v
            for k, v in fusion.state.items()
            if k in (weight_key, bias_key)
            or np.shape(v) != sent[k].shape
            or not np.array_equal(np.asarray(v).astype(sent[k].dtype), sent[k])
        }
        posterior = _posterior_record(fusion, weight_key, bias_key)
        return {"fusion": fusion, "entries": state_to_record(differs), "posterior": posterior}

    def aggregate_temperature(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The candidate and temperature of least summed NLL over the nodes' replies.

        Parameters
        ----------
        server_round : int
        replies : iterable of Message
            Replies to :meth:`configure_temperature`'s messages
            (:func:`~bayesfuse.integrations.flower.records.temperature_reply`).

        Returns
        -------
        tuple of (ArrayRecord or None, MetricRecord or None)
            The fused network, its output layer divided by the temperature where the plain network
            won, the counts-pooled fusion's network (perhaps of other widths) where that won
            (``None`` when no valid reply came: the fused network stays), and ``num-examples``,
            ``temperature-replies``, ``failed-replies``, ``rejected-replies``, ``temperature``,
            ``candidate`` (its index in the round's ``candidates``), ``bytes-up`` and
            ``bytes-down`` (per node), and ``global-sizes`` (the widths of the network returned).
        """
        from bayesfuse.fusion import TEMPERATURES
        from bayesfuse.inference.summary_fusion import best_candidate, fold_temperature

        pending, self._pending_temperature = self._pending_temperature, None
        if pending is None:
            raise ValueError("aggregate_temperature: no temperature round was configured (configure_temperature)")
        start = time.perf_counter()
        self.rejected, self.failed = [], []
        shape = (len(pending["names"]), len(TEMPERATURES))
        sums, examples = [], 0.0
        sizes: list[int] = []  # bytes of each valid reply
        for node, msg in self._answered(replies):
            record = msg.content.array_records.get(TEMPERATURE_NLL_KEY)
            try:
                nll = None if record is None or "nll" not in record else np.asarray(record["nll"].numpy())
            except (TypeError, ValueError):  # an array that does not decode
                nll = np.empty((0,), dtype=object)
            numeric = nll is not None and nll.dtype.kind in "fiu"
            if nll is None or nll.shape != shape or not numeric or not np.isfinite(nll).all() or (nll < 0).any():
                found = "none" if nll is None else f"shape {nll.shape}" + ("" if nll.shape != shape else ", bad values")
                self._reject(
                    node,
                    f"node {node}: its reply to the temperature round needs {TEMPERATURE_NLL_KEY!r} array 'nll' "
                    f"of shape {shape}, finite and >= 0; got {found}",
                )
                continue
            sums.append(nll.astype(np.float64))
            arrived = cast(ArrayRecord, record)
            sizes.append(int(sum(arrived[k].numpy().nbytes for k in arrived.keys())))  # as it arrived
            metrics_in = _metric_record(msg.content)
            count = metrics_in.get("num-examples", 0) if metrics_in is not None else 0
            if isinstance(count, (int, float)) and not isinstance(count, bool) and 0 <= count < np.inf:
                examples += float(count)
        log(INFO, "aggregate_train: Received %s temperature replies and %s failures", len(sums), len(self.failed))
        metrics: dict = {
            "num-examples": examples,
            "temperature-replies": len(sums),
            "failed-replies": len(self.failed),
            "rejected-replies": len(self.rejected),
            "bytes-up": max(sizes, default=0),
            "bytes-down": pending["bytes_down"],
        }
        if not sums:
            self._none_left(server_round, "temperature reply")
            return None, MetricRecord(metrics)
        nll = np.stack(sums)
        choice, t = best_candidate(nll)
        temperature, name = float(TEMPERATURES[t]), pending["names"][choice]
        state = pending["state"]
        result = cast(StateFusion, pending["fusion"])
        if name == SHARED_COUNTS:  # the counts-pooled fusion becomes the round's network and fusion
            result = self.last_fusion = cast(StateFusion, pending["counts-fusion"])
            state = {k: np.asarray(v, dtype=np.asarray(pending["state"][k]).dtype) for k, v in result.state.items()}
        if name == SHARED and SHARED_POSTERIOR_KEY not in pending["records"]:  # a plain network: fold T in
            spec = cast(PermutationSpec, result.spec)
            folded = fold_temperature(state, spec, temperature)
            state = {k: np.asarray(v).astype(np.asarray(pending["state"][k]).dtype) for k, v in folded.items()}
            result.state = fold_temperature(result.state, spec, temperature)
        else:
            result.hyper["predictive"] = f"{name} at temperature {temperature:.4g} (MatchedAveraging.tempered)"
        self._tempered = {**pending, "state": state, "name": name, "temperature": temperature}
        self.second_round_report = {
            "kind": "temperature",
            "candidate": name,
            "temperature": temperature,
            "at_edge": bool(temperature in (TEMPERATURES[0], TEMPERATURES[-1])),
            "nll": {n: float(nll[:, c].sum(0).min()) for c, n in enumerate(pending["names"])},
            "candidates": int(np.prod(shape)),
            "bytes_up": metrics["bytes-up"],
            "bytes_down": pending["bytes_down"],
            "replies": len(sums),
            "seconds": time.perf_counter() - start,
        }
        result.hyper["second_round"] = self.second_round_report
        metrics.update(temperature=temperature, candidate=choice, **{"global-sizes": [int(w) for w in result.sizes]})
        log(INFO, "\t└──> kept %s at temperature %.3g from %d replies", name, temperature, len(sums))
        return state_to_record(state), MetricRecord(metrics)

    def tempered(self, like: nn.Module) -> nn.Module:
        """The temperature round's choice: the fused network with the temperature folded into its
        output layer; or, with its ``temperature`` set, its output layer's Laplace
        (:class:`~bayesfuse.nets.laplace.LastLayerLaplace`; the counts-pooled fusion's where that
        won) or the nodes' heads on it (:class:`~bayesfuse.nets.heads.ClientHeads`, trace-matched,
        with their EKFAC eigenvalues or as diagonal posteriors where that candidate won); in eval mode.

        Parameters
        ----------
        like : nn.Module
            A network of the clients' architecture, rebuilt at the fused widths.

        Returns
        -------
        nn.Module
        """
        chosen = self._tempered
        if chosen is None:
            raise ValueError(
                "no temperature round has chosen a model: make the strategy with second_round='temperature' "
                "and run it (a round without valid replies chooses none)"
            )
        network = rebuild(like, tensor_state(chosen["state"]), self.spec).eval()
        config = {**chosen["config"], "candidates": [chosen["name"]]}  # the winner alone
        model = temperature_candidates(network, config, chosen["records"])[chosen["name"]]
        if isinstance(model, (ClientHeads, LastLayerLaplace)):
            model.temperature.fill_(chosen["temperature"])
        return model  # a plain network has the temperature folded into its output layer

    def client_heads(self, like: nn.Module, *, pool: str | None = None) -> ClientHeads:
        """The refitted network predicting with the nodes' own output fits: a
        :class:`~bayesfuse.nets.heads.ClientHeads` (the class-share mixture of the heads, or their
        geometric pool with ``pool="log"``), each head its fit's Laplace posterior, as
        ``bayesfuse.fuse(..., head="clients")``. Without a refit round (``second_round=None`` or
        ``"temperature"``), the one-shot heads of the last fusion (untempered: :meth:`tempered`
        gives the temperature round's choice): each node's own output layer on the fused network
        (:meth:`~bayesfuse.nets.heads.ClientHeads.from_clients`), each its Laplace posterior
        (Kronecker-factored, :mod:`bayesfuse.inference.client_heads`) where the nodes sent
        summaries, mixed by their class counts (the replies', else their summaries'; uniformly when
        neither gives every node's, as ``fuse_states`` weights them).

        Parameters
        ----------
        like : nn.Module
            A network of the clients' architecture, rebuilt at the fused widths.
        pool : {"linear", "log"}, optional
            The heads' mixture or geometric pool; by default ``"log"`` for one-shot heads with
            summaries (as ``bayesfuse.fuse``), ``"linear"`` otherwise.

        Returns
        -------
        ClientHeads
            One head per valid output fit; each node's class shares from the class counts its
            reply to the fusion round reported (``class_counts_key``).

        Raises
        ------
        ValueError
            No refit round has run, or a node that sent a fit reported no class counts.
        """
        if self._refitted is None and self.second_round != "refit" and self._one_shot is not None:
            return self._one_shot_heads(like, pool)
        return self._refit_heads(like, pool or "linear", "or with second_round=None for the one-shot heads")

    def _one_shot_heads(self, like: nn.Module, pool: str | None) -> ClientHeads:
        """:meth:`client_heads` of the last one-shot fusion (PFNM, NAFI: one global unit per unit)."""
        from bayesfuse.methods import ONE_SHOT_HEADS

        result, inputs = self.last_fusion, cast(dict, self._one_shot)
        if result is None or self.method not in ONE_SHOT_HEADS or result.kind != "network":
            raise ValueError(
                f"one-shot client heads need networks fused by {' or '.join(ONE_SHOT_HEADS)} (one global unit per "
                f"unit); this strategy fuses with {self.method!r}"
            )
        network = rebuild(like, tensor_state(result.state), self.spec)
        assignments = {g: layer.assignments for g, layer in zip(result.groups, result.layers)}
        pool = pool or default_pool(inputs["summaries"])
        return self._smoothed(
            ClientHeads.from_clients(
                network, result.spec, inputs["states"], assignments, inputs["counts"], inputs["summaries"], pool=pool
            )
        )

    def _summaries(self, good: list[_Reply]) -> tuple[list[ClientSummary] | None, list[_Reply]]:
        """The summaries to fuse with (None: data-free), and the replies left once a summary
        of another network or with bad values has rejected its reply."""
        if self.summaries == "none" or self.kind not in methods.METHODS[self.method].summaries:
            return None, good
        kept = []
        for r in good:
            try:
                if r.summary is not None:
                    check_summary(r.summary, r.state, f"node {r.node}")
                kept.append(r)
            except SummaryError as err:
                self._reject(r.node, str(err))
        without = [r.node for r in kept if r.summary is None]
        if without and len(without) < len(kept):
            log(WARNING, "nodes %s sent no summary: this round is fused data-free", without)
        if not kept or without:
            return None, kept
        return cast(list[ClientSummary], [r.summary for r in kept]), kept


def _digest(reply: _Reply) -> str:
    return state_digest(reply.state)


def _fit_digest(fit) -> str:
    return state_digest({"weight": fit.weight, "gram": fit.gram, "curvature": fit.curvature, "n": np.asarray([fit.n])})


def _output_layer(state: dict) -> str | None:
    """The name of the network's output layer: the last entry ``NAME.weight`` of two dimensions
    that has a ``NAME.bias`` (a Linear layer's); ``None`` if there is none."""
    names = [
        k[: -len(".weight")]
        for k, v in state.items()
        if k.endswith(".weight") and np.ndim(v) == 2 and k[: -len(".weight")] + ".bias" in state
    ]
    return names[-1] if names else None


def _signature(spec: PermutationSpec, state: dict) -> tuple:
    """Entry names and their unpermuted dimensions: what must agree between clients."""
    state = spec.split(state)  # an entry reading streams side by side: its pieces
    return tuple(
        (k, tuple(None if ax is not None else state[k].shape[d] for d, ax in enumerate(axes)))
        for k, axes in spec.axes.items()
    )


def _difference(sig: tuple, common: tuple) -> str:
    mine, theirs = dict(sig), dict(common)
    if mine.keys() != theirs.keys():
        return f"entries {sorted(set(mine) ^ set(theirs))[:4]}"
    k = next(k for k in mine if mine[k] != theirs[k])
    return f"{k!r} has fixed dimensions {mine[k]} instead of {theirs[k]}"
