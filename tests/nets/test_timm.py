"""timm's networks, traced from their modules (bayesfuse.nets.graph_spec), where timm is
installed (it is no dependency of bayesfuse; skipped without it).

timm writes its layers as classes of its own: ``BatchNormAct2d`` (``F.batch_norm`` and an
activation), ``Linear`` (``F.linear``), ``LayerNorm2d`` (``F.layer_norm`` of the channels moved
last); Swin rolls and pads its channels-last windows along the positions; ConvNeXt-V2's
response norm is ``torch.addcmul``; MLP-Mixer and ResMLP mix tokens by Linear layers across them; GCViT repeats a global query for every window
(``repeat_interleave`` along the batch) and cuts its channels into heads after bias-free
squeeze-and-excitation layers have read them. Small models of six families fuse back from permuted copies and fuse independent
clients into networks of timm's classes (:func:`tests.helpers.assert_library_network_fuses`).
So does a small ViT whose attention runs without its fused kernel (``fused_attn=False``): it cuts
heads of the width each ``Attention`` holds, ``self.head_dim``, which the rebuild sets to the
fused width, and keeps the clients' scale. With the kernel, ``F.scaled_dot_product_attention``
scales by the fused width, so the heads' widths are fixed: PFNM matches them at it and grows the
stream, OT keeps every width.
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
        # the qkv layer's bias put together in the forward; the attention held in place
        ("eva02_tiny_patch14_224", {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}),
        ("beit_base_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 32, "num_heads": 2}),
    ],
)
def test_timm_networks_fuse_back_and_fuse(name, options):
    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return library_randomised(timm.create_model(name, pretrained=False, num_classes=10, **options))

    assert_library_network_fuses(make, torch.randn(4, 3, 32, 32))


def _small_vit(seed: int, fused_attn: bool) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8, depth=2, embed_dim=24
    )
    for block in model.blocks:
        block.attn.fused_attn = fused_attn
    return library_randomised(model)


def test_timm_vit_fuses_with_heads_of_the_width_its_attention_holds():
    import bayesfuse
    from bayesfuse.nets.graph_spec import spec_from_graph

    x = torch.randn(4, 3, 32, 32)
    assert_library_network_fuses(lambda seed: _small_vit(seed, fused_attn=False), x)
    spec = spec_from_graph(_small_vit(0, fused_attn=False), x[:1])
    assert {p.rpartition(".")[2] for p in spec.widths} == {"head_dim", "attn_dim"} and not spec.fixed
    fused = bayesfuse.fuse([_small_vit(s, fused_attn=False) for s in (1, 2)], "pfnm", example_input=x[:1]).model
    attn = fused.blocks[0].attn
    assert attn.head_dim * attn.num_heads == attn.attn_dim == attn.qkv.out_features // 3 > 24
    kernel = [_small_vit(s, fused_attn=True) for s in (1, 2)]
    spec = spec_from_graph(kernel[0], x[:1])
    assert spec.fixed and set(spec.fixed.values()) == {
        "scaled_dot_product_attention without scale= scales by the queries' width"
    }
    fused = bayesfuse.fuse(kernel, "pfnm", example_input=x[:1])  # the heads at their width, the stream grown
    attn = fused.model.blocks[0].attn
    assert attn.head_dim == 8 and attn.qkv.out_features == 3 * 24 and fused.model.blocks[0].mlp.fc1.out_features > 96
    assert fused.model(x).shape == (4, 10)
    assert bayesfuse.fuse(kernel, "ot", example_input=x[:1]).model(x).shape == (4, 10)


def test_timm_vit_with_relative_positions_keeps_its_heads_bias_in_order():
    """timm's relative-position ViT gives attention a bias per head (``attn_mask=``) from an MLP
    of one output unit per head: those units keep the heads' order, so a copy permuted by the
    traced spec computes the same function, and OT fuses it back (its kernel's default scale fixes
    the widths, as for the ViT above)."""
    import bayesfuse
    from bayesfuse.nets.graph_spec import spec_from_graph
    from tests.helpers import permuted_copy

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_relpos_small_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8, depth=2
    )
    model = library_randomised(model).eval()
    x = torch.randn(4, 3, 32, 32)
    permuted = permuted_copy(model, spec_from_graph(model, x[:1]), seed=1)
    with torch.no_grad():
        reference = model(x)
        assert float((permuted(x) - reference).abs().max()) < 1e-4
        fused = bayesfuse.fuse([model, permuted], "ot", example_input=x[:1]).model
        assert float((fused(x) - reference).abs().max()) < 1e-4


@pytest.mark.parametrize("kind", ["mixer", "resmlp"])
def test_timm_token_mixing_networks_fuse_back_and_fuse(kind):
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock

    layers = {"block_layer": ResBlock, "norm_layer": Affine, "mlp_ratio": 4} if kind == "resmlp" else {}

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=16, **layers)
        return library_randomised(model)

    assert_library_network_fuses(make, torch.randn(4, 3, 32, 32))


def test_a_small_gcvit_fuses_back_and_fuses():
    from timm.models.gcvit import GlobalContextVit

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        net = GlobalContextVit(
            num_classes=10, img_size=64, window_ratio=(16, 16), embed_dim=16, depths=(1, 1), num_heads=(2, 4)
        )
        return library_randomised(net)

    assert_library_network_fuses(make, torch.randn(4, 3, 64, 64))


def test_a_small_res2net_fuses_back_and_fuses():
    """Res2Net splits its channels into scales by the width each block holds (``torch.split(out,
    self.width, 1)``): the rebuild sets it to the fused width, so PFNM fuses it (it was fixed)."""
    from timm.models.res2net import Bottle2neck
    from timm.models.resnet import ResNet

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        net = ResNet(block=Bottle2neck, layers=[1, 1, 1, 1], num_classes=10, base_width=8, block_args={"scale": 4})
        return library_randomised(net)

    assert_library_network_fuses(make, torch.randn(4, 3, 32, 32))
