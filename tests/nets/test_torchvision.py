"""torchvision's own networks, traced from their modules (bayesfuse.nets.graph_spec), where
torchvision is installed (it is no dependency of bayesfuse; skipped without it).

Small configurations of ConvNeXt (``LayerNorm2d``: ``F.layer_norm`` in a subclass of
``nn.LayerNorm``; layer scales; stochastic depth), EfficientNet (squeeze-and-excitation gates,
stochastic depth) and MobileNetV3 (depthwise convolutions, hard-swish gates): a permuted copy
fuses back to the network (max abs logit difference under 1e-4, float32 round-off on logits of
order 1) by PFNM and OT, and independent clients fuse by PFNM into a network that runs.
"""

import copy

import numpy as np
import pytest
import torch

import bayesfuse
from bayesfuse.inference.spec import permute, random_permutations
from bayesfuse.nets.graph_spec import spec_from_graph

models = pytest.importorskip("torchvision.models")


def _convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], stochastic_depth_prob=0.1, num_classes=10)


def _efficientnet():
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    stages = [MBConvConfig(1, 3, 1, 16, 16, 1), MBConvConfig(6, 3, 2, 16, 24, 2)]
    return EfficientNet(stages, dropout=0.2, stochastic_depth_prob=0.2, num_classes=10)


def _mobilenet():
    return models.mobilenet_v3_small(num_classes=10, width_mult=0.25)


def _random(make, seed: int) -> torch.nn.Module:
    """``make()`` with its norms' scales, shifts and statistics away from 1 and 0, in eval mode."""
    torch.manual_seed(seed)
    model = make()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.normal_(0, 0.1)
            elif name.endswith("running_var"):
                b.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():
            if p.dim() == 1 or "layer_scale" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") or "scale" in name else p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("make", [_convnext, _efficientnet, _mobilenet])
def test_torchvision_networks_fuse_back_and_fuse(make):
    x = torch.randn(6, 3, 32, 32)
    model = _random(make, 0)
    spec = spec_from_graph(model, x[:1])
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    perms = random_permutations(spec.sizes(state), np.random.default_rng(1))
    permuted = copy.deepcopy(model)
    permuted.load_state_dict({k: torch.as_tensor(v) for k, v in permute(state, spec, perms).items()})
    with torch.no_grad():
        reference = model(x)
        assert float((permuted(x) - reference).abs().max()) < 1e-4
        for method in ("pfnm", "ot"):
            fused = bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model
            assert float((fused(x) - reference).abs().max()) < 1e-4, method
        fused = bayesfuse.fuse([_random(make, s) for s in (1, 2, 3)], "pfnm", example_input=x[:1]).model
        assert fused(x).shape == (6, 10)
