import numpy as np
import pytest
import torch

from bayesfuse.data import Dataset, dirichlet_partition
from bayesfuse.nets import predict_proba
from bayesfuse.train import TrainConfig, TrainingDivergedError, torch_threads, train_clients, train_mlp


def _blobs(n=300, d=5, k=3, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(scale=4.0, size=(k, d))
    y = rng.integers(0, k, n)
    return (centres[y] + rng.normal(size=(n, d))).astype(np.float32), y


def test_learns_separable_blobs():
    x, y = _blobs()
    model = train_mlp(x, y, 3, TrainConfig(hidden=(16,), epochs=5), verbose=False)
    assert (predict_proba(model, x).argmax(1) == y).mean() > 0.95
    assert len(model.loss_history) == 5 and model.loss_history[-1] < model.loss_history[0]


def test_same_seed_same_weights_other_seed_differs():
    x, y = _blobs()
    cfg = TrainConfig(hidden=(8, 4), epochs=2, seed=3)
    a, b = train_mlp(x, y, 3, cfg, verbose=False), train_mlp(x, y, 3, cfg, verbose=False)
    c = train_mlp(x, y, 3, TrainConfig(hidden=(8, 4), epochs=2, seed=4), verbose=False)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.layers[0].weight, c.layers[0].weight)
    assert a.widths == [5, 8, 4, 3]


def test_nan_loss_stops_with_clear_error():
    # Adam's first step moves every weight by about lr = 1e30, so at step 2 the logits
    # overflow float32 and the loss is no longer finite.
    x, y = _blobs()
    with pytest.raises(TrainingDivergedError, match="epoch 1, step 2.*lower the learning rate"):
        train_mlp(x, y, 3, TrainConfig(hidden=(4,), epochs=1, lr=1e30), verbose=False)


def test_bad_inputs():
    x, y = _blobs()
    x_nan = x.copy()
    x_nan[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        train_mlp(x_nan, y, 3, verbose=False)
    with pytest.raises(ValueError, match="empty"):
        train_mlp(x[:0], y[:0], 3, verbose=False)
    with pytest.raises(ValueError, match="labels"):
        train_mlp(x, y + 5, 3, verbose=False)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0)


def test_train_clients_shares_init_and_rejects_empty_clients():
    x, y = _blobs(n=200)
    data = Dataset(x, y, 3)
    part = dirichlet_partition(y, 3, 1.0, seed=0)
    cfg = TrainConfig(hidden=(6,), epochs=1)
    models = train_clients(data, part, cfg, verbose=False)
    assert len(models) == 3 and all(m.train_seconds > 0 for m in models)
    # Shared initialisation: all clients started from the network built with cfg.seed.
    torch.manual_seed(cfg.seed)
    from bayesfuse.nets import MLP

    init = MLP(5, (6,), 3)
    untrained = train_clients(data, part, TrainConfig(hidden=(6,), epochs=1, lr=1e-12), verbose=False)
    for m in untrained:
        torch.testing.assert_close(m.layers[0].weight, init.layers[0].weight, rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match=r"clients \[1\] hold no examples"):
        train_clients(data, [np.arange(5), np.array([], dtype=int)], cfg, verbose=False)


def test_torch_threads_restores():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_a_network_returning_more_than_its_logits_is_refused_in_one_line():
    """Training (FedMA's retraining, the demo's clients) reads the logits; a tuple is refused, naming it."""
    from bayesfuse.train import _fit

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(5, 3)

        def forward(self, x):
            return self.fc(x), x

    x, y = _blobs()
    with pytest.raises(ValueError, match="client 2: training reads the network's logits, and Pair returns a tuple"):
        _fit(Pair(), torch.as_tensor(x), torch.as_tensor(y), TrainConfig(epochs=1), torch.Generator(), name="client 2")
