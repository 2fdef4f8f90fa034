"""Matched averaging on Flower (flwr >= 1.21, the Message API): two strategies.

Install with ``pip install 'bayesfuse[flower]'``; importing :mod:`bayesfuse` never needs flwr.

* :class:`MatchedAveraging` is a ``flwr.serverapp.strategy.FedAvg`` whose ``aggregate_train``
  fuses the clients' returned state_dicts with bayesfuse (PFNM or NAFI layer-wise matching, or
  KL-fusion of HorseshoeBNN posteriors sent as ``loc``/``log_scale`` arrays) instead of
  averaging them coordinate by coordinate. Outgoing weights are weighted by the clients' class
  counts when they report them (``"class-counts"`` in their MetricRecord), and the fused
  model, possibly wider than the clients', is what the next round sends: clients rebuild their
  network from it (:func:`bayesfuse.nets.arch.rebuild`).
* :class:`FedMA` runs FedMA (Wang et al. 2020, Algorithm 1) as a strategy: one ``train.local``
  round, then per hidden layer a ``train.fedma`` round in which each client gets its own
  message (the global layers so far, its next layer mapped onto the global units, the names
  of the frozen entries) and returns its retrained network. Both run through Flower's
  ``Strategy.start``: Flower's per-round log lines, and a ``flwr.serverapp.strategy.Result``.

A client may send its summary of its own data (:func:`bayesfuse.summarize`) beside its arrays:
:func:`summary_to_records` gives an ArrayRecord of its arrays (``"summary"``) and a ConfigRecord
of its metadata (``"summary-meta"``); :class:`MatchedAveraging` reads them and fuses the
networks as Laplace posteriors when every reply carries one (``summaries="auto"``).

Replies that carry an error or never come are skipped and reported (``failed-replies``);
replies whose arrays do not fit the architecture are rejected with the node named
(``rejected-replies``), not fatal.

:func:`metrics_aggregation` makes a ``train_metrics_aggr_fn`` for Flower's own strategies
(FedAvg and the others) that sums the clients' ``class-counts`` instead of averaging them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from typing import Callable, Iterable, Sequence

import numpy as np

try:
    import torch
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.common import log
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import FedAvg, Result
except ImportError as err:  # pragma: no cover - exercised only without flwr
    raise ImportError(
        "bayesfuse.integrations.flower needs Flower (flwr >= 1.21): pip install 'bayesfuse[flower]'"
    ) from err

from bayesfuse import methods
from bayesfuse.core import fuse_states
from bayesfuse.inference.fedma import FedMAResult, FedMASteps, fedma_steps
from bayesfuse.inference.spec import PermutationSpec, spec_for_state_dict
from bayesfuse.models.bnn_posterior import BNNPosterior
from bayesfuse.models.bnn_sites import is_bnn_state
from bayesfuse.nets.state import numpy_state
from bayesfuse.summaries import (
    SUMMARY_FORMAT,
    SUMMARY_VERSION,
    ClientSummary,
    SummaryError,
    check_summary,
    summary_arrays,
    summary_from_arrays,
)

__all__ = ["MatchedAveraging", "FedMA", "metrics_aggregation", "state_to_record", "record_to_state", "state_digest",
           "summary_to_records", "records_to_summary", "FEDMA_LOCAL", "FEDMA_ROUND", "SUMMARY_KEY", "SUMMARY_META_KEY"]

#: Message types of FedMA's rounds (``@app.train("local")`` / ``@app.train("fedma")`` on clients).
FEDMA_LOCAL = "train.local"
FEDMA_ROUND = "train.fedma"

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]

#: Keys of a client summary in a reply: its arrays (ArrayRecord) and its metadata (ConfigRecord).
SUMMARY_KEY = "summary"
SUMMARY_META_KEY = "summary-meta"


def state_to_record(state) -> ArrayRecord:
    """A state_dict (tensors or NumPy arrays) as an ArrayRecord, floats as float32.

    Parameters
    ----------
    state : mapping of str to array or tensor

    Returns
    -------
    ArrayRecord
    """
    tensors = {}
    for k, v in state.items():
        t = torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v.detach().cpu()
        tensors[k] = t.float() if t.is_floating_point() else t
    return ArrayRecord(torch_state_dict=tensors)


def record_to_state(record: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord as a NumPy state_dict (in its order).

    Parameters
    ----------
    record : ArrayRecord

    Returns
    -------
    dict of str to ndarray
    """
    return numpy_state(record.to_torch_state_dict())


