"""Matched averaging on Flower (flwr >= 1.21, the Message API): a strategy and a FedMA server loop.

Install with ``pip install 'bayesfuse[flower]'``; importing :mod:`bayesfuse` never needs flwr.

* :class:`MatchedAveraging` is a ``flwr.serverapp.strategy.FedAvg`` whose ``aggregate_train``
  fuses the clients' returned state_dicts with bayesfuse (PFNM or NAFI layer-wise matching, or
  KL-fusion of HorseshoeBNN posteriors sent as ``loc``/``log_scale`` arrays) instead of
  averaging them coordinate by coordinate. Outgoing weights are weighted by the clients' class
  counts when they report them (``"class-counts"`` in their MetricRecord), and the fused
  model, possibly wider than the clients', is what the next round sends: clients rebuild their
  network from it (:func:`bayesfuse.nets.arch.rebuild`).
* :func:`fedma_server` runs FedMA (Wang et al. 2020, Algorithm 1) as a server loop: one
  ``train.local`` round, then per hidden layer a ``train.fedma`` round in which each client gets
  its own message (the global layers so far, its next layer mapped onto the global units, the
  names of the frozen entries) and returns its retrained network.

Replies that carry an error or never come are skipped and reported (``failed-replies``);
replies whose arrays do not fit the architecture are rejected with the node named
(``rejected-replies``), not fatal.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

try:
    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg
except ImportError as err:  # pragma: no cover - exercised only without flwr
    raise ImportError(
        "bayesfuse.integrations.flower needs Flower (flwr >= 1.21): pip install 'bayesfuse[flower]'"
    ) from err

from bayesfuse import methods
from bayesfuse.core import fuse_states
from bayesfuse.inference.fedma import FedMAResult, fedma
from bayesfuse.models.bnn_posterior import BNNPosterior
from bayesfuse.models.bnn_sites import is_bnn_state
from bayesfuse.inference.spec import PermutationSpec, spec_for_state_dict
from bayesfuse.nets.state import numpy_state

__all__ = ["MatchedAveraging", "fedma_server", "FedMAServerResult", "state_to_record", "record_to_state", "state_digest",
           "FEDMA_LOCAL", "FEDMA_ROUND"]

log = logging.getLogger("bayesfuse.flower")

#: Message types of the FedMA loop (``@app.train("local")`` / ``@app.train("fedma")`` on clients).
FEDMA_LOCAL = "train.local"
FEDMA_ROUND = "train.fedma"


def state_to_record(state) -> ArrayRecord:
    """A state_dict (tensors or NumPy arrays) as an ArrayRecord, floats as float32."""
    tensors = {}
    for k, v in state.items():
        t = torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v.detach().cpu()
        tensors[k] = t.float() if t.is_floating_point() else t
    return ArrayRecord(torch_state_dict=tensors)


def record_to_state(record: ArrayRecord) -> dict[str, np.ndarray]:
    """An ArrayRecord as a NumPy state_dict (in its order)."""
    return numpy_state(record.to_torch_state_dict())


def _metric_record(content: RecordDict) -> MetricRecord | None:
    records = list(content.metric_records.values())
    return records[0] if records else None


@dataclass
class _Reply:
    node: int
    state: dict
    num_examples: float
    class_counts: np.ndarray | None


class MatchedAveraging(FedAvg):
    """FedAvg whose aggregation is bayesfuse's matched (or KL) fusion.

    Parameters
    ----------
    method : {"pfnm", "nafi", "kl"}
        PFNM / NAFI layer-wise matching of point-estimate networks, or KL-fusion of
        HorseshoeBNN state_dicts.
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
    **kwargs
        Passed to ``flwr.serverapp.strategy.FedAvg`` (sampling, record keys).
    """

    def __init__(self, method: str = "pfnm", *, spec: PermutationSpec | None = None, hyper: dict | None = None,
                 class_counts_key: str = "class-counts", seed: int = 0, **kwargs) -> None:
        choices = [m for m in methods.names(needs_data=False) if m != "fedavg"]
        if method not in choices:
            raise ValueError(f"unknown method {method!r}; choose one of {', '.join(choices)} (FedAvg is flwr's "
                             "own strategy; FedMA runs as fedma_server)")
        # point-estimate networks for pfnm/nafi, HorseshoeBNN posteriors for kl; bad keys fail here
        self.kind = "bnn" if method == "kl" else "network"
        methods.resolve(method, self.kind, hyper)
        super().__init__(**kwargs)
        self.method = method
        self.spec = spec
        self.hyper = dict(hyper or {})
        self.class_counts_key = class_counts_key
        self.seed = seed
        self.last_fusion = None
        self.rejected: list[tuple[int, str]] = []
        self.failed: list[tuple[int, str]] = []

    def summary(self) -> None:
        super().summary()
        log.info("\t└──> bayesfuse %s fusion, hyper-parameters %s", self.method, self.hyper)

    # ------------------------------------------------------------------ replies

    def _collect(self, replies: Iterable[Message]) -> list[_Reply]:
        self.rejected, self.failed = [], []
        collected = []
        for msg in sorted(replies, key=lambda m: m.metadata.src_node_id):
            node = msg.metadata.src_node_id
            if msg.has_error():
                self.failed.append((node, str(msg.error.reason)))
                log.warning("node %d: reply skipped (%s)", node, msg.error.reason)
                continue
            content = msg.content
            record = content.array_records.get(self.arrayrecord_key)
            if record is None:
                self.rejected.append((node, f"no ArrayRecord under {self.arrayrecord_key!r}"))
                continue
            metrics = _metric_record(content) or MetricRecord()
            counts = metrics.get(self.class_counts_key)
            collected.append(_Reply(node, record_to_state(record), float(metrics.get(self.weighted_by_key, 1.0)),
                                    None if counts is None else np.asarray(counts, dtype=np.float64)))
        return sorted(collected, key=_digest)

    def _check(self, replies: list[_Reply]) -> tuple[PermutationSpec | None, list[_Reply]]:
        """Replies that fit the architecture: the strategy's spec, or else the one most nodes
        share (a single odd node cannot reject all the others by arriving first)."""
        def reject(r: _Reply, reason: str) -> None:
            self.rejected.append((r.node, reason))
            log.warning("node %d: reply rejected: %s", r.node, reason)

        if self.method == "kl":
            good = []
            for r in replies:
                try:
                    if not is_bnn_state(r.state):
                        raise ValueError(f"node {r.node}: not a HorseshoeBNN state_dict (keys {sorted(r.state)[:4]}...)")
                    BNNPosterior.from_state(r.state, f"node {r.node}")
                    good.append(r)
                except (ValueError, TypeError) as err:
                    reject(r, str(err))
            return None, good
        specs = {}
        for r in replies:
            try:
                spec = self.spec or spec_for_state_dict(r.state, name=f"node {r.node}")
                spec.check(r.state, f"node {r.node}")
                specs[r.node] = (spec, _signature(spec, r.state))
            except (ValueError, TypeError) as err:
                reject(r, str(err))
        if not specs:
            return self.spec, []
        signatures = [sig for _, sig in specs.values()]
        common = max(signatures, key=signatures.count)  # ties: the first in canonical order
        n_common = signatures.count(common)
        good = []
        for r in replies:
            if r.node not in specs:
                continue
            spec, sig = specs[r.node]
            if sig == common:
                good.append(r)
            else:
                reject(r, f"node {r.node}: a different architecture from the one {n_common} of "
                          f"{len(specs)} nodes share ({_difference(sig, common)})")
        return specs[good[0].node][0], good

    # ------------------------------------------------------------------ aggregation

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        """Fuse the valid replies; ``(None, None)`` when none is left."""
        collected = self._collect(replies)
        spec, good = self._check(collected)
        if not good:
            log.warning("round %d: no valid replies to fuse (%d failed, %d rejected)", server_round,
                        len(self.failed), len(self.rejected))
            return None, None
        counts = None
        if all(r.class_counts is not None for r in good):
            counts = np.stack([r.class_counts for r in good])
        result = fuse_states([r.state for r in good], self.method, spec=spec, class_counts=counts, seed=self.seed,
                             names=[f"node {r.node}" for r in good], **self.hyper)
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
        })
        ref = good[0].state
        return state_to_record({k: np.asarray(fused[k]).astype(ref[k].dtype) for k in ref}), metrics


def state_digest(state) -> str:
    """sha256 of a state_dict's names and bytes: the canonical order of replies."""
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


