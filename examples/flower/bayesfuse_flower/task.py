"""The clients' data and networks: Dirichlet-split digits, MLPs from bayesfuse.

Each simulated node reads partition ``partition-id`` of ``num-partitions`` (from the node
config Flower gives it). A real deployment would load the node's own data here instead.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from bayesfuse.data import dirichlet_partition, holdout_partition, load_digits
from bayesfuse.nets.arch import rebuild
from bayesfuse.train import TrainConfig, new_model, train_model

ALPHA = 0.5
#: The app's settings; ``[tool.flwr.app.config]`` in pyproject.toml (``flwr run``) and the
#: ``overrides`` of ``make_*_app`` (``run_simulation``) replace them.
DEFAULTS = {
    "method": "pfnm",
    "hidden": "50",
    "local-epochs": 10,
    "round-epochs": 5,
    "num-rounds": 3,
    "num-nodes": 10,
    "seed": 0,
    "timeout": 600,
    "compare-fedavg": True,
    "summaries": False,
    "second-round": "none",
    "holdout": 0.1,
}


def settings(context, overrides) -> dict:
    return {**DEFAULTS, **dict(context.run_config), **overrides}


@lru_cache(maxsize=None)
def _split(seed: int):
    return load_digits(seed=seed).standardize()


def load_data(partition_id: int, num_partitions: int, seed: int = 0, holdout: float = 0.0, held: bool = False):
    """``(x, y)`` of this node's share of the digits training set, and the test set. With
    ``holdout``, the node keeps back that share of its examples from training: ``held`` gives
    them (the temperature round scores its candidates on them), else the rest."""
    split = _split(seed)
    part = dirichlet_partition(split.train.y, num_partitions, ALPHA, seed=seed)
    if holdout:
        part = holdout_partition(part, split.train.y, holdout, seed=seed)[1 if held else 0]
    idx = part[partition_id]
    return split.train.x[idx], split.train.y[idx], split.test


def config(run_config) -> TrainConfig:
    hidden = tuple(int(h) for h in str(run_config.get("hidden", "50")).split(","))
    return TrainConfig(
        hidden=hidden, epochs=int(run_config.get("local-epochs", 10)), seed=int(run_config.get("seed", 0))
    )


def fresh_model(cfg: TrainConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return new_model(64, 10, cfg)


def model_from_state(cfg: TrainConfig, state: dict) -> torch.nn.Module:
    """The configured network at the widths of ``state`` (fused models may be wider)."""
    return rebuild(fresh_model(cfg, 0), {k: torch.as_tensor(v) for k, v in state.items()})


def train(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, cfg: TrainConfig, frozen=()) -> torch.nn.Module:
    return train_model(model, x, y, 10, cfg, frozen=frozen, verbose=False)
