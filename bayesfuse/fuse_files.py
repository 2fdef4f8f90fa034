"""``bayesfuse fuse``: fuse model files from collaborators into one file plus a JSON report.

Inputs are state_dicts of MLPs of any depth (any parameter names: layers are read in file
order as ``weight``/``bias`` pairs), ConvNets with batch norms, LSTM classifiers, or anything an
architecture spec file describes (:mod:`bayesfuse.inference.spec`); or
:class:`~bayesfuse.models.bnn.HorseshoeBNN` state_dicts. A safetensors file that does not record
the order of its entries (one written by another tool) gets a plain MLP's layer order from the
shapes, and is refused when the shapes chain in several orders.

Files are put in a canonical order before fusing, by a digest of their tensors
(:func:`~bayesfuse.checkpoints.tensors_sha256`: names, dtypes, shapes and bytes, whatever the
file's name or format), so neither the order they are given in nor their names change the
result; the same tensors and seed give a bit-identical output.
"""

from __future__ import annotations

import functools
import json
import math
import platform
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence, TypedDict

import numpy as np
import torch

from bayesfuse import __version__, methods
from bayesfuse._io import finite_json, jsonable
from bayesfuse._text import first_line
from bayesfuse.checkpoints import (
    Checkpoint,
    heads_bytes,
    heads_path,
    input_record,
    output_format,
    posterior_bytes,
    posterior_path,
    read_checkpoint,
    state_dict_bytes,
    tensors_sha256,
)
from bayesfuse.core import State, averaged_states, fuse_states, unpermuted_spec
from bayesfuse.fusion_record import check_fusion_outputs, fusion_bytes, fusion_path, write_fusion_files
from bayesfuse.inference._backend import check_device
from bayesfuse.inference.client_heads import default_head, default_pool
from bayesfuse.inference.spec import Axis, PermutationSpec, entry_order, spec_for_state_dict, spec_from_dict
from bayesfuse.models.bnn_sites import is_bnn_state, state_depth, state_keys
from bayesfuse.summaries import load_summary, summary_path

__all__ = ["fuse_files", "ARCHS", "SUMMARY_MODES"]

ARCHS = ("auto", "mlp", "cnn", "lstm")
#: ``summaries=``: "auto" reads each input's summary beside it (when every input has one), "none" ignores them.
SUMMARY_MODES = ("auto", "none")


def check_outputs_not_inputs(outputs: Sequence, inputs: Sequence) -> None:
    """Refuse (``ValueError``) an output that is also one of the run's inputs (a model, a summary
    beside one, an architecture spec, a class-counts file), whatever ``force`` says."""
    read = {Path(p).resolve(): Path(p) for p in inputs if p is not None}
    for output in outputs:
        if Path(output).resolve() in read:
            raise ValueError(f"the output {output} is also an input ({read[Path(output).resolve()]}); write elsewhere")


def _linear_pairs(sd: dict, name: str) -> list[tuple[str, str]]:
    """(weight key, bias key) of each Linear layer, in the order of ``sd`` (forward order)."""
    pairs = []
    for key in sd:
        t = sd[key]
        if t.ndim == 2:
            bias = key[: -len("weight")] + "bias" if key.endswith("weight") else None
            if bias is None or bias not in sd or sd[bias].shape != (t.shape[0],):
                raise ValueError(
                    f"{name}: parameter {key!r} {tuple(t.shape)} has no matching bias, so the file is not a "
                    "plain MLP's; give the network itself (like=model)"
                )
            pairs.append((key, bias))
        elif t.ndim not in (1,):
            raise ValueError(f"{name}: parameter {key!r} has shape {tuple(t.shape)}; only Linear layers are supported")
    if not pairs:
        raise ValueError(f"{name}: no Linear layers (2-D weight tensors) found")
    for (w_prev, _), (w_next, _) in zip(pairs[:-1], pairs[1:]):
        if sd[w_prev].shape[0] != sd[w_next].shape[1]:
            raise ValueError(
                f"{name}: layer {w_prev!r} {tuple(sd[w_prev].shape)} does not feed {w_next!r} {tuple(sd[w_next].shape)}"
            )
    for w, _ in pairs:
        if 0 in sd[w].shape:
            raise ValueError(f"{name}: layer {w!r} has zero width {tuple(sd[w].shape)}")
    return pairs


def _check_finite(sd: dict, name: str) -> None:
    for key, t in sd.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{name}: parameter {key!r} contains NaN or infinite values")