@dataclass
class FedMAServerResult:
    """What :func:`fedma_server` returns: the global arrays and FedMA's record."""

    arrays: ArrayRecord
    result: FedMAResult
    nodes: list[int]
    failed: list[tuple[int, str]] = field(default_factory=list)


def _send(grid, node_records: Sequence[tuple[int, RecordDict]], message_type: str, timeout: float) -> dict[int, Message]:
    messages = [Message(content=rd, message_type=message_type, dst_node_id=node) for node, rd in node_records]
    replies = grid.send_and_receive(messages=messages, timeout=timeout)
    return {m.metadata.src_node_id: m for m in replies}


def fedma_server(grid, *, spec: PermutationSpec | None = None, config: dict | None = None, timeout: float = 600.0,
                 min_nodes: int = 2, hyper: dict | None = None, seed: int = 0) -> FedMAServerResult:
    """FedMA over a Flower grid (Wang et al. 2020, Algorithm 1; NAFI Algorithm 2 with ``kl_weight``).

    1. ``train.local``: every node trains its own network and replies with its arrays and a
       MetricRecord holding ``num-examples`` and ``class-counts``.
    2. For each hidden layer, ``train.fedma``: the server matches the layer
       (:func:`bayesfuse.inference.fedma.fedma`); each node receives its own arrays and a
       ConfigRecord with ``frozen`` (JSON list of entry names) and retrains the rest.
    3. The output layer is the class-count weighted average of the last replies.

    Nodes whose replies fail or time out are dropped from the later rounds and reported.
    """
    from flwr.serverapp.strategy.strategy_utils import sample_nodes

    node_ids, _ = sample_nodes(grid, min_nodes, min_nodes)
    node_ids = sorted(node_ids)
    base = ConfigRecord({k: v for k, v in (config or {}).items()})
    first = _send(grid, [(n, RecordDict({"config": base})) for n in node_ids], FEDMA_LOCAL, timeout)
    failed, nodes, states, counts = [], [], [], []
    for n in node_ids:
        msg = first.get(n)
        if msg is None or msg.has_error():
            failed.append((n, "no reply" if msg is None else str(msg.error.reason)))
            continue
        metrics = _metric_record(msg.content) or MetricRecord()
        nodes.append(n)
        states.append(record_to_state(next(iter(msg.content.array_records.values()))))
        counts.append(np.asarray(metrics.get("class-counts", []), dtype=np.float64))
    if len(nodes) == 0:
        raise RuntimeError(f"no node answered the local training round: {failed}")
    spec = spec or spec_for_state_dict(states[0], name=f"node {nodes[0]}")
    class_counts = np.stack(counts) if all(len(c) for c in counts) else None

    def client_update(jobs: list, frozen: set) -> list:
        payload = [(nodes[j], RecordDict({"arrays": state_to_record(state),
                                          "config": ConfigRecord({**dict(base), "frozen": json.dumps(sorted(frozen))})}))
                   for j, state in jobs]
        replies = _send(grid, payload, FEDMA_ROUND, timeout)
        out = []
        for j, _ in jobs:
            msg = replies.get(nodes[j])
            if msg is None or msg.has_error():
                failed.append((nodes[j], "no reply" if msg is None else str(msg.error.reason)))
                out.append(None)
            else:
                out.append(record_to_state(next(iter(msg.content.array_records.values()))))
        return out

    settings = methods.resolve("fedma", "network", hyper)
    if settings.pop("passes") != 1:
        raise ValueError("fedma_server runs one layer-wise pass; passes > 1 is not supported here")
    result = fedma(states, spec, client_update, class_counts=class_counts, seed=seed, **settings)
    return FedMAServerResult(arrays=state_to_record(result.state_dict), result=result, nodes=nodes, failed=failed)
