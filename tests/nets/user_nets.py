"""Networks written as users write them (classes with a forward method), for the tracing tests
and for ``bayesfuse fuse --model tests.nets.user_nets:NAME``."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class MyMLP(nn.Module):
    def __init__(self, d: int = 64, h: int = 48, k: int = 10) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, k)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class ResMLP(nn.Module):
    """A residual MLP: one stream of width ``w``, pre-norm blocks ``x + fc2(gelu(fc1(ln(x))))``."""

    def __init__(self, d: int = 64, w: int = 32, h: int = 48, k: int = 10, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Linear(d, w)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(norm=nn.LayerNorm(w), fc1=nn.Linear(w, h), fc2=nn.Linear(h, w))) for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(w)
        self.head = nn.Linear(w, k)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = x + b["fc2"](F.gelu(b["fc1"](b["norm"](x))))
        return self.head(self.norm(x))


class SkipCNN(nn.Module):
    """Conv-BN-ReLU, then a residual block of two convs, pooling and a dense head, on flat 8x8 images."""

    def __init__(self, c: int = 8, k: int = 10) -> None:
        super().__init__()
        self.conv0, self.bn0 = nn.Conv2d(1, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.fc = nn.Linear(c * 4 * 4, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        x = F.relu(self.bn0(self.conv0(x.view(-1, 1, 8, 8))))
        y = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(x + self.bn2(self.conv2(y)))
        return self.fc(torch.flatten(F.max_pool2d(x, 2), 1))


class TokenMixer(nn.Module):
    """Patches as tokens with a class token and a position embedding, a pre-norm MLP block, mean pooling."""

    def __init__(self, d: int = 16, k: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, 5, d))
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        tokens = self.embed(x.view(-1, 4, 16))
        tokens = torch.cat([self.cls.expand(tokens.shape[0], -1, -1), tokens], dim=1) + self.pos
        tokens = tokens + self.fc2(F.relu(self.fc1(self.norm(tokens))))
        return self.head(tokens.mean(dim=1))


class Attention(nn.Module):
    """A transformer block with nn.MultiheadAttention (refused: its heads are tied to the stream's width)."""

    def __init__(self, d: int = 16, k: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.head = nn.Linear(d, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.embed(x.view(-1, 4, 16))
        t = t + self.attn(t, t, t)[0]
        return self.head(t.mean(dim=1))


class SplitAttention(Attention):
    """:class:`Attention` with its nn.MultiheadAttention split into heads (bayesfuse.nets.attention.split_heads)."""

    def __init__(self, d: int = 16, k: int = 10) -> None:
        super().__init__(d, k)
        from bayesfuse.nets.attention import split_heads

        self.attn = split_heads(self.attn)


class Encoder(nn.Module):
    """Two of PyTorch's own transformer encoder layers (nn.TransformerEncoder), as users write them."""

    def __init__(self, d: int = 16, k: int = 10, norm_first: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        layer = nn.TransformerEncoderLayer(d, 2, 24, dropout=0.0, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.head = nn.Linear(d, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x.view(-1, 4, 16))).mean(dim=1))


class PreNormEncoder(Encoder):
    def __init__(self, d: int = 16, k: int = 10) -> None:
        super().__init__(d, k, norm_first=True)


class MyLSTM(nn.Module):
    """An LSTM over 8 steps of 8 features whose head reads its final hidden state."""

    def __init__(self, h: int = 12, k: int = 10) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, h, batch_first=True)
        self.head = nn.Linear(h, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        _, (h, _) = self.rnn(x.view(-1, 8, 8))
        return self.head(h[-1])


class MyGRU(nn.Module):
    """Embedded steps into a sequence-first GRU; the head reads the last step of its output."""

    def __init__(self, h: int = 12, k: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 10)
        self.rnn = nn.GRU(10, h)
        self.head = nn.Linear(h, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        steps = F.relu(self.embed(x.view(-1, 8, 8))).transpose(0, 1)
        out, _ = self.rnn(steps)
        return self.head(out[-1])


class StackedLSTM(nn.Module):
    """Two LSTM layers in one nn.LSTM (one width for both); the head reads the output's last step."""

    def __init__(self, h: int = 12, k: int = 10) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, h, num_layers=2, batch_first=True)
        self.head = nn.Linear(h, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        return self.head(self.rnn(x.view(-1, 8, 8))[0][:, -1])


class StackedStateLSTM(StackedLSTM):
    """:class:`StackedLSTM` whose head reads the final state, every layer's units in one tensor."""

    def forward(self, x):
        _, (h, _) = self.rnn(x.view(-1, 8, 8))
        return self.head(h[-1])


class BiasFreeCNN(nn.Module):
    """Convolutions without a bias, each followed by a batch norm, as ResNets and VGGs are written."""

    def __init__(self, affine: bool = True) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(1, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6, affine=affine)
        self.c2, self.bn2 = nn.Conv2d(6, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, affine=affine)
        self.head = nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        x = F.relu(self.bn1(self.c1(x.view(-1, 1, 8, 8))))
        x = F.relu(self.bn2(self.c2(x)))
        return self.head(x.mean(dim=(2, 3)))


class BiasFreePlainNormCNN(BiasFreeCNN):
    """:class:`BiasFreeCNN` whose batch norms have no scale and shift (``affine=False``)."""

    def __init__(self) -> None:
        super().__init__(affine=False)


class SlopesCNN(nn.Module):
    """Instance norms and a PReLU slope per channel, between two convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.norm = nn.Conv2d(1, 6, 3, padding=1), nn.InstanceNorm2d(6, affine=True)
        self.act, self.c2, self.head = nn.PReLU(6), nn.Conv2d(6, 8, 3, padding=1), nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        x = self.act(self.norm(self.c1(x.view(-1, 1, 8, 8))))
        return self.head(F.hardswish(self.c2(x)).mean(dim=(2, 3)))


class CausalAttention(nn.Module):
    """Self-attention over 4 steps with a causal mask buffer, as GPT-style models write it: the mask
    is a fixed tensor, not a layer (``masked_fill`` or ``torch.where``)."""

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.where = where
        self.register_buffer("mask", torch.tril(torch.ones(1, 4, 4)).bool())
        self.emb, self.q, self.k, self.v = nn.Linear(16, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.emb(x.view(-1, 4, 16))
        s = self.q(t) @ self.k(t).transpose(1, 2) * 0.35
        if self.where:
            s = torch.where(self.mask, s, torch.full_like(s, -1e9))
        else:
            s = s.masked_fill(~self.mask[:, :4, :4], float("-inf"))
        return self.head((s.softmax(-1) @ self.v(t)).mean(1))


class CausalWhere(CausalAttention):
    def __init__(self) -> None:
        super().__init__(where=True)


class BlurredCNN(nn.Module):
    """A fixed smoothing filter (a buffer, applied with ``F.conv2d``) before a small CNN."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("kernel", torch.full((1, 1, 3, 3), 1 / 9))
        self.conv, self.head = nn.Conv2d(1, 6, 3, padding=1), nn.Linear(6 * 64, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        x = F.conv2d(x.view(-1, 1, 8, 8), self.kernel, padding=1)
        return self.head(torch.relu(self.conv(x)).flatten(1))


class ConcatMLP(nn.Module):
    """Two branches concatenated along the units: no permutation of them can be traced."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(64, 12), nn.Linear(64, 8), nn.Linear(20, 10)

    def forward(self, x):
        return self.head(torch.cat([F.relu(self.a(x)), torch.tanh(self.b(x))], dim=1))


class BagOfWords(nn.Module):
    """Token ids (N, 12) averaged by an nn.EmbeddingBag, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.bag, self.fc, self.head = nn.EmbeddingBag(40, 8, mode="mean"), nn.Linear(8, 16), nn.Linear(16, 10)

    def example_input(self):
        return torch.zeros(2, 12, dtype=torch.long)

    def forward(self, x):
        return self.head(F.selu(self.fc(self.bag(x))))


class IdsBag(BagOfWords):
    """:class:`BagOfWords` without an ``example_input``: its input (token ids) cannot be guessed."""

    example_input = None


class NeedsArgs(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2)


class StepGRU(MyGRU):
    """:class:`MyGRU` without an ``example_input``: its first Linear reads steps of 8 features,
    so the width of that layer is not the input's (64)."""

    example_input = None


class FlatCNN(nn.Module):
    """A CNN reading flat 8x8 images, a convolution first, no ``example_input``."""

    def __init__(self, k: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, k)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x.view(-1, 1, 8, 8))).flatten(1))


class StepEncoder(Encoder):
    """:class:`Encoder` without an ``example_input``."""

    example_input = None


class HandLinear(nn.Module):
    """A hidden layer applied by hand by ``torch.tensordot(x, self.w, dims=1)``, which the walk
    does not read as a layer, so that the first ``nn.Linear`` (the head) does not tell the input's
    width (5)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 10))
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        return self.head(torch.tanh(torch.tensordot(x, self.w, dims=1)))


class LogSoftmaxMLP(MyMLP):
    """:class:`MyMLP` returning the log-probabilities of its output layer's logits."""

    def forward(self, x):
        return F.log_softmax(super().forward(x), dim=-1)


class TransposedConv(nn.Module):
    """A Linear on the features of 8 steps, then a Conv1d over the steps of its units, read
    through ``.mT``: the units move from the last axis to axis 1."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 12)
        self.conv = nn.Conv1d(12, 6, 3, padding=1)
        self.head = nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = torch.relu(self.fc(x.view(-1, 8, 8)))
        return self.head(torch.relu(self.conv(h.mT)).mean(-1))


class PlainNormMLP(nn.Module):
    """A biased Linear, then a batch norm without scale and shift (folded as weight 1, bias 0)."""

    def __init__(self, **norm) -> None:
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(64, 32), nn.BatchNorm1d(32, affine=False, **norm), nn.Linear(32, 10)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


class BatchStatsMLP(PlainNormMLP):
    """A batch norm that keeps no running statistics: it normalises by each batch's, in eval mode too."""

    def __init__(self) -> None:
        super().__init__(track_running_stats=False)


class DepthwiseCNN(nn.Module):
    """A depthwise convolution (one filter per channel) between two ordinary ones."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 6, 1)
        self.head = nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = torch.relu(self.dw(torch.relu(self.c1(x.view(-1, 1, 8, 8)))))
        return self.head(torch.relu(self.pw(h)).mean(dim=(2, 3)))


class TwoOutputs(MyMLP):
    """:class:`MyMLP` returning its logits and a second head's, as a tuple (``as_dict``: a dict)."""

    as_dict = False

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(self.fc1.out_features, 3)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        out = (self.fc2(h), self.aux(h))
        return {"logits": out[0], "aux": out[1]} if self.as_dict else out


class PairInputs(nn.Module):
    """A ``forward`` of two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(16, 10)

    def example_input(self):
        return (torch.zeros(2, 32), torch.zeros(2, 32))

    def forward(self, x, y):
        return self.head(torch.relu(self.a(x)) + torch.relu(self.b(y)))


class PaddedCNN(nn.Module):
    """Element-wise functions of numbers (clamp, a power, sqrt, sin), padding and upsampling of the
    maps between two convolutions: all leave the channels' order."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 6, 3), nn.Conv2d(6, 5, 3)
        self.pad, self.up = nn.ZeroPad2d(1), nn.Upsample(scale_factor=2)
        self.head = nn.Linear(5, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = torch.clamp(self.c1(x.view(-1, 1, 8, 8)), -1.0, 6.0) ** 2
        h = torch.sqrt(h + 1) + torch.sin(h).clamp(min=0) + 2**-h
        h = self.c2(self.up(self.pad(h)))
        return self.head(F.relu(h).mean(dim=(2, 3)))


class LayerScaleCNN(nn.Module):
    """A residual block whose branch is scaled per channel by a vector shaped to the maps, as
    ConvNeXt writes it (``gamma.view(1, -1, 1, 1) * x``), and a bias shaped by indexing."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv = nn.Conv2d(1, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.gamma = nn.Parameter(torch.rand(6) + 0.5)
        self.shift = nn.Parameter(torch.randn(6))
        self.head = nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.relu(self.stem(x.view(-1, 1, 8, 8)))
        h = h + self.gamma.view(1, -1, 1, 1) * F.relu(self.conv(h)) + self.shift[:, None, None]
        return self.head(h.mean(dim=(2, 3)))


class ReducedCNN(nn.Module):
    """Reductions and normalisations that keep the channels' order: ``F.normalize`` over the
    channels, the element-wise maximum of two streams (which ties their channels), the max along a
    row with its indices, logsumexp, std, amin and a norm over the maps, sums kept by place
    (``mean(1, True)``, before the channels), and the max over the channels (``h.max(1)[0]``),
    which forgets them."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(1, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.head, self.spatial = nn.Linear(6, 10), nn.Linear(64, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.normalize(torch.relu(self.c1(x.view(-1, 1, 8, 8))), dim=1)
        g = torch.maximum(h, self.c2(h)) - h.mean(1, True)
        rows = g.max(dim=3).values + g.max(3)[1].float() * 0.01  # (N, 6, 8): the largest of each row, and where
        pooled = torch.logsumexp(rows, dim=2) + rows.std(2, True, False) + torch.amin(g, dim=(2, 3))
        pooled = pooled + torch.linalg.vector_norm(g, 2, (2, 3)) + rows.mT.sum(1, True).squeeze(1)
        return self.head(pooled) + self.spatial(g.max(1)[0].flatten(1))


class ArgmaxUnits(nn.Module):
    """Where the largest unit lies, read as a number: it names units by their place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(64, 12), nn.Linear(13, 10)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return self.head(torch.cat([h, h.argmax(1, keepdim=True).float()], 1))


class MyRNN(nn.Module):
    """A two-layer Elman RNN (tanh) over embedded steps; the head reads the last step."""

    def __init__(self, h: int = 12, k: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 10)
        self.rnn = nn.RNN(10, h, num_layers=2, batch_first=True)
        self.head = nn.Linear(h, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        out, _ = self.rnn(F.relu(self.embed(x.view(-1, 8, 8))))
        return self.head(out[:, -1])


class BiLSTM(nn.Module):
    """A two-layer bidirectional LSTM, whose output holds both directions' units side by side, read
    by the head (the mean over the steps) and by a one-layer bidirectional GRU, whose final state's
    backward direction the head reads too."""

    def __init__(self, h: int = 6, k: int = 10) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, h, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(2 * h, 5, batch_first=True, bidirectional=True)
        self.head, self.back = nn.Linear(2 * h, k), nn.Linear(5, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        out, _ = self.rnn(x.view(-1, 8, 8))
        _, h = self.gru(out)
        return self.head(out.mean(1)) + self.back(h[-1])


class ConcatCNN(nn.Module):
    """Streams of one width side by side on the channels (``torch.cat``), as a dense block or a
    U-Net's skip: each convolution's channels a permutation of their own, read as two pieces; and
    streams tied by a product, side by side as three blocks of one permutation."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(1, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1), nn.Conv2d(12, 5, 3)
        self.a, self.b, self.head = nn.Linear(5, 7), nn.Linear(5, 7), nn.Linear(21, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = torch.relu(self.c1(x.view(-1, 1, 8, 8)))
        h = self.c3(torch.cat([h, torch.relu(self.c2(h))], dim=1)).mean(dim=(2, 3))
        a, b = torch.relu(self.a(h)), torch.tanh(self.b(h))
        return self.head(torch.cat((a, b, a * b), -1))


class KeywordOps(nn.Module):
    """Operands given by keyword (``torch.sum(input=h, dim=1)``), constants fx makes
    (``torch.tensor(0.1)``), a full std with ``unbiased`` by place, a layer norm over a
    bidirectional layer's two blocks, and attention pooling: one weight per step,
    ``softmax(Linear(2H, 1)(out), 1)``, broadcast along the units (that one unit never permuted)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 6, batch_first=True, bidirectional=True)
        self.norm, self.att = nn.LayerNorm(12), nn.Linear(12, 1)
        self.head = nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        out = self.norm(self.rnn(x.view(-1, 8, 8))[0])  # (N, 8, 12)
        pooled = (torch.softmax(self.att(out), 1) * out).sum(1)
        h = torch.maximum(pooled, torch.tensor(0.1)) + torch.tensor(0.5) + out.std(False)
        h = F.normalize(input=h, dim=1) + torch.sum(input=out, dim=1) + torch.linalg.vector_norm(x=out, dim=1)
        return self.head(h + torch.amin(input=out, dim=1))


class BiStateLSTM(nn.Module):
    """A bidirectional LSTM's two final states side by side, as text classifiers read them:
    ``torch.cat([h_n[-2], h_n[-1]], 1)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(8, 6, batch_first=True, bidirectional=True), nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        _, (h, _) = self.rnn(x.view(-1, 8, 8))
        return self.head(torch.cat([h[-2], h[-1]], 1))


class BiEnds(nn.Module):
    """A bidirectional GRU read at its two ends: the forward direction's last step and the backward
    direction's first, each one block of the output (``out[:, -1, :H]``, ``out[:, 0, H:]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(8, 6, batch_first=True, bidirectional=True), nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        out, _ = self.rnn(x.view(-1, 8, 8))
        h = out.shape[-1] // 2  # a width read off the tensor follows the fused width (6 would fix it)
        return self.head(torch.cat([out[:, -1, :h], out[:, 0, h:]], 1))


class GatedNet(nn.Module):
    """Gated units, as users write them: ``F.glu`` over a convolution's channels, a layer norm
    over a linear layer's whole output before ``chunk`` cuts it into halves multiplied unit by
    unit (``u * gelu(g)``), and ``torch.split`` into three equal pieces that meet."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc1, self.norm = nn.Conv2d(1, 8, 3, padding=1), nn.Linear(64, 24), nn.LayerNorm(24)
        self.fc2, self.head = nn.Linear(12, 18), nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        c = F.max_pool2d(F.glu(self.conv(x.view(-1, 1, 8, 8)), dim=1), 2)  # (N, 4, 4, 4)
        u, g = self.norm(self.fc1(c.flatten(1))).chunk(2, dim=-1)
        h = self.fc2(u * F.gelu(g))
        a, b, v = torch.split(h, h.shape[1] // 3, dim=1)  # a width read off the tensor: fused widths run
        return self.head(torch.tanh(a) + torch.sigmoid(b) * v)


class GatedStream(nn.Module):
    """A residual stream cut into halves that gate each other, then written to by a layer whose
    units are one plain run (``s + self.up(...)``): the layer's units are cut into the stream's
    blocks. An LSTM's output cut into halves (its units in pairs, gates and all)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.embed = nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 12)
        self.up, self.head = nn.Linear(6, 12), nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        out, _ = self.rnn(x.view(-1, 8, 8))
        a, b = out[:, -1].chunk(2, 1)
        s = self.embed(torch.cat([a * b, a], 1))
        u, g = s.chunk(2, -1)
        s = s + self.up(u * torch.sigmoid(g))
        return self.head(torch.relu(s))


class QKVAttention(nn.Module):
    """Attention written by hand as vision transformers do: one projection for the queries, keys
    and values, ``reshape(B, N, 3, heads, -1)``, heads merged back with the stream's width
    (``reshape(B, N, C)``), a scale written as a number; a gated MLP after it."""

    def __init__(self, d: int = 16, heads: int = 2, k: int = 10) -> None:
        super().__init__()
        self.heads, self.scale = heads, (d // heads) ** -0.5
        self.embed, self.norm = nn.Linear(16, d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down, self.head = nn.Linear(d, 2 * 24), nn.Linear(24, d), nn.Linear(d, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.embed(x.view(-1, 4, 16))
        B, N, C = t.shape
        qkv = self.qkv(self.norm(t)).reshape(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        t = t + self.proj(self.merged((a @ v).transpose(1, 2), t))
        u, g = self.up(t).chunk(2, dim=-1)
        return self.head((t + self.down(u * F.silu(g))).mean(dim=1))

    def merged(self, heads, t):
        """(B, N, heads, width) back to the stream's (B, N, C), ``C`` read off the stream."""
        B, N, C = t.shape
        return heads.reshape(B, N, C)


class ViewHeadsAttention(nn.Module):
    """Attention written by hand as GPT-style code does: a query, key and value projection each
    viewed into heads of ``C // heads`` features, ``C`` read off the stream
    (``q.view(B, N, heads, C // heads)``), ``scaled_dot_product_attention`` with its scale given."""

    def __init__(self, d: int = 16, heads: int = 4, k: int = 10) -> None:
        super().__init__()
        self.heads = heads
        self.embed, self.q, self.k, self.v = nn.Linear(16, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o, self.head = nn.Linear(d, d), nn.Linear(d, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.embed(x.view(-1, 4, 16))
        B, N, C = t.size()
        q, k, v = (p(t).view(B, N, self.heads, C // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, scale=0.5).transpose(1, 2).contiguous().view(B, N, C)
        return self.head(torch.relu(t + self.o(o))[:, 0])


class GroupedCNN(nn.Module):
    """ResNeXt's bottleneck: a 1x1 convolution, a 3x3 one of 4 groups and a 1x1 one back into
    the stream, with batch norms; then a convolution of 2 groups reading two copies of the
    stream side by side (one block each)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(1, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.a, self.bna = nn.Conv2d(8, 12, 1, bias=False), nn.BatchNorm2d(12)
        self.b, self.bnb = nn.Conv2d(12, 12, 3, padding=1, groups=4, bias=False), nn.BatchNorm2d(12)
        self.c, self.bnc = nn.Conv2d(12, 8, 1, bias=False), nn.BatchNorm2d(8)
        self.d, self.head = nn.Conv2d(16, 6, 3, padding=1, groups=2), nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.relu(self.bn0(self.stem(x.view(-1, 1, 8, 8))))
        y = F.relu(self.bnb(self.b(F.relu(self.bna(self.a(h))))))
        h = F.relu(h + self.bnc(self.c(y)))
        return self.head(self.d(torch.cat([h, 2 * h], 1)).mean(dim=(2, 3)))


class BilinearNet(nn.Module):
    """``nn.Bilinear`` of two branches' units, then of one stream with itself (both its input
    axes permuted by one permutation)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 8), nn.Linear(64, 6)
        self.pair, self.self_pair, self.head = nn.Bilinear(8, 6, 7), nn.Bilinear(7, 7, 5, bias=False), nn.Linear(5, 10)

    def forward(self, x):
        h = torch.tanh(self.pair(torch.relu(self.a(x)), torch.relu(self.b(x))))
        return self.head(torch.tanh(self.self_pair(h, h)))


class SharedBlocks(nn.Module):
    """Modules called again after their units were cut: a siamese encoder whose first output is
    cut into halves before its second call, and one attention block (heads written by hand)
    applied twice in a loop, weights shared."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.embed = nn.Linear(32, 16), nn.Linear(8, 16)
        self.qkv, self.proj, self.head = nn.Linear(16, 48), nn.Linear(16, 16), nn.Linear(16, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        a, b = torch.relu(self.enc(x[:, :32])).chunk(2, 1)
        c, d = torch.relu(self.enc(x[:, 32:])).chunk(2, 1)
        t = self.embed(torch.stack([a * c, b * d], 1))  # (N, 2 tokens, 16)
        B, N, C = t.shape
        for _ in range(2):
            q, k, v = self.qkv(t).reshape(B, N, 3, 2, -1).permute(2, 0, 3, 1, 4).unbind(0)
            t = t + self.proj(((q @ k.transpose(-2, -1)) * 0.35).softmax(-1).matmul(v).transpose(1, 2).reshape(B, N, C))
        return self.head(t.mean(1))


class ProjectedLSTM(nn.Module):
    """Projected LSTMs (``proj_size``): a one-layer one whose final ``h`` (the projection's units)
    and ``c`` (the cells') two heads read, feeding a two-layer bidirectional one."""

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.LSTM(8, 6, batch_first=True, proj_size=4)
        self.two = nn.LSTM(4, 5, batch_first=True, proj_size=3, num_layers=2, bidirectional=True)
        self.h, self.c, self.head = nn.Linear(4, 10), nn.Linear(6, 10), nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        out, (h, c) = self.one(x.view(-1, 8, 8))
        return self.h(h[-1]) + self.c(c[-1]) + self.head(self.two(out)[0][:, -1])


class NanoGPT(nn.Module):
    """A nanoGPT-style language model: token and position embeddings, pre-norm blocks of causal
    self-attention written by hand (``B, T, C = x.size()``, ``split``, heads viewed by ``C //
    n_head``, the causal mask a buffer sliced by the sequence's length, ``self.bias[:, :, :T,
    :T]``) and a GELU MLP, a final LayerNorm and a bias-free head. ``split`` by ``n_embd``, as
    nanoGPT writes it, fixes the width; ``split_by="C"`` reads it off the stream instead."""

    def __init__(self, split_by: str = "n_embd", vocab: int = 12, n_embd: int = 16, n_head: int = 2) -> None:
        super().__init__()
        self.split_by, self.n_embd, self.n_head = split_by, n_embd, n_head
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(6, n_embd)
        self.ln_1, self.ln_2, self.ln_f = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.c_fc, self.mlp_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.register_buffer("bias", torch.tril(torch.ones(6, 6)).view(1, 1, 6, 6))

    def example_input(self):
        return torch.zeros(2, 6, dtype=torch.long)

    def attn(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd if self.split_by == "n_embd" else C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * 0.5
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")).softmax(-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, idx):
        b, t = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))
        return self.lm_head(self.ln_f(x))


class DenseBlockCNN(nn.Module):
    """A DenseNet block: each layer (batch norm, ReLU, a bias-free 1x1 then 3x3 convolution, the
    first's batch norm folded into it) reads the input and every earlier layer's channels
    concatenated, of different widths; a transition, global pooling and a classifier reading
    the last concatenation."""

    def __init__(self, growth: tuple = (6, 4)) -> None:
        super().__init__()
        layers, width = [], 3
        for g in growth:
            layers.append(
                nn.ModuleDict(
                    {
                        "norm1": nn.BatchNorm2d(width),
                        "conv1": nn.Conv2d(width, 8, 1, bias=False),
                        "norm2": nn.BatchNorm2d(8),
                        "conv2": nn.Conv2d(8, g, 3, padding=1, bias=False),
                    }
                )
            )
            width += g
        self.layers = nn.ModuleList(layers)
        self.norm, self.head = nn.BatchNorm2d(width), nn.Linear(width, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        features = [x.view(-1, 1, 8, 8).expand(-1, 3, -1, -1) * torch.tensor([1.0, 0.5, -1.0]).view(1, 3, 1, 1)]
        for layer in self.layers:
            h = torch.cat(features, 1)
            h = layer["conv1"](F.relu(layer["norm1"](h)))
            features.append(layer["conv2"](F.relu(layer["norm2"](h))))
        h = F.adaptive_avg_pool2d(F.relu(self.norm(torch.cat(features, 1))), 1)
        return self.head(torch.flatten(h, 1))


class InceptionMLP(nn.Module):
    """Inception-style branches of different widths concatenated and read by a layer, the input
    concatenated beside hidden units, and a dense layer reading concatenated channels' maps
    flattened."""

    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2, self.b3 = nn.Conv1d(1, 4, 1), nn.Conv1d(1, 6, 3, padding=1), nn.Conv1d(1, 2, 5, padding=2)
        self.mix, self.fc, self.head = nn.Linear(12 * 8, 16), nn.Linear(64 + 16, 12), nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = x[:, :8].unsqueeze(1)
        h = torch.cat([F.relu(self.b1(t)), F.relu(self.b2(t)), F.relu(self.b3(t))], 1)  # (N, 12, 8)
        h = F.relu(self.mix(h.flatten(1)))
        return self.head(F.relu(self.fc(torch.cat([x, h], 1))))


class DenseBasic(nn.Module):
    """DenseNet's basic layers: bias-free 3x3 convolutions after a batch norm and ReLU, each output
    only concatenated (its width read off no whole entry), global pooling as a mean over the maps."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(1, 5, 3, padding=1)
        self.bn1, self.c1 = nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3, padding=1, bias=False)
        self.bn2, self.c2 = nn.BatchNorm2d(9), nn.Conv2d(9, 3, 3, padding=1, bias=False)
        self.bn, self.head = nn.BatchNorm2d(12), nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = self.c0(x.view(-1, 1, 8, 8))
        h = torch.cat([h, self.c1(F.relu(self.bn1(h)))], 1)
        h = torch.cat([h, self.c2(F.relu(self.bn2(h)))], 1)
        return self.head(F.relu(self.bn(h)).mean((2, 3)))


class TokenConcat(nn.Module):
    """Tokens' features of different widths concatenated on the last axis, (B, T, C): a LayerNorm,
    a transpose to channels and back, padding of the tokens, a mean over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 6), nn.Linear(16, 4)
        self.norm, self.fc, self.head = nn.LayerNorm(26), nn.Linear(26, 12), nn.Linear(12, 10)
        self.pad = nn.ConstantPad1d((1, 1), 0.0)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = x.view(-1, 4, 16)
        h = self.norm(torch.concat([F.gelu(self.a(t)), t, torch.tanh(self.b(t)), t[..., :0]], -1))
        h = self.pad(h.transpose(1, 2)).transpose(1, 2)  # (B, 6, 26): a zero token each side
        return self.head(F.relu(self.fc(h)).mean(1))


class UNetLike(nn.Module):
    """A U-Net step: an encoder's maps, pooled and convolved, upsampled (``F.interpolate``), padded
    to the skip's size (``F.pad`` by sizes read off the maps) and concatenated with the skip, of
    another width, then a convolution, a batch norm and a mean over the maps."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.down = nn.Conv2d(1, 6, 3, padding=1), nn.Conv2d(6, 10, 3, padding=1)
        self.up, self.bn, self.head = nn.Conv2d(16, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        skip = F.relu(self.enc(x.view(-1, 1, 8, 8)[:, :, :7, :7]))  # 7x7: pooling and upsampling give 6x6
        low = F.relu(self.down(F.max_pool2d(skip, 2)))
        up = F.interpolate(low, scale_factor=2.0, mode="nearest")
        dy, dx = skip.size(2) - up.size(2), skip.size(3) - up.size(3)
        up = F.pad(up, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.head(F.relu(self.bn(self.up(torch.cat([skip, up], 1)))).mean((2, 3)))


class UpConvUNet(nn.Module):
    """A U-Net written with transposed convolutions: an encoder (conv, batch norm, pooling), a
    bottleneck without bias, upsampled by ``nn.ConvTranspose2d`` (stride 2, no bias, then a batch
    norm folded through it), concatenated with the skip, read by a second transposed convolution
    (stride 1, with bias) and a 1x1 convolution, then a mean over the maps and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.bn0 = nn.Conv2d(1, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.mid, self.bn1 = nn.Conv2d(6, 10, 3, padding=1, bias=False), nn.BatchNorm2d(10)
        self.up, self.bn2 = nn.ConvTranspose2d(10, 7, 2, stride=2, bias=False), nn.BatchNorm2d(7)
        self.dec = nn.ConvTranspose2d(13, 9, 3, padding=1)
        self.mix, self.head = nn.Conv2d(9, 5, 1), nn.Linear(5, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        skip = F.relu(self.bn0(self.enc(x.view(-1, 1, 8, 8))))
        low = F.relu(self.bn1(self.mid(F.max_pool2d(skip, 2))))
        up = F.relu(self.bn2(self.up(low)))
        h = F.relu(self.dec(torch.cat([skip, up], 1)))
        return self.head(F.relu(self.mix(h)).mean((2, 3)))


class UpConv1d(nn.Module):
    """Signals upsampled by ``nn.ConvTranspose1d``: one reading the input (its channels never
    permuted), then one reading hidden channels, a batch norm, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.up1 = nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1)
        self.up2, self.bn = nn.ConvTranspose1d(6, 8, 4, stride=2, padding=1), nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = torch.tanh(self.up1(x.view(-1, 4, 16)))
        return self.head(F.relu(self.bn(self.up2(h))).amax(2))


class VolumeCNN(nn.Module):
    """A 3-D network for volumes (a scan's voxels; here 4x4x4): convolutions with batch norms, one
    without a bias, pooling, dropout, a transposed convolution and an instance norm, padding, and
    global pooling before a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv3d(1, 6, 3, padding=1), nn.BatchNorm3d(6)
        self.conv2, self.bn2 = nn.Conv3d(6, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8)
        self.up, self.norm = nn.ConvTranspose3d(8, 5, 2, stride=2), nn.InstanceNorm3d(5, affine=True)
        self.pool, self.drop, self.pad = nn.MaxPool3d(2), nn.Dropout3d(0.1), nn.ConstantPad3d(1, 0.0)
        self.gap, self.head = nn.AdaptiveAvgPool3d(1), nn.Linear(5, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = self.pool(F.relu(self.bn1(self.conv1(x.view(-1, 1, 4, 4, 4)))))
        h = self.drop(F.relu(self.bn2(self.conv2(self.pad(h)))))
        h = F.relu(self.norm(self.up(F.avg_pool3d(h, 3, 1))))
        return self.head(self.gap(h).flatten(1))


class GroupNormCNN(nn.Module):
    """Group norms of several groups (as U-Nets and diffusion models write them), after a
    convolution and after the input's channels, one after a residual add, and one in a dense
    layer's (N, C) output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.gn1 = nn.Conv2d(2, 8, 3, padding=1), nn.GroupNorm(4, 8)
        self.conv2, self.gn2 = nn.Conv2d(8, 12, 3, padding=1), nn.GroupNorm(3, 12)
        self.conv3, self.gn3 = nn.Conv2d(12, 12, 3, padding=1), nn.GroupNorm(2, 12, affine=False)
        self.gn0, self.fc, self.gn4 = nn.GroupNorm(2, 2), nn.Linear(12, 6), nn.GroupNorm(2, 6)
        self.head = nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.silu(self.gn1(self.conv1(self.gn0(x.view(-1, 2, 4, 8)))))
        h = F.silu(self.gn2(self.conv2(h)))
        h = self.gn3(h + self.conv3(h)).mean((2, 3))
        return self.head(F.relu(self.gn4(self.fc(h))))


class LlamaMLP(nn.Module):
    """A residual stream with RMSNorm pre-norms and SwiGLU feed-forwards (``w2(silu(w1 x) * w3 x)``),
    as Llama-style transformers write their MLP blocks."""

    def __init__(self, d: int = 64, w: int = 24, h: int = 32, blocks: int = 2) -> None:
        super().__init__()
        self.stem, self.norm, self.head = nn.Linear(d, w), nn.RMSNorm(w), nn.Linear(w, 10)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(norm=nn.RMSNorm(w), w1=nn.Linear(w, h, bias=False), w3=nn.Linear(w, h, bias=False))
                | dict(w2=nn.Linear(h, w, bias=False))
            )
            for _ in range(blocks)
        )

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            t = b["norm"](x)
            x = x + b["w2"](F.silu(b["w1"](t)) * b["w3"](t))
        return self.head(self.norm(x))


class SqueezeExcite(nn.Module):
    """Channel gates (squeeze-and-excitation): each channel scaled by a gate computed from the
    pooled maps, ``x * sigmoid(fc2(relu(fc1(mean(x)))))[:, :, None, None]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc1, self.fc2, self.head = nn.Linear(8, 2), nn.Linear(2, 8), nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x.view(-1, 1, 8, 8))))
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(h.mean((2, 3))))))
        return self.head((h * gate[:, :, None, None]).mean((2, 3)))


class LayerNorm2d(nn.LayerNorm):
    """A layer norm over the channels of (N, C, H, W) maps, as ConvNeXt writes it: a subclass of
    ``nn.LayerNorm`` whose forward moves the channels last and calls ``F.layer_norm``."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    """A ConvNeXt stage: a stem with a :class:`LayerNorm2d`, a block (depthwise convolution,
    channels-last LayerNorm, an inverted bottleneck of Linear layers, a layer scale of shape
    ``(C, 1, 1)``, a residual add), a downsampling LayerNorm2d and strided convolution, and a
    pooled head with a layer norm given its width off the input (``F.layer_norm(x, x.shape[-1:])``)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.stem_norm = nn.Conv2d(1, 8, 2, stride=2), LayerNorm2d(8, eps=1e-6)
        self.dw, self.norm = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.LayerNorm(8)
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)
        self.layer_scale = nn.Parameter(torch.rand(8, 1, 1) + 0.5)
        self.down_norm, self.reduce = LayerNorm2d(8), nn.Conv2d(8, 12, 2, stride=2)
        self.head_scale, self.head_shift = nn.Parameter(torch.rand(12) + 0.5), nn.Parameter(torch.randn(12))
        self.head = nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = self.stem_norm(self.stem(x.view(-1, 1, 8, 8)))
        branch = self.norm(self.dw(h).permute(0, 2, 3, 1))
        branch = self.down(F.gelu(self.up(branch))).permute(0, 3, 1, 2)
        h = h + self.layer_scale * branch
        h = self.reduce(self.down_norm(h)).mean((2, 3))
        return self.head(F.layer_norm(h, h.shape[-1:], self.head_scale, self.head_shift))


class GroupNormSiLU(nn.GroupNorm):
    """A group norm with its activation, a class of one's own calling ``F.group_norm`` (as
    timm's and diffusion models' norm layers do)."""

    def forward(self, x):
        return F.silu(F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps))


class OwnGroupNormCNN(nn.Module):
    """:class:`GroupNormSiLU` of 4 groups after a convolution, and of one group per channel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.gn1 = nn.Conv2d(1, 8, 3, padding=1), GroupNormSiLU(4, 8)
        self.conv2, self.gn2 = nn.Conv2d(8, 6, 3, padding=1), GroupNormSiLU(6, 6)
        self.head = nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = self.gn2(self.conv2(self.gn1(self.conv1(x.view(-1, 1, 8, 8)))))
        return self.head(h.mean((2, 3)))


class BatchNormAct2d(nn.BatchNorm2d):
    """A batch norm and its activation in one class of one's own, calling ``F.batch_norm``, as
    timm writes its ``BatchNormAct2d`` (the activation a child module)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.act = nn.SiLU()

    def forward(self, x):
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, self.eps)
        return self.act(x)


class OwnLinear(nn.Linear):
    """``nn.Linear`` whose forward calls ``F.linear`` itself, as timm's ``Linear`` does."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class TimmStyleCNN(nn.Module):
    """Convolutions without biases, each followed by a :class:`BatchNormAct2d` (folded into it),
    a depthwise one among them, and an :class:`OwnLinear` head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3, padding=1, bias=False), BatchNormAct2d(8)
        self.dw, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), BatchNormAct2d(8)
        self.pw, self.bn3 = nn.Conv2d(8, 6, 1, bias=False), BatchNormAct2d(6)
        self.head = OwnLinear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = self.bn2(self.dw(self.bn1(self.conv1(x.view(-1, 1, 8, 8)))))
        return self.head(self.bn3(self.pw(h)).mean((2, 3)))


class ShiftedWindows(nn.Module):
    """Channels-last maps as Swin moves them: padded along the positions with nothing on the
    channels (``F.pad(x, (0, 0, 0, 1, 0, 1))``), rolled along the positions (``dims=(1, 2)``), an
    affine ``torch.addcmul(beta, alpha, x)`` (timm's ``Affine``, ConvNeXt-V2's response norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.mix = nn.Linear(1, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.alpha, self.beta = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8))
        self.head = nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = self.embed(x.view(-1, 8, 8, 1))  # (B, H, W, C)
        h = torch.roll(F.pad(self.norm(h), (0, 0, 0, 1, 0, 1)), shifts=(-1, -1), dims=(1, 2))
        h = h + torch.addcmul(self.beta, self.alpha, F.gelu(self.mix(h)))
        return self.head(h.mean((1, 2)))


class MixerBlock(nn.Module):
    """An MLP-Mixer block: 8 tokens of 8 features embedded to 12 channels, a token-mixing MLP
    across the tokens (``fc(x.transpose(1, 2))``, its units kept in place) and a channel MLP, each
    added to the stream, a pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm1, self.norm2 = nn.Linear(8, 12), nn.LayerNorm(12), nn.LayerNorm(12)
        self.tok1, self.tok2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.ch1, self.ch2, self.head = nn.Linear(12, 24), nn.Linear(24, 12), nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = self.embed(x.view(-1, 8, 8))
        mixed = self.tok2(F.gelu(self.tok1(self.norm1(h).transpose(1, 2))))
        h = h + mixed.transpose(1, 2)
        h = h + self.ch2(F.gelu(self.ch1(self.norm2(h))))
        return self.head(h.mean(1))


class DepthwiseMultiplierCNN(nn.Module):
    """A depthwise convolution with two filters per channel (``Conv2d(6, 12, 3, groups=6)``) on a
    residual stream: channel c's two filters follow channel c."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv = nn.Conv2d(1, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.dw, self.pw = nn.Conv2d(6, 12, 3, padding=1, groups=6), nn.Conv2d(12, 8, 1)
        self.head = nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.relu(self.stem(x.view(-1, 1, 8, 8)))
        h = h + F.relu(self.conv(h))
        return self.head(F.relu(self.pw(F.relu(self.dw(h)))).mean((2, 3)))


class GroupNormSkip(nn.Module):
    """A diffusion U-Net's step: a skip's channels (8) concatenated with the upsampled ones (4),
    then a GroupNorm of 3 groups of 4 channels right after the concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.gn, self.dec, self.head = nn.GroupNorm(3, 12), nn.Conv2d(12, 6, 3, padding=1), nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        skip = F.silu(self.enc(x.view(-1, 1, 8, 8)))
        h = F.silu(self.gn(torch.cat([skip, F.silu(self.mid(skip))], 1)))
        return self.head(F.silu(self.dec(h)).mean((2, 3)))


class PatchTokens(nn.Module):
    """A vision transformer's patch embedding as torchvision writes it: the patches' channels
    reshaped by the width the network holds, ``self.hidden_dim``, then a token MLP."""

    def __init__(self, hidden_dim: int = 12) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.patch = nn.Conv2d(1, hidden_dim, 4, stride=4)
        self.norm, self.mlp, self.head = (
            nn.LayerNorm(hidden_dim),
            nn.Linear(hidden_dim, hidden_dim),
            nn.Linear(hidden_dim, 10),
        )

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        n = x.shape[0]
        h = self.patch(x.view(n, 1, 8, 8)).reshape(n, self.hidden_dim, -1).permute(0, 2, 1)
        h = h + F.gelu(self.mlp(self.norm(h)))
        return self.head(h.mean(1))


class PatchTokensUnguessed(PatchTokens):
    """:class:`PatchTokens` that does not say its input: its first layer, a convolution of images
    its forward makes from rows of 64, does not tell it either."""

    example_input = None


class EinsumAttention(nn.Module):
    """Attention written with ``torch.einsum``, as research code often is: queries, keys and values
    viewed into heads of the width the module holds (``self.head_dim``), scores
    ``einsum("bhid,bhjd->bhij")``, values ``einsum("bhij,bhjd->bhid")``; a gate by an ellipsis
    equation and a squared norm by an implicit one; axes moved by ``movedim`` and ``swapaxes``."""

    def __init__(self, d: int = 16, heads: int = 2, k: int = 10) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.embed, self.qkv, self.out = nn.Linear(16, d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.gate, self.head = nn.Linear(d, d), nn.Linear(d, k)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.embed(x.view(-1, 4, 16))
        B, N, _ = t.shape
        q, k, v = self.qkv(t).view(B, N, 3, self.heads, self.head_dim).movedim(2, 0).swapaxes(2, 3).unbind(0)
        a = (torch.einsum("bhid,bhjd->bhij", q, k) * 0.3).softmax(-1)
        o = torch.einsum("bhij,bhjd->bhid", a, v).swapdims(1, 2).flatten(2)
        t = t + self.out(o)
        t = torch.einsum("...d,...d->...d", t, torch.sigmoid(self.gate(t)))
        energy = torch.einsum("bnd,bnd", t, t)  # a number: summed over every axis
        return self.head(t.mean(1)) + 0 * energy


class GateThenHeads(nn.Module):
    """A stream gated by a bias-free squeeze-and-excitation MLP, then cut into two heads (``view(B, 2, -1)``)
    for attention across them: the heads' cut makes the stream's group anew after the gate's
    hidden group, which reads it, was made (as in timm's GCViT)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.se1, self.se2 = nn.Linear(64, 8), nn.Linear(8, 3, bias=False), nn.Linear(3, 8, bias=False)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.stem(x)
        h = h * torch.sigmoid(self.se2(torch.relu(self.se1(h))))
        t = h.view(h.shape[0], 2, -1)
        t = t + t.mean(1, keepdim=True).repeat_interleave(2, dim=1)  # the heads' mean, repeated per head
        h = h + ((t @ t.transpose(1, 2)).softmax(-1) @ t).reshape_as(h)
        return self.head(h)


class TiedGPT(NanoGPT):
    """:class:`NanoGPT` whose token embedding is its output layer's weight, as nanoGPT ties them
    (``self.transformer.wte.weight = self.lm_head.weight``): one tensor under two names."""

    def __init__(self) -> None:
        super().__init__(split_by="C")
        self.wte.weight = self.lm_head.weight


class SharedModule(nn.Module):
    """One module held under two names, called twice (as timm's CoaT holds its convolutional
    position encodings in a stage and in its first block): its entries appear twice in the
    state_dict."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.mix, self.head = nn.Linear(64, 12), nn.Linear(12, 12), nn.Linear(12, 10)
        self.block = nn.ModuleDict({"mix": self.mix, "out": nn.Linear(12, 12)})

    def forward(self, x):
        h = torch.relu(self.fc(x))
        h = h + torch.tanh(self.block["out"](torch.tanh(self.block["mix"](h))))
        return self.head(h + torch.tanh(self.mix(h)))


class GroupedUpConv(nn.Module):
    """Transposed convolutions of groups: one of 4 groups (stride 2, a batch norm after it, not
    folded) and a depthwise one of two filters per channel, then a 1x1 convolution and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(1, 8, 3, padding=1)
        self.up, self.bn = nn.ConvTranspose2d(8, 12, 2, stride=2, groups=4), nn.BatchNorm2d(12)
        self.depth = nn.ConvTranspose2d(12, 24, 3, padding=1, groups=12)
        self.mix, self.head = nn.Conv2d(24, 6, 1), nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = F.relu(self.enc(x.view(-1, 1, 8, 8)))
        h = F.relu(self.depth(F.relu(self.bn(self.up(h)))))
        return self.head(F.relu(self.mix(h)).sum((2, 3)))


class TiedFoldCNN(nn.Module):
    """A bias-free convolution followed by a batch norm whose weight a second convolution, without
    one, shares (``c2.weight = c1.weight``); and a convolution applied twice, a batch norm after
    its first call only: no batch norm folds into a weight used elsewhere too."""

    def __init__(self) -> None:
        super().__init__()
        self.c0 = nn.Conv2d(1, 6, 3, padding=1)
        self.c1, self.bn1 = nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.c2 = nn.Conv2d(6, 6, 3, padding=1)
        self.c2.weight = self.c1.weight
        self.twice, self.bn2 = nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6)
        self.head = nn.Linear(6, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = torch.relu(self.c0(x.view(-1, 1, 8, 8)))
        h = torch.relu(self.c2(torch.relu(self.bn1(self.c1(h)))))
        h = torch.relu(self.twice(torch.relu(self.bn2(self.twice(h)))))
        return self.head(h.sum((2, 3)))


class EinsumScale(nn.Module):
    """A layer scale applied by ``torch.einsum`` with a vector of parameters (``"bnd,d->bnd"``)
    and a scale per position and unit (``"bnd,nd->bnd"``), and axes swapped by keyword (``torch.swapaxes(h, axis0=1, axis1=2)``,
    ``h.transpose(1, dim1=2)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.mix, self.head = nn.Linear(16, 12), nn.Linear(4, 4), nn.Linear(12, 10)
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 12))  # not all alike: permuting them shows
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 48).view(4, 12))  # one per position and unit

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        h = torch.relu(self.fc(x.view(-1, 4, 16)))
        h = h + torch.einsum("bnd,d->bnd", h, self.gamma) + torch.einsum("bnd,nd->bnd", h, self.scale)
        h = self.mix(torch.swapaxes(h, axis0=1, axis1=2)).transpose(1, dim1=2)
        return self.head(h.mean(1))


