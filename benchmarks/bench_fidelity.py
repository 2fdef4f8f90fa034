"""NAFI's comparison table (Xiao & Cheng, Table 2: Local, FedAvg, OT, PFNM, NAFI): data-free fusion
of MLPs trained on a heterogeneous federation, at the library's default hyper-parameters.

Usage: python benchmarks/bench_fidelity.py [--dataset fashion-mnist] [--clients 10] [--alpha 0.5]
       [--epochs 10] [--depths 100 100,100] [--seeds 0 1 2] [--inits shared independent]
       [--sweep 0.3 1 3 10 30] [--holdout 0.1] [--out bench-results] [--quick]

``--quick`` is a smoke run: digits, seed 0, shared init, 3 epochs, sweep 1 10 (options given
explicitly still win). For every depth (``100``: one hidden layer of 100 units, ``100,100``: two),
init and seed: a Dirichlet(alpha) split of the training set over J clients, one MLP trained per
client (PFNM Table 1 settings, ``TrainConfig(hidden, epochs, seed)``) from one shared initial
network (``shared``) or each from its own (``independent``), then one global model per row:

  local          mean over the J clients of each client's metrics; width: its hidden units
  ensemble       uniform mixture of the J clients' predictive distributions; width J x local
  fedavg         one-shot FedAvg of the local models (weighted by client sizes)
  fedavg xR      FedAvg at equal rounds: R = hidden layers + 1 rounds of ``--epochs`` epochs from
                 one shared initial network (as ``bayesfuse demo``); it does not use the local
                 models, so it is trained once per (seed, depth) and repeated for both inits
  ot             OT fusion (Singh & Jaggi) at the library defaults
  pfnm, nafi     the library defaults: hyper-parameters chosen per layer by empirical Bayes
                 from the models alone (printed below each summary, for the first seed)
  pfnm s2=X      PFNM's hand-set setting: noise_var X, prior_var 10, gamma0 1, cost "pfnm"
  ... +summaries  with the clients' summaries (bayesfuse.summarize); "2 rounds temperature": the
                 second round picks a candidate (the shared head by either output pool, or the
                 clients' heads of the one-shot default, their Kronecker curvatures as sent,
                 trace-matched or with the GGN's eigenvalues, or their diagonal posteriors) and a
                 temperature by the clients' NLL on the examples they kept back from training
                 (``--holdout``, a tenth of each client's by default; every model of the run is
                 trained on the rest) ("... shared": the shared head's candidates alone);
                 "2 rounds refit": the second round refits the output layer as the product of the
                 clients' Laplace fits on the fused features (bayesfuse.inference.output_fusion);
                 "pfnm 2 rounds refit" does so after the data-free fusion, without summaries;
                 "pfnm client heads" (one shot, data-free) and "pfnm +summaries" (the default with
                 summaries) keep every client's own output layer on the fused body, each weight
                 moved to the global unit its hidden unit was matched to, and predict with their
                 class-share mixture ("pfnm client heads") or geometric pool ("... log"; the
                 default with summaries, "... linear" the mixture); with summaries each head is its
                 client's Kronecker-factored Laplace posterior ("... diagonal heads": the
                 summaries' diagonal one, their output factors left out; "... map": the means
                 alone); every head's predictive is smoothed by its client's examples
                 (``ClientHeads.pseudo_count``, 1; "... unsmoothed": 0); "pfnm +summaries
                 float32": the default with version 4 summaries, the weights' precisions in
                 float32 instead of bfloat16 (``summarize(..., precisions="float32")``);
                 "pfnm +summaries shared head" fuses one output layer with its Laplace
                 posterior (the default with summaries before the heads);
                 "pfnm 2 rounds client heads" keeps the clients' refitted output layers, each
                 its fit's Laplace posterior, and predicts with their class-share mixture
                 (bayesfuse.nets.heads.ClientHeads), "... map" with the fits' means alone,
                 "... log" with the geometric pool of the Laplace heads

Nothing is chosen with test data; the full test split gives the metrics only. One column is a
diagnostic read on the test set: the OOD AUROC at matched calibration ("auroc at ece<=0.03":
each predictive tempered to the temperature with the best AUROC among those whose test ECE is
at most 0.03, ``bayesfuse.calibration.calibration_frontier``), which compares what the
predictives know apart from how confident they are. The metrics: accuracy, NLL,
ECE (15 bins), the global width (sum of hidden widths) and the seconds spent building the
global model ("local": mean training time of one client). A row's ``converged`` is "no" when
a matching stopped at its iteration limit. The summary gives mean +- sd (population sd) over
the seeds, and the width of each seed. Writes ``fidelity.json`` (every per-seed row, rewritten
after each federation) and ``fidelity.png`` (accuracy and NLL against global width) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from common import (
    AUTO_METHODS,
    RESULTS,
    by_method,
    depth_name,
    fused_row,
    make_row,
    mean_sd,
    ood_scores,
    parse_depth,
    summary_table,
    test_metrics,
    write_bytes,
    write_text,
)

from bayesfuse import fuse, summarize
from bayesfuse.baselines import Ensemble, evaluate_locals
from bayesfuse.data import load_font_digits
from bayesfuse.data.datasets import DataSplit, load_dataset
from bayesfuse.data.partition import Partition, dirichlet_partition, holdout_partition
from bayesfuse.demo import format_table
from bayesfuse.federated import run_fedavg
from bayesfuse.inference.result import ConvergenceWarning
from bayesfuse.nets.heads import PSEUDO_COUNT
from bayesfuse.train import TrainConfig, new_model, torch_threads, train_clients

QUICK = dict(dataset="digits", seeds=[0], inits=["shared"], epochs=3, sweep=[1.0, 10.0])
SEED_COLUMNS = ("method", "accuracy", "nll", "ece", "auroc", "width", "seconds", "converged")
#: The rows with client summaries (bayesfuse.summarize): name -> fuse() options beyond the method.
#: ``"summaries": False``: the row fuses without them (the data-free fusion, then its second round);
#: ``"factors": False``: with the summaries' output factors left out (diagonal heads).
SUMMARY_ROWS = {
    "pfnm +summaries": ("pfnm", {}),
    "pfnm +summaries float32": ("pfnm", {"precisions": "float32"}),
    "pfnm +summaries shared head": ("pfnm", {"head": "shared"}),
    "pfnm +summaries diagonal heads": ("pfnm", {"factors": False}),
    "pfnm client heads": ("pfnm", {"summaries": False, "head": "clients"}),
    "pfnm +summaries counts": ("pfnm", {"output_pool": "counts", "head": "shared"}),
    "nafi +summaries": ("nafi", {}),
    "pfnm +summaries 2 rounds temperature": ("pfnm", {"rounds": 2, "second_round": "temperature"}),
    "pfnm +summaries 2 rounds temperature shared": (
        "pfnm",
        {"rounds": 2, "second_round": "temperature", "head": "shared"},
    ),
    "pfnm +summaries 2 rounds refit": ("pfnm", {"rounds": 2}),
    "pfnm 2 rounds refit": ("pfnm", {"rounds": 2, "summaries": False}),
    "pfnm 2 rounds client heads": ("pfnm", {"rounds": 2, "summaries": False, "head": "clients"}),
}
#: Rows measured again from a row's fused model with other settings of its ClientHeads (pool, predictive).
HEAD_VARIANTS = {
    "pfnm client heads": {"pfnm client heads log": {"pool": "log"}},
    "pfnm +summaries": {
        "pfnm +summaries unsmoothed": {"pool": "log", "predictive": "laplace", "pseudo_count": 0.0},
        "pfnm +summaries linear": {"pool": "linear", "predictive": "laplace", "pseudo_count": PSEUDO_COUNT},
        "pfnm +summaries map": {"pool": "log", "predictive": "map", "pseudo_count": PSEUDO_COUNT},
    },
    "pfnm +summaries diagonal heads": {
        "pfnm +summaries diagonal heads unsmoothed": {"pool": "log", "pseudo_count": 0.0},
        "pfnm +summaries diagonal heads linear": {"pool": "linear", "pseudo_count": PSEUDO_COUNT},
    },
    "pfnm 2 rounds client heads": {
        "pfnm 2 rounds client heads map": {"pool": "linear", "predictive": "map"},
        "pfnm 2 rounds client heads log": {"pool": "log", "predictive": "laplace"},
    },
}
HAND_SET = dict(prior_var=10.0, gamma0=1.0, cost="pfnm")  # PFNM's setting; noise_var from --sweep


# --------------------------------------------------------------------------- options


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--quick", action="store_true")
    quick = pre.parse_known_args(argv)[0].quick
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist (default) or digits")
    parser.add_argument("--clients", type=int, default=10, help="J, the number of clients")
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of the split")
    parser.add_argument("--epochs", type=int, default=10, help="local epochs (and per FedAvg round)")
    parser.add_argument(
        "--depths",
        type=parse_depth,
        nargs="+",
        default=[(100,), (100, 100)],
        help="hidden widths of each network, e.g. 100 100,100",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--inits", nargs="+", choices=("shared", "independent"), default=["shared", "independent"])
    parser.add_argument(
        "--sweep",
        type=float,
        nargs="*",
        default=[0.3, 1.0, 3.0, 10.0, 30.0],
        help="noise_var values of the hand-set PFNM sweep (none: no sweep)",
    )
    parser.add_argument(
        "--holdout",
        type=float,
        default=0.1,
        help="share of each client's examples it keeps back from training, on which it scores the "
        "temperature round's candidates (0: it scores them on its training examples)",
    )
    parser.add_argument(
        "--no-summaries", dest="summaries", action="store_false", help="leave out the rows that use client summaries"
    )
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items())
    )
    if quick:
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- one federation


def fedavg_rounds_row(split: DataSplit, part: Partition, hidden: tuple[int, ...], seed: int, epochs: int) -> dict:
    """FedAvg for (hidden layers + 1) rounds from one shared initial network (``bayesfuse demo``)."""
    config = TrainConfig(hidden=hidden, epochs=epochs, seed=seed)
    rounds = len(hidden) + 1
    with torch_threads(config.num_threads):
        torch.manual_seed(seed)
        init = new_model(split.n_features, split.n_classes, config)
    run = run_fedavg(init, split.train, part, config, rounds=rounds, verbose=False)
    return make_row(f"fedavg x{rounds}", test_metrics(run.model, split), hidden, run.seconds, rounds=rounds)


def summary_rows(
    models, part: Partition, held: Partition | None, split: DataSplit, seed: int, ood: np.ndarray
) -> list[dict]:
    """Each client summarises its own data (one pass); the rows of :data:`SUMMARY_ROWS` fuse with them.
    The temperature rounds score on each client's held-out examples ``held`` (its training
    examples ``part`` where none are held out); the refit rounds fit on ``part``."""
    start = time.perf_counter()
    summaries = [summarize(m, split.train.x[idx], split.train.y[idx]) for m, idx in zip(models, part)]
    summary_seconds = (time.perf_counter() - start) / len(models)
    model_kb = 4 * sum(p.numel() for p in models[0].parameters()) / 1000  # kB: 1000 bytes, as the docs quote sizes
    rows = []
    for name, (method, options) in SUMMARY_ROWS.items():
        data = {}
        if options.get("rounds") == 2:
            scored = held if held is not None and options.get("second_round") == "temperature" else part
            data = dict(data=(split.train, scored))
        options = dict(options)
        given = summaries if options.pop("summaries", True) else None
        if options.pop("precisions", "bfloat16") == "float32":  # version 4: the precisions unrounded
            given = [
                summarize(m, split.train.x[idx], split.train.y[idx], precisions="float32")
                for m, idx in zip(models, part)
            ]
        if not options.pop("factors", True):
            given = [dataclasses.replace(s, output_factors=None) for s in summaries]
        if given is None and not data:  # one shot without summaries: the class counts the clients send
            options["class_counts"] = part.counts
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            result = fuse(models, method, summaries=given, seed=seed, **options, **data)
        second = result.hyper.get("second_round", {})
        variants = HEAD_VARIANTS.get(name, {})
        for label in (name, *variants):
            for key, value in variants.get(label, {}).items():
                setattr(result.model, key, value)
            rows.append(
                make_row(
                    label,
                    test_metrics(result.model, split),
                    result.sizes,
                    result.seconds,
                    result.converged,
                    **ood_scores(result.model, split, ood),
                    summary_kb=float(np.mean([s.nbytes for s in given or summaries]) / 1000),
                    model_kb=model_kb,
                    summary_seconds=summary_seconds,
                    temperature=second.get("temperature"),
                    prior_precision=second.get("prior_precision"),
                    output_pool=second.get("output_pool"),
                    round2_bytes_up=second.get("bytes_up"),
                )
            )
    return rows


def federation_rows(
    split: DataSplit,
    part: Partition,
    held: Partition | None,
    hidden: tuple[int, ...],
    init: str,
    seed: int,
    args: argparse.Namespace,
    fedavg_rounds: dict,
) -> tuple[list[dict], float]:
    """Every row of one federation (see the module docstring) and its local training seconds."""
    ood = split.standardizer.transform(load_font_digits(split.train.image_shape[0], seed=seed).x)
    config = TrainConfig(hidden=hidden, epochs=args.epochs, seed=seed)
    start = time.perf_counter()
    models = train_clients(split.train, part, config, shared_init=init == "shared", verbose=False)
    train_seconds = time.perf_counter() - start
    locals_ = evaluate_locals(models, split.test.x, split.test.y)
    local_mean = {k: float(np.mean([m[k] for m in locals_])) for k in locals_[0]}
    rows = [make_row("local", local_mean, hidden, float(np.mean([m.train_seconds for m in models])))]
    start = time.perf_counter()
    ensemble = Ensemble(models)
    rows.append(
        make_row(
            "ensemble",
            test_metrics(ensemble, split),
            [len(models) * h for h in hidden],
            time.perf_counter() - start,
            **ood_scores(ensemble, split, ood),
        )
    )
    rows.append(fused_row("fedavg", models, part, split, "fedavg"))
    key = (seed, hidden)
    if key not in fedavg_rounds:
        fedavg_rounds[key] = fedavg_rounds_row(split, part, hidden, seed, args.epochs)
    rows.append(dict(fedavg_rounds[key]))
    rows.append(fused_row("ot", models, part, split, "ot"))
    for method in AUTO_METHODS:
        # with summaries, the data-free default's OOD AUROC too, for their rows to compare with
        rows.append(fused_row(method, models, part, split, method, seed=seed, ood=ood if args.summaries else None))
    if args.summaries:
        rows += summary_rows(models, part, held, split, seed, ood)
    for noise_var in args.sweep:
        rows.append(
            fused_row(f"pfnm s2={noise_var:g}", models, part, split, "pfnm", seed=seed, noise_var=noise_var, **HAND_SET)
        )
    return rows, train_seconds


# --------------------------------------------------------------------------- reporting


def seed_table(rows: list[dict]) -> str:
    shown = [
        dict(r, converged={None: "-", True: "yes", False: "no"}[r["converged"]], auroc=r.get("auroc") or "-")
        for r in rows
    ]
    return format_table(shown, SEED_COLUMNS)


def _matched(group: list[dict]) -> str:
    """The AUROC at ECE <= 0.03 over seeds, with each seed's temperature; "-" on seeds where no
    temperature brings the ECE that low (a small test set: its ECE alone is noisy)."""
    values = [r["auroc_at_ece"] for r in group]
    temps = "/".join("-" if np.isnan(r["t_at_ece"]) else f"{r['t_at_ece']:.2f}" for r in group)
    return f"{mean_sd(values)} ({temps})" if np.isfinite(values).all() else f"- ({temps})"


def ood_cost_table(rows: list[dict]) -> str:
    """Mean +- sd over seeds of the rows that have an OOD AUROC (ensemble, the data-free defaults, the
    summaries' rows), the AUROC at matched calibration (tempered on the test set to ECE <= 0.03, a
    diagnostic; :func:`common.ood_scores`) with each seed's temperature, the summary's and the
    model's size and the second round's temperature."""
    summary = []
    for method, group in by_method([r for r in rows if r.get("auroc") is not None]).items():
        kb = [r["summary_kb"] for r in group if r.get("summary_kb") is not None]
        temps = [f"{r['temperature']:.2f} {r['output_pool']}" for r in group if r.get("temperature") is not None]
        summary.append(
            {
                "method": method,
                "auroc": mean_sd([r["auroc"] for r in group]),
                "auroc at ece<=0.03 (T)": _matched(group),
                "summary kB": f"{np.mean(kb):.1f} (model {group[0]['model_kb']:.1f})" if kb else "-",
                "summarise s": f"{np.mean([r['summary_seconds'] for r in group]):.2f}" if kb else "-",
                "second round": "/".join(temps) if temps else "-",
            }
        )
    return format_table(
        summary, ("method", "auroc", "auroc at ece<=0.03 (T)", "summary kB", "summarise s", "second round")
    )


def hyper_lines(method: str, chosen: list[dict]) -> list[str]:
    """One compact line per matched layer: each block's noise_var and prior_var, gamma0 (3 s.f.)."""
    g = lambda values: "/".join(f"{v:.3g}" for v in values)  # noqa: E731
    lines = []
    for layer in chosen:
        kl = f", kl_weight/D {layer['kl_weight']:.3g}" if layer["kl_weight"] else ""
        lines.append(
            f"  {method} {layer['layer']} [{'/'.join(layer['blocks'])}]: noise_var {g(layer['noise_var'])}, "
            f"prior_var {g(layer['prior_var'])}, gamma0 {layer['gamma0']:.3g}{kl}"
        )
    return lines


