"""Flower records of bayesfuse's arrays: state_dicts, client summaries, and a metrics
aggregation that sums class counts (:mod:`bayesfuse.integrations.flower`)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from bayesfuse.checkpoints import tensors_sha256
from bayesfuse.nets.state import numpy_state
from bayesfuse.summaries import (
    SUMMARY_FORMAT,
    SUMMARY_VERSION,
    ClientSummary,
    SummaryError,
    summary_arrays,
    summary_from_arrays,
)

#: Keys of a client summary in a reply: its arrays (ArrayRecord) and its metadata (ConfigRecord).
SUMMARY_KEY = "summary"
SUMMARY_META_KEY = "summary-meta"

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord]


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



def state_digest(state) -> str:
    """The digest that orders replies: :func:`~bayesfuse.checkpoints.tensors_sha256` of the state
    (names, dtypes, shapes, bytes), the rule by which ``bayesfuse fuse`` orders files and
    :func:`bayesfuse.fuse` its models (:mod:`bayesfuse.client_order`), so the same networks fuse
    alike through every entry point.

    Parameters
    ----------
    state : mapping of str to array

    Returns
    -------
    str
    """
    return tensors_sha256({k: torch.as_tensor(np.ascontiguousarray(np.asarray(v))) for k, v in state.items()})

