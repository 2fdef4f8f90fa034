"""The canonical order of the clients: the same models give the same fused model however they are listed.

Matching visits the clients in their order (PFNM's and NAFI's sweeps, KL-fusion's initial
global components, OT's choice among equally wide anchors, the round-off of every weighted sum),
so fusing a permutation of the same list gives another, equally valid, fused model. The command
line (:mod:`bayesfuse.fuse_files`) fuses files in a canonical order: sorted by the digest of their
tensors (:func:`~bayesfuse.checkpoints.tensors_sha256`: each entry's name, dtype, shape and bytes).
:func:`bayesfuse.fuse` uses the same rule on the modules' state_dicts (warning of two clients
with the same tensors, which the command line refuses), so that a list of modules and the files of
their state_dicts are fused alike.

Let ``order`` be that permutation: ``order[i]`` is the caller's index of the i-th client fused.
Everything given per client (``class_counts`` rows, summaries, the clients' data, an ``anchor``
index) is put in that order before fusing (:func:`to_canonical`), and everything returned per
client (each layer's ``assignments``, KL-fusion's relaxed plans, OT's plans and costs, the OT
anchor, the BNN units kept, the per-client records of summaries) is put back in the caller's
order (:func:`to_callers`): ``result.layers[l].assignments[j]`` is the caller's client j's,
whatever the order of the list. ``result.hyper["fused_order"]`` records ``order``. The fused
model itself is the same whatever the order, bit for bit: a
:class:`~bayesfuse.models.bnn_heads.HeadMixtureBNN` keeps its heads in the fused order (head i
is client ``fused_order[i]``'s), since its Monte Carlo draws are taken head by head and the
same model must predict the same with the same seed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence, cast

import numpy as np
import torch
from torch import nn

from bayesfuse._text import warn_from_caller
from bayesfuse.checkpoints import tensors_sha256

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["canonical_order", "to_canonical", "to_callers", "PER_CLIENT_FIELDS"]

#: Fields of a layer's result (:class:`~bayesfuse.inference.result.LayerResult`) that hold one
#: entry per client: ``MatchResult.assignments``, ``KLFusionResult.relaxed``, ``OTLayer.plans``
#: and ``OTLayer.costs``.
PER_CLIENT_FIELDS = ("assignments", "relaxed", "plans", "costs")

#: Entries of ``hyper["summaries"]`` that hold one value per client.
_PER_CLIENT_SUMMARY = ("prior_precision", "examples", "bytes")


def canonical_order(models: Sequence[nn.Module]) -> list[int]:
    """The caller's indices of ``models`` in the order they are fused: sorted by the digest of
    each state_dict's tensors (:func:`~bayesfuse.checkpoints.tensors_sha256`, the command line's
    rule), ties in the caller's order. Two models with the same tensors are counted twice, with a
    warning naming them (the command line refuses two files of the same tensors, which are almost
    always one file given twice; in Python, identical copies are also how one checks that a
    network fuses back to itself).

    >>> import torch
    >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    >>> canonical_order([a, b]) == canonical_order([b, a])[::-1]
    True
    """
    digests = [tensors_sha256(m.state_dict()) for m in models]
    first: dict[str, int] = {}
    for j, d in enumerate(digests):  # the same client twice counts twice (the command line refuses it)
        if first.setdefault(d, j) != j:
            warn_from_caller(
                f"client {j} holds the same tensors as client {first[d]} (the same client twice?): it is counted "
                "twice; give each client once unless that is what you mean"
            )
    return sorted(range(len(models)), key=lambda j: (digests[j], j))


def _permuted(values, order: Sequence[int]):
    """``values`` (a sequence or array with one entry per client) in ``order``; as given when it
    does not have one entry per client (the fusion refuses it then, naming what is wrong)."""
    if values is None or len(values) != len(order):
        return values
    if isinstance(values, (np.ndarray, torch.Tensor)):
        return values[list(order)]
    return [values[j] for j in order]


def _permuted_partition(partition, order: Sequence[int]):
    """A partition (:class:`~bayesfuse.data.Partition`, or one index array per client) in ``order``."""
    if len(partition) != len(order):
        return partition
    if dataclasses.is_dataclass(partition) and hasattr(partition, "indices") and hasattr(partition, "counts"):
        return dataclasses.replace(
            cast("DataclassInstance", partition),  # a Partition: a dataclass instance
            indices=tuple(partition.indices[j] for j in order),
            counts=np.asarray(partition.counts)[list(order)],
        )
    return [partition[j] for j in order]


def to_canonical(
    order: Sequence[int],
    models: Sequence[nn.Module],
    class_counts=None,
    summaries=None,
    data=None,
    hyper: dict | None = None,
) -> tuple[list, Any, Any, Any, dict]:
    """The inputs of a fusion put in ``order``: the models, the rows of ``class_counts``, the
    summaries, the clients' data ``(train, partition)`` and an integer ``anchor`` (OT fusion's,
    a caller's index) among ``hyper``."""
    hyper = dict(hyper or {})
    anchor = hyper.get("anchor")
    if isinstance(anchor, (int, np.integer)) and not isinstance(anchor, bool) and 0 <= anchor < len(order):
        hyper["anchor"] = int(np.argsort(order)[anchor])
    if data is not None and isinstance(data, tuple) and len(data) == 2:
        data = (data[0], _permuted_partition(data[1], order))
    return ([models[j] for j in order], _permuted(class_counts, order), _permuted(summaries, order), data, hyper)


def _layer_in_callers_order(layer, back):
    """A layer's result with its per-client fields (:data:`PER_CLIENT_FIELDS`) in the caller's order."""
    if not dataclasses.is_dataclass(layer):
        return layer
    names = {f.name for f in dataclasses.fields(layer)}
    return dataclasses.replace(
        cast("DataclassInstance", layer), **{k: back(getattr(layer, k)) for k in PER_CLIENT_FIELDS if k in names}
    )


def to_callers(result, order: Sequence[int]):
    """``result`` (a :class:`~bayesfuse.fusion.FusionResult` of the clients fused in ``order``)
    with everything it holds per client in the caller's order (module docstring), and
    ``hyper["fused_order"] = order``."""
    order = [int(j) for j in order]
    position = np.argsort(order)  # position[j]: where the caller's client j was fused

    def back(values):
        if isinstance(values, np.ndarray):
            return values[position]
        return [values[i] for i in position]

    result.layers = [_layer_in_callers_order(layer, back) for layer in result.layers]
    hyper = result.hyper
    if isinstance(hyper.get("anchor"), (int, np.integer)) and not isinstance(hyper["anchor"], bool):
        hyper["anchor"] = order[hyper["anchor"]]
    if "kept_units" in hyper:  # per client for one hidden layer; per layer, then per client, deeper
        kept = hyper["kept_units"]
        hyper["kept_units"] = back(kept) if len(result.layers) == 1 else [back(k) for k in kept]
    if "head_orders" in hyper:  # per client: each set of attention heads' order
        hyper["head_orders"] = back(hyper["head_orders"])
    records = hyper.get("summaries")
    if isinstance(records, dict):
        hyper["summaries"] = {
            k: back(v) if k in _PER_CLIENT_SUMMARY and len(v) == len(order) else v for k, v in records.items()
        }
    hyper["fused_order"] = order
    return result
