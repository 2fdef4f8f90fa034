"""Flower records of bayesfuse's arrays: state_dicts, client summaries, the clients' output fits of
the refit round, and a metrics aggregation that sums class counts
(:mod:`bayesfuse.integrations.flower`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from bayesfuse.checkpoints import heads_arrays, heads_from_arrays, tensors_sha256
from bayesfuse.inference.output_fusion import OutputFit, packed_upper, unpacked_upper
from bayesfuse.nets.state import numpy_state
from bayesfuse.summaries import (
    SUMMARY_FORMAT,
    ClientSummary,
    SummaryError,
    check_version,
    output_fit,
    summary_arrays,
    summary_from_arrays,
)

#: Keys of a client summary in a reply: its arrays (ArrayRecord) and its metadata (ConfigRecord).
SUMMARY_KEY = "summary"
SUMMARY_META_KEY = "summary-meta"

#: Keys of a client's output fit in its reply to the refit round: its arrays (ArrayRecord) and its
#: metadata (ConfigRecord).
OUTPUT_FIT_KEY = "output-fit"
OUTPUT_FIT_META_KEY = "output-fit-meta"
OUTPUT_FIT_FORMAT = "bayesfuse-output-fit"
OUTPUT_FIT_VERSION = 2  # 2: the Gram as its upper triangle
#: The config entry of a training message that names a bayesfuse round other than training, and its
#: value in the refit round (``MatchedAveraging(second_round="refit")``).
ROUND_KEY = "bayesfuse-round"
OUTPUT_FIT = "output_fit"
#: The temperature round (``MatchedAveraging(second_round="temperature")``): its value of
#: :data:`ROUND_KEY`, the key of the clients' heads the server sends beside the fused network
#: (an ArrayRecord, :func:`heads_to_record`), and the key of a client's reply.
TEMPERATURE = "temperature"
HEADS_KEY = "client-heads"
#: The fused output layer's posterior variances the temperature round sends where the fusion had
#: summaries (its shared candidate is then that layer's Laplace, as ``bayesfuse.fuse`` scores it).
SHARED_POSTERIOR_KEY = "shared-posterior"
#: Where the fusion had summaries, the same fusion with the output layer's shares by class counts
#: (``output_pool="counts"``): the entries of its network that differ from the fused network sent
#: (its output layer at least), and its output layer's posterior variances.
COUNTS_ARRAYS_KEY = "shared-counts"
COUNTS_POSTERIOR_KEY = "shared-counts-posterior"
TEMPERATURE_NLL_KEY = "temperature-nll"
#: The temperature round's candidates: the fused network as it is (its shared output layer), the
#: fusion with the output layer pooled by class counts, the clients' own heads on the fused
#: network, and the same heads each with its curvature trace-matched.
SHARED, SHARED_COUNTS = "shared", "shared, by counts"
CLIENT_HEADS, TRACE_MATCHED = "client heads", "client heads, trace-matched"
#: ... and the same heads with the exact GGN's eigenvalues in their Kronecker eigenbasis, where
#: every node's summary measured them (version 3).
EKFAC_HEADS = "client heads, EKFAC"
#: ... and the same heads, each its client's diagonal Laplace posterior (the summary's GGN diagonal).
DIAGONAL_HEADS = "client heads, diagonal"
_FIT_ARRAYS = ("weight", "gram", "curvature")

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

    The ArrayRecord holds ``precision/<entry>``, ``moments/<group>/<stat>`` and ``output/<factor>``
    (float32; since version 4 ``output/gram`` as its upper triangle; since version 5
    ``precision/<entry>`` as bfloat16 bits, ``uint16``; since version 6 ``output/gram_factor``,
    the upper triangle of the Gram's triangular factor, and ``output/eigenvalues`` as bfloat16
    bits) and ``class_counts`` (int64),
    as the summary file does (:func:`bayesfuse.summaries.save_summary`);
    the ConfigRecord ``format``, ``version``, ``n-examples``, ``prior-precision`` and
    ``fingerprint``. Put them in a reply under :data:`SUMMARY_KEY` and :data:`SUMMARY_META_KEY`.

    Parameters
    ----------
    summary : ClientSummary

    Returns
    -------
    tuple of (ArrayRecord, ConfigRecord)
    """
    record = {k: Array(v) for k, v in summary_arrays(summary, "summary record").items()}
    meta = ConfigRecord(
        {
            "format": SUMMARY_FORMAT,
            "version": int(summary.version),
            "n-examples": int(summary.n_examples),
            "prior-precision": float(summary.prior_precision),
            "fingerprint": summary.fingerprint,
        }
    )
    return ArrayRecord(array_dict=record), meta


