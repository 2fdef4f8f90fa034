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
from typing import Any, Sequence

import numpy as np
import torch

from bayesfuse import methods
from bayesfuse._io import atomic_write_files, check_output_dir, jsonable, prepare_output_dir
from bayesfuse.baselines import Ensemble, evaluate_locals, fedavg
from bayesfuse.data.datasets import DataSplit, load_dataset
from bayesfuse.data.partition import Partition, dirichlet_partition, holdout_partition
from bayesfuse.federated import run_fedavg
from bayesfuse.fusion import ONE_SHOT_HEADS, fuse
from bayesfuse.metrics import evaluate
from bayesfuse.nets.pans import PANConfig
from bayesfuse.nets.predict import predict_proba
from bayesfuse.nets.spec import spec_from_module
from bayesfuse.nets.state import numpy_state
from bayesfuse.summaries import summarize
from bayesfuse.train import TrainConfig, new_model, torch_threads, train_clients

__all__ = ["DemoConfig", "DemoResult", "run_demo", "format_table", "DEMO_METHODS"]

COLUMNS = ("method", "accuracy", "nll", "ece", "hidden", "rounds", "seconds")
#: The methods of the table for networks the demo runs only when asked (a baseline such as
#: FedAvg always runs), with their aliases (``"fedma-nafi"``: FedMA matching with NAFI's penalty).
_TABLE_METHODS = methods.names("network", baseline=False, aliases=True)
#: Methods the demo can add after local/ensemble/fedavg: those of the table, then the demo's own
#: "fedavg-rounds", FedAvg run for as many communication rounds as FedMA uses (one per hidden
#: layer, plus the output layer).
DEMO_METHODS = _TABLE_METHODS + ("fedavg-rounds",)
#: What the demo runs unless told: the table's featured methods.
DEFAULT_METHODS = methods.names("network", featured=True)


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
    #: width multiplier of the ResNets and the vision transformer (``arch="resnet20"``, ``"resnet18"``, ``"vit"``)
    width: float = 1.0
    methods: tuple[str, ...] = DEFAULT_METHODS
    retrain_epochs: int | None = None
    pan: PANConfig | None = None
    #: hyper-parameters per fusion method (``{"nafi": {"kl_weight": 0.1}}``); see :func:`hyper_for_methods`
    hyper: dict = field(default_factory=dict)
    #: each client also summarises its data (:func:`bayesfuse.summarize`) and every method that reads
    #: summaries gets more rows: ``"METHOD 2 rounds"``, the data-free fusion and the second round of
    #: :func:`bayesfuse.fuse` (the output layer refitted from the clients' fits; every architecture
    #: without position encodings), and for MLPs and ConvNets ``"METHOD +summaries"`` fused with
    #: them in one shot (the default: for PFNM and NAFI each client's own output layer kept as its
    #: Kronecker Laplace posterior, pooled geometrically), ``"METHOD +summaries 2 rounds"`` with
    #: the second round too and ``"METHOD +summaries temperature"`` with the temperature round
    #: instead (``second_round="temperature"``: the clients score the candidates, the shared head
    #: and their own heads, at each temperature on the examples they kept back from training,
    #: :attr:`holdout`, the server keeps the best); for
    #: PFNM and NAFI on MLPs and ConvNets, ``"METHOD client heads"`` (one shot, data-free: each
    #: client's own output layer on the fused body, their class-share mixture) and ``"METHOD
    #: +summaries shared head"`` (one fused output layer with its Laplace posterior)
    summaries: bool = True
    #: with summaries, on MLPs and ConvNets: the share of each client's examples it keeps back from
    #: local training (:func:`bayesfuse.data.holdout_partition`), on which it scores the temperature
    #: round's candidates (on its training examples its own head looks better than it is); 0: none
    #: kept back, the round scores on the training examples
    holdout: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        unknown = [m for m in self.methods if m not in DEMO_METHODS]
        if unknown:
            raise ValueError(f"unknown demo methods {unknown}; known: {', '.join(DEMO_METHODS)}")
        for method, values in self.hyper.items():
            if method not in self.methods:
                raise ValueError(
                    f"hyper-parameters given for {method!r}, which is not among the methods run "
                    f"({', '.join(self.methods)})"
                )
            row, variant = methods.lookup(method)
            methods.resolve(row.name, "network", values, variant=variant)  # unknown keys and bad values, now

    def train_config(self) -> TrainConfig:
        """Local training settings. ConvNets and ResNets train faster on every core (large matrix
        products; ResNet-20 at width 1: 253 images/s on 2 threads against 159 on one, idle 2-core
        machine), MLPs and LSTMs on one (see ``benchmarks/bench_training.py``)."""
        every_core = self.arch in ("cnn", "resnet20", "resnet18")
        return TrainConfig(
            arch=self.arch,
            hidden=self.hidden,
            channels=self.channels,
            width=self.width,
            epochs=self.epochs,
            seed=self.seed,
            num_threads=None if every_core else 1,
            pan=self.pan,
        )


