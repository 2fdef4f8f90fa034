"""Helpers shared by the tests of network plumbing and layer-wise matching."""

import torch
from torch import nn


def randomise(model: nn.Module, seed: int) -> nn.Module:
    """Every float entry ~ N(0, 0.25) (running variances made positive), in eval mode: units
    far enough apart that matching can tell them from one another."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
                if "running_var" in name:
                    t.abs_().add_(0.1)
    return model.eval()
