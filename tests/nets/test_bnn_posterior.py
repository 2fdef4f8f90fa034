import numpy as np
import pytest
import torch

from bayesfuse import fuse
from bayesfuse.data import load_digits
from bayesfuse.models.bnn import BNNConfig, HorseshoeBNN, train_bnn
from bayesfuse.nets import MLP
from bayesfuse.nets.bnn_posterior import BNNPosterior

# Single-model cases are part of these tests; the warning they raise is expected.
pytestmark = pytest.mark.filterwarnings("ignore:only one model")



@pytest.fixture(scope="module")
def data():
    return load_digits().standardize()


@pytest.fixture(scope="module")
def bnn(data):
    return train_bnn(data.train.x[:400], data.train.y[:400], 10, 12, BNNConfig(epochs=20, seed=3), verbose=False)


def _rows(a):
    return a[np.lexsort(a.T[::-1])]


def _shuffled(bnn: HorseshoeBNN, seed: int) -> HorseshoeBNN:
    post = BNNPosterior.from_bnn(bnn)
    perm = np.random.default_rng(seed).permutation(post.hidden)
    return BNNPosterior(post.units[perm], post.out_bias, post.log_tau, post.in_features, post.n_classes,
                        post.global_scale, post.weight_scale).to_bnn()


def test_round_trip_gives_identical_predictive(bnn, data):
    back = BNNPosterior.from_bnn(bnn).to_bnn()
    for site in bnn.loc:
        assert torch.equal(back.loc[site], bnn.loc[site])
        torch.testing.assert_close(back.log_scale[site], bnn.log_scale[site], rtol=0, atol=1e-15)
    np.testing.assert_allclose(back.predict(data.test.x, 20, seed=4), bnn.predict(data.test.x, 20, seed=4),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("method", ["kl", "nafi"])
def test_fusing_one_bnn_returns_it(bnn, method):
    res = fuse([bnn], method, prior_var=1e8)
    post, fused = BNNPosterior.from_bnn(bnn), BNNPosterior.from_bnn(res.model)
    assert res.sizes == [bnn.hidden]
    if method == "kl":  # the barycenter of one Gaussian is itself
        np.testing.assert_allclose(_rows(fused.units.loc), _rows(post.units.loc), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(_rows(fused.units.var), _rows(post.units.var), rtol=1e-10)
    else:  # one noisy observation of each atom, prior N(0, 1e8): the mean moves by < 1e-6
        np.testing.assert_allclose(_rows(fused.units.loc), _rows(post.units.loc), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(fused.out_bias.loc, post.out_bias.loc, rtol=1e-12)
    np.testing.assert_allclose(fused.log_tau.var, post.log_tau.var, rtol=1e-12)


def test_fusing_shuffled_copies_returns_the_same_predictive(bnn, data):
    copies = [_shuffled(bnn, s) for s in range(3)]
    res = fuse(copies, "kl")
    assert res.sizes == [bnn.hidden]
    post, fused = BNNPosterior.from_bnn(bnn), BNNPosterior.from_bnn(res.model)
    np.testing.assert_allclose(_rows(fused.units.loc), _rows(post.units.loc), rtol=1e-9, atol=1e-12)
    # Same posterior, units in another order, so Monte Carlo draws differ: with S = 4000 each
    # predictive probability has sd <= 0.5 / sqrt(S) = 0.008, a difference of two <= 0.011;
    # 0.06 is over 5 sd for each of the 500 entries compared.
    x = data.test.x[:50]
    np.testing.assert_allclose(res.model.predict(x, 4000, seed=0), bnn.predict(x, 4000, seed=1), atol=0.06)


def test_bad_inputs(bnn, data):
    other = train_bnn(data.train.x[:50, :32], data.train.y[:50], 10, 4, BNNConfig(epochs=1), verbose=False)
    with pytest.raises(ValueError, match="maps 64 -> 10"):
        fuse([bnn, other], "kl")
    with pytest.raises(TypeError, match="Bayesian and point-estimate"):
        fuse([bnn, MLP(64, [5], 10)], "kl")
    with pytest.raises(TypeError, match="HorseshoeBNN"):
        BNNPosterior.from_bnn(MLP(64, [5], 10))
    broken = BNNPosterior.from_bnn(bnn).to_bnn()
    with torch.no_grad():
        broken.loc["w1"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fuse([bnn, broken], "kl")
    with pytest.raises(ValueError, match="method"):
        fuse([bnn], "fedavg")