def write_json(path: Path, args: argparse.Namespace, rows: list[dict], federations: list[dict]) -> None:
    config = {k: ([depth_name(d) for d in v] if k == "depths" else v) for k, v in vars(args).items()}
    report = {"config": config, "hand_set": HAND_SET, "federations": federations, "rows": rows}
    write_text(path, json.dumps(report, indent=1) + "\n")


# --------------------------------------------------------------------------- figure

INIT_COLORS = {"shared": "#1f77b4", "independent": "#d62728"}
MARKERS = {
    "pfnm": ("*", 14),
    "nafi": ("D", 7),
    "ot": ("s", 7),
    "fedavg": ("v", 7),
    "fedavg x": ("^", 7),
    "ensemble": ("P", 9),
    "local": ("o", 6),
}


def _mean_point(group: list[dict], key: str) -> tuple[float, float]:
    return float(np.mean([r["width"] for r in group])), float(np.mean([r[key] for r in group]))


def _marker(method: str) -> tuple[str, float] | None:
    if method.startswith("fedavg x"):
        return MARKERS["fedavg x"]
    return MARKERS.get(method)


def _draw_panel(ax, rows: list[dict], key: str, inits: Sequence[str]) -> None:
    for init in inits:
        groups = by_method([r for r in rows if r["init"] == init])
        sweep = sorted((g for m, g in groups.items() if m.startswith("pfnm s2=")), key=lambda g: g[0]["noise_var"])
        points = [_mean_point(g, key) for g in sweep]
        if points:
            ax.plot(*zip(*points), "-", color=INIT_COLORS[init], lw=1.3, marker=".", ms=6, zorder=2)
            for i, (g, (x, y)) in enumerate(zip(sweep, points)):  # alternate sides: points may share a width
                ax.annotate(
                    f"{g[0]['noise_var']:g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(5, 0) if i % 2 == 0 else (-5, 0),
                    ha="left" if i % 2 == 0 else "right",
                    va="center",
                    fontsize=7,
                    color=INIT_COLORS[init],
                )
        for method, group in groups.items():
            style = _marker(method)
            if style is not None:
                ax.plot(
                    *_mean_point(group, key),
                    linestyle="none",
                    marker=style[0],
                    ms=style[1],
                    color=INIT_COLORS[init],
                    markeredgecolor="black",
                    markeredgewidth=0.5,
                    zorder=3,
                )
    _log_width_axis(ax)
    if key == "nll":
        _clip_local_nll(ax, rows, inits)


