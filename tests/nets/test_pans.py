"""Position-aware neurons: the switch on permutation invariance (PANs eqs. 2-8)."""

import numpy as np
import pytest
import torch

from bayesfuse.nets.arch import make_cnn
from bayesfuse.nets.mlp import MLP
from bayesfuse.nets.pans import PANConfig, PositionAware, position_encoding, shuffle_error


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
@pytest.mark.parametrize(
    "make, d",
    [
        (lambda pan: MLP(16, [12, 10], 4, pan=pan), 16),
        (lambda pan: make_cnn(64, 4, channels=(6, 5), hidden=(7,), pan=pan), 64),
    ],
)
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
    wider = rebuild(
        pan,
        {
            k: torch.zeros((9, *v.shape[1:]))
            if k.startswith("layers.0")
            else (torch.zeros(2, 9) if k == "layers.1.weight" else v)
            for k, v in pan.state_dict().items()
        },
    )
    assert wider.pans[0].n_units == 9
    assert wider(torch.zeros(3, 5)).shape == (3, 2)


def test_bad_pan_settings():
    with pytest.raises(ValueError, match="mode"):
        PANConfig("both")
    with pytest.raises(ValueError, match="amplitude"):
        PANConfig("add", 1.0, -0.1)


# --------------------------------------------------------------------------- encodings in specs, folded into weights

from bayesfuse.inference.encodings import fold_encodings, unfold_encodings  # noqa: E402
from bayesfuse.inference.spec import Encoding, permute, random_permutations  # noqa: E402
from bayesfuse.nets.arch import rebuild  # noqa: E402
from bayesfuse.nets.spec import UnsupportedLayerError, spec_from_module  # noqa: E402
from bayesfuse.nets.state import numpy_state  # noqa: E402


def tensor_state(state):
    """Tensors of the arrays' own dtype (float64 here)."""
    return {k: torch.as_tensor(v) for k, v in state.items()}


def test_spec_records_each_encoding_and_the_module_it_follows():
    pan = PANConfig("add", 1.0, 0.2)
    mlp = spec_from_module(MLP(5, [6, 7], 2, pan=pan))
    assert mlp.encodings == {
        "P1": Encoding("add", 1.0, 0.2, after="layers.0"),
        "P2": Encoding("add", 1.0, 0.2, after="layers.1"),
    }
    cnn = make_cnn(64, 3, channels=(4, 5), hidden=(6,), pan=pan)  # Conv -> BN -> PAN: the BN's outputs
    spec = spec_from_module(cnn)
    bns = [n for n, m in cnn.named_children() if isinstance(m, torch.nn.BatchNorm2d)]
    assert [spec.encodings[g].after for g in ("P1", "P2")] == bns
    hidden = [n for n, m in cnn.named_children() if isinstance(m, torch.nn.Linear)][0]
    assert spec.encodings["P3"].after == hidden  # the hidden Linear after Flatten
    assert spec_from_module(MLP(5, [6], 2)).encodings == {}
    late = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), PositionAware(3, pan), torch.nn.Linear(3, 2))
    with pytest.raises(UnsupportedLayerError, match="directly follow"):
        spec_from_module(late)


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_folded_encodings_give_the_plain_network(float64, mode):
    pan = _init(MLP(6, [9, 8], 3, pan=PANConfig(mode, 1.0, 0.3)))
    spec = spec_from_module(pan)
    plain = MLP(6, [9, 8], 3).eval()
    plain.load_state_dict(tensor_state(fold_encodings(numpy_state(pan), spec)))
    x = torch.randn(20, 6)
    torch.testing.assert_close(plain(x), pan(x), rtol=1e-12, atol=1e-12)
    back = unfold_encodings(fold_encodings(numpy_state(pan), spec), spec)
    for k, v in numpy_state(pan).items():
        np.testing.assert_allclose(back[k], v, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("mode", ["add", "mul"])
@pytest.mark.parametrize(
    "make, d",
    [
        (lambda pan: MLP(16, [12, 10], 4, pan=pan), 16),
        (lambda pan: make_cnn(64, 4, channels=(6, 5), hidden=(7,), pan=pan), 64),
    ],
)
def test_units_keep_their_function_when_their_encodings_move_with_them(float64, mode, make, d):
    """Fold at the old positions, permute, unfold at the new ones (eqs. F, U): the same function."""
    from tests.helpers import randomise

    model = randomise(make(PANConfig(mode, 1.0, 0.3)), 0)  # batch norms' statistics included
    spec = spec_from_module(model)
    plain = fold_encodings(numpy_state(model), spec)
    perms = random_permutations(spec.sizes(plain), np.random.default_rng(0))
    moved = rebuild(model, tensor_state(unfold_encodings(permute(plain, spec, perms), spec))).eval()
    shuffled = rebuild(model, tensor_state(permute(numpy_state(model), spec, perms))).eval()
    x = torch.randn(30, d)
    torch.testing.assert_close(moved(x), model(x), rtol=1e-10, atol=1e-10)
    assert (shuffled(x) - model(x)).abs().max() > 1e-2  # what PANs are for


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_unfolding_at_a_wider_width_keeps_the_function(float64, mode):
    """A fused network is wider than the clients: a dead unit appended, the encodings of 10 units."""
    model = _init(MLP(6, [9], 3, pan=PANConfig(mode, 1.0, 0.3)))
    spec = spec_from_module(model)
    plain = fold_encodings(numpy_state(model), spec)
    wide = {
        "layers.0.weight": np.vstack([plain["layers.0.weight"], np.ones((1, 6))]),
        "layers.0.bias": np.append(plain["layers.0.bias"], 1.0),
        "layers.1.weight": np.hstack([plain["layers.1.weight"], np.zeros((3, 1))]),
        "layers.1.bias": plain["layers.1.bias"],
    }
    wider = rebuild(model, tensor_state(unfold_encodings(wide, spec))).eval()
    assert wider.pans[0].n_units == 10
    x = torch.randn(20, 6)
    torch.testing.assert_close(wider(x), model(x), rtol=1e-10, atol=1e-10)
