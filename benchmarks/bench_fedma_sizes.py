"""FedMA's global width against its noise variance sigma^2 (the knob of model growth).

Usage: python benchmarks/bench_fedma_sizes.py [--dataset fashion-mnist] [--noise-vars 1 3 10] [--seed 0]
       [--passes 1 2]
Clients as in bench_deep.py (10 clients, Dirichlet 0.5, 784-100-100-10 MLPs from one shared
initialisation, 10 local epochs, 5 per FedMA round); prints global widths, growth over the
local width, accuracy and the bytes exchanged for each sigma^2 and number of passes (more than
one is FedMA with communication).
"""

from __future__ import annotations

import argparse
import time

from bayesfuse.data.datasets import load_dataset
from bayesfuse.data.partition import dirichlet_partition
from bayesfuse.demo import format_table
from bayesfuse.federated import run_fedma
from bayesfuse.metrics import evaluate
from bayesfuse.nets.predict import predict_proba
from bayesfuse.train import TrainConfig, train_clients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--noise-vars", type=float, nargs="+", default=[1.0, 3.0, 10.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    split = load_dataset(args.dataset, seed=args.seed).standardize()
    part = dirichlet_partition(split.train.y, 10, 0.5, seed=args.seed)
    cfg = TrainConfig(hidden=(100, 100), epochs=10, seed=args.seed)
    models = train_clients(split.train, part, cfg, shared_init=True, verbose=False)
    rows = []
    for nv in args.noise_vars:
        for passes in args.passes:
            start = time.perf_counter()
            run = run_fedma(
                models,
                split.train,
                part,
                TrainConfig(hidden=(100, 100), epochs=5, seed=args.seed),
                noise_var=nv,
                passes=passes,
                verbose=False,
            )
            m = evaluate(predict_proba(run.model, split.test.x), split.test.y)
            rows.append(
                {
                    "sigma^2": nv,
                    "passes": passes,
                    "rounds": run.rounds,
                    "global widths": "/".join(map(str, run.sizes)),
                    "growth": f"{sum(run.sizes) / 200:.2f}x",
                    "accuracy": m["accuracy"],
                    "nll": m["nll"],
                    "MB up": run.bytes_up / 1e6,
                    "seconds": time.perf_counter() - start,
                }
            )
    print(f"FedMA on {args.dataset}, J=10, alpha=0.5, seed {args.seed}, shared init")
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
