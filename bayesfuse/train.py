"""Local training of client networks for federation simulations.

Defaults follow PFNM supplement Table 1 (MNIST column): AMSGrad, learning rate 0.01, L2
regularisation 1e-6, minibatches of 32, 10 epochs, weights ~ N(0, 0.01), biases 0.1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterable, Sequence, cast

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bayesfuse._runtime import progress as _progress
from bayesfuse._runtime import torch_threads
from bayesfuse.data.datasets import Dataset
from bayesfuse.data.partition import Partition
from bayesfuse.nets.arch import ARCHITECTURES, make_model
from bayesfuse.nets.pans import PANConfig
from bayesfuse.nets.state import floating_like

__all__ = [
    "TrainConfig",
    "TrainingDivergedError",
    "torch_threads",
    "new_model",
    "train_model",
    "train_mlp",
    "train_clients",
]


class TrainingDivergedError(FloatingPointError):
    """The training loss became NaN or infinite."""


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of local training (PFNM supplement Table 1, MNIST column).

    ``arch`` picks the network (:func:`bayesfuse.nets.arch.make_model`): ``"mlp"`` with
    ``hidden`` widths, ``"cnn"`` with ``channels`` then ``hidden``, ``"lstm"`` with
    ``hidden[0]`` states, ``"resnet20"`` / ``"resnet18"`` / ``"vit"`` with the width multiplier ``width``
    (:mod:`bayesfuse.nets.resnet`); ``pan`` adds position-aware neurons (:mod:`bayesfuse.nets.pans`).

    ``num_threads=1`` is the default because these small networks train faster on one thread
    than on two on a 2-core machine (see ``benchmarks/bench_training.py``); ``None`` leaves
    torch's setting alone.
    """

    hidden: tuple[int, ...] = (100,)
    arch: str = "mlp"
    channels: tuple[int, ...] = (16, 32)
    width: float = 1.0
    pan: PANConfig | None = None
    epochs: int = 10
    lr: float = 0.01
    weight_decay: float = 1e-6
    batch_size: int = 32
    amsgrad: bool = True
    seed: int = 0
    num_threads: int | None = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        object.__setattr__(self, "channels", tuple(int(c) for c in self.channels))
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r}; known: {', '.join(ARCHITECTURES)}")
        if not self.width > 0:
            raise ValueError(f"width must be positive, got {self.width}")
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")


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
    eval_modules: Sequence[nn.Module] = (),
) -> list[float]:
    """Minibatch training loop over the parameters that require grad; returns each epoch's mean loss.

    ``eval_modules`` stay in eval mode (frozen batch norms keep their running statistics).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{name}: every parameter is frozen; nothing to train")
    opt = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay, amsgrad=config.amsgrad)
    loss_fn = nn.CrossEntropyLoss()
    n = len(x)
    history = []
    model.train()
    for m in eval_modules:
        m.eval()
    for epoch in range(config.epochs):
        order = torch.randperm(n, generator=generator)
        total = 0.0
        for step, start in enumerate(range(0, n, config.batch_size)):
            batch = order[start : start + config.batch_size]
            logits = model(x[batch])
            if not isinstance(logits, torch.Tensor):
                raise ValueError(
                    f"{name}: training reads the network's logits, and {type(model).__name__} returns a "
                    f"{type(logits).__name__}: make its forward return the logits alone"
                )
            loss = loss_fn(logits, y[batch])
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


def new_model(n_features: int, n_classes: int, config: TrainConfig) -> nn.Module:
    """A freshly initialised network of ``config.arch`` (seeded by the caller).

    MLPs keep PFNM's initialisation (weights N(0, 0.01), biases 0.1); ConvNets and LSTMs keep
    torch's defaults, which they need to train at all at these depths.
    """
    return make_model(
        config.arch,
        n_features,
        n_classes,
        hidden=config.hidden,
        channels=config.channels,
        pan=config.pan,
        width=config.width,
    )


def train_model(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    config: TrainConfig | None = None,
    *,
    frozen: Iterable[str] = (),
    verbose: bool | None = None,
    name: str = "model",
) -> nn.Module:
    """Train ``model`` in place with cross-entropy, keeping the state_dict entries ``frozen`` fixed.

    Frozen parameters get ``requires_grad=False``; a batch norm whose weight or running mean is
    frozen stays in eval mode so its running statistics do not move either (FedMA's frozen
    matched layers).
    ``config.hidden``/``arch`` are ignored: the network is given.
    """
    config = config or TrainConfig()
    xt, yt = _as_tensors(x, y, n_classes)
    like = floating_like(model)
    if like is not None:  # the network's own dtype (a float64 network trains on float64 inputs)
        xt = xt.to(like.dtype)
    frozen_keys = set(frozen)
    unknown = frozen_keys - set(model.state_dict())
    if unknown:
        raise ValueError(f"{name}: frozen entries {sorted(unknown)[:5]} are not in the network")
    eval_modules = []
    for pname, p in model.named_parameters():
        p.requires_grad_(pname not in frozen_keys)
    for mname, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and frozen_keys & {
            f"{mname}.weight",
            f"{mname}.running_mean",
        }:
            eval_modules.append(m)
    with torch_threads(config.num_threads):
        gen = torch.Generator().manual_seed(config.seed)
        with tqdm(total=config.epochs, desc=name, disable=not _progress(verbose), leave=False) as bar:

            def on_epoch(epoch: int, loss: float) -> None:
                bar.set_postfix(loss=f"{loss:.4f}")
                bar.update()

            # a plain attribute: torch's stub types a module's attributes as Tensor | Module
            model.loss_history = _fit(model, xt, yt, config, gen, on_epoch, name, eval_modules)  # type: ignore[assignment]
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def train_mlp(
    x: np.ndarray,
    y: np.ndarray,
    n_classes: int,
    config: TrainConfig | None = None,
    *,
    init: nn.Module | None = None,
    verbose: bool | None = None,
    name: str = "model",
) -> nn.Module:
    """Train one network of ``config.arch`` (an MLP by default) with cross-entropy on ``(x, y)``.

    Parameters
    ----------
    x : ndarray (n, d)
    y : ndarray of int (n,)
    n_classes : int
    config : TrainConfig, optional
        Hyper-parameters; the defaults of :class:`TrainConfig` when omitted.
    init : nn.Module, optional
        Start from a copy of this network instead of a fresh seeded initialisation.
    verbose : bool, optional
        Show a progress bar; default: only when stderr is a terminal.

    Returns
    -------
    nn.Module
        In eval mode; ``model.loss_history`` holds the mean loss per epoch.

    Raises
    ------
    TrainingDivergedError
        If the loss becomes NaN or infinite.
    """
    config = config or TrainConfig()
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D (n, d), got shape {x.shape}")
    with torch_threads(config.num_threads):
        torch.manual_seed(config.seed)
        model = new_model(x.shape[1], n_classes, config)
    if init is not None:
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        given = {k: tuple(v.shape) for k, v in init.state_dict().items()}
        if shapes != given:
            raise ValueError(f"init's parameter shapes {given} differ from the configured network's {shapes}")
        model.load_state_dict(init.state_dict())
    return train_model(model, x, y, n_classes, config, verbose=verbose, name=name)


def train_clients(
    train: Dataset,
    partition: Partition | Sequence[np.ndarray],
    config: TrainConfig | None = None,
    *,
    shared_init: bool = True,
    verbose: bool | None = None,
) -> list[nn.Module]:
    """Train one network per client on its part of ``train``.

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
    list of nn.Module
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
            init = new_model(train.n_features, train.n_classes, config)
    models = []
    bar = tqdm(parts, desc="local training", unit="client", disable=not _progress(verbose))
    for j, idx in enumerate(bar):
        start = time.perf_counter()
        client_config = replace(config, seed=config.seed + j)
        model = train_mlp(
            train.x[idx],
            train.y[idx],
            train.n_classes,
            client_config,
            init=init,
            verbose=False,
            name=f"client {j}",
        )
        model.train_seconds = time.perf_counter() - start  # type: ignore[assignment]  # a plain attribute, as above
        bar.set_postfix(client=j, loss=f"{cast(list[float], model.loss_history)[-1]:.3f}")
        models.append(model)
    return models
