"""``bayesfuse fuse``: fuse model files from collaborators into one file plus a JSON report.

Inputs are one-hidden-layer MLP state_dicts (any parameter names: the Linear layers are read in
file order as ``weight``/``bias`` pairs) or :class:`~bayesfuse.models.bnn.HorseshoeBNN`
state_dicts. Files are put in a canonical order (by content hash) before fusing, so the order
they are given in never changes the result; the same files and seed give a bit-identical output.
"""

from __future__ import annotations

import json
import platform
import time
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from bayesfuse._io import atomic_write_text
from bayesfuse.checkpoints import FORMATS, read_checkpoint, save_state_dict

__all__ = ["fuse_files", "METHODS", "HYPER_KEYS"]

METHODS = ("pfnm", "nafi", "kl", "fedavg")
HYPER_KEYS = {
    "pfnm": {"noise_var": float, "prior_var": float, "gamma0": float, "cost": str, "n_iter": int},
    "nafi": {"noise_var": float, "prior_var": float, "gamma0": float, "kl_weight": float, "cost": str, "n_iter": int},
    "kl": {"reg": float, "solver": str, "n_iter": int},
    "fedavg": {},
}
_BNN_KEYS = {f"{p}.{s}" for p in ("loc", "log_scale") for s in ("w1", "b1", "log_lam", "log_tau", "w2", "b2")} | {
    "prior_scales"}


def parse_hyper(method: str, items: Sequence[str]) -> dict:
    """``["noise_var=2", "cost=marginal"]`` -> typed dict, checked against the method's keys."""
    known = HYPER_KEYS[method]
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--hyper expects key=value, got {item!r}")
        if key not in known:
            raise ValueError(f"unknown hyper-parameter {key!r} for {method}; known: {sorted(known) or 'none'}")
        try:
            out[key] = known[key](value)
        except ValueError:
            raise ValueError(f"hyper-parameter {key} must be {known[key].__name__}, got {value!r}") from None
    return out


def _linear_pairs(sd: dict, name: str) -> list[tuple[str, str]]:
    """(weight key, bias key) of each Linear layer, in file order."""
    pairs = []
    for key, t in sd.items():
        if t.ndim == 2:
            bias = key[: -len("weight")] + "bias" if key.endswith("weight") else None
            if bias not in sd or sd[bias].shape != (t.shape[0],):
                raise ValueError(f"{name}: parameter {key!r} {tuple(t.shape)} has no matching bias")
            pairs.append((key, bias))
        elif t.ndim not in (1,):
            raise ValueError(f"{name}: parameter {key!r} has shape {tuple(t.shape)}; only Linear layers are supported")
    if not pairs:
        raise ValueError(f"{name}: no Linear layers (2-D weight tensors) found")
    for (w_prev, _), (w_next, _) in zip(pairs[:-1], pairs[1:]):
        if sd[w_prev].shape[0] != sd[w_next].shape[1]:
            raise ValueError(f"{name}: layer {w_prev!r} {tuple(sd[w_prev].shape)} does not feed {w_next!r} "
                             f"{tuple(sd[w_next].shape)}")
    for w, _ in pairs:
        if 0 in sd[w].shape:
            raise ValueError(f"{name}: layer {w!r} has zero width {tuple(sd[w].shape)}")
    return pairs


def _check_finite(sd: dict, name: str) -> None:
    for key, t in sd.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{name}: parameter {key!r} contains NaN or infinite values")


def _to_mlp(sd: dict, pairs):
    from bayesfuse.nets.mlp import MLP

    widths = [sd[pairs[0][0]].shape[1], *(sd[w].shape[0] for w, _ in pairs)]
    model = MLP(widths[0], widths[1:-1], widths[-1])
    with torch.no_grad():
        for layer, (w, b) in zip(model.layers, pairs):
            layer.weight.copy_(sd[w].float())
            layer.bias.copy_(sd[b].float())
    return model


def _to_bnn(sd: dict, name: str):
    from bayesfuse.models.bnn import HorseshoeBNN

    H, D = sd["loc.w1"].shape
    K = sd["loc.w2"].shape[0]
    global_scale, weight_scale = (float(v) for v in sd["prior_scales"])
    bnn = HorseshoeBNN(D, H, K, global_scale=global_scale, weight_scale=weight_scale)
    try:
        bnn.load_state_dict(sd)
    except RuntimeError as err:
        raise ValueError(f"{name}: not a consistent HorseshoeBNN state_dict ({str(err).splitlines()[0]})") from None
    return bnn


