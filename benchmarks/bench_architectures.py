"""Residual networks and transformers: every method on ResNet-20 or ViT clients of a heterogeneous federation.

Usage: python benchmarks/bench_architectures.py [--arch resnet20|vit] [--dataset fashion-mnist] [--clients 10]
       [--alpha 0.5] [--seeds 0 1 2] [--width W] [--train-size 4000] [--test-size 5000] [--epochs 5]
       [--retrain-epochs 1] [--fedma-passes 1] [--methods fedavg ot pfnm nafi fedma fedavg-rounds fedavg+bn ot+bn
       pfnm+bn pfnm+bn+refit pfnm+refit fedma+refit] [--shared-init] [--data-path DIR] [--jobs N]

``--arch vit``: the small vision transformer (``bayesfuse.nets.attention.vit``: 16 patches of 7x7
pixels, a stream of 32 x ``--width``, 2 pre-norm blocks of 4 heads of 8 x ``--width`` and an MLP
of 64 x ``--width``, mean pooling; default width 1); its heads are aligned before matching
(``bayesfuse.inference.heads``). It has no batch norms, so its methods are
``fedavg ot pfnm nafi fedma fedavg-rounds pfnm+refit fedma+refit`` (``METHOD+refit``: the
fusion, then the output refit round, ``fuse(..., rounds=2, data=...)``). ``--jobs N`` runs N seeds at
once in separate processes (one torch thread each), for machines with the cores.

For each seed: ``--train-size`` training examples drawn at random (seeded) from the dataset's
training set, split over ``--clients`` clients by Dirichlet(``--alpha``) class shares; one CIFAR-
style ResNet-20 (He et al. 2016; ``bayesfuse.nets.resnet.resnet20``, 16/32/64 x ``--width``
channels, batch norm, projection shortcuts) per client, trained ``--epochs`` epochs with the
library's defaults (AMSGrad, learning rate 0.01, minibatches of 32; one torch thread), each
client from its own initialisation unless ``--shared-init``. Then the global models:

* ``local (mean)``: the clients' own networks, their metrics averaged; ``ensemble``: the
  equal-weight mixture of their predictive distributions (all of them kept);
* ``fedavg``: one-shot FedAvg (the clients' weights averaged by client size, no alignment);
* ``ot``: OT fusion (Singh & Jaggi 2020) onto the widest client; ``pfnm``, ``nafi``: one-shot
  matching, bottom-up, every hyper-parameter chosen from the models ("auto"); all three with
  the permutations of each residual stream tied (Ainsworth et al. 2023) and batch norms folded
  into the convolutions before them (the fused batch norms are identities);
* ``METHOD+bn``: the one-shot fusion, then the batch-norm round (``fuse(..., rounds=2,
  second_round="batchnorm")``): each client returns the moments of every batch norm's input in
  the fused network over its own data and the server sets the fused batch norms' statistics to
  their pool; ``pfnm+bn+refit`` then refits the output layer (``rounds=3``);
* ``fedma``: FedMA (Wang et al. 2020), one round per stream and inner layer (12) plus one for the
  output layer, ``--retrain-epochs`` of client training after each; with ``--fedma-passes P > 1``,
  FedMA with communication (section 2.3): P such passes, each client rebuilding its own widths
  from the global model and training ``--retrain-epochs`` in the first round of the next;
* ``fedma+refit``: FedMA, then one more round that refits its output layer (``fuse(...,
  "fedma", rounds=2)``: the product of the clients' Laplace fits on the FedMA body in place of
  FedMA's class-share average);
* ``pfnm+summaries``: one-shot PFNM with client summaries, the default path of ``fuse`` when
  they are given: each client sends ``bayesfuse.summarize(model, x, y)`` of its own examples
  (activation moments, the Laplace GGN diagonal, its output layer's Kronecker factors) and the
  server fuses the networks as Laplace posteriors, keeping the clients' heads where the output
  layer allows them (not run by default);
* ``fedavg xR rounds``: FedAvg from one shared initialisation for as many rounds R as FedMA uses,
  ``--retrain-epochs`` each.

Columns: test accuracy, NLL and ECE on ``--test-size`` examples drawn from the test set with the
seed (the same for every method), mean +- sd over the seeds; the global model's parameters
(``local``: one client's; ``ensemble``: all clients'); communication rounds after local training;
seconds to build the global model (``local``: to train one client); CPU seconds to build and
evaluate it (``local``: all clients).

The defaults (width 0.25, 4,000 training and 5,000 test examples, 5 epochs, 1 retraining epoch)
keep the run within about 20 minutes of CPU on 2 cores: one seed with the whole test set took
513 s of CPU (training and evaluating the clients 133 s, FedMA 120 s, FedAvg at its rounds
150 s, evaluating the fused networks, up to 50 times a client's size, 100 s). They were chosen
from these times alone, never from test results. The run prints the CPU time it used.
"""

from __future__ import annotations

import argparse
import resource
import time
import warnings
from dataclasses import replace

