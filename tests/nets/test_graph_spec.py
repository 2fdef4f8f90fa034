"""Specs traced from a module's forward with torch.fx (bayesfuse.nets.graph_spec).

Each traced spec is checked by what it promises: permuting every group of a network by the spec
leaves its function unchanged (to float32 round-off, 1e-4 on logits of order 1), and fusing a
network with a permuted copy of itself gives back that function, for every matching method.
"""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import bayesfuse
from bayesfuse.data import Dataset
from bayesfuse.inference.spec import Axis, permute, random_permutations
from bayesfuse.nets.graph_spec import example_input_for, spec_from_graph
from bayesfuse.nets.tracing import UnsupportedLayerError, spec_from_module
from tests.helpers import far_from_identity_norms, library_randomised, permuted_copy, randomise
from tests.nets.user_nets import (
    ArgmaxUnits,
    Attention,
    BagOfWords,
    BatchNormAct2d,
    BatchStatsMLP,
    BiasFreeCNN,
    BiasFreePlainNormCNN,
    BiEnds,
    BilinearNet,
    BiLSTM,
    BiStateLSTM,
    BlurredCNN,
    CausalAttention,
    CausalWhere,
    ConcatCNN,
    ConvNeXtLike,
    DenseBasic,
    DenseBlockCNN,
    DepthwiseCNN,
    DepthwiseMultiplierCNN,
    EinsumAttention,
    EinsumScale,
    GatedNet,
    GatedStream,
    GateThenHeads,
    GroupedCNN,
    GroupedUpConv,
    GroupNormCNN,
    GroupNormSiLU,
    GroupNormSkip,
    InceptionMLP,
    InputsFirstMLP,
    KeywordOps,
    LayerNorm2d,
    LayerScaleCNN,
    LlamaMLP,
    LogSoftmaxMLP,
    MixerBlock,
    MyGRU,
    MyLSTM,
    MyMLP,
    MyRNN,
    NanoGPT,
    OwnGroupNormCNN,
    OwnLinear,
    PaddedCNN,
    PairInputs,
    PlainNormMLP,
    ProjectedLSTM,
    QKVAttention,
    ReducedCNN,
    ResMLP,
    ShapeOfAttention,
    SharedBlocks,
    SharedModule,
    ShiftedWindows,
    SkipCNN,
    SlopesCNN,
    SplitAttention,
    SqueezeExcite,
    StackedLSTM,
    StackedStateLSTM,
    TiedFoldCNN,
    TiedGPT,
    TimmStyleCNN,
    TokenConcat,
    TokenMixer,
    TransposedConv,
    TwoOutputs,
    UnequalSplit,
    UNetLike,
    UpConv1d,
    UpConvUNet,
    VectorNormMLP,
    ViewHeadsAttention,
    VolumeCNN,
)

NETS = [
    MyMLP,
    ResMLP,
    SkipCNN,
    TokenMixer,
    SplitAttention,
    MyLSTM,
    MyGRU,
    StackedLSTM,
    BiasFreeCNN,
    BiasFreePlainNormCNN,
    SlopesCNN,
    CausalAttention,  # a mask buffer is not a layer: traced, not refused
    CausalWhere,
    BlurredCNN,  # nor is a fixed filter applied with F.conv2d
    LogSoftmaxMLP,  # what follows the output layer keeps its classes
    TransposedConv,  # units moved by .mT
    PlainNormMLP,  # a batch norm without scale, folded
    BatchStatsMLP,  # one without running statistics, not folded
    DepthwiseCNN,
    PaddedCNN,  # element-wise functions of numbers, padding and upsampling of the maps
    LayerScaleCNN,  # a vector shaped to the maps follows the channels
    ReducedCNN,  # normalize, maximum, max with indices, logsumexp, std, amin, norms
    MyRNN,
    BiLSTM,  # both directions' units, side by side
    ConcatCNN,  # streams of one width concatenated on their units
    KeywordOps,  # operands by keyword, fx's constants, attention pooling over a bidirectional layer
    BiStateLSTM,  # torch.cat([h_n[-2], h_n[-1]], 1)
    BiEnds,  # one direction sliced out of the output: out[:, -1, :H]
    GatedNet,  # chunk, split and glu of the units into equal pieces
    GatedStream,  # a stream cut into pieces, then written to; an LSTM's units in pairs
    QKVAttention,  # heads written by hand: reshape(B, N, 3, heads, -1), merged back at the stream's width
    ViewHeadsAttention,  # q.view(B, N, heads, C // heads), C read off the stream
    GroupedCNN,  # convolutions of 4 and 2 groups
    BilinearNet,  # nn.Bilinear of two branches, and of one stream with itself
    SharedBlocks,  # modules called again after their units were cut
    ProjectedLSTM,  # proj_size: the projection's units a permutation of their own
    DenseBlockCNN,  # streams of different widths concatenated, the input among them; norms over them
    InceptionMLP,  # branches of different widths, flattened; the input beside hidden units
    DenseBasic,  # a layer's output only concatenated: its width read off its rows
    TokenConcat,  # tokens' features side by side, transposed, padded, averaged; an empty part
    UNetLike,  # F.interpolate, F.pad by sizes read off the maps, a skip of another width concatenated
    UpConvUNet,  # transposed convolutions: their units on the weight's axis 1; one reads streams side by side
    UpConv1d,  # a transposed convolution reading the input
    VolumeCNN,  # 3-d convolutions, transposed too, batch and instance norms, pooling, padding, dropout
    GroupNormCNN,  # group norms of several groups: one permutation within a group serves every group
    LlamaMLP,  # RMSNorm pre-norms and SwiGLU feed-forwards on a residual stream
    SqueezeExcite,  # channel gates computed from the pooled maps
    ConvNeXtLike,  # F.layer_norm in a LayerNorm subclass of one's own, a layer scale of shape (C, 1, 1)
    OwnGroupNormCNN,  # F.group_norm in a GroupNorm subclass, of 4 groups and of one per channel
    TimmStyleCNN,  # F.batch_norm with its activation in a BatchNorm2d subclass, F.linear in a Linear one
    ShiftedWindows,  # F.pad and torch.roll along the positions of channels-last maps, torch.addcmul
    MixerBlock,  # a Linear across the tokens, its units kept in place
    DepthwiseMultiplierCNN,  # two depthwise filters per channel
    EinsumAttention,  # einsum for scores, values, a gate (an ellipsis) and a number (implicit output)
    GateThenHeads,  # a stream's group made anew (cut into heads) after a layer reading it
    SharedModule,  # one module held under two names
    GroupedUpConv,  # transposed convolutions of 4 groups and depthwise
    TiedFoldCNN,  # no batch norm folded into a weight used elsewhere (tied, or a layer applied twice)
    EinsumScale,  # a layer scale by einsum with a parameter vector; swapaxes by keyword
    ShapeOfAttention,  # heads merged back by reshape(t.shape)
    UnequalSplit,  # units split into pieces of different widths, each a group of its own
    VectorNormMLP,  # F.layer_norm(x, self.weight.shape, ...), nanoGPT's LayerNorm
]


