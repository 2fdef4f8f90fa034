"""The demo job: split a dataset across clients, train local networks, fuse, compare, report.

``bayesfuse demo`` calls :func:`run_demo`. One-shot methods (ensemble, FedAvg, PFNM, NAFI)
build one global model from the local models alone; FedMA (and FedAvg run for as many rounds)
also retrain on the clients. The table lists test accuracy, NLL, ECE, the number of hidden
units (channels included) of the global model, the communication rounds after local training
(0 for the local models themselves), and the seconds spent building the global model (for
"local", the mean training time of one client).
"""

from __future__ import annotations

import csv
import io
import json
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from bayesfuse import methods
from bayesfuse._io import atomic_write_bytes, atomic_write_text, check_output_dir, prepare_output_dir
from bayesfuse.baselines import Ensemble, evaluate_locals, fedavg
from bayesfuse.data.datasets import DataSplit, load_dataset
from bayesfuse.data.partition import Partition, dirichlet_partition
from bayesfuse.fusion import fuse
from bayesfuse.metrics import evaluate
from bayesfuse.nets.predict import predict_proba
from bayesfuse.federated import run_fedavg
from bayesfuse.nets.state import numpy_state
from bayesfuse.nets.pans import PANConfig
from bayesfuse.nets.spec import spec_from_module
from bayesfuse.train import TrainConfig, new_model, torch_threads, train_clients

__all__ = ["DemoConfig", "DemoResult", "run_demo", "format_table", "DEMO_METHODS"]

COLUMNS = ("method", "accuracy", "nll", "ece", "hidden", "rounds", "seconds")
#: Methods the demo can add after local/ensemble/fedavg. "fedavg-rounds" is FedAvg run for as
#: many communication rounds as FedMA uses (one per hidden layer, plus the output layer).
#: The demo's methods: every method of the table for networks (FedAvg always runs), then FedMA
#: matching with NAFI's penalty and FedAvg at as many rounds as FedMA.
DEMO_METHODS = tuple(m for m in methods.names("network") if m != "fedavg") + ("fedma-nafi", "fedavg-rounds")


@dataclass(frozen=True)
class DemoConfig:
    """Settings of one demo run (all recorded in ``results.json``)."""

    dataset: str = "digits"
    n_clients: int = 10
    alpha: float = 0.5
    seed: int = 0
    hidden: tuple[int, ...] = (100,)
    epochs: int = 10
    shared_init: bool = False
    data_path: str | None = None
    arch: str = "mlp"
    channels: tuple[int, ...] = (16, 32)
    methods: tuple[str, ...] = ("pfnm", "nafi")
    retrain_epochs: int | None = None
    pan: PANConfig | None = None

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in DEMO_METHODS]
        if unknown:
            raise ValueError(f"unknown demo methods {unknown}; known: {', '.join(DEMO_METHODS)}")

    def train_config(self) -> TrainConfig:
        """Local training settings. ConvNets train faster on every core (large matrix
        products), MLPs and LSTMs on one (see ``benchmarks/bench_training.py``)."""
        return TrainConfig(arch=self.arch, hidden=self.hidden, channels=self.channels, epochs=self.epochs,
                           seed=self.seed, num_threads=None if self.arch == "cnn" else 1, pan=self.pan)


@dataclass
class DemoResult:
    """What a demo run measured.

    Attributes
    ----------
    rows : list of dict
        One per method with the keys of :data:`COLUMNS`.
    local_metrics : list of dict
        Each local model's metrics on the global test set.
    partition : Partition
    config : DemoConfig
    files : dict of str -> Path
        Files written (empty when no output directory was given).
    """

    rows: list[dict]
    local_metrics: list[dict]
    partition: Partition
    config: DemoConfig
    train_seconds: float
    files: dict[str, Path] = field(default_factory=dict)

    def table(self) -> str:
        return format_table(self.rows)


def format_table(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    """Fixed-width text table of ``rows`` (floats to 4 significant decimals)."""

    def cell(v) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    cells = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(  # noqa: E731
        v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths))
    )
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def _row(method: str, metrics: dict, hidden: int, seconds: float, rounds: int = 1) -> dict:
    return {
        "method": method,
        "accuracy": metrics["accuracy"],
        "nll": metrics["nll"],
        "ece": metrics["ece"],
        "hidden": int(hidden),
        "rounds": int(rounds),
        "seconds": float(seconds),
    }