class ShapeOfAttention(QKVAttention):
    """:class:`QKVAttention` merging its heads back by the stream's whole shape,
    ``reshape(t.shape)``: the heads' width is tied to the stream's by that shape alone."""

    def merged(self, heads, t):
        return heads.reshape(t.shape)


class UnequalSplit(nn.Module):
    """Queries and keys narrower than values, split from one projection by widths the module holds
    (``qkv(t).split([self.dk, self.dk, self.dv], -1)``), and a gated unit cut by the stream's width
    read off it and one the module holds (``split([t.shape[-1], self.dg], -1)``; ``written=True``
    writes the second as a number, which fixes that piece's width)."""

    def __init__(self, written: bool = False) -> None:
        super().__init__()
        self.dk, self.dv, self.dg, self.written = 4, 6, 4, written
        self.embed, self.qkv = nn.Linear(16, 8), nn.Linear(8, 14)
        self.out, self.gate = nn.Linear(6, 8), nn.Linear(8, 12)
        self.mix, self.head = nn.Linear(4, 8), nn.Linear(8, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.embed(x.view(-1, 4, 16))
        q, k, v = self.qkv(t).split([self.dk, self.dk, self.dv], -1)
        t = t + self.out(((q @ k.transpose(1, 2)) * 0.5).softmax(-1) @ v)
        a, g = self.gate(t).split([t.shape[-1], 4 if self.written else self.dg], -1)
        return self.head(torch.relu(t + a * torch.sigmoid(self.mix(g))).mean(1))


class VectorNorm(nn.Module):
    """nanoGPT's LayerNorm: ``F.layer_norm(x, self.weight.shape, self.weight, self.bias)``, its
    width read off its own weight's shape; the bias optional."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class VectorNormMLP(nn.Module):
    """A residual MLP normalised by :class:`VectorNorm`, with and without its bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.ln1, self.mlp = nn.Linear(64, 12), VectorNorm(12, True), nn.Linear(12, 12)
        self.ln2, self.head = VectorNorm(12, False), nn.Linear(12, 10)

    def forward(self, x):
        h = self.fc(x)
        h = h + torch.relu(self.mlp(self.ln1(h)))
        return self.head(self.ln2(h))


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, flash):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(0.0), nn.Dropout(0.0)
        self.n_head, self.n_embd, self.dropout, self.flash = n_head, n_embd, 0.0, flash
        if not flash:
            self.register_buffer(
                "bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
            )

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class _GPTMLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj, self.dropout = (
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(0.0),
        )

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class _GPTBlock(nn.Module):
    def __init__(self, n_embd, n_head, block_size, flash):
        super().__init__()
        self.ln_1, self.attn = VectorNorm(n_embd, True), _CausalSelfAttention(n_embd, n_head, block_size, flash)
        self.ln_2, self.mlp = VectorNorm(n_embd, True), _GPTMLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class WrittenGPT(nn.Module):
    """A GPT as nanoGPT writes it, whole: ``assert t <= self.block_size``, ``forward(idx,
    targets=None)`` returning ``(logits, loss)`` with ``if targets is not None:``, attention by
    ``F.scaled_dot_product_attention(..., is_causal=True)`` (``flash``) or by hand with
    ``1.0 / math.sqrt(k.size(-1))`` and a causal mask buffer, heads cut by ``C // self.n_head``,
    its LayerNorm's width read off its weight, and the token embedding tied to the output layer."""

    def __init__(self, flash=True, vocab_size=12, block_size=8, n_layer=2, n_head=2, n_embd=16):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList([_GPTBlock(n_embd, n_head, block_size, flash) for _ in range(n_layer)]),
                ln_f=VectorNorm(n_embd, True),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def example_input(self):
        return torch.zeros(2, 8, dtype=torch.long)

    def forward(self, idx, targets=None):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