def _random(cls, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = cls()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in ("cls", "pos"):
                p.normal_()
    return far_from_identity_norms(model).eval()


def _permuted(model: nn.Module, seed: int) -> nn.Module:
    spec = spec_from_module(model)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    perms = random_permutations(spec.sizes(state), np.random.default_rng(seed))
    copy = type(model)()
    copy.load_state_dict({k: torch.as_tensor(v) for k, v in permute(state, spec, perms).items()})
    return copy.eval()


def _kept_fixed(fused, spec, model: nn.Module) -> bool:
    """Whether a fusion by a method that changes widths (PFNM, NAFI) matched the groups whose width
    ``model``'s forward fixes at that width, and says so (``hyper["fixed"]``)."""
    sizes, clients = dict(zip(fused.groups, fused.sizes)), spec.sizes(model.state_dict())
    return fused.hyper["fixed"] == spec.fixed and all(sizes[g] == clients[g] for g in spec.fixed)


def _gap(a: nn.Module, b: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((a(x) - b(x)).abs().max())


def test_residual_streams_share_one_permutation():
    spec = spec_from_graph(ResMLP())
    stream = spec.axes["stem.weight"][0].group
    for b in range(2):
        assert spec.axes[f"blocks.{b}.fc2.weight"][0].group == stream  # writes into the stream
        assert spec.axes[f"blocks.{b}.fc1.weight"][1].group == stream  # reads it
        assert spec.axes[f"blocks.{b}.norm.weight"][0].group == stream
    assert spec.axes["blocks.0.fc1.weight"][0].group != spec.axes["blocks.1.fc1.weight"][0].group
    assert spec.axes["head.weight"][0] is None and spec.output == ("head.weight", "head.bias")
    assert len(spec.groups) == 3


def test_skip_cnn_folds_and_flatten_blocks():
    spec = spec_from_graph(SkipCNN())
    assert spec.folds == {"bn0": "conv0", "bn1": "conv1", "bn2": "conv2"}
    assert spec.axes["conv2.weight"][0].group == spec.axes["conv0.weight"][0].group
    assert spec.axes["fc.weight"][1].inner == 16  # channel c's 4x4 pixels, contiguous after flatten


def test_class_token_and_position_embedding_follow_the_stream():
    spec = spec_from_graph(TokenMixer())
    stream = spec.axes["embed.weight"][0].group
    assert spec.axes["cls"] == (None, None, spec.axes["cls"][2]) and spec.axes["cls"][2].group == stream
    assert spec.axes["pos"][2].group == stream


@pytest.mark.parametrize("cls", NETS)
def test_permuting_by_the_traced_spec_keeps_the_function(cls):
    model = _random(cls, 0)
    x = torch.randn(20, 64)
    assert _gap(model, _permuted(model, 1), x) < 1e-4
    # and the spec is not vacuous: permuting one group's rows alone changes the function
    spec = spec_from_module(model)
    state = model.state_dict()
    first = next(
        k for k, v in spec.axes.items() if v and v[0] is not None and k.rpartition(".")[2].startswith("weight")
    )
    broken = type(model)()
    broken.load_state_dict({**state, first: state[first].flip(0)})
    assert _gap(model, broken.eval(), x) > 1e-3


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
@pytest.mark.parametrize("cls", NETS)
def test_a_permuted_copy_fuses_back_to_the_network(cls, method):
    model = _random(cls, 0)
    x = torch.randn(20, 64)
    fused = bayesfuse.fuse([model, _permuted(model, 2)], method)
    assert _gap(model, fused.model, x) < 1e-4


def test_independent_residual_networks_fuse_into_one_that_runs():
    models = [_random(ResMLP, s) for s in range(3)]
    a = bayesfuse.fuse(models, "pfnm")
    assert a.sizes[0] > 32  # the stream grows: units of different clients stay apart
    assert a.model.norm.weight.shape == (a.sizes[0],)  # the LayerNorm was rebuilt at the stream's width
    assert a.model.blocks[1]["fc2"].weight.shape == (a.sizes[0], a.sizes[2])
    assert a.model(torch.randn(5, 64)).shape == (5, 10)


class _ConcatInput(nn.Module):
    """The input beside hidden units on one axis: the input's features are never permuted."""

    def __init__(self, widths=(64, 12)) -> None:
        super().__init__()
        self.fc, self.other, self.head = nn.Linear(64, widths[1]), nn.Linear(64, widths[0]), nn.Linear(sum(widths), 3)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return self.head(torch.cat([x if self.other.out_features == 64 else self.other(x), h], 1))


class _SideBySide(nn.Module):
    """Streams concatenated on their units read where they cannot be followed: ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.fc, self.a, self.b = how, nn.Linear(64, 12), nn.Conv1d(1, 4, 1), nn.Conv1d(1, 6, 1)
        self.head, self.conv = nn.Linear(76, 3), nn.Conv1d(10, 4, 1, groups=2)

    def forward(self, x):
        h = torch.cat([x, torch.relu(self.fc(x))], 1)
        if self.how == "rolled":
            return self.head(torch.roll(h, 1, 1))
        if self.how == "added":
            return self.head(h + torch.cat([torch.relu(self.fc(x)), x], 1))
        if self.how == "padded":  # F.pad of the last axis of (B, C): the units'
            return self.head(F.pad(h, (1, 1))[:, 1:-1])
        if self.how == "pooled alone":  # (B, C) read by a 1-d pooling as one map of C channels... of length C
            return self.head(torch.cat([x, F.max_pool1d(torch.relu(self.fc(x)), 3, 1, 1)], 1))
        t = x.view(-1, 1, 64)
        if self.how == "pooled":  # (B, C, L) read by a 2-d pooling as one map without its batch
            return F.max_pool2d(torch.cat([self.a(t), self.b(t)], 1), 3, 1, 1).mean((1, 2), keepdim=True)
        if self.how == "other axes":  # streams side by side on axis 1, then concatenated on axis 2
            return torch.cat([torch.cat([self.a(t), self.b(t)], 1), t.expand(-1, 10, -1)], 2).mean((1, 2))
        return self.conv(torch.cat([self.a(t), self.b(t)], 1)).mean((1, 2), keepdim=True) + self.head(h)


class _Reads(nn.Module):
    """What a forward reads of its units that names them by place or cannot be read: ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.fc, self.head = how, nn.Linear(64, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if self.how == "indices concatenated":
            r = h.max(1, keepdim=True)
            return self.head(h) + torch.cat([r.values, r.indices.float()], 1).sum(1, keepdim=True)
        if self.how == "a computed dim":
            return self.head(h) + h.mean(h.dim() - 1, keepdim=True)
        return self.head(torch.roll(input=h, shifts=1, dims=-1))  # an operand by keyword


class _GivenState(MyLSTM):
    def forward(self, x):
        h0 = torch.zeros(1, x.shape[0], 12)  # the tutorials' zeros, of the clients' width
        _, (h, _) = self.rnn(x.view(-1, 8, 8), (h0, h0))
        return self.head(h[-1])


class _HandWritten(nn.Module):
    """A hidden layer applied by hand: its units are the columns of a parameter the walk cannot see."""

    def __init__(self, how: str = "tensordot", frozen: bool = False) -> None:
        super().__init__()
        self.how = how
        shape = (4, 6) if how == "tensordot" else (6, 4)
        self.W = nn.Parameter(torch.randn(*shape), requires_grad=not frozen)
        self.head = nn.Linear(6, 2)

    def example_input(self):
        return torch.zeros(2, 4)

    def forward(self, x):
        if self.how == "tensordot":
            h = torch.tensordot(x, self.W, dims=1)
        elif self.how == "linear":
            h = torch.nn.functional.linear(x, self.W)
        elif self.how == "linear of .T.T":  # a view of the weight is the weight
            h = torch.nn.functional.linear(x, self.W.T.T)
        elif self.how == "x @ W.T":  # the input is not permuted: nothing else would see the layer
            h = x @ self.W.T
        elif self.how == "einsum":
            h = torch.einsum("bi,oi->bo", x, self.W)
        elif self.how == "einsum of W.T":
            h = torch.einsum("io,bi->bo", self.W.T, x)
        else:
            h = torch.matmul(x, self.W.t().contiguous())
        return self.head(torch.relu(h))


class _RowsPicked(nn.Module):
    """Rows of a table picked by the units (``self.E[h.argmax(-1)]``, ``self.E[torch.where(h > 0, 1, 0)]``):
    the picks follow the units' places, which fusion moves."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc, self.E = nn.Linear(64, 12), nn.Parameter(torch.randn(12, 5))
        if how == "other":
            self.other = nn.Linear(64, 12)
        self.head = nn.Linear({"input": 1, "other": 2}.get(how, 5), 10)

    def forward(self, x):
        h = F.relu(self.fc(x))
        if self.how == "argmax":
            return self.head(self.E[h.argmax(-1)])
        if self.how == "in a list":
            return self.head(self.E[[h.argmax(-1)]])
        if self.how == "input":  # the input's numbers, picked by the units
            return self.head(x[torch.arange(x.shape[0]), h.argmax(-1)][:, None])
        if self.how == "other":  # units of another stream, picked by these
            return self.head(F.relu(self.other(x))[:, h.topk(2).indices[0]])
        return self.head(self.E[torch.where(h > 0, 1, 0)].mean(1))


class _Ordered(nn.Module):
    """Order statistics of the units (``topk``, ``sort``, ``kthvalue``, ``median``, ``mode``), the
    same whatever their order; ``topk`` along another axis keeps them; ``topk`` unsorted and the
    indices of ``topk`` over the units follow their places."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.fc = nn.Linear(64, 12)
        if how == "topk over time":
            self.mix = nn.Linear(12, 12)
        if how == "side by side":
            self.side = nn.Linear(64, 6)
        self.head = nn.Linear(12 if how in ("kthvalue", "median", "mode", "topk over time", "sort whole") else 3, 10)

    def forward(self, x):
        h = F.relu(self.fc(x))
        if self.how == "topk":
            return self.head(h.topk(3, dim=-1)[0])
        if self.how == "torch.topk values":
            return self.head(torch.topk(h, 3).values)
        if self.how == "sort":
            return self.head(h.sort(dim=1, descending=True).values[:, :3])
        if self.how == "kthvalue":
            return self.head(h * h.kthvalue(2, dim=1, keepdim=True).values)
        if self.how == "median":
            return self.head(h - h.median(1, keepdim=True)[0])
        if self.how == "mode":
            return self.head(h + torch.mode(h, 1)[0][:, None])
        if self.how == "topk over time":  # units on the last axis, the top 2 of 5 steps of each
            steps = self.mix(h)[:, None, :] * torch.linspace(-1.0, 1.0, 5)[None, :, None]
            return self.head(steps.topk(2, dim=1).values.sum(1))
        if self.how == "sort whole":  # as many numbers as units: their width
            return self.head(h.sort(-1).values)
        if self.how == "unpacked":
            return self.head((lambda values, indices: values)(*h.topk(3)))
        if self.how == "side by side":  # streams side by side on their units, ordered together
            return self.head(torch.cat([h, F.relu(self.side(x))], 1).topk(3, 1).values)
        if self.how == "unsorted":
            return self.head(h.topk(3, dim=-1, sorted=False)[0])
        return self.head(h.topk(3, dim=-1)[1].float())  # "indices"


@pytest.mark.parametrize(
    "how",
    ["topk", "torch.topk values", "sort", "kthvalue", "median", "mode", "topk over time", "unpacked", "side by side"],
)
def test_order_statistics_of_the_units_do_not_depend_on_their_order(how):
    """The largest units, the units sorted, the k-th, the median and the mode are the same whatever
    the units' order: a permuted copy computes the same function, and fuses back to it."""
    torch.manual_seed(0)
    model = _Ordered(how).eval()
    spec = spec_from_module(model)
    assert spec.axes["fc.weight"][0] is not None
    if how == "topk over time":
        assert spec.axes["mix.weight"][0] is not None
    permuted, x = permuted_copy(model, spec, seed=1), torch.randn(7, 64)
    assert not torch.equal(permuted.fc.weight, model.fc.weight)
    assert _gap(permuted, model, x) < 1e-5
    assert _gap(bayesfuse.fuse([model, permuted], "pfnm").model, model, x) < 1e-4
    assert bool(spec.fixed) == (how == "sort")  # sort keeps as many numbers as units; a k written in the code does not


def test_the_units_sorted_whole_fix_their_width():
    """``self.head(h.sort(-1).values)`` reads as many numbers as there are units: their width is
    fixed (``spec.fixed``), so clients fuse at it and the fused network runs."""
    torch.manual_seed(0)
    spec = spec_from_module(_Ordered("sort whole"))
    assert spec.axes["fc.weight"][0].group in spec.fixed
    clients, x = [randomise(_Ordered("sort whole"), seed) for seed in range(3)], torch.randn(7, 64)
    fused = bayesfuse.fuse(clients, "pfnm").model
    assert fused.fc.out_features == 12 and fused(x).shape == (7, 10)


class _Blur(nn.Module):
    """A binomial blur before a strided step, as timm's ``BlurPool2d``: one filter for every channel,
    a buffer of one row per channel (``channels`` given; stored or not) or one row expanded to the
    channels read off the input."""

    def __init__(self, channels: int | None, *, persistent: bool = False) -> None:
        super().__init__()
        self.channels = channels
        k = torch.tensor([1.0, 2.0, 1.0])
        filt = (k[:, None] * k[None, :] / 16)[None, None].repeat(channels or 1, 1, 1, 1)
        self.register_buffer("filt", filt, persistent=persistent)

    def forward(self, x):
        x = F.pad(x, [1, 1, 1, 1], mode="reflect")
        if self.channels is None:
            c = x.shape[1]
            return F.conv2d(x, self.filt.expand(c, 1, 3, 3), stride=2, groups=c)
        return F.conv2d(x, self.filt, stride=2, groups=self.channels)


class _Blurred(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.blur = _Blur(None if how == "expanded" else 8, persistent=how == "stored")
        self.conv2, self.head = nn.Conv2d(8, 6, 3, padding=1), nn.Linear(6, 3)

    def forward(self, x):
        h = self.blur(F.relu(self.bn(self.conv(x))))
        return self.head(F.relu(self.conv2(h)).mean((2, 3)))


def _blur_kept(model: _Blurred) -> _Blurred:
    """``model`` with its blur's filter as built (randomise draws every float entry, a stored filter too)."""
    with torch.no_grad():
        model.blur.filt.copy_(_Blur(model.blur.channels).filt)
    return model


@pytest.mark.parametrize("how", ["expanded", "held", "stored"])
def test_one_filter_for_every_channel_passes_the_channels(how):
    """``F.conv2d(x, filt, groups=C)`` with one filter for every channel (timm's TResNet) filters each
    channel alike: the channels pass, and a permuted copy fuses back. Where the filter holds a row
    per channel (a buffer made at the width, ``groups=self.channels``), the width is fixed, and
    three clients fuse at it; one row expanded to the input's channels follows the fusion."""
    x = torch.randn(4, 1, 8, 8)
    model = _blur_kept(randomise(_Blurred(how), 0))
    spec = spec_from_graph(model, x)
    group = spec.axes["conv.weight"][0].group
    assert spec.axes["conv2.weight"][1].group == group and (group in spec.fixed) == (how != "expanded")
    permuted = permuted_copy(model, spec, seed=1)
    assert not torch.equal(permuted.conv.weight, model.conv.weight)
    assert _gap(permuted, model, x) < 1e-5
    assert _gap(bayesfuse.fuse([model, permuted], "pfnm", example_input=x).model, model, x) < 1e-4
    clients = [_blur_kept(randomise(_Blurred(how), seed)) for seed in range(3)]
    fused = bayesfuse.fuse(clients, "pfnm", example_input=x)
    assert (fused.model.conv.out_channels == 8) == (how != "expanded")
    assert fused.model(x).shape == (4, 3)


class _BlurSizedByAnother(nn.Module):
    """A blur of one group's channels whose filter is expanded to another group's width."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(1, 8, 3, padding=1), nn.Linear(16, 3)
        self.register_buffer("filt", torch.full((1, 1, 3, 3), 1 / 9), persistent=False)

    def forward(self, x):
        h, g = F.relu(self.a(x)), F.relu(self.b(x))
        c = g.shape[1]
        h = F.conv2d(h, self.filt.expand(c, 1, 3, 3), groups=c)
        return self.head(torch.cat([h.mean((2, 3)), g.mean((2, 3))], 1))


def test_a_filter_sized_by_another_groups_width_fixes_both():
    x = torch.randn(4, 1, 8, 8)
    spec = spec_from_graph(_BlurSizedByAnother(), x[:1])
    assert {spec.axes["a.weight"][0].group, spec.axes["b.weight"][0].group} == set(spec.fixed)
    fused = bayesfuse.fuse([randomise(_BlurSizedByAnother(), seed) for seed in (1, 2, 3)], "pfnm", example_input=x[:1])
    assert fused.sizes == [8, 8] and fused.model(x).shape == (4, 3)


def test_a_filter_per_channel_that_differs_is_refused():
    """A stored filter whose rows differ filters each channel its own way: refused, not read as a blur."""
    model = randomise(_Blurred("stored"), 0)  # the filter's rows drawn apart
    with pytest.raises(UnsupportedLayerError, match=r"conv2d on a permuted axis cannot be followed"):
        spec_from_graph(model, torch.randn(4, 1, 8, 8))


class _Repeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 6), nn.Linear(12, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).repeat(1, 2))


class _Tied(nn.Module):
    """An embedding tied to the output layer (``out.weight = emb.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(20, 12), nn.Linear(12, 12), nn.Linear(12, 20, bias=False)
        self.out.weight = self.emb.weight

    def example_input(self):
        return torch.zeros(2, 5, dtype=torch.long)

    def forward(self, t):
        return self.out(torch.tanh(self.fc(self.emb(t).mean(1))))


def test_recurrent_layers_permute_each_gate_block_and_their_own_state():
    spec = spec_from_graph(MyLSTM())
    gates, state = spec.axes["rnn.weight_hh_l0"]
    assert (gates.group, gates.outer, state.group, state.outer) == (state.group, 4, gates.group, 1)
    assert spec.axes["rnn.weight_ih_l0"][1] is None  # the input is never permuted
    assert spec.axes["head.weight"][1].group == gates.group
    gru = spec_from_graph(MyGRU())
    assert gru.axes["rnn.weight_ih_l0"][0].outer == 3
    assert gru.axes["rnn.weight_ih_l0"][1].group == gru.axes["embed.weight"][0].group
    stacked = spec_from_graph(StackedLSTM())
    first, second = (stacked.axes[f"rnn.weight_hh_l{k}"][0].group for k in (0, 1))
    assert first != second and stacked.axes["rnn.weight_ih_l1"][1].group == first
    assert stacked.axes["head.weight"][1].group == second


def test_independent_recurrent_networks_fuse_and_stacked_ones_as_one_group():
    x = torch.randn(6, 64)
    for cls in (MyLSTM, MyGRU, MyRNN, BiLSTM):
        models = [_random(cls, s) for s in range(3)]
        fused = bayesfuse.fuse(models, "pfnm")
        assert fused.sizes[-1] > models[0].rnn.hidden_size and fused.model(x).shape == (6, 10)
        assert type(fused.model.rnn) is type(models[0].rnn)
        assert fused.model.rnn.bidirectional == models[0].rnn.bidirectional
    stacked = [_random(StackedLSTM, s) for s in range(3)]
    tied = bayesfuse.fuse(stacked, "pfnm")  # nn.LSTM keeps one width: its layers are one group
    assert len(tied.sizes) == 1 and tied.model.rnn.hidden_size == tied.sizes[0] and tied.model(x).shape == (6, 10)
    averaged = bayesfuse.fuse(stacked, "fedavg").model
    mean = {k: sum(m.state_dict()[k] for m in stacked) / 3 for k in stacked[0].state_dict()}
    assert all(torch.allclose(averaged.state_dict()[k], v, atol=1e-6) for k, v in mean.items())


@pytest.mark.parametrize("method", ["pfnm", "ot"])
def test_a_bag_of_words_model_fuses_back_from_a_permuted_copy(method):
    model = _random(BagOfWords, 0)
    spec = spec_from_module(model)
    assert spec.axes["bag.weight"][1].group == spec.axes["fc.weight"][1].group  # the embedding's units
    x = torch.randint(0, 40, (20, 12))
    copy = _permuted(model, 3)
    assert _gap(model, copy, x) < 1e-5
    assert _gap(model, bayesfuse.fuse([model, copy], method).model, x) < 1e-5


def test_recurrent_files_fuse_with_the_network_and_never_into_a_file_no_module_holds(tmp_path, capsys):
    from bayesfuse.checkpoints import save_state_dict
    from bayesfuse.cli import main

    def files(cls, stem):
        return [str(save_state_dict(_random(cls, s).state_dict(), tmp_path / f"{stem}{s}.pt")) for s in range(3)]

    gru, stacked, out = files(MyGRU, "g"), files(StackedLSTM, "s"), tmp_path / "fused.pt"
    for paths, model, message in (
        (gru, [], r"'rnn' has recurrent weights of shape \(36, 12\), not an LSTM's .* \(--model MODULE:NAME\)"),
    ):
        assert main(["fuse", *paths, "--method", "pfnm", *model, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and re.search(message, err), err
        assert not list(tmp_path.glob("fused*"))
    assert main(["fuse", *gru, "--method", "pfnm", "--model", "tests.nets.user_nets:MyGRU", "--out", str(out)]) == 0
    loaded = bayesfuse.load(out, like=MyGRU())
    python = bayesfuse.fuse([_random(MyGRU, s) for s in range(3)], "pfnm").model
    assert _gap(loaded, python, torch.randn(6, 64)) < 1e-5
    assert main(["fuse", *stacked, "--method", "fedavg", "--out", str(tmp_path / "avg.pt")]) == 0
    ref = ["--model", "tests.nets.user_nets:StackedLSTM"]
    assert main(["fuse", *stacked, "--method", "pfnm", *ref, "--out", str(tmp_path / "tied.pt"), "--force"]) == 0
    fused = bayesfuse.load(tmp_path / "tied.pt", like=StackedLSTM())
    assert (
        _gap(fused, bayesfuse.fuse([_random(StackedLSTM, s) for s in range(3)], "pfnm").model, torch.randn(6, 64))
        < 1e-5
    )


@pytest.mark.parametrize(
    "model, message",
    [
        (Attention(), r"nn.MultiheadAttention's heads are embed_dim / num_heads wide"),
        (nn.GRU(3, 4), r"bare GRU"),
        (StackedStateLSTM(), r"final state of the 2-layer LSTM 'rnn' holds every layer's units"),
        (_Reads("indices concatenated"), r"max over the units names units by their place"),
        (_Reads("a computed dim"), r"mean along a dim computed in the forward cannot be read; give it as a number"),
        (_Reads("by keyword"), r"roll on a permuted axis cannot be followed"),
        (_SideBySide("rolled"), r"cat holds streams concatenated on their units \(\[64, 12\] wide\), read where"),
        (
            _SideBySide("added"),
            r"\(add\): an operation of streams concatenated on their units with a tensor that does not",
        ),
        (_SideBySide("pooled"), r"a 2-d pooling of a tensor of rank 3 pools its axis 1, the units'"),
        (_SideBySide("pooled alone"), r"a 1-d pooling of a tensor of rank 2 pools its axis 1, the units'"),
        (_SideBySide("other axes"), r"cat_1 holds streams concatenated on their units \(\[4, 6\] wide\), read where"),
        (_SideBySide("padded"), r"pad acts on the units' axis"),
        (_SideBySide("grouped"), r"Conv1d reads streams concatenated on their units \(of widths \[4, 6\]\)"),
        (_GivenState(), r"an LSTM given a first state is not supported: .* call it without one"),
        (_HandWritten("tensordot"), r"tensordot applies the network's own weight 'W'"),
        (_Repeated(), r"repeat along the units' axis copies each unit"),
        (ArgmaxUnits(), r"argmax over the units names units by their place, which fusion changes"),
        (_RowsPicked("argmax"), r"argmax over the units names units by their place, which fusion changes"),
        (_RowsPicked("along"), r"indexing by a tensor along permuted units is not supported"),
        (_RowsPicked("in a list"), r"argmax over the units names units by their place, which fusion changes"),
        (_RowsPicked("input"), r"argmax over the units names units by their place, which fusion changes"),
        (_RowsPicked("other"), r"topk over the units names units by their place, which fusion changes"),
        (_Ordered("unsorted"), r"topk over the units, unsorted, gives them in no set order"),
        (_Ordered("indices"), r"topk over the units names units by their place, which fusion changes"),
    ],
)
@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")  # torch's, on tracing
@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence for multidimensional indexing")  # torch's: E[[idx]]
def test_what_cannot_be_followed_is_refused_in_one_line(model, message):
    with pytest.raises(UnsupportedLayerError, match=message) as err:
        spec_from_module(model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "how, frozen",
    [("linear", True), ("linear of .T.T", False), ("x @ W.T", False), ("matmul of W.t()", False)]
    + [("einsum", False), ("einsum of W.T", False)],
)
def test_a_weight_applied_by_hand_through_its_transposes_is_a_layer(how, frozen):
    """``F.linear(x, self.W)`` (frozen too: still a layer), through ``.T.T``, ``x @ self.W.T``,
    ``torch.matmul(x, self.W.t().contiguous())``, ``torch.einsum("bi,oi->bo", x, self.W)`` and
    ``torch.einsum("io,bi->bo", self.W.T, x)``: ``W``'s rows are the hidden units, read by the head."""
    torch.manual_seed(0)
    model = _HandWritten(how, frozen=frozen).eval()
    spec = spec_from_module(model)
    assert spec.axes["W"][0] is not None and spec.axes["W"][1] is None and "W" not in spec.transposed
    assert spec.axes["head.weight"][1].group == spec.axes["W"][0].group
    permuted, x = permuted_copy(model, spec, seed=1), torch.randn(5, 4)
    assert _gap(permuted, model, x) < 1e-5
    for method in ("pfnm", "ot"):
        assert _gap(bayesfuse.fuse([model, permuted], method).model, model, x) < 1e-4, method


class _NormedLSTM(nn.Module):
    """An LSTM whose hidden-to-hidden weight is computed by weight_norm (``old``: the hooks' API)."""

    def __init__(self, old: bool = False) -> None:
        from torch.nn.utils import parametrizations, weight_norm

        super().__init__()
        wrap = weight_norm if old else parametrizations.weight_norm
        self.rnn, self.head = wrap(nn.LSTM(8, 6, batch_first=True), name="weight_hh_l0"), nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        return self.head(self.rnn(x.view(-1, 8, 8))[0][:, -1])


def _normed(kind: str) -> nn.Module:
    """An MLP whose first layer's weight is computed from other tensors the state_dict holds."""
    from torch.nn.utils import parametrizations, spectral_norm, weight_norm

    if kind.startswith("lstm"):
        return _NormedLSTM(old="old" in kind)
    first = nn.Linear(64, 16)
    wrap = {"weight_norm": parametrizations.weight_norm, "old weight_norm": weight_norm}
    wrap |= {"spectral_norm": parametrizations.spectral_norm, "old spectral_norm": spectral_norm}
    return nn.Sequential(wrap[kind](first), nn.ReLU(), nn.Linear(16, 10))


@pytest.mark.parametrize(
    "kind", ["weight_norm", "old weight_norm", "spectral_norm", "old spectral_norm", "lstm weight_norm", "lstm old"]
)
def test_a_weight_computed_from_other_tensors_is_refused_and_fedavg_averages_it(kind):
    """weight_norm / spectral_norm (either API) store other tensors than the weight (g and v, the
    weight before normalising): the spec left them unpermuted while it permuted the bias, so a
    permuted copy fused 0.94 off, silently. Refused in one line; FedAvg averages entry by entry."""
    with pytest.raises(UnsupportedLayerError, match="is computed from other tensors") as err:
        spec_from_module(_normed(kind))
    assert "\n" not in str(err.value)
    torch.manual_seed(0)
    models = [_normed(kind).eval() for _ in range(2)]
    with pytest.raises(UnsupportedLayerError, match="is computed from other tensors"):
        bayesfuse.fuse(models, "pfnm")
    assert bayesfuse.fuse(models, "fedavg").model(torch.randn(3, 64)).shape == (3, 10)
    if kind == "lstm weight_norm":  # parametrizations of one's own, of a layer's bias and of the network's
        from torch.nn.utils import parametrize

        class Scale(nn.Module):
            def forward(self, p):
                return p * 2.0

        class WithPos(MyMLP):
            def __init__(self) -> None:
                super().__init__()
                self.pos = nn.Parameter(torch.zeros(64))

            def forward(self, x):
                return super().forward(x + self.pos)

        own = MyMLP()
        parametrize.register_parametrization(own.fc1, "bias", Scale())
        with pytest.raises(UnsupportedLayerError, match=r"fc1\.bias is computed from other tensors"):
            spec_from_module(own)
        network = WithPos()
        parametrize.register_parametrization(network, "pos", Scale())  # its class is now torch's: not "bare"
        with pytest.raises(UnsupportedLayerError, match=r": pos is computed from other tensors"):
            spec_from_module(network)


def test_untraceable_forward_and_missing_input_are_named():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else -self.fc(x)

    with pytest.raises(UnsupportedLayerError, match="cannot trace Branchy with torch.fx"):
        spec_from_graph(Branchy())
    conv_first = nn.Sequential()
    conv_first.add_module("conv", nn.Conv2d(1, 2, 3))
    with pytest.raises(ValueError, match="give an example input"):
        example_input_for(conv_first)


class _HeldWidth(nn.Module):
    """Reshapes by a width it holds, ``self.width`` (torchvision's ViT: ``x.reshape(n,
    self.hidden_dim, n_h * n_w)``)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 6), nn.Linear(6, 2)
        self.width = 6

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)).reshape(-1, self.width))


def _padded(state: dict, rows: dict, cols: dict, extra: int) -> dict:
    """``state`` with ``extra`` dead units: zero rows appended to ``rows``' entries along the
    given axis, zero columns to ``cols``' (where they are read): the same function."""
    out = dict(state)
    for k, axis in {**rows, **cols}.items():
        v = state[k]
        shape = list(v.shape)
        shape[axis] = extra
        out[k] = torch.cat([v, v.new_zeros(shape)], axis)
    return out


def test_a_width_a_module_holds_follows_the_fusion():
    """A module's ``int`` attribute that a reshape reads as the units' width (``self.width``)
    is recorded in the spec and set to the fused width by the rebuild: PFNM fuses such networks.
    A network given dead units (zero rows in, zero columns out) computes the same function when
    rebuilt at its new width. A width written in the code (``reshape(-1, 6)``) is refused
    after fusion; OT, which keeps the widths, fuses it."""
    from bayesfuse.nets.arch import rebuild

    torch.manual_seed(0)
    models = [_HeldWidth().eval() for _ in range(3)]
    spec = spec_from_graph(models[0], torch.randn(2, 8))
    assert spec.widths == {"width": Axis("P1")} and not spec.fixed
    assert type(models[0].width) is int and models[0].width == 6  # the user's attribute given back as it was
    x = torch.randn(5, 8)
    assert _gap(models[0], bayesfuse.fuse([models[0], _permuted(models[0], 1)], "pfnm").model, x) < 1e-5
    fused = bayesfuse.fuse(models, "pfnm").model
    assert fused.width == fused.fc1.out_features > 6 and fused(x).shape == (5, 2)
    assert models[0].width == 6  # the rebuild set its own copy's

    state = _padded(models[0].state_dict(), {"fc1.weight": 0, "fc1.bias": 0}, {"fc2.weight": 1}, extra=3)
    wider = rebuild(models[0], state, spec)
    assert wider.width == 9
    assert _gap(models[0], wider, x) == 0.0
    with pytest.raises(RuntimeError):  # without the spec the rebuild keeps the old number
        rebuild(models[0], state)(x)
    import dataclasses

    for wrong in ("fc1.width", "nosuch.width", "fc1"):  # a spec (file) naming no int attribute: one line
        with pytest.raises(ValueError, match=f"the spec's width '{wrong}' is no int attribute"):
            rebuild(models[0], state, dataclasses.replace(spec, widths={wrong: "P1"}))

    class Written(_HeldWidth):
        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)).reshape(-1, 6))

    torch.manual_seed(0)
    models = [Written().eval() for _ in range(3)]
    assert spec_from_graph(models[0], x).widths == {}
    with pytest.raises(ValueError, match="does not run at its fused widths .*keep a width of its own"):
        bayesfuse.fuse(models, "pfnm")
    assert bayesfuse.fuse(models, "ot").model(torch.randn(3, 8)).shape == (3, 2)

    class LayersWidth(_HeldWidth):
        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)).reshape(-1, self.fc2.in_features))

    torch.manual_seed(0)
    models = [LayersWidth().eval() for _ in range(3)]
    assert _gap(models[0], bayesfuse.fuse([models[0], _permuted(models[0], 1)], "pfnm").model, x) < 1e-5
    assert bayesfuse.fuse(models, "pfnm").model(torch.randn(3, 8)).shape == (3, 2)


def test_a_width_a_module_holds_for_two_streams_fixes_them():
    """One attribute read as the width of two streams that fusion sets apart: their widths are
    fixed (PFNM matches them at it), never one of them given the other's."""

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(12, 2)
            self.width = 6

        def forward(self, x):
            h = torch.relu(self.a(x)).reshape(-1, self.width)
            g = torch.relu(self.b(x)).reshape(-1, self.width)
            return self.out(torch.cat([h, g], 1))

    torch.manual_seed(0)
    models = [Twice().eval() for _ in range(2)]
    spec = spec_from_graph(models[0], torch.randn(2, 4))
    assert spec.widths == {} and "reads width as the width of two axes of units" in next(iter(spec.fixed.values()))
    fused = bayesfuse.fuse(models, "pfnm")
    assert _kept_fixed(fused, spec, models[0]) and fused.model(torch.randn(3, 4)).shape == (3, 2)


class _HeadDim(nn.Module):
    """Attention written as timm's ``Attention`` without its fused kernel: heads cut by a width
    the module holds, ``self.head_dim``, and a scale fixed at construction."""

    def __init__(self, dim: int = 16, heads: int = 4):
        super().__init__()
        self.qkv, self.proj, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, 3)
        self.num_heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim**-0.5

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1)
        return self.head(self.proj((attn @ v).transpose(1, 2).reshape(B, N, -1)).mean(1))


