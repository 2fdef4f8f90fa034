"""The layer-wise loop every layer-wise fusion shares (bayesfuse.inference.walk), and the BNNs' spec."""

import numpy as np
import pytest

from bayesfuse.inference.bnn.sites import bnn_spec, state_keys
from bayesfuse.inference.spec import chain, dense, lstm, permute
from bayesfuse.inference.walk import Basis, GroupWalk
from bayesfuse.models.bnn_posterior import DeepBNNPosterior
from tests.helpers import varied_bnn
from tests.models.test_bnn_fusion import _permuted

SPEC = chain(dense("a", None, "P1"), dense("b", "P1", "P2"), dense("c", "P2", "P3"), dense("d", "P3", None))


@pytest.mark.parametrize(
    ("direction", "order", "reads"),
    [
        ("bottom-up", ("P1", "P2", "P3"), [[], ["P1"], ["P2"]]),
        ("top-down", ("P3", "P2", "P1"), [[], ["P3"], ["P2"]]),
    ],
)
def test_the_walk_visits_the_groups_in_order_and_each_reads_its_fused_neighbour(direction, order, reads):
    walk: GroupWalk[Basis] = GroupWalk(SPEC, direction)
    seen = []
    for i, group in walk:
        seen.append((i, group, walk.reads(group)))
        walk.record(group, Basis.identity(2, 3))
    assert seen == [(i, g, r) for i, (g, r) in enumerate(zip(order, reads))]
    assert set(walk.fused) == set(order)


def test_an_lstm_group_reads_its_input_group_not_itself():
    spec = chain(dense("emb", None, "E"), lstm("rnn", "E", "H"), dense("out", "H", None), groups=("E", "H"))
    walk: GroupWalk[Basis] = GroupWalk(spec)
    reads = {}
    for _, group in walk:
        reads[group] = walk.reads(group)
        walk.record(group, Basis.identity(1, 2))
    assert reads == {"E": [], "H": ["E"]}


def test_a_group_left_unrecorded_and_unknown_groups_are_refused():
    walk: GroupWalk[Basis] = GroupWalk(SPEC)
    with pytest.raises(RuntimeError, match="'P1' was visited but its basis was not recorded"):
        for _ in walk:
            pass
    walk = GroupWalk(SPEC)
    with pytest.raises(ValueError, match="'Q' is not a group"):
        walk.record("Q", Basis.identity(1, 1))
    with pytest.raises(ValueError, match=r"groups \['P2'\] have not been fused"):
        walk.rebase({"P2": Basis.identity(1, 1)})
    with pytest.raises(ValueError, match="direction"):
        GroupWalk(SPEC, "sideways")  # type: ignore[arg-type]


def test_rebase_replaces_a_fused_groups_basis():
    walk: GroupWalk[Basis] = GroupWalk(SPEC)
    walk.record("P1", Basis([np.array([2, 0]), np.array([1])], 3))
    walk.rebase({"P1": Basis.identity(2, 3)})
    assert [a.tolist() for a in walk.fused["P1"].assignments] == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("hidden", [(4,), (5, 3), (4, 3, 2)])
def test_the_bnn_spec_describes_a_horseshoe_bnn_state_dict_of_any_depth(hidden):
    state = varied_bnn(6, hidden, 3, seed=0, spread=1.0, scale_low=0.05, scale_span=0.3).state_dict()
    spec = bnn_spec(len(hidden))
    assert sorted(spec.axes) == sorted(state_keys(len(hidden))) == sorted(state)
    assert spec.sizes({k: v.numpy() for k, v in state.items()}) == {
        g: h for g, h in zip(spec.groups, hidden)
    }  # and the spec checks every shape
    with pytest.raises(ValueError, match="at least 1 hidden layer"):
        bnn_spec(0)
    assert len(bnn_spec(20).groups) == 20  # any depth a posterior can have, not only what files hold


def test_permuting_by_the_bnn_spec_is_the_hand_written_permutation_of_a_posterior():
    """An independent check of the spec: tests/models/test_bnn_fusion.py's ``_permuted`` moves each
    layer's rows, the layer above's columns and the outgoing rows by hand."""
    post = DeepBNNPosterior.from_state(
        varied_bnn(6, (5, 4), 3, seed=1, spread=1.0, scale_low=0.05, scale_span=0.3).state_dict()
    )
    rng = np.random.default_rng(0)
    perms = [rng.permutation(5), rng.permutation(4)]
    state = {k: np.asarray(v) for k, v in post.to_state().items()}
    moved = permute(state, bnn_spec(2), dict(zip(("units", "units2"), perms)))
    expected = _permuted(post, perms).to_state()
    assert sorted(moved) == sorted(expected)
    for k in expected:
        np.testing.assert_array_equal(np.asarray(moved[k]), np.asarray(expected[k]), err_msg=k)