@dataclass
class SeedRun:
    """One seed's run: its rows (one per method), local models' metrics, split and timing.
    ``partition`` holds the examples the clients trained on, ``held`` those they kept back for
    the temperature round (None: none, :attr:`DemoConfig.holdout`)."""

    seed: int
    rows: list[dict]
    local_metrics: list[dict]
    partition: Partition
    train_seconds: float
    held: Partition | None = None


@dataclass
class DemoResult:
    """What a demo run measured, over one or more seeds.

    Attributes
    ----------
    rows : list of dict
        One per method: the mean over seeds of each number of :data:`COLUMNS`, its standard
        deviation (``accuracy_sd``, ...), the per-layer global widths of the first seed
        (``widths``) and the hyper-parameters used (``hyper``, those chosen by "auto" included).
    runs : list of SeedRun
        Each seed's own rows, local metrics and partition.
    config : DemoConfig
        The first seed's settings (``seeds`` lists all).
    seeds : tuple of int
    files : dict of str -> Path
        Files written (empty when no output directory was given).
    """

    rows: list[dict]
    runs: list[SeedRun]
    config: DemoConfig
    seeds: tuple[int, ...]
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def partition(self) -> Partition:
        """The first seed's partition."""
        return self.runs[0].partition

    @property
    def local_metrics(self) -> list[dict]:
        """The first seed's local models' metrics."""
        return self.runs[0].local_metrics

    @property
    def train_seconds(self) -> float:
        """Local training time, summed over seeds."""
        return float(sum(r.train_seconds for r in self.runs))

    def table(self) -> str:
        if len(self.seeds) == 1:
            return format_table(self.rows)
        shown = []
        for row in self.rows:
            cells = dict(row)
            for c in ("accuracy", "nll", "ece"):
                cells[c] = f"{row[c]:.4f} ± {row[c + '_sd']:.4f}"
            for c in ("hidden", "rounds"):
                cells[c] = f"{row[c]:g}" if row[c + "_sd"] == 0 else f"{row[c]:.1f} ± {row[c + '_sd']:.1f}"
            shown.append(cells)
        return format_table(shown)


#: Columns that count things (units, rounds): printed as integers.
COUNT_COLUMNS = ("hidden", "rounds")


def format_table(rows: Sequence[dict], columns: Sequence[str] = COLUMNS) -> str:
    """Fixed-width text table of ``rows`` (floats to 4 decimals; counts such as ``hidden`` and
    ``rounds``, means over one seed stored as floats, as integers)."""

    def cell(v, column: str) -> str:
        if isinstance(v, float) and column in COUNT_COLUMNS and v.is_integer():
            return str(int(v))
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    cells = [[cell(r[c], c) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(  # noqa: E731
        v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths))
    )
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def _row(method: str, metrics: dict, hidden: int, seconds: float, rounds: int = 1, *, widths=None, hyper=None) -> dict:
    return {
        "method": method,
        "accuracy": metrics["accuracy"],
        "nll": metrics["nll"],
        "ece": metrics["ece"],
        "hidden": int(hidden),
        "rounds": int(rounds),
        "seconds": float(seconds),
        "widths": [int(w) for w in widths] if widths is not None else None,
        "hyper": hyper or {},
    }


def hyper_for_methods(assignments: Sequence[str], demo_methods: Sequence[str]) -> dict[str, dict]:
    """``--hyper`` of the demo: ``key=value`` for every method run that has ``key``, or
    ``method.key=value`` for one method. Values are typed by the method table.

    Raises
    ------
    ValueError
        A malformed item, a method not run, or a key no method run knows.
    """
    tuned = [m for m in demo_methods if m in _TABLE_METHODS]
    out: dict[str, dict] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--hyper takes key=value or method.key=value, got {item!r}")
        method, dot, key = key.rpartition(".")
        targets = [method] if dot else [m for m in tuned if key in methods.lookup(m)[0].keys()]
        if dot and method not in tuned:
            raise ValueError(
                f"--hyper {item!r}: {method!r} is not among the fusion methods run ({', '.join(tuned) or 'none'})"
            )
        if not targets:
            raise ValueError(f"--hyper {item!r}: no method run ({', '.join(tuned) or 'none'}) has a key {key!r}")
        for m in targets:
            typed = methods.parse_assignments(methods.lookup(m)[0].name, [f"{key}={value}"])
            if key in out.get(m, {}):
                raise ValueError(f"--hyper gives {m}.{key} twice")
            out.setdefault(m, {}).update(typed)
    return out


