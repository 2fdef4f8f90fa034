"""Networks written as users write them: every method on a U-Net with transposed convolutions or a
DenseNet block, classes with a ``forward`` of their own, traced with ``torch.fx``.

Usage: python benchmarks/bench_user_nets.py [--net unet|unet-gn|dense] [--dataset digits] [--clients 5]
       [--alpha 0.5] [--seeds 0 1 2] [--epochs 20] [--methods fedavg ot pfnm nafi pfnm+bn
       pfnm+bn+refit fedma pfnm+summaries] [--data-path DIR]

``--net unet`` (:class:`UNet`): an encoder (conv-BN-ReLU), max pooling, a bottleneck convolution
without bias and its batch norm, upsampled by ``nn.ConvTranspose2d`` (stride 2, no bias, a batch
norm after it), concatenated with the encoder's maps (16 + 16 channels), a decoder convolution with
its batch norm, global mean pooling and a dense classifier; ``--net unet-gn`` the same with group
norms of 4 groups in place of its batch norms (:class:`GroupNormUNet`; no batch-norm round for
it). ``--net dense`` (:class:`DenseBlock`): a
stem convolution of 8 channels, a dense block of three BN-ReLU-conv3x3 layers growing by 8, 12 and
8, each reading the concatenation of everything before it, a batch norm, global pooling and a
classifier reading the last concatenation (pre-activation batch norms: not foldable).

For each seed: the dataset's training set split over ``--clients`` clients by Dirichlet(``--alpha``)
class shares; each client trains its own network from its own initialisation for ``--epochs`` epochs
(the library's defaults: AMSGrad, learning rate 0.01, minibatches of 32, one torch thread). Global
models, the methods of ``benchmarks/bench_architectures.py``: the clients' mean and their ensemble,
one-shot FedAvg, OT, PFNM and NAFI; ``pfnm+bn`` the batch-norm round after PFNM, ``pfnm+bn+refit``
the refit round after it (3 rounds), ``pfnm+refit`` the refit round alone, ``fedma`` FedMA with
the library's retraining per round (``TrainConfig()``: 10 epochs), ``pfnm+summaries`` one-shot
PFNM with client summaries. Columns: test accuracy, NLL, ECE (mean +- sd over the seeds),
parameters, rounds, seconds to fuse and CPU seconds. Nothing is chosen on test data.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from bench_architectures import COLUMNS, cpu_seconds, n_parameters, probabilities, row, summary
from torch import nn

from bayesfuse import fuse, summarize
from bayesfuse.data import dirichlet_partition, load_dataset
from bayesfuse.demo import format_table
from bayesfuse.inference.result import ConvergenceWarning
from bayesfuse.metrics import evaluate
from bayesfuse.train import TrainConfig, train_model

METHODS = ("fedavg", "ot", "pfnm", "nafi", "pfnm+bn", "pfnm+bn+refit", "pfnm+refit", "fedma", "pfnm+summaries")


class UNet(nn.Module):
    """A U-Net step with transposed convolutions, on square images of ``side`` pixels (even)."""

    def __init__(self, side: int = 8, n_classes: int = 10) -> None:
        super().__init__()
        self.side = side
        self.enc, self.bn0 = nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.mid, self.bn1 = nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        self.up, self.bn2 = nn.ConvTranspose2d(32, 16, 2, stride=2, bias=False), nn.BatchNorm2d(16)
        self.dec, self.bn3 = nn.Conv2d(32, 24, 3, padding=1), nn.BatchNorm2d(24)
        self.head = nn.Linear(24, n_classes)

    def example_input(self) -> torch.Tensor:
        return torch.zeros(2, self.side * self.side)

    def forward(self, x):
        skip = F.relu(self.bn0(self.enc(x.view(-1, 1, self.side, self.side))))
        low = F.relu(self.bn1(self.mid(F.max_pool2d(skip, 2))))
        up = F.relu(self.bn2(self.up(low)))
        h = F.relu(self.bn3(self.dec(torch.cat([skip, up], 1))))
        return self.head(h.mean((2, 3)))


class GroupNormUNet(UNet):
    """:class:`UNet` with group norms of 4 groups in place of its batch norms (as diffusion models'
    U-Nets are written): statistics of each example's own maps, none to re-estimate."""

    def __init__(self, side: int = 8, n_classes: int = 10) -> None:
        super().__init__(side, n_classes)
        self.bn0, self.bn1, self.bn2, self.bn3 = (nn.GroupNorm(4, c) for c in (16, 32, 16, 24))


