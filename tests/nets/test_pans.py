"""Position-aware neurons: the switch on permutation invariance (PANs eqs. 2-8)."""

import numpy as np
import pytest
import torch

from bayesfuse.nets.arch import make_cnn
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.pans import PANConfig, position_encoding, shuffle_error


def _init(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval()


def test_encodings_follow_eqs_4_and_5():
    add = position_encoding(8, PANConfig("add", 1.0, 0.2))
    mul = position_encoding(8, PANConfig("mul", 1.0, 0.2))
    np.testing.assert_allclose(add, 0.2 * np.sin(2 * np.pi * np.arange(8) / 8))
    np.testing.assert_allclose(mul, 1 + add)
    assert add.min() >= -0.2 and add.max() <= 0.2


@pytest.mark.parametrize("mode", ["add", "mul"])
@pytest.mark.parametrize("make, d", [(lambda pan: MLP(16, [12, 10], 4, pan=pan), 16),
                                     (lambda pan: make_cnn(64, 4, channels=(6, 5), hidden=(7,), pan=pan), 64)])
def test_shuffle_error_is_zero_when_off_and_grows_with_amplitude(mode, make, d):
    x = torch.randn(64, d)
    errors = []
    for amplitude in (0.0, 0.05, 0.25, 0.75):
        model = _init(make(PANConfig(mode, 1.0, amplitude)))
        errors.append(shuffle_error(model, x, seed=0, n_trials=5))
    assert errors[0] < 1e-6  # float32 round-off of a permuted sum
    assert all(b > a for a, b in zip(errors, errors[1:])), errors
    # T = 0 turns them off too, whatever the amplitude
    off = _init(make(PANConfig(mode, 0.0, 0.75)))
    assert shuffle_error(off, x, n_trials=3) < 1e-6


def test_pans_add_no_state_and_rebuild_at_new_width():
    from bayesfuse.nets.arch import rebuild

    plain, pan = MLP(5, [6], 2), MLP(5, [6], 2, pan=PANConfig())
    assert plain.state_dict().keys() == pan.state_dict().keys()
    wider = rebuild(pan, {k: torch.zeros((9, *v.shape[1:])) if k.startswith("layers.0") else
                          (torch.zeros(2, 9) if k == "layers.1.weight" else v) for k, v in pan.state_dict().items()})
    assert wider.pans[0].n_units == 9
    assert wider(torch.zeros(3, 5)).shape == (3, 2)


def test_bad_pan_settings():
    with pytest.raises(ValueError, match="mode"):
        PANConfig("both")
    with pytest.raises(ValueError, match="amplitude"):
        PANConfig("add", 1.0, -0.1)
