"""The output layer and global weights of a fused network: each choice's accuracy, NLL and ECE.

Usage: python benchmarks/bench_calibration.py [--dataset fashion-mnist] [--depths 100 100,100]
       [--seeds 0 1 2] [--inits shared independent] [--epochs 10]

The federations of ``bench_fidelity.py`` (J = 10, Dirichlet(0.5)), each client trained on all
its examples (``bench_fidelity.py --holdout 0``). PFNM and NAFI at their
default (data-free) hyper-parameters, with every combination of

* ``average_outputs``: outgoing weights of global unit g times m_g / J (the fused logits
  average the clients' where units match) or left as the atoms' values (they add up);
* ``global_weights``: the atoms' posterior means or the plain average of the matched units.

``default`` marks the library's choice. Metrics on the test split; mean +- sd over the seeds.
"""

from __future__ import annotations

import argparse
import warnings

from common import depth_name, fused_row, make_row, parse_depth, summary_table, test_metrics

from bayesfuse.baselines import Ensemble
from bayesfuse.data.datasets import load_dataset
from bayesfuse.data.partition import dirichlet_partition
from bayesfuse.inference.result import ConvergenceWarning
from bayesfuse.train import TrainConfig, train_clients

CHOICES = [(outputs, weights) for outputs in (True, False) for weights in ("posterior", "average")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--depths", type=parse_depth, nargs="+", default=[(100,), (100, 100)])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--inits", nargs="+", default=["shared", "independent"], choices=["shared", "independent"])
    args = parser.parse_args()
    warnings.simplefilter("ignore", ConvergenceWarning)
    for hidden in args.depths:
        default_weights = "posterior" if len(hidden) == 1 else "average"
        for init in args.inits:
            rows = []
            for seed in args.seeds:
                split = load_dataset(args.dataset, seed=seed).standardize()
                part = dirichlet_partition(split.train.y, args.clients, args.alpha, seed=seed)
                config = TrainConfig(hidden=hidden, epochs=args.epochs, seed=seed)
                models = train_clients(split.train, part, config, shared_init=init == "shared", verbose=False)
                rows.append(
                    make_row("ensemble", test_metrics(Ensemble(models), split), [len(models) * h for h in hidden], 0.0)
                )
                for method in ("pfnm", "nafi"):
                    for outputs, weights in CHOICES:
                        mark = " (default)" if outputs and weights == default_weights else ""
                        name = f"{method} {'m/J' if outputs else 'sum'} {weights}{mark}"
                        rows.append(
                            fused_row(
                                name,
                                models,
                                part,
                                split,
                                method,
                                seed=seed,
                                average_outputs=outputs,
                                global_weights=weights,
                            )
                        )
            print(
                f"\n{args.dataset}, hidden {depth_name(hidden)}, {init} init, seeds {args.seeds}: mean +- sd",
                flush=True,
            )
            print(summary_table(rows), flush=True)


if __name__ == "__main__":
    main()