class DenseBlock(nn.Module):
    """A DenseNet block of pre-activation layers, on square images of ``side`` pixels."""

    def __init__(self, side: int = 8, n_classes: int = 10, growth: tuple[int, ...] = (8, 12, 8)) -> None:
        super().__init__()
        self.side, width = side, 8
        self.stem = nn.Conv2d(1, width, 3, padding=1)
        self.layers = nn.ModuleList()
        for g in growth:
            self.layers.append(nn.ModuleDict(dict(norm=nn.BatchNorm2d(width), conv=nn.Conv2d(width, g, 3, padding=1))))
            width += g
        self.norm, self.head = nn.BatchNorm2d(width), nn.Linear(width, n_classes)

    def example_input(self) -> torch.Tensor:
        return torch.zeros(2, self.side * self.side)

    def forward(self, x):
        features = [self.stem(x.view(-1, 1, self.side, self.side))]
        for layer in self.layers:
            features.append(layer["conv"](F.relu(layer["norm"](torch.cat(features, 1)))))
        return self.head(F.relu(self.norm(torch.cat(features, 1))).mean((2, 3)))


NETS = {"unet": UNet, "unet-gn": GroupNormUNet, "dense": DenseBlock}
NAMES = {
    "unet": "U-Net (transposed convolutions)",
    "unet-gn": "U-Net (transposed convolutions, group norms)",
    "dense": "DenseNet block",
}


def run_seed(args, seed: int) -> tuple[list[dict], str]:
    """The rows of one seed, and the data they were measured on in words."""
    torch.set_num_threads(1)
    split = load_dataset(args.dataset, seed=seed, path=args.data_path).standardize()
    side = int(round(np.sqrt(split.n_features)))
    part = dirichlet_partition(split.train.y, args.clients, args.alpha, seed=seed)
    start, cpu = time.perf_counter(), cpu_seconds()
    models = []
    for j, idx in enumerate(part):
        torch.manual_seed(1000 * seed + j)
        model = NETS[args.net](side, split.n_classes)
        config = TrainConfig(epochs=args.epochs, seed=1000 * seed + j, num_threads=1)
        train_model(model, split.train.x[idx], split.train.y[idx], split.n_classes, config, verbose=False)
        models.append(model.eval())
    train_seconds = (time.perf_counter() - start) / len(models)
    x, y = split.test.x, split.test.y
    probs = [probabilities(m, x) for m in models]
    size = n_parameters(models[0])
    local = [evaluate(p, y) for p in probs]
    mean = {k: float(np.mean([m[k] for m in local])) for k in local[0]}
    rows = [
        row("local (mean)", mean, size, 0, train_seconds, cpu_seconds() - cpu),
        row("ensemble", evaluate(np.mean(probs, axis=0), y), size * len(models), 1, 0.0, 0.0),
    ]
    for method in args.methods:
        cpu = cpu_seconds()
        base, *after = method.split("+")
        if after == ["summaries"]:
            hyper: dict = {
                "summaries": [summarize(m, split.train.x[i], split.train.y[i]) for m, i in zip(models, part)]
            }
        elif base == "fedma":  # the library's retraining between layers (TrainConfig(): 10 epochs)
            hyper = {"data": (split.train, part)}
        elif after:  # the batch-norm round (then the refit round), or the refit round
            hyper = {"class_counts": part.counts, "data": (split.train, part), "rounds": 1 + len(after)}
            hyper["second_round"] = "batchnorm" if after[0] == "bn" else "refit"
        else:
            hyper = {"class_counts": part.counts} if base in ("pfnm", "nafi") else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            result = fuse(models, base, seed=seed, **hyper)
        rounds = result.hyper.get("rounds", 1 + len([a for a in after if a != "summaries"]))
        rows.append(
            row(
                method,
                evaluate(probabilities(result.model, x), y),
                n_parameters(result.model),
                rounds,
                result.seconds,
                cpu_seconds() - cpu,
            )
        )
    return rows, f"{split.name}, {len(split.train)} training and {len(split.test)} test examples"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--net", default="unet", choices=sorted(NETS), help="the clients' network (default: unet)")
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--data-path", default=None, help="IDX directory (default: the Debian package's)")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=20, help="local training epochs (default: 20)")
    parser.add_argument(
        "--methods", nargs="+", default=None, choices=METHODS, help="default: every method the network has"
    )
    args = parser.parse_args()
    no_batch_norms = args.net == "unet-gn"
    if args.methods is None:  # the refit round after the batch-norm round, or alone where there is none
        args.methods = [m for m in METHODS if ("+bn" not in m if no_batch_norms else m != "pfnm+refit")]
    if no_batch_norms and any("+bn" in m for m in args.methods):
        parser.error(f"--net {args.net} has no batch norms: drop the +bn methods")
    torch.set_num_threads(1)
    start, cpu = time.perf_counter(), cpu_seconds()
    setting = f"J={args.clients}, Dirichlet({args.alpha}), {NAMES[args.net]}, {args.epochs} local epochs"
    per_seed = []
    for seed in args.seeds:
        rows, data = run_seed(args, seed)
        per_seed.append(rows)
        print(f"\nseed {seed}: {data}, {setting}", flush=True)
        print(format_table(rows, COLUMNS), flush=True)
    print(f"\nmean +- sd over seeds {', '.join(map(str, args.seeds))}: {data}, {setting}")
    print(format_table(summary(per_seed), COLUMNS))
    print(f"\n{time.perf_counter() - start:.0f} s wall, {cpu_seconds() - cpu:.0f} s CPU in all")


if __name__ == "__main__":
    main()