def fuse_files(
    paths: Sequence[str | Path],
    method: str,
    out: str | Path,
    *,
    hyper: dict | None = None,
    fmt: str | None = None,
    force: bool = False,
    seed: int = 0,
) -> dict:
    """Fuse checkpoint files; write the fused state_dict to ``out`` and a report to ``out + '.json'``.

    Nothing is written unless fusion succeeds; existing outputs are replaced only with ``force``.
    Returns the report.
    """
    from bayesfuse import __version__
    from bayesfuse.baselines import fedavg
    from bayesfuse.fusion import fuse

    start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    hyper = dict(hyper or {})
    unknown = set(hyper) - set(HYPER_KEYS[method])
    if unknown:
        raise ValueError(f"unknown hyper-parameters {sorted(unknown)} for {method}; known: {sorted(HYPER_KEYS[method])}")
    if not paths:
        raise ValueError("no model files given")
    out = Path(out)
    report_path = out.with_name(out.name + ".json")
    fmt = fmt or FORMATS.get(out.suffix.lower()) or FORMATS.get(Path(paths[0]).suffix.lower())
    if fmt not in ("pt", "safetensors"):
        raise ValueError(f"cannot tell the output format from {out.name!r}; pass --format pt or safetensors")
    for p in (out, report_path):
        if p.exists() and not force:
            raise FileExistsError(f"{p} exists; pass --force to replace it")
    if any(Path(p).resolve() == out.resolve() for p in paths):
        raise ValueError(f"the output {out} is also an input")

    loaded = [read_checkpoint(p) for p in paths]
    state_dicts = [sd for sd, _ in loaded]
    files = [{"path": str(p), "sha256": digest} for p, (_, digest) in zip(paths, loaded)]
    order = sorted(range(len(paths)), key=lambda i: (files[i]["sha256"], str(paths[i])))
    state_dicts = [state_dicts[i] for i in order]
    names = [str(paths[i]) for i in order]
    for sd, name in zip(state_dicts, names):
        _check_finite(sd, name)

    is_bnn = [set(sd) == _BNN_KEYS for sd in state_dicts]
    if any(is_bnn) and not all(is_bnn):
        raise ValueError("cannot fuse Bayesian (HorseshoeBNN) and point-estimate checkpoints together")
    if method == "kl" and not all(is_bnn):
        raise ValueError("method 'kl' fuses HorseshoeBNN checkpoints (mean-field posteriors); these are point estimates")
    if all(is_bnn):
        if method == "fedavg":
            raise ValueError("method 'fedavg' is for point-estimate networks; use kl, nafi or pfnm for BNNs")
        models = [_to_bnn(sd, n) for sd, n in zip(state_dicts, names)]
        result = fuse(models, method, seed=seed, **hyper)
        fused_sd = result.model.state_dict()
        layers = result.layers
    else:
        pairs = [_linear_pairs(sd, n) for sd, n in zip(state_dicts, names)]
        ref_keys = [k for pair in pairs[0] for k in pair]
        for p, n in zip(pairs[1:], names[1:]):
            if [k for pair in p for k in pair] != ref_keys:
                raise ValueError(f"{n}: parameter names differ from {names[0]}'s ({ref_keys})")
        models = [_to_mlp(sd, p) for sd, p in zip(state_dicts, pairs)]
        for model, n in zip(models[1:], names[1:]):
            w0, w = models[0].widths, model.widths
            if (w[0], w[-1]) != (w0[0], w0[-1]) or len(w) != len(w0):
                raise ValueError(f"{n}: architecture {w} does not match {names[0]}'s {w0}")
            if method == "fedavg" and w != w0:
                raise ValueError(f"{n}: fedavg needs identical widths, got {w} and {w0}")
        if method == "fedavg":
            fused_model, layers, sizes = fedavg(models), [], models[0].widths[1:-1]
        else:
            result = fuse(models, method, seed=seed, **hyper)
            fused_model, layers = result.model, result.layers
        fused_sd = OrderedDict()
        for layer, (w, b) in zip(fused_model.layers, pairs[0]):
            fused_sd[w] = layer.weight.detach().to(state_dicts[0][w].dtype)
            fused_sd[b] = layer.bias.detach().to(state_dicts[0][b].dtype)

    report = {
        "method": method,
        "hyper": hyper,
        "seed": seed,
        "inputs": files,
        "fused_order": names,
        "global_sizes": [int(l.n_global if hasattr(l, "n_global") else l.n_components) for l in layers]
        if layers else [int(s) for s in sizes],
        "layers": [
            {
                "global_units": int(l.n_global if hasattr(l, "n_global") else l.n_components),
                "assignments": [np.asarray(a).tolist() for a in l.assignments],
                "objective": [float(v) for v in l.objective],
            }
            for l in layers  # noqa: E741
        ],
        "versions": {"bayesfuse": __version__, "torch": torch.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "seconds": time.perf_counter() - start,
    }
    save_state_dict(fused_sd, out, fmt=fmt, overwrite=force)
    try:
        atomic_write_text(report_path, json.dumps(report, indent=2) + "\n", overwrite=force)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return report
