"""timm's networks, traced from their modules (bayesfuse.nets.graph_spec), where timm is
installed (it is no dependency of bayesfuse; skipped without it).

timm writes its layers as classes of its own: ``BatchNormAct2d`` (``F.batch_norm`` and an
activation), ``Linear`` (``F.linear``), ``LayerNorm2d`` (``F.layer_norm`` of the channels moved
last). Small models of four families fuse back from permuted copies and fuse independent
clients into networks of timm's classes (:func:`tests.helpers.assert_library_network_fuses`).
"""

import pytest
import torch

from tests.helpers import assert_library_network_fuses, library_randomised

timm = pytest.importorskip("timm")


@pytest.mark.parametrize("name", ["lcnet_050", "mobilenetv3_small_050", "regnety_002", "convnext_atto"])
def test_timm_networks_fuse_back_and_fuse(name):
    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return library_randomised(timm.create_model(name, pretrained=False, num_classes=10))

    assert_library_network_fuses(make, torch.randn(4, 3, 64, 64))
