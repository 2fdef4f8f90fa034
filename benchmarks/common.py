"""What the benchmark scripts share: where results go, writing them, the cache of trained
clients, mean +- sd cells, the fused-network rows of ``bench_fidelity`` / ``bench_calibration``,
and the dual certificate of ``bench_wide_floor``.

The scripts run as ``python benchmarks/bench_x.py``: Python puts this folder first on
``sys.path``, so they import this module as ``common``; the tests import it as
``benchmarks.common``. Nothing here is part of bayesfuse's API.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import numpy as np

#: Where the benchmarks write their tables, JSON and figures by default.
RESULTS = Path(__file__).resolve().parent.parent / "bench-results"

M = TypeVar("M")


# --------------------------------------------------------------------------- writing results


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` (its folder made if missing) through a temporary file and a
    rename, so that a reader never sees a half-written result; an existing file is replaced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | os.PathLike, text: str) -> Path:
    """UTF-8 text counterpart of :func:`write_bytes`."""
    return write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def json_default(value):
    """``json.dumps(..., default=json_default)``: NumPy arrays and scalars as lists and numbers,
    paths as strings."""
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def machine() -> dict:
    """Where and when a benchmark ran: CPU model, cores, OS, Python, torch and the UTC date."""
    import datetime
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": cores,
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "torch": torch_version,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def write_record(
    path: str | os.PathLike,
    *,
    benchmark: str,
    options: Sequence[str],
    seconds: float,
    returncode: int,
    output: str,
    figures: Sequence[str] = (),
    **extra,
) -> Path:
    """Write one benchmark run as JSON (``run_all.py``; the documentation's benchmarks page reads it):
    the script, its options, the tables it printed, the figures it wrote, its time, the machine and date."""
    import json

    record = {
        "benchmark": benchmark,
        "options": list(options),
        "seconds": round(seconds, 1),
        "returncode": returncode,
        "machine": machine(),
        "output": output,
        "figures": list(figures),
        **extra,
    }
    return write_text(path, json.dumps(record, indent=1, default=json_default) + "\n")


# --------------------------------------------------------------------------- trained clients


def cached_models(files: Sequence[Path] | None, train: Callable[[], Sequence[M]], load: Callable[[dict], M]) -> list[M]:
    """Trained models kept between runs: ``load`` of each state_dict in ``files`` when all of
    them exist; else the models ``train()`` returns, their state_dicts saved to ``files`` first
    (``files`` None: no cache, train every time)."""
    from bayesfuse.checkpoints import load_state_dict, save_state_dict

    if files and all(Path(f).exists() for f in files):
        return [load(load_state_dict(f)) for f in files]
    models = list(train())
    for f, m in zip(files or (), models):
        Path(f).parent.mkdir(parents=True, exist_ok=True)
        save_state_dict(m.state_dict(), f, overwrite=True)
    return models


def wide_models(cache: Path, data_path: str | None) -> list[Path]:
    """The checkpoints of ten 784-1000-10 MLPs trained for 2 epochs on a Dirichlet(0.5) split of
    Fashion-MNIST (seed 0, each client its own initialisation): the wide case of ``bench_scale``
    and ``bench_wide_floor``, trained into ``cache`` when missing."""
    files = [cache / f"mlp784-1000-10_client{j}.pt" for j in range(10)]

    def train():
        from bayesfuse.data import dirichlet_partition, load_fashion_mnist
        from bayesfuse.train import TrainConfig, train_clients

        data = load_fashion_mnist(data_path).standardize()
        partition = dirichlet_partition(data.train.y, 10, 0.5, seed=0)
        return train_clients(
            data.train, partition, TrainConfig(hidden=(1000,), epochs=2, seed=0), shared_init=False, verbose=False
        )

    cached_models(files, train, load=lambda state: state)
    return files


# --------------------------------------------------------------------------- simulated federations


def simulate_posteriors(n_clients: int, n_local: int, n_true: int, dim: int, seed: int = 0):
    """``n_clients`` posteriors of ``n_local`` diagonal Gaussians each, drawn from ``n_true`` true
    components (means ~ N(0, 1), variances ~ 0.01 x LogNormal(0, 0.3^2)): each client holds a
    random subset, each component seen with its mean off the truth by N(0, 0.05^2) and its
    variance times LogNormal(0, 0.1^2). Returns the posteriors (``DiagNormal``) and each
    client's true component indices."""
    from bayesfuse.inference.expfam import DiagNormal

    rng = np.random.default_rng(seed)
    loc = rng.normal(size=(n_true, dim))
    var = 0.01 * np.exp(rng.normal(0, 0.3, size=(n_true, dim)))
    posteriors, truth = [], []
    for _ in range(n_clients):
        idx = rng.choice(n_true, n_local, replace=False)
        posteriors.append(
            DiagNormal(
                loc=loc[idx] + rng.normal(0, 0.05, size=(n_local, dim)),
                var=var[idx] * np.exp(rng.normal(0, 0.1, size=(n_local, dim))),
            )
        )
        truth.append(idx)
    return posteriors, truth


# --------------------------------------------------------------------------- options and tables


def parse_depth(text: str) -> tuple[int, ...]:
    """``"100,100"`` -> ``(100, 100)``."""
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a depth is comma-separated hidden widths, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"hidden widths must be positive, got {text!r}")
    return widths