def records_to_summary(arrays: ArrayRecord, meta: ConfigRecord | None, name: str = "client") -> ClientSummary:
    """The client summary in a reply's records (:func:`summary_to_records`).

    Raises
    ------
    SummaryError
        With one line naming ``name``: no metadata, another format or version, missing keys.
    """
    if meta is None:
        raise SummaryError(
            f"{name}: the summary's arrays came without its metadata (ConfigRecord {SUMMARY_META_KEY!r})"
        )
    if meta.get("format") != SUMMARY_FORMAT:
        raise SummaryError(f"{name}: not a bayesfuse client summary (format {meta.get('format')!r})")
    values: Mapping[str, Any] = meta  # any record values: int() and float() refuse the wrong ones
    try:
        version, n_examples = int(values["version"]), int(values["n-examples"])
        prior, fp = float(values["prior-precision"]), str(values["fingerprint"])
    except (KeyError, TypeError, ValueError):
        raise SummaryError(
            f"{name}: the summary's metadata is incomplete (needs version, n-examples, prior-precision, fingerprint)"
        ) from None
    check_version(version, name)
    return summary_from_arrays(
        {key: arrays[key].numpy() for key in arrays.keys()},
        name,
        version=version,
        n_examples=n_examples,
        prior_precision=prior,
        fingerprint=fp,
    )


def output_fit_to_records(
    fit: OutputFit, *, prior_precision: float, n_clients: int
) -> tuple[ArrayRecord, ConfigRecord]:
    """A client's output fit (:func:`bayesfuse.summaries.output_fit`) as Flower records.

    The ArrayRecord holds ``weight`` ``(G+1, K)``, ``gram`` (the upper triangle of the symmetric
    ``(G+1, G+1)`` Gram, row by row: ``(G+1)(G+2)/2`` numbers) and ``curvature`` ``(K, K)``, in
    float32 (:attr:`~bayesfuse.inference.output_fusion.OutputFit.nbytes` bytes with the count);
    the ConfigRecord ``format``, ``version``, ``n-examples`` and the ``prior-precision`` and
    ``n-clients`` the fit was made with. Put them in a reply under
    :data:`OUTPUT_FIT_KEY` and :data:`OUTPUT_FIT_META_KEY` (:func:`output_fit_reply` does).

    Parameters
    ----------
    fit : OutputFit
    prior_precision : float
        ``lambda``, as the server sent it.
    n_clients : int
        ``J``, as the server sent it.

    Returns
    -------
    tuple of (ArrayRecord, ConfigRecord)
    """
    values = {name: getattr(fit, name) for name in _FIT_ARRAYS}
    values["gram"] = packed_upper(values["gram"])
    arrays = {name: Array(np.ascontiguousarray(v, dtype=np.float32)) for name, v in values.items()}
    meta = ConfigRecord(
        {
            "format": OUTPUT_FIT_FORMAT,
            "version": OUTPUT_FIT_VERSION,
            "n-examples": int(fit.n),
            "prior-precision": float(prior_precision),
            "n-clients": int(n_clients),
        }
    )
    return ArrayRecord(array_dict=arrays), meta


