"""Pruning a horseshoe BNN's units before fusion, against how long its guide was trained.

Usage: python benchmarks/bench_bnn_pruning.py [--dataset fashion-mnist] [--train-size 3000]
       [--hidden 150] [--epochs 3 10 30 100] [--seeds 0 1 2] [--quick]

Per seed: one client of ``--train-size`` training images (a random subset), one 150-unit
horseshoe BNN trained for each number of epochs. Each network is pruned by the two rules of
``bayesfuse.fuse`` (a one-client fusion returns the client with its pruned units dropped):

* **information** (data-free, ``prune_kl=1``): units whose incoming weights hold less than 1 nat
  of information, their KL to the prior. A guide that has not converged sits far from the prior
  (its start: standard deviation 0.01), so every unit counts as informative;
* **function** (with the client's summary, ``prune_share=1e-3``): the least-contributing units
  that together put at most 0.1% of the layer's output into the layer above on the client's data.

Reported per epoch count (mean ± sd over seeds): the test accuracy of the unpruned network, the
units each rule keeps, and how much each pruned network's predictions differ from the unpruned
network's (mean total variation distance between the two networks' predictive distributions at
their guides' means on the test set, and the test accuracy change; at the means, so that no Monte
Carlo noise enters the comparison). A rule that reads the function keeps the predictions at any
stage of training; one that reads the distance to the prior keeps every unit early and, once the
guide has converged, drops what the horseshoe switched off.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

from bayesfuse import fuse, summarize
from bayesfuse.data import load_dataset
from bayesfuse.demo import format_table
from bayesfuse.models.bnn import BNNConfig, forward_logits, train_bnn


def _at_means(model, x) -> np.ndarray:
    """The network's predictive at its guide's means (deterministic, so that two networks compare
    without Monte Carlo noise)."""
    params = {k: v.detach().unsqueeze(0) for k, v in model.loc.items()}
    with torch.no_grad():
        logits = forward_logits(torch.as_tensor(x, dtype=torch.float64), params, model.depth)[0]
    return torch.softmax(logits, -1).numpy()


COLUMNS = ("epochs", "accuracy", "units info", "units function", "tv info", "tv function", "acc change info",
           "acc change function")  # fmt: skip


def _pruned(bnn, **kwargs):
    with warnings.catch_warnings():  # one model on purpose: it comes back pruned
        warnings.filterwarnings("ignore", "only one model", UserWarning)
        res = fuse([bnn], "kl", **kwargs)
    return res.model, int(sum(res.sizes))


def run_seed(args, seed: int) -> list[dict]:
    split = load_dataset(args.dataset, seed=seed).standardize()
    idx = np.random.default_rng(seed).permutation(len(split.train))[: args.train_size]
    x, y = split.train.x[idx], split.train.y[idx]
    rows = []
    for epochs in args.epochs:
        start = time.perf_counter()
        bnn = train_bnn(x, y, split.n_classes, args.hidden, BNNConfig(epochs=epochs, seed=seed))
        p = _at_means(bnn, split.test.x)
        row = {"seed": seed, "epochs": epochs, "accuracy": float((p.argmax(1) == split.test.y).mean())}
        for rule, kwargs in (("info", {}), ("function", {"summaries": [summarize(bnn, x, y)]})):
            model, units = _pruned(bnn, **kwargs)
            q = _at_means(model, split.test.x)
            row[f"units {rule}"] = units
            row[f"tv {rule}"] = float(0.5 * np.abs(p - q).sum(1).mean())
            row[f"acc change {rule}"] = float((q.argmax(1) == split.test.y).mean()) - row["accuracy"]
        print(
            f"seed {seed}, {epochs} epochs ({time.perf_counter() - start:.0f} s): accuracy {row['accuracy']:.4f}, "
            f"units kept {row['units info']} (information) / {row['units function']} (function)",
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--train-size", type=int, default=3000)
    parser.add_argument("--hidden", type=int, default=150)
    parser.add_argument("--epochs", type=int, nargs="+", default=[3, 10, 30, 100])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--quick", action="store_true", help="digits, 300 images, 40 units, epochs 5 50, seed 0")
    args = parser.parse_args(argv)
    if args.quick:
        args.dataset, args.train_size, args.hidden, args.epochs, args.seeds = "digits", 300, 40, [5, 50], [0]
    start = time.perf_counter()
    rows = [r for seed in args.seeds for r in run_seed(args, seed)]
    table = []
    for epochs in args.epochs:
        group = [r for r in rows if r["epochs"] == epochs]
        cell = {"epochs": epochs}
        for c in COLUMNS[1:]:
            v = np.array([r[c] for r in group], dtype=float)
            cell[c] = f"{v.mean():.0f} ± {v.std():.0f}" if c.startswith("units") else f"{v.mean():+.4f} ± {v.std():.4f}"
        cell["accuracy"] = cell["accuracy"].lstrip("+")
        table.append(cell)
    print(f"\n{args.dataset}, {args.train_size} training images, {args.hidden} units, seeds {args.seeds}: mean ± sd")
    print(format_table(table, COLUMNS))
    print(f"whole study: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