import numpy as np
import torch
from common import mean_sd

from bayesfuse import fuse, summarize
from bayesfuse.data import DataSplit, dirichlet_partition, load_dataset
from bayesfuse.demo import format_table
from bayesfuse.federated import fedma_rounds, run_fedavg
from bayesfuse.inference.result import ConvergenceWarning
from bayesfuse.metrics import evaluate
from bayesfuse.nets.predict import predict_proba
from bayesfuse.nets.tracing import spec_from_module
from bayesfuse.train import TrainConfig, new_model, train_clients

METHODS = (
    "fedavg",
    "ot",
    "pfnm",
    "nafi",
    "fedma",
    "fedavg-rounds",
    "fedavg+bn",
    "ot+bn",
    "pfnm+bn",
    "pfnm+bn+refit",
    "pfnm+refit",
    "fedma+refit",
    "pfnm+summaries",
)
#: What each architecture runs by default: the ViT has no batch norms for the ``+bn`` rounds.
DEFAULT_METHODS = {
    "resnet20": METHODS[:-2] + ("fedma+refit",),
    "vit": ("fedavg", "ot", "pfnm", "nafi", "fedma", "fedavg-rounds", "pfnm+refit", "fedma+refit"),
}
DEFAULT_WIDTH = {"resnet20": 0.25, "vit": 1.0}
#: Local epochs: the ViT (19,594 parameters) trains an epoch about ten times faster than ResNet-20 x
#: 0.25, so 20 epochs cost it less than ResNet-20's 5 (chosen from training time, not test results).
DEFAULT_EPOCHS = {"resnet20": 5, "vit": 20}
NAMES = {"resnet20": "ResNet-20", "vit": "ViT"}
COLUMNS = ("method", "accuracy", "nll", "ece", "parameters", "rounds", "seconds", "cpu")


def cpu_seconds() -> float:
    """User and system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def federation(args, seed: int) -> DataSplit:
    """The dataset with ``args.train_size`` training and ``args.test_size`` test examples drawn with
    ``seed`` (0: all), standardised on the training examples."""
    split = load_dataset(args.dataset, seed=seed, path=args.data_path)
    rng = np.random.default_rng(seed)
    parts = []
    for data, size in ((split.train, args.train_size), (split.test, args.test_size)):
        parts.append(data.subset(np.sort(rng.choice(len(data), size, replace=False))) if 0 < size < len(data) else data)
    return DataSplit(*parts).standardize()


def probabilities(model: torch.nn.Module, x: np.ndarray, batch_size: int = 1000) -> np.ndarray:
    """``predict_proba`` in batches small enough for a wide fused network's activations."""
    return np.concatenate([predict_proba(model, x[i : i + batch_size]) for i in range(0, len(x), batch_size)])


def n_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def row(method: str, metrics: dict, parameters: int, rounds: int, seconds: float, cpu: float) -> dict:
    return {
        "method": method,
        "accuracy": metrics["accuracy"],
        "nll": metrics["nll"],
        "ece": metrics["ece"],
        "parameters": int(parameters),
        "rounds": int(rounds),
        "seconds": float(seconds),
        "cpu": float(cpu),
    }


def run_seed(args, seed: int) -> tuple[list[dict], str]:
    """The rows of one seed, and the data they were measured on in words."""
    torch.set_num_threads(1)
    split = federation(args, seed)
    part = dirichlet_partition(split.train.y, args.clients, args.alpha, seed=seed)
    config = TrainConfig(arch=args.arch, width=args.width, epochs=args.epochs, seed=seed, num_threads=1)
    retrain = replace(config, epochs=args.retrain_epochs)
    start, cpu = time.perf_counter(), cpu_seconds()
    models = train_clients(split.train, part, config, shared_init=args.shared_init, verbose=False)
    train_seconds = (time.perf_counter() - start) / len(models)
    x, y = split.test.x, split.test.y
    probs = [probabilities(m, x) for m in models]
    size = n_parameters(models[0])
    local = [evaluate(p, y) for p in probs]
    rows = [
        row(
            "local (mean)",
            {k: float(np.mean([m[k] for m in local])) for k in local[0]},
            size,
            0,
            train_seconds,
            cpu_seconds() - cpu,
        ),
        row("ensemble", evaluate(np.mean(probs, axis=0), y), size * len(models), 1, 0.0, 0.0),
    ]
    # FedMA: each group (stream, inner layer, head), then fc; a later pass's first round sends the global model down
    passes = args.fedma_passes
    n_rounds = fedma_rounds(spec_from_module(models[0]), passes)
    for method in args.methods:
        cpu = cpu_seconds()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            if method == "fedavg-rounds":
                torch.manual_seed(seed)
                run = run_fedavg(
                    new_model(split.n_features, split.n_classes, config),
                    split.train,
                    part,
                    retrain,
                    rounds=n_rounds,
                    verbose=False,
                )
                model, seconds, rounds, name = run.model, run.seconds, n_rounds, f"fedavg x{n_rounds} rounds"
            else:
                base, *rounds_after = method.split("+")
                if rounds_after == ["summaries"]:  # one shot, each client's summary of its own examples
                    data = {
                        "summaries": [summarize(m, split.train.x[i], split.train.y[i]) for m, i in zip(models, part)]
                    }
                    rounds_after = []
                elif base == "fedma":  # "+refit": the refit round after FedMA's own (rounds=2)
                    data = {"data": (split.train, part), "retrain": retrain, "passes": passes}
                    data["rounds"] = 2 if rounds_after == ["refit"] else 1
                elif rounds_after:  # the batch-norm round and/or the refit round, in that order
                    data = {
                        "class_counts": part.counts,
                        "data": (split.train, part),
                        "rounds": 1 + len(rounds_after),
                        "second_round": rounds_after[0].replace("bn", "batchnorm"),
                    }
                else:
                    data = {"class_counts": part.counts}
                result = fuse(models, base, seed=seed, **data)
                rounds = result.hyper.get("rounds", 1 + len(rounds_after))  # FedMA reports its own
                model, seconds, name = result.model, result.seconds, method
        rows.append(
            row(name, evaluate(probabilities(model, x), y), n_parameters(model), rounds, seconds, cpu_seconds() - cpu)
        )
    return rows, f"{split.name}, {len(split.train)} training and {len(split.test)} test examples"