def test_heads_of_a_width_a_module_holds_follow_the_fusion():
    """``reshape(B, N, 3, self.num_heads, self.head_dim)``: the width within a head follows the
    features within a head (every head permuted alike), so PFNM fuses; padded with dead features
    in every head (zero query, key and value rows, zero columns of the output projection) the
    network computes the same function at its new head width."""
    from bayesfuse.nets.arch import rebuild

    torch.manual_seed(0)
    models = [library_randomised(_HeadDim()).eval() for _ in range(2)]
    x = torch.randn(3, 5, 16)
    spec = spec_from_graph(models[0], x[:1])
    assert list(spec.widths) == ["head_dim"] and not spec.fixed
    back = bayesfuse.fuse([models[0], permuted_copy(models[0], spec, seed=1)], "pfnm", example_input=x[:1]).model
    assert _gap(models[0], back, x) < 1e-5
    fused = bayesfuse.fuse(models, "pfnm", example_input=x[:1]).model
    assert fused.head_dim > 4 and fused(x).shape == (3, 3)

    state = dict(models[0].state_dict())
    w, b = state["qkv.weight"].reshape(3, 4, 4, 16), state["qkv.bias"].reshape(3, 4, 4)
    state["qkv.weight"] = torch.cat([w, w.new_zeros(3, 4, 2, 16)], 2).reshape(-1, 16)
    state["qkv.bias"] = torch.cat([b, b.new_zeros(3, 4, 2)], 2).reshape(-1)
    p = state["proj.weight"].reshape(16, 4, 4)
    state["proj.weight"] = torch.cat([p, p.new_zeros(16, 4, 2)], 2).reshape(16, -1)
    wider = rebuild(models[0], state, spec)
    assert wider.head_dim == 6
    assert _gap(models[0], wider, x) < 1e-6


def test_a_bias_per_head_given_to_attention_keeps_the_heads_in_their_order():
    """``scaled_dot_product_attention(q, k, v, attn_mask=bias)`` with a bias per head made by a
    layer of one unit per head (timm's relative position MLP): the heads keep their order, so
    that layer's units are not permuted, and a permuted copy computes the same function."""

    class MaskBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj, self.head = nn.Linear(16, 48), nn.Linear(16, 16), nn.Linear(16, 3)
            self.rel = nn.Linear(2, 4)  # one bias per head from each pair's offset
            self.register_buffer("offsets", torch.randn(25, 2))

        def forward(self, x):
            B, N, C = x.shape
            q, k, v = self.qkv(x).reshape(B, N, 3, 4, -1).permute(2, 0, 3, 1, 4).unbind(0)
            bias = self.rel(self.offsets).permute(1, 0).reshape(1, 4, N, N)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.5)
            return self.head(self.proj(out.transpose(1, 2).reshape(B, N, C)).mean(1))

    torch.manual_seed(0)
    model = library_randomised(MaskBias()).eval()
    x = torch.randn(3, 5, 16)
    spec = spec_from_graph(model, x[:1])
    assert all(a is None for a in spec.axes["rel.weight"]), spec.axes["rel.weight"]
    assert _gap(model, permuted_copy(model, spec, seed=1), x) < 1e-5


def test_heads_counted_from_a_width_within_a_head_the_module_holds_follow_the_fusion():
    """``view(B, N, -1, self.head_dim)``: the number of heads counted from the width within a
    head, which the module holds and the rebuild sets to the fused one, so the count stays. A
    width written as a number there (``view(B, N, -1, 4)``) still fixes the width."""
    from bayesfuse.nets.arch import rebuild

    class Counted(_HeadDim):
        def forward(self, x):
            B, N, C = x.shape
            q, k, v = self.qkv(x).chunk(3, -1)
            q, k, v = (
                q.view(B, N, -1, self.head_dim).transpose(1, 2),
                k.view(B, N, -1, self.head_dim).transpose(1, 2),
                v.view(B, N, -1, self.head_dim).transpose(1, 2),
            )
            attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1)
            return self.head(self.proj((attn @ v).transpose(1, 2).reshape(B, N, -1)).mean(1))

    class Written(_HeadDim):
        def forward(self, x):
            B, N, C = x.shape
            q, k, v = self.qkv(x).chunk(3, -1)
            q, k, v = (
                q.view(B, N, -1, 4).transpose(1, 2),
                k.view(B, N, -1, 4).transpose(1, 2),
                v.view(B, N, -1, 4).transpose(1, 2),
            )
            attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1)
            return self.head(self.proj((attn @ v).transpose(1, 2).reshape(B, N, -1)).mean(1))

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    model = library_randomised(Counted()).eval()
    spec = spec_from_graph(model, x[:1])
    assert list(spec.widths) == ["head_dim"] and not spec.fixed
    back = bayesfuse.fuse([model, permuted_copy(model, spec, seed=1)], "pfnm", example_input=x[:1]).model
    assert _gap(model, back, x) < 1e-5
    state = dict(model.state_dict())  # 2 dead features in every head: the same function at head_dim 6
    w, b = state["qkv.weight"].reshape(3, 4, 4, 16), state["qkv.bias"].reshape(3, 4, 4)
    state["qkv.weight"] = torch.cat([w, w.new_zeros(3, 4, 2, 16)], 2).reshape(-1, 16)
    state["qkv.bias"] = torch.cat([b, b.new_zeros(3, 4, 2)], 2).reshape(-1)
    p = state["proj.weight"].reshape(16, 4, 4)
    state["proj.weight"] = torch.cat([p, p.new_zeros(16, 4, 2)], 2).reshape(16, -1)
    wider = rebuild(model, state, spec)
    assert wider.head_dim == 6 and _gap(model, wider, x) < 1e-6
    assert "counts its heads from a width within a head" in str(spec_from_graph(Written().eval(), x[:1]).fixed)


def test_a_width_the_forward_also_computes_with_is_fixed():
    """``math.sqrt(self.head_dim)`` (Hugging Face's eager attention): the trace holds the
    scale as a number, which setting ``head_dim`` to a fused width would change. The width is
    fixed: PFNM matches it at that width, as OT does; the attribute is given back as a plain int."""
    import math

    class Scaled(_HeadDim):
        def forward(self, x):
            B, N, C = x.shape
            qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            attn = ((q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)).softmax(-1)
            return self.head(self.proj((attn @ v).transpose(1, 2).reshape(B, N, -1)).mean(1))

    torch.manual_seed(0)
    models = [library_randomised(Scaled()).eval() for _ in range(2)]
    x = torch.randn(3, 5, 16)
    spec = spec_from_graph(models[0], x[:1])
    assert spec.widths == {} and "reads head_dim as their width and also computes with it" in str(spec.fixed)
    assert type(models[0].head_dim) is int
    assert _kept_fixed(bayesfuse.fuse(models, "pfnm", example_input=x[:1]), spec, models[0])
    for method in ("pfnm", "ot"):
        back = bayesfuse.fuse([models[0], permuted_copy(models[0], spec, seed=1)], method, example_input=x[:1]).model
        assert _gap(models[0], back, x) < 1e-5, method


def test_a_network_of_two_inputs_is_traced_from_its_pair_of_example_inputs():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 3)

        def example_input(self):
            return (torch.zeros(2, 8), torch.zeros(2, 8))

        def forward(self, xy):
            x, y = xy
            return self.head(torch.relu(self.a(x)) * torch.relu(self.b(y)))

    model = _random(Pair, 0)
    spec, state = spec_from_module(model), model.state_dict()
    perms = random_permutations(spec.sizes(state), np.random.default_rng(1))
    copy = Pair()
    copy.load_state_dict({k: torch.as_tensor(v) for k, v in permute(state, spec, perms).items()})
    fused = bayesfuse.fuse([model, copy.eval()], "pfnm", prior_var=1e8, noise_var=1.0).model
    xy = (torch.randn(5, 8), torch.randn(5, 8))
    with torch.no_grad():
        assert float((fused(xy) - model(xy)).abs().max()) < 1e-4


def test_the_output_layer_is_found_through_what_follows_it_and_fuses_as_without_it():
    """A log_softmax after the output layer changes nothing of the fusion: the same output layer
    (its m/J average), the same fused weights, and class counts are read."""
    assert spec_from_graph(LogSoftmaxMLP()).output == ("fc2.weight", "fc2.bias")
    plain, logged = [_random(MyMLP, s) for s in range(3)], [_random(LogSoftmaxMLP, s) for s in range(3)]
    counts = np.random.default_rng(0).integers(1, 50, size=(3, 10))
    for method in ("pfnm", "nafi"):
        a, b = (bayesfuse.fuse(m, method, class_counts=counts).model.state_dict() for m in (plain, logged))
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.parametrize("as_dict", [False, True])
def test_every_tensor_a_network_returns_keeps_its_classes(as_dict):
    """A forward returning (logits, aux) or a dict of them: no output is permuted, the first is
    the logits; independent clients fuse to the clients' number of classes, permuted copies back."""
    TwoOutputs.as_dict = as_dict
    try:
        spec = spec_from_graph(TwoOutputs())
        assert spec.output == ("fc2.weight", "fc2.bias") and spec.axes["aux.weight"][0] is None
        x = torch.randn(20, 64)
        model = _random(TwoOutputs, 0)
        logits = (lambda m: m(x)["logits"]) if as_dict else (lambda m: m(x)[0])
        for method in ("pfnm", "nafi", "ot"):
            fused = bayesfuse.fuse([model, _permuted(model, 2)], method).model
            with torch.no_grad():
                assert float((logits(model) - logits(fused)).abs().max()) < 1e-4
            independent = bayesfuse.fuse([_random(TwoOutputs, s) for s in range(3)], method).model
            with torch.no_grad():
                assert logits(independent).shape == (20, 10)
    finally:
        TwoOutputs.as_dict = False


def test_a_forward_of_two_inputs_traces_and_fuses_back():
    model = _random(PairInputs, 0)
    x = (torch.randn(20, 32), torch.randn(20, 32))
    assert spec_from_graph(model).groups == ("P1",)
    for method in ("pfnm", "ot", "fedavg"):
        fused = bayesfuse.fuse([model, _permuted(model, 3) if method != "fedavg" else model], method).model
        with torch.no_grad():
            assert float((model(*x) - fused(*x)).abs().max()) < 1e-4


