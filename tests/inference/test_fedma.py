"""FedMA's protocol: rounds of matching and client retraining, clients that fail."""

import numpy as np
import pytest

from bayesfuse.inference.fedma import fedma, restart_states
from bayesfuse.inference.layerwise import scale_outputs
from bayesfuse.inference.spec import Axis, PermutationSpec
from bayesfuse.models.bbp import simulate_deep_federation
from bayesfuse.nets.mlp import MLP


def test_fedma_drops_clients_that_fail_and_reports_them():
    fed = simulate_deep_federation(4, 12, 2, 3, gamma0=4.0, noise_var=0.01, seed=1)
    spec = MLP(1, [1, 1], 1).permutation_spec()
    calls = []

    def update(jobs, frozen):  # "retraining" that changes nothing; client 2 fails in round 1
        calls.append([j for j, _ in jobs])
        return [None if (j == 2 and len(calls) == 1) else state for j, state in jobs]

    res = fedma(fed.states, spec, update, class_counts=np.ones((4, 3)))
    assert calls == [[0, 1, 2, 3], [0, 1, 3]]
    assert res.dropped == [2] and res.history[0]["dropped"] == [2]
    assert res.state_dict["layers.2.weight"].shape == (3, res.sizes["P2"])
    with pytest.raises(RuntimeError, match="every client failed"):
        fedma(fed.states, spec, lambda jobs, frozen: [None] * len(jobs))


def test_restart_states_cut_each_clients_units_out_of_the_global_network():
    """FedMA with communication: client j's global units, by its assignments in each group's
    matching (indexed among the clients alive at that matching), at its original widths; the
    clients a pass dropped get none."""
    fed = simulate_deep_federation(4, 12, 2, 3, gamma0=4.0, noise_var=0.01, seed=1)
    spec = MLP(1, [1, 1], 1).permutation_spec()
    calls = []

    def update(jobs, frozen):  # client 1 fails after the first group: P2 matches clients 0, 2, 3
        calls.append(len(calls))
        return [None if (j == 1 and len(calls) == 1) else state for j, state in jobs]

    res = fedma(fed.states, spec, update, class_counts=np.ones((4, 3)))
    cut = restart_states(res, spec, 4)
    assert [j for j, _ in cut] == [0, 2, 3]
    g = res.state_dict
    for (j, state), at_p2 in zip(cut, (0, 1, 2)):  # client j's index among P2's clients
        a1, a2 = res.layers["P1"].assignments[j], res.layers["P2"].assignments[at_p2]
        assert {k: v.shape for k, v in state.items()} == {k: np.shape(v) for k, v in fed.states[j].items()}
        np.testing.assert_array_equal(state["layers.0.weight"], g["layers.0.weight"][a1])
        np.testing.assert_array_equal(state["layers.1.weight"], g["layers.1.weight"][a2][:, a1])
        np.testing.assert_array_equal(state["layers.2.weight"], g["layers.2.weight"][:, a2])
        np.testing.assert_array_equal(state["layers.2.bias"], g["layers.2.bias"])


def _retrained_outputs(n_classes, seed):
    """A client_update whose "retraining" writes known output layers (from the global widths it
    is sent) and keeps everything else; it records what each client returned."""
    written = {}

    def update(jobs, frozen):
        out = []
        for j, state in jobs:
            rng = np.random.default_rng(seed + j)
            state = dict(state)
            G = state["layers.1.weight"].shape[1]
            state["layers.1.weight"] = rng.normal(size=(n_classes, G))
            state["layers.1.bias"] = rng.normal(size=n_classes)
            written[j] = (state["layers.1.weight"], state["layers.1.bias"])
            out.append(state)
        return out

    return update, written