def summary(per_seed: list[list[dict]]) -> list[dict]:
    out = []
    for i, first in enumerate(per_seed[0]):
        group = [rows[i] for rows in per_seed]
        cells = {"method": first["method"]}
        for k in ("accuracy", "nll", "ece"):
            cells[k] = mean_sd([r[k] for r in group])
        cells["parameters"] = f"{np.mean([r['parameters'] for r in group]):,.0f}"
        cells["rounds"] = str(first["rounds"])
        cells["seconds"] = f"{np.mean([r['seconds'] for r in group]):.1f}"
        cells["cpu"] = f"{np.mean([r['cpu'] for r in group]):.0f}"
        out.append(cells)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--data-path", default=None, help="IDX directory (default: the Debian package's)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--arch", default="resnet20", choices=sorted(NAMES), help="the clients' network (default: resnet20)"
    )
    parser.add_argument(
        "--width", type=float, default=None, help="width multiplier (default: 0.25 for resnet20, 1 for vit)"
    )
    parser.add_argument(
        "--train-size",
        type=int,
        default=4000,
        help="training examples drawn from the training set; 0: all (default: 4000)",
    )
    parser.add_argument(
        "--test-size",
        type=int,
        default=5000,
        help="test examples drawn from the test set, the same for every method; 0: all (default: 5000)",
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="local training epochs (default: 5 for resnet20, 20 for vit)"
    )
    parser.add_argument(
        "--retrain-epochs", type=int, default=1, help="epochs of client training per FedMA / FedAvg round (default: 1)"
    )
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS, help="default: the architecture's")
    parser.add_argument(
        "--fedma-passes",
        type=int,
        default=1,
        help="FedMA's layer-wise passes (> 1: FedMA with communication, section 2.3); FedAvg then runs as many "
        "rounds as all passes take (default: 1)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once, in separate processes (default: 1)")
    parser.add_argument(
        "--shared-init",
        action="store_true",
        help="clients start from one shared initialisation (default: each its own)",
    )
    args = parser.parse_args()
    args.width = args.width if args.width is not None else DEFAULT_WIDTH[args.arch]
    args.epochs = args.epochs if args.epochs is not None else DEFAULT_EPOCHS[args.arch]
    args.methods = args.methods if args.methods is not None else list(DEFAULT_METHODS[args.arch])
    if args.arch == "vit" and any("+bn" in m for m in args.methods):
        parser.error("the ViT has no batch norms: drop the +bn methods")
    torch.set_num_threads(1)
    start, cpu = time.perf_counter(), cpu_seconds()
    init = "shared" if args.shared_init else "independent"
    setting = (
        f"J={args.clients}, Dirichlet({args.alpha}), {NAMES[args.arch]} x {args.width:g}, {args.epochs} local epochs, "
        f"{args.retrain_epochs} per later round, {init} initialisation"
    )
    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(run_seed, [args] * len(args.seeds), args.seeds))
    else:
        results = (run_seed(args, seed) for seed in args.seeds)
    per_seed = []
    for seed, (rows, data) in zip(args.seeds, results):
        per_seed.append(rows)
        print(f"\nseed {seed}: {data}, {setting}")
        print(format_table(rows, COLUMNS))
    print(f"\nmean +- sd over seeds {', '.join(map(str, args.seeds))}: {data}, {setting}")
    print(format_table(summary(per_seed), COLUMNS))
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_all = cpu_seconds() - cpu + children.ru_utime + children.ru_stime
    print(f"\n{time.perf_counter() - start:.0f} s wall, {cpu_all:.0f} s CPU in all")


if __name__ == "__main__":
    main()
