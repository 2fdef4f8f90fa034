"""Fused HMM states on sequences simulated from the Pyro Gaussian HMM (KL-fusion paper, section 5.2)."""

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from bayesfuse.inference.klfusion import kl_fuse
from bayesfuse.models.hmm import relabel, segmentation_scores, simulate_hmm_federation

pytest.importorskip("hmmlearn", reason="fit_local_hmm needs hmmlearn (pip install 'bayesfuse[apps]')")

from bayesfuse.models.hmm import fit_local_hmm  # noqa: E402

LENGTH = 200


@pytest.fixture(scope="module")
def federation():
    """3 clients, each visiting 3 of 4 well separated 2-D states for 200 steps (stay 0.95)."""
    fed = simulate_hmm_federation(3, 4, 2, states_per_client=3, length=LENGTH, separation=4.0, seed=1)
    local = [fit_local_hmm(x, 3, n_iter=50, seed=0) for x in fed.sequences]
    return fed, local


# A state's mean is estimated from its ~LENGTH / 3 = 67 steps of one client (about 130 when two
# clients share it); with axis scales <= 0.5 the standard error per coordinate is <= 0.5 / sqrt(67)
# = 0.06, so 0.3 (5 standard errors) bounds the distance to the truth; distinct means lie ~4 apart.
MEAN_TOL = 0.3


def test_simulation_is_seeded(federation):
    fed, _ = federation
    assert all(x.shape == (LENGTH, 2) for x in fed.sequences)
    assert all(set(np.unique(z)) <= set(s) for z, s in zip(fed.states, fed.client_states))
    again = simulate_hmm_federation(3, 4, 2, states_per_client=3, length=LENGTH, separation=4.0, seed=1)
    np.testing.assert_array_equal(again.sequences[2], fed.sequences[2])


def test_kl_fusion_recovers_states_and_segmentation(federation):
    fed, local = federation
    present = np.unique(np.concatenate(fed.client_states))
    res = kl_fuse([m.states for m in local], reg=0.3)
    assert res.n_global == len(present)
    d = np.linalg.norm(res.components.mean[:, None] - fed.means[None, present], axis=-1)
    rows, cols = linear_sum_assignment(d)
    assert d[rows, cols].max() < MEAN_TOL
    scores = segmentation_scores(fed.states, relabel([m.labels for m in local], res.assignments))
    # well separated states: only the steps at a switch can be mislabelled (a few per client)
    assert scores["rand"] > 0.95 and scores["ami"] > 0.9


def test_one_client_fuses_to_itself(federation):
    _, local = federation
    res = kl_fuse([local[0].states], reg=0.3)
    np.testing.assert_allclose(res.components.mean[res.assignments[0]], local[0].states.mean, rtol=1e-8)


def test_permuting_a_client_changes_nothing(federation):
    _, local = federation
    posts = [m.states for m in local]
    ref = kl_fuse(posts, reg=0.3)
    perm = np.array([2, 0, 1])
    res = kl_fuse([posts[0], posts[1][perm], posts[2]], reg=0.3)

    def canon(r):
        return r.components.mean[np.lexsort(r.components.mean.T)]

    np.testing.assert_allclose(canon(res), canon(ref), rtol=1e-8)
    # relabelling the permuted client's path gives the same global labels
    before = relabel([local[1].labels], [ref.assignments[1]])[0]
    inverse = np.argsort(perm)
    after = relabel([inverse[local[1].labels]], [res.assignments[1]])[0]
    assert segmentation_scores([before], [after])["rand"] == pytest.approx(1.0)


def test_segmentation_scores_by_hand():
    s = segmentation_scores([np.array([0, 0, 1, 1])], [np.array([5, 5, 7, 7])])
    assert s == {"rand": 1.0, "ami": 1.0}
    # of the 6 pairs, (0,1) is together in both and (0,3), (1,3) apart in both; (0,2), (1,2), (2,3)
    # disagree: Rand index 3/6
    assert segmentation_scores([np.array([0, 0, 1, 1])], [np.array([0, 0, 0, 1])])["rand"] == pytest.approx(0.5)


def test_fits_that_all_end_with_a_nan_bound_are_refused_in_one_line(monkeypatch):
    import hmmlearn.vhmm

    def fit(self, x):
        self.monitor_ = type("Monitor", (), {"history": [float("nan")]})()
        return self

    monkeypatch.setattr(hmmlearn.vhmm.VariationalGaussianHMM, "fit", fit)
    x = np.random.default_rng(0).normal(size=(40, 2))
    with pytest.raises(FloatingPointError, match="none of the 2 HMM fits has a finite lower bound"):
        fit_local_hmm(x, 3, n_init=2)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"min_share": 2.0}, r"min_share must be non-negative, at most 0.333333 \(1 / n_states"),
        ({"min_share": 0.5}, "min_share must be non-negative, at most 0.333333"),
        ({"min_share": -0.1}, "min_share must be non-negative"),
        ({"n_states": 0}, "n_states must be a positive integer, got 0"),
        ({"stickiness": -5.0}, "stickiness must be non-negative, got -5.0"),
        ({"n_iter": 0}, "n_iter must be a positive integer, got 0"),
    ],
)
def test_fit_local_hmm_refuses_bad_settings_in_one_line(options, match):
    x = np.random.default_rng(0).normal(size=(40, 2))
    options = {"n_states": 3, **options}
    with pytest.raises(ValueError, match=match):
        fit_local_hmm(x, **options)


def test_fit_local_hmm_names_nan_in_x():
    x = np.random.default_rng(0).normal(size=(40, 2))
    x[3, 0] = np.nan
    with pytest.raises(ValueError, match="x contains NaN or infinite values"):
        fit_local_hmm(x, 3)
    with pytest.raises(ValueError, match=r"x must be \(T, D\)"):
        fit_local_hmm(np.zeros((40, 0)), 3)


def test_relabel_and_scores_refuse_mismatched_inputs():
    with pytest.raises(
        ValueError, match=r"labels\[0\] must lie in 0..1 \(the local states assignments\[0\] maps\), got range 0..2"
    ):
        relabel([np.array([0, 1, 2])], [np.array([0, 1])])
    with pytest.raises(ValueError, match=r"labels\[0\] must lie in 0..1 .*got range -1..1"):
        relabel([np.array([-1, 1])], [np.array([0, 1])])
    with pytest.raises(TypeError, match=r"labels\[0\] must be integers"):
        relabel([np.array([0.0, 1.0])], [np.array([0, 1])])
    with pytest.raises(ValueError, match="2 label sequences but 1 assignments"):
        relabel([np.array([0]), np.array([0])], [np.array([0])])
    with pytest.raises(ValueError, match=r"truth\[0\] has shape \(3,\) but labels\[0\] has \(2,\)"):
        segmentation_scores([np.array([0, 0, 1])], [np.array([0, 1])])
    with pytest.raises(ValueError, match="1 true sequences but 2 label sequences"):
        segmentation_scores([np.array([0, 1])], [np.array([0, 1]), np.array([1])])
