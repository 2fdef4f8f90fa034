"""``bayesfuse.save(result, path)``: a fusion made in Python written as ``bayesfuse fuse`` writes one.

The files are those of the command line (:doc:`/guide/files`): the fused network's state_dict
(``.pt`` or ``.safetensors``, by the suffix), its JSON report ``path + '.json'``, and beside them
what the model predicts with: the clients' own heads (``.heads.safetensors``) of a
:class:`~bayesfuse.nets.heads.ClientHeads`, or the output layer's posterior
(``.posterior.safetensors``) of a :class:`~bayesfuse.nets.laplace.LastLayerLaplace`, and the
matched layers' posteriors (``.fusion.safetensors``, :mod:`bayesfuse.fusion_record`).
:func:`bayesfuse.load` reads them back into a model that predicts exactly as ``result.model``
does: the heads and the posterior are stored as the module's own tensors (the eigenbases, draws
and temperature it predicts with, versions 3 and 2 of their formats), not recomputed.

All the files are written as one unit, atomically; none replaces a file unless ``force``.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from bayesfuse._io import finite_json
from bayesfuse.checkpoints import (
    HashedState,
    heads_path,
    input_record,
    module_heads_bytes,
    module_posterior_bytes,
    output_format,
    posterior_path,
    state_dict_bytes,
    tensors_sha256,
)
from bayesfuse.fusion_record import check_fusion_outputs, fusion_bytes, fusion_path, write_fusion_files
from bayesfuse.loading import in_file_dtype, recognised

__all__ = ["save"]


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """The network whose state_dict is the model file, and the wrapper predicting with it (or None)."""
    from bayesfuse.nets.heads import ClientHeads
    from bayesfuse.nets.laplace import LastLayerLaplace

    if isinstance(model, (ClientHeads, LastLayerLaplace)):
        return model.network, model
    return model, None


def _how_to_load(network: nn.Module, state: dict, name: str) -> dict:
    """What :func:`bayesfuse.load` needs to give ``network`` back from its entries ``state``: the
    report's ``load``. ``like`` names the network's class where the network load recognises from
    the entries alone (:func:`~bayesfuse.loading.recognised`) is not this one, or does not compute
    what it does on an example input (a class of your own; constructor options no entry holds,
    as an activation, an image size or position-aware neurons), with ``why``; ``n_features`` is the
    input size it ran on (a ConvNet's, which its entries leave open where poolings round down)."""
    from bayesfuse.models.bnn import HorseshoeBNN
    from bayesfuse.nets.graph_spec import example_input_for

    if isinstance(network, HorseshoeBNN):  # its state_dict is all of it, its posterior included
        return {"like": None, "why": None, "n_features": None}
    try:
        x = example_input_for(network)
    except ValueError:
        x = None
    n_features = int(np.prod(x.shape[1:])) if isinstance(x, torch.Tensor) and x.is_floating_point() else None
    why = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a chain of Linear layers read with ReLU: checked below
            rebuilt = recognised(state, name, n_features)
    except ValueError:
        why = "bayesfuse rebuilds no such network from entry names"
    else:
        if type(rebuilt) is not type(network):
            why = f"its entries read as a {type(rebuilt).__name__}"
        elif x is None:
            why = "no example input to check the network its entries give"
        else:
            rebuilt = in_file_dtype(rebuilt, state).eval()
            was_training = network.training
            try:
                with torch.no_grad():
                    same = torch.equal(rebuilt(x), network.eval()(x))
            except (RuntimeError, TypeError, ValueError):  # it does not run on the input, or returns no tensor
                same = False
            finally:
                network.train(was_training)
            if not same:
                why = "the network its entries give computes otherwise (an option no entry holds)"
    cls = f"{type(network).__module__}:{type(network).__qualname__}"
    return {"like": cls if why else None, "why": why, "n_features": n_features}


def save(result, path: str | os.PathLike, *, force: bool = False) -> dict:
    """Write the fused model of ``result`` (what :func:`bayesfuse.fuse` returned) as ``bayesfuse
    fuse --out path`` writes one, and return its report.

    ``path`` holds the fused network's state_dict (``.pt``, ``.pth`` or ``.safetensors``); beside
    it the JSON report ``path + '.json'``, the clients' heads or the output layer's posterior the
    model predicts with, and the matched layers' posteriors (module docstring).
    ``bayesfuse.load(path)`` (``like=`` your network, for a class of your own) returns a model
    that predicts exactly as ``result.model`` does, with the posteriors as ``model.fusion``.
    Written as one unit, atomically.

    Raises
    ------
    FileExistsError
        One of the files exists and ``force`` is false: nothing is written.
    ValueError
        ``path``'s suffix is not ``.pt``, ``.pth`` or ``.safetensors``.
    """
    from bayesfuse.fusion import FusionResult

    if not isinstance(result, FusionResult):
        raise TypeError(
            f"save takes what bayesfuse.fuse returned (a FusionResult), got a {type(result).__name__}; a network "
            "alone is saved with torch.save(model.state_dict(), path)"
        )
    path = Path(path)
    fmt = output_format(path)
    check_fusion_outputs(path, force=force)  # another fusion's side files there too
    network, wrapper = _parts(result.model)
    temperature = None if wrapper is None else float(cast(torch.Tensor, wrapper.temperature))
    state = HashedState((k, v.detach().cpu()) for k, v in network.state_dict().items())
    loading = _how_to_load(network, state, str(path))
    files: list[tuple[Path, bytes]] = []
    heads = posterior = None
    if wrapper is not None and hasattr(wrapper, "shares"):  # ClientHeads
        files.append((heads_path(path), module_heads_bytes(wrapper, model_tensors=state)))
        heads = {
            "file": str(heads_path(path)),
            "output_layer": wrapper.output,
            "form": wrapper.form,
            "pool": wrapper.pool,
            "predictive": wrapper.predictive,
            "pseudo_count": wrapper.pseudo_count if hasattr(wrapper, "examples") else None,
            "temperature": temperature,
            "stores": "the clients' own heads as the saved model held them; bayesfuse.load returns a ClientHeads",
        }
    elif wrapper is not None:  # LastLayerLaplace
        files.append((posterior_path(path), module_posterior_bytes(wrapper, model_tensors=state)))
        posterior = {
            "file": str(posterior_path(path)),
            "output_layer": wrapper.output,
            "covariance": None if wrapper.covariance is None else ("joint" if wrapper.joint else "per class"),
            "temperature": temperature,
            "stores": "the output layer's posterior variances (and covariance) as the saved model held them; "
            "bayesfuse.load returns a LastLayerLaplace",
        }
    record = fusion_bytes(result, model_tensors=state)
    if record is not None:
        files.append((fusion_path(path), record))
    clients = max((len(layer.assignments) for layer in result.layers), default=None)
    report = {
        "method": result.method,
        "architecture": {
            "groups": list(result.groups),
            "source": "saved from Python (bayesfuse.save)",
            "spec_file": None,
            "network": None,  # never built from the report: load's like= when loading["like"] says so
            **input_record(getattr(result, "example_input", None)),  # fuse's example_input: load runs on it
        },
        "load": loading,
        "hyper": finite_json(result.hyper),
        "inputs": None if clients is None else [{"model": j} for j in range(clients)],
        "clients": "the models in the order fuse was given them (hyper's fused_order: the order they were fused)",
        "fused_order": finite_json(result.hyper.get("fused_order")),
        "summaries": finite_json(result.hyper.get("summaries") or {}),
        "posterior": posterior,
        "heads": heads,
        "fusion_record": None
        if record is None
        else {
            "file": str(fusion_path(path)),
            "stores": "each matched layer's global units' posterior mean and variance, counts, assignments and "
            "objective; bayesfuse.load returns them as model.fusion",
        },
        "global_sizes": [int(s) for s in result.sizes],
        "model_tensors_sha256": tensors_sha256(state),
        "converged": bool(result.converged),
        "layers": [
            {
                "group": group,
                "global_units": int(layer.n_global),
                "converged": bool(getattr(layer, "converged", True)),
                "assignments": [np.asarray(a).tolist() for a in layer.assignments],
                "objective": [float(v) if np.isfinite(v) else None for v in layer.objective],
            }
            for group, layer in zip(result.groups, result.layers)
        ],
        "versions": {
            "bayesfuse": _version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "seconds": float(result.seconds),
    }
    write_fusion_files(path, state_dict_bytes(OrderedDict(state), fmt), report, files, force=force)
    return report


def _version() -> str:
    """bayesfuse's version: the package is imported whenever this module is (read, not imported:
    ``bayesfuse`` exports :func:`save`)."""
    return str(sys.modules[__name__.partition(".")[0]].__version__)
