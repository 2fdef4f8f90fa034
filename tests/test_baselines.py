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
