"""Attention written head by head (bayesfuse.nets.attention), its traced spec, and every method on it.

The spec is checked by what it promises: permuting every group (the residual stream, each
head's query/key and value features, each MLP) and the heads of every block keeps the function
(float32 round-off, 1e-4 on logits of order 1); fusing permuted copies gives the function back.
The head alignment (bayesfuse.inference.heads) is checked against the permutations that made
the copies, and its descriptors against random permutations of everything else.
"""

import json
import warnings
from copy import deepcopy

import numpy as np
import pytest
import torch
from torch import nn

import bayesfuse
from bayesfuse.checkpoints import save_state_dict
from bayesfuse.cli import main
from bayesfuse.inference.heads import align_heads, head_descriptors, rename_heads
from bayesfuse.inference.result import ConvergenceWarning
from bayesfuse.inference.spec import permute, random_permutations, spec_from_dict, spec_to_dict
from bayesfuse.nets.arch import make_model
from bayesfuse.nets.attention import Head, HeadAttention, merge_heads, split_heads, split_state_dict, vit
from bayesfuse.nets.tracing import UnsupportedLayerError, spec_from_module
from tests.helpers import fused_both_ways
from tests.nets.test_graph_spec import _random as _random_user
from tests.nets.user_nets import Attention, Encoder, PreNormEncoder, SplitAttention

pytestmark = pytest.mark.usefixtures("one_thread")


def _random(seed: int, width: float = 0.5) -> nn.Module:
    """A ViT (stream 16, 4 heads of 4, MLP 32) with random weights and position embeddings of order 1."""
    torch.manual_seed(seed)
    model = vit(width=width)
    with torch.no_grad():
        model.pos.normal_()
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.3)
    return model.eval()


def _numpy(model: nn.Module) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def _loaded(model: nn.Module, state) -> nn.Module:
    copy = deepcopy(model)
    copy.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()})
    return copy.eval()


def _permuted(model: nn.Module, seed: int) -> tuple[nn.Module, dict]:
    """``model`` with every group and the heads of every block permuted at random, and the head orders."""
    spec = spec_from_module(model)
    rng = np.random.default_rng(seed)
    state = permute(_numpy(model), spec, random_permutations(spec.sizes(_numpy(model)), rng))
    orders = {heads: rng.permutation(len(heads)) for heads in spec.heads}
    assert all((o != np.arange(len(o))).any() for o in orders.values())
    return _loaded(model, rename_heads(state, spec, orders)), orders