def summary_to_records(summary: ClientSummary) -> tuple[ArrayRecord, ConfigRecord]:
    """A client summary as Flower records: its arrays and its metadata.

    The ArrayRecord holds ``precision/<entry>`` and ``moments/<group>/<stat>`` (float32) and
    ``class_counts`` (int64), as the summary file does (:func:`bayesfuse.summaries.save_summary`);
    the ConfigRecord ``format``, ``version``, ``n-examples``, ``prior-precision`` and
    ``fingerprint``. Put them in a reply under :data:`SUMMARY_KEY` and :data:`SUMMARY_META_KEY`.

    Parameters
    ----------
    summary : ClientSummary

    Returns
    -------
    tuple of (ArrayRecord, ConfigRecord)
    """
    record = {k: Array(v) for k, v in summary_arrays(summary).items()}
    meta = ConfigRecord({"format": SUMMARY_FORMAT, "version": int(summary.version),
                         "n-examples": int(summary.n_examples),
                         "prior-precision": float(summary.prior_precision), "fingerprint": summary.fingerprint})
    return ArrayRecord(array_dict=record), meta


def records_to_summary(arrays: ArrayRecord, meta: ConfigRecord | None, name: str = "client") -> ClientSummary:
    """The client summary in a reply's records (:func:`summary_to_records`).

    Raises
    ------
    SummaryError
        With one line naming ``name``: no metadata, another format or version, missing keys.
    """
    if meta is None:
        raise SummaryError(f"{name}: the summary's arrays came without its metadata (ConfigRecord "
                           f"{SUMMARY_META_KEY!r})")
    if meta.get("format") != SUMMARY_FORMAT:
        raise SummaryError(f"{name}: not a bayesfuse client summary (format {meta.get('format')!r})")
    try:
        version, n_examples = int(meta["version"]), int(meta["n-examples"])
        prior, fp = float(meta["prior-precision"]), str(meta["fingerprint"])
    except (KeyError, TypeError, ValueError):
        raise SummaryError(f"{name}: the summary's metadata is incomplete (needs version, n-examples, "
                           "prior-precision, fingerprint)") from None
    if version != SUMMARY_VERSION:
        raise SummaryError(f"{name}: summary version {version} is not one this bayesfuse reads ({SUMMARY_VERSION}); "
                           "recompute it with bayesfuse.summarize")
    return summary_from_arrays({key: arrays[key].numpy() for key in arrays.keys()}, name, version=version,
                               n_examples=n_examples, prior_precision=prior, fingerprint=fp)