class InputsFirstLinear(nn.Module):
    """A linear layer whose weight is stored inputs first, ``(nx, nf)``, and applied by
    ``torch.addmm`` (Hugging Face's ``Conv1D``, GPT-2's layers)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class InputsFirstMLP(nn.Module):
    """A residual token MLP of :class:`InputsFirstLinear` layers, as GPT-2 writes its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = InputsFirstLinear(12, 16), nn.LayerNorm(12)
        self.c_fc, self.c_proj, self.head = InputsFirstLinear(24, 12), InputsFirstLinear(12, 24), nn.Linear(12, 10)

    def example_input(self):
        return torch.zeros(2, 64)

    def forward(self, x):
        t = self.embed(x.view(-1, 4, 16))
        t = t + self.c_proj(F.gelu(self.c_fc(self.norm(t))))
        return self.head(t.mean(1))


class _RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class _RotaryAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(n_embd, n_embd, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(n_embd, n_embd, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.past_keys = torch.tensor([])  # a key cache before its first step, as Hugging Face's caches start

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + _rotate_half(q) * sin
        k = torch.cat([self.past_keys, k * cos + _rotate_half(k) * sin], dim=-2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class _SwiGLU(nn.Module):
    def __init__(self, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(n_embd, hidden, bias=False), nn.Linear(n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryLM(nn.Module):
    """A language model as Llama writes it: RMS norms, a SwiGLU MLP, and attention whose queries
    and keys are turned by a rotary position embedding (``q * cos + rotate_half(q) * sin``, the
    tables computed in the forward from a non-persistent buffer of frequencies), their keys put
    after an empty cache (``torch.cat([torch.tensor([]), k], -2)``)."""

    def __init__(self, vocab_size=12, n_layer=2, n_head=2, n_embd=16, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln_1=_RMSNorm(n_embd),
                    attn=_RotaryAttention(n_embd, n_head),
                    ln_2=_RMSNorm(n_embd),
                    mlp=_SwiGLU(n_embd, hidden),
                )
            )
            for _ in range(n_layer)
        )
        self.norm = _RMSNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def example_input(self):
        return torch.zeros(2, 8, dtype=torch.long)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = x + layer["attn"](layer["ln_1"](x))
            x = x + layer["mlp"](layer["ln_2"](x))
        return self.lm_head(self.norm(x))


class HandMLP(nn.Module):
    """An MLP whose layers are parameters applied by hand, as research code writes them: ``x @
    self.w1 + self.b1`` (stored inputs first), ``F.linear(h, self.w2, self.b2)`` and ``h @
    self.w3.T + self.b3`` (stored outputs first). ``last_as_stored``: the output weight stored
    ``(features, classes)`` and applied as it is, ``h @ self.w3``."""

    def __init__(self, d_in=8, hidden=16, classes=3, last_as_stored=False):
        super().__init__()
        self.last_as_stored = last_as_stored
        self.w1, self.b1 = nn.Parameter(torch.randn(d_in, hidden) * 0.5), nn.Parameter(torch.randn(hidden) * 0.1)
        self.w2, self.b2 = nn.Parameter(torch.randn(hidden, hidden) * 0.3), nn.Parameter(torch.randn(hidden) * 0.1)
        shape = (hidden, classes) if last_as_stored else (classes, hidden)
        self.w3, self.b3 = nn.Parameter(torch.randn(*shape) * 0.3), nn.Parameter(torch.randn(classes) * 0.1)

    def example_input(self):
        return torch.zeros(2, self.w1.shape[0])

    def forward(self, x):
        h = torch.relu(x @ self.w1 + self.b1)
        h = torch.tanh(F.linear(h, self.w2, self.b2))
        return (h @ self.w3 if self.last_as_stored else h @ self.w3.T) + self.b3