_WARM = False


def _warm_up(models) -> None:
    """Fuse two clients once, untimed, so that the timings exclude one-time costs (imports,
    first calls into compiled code); done once per process."""
    global _WARM
    if not _WARM:
        fuse(models[:2], "pfnm", seed=0)
        _WARM = True


def run_demo(
    config: DemoConfig | None = None,
    *,
    seeds: Sequence[int] | None = None,
    out: str | Path | None = None,
    force: bool = False,
    verbose: bool | None = None,
    data: DataSplit | None = None,
) -> DemoResult:
    """Run the demo for each seed and, when ``out`` is given, write ``results.csv``,
    ``results.json`` and ``summary.png``.

    Parameters
    ----------
    config : DemoConfig, optional
    seeds : sequence of int, optional
        Seeds of split, initialisation and training, one run each (default: ``config.seed``).
        The rows report the mean and standard deviation over them.
    out : path, optional
        Output directory; must be empty or absent unless ``force``.
    force : bool
        Reuse a non-empty ``out``, replacing the files the demo writes there.
    verbose : bool, optional
        Progress bars; default only when stderr is a terminal.
    data : DataSplit, optional
        Use this (unstandardised) split instead of loading ``config.dataset``.

    Notes
    -----
    ``seconds`` is the time to build each global model after an untimed warm-up fusion (so
    one-time imports are not counted); for "local", the mean training time of one client.
    """
    config = config or DemoConfig()
    seeds = (config.seed,) if seeds is None else tuple(int(s) for s in seeds)
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"seeds must be distinct non-negative integers, got {list(seeds)}")
    out_dir = check_output_dir(out, force=force) if out is not None else None  # created when written
    splits = {}
    runs = []
    for seed in seeds:
        split = (data or load_dataset(config.dataset, seed=seed, path=config.data_path)).standardize()
        splits[seed] = split
        runs.append(_run_seed(replace(config, seed=seed), split, verbose))
    result = DemoResult(_summary(runs), runs, replace(config, seed=seeds[0]), seeds)
    if out_dir is not None:
        result.files = _write_outputs(result, prepare_output_dir(out_dir, force=force), splits[seeds[0]])
    return result


def _tempers(config: DemoConfig) -> bool:
    """Whether the run has temperature rows (``"METHOD +summaries temperature"``): summaries, an
    MLP or ConvNet without position encodings, and a method that fuses networks with them."""
    tabled = [m for m in config.methods if m in _TABLE_METHODS]
    return (
        config.summaries
        and config.arch in ("mlp", "cnn")
        and config.pan is None
        and any("network" in methods.lookup(m)[0].summaries for m in tabled)
    )


