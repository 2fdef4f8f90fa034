"""The fused posterior beside a fused model file, so that a loaded file analyses as a fresh result.

``bayesfuse fuse`` writes the fused network (its posterior means) to ``fused.pt``; the matched
layers' posteriors go beside it, to ``fused.pt.fusion.safetensors`` (:func:`fusion_path`):
for every matched layer the global units' Gaussian posterior (mean and variance, ``(G, D)``),
their usage counts, each client's assignment and the objective per sweep, with the method, its
hyper-parameters and each layer's convergence in the file's metadata. :func:`bayesfuse.load`
reads it back into a :class:`~bayesfuse.fusion.FusionResult` (``model.fusion``), so that
``bayesfuse.to_arviz(model.fusion)`` and the plots work on a loaded file as on the result of
:func:`bayesfuse.fuse`. The metadata records the fused model's :func:`tensors_sha256`: a record
is never read beside another model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from bayesfuse._io import atomic_write_files, check_output_file, check_writable, finite_json, recover
from bayesfuse.checkpoints import heads_path, posterior_path, read_bound_file, tensors_sha256

__all__ = [
    "fusion_path",
    "fusion_files",
    "fusion_bytes",
    "read_fusion",
    "SavedLayer",
    "FUSION_FORMAT",
    "FUSION_VERSION",
]

FUSION_FORMAT = "bayesfuse.fusion"
FUSION_VERSION = 1


@dataclass
class SavedLayer:
    """One matched layer as read back from a fusion record (the result protocol of
    :class:`~bayesfuse.inference.result.LayerResult`, with the layer's ``counts`` and ``hyper``)."""

    assignments: list
    counts: np.ndarray | None  # None when the fusion recorded none
    objective: list
    converged: bool
    n_global: int
    seconds: float = 0.0
    hyper: dict = field(default_factory=dict)


def fusion_path(path: str | os.PathLike) -> Path:
    """``fused.pt`` -> ``fused.pt.fusion.safetensors`` (beside it, named like its report)."""
    path = Path(path)
    return path.with_name(path.name + ".fusion.safetensors")


def fusion_files(path: str | os.PathLike) -> list[Path]:
    """Every file of one fused model ``path``: the model, its report ``path + '.json'``, and the
    output layer's posterior, the fusion record and the clients' heads beside it (whichever the
    fusion wrote)."""
    path = Path(path)
    return [path, path.with_name(path.name + ".json"), posterior_path(path), fusion_path(path), heads_path(path)]


def check_fusion_outputs(path: str | os.PathLike, *, force: bool) -> list[Path]:
    """:func:`fusion_files` of ``path``, checked before anything is computed: a read-only
    directory, a directory in a file's place, and (without ``force``) any file of a fusion there,
    the side files of another fusion included, are refused; a killed writer's commit is finished
    or undone first."""
    check_output_file(path)
    check_writable(Path(path).parent)  # a read-only directory fails now, not after the fusion
    outputs = fusion_files(path)
    recover(outputs)  # finish or undo a killed run's commit
    for target in outputs:
        if target.is_dir():
            raise IsADirectoryError(f"{target} is a directory; give a file name for the fused model")
        if target.exists() and not force:
            raise FileExistsError(f"{target} exists; replace it with force=True")
    return outputs


def write_fusion_files(
    path: str | os.PathLike, model: bytes, report: dict, sides: Sequence[tuple[Path, bytes]], *, force: bool
) -> None:
    """A fused model ``path``, its JSON ``report`` and its side files ``sides`` (the output
    layer's posterior, the fusion record, the clients' heads) as one unit: all written, or
    (without ``force``) none (:func:`~bayesfuse._io.atomic_write_files`). With ``force``, the side
    files of a fusion there before that this one does not write (not this model's) are removed
    in the same commit."""
    path = Path(path)
    written = {Path(side) for side, _ in sides}
    stale = [side for side in fusion_files(path)[2:] if side not in written]
    atomic_write_files(
        [
            (path, model),
            (
                path.with_name(path.name + ".json"),
                (json.dumps(report, indent=2, allow_nan=False) + "\n").encode("utf-8"),
            ),
            *sides,
        ],
        overwrite=force,
        remove=stale if force else (),
    )


def fusion_bytes(fused, *, model_tensors: dict, hyper: dict | None = None) -> bytes | None:
    """The matched layers of ``fused`` (a :class:`~bayesfuse.core.StateFusion`) as a safetensors
    file, or None when nothing was matched (FedAvg).

    Tensors ``layer{i}/mean``, ``layer{i}/var``, ``layer{i}/counts``, ``layer{i}/objective`` and
    ``layer{i}/assignment{j}`` (client j in the fused order: the report's ``fused_order``, the
    inputs' canonical order); metadata: ``format``, ``version``,
    ``model_tensors_sha256`` and ``record`` (JSON: method, hyper, groups, sizes, and per layer
    ``converged``, ``n_global``, ``seconds``, ``hyper``). ``hyper`` (default ``fused.hyper``) is
    what the record reports as the fusion's hyper-parameters: the command line gives its report's,
    with ``fused_order`` (the files in the order the record lists the clients), the clients' heads'
    ``head``, ``pool`` and ``pseudo_count`` where it kept them.
    """
    from safetensors.numpy import save

    layers = list(getattr(fused, "layers", None) or [])
    posteriors = list(getattr(fused, "posteriors", None) or [])
    if not layers or len(posteriors) != len(layers):
        return None
    tensors: dict[str, np.ndarray] = {}
    described = []
    for i, (layer, (mean, var)) in enumerate(zip(layers, posteriors)):
        mean = np.asarray(_host(mean), dtype=np.float64)
        tensors[f"layer{i}/mean"] = np.ascontiguousarray(mean)
        tensors[f"layer{i}/var"] = np.ascontiguousarray(np.broadcast_to(np.asarray(_host(var), np.float64), mean.shape))
        counts = getattr(layer, "counts", None)
        if counts is not None:
            tensors[f"layer{i}/counts"] = np.ascontiguousarray(_host(counts), dtype=np.float64)
        tensors[f"layer{i}/objective"] = np.asarray(
            [v if np.isfinite(v) else np.nan for v in layer.objective], dtype=np.float64
        ).reshape(-1)
        for j, a in enumerate(layer.assignments):
            tensors[f"layer{i}/assignment{j}"] = np.ascontiguousarray(_host(a), dtype=np.int64)
        described.append(
            {
                "converged": bool(layer.converged),
                "n_global": int(layer.n_global),
                "seconds": float(getattr(layer, "seconds", 0.0) or 0.0),
                "clients": len(layer.assignments),
                "hyper": finite_json(getattr(layer, "hyper", None) or {}),
            }
        )
    record = {
        "method": str(getattr(fused, "method", "")),
        "hyper": finite_json(fused.hyper if hyper is None else hyper),
        "groups": list(getattr(fused, "groups", ())),
        "sizes": [int(s) for s in fused.sizes],
        "layers": described,
    }
    meta = {
        "format": FUSION_FORMAT,
        "version": str(FUSION_VERSION),
        "model_tensors_sha256": tensors_sha256(model_tensors),
        "record": json.dumps(record, allow_nan=False),
    }
    return save(tensors, metadata=meta)


def read_fusion(path: str | os.PathLike, model, model_tensors: dict, model_name: str, *, method: str | None = None):
    """The :class:`~bayesfuse.fusion.FusionResult` recorded in ``path`` for ``model``.

    Refuses, with one line naming the file, another format or version, or a record written
    beside other tensors than ``model_tensors`` (``model_name``'s).
    """
    from bayesfuse.fusion import FusionResult

    meta, tensors = read_bound_file(
        path,
        fmt=FUSION_FORMAT,
        version=FUSION_VERSION,
        model_tensors=model_tensors,
        model_name=model_name,
        what="fusion record",
    )
    try:
        record = json.loads(meta["record"])
        layers, posteriors = [], []
        for i, info in enumerate(record["layers"]):
            objective = tensors[f"layer{i}/objective"]
            layers.append(
                SavedLayer(
                    assignments=[tensors[f"layer{i}/assignment{j}"] for j in range(int(info["clients"]))],
                    counts=tensors.get(f"layer{i}/counts"),
                    objective=[float(v) for v in objective],
                    converged=bool(info["converged"]),
                    n_global=int(info["n_global"]),
                    seconds=float(info["seconds"]),
                    hyper=dict(info["hyper"]),
                )
            )
            posteriors.append((tensors[f"layer{i}/mean"], tensors[f"layer{i}/var"]))
            _check_layer(i, layers[-1], *posteriors[-1])
        result = FusionResult(
            model=model,
            layers=layers,
            sizes=[int(s) for s in record["sizes"]],
            method=method or str(record["method"]),
            hyper=dict(record["hyper"]),
            seconds=0.0,
            groups=tuple(str(g) for g in record["groups"]),
            posteriors=posteriors,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: a malformed fusion record ({type(err).__name__}: {err})") from None
    return result


def _check_layer(i: int, layer: SavedLayer, mean: np.ndarray, var: np.ndarray) -> None:
    """Refuse (``ValueError``) a recorded layer whose arrays do not fit its ``n_global`` units."""
    G = layer.n_global
    if mean.ndim != 2 or mean.shape[0] != G or var.shape != mean.shape:
        raise ValueError(f"layer {i}: mean {mean.shape} and var {var.shape} do not fit its {G} global units")
    if not (np.isfinite(mean).all() and np.isfinite(var).all() and (var >= 0).all()):
        raise ValueError(f"layer {i}: its posterior holds NaN, inf or negative variances")
    if layer.counts is not None and np.shape(layer.counts) != (G,):
        raise ValueError(f"layer {i}: counts {np.shape(layer.counts)} do not fit its {G} global units")
    for j, a in enumerate(layer.assignments):
        if a.ndim != 1 or (a.size and (a.min() < 0 or a.max() >= G)):
            raise ValueError(f"layer {i}: client {j}'s assignment is not a list of its units' global units 0..{G - 1}")


def _host(values):
    """A NumPy array of ``values`` (torch tensors are copied to the host)."""
    if hasattr(values, "detach"):
        return values.detach().cpu().numpy()
    return np.asarray(values)
