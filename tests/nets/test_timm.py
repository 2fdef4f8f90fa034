"""timm's networks, traced from their modules (bayesfuse.nets.graph_spec), where timm is
installed (it is no dependency of bayesfuse; skipped without it).

timm writes its layers as classes of its own: ``BatchNormAct2d`` (``F.batch_norm`` and an
activation), ``Linear`` (``F.linear``), ``LayerNorm2d`` (``F.layer_norm`` of the channels moved
last); Swin rolls and pads its channels-last windows along the positions; ConvNeXt-V2's
response norm is ``torch.addcmul``; MLP-Mixer and ResMLP mix tokens by Linear layers across them. Small models of six families fuse back from permuted copies and fuse independent
clients into networks of timm's classes (:func:`tests.helpers.assert_library_network_fuses`).
"""

import pytest
import torch

from tests.helpers import assert_library_network_fuses, library_randomised

timm = pytest.importorskip("timm")


SMALL_SWIN = {"img_size": 32, "window_size": 4, "embed_dim": 16, "depths": (1, 1), "num_heads": (2, 2)}


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("lcnet_050", {}),
        ("mobilenetv3_small_050", {}),
        ("regnety_002", {}),
        ("convnext_atto", {}),
        ("convnextv2_atto", {}),
        ("swin_tiny_patch4_window7_224", SMALL_SWIN),
    ],
)
def test_timm_networks_fuse_back_and_fuse(name, options):
    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return library_randomised(timm.create_model(name, pretrained=False, num_classes=10, **options))

    assert_library_network_fuses(make, torch.randn(4, 3, 32, 32))


@pytest.mark.parametrize("kind", ["mixer", "resmlp"])
def test_timm_token_mixing_networks_fuse_back_and_fuse(kind):
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock

    layers = {"block_layer": ResBlock, "norm_layer": Affine, "mlp_ratio": 4} if kind == "resmlp" else {}

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=16, **layers)
        return library_randomised(model)

    assert_library_network_fuses(make, torch.randn(4, 3, 32, 32))
