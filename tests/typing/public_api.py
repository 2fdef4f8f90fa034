"""The public API as a user's code calls it, checked by mypy (``make test`` runs ``mypy``).

Never run: mypy reads it, so that a signature or a return type of a public name that no longer
fits documented use fails the type check. The calls follow the README and the user guide.
"""

from __future__ import annotations

import numpy as np
import torch

import bayesfuse
from bayesfuse import (
    Ensemble,
    FusionResult,
    MatchResult,
    TrainConfig,
    fedavg,
    fuse,
    fuse_states,
    load,
    match_neurons,
    summarize,
    train_clients,
)
from bayesfuse.data import dirichlet_partition, load_digits


def fuse_digits() -> FusionResult:
    split = load_digits().standardize()
    parts = dirichlet_partition(split.train.y, n_clients=3, alpha=0.5, seed=0)
    models = train_clients(split.train, parts, TrainConfig(hidden=(20,), epochs=1))
    summaries = [summarize(m, split.train.x[idx], split.train.y[idx]) for m, idx in zip(models, parts)]
    fused = fuse(models, "pfnm", class_counts=parts.counts, summaries=summaries)
    sizes: list[int] = list(fused.sizes)
    assert sizes
    ensemble: torch.nn.Module = Ensemble(models)
    average: torch.nn.Module = fedavg(models, weights=parts.sizes)
    assert ensemble is not average
    return fused


def match_arrays() -> MatchResult:
    rng = np.random.default_rng(0)
    layers = [rng.normal(size=(10, 5)) for _ in range(3)]
    return match_neurons(layers, noise_var=0.01, prior_var=1.0, gamma0=1.0)


def fuse_files(states: list[dict[str, torch.Tensor]]) -> None:
    result = fuse_states(states, "pfnm")
    assert result is not None
    model: torch.nn.Module = load("fused.pt")
    assert model is not None
    assert isinstance(bayesfuse.__version__, str)