def _gap(a: nn.Module, b: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


# --------------------------------------------------------------------------- the modules


@pytest.mark.parametrize("batch_first", [True, False])
def test_split_heads_computes_what_multihead_attention_computes(batch_first):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(12, 3, batch_first=batch_first).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    q, kv = torch.randn(4, 5, 12), torch.randn(4, 7, 12)  # cross-attention: 5 queries, 7 keys
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    split = split_heads(mha)
    assert isinstance(split, HeadAttention) and len(split.heads) == 3
    with torch.no_grad():
        assert torch.allclose(split(q, kv, kv)[0], mha(q, kv, kv, need_weights=False)[0], atol=1e-5)
    model = Attention()
    converted = split_heads(model)
    assert isinstance(model.attn, nn.MultiheadAttention)  # the caller's model is left as it was
    assert _gap(model.eval(), converted.eval(), torch.randn(3, 64)) < 1e-5
    with pytest.raises(ValueError, match="kdim = vdim = embed_dim"):
        split_heads(nn.MultiheadAttention(8, 2, kdim=4, vdim=4))


def test_the_vit_and_its_sizes():
    model = make_model("vit", 784, 10, width=1.0)
    assert model(torch.zeros(3, 784)).shape == (3, 10)
    assert model.pos.shape == (1, 16, 32) and model.embed.kernel_size == (7, 7)  # 16 patches of 7x7
    assert len(model.blocks) == 2 and all(len(b.attn.heads) == 4 for b in model.blocks)
    assert vit(64, 10)(torch.zeros(2, 64)).shape == (2, 10)  # 8x8 digits: patches of 2x2
    with pytest.raises(ValueError, match="not a multiple of the patch side"):
        from bayesfuse.nets.attention import VisionTransformer

        VisionTransformer(784, patch=5)


# --------------------------------------------------------------------------- the spec


def test_each_head_has_a_query_key_group_and_a_value_group():
    model = _random(0)
    spec = spec_from_module(model)
    stream = spec.axes["embed.weight"][0].group
    assert len(spec.heads) == 2 and all(len(h) == 4 for h in spec.heads)
    seen = set()
    for b in range(2):
        for h in range(4):
            p = f"blocks.{b}.attn.heads.{h}"
            qk, v = spec.axes[f"{p}.q.weight"][0].group, spec.axes[f"{p}.v.weight"][0].group
            assert spec.axes[f"{p}.k.weight"][0].group == qk  # tied by the product q k^T
            assert spec.axes[f"{p}.o.weight"] == (spec.axes["embed.weight"][0], spec.axes[f"{p}.v.weight"][0])
            assert spec.axes[f"{p}.q.weight"][1].group == stream and spec.head_groups(p) == [qk, v]
            assert not {qk, v} & seen and qk != v
            seen |= {qk, v}
        assert spec.axes[f"blocks.{b}.ln1.weight"][0].group == stream
    assert spec.axes["pos"][2].group == stream and spec.output == ("head.weight", "head.bias")
    assert len(spec.groups) == 1 + 2 * (8 + 1)  # the stream; per block 4 x (qk, v) and the MLP
    assert spec_from_dict(spec_to_dict(spec)) == spec


def test_heads_that_are_not_exchangeable_are_refused():
    spec = spec_to_dict(spec_from_module(_random(0)))
    spec["heads"] = [["blocks.0.attn.heads.0", "blocks.0.fc1"]]
    with pytest.raises(ValueError, match="must hold entries of the same names"):
        spec_from_dict(spec)
    spec["heads"] = [["blocks.0.attn.heads.0", "blocks.0.attn.heads.1"]]
    spec["axes"]["blocks.0.attn.heads.1.o.weight"] = [spec["axes"]["blocks.0.attn.heads.1.o.weight"][0], None]
    with pytest.raises(ValueError, match="is not permuted like"):
        spec_from_dict(spec)


def test_permuting_groups_and_heads_keeps_the_function():
    model = _random(0)
    x = torch.randn(8, 784)
    copy, _ = _permuted(model, 1)
    assert _gap(model, copy, x) < 1e-4
    # not vacuous: one head's query rows permuted alone (not its keys') change the function
    state = model.state_dict()
    key = "blocks.0.attn.heads.1.q.weight"
    assert _gap(model, _loaded(model, {**state, key: state[key].flip(0)}), x) > 1e-3


def test_multihead_attention_is_refused_with_the_way_out():
    with pytest.raises(UnsupportedLayerError, match=r"split_heads\(model\)") as err:
        spec_from_module(Attention())
    assert "\n" not in str(err.value)
    spec = spec_from_module(split_heads(Attention()))
    assert spec.heads == (("attn.heads.0", "attn.heads.1"),)


# --------------------------------------------------------------------------- head alignment


def test_descriptors_do_not_change_under_any_permutation_of_the_groups():
    model = _random(0)
    spec = spec_from_module(model)
    state = _numpy(model)
    moved = permute(state, spec, random_permutations(spec.sizes(state), np.random.default_rng(3)))
    for heads in spec.heads:
        for a, b in zip(head_descriptors(state, spec, heads), head_descriptors(moved, spec, heads)):
            for x, y in zip(a, b):
                assert np.allclose(x, y, rtol=1e-10, atol=1e-12)


def test_alignment_undoes_the_head_permutations_of_copies():
    model = _random(0)
    spec = spec_from_module(model)
    copies = [_permuted(model, s) for s in (1, 2, 3)]
    orders = align_heads([_numpy(model)] + [_numpy(c) for c, _ in copies], spec)
    for (_, made), found in zip(copies, orders[1:]):
        for heads, order in made.items():
            # the copy's position b holds original head order[b]; alignment must put it back at order[b]
            assert np.array_equal(order[found[heads]], np.arange(len(heads)))


# --------------------------------------------------------------------------- fusion


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
def test_permuted_copies_fuse_back_to_the_network(method):
    model = _random(0)
    x = torch.randn(8, 784)
    fused = bayesfuse.fuse([model, _permuted(model, 1)[0], _permuted(model, 2)[0]], method)
    assert _gap(model, fused.model, x) < 1e-4
    assert fused.sizes == list(spec_from_module(model).sizes(model.state_dict()).values())
    assert len(fused.hyper["head_orders"]) == 3 and set(fused.hyper["head_orders"][0]) == {
        "blocks.0.attn.heads",
        "blocks.1.attn.heads",
    }


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot", "fedavg"])
def test_client_order_does_not_matter(method):
    models = [_random(s) for s in range(3)]  # three different networks
    a, b = fused_both_ways(models, method)
    assert a.sizes == b.sizes
    assert _gap(a.model, b.model, torch.randn(8, 784)) == 0.0
    if method != "fedavg":
        assert a.hyper["head_orders"] == b.hyper["head_orders"][::-1]  # per client, in the caller's order


def test_heads_fused_to_other_widths_still_run():
    """Independent networks: PFNM grows each head's groups to widths of its own; the module takes them."""
    models = [_random(s) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fused = bayesfuse.fuse(models, "pfnm")
    heads = fused.model.blocks[0].attn.heads
    widths = [(h.q.out_features, h.v.out_features) for h in heads]
    assert any(w != (4, 4) for w in widths)
    assert all(h.scale == 0.5 for h in heads)  # the clients' 1/sqrt(4), not one of the fused width
    assert torch.isfinite(fused.model(torch.randn(5, 784))).all()


def test_a_users_attention_block_fuses_from_python_and_the_command_line(tmp_path, capsys):
    models = [_random_user(SplitAttention, s) for s in range(3)]
    paths = [str(save_state_dict(m.state_dict(), tmp_path / f"a{j}.pt")) for j, m in enumerate(models)]
    out = tmp_path / "fused.pt"
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(out)]) == 2  # names alone: refused
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--model MODULE:NAME" in err, err
    assert not out.exists()
    assert (
        main(["fuse", *paths, "--method", "pfnm", "--model", "tests.nets.user_nets:SplitAttention", "--out", str(out)])
        == 0
    )
    report = json.loads((tmp_path / "fused.pt.json").read_text())
    assert report["architecture"]["source"] == "traced from tests.nets.user_nets.SplitAttention"
    loaded = bayesfuse.load(out, like=SplitAttention())
    python = bayesfuse.fuse(models, "pfnm").model
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert float((loaded(x) - python(x)).abs().max()) < 1e-4


