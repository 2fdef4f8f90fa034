"""Local training of client networks for federation simulations.

Defaults follow PFNM supplement Table 1 (MNIST column): AMSGrad, learning rate 0.01, L2
regularisation 1e-6, minibatches of 32, 10 epochs, weights ~ N(0, 0.01), biases 0.1.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bayesfuse.data.datasets import Dataset
from bayesfuse.data.partition import Partition
from bayesfuse.nets.mlp import MLP

__all__ = ["TrainConfig", "TrainingDivergedError", "torch_threads", "train_mlp", "train_clients"]


class TrainingDivergedError(FloatingPointError):
    """The training loss became NaN or infinite."""


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of local training (PFNM supplement Table 1, MNIST column).

    ``num_threads=1`` is the default because these small networks train faster on one thread
    than on two on a 2-core machine (see ``benchmarks/bench_training.py``); ``None`` leaves
    torch's setting alone.
    """

    hidden: tuple[int, ...] = (100,)
    epochs: int = 10
    lr: float = 0.01
    weight_decay: float = 1e-6
    batch_size: int = 32
    amsgrad: bool = True
    seed: int = 0
    num_threads: int | None = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run a block with ``torch.set_num_threads(n)``, restoring the previous value after."""
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _progress(verbose: bool | None) -> bool:
    return sys.stderr.isatty() if verbose is None else bool(verbose)


def _as_tensors(x: np.ndarray, y: np.ndarray, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = np.asarray(x, dtype=np.float32)
    y = np.asarray(y)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (n, d), got shape {x.shape}")
    if len(x) == 0:
        raise ValueError("cannot train on an empty dataset (0 examples)")
    if y.shape != (len(x),):
        raise ValueError(f"y must have shape ({len(x)},), got {y.shape}")
    if not np.isfinite(x).all():
        raise ValueError("training inputs contain NaN or infinite values")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= n_classes:
        raise ValueError(f"labels must be integers in 0..{n_classes - 1}")
    return torch.from_numpy(x), torch.from_numpy(y.astype(np.int64))


def _fit(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    config: TrainConfig,
    generator: torch.Generator,
    on_epoch=None,
    name: str = "model",
) -> list[float]:
    """Minibatch training loop; returns the mean loss of each epoch."""
    opt = torch.optim.Adam(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, amsgrad=config.amsgrad
    )
    loss_fn = nn.CrossEntropyLoss()
    n = len(x)
    history = []
    model.train()
    for epoch in range(config.epochs):
        order = torch.randperm(n, generator=generator)
        total = 0.0
        for step, start in enumerate(range(0, n, config.batch_size)):
            batch = order[start : start + config.batch_size]
            loss = loss_fn(model(x[batch]), y[batch])
            if not torch.isfinite(loss):
                raise TrainingDivergedError(
                    f"{name}: loss became {loss.item()} at epoch {epoch + 1}, step {step + 1}; "
                    f"lower the learning rate (now {config.lr}) or check the inputs"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
        history.append(total / n)
        if on_epoch is not None:
            on_epoch(epoch, history[-1])
    model.eval()
    return history


def train_mlp(
    x: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    config: TrainConfig | None = None,
    *,
    init: MLP | None = None,
    verbose: bool | None = None,
    name: str = "model",
) -> MLP:
    """Train one MLP with cross-entropy on ``(x, y)``.

    Parameters
    ----------
    x : ndarray (n, d)
    y : ndarray of int (n,)
    n_classes : int
    config : TrainConfig, optional
        Hyper-parameters; the defaults of :class:`TrainConfig` when omitted.
    init : MLP, optional
        Start from a copy of this network instead of a fresh seeded initialisation.
    verbose : bool, optional
        Show a progress bar; default: only when stderr is a terminal.

    Returns
    -------
    MLP
        In eval mode; ``model.loss_history`` holds the mean loss per epoch.

    Raises
    ------
    TrainingDivergedError
        If the loss becomes NaN or infinite.
    """
    config = config or TrainConfig()
    xt, yt = _as_tensors(x, y, n_classes)
    with torch_threads(config.num_threads):
        torch.manual_seed(config.seed)
        model = MLP(xt.shape[1], config.hidden, n_classes)
        if init is not None:
            if init.widths != model.widths:
                raise ValueError(f"init widths {init.widths} differ from {model.widths}")
            model.load_state_dict(init.state_dict())
        gen = torch.Generator().manual_seed(config.seed)
        with tqdm(total=config.epochs, desc=name, disable=not _progress(verbose), leave=False) as bar:

            def on_epoch(epoch: int, loss: float) -> None:
                bar.set_postfix(loss=f"{loss:.4f}")
                bar.update()

            model.loss_history = _fit(model, xt, yt, config, gen, on_epoch, name)
    return model


def train_clients(
    train: Dataset,
    partition: Partition | Sequence[np.ndarray],
    config: TrainConfig | None = None,
    *,
    shared_init: bool = True,
    verbose: bool | None = None,
) -> list[MLP]:
    """Train one MLP per client on its part of ``train``.

    Parameters
    ----------
    train : Dataset
    partition : Partition or sequence of index arrays
    config : TrainConfig, optional
    shared_init : bool
        Start every client from the same initial weights (drawn with ``config.seed``), as a
        server that broadcasts one initial model does; otherwise client j draws its own with
        seed ``config.seed + j``. Minibatch order always uses ``config.seed + j``.
    verbose : bool, optional
        Progress bar over clients; default: only when stderr is a terminal.

    Returns
    -------
    list of MLP
        ``models[j].train_seconds`` holds client j's training time.
    """
    config = config or TrainConfig()
    parts = list(partition)
    if not parts:
        raise ValueError("partition holds no clients")
    empty = [j for j, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(f"clients {empty} hold no examples; cannot train a local model on them")
    init = None
    if shared_init:
        with torch_threads(config.num_threads):
            torch.manual_seed(config.seed)
            init = MLP(train.n_features, config.hidden, train.n_classes)
    models = []
    bar = tqdm(parts, desc="local training", unit="client", disable=not _progress(verbose))
    for j, idx in enumerate(bar):
        start = time.perf_counter()
        client_config = replace(config, seed=config.seed + j)
        model = train_mlp(
            train.x[idx], train.y[idx], train.n_classes, client_config,
            init=init, verbose=False, name=f"client {j}",
        )
        model.train_seconds = time.perf_counter() - start
        bar.set_postfix(client=j, loss=f"{model.loss_history[-1]:.3f}")
        models.append(model)
    return models