def records_to_output_fit(
    arrays: ArrayRecord,
    meta: ConfigRecord | None,
    name: str = "client",
    *,
    shape: tuple[int, int] | None = None,
    prior_precision: float | None = None,
    n_clients: int | None = None,
) -> OutputFit:
    """The output fit in a reply's records (:func:`output_fit_to_records`), checked.

    Parameters
    ----------
    arrays : ArrayRecord
    meta : ConfigRecord or None
    name : str
        Who sent it, for the messages (``"node 3"``).
    shape : (int, int), optional
        ``(G+1, K)`` of the fused output layer the server sent.
    prior_precision, n_clients : optional
        What the server sent: a fit made with others is refused.

    Returns
    -------
    OutputFit
        In float64.

    Raises
    ------
    ValueError
        With one line naming ``name``: no metadata, another format or version, missing arrays,
        shapes that do not fit ``shape`` or each other, values that are not finite, a Gram or
        curvature that is not symmetric positive semi-definite, another prior.
    """
    if meta is None:
        raise ValueError(
            f"{name}: the output fit's arrays came without its metadata (ConfigRecord {OUTPUT_FIT_META_KEY!r})"
        )
    if meta.get("format") != OUTPUT_FIT_FORMAT:
        raise ValueError(f"{name}: not a bayesfuse output fit (format {meta.get('format')!r})")
    values: Mapping[str, Any] = meta  # any record values: int() and float() refuse the wrong ones
    try:
        version, n = int(values["version"]), int(values["n-examples"])
        prior, clients = float(values["prior-precision"]), int(values["n-clients"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"{name}: the output fit's metadata is incomplete (needs version, n-examples, prior-precision, n-clients)"
        ) from None
    if version != OUTPUT_FIT_VERSION:
        raise ValueError(f"{name}: output fit version {version} is not one this bayesfuse reads ({OUTPUT_FIT_VERSION})")
    if n <= 0:
        raise ValueError(f"{name}: the output fit has n-examples = {n}")
    if prior_precision is not None and not np.isclose(prior, prior_precision, rtol=1e-6, atol=0.0):
        raise ValueError(
            f"{name}: the output fit was made with prior precision {prior:g}, the server sent {prior_precision:g}"
        )
    if n_clients is not None and clients != n_clients:
        raise ValueError(f"{name}: the output fit was made for {clients} clients, the server sent {n_clients}")
    missing = [k for k in _FIT_ARRAYS if k not in arrays]
    if missing:
        raise ValueError(f"{name}: the output fit lacks {missing} (has {sorted(arrays.keys())})")
    values = {k: np.asarray(arrays[k].numpy(), dtype=np.float64) for k in _FIT_ARRAYS}
    if values["weight"].ndim != 2:
        raise ValueError(f"{name}: the output fit's weight has shape {values['weight'].shape}, not (G+1, K)")
    g, k = shape if shape is not None else values["weight"].shape
    upper = values["gram"]
    if upper.shape != (g * (g + 1) // 2,):
        raise ValueError(
            f"{name}: the output fit's gram has shape {upper.shape}; the fused output layer needs its upper "
            f"triangle, ({g * (g + 1) // 2},)"
        )
    values["gram"] = unpacked_upper(upper, g)
    weight, gram, curvature = values["weight"], values["gram"], values["curvature"]
    for key, want in (("weight", (g, k)), ("gram", (g, g)), ("curvature", (k, k))):
        if values[key].shape != want:
            raise ValueError(
                f"{name}: the output fit's {key} has shape {values[key].shape}; the fused output layer needs {want}"
            )
        if not np.isfinite(values[key]).all():
            raise ValueError(f"{name}: the output fit's {key} has values that are not finite (NaN or inf)")
    for key, m in (("gram", gram), ("curvature", curvature)):
        scale = 1e-5 * max(1.0, float(np.abs(m).max()))
        if not np.allclose(m, m.T, rtol=0.0, atol=scale) or np.linalg.eigvalsh(0.5 * (m + m.T)).min() < -scale:
            raise ValueError(f"{name}: the output fit's {key} is not symmetric positive semi-definite")
    # the Gram was rebuilt from its upper triangle: symmetric already
    return OutputFit(weight=weight, gram=gram, curvature=0.5 * (curvature + curvature.T), n=n)


def output_fit_reply(model: torch.nn.Module, x, y, config: Mapping) -> RecordDict:
    """A client's reply to the refit round of ``MatchedAveraging(second_round="refit")``.

    The server's training message carries the fused network's arrays and a ConfigRecord whose
    :data:`ROUND_KEY` (``"bayesfuse-round"``) is :data:`OUTPUT_FIT` (``"output_fit"``), with the
    ``output-layer`` to refit, the ``prior-precision`` and ``n-clients``. The client fits that
    layer on the fused network's features of its own data (:func:`bayesfuse.summaries.output_fit`)
    and replies with the fit: aggregates of its data, no row of it.

    Parameters
    ----------
    model : nn.Module
        The network the server sent: the client's own network rebuilt with the message's arrays,
        e.g. ``bayesfuse.nets.arch.rebuild(model, tensor_state(record_to_state(msg.content["arrays"])))``
        (the fused network may be wider than the client's; a network whose forward reads a width
        it holds, ``self.width``, is rebuilt with its spec too:
        ``rebuild(model, state, bayesfuse.nets.tracing.spec_from_module(model, x[:2]))``, with
        ``nn.MultiheadAttention`` split into heads first: ``split_heads(model)``).
    x, y : arrays
        The client's examples and their integer classes.
    config : mapping
        The message's ConfigRecord (``msg.content["config"]``).

    Returns
    -------
    RecordDict
        The fit under :data:`OUTPUT_FIT_KEY` and :data:`OUTPUT_FIT_META_KEY`, and a MetricRecord
        ``metrics`` with ``num-examples``: ``Message(output_fit_reply(...), reply_to=msg)``.

    Examples
    --------
    In the ClientApp's training handler::

        @app.train()
        def train(msg, context):
            config = msg.content["config"]
            if config.get(ROUND_KEY) == OUTPUT_FIT:
                fused = rebuild(model, tensor_state(record_to_state(msg.content["arrays"])))
                return Message(output_fit_reply(fused, x, y, config), reply_to=msg)
            ...  # an ordinary training round
    """
    if config.get(ROUND_KEY) != OUTPUT_FIT:
        raise ValueError(
            f"not a refit round: the config's {ROUND_KEY!r} is {config.get(ROUND_KEY)!r}, not {OUTPUT_FIT!r}"
        )
    try:
        output, prior, clients = str(config["output-layer"]), float(config["prior-precision"]), int(config["n-clients"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            "the refit round's config is incomplete (needs output-layer, prior-precision, n-clients)"
        ) from None
    fit = output_fit(model, output, x, y, prior, n_clients=clients)
    arrays, meta = output_fit_to_records(fit, prior_precision=prior, n_clients=clients)
    return RecordDict(
        {OUTPUT_FIT_KEY: arrays, OUTPUT_FIT_META_KEY: meta, "metrics": MetricRecord({"num-examples": int(fit.n)})}
    )


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
        weights = np.array([float(cast(float, m.get(weighted_by_key, 1.0))) for m in metrics])
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


def heads_to_record(heads: dict, trace_scale=None, eigenvalues=None, diagonal=None) -> ArrayRecord:
    """The clients' one-shot heads (:func:`~bayesfuse.inference.client_heads.one_shot_heads`) as
    an ArrayRecord, float64, in a heads file's layout (:func:`bayesfuse.checkpoints.heads_arrays`),
    with ``trace-scale`` (J,) where the trace-matched heads are a candidate too,
    ``ekfac-eigenvalues`` (J, G+1, K) where the EKFAC heads are
    (:func:`~bayesfuse.inference.client_heads.ekfac_eigenvalues`), and ``diagonal-precision``
    (J, K, G+1) where the diagonal heads are (the diagonal heads' ``laplace["precision"]``, the
    same heads' weights), and ``pseudo-count`` (1,) where ``heads["pseudo_count"]`` is set (their
    smoothing, :attr:`~bayesfuse.nets.heads.ClientHeads.pseudo_count`)."""
    arrays = heads_arrays(heads)
    if heads.get("pseudo_count") is not None:
        arrays["pseudo-count"] = np.array([float(heads["pseudo_count"])], dtype=np.float64)
    if trace_scale is not None:
        arrays["trace-scale"] = np.ascontiguousarray(trace_scale, dtype=np.float64)
    if eigenvalues is not None:
        arrays["ekfac-eigenvalues"] = np.ascontiguousarray(eigenvalues, dtype=np.float64)
    if diagonal is not None:
        arrays["diagonal-precision"] = np.ascontiguousarray(diagonal, dtype=np.float64)
    return ArrayRecord(array_dict={k: Array(v) for k, v in arrays.items()})


def record_to_heads(record: ArrayRecord, output: str, form: str, name: str = "client heads") -> tuple[dict, Any]:
    """The heads in :func:`heads_to_record`'s record (on the output layer ``output``, of posterior
    ``form``), with ``heads["pseudo_count"]`` where the record has a ``pseudo-count``, and its
    ``trace-scale`` (None without); one line naming ``name`` if incomplete, or if the pseudo-count
    is not one real number >= 0 of heads that know their examples."""
    arrays = {k: record[k].numpy() for k in record.keys()}
    scale = arrays.pop("trace-scale", None)
    smoothing = arrays.pop("pseudo-count", None)
    for variant in ("ekfac-eigenvalues", "diagonal-precision"):  # other candidates', read by temperature_candidates
        arrays.pop(variant, None)
    heads = heads_from_arrays(arrays, output, form, name)
    if smoothing is not None:
        from bayesfuse.nets.heads import checked_pseudo_count, unsmoothable

        smoothing = np.asarray(smoothing)
        if smoothing.shape != (1,) or smoothing.dtype.kind not in "fiu":
            raise ValueError(
                f"{name}: the heads' pseudo-count must be one real number, shape (1,); got {smoothing.dtype} "
                f"of shape {smoothing.shape}"
            )
        if heads.get("examples") is None:
            raise unsmoothable("the record has no examples of its heads", name)
        try:
            heads["pseudo_count"] = checked_pseudo_count(float(smoothing[0]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: {err}") from None
    return heads, scale


def temperature_candidates(model: torch.nn.Module, config: Mapping, records: Mapping | None = None) -> dict:
    """The temperature round's candidates that ``config`` names, built on the fused network ``model``.

    :data:`SHARED` is ``model`` itself, or, where the message carries the output layer's posterior
    variances (:data:`SHARED_POSTERIOR_KEY`: ``weight_var``, ``bias_var``; the fusion with
    summaries), its last-layer Laplace (:class:`~bayesfuse.nets.laplace.LastLayerLaplace`, the
    probit predictive, as ``bayesfuse.fuse`` scores it); :data:`SHARED_COUNTS` the last-layer
    Laplace of ``model`` with the entries of :data:`COUNTS_ARRAYS_KEY` and the variances of
    :data:`COUNTS_POSTERIOR_KEY`; :data:`CLIENT_HEADS` the clients' heads of :data:`HEADS_KEY` on
    ``model`` (:class:`~bayesfuse.nets.heads.ClientHeads`); :data:`TRACE_MATCHED` the same heads
    with their ``trace-scale``; :data:`EKFAC_HEADS` with their ``ekfac-eigenvalues``;
    :data:`DIAGONAL_HEADS` the same weights, each head's posterior the ``diagonal-precision``.
    ``records`` are the message's ArrayRecords (``msg.content.array_records``). In the config's
    order; one line says what is missing.
    """
    from bayesfuse.nets.heads import ClientHeads

    if config.get(ROUND_KEY) != TEMPERATURE:
        raise ValueError(
            f"not a temperature round: the config's {ROUND_KEY!r} is {config.get(ROUND_KEY)!r}, not {TEMPERATURE!r}"
        )
    values: Mapping[str, Any] = config
    records = records or {}
    try:
        names = [str(c) for c in values["candidates"]]
    except (KeyError, TypeError):
        raise ValueError("the temperature round's config is incomplete (needs candidates, temperatures)") from None
    unknown = sorted(set(names) - {SHARED, SHARED_COUNTS, CLIENT_HEADS, TRACE_MATCHED, EKFAC_HEADS, DIAGONAL_HEADS})
    if unknown or not names:
        raise ValueError(f"the temperature round names no candidates or unknown ones: {unknown or names}")
    needs = {
        SHARED_POSTERIOR_KEY: SHARED in names and SHARED_POSTERIOR_KEY in records,
        COUNTS_ARRAYS_KEY: SHARED_COUNTS in names,
        HEADS_KEY: bool(set(names) & {CLIENT_HEADS, TRACE_MATCHED, EKFAC_HEADS, DIAGONAL_HEADS}),
    }
    output = values.get("output-layer")
    if any(needs.values()) and output is None:
        raise ValueError("the temperature round's config is incomplete (needs output-layer)")
    candidates: dict[str, torch.nn.Module] = {SHARED: model}
    if needs[SHARED_POSTERIOR_KEY]:
        candidates[SHARED] = _last_layer_laplace(model, str(output), records[SHARED_POSTERIOR_KEY])
    if needs[COUNTS_ARRAYS_KEY]:
        candidates[SHARED_COUNTS] = _counts_candidate(model, str(output), records)
    if needs[HEADS_KEY]:
        if HEADS_KEY not in records:
            raise ValueError(f"the temperature round scores the clients' heads, and the message has no {HEADS_KEY!r}")
        try:
            form, pool = str(values["heads-form"]), str(values["pool"])
        except KeyError:
            raise ValueError("the temperature round's config is incomplete (needs heads-form, pool)") from None
        arrays, scale = record_to_heads(records[HEADS_KEY], str(output), form)
        heads = ClientHeads.from_arrays(model, arrays, pool=pool)
        candidates[CLIENT_HEADS] = heads
        if TRACE_MATCHED in names:
            if scale is None or heads.form != "kronecker":
                raise ValueError("the trace-matched heads need Kronecker-factored heads and their trace-scale")
            candidates[TRACE_MATCHED] = heads.with_scale(scale)
        if EKFAC_HEADS in names:
            if "ekfac-eigenvalues" not in records[HEADS_KEY] or heads.form != "kronecker":
                raise ValueError("the EKFAC heads need Kronecker-factored heads and their ekfac-eigenvalues")
            candidates[EKFAC_HEADS] = heads.with_eigenvalues(records[HEADS_KEY]["ekfac-eigenvalues"].numpy())
        if DIAGONAL_HEADS in names:
            if "diagonal-precision" not in records[HEADS_KEY]:
                raise ValueError("the diagonal heads need their diagonal-precision")
            candidates[DIAGONAL_HEADS] = heads.with_diagonal(records[HEADS_KEY]["diagonal-precision"].numpy())
    return {name: candidates[name] for name in names}


def _counts_candidate(model: torch.nn.Module, output: str, records: Mapping) -> torch.nn.Module:
    """:data:`SHARED_COUNTS`: ``model`` with the entries the message carries for it, rebuilt at
    their widths, as its last-layer Laplace."""
    from bayesfuse.nets.arch import rebuild

    missing = [key for key in (COUNTS_ARRAYS_KEY, COUNTS_POSTERIOR_KEY) if key not in records]
    if missing:
        raise ValueError(f"the temperature round scores {SHARED_COUNTS!r}, and the message has no {missing}")
    state = dict(model.state_dict())
    entries = records[COUNTS_ARRAYS_KEY]
    unknown = sorted(set(entries.keys()) - set(state))
    if unknown:
        raise ValueError(f"{COUNTS_ARRAYS_KEY!r} has entries the fused network does not: {unknown[:3]}")
    state.update({k: torch.as_tensor(entries[k].numpy()) for k in entries.keys()})
    return _last_layer_laplace(rebuild(model, state).eval(), output, records[COUNTS_POSTERIOR_KEY])


def _last_layer_laplace(network: torch.nn.Module, output: str, posterior) -> torch.nn.Module:
    """``network``'s last-layer Laplace with the variances ``weight_var``, ``bias_var`` of the
    record ``posterior`` (as the strategy sends them)."""
    from bayesfuse.nets.laplace import LastLayerLaplace

    variances = [posterior[k].numpy() for k in ("weight_var", "bias_var")]
    return LastLayerLaplace(network, output, *variances).eval()


def temperature_reply(model: torch.nn.Module, x, y, config: Mapping, records: Mapping | None = None) -> RecordDict:
    """A client's reply to the temperature round of ``MatchedAveraging(second_round="temperature")``.

    The server's training message carries the fused network's arrays, a ConfigRecord whose
    :data:`ROUND_KEY` is :data:`TEMPERATURE` with the ``candidates`` (their names:
    :data:`SHARED`, :data:`SHARED_COUNTS`, :data:`CLIENT_HEADS`, :data:`TRACE_MATCHED`,
    :data:`EKFAC_HEADS`, :data:`DIAGONAL_HEADS`) and
    ``temperatures`` to score, and what the candidates need beside the network
    (:func:`temperature_candidates`): the output layer's posterior variances
    (:data:`SHARED_POSTERIOR_KEY`), the counts-pooled fusion (:data:`COUNTS_ARRAYS_KEY`,
    :data:`COUNTS_POSTERIOR_KEY`) and the clients' heads (:data:`HEADS_KEY`), with the
    ``output-layer``, ``heads-form`` and ``pool``. The client scores
    each candidate's predictive at each temperature on its own data
    (:func:`bayesfuse.summaries.temperature_nll`, as ``bayesfuse.fuse(...,
    second_round="temperature")`` simulates it) and replies with the (candidates, temperatures)
    sums: no row of its data.

    Parameters
    ----------
    model : nn.Module
        The fused network the server sent, rebuilt as for :func:`output_fit_reply`.
    x, y : arrays
        The client's examples and their integer classes.
    config : mapping
        The message's ConfigRecord (``msg.content["config"]``).
    records : mapping, optional
        The message's ArrayRecords (``msg.content.array_records``).

    Returns
    -------
    RecordDict
        The sums under :data:`TEMPERATURE_NLL_KEY` (array ``nll``, float64) and a MetricRecord
        ``metrics`` with ``num-examples``.
    """
    from bayesfuse.summaries import temperature_nll

    candidates = temperature_candidates(model, config, records)
    try:
        temperatures = np.asarray(config["temperatures"], dtype=np.float64)
    except (KeyError, TypeError, ValueError):
        raise ValueError("the temperature round's config is incomplete (needs candidates, temperatures)") from None
    nll = np.stack([temperature_nll(m, x, y, temperatures) for m in candidates.values()])
    return RecordDict(
        {
            TEMPERATURE_NLL_KEY: ArrayRecord(array_dict={"nll": Array(nll)}),
            "metrics": MetricRecord({"num-examples": len(y)}),
        }
    )