def run_demo(
    config: DemoConfig | None = None,
    *,
    out: str | Path | None = None,
    force: bool = False,
    verbose: bool | None = None,
    data: DataSplit | None = None,
) -> DemoResult:
    """Run the demo and, when ``out`` is given, write ``results.csv``, ``results.json``, ``summary.png``.

    Parameters
    ----------
    config : DemoConfig, optional
    out : path, optional
        Output directory; must be empty or absent unless ``force``.
    force : bool
        Reuse a non-empty ``out``, replacing the files the demo writes there.
    verbose : bool, optional
        Progress bars; default only when stderr is a terminal.
    data : DataSplit, optional
        Use this (unstandardised) split instead of loading ``config.dataset``.
    """
    config = config or DemoConfig()
    out_dir = check_output_dir(out, force=force) if out is not None else None  # created when written
    split = (data or load_dataset(config.dataset, seed=config.seed, path=config.data_path)).standardize()
    partition = dirichlet_partition(split.train.y, config.n_clients, config.alpha, seed=config.seed)
    train_config = config.train_config()

    start = time.perf_counter()
    models = train_clients(split.train, partition, train_config, shared_init=config.shared_init, verbose=verbose)
    train_seconds = time.perf_counter() - start
    x_test, y_test = split.test.x, split.test.y
    spec = spec_from_module(models[0])
    width = sum(spec.sizes(numpy_state(models[0])).values())

    local_metrics = evaluate_locals(models, x_test, y_test)
    local_mean = {k: float(np.mean([m[k] for m in local_metrics])) for k in local_metrics[0]}
    rows = [_row(f"local (mean of {len(models)})", local_mean, width, train_seconds / len(models), rounds=0)]

    start = time.perf_counter()
    ensemble = Ensemble(models)
    rows.append(_row("ensemble", evaluate(predict_proba(ensemble, x_test), y_test),
                     width * len(models), time.perf_counter() - start))

    start = time.perf_counter()
    averaged = fedavg(models, weights=partition.sizes)
    seconds = time.perf_counter() - start
    rows.append(_row("fedavg", evaluate(predict_proba(averaged, x_test), y_test), width, seconds))

    retrain = replace(train_config, epochs=config.retrain_epochs or config.epochs)
    n_rounds = len(spec.groups) + 1  # FedMA: one round per hidden layer, one for the output layer
    for method in config.methods:
        if method in ("pfnm", "nafi"):
            fused = fuse(models, method, class_counts=partition.counts, seed=config.seed)
        elif method in ("fedma", "fedma-nafi"):
            fused = fuse(models, "fedma", data=(split.train, partition), retrain=retrain, seed=config.seed,
                         kl_weight=methods.defaults("nafi")["kl_weight"] if method == "fedma-nafi" else None,
                         verbose=verbose)
        else:  # FedAvg from one shared initialisation, as many rounds as FedMA
            start = time.perf_counter()
            with torch_threads(train_config.num_threads):
                torch.manual_seed(config.seed)
                init = new_model(split.n_features, split.n_classes, train_config)
            run = run_fedavg(init, split.train, partition, retrain, rounds=n_rounds, verbose=verbose)
            rows.append(_row(f"fedavg x{n_rounds} rounds", evaluate(predict_proba(run.model, x_test), y_test),
                             width, time.perf_counter() - start, rounds=n_rounds))
            continue
        rows.append(_row(method, evaluate(predict_proba(fused.model, x_test), y_test), sum(fused.sizes),
                         fused.seconds, rounds=fused.hyper.get("rounds", 1)))

    result = DemoResult(rows, local_metrics, partition, config, train_seconds)
    if out_dir is not None:
        result.files = _write_outputs(result, prepare_output_dir(out_dir, force=force), split)
    return result


def _versions() -> dict[str, str]:
    import torch

    from bayesfuse import __version__

    return {"bayesfuse": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def _write_outputs(result: DemoResult, out_dir: Path, split: DataSplit) -> dict[str, Path]:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(result.rows)
    files = {"csv": atomic_write_text(out_dir / "results.csv", buf.getvalue(), overwrite=True)}
    report = {
        "config": asdict(result.config),
        "data": {"name": split.name, "n_train": len(split.train), "n_test": len(split.test),
                 "n_features": split.n_features, "n_classes": split.n_classes},
        "results": result.rows,
        "local_models": result.local_metrics,
        "client_class_counts": result.partition.counts.tolist(),
        "train_seconds": result.train_seconds,
        "versions": _versions(),
    }
    files["json"] = atomic_write_text(out_dir / "results.json", json.dumps(report, indent=2) + "\n", overwrite=True)
    files["figure"] = atomic_write_bytes(out_dir / "summary.png", _figure_png(result, split), overwrite=True)
    return files


def _figure_png(result: DemoResult, split: DataSplit) -> bytes:
    """Two panels: test accuracy by method, and each client's class histogram."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_acc, ax_hist = fig.subplots(1, 2, width_ratios=[1, 1.4])

    names = [r["method"] for r in result.rows]
    accs = [r["accuracy"] for r in result.rows]
    ax_acc.bar(range(len(names)), accs, color=[["#9e9e9e", "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860",
                    "#da8bc3"][i % 8] for i in range(len(names))])
    local_accs = [m["accuracy"] for m in result.local_metrics]
    jitter = np.linspace(-0.25, 0.25, len(local_accs))
    ax_acc.scatter(jitter, local_accs, s=12, color="black", zorder=3, label="each local model")
    for i, a in enumerate(accs):
        ax_acc.text(i, 0.02, f"{a:.3f}", ha="center", va="bottom", fontsize=9, color="white",
                    fontweight="bold")
    ax_acc.set_xticks(range(len(names)), names, rotation=15)
    ax_acc.set_ylim(0, 1.08)
    ax_acc.set_ylabel("test accuracy")
    ax_acc.set_title(f"{split.name}: J={result.config.n_clients}, alpha={result.config.alpha}")
    ax_acc.legend(loc="lower right", fontsize=8)

    counts = result.partition.counts
    cmap = matplotlib.colormaps["tab10"]
    bottom = np.zeros(len(counts))
    for k in range(counts.shape[1]):
        ax_hist.bar(np.arange(len(counts)), counts[:, k], bottom=bottom, color=cmap(k % 10),
                    label=split.train.class_names[k])
        bottom += counts[:, k]
    ax_hist.set_xlabel("client")
    ax_hist.set_ylabel("training examples")
    ax_hist.set_xticks(np.arange(len(counts)))
    ax_hist.set_title("class counts per client (Dirichlet partition)")
    ax_hist.legend(title="class", fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