def test_independent_depthwise_networks_fuse_into_one_that_runs():
    """The depthwise convolution is rebuilt with one group per channel at the fused width."""
    for method in ("pfnm", "nafi"):
        fused = bayesfuse.fuse([_random(DepthwiseCNN, s) for s in range(3)], method)
        assert fused.model.dw.groups == fused.model.dw.out_channels == fused.sizes[0] > 8
        assert fused.model(torch.randn(5, 64)).shape == (5, 10)


def test_grouped_convolutions_keep_their_groups_at_the_fused_widths():
    """One permutation within a group for every group: the fused convolution has its groups,
    equally wide; the channels it reads are cut into blocks the groups do not cross."""
    spec = spec_from_module(GroupedCNN())
    assert spec.axes["b.weight"][:2] == (Axis("P3", 4), Axis("P2", 1))
    assert spec.axes["a.weight"][0] == spec.axes["bna.weight"][0] == Axis("P2", 4)  # cut for the groups
    assert spec.axes["d.weight"][:2] == (Axis("P4", 2), Axis("P1", 1))  # two groups, one block of the stream each
    for method in ("pfnm", "nafi"):
        fused = bayesfuse.fuse([_random(GroupedCNN, s) for s in range(3)], method)
        b = fused.model.b
        assert b.groups == 4 and b.in_channels % 4 == 0 and b.out_channels == fused.sizes[2] * 4 > 12
        assert fused.model(torch.randn(5, 64)).shape == (5, 10)
    torch.manual_seed(0)  # FedMA folds the batch norms of the grouped convolution at each width it retrains
    train = Dataset(torch.randn(60, 64).numpy(), torch.randint(0, 10, (60,)).numpy(), 10)
    models = [_random(GroupedCNN, s) for s in range(3)]
    fused = bayesfuse.fuse(models, "fedma", data=(train, [np.arange(20 * j, 20 * j + 20) for j in range(3)]))
    assert fused.model.b.groups == 4 and fused.model.bnb.running_mean.shape == (fused.model.b.out_channels,)
    assert fused.model(torch.randn(5, 64)).shape == (5, 10)


def test_transposed_convolutions_keep_their_groups_at_the_fused_widths():
    """A transposed convolution of 4 groups: one permutation within a group on its weight's axis
    1, four blocks of it on the bias and the output; its input cut into blocks the groups do not
    cross. A depthwise one keeps its input's units, two filters each."""
    spec = spec_from_module(GroupedUpConv())
    out, enc = spec.axes["up.weight"][1], spec.axes["enc.weight"][0]
    assert out.outer == 1 and spec.axes["up.bias"][0] == spec.axes["bn.weight"][0] == Axis(out.group, 4)
    assert spec.axes["up.weight"][0] == enc == Axis(enc.group, 4) and "bn" not in spec.folds
    assert spec.axes["depth.weight"][:2] == (Axis(out.group, 4), None)
    assert spec.axes["depth.bias"][0] == spec.axes["mix.weight"][1] == Axis(out.group, 4, 2)
    for method in ("pfnm", "nafi"):
        fused = bayesfuse.fuse([_random(GroupedUpConv, s) for s in range(3)], method)
        up, depth = fused.model.up, fused.model.depth
        assert up.groups == 4 and up.out_channels == 4 * fused.sizes[1] > 12 and up.in_channels % 4 == 0
        assert depth.groups == depth.in_channels == up.out_channels and depth.out_channels == 2 * up.out_channels
        assert fused.model(torch.randn(5, 64)).shape == (5, 10)


def test_independent_projected_lstms_fuse_into_one_that_runs():
    """A stacked projected LSTM keeps one width for its cells and one for its projections."""
    spec = spec_from_module(ProjectedLSTM())
    p, h = spec.axes["one.weight_hr_l0"]
    assert spec.axes["one.weight_hh_l0"] == (Axis(h.group, 4), p) and p.group != h.group
    for method in ("pfnm", "nafi"):
        fused = bayesfuse.fuse([_random(ProjectedLSTM, s) for s in range(3)], method)
        two = fused.model.two
        assert two.proj_size == two.weight_hr_l1_reverse.shape[0] and two.hidden_size == two.weight_hr_l1.shape[1]
        assert fused.model(torch.randn(5, 64)).shape == (5, 10)


