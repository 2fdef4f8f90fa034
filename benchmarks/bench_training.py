"""How fast local training is, and whether one or two torch threads is better for it.

Usage: python benchmarks/bench_training.py [--repeats 3]
Prints a table: workload, threads, seconds (best of repeats), examples per second.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bayesfuse.data import FASHION_MNIST_DIR, load_digits, load_fashion_mnist
from bayesfuse.demo import format_table
from bayesfuse.train import TrainConfig, train_mlp


def _time(x, y, n_classes, hidden, threads, repeats, epochs):
    best = np.inf
    for r in range(repeats):
        start = time.perf_counter()
        train_mlp(
            x, y, n_classes, TrainConfig(hidden=hidden, epochs=epochs, num_threads=threads, seed=r), verbose=False
        )
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    workloads = [("digits 64-100-10, 1347 ex x 10 ep", load_digits().standardize().train, (100,), 10)]
    if FASHION_MNIST_DIR.is_dir():
        train = load_fashion_mnist().standardize().train
        workloads.append(("fashion 784-100-10, 6000 ex x 2 ep", train.subset(np.arange(6000)), (100,), 2))
    else:
        print(f"(Fashion-MNIST not in {FASHION_MNIST_DIR}: `make data` adds that workload)")
    rows = []
    for name, data, hidden, epochs in workloads:
        for threads in (1, 2):
            sec = _time(data.x, data.y, data.n_classes, hidden, threads, args.repeats, epochs)
            rows.append(
                {"workload": name, "threads": threads, "seconds": sec, "examples/s": f"{len(data) * epochs / sec:,.0f}"}
            )
    print(format_table(rows, ["workload", "threads", "seconds", "examples/s"]))


if __name__ == "__main__":
    main()
