"""torchvision's own networks, traced from their modules (bayesfuse.nets.graph_spec), where
torchvision is installed (it is no dependency of bayesfuse; skipped without it).

Small configurations of ConvNeXt (``LayerNorm2d``: ``F.layer_norm`` in a subclass of
``nn.LayerNorm``; layer scales; stochastic depth), EfficientNet (squeeze-and-excitation gates,
stochastic depth) and MobileNetV3 (depthwise convolutions, hard-swish gates) fuse back from
permuted copies and fuse independent clients (:func:`tests.helpers.assert_library_network_fuses`).
So does a small ViT, its ``nn.MultiheadAttention`` split into heads
(:func:`bayesfuse.nets.attention.split_heads`): its forward reshapes the patches by the width
it holds, ``self.hidden_dim``, which the rebuild sets to the fused width. And a small MaxViT,
whose attention moves its axes by ``swapaxes`` and scores and weighs by ``torch.einsum``.
"""

import pytest
import torch

from tests.helpers import assert_library_network_fuses, library_randomised

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


def _vit():
    from torchvision.models import VisionTransformer

    from bayesfuse.nets.attention import split_heads

    vit = VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=10
    )
    return split_heads(vit)


def _maxvit():
    from torchvision.models.maxvit import MaxVit

    return MaxVit(
        input_size=(32, 32),
        stem_channels=8,
        partition_size=2,
        block_channels=[16, 32],
        block_layers=[1, 1],
        head_dim=8,
        stochastic_depth_prob=0.1,
        num_classes=10,
    )


@pytest.mark.parametrize("build", [_convnext, _efficientnet, _mobilenet, _vit, _maxvit])
def test_torchvision_networks_fuse_back_and_fuse(build):
    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return library_randomised(build())

    assert_library_network_fuses(make, torch.randn(6, 3, 32, 32))


def _swin(seed: int) -> torch.nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(seed)
    swin = SwinTransformer([4, 4], 16, [2, 2], [2, 2], [2, 2], stochastic_depth_prob=0.1, num_classes=10)
    return library_randomised(swin)


def test_torchvision_swin_traces_through_its_wrapped_attention():
    """torchvision wraps Swin's ``shifted_window_attention`` for fx (``torch.fx.wrap``), since it
    pads and shifts by sizes it branches on, and builds its mask by item assignment: the tracer
    goes through it, taking those branches at the example input. Its queries are scaled by
    ``(C // num_heads) ** -0.5``, a root of the fused width, so the widths that scale reads are
    fixed: OT and PFNM (matching those groups at their widths) fuse a permuted copy back."""
    import bayesfuse
    from bayesfuse.nets.graph_spec import spec_from_graph
    from tests.helpers import permuted_copy

    x = torch.randn(3, 3, 32, 32)
    model = _swin(0)
    spec = spec_from_graph(model, x[:1])
    assert spec.fixed and all("root of their width" in why for why in spec.fixed.values())
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        reference = model(x)
        assert float((permuted(x) - reference).abs().max()) < 1e-4
        for method in ("ot", "pfnm"):
            fused = bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model
            assert float((fused(x) - reference).abs().max()) < 1e-4, method
            assert bayesfuse.fuse([_swin(s) for s in (1, 2)], method, example_input=x[:1]).model(x).shape == (3, 10)