def test_fedma_starts_from_clients_whose_heads_are_aligned():
    from bayesfuse.fusion import _aligned_heads

    model = _random(0)
    spec = spec_from_module(model)
    copies = [_permuted(model, s)[0] for s in (1, 2)]
    aligned, report = _aligned_heads([model, *copies], spec)
    x = torch.randn(8, 784)
    for before, after in zip([model, *copies], aligned):
        assert _gap(before, after, x) < 1e-4  # moving whole heads keeps each client's function
    reference = head_descriptors(_numpy(model), spec, spec.heads[0])
    for after in aligned[1:]:
        for a, b in zip(head_descriptors(_numpy(after), spec, spec.heads[0]), reference):
            assert all(np.allclose(x, y, atol=1e-5) for x, y in zip(a, b))  # head h is the original's head h
    assert report[0] == {"blocks.0.attn.heads": [0, 1, 2, 3], "blocks.1.attn.heads": [0, 1, 2, 3]}


@pytest.mark.parametrize(
    "device, dtype, tol",
    [
        ("cpu", "float64", 1e-4),
        pytest.param(
            "cuda",
            "float32",
            1e-3,
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
        ),
    ],
)
def test_the_matching_on_a_torch_device_gives_the_same_network(device, dtype, tol):
    """The heads are aligned on the host either way; the matching's arithmetic moves (float32 on a
    GPU: logits agree to float32 round-off accumulated over the layers, hence 1e-3)."""
    model = _random(0)
    clients = [model, _permuted(model, 1)[0], _permuted(model, 2)[0]]
    host = bayesfuse.fuse(clients, "pfnm")
    moved = bayesfuse.fuse(clients, "pfnm", device=device, dtype=dtype)
    assert moved.sizes == host.sizes
    assert _gap(host.model, moved.model, torch.randn(8, 784)) < tol