def _run_seed(config: DemoConfig, split: DataSplit, verbose: bool | None) -> SeedRun:
    partition = dirichlet_partition(split.train.y, config.n_clients, config.alpha, seed=config.seed)
    held = None  # the examples each client keeps back for the temperature round (its candidates' scores)
    if config.holdout and _tempers(config):
        partition, held = holdout_partition(partition, split.train.y, config.holdout, seed=config.seed)
    train_config = config.train_config()

    start = time.perf_counter()
    models = train_clients(split.train, partition, train_config, shared_init=config.shared_init, verbose=verbose)
    train_seconds = time.perf_counter() - start
    x_test, y_test = split.test.x, split.test.y
    spec = spec_from_module(models[0])
    local_widths = list(spec.sizes(numpy_state(models[0])).values())
    width = sum(local_widths)
    _warm_up(models)

    local_metrics = evaluate_locals(models, x_test, y_test)
    local_mean = {k: float(np.mean([m[k] for m in local_metrics])) for k in local_metrics[0]}
    rows = [
        _row(
            f"local (mean of {len(models)})",
            local_mean,
            width,
            train_seconds / len(models),
            rounds=0,
            widths=local_widths,
        )
    ]

    start = time.perf_counter()
    ensemble = Ensemble(models)
    rows.append(
        _row(
            "ensemble",
            evaluate(predict_proba(ensemble, x_test), y_test),
            width * len(models),
            time.perf_counter() - start,
            widths=[w * len(models) for w in local_widths],
        )
    )

    start = time.perf_counter()
    averaged = fedavg(models, weights=partition.sizes)
    seconds = time.perf_counter() - start
    rows.append(_row("fedavg", evaluate(predict_proba(averaged, x_test), y_test), width, seconds, widths=local_widths))

    retrain = replace(train_config, epochs=config.retrain_epochs or config.epochs)
    n_rounds = len(spec.groups) + 1  # FedMA: one round per hidden layer, one for the output layer
    summaries = None
    for method in config.methods:
        if method in _TABLE_METHODS:
            row, variant = methods.lookup(method)
            hyper = {**row.preset(variant), **config.hyper.get(method, {})}
            if row.needs_data:
                fused = fuse(
                    models,
                    row.name,
                    data=(split.train, partition),
                    retrain=retrain,
                    seed=config.seed,
                    verbose=verbose,
                    **hyper,
                )
            else:
                fused = fuse(models, row.name, class_counts=partition.counts, seed=config.seed, **hyper)
        else:  # "fedavg-rounds": FedAvg from one shared initialisation, as many rounds as FedMA
            start = time.perf_counter()
            with torch_threads(train_config.num_threads):
                torch.manual_seed(config.seed)
                init = new_model(split.n_features, split.n_classes, train_config)
            run = run_fedavg(init, split.train, partition, retrain, rounds=n_rounds, verbose=verbose)
            rows.append(
                _row(
                    f"fedavg x{n_rounds} rounds",
                    evaluate(predict_proba(run.model, x_test), y_test),
                    width,
                    time.perf_counter() - start,
                    rounds=n_rounds,
                    widths=local_widths,
                )
            )
            continue
        rows.append(
            _row(
                method,
                evaluate(predict_proba(fused.model, x_test), y_test),
                sum(fused.sizes),
                fused.seconds,
                rounds=fused.hyper.get("rounds", 1),
                widths=fused.sizes,
                hyper=fused.hyper,
            )
        )
        if config.summaries and "network" in row.summaries and config.pan is None:
            # an output layer that reads hidden units
            heads = row.name in ONE_SHOT_HEADS and config.arch in ("mlp", "cnn") and len(config.hidden) > 0
            variants: list[tuple[str, int, list | None, dict]] = [("2 rounds", 2, None, {})]
            if heads:
                variants.append(("client heads", 1, None, {"head": "clients", "class_counts": partition.counts}))
            if config.arch in ("mlp", "cnn"):
                if summaries is None:  # each client, on its own data, once
                    summaries = [
                        summarize(m, split.train.x[idx], split.train.y[idx]) for m, idx in zip(models, partition)
                    ]
                variants += [
                    ("+summaries", 1, summaries, {}),
                    ("+summaries 2 rounds", 2, summaries, {}),
                    ("+summaries temperature", 2, summaries, {"second_round": "temperature"}),
                ]
                if heads:
                    variants.append(("+summaries shared head", 1, summaries, {"head": "shared"}))
            for label, rounds, given, extra in variants:
                if given is None:  # the one-shot row's first round: its class counts (summaries carry their own)
                    extra = {"class_counts": partition.counts, **extra}
                data: dict[str, Any] = {}
                if rounds == 2:
                    scored = held if held is not None and extra.get("second_round") == "temperature" else partition
                    data["data"] = (split.train, scored)
                fused = fuse(
                    models, row.name, summaries=given, rounds=rounds, seed=config.seed, **data, **extra, **hyper
                )
                rows.append(
                    _row(
                        f"{method} {label}",
                        evaluate(predict_proba(fused.model, x_test), y_test),
                        sum(fused.sizes),
                        fused.seconds,
                        rounds=rounds,
                        widths=fused.sizes,
                        hyper=fused.hyper,
                    )
                )
    return SeedRun(config.seed, rows, local_metrics, partition, train_seconds, held)


