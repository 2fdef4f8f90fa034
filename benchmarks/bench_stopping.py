"""Where wide-layer matching stops: time and quality against ``tol`` (nats per unit).

Usage: python benchmarks/bench_stopping.py [--seeds 0 1 2] [--tols 0 0.1 0.3 1 3] [--methods pfnm nafi]
       [--cache DIR] [--data-path DIR] [--out DIR]

For each seed: 10k Fashion-MNIST training images are held out for validation; the other 50k
are split over 10 clients (Dirichlet(0.5)), and each trains a 784-1000-10 MLP for 2 epochs
(the wide case of ``bench_scale.py``). The clients are fused by PFNM (and NAFI) with empirical
Bayes at each ``tol``; 0 sweeps until no unit moves. Printed per tol: wall time, sweeps, global
units, and validation accuracy, NLL and ECE (mean +- sd over seeds) next to the ensemble's;
then the test set at the fixed point and at the table's default. The default is chosen on the
validation rows only. The rows go to ``DIR/stopping.json``, a figure of time, validation
accuracy and NLL against tol to ``DIR/stopping.png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, cached_models, mean_sd, write_bytes, write_text

from bayesfuse import fuse, methods
from bayesfuse.data import dirichlet_partition, load_fashion_mnist
from bayesfuse.demo import format_table
from bayesfuse.metrics import evaluate
from bayesfuse.nets.arch import rebuild
from bayesfuse.nets.predict import predict_proba
from bayesfuse.train import TrainConfig, new_model, train_clients

N_CLIENTS, ALPHA, HIDDEN, EPOCHS, N_VAL = 10, 0.5, (1000,), 2, 10_000


def _clients(data, seed: int, cache: Path):
    """The seed's validation split and its 10 trained clients (read from ``cache`` when there)."""
    order = np.random.default_rng(100 + seed).permutation(len(data.train))
    val, train = data.train.subset(order[:N_VAL]), data.train.subset(order[N_VAL:])
    config = TrainConfig(hidden=HIDDEN, epochs=EPOCHS, seed=seed)
    files = [cache / f"seed{seed}_client{j}.pt" for j in range(N_CLIENTS)]

    def train_():
        partition = dirichlet_partition(train.y, N_CLIENTS, ALPHA, seed=seed)
        return train_clients(train, partition, config, shared_init=False, verbose=False)

    template = functools.cache(lambda: new_model(data.n_features, data.n_classes, config))  # made once, if needed
    models = cached_models(files, train_, load=lambda state: rebuild(template(), state))
    return val, [m.eval() for m in models]


