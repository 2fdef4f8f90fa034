"""fuse() gives the same fused model whatever the order of its inputs, its per-client outputs in the caller's order."""

import itertools

import numpy as np
import pytest
import torch

from bayesfuse import TrainConfig, fuse, train_clients
from bayesfuse.client_order import canonical_order
from bayesfuse.data import dirichlet_partition
from bayesfuse.models.bnn import BNNConfig, train_bnn

PERMUTATIONS = list(itertools.permutations(range(3)))


@pytest.fixture(scope="module")
def clients(digits):
    """Three small digits MLPs (independent initialisations) and their partition."""
    part = dirichlet_partition(digits.train.y, 3, 0.5, seed=0)
    models = train_clients(digits.train, part, TrainConfig(hidden=(12,), epochs=2), shared_init=False)
    return models, part


@pytest.fixture(scope="module")
def bnns(digits):
    part = dirichlet_partition(digits.train.y, 3, 0.5, seed=1)
    models = [
        train_bnn(digits.train.x[i], digits.train.y[i], 10, hidden=12, config=BNNConfig(epochs=3, seed=j))
        for j, i in enumerate(part)
    ]
    return models, part


def _state(result) -> dict:
    return {k: v.detach().double() for k, v in result.model.state_dict().items()}


def _check_invariant(base, fused, perm, n_layers):
    """``fused`` (the clients listed as ``perm``) against ``base`` (listed 0, 1, 2): the same state,
    and the caller's client j in ``fused`` is client ``perm[j]`` of ``base``."""
    a, b = _state(base), _state(fused)
    assert a.keys() == b.keys()
    for k in a:
        # the same clients fused in the same canonical order: the same arithmetic, bit for bit
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    assert fused.sizes == base.sizes and len(fused.layers) == len(base.layers) == n_layers
    for lb, lf in zip(base.layers, fused.layers):
        for j, i in enumerate(perm):
            np.testing.assert_array_equal(lf.assignments[j], lb.assignments[i])
    assert [perm[j] for j in fused.hyper["fused_order"]] == base.hyper["fused_order"]


@pytest.mark.parametrize("method", ["pfnm", "nafi", "fedavg", "ot"])
def test_networks_fuse_alike_in_any_order(clients, method):
    models, part = clients
    base = fuse(models, method, class_counts=part.counts)
    for perm in PERMUTATIONS[1:]:
        fused = fuse([models[i] for i in perm], method, class_counts=part.counts[list(perm)])
        _check_invariant(base, fused, perm, len(base.layers))


@pytest.mark.parametrize("method", ["kl", "nafi", "pfnm"])
def test_bnns_fuse_alike_in_any_order(bnns, method):
    models, part = bnns
    base = fuse(models, method, class_counts=part.counts)
    for perm in PERMUTATIONS[1:]:
        fused = fuse([models[i] for i in perm], method, class_counts=part.counts[list(perm)])
        _check_invariant(base, fused, perm, 1)
        for j, i in enumerate(perm):  # the units kept by pruning, per client, in the caller's order
            assert fused.hyper["kept_units"][j] == base.hyper["kept_units"][i]


def test_client_heads_are_the_same_model_in_any_order(bnns, digits):
    models, part = bnns
    base = fuse(models, "kl", class_counts=part.counts, head="clients")
    perm = (2, 0, 1)
    fused = fuse([models[i] for i in perm], "kl", class_counts=part.counts[list(perm)], head="clients")
    _check_invariant(base, fused, perm, 1)  # heads included: head i is client fused_order[i]'s
    x = digits.test.x[:50]
    np.testing.assert_array_equal(fused.model.predict(x, 20), base.model.predict(x, 20))
    # head i is the one of the caller's client fused_order[i]: its output bias is that client's
    for i, j in enumerate(fused.hyper["fused_order"]):
        client = [models[k] for k in perm][j]
        np.testing.assert_array_equal(fused.model.heads.loc_b[i].numpy(), client.loc["b2"].detach().numpy())


def test_an_anchor_index_is_the_callers(clients):
    models, part = clients
    first = fuse(models, "ot", anchor=2)
    reversed_ = fuse(models[::-1], "ot", anchor=0)
    assert first.hyper["anchor"] == 2 and reversed_.hyper["anchor"] == 0
    _check_invariant(first, reversed_, (2, 1, 0), len(first.layers))


def test_summaries_follow_their_clients(clients, digits):
    from bayesfuse import summarize

    models, part = clients
    summaries = [summarize(m, digits.train.x[i], digits.train.y[i]) for m, i in zip(models, part)]
    base = fuse(models, "pfnm", summaries=summaries)
    perm = (1, 2, 0)
    fused = fuse([models[i] for i in perm], "pfnm", summaries=[summaries[i] for i in perm])
    _check_invariant(base, fused, perm, len(base.layers))
    assert fused.hyper["summaries"]["examples"] == [len(part[i]) for i in perm]


def test_a_list_of_modules_and_their_files_fuse_alike(clients, tmp_path):
    from bayesfuse.fuse_files import fuse_files

    models, _ = clients
    paths = []
    for j in (2, 0, 1):  # files given in another order than the list
        paths.append(tmp_path / f"client{j}.pt")
        torch.save(models[j].state_dict(), paths[-1])
    report = fuse_files(paths, "nafi", tmp_path / "fused.pt")
    fused = fuse(models, "nafi")
    on_disk = torch.load(tmp_path / "fused.pt")
    for k, v in fused.model.state_dict().items():
        torch.testing.assert_close(on_disk[k].double(), v.double(), rtol=0, atol=0, msg=k)
    assert report["fused_order"] == [str(tmp_path / f"client{j}.pt") for j in fused.hyper["fused_order"]]


def test_canonical_order_is_by_content():
    torch.manual_seed(0)
    a, b, c = (torch.nn.Linear(3, 2) for _ in range(3))
    order = canonical_order([a, b, c])
    assert sorted(order) == [0, 1, 2]
    assert [[b, c, a][j] for j in canonical_order([b, c, a])] == [[a, b, c][j] for j in order]
    with pytest.warns(UserWarning, match=r"client 1 holds the same tensors as client 0 \(the same client twice\?\)"):
        assert canonical_order([a, a]) == [0, 1]  # identical networks keep the caller's order