def _clip_local_nll(ax, rows: list[dict], inits: Sequence[str]) -> None:
    """The local models' NLL can be several times the others'; cap the axis and print it at the top."""
    others = [
        _mean_point(g, "nll")[1]
        for init in inits
        for m, g in by_method([r for r in rows if r["init"] == init]).items()
        if m != "local"
    ]
    if not others:
        return
    low, high = min(others), max(others)
    top = high + 0.15 * (high - low) + 0.05
    for i, init in enumerate(inits):
        local = [r for r in rows if r["init"] == init and r["method"] == "local"]
        if local and _mean_point(local, "nll")[1] > top:
            x, y = _mean_point(local, "nll")
            ax.annotate(
                f"local NLL {y:.2f} (off scale)",
                (x, top),
                textcoords="offset points",
                xytext=(8, -10 - 11 * i),
                fontsize=7,
                color=INIT_COLORS[init],
                va="top",
                arrowprops=dict(arrowstyle="->", color=INIT_COLORS[init], lw=0.8),
            )
    ax.set_ylim(max(0.0, low - 0.1 * (high - low) - 0.05), top)


def _log_width_axis(ax) -> None:
    """Log-x with plain-number ticks at 1-2-5 steps (matplotlib's 3x10^2 minor labels collide)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator, ScalarFormatter

    ax.set_xscale("log")
    ax.margins(x=0.08)
    low, high = ax.get_xlim()
    ticks = [m * 10**e for e in range(0, 7) for m in (1, 2, 5) if low <= m * 10**e <= high]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, alpha=0.3)


def _legend_handles(inits: Sequence[str]) -> list:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=INIT_COLORS[i], marker=".", label=f"PFNM hand-set, sigma^2 sweep ({i} init)")
        for i in inits
    ]
    names = {
        "pfnm": "PFNM default (auto)",
        "nafi": "NAFI default (auto)",
        "ot": "OT fusion",
        "fedavg": "FedAvg (one shot)",
        "fedavg x": "FedAvg, equal rounds",
        "ensemble": "ensemble of J",
        "local": "local (mean of J)",
    }
    handles += [
        Line2D(
            [],
            [],
            linestyle="none",
            marker=m,
            ms=s,
            color="0.6",
            markeredgecolor="black",
            markeredgewidth=0.5,
            label=names[k],
        )
        for k, (m, s) in MARKERS.items()
    ]
    return handles


def figure_png(rows: list[dict], args: argparse.Namespace) -> bytes:
    """Accuracy (top) and NLL (bottom) against global width, one column per depth."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    depths = [depth_name(d) for d in args.depths]
    fig = Figure(figsize=(5.0 * len(depths) + 3.6, 7.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_2d(fig.subplots(2, len(depths), squeeze=False))
    for col, depth in enumerate(depths):
        sub = [r for r in rows if r["depth"] == depth]
        for row, (key, label) in enumerate((("accuracy", "test accuracy"), ("nll", "test NLL"))):
            ax = axes[row, col]
            _draw_panel(ax, sub, key, args.inits)
            ax.set_ylabel(label)
            ax.set_xlabel("global width (hidden units, log scale)")
        axes[0, col].set_title(f"hidden {depth}: accuracy vs width")
        axes[1, col].set_title(f"hidden {depth}: NLL vs width")
    fig.suptitle(
        f"{args.dataset}, J={args.clients}, alpha={args.alpha}, {args.epochs} epochs: data-free fusion\n"
        f"mean over seeds {'/'.join(map(str, args.seeds))}; point labels: PFNM noise_var sigma^2",
        fontsize=11,
    )
    fig.legend(handles=_legend_handles(args.inits), loc="outside right center", fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150)
    return buf.getvalue()


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    json_path = out / "fidelity.json"
    splits: dict[int, tuple[DataSplit, Partition, Partition | None]] = {}
    fedavg_rounds: dict = {}
    rows: list[dict] = []
    federations: list[dict] = []
    print(
        f"{args.dataset}, J={args.clients}, alpha={args.alpha}, {args.epochs} epochs, seeds {args.seeds}; "
        f"hand-set PFNM: {HAND_SET}, noise_var in {args.sweep}",
        flush=True,
    )
    for hidden in args.depths:
        for init in args.inits:
            block = []
            for seed in args.seeds:
                if seed not in splits:
                    split = load_dataset(args.dataset, seed=seed).standardize()
                    part = dirichlet_partition(split.train.y, args.clients, args.alpha, seed=seed)
                    held = None
                    if args.holdout and args.summaries:  # each client keeps back a share for the temperature round
                        part, held = holdout_partition(part, split.train.y, args.holdout, seed=seed)
                    splits[seed] = split, part, held
                split, part, held = splits[seed]
                start = time.perf_counter()
                fed_rows, train_seconds = federation_rows(split, part, held, hidden, init, seed, args, fedavg_rounds)
                tag = dict(dataset=args.dataset, depth=depth_name(hidden), init=init, seed=seed)
                fed_rows = [{**tag, **r} for r in fed_rows]
                block += fed_rows
                rows += fed_rows
                federations.append(
                    {**tag, "train_seconds": train_seconds, "total_seconds": time.perf_counter() - start}
                )
                write_json(json_path, args, rows, federations)
                progress(
                    f"[fidelity] seed {seed}, depth {depth_name(hidden)}, {init} init: local training "
                    f"{train_seconds:.1f} s, federation {time.perf_counter() - start:.1f} s"
                )
                print(f"\nhidden {depth_name(hidden)}, {init} init, seed {seed}", flush=True)
                print(seed_table(fed_rows), flush=True)
            print(f"\nhidden {depth_name(hidden)}, {init} init: mean +- sd over seeds {args.seeds}")
            print(summary_table(block))
            if args.summaries:
                print("\nOOD (entropy AUROC, font digits against the test set) and what summaries cost:")
                print(ood_cost_table(block))
            first = [r for r in block if r["seed"] == args.seeds[0] and r["method"] in AUTO_METHODS]
            print(f"hyper-parameters chosen by the library (seed {args.seeds[0]}; per block):")
            for r in first:
                print("\n".join(hyper_lines(r["method"], r["chosen"])))
            sys.stdout.flush()
    png = write_bytes(out / "fidelity.png", figure_png(rows, args))
    print(f"\nwrote {json_path} and {png}")


if __name__ == "__main__":
    main()