class _OneProjected(nn.Module):
    """A projected LSTM whose projections are 4 of its 6 cells; ``layers=2`` stacks two."""

    def __init__(self, layers: int = 1) -> None:
        super().__init__()
        self.rnn, self.fc = nn.LSTM(8, 6, num_layers=layers, batch_first=True, proj_size=4), nn.Linear(4, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        return self.fc(self.rnn(x.view(-1, 8, 8))[0][:, -1])


@pytest.mark.parametrize("layers", [1, 2])
def test_a_projected_lstm_fused_to_as_many_projections_as_cells_gets_dead_cells(layers):
    """nn.LSTM needs proj_size < hidden_size; matching sets the two widths apart (here 12 and
    12): the fused LSTM gets dead cells up to one more than its projections (the same function,
    tests/inference/test_dead_cells.py), and says so."""
    models = [_random(lambda: _OneProjected(layers), s) for s in range(3)]
    padded = 0
    for method in ("pfnm", "nafi"):
        fused = bayesfuse.fuse(models, method)
        rnn = fused.model.rnn
        assert rnn.hidden_size > rnn.proj_size and rnn.hidden_size == fused.sizes[0]
        if "dead_cells" in fused.hyper:  # matched to no more cells than projections
            before, after = fused.hyper["dead_cells"]["rnn"]
            assert before <= rnn.proj_size and after == rnn.hidden_size == rnn.proj_size + 1
            padded += 1
        assert fused.model(torch.randn(5, 64)).shape == (5, 10)
    assert padded >= 1  # the case arises on these clients (PFNM and NAFI one layer, NAFI two)
    assert "dead_cells" not in bayesfuse.fuse(models, "ot").hyper


class _ProjectedHeldTwice(_OneProjected):
    def __init__(self) -> None:
        super().__init__()
        self.alias = nn.ModuleDict({"rnn": self.rnn})


def test_dead_cells_reach_a_projected_lstm_held_under_two_names():
    """Padded once, under its entry's names, then retied: both names hold the padded tensors."""
    fused = bayesfuse.fuse([_random(_ProjectedHeldTwice, s) for s in (6, 7, 8)], "nafi")
    assert fused.hyper["dead_cells"] == {"rnn": [12, 13]} and fused.model.rnn is fused.model.alias["rnn"]
    assert fused.model(torch.randn(5, 64)).shape == (5, 10)


class _ReadsCells(_OneProjected):
    """A projected LSTM, 5 cells and 4 projections, whose final cells ``c`` a layer reads: dead
    cells would reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.c = nn.LSTM(8, 5, batch_first=True, proj_size=4), nn.Linear(5, 10)

    def forward(self, x):
        out, (h, c) = self.rnn(x.view(-1, 8, 8))
        return self.fc(out[:, -1]) + self.c(c[-1])


def test_no_dead_cells_where_a_layer_reads_the_cells():
    """Nothing but the LSTM may read the cells that get dead ones: where another layer reads its
    final ``c``, the fusion that leaves no more cells than projections is refused in one line."""
    models = [_random(_ReadsCells, s) for s in range(3)]
    with pytest.raises(ValueError, match=r"'rnn' is a projected nn.LSTM, which needs fewer projections than cells"):
        bayesfuse.fuse(models, "pfnm")
    assert bayesfuse.fuse(models, "ot").model(torch.randn(5, 64)).shape == (5, 10)


def test_a_multiple_of_a_held_width_follows_a_flattened_axis():
    """``x.view(-1, self.channels * 4 * 4)``: a ConvNet flattening its maps by the channels it
    holds times the maps' size written in the code. The multiple is the attribute's, so the
    channels follow the fusion; dead channels (zero filters in, zero columns out) keep the
    function at the new width. A product of two held numbers computes with both: fixed."""
    from bayesfuse.nets.arch import rebuild

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.channels, self.side = 6, 4
            self.conv, self.fc = nn.Conv2d(1, 6, 3, padding=1), nn.Linear(6 * 16, 3)

        def example_input(self):
            return torch.zeros(2, 1, 8, 8)

        def forward(self, x):
            h = F.max_pool2d(torch.relu(self.conv(x)), 2)
            return self.fc(h.view(-1, self.channels * 4 * 4))

    class Product(Flat):
        def forward(self, x):
            h = F.max_pool2d(torch.relu(self.conv(x)), 2)
            return self.fc(h.view(-1, self.channels * self.side * self.side))

    torch.manual_seed(0)
    model, x = Flat().eval(), torch.randn(3, 1, 8, 8)
    spec = spec_from_graph(model)
    assert spec.widths == {"channels": Axis("P1")} and not spec.fixed
    assert _gap(model, bayesfuse.fuse([model, permuted_copy(model, spec, seed=1)], "pfnm").model, x) < 1e-5
    fused = bayesfuse.fuse([Flat().eval() for _ in range(3)], "pfnm").model
    assert fused.channels == fused.conv.out_channels > 6 and fused(x).shape == (3, 3)
    state = dict(model.state_dict())
    state["conv.weight"] = torch.cat([state["conv.weight"], torch.zeros(2, 1, 3, 3)])
    state["conv.bias"] = torch.cat([state["conv.bias"], torch.zeros(2)])
    state["fc.weight"] = torch.cat([state["fc.weight"], torch.zeros(3, 32)], 1)  # channel-major: 2 x 16 more
    wider = rebuild(model, state, spec)
    assert wider.channels == 8 and _gap(model, wider, x) == 0.0
    assert "also computes with it" in str(spec_from_graph(Product().eval()).fixed)


def test_a_held_width_read_otherwise_or_where_no_permutation_reaches_is_fixed():
    """``h.reshape(-1, self.width) / self.width``: the graph divides by the attribute, which a
    rebuild at the fused width would change. ``s.reshape(-1, self.width)`` of units later tied
    to the classes: that axis keeps its width while the other would follow. Both fix the width."""

    class Divided(_HeldWidth):
        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)).reshape(-1, self.width) / self.width)

    class ClassesToo(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.out, self.width = nn.Linear(8, 6), nn.Linear(8, 6), nn.Linear(6, 6), 6

        def forward(self, x):
            s = self.fc1(x)
            h = torch.relu(self.fc2(x)).reshape(-1, self.width)
            return self.out(h) + s.reshape(-1, self.width).softmax(-1).reshape(s.shape)

    class IntOf(_HeldWidth):
        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)).reshape(-1, self.width) / int(self.width))

    class TensorOf(_HeldWidth):  # read in C, by no int operation: the graph traced at width + 1 differs
        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)).reshape(-1, self.width) * torch.full((), self.width).rsqrt())

    class Looped(_HeldWidth):  # a loop over it: more nodes at width + 1
        def forward(self, x):
            h = torch.relu(self.fc1(x)).reshape(-1, self.width)
            for _ in range(self.width // 3):
                h = h * 0.9
            return self.fc2(h)

    cases = [
        (Divided, "also computes with it"),
        (ClassesToo, "no permutation reaches"),
        (IntOf, "also computes with it"),
        (TensorOf, "the graph changes with it elsewhere"),
        (Looped, "also computes with it"),
    ]
    for cls, why in cases:
        torch.manual_seed(0)
        models = [cls().eval() for _ in range(2)]
        spec = spec_from_graph(models[0], torch.randn(2, 8))
        assert spec.widths == {} and why in str(spec.fixed), cls
        assert _kept_fixed(bayesfuse.fuse(models, "pfnm"), spec, models[0]), cls


def test_tracing_gives_a_modules_numbers_back_as_they_were():
    """The numbers a module holds are stood in for while tracing: a ``__setattr__`` of one's own
    that refuses new values is never run, and a copy the forward keeps (``self.cols =
    self.width``) comes back an ``int``, as the attribute does."""

    class Frozen(_HeldWidth):
        def __setattr__(self, name, value):
            if getattr(self, "_frozen", False) and type(value) is not bool and isinstance(value, int):
                raise AttributeError(f"{name} is read-only")
            super().__setattr__(name, value)

    class Copying(_HeldWidth):
        def __init__(self):
            super().__init__()
            self.cols = 1  # one the forward writes over: given back as it was, an int

        def forward(self, x):
            self.cols = self.width
            return self.fc2(torch.relu(self.fc1(x)).reshape(-1, self.cols))

    class Constant(_HeldWidth):  # a constant the forward makes: fx keeps it, and tracing leaves none on the model
        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)).reshape(-1, self.width) * torch.tensor(0.5))

    constant = Constant().eval()
    own = set(vars(constant))
    assert spec_from_graph(constant, torch.randn(2, 8)).widths == {"width": Axis("P1")}
    assert set(vars(constant)) == own

    frozen = Frozen().eval()
    frozen._frozen = True
    assert spec_from_graph(frozen, torch.randn(2, 8)).widths == {"width": Axis("P1")}
    assert type(vars(frozen)["width"]) is int
    copying = Copying().eval()
    assert spec_from_graph(copying, torch.randn(2, 8)).widths == {"width": Axis("P1")}
    assert type(copying.width) is int and type(copying.cols) is int and copying.cols in (1, 6)


def test_a_width_held_for_a_stacked_lstm_follows_its_tied_layers():
    """A stacked LSTM's layers are matched as one group when they come out of different widths
    (the spec's groups renamed): the width the network holds for its output follows the group."""

    class HeldLSTM(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.head, self.hidden = nn.LSTM(8, 12, num_layers=2, batch_first=True), nn.Linear(12, 3), 12

        def example_input(self):
            return torch.zeros(2, 40)

        def forward(self, x):
            out, _ = self.rnn(x.view(x.shape[0], 5, 8))
            return self.head(out.reshape(x.shape[0], 5, self.hidden)[:, -1])

    models = [_random(HeldLSTM, s) for s in range(3)]
    assert list(spec_from_graph(models[0]).widths) == ["hidden"]
    fused = bayesfuse.fuse(models, "pfnm")
    assert "rnn" in fused.hyper.get("tied_layers", {})
    assert fused.model.hidden == fused.model.rnn.hidden_size and fused.model(torch.randn(4, 40)).shape == (4, 3)


def test_a_stacked_projected_lstm_ties_its_cells_and_projections_together():
    """Where one part of a stacked projected LSTM comes out uneven, both are matched again as one
    group each: tying the cells moves the projections' matching too."""
    fused = bayesfuse.fuse([_random(lambda: _OneProjected(2), s) for s in range(3)], "pfnm")
    assert set(fused.hyper["tied_layers"]) == {"rnn", "rnn (cells)"}
    assert fused.model(torch.randn(5, 64)).shape == (5, 10)


def test_independent_bilinear_networks_fuse_into_one_that_runs():
    spec = spec_from_module(BilinearNet())
    assert spec.axes["pair.weight"] == (Axis("P3"), Axis("P1"), Axis("P2"))
    assert spec.axes["self_pair.weight"] == (Axis("P4"), Axis("P3"), Axis("P3"))
    fused = bayesfuse.fuse([_random(BilinearNet, s) for s in range(3)], "pfnm")
    assert fused.model.pair.weight.shape == (fused.sizes[2], fused.sizes[0], fused.sizes[1])
    assert fused.model(torch.randn(5, 64)).shape == (5, 10) and min(fused.sizes) > 5


def test_independent_networks_concatenating_streams_of_one_width_keep_a_permutation_each():
    """Two convolutions' channels side by side, of one width: not tied (their units need not
    match), each grown to its own fused width; streams of one permutation already (``a``, ``b``
    tied by ``a * b``) are blocks of the layer reading them."""
    models = [_random(ConcatCNN, s) for s in range(3)]
    spec = spec_from_module(models[0])
    c1, c2 = spec.axes["c1.weight"][0].group, spec.axes["c2.weight"][0].group
    assert c1 != c2 and [spec.axes[k][1].group for k in spec.parts("c3.weight")] == [c1, c2]
    assert spec.axes["head.weight"][1].outer == 3 and "head.weight" not in spec.pieces
    fused = bayesfuse.fuse(models, "pfnm")
    assert fused.model.c3.in_channels == fused.model.c1.out_channels + fused.model.c2.out_channels > 12
    assert fused.model(torch.randn(4, 64)).shape == (4, 10)


def test_independent_gated_networks_fuse_into_ones_that_run():
    """A gated layer's pieces are blocks of its units: the fused layer writes equal pieces again."""
    for cls in (GatedNet, GatedStream):
        models = [_random(cls, s) for s in range(3)]
        for method in ("pfnm", "nafi"):
            fused = bayesfuse.fuse(models, method)
            assert fused.model(torch.randn(5, 64)).shape == (5, 10)
    spec = spec_from_module(GatedNet())
    assert spec.axes["conv.weight"][0].outer == 2 and spec.axes["fc1.weight"][1] == Axis("P1", 1, 16)
    assert spec.axes["norm.weight"][0] == spec.axes["fc1.weight"][0] == Axis("P2", 2)  # normed whole, cut after
    assert spec.axes["fc2.weight"][0] == Axis("P3", 3) and spec.axes["head.weight"][1] == Axis("P3")
    fused = bayesfuse.fuse([_random(GatedNet, s) for s in range(3)], "pfnm")
    assert fused.model.fc1.out_features == 2 * fused.model.fc2.in_features > 24
    stream = spec_from_module(GatedStream())
    assert stream.axes["rnn.weight_hh_l0"] == (Axis("P1", 8), Axis("P1", 2))  # the LSTM's units in pairs
    assert stream.axes["up.weight"][0] == stream.axes["embed.weight"][0] == Axis("P2", 2)  # cut as the stream


class _Pieces(nn.Module):
    """Pieces of the units that cannot be followed, or a width the forward keeps: ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.fc, self.head = how, nn.Linear(64, 12), nn.Linear(4 if how == "a width kept" else 6, 3)
        self.wide, self.rnn = nn.Linear(64, 64), nn.LSTM(6, 6, batch_first=True)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        if self.how == "unequal":  # units cut into two heads, then into pieces of different widths
            a, b = torch.split(h.view(h.shape[0], 2, -1).flatten(1), [4, 8], 1)
            return self.head(torch.cat([a, b[:, :2]], 1))
        if self.how == "unbind":
            return self.head(torch.stack(h.unbind(1)[:6], 1))
        if self.how == "a buffer along the units":
            a, b = h.chunk(2, 1)
            return self.head(a * b * self.mask)
        if self.how == "a split by C - 6":  # computed, but not in proportion to the width
            a, b = h.split(h.shape[-1] - 6, 1)
            return self.head(a * b)
        if self.how == "a slice written":
            a, b = h.chunk(2, 1)
            return self.head(torch.cat([b, a], 1)[:, :6])
        if self.how == "the input cut":  # the input's features are never permuted, so never cut
            a, b = torch.relu(self.wide(x)).chunk(2, 1)
            return self.head((x + torch.cat([b, a], 1))[:, :6])
        a, b, c = torch.split(h, 4, 1)
        return self.head(a * b * c)


@pytest.mark.parametrize(
    "how, says",
    [
        ("unequal", "cutting the units' axis into pieces of widths [4, 8]"),
        ("unbind", "unbind of the units' axis"),
        ("the input cut", "the two operands' units lie on different axes"),
    ],
)
def test_pieces_that_cannot_be_followed_are_refused_in_one_line(how, says):
    with pytest.raises(UnsupportedLayerError, match=re.escape(says)):
        spec_from_module(_Pieces(how), torch.zeros(2, 64))


@pytest.mark.parametrize(
    "how, why",
    [
        ("a width kept", "its forward cuts them by split(4), widths written in the code"),
        ("a buffer along the units", "buffer 'mask' holds a number per unit"),
        ("a slice written", "its forward slices them at None:6, widths written in the code"),
        ("a split by C - 6", "its forward cuts them by split(sub), widths that do not follow theirs"),
    ],
)
def test_pieces_whose_widths_the_forward_fixes_fuse_only_at_their_widths(how, why):
    torch.manual_seed(0)
    models = [_Pieces(how).eval() for _ in range(2)]
    for m in models:
        m.register_buffer("mask", torch.rand(6))
    spec = spec_from_module(models[0], torch.zeros(2, 64))
    assert len(spec.fixed) == 1 and next(iter(spec.fixed.values())).startswith(why)
    (group,) = spec.fixed
    fused = bayesfuse.fuse(models, "nafi")  # the fixed group matched at its width, one to one
    assert fused.hyper["fixed"] == spec.fixed
    assert dict(zip(fused.groups, fused.sizes))[group] == spec.sizes(models[0].state_dict())[group]
    assert fused.model(torch.randn(5, 64)).shape == (5, 3)
    assert bayesfuse.fuse(models, "ot").model(torch.randn(5, 64)).shape == (5, 3)


class _Stacked(nn.Module):
    """Streams stacked: pieces given by keyword, and two convolutions' channels interleaved
    (``stack(..., 2).flatten(1, 2)``) read by a depthwise convolution, one filter per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.c1, self.c2 = nn.Linear(64, 12), nn.Conv1d(4, 8, 3, padding=1), nn.Conv1d(8, 8, 3, padding=1)
        self.dw, self.head, self.head2 = nn.Conv1d(16, 16, 3, padding=1, groups=16), nn.Linear(6, 10), nn.Linear(16, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        a, b = torch.relu(self.fc(x)).chunk(2, 1)
        u = torch.stack(tensors=[a, b], dim=1).sum(1)
        c = torch.relu(self.c1(x.view(-1, 4, 16)))
        h = torch.stack([c, torch.relu(self.c2(c))], 2).flatten(1, 2)  # channel 2i, 2i+1: unit i of each
        return self.head(u) + self.head2(self.dw(h).mean(-1))


def test_stacked_streams_are_tied_and_a_depthwise_convolution_keeps_their_interleaving():
    spec = spec_from_module(_Stacked())
    assert spec.axes["dw.weight"][0] == Axis(spec.axes["c1.weight"][0].group, 1, 2)
    torch.manual_seed(0)
    model, x = far_from_identity_norms(_Stacked()).eval(), torch.randn(20, 64)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    copy = _Stacked()
    perms = random_permutations(spec.sizes(state), np.random.default_rng(0))
    copy.load_state_dict({k: torch.as_tensor(v) for k, v in permute(state, spec, perms).items()})
    assert _gap(model, copy.eval(), x) < 1e-4 and _gap(model, bayesfuse.fuse([model, copy], "pfnm").model, x) < 1e-4


def test_a_mean_written_by_hand_divides_by_the_width_as_mean_does():
    """``h.sum(-1) / h.shape[-1]``: a width itself (no root of it) follows the units."""

    class HandMean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = nn.Linear(64, 16), nn.Linear(16, 10)

        def forward(self, x):
            h = torch.relu(self.fc(x))
            return self.head(h) + h.sum(-1, keepdim=True) / h.shape[-1]

    torch.manual_seed(0)
    model, x = HandMean().eval(), torch.randn(20, 64)
    spec = spec_from_module(model, x[:2])
    assert spec.axes["fc.weight"][0] == Axis("P1")
    assert bayesfuse.fuse([model, HandMean().eval()], "pfnm").model(x).shape == (20, 10)


def test_heads_written_by_hand_are_blocks_of_one_permutation_tied_to_the_widths_read():
    """Within-head features are one permutation for every head; where the forward reads a width
    off the stream (``C // heads``, ``reshape(B, N, C)``), the stream is cut into as many blocks
    and tied to them, so independent networks fuse into ones whose reshapes run."""
    spec = spec_from_module(QKVAttention())
    p = spec.axes["qkv.weight"][0].group
    assert spec.axes["qkv.weight"][0] == Axis(p, 6) and spec.axes["proj.weight"][1] == Axis(p, 2)
    assert spec.axes["embed.weight"][0] == spec.axes["norm.weight"][0] == Axis(p, 2)  # the stream, tied by C
    assert spec.axes["up.weight"][0].outer == 2 and spec.axes["up.weight"][0].group != p
    views = spec_from_module(ViewHeadsAttention())
    assert {views.axes[f"{n}.weight"][0] for n in ("embed", "q", "k", "v", "o")} == {Axis("P1", 4)}
    for cls in (QKVAttention, ViewHeadsAttention, SharedBlocks):  # the last calls its modules again after cuts
        models = [_random(cls, s) for s in range(3)]
        for method in ("pfnm", "nafi"):
            fused = bayesfuse.fuse(models, method)
            assert fused.sizes[0] > 8 and fused.model(torch.randn(5, 64)).shape == (5, 10)


class _Heads(nn.Module):
    """Heads written by hand whose widths fusion would change unseen: ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.qk, self.head = how, nn.Linear(16, 16), nn.Linear(4, 3)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.qk(x.view(-1, 4, 16))
        if self.how == "the heads counted":  # by the code, from a width within a head written as a number
            t = t.view(t.shape[0], 4, -1, 8).transpose(1, 2)
            return self.head((t @ t.transpose(-2, -1)).mean(dim=(1, 2)))
        if self.how == "a width within a head written":  # the tokens' axis would take what fusion adds
            t = t.view(t.shape[0], -1, 2, 8).transpose(1, 2)
            return self.head((t @ t.transpose(-2, -1)).mean(dim=(1, 2)))
        t = t.view(-1, 4, 2, t.shape[-1] // 2).transpose(1, 2)  # (B, heads, N, 8)
        if self.how == "a scale in sdpa":
            return self.head(F.scaled_dot_product_attention(t, t, t, scale=t.size(-1) ** -0.5).mean(dim=(1, 3)))
        d, logits = t.shape[-1], t @ t.transpose(-2, -1)
        scale = d**0.5 if self.how == "a computed scale" else logits.new_tensor(d).sqrt()  # or made a tensor
        return self.head((logits / scale).mean(dim=(1, 2)))


@pytest.mark.parametrize(
    "how, why",
    [
        ("a computed scale", "a number that scales a tensor is computed as a root of their width"),
        ("a scale made a tensor", "a number that scales a tensor is computed as a root of their width"),
        ("a scale in sdpa", "the attention's scale is computed as a root of their width"),
        ("the heads counted", "its forward counts its heads from a width within a head"),
        ("a width within a head written", "its forward cuts them into heads of 8, widths written in the code"),
    ],
)
def test_heads_whose_widths_the_forward_fixes_fuse_only_at_their_widths(how, why):
    """A permuted copy keeps the function; PFNM matches the fixed group at its width (its units
    one to one) and fuses the copy back; OT, which keeps every width, fuses it back too."""
    torch.manual_seed(0)
    models = [_Heads(how).eval() for _ in range(2)]
    x = torch.randn(20, 64)
    spec = spec_from_module(models[0], x[:2])
    assert set(spec.fixed) == {"P1"} and spec.fixed["P1"].startswith(why)
    state = {k: v.numpy() for k, v in models[0].state_dict().items()}
    perms = random_permutations(spec.sizes(state), np.random.default_rng(0))
    copy = _Heads(how)
    copy.load_state_dict({k: torch.as_tensor(v) for k, v in permute(state, spec, perms).items()})
    assert _gap(models[0], copy.eval(), x) < 1e-4
    fused = bayesfuse.fuse(models, "pfnm")
    assert fused.hyper["fixed"] == spec.fixed and dict(zip(fused.groups, fused.sizes))["P1"] == spec.sizes(state)["P1"]
    assert _gap(models[0], bayesfuse.fuse([models[0], copy], "pfnm").model, x) < 1e-4
    assert _gap(models[0], bayesfuse.fuse([models[0], copy], "ot").model, x) < 1e-4


@pytest.mark.parametrize(
    "equation, shapes",
    [
        ("bhid,bhjd->bhij", [(2, 3, 4, 5), (2, 3, 6, 5)]),
        ("bhij, bhjd -> bhid", [(2, 3, 4, 6), (2, 3, 6, 5)]),
        ("...d,...d->...d", [(2, 4, 5), (4, 5)]),  # ellipses of different lengths, broadcast
        ("...ij,...jk", [(2, 3, 4), (4, 5)]),  # implicit: the ellipsis first, then i k
        ("bnd,bnd", [(2, 3, 4), (2, 3, 4)]),  # implicit: a number
        ("ij,jk", [(3, 4), (4, 5)]),
        ("bI,bJ->bJI", [(2, 3), (2, 4)]),  # capitals are letters too
        ("...,...->...", [(2, 3), (1, 3)]),
    ],
)
def test_einsum_subscripts_agree_with_torch(equation, shapes):
    """``_einsum_subscripts`` names every axis; the result's letters, read at the operands' sizes,
    give the shape torch's einsum returns (an axis of size 1 broadcast)."""
    from bayesfuse.nets.graph_spec import _einsum_subscripts

    subscripts, result = _einsum_subscripts(equation, [len(s) for s in shapes])
    sizes: dict[str, int] = {}
    for subs, shape in zip(subscripts, shapes):
        assert len(subs) == len(shape)
        for letter, n in zip(subs, shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    out = torch.einsum(equation, *(torch.randn(s) for s in shapes))
    assert tuple(sizes[letter] for letter in result) == tuple(out.shape)


@pytest.mark.parametrize(
    "name, args",
    [
        ("transpose", [0, 2]),
        ("swapaxes", [-1, 1]),
        ("swapdims", [3, 3]),
        ("permute", [[3, 1, 0, 2]]),
        ("permute", [3, 1, 0, 2]),
        ("movedim", [0, -1]),
        ("movedim", [[0, 1], [3, 0]]),
        ("moveaxis", [(1,), (2,)]),
    ],
)
def test_where_moving_axes_puts_them_agrees_with_torch(name, args):
    from bayesfuse.nets.graph_spec import _axes_order

    x = torch.randn(2, 3, 4, 5)
    order = _axes_order(name, args, {}, x.dim())
    assert torch.equal(x.permute(order), getattr(x, name)(*args))


class _Einsum(nn.Module):
    """An einsum that no permutation of the units can pass: ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.fc, self.other = how, nn.Linear(64, 6), nn.Linear(64, 5)
        self.w, self.head = nn.Parameter(torch.randn(4, 6)), nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        if self.how == "outer":  # two streams' units on two axes of the result
            return self.head(torch.einsum("bi,bj->bij", h, self.other(x)).sum(2))
        if self.how == "diagonal":
            return self.head(torch.einsum("bii->bi", h.unsqueeze(1).expand(-1, 6, -1)))
        if self.how == "weight":  # a weight applied by hand with another operand: no layer
            return self.head(torch.einsum("bd,ed,e->be", h, self.w, x[:, :4].mean(0)).repeat(1, 2)[:, :6])
        return self.head(torch.einsum("bd,bd->bd", h, x[:, :6]))  # the input's features met with units


@pytest.mark.parametrize(
    "how, why",
    [
        ("outer", "einsum 'bi,bj->bij' of two permuted streams (an outer product) cannot be followed"),
        ("diagonal", "einsum 'bii->bi' takes a diagonal along permuted units"),
        ("weight", "einsum applies the network's own weight 'w'"),
        ("unknown", "einsum 'bd,bd->bd': an operand (getitem) whose units cannot be followed meets permuted units"),
    ],
)
def test_an_einsum_that_cannot_be_followed_is_refused_in_one_line(how, why):
    with pytest.raises(UnsupportedLayerError, match=re.escape(why)):
        spec_from_graph(_Einsum(how), torch.zeros(2, 64))


class _RepeatedUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(64, 4), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.fc(x).repeat_interleave(2, dim=1))


class _ReshapedAsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(64, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.fc(x).view(x.shape[0], 2, -1).reshape_as(x[:, :8]))


def test_reshaped_as_a_tensor_without_units_fixes_their_width():
    spec = spec_from_graph(_ReshapedAsInput(), torch.zeros(2, 64))
    assert spec.fixed == {"P1": "its forward reshapes them as getitem_1, which holds no units on their axis"}


class _InputAsUnits(nn.Module):
    def __init__(self, how: str = "reshape_as") -> None:
        super().__init__()
        self.fc, self.head, self.other = nn.Linear(64, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        self.how = how

    def forward(self, x):
        h = self.fc(x)
        if self.how == "view":
            return self.head(h) + self.other(x[:, 8:16].view(h.shape))
        return self.head(h) + self.other(x[:, :8].reshape_as(h))


def test_numbers_without_units_reshaped_to_their_width_fix_it():
    """The input's numbers reshaped to the units' whole shape (``reshape_as(h)``, ``view(h.shape)``):
    a fused width would not fit them, so it stays; independent networks whose heads are merged
    by ``reshape(t.shape)`` fuse into one that runs, the heads' width tied to the stream's."""
    spec = spec_from_graph(_InputAsUnits(), torch.zeros(2, 64))
    assert spec.fixed == {"P1": "its forward reshapes getitem to their width, as fc"}
    viewed = spec_from_graph(_InputAsUnits("view"), torch.zeros(2, 64))
    assert viewed.fixed == {"P1": "its forward reshapes getitem to their width, as fc"}
    fused = bayesfuse.fuse([_random(ShapeOfAttention, s) for s in range(3)], "pfnm")
    assert fused.sizes[0] > 8 and fused.model(torch.randn(5, 64)).shape == (5, 10)


def test_repeating_each_unit_is_refused_in_one_line():
    with pytest.raises(UnsupportedLayerError, match="repeat_interleave on a permuted axis cannot be followed"):
        spec_from_graph(_RepeatedUnits(), torch.zeros(2, 64))


def test_a_frozen_layer_comes_back_frozen():
    models = [_random(MyMLP, s) for s in range(2)]
    for m in models:
        m.fc1.requires_grad_(False)
    for method in ("pfnm", "ot", "fedavg"):
        fused = bayesfuse.fuse(models, method).model
        assert not fused.fc1.weight.requires_grad and fused.fc2.weight.requires_grad


def test_where_indexing_puts_the_units_agrees_with_torch():
    """``_indexed_axis`` against PyTorch itself, on every index of up to three elements built from
    ints, slices, None, Ellipsis and list (advanced) indices, for the units on each axis of a 4-D
    tensor: wherever it names an axis, the units are there (it may refuse, never misplace)."""
    import itertools

    from bayesfuse.nets.graph_spec import _indexed_axis

    sizes, named = (2, 3, 4, 5), 0
    elements = [0, -1, slice(None), slice(1, None), None, Ellipsis, [0, 1], [[0], [1]]]
    for dim in range(4):
        x = (torch.arange(sizes[dim]) + 1.0).view(*[-1 if d == dim else 1 for d in range(4)]).expand(sizes)
        for length in (1, 2, 3):
            for index in itertools.product(elements, repeat=length):
                try:
                    y = x[index]
                except (IndexError, TypeError, RuntimeError):
                    continue
                got = _indexed_axis(tuple(index), 4, dim, y.dim())
                if isinstance(got, int):
                    named += 1
                    units = y.movedim(got, 0).reshape(y.shape[got], -1)
                    assert y.shape[got] == sizes[dim] and torch.equal(units[:, :1].flatten(), x.unique()), index
                    assert bool((units == units[:, :1]).all()), index
    assert named > 1000


class _LastValid(nn.Module):
    """An LSTM read at each sequence's last real step: ``out[arange(B), lengths - 1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 12, batch_first=True), nn.Linear(12, 10)
        self.register_buffer("lengths", torch.tensor([8, 5]))

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        out, _ = self.rnn(x.view(-1, 8, 8))
        return self.head(out[torch.arange(2), self.lengths - 1])  # a batch of two


class _PairWithScale(nn.Module):
    """``forward(self, pair, scale=1.0)``: a tuple example input is the one pair, not two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(32, 16), nn.Linear(16, 10)

    def example_input(self):
        return (torch.zeros(2, 32), torch.zeros(2, 32))

    def forward(self, pair, scale=1.0):
        return self.head(torch.relu(self.a(pair[0] + pair[1]))) * scale


@pytest.mark.parametrize("cls", [_LastValid, _PairWithScale])
def test_gathers_before_the_units_and_a_pair_with_options_trace_and_fuse_back(cls):
    model = _random(cls, 0)
    x = example_input_for(model)
    x = (torch.randn(2, 32), torch.randn(2, 32)) if isinstance(x, tuple) else torch.randn(2, 64)

    def run(m):
        with torch.no_grad():
            return m(x)

    assert float((run(model) - run(_permuted(model, 1))).abs().max()) < 1e-4
    fused = bayesfuse.fuse([model, _permuted(model, 2)], "pfnm").model
    assert float((run(model) - run(fused)).abs().max()) < 1e-4


@pytest.mark.parametrize("split_by", ["n_embd", "C"])
def test_a_nanogpt_block_traces_its_causal_mask_sliced_by_the_sequence_length(split_by):
    """nanoGPT's attention: ``B, T, C = x.size()`` and the mask buffer ``self.bias[:, :, :T, :T]``
    (a slice by a size read off the input, which fx traces only with buffers as nodes). Split by
    ``self.n_embd``, a width the module holds (set to the fused one), or by ``C``, read off the
    stream, every method fuses."""
    models = [_random(lambda: NanoGPT(split_by), s) for s in range(3)]
    x = torch.randint(0, 12, (8, 6))
    spec = spec_from_module(models[0])
    state = {k: v.detach().numpy() for k, v in models[0].state_dict().items()}
    copy = NanoGPT(split_by)
    copy.load_state_dict(
        {
            k: torch.as_tensor(v)
            for k, v in permute(state, spec, random_permutations(spec.sizes(state), np.random.default_rng(0))).items()
        }
    )
    copy.eval()
    assert _gap(models[0], copy, x) < 1e-4 and _gap(models[0], bayesfuse.fuse([models[0], copy], "ot").model, x) < 1e-4
    assert bayesfuse.fuse(models, "fedavg").model(x).shape == (8, 6, 12)
    assert not spec.fixed
    assert spec.widths == ({"n_embd": spec.axes["ln_f.weight"][0]} if split_by == "n_embd" else {})  # the stream
    assert _gap(models[0], bayesfuse.fuse([models[0], copy], "pfnm").model, x) < 1e-4
    fused = bayesfuse.fuse(models, "pfnm")
    assert fused.sizes[0] > 16 and fused.model(x).shape == (8, 6, 12)
    assert split_by == "C" or fused.model.n_embd == fused.model.ln_f.weight.shape[0] > 16


class _SplitWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(64, 8), nn.Linear(4, 3)

    def forward(self, x):
        a, b = self.fc(x).split(4, dim=1)
        return self.head(a * b)


def test_pieces_of_different_widths_are_groups_of_their_own():
    """``qkv.split([self.dk, self.dk, self.dv], -1)``: the projection's rows are held in pieces,
    one group per piece (the queries' and keys' one, tied by ``q @ k^T``), each held width set to
    its piece's fused width; a piece read off the stream is the stream's; one written in the code
    is fixed. (Permuted copies fuse back: NETS above.)"""
    spec = spec_from_module(UnequalSplit())
    qk, v, stream = spec.axes["qkv.weight@0"][0], spec.axes["qkv.weight@2"][0], spec.axes["embed.weight"][0]
    assert spec.axes["qkv.weight@1"][0] == qk and len({qk, v, stream}) == 3 and not spec.fixed
    assert spec.axes["gate.weight@0"][0] == stream and spec.widths == {
        "dk": qk,
        "dv": v,
        "dg": spec.axes["mix.weight"][1],
    }
    assert spec.sizes(UnequalSplit().state_dict()) == {"P1": 8, "P2": 4, "P3": 6, "P4": 4}
    fused = bayesfuse.fuse([_random(UnequalSplit, s) for s in range(3)], "pfnm")
    m = fused.model
    assert (m.dk, m.dv, m.dg) == ((m.qkv.out_features - m.out.in_features) // 2, m.out.in_features, m.mix.in_features)
    assert m.qkv.out_features == 2 * m.dk + m.dv > 14 and m(torch.randn(5, 64)).shape == (5, 10)
    written = spec_from_module(UnequalSplit(written=True))
    assert written.fixed == {"P4": "its forward cuts them into pieces of widths [8, 4], widths written in the code"}


class _AfterSplit(nn.Module):
    """Units split into pieces of different widths, then read whole again: reshaped by a width
    (``how``: the module's ``self.hidden``, or written), or a width read off the layer that makes
    them, whose rows are held in pieces (``"scale"``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.da, self.db, self.hidden, self.how = 4, 6, 10, how
        self.fc, self.fa, self.whole, self.head = nn.Linear(16, 10), nn.Linear(4, 8), nn.Linear(10, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.fc(x.view(-1, 4, 16)))
        a, b = h.split([self.da, self.db], -1)
        if self.how == "scale":
            return self.head(self.fa(a).mean(1) * self.fc.weight.shape[0] ** -0.5)
        y = h.reshape(-1, self.hidden if self.how == "held" else 10)
        return self.head(self.fa(a).mean(1) + self.whole(y).view(-1, 4, 8).mean(1))


def test_pieces_read_whole_by_a_width_given_as_a_number_are_fixed():
    """One number is the sum of the pieces' widths, which fusion changes one by one: each piece's
    width is fixed (PFNM matches them at it); read off the weight in pieces, refused."""
    for how, given in (("held", "a number it holds"), ("written", "a number written in the code")):
        spec = spec_from_graph(_AfterSplit(how), torch.zeros(2, 64))
        why = f"its forward reshapes them, beside other streams, to a width given by {given}"
        assert set(spec.fixed) == {"P1", "P2"} and set(spec.fixed.values()) == {why}  # the two pieces
    with pytest.raises(UnsupportedLayerError, match="a width read off 'fc.weight', whose axis 0 holds several groups'"):
        spec_from_graph(_AfterSplit("scale"), torch.zeros(2, 64))


def test_a_norm_reading_its_width_off_its_weight_follows_the_fusion():
    """nanoGPT's LayerNorm reads its width off its own weight (``self.weight.shape``): it follows
    the units, and independent networks fuse into one that runs at the fused width."""
    spec = spec_from_module(VectorNormMLP())
    assert not spec.fixed and spec.axes["ln2.weight"] == spec.axes["fc.bias"]
    fused = bayesfuse.fuse([_random(VectorNormMLP, s) for s in range(3)], "pfnm")
    assert fused.model.ln2.weight.shape == (fused.sizes[0],) and fused.sizes[0] > 12
    assert fused.model(torch.randn(5, 64)).shape == (5, 10)


def test_a_split_by_a_width_written_in_the_code_fixes_it():
    spec = spec_from_graph(_SplitWritten(), torch.zeros(2, 64))
    assert spec.fixed == {"P1": "its forward cuts them by split(4), widths written in the code"}


def test_weights_tied_fuse_as_one_tensor():
    """An embedding tied to the output layer (``wte.weight = lm_head.weight``) is one tensor: the
    spec gives both names one description and ties the alias to the output layer's entry; a
    permuted copy computes the function and fuses back by every method; independent networks
    fuse into one that holds the tensor once, as the clients did."""
    spec = spec_from_module(TiedGPT())
    assert spec.tied == {"wte.weight": "lm_head.weight"}
    assert spec.axes["wte.weight"] == spec.axes["lm_head.weight"] == (None, spec.axes["ln_f.weight"][0])
    models = [_random(TiedGPT, s) for s in range(3)]
    x = torch.randint(0, 12, (8, 6))
    state = {k: v.detach().numpy() for k, v in models[0].state_dict().items()}
    copy = TiedGPT()
    copy.load_state_dict(
        {
            k: torch.as_tensor(v)
            for k, v in permute(state, spec, random_permutations(spec.sizes(state), np.random.default_rng(0))).items()
        }
    )
    copy.eval()
    assert _gap(models[0], copy, x) < 1e-4
    for method in ("pfnm", "nafi", "ot"):
        assert _gap(models[0], bayesfuse.fuse([models[0], copy], method).model, x) < 1e-4, method
    for method in ("pfnm", "nafi", "ot", "fedavg"):
        fused = bayesfuse.fuse(models, method)
        assert fused.model.wte.weight is fused.model.lm_head.weight, method
        assert fused.model(x).shape == (8, 6, 12) and fused.hyper["tied"] == {"wte.weight": "lm_head.weight"}
        written = fused.model.state_dict()  # what a file of it holds: the one tensor under both names
        assert torch.equal(written["wte.weight"], written["lm_head.weight"])


def test_no_batch_norm_folds_into_a_weight_used_elsewhere_too():
    """Folding a batch norm into a layer rewrites that layer's weight; where the weight is used
    elsewhere too (tied to another layer's, or the layer applied twice) the fold would reach the
    other use: such batch norms are kept. (Permuted copies fuse back: NETS above.)"""
    spec = spec_from_module(TiedFoldCNN())
    assert spec.folds == {} and spec.tied == {"c2.weight": "c1.weight"}


def test_a_parameter_held_as_a_buffer_too_is_refused_in_one_line():
    class ParamBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = nn.Linear(64, 6), nn.Linear(6, 3)
            self.register_buffer("copy", self.fc.weight)

        def forward(self, x):
            return self.head(self.fc(x))

    with pytest.raises(UnsupportedLayerError, match=r"'fc.weight' is a parameter also held as a buffer \('copy'\)"):
        spec_from_graph(ParamBuffer(), torch.zeros(2, 64))


class _StackedHeldTwice(nn.Module):
    """A stacked LSTM whose output layer is held under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 12, num_layers=2, batch_first=True), nn.Linear(12, 10)
        self.more = nn.ModuleDict({"head": self.head})

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        return self.head(self.rnn(x.view(-1, 8, 8))[0][:, -1])


def test_aliases_come_back_on_the_spec_the_method_returns():
    """Matching ties a stacked LSTM's layers into one group and returns that spec: the aliases
    come back on it, so the clients' heads read the groups it has."""
    fused = bayesfuse.fuse([_random(_StackedHeldTwice, s) for s in range(3)], "pfnm", head="clients")
    assert fused.hyper["tied"] == {"more.head.weight": "head.weight", "more.head.bias": "head.bias"}
    assert fused.model(torch.randn(5, 64)).shape == (5, 10)


def test_a_module_held_under_two_names_stays_one_module():
    models = [_random(SharedModule, s) for s in range(3)]
    spec = spec_from_module(models[0])
    assert spec.tied == {"block.mix.weight": "mix.weight", "block.mix.bias": "mix.bias"}
    x = torch.randn(20, 64)
    for method in ("pfnm", "ot"):
        fused = bayesfuse.fuse(models, method).model
        assert fused.block["mix"] is fused.mix and fused(x).shape == (20, 10)
    train = Dataset(x.repeat(3, 1).numpy(), torch.randint(0, 10, (60,)).numpy(), 10)
    fused = bayesfuse.fuse(models, "fedma", data=(train, [np.arange(20 * j, 20 * j + 20) for j in range(3)]))
    assert fused.model.block["mix"] is fused.model.mix and fused.model(x).shape == (20, 10)


def test_streams_of_different_widths_side_by_side_keep_a_permutation_each():
    """``torch.cat`` of streams of different widths, or of the input beside hidden units: each
    stream keeps its own permutation, and the layer reading them has a weight the spec holds in
    pieces, one per stream (the input's numbers one unpermuted piece)."""
    spec = spec_from_module(_ConcatInput((5, 12)))
    assert spec.pieces == {"head.weight": (1, (("head.weight@0", None), ("head.weight@1", None)))}
    assert spec.axes["head.weight@0"] == (None, Axis("P2")) and spec.axes["head.weight@1"] == (None, Axis("P1"))
    spec = spec_from_module(_ConcatInput())
    assert spec.pieces["head.weight"] == (1, (("head.weight@0", 64), ("head.weight@1", None)))
    dense = spec_from_module(DenseBlockCNN())
    assert [len(dense.parts(k)) for k in ("layers.1.conv1.weight", "norm.weight", "head.weight")] == [2, 3, 3]
    assert dense.axes["norm.running_var@1"] == (dense.axes["layers.0.conv2.weight"][0],)  # a norm of pieces
    assert dense.folds == {f"layers.{i}.norm2": f"layers.{i}.conv1" for i in range(2)}  # into a layer of pieces
    inception = spec_from_module(InceptionMLP())
    assert inception.axes["mix.weight@1"][1] == Axis(inception.axes["b2.weight"][0].group, 1, 8)  # flattened maps
    with pytest.raises(ValueError, match=re.escape("does not hold its pieces of lengths [64, 5] along dimension 1")):
        spec.split({**_ConcatInput((5, 12)).state_dict(), "fc.weight": torch.zeros(5, 64)})


class _BiasFreeUp(nn.Module):
    """A transposed convolution without bias before a batch norm at its initial values: the folded
    biases are all alike, so only the weights (on their axis 1) tell its units apart."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, bias=False)
        self.bn, self.head = nn.BatchNorm1d(6), nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.up(x.view(-1, 4, 16)))).mean(2))


def test_a_norm_without_affine_parameters_fixes_its_width():
    """A LayerNorm or RMSNorm without affine parameters holds its width in ``normalized_shape``
    alone, which no entry gives at another width: the rebuilt network failed to run after PFNM
    (with a message about the forward's own widths); the spec now says so, and PFNM matches its
    units at that width, as OT keeps the widths. With affine parameters (an RMSNorm's scale) it is
    rebuilt at the fused width."""

    class Plain(nn.Module):
        def __init__(self, rms: bool = False) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)
            self.ln = nn.RMSNorm(16, elementwise_affine=False) if rms else nn.LayerNorm(16, elementwise_affine=False)

        def forward(self, x):
            return self.b(F.relu(self.ln(self.a(x))))

    for rms in (False, True):
        torch.manual_seed(0)
        models = [Plain(rms).eval() for _ in range(3)]
        kind = "RMSNorm" if rms else "LayerNorm"
        spec = spec_from_graph(models[0], torch.zeros(2, 64))
        assert f"{kind} 'ln' has no affine parameters" in spec.fixed["P1"]
        fused = bayesfuse.fuse(models, "pfnm")
        assert _kept_fixed(fused, spec, models[0]) and fused.model(torch.randn(2, 64)).shape == (2, 10)
        assert bayesfuse.fuse(models, "ot").model(torch.randn(2, 64)).shape == (2, 10)
    fused = bayesfuse.fuse([_random(LlamaMLP, s) for s in range(3)], "pfnm").model
    assert fused.norm.weight.shape == (fused.stem.out_features,) and fused.stem.out_features > 24


def test_functional_layer_norms_of_a_class_of_ones_own_follow_the_units():
    """``F.layer_norm`` as ConvNeXt's ``LayerNorm2d`` calls it (a subclass of ``nn.LayerNorm``
    with its own forward, channels moved last): its weight and bias follow the channels, and the
    rebuilt norm is still the user's class at the fused width. A width written as a number in the
    forward fixes the units' width: OT fuses, and PFNM matches them at it."""
    spec = spec_from_module(ConvNeXtLike())
    stream = spec.axes["stem.weight"][0].group
    assert spec.axes["stem_norm.weight"] == (Axis(stream),) and spec.axes["down_norm.bias"] == (Axis(stream),)
    assert spec.axes["layer_scale"][0] == Axis(stream) and spec.axes["head_scale"][0].group != stream
    assert not spec.fixed
    models = [_random(ConvNeXtLike, s) for s in range(3)]
    fused = bayesfuse.fuse(models, "pfnm")
    width = fused.model.stem.out_channels
    assert (
        width > 8 and type(fused.model.stem_norm) is LayerNorm2d and fused.model.stem_norm.normalized_shape == (width,)
    )
    assert fused.model(torch.randn(4, 64)).shape == (4, 10)
    spec = spec_from_module(OwnGroupNormCNN())
    assert spec.axes["gn1.weight"][0].outer == 4 and spec.axes["gn2.bias"][0] == Axis(
        spec.axes["conv2.weight"][0].group
    )
    fused = bayesfuse.fuse([_random(OwnGroupNormCNN, s) for s in range(3)], "pfnm").model
    assert type(fused.gn1) is GroupNormSiLU and (fused.gn1.num_groups, fused.gn2.num_groups) == (
        4,
        fused.conv2.out_channels,
    )
    assert fused.gn1.num_channels == fused.conv1.out_channels > 8 and fused(torch.randn(4, 64)).shape == (4, 10)

    # timm's way: F.batch_norm and its activation in a BatchNorm2d subclass, folded into the
    # convolution before it; F.linear in a Linear subclass; both rebuilt as the user's classes
    training = TimmStyleCNN()  # its forward passes self.training: traced as in eval mode, the modes kept
    spec = spec_from_module(training)
    assert spec.folds == {"bn1": "conv1", "bn2": "dw", "bn3": "pw"} and training.training and training.bn1.training
    assert spec.axes["bn2.running_var"] == (Axis(spec.axes["conv1.weight"][0].group),)
    assert spec.axes["head.weight"][1] == Axis(spec.axes["pw.weight"][0].group) and spec.output[0] == "head.weight"
    fused = bayesfuse.fuse([_random(TimmStyleCNN, s) for s in range(3)], "pfnm").model
    assert type(fused.bn1) is BatchNormAct2d and isinstance(fused.bn1.act, nn.SiLU) and type(fused.head) is OwnLinear
    assert fused.bn1.running_mean.shape == (fused.conv1.out_channels,) and fused.conv1.out_channels > 8
    assert fused(torch.randn(4, 64)).shape == (4, 10)

    class Literal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 16), nn.Linear(16, 10)
            self.scale, self.shift = nn.Parameter(torch.rand(16) + 0.5), nn.Parameter(torch.randn(16))

        def forward(self, x):
            return self.b(F.relu(F.layer_norm(self.a(x), (16,), self.scale, self.shift)))

    torch.manual_seed(0)
    models = [Literal().eval() for _ in range(3)]
    spec = spec_from_module(models[0])
    assert "layer_norm is given their width as 16 in the forward" in spec.fixed["P1"]
    assert _kept_fixed(bayesfuse.fuse(models, "pfnm"), spec, models[0])  # matched at 16
    model = models[0]
    assert _gap(model, bayesfuse.fuse([model, _permuted(model, 1)], "ot").model, torch.randn(5, 64)) < 1e-4


def test_group_norms_of_several_groups_keep_each_groups_channels():
    """A GroupNorm of g groups normalises each group's channels together: the channels are one
    permutation within a group for every group (g blocks), so that independent clients fuse into
    groups of equal widths, rebuilt with g groups; a Sequential's too (it was refused)."""
    spec = spec_from_module(GroupNormCNN())
    assert spec.axes["gn1.weight"][0].outer == 4 and spec.axes["conv1.weight"][0].outer == 4
    # the residual add ties conv2's channels (3 groups) to gn3's (2 groups): 6 blocks, lcm(3, 2)
    assert spec.axes["gn2.weight"][0].outer == 6 and spec.axes["conv3.weight"][0].outer == 6
    assert spec.axes["gn4.weight"][0].outer == 2 and spec.axes["gn0.weight"] == (None,)  # the input's: fixed
    models = [_random(GroupNormCNN, s) for s in range(3)]
    fused = bayesfuse.fuse(models, "pfnm").model
    assert (fused.gn1.num_groups, fused.gn2.num_groups, fused.gn4.num_groups) == (4, 3, 2)
    assert fused.gn1.num_channels > 8 and fused.gn1.num_channels % 4 == 0 and fused(torch.randn(5, 64)).shape == (5, 10)
    seq = nn.Sequential(nn.Linear(4, 6), nn.GroupNorm(2, 6), nn.ReLU(), nn.Linear(6, 2))
    assert spec_from_module(seq, torch.zeros(2, 4)).axes["1.weight"][0].outer == 2


@pytest.mark.parametrize("method", ["pfnm", "nafi", "ot"])
def test_a_transposed_convolution_is_matched_by_its_weights(method):
    """OT described a group's units by the entries with the group on axis 0 alone: a transposed
    convolution's weight (its units on axis 1) was left out, and it matched by the biases."""
    torch.manual_seed(0)
    model = _BiasFreeUp().eval()
    spec = spec_from_module(model)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    copy = _BiasFreeUp().eval()
    perms = random_permutations(spec.sizes(state), np.random.default_rng(1))
    copy.load_state_dict({k: torch.as_tensor(v) for k, v in permute(state, spec, perms).items()})
    assert _gap(model, bayesfuse.fuse([model, copy], method).model.eval(), torch.randn(20, 64)) < 1e-4


@pytest.mark.parametrize(
    "cls", [DenseBlockCNN, InceptionMLP, _ConcatInput, UpConvUNet, UpConv1d, VolumeCNN, GroupNormCNN]
)
def test_independent_networks_with_streams_side_by_side_fuse_with_every_method(cls):
    """PFNM and NAFI grow each stream to its own width, and the pieces of the layers reading them
    are put together at the fused widths; FedMA retrains them; OT and FedAvg keep the widths.
    Transposed convolutions (their units on the weight's axis 1) grow alike."""
    models = [_random(cls, s) for s in range(3)]
    x = torch.randn(20, 64)
    for method in ("pfnm", "nafi", "ot", "fedavg"):
        fused = bayesfuse.fuse(models, method)
        assert fused.model(x).shape == models[0](x).shape
        if method in ("pfnm", "nafi") and cls is DenseBlockCNN:  # the classifier reads 3 + both streams, grown
            sizes = dict(zip(fused.groups, fused.sizes))
            assert fused.model.head.in_features == 3 + sizes["P2"] + sizes["P4"] > 13
        if method in ("pfnm", "nafi") and cls is UpConvUNet:  # rebuilt at the fused widths: in, out, in pieces
            up, dec = fused.model.up, fused.model.dec
            assert up.weight.shape[:2] == (fused.model.mid.out_channels, up.out_channels) and up.out_channels > 7
            assert dec.in_channels == fused.model.enc.out_channels + up.out_channels
    torch.manual_seed(0)
    train = Dataset(torch.randn(60, 64).numpy(), torch.randint(0, 10, (60,)).numpy(), 10)
    parts = [np.arange(20 * j, 20 * j + 20) for j in range(3)]
    if cls is not _ConcatInput:
        assert bayesfuse.fuse(models, "fedma", data=(train, parts)).model(x).shape == (20, 10)


@pytest.mark.parametrize("cls", [DenseBlockCNN, _ConcatInput, UpConvUNet])
def test_an_output_layer_reading_streams_side_by_side_keeps_the_clients_heads(cls):
    """The clients' own heads on an output layer that reads streams side by side (and the input):
    each client's column moves to its stream's fused unit, piece by piece, so permuted copies fuse
    back to the network's predictive; with summaries the heads are Laplace posteriors, and the
    second rounds run."""
    model, x = _random(cls, 0), torch.randn(40, 64)
    copies = [_permuted(model, s) for s in range(3)]
    fused = bayesfuse.fuse(copies, "pfnm", head="clients")
    with torch.no_grad():
        torch.testing.assert_close(fused.model(x).softmax(-1).float(), model(x).softmax(-1), atol=1e-5, rtol=0)
    torch.manual_seed(0)
    y = torch.randint(0, 3 if cls is _ConcatInput else 10, (60,))
    x = torch.randn(60, 64)
    models = [_random(cls, s) for s in range(3)]
    fused = bayesfuse.fuse(models, "pfnm", summaries=[bayesfuse.summarize(m, x, y) for m in models])
    assert fused.hyper["summaries"]["used"] and fused.model.n_heads == 3 and fused.model(x).shape == (60, y.max() + 1)
    train, parts = Dataset(x.numpy(), y.numpy(), int(y.max()) + 1), [np.arange(20 * j, 20 * j + 20) for j in range(3)]
    assert bayesfuse.fuse(models, "pfnm", rounds=2, data=(train, parts)).model(x).shape == (60, y.max() + 1)
    if cls is DenseBlockCNN:  # the batch-norm round averages a norm of pieces piece by piece
        fused = bayesfuse.fuse(models, "pfnm", rounds=2, second_round="batchnorm", data=(train, parts))
        assert fused.model.norm.running_var.shape == (fused.model.head.in_features,)
    if cls is UpConvUNet:  # a batch norm after a transposed convolution: its channels on the weight's axis 1
        fused = bayesfuse.fuse(models, "pfnm", rounds=2, second_round="batchnorm", data=(train, parts))
        assert fused.model.bn2.running_var.shape == (fused.model.up.out_channels,)


def test_buffers_read_in_python_trace_as_constants_and_unsaved_ones_along_the_units_fix_them():
    """A buffer whose value the forward uses in Python (``if self.flag:``) traces as a constant;
    a buffer with a number per unit that the state_dict does not hold (``persistent=False``)
    cannot be moved with the units, so they are not permuted at all; an unused
    ``nn.MultiheadAttention`` is left alone."""

    class Flags(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.head = nn.Linear(64, 8), nn.Linear(8, 6), nn.Linear(6, 10)
            self.mha = nn.MultiheadAttention(8, 2)
            self.register_buffer("use_relu", torch.tensor(True))
            self.register_buffer("scale", torch.rand(8) + 0.5, persistent=False)
            self.register_buffer("steps", torch.tensor(2))

        def forward(self, x):
            h = self.a(x)
            for _ in range(int(self.steps)):
                h = F.relu(h) if self.use_relu else h
            return self.head(torch.relu(self.b(h * self.scale)))

    torch.manual_seed(0)
    models, x = [Flags().eval() for _ in range(2)], torch.randn(20, 64)
    spec = spec_from_module(models[0])
    assert spec.axes["a.weight"] == (None, None) and spec.axes["b.weight"] == (Axis("P1"), None)  # a's stay in place
    state = {k: v.numpy() for k, v in models[0].state_dict().items()}
    models[1].load_state_dict(
        {k: torch.as_tensor(v) for k, v in permute(state, spec, {"P1": np.arange(6)[::-1]}).items()}
    )
    models[1].scale = models[0].scale.clone()  # the one buffer the state_dict does not hold
    assert _gap(models[0], models[1], x) < 1e-5 and _gap(models[0], bayesfuse.fuse(models, "ot").model, x) < 1e-5


class _Twice(nn.Module):
    """A stream read twice side by side (one permutation, two blocks) by the output layer, beside
    channels of two widths reduced by ``max(dim).values`` and read through ``.mT``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.a, self.b = nn.Linear(64, 12), nn.Conv1d(1, 3, 3, padding=1), nn.Conv1d(1, 5, 3, padding=1)
        self.mix, self.head = nn.Linear(8, 4), nn.Linear(24 + 8 + 4, 10)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        c = torch.cat([self.a(x.view(-1, 1, 64)), self.b(x.view(-1, 1, 64))], 1)  # (B, 8, 64)
        m = torch.relu(self.mix(c.mT)).mean(1)  # (B, 4)
        return self.head(torch.cat([torch.cat([h, h], 1), c.max(dim=2).values, m], 1))


def test_an_output_layer_reading_a_stream_twice_keeps_the_clients_heads():
    model, x = _random(_Twice, 0), torch.randn(40, 64)
    spec = spec_from_module(model)
    assert [spec.axes[k][1] for k in spec.parts("head.weight")][0] == Axis(spec.axes["fc.weight"][0].group, 2)
    copies = [_permuted(model, s) for s in range(3)]
    assert _gap(model, copies[1], x) < 1e-4
    fused = bayesfuse.fuse(copies, "pfnm", head="clients")
    with torch.no_grad():
        torch.testing.assert_close(fused.model(x).softmax(-1).float(), model(x).softmax(-1), atol=1e-5, rtol=0)


class _SiameseLSTM(nn.Module):
    """A (bidirectional) LSTM whose output is cut into halves multiplied together, then called
    again on another input: its second call finds its units in blocks."""

    def __init__(self, bidirectional: bool = False) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 6, batch_first=True, bidirectional=bidirectional)
        self.pieces, self.head = 2 * (1 + bidirectional), nn.Linear(3 + 6 * (1 + bidirectional), 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        pieces = self.rnn(x[:, :32].reshape(-1, 4, 8))[0][:, -1].chunk(self.pieces, 1)  # halves of each direction
        product = pieces[0]
        for i in range(1, self.pieces):
            product = product * pieces[i]
        again = self.rnn(x[:, 32:].reshape(-1, 4, 8))[0][:, -1]
        return self.head(torch.cat([product, again], 1))


@pytest.mark.parametrize("bidirectional", [False, True])
def test_an_lstm_called_again_after_its_units_were_cut_reads_them_in_blocks(bidirectional):
    model, x = _random(lambda: _SiameseLSTM(bidirectional), 0), torch.randn(20, 64)
    spec = spec_from_module(model)
    gates = spec.axes["rnn.weight_hh_l0"][0]
    assert (gates.outer, spec.axes["rnn.weight_hh_l0"][1].outer) == (8, 2)  # 4 gates x 2 blocks; 2 blocks
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    copy = _SiameseLSTM(bidirectional)
    perms = random_permutations(spec.sizes(state), np.random.default_rng(0))
    copy.load_state_dict({k: torch.as_tensor(v) for k, v in permute(state, spec, perms).items()})
    assert _gap(model, copy.eval(), x) < 1e-4
    for method in ("pfnm", "nafi", "ot"):
        assert _gap(model, bayesfuse.fuse([model, copy], method).model, x) < 1e-4
    fused = bayesfuse.fuse([_random(lambda: _SiameseLSTM(bidirectional), s) for s in range(3)], "pfnm")
    assert fused.model.rnn.hidden_size % 2 == 0 and fused.model(x).shape == (20, 10)


class _AlwaysBatchStats(nn.BatchNorm2d):
    """``F.batch_norm`` with ``training=True``: batch statistics in eval mode too, nothing to fold."""

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps)


class _ShiftAfterAct(nn.BatchNorm2d):
    """Its shift applied after an activation: not the norm's, so not folded with it."""

    def forward(self, x):
        y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, None, False, 0.1, self.eps)
        return F.relu(y) + self.bias[:, None, None]


class _NoShift(nn.BatchNorm2d):
    """A shift it holds and never applies."""

    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, None, False, 0.1, self.eps)


class _KeptForward(nn.BatchNorm2d):
    """A class of one's own that keeps torch's forward: torch's batch norm, folded."""


class _OwnRMS(nn.RMSNorm):
    def __init__(self, dim: int) -> None:
        super().__init__(dim, eps=1e-6)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


def _norm_cnn(norm) -> type:
    class NormCNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.head = nn.Conv2d(1, 8, 3, padding=1), norm(8), nn.Linear(8, 10)

        def example_input(self):
            return torch.zeros(2, 64)

        def forward(self, x):
            return self.head(F.relu(self.bn(self.conv(x.view(-1, 1, 8, 8)))).mean((2, 3)))

    return NormCNN


class _RMSNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(64, 16), _OwnRMS(16), nn.Linear(16, 10)

    def forward(self, x):
        return self.b(F.relu(self.norm(self.a(x))))


@pytest.mark.parametrize(
    ("cls", "folded"),
    [
        (_norm_cnn(_AlwaysBatchStats), False),
        (_norm_cnn(_ShiftAfterAct), False),
        (_norm_cnn(_NoShift), False),
        (_norm_cnn(_KeptForward), True),
        (_RMSNet, False),
    ],
)
@pytest.mark.parametrize("method", ["pfnm", "ot"])
def test_norms_of_ones_own_fold_only_when_they_are_a_batch_norm(cls, folded, method):
    """A functional batch norm is folded into the layer before it only where it normalises by its
    running statistics and applies every scale and shift its module holds (a shift applied after
    the activation, or never, is not the norm's; each had been folded, 0.06-0.08 off, or crashed);
    a class that keeps torch's forward is torch's layer; an RMSNorm of one's own is rebuilt as a
    copy (its ``__init__`` took no ``eps``)."""
    torch.manual_seed(0)
    model = library_randomised(cls())
    assert bool(spec_from_module(model).folds) == folded
    x = torch.randn(12, 64)
    assert _gap(model, bayesfuse.fuse([model, _permuted(model, 1)], method).model, x) < 1e-4
    torch.manual_seed(1)
    assert bayesfuse.fuse([library_randomised(cls()) for _ in range(3)], method).model(x).shape == (12, 10)


def test_norms_without_affine_parameters_of_one_group_per_channel_keep_their_width():
    """A group norm of one group per channel without affine parameters has nothing that gives its
    ``num_groups`` at another width (torch's GroupNorm: PFNM built a network that could not run;
    one of one's own calling ``F.group_norm``): the width is fixed, and says why; PFNM matches the
    channels at it, as OT keeps every width."""

    class OwnGroupNorm(nn.GroupNorm):
        def forward(self, x):
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    for norm, message in (
        (lambda n: nn.GroupNorm(n, n, affine=False), "GroupNorm 'bn' of one group per channel has no affine"),
        (lambda n: OwnGroupNorm(n, n, affine=False), "group_norm has no weight or bias, so nothing gives its width"),
    ):
        torch.manual_seed(0)
        models = [_norm_cnn(norm)().eval() for _ in range(3)]
        spec = spec_from_graph(models[0], torch.zeros(2, 64))
        assert any(message in why for why in spec.fixed.values())
        fused = bayesfuse.fuse(models, "pfnm")
        assert _kept_fixed(fused, spec, models[0]) and fused.model(torch.randn(5, 64)).shape == (5, 10)
        assert (
            _gap(models[0], bayesfuse.fuse([models[0], _permuted(models[0], 1)], "ot").model, torch.randn(5, 64)) < 1e-4
        )


class _Versioned(nn.Module):
    """A module that reads its version from the state_dict's metadata while loading, as
    torchvision's MNASNet does, and refuses a state_dict without one."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(64, 12), nn.Linear(12, 10)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        if local_metadata.get("version") != 2:
            raise ValueError(f"version should be set to 2 instead of {local_metadata.get('version')}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)


@pytest.mark.parametrize("method", ["pfnm", "ot", "fedavg"])
def test_a_module_that_reads_its_version_while_loading_is_rebuilt(method):
    """The fused network is loaded with the versions its own state_dict records (a plain dict has
    none, and torchvision's MNASNet refused to load one: every method failed)."""
    model = _random(_Versioned, 0)
    fused = bayesfuse.fuse([model, permuted_copy(model, spec_from_module(model), seed=1)], method).model
    assert type(fused) is _Versioned and fused(torch.randn(3, 64)).shape == (3, 10)
    if method != "fedavg":
        assert _gap(model, fused, torch.randn(5, 64)) < 1e-5


class _GainConv(nn.Conv2d):
    """Keeps torch's forward, but its ``_conv_forward`` scales the filters by a gain of its own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.rand(self.out_channels, 1, 1, 1) + 0.5)

    def _conv_forward(self, x, w, b):
        return super()._conv_forward(x, w * self.gain, b)


class _HookedLinear(nn.Linear):
    """Keeps torch's forward, with a pre-hook scaling its inputs by a buffer."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("mask", torch.rand(self.in_features) + 0.5)
        self.register_forward_pre_hook(lambda mod, inp: (inp[0] * mod.mask,))


def test_only_a_torch_layer_renamed_is_traced_as_the_torch_layer():
    """``class MyNorm(nn.BatchNorm2d): pass`` is torch's batch norm (folded); a subclass that changes
    anything (a method, a hook, a forward set on the instance) is traced through, here to a
    refusal: as torch's layer, a gain of its own went unpermuted (a permuted copy 0.02 off)."""
    from bayesfuse._layers import renamed_torch_layer as _renamed_torch_layer

    assert _renamed_torch_layer(_KeptForward(4)) and not _renamed_torch_layer(_GainConv(1, 4, 3))
    assert not _renamed_torch_layer(_HookedLinear(4, 3)) and not _renamed_torch_layer(nn.Module())
    assert not _renamed_torch_layer(LayerNorm2d(4)) and not _renamed_torch_layer(nn.Sequential())
    with pytest.raises(UnsupportedLayerError, match="conv2d on a permuted axis cannot be followed"):
        spec_from_module(_GainNet())


class _GainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv, self.head = nn.Conv2d(1, 8, 3, padding=1), _GainConv(8, 8, 3, padding=1), nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        return self.head(F.relu(self.conv(F.relu(self.stem(x.view(-1, 1, 8, 8))))).mean((2, 3)))


class _NormReadTwice(nn.BatchNorm2d):
    """``F.batch_norm``, then its scale applied once more: its entries are read outside the norm."""

    def forward(self, x):
        y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.1, self.eps)
        return y * self.weight[:, None, None]


class _OneNormTwoConvs(nn.Module):
    """One batch-norm module applied after two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.bn, self.head = nn.BatchNorm2d(8), nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.relu(self.bn(self.a(x.view(-1, 1, 8, 8))))
        return self.head(F.relu(self.bn(self.b(h))).mean((2, 3)))


@pytest.mark.parametrize("cls", [_norm_cnn(_NormReadTwice), _OneNormTwoConvs])
def test_a_batch_norm_read_more_than_once_is_folded_into_no_layer(cls):
    """Folding sets a batch norm to the identity: where its entries are read elsewhere too (its
    scale applied again; one module after two layers), it had been folded all the same and a
    permuted copy fused back 0.2-0.5 off. It is folded into none now."""
    torch.manual_seed(0)
    model = library_randomised(cls())
    assert spec_from_module(model).folds == {}
    x = torch.randn(12, 64)
    for method in ("pfnm", "ot"):
        assert _gap(model, bayesfuse.fuse([model, _permuted(model, 1)], method).model, x) < 1e-4


class _RMSWithAct(nn.RMSNorm):
    """An RMSNorm holding its activation as a child module."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(super().forward(x))


class _FrozenInEval(nn.Module):
    """A ``train`` of its own that freezes a layer in eval mode and thaws it in training."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(64, 16), _RMSWithAct(16), nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))

    def train(self, mode: bool = True):
        super().train(mode)
        for p in self.fc1.parameters():
            p.requires_grad_(mode)
        return self


class _AuxHead(nn.Module):
    """An auxiliary classifier read only in training (GoogLeNet's, Inception's)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.aux = nn.Linear(64, 12), nn.Linear(12, 10), nn.Linear(12, 10)

    def forward(self, x):
        h = F.relu(self.a(x))
        return (self.b(h), self.aux(h)) if self.training else self.b(h)


def test_tracing_in_eval_mode_gives_back_the_models_modes_and_says_what_it_does_not_read():
    """The trace reads the network as it predicts (eval mode) and gives every module its mode back
    through the model's own ``train`` (which had been left undone: a layer frozen in eval mode
    stayed frozen); an RMSNorm holding a child module is rebuilt at the fused width; parameters
    the eval-mode forward never reads (an auxiliary head) are named in a warning, since fusion
    leaves them unaligned."""
    torch.manual_seed(0)
    models = [_FrozenInEval().train() for _ in range(2)]
    fused = bayesfuse.fuse(models, "pfnm").model
    assert all(m.training and m.fc1.weight.requires_grad for m in models)
    assert fused.norm.normalized_shape == (fused.fc1.out_features,) and fused(torch.randn(3, 64)).shape == (3, 10)
    with pytest.warns(UserWarning, match=r"aux.weight, aux.bias are not read by its forward in eval mode"):
        spec = spec_from_module(_AuxHead().train())
    assert spec.axes["aux.weight"] == (None, None)


def test_a_depthwise_convolution_with_a_channel_multiplier_keeps_the_streams_permutation():
    """``Conv2d(C, k C, groups=C)``: channel c's k filters follow channel c (its rows the stream's
    units, k numbers each). It was read as a convolution of C groups, which cut the stream into C
    blocks of one unit: no permutation left, independent clients averaged unit by unit."""
    spec = spec_from_module(DepthwiseMultiplierCNN())
    assert spec.axes["dw.weight"][0] == Axis(spec.axes["stem.weight"][0].group, 1, 2)
    fused = bayesfuse.fuse([_random(DepthwiseMultiplierCNN, s) for s in range(3)], "pfnm").model
    width = fused.stem.out_channels
    assert width > 6 and (fused.dw.groups, fused.dw.out_channels) == (width, 2 * width)
    assert fused(torch.randn(3, 64)).shape == (3, 10)


def test_a_group_norm_right_after_a_concatenation_keeps_each_streams_groups():
    """A GroupNorm of g groups right after streams side by side (a diffusion U-Net's skip): each
    stream holds whole groups, its units cut into blocks the groups do not cross, and its width
    fixed (streams fused apart would not keep the groups equal): OT and FedAvg fuse it, PFNM
    matches those streams at their widths. It was refused by every method; a norm class of one's
    own calling ``F.group_norm`` is read the same way."""
    spec = spec_from_module(GroupNormSkip())
    assert spec.axes["enc.weight"][0].outer == 2 and spec.axes["mid.weight"][0].outer == 1  # 2 groups, 1 group
    assert len(spec.fixed) == 2 and all("GroupNorm 'gn'" in why for why in spec.fixed.values())
    model, x = _random(GroupNormSkip, 0), torch.randn(6, 64)
    assert _gap(model, _permuted(model, 1), x) < 1e-4
    assert _gap(model, bayesfuse.fuse([model, _permuted(model, 2)], "ot").model, x) < 1e-4
    models = [_random(GroupNormSkip, s) for s in range(3)]
    assert bayesfuse.fuse(models, "fedavg").model(x).shape == (6, 10)
    fused = bayesfuse.fuse(models, "pfnm")
    assert _kept_fixed(fused, spec, models[0]) and fused.model(x).shape == (6, 10)
    assert "GroupNorm 'gn' normalises groups across streams side by side" in next(iter(fused.hyper["fixed"].values()))

    class OwnNormSkip(GroupNormSkip):  # the same, its norm a class of one's own calling F.group_norm
        def __init__(self) -> None:
            super().__init__()
            self.gn = GroupNormSiLU(3, 12)

    spec = spec_from_module(OwnNormSkip())
    assert spec.axes["enc.weight"][0].outer == 2 and any("group_norm" in why for why in spec.fixed.values())
    model = _random(OwnNormSkip, 0)
    assert _gap(model, bayesfuse.fuse([model, _permuted(model, 2)], "ot").model, x) < 1e-4


class _DepthwiseThen(nn.Module):
    """A depthwise convolution of two filters per channel, then a GroupNorm of 3 or 2 groups, a
    convolution of 3 groups, or an add of a layer's output (its units taken in pairs)."""

    def __init__(self, then: str = "gn") -> None:
        super().__init__()
        self.then = then
        self.stem, self.dw = nn.Conv2d(1, 6, 3, padding=1), nn.Conv2d(6, 12, 3, padding=1, groups=6)
        if then == "grouped":
            self.grouped = nn.Conv2d(12, 6, 1, groups=3)
        elif then == "add":
            self.side = nn.Conv2d(6, 12, 1)
        else:
            self.gn = nn.GroupNorm(3 if then == "gn" else 2, 12)
        self.pw, self.head = nn.Conv2d(6 if then == "grouped" else 12, 5, 1), nn.Linear(5, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.relu(self.stem(x.view(-1, 1, 8, 8)))
        d = self.dw(h)
        d = self.grouped(d) if self.then == "grouped" else d + self.side(h) if self.then == "add" else self.gn(d)
        return self.head(F.relu(self.pw(F.relu(d))).mean((2, 3)))


class _CatTwice(GroupNormSkip):
    """A stream concatenated twice beside another, then a GroupNorm of 5 groups."""

    def __init__(self) -> None:
        super().__init__()
        self.gn, self.dec = nn.GroupNorm(5, 20), nn.Conv2d(20, 6, 3, padding=1)

    def forward(self, x):
        a = F.silu(self.enc(x.view(-1, 1, 8, 8)))
        return self.head(F.silu(self.dec(F.silu(self.gn(torch.cat([a, F.silu(self.mid(a)), a], 1))))).mean((2, 3)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: _DepthwiseThen("gn"),
        lambda: _DepthwiseThen("gn2"),
        lambda: _DepthwiseThen("grouped"),
        lambda: _DepthwiseThen("add"),
        _CatTwice,
    ],
)
def test_units_of_several_channels_meet_groups_and_other_layers(make):
    """A depthwise convolution's k filters per channel are one unit of k numbers: a GroupNorm or a
    grouped convolution after it keeps whole units in a group, and a layer's output added to it
    is taken k units at a time (they had been refused, after tracing them at first as a grouped
    convolution); a stream concatenated twice before a GroupNorm is cut once (twice, it left a
    group with no entry: OT failed, FedAvg crashed)."""
    torch.manual_seed(0)
    model, x = make().eval(), torch.randn(6, 64)
    assert _gap(model, permuted_copy(model, spec_from_module(model), seed=1), x) < 1e-4
    for method in ("ot", "pfnm") if make is not _CatTwice else ("ot",):
        copy_ = permuted_copy(model, spec_from_module(model), seed=2)
        assert _gap(model, bayesfuse.fuse([model, copy_], method).model, x) < 1e-4
    torch.manual_seed(1)
    clients = [make().eval() for _ in range(3)]
    for method in ("ot", "fedavg", "pfnm") if make is not _CatTwice else ("ot", "fedavg"):
        assert bayesfuse.fuse(clients, method).model(x).shape == (6, 10)


def test_a_weight_stored_inputs_first_and_applied_by_addmm_is_a_layer():
    """Hugging Face's ``Conv1D`` (GPT-2's layers): weight ``(in, out)``, ``torch.addmm(bias, x,
    weight)``, the output viewed by the width the module holds (``self.nf``). Its units are its
    weight's axis 1; a permuted copy computes the same function and fuses back by PFNM and OT,
    and three fuse by PFNM into a network whose ``nf`` follow the fused widths."""
    spec = spec_from_module(InputsFirstMLP())
    assert spec.rows_dim("c_fc.weight") == 1 and spec.axes["c_fc.weight"][1] == spec.axes["c_fc.bias"][0]
    assert {"c_fc.nf", "c_proj.nf", "embed.nf"} == set(spec.widths) and not spec.fixed
    model, x = _random(InputsFirstMLP, 0), torch.randn(5, 64)
    assert _gap(model, _permuted(model, 1), x) < 1e-4
    for method in ("pfnm", "ot"):
        assert _gap(model, bayesfuse.fuse([model, _permuted(model, 2)], method).model, x) < 1e-4, method
    fused = bayesfuse.fuse([_random(InputsFirstMLP, s) for s in range(3)], "pfnm").model
    assert fused.c_fc.nf == fused.c_fc.weight.shape[1] > 24 and fused.embed.nf == fused.norm.weight.shape[0] > 12
    assert fused(x).shape == (5, 10)


class _Idiom(nn.Module):
    """Two hidden layers between which each case below writes its forward's idiom."""

    def __init__(self, idiom) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.idiom = idiom

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.out(torch.relu(self.fc2(self.idiom(self, h))))


def _rank_checked(s, h):
    return h.mean(1) if len(h.shape) == 3 else h.to(h.T.dtype)


_IDIOMS = {
    "len(x.shape), h.T.dtype": _rank_checked,
    "where(h > 1, h, zeros_like(h))": lambda s, h: torch.where(h > 1, h, torch.zeros_like(h)),
    "masked_fill(h > bias, 0)": lambda s, h: h.masked_fill(h > s.fc1.bias, 0.0),
    "clamp(h, max=a tensor)": lambda s, h: torch.clamp(h, max=h.amax(-1, keepdim=True) * 0.5),
    "h * (h > 0) with the mask's count": lambda s, h: h * (h > 0) * (h > 0).sum(-1, keepdim=True),
}


@pytest.mark.parametrize("name", list(_IDIOMS))
def test_masks_comparisons_and_sizes_keep_the_units(name):
    """Comparisons are masks with their operands' units, ``where`` / ``masked_fill`` / ``clamp``
    with tensors tie their operands' units as a sum does, ``zeros_like(h)`` keeps ``h``'s, and
    ``len(x.shape)`` or ``h.T.dtype`` are read at the example: a permuted copy computes the
    function and fuses back."""
    torch.manual_seed(0)
    model = _Idiom(_IDIOMS[name]).eval()
    spec = spec_from_graph(model, torch.zeros(2, 8))
    assert len(spec.groups) == 2
    x = torch.randn(5, 8) * 2
    permuted = permuted_copy(model, spec, seed=1)
    assert _gap(permuted, model, x) < 1e-5
    assert _gap(bayesfuse.fuse([model, permuted], "pfnm").model, model, x) < 1e-4


def test_a_mask_that_counts_positions_of_units_is_refused():
    with pytest.raises(UnsupportedLayerError, match="where on a permuted axis"):  # the indices of a mask
        spec_from_graph(_Idiom(lambda s, h: h + torch.where(h > 0.5)[1].sum()), torch.zeros(2, 8))


def test_a_mask_that_selects_numbers_of_units_holds_them_in_place():
    """``h[h > 0.5]`` picks numbers by the units' places: those units stay in place, and the
    network still fuses back."""
    torch.manual_seed(0)
    model = _Idiom(lambda s, h: h + h[h > 0.5].sum()).eval()
    spec = spec_from_graph(model, torch.zeros(2, 8))
    assert "fc1" in spec.in_place and "its forward indexes into them" in spec.in_place["fc1"]
    assert spec.axes["fc1.weight"][0] is None and spec.axes["fc2.weight"][0] is not None
    x = torch.randn(5, 8)
    permuted = permuted_copy(model, spec, seed=1)
    assert _gap(permuted, model, x) < 1e-5
    assert _gap(bayesfuse.fuse([model, permuted], "pfnm").model, model, x) < 1e-4