def _summary(runs: Sequence[SeedRun]) -> list[dict]:
    """Mean and standard deviation over seeds of each method's numbers (rows in the first seed's order)."""
    out = []
    for i, first in enumerate(runs[0].rows):
        row = {"method": first["method"]}
        for c in COLUMNS[1:]:
            values = np.array([r.rows[i][c] for r in runs], dtype=float)
            row[c] = float(values.mean())
            row[c + "_sd"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        row["widths"], row["hyper"] = first["widths"], first["hyper"]
        out.append(row)
    return out


def _versions() -> dict[str, str]:
    import torch

    from bayesfuse import __version__

    return {
        "bayesfuse": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def _write_outputs(result: DemoResult, out_dir: Path, split: DataSplit) -> dict[str, Path]:
    columns = ("seed", *COLUMNS, "widths")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    for run in result.runs:
        writer.writerows(
            {**row, "seed": run.seed, "widths": "/".join(map(str, row["widths"] or []))} for row in run.rows
        )
    report = {
        "config": asdict(result.config),
        "seeds": list(result.seeds),
        "data": {
            "name": split.name,
            "n_train": len(split.train),
            "n_test": len(split.test),
            "n_features": split.n_features,
            "n_classes": split.n_classes,
        },
        "summary": result.rows,
        "runs": [
            {
                "seed": run.seed,
                "results": run.rows,
                "local_models": run.local_metrics,
                "client_class_counts": run.partition.counts.tolist(),
                "client_held_out_counts": None if run.held is None else run.held.counts.tolist(),
                "train_seconds": run.train_seconds,
            }
            for run in result.runs
        ],
        "seconds": "time to build each global model, after an untimed warm-up fusion; local: mean training time "
        "of one client",
        "versions": _versions(),
    }
    text = json.dumps(jsonable(report), indent=2, allow_nan=False) + "\n"
    outputs = {
        "csv": (out_dir / "results.csv", buf.getvalue().encode("utf-8")),
        "json": (out_dir / "results.json", text.encode("utf-8")),
        "figure": (out_dir / "summary.png", _figure_png(result, split)),
    }
    # one run's three files: all written, or none (never a table of one run beside another's figure)
    atomic_write_files(list(outputs.values()), overwrite=True)
    return {key: path for key, (path, _) in outputs.items()}


#: (column, axis label, whether smaller is better) of the figure's panels
_PANELS = (
    ("accuracy", "test accuracy", False),
    ("nll", "test NLL", True),
    ("ece", "ECE", True),
    ("hidden", "hidden units of the global model", True),
    ("rounds", "communication rounds", True),
)


def _figure_png(result: DemoResult, split: DataSplit) -> bytes:
    """Five panels (accuracy, NLL, ECE, global width, rounds: mean and sd over seeds, one
    horizontal bar per method) and the first seed's class counts per client."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    names = [r["method"] for r in result.rows]
    colours = [matplotlib.colormaps["tab10"](i % 10) for i in range(len(names))]
    y = np.arange(len(names))[::-1]
    n_seeds = len(result.seeds)
    for ax, (column, label, smaller) in zip(axes, _PANELS):
        means = np.array([r[column] for r in result.rows])
        sds = np.array([r[column + "_sd"] for r in result.rows])
        ax.barh(y, means, xerr=sds if n_seeds > 1 else None, color=colours, capsize=3)
        right = means + (sds if n_seeds > 1 else 0)  # where each bar's label starts
        if column == "accuracy":  # each local model of each seed, on the "local" bar
            local = [m["accuracy"] for run in result.runs for m in run.local_metrics]
            ax.scatter(
                local, np.full(len(local), y[0]) + np.linspace(-0.25, 0.25, len(local)), s=9, color="black", zorder=3
            )
            right[0] = max(right[0], max(local, default=0.0))  # the label right of the dots, not under them
        ax.set_yticks(y, names if column in ("accuracy", "hidden") else [""] * len(names))
        for yi, m, at in zip(y, means, right):
            text = f"{m:.3f}" if column in ("accuracy", "nll", "ece") else (f"{m:g}" if m == int(m) else f"{m:.1f}")
            ax.text(at, yi, " " + text, va="center", fontsize=8)
        ax.set_xlabel(label + (" (lower is better)" if smaller and column in ("nll", "ece") else ""))
        ax.set_xlim(0, max(1e-9, float((means + sds).max())) * 1.25)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_title(
        f"{split.name}: J={result.config.n_clients}, alpha={result.config.alpha}, "
        f"seeds {', '.join(map(str, result.seeds))}",
        loc="left",
        fontsize=10,
    )

    ax_hist = axes[5]
    counts = result.partition.counts
    cmap = matplotlib.colormaps["tab10"]
    bottom = np.zeros(len(counts))
    for k in range(counts.shape[1]):
        ax_hist.bar(
            np.arange(len(counts)), counts[:, k], bottom=bottom, color=cmap(k % 10), label=split.train.class_names[k]
        )
        bottom += counts[:, k]
    ax_hist.set_xlabel("client")
    ax_hist.set_ylabel("training examples")
    ax_hist.set_xticks(np.arange(len(counts)))
    ax_hist.set_title(f"class counts per client (seed {result.seeds[0]})", fontsize=10)
    ax_hist.legend(title="class", fontsize=7, ncols=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
