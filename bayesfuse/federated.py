"""Multi-round federated training in simulation: FedMA and FedAvg on the same clients.

The server side of FedMA is :func:`bayesfuse.inference.fedma.fedma` (arrays only); here it
gets a ``client_update`` that rebuilds client j's network at its new widths and retrains the
unmatched layers on client j's data (:func:`bayesfuse.train.train_model`). FedAvg with as many
rounds is the baseline FedMA is compared with at equal communication (FedMA section 3).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from bayesfuse import methods
from bayesfuse._runtime import progress as _progress
from bayesfuse.baselines import fedavg_state_dicts
from bayesfuse.data.datasets import Dataset
from bayesfuse.inference.bias_free import (
    Added,
    added_keys,
    with_zero_biases,
)
from bayesfuse.inference.encodings import check_unfoldable, fold_encodings
from bayesfuse.inference.fedma import FedMAResult, fedma, matched_form, network_form, restart_states, state_bytes
from bayesfuse.inference.spec import PermutationSpec, tie_stacked_recurrent
from bayesfuse.nets.arch import rebuild
from bayesfuse.nets.spec import spec_with_encodings
from bayesfuse.nets.state import numpy_state, tensor_state
from bayesfuse.train import TrainConfig, train_model

__all__ = ["FedMARun", "run_fedma", "fedma_rounds", "FedAvgRun", "run_fedavg"]


def fedma_rounds(spec: PermutationSpec, passes: int = 1) -> int:
    """The communication rounds FedMA takes on networks of ``spec`` before it runs: one per
    permuted group and one for the output layer in each pass (FedMA section 2.2). A later pass
    (section 2.3) starts with the round that sends each client its network cut out of the global
    one and takes back what it trained, in place of the first pass's local training: that round
    is the pass's first, as on Flower (:class:`~bayesfuse.integrations.flower.FedMA`).
    :attr:`FedMARun.rounds` counts what a run took; this is what FedAvg must match to be
    compared at equal rounds."""
    return passes * (len(spec.groups) + 1)


def _client_data(train: Dataset, partition) -> list[np.ndarray]:
    parts = [np.asarray(p) for p in partition]
    if not parts:
        raise ValueError("partition holds no clients")
    empty = [j for j, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ValueError(f"clients {empty} hold no examples")
    return parts


@dataclass
class FedMARun:
    """A FedMA run: the global network and the server's record of each pass.

    Attributes
    ----------
    model : nn.Module
    result : FedMAResult
        The last pass.
    spec : PermutationSpec
    passes : list of FedMAResult
        Every pass (one unless ``passes > 1``, FedMA "with communication").
    """

    model: nn.Module
    result: FedMAResult
    spec: PermutationSpec
    passes: list = field(default_factory=list)

    @property
    def sizes(self) -> list[int]:
        return list(self.result.sizes.values())

    @property
    def rounds(self) -> int:
        """Communication rounds of all passes (a later pass's first round sends the global model
        down, cut to each client's widths, and takes back what the client trained: :func:`fedma_rounds`)."""
        return sum(p.rounds for p in self.passes)

    @property
    def bytes_up(self) -> int:
        return sum(p.bytes_up for p in self.passes)

    @property
    def bytes_down(self) -> int:
        return sum(p.bytes_down for p in self.passes) + self._broadcast_bytes

    _broadcast_bytes: int = 0


def run_fedma(
    models: Sequence[nn.Module],
    train: Dataset,
    partition,
    config: TrainConfig | None = None,
    *,
    method: str | None = "pfnm",
    spec: PermutationSpec | None = None,
    seed: int = 0,
    verbose: bool | None = None,
    **hyper,
) -> FedMARun:
    """FedMA (Algorithm 1) from the clients' trained networks, retraining on their data.

    With ``passes > 1`` this is "FedMA with communication" (FedMA section 2.3): after a pass,
    every client receives the global model and rebuilds a network of its *original* widths
    from it, keeping the global units its own units were matched to (so the global model does
    not snowball), trains it ``config.epochs`` epochs, and a new layer-wise pass follows.

    Parameters
    ----------
    models : sequence of nn.Module
        Client j's trained network; its data is ``train`` restricted to ``partition[j]``.
    config : TrainConfig
        Local retraining after each matched layer (``config.epochs`` epochs; FedMA retrains
        for as many epochs as local training).
    method : str or None
        The variant of the ``"fedma"`` row (:mod:`bayesfuse.methods`): ``"pfnm"``, PFNM's
        cost (``kl_weight`` fixed at 0), or ``"nafi"``, NAFI's KL penalty (NAFI Alg. 2;
        ``kl_weight`` defaults to NAFI's); None, the row as it is (``kl_weight`` given or 0).
    **hyper
        The ``"fedma"`` row of the method table: ``noise_var``, ``prior_var``, ``gamma0``,
        ``kl_weight``, ``cost``, ``n_iter`` (BBP-MAP settings for every layer) and ``passes``
        (layer-wise passes; FedMA with communication when > 1). ``noise_var`` sets the global
        widths: the paper's sigma^2 = 1 merges almost no 785-dimensional first-layer units of
        Fashion-MNIST MLPs (5.9x growth); sigma^2 = 10 grows them 1.04x at the same accuracy
        (``benchmarks/bench_fedma_sizes.py``).

    Position-aware neurons. With ``spec.encodings`` (traced from ``models[0]`` when ``spec`` is
    omitted) the server matches plain units: each client's encodings are folded into its
    weights at its own widths (:func:`~bayesfuse.inference.encodings.fold_encodings`, eq. F), and
    every state handed to a client to retrain is unfolded for the widths it is loaded at, its
    matched groups' global widths included (eq. U), and folded again when it comes back. The
    result's ``state_dict`` is for the position-aware network at the global widths.
    """
    variants = methods.METHODS["fedma"].variants
    if method is not None and method not in variants:
        raise ValueError(f"FedMA matches with {' or '.join(map(repr, variants))}, got {method!r}")
    settings = methods.resolve("fedma", "network", hyper, variant=method)
    passes = settings.pop("passes")
    config = config or TrainConfig()
    parts = _client_data(train, partition)
    if len(parts) != len(models):
        raise ValueError(f"{len(models)} models but {len(parts)} clients in the partition")
    spec = spec_with_encodings(models[0], spec)
    # groups whose width the forward fixes are matched at it (layerwise.match_group)
    spec, _ = tie_stacked_recurrent(spec, models[0].state_dict())  # a stacked LSTM keeps one width
    check_unfoldable(spec)
    widths = spec.sizes(numpy_state(models[0])) if spec.fixed else {}  # the fixed ones' widths, kept
    counts = np.stack([np.bincount(train.y[p], minlength=train.n_classes) for p in parts])
    bar = tqdm(
        total=len(spec.groups) * len(models), desc="FedMA retraining", unit="client", disable=not _progress(verbose)
    )

    keys = list(spec.split(models[0].state_dict()))  # an entry reading streams side by side: its pieces
    states = [fold_encodings(spec.split(numpy_state(m)), spec) for m in models]
    # layers without a bias before a batch norm: the server folds through a zero bias, the
    # clients' networks hold it in the batch norm (bayesfuse.inference.bias_free)
    states, spec, _, added = with_zero_biases(states, spec)
    virtual = added_keys(added)

    def to_network(state: dict) -> dict:
        return network_form(state, spec, added, keys)

    def retrain(j: int, state: dict, frozen: set) -> dict:
        # the server's plain units -> the client's position-aware network at the widths it gets, and back
        net = rebuild(models[j], tensor_state(to_network(state)), spec)
        # the client's own entries (the server's zero biases are none of them), pieces frozen as their entry
        frozen = {spec.whole(k) for k in frozen - virtual}
        cfg = replace(config, seed=config.seed + 1000 * (len(frozen) + 1) + j)
        train_model(
            net,
            train.x[parts[j]],
            train.y[parts[j]],
            train.n_classes,
            cfg,
            frozen=frozen,
            verbose=False,
            name=f"client {j}",
        )
        bar.update()
        return matched_form(numpy_state(net), spec, added)

    def client_update(jobs: list, frozen: set) -> list:
        return [retrain(j, state, frozen) for j, state in jobs]

    done: list[FedMAResult] = []
    broadcast = 0
    try:
        for p in range(int(passes)):
            if p > 0:
                states, sent = _restart_clients(done[-1], spec, models, train, parts, config, p, added)
                broadcast += sent
            server = fedma(states, spec, client_update, class_counts=counts, seed=seed + p, **settings)
            # one tensor under two names (spec.tied), fused as two entries: the alias takes its entry's value
            done.append(replace(server, state_dict=spec.retie(to_network(server.state_dict))))
    finally:
        bar.close()
    result = done[-1]
    spec.check_fixed_kept("fedma", widths, result.sizes)  # matched at the width the forward fixes (match_group)
    model = rebuild(models[0], {k: torch.as_tensor(v) for k, v in result.state_dict.items()}, spec).eval()
    return FedMARun(model=model, result=result, spec=spec, passes=done, _broadcast_bytes=broadcast)


def _restart_clients(
    result: FedMAResult,
    spec: PermutationSpec,
    models,
    train: Dataset,
    parts,
    config: TrainConfig,
    p: int,
    added: Sequence[Added] = (),
) -> tuple[list[dict], int]:
    """Each client's network of its original widths cut out of the global one, trained anew
    (``added``: the zero biases of layers without one, :mod:`bayesfuse.inference.bias_free`)."""
    if result.dropped:
        raise RuntimeError(f"clients {result.dropped} dropped out; FedMA with communication needs every client")
    sent = 0
    states = []
    keys = list(spec.split(models[0].state_dict()))
    # global unit a_j[l] becomes local unit l (position encodings, if any, follow the units: eqs. F, U)
    cut = restart_states(result, spec, len(models), matched_form(result.state_dict, spec, added))
    for (j, local), model in zip(cut, models):
        net = rebuild(model, tensor_state(network_form(local, spec, added, keys)), spec)
        sent += state_bytes(net.state_dict())
        train_model(
            net,
            train.x[parts[j]],
            train.y[parts[j]],
            train.n_classes,
            replace(config, seed=config.seed + 100_000 * p + j),
            verbose=False,
            name=f"client {j}",
        )
        states.append(matched_form(numpy_state(net), spec, added))
    return states, sent


@dataclass
class FedAvgRun:
    """FedAvg over several rounds: the global network and per-round bookkeeping."""

    model: nn.Module
    rounds: int
    bytes_up: int
    bytes_down: int
    seconds: float


def run_fedavg(
    init: nn.Module,
    train: Dataset,
    partition,
    config: TrainConfig | None = None,
    *,
    rounds: int = 1,
    verbose: bool | None = None,
) -> FedAvgRun:
    """FedAvg (McMahan et al. 2017): each round, every client trains ``config.epochs`` epochs from
    the global network and the server averages the results weighted by data size."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    config = config or TrainConfig()
    parts = _client_data(train, partition)
    sizes = np.array([len(p) for p in parts], dtype=np.float64)
    start = time.perf_counter()
    global_state = {k: v.clone() for k, v in init.state_dict().items()}
    up = down = 0
    bar = tqdm(total=rounds * len(parts), desc="FedAvg", unit="client", disable=not _progress(verbose))
    for r in range(rounds):
        states = []
        for j, idx in enumerate(parts):
            net = rebuild(init, global_state)
            cfg = replace(config, seed=config.seed + 1000 * r + j)
            train_model(net, train.x[idx], train.y[idx], train.n_classes, cfg, verbose=False, name=f"client {j}")
            states.append(net.state_dict())
            bar.update()
        down += len(parts) * state_bytes(global_state)
        up += sum(state_bytes(s) for s in states)
        global_state = fedavg_state_dicts(states, sizes)
    bar.close()
    model = rebuild(init, global_state).eval()
    return FedAvgRun(model=model, rounds=rounds, bytes_up=up, bytes_down=down, seconds=time.perf_counter() - start)