def _fused(models, method: str, tol: float, x_val, y_val, x_test, y_test, *, on_test: bool) -> dict:
    """One fusion at ``tol``: time, sweeps, units, validation metrics, and the test set's when ``on_test``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        res = fuse(models, method, tol=tol)
        seconds = time.perf_counter() - start
    layer = res.layers[0]
    return dict(
        method=method,
        tol=tol,
        seconds=seconds,
        sweeps=layer.n_sweeps,
        units=res.sizes[0],
        val=evaluate(predict_proba(res.model, x_val), y_val),
        test=evaluate(predict_proba(res.model, x_test), y_test) if on_test else None,
    )


def _runs(rows: list[dict], method: str, tol: float) -> list[dict]:
    """The rows of ``method`` at ``tol``, one per seed."""
    return [r for r in rows if r["method"] == method and r["tol"] == tol]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tols", type=float, nargs="+", default=[0.0, 0.1, 0.3, 1.0, 3.0])
    parser.add_argument("--methods", nargs="+", default=["pfnm"], choices=["pfnm", "nafi"])
    parser.add_argument("--cache", default=str(RESULTS / "stopping-mlps"), help="where the trained MLPs are kept")
    parser.add_argument("--data-path", default=None, help="Fashion-MNIST directory (default: the Debian one)")
    parser.add_argument(
        "--out",
        default=str(RESULTS),
        help="directory for stopping.json (the rows) and stopping.png (replaced if there)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # small MLPs train faster on one thread; the matching sets its own BLAS threads
    data = load_fashion_mnist(args.data_path).standardize()
    default = methods.resolve("pfnm", "network")["tol"]
    rows, ensembles = [], []
    for seed in args.seeds:
        val, models = _clients(data, seed, Path(args.cache))
        local_val = [predict_proba(m, val.x) for m in models]
        local_test = [predict_proba(m, data.test.x) for m in models]
        ensembles.append(
            dict(
                val=evaluate(np.mean(local_val, axis=0), val.y), test=evaluate(np.mean(local_test, axis=0), data.test.y)
            )
        )
        for method in args.methods:
            for tol in args.tols:
                row = _fused(models, method, tol, val.x, val.y, data.test.x, data.test.y, on_test=tol in (0.0, default))
                rows.append(dict(row, seed=seed))
                print(
                    f"seed {seed} {method} tol {tol:g}: {row['seconds']:.1f} s, {row['sweeps']} sweeps, "
                    f"{row['units']} units, validation accuracy {row['val']['accuracy']:.4f} "
                    f"nll {row['val']['nll']:.4f}",
                    flush=True,
                )
    print(
        f"\nFashion-MNIST, {N_CLIENTS} clients, Dirichlet({ALPHA}), 784-1000-10, seeds {args.seeds}: "
        "validation (mean +- sd)"
    )
    table = [
        dict(
            model="ensemble",
            seconds="-",
            sweeps="-",
            units=str(N_CLIENTS * HIDDEN[0]),
            **{k: mean_sd([e["val"][k] for e in ensembles]) for k in ("accuracy", "nll", "ece")},
        )
    ]
    for method in args.methods:
        for tol in args.tols:
            sel = _runs(rows, method, tol)
            table.append(
                dict(
                    model=f"{method} tol {tol:g}",
                    seconds=mean_sd([r["seconds"] for r in sel], 1),
                    sweeps="/".join(str(r["sweeps"]) for r in sel),
                    units="/".join(str(r["units"]) for r in sel),
                    **{k: mean_sd([r["val"][k] for r in sel]) for k in ("accuracy", "nll", "ece")},
                )
            )
    print(format_table(table, ["model", "seconds", "sweeps", "units", "accuracy", "nll", "ece"]))
    print(f"\ntest set (10k), at the fixed point (tol 0) and at the default (tol {default:g})")
    table = [dict(model="ensemble", **{k: mean_sd([e["test"][k] for e in ensembles]) for k in ("accuracy", "nll")})]
    for method in args.methods:
        for tol in sorted({0.0, default} & set(args.tols)):
            sel = _runs(rows, method, tol)
            table.append(
                dict(
                    model=f"{method} tol {tol:g}",
                    **{k: mean_sd([r["test"][k] for r in sel]) for k in ("accuracy", "nll")},
                )
            )
    print(format_table(table, ["model", "accuracy", "nll"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "stopping.json", json.dumps(dict(rows=rows, ensembles=ensembles), indent=1))
    print(f"figure: {_figure(rows, ensembles, out / 'stopping.png')}")


def _figure(rows: list[dict], ensembles: list[dict], path: Path) -> Path:
    """Seconds, validation accuracy and NLL against tol, one line per method and seed."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained")
    keys = [
        ("seconds", None, "wall time (s)"),
        ("val", "accuracy", "validation accuracy"),
        ("val", "nll", "validation NLL"),
    ]
    seeds = sorted({r["seed"] for r in rows})
    for method, style in zip(sorted({r["method"] for r in rows}), ("o-", "s--")):
        for seed in seeds:
            sel = sorted((r for r in rows if r["method"] == method and r["seed"] == seed), key=lambda r: r["tol"])
            x = [max(r["tol"], 0.03) for r in sel]  # tol 0 (the fixed point) drawn at the left edge
            for ax, (key, sub, _) in zip(axes, keys):
                y = [r[key] if sub is None else r[key][sub] for r in sel]
                ax.plot(x, y, style, color=f"C{seed}", label=f"{method}, seed {seed}", alpha=0.8)
    for seed, e in zip(seeds, ensembles):
        for ax, (key, sub, _) in zip(axes[1:], keys[1:]):
            ax.axhline(e[key][sub], color=f"C{seed}", lw=0.8, ls=":")
    for ax, (_, _, label) in zip(axes, keys):
        ax.set_xscale("log")
        ax.set_xlabel("tol (nats per unit; leftmost point: 0, the fixed point)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    axes[1].set_title("dotted: ensemble of the clients", fontsize=9)
    fig.suptitle("Wide-layer matching (10 x 784-1000-10, Fashion-MNIST): where it stops")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return write_bytes(path, buf.getvalue())


if __name__ == "__main__":
    main()
