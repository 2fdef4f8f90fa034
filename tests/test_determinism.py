"""Every fusion method: the same inputs and seed give bit-identical fused networks."""

from dataclasses import replace

import pytest
import torch

from bayesfuse import fuse
from bayesfuse.data import dirichlet_partition, load_digits
from bayesfuse.models.bnn import BNNConfig, train_bnn
from bayesfuse.train import TrainConfig, train_clients


@pytest.fixture(scope="module")
def setup():
    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, 3, 0.5, seed=2)
    cfg = TrainConfig(arch="cnn", channels=(4, 5), hidden=(12,), epochs=2)
    models = train_clients(split.train, part, cfg, shared_init=True, verbose=False)
    bnns = [
        train_bnn(split.train.x[i], split.train.y[i], 10, 6, BNNConfig(epochs=2, seed=j), verbose=False)
        for j, i in enumerate(part)
    ]
    return split, part, cfg, models, bnns


CASES = {
    "pfnm": lambda s: fuse(s[3], "pfnm", class_counts=s[1].counts, seed=3),
    "nafi": lambda s: fuse(s[3], "nafi", class_counts=s[1].counts, seed=3),
    "pfnm top-down": lambda s: fuse(s[3], "pfnm", direction="top-down", seed=3),
    "fedavg": lambda s: fuse(s[3], "fedavg", class_counts=s[1].counts),
    "fedma": lambda s: fuse(s[3], "fedma", data=(s[0].train, s[1]), retrain=replace(s[2], epochs=1), seed=3),
    "fedma nafi": lambda s: fuse(
        s[3], "fedma", data=(s[0].train, s[1]), retrain=replace(s[2], epochs=1), kl_weight=0.01, seed=3
    ),
    "kl (BNN)": lambda s: fuse(s[4], "kl"),
    "pfnm (BNN)": lambda s: fuse(s[4], "pfnm", seed=3),
}


@pytest.mark.parametrize("method", sorted(CASES))
def test_same_inputs_and_seed_give_identical_bits(setup, method):
    a, b = CASES[method](setup).model.state_dict(), CASES[method](setup).model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (method, k)