def test_masks_mean_what_they_mean_to_multihead_attention():
    torch.manual_seed(0)
    for batch_first in (True, False):
        mha = nn.MultiheadAttention(8, 2, batch_first=batch_first).eval()
        split = split_heads(mha)
        x = torch.randn(3, 5, 8) if batch_first else torch.randn(5, 3, 8)
        causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
        padding = torch.zeros(3, 5, dtype=torch.bool)
        padding[:, 3:] = True
        cases = [
            dict(attn_mask=causal),
            dict(key_padding_mask=padding),
            dict(attn_mask=causal, key_padding_mask=padding),
            dict(attn_mask=torch.randn(5, 5)),  # a float mask is added to the scores
        ]
        with torch.no_grad():
            for kw in cases:
                gap = (mha(x, x, x, need_weights=False, **kw)[0] - split(x, x, x, **kw)[0]).abs().max()
                assert gap < 1e-5, kw
            causal_gap = (
                mha(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)[0] - split(x, is_causal=True)[0]
            )
            assert causal_gap.abs().max() < 1e-5
            single = torch.randn(5, 8)  # unbatched (L, E), whatever batch_first says
            assert (mha(single, single, single)[0] - split(single)[0]).abs().max() < 1e-5
    with pytest.raises(ValueError, match="2-D attn_mask"):
        split(x, attn_mask=torch.zeros(6, 5, 5, dtype=torch.bool))


def _heads_spec(**extra):
    """Two heads of query/key group qkH and value group vH over a stream T, as a dict."""
    axes = {}
    for h in (0, 1):
        axes[f"a.{h}.q.weight"] = [f"qk{h}", "T"]
        axes[f"a.{h}.k.weight"] = [f"qk{h}", "T"]
        axes[f"a.{h}.v.weight"] = [f"v{h}", "T"]
        axes[f"a.{h}.o.weight"] = ["T", f"v{h}"]
    axes["embed.weight"] = ["T", None]
    axes.update(extra)
    return {"axes": axes, "heads": [["a.0", "a.1"]]}


def test_head_sets_are_checked_and_their_groups_paired_by_name():
    spec = spec_from_dict(_heads_spec())
    assert spec.head_groups("a.0") == ["qk0", "v0"] and spec.head_groups("a.1") == ["qk1", "v1"]
    listed = _heads_spec()
    listed["axes"] = dict(reversed(list(listed["axes"].items())))  # another order of the entries
    spec = spec_from_dict(listed)
    assert spec.head_groups("a.0") == ["qk0", "v0"] and spec.head_groups("a.1") == ["qk1", "v1"]
    with pytest.raises(ValueError, match="is not permuted like"):  # head 0's values also read outside it
        spec_from_dict(_heads_spec(**{"out.weight": [None, "v0"]}))
    tied = _heads_spec()
    tied["axes"]["a.1.k.weight"] = ["v1", "T"]  # head 1 ties its keys to its values, head 0 does not
    with pytest.raises(ValueError, match="does not tie its groups as head"):
        spec_from_dict(tied)
    from bayesfuse.inference.spec import chain, dense

    joined = chain(spec_from_dict(_heads_spec()), dense("fc", "T", None))
    assert joined.heads == (("a.0", "a.1"),)


