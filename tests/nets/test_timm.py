"""timm's networks, traced from their modules (bayesfuse.nets.graph_spec), where timm is
installed (it is no dependency of bayesfuse; skipped without it).

timm writes its layers as classes of its own: ``BatchNormAct2d`` (``F.batch_norm`` and an
activation), ``Linear`` (``F.linear``), ``LayerNorm2d`` (``F.layer_norm`` of the channels moved
last). Small models of four families: a permuted copy fuses back to the network (max abs logit
difference under 1e-4, float32 round-off on logits of order 1) by PFNM and OT, and independent
clients fuse by PFNM into a network that runs, its layers still timm's classes.
"""

import copy

import numpy as np
import pytest
import torch

import bayesfuse
from bayesfuse.inference.spec import permute, random_permutations
from bayesfuse.nets.graph_spec import spec_from_graph

timm = pytest.importorskip("timm")


def _random(name: str, seed: int) -> torch.nn.Module:
    """timm's ``name`` with its norms' scales, shifts and statistics away from 1 and 0, in eval mode."""
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    with torch.no_grad():
        for key, b in model.named_buffers():
            if key.endswith("running_mean"):
                b.normal_(0, 0.1)
            elif key.endswith("running_var"):
                b.uniform_(0.5, 1.5)
        for key, p in model.named_parameters():
            if p.dim() == 1 or "gamma" in key:
                p.uniform_(0.5, 1.5) if key.endswith("weight") or "gamma" in key else p.normal_(0, 0.1)
    return model.eval()


@pytest.mark.parametrize("name", ["lcnet_050", "mobilenetv3_small_050", "regnety_002", "convnext_atto"])
def test_timm_networks_fuse_back_and_fuse(name):
    x = torch.randn(4, 3, 64, 64)
    model = _random(name, 0)
    spec = spec_from_graph(model, x[:1])
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    permuted = copy.deepcopy(model)
    perms = random_permutations(spec.sizes(state), np.random.default_rng(1))
    permuted.load_state_dict({k: torch.as_tensor(v) for k, v in permute(state, spec, perms).items()})
    with torch.no_grad():
        reference = model(x)
        assert float((permuted(x) - reference).abs().max()) < 1e-4
        for method in ("pfnm", "ot"):
            fused = bayesfuse.fuse([model, permuted], method, example_input=x[:1]).model
            assert float((fused(x) - reference).abs().max()) < 1e-4, method
        fused = bayesfuse.fuse([_random(name, s) for s in (1, 2, 3)], "pfnm", example_input=x[:1]).model
        assert fused(x).shape == (4, 10)
        assert {type(m) for m in fused.modules()} == {type(m) for m in model.modules()}
