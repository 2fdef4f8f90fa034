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

``MatchedAveraging(second_round="refit")`` makes the last round a refit of the fused network's
output layer: each client answers the server's message (``"bayesfuse-round": "output_fit"`` in
its config) with :func:`output_fit_reply`, its Laplace fit of that layer on the fused features of
its own data, and the server multiplies the fits into the output layer and its covariance
(:meth:`MatchedAveraging.laplace`). ``second_round="temperature"`` makes it the temperature
round: the server sends the fused network and, after PFNM or NAFI with summaries, the clients'
own heads on it; each client answers (``"bayesfuse-round": "temperature"``) with
:func:`temperature_reply`, its summed NLL of each candidate at each temperature, and the server
keeps the best pair (:meth:`MatchedAveraging.tempered`).

Replies that carry an error or never come are skipped and reported (``failed-replies``);
replies whose arrays do not fit the architecture are rejected with the node named
(``rejected-replies``), not fatal.

:func:`metrics_aggregation` makes a ``train_metrics_aggr_fn`` for Flower's own strategies
(FedAvg and the others) that sums the clients' ``class-counts`` instead of averaging them.
"""

try:
    import flwr.app  # noqa: F401 (the optional dependency, checked before the modules that use it)
except ImportError as err:  # pragma: no cover - exercised only without flwr
    raise ImportError(
        "bayesfuse.integrations.flower needs Flower (flwr >= 1.21): pip install 'bayesfuse[flower]'"
    ) from err

from bayesfuse.integrations.flower.fedma import FEDMA_LOCAL, FEDMA_ROUND, FedMA
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
    heads_to_record,
    metrics_aggregation,
    output_fit_reply,
    output_fit_to_records,
    record_to_heads,
    record_to_state,
    records_to_output_fit,
    records_to_summary,
    state_digest,
    state_to_record,
    summary_to_records,
    temperature_candidates,
    temperature_reply,
)
from bayesfuse.integrations.flower.strategy import MatchedAveraging

__all__ = [
    "MatchedAveraging",
    "FedMA",
    "metrics_aggregation",
    "state_to_record",
    "record_to_state",
    "state_digest",
    "summary_to_records",
    "records_to_summary",
    "output_fit_reply",
    "output_fit_to_records",
    "records_to_output_fit",
    "FEDMA_LOCAL",
    "FEDMA_ROUND",
    "SUMMARY_KEY",
    "SUMMARY_META_KEY",
    "OUTPUT_FIT_KEY",
    "OUTPUT_FIT_META_KEY",
    "ROUND_KEY",
    "OUTPUT_FIT",
    "TEMPERATURE",
    "HEADS_KEY",
    "TEMPERATURE_NLL_KEY",
    "SHARED",
    "SHARED_COUNTS",
    "CLIENT_HEADS",
    "TRACE_MATCHED",
    "EKFAC_HEADS",
    "DIAGONAL_HEADS",
    "temperature_reply",
    "temperature_candidates",
    "SHARED_POSTERIOR_KEY",
    "COUNTS_ARRAYS_KEY",
    "COUNTS_POSTERIOR_KEY",
    "heads_to_record",
    "record_to_heads",
]