class _SDPA(nn.Module):
    """Two heads written with scaled_dot_product_attention, over a residual stream."""

    def __init__(self, scale: float | None = 0.5) -> None:
        super().__init__()
        from bayesfuse.nets.attention import Heads

        self.embed = nn.Linear(16, 8)
        self.heads = Heads(
            nn.ModuleDict(dict(q=nn.Linear(8, 4), k=nn.Linear(8, 4), v=nn.Linear(8, 4), o=nn.Linear(4, 8)))
            for _ in range(2)
        )
        self.head = nn.Linear(8, 10)
        self.scale = scale

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.embed(x.view(-1, 4, 16))
        out = t
        for h in self.heads:  # in parallel: every head reads t, their outputs are summed
            a = torch.nn.functional.scaled_dot_product_attention(h["q"](t), h["k"](t), h["v"](t), scale=self.scale)
            out = out + h["o"](a)
        return self.head(out.mean(dim=1))


def test_scaled_dot_product_attention_needs_its_scale():
    """Without ``scale=`` it scales by the queries' width: the spec says the forward fixes that
    width: PFNM matches the queries' units at that width (the other groups grow) and OT, which keeps
    every width, fuses it."""
    unscaled = [_SDPA(scale=None).eval() for _ in range(2)]
    spec = spec_from_module(unscaled[0])
    queries = {spec.axes[f"{h}.q.weight"][0].group for h in spec.heads[0]}
    assert set(spec.fixed) == queries and len(queries) == 2
    assert set(spec.fixed.values()) == {"scaled_dot_product_attention without scale= scales by the queries' width"}
    fused = bayesfuse.fuse(unscaled, "pfnm")
    sizes = dict(zip(fused.groups, fused.sizes))
    assert fused.hyper["fixed"] == spec.fixed and all(
        sizes[g] == unscaled[0].heads[0]["q"].out_features for g in queries
    )
    assert fused.model(torch.randn(6, 64)).shape == (6, 10)
    assert bayesfuse.fuse(unscaled, "ot").model(torch.randn(6, 64)).shape == (6, 10)
    torch.manual_seed(0)
    model = _SDPA().eval()
    spec = spec_from_module(model)
    assert spec.axes["heads.0.q.weight"][0] == spec.axes["heads.0.k.weight"][0] and len(spec.heads) == 1
    copy, _ = _permuted(model, 1)
    fused = bayesfuse.fuse([model, copy], "pfnm")
    assert _gap(model, fused.model, torch.randn(6, 64)) < 1e-4


class _Sequential(_SDPA):
    """The same heads applied one after another: not exchangeable."""

    def forward(self, x):
        t = self.embed(x.view(-1, 4, 16))
        for h in self.heads:
            a = torch.nn.functional.scaled_dot_product_attention(h["q"](t), h["k"](t), h["v"](t), scale=self.scale)
            t = t + h["o"](a)
        return self.head(t.mean(dim=1))


def test_heads_applied_one_after_another_are_refused():
    with pytest.raises(UnsupportedLayerError, match="heads must run in parallel") as err:
        spec_from_module(_Sequential())
    assert "'heads.1'" in str(err.value) and "'heads.0'" in str(err.value)


# --------------------------------------------------------------------------- nn.MultiheadAttention in a user's network


@pytest.mark.parametrize("bias", [True, False])
def test_split_state_dict_is_the_state_of_split_heads_at_any_width(bias):
    torch.manual_seed(0)
    like = nn.Sequential(nn.MultiheadAttention(16, 2, bias=bias))  # the template: 16 wide
    wider = nn.Sequential(nn.MultiheadAttention(24, 2, bias=bias))  # a file of another width
    expected = split_heads(wider).state_dict()
    got = split_state_dict(like, wider.state_dict())
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match=r"E a multiple of 2"):
        split_state_dict(like, nn.Sequential(nn.MultiheadAttention(9, 1)).state_dict())


