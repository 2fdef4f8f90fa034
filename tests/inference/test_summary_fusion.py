"""Laplace fusion of matched networks: by hand on a tiny case, invariances, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from bayesfuse.inference.spec import chain, dense
from bayesfuse.inference.summary_fusion import (
    best_candidate,
    fold_temperature,
    laplace_fuse_entries,
    laplace_precisions,
    output_shares,
)
from bayesfuse.inference.walk import Basis

SPEC = chain(dense("l0", None, "P1"), dense("l1", "P1", None), output=("l1.weight", "l1.bias"))


def net(rng, hidden=3, d=4, k=2):
    return {
        "l0.weight": rng.normal(size=(hidden, d)),
        "l0.bias": rng.normal(size=hidden),
        "l1.weight": rng.normal(size=(k, hidden)),
        "l1.bias": rng.normal(size=k),
    }


def precision(rng, state):
    return {k: rng.uniform(0.1, 5.0, size=v.shape) for k, v in state.items()}


def test_by_hand_two_clients_one_shared_unit():
    rng = np.random.default_rng(0)
    a, b = net(rng, hidden=2), net(rng, hidden=1)
    pa, pb = precision(rng, a), precision(rng, b)
    # client a's units -> global 0 and 1, client b's only unit -> global 1
    bases = {"P1": Basis([np.array([0, 1]), np.array([1])], 2)}
    shares = np.array([[0.25, 0.5], [0.75, 0.5]])
    values, prec = laplace_fuse_entries([a, b], [pa, pb], [1.0, 2.0], SPEC, bases, shares)
    wa, wb = pa["l0.weight"] + 1.0, pb["l0.weight"] + 2.0
    np.testing.assert_allclose(values["l0.weight"][0], a["l0.weight"][0])  # only a has global unit 0
    np.testing.assert_allclose(
        values["l0.weight"][1], (wa[1] * a["l0.weight"][1] + wb[0] * b["l0.weight"][0]) / (wa[1] + wb[0])
    )
    np.testing.assert_allclose(prec["l0.weight"][1], wa[1] + wb[0])
    # the output layer pools the logits: W[k, g] = sum over members of s_jk W_j[k, l]
    want = np.stack(
        [shares[0] * a["l1.weight"][:, 0], shares[0] * a["l1.weight"][:, 1] + shares[1] * b["l1.weight"][:, 0]], axis=1
    )
    np.testing.assert_allclose(values["l1.weight"], want)
    np.testing.assert_allclose(values["l1.bias"], shares[0] * a["l1.bias"] + shares[1] * b["l1.bias"])


def test_absent_lower_unit_is_a_zero_with_the_prior_precision():
    rng = np.random.default_rng(1)
    spec = chain(
        dense("l0", None, "P1"), dense("l1", "P1", "P2"), dense("l2", "P2", None), output=("l2.weight", "l2.bias")
    )
    a = {
        "l0.weight": rng.normal(size=(2, 3)),
        "l0.bias": rng.normal(size=2),
        "l1.weight": rng.normal(size=(1, 2)),
        "l1.bias": rng.normal(size=1),
        "l2.weight": rng.normal(size=(2, 1)),
        "l2.bias": rng.normal(size=2),
    }
    b = {k: rng.normal(size=np.shape(v)) for k, v in a.items()}
    b["l0.weight"], b["l0.bias"], b["l1.weight"] = rng.normal(size=(1, 3)), rng.normal(size=1), rng.normal(size=(1, 1))
    pa, pb = precision(rng, a), precision(rng, b)
    bases = {"P1": Basis([np.array([0, 1]), np.array([1])], 2), "P2": Basis([np.array([0]), np.array([0])], 1)}
    values, _ = laplace_fuse_entries([a, b], [pa, pb], [1.0, 3.0], spec, bases, np.full((2, 2), 0.5))
    # global unit of P2 from P1's unit 0: only a has it; b's weight there is 0 with precision 3
    wa = pa["l1.weight"][0, 0] + 1.0
    np.testing.assert_allclose(values["l1.weight"][0, 0], wa * a["l1.weight"][0, 0] / (wa + 3.0))


@pytest.mark.parametrize("n_clients", [1, 3])
def test_identical_clients_fuse_to_the_client(n_clients):
    rng = np.random.default_rng(2)
    a = net(rng)
    p = precision(rng, a)
    bases = {"P1": Basis([np.arange(3)] * n_clients, 3)}
    shares = output_shares(np.ones((n_clients, 2)))
    values, _ = laplace_fuse_entries([a] * n_clients, [p] * n_clients, [1.0] * n_clients, SPEC, bases, shares)
    for k in a:
        np.testing.assert_allclose(values[k], a[k], rtol=1e-12, err_msg=k)


def test_permuted_copy_fuses_back_and_order_does_not_matter():
    rng = np.random.default_rng(3)
    a = net(rng)
    perm = np.array([2, 0, 1])
    b = {
        "l0.weight": a["l0.weight"][perm],
        "l0.bias": a["l0.bias"][perm],
        "l1.weight": a["l1.weight"][:, perm],
        "l1.bias": a["l1.bias"],
    }
    p = precision(rng, a)
    q = {
        "l0.weight": p["l0.weight"][perm],
        "l0.bias": p["l0.bias"][perm],
        "l1.weight": p["l1.weight"][:, perm],
        "l1.bias": p["l1.bias"],
    }
    shares = output_shares(np.array([[1.0, 2.0], [3.0, 1.0]]))
    bases = {"P1": Basis([np.arange(3), perm], 3)}
    values, _ = laplace_fuse_entries([a, b], [p, q], [1.0, 1.0], SPEC, bases, shares)
    for k in a:
        np.testing.assert_allclose(values[k], a[k], rtol=1e-12, err_msg=k)
    swapped, _ = laplace_fuse_entries(
        [b, a], [q, p], [1.0, 1.0], SPEC, {"P1": Basis([perm, np.arange(3)], 3)}, shares[::-1]
    )
    for k in a:
        np.testing.assert_allclose(swapped[k], values[k], rtol=1e-12, err_msg=k)


def test_output_shares():
    s = output_shares(np.array([[1.0, 0.0], [3.0, 0.0]]))
    np.testing.assert_allclose(s, [[0.25, 0.5], [0.75, 0.5]])  # an uninformed class is shared equally
    with pytest.raises(ValueError, match="non-negative"):
        output_shares(np.array([[-1.0, 1.0]]))


def test_temperature():
    # summed over clients: 4, 3, 2.5 -> the third; over a (candidate, temperature) grid likewise
    assert best_candidate(np.array([[3.0, 1.0, 2.0], [1.0, 2.0, 0.5]])) == (2,)
    assert best_candidate(np.array([[[3.0, 1.0], [2.0, 0.2]], [[1.0, 2.0], [0.5, 3.0]]])) == (1, 0)
    with pytest.raises(ValueError, match="finite"):
        best_candidate(np.array([[1.0, np.nan, 2.0]]))
    state = {
        "l0.weight": np.ones((3, 4)),
        "l0.bias": np.ones(3),
        "l1.weight": np.full((2, 3), 4.0),
        "l1.bias": np.full(2, 2.0),
    }
    folded = fold_temperature(state, SPEC, 2.0)  # logits f / T: only the output layer changes
    np.testing.assert_array_equal(folded["l1.weight"], np.full((2, 3), 2.0))
    np.testing.assert_array_equal(folded["l1.bias"], np.ones(2))
    np.testing.assert_array_equal(folded["l0.weight"], state["l0.weight"])
    with pytest.raises(ValueError, match="positive"):
        fold_temperature(state, SPEC, 0.0)


def test_batch_norm_folding_of_precisions():
    from bayesfuse.inference.spec import batchnorm

    rng = np.random.default_rng(4)
    spec = chain(
        dense("l0", None, "P1"),
        batchnorm("bn", "P1", after="l0"),
        dense("l1", "P1", None),
        output=("l1.weight", "l1.bias"),
    )
    state = {
        "l0.weight": rng.normal(size=(3, 2)),
        "l0.bias": rng.normal(size=3),
        "bn.weight": rng.normal(size=3),
        "bn.bias": rng.normal(size=3),
        "bn.running_mean": rng.normal(size=3),
        "bn.running_var": rng.uniform(0.5, 2, size=3),
        "l1.weight": rng.normal(size=(2, 3)),
        "l1.bias": rng.normal(size=2),
    }
    ggn = {
        k: rng.uniform(0, 3, size=np.shape(state[k]))
        for k in ("l0.weight", "l0.bias", "bn.weight", "bn.bias", "l1.weight", "l1.bias")
    }
    pi = laplace_precisions(state, ggn, 0.5, spec)
    c = state["bn.weight"] / np.sqrt(state["bn.running_var"] + 1e-5)
    # var(c W) = c^2 var(W); var(c (b - mu) + beta) = c^2 var(b) + var(beta)
    np.testing.assert_allclose(pi["l0.weight"], (ggn["l0.weight"] + 0.5) / c[:, None] ** 2)
    np.testing.assert_allclose(1 / pi["l0.bias"], c**2 / (ggn["l0.bias"] + 0.5) + 1 / (ggn["bn.bias"] + 0.5))
    np.testing.assert_allclose(pi["l1.weight"], ggn["l1.weight"] + 0.5)
    assert "bn.weight" not in pi and "bn.bias" not in pi


def test_layers_reading_matched_channel_maps_keep_the_matching():
    """Convolutions on matched channels and the dense layer reading them flattened are left to the
    matching; the first convolution (inputs shared by all clients), later dense layers and the
    output are fused by precision."""
    from bayesfuse.inference.spec import Axis, conv
    from bayesfuse.inference.summary_fusion import matched_filters

    spec = chain(
        conv("c1", None, "P1"),
        conv("c2", "P1", "P2"),
        dense("d1", Axis("P2", inner=16), "P3"),
        dense("d2", "P3", "P4"),
        dense("out", "P4", None),
        output=("out.weight", "out.bias"),
    )
    assert matched_filters(spec) == {"c2.weight", "c2.bias", "d1.weight", "d1.bias"}
    # a convolution reading streams side by side (a DenseNet block's, a U-Net's skip) reads matched
    # channels piece by piece: every piece (the input's beside them too: a filter is one pattern),
    # and its bias, is left to the matching too (they were fused by precision, coordinate by coordinate)
    from bayesfuse.nets.tracing import spec_from_module
    from tests.nets.user_nets import DenseBlockCNN, UpConvUNet

    dense_block = spec_from_module(DenseBlockCNN())
    assert {"layers.1.conv1.weight@0", "layers.1.conv1.weight@1"} <= matched_filters(dense_block)
    unet = spec_from_module(UpConvUNet())
    assert {"dec.weight@0", "dec.weight@1", "dec.bias", "up.weight", "mid.weight"} <= matched_filters(unet)
    assert "enc.weight" not in matched_filters(unet)  # the first convolution reads the inputs
    rng = np.random.default_rng(0)
    shapes = {
        "c1.weight": (2, 1, 3, 3),
        "c1.bias": (2,),
        "c2.weight": (3, 2, 3, 3),
        "c2.bias": (3,),
        "d1.weight": (4, 48),
        "d1.bias": (4,),
        "d2.weight": (5, 4),
        "d2.bias": (5,),
        "out.weight": (2, 5),
        "out.bias": (2,),
    }
    states = [{k: rng.normal(size=v) for k, v in shapes.items()} for _ in range(2)]
    ggn = [{k: rng.uniform(0.5, 2, size=v) for k, v in shapes.items()} for _ in range(2)]
    bases = {g: Basis([np.arange(n), np.arange(n)], n) for g, n in (("P1", 2), ("P2", 3), ("P3", 4), ("P4", 5))}
    values, _ = laplace_fuse_entries(states, ggn, [1.0, 1.0], spec, bases, np.full((2, 2), 0.5))
    assert set(values) == set(shapes) - matched_filters(spec)
