import pytest
import torch

from bayesfuse.nets import MLP


def test_state_dict_layout_and_round_trip():
    torch.manual_seed(0)
    model = MLP(10, [7, 5], 3)
    sd = model.state_dict()
    assert list(sd) == [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
        "layers.2.weight",
        "layers.2.bias",
    ]
    assert sd["layers.0.weight"].shape == (7, 10)
    back = MLP.from_state_dict(sd)
    assert back.widths == [10, 7, 5, 3]
    x = torch.randn(4, 10)
    torch.testing.assert_close(back(x), model(x))


def test_table1_initialisation():
    torch.manual_seed(0)
    model = MLP(784, [100], 10)
    assert torch.all(model.layers[0].bias == 0.1)
    # 78,400 draws from N(0, 0.01^2): the sample std is within 1% of 0.01 (its sd is
    # 0.01/sqrt(2n) = 2.5e-5, so 1e-4 is 4 sd).
    assert abs(model.layers[0].weight.std().item() - 0.01) < 1e-4


def test_bad_widths_and_state_dicts():
    with pytest.raises(ValueError, match="positive"):
        MLP(4, [0], 2)
    with pytest.raises(ValueError, match="no 'layers"):
        MLP.from_state_dict({"fc.weight": torch.zeros(2, 2)})
    sd = MLP(4, [3], 2).state_dict()
    sd["layers.1.weight"] = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="inconsistent"):
        MLP.from_state_dict(sd)
