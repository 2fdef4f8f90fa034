"""Class probabilities of a network (bayesfuse.nets.predict)."""

import numpy as np
import torch
from torch import nn

from bayesfuse.nets.predict import predict_proba
from bayesfuse.nets.state import model_input
from tests.nets.user_nets import BagOfWords


def test_token_ids_reach_the_network_as_integers_whatever_its_dtype():
    """Ids cast to float16 lose their value above 2048 (2049 -> 2048): they are never cast."""
    torch.manual_seed(0)
    model = BagOfWords()
    model.bag = nn.EmbeddingBag(5000, 8, mode="mean")
    model = model.half().eval()
    ids = torch.tensor([[2049, 2051, 3001, 4097, 10, 11, 12, 13, 14, 15, 16, 17]])
    with torch.no_grad():
        exact = torch.softmax(model(ids).double(), -1).numpy()
    np.testing.assert_array_equal(predict_proba(model, ids), exact)
    np.testing.assert_array_equal(predict_proba(model, ids.numpy()), exact)  # NumPy int64 too


def test_floating_inputs_come_in_the_networks_dtype():
    model = nn.Linear(3, 2).double()
    assert model_input(np.ones((2, 3), dtype=np.float32), model).dtype == torch.float64
    assert model_input(torch.ones(2, 3, dtype=torch.float64), nn.Linear(3, 2)).dtype == torch.float32
    # integer features (uint8 pixels) are numbers to a network without an embedding; ids to one with
    assert model_input(np.ones((2, 3), dtype=np.uint8), model).dtype == torch.float64
    assert model_input(np.ones((2, 3), dtype=np.int32), BagOfWords()).dtype == torch.int32
    assert model_input(torch.ones(2, 3), nn.ReLU()).dtype == torch.float32  # no parameters: float32
    pixels = np.random.default_rng(0).integers(0, 17, size=(5, 3), dtype=np.uint8)
    np.testing.assert_allclose(predict_proba(model, pixels), predict_proba(model, pixels.astype(np.float64)))
