import copy

import numpy as np
import pytest
import torch

from bayesfuse import fedavg, fuse
from bayesfuse.data import dirichlet_partition
from bayesfuse.metrics import evaluate
from bayesfuse.nets import MLP, predict_proba
from bayesfuse.train import TrainConfig, train_clients
from tests.helpers import mlp_from_neurons, one_hidden_layer

# Single-model cases are part of these tests; the warning they raise is expected.
pytestmark = pytest.mark.filterwarnings("ignore:only one model")



def _shuffled(model: MLP, seed: int) -> MLP:
    """The same function with its hidden units in another order."""
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(model.layers[0].out_features))
    out = copy.deepcopy(model)
    with torch.no_grad():
        out.layers[0].weight.copy_(model.layers[0].weight[perm])
        out.layers[0].bias.copy_(model.layers[0].bias[perm])
        out.layers[1].weight.copy_(model.layers[1].weight[:, perm])
    return out


def _net(seed=0, d=6, hidden=5, k=3):
    torch.manual_seed(seed)
    model = MLP(d, [hidden], k)
    with torch.no_grad():  # spread the units apart so that they are distinguishable
        for p in model.parameters():
            p.normal_(0, 1.0)
    return model


def test_neurons_round_trip():
    model = _net()
    part = one_hidden_layer(model)
    assert part.neurons.shape == (5, 6 + 1 + 3)
    back = mlp_from_neurons(part.neurons, part.out_bias, part.in_features)
    x = torch.randn(10, 6)
    torch.testing.assert_close(back(x), model(x))


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_shuffled_copies_fuse_back_to_the_network(method):
    model = _net()
    copies = [_shuffled(model, s) for s in range(4)]
    # A vague prior (variance 1e4) makes the posterior mean the plain average of the copies:
    # each weight is shrunk by the factor J/(J + sigma^2/sigma0^2) = 1 - 2.5e-5.
    res = fuse(copies, method, prior_var=1e4, noise_var=1.0)
    assert res.sizes == [5]
    x = torch.randn(50, 6)
    torch.testing.assert_close(res.model(x), model(x), rtol=1e-3, atol=1e-3)


def test_fused_weights_are_the_gaussian_posterior_mean():
    # Identical copies, PFNM's settings (prior N(mu0, 10), noise 1): theta = (mu0/10 + J v) / (1/10 + J).
    model = _net(1)
    J = 3
    res = fuse([_shuffled(model, s) for s in range(J)], "pfnm", noise_var=1.0, prior_var=10.0, gamma0=1.0)
    part = one_hidden_layer(model)
    mu0 = np.zeros(part.neurons.shape[1])
    mu0[6] = 0.1
    expected = (mu0 / 10 + J * part.neurons) / (1 / 10 + J)
    got = one_hidden_layer(res.model).neurons
    key = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731  (compare as sets of rows)
    np.testing.assert_allclose(key(got), key(expected), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one_hidden_layer(res.model).out_bias, J * part.out_bias / (1 / 10 + J), rtol=1e-6)


def test_single_model_fuses_to_itself():
    model = _net(2)
    res = fuse([model], "nafi", prior_var=1e6)
    x = torch.randn(20, 6)
    torch.testing.assert_close(res.model(x), model(x), rtol=1e-4, atol=1e-4)


def test_class_counts_weight_the_outgoing_weights():
    # A client that never saw class 2 has no say on the weights into class 2.
    a, b = _net(3), _net(3)
    with torch.no_grad():
        b.layers[1].weight[2] += 5.0
        b.layers[1].bias[2] += 5.0
    counts = np.array([[10, 10, 10], [10, 10, 0]])
    res = fuse([a, b], "pfnm", class_counts=counts, prior_var=1e6)
    # The units differ only where b has precision 0, so they match one to one ...
    assert res.sizes == [5]
    # ... and the fused network is a's: b's changes to class 2 carry no weight.
    x = torch.randn(30, 6)
    torch.testing.assert_close(res.model(x), a(x), rtol=1e-4, atol=1e-4)