def _read_json(path: str | Path, what: str):
    """The JSON value in the file ``path``; errors name the file as ``what``."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{what} {path} is a directory; give its JSON file")
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{what} {path} is not JSON ({err})") from None
    except OSError as err:
        raise type(err)(f"{what} {path} cannot be read ({err.strerror or err})") from None


def _load_spec(path: str | Path) -> PermutationSpec:
    """The permutation spec in a JSON file; errors name the file."""
    data = _read_json(path, "architecture spec")
    try:
        return spec_from_dict(data)
    except (ValueError, TypeError) as err:
        raise ValueError(f"architecture spec {path}: {err}") from None


def read_class_counts(path: str | Path) -> dict[str, list[float]]:
    """Class counts from a JSON file: an object mapping each model file (its path as given to
    :func:`fuse_files`, or its file name) to its training examples per class, e.g.
    ``{"client0.pt": [120, 0, 35], "client1.pt": [3, 80, 41]}``."""
    data = _read_json(path, "class counts")
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise ValueError(
            f"class counts {path}: expected a JSON object mapping each model file to a list of "
            'examples per class, e.g. {"client0.pt": [120, 0, 35]}'
        )
    return data


def _counts_in_order(class_counts: Mapping, names: Sequence[str]) -> np.ndarray:
    """(J, K) rows of ``class_counts`` for the files ``names`` (paths as given), each found under
    its path (spelled any way that names the same file) or its file name; every key must name
    one of the files, and no file may be named twice."""
    if not isinstance(class_counts, Mapping):
        raise ValueError(
            "class counts must map each model file (its path or its file name) to its examples per "
            f"class, got a {type(class_counts).__name__}"
        )
    keys: dict[Path, str] = {}
    for k in class_counts:
        if Path(k) in keys:
            raise ValueError(f"class counts: {k} is given twice (also as {keys[Path(k)]})")
        keys[Path(k)] = k
    resolved = {p: p.resolve() for p in keys}
    by_name: dict[str, list[str]] = {}
    for n in names:
        by_name.setdefault(Path(n).name, []).append(n)
    rows, used = [], set()
    for n in names:
        path = Path(n)
        target = path.resolve()
        found = [p for p in keys if p == path or resolved[p] == target or p == Path(path.name)]
        if not found:
            raise ValueError(f"class counts: no entry for {n} (key it by its path or its file name)")
        if len(found) > 1:
            raise ValueError(f"class counts: {n} is given twice (as {' and '.join(str(keys[p]) for p in found)})")
        key = found[0]
        if key == Path(path.name) and key != path and len(by_name[path.name]) > 1:
            raise ValueError(
                f"class counts: the file name {path.name} names {len(by_name[path.name])} inputs; key them by path"
            )
        used.add(key)
        row = class_counts[keys[key]]
        if not isinstance(row, (list, tuple, np.ndarray)) or not all(
            isinstance(c, (int, float, np.integer, np.floating)) and not isinstance(c, bool) for c in row
        ):
            raise ValueError(f"class counts of {n}: expected a list of numbers per class, got {row!r}")
        if not all(math.isfinite(c) and c >= 0 for c in row):
            raise ValueError(f"class counts of {n} must be finite and non-negative, got {list(row)!r}")
        if not all(float(c).is_integer() for c in row):
            raise ValueError(f"class counts of {n} must be whole numbers of examples, not shares: got {list(row)!r}")
        with np.errstate(over="ignore"):
            total = float(np.sum(np.asarray(row, dtype=np.float64)))
        if not (math.isfinite(total) and total > 0):
            raise ValueError(f"class counts of {n} must sum to a finite number above 0, got {list(row)!r}")
        rows.append([float(c) for c in row])
    unknown = sorted(str(keys[p]) for p in keys if p not in used)
    if unknown:
        raise ValueError(f"class counts name files that are not inputs: {', '.join(unknown)}")
    if len({len(r) for r in rows}) > 1:
        raise ValueError(
            f"class counts: every file needs one count per class; got lengths "
            f"{', '.join(f'{n}: {len(r)}' for n, r in zip(names, rows))}"
        )
    return np.array(rows)


def _forward_order(checkpoint: Checkpoint, name: str, spec: PermutationSpec | None) -> "OrderedDict":
    """A file's entries in forward order: as the file records it, else from the spec or the shapes.

    A HorseshoeBNN's names say everything (:func:`~bayesfuse.models.bnn_sites.state_keys`). A
    file that records no order (safetensors from another tool) is put in the order of the
    architecture spec when one is given, else a plain MLP's layers in the one order their
    shapes chain in (:func:`~bayesfuse.inference.spec.entry_order`; several orders are refused).
    """
    sd = checkpoint.tensors
    if is_bnn_state(sd):
        depth = state_depth(sd)
        assert depth is not None  # is_bnn_state: the keys of some depth
        keys = list(state_keys(depth))
    elif checkpoint.order_recorded:
        keys = entry_order(sd)
    elif spec is not None:
        keys = [k for k in spec.axes if k in sd] + [k for k in sd if k not in spec.axes]
    else:
        keys = entry_order(sd, {k: tuple(t.shape) for k, t in sd.items()}, name)
    return OrderedDict((k, sd[k]) for k in keys)


def _network_spec(state_dicts, names, arch, spec, like=None, example_input=None):
    """The permutation spec of point-estimate files (``spec``, traced from the network ``like``, or
    read off the names), checked against every file, and where it came from (for the report)."""
    source = "spec file" if spec is not None else None
    if spec is not None and like is not None and not spec.widths:
        spec, held = _traced_widths(spec, like, example_input)
        source = f"spec file, the widths the network holds ({', '.join(held)}) traced from it" if held else source
    if spec is None and like is not None:
        from bayesfuse.nets.tracing import spec_from_module

        spec, source = (
            spec_from_module(like, example_input),
            f"traced from {type(like).__module__}.{type(like).__qualname__}",
        )
    if spec is None:
        attention = next((k for k in state_dicts[0] if k.endswith("in_proj_weight")), None)
        if attention is not None:
            raise ValueError(
                f"{names[0]}: entry {attention!r} is an nn.MultiheadAttention's, and entry names do not show "
                "how the network uses it; give the network itself (like=model)"
            )
        source = (
            "entry names, as a plain chain" + (" (--arch {})".format(arch) if arch != "auto" else "")
            if not any("weight_ih_l" in k for k in state_dicts[0])
            else "entry names, as an LSTM classifier"
        )
        if (
            arch in ("auto", "mlp")
            and not any(t.ndim in (3, 4) for t in state_dicts[0].values())
            and not any(k.endswith("running_mean") or "weight_ih_l" in k for k in state_dicts[0])
        ):
            for sd, n in zip(state_dicts, names):
                _linear_pairs(sd, n)  # clearest messages for plain MLP files
        spec = spec_for_state_dict(state_dicts[0], arch, names[0], ordered=True)
    for sd, n in zip(state_dicts, names):
        spec.check(sd, n)
        for k, t in sd.items():
            if 0 in t.shape:
                raise ValueError(f"{n}: layer entry {k!r} has zero width {tuple(t.shape)}")
    if not spec.groups:
        raise ValueError(f"{names[0]}: the network has no hidden layer to match")
    return spec, source


def _traced_widths(spec: PermutationSpec, like, example_input=None) -> tuple[PermutationSpec, list[str]]:
    """``spec`` (a file's, listing no ``widths``) with the numbers ``like``'s modules hold as
    widths (``self.hidden_dim``) traced from it, each on the file's group of an entry axis the
    traced spec gives it; and their paths. Nothing where ``like`` does not trace, or where an
    axis of the file's spec does not hold the traced one's units alike (the run check refuses)."""
    from dataclasses import replace

    from bayesfuse.nets.graph_spec import UnsupportedLayerError
    from bayesfuse.nets.tracing import spec_from_module

    try:
        traced = spec_from_module(like, example_input)
    except (UnsupportedLayerError, ValueError):  # a file is given because the network does not trace
        return spec, []
    widths = {}
    for path, held in traced.widths.items():
        mapped = {
            Axis(mine.group, held.outer, held.inner)
            for key, axes in traced.axes.items()
            for dim, theirs in enumerate(axes)
            if theirs is not None and theirs.group == held.group and key in spec.axes and dim < len(spec.axes[key])
            for mine in [spec.axes[key][dim]]
            if mine is not None and (mine.outer, mine.inner) == (theirs.outer, theirs.inner)
        }
        if len(mapped) == 1:
            widths[path] = mapped.pop()
    return (replace(spec, widths=widths), list(widths)) if widths else (spec, [])


def _check_like(
    like, fused_sd: Mapping, example_input=None, *, run: bool = True, spec: PermutationSpec | None = None
) -> torch.nn.Module:
    """Load the fused state into ``like``'s architecture at the fused widths (the numbers its
    modules hold as widths, ``spec.widths``, set to theirs) and run it once
    (without ``run``, only where an input can be had that runs through ``like`` itself: the
    clients' widths, averaged, run where theirs do); the model."""
    from bayesfuse.nets.arch import check_runs, rebuild
    from bayesfuse.nets.graph_spec import check_example_runs, example_input_for

    try:
        model = rebuild(like, fused_sd, spec)
    except (RuntimeError, KeyError, ValueError) as err:
        raise ValueError(
            f"the fused state does not load into {type(like).__name__} ({str(err).strip().splitlines()[0]})"
        ) from None
    try:
        x = example_input_for(like, example_input) if run else check_example_runs(like, example_input)
    except ValueError:
        if run:
            raise
        return model  # the clients' own widths, averaged: it runs where theirs do
    check_runs(model, x, what=f"the fused {type(like).__name__}")
    return model


def _split_attention(like, state: Mapping, name: str) -> "OrderedDict[str, torch.Tensor]":
    """A file of ``like``'s architecture with its ``nn.MultiheadAttention`` entries split into
    heads (:func:`~bayesfuse.nets.attention.split_state_dict`), or one line naming the file."""
    from bayesfuse.nets.attention import split_state_dict

    try:
        return split_state_dict(like, state)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def _merged_attention(fused_model, template, fused_sd: Mapping) -> tuple["OrderedDict[str, torch.Tensor]", str]:
    """The fused state with ``nn.MultiheadAttention`` entries again where the fused heads allow
    (:func:`~bayesfuse.nets.attention.merged_where_possible`: it then loads into the caller's network
    as it is), else as :class:`~bayesfuse.nets.attention.HeadAttention`'s; and what the report says."""
    from bayesfuse.nets.attention import SPLIT_NOTE, merged_where_possible

    merged, why = merged_where_possible(fused_model, template)
    if why is not None:
        return OrderedDict(fused_sd), (
            f"{SPLIT_NOTE}; written as HeadAttention, which computes the same function ({why}): load it with "
            f"bayesfuse.load(path, like={type(template).__name__}(...))"
        )
    dtype = next(iter(fused_sd.values())).dtype
    state = OrderedDict(
        (k, t.detach().to(dtype) if t.is_floating_point() else t) for k, t in merged.state_dict().items()
    )
    return state, f"{SPLIT_NOTE}, then merged back (the fused heads have its widths)"


def _input_summaries(names: Sequence[str], mode: str, method: str, kind: str) -> tuple[list | None, dict]:
    """The summaries beside the inputs ``names`` (canonical order) that ``mode`` asks for, and
    what the report says about them: used (with their files), or why the fusion is data-free.

    With ``mode="auto"`` and a method that reads summaries for ``kind``, every input's
    :func:`~bayesfuse.summaries.summary_path` is read when every input has one; when only some
    have one, the files without are named in the error.
    """
    if mode == "none":
        return None, {"used": False, "path": "data-free", "reason": "summaries='none'"}
    if kind not in methods.METHODS[method].summaries:
        return None, {
            "used": False,
            "path": "data-free",
            "reason": f"{method} reads no client summaries for {kind} inputs",
        }
    files = [summary_path(n) for n in names]
    present = [f.is_file() for f in files]
    if not any(present):
        return None, {"used": False, "path": "data-free", "reason": "no input has a summary beside it"}
    if not all(present):
        missing = [n for n, p in zip(names, present) if not p]
        raise ValueError(
            f"only some inputs have a client summary beside them; none for {', '.join(missing)} "
            f"(expected {files[present.index(False)].name}): summarize them too (bayesfuse summarize "
            "MODEL --data ...) or fuse without summaries (summaries='none')"
        )
    return [load_summary(f) for f in files], {
        "files": [str(f) for f in files],
        "file_bytes": [f.stat().st_size for f in files],
    }


@contextmanager
def _naming_summary_files(names: Sequence[str], summaries_report: dict) -> Iterator[None]:
    """Re-raise a refused summary (:class:`~bayesfuse.summaries.SummaryError`, which names its
    client's model file) naming the summary file too, the one to fix or compute again."""
    from bayesfuse.summaries import SummaryError

    try:
        yield
    except SummaryError as err:
        message = str(err)
        for name, file in zip(names, summaries_report.get("files", ())):
            if message.startswith(f"{name}: "):
                raise SummaryError(f"{file} (the summary of {name}): {message[len(name) + 2 :]}") from None
        raise


def _output_posterior(fused, fused_sd: dict, out: Path, heads_kept: bool = False) -> tuple[list, dict | None]:
    """The file of the output layer's fused precisions (:func:`~bayesfuse.checkpoints.posterior_bytes`)
    and its entry in the report, which says what :func:`bayesfuse.load` returns (the clients'
    heads where ``heads_kept``); nothing without a fused precision."""
    if getattr(fused, "precision", None) is None:  # BNNs, and networks fused without summaries
        return [], None
    entries = [k for k in fused.spec.output if k in fused.precision]
    output = entries[0].rpartition(".")[0] if entries else ""
    if not entries or any(k.rpartition(".")[0] != output for k in entries):
        raise ValueError(
            f"the fused posterior needs one output layer; the output entries are {list(fused.spec.output)}"
        )
    path = posterior_path(out)
    data = posterior_bytes({k: fused.precision[k] for k in entries}, output=output, model_tensors=fused_sd)
    return [(path, data)], {
        "file": str(path),
        "output_layer": output,
        "entries": entries,
        "stores": (
            "fused posterior precision of each entry of the shared output layer (variance = 1 / precision); "
            "bayesfuse.load returns the clients' heads beside it (ClientHeads), not this layer"
            if heads_kept
            else "fused posterior precision of each output-layer entry (variance = 1 / "
            "precision); bayesfuse.load returns a LastLayerLaplace with it"
        ),
    }


def _check_head(head: str, pool: str | None, method: str, hyper: dict, pseudo_count: float | None = None) -> None:
    """``head``, ``pool`` and ``pseudo_count`` are known, and ``head`` is not also given as a key."""
    if head not in ("auto", "shared", "clients"):
        raise ValueError(f"unknown head={head!r}; choose auto, shared or clients")
    if pool is not None and pool not in ("linear", "log"):
        raise ValueError(f"unknown pool={pool!r}; choose linear or log")
    if pool is not None and head == "shared":
        raise ValueError(
            "pool (--pool) is how the clients' own heads are pooled: not with the shared head "
            "(--head shared, head='shared')"
        )
    if pseudo_count is not None:
        from bayesfuse.nets.heads import checked_pseudo_count

        checked_pseudo_count(pseudo_count)
        if head == "shared":
            raise ValueError(
                "pseudo_count (--pseudo-count) smooths the clients' own heads: not with the shared head "
                "(--head shared, head='shared')"
            )
    if "head" in hyper and head not in ("auto", "shared"):
        raise ValueError("head is given twice (as head= and as a hyper-parameter); give it once")


def _client_heads(
    fused, states, counts, summaries, fused_sd: dict, out: Path, pool: str | None, pseudo_count: float | None
) -> tuple:
    """The file of the clients' own heads of a one-shot fusion (:func:`~bayesfuse.checkpoints.heads_bytes`)
    and its entry in the report."""
    from bayesfuse.inference.client_heads import one_shot_heads
    from bayesfuse.nets.heads import PSEUDO_COUNT

    weight_key, _ = fused.spec.output_layer(fused.state)
    width = int(np.shape(fused.state[weight_key])[1])
    assignments = {g: layer.assignments for g, layer in zip(fused.groups, fused.layers)}
    heads = one_shot_heads(fused.spec, states, assignments, width, counts, summaries)
    smoothed = heads.get("examples") is not None
    if smoothed or pseudo_count is not None:  # heads_bytes refuses a pseudo-count for heads of no examples
        heads["pseudo_count"] = PSEUDO_COUNT if pseudo_count is None else float(pseudo_count)
    pool = pool or default_pool(summaries)
    path = heads_path(out)
    return (path, heads_bytes(heads, pool=pool, model_tensors=fused_sd)), {
        "file": str(path),
        "output_layer": heads["output"],
        "form": heads["form"],
        "pool": pool,
        "pseudo_count": heads["pseudo_count"] if smoothed else None,
        "clients": len(states),
        "stores": "each client's own output layer on the fused hidden units"
        + (f" with its {heads['form']} Laplace posterior" if heads["form"] != "map" else "")
        + (
            " and its number of examples, which smooths its predictive"
            if smoothed and heads["pseudo_count"] > 0
            else " and its number of examples (pseudo-count 0: unsmoothed)"
            if smoothed
            else ""
        )
        + "; bayesfuse.load returns a ClientHeads that predicts with them",
    }


def _wrong_kind(method: str, kind: str) -> str:
    """Why ``method`` cannot fuse checkpoints of ``kind``."""
    if kind == "network":
        return f"method {method!r} fuses HorseshoeBNN checkpoints (mean-field posteriors); these are point estimates"
    *first, last = sorted(methods.names("bnn"))
    return f"method {method!r} is for point-estimate networks; use {', '.join(first)} or {last} for BNNs"


class _FileRecord(TypedDict):
    """One input file in the report's ``inputs``."""

    path: str
    sha256: str
    tensors_sha256: str
    order_recorded: bool
    state_dict_key: str | None


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
    device=None,
    dtype: str = "float64",
    class_counts: Mapping[str, Sequence[float]] | None = None,
    summaries: str = "auto",
    like=None,
    head: str = "auto",
    pool: str | None = None,
    pseudo_count: float | None = None,
    example_input=None,
) -> dict:
    """Fuse checkpoint files; write the fused state_dict to ``out`` and a report to ``out + '.json'``.

    Point-estimate networks are described by a permutation spec: read from ``spec_path`` (JSON,
    :func:`~bayesfuse.inference.spec.spec_to_dict`) or derived from the first file's entries for
    ``arch`` (:func:`~bayesfuse.inference.spec.spec_for_state_dict`). The output format is
    ``fmt`` or the one ``out``'s suffix names; they must agree. Nothing is written unless
    fusion succeeds; existing outputs are replaced only with ``force``. Returns the report,
    which lists the inputs in their canonical order. ``method`` may be given in any case. A
    training loop's checkpoint dict is fused by the one state_dict it holds; its input's
    ``state_dict_key`` in the report names that entry (None for a plain state_dict,
    :attr:`~bayesfuse.checkpoints.Checkpoint.state_dict_key`).

    ``device`` and ``dtype`` say where PFNM/NAFI on point-estimate networks run their
    arithmetic (:func:`bayesfuse.core.fuse_states`): None, NumPy float64 on the host (the
    default); a torch device (``"cpu"``, ``"cuda"``...), torch there in ``dtype``. They are
    checked before any file is read and recorded in the report (``device``, ``dtype``); a
    result computed on a device equals the host's up to round-off.

    ``summaries`` (:data:`SUMMARY_MODES`): with ``"auto"``, when the method reads client
    summaries (PFNM, NAFI on point-estimate networks) and every input has one beside it
    (``model.pt`` -> ``model.summary.safetensors``, ``bayesfuse summarize``), the networks are
    fused as Laplace posteriors (:func:`bayesfuse.core.fuse_states`); inputs of which only some
    have a summary are refused, naming those without; ``"none"`` fuses data-free. The report's
    ``summaries`` says what was used (the summaries' files and bytes) or ``"path":
    "data-free"`` and why. With summaries, the fused precision of the output layer's entries is
    written beside the model, ``out + '.posterior.safetensors'``
    (:func:`~bayesfuse.checkpoints.posterior_bytes`; the report's ``posterior``), and
    :func:`bayesfuse.load` returns the model with that posterior.

    ``head="clients"`` (PFNM and NAFI on point-estimate networks, ``--head clients``; with
    ``"auto"``, the default, when they fuse with summaries and the output layer reads hidden
    units, else ``"shared"``) keeps every client's own output layer as a head on the fused hidden units
    (:func:`~bayesfuse.inference.client_heads.one_shot_heads`; each its client's Laplace posterior
    with summaries) and writes them beside the model, ``out + '.heads.safetensors'``
    (:func:`~bayesfuse.checkpoints.heads_bytes`; the report's ``heads``), with the ``pool`` they
    predict with (``"log"`` with summaries, ``"linear"`` without, by default) and the
    ``pseudo_count`` that smooths each head's predictive by its client's examples (default
    :data:`~bayesfuse.nets.heads.PSEUDO_COUNT`; 0: unsmoothed);
    :func:`bayesfuse.load` returns a :class:`~bayesfuse.nets.heads.ClientHeads`. For BNNs,
    ``head`` is the method's key of that name.

    ``like`` (an ``nn.Module`` of the files' architecture, any widths; ``--model`` on the command
    line) has its spec traced (:func:`~bayesfuse.nets.tracing.spec_from_module`, residual streams
    included) instead of read off the entry names, and the fused state is loaded into it and
    run once before anything is written. Names alone show only a chain: where a skip
    connection is possible they are refused
    (:class:`~bayesfuse.inference.spec_io.AmbiguousArchitectureError`) unless ``arch`` says
    ``"mlp"`` / ``"cnn"``. The report's ``architecture.source`` says where the spec came from.
    ``example_input`` (a batch of inputs; ``--input-shape`` on the command line) traces and runs
    ``like`` where its first layer does not tell the input's shape.
    """
    start = time.perf_counter()
    method = methods.canonical(method)  # any case; unknown names are refused naming the closest
    methods.check_one_shot(method)
    row = methods.METHODS[method]
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if summaries not in SUMMARY_MODES:
        raise ValueError(f"unknown summaries={summaries!r}; choose one of {', '.join(SUMMARY_MODES)}")
    if example_input is not None and like is None:
        raise ValueError("example_input= traces and runs the network itself: give it too (like=model)")
    methods.check_execution(method, None, device)
    checked_device = check_device(device, dtype)  # before any file is read
    hyper = dict(hyper or {})
    _check_head(head, pool, method, hyper, pseudo_count)
    known = row.keys()
    unknown = set(hyper) - set(known)
    if unknown:
        raise ValueError(f"unknown hyper-parameters {sorted(unknown)} for {method}; known: {sorted(known)}")
    if not paths:
        raise ValueError("no model files given")
    fmt = output_format(out, fmt)
    outputs = check_fusion_outputs(out, force=force)
    out = Path(out)
    check_outputs_not_inputs(outputs, [*paths, *map(summary_path, paths), spec_path])

    seen: dict[Path, str] = {}
    for p in paths:
        resolved = Path(p).resolve()
        if resolved in seen:
            raise ValueError(f"{p} is given twice (as {seen[resolved]}): each client's file once")
        seen[resolved] = str(p)
    given_spec = _load_spec(spec_path) if spec_path is not None else None
    loaded = [read_checkpoint(p) for p in paths]
    forward = [_forward_order(c, str(p), given_spec) for c, p in zip(loaded, paths)]
    files: list[_FileRecord] = [
        {
            "path": str(p),
            "sha256": c.sha256,
            "tensors_sha256": tensors_sha256(sd),
            "order_recorded": c.order_recorded,
            "state_dict_key": c.state_dict_key,
        }
        for p, c, sd in zip(paths, loaded, forward)
    ]
    held: dict[str, str] = {}
    for f in files:  # the same client under two names would count twice
        first = held.setdefault(f["tensors_sha256"], f["path"])
        if first != f["path"]:
            raise ValueError(
                f"{f['path']} holds the same tensors as {first} (the same client twice?): give each client's file once"
            )
    order = sorted(range(len(paths)), key=lambda i: (files[i]["tensors_sha256"], files[i]["sha256"], str(paths[i])))
    state_dicts = [forward[i] for i in order]
    files = [files[i] for i in order]
    names = [f["path"] for f in files]
    counts = None if class_counts is None else _counts_in_order(class_counts, names)
    for sd, name in zip(state_dicts, names):
        _check_finite(sd, name)

    from bayesfuse.models.bnn_sites import has_heads

    for sd, name in zip(state_dicts, names):
        if has_heads(sd):
            raise ValueError(
                f"{name} is a fused BNN with one head per client (head='clients'); fuse the clients' "
                "HorseshoeBNN checkpoints instead"
            )
    is_bnn = [is_bnn_state(sd) for sd in state_dicts]
    if any(is_bnn) and not all(is_bnn):
        raise ValueError("cannot fuse Bayesian (HorseshoeBNN) and point-estimate checkpoints together")
    kind = "bnn" if all(is_bnn) else "network"
    if kind not in row.kinds:
        raise ValueError(_wrong_kind(method, kind))
    if kind == "bnn" and (pool is not None or pseudo_count is not None):
        raise ValueError(
            f"{'pool' if pool is not None else 'pseudo_count'} is for the clients' own heads of point-estimate "
            "networks; these are HorseshoeBNN checkpoints"
        )
    if kind == "bnn" and head not in ("auto", "shared"):
        hyper["head"] = head  # a BNN's heads are its method's key
    elif head == "clients" and method not in methods.ONE_SHOT_HEADS:
        raise ValueError(
            f"--head clients keeps each client's output layer through the matching's assignments: "
            f"method must be one of {', '.join(methods.ONE_SHOT_HEADS)}, got {method!r}"
        )
    client_summaries, summaries_report = _input_summaries(names, summaries, method, kind)
    if counts is not None and client_summaries is not None:
        for name, given_row, summary in zip(names, counts, client_summaries):
            if not np.array_equal(given_row, np.asarray(summary.class_counts, dtype=np.float64)):
                raise ValueError(
                    f"class counts of {name}: {given_row.astype(int).tolist()} are not its summary's "
                    f"{np.asarray(summary.class_counts).astype(int).tolist()}; give its counts, or leave them "
                    "to the summaries"
                )
    shared = kind == "network" and head == "auto" and (client_summaries is None or not row.own_heads)
    if shared and (pool is not None or pseudo_count is not None):  # known before fusing: say so now
        raise ValueError(_shared_head_refusal(method, row.own_heads, pool, None))
    given = dict(names=names, seed=seed, device=device, dtype=dtype, class_counts=counts, summaries=client_summaries)
    if kind == "bnn":
        from bayesfuse.models.bnn import HorseshoeBNN

        states: Sequence[State] = [
            HorseshoeBNN.from_state_dict(sd, n).state_dict() for sd, n in zip(state_dicts, names)
        ]
        with _naming_summary_files(names, summaries_report):
            fused = fuse_states(states, method, **given, **hyper)
        from bayesfuse.models.bnn_heads import bnn_from_state

        fused_sd = bnn_from_state(fused.state).state_dict()
    else:
        from bayesfuse.nets.attention import multihead_modules, split_heads

        template, as_given = like, state_dicts  # the caller's network, nn.MultiheadAttention included
        if like is not None and multihead_modules(like):  # fused as HeadAttention (split_heads)
            from bayesfuse.nets.graph_spec import check_example_runs

            check_example_runs(like, example_input)  # the caller's network runs, before it is rewritten
            state_dicts = [_split_attention(like, sd, n) for sd, n in zip(state_dicts, names)]
            like = split_heads(like)
        if like is not None and example_input is not None:
            from bayesfuse.nets.graph_spec import check_example_runs

            example_input = check_example_runs(like, example_input)  # a wrong shape, said now
        from bayesfuse.nets.graph_spec import UnsupportedLayerError, untraceable

        try:
            spec, source = _network_spec(state_dicts, names, arch, given_spec, like, example_input)
        except (UnsupportedLayerError, ValueError) as err:  # FedAvg needs no units: averaged as they are
            if (
                row.aligns_units
                or given_spec is not None
                or like is not None
                and not untraceable(err, like, example_input)
            ):
                raise
            state_dicts, like = as_given, template
            spec, source = unpermuted_spec(state_dicts[0]), f"none, every entry averaged as it is ({first_line(err)})"
        states = (
            state_dicts
            if not row.aligns_units
            else [  # FedAvg averages in the clients' dtype
                {k: t.detach().double().numpy() if t.is_floating_point() else t.numpy() for k, t in sd.items()}
                for sd in state_dicts
            ]
        )
        if not spec.groups:
            fused = averaged_states(states, names, method, spec, counts)
        else:
            with _naming_summary_files(names, summaries_report):
                fused = fuse_states(states, method, spec=spec, **given, **hyper)
        fused_sd = OrderedDict(  # each entry in the widest dtype the clients give it, whatever their order
            (
                k,
                torch.as_tensor(fused.state[k]).to(
                    functools.reduce(torch.promote_types, (sd[k].dtype for sd in state_dicts))
                ),
            )
            for k in state_dicts[0]
        )
        from bayesfuse.nets.arch import check_recurrent_widths

        check_recurrent_widths(fused_sd)  # never a stacked LSTM no module can hold, network given or not
        if like is not None:  # never a file that cannot be loaded into the user's network and run
            fused_model = _check_like(like, fused_sd, example_input, run=bool(spec.groups), spec=spec)
            if template is not like:
                fused_sd, fused.hyper["attention"] = _merged_attention(fused_model, template, fused_sd)
    report = {
        "method": method,
        "architecture": None
        if all(is_bnn)
        else {
            "groups": list(spec.groups),
            "source": source,
            "spec_file": str(spec_path) if spec_path else None,
            "network": None if like is None else f"{type(like).__module__}:{type(like).__qualname__}",
            # what the network was traced and run on (--input-shape), for bayesfuse.load to run it on again
            **input_record(example_input if like is not None else None),
            # numbers the network's modules hold that follow the fused widths (self.hidden_dim), at them
            **({"widths": spec.held_widths(fused_sd)} if spec.widths else {}),
        },
        "hyper": finite_json(fused.hyper),
        "hyper_given": finite_json(hyper),
        "seed": seed,
        "device": None if checked_device is None else str(checked_device),
        "dtype": dtype,
        "inputs": files,
        "fused_order": names,
        "class_counts": None if counts is None else counts.tolist(),
        "summaries": jsonable({**fused.hyper.get("summaries", {}), **summaries_report}),
        "posterior": None,
        "heads": None,
        "fusion_record": None,
        "global_sizes": [int(s) for s in fused.sizes],
        "model_tensors_sha256": tensors_sha256(fused_sd),
        "converged": fused.converged,
        "layers": [
            {
                "group": group,
                "global_units": int(layer.n_global),
                "converged": bool(layer.converged),
                "assignments": [np.asarray(a).tolist() for a in layer.assignments],
                "objective": [float(v) if np.isfinite(v) else None for v in layer.objective],
            }
            for group, layer in zip(fused.groups, fused.layers)
        ],
        "versions": {
            "bayesfuse": __version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "seconds": time.perf_counter() - start,
    }
    if kind == "network" and head == "auto":  # the clients' heads, by default with summaries (as bayesfuse.fuse)
        head, refused = default_head(row.own_heads, client_summaries, fused.spec, fused.state)
        if refused:
            report["hyper"]["head"] = f"shared ({refused})"
        if head == "shared" and (pool is not None or pseudo_count is not None):
            raise ValueError(_shared_head_refusal(method, row.own_heads, pool, refused))
    heads_kept = kind == "network" and head == "clients"
    posterior, report["posterior"] = _output_posterior(fused, fused_sd, out, heads_kept)
    if heads_kept:
        heads_file, report["heads"] = _client_heads(
            fused, states, counts, client_summaries, fused_sd, out, pool, pseudo_count
        )
        posterior.append(heads_file)
        report["hyper"].update(head="clients", pool=report["heads"]["pool"])
        if report["heads"]["pseudo_count"] is not None:
            report["hyper"]["pseudo_count"] = report["heads"]["pseudo_count"]
    # the record's clients are the files in fused_order (a loaded fusion's hyper says so)
    record = fusion_bytes(fused, model_tensors=fused_sd, hyper={**report["hyper"], "fused_order": names})
    if record is not None:
        posterior.append((fusion_path(out), record))
        report["fusion_record"] = {
            "file": str(fusion_path(out)),
            "stores": "each matched layer's global units' "
            "posterior mean and variance, counts, assignments and objective; bayesfuse.load "
            "returns them as model.fusion",
        }
    # the model, its report and its side files are one unit: all written, or (without force) none
    write_fusion_files(out, state_dict_bytes(fused_sd, fmt), report, posterior, force=force)
    return report


def _shared_head_refusal(method: str, own_heads: bool, pool: str | None, refused: str | None) -> str:
    """Why ``pool`` (else a pseudo-count) is refused where the fusion keeps the shared head: the
    output layer allows no client heads (``refused``), the method keeps none, or no summaries."""
    what = (
        "pool (--pool) is how the clients' own heads are pooled"
        if pool is not None
        else "pseudo_count (--pseudo-count) smooths the clients' own heads"
    )
    if refused:
        why = refused
    elif not own_heads:
        why = f"{method} keeps no client heads ({', '.join(methods.ONE_SHOT_HEADS)} do)"
    else:
        why = "without summaries the shared head is the default: " + (
            "ask for --head clients (head='clients')"
            if pool is not None
            else "give the clients' summaries, or their class counts with --head clients (head='clients')"
        )
    return f"{what}; these networks are fused with the shared head: {why}"
