"""Deep networks: multilayer PFNM/NAFI, FedMA, FedAvg at equal rounds, PANs.

Usage: python benchmarks/bench_deep.py [--parts synthetic mlp cnn pans] [--dataset fashion-mnist]
       [--clients 10] [--alpha 0.5] [--seeds 0] [--shared-init] [--retrain-epochs 5]

* synthetic: an IBP-simulated federation of 784-H1-H2-10 MLPs (J=10, gamma0=100, so about 100
  units per client and ~300 atoms per layer; noise variance 0.01, prior variance 1). Each layer
  is matched bottom-up and top-down (PFNM supplement Algorithm 1) with the PFNM cost at
  sigma^2 = 1 and the exact marginal cost at the true sigma^2; prints the global sizes and the
  share of units assigned to their true atom, per layer.
* mlp: Dirichlet-split dataset, 784-100-100-10 MLPs: locals, ensemble, one-shot FedAvg,
  multilayer PFNM and NAFI, FedMA (PFNM and NAFI costs), FedAvg with FedMA's number of rounds.
* cnn: the same with a ConvNet (2 x conv3x3-BN-ReLU-maxpool with 8 and 16 channels, dense 64,
  dense 10); FedMA vs FedAvg at equal rounds.
* pans: FedAvg (4 rounds) of 784-100-100-10 MLPs with multiplicative PANs (T=1, A=0.1, the
  paper's FL default) on vs off, from one shared initialisation.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from common import mean_sd

from bayesfuse.data.datasets import load_dataset
from bayesfuse.data.partition import dirichlet_partition
from bayesfuse.demo import DemoConfig, format_table, run_demo
from bayesfuse.federated import run_fedavg
from bayesfuse.inference.layerwise import match_layerwise
from bayesfuse.metrics import assignment_accuracy, evaluate
from bayesfuse.models.bbp import simulate_deep_federation
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.pans import PANConfig
from bayesfuse.nets.predict import predict_proba
from bayesfuse.train import TrainConfig, new_model


def synthetic(seed: int) -> None:
    fed = simulate_deep_federation(10, 784, 2, 10, gamma0=100.0, noise_var=0.01, prior_var=1.0, seed=seed)
    spec = MLP(1, [1, 1], 1).permutation_spec()
    true = [a.shape[0] for a in fed.atoms[:-1]]
    per_client = [int(np.mean([len(a) for a in fed.assignments[n]])) for n in range(2)]
    print(f"\nsynthetic seed {seed}: true atoms per layer {true}, mean units per client {per_client}")
    rows = []
    for direction in ("bottom-up", "top-down"):
        for cost, nv in (("pfnm", 1.0), ("marginal", 0.01)):
            start = time.perf_counter()
            res = match_layerwise(
                fed.states,
                spec,
                direction=direction,
                cost=cost,
                noise_var=nv,
                prior_var=1.0,
                gamma0=100.0,
                bias_prior_mean=0.0,
                absent="unobserved",
            )
            seconds = time.perf_counter() - start
            acc = [
                assignment_accuracy(fed.assignments[n], res.layers[g].assignments) for n, g in enumerate(spec.groups)
            ]
            rows.append(
                {
                    "order": direction,
                    "cost": f"{cost} s2={nv}",
                    "global sizes": "/".join(str(res.sizes[g]) for g in spec.groups),
                    "true sizes": "/".join(map(str, true)),
                    "correct layer 1": acc[0],
                    "correct layer 2": acc[1],
                    "seconds": seconds,
                }
            )
    print(format_table(rows, list(rows[0])))


def demo_part(arch: str, args, seed: int) -> list[dict]:
    hidden = (100, 100) if arch == "mlp" else (64,)
    config = DemoConfig(
        dataset=args.dataset,
        n_clients=args.clients,
        alpha=args.alpha,
        seed=seed,
        hidden=hidden,
        epochs=args.epochs if arch == "mlp" else args.cnn_epochs,
        shared_init=args.shared_init,
        arch=arch,
        channels=(8, 16),
        methods=("pfnm", "nafi", "fedma", "fedma-nafi", "fedavg-rounds")
        if arch == "mlp"
        else ("pfnm", "fedma", "fedavg-rounds"),
        retrain_epochs=args.retrain_epochs,
    )
    start = time.perf_counter()
    result = run_demo(config, verbose=False)
    init = "shared" if args.shared_init else "independent"
    print(
        f"\n{arch} on {args.dataset}, J={args.clients}, alpha={args.alpha}, seed {seed}, {init} init, "
        f"local {config.epochs} epochs, {config.retrain_epochs} epochs per later round "
        f"({time.perf_counter() - start:.0f} s in all)"
    )
    print(result.table())
    return result.rows


def pans(args, seed: int) -> None:
    split = load_dataset(args.dataset, seed=seed).standardize()
    part = dirichlet_partition(split.train.y, args.clients, args.alpha, seed=seed)
    rows = []
    for pan in (None, PANConfig("mul", 1.0, 0.1), PANConfig("add", 1.0, 0.1)):
        cfg = TrainConfig(hidden=(100, 100), epochs=args.retrain_epochs, seed=seed, pan=pan)
        torch.manual_seed(seed)
        init = new_model(split.n_features, split.n_classes, cfg)
        run = run_fedavg(init, split.train, part, cfg, rounds=4, verbose=False)
        m = evaluate(predict_proba(run.model, split.test.x), split.test.y)
        rows.append(
            {
                "PANs": "off" if pan is None else f"{pan.mode} T={pan.period} A={pan.amplitude}",
                "accuracy": m["accuracy"],
                "nll": m["nll"],
                "seconds": run.seconds,
            }
        )
    print(
        f"\nFedAvg x4 rounds ({args.retrain_epochs} epochs each), 784-100-100-10, {args.dataset}, "
        f"J={args.clients}, alpha={args.alpha}, seed {seed}"
    )
    print(format_table(rows, list(rows[0])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts", nargs="+", default=["synthetic", "mlp", "cnn", "pans"], choices=["synthetic", "mlp", "cnn", "pans"]
    )
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=10, help="local training epochs of the MLPs")
    parser.add_argument("--cnn-epochs", type=int, default=5, help="local training epochs of the ConvNets")
    parser.add_argument("--retrain-epochs", type=int, default=5, help="epochs per FedMA/FedAvg round")
    parser.add_argument("--shared-init", action="store_true")
    args = parser.parse_args()
    summary: dict[str, list[float]] = {}
    for seed in args.seeds:
        if "synthetic" in args.parts:
            synthetic(seed)
        for arch in ("mlp", "cnn"):
            if arch in args.parts:
                for row in demo_part(arch, args, seed):
                    summary.setdefault(f"{arch}: {row['method']}", []).append(row["accuracy"])
        if "pans" in args.parts:
            pans(args, seed)
    if len(args.seeds) > 1 and summary:
        rows = [{"method": k, "accuracy": mean_sd(v)} for k, v in summary.items()]
        print(f"\nmean +- sd over seeds {args.seeds}")
        print(format_table(rows, ["method", "accuracy"]))


if __name__ == "__main__":
    main()