def test_fusion_beats_fedavg_on_heterogeneous_digits():
    from bayesfuse import fedavg
    from bayesfuse.data import load_digits
    from bayesfuse.metrics import accuracy

    split = load_digits().standardize()
    part = dirichlet_partition(split.train.y, 5, 0.5, seed=0)
    models = train_clients(split.train, part, TrainConfig(hidden=(50,), epochs=5), shared_init=False, verbose=False)
    acc = lambda m: accuracy(predict_proba(m, split.test.x), split.test.y)  # noqa: E731
    local = np.mean([acc(m) for m in models])
    fused = acc(fuse(models, "pfnm", class_counts=part.counts).model)
    averaged = acc(fedavg(models, part.sizes))
    assert fused > averaged and fused > local


def test_bad_inputs():
    with pytest.raises(ValueError, match="method"):
        fuse([_net()], "bogus")
    with pytest.raises(ValueError, match=r"data=\(train, partition\)"):
        fuse([_net(), _net(1)], "fedma")
    with pytest.raises(ValueError, match="client 1 has 4 classes in 'layers.1.weight', client 0 has 3"):
        fuse([_net(), _net(d=6, k=4)])
    with pytest.raises(ValueError, match=r"client 1\['layers.0.weight'\] has shape \(5, 7\).*differ beyond hidden widths"):
        fuse([_net(), MLP(7, [5], 3)])
    with pytest.raises(ValueError, match="no hidden units"):
        fuse([MLP(6, [], 3)])
    with pytest.raises(ValueError, match="class_counts"):
        fuse([_net(), _net(1)], class_counts=np.ones((3, 3)))
    with pytest.raises(ValueError, match="nafi"):
        fuse([_net()], "pfnm", kl_weight=0.1)
    broken = _net()
    with torch.no_grad():
        broken.layers[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fuse([_net(), broken])


@pytest.fixture(scope="module")
def digits_federation(digits):
    part = dirichlet_partition(digits.train.y, 5, 0.5, seed=0)
    models = train_clients(digits.train, part, TrainConfig(hidden=(50,), epochs=5, seed=0), shared_init=False,
                           verbose=False)
    return digits, part, models


@pytest.mark.parametrize("global_weights", ["posterior", "average"])
def test_each_output_calibration_on_a_real_split(digits_federation, global_weights):
    # Every choice fuses into a network better than the clients and than one-shot FedAvg. Their
    # confidence orders as their construction says: scaling the outgoing weights of global
    # units merged from m_g < J clients by m_g / J shrinks logits, so average_outputs=True
    # predicts with more entropy; the posterior mean shrinks weights towards the prior, the
    # matched average does not, so "average" is the more confident. (On this 5-client split
    # the less confident choices are under-confident: see bench_fidelity.py for Fashion-MNIST,
    # where averaging the outputs is what brings the NLL down.)
    split, part, models = digits_federation
    x, y = split.test.x, split.test.y
    local = max(evaluate(predict_proba(m, x), y)["accuracy"] for m in models)
    averaged = evaluate(predict_proba(fedavg(models, part.sizes), x), y)["accuracy"]
    scores = {}
    for outputs in (True, False):
        res = fuse(models, "pfnm", class_counts=part.counts, global_weights=global_weights, average_outputs=outputs)
        scores[outputs] = evaluate(predict_proba(res.model, x), y)
        assert res.hyper["average_outputs"] is outputs and res.hyper["global_weights"] == global_weights
        assert scores[outputs]["accuracy"] > max(local, averaged)
    assert scores[True]["entropy"] > scores[False]["entropy"]


def test_the_matched_average_is_more_confident_than_the_posterior_mean(digits_federation):
    split, part, models = digits_federation
    entropy = {gw: evaluate(predict_proba(fuse(models, "pfnm", class_counts=part.counts, global_weights=gw).model,
                                          split.test.x), split.test.y)["entropy"] for gw in ("posterior", "average")}
    assert entropy["average"] < entropy["posterior"]
