import copy

import numpy as np
import pytest
import torch

from bayesfuse.baselines import Ensemble, evaluate_locals, fedavg, fedavg_state_dicts
from bayesfuse.nets import MLP, predict_proba


def _mlp(seed, widths=(6, 5, 3)):
    torch.manual_seed(seed)
    return MLP(widths[0], widths[1:-1], widths[-1])


def test_fedavg_of_identical_models_returns_the_model():
    model = _mlp(0)
    fused = fedavg([copy.deepcopy(model) for _ in range(4)], weights=[1, 5, 2, 9])
    for k, v in model.state_dict().items():
        # float64 accumulation of equal values with weights summing to one: exact up to
        # one float32 rounding.
        torch.testing.assert_close(fused.state_dict()[k], v, rtol=1.2e-7, atol=0)


def test_fedavg_is_the_weighted_average():
    models = [_mlp(s) for s in range(3)]
    w = np.array([10.0, 30.0, 60.0])
    fused = fedavg(models, weights=w)
    for k in fused.state_dict():
        expected = sum(wj / w.sum() * m.state_dict()[k].double() for wj, m in zip(w, models))
        torch.testing.assert_close(fused.state_dict()[k].double(), expected, rtol=1e-6, atol=1e-7)
    assert fused is not models[0]  # a copy, the inputs are untouched


def test_fedavg_uniform_default_and_order_invariance():
    models = [_mlp(s) for s in range(3)]
    a = fedavg_state_dicts([m.state_dict() for m in models])
    b = fedavg_state_dicts([m.state_dict() for m in models[::-1]])
    for k in a:
        torch.testing.assert_close(a[k], b[k])


def test_fedavg_bad_inputs():
    good, other = _mlp(0), _mlp(1, widths=(6, 4, 3))
    with pytest.raises(ValueError, match="identical architectures"):
        fedavg([good, other])
    with pytest.raises(ValueError, match="at least one"):
        fedavg([])
    broken = _mlp(2)
    with torch.no_grad():
        broken.layers[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fedavg([good, broken])
    with pytest.raises(ValueError, match="weights"):
        fedavg([good, _mlp(3)], weights=[1.0, float("nan")])
    with pytest.raises(ValueError, match="one weight per model"):
        fedavg([good, _mlp(3)], weights=[1.0])
    with pytest.raises(ValueError, match="different parameters"):
        fedavg_state_dicts([good.state_dict(), {"x": torch.zeros(1)}])


def test_ensemble_of_one_equals_the_model():
    model = _mlp(0)
    x = torch.randn(20, 6)
    np.testing.assert_allclose(predict_proba(Ensemble([model]), x), predict_proba(model, x), rtol=1e-12, atol=1e-15)


def test_ensemble_averages_probabilities():
    models = [_mlp(s) for s in range(3)]
    x = torch.randn(15, 6)
    probs = [predict_proba(m, x) for m in models]
    np.testing.assert_allclose(predict_proba(Ensemble(models), x), np.mean(probs, axis=0), rtol=1e-10)
    weighted = Ensemble(models, weights=[1, 0, 3])
    np.testing.assert_allclose(predict_proba(weighted, x), 0.25 * probs[0] + 0.75 * probs[2], rtol=1e-10)


def test_evaluate_locals():
    models = [_mlp(s) for s in range(2)]
    x = np.random.default_rng(0).normal(size=(30, 6)).astype(np.float32)
    y = np.arange(30) % 3
    out = evaluate_locals(models, x, y)
    assert len(out) == 2 and set(out[0]) == {"accuracy", "nll", "ece", "entropy"}


# --------------------------------------------------------------------------- ensembles of BNNs


def _bnns(n=3):
    from tests.helpers import varied_bnn

    return [varied_bnn(6, 5, 3, seed=s, spread=0.5, scale_low=0.05, scale_span=0.3) for s in range(n)]


def test_ensemble_of_bnns_is_the_mixture_of_their_posterior_predictives():
    bnns = _bnns()
    # float32-representable inputs: predict_proba hands the ensemble float32, each BNN reads float64
    x = np.random.default_rng(0).normal(size=(40, 6)).astype(np.float32).astype(np.float64)
    direct = np.mean([b.predict(x, 100, seed=0) for b in bnns], axis=0)
    # the same draws on both sides: only round-off of log, logsumexp and softmax separates them
    np.testing.assert_allclose(predict_proba(Ensemble(bnns), x), direct, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(Ensemble(bnns).predict(x), direct, rtol=1e-10, atol=1e-14)
    draws = np.mean([b.predict(x, 20, seed=7) for b in bnns], axis=0)
    np.testing.assert_allclose(Ensemble(bnns, num_samples=20, seed=7).predict(x), draws, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(Ensemble(bnns).predict(x, 20, seed=7), draws, rtol=1e-10, atol=1e-14)
    # other draws give another Monte Carlo estimate: the seed is passed on, not ignored
    assert np.abs(Ensemble(bnns).predict(x, 20, seed=8) - draws).max() > 1e-4


def test_ensemble_mixes_networks_and_bnns_by_their_predictives():
    (bnn,) = _bnns(1)
    mlp = _mlp(0, widths=(6, 5, 3))
    x = np.random.default_rng(1).normal(size=(25, 6))
    expected = 0.25 * predict_proba(mlp, x) + 0.75 * bnn.predict(x, 30, seed=2)
    ensemble = Ensemble([mlp, bnn], weights=[1, 3], num_samples=30, seed=2)
    np.testing.assert_allclose(ensemble.predict(x), expected, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(ensemble.predict(x).sum(1), 1.0, atol=1e-12)


def test_ensemble_of_bnns_refuses_bad_settings():
    with pytest.raises(ValueError, match="num_samples"):
        Ensemble(_bnns(1), num_samples=0)
    with pytest.raises(ValueError, match="0 examples"):
        Ensemble(_bnns(1)).predict(np.zeros((0, 6)))


def test_evaluate_locals_reads_a_bnn_by_its_predictive():
    bnns = _bnns(2)
    x = np.random.default_rng(2).normal(size=(30, 6))
    y = np.arange(30) % 3
    out = evaluate_locals(bnns, x, y, num_samples=40, seed=1)
    from bayesfuse.metrics import evaluate

    assert out == [evaluate(b.predict(x, 40, seed=1), y) for b in bnns]
