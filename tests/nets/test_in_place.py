"""Units the forward holds in place (bayesfuse.nets.graph_spec, PermutationSpec.in_place): a
rotary position embedding multiplies the queries and keys by ``cos`` and ``sin`` tables along
their features, which no permutation moves, so those features keep their order and width and
every method fuses them in place; the values, the stream and the MLPs are matched as before."""

import json

import torch

import bayesfuse
from bayesfuse.inference.spec_io import spec_from_dict, spec_to_dict
from bayesfuse.nets.graph_spec import spec_from_graph
from tests.helpers import permuted_copy
from tests.nets.user_nets import RotaryLM


def _model(seed: int) -> RotaryLM:
    torch.manual_seed(seed)
    model = RotaryLM().eval()
    with torch.no_grad():  # norms away from 1, so a wrong permutation of their weights shows
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 1:
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def test_rotary_queries_and_keys_stay_in_place_and_the_rest_is_matched():
    model = _model(0)
    spec = spec_from_graph(model)
    layer = "layers.0.attn."
    assert set(spec.in_place) == {f"layers.{i}.attn.{p}_proj" for i in (0, 1) for p in ("q", "k")}
    assert "numbers along their units that no permutation moves" in spec.in_place[layer + "q_proj"]
    # the queries' and keys' rows are no group's, their columns the stream's; the values' rows are permuted
    assert spec.axes[layer + "q_proj.weight"][0] is None and spec.axes[layer + "k_proj.weight"][0] is None
    assert spec.axes[layer + "q_proj.weight"][1] is not None and spec.axes[layer + "v_proj.weight"][0] is not None
    assert spec_from_dict(json.loads(json.dumps(spec_to_dict(spec)))).in_place == spec.in_place


def test_a_rotary_language_model_fuses_back_and_fuses():
    """A permuted copy (every group the spec lists permuted) computes the function and fuses back
    by each method; three independent ones fuse by PFNM with the stream and MLPs grown, the
    queries and keys at their width, and the report saying which units stayed in place."""
    x = torch.randint(0, 12, (3, 8))
    model = _model(0)
    spec = spec_from_graph(model)
    permuted = permuted_copy(model, spec, seed=1)
    with torch.no_grad():
        reference = model(x)
        assert float((permuted(x) - reference).abs().max()) < 1e-5
        for method in ("pfnm", "nafi", "ot"):
            fused = bayesfuse.fuse([model, permuted], method)
            assert float((fused.model(x) - reference).abs().max()) < 1e-4, method
            assert set(fused.hyper["in_place"]) == set(spec.in_place)
        fused = bayesfuse.fuse([_model(s) for s in (1, 2, 3)], "pfnm")
        net = fused.model
        attention = net.layers[0]["attn"]
        assert attention.q_proj.out_features == attention.k_proj.out_features == 16
        assert net.norm.weight.shape[0] > 16 and net.layers[0]["mlp"].gate_proj.out_features > 32
        assert net(x).shape == (3, 8, 12)
