"""Local models, ensemble, one-shot FedAvg, PFNM and NAFI on a heterogeneous federation.

Usage: python benchmarks/bench_baselines.py [--dataset fashion-mnist] [--clients 10] [--alpha 0.5]
       [--seeds 0 1 2] [--hidden 100] [--shared-init]
For each seed: Dirichlet split of the training set, one 784-100-10 MLP per client (PFNM Table 1
settings), metrics on the full test set. Prints the per-seed table and mean +- sd over seeds.
"""

from __future__ import annotations

import argparse

from common import mean_sd

from bayesfuse.demo import DemoConfig, format_table, run_demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--hidden", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument(
        "--shared-init",
        action="store_true",
        help="clients start from one shared initialisation (default: each its own)",
    )
    args = parser.parse_args()
    per_method: dict[str, list[dict]] = {}
    for seed in args.seeds:
        config = DemoConfig(
            dataset=args.dataset,
            n_clients=args.clients,
            alpha=args.alpha,
            seed=seed,
            hidden=(args.hidden,),
            epochs=args.epochs,
            shared_init=args.shared_init,
        )
        result = run_demo(config, verbose=False)
        print(f"\nseed {seed} (local training {result.train_seconds:.1f} s)")
        print(result.table())
        for row in result.rows:
            key = row["method"]
            per_method.setdefault(key, []).append(row)
    summary = []
    for method, rows in per_method.items():
        summary.append(
            {
                "method": method,
                "accuracy": mean_sd([r["accuracy"] for r in rows]),
                "nll": mean_sd([r["nll"] for r in rows]),
                "hidden": "/".join(str(r["hidden"]) for r in rows),
            }
        )
    init = "shared" if args.shared_init else "independent"
    print(f"\n{args.dataset}, J={args.clients}, alpha={args.alpha}, {init} init, seeds {args.seeds}: mean +- sd")
    print(format_table(summary, ["method", "accuracy", "nll", "hidden"]))
    print("hidden: global hidden units for each seed")


if __name__ == "__main__":
    main()
