""":class:`MatchedAveraging`, and the reading of replies both strategies share
(:mod:`bayesfuse.integrations.flower`)."""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Iterable

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp.strategy import FedAvg

from bayesfuse import methods
from bayesfuse.core import fuse_states
from bayesfuse.inference.spec import PermutationSpec, spec_for_state_dict
from bayesfuse.integrations.flower.records import (
    SUMMARY_KEY,
    SUMMARY_META_KEY,
    _metric_record,
    record_to_state,
    records_to_summary,
    state_digest,
    state_to_record,
)
from bayesfuse.models.bnn_posterior import BNNPosterior
from bayesfuse.models.bnn_sites import is_bnn_state
from bayesfuse.summaries import (
    ClientSummary,
    SummaryError,
    check_summary,
)


@dataclass
class _Reply:
    node: int
    state: dict
    num_examples: float
    class_counts: np.ndarray | None
    summary: ClientSummary | None = None


class _Fusion(FedAvg):
    """What both strategies share: reading, checking and ordering the clients' replies."""

    kind = "network"

    def __init__(self, *, spec: PermutationSpec | None = None, class_counts_key: str = "class-counts", seed: int = 0,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.class_counts_key = class_counts_key
        self.seed = seed
        self.rejected: list[tuple[int, str]] = []
        self.failed: list[tuple[int, str]] = []

    def _collect(self, replies: Iterable[Message]) -> list[_Reply]:
        """The replies that carry arrays, in the order of their contents' hashes; failed ones go
        to ``self.failed``, ones without arrays to ``self.rejected``."""
        collected, n_failed = [], 0
        for msg in sorted(replies, key=lambda m: m.metadata.src_node_id):
            node = msg.metadata.src_node_id
            if msg.has_error():
                n_failed += 1
                self.failed.append((node, str(msg.error.reason)))
                log(WARNING, "node %d: reply skipped (%s)", node, msg.error.reason)
                continue
            content = msg.content
            record = content.array_records.get(self.arrayrecord_key)
            if record is None:
                self._reject(node, f"no ArrayRecord under {self.arrayrecord_key!r}")
                continue
            metrics = _metric_record(content) or MetricRecord()
            counts = metrics.get(self.class_counts_key)
            summary = content.array_records.get(SUMMARY_KEY)
            if summary is not None:
                try:
                    summary = records_to_summary(summary, content.config_records.get(SUMMARY_META_KEY), f"node {node}")
                except SummaryError as err:
                    self._reject(node, str(err))
                    continue
            collected.append(_Reply(node, record_to_state(record), float(metrics.get(self.weighted_by_key, 1.0)),
                                    None if counts is None else np.asarray(counts, dtype=np.float64), summary))
        log(INFO, "aggregate_train: Received %s results and %s failures", len(collected), n_failed)
        return sorted(collected, key=_digest)

    def _reject(self, node: int, reason: str) -> None:
        self.rejected.append((node, reason))
        log(WARNING, "node %d: reply rejected: %s", node, reason)

    def _check(self, replies: list[_Reply],
               spec: PermutationSpec | None) -> tuple[PermutationSpec | None, list[_Reply]]:
        """Replies that fit the architecture: ``spec``, or else the one most nodes share (a
        single odd node cannot reject all the others by arriving first)."""
        if self.kind == "bnn":
            good = []
            for r in replies:
                try:
                    if not is_bnn_state(r.state):
                        raise ValueError(f"node {r.node}: not a HorseshoeBNN state_dict "
                                         f"(keys {sorted(r.state)[:4]}...)")
                    BNNPosterior.from_state(r.state, f"node {r.node}")
                    good.append(r)
                except (ValueError, TypeError) as err:
                    self._reject(r.node, str(err))
            return None, good
        specs = {}
        for r in replies:
            try:
                own = spec or spec_for_state_dict(r.state, name=f"node {r.node}")
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
                good.append(r)
            else:
                self._reject(r.node, f"node {r.node}: a different architecture from the one {n_common} of "
                                     f"{len(specs)} nodes share ({_difference(specs[r.node][1], common)})")
        return specs[good[0].node][0], good


class MatchedAveraging(_Fusion):
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
        The clients' architecture; derived from the first reply's entries when omitted
        (:func:`~bayesfuse.inference.spec.spec_for_state_dict`).
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
    **kwargs
        Passed to ``flwr.serverapp.strategy.FedAvg`` (sampling, record keys).
    """

    def __init__(self, method: str = "pfnm", *, kind: str | None = None, spec: PermutationSpec | None = None,
                 hyper: dict | None = None, class_counts_key: str = "class-counts", seed: int = 0,
                 summaries: str = "auto", **kwargs) -> None:
        choices = methods.names(needs_data=False, baseline=False)
        if method not in choices:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(choices)} (FedAvg is flwr's "
                             "own strategy; FedMA is the FedMA strategy)")
        self.kind = kind if kind is not None else methods.METHODS[method].kinds[0]
        methods.resolve(method, self.kind, hyper)  # a kind the method does not take, bad keys: refused here
        if (hyper or {}).get("head", "shared") != "shared":
            raise ValueError("head='clients' builds a fused model with one output layer per client, which the "
                             "clients' HorseshoeBNN cannot take; the strategy sends back the shared head")
        if summaries not in ("auto", "none"):
            raise ValueError(f"unknown summaries={summaries!r}; choose auto or none")
        super().__init__(spec=spec, class_counts_key=class_counts_key, seed=seed, **kwargs)
        self.method = method
        self.hyper = dict(hyper or {})
        self.summaries = summaries
        self.last_fusion = None

    def summary(self) -> None:
        """Log the strategy's settings (Flower's, then the fusion's)."""
        super().summary()
        log(INFO, "\t└──> bayesfuse %s fusion, hyper-parameters %s", self.method, self.hyper)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
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
            ``summary-bytes``.
        """
        self.rejected, self.failed = [], []
        spec, good = self._check(self._collect(replies), self.spec)
        summaries, good = self._summaries(good)
        if not good:
            log(WARNING, "round %d: no valid replies to fuse (%d failed, %d rejected)", server_round,
                len(self.failed), len(self.rejected))
            return None, None
        counts = None
        if all(r.class_counts is not None for r in good):
            counts = np.stack([r.class_counts for r in good])
        result = fuse_states([r.state for r in good], self.method, spec=spec, class_counts=counts, seed=self.seed,
                             names=[f"node {r.node}" for r in good], summaries=summaries, **self.hyper)
        fused, sizes = result.state, result.sizes
        objective = [float(layer.objective[-1]) for layer in result.layers]
        self.last_fusion = result
        metrics = MetricRecord({
            "num-examples": float(sum(r.num_examples for r in good)),
            "global-sizes": [int(s) for s in sizes],
            "objective": objective,
            "fused-replies": len(good),
            "failed-replies": len(self.failed),
            "rejected-replies": len(self.rejected),
            "summaries-used": int(summaries is not None),
            "summary-bytes": int(sum(s.nbytes for s in summaries or ())),
        })
        ref = good[0].state
        return state_to_record({k: np.asarray(fused[k]).astype(ref[k].dtype) for k in ref}), metrics


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
        return [r.summary for r in kept], kept


def _digest(reply: _Reply) -> str:
    return state_digest(reply.state)


def _signature(spec: PermutationSpec, state: dict) -> tuple:
    """Entry names and their unpermuted dimensions: what must agree between clients."""
    return tuple((k, tuple(None if ax is not None else state[k].shape[d] for d, ax in enumerate(axes)))
                 for k, axes in spec.axes.items())


def _difference(sig: tuple, common: tuple) -> str:
    mine, theirs = dict(sig), dict(common)
    if mine.keys() != theirs.keys():
        return f"entries {sorted(set(mine) ^ set(theirs))[:4]}"
    k = next(k for k in mine if mine[k] != theirs[k])
    return f"{k!r} has fixed dimensions {mine[k]} instead of {theirs[k]}"