def depth_name(hidden: Sequence[int]) -> str:
    return ",".join(map(str, hidden))


def mean_sd(values, digits: int = 4) -> str:
    """``"mean +- sd"`` (population sd) of ``values``, with ``digits`` decimals."""
    values = np.asarray(values, dtype=float)
    return f"{values.mean():.{digits}f} +- {values.std():.{digits}f}"


def by_method(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows grouped by their ``"method"``, in order of first appearance."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["method"], []).append(r)
    return out


SUMMARY_COLUMNS = ("method", "accuracy", "nll", "ece", "width", "seconds")


def summary_table(rows: list[dict]) -> str:
    """Mean +- sd over seeds per method; width as its mean and each seed's value."""
    from bayesfuse.demo import format_table

    summary = []
    for method, group in by_method(rows).items():
        widths = [r["width"] for r in group]
        summary.append(
            {
                "method": method,
                **{k: mean_sd([r[k] for r in group]) for k in ("accuracy", "nll", "ece")},
                "width": f"{np.mean(widths):.0f} ({'/'.join(map(str, widths))})",
                "seconds": f"{np.mean([r['seconds'] for r in group]):.2f}",
            }
        )
    return format_table(summary, SUMMARY_COLUMNS)


# --------------------------------------------------------------------------- fused-network rows

#: The methods whose hyper-parameters the library chooses from the models (empirical Bayes).
AUTO_METHODS = ("pfnm", "nafi")


def make_row(
    method: str, metrics: dict, sizes: Sequence[int], seconds: float, converged: bool | None = None, **extra
) -> dict:
    return {
        "method": method,
        "accuracy": float(metrics["accuracy"]),
        "nll": float(metrics["nll"]),
        "ece": float(metrics["ece"]),
        "width": int(sum(sizes)),
        "sizes": [int(s) for s in sizes],
        "seconds": float(seconds),
        "converged": converged,
        **extra,
    }


def test_metrics(model, split) -> dict:
    """Accuracy, NLL and ECE of ``model`` on ``split``'s test set."""
    from bayesfuse.metrics import evaluate
    from bayesfuse.nets.predict import predict_proba

    return evaluate(predict_proba(model, split.test.x), split.test.y)


def chosen_hyper(result) -> list[dict]:
    """Per matched layer of a ``FusionResult``, the hyper-parameters the library chose (one value per block)."""
    out = []
    for i, layer in enumerate(result.layers):
        h = getattr(layer, "hyper", None) or {}
        out.append(
            {
                "layer": result.groups[i] if i < len(result.groups) else f"layer {i + 1}",
                "blocks": [str(b).removeprefix("layers.") for b in h.get("blocks", [])],
                "noise_var": np.atleast_1d(h.get("noise_var", np.nan)).astype(float).tolist(),
                "prior_var": np.atleast_1d(h.get("prior_var", np.nan)).astype(float).tolist(),
                "gamma0": float(h.get("gamma0", np.nan)),
                "kl_weight": float(h.get("kl_weight", 0.0)),
            }
        )
    return out


#: The ECE at which :func:`ood_scores` compares predictives' OOD AUROC (the client-summary issue's bound).
MATCHED_ECE = 0.03


def ood_scores(model, split, ood) -> dict:
    """``auroc``: AUROC of predictive entropy for telling ``ood`` inputs from ``split``'s test set
    (higher: better); ``auroc_at_ece`` and ``t_at_ece``: the best AUROC over temperatures at which
    the tempered predictive's test ECE is at most :data:`MATCHED_ECE`, and that temperature
    (:func:`bayesfuse.calibration.calibration_frontier`: read on the test set, a diagnostic that
    compares predictives at one calibration, never a choice of model)."""
    from bayesfuse.calibration import auroc_at_ece, calibration_frontier
    from bayesfuse.metrics import ood_auroc, predictive_entropy
    from bayesfuse.nets.predict import predict_proba

    p, q = predict_proba(model, split.test.x), predict_proba(model, ood)
    at_ece, t = auroc_at_ece(calibration_frontier(p, split.test.y, q), MATCHED_ECE)
    return {
        "auroc": ood_auroc(predictive_entropy(p), predictive_entropy(q)),
        "auroc_at_ece": at_ece,
        "t_at_ece": t,
    }


def fused_row(name: str, models: list, part, split, method: str, seed: int | None = None, ood=None, **hyper) -> dict:
    """Fuse with ``fuse`` (ConvergenceWarnings become the row's ``converged``) and measure; with
    out-of-distribution inputs ``ood``, the row's ``auroc`` too (:func:`ood_scores`)."""
    from bayesfuse.fusion import fuse
    from bayesfuse.inference.result import ConvergenceWarning

    kwargs = {} if seed is None else {"seed": seed}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        result = fuse(models, method, class_counts=part.counts, **kwargs, **hyper)
    matched = method not in ("fedavg", "ot")
    extra = {"chosen": chosen_hyper(result)} if method in AUTO_METHODS and not hyper else {}
    if "noise_var" in hyper:
        extra["noise_var"] = float(hyper["noise_var"])
    if ood is not None:
        extra.update(ood_scores(result.model, split, ood))
    return make_row(
        name,
        test_metrics(result.model, split),
        result.sizes,
        result.seconds,
        result.converged if matched else None,
        **extra,
    )


# --------------------------------------------------------------------------- assignment duals


def optimal_duals(W: np.ndarray, match: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dual values proving ``match`` a maximum-weight matching of ``W`` (atoms x neurons, >= 0).

    The linear programme ``max sum W_il x_il`` over matchings (each atom and neuron at most once)
    has the dual ``min sum_l u_l + sum_i w_i`` with ``u, w >= 0`` and ``u_l + w_i >= W_il``. For an
    optimal ``match`` (``match[l]``: neuron l's atom, or -1) complementary slackness fixes
    ``w_i = W_{i m(i)} - u_{m(i)}`` on a matched atom i (neuron ``m(i)``), so the least feasible
    ``u`` is the smallest fixed point of

    .. math::

        u_l = \\max\\Big(b_l,\\ \\max_{i \\text{ matched}} W_{il} - W_{i m(i)} + u_{m(i)}\\Big),
        \\qquad b_l = \\max\\big(0, \\max_{i \\text{ unmatched}} W_{il}\\big),

    longest paths in the graph of alternating pairs, found by iterating from ``u = b``. The
    result is a certificate to check, not a proof: for a ``match`` that is not optimal either
    the paths grow without end (a positive cycle: ValueError after L + 1 steps) or the duals
    are feasible but worth more than the matching (an unmatched neuron or atom keeps a
    positive dual).

    Returns
    -------
    (u, w) : neurons' (L,) and atoms' (G,) duals.
    """
    G, L = W.shape
    matched = np.flatnonzero(match >= 0)
    atoms = match[matched]
    unmatched = np.ones(G, dtype=bool)
    unmatched[atoms] = False
    base = np.maximum(W[unmatched].max(axis=0, initial=0.0), 0.0)
    step = W[atoms] - W[atoms, matched][:, None]  # (matched atoms, L): W_il - W_{i m(i)}
    u = base
    for _ in range(L + 1):
        new = np.maximum(base, (step + u[matched][:, None]).max(axis=0, initial=-np.inf))
        if np.all(new <= u):
            return u, atom_duals(W, u)
        u = new
    raise ValueError("the matching is not optimal: the alternating paths have a positive cycle")


def atom_duals(W: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The least atoms' duals ``w >= 0`` with ``u_l + w_i >= W_il`` for the neurons' duals ``u``."""
    return np.maximum((W - u[None, :]).max(axis=1), 0.0)