def metrics_aggregation(sum_keys: Sequence[str] = ("class-counts",)) -> MetricsAggregation:
    """A metrics aggregation for Flower's strategies that sums counts instead of averaging them.

    Flower's default (``aggregate_metricrecords``) averages every value weighted by
    ``weighted_by_key``, which turns per-class example counts into meaningless fractions.

    Parameters
    ----------
    sum_keys : sequence of str
        Keys summed over the replies (element-wise for lists); ``"class-counts"`` by default.

    Returns
    -------
    callable ``(records, weighted_by_key) -> MetricRecord``
        For ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn`` of ``FedAvg`` and the
        strategies derived from it. The weighting key is totalled, the ``sum_keys`` summed and
        every other value averaged with the weights, as Flower does.

    Examples
    --------
    >>> from flwr.serverapp.strategy import FedAvg
    >>> strategy = FedAvg(train_metrics_aggr_fn=metrics_aggregation())
    """
    summed = frozenset(sum_keys)

    def aggregate(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
        metrics = [_metric_record(r) or MetricRecord() for r in records]
        weights = np.array([float(m.get(weighted_by_key, 1.0)) for m in metrics])
        shares = weights / weights.sum() if weights.sum() > 0 else np.full(len(weights), 1.0 / max(len(weights), 1))
        out = MetricRecord()
        keys = list(dict.fromkeys(k for m in metrics for k in m.keys()))
        for key in keys:
            values = [m[key] for m in metrics if key in m]
            if key == weighted_by_key or key in summed:
                try:
                    total = np.sum(np.asarray(values), axis=0)
                except ValueError as err:
                    raise ValueError(f"metric {key!r}: the replies' values do not add up ({err})") from None
                out[key] = total.tolist()
            elif len(values) == len(metrics):
                w = shares.reshape(-1, *([1] * (np.ndim(values[0]))))
                out[key] = (w * np.asarray(values, dtype=np.float64)).sum(0).tolist()
        return out

    return aggregate


def _metric_record(content: RecordDict) -> MetricRecord | None:
    records = list(content.metric_records.values())
    return records[0] if records else None


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


def state_digest(state) -> str:
    """sha256 of a state_dict's names and bytes: the canonical order of replies.

    Parameters
    ----------
    state : mapping of str to array

    Returns
    -------
    str
    """
    h = hashlib.sha256()
    for k, v in state.items():
        h.update(k.encode())
        h.update(np.ascontiguousarray(np.asarray(v, dtype=np.float32 if np.issubdtype(np.asarray(v).dtype, np.floating)
                                                 else None)).tobytes())
    return h.hexdigest()


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


# --------------------------------------------------------------------------- FedMA


class _PausedRun:
    """:func:`~bayesfuse.inference.fedma.fedma_steps` paused at each round's retraining jobs.

    A strategy gets the clients' retrained networks one round later, in ``aggregate_train``:
    :meth:`begin` runs the generator to its first request, :meth:`resume` sends it the states and
    runs it to the next. No thread: the generator waits between the strategy's calls.
    """

    def __init__(self, steps: FedMASteps) -> None:
        self._steps = steps
        self.waiting = False

    def _step(self, states: list | None) -> tuple[str, object]:
        try:
            request = next(self._steps) if states is None else self._steps.send(states)
        except StopIteration as stop:
            self.waiting = False
            return "done", stop.value
        except Exception as err:  # reported by the strategy
            self.waiting = False
            return "error", err
        self.waiting = True
        return "jobs", request

    def begin(self) -> tuple[str, object]:
        """Run until the first request (``("jobs", (jobs, frozen))``), or the end (``("done",
        FedMAResult)`` or ``("error", exception)``)."""
        return self._step(None)

    def resume(self, states: list) -> tuple[str, object]:
        """Send the paused request its states and run to the next request or the end."""
        return self._step(list(states))

    def stop(self) -> None:
        """End a paused run."""
        if self.waiting:
            self.waiting = False
            self._steps.close()


class FedMA(_Fusion):
    """FedMA as a Flower strategy (Wang et al. 2020, Algorithm 1; NAFI Algorithm 2 with ``kl_weight``).

    Rounds, ``1 + len(spec.groups)`` of them (:meth:`start` sets ``num_rounds``):

    1. ``train.local`` (:data:`FEDMA_LOCAL`): every sampled node trains its own network and
       replies with its arrays and a MetricRecord holding ``num-examples`` and ``class-counts``.
       The server matches the first hidden group (:func:`bayesfuse.inference.fedma.fedma`).
    2. For each hidden group, ``train.fedma`` (:data:`FEDMA_ROUND`): each node receives its own
       message, the global layers so far and its next layer mapped onto the global units, and a
       ConfigRecord whose ``frozen`` is the JSON list of the entries to keep; it retrains the
       rest and replies. The server matches the next group; after the last one, the output
       layer is the class-count weighted average of the replies and the global network is the
       round's ArrayRecord (so ``Result.arrays``).

    Nodes whose replies fail, never come or do not fit the arrays they were sent are dropped
    from the later rounds and reported (``failed``, ``rejected``, ``dropped``). The rounds
    before the last have no global network: server-side evaluation (``evaluate_fn``) runs on
    ``initial_arrays`` and after the last round, client-side evaluation after the last round.

    Parameters
    ----------
    spec : PermutationSpec, optional
        The clients' architecture; derived from ``initial_arrays`` in :meth:`start` when
        omitted (:func:`~bayesfuse.inference.spec.spec_for_state_dict`).
    hyper : dict, optional
        The ``"fedma"`` row of :mod:`bayesfuse.methods`: ``noise_var``, ``prior_var``,
        ``gamma0``, ``kl_weight``, ``cost``, ``n_iter``. Checked when the strategy is made;
        ``passes`` must be 1.
    class_counts_key : str
        Key of a reply's per-class example counts in its MetricRecord (the output layer's weights).
    seed : int
        Matching seed. The first round's replies are put in the order of their contents'
        hashes, so neither the arrival order nor the node ids change the result.
    local_message_type, round_message_type : str
        Message types of the first round and of the retraining rounds.
    **kwargs
        Passed to ``flwr.serverapp.strategy.FedAvg`` (sampling of the first round and of the
        evaluation, record keys).

    Attributes
    ----------
    fedma_result : FedMAResult or None
        The finished run's record (matchings, sizes, bytes, history); ``None`` before the end.
    nodes : list of int
        The nodes of the run, in the order FedMA indexes its clients.
    failed, rejected : list of (int, str)
        Replies skipped over the run, with the reason.
    dropped : list of int
        Nodes dropped from the later rounds.
    error : Exception or None
        What stopped the run early, if anything (every node lost, say).
    """

    def __init__(self, *, spec: PermutationSpec | None = None, hyper: dict | None = None,
                 class_counts_key: str = "class-counts", seed: int = 0, local_message_type: str = FEDMA_LOCAL,
                 round_message_type: str = FEDMA_ROUND, **kwargs) -> None:
        settings = methods.resolve("fedma", "network", hyper)
        if settings.pop("passes") != 1:
            raise ValueError("the FedMA strategy runs one layer-wise pass; passes > 1 is not supported here")
        super().__init__(spec=spec, class_counts_key=class_counts_key, seed=seed, **kwargs)
        self.method = "fedma"
        self.hyper = dict(hyper or {})
        self.settings = settings
        self.local_message_type = local_message_type
        self.round_message_type = round_message_type
        self._run: _PausedRun | None = None
        self._arch = spec  # the architecture a run checks its first replies against
        self._reset(spec)

    def _reset(self, spec: PermutationSpec | None) -> None:
        if getattr(self, "_run", None) is not None:
            self._run.stop()
        self._run = None
        self._spec = spec
        self._pending: tuple[list, set, str] | None = None
        self._matched = 0
        self._final_round: int | None = None
        self._examples: dict[int, float] = {}
        self.fedma_result: FedMAResult | None = None
        self.nodes: list[int] = []
        self.failed, self.rejected = [], []
        self.dropped: list[int] = []
        self.error: BaseException | None = None

    def num_rounds(self, arrays: ArrayRecord) -> int:
        """The rounds FedMA takes for the network ``arrays``: one local round, one per hidden group.

        Parameters
        ----------
        arrays : ArrayRecord
            A network of the clients' architecture.

        Returns
        -------
        int
        """
        spec = self.spec or spec_for_state_dict(record_to_state(arrays), name="initial_arrays")
        return 1 + len(spec.groups)

    def summary(self) -> None:
        """Log the strategy's settings (Flower's, then FedMA's)."""
        super().summary()
        log(INFO, "\t└──> FedMA: a local round, then a round per hidden group; hyper-parameters %s",
            self.settings)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int | None = None, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Run FedMA through Flower's ``Strategy.start`` loop.

        Parameters
        ----------
        grid : Grid
        initial_arrays : ArrayRecord
            A network of the clients' architecture: it gives the number of rounds (and the
            spec when the strategy has none). The clients train their own networks in round 1;
            it is not sent.
        num_rounds : int, optional
            ``1 + len(spec.groups)``, the default; any other value is an error.
        timeout : float
            Seconds to wait for the replies of each round.
        train_config, evaluate_config : ConfigRecord, optional
            Sent to the nodes in every training / evaluation message.
        evaluate_fn : callable ``(server_round, arrays) -> MetricRecord or None``, optional
            Server-side evaluation, called before round 1 (on ``initial_arrays``) and after the
            last round (on the global network).

        Returns
        -------
        Result
            ``arrays`` is the global network; ``train_metrics_clientapp`` holds each round's
            metrics, the last one ``global-sizes``, ``fedma-rounds``, ``bytes-up``/``bytes-down``.
        """
        spec = self.spec or spec_for_state_dict(record_to_state(initial_arrays), name="initial_arrays")
        needed = 1 + len(spec.groups)
        if num_rounds is None:
            num_rounds = needed
        elif num_rounds != needed:
            raise ValueError(f"FedMA takes {needed} rounds for this network (a local round, then one per hidden "
                             f"group {list(spec.groups)}); got num_rounds={num_rounds}")
        self._arch = spec
        self._reset(spec)
        try:
            return super().start(grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds, timeout=timeout,
                                 train_config=train_config, evaluate_config=evaluate_config,
                                 evaluate_fn=None if evaluate_fn is None else self._on_global(evaluate_fn))
        finally:
            if self._run is not None:
                self._run.stop()

    def _on_global(self, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None]
                   ) -> Callable[[int, ArrayRecord], MetricRecord | None]:
        """``evaluate_fn`` called on ``initial_arrays`` and on the global network, ``None`` in between."""
        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 or server_round == self._final_round:
                return evaluate_fn(server_round, arrays)
            return None  # no global network between the first round and the last

        return evaluate

    # ------------------------------------------------------------------ training rounds

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Round 1: a ``train.local`` message to each sampled node (the config only). Later
        rounds: one ``train.fedma`` message per node still taking part, with its own arrays.

        Parameters
        ----------
        server_round : int
        arrays : ArrayRecord
            Not sent: the clients start from their own networks.
        config : ConfigRecord
        grid : Grid

        Returns
        -------
        list of Message
        """
        if server_round == 1:
            sampled = list(super().configure_train(server_round, arrays, config, grid))  # samples and logs
            content = RecordDict({self.configrecord_key: ConfigRecord(dict(config))})
            return [Message(content=content, message_type=self.local_message_type, dst_node_id=m.metadata.dst_node_id)
                    for m in sampled]
        if self._pending is None:
            log(INFO, "configure_train: no FedMA round to run (%s)",
                "the run has ended" if self.fedma_result is not None or self.error is not None else "no local round")
            return []
        jobs, frozen, group = self._pending
        round_config = ConfigRecord({**dict(config), "server-round": server_round,
                                     "frozen": json.dumps(sorted(frozen))})
        log(INFO, "configure_train: %d nodes retrain the layers above group %r (%d entries frozen)", len(jobs),
            group, len(frozen))
        return [Message(content=RecordDict({self.arrayrecord_key: state_to_record(state),
                                            self.configrecord_key: round_config}),
                        message_type=self.round_message_type, dst_node_id=self.nodes[j])
                for j, state in jobs]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Round 1: start FedMA on the local networks. Later rounds: hand FedMA the retrained
        networks. FedMA matches the next group (metrics only) or, after the last, returns the
        global network.

        Parameters
        ----------
        server_round : int
        replies : iterable of Message

        Returns
        -------
        tuple of (ArrayRecord or None, MetricRecord or None)
            The global network in the last round, ``None`` before; the round's metrics.
        """
        if server_round == 1:
            return self._aggregate_local(list(replies))
        return self._aggregate_retrained(server_round, list(replies))

    def _aggregate_local(self, replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._reset(self._arch)
        spec, good = self._check(self._collect(replies), self._arch)
        if not good:
            self.error = RuntimeError("no node answered the local training round")
            log(ERROR, "FedMA stopped in round 1: no valid replies (%d failed, %d rejected)", len(self.failed),
                len(self.rejected))
            return None, None
        self._spec = spec
        self.nodes = [r.node for r in good]
        self._examples = {r.node: r.num_examples for r in good}
        counts = np.stack([r.class_counts for r in good]) if all(r.class_counts is not None for r in good) else None
        states, settings, seed = [r.state for r in good], dict(self.settings), self.seed
        self._run = _PausedRun(fedma_steps(states, spec, class_counts=counts, seed=seed, **settings))
        metrics = {"num-examples": float(sum(self._examples.values())), "local-replies": len(good),
                   "failed-replies": len(self.failed), "rejected-replies": len(self.rejected)}
        return self._advance(1, self._run.begin(), metrics)

    def _aggregate_retrained(self, server_round: int,
                             replies: list[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._pending is None or self._run is None:
            log(WARNING, "aggregate_train: round %d has no FedMA step to take; replies ignored", server_round)
            return None, None
        jobs, _, _ = self._pending
        by_node = {m.metadata.src_node_id: m for m in replies}
        n_failed, n_rejected, examples = len(self.failed), len(self.rejected), 0.0
        updated: list[dict | None] = []
        for j, sent in jobs:
            node = self.nodes[j]
            msg = by_node.get(node)
            if msg is None or msg.has_error():
                reason = "no reply" if msg is None else str(msg.error.reason)
                self.failed.append((node, reason))
                log(WARNING, "node %d: dropped from FedMA (%s)", node, reason)
                updated.append(None)
                continue
            record = msg.content.array_records.get(self.arrayrecord_key)
            problem = f"no ArrayRecord under {self.arrayrecord_key!r}" if record is None else None
            state = None if record is None else record_to_state(record)
            problem = problem or _mismatch(sent, state, node)
            if problem:
                self._reject(node, f"{problem}; dropped from FedMA")
                updated.append(None)
                continue
            metrics = _metric_record(msg.content) or MetricRecord()
            examples += float(metrics.get(self.weighted_by_key, self._examples.get(node, 1.0)))
            updated.append(state)
        n_failed, n_rejected = len(self.failed) - n_failed, len(self.rejected) - n_rejected
        log(INFO, "aggregate_train: Received %s results and %s failures", len(jobs) - n_failed - n_rejected, n_failed)
        self.dropped += [self.nodes[j] for (j, _), u in zip(jobs, updated) if u is None]
        metrics = {"num-examples": examples, "retrained-replies": len(jobs) - n_failed - n_rejected,
                   "failed-replies": n_failed, "rejected-replies": n_rejected}
        if all(u is None for u in updated):
            self._run.stop()
            self._run, self._pending = None, None
            self.error = RuntimeError(f"every node was lost in round {server_round}")
            log(ERROR, "FedMA stopped in round %d: no node returned a retrained network (%d failed, %d rejected)",
                server_round, n_failed, n_rejected)
            return None, MetricRecord(metrics)
        return self._advance(server_round, self._run.resume(updated), metrics)

    def _advance(self, server_round: int, step: tuple[str, object],
                 metrics: dict) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's outcome from FedMA's next step: the next jobs, the end, or an error."""
        kind, value = step
        self._pending = None
        if kind == "jobs":
            jobs, frozen = value
            group = self._spec.groups[self._matched]
            self._matched += 1
            self._pending = (jobs, frozen, group)
            width = self._spec.sizes(jobs[0][1])[group]
            log(INFO, "\t└──> FedMA matched group %r: %d global units", group, width)
            return None, MetricRecord({**metrics, "matched-groups": self._matched, "global-size": width})
        self._run = None
        if kind == "error":
            self.error = value
            raise value
        result: FedMAResult = value
        self.fedma_result = result
        self._final_round = server_round
        log(INFO, "\t└──> FedMA finished: global sizes %s, %d nodes dropped", result.sizes, len(self.dropped))
        metrics.update({"global-sizes": [int(s) for s in result.sizes.values()], "fedma-rounds": result.rounds,
                        "bytes-up": result.bytes_up, "bytes-down": result.bytes_down,
                        "dropped-nodes": len(self.dropped)})
        return state_to_record(result.state_dict), MetricRecord(metrics)

    # ------------------------------------------------------------------ evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Federated evaluation of the global network, after the last round only.

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
        if self.fedma_result is None or server_round != self._final_round:
            return []
        return super().configure_evaluate(server_round, arrays, config, grid)


def _mismatch(sent: dict, state: dict, node: int) -> str | None:
    """Why a retrained network cannot be the one sent (other entries or shapes), or ``None``."""
    if set(state) != set(sent):
        return f"node {node}: entries {sorted(set(state) ^ set(sent))[:4]} differ from the ones sent"
    for k, v in sent.items():
        if np.shape(state[k]) != np.shape(v):
            return f"node {node}: {k!r} has shape {np.shape(state[k])}, it was sent with {np.shape(v)}"
    return None