@pytest.mark.catalogue
def test_fedma_output_layer_is_the_class_proportion_weighted_average():
    # FedMA Algorithm 1: the last layer is W_N = sum_j p_jk W_{j,N}, row k (class k) weighted by
    # client j's share of class k, p_jk = n_jk / sum_j n_jk, the clients' layers being the
    # retrained ones in the global basis. One hidden group: one round of retraining, then this.
    # Sums of three products: a few ulps apart from the formula's order, hence rtol 1e-12.
    fed = simulate_deep_federation(3, 5, 1, 3, gamma0=3.0, noise_var=0.01, seed=2)
    spec = MLP(1, [1], 1).permutation_spec()
    counts = np.array([[10.0, 0.0, 3.0], [0.0, 5.0, 3.0], [2.0, 5.0, 0.0]])
    update, written = _retrained_outputs(3, seed=10)
    res = fedma(fed.states, spec, update, class_counts=counts)
    shares = counts / counts.sum(0)  # columns: classes
    W = np.stack([written[j][0] for j in range(3)])  # (J, K, G)
    b = np.stack([written[j][1] for j in range(3)])  # (J, K)
    expected_w = np.einsum("jk,jkg->kg", shares, W)
    np.testing.assert_allclose(res.state_dict["layers.1.weight"], expected_w, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(res.state_dict["layers.1.bias"], (shares * b).sum(0), rtol=1e-12, atol=1e-15)
    # class 0: clients 0 and 2 only, 10:2 (client 1 has none of it and does not count)
    np.testing.assert_allclose(
        res.state_dict["layers.1.weight"][0], (10 * W[0, 0] + 2 * W[2, 0]) / 12, rtol=1e-12, atol=1e-15
    )
    # without class counts, the plain average of the retrained clients
    update, written = _retrained_outputs(3, seed=10)
    plain = fedma(fed.states, spec, update)
    np.testing.assert_allclose(plain.state_dict["layers.1.weight"], W.mean(0), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(plain.state_dict["layers.1.bias"], b.mean(0), rtol=1e-12, atol=1e-15)


@pytest.mark.catalogue
def test_fedma_output_shares_are_renormalised_over_the_clients_left():
    # client 2 fails to retrain: p_jk = n_jk / (n_0k + n_1k) over clients 0 and 1 only
    fed = simulate_deep_federation(3, 5, 1, 3, gamma0=3.0, noise_var=0.01, seed=2)
    spec = MLP(1, [1], 1).permutation_spec()
    counts = np.array([[1.0, 3.0, 2.0], [3.0, 1.0, 2.0], [50.0, 50.0, 50.0]])
    update, written = _retrained_outputs(3, seed=20)
    res = fedma(fed.states, spec, lambda jobs, frozen: update(jobs, frozen)[:2] + [None], class_counts=counts)
    assert res.dropped == [2]
    shares = counts[:2] / counts[:2].sum(0)
    W = np.stack([written[j][0] for j in range(2)])
    np.testing.assert_allclose(res.state_dict["layers.1.weight"], np.einsum("jk,jkg->kg", shares, W), rtol=1e-12)
    np.testing.assert_allclose(res.state_dict["layers.1.weight"][2], W[:, 2].mean(0), rtol=1e-12)


@pytest.mark.catalogue
def test_scale_outputs_multiplies_each_global_units_columns_by_its_share():
    # One-shot matching's output weighting (match_layerwise, average_outputs): the outgoing
    # weights of global unit g times m_g / J. With inner = 2 (two flattened positions per unit,
    # as after a convolution) unit g owns columns 2g and 2g + 1.
    spec = PermutationSpec(
        {"out.weight": (None, Axis("P", inner=2)), "out.bias": (None,)}, ("P",), output=("out.weight", "out.bias")
    )
    rng = np.random.default_rng(0)
    w, bias = rng.normal(size=(3, 8)), rng.normal(size=3)
    m, J = np.array([1, 4, 2, 3]), 4
    values = {"out.weight": w.copy(), "out.bias": bias.copy()}
    scale_outputs(values, spec, {"P": (m, J)})
    np.testing.assert_allclose(values["out.weight"], w * np.repeat(m / J, 2)[None, :], rtol=1e-15)
    np.testing.assert_array_equal(values["out.bias"], bias)
