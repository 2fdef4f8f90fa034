"""Dead cells for projected LSTMs (bayesfuse.inference.dead_cells): the same function, exactly."""

import numpy as np
import pytest
import torch
from torch import nn

from bayesfuse.inference.dead_cells import pad_projected_cells


@pytest.mark.parametrize("bidirectional", [False, True])
def test_dead_cells_keep_a_projected_lstms_function_exactly(bidirectional):
    """Zero rows in every gate's block, zero columns in the projection: each dead cell's state
    stays 0 (``c = c / 2 + 1/2 * tanh(0)``), its output 0, so the outputs and final states are
    the network's, on two stacked layers in both directions: in float64, to round-off (the added
    terms are exact zeros; only the order of the matrix products' sums may differ), and the dead
    cells' states exactly 0."""
    torch.manual_seed(0)
    lstm = nn.LSTM(5, 6, num_layers=2, proj_size=4, bidirectional=bidirectional, batch_first=True).double().eval()
    state, padded = pad_projected_cells({f"rnn.{k}": v for k, v in lstm.state_dict().items()}, cells={"rnn": 9})
    assert padded == {"rnn": (6, 9)}
    wide = nn.LSTM(5, 9, num_layers=2, proj_size=4, bidirectional=bidirectional, batch_first=True).double().eval()
    wide.load_state_dict({k.removeprefix("rnn."): v for k, v in state.items()})
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    with torch.no_grad():
        (out, (h, c)), (out_w, (h_w, c_w)) = lstm(x), wide(x)
    for a, b in ((out, out_w), (h, h_w), (c, c_w[..., :6])):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    assert not c_w[..., 6:].any()


def test_only_projections_as_wide_as_the_cells_are_padded():
    state = {"a.weight_hr_l0": np.zeros((4, 6)), "b.weight_hr_l0": np.ones((5, 5)), "b.weight_ih_l0": np.ones((20, 3))}
    out, padded = pad_projected_cells(state)
    assert padded == {"b": (5, 6)} and out["a.weight_hr_l0"] is state["a.weight_hr_l0"]
    assert out["b.weight_hr_l0"].shape == (5, 6) and not out["b.weight_hr_l0"][:, 5].any()
    rows = out["b.weight_ih_l0"].reshape(4, 6, 3)
    assert rows[:, :5].all() and not rows[:, 5].any()  # a zero row at the end of each gate's block
