"""``bayesfuse fuse``: fuse model files from collaborators into one file plus a JSON report.

Inputs are state_dicts of MLPs of any depth (any parameter names: layers are read in file
order as ``weight``/``bias`` pairs), ConvNets with batch norms, LSTM classifiers, or anything an
architecture spec file describes (:mod:`bayesfuse.nets.spec`); or
:class:`~bayesfuse.models.bnn.HorseshoeBNN` state_dicts. Files are put in a canonical order (by content hash) before fusing, so the order
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

METHODS = ("pfnm", "nafi", "fedma", "kl", "fedavg")
HYPER_KEYS = {
    "pfnm": {"noise_var": float, "prior_var": float, "gamma0": float, "cost": str, "n_iter": int, "direction": str},
    "nafi": {"noise_var": float, "prior_var": float, "gamma0": float, "kl_weight": float, "cost": str, "n_iter": int,
             "direction": str},
    "fedma": {},
    "kl": {"reg": float, "solver": str, "n_iter": int},
    "fedavg": {},
}
ARCHS = ("auto", "mlp", "cnn", "lstm")
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
    from bayesfuse.nets.spec import entry_order

    pairs = []
    for key in entry_order(sd):
        t = sd[key]
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


def _load_spec(path, names):
    from bayesfuse.nets.spec import spec_from_dict

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"architecture spec {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"architecture spec {path} is not JSON ({err})") from None
    return spec_from_dict(data)


def _fuse_point_estimates(state_dicts, names, method, hyper, seed, arch, spec_path):
    """Match (pfnm/nafi) or average (fedavg) state_dicts described by a permutation spec."""
    from bayesfuse.baselines import fedavg_state_dicts
    from bayesfuse.fusion import _warn_single, resolve_hyper
    from bayesfuse.inference.layerwise import match_layerwise
    from bayesfuse.nets.spec import spec_for_state_dict

    if spec_path is not None:
        spec = _load_spec(spec_path, names)
    else:
        if arch in ("auto", "mlp") and not any(t.ndim in (3, 4) for t in state_dicts[0].values()) and not any(
                k.endswith("running_mean") or "weight_ih_l" in k for k in state_dicts[0]):
            for sd, n in zip(state_dicts, names):
                _linear_pairs(sd, n)  # clearest messages for plain MLP files
        spec = spec_for_state_dict(state_dicts[0], arch, names[0])
    for sd, n in zip(state_dicts, names):
        spec.check(sd, n)
        for k, t in sd.items():
            if 0 in t.shape:
                raise ValueError(f"{n}: layer entry {k!r} has zero width {tuple(t.shape)}")
    if not spec.groups:
        raise ValueError(f"{names[0]}: the network has no hidden layer to match")
    if method == "fedavg":
        for sd, n in zip(state_dicts[1:], names[1:]):
            for k, t in sd.items():
                if t.shape != state_dicts[0][k].shape:
                    raise ValueError(f"{n}: fedavg needs identical widths, {k!r} has shape {tuple(t.shape)} and "
                                     f"{tuple(state_dicts[0][k].shape)} in {names[0]}")
        fused = fedavg_state_dicts(state_dicts)
        sizes = spec.sizes({k: v.numpy() for k, v in fused.items()})
        return OrderedDict(fused), [], [sizes[g] for g in spec.groups], spec
    settings = resolve_hyper(method, **{k: v for k, v in hyper.items() if k in ("noise_var", "prior_var", "gamma0",
                                                                                 "kl_weight")})
    arrays = [{k: t.detach().double().numpy() if t.is_floating_point() else t.numpy() for k, t in sd.items()}
              for sd in state_dicts]
    _warn_single(arrays, stacklevel=4)
    res = match_layerwise(arrays, spec, cost=hyper.get("cost", "pfnm"), n_iter=hyper.get("n_iter", 10), seed=seed,
                          direction=hyper.get("direction", "bottom-up"), names=names, **settings)
    fused = OrderedDict((k, torch.as_tensor(res.state_dict[k]).to(state_dicts[0][k].dtype)) for k in state_dicts[0])
    return fused, [res.layers[g] for g in spec.groups], [res.sizes[g] for g in spec.groups], spec


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
    arch: str = "auto",
    spec_path: str | Path | None = None,
) -> dict:
    """Fuse checkpoint files; write the fused state_dict to ``out`` and a report to ``out + '.json'``.

    Point-estimate networks are described by a permutation spec: read from ``spec_path`` (JSON,
    :func:`~bayesfuse.nets.spec.spec_to_dict`) or derived from the first file's entries for
    ``arch`` (:func:`~bayesfuse.nets.spec.spec_for_state_dict`). Nothing is written unless
    fusion succeeds; existing outputs are replaced only with ``force``. Returns the report.
    """
    from bayesfuse import __version__
    from bayesfuse.fusion import fuse

    start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "fedma":
        raise ValueError("fedma retrains each client between layers, so it needs the clients' data, not only their "
                         "files; run it where the data is (bayesfuse.fuse(models, 'fedma', data=...) or "
                         "`bayesfuse demo --methods fedma`), or fuse the files in one shot with pfnm or nafi")
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
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
        fused_sd, layers, sizes, spec = _fuse_point_estimates(state_dicts, names, method, hyper, seed, arch, spec_path)
    report = {
        "method": method,
        "architecture": None if all(is_bnn) else {"groups": list(spec.groups), "spec_file": str(spec_path) if spec_path
                                                  else None},
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