@pytest.mark.parametrize("batch_first", [True, False])
def test_merge_heads_undoes_split_heads(batch_first):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.MultiheadAttention(12, 3, batch_first=batch_first)).eval()
    merged = merge_heads(split_heads(model), model)
    assert isinstance(merged[1], nn.MultiheadAttention) and merged[1].batch_first == batch_first
    state = model.state_dict()
    assert list(merged.state_dict()) == list(state)
    assert all(torch.equal(merged.state_dict()[k], state[k]) for k in state)


def test_an_attention_held_under_two_names_is_split_and_merged_as_one_module():
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.MultiheadAttention(8, 2, batch_first=True)})
    model["b"] = model["a"]
    split = split_heads(model)
    assert isinstance(split["a"], HeadAttention) and split["a"] is split["b"]
    merged = merge_heads(split, model)
    assert isinstance(merged["a"], nn.MultiheadAttention) and merged["a"] is merged["b"]


class _AttentionHeldTwice(nn.Module):
    """An attention module held under two names and called under one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Linear(16, 8), nn.Linear(8, 3)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True)
        self.blocks = nn.ModuleDict({"one": self.att})

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = self.emb(x.view(-1, 4, 16))
        return self.head((h + self.att(h, h, h, need_weights=False)[0]).mean(1))


def test_an_attention_held_under_two_names_fuses_as_one_module():
    """Its heads' entries under the second name are aliases (spec.tied), no head's own: every
    method fuses it, a permuted copy back to the network."""
    models = [_random_user(_AttentionHeldTwice, s) for s in range(3)]
    x = torch.randn(5, 64)
    for method in ("pfnm", "ot", "fedavg"):
        fused = bayesfuse.fuse(models, method).model
        assert fused.att is fused.blocks["one"] and fused(x).shape == (5, 3)
    split = split_heads(models[0])
    spec = spec_from_module(split)
    state = {k: v.detach().numpy() for k, v in split.state_dict().items()}
    copy = deepcopy(split)
    copy.load_state_dict(
        {
            k: torch.as_tensor(v)
            for k, v in permute(state, spec, random_permutations(spec.sizes(state), np.random.default_rng(0))).items()
        }
    )
    with torch.no_grad():
        assert float((copy(x) - models[0](x)).abs().max()) < 1e-5
        assert float((bayesfuse.fuse([models[0], copy], "pfnm").model(x) - models[0](x)).abs().max()) < 1e-5


class _AttentionAppliedTwice(_AttentionHeldTwice):
    def forward(self, x):
        h = self.emb(x.view(-1, 4, 16))
        h = h + self.att(h, h, h, need_weights=False)[0]
        return self.head((h + self.blocks["one"](h, h, h, need_weights=False)[0]).mean(1))


def test_an_attention_applied_twice_is_refused_saying_so():
    with pytest.raises(
        UnsupportedLayerError, match=r"the attention whose heads are 'att.heads.0', ... is applied more"
    ):
        bayesfuse.fuse([_random_user(_AttentionAppliedTwice, s) for s in range(2)], "pfnm")


def test_merge_heads_refuses_heads_multihead_attention_cannot_hold():
    torch.manual_seed(0)
    model = Attention()
    split = split_heads(model)
    wide = HeadAttention(16, 2, 8)
    wide.heads[1] = Head(16, 8, 10, scale=wide.heads[0].scale)  # one head's values wider
    split.attn = wide
    with pytest.raises(ValueError, match=r"attn: head 1 has query/key/value widths \(8, 8, 10\)"):
        merge_heads(split, model)
    rescaled = split_heads(model)
    rescaled.attn.heads[0].scale = 0.5
    with pytest.raises(ValueError, match=r"head 0 scales its scores by 0.5"):
        merge_heads(rescaled, model)
    plain = nn.Sequential(nn.MultiheadAttention(8, 2, bias=False))
    biased = split_heads(plain)
    with torch.no_grad():
        biased[0].bias.fill_(0.1)
    with pytest.raises(ValueError, match=r"has none \(bias=False\)"):
        merge_heads(biased, plain)


def test_fuse_splits_multihead_attention_and_merges_it_back_where_it_can():
    mha = [_random_user(Attention, s) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fused = bayesfuse.fuse(mha, "pfnm")
        # the same fusion of the split networks' states, in the order fuse took them
        split = [split_heads(mha[j]) for j in fused.hyper["fused_order"]]
        states = [{k: v.detach().double().numpy() for k, v in m.state_dict().items()} for m in split]
        reference = bayesfuse.fuse_states(states, "pfnm", spec=spec_from_module(split[0])).state
    assert isinstance(fused.model.attn, HeadAttention)  # fused heads of other widths
    assert "kept as HeadAttention" in fused.hyper["attention"]
    state = fused.model.state_dict()
    assert set(state) == set(reference)
    assert all(np.allclose(state[k].numpy(), reference[k], atol=1e-6) for k in reference)
    averaged = bayesfuse.fuse(mha, "fedavg")
    assert isinstance(averaged.model.attn, nn.MultiheadAttention)
    assert "merged back" in averaged.hyper["attention"]
    mean = {k: sum(m.state_dict()[k] for m in mha) / 3 for k in mha[0].state_dict()}
    assert all(torch.allclose(averaged.model.state_dict()[k], mean[k], atol=1e-6) for k in mean)
    assert all(isinstance(m.attn, nn.MultiheadAttention) for m in mha)  # the callers' models unchanged


def test_files_of_a_multihead_attention_network_fuse_with_the_network_given(tmp_path, capsys):
    models = [_random_user(Attention, s) for s in range(3)]
    paths = [str(save_state_dict(m.state_dict(), tmp_path / f"a{j}.pt")) for j, m in enumerate(models)]
    out = tmp_path / "fused.pt"
    assert main(["fuse", *paths, "--method", "pfnm", "--out", str(out)]) == 2  # names alone: refused
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nn.MultiheadAttention" in err and "--model MODULE:NAME" in err, err
    assert not out.exists()
    model = "tests.nets.user_nets:Attention"
    assert main(["fuse", *paths, "--method", "pfnm", "--model", model, "--out", str(out)]) == 0
    note = json.loads((tmp_path / "fused.pt.json").read_text())["hyper"]["attention"]
    assert "written as HeadAttention" in note and "bayesfuse.load(path, like=Attention(...))" in note, note
    loaded = bayesfuse.load(out, like=Attention())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        python = bayesfuse.fuse(models, "pfnm").model
    x = torch.randn(16, 64)
    with torch.no_grad():
        assert float((loaded(x) - python(x)).abs().max()) < 1e-4
    # FedAvg keeps the widths: the file is the network's own state_dict, nn.MultiheadAttention's entries
    avg = tmp_path / "avg.pt"
    assert main(["fuse", *paths, "--method", "fedavg", "--model", model, "--out", str(avg)]) == 0
    plain = Attention()
    plain.load_state_dict(torch.load(avg, weights_only=True))
    loaded = bayesfuse.load(avg, like=Attention())
    assert isinstance(loaded.attn, nn.MultiheadAttention)
    with torch.no_grad():
        assert float((plain.eval()(x) - loaded(x)).abs().max()) == 0.0


# --------------------------------------------------------------------------- PyTorch's transformer modules


def _user_permuted(model: nn.Module, seed: int) -> nn.Module:
    """``model`` (the user's form, nn.MultiheadAttention inside) with every group permuted at random
    and the heads of every layer in reverse order (two heads: a random order may keep them)."""
    split = split_heads(model)
    spec = spec_from_module(split)
    state = permute(_numpy(split), spec, random_permutations(spec.sizes(_numpy(split)), np.random.default_rng(seed)))
    state = rename_heads(state, spec, {heads: np.arange(len(heads))[::-1] for heads in spec.heads})
    return merge_heads(_loaded(split, state), model).eval()


@pytest.mark.parametrize("cls", [Encoder, PreNormEncoder])
def test_pytorch_encoder_layers_are_traced_through_with_the_same_function(cls):
    """nn.TransformerEncoderLayer's forward (and nn.TransformerEncoder's) cannot be traced: split_heads
    gives them their reference path. The original runs its fused fast path in eval mode (post-norm),
    the split copy the reference path: the same function to float32 round-off."""
    model = _random_user(cls, 0)
    split = split_heads(model)
    x = torch.randn(8, 64)
    assert _gap(model, split, x) < 1e-5
    spec = spec_from_module(split)
    assert len(spec.heads) == 2  # one set of heads per encoder layer
    back = merge_heads(split, model)
    assert type(back.encoder) is nn.TransformerEncoder
    assert all(type(layer) is nn.TransformerEncoderLayer for layer in back.encoder.layers)
    assert all(isinstance(layer.self_attn, nn.MultiheadAttention) for layer in back.encoder.layers)
    assert _gap(model, back, x) == 0.0
    assert type(model.encoder.layers[0]) is nn.TransformerEncoderLayer  # the caller's model unchanged


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
def test_permuted_copies_of_pytorch_encoder_layers_fuse_back(method):
    model = _random_user(Encoder, 0)
    copies = [model, _user_permuted(model, 1), _user_permuted(model, 2)]
    x = torch.randn(8, 64)
    for c in copies[1:]:  # the same function from entries that moved
        assert _gap(model, c, x) < 1e-4
        moved = [k for k, v in c.state_dict().items() if not torch.allclose(v, model.state_dict()[k])]
        assert any("self_attn.in_proj_weight" in k for k in moved) and any("linear1" in k for k in moved)
    fused = bayesfuse.fuse(copies, method)
    assert _gap(model, fused.model, x) < 1e-4
    layers = fused.model.encoder.layers
    assert all(type(layer) is nn.TransformerEncoderLayer for layer in layers)
    assert all(isinstance(layer.self_attn, nn.MultiheadAttention) for layer in layers)  # merged back
    assert set(fused.model.state_dict()) == set(model.state_dict())


def test_independent_pytorch_encoders_fuse_to_a_network_that_runs_and_trains():
    models = [_random_user(Encoder, s) for s in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        a, b = fused_both_ways(models, "pfnm")
    x = torch.randn(8, 64)
    assert _gap(a.model, b.model, x) == 0.0
    layer = a.model.encoder.layers[0]
    assert type(layer) is nn.TransformerEncoderLayer and isinstance(layer.self_attn, HeadAttention)
    assert "kept as HeadAttention" in a.hyper["attention"]
    assert torch.isfinite(a.model(x)).all()
    a.model.train()  # off the fast path too, and gradients reach every head
    a.model(x).square().mean().backward()
    assert layer.self_attn.heads[0].q.weight.grad is not None


def test_files_of_pytorch_encoders_fuse_and_load_with_the_network_given(tmp_path, capsys):
    models = [_random_user(Encoder, s) for s in range(3)]
    paths = [str(save_state_dict(m.state_dict(), tmp_path / f"e{j}.pt")) for j, m in enumerate(models)]
    out = tmp_path / "fused.pt"
    assert (
        main(["fuse", *paths, "--method", "fedavg", "--model", "tests.nets.user_nets:Encoder", "--out", str(out)]) == 0
    )
    loaded = bayesfuse.load(out, like=Encoder())
    assert type(loaded.encoder.layers[1]) is nn.TransformerEncoderLayer
    mean = {k: sum(m.state_dict()[k] for m in models) / 3 for k in models[0].state_dict()}
    plain = Encoder()
    plain.load_state_dict(mean)
    x = torch.randn(8, 64)
    assert _gap(plain.eval(), loaded, x) < 1e-6
    matched = tmp_path / "matched.pt"  # fused heads of other widths: HeadAttention inside PyTorch's layers
    assert (
        main(["fuse", *paths, "--method", "pfnm", "--model", "tests.nets.user_nets:Encoder", "--out", str(matched)])
        == 0
    )
    loaded = bayesfuse.load(matched, like=Encoder())
    layer = loaded.encoder.layers[0]
    assert type(layer) is nn.TransformerEncoderLayer and isinstance(layer.self_attn, HeadAttention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        python = bayesfuse.fuse(models, "pfnm").model
    assert _gap(python, loaded, x) < 1e-4
