"""Multi-head attention written so that fusion can change its widths, and a vision transformer.

In ``nn.MultiheadAttention`` one matrix holds the queries, keys and values of every head, each
head ``embed_dim / num_heads`` wide: a head's width is tied to the stream it reads, so a network
whose stream was fused to another width cannot be rebuilt into it. :class:`HeadAttention`
computes the same function with one small module per head (:class:`Head`), each with its own
query/key width and value width:

.. math::

    \\mathrm{attn}(x) = b_O + \\sum_{h=1}^{H} W_O^h\\, \\mathrm{softmax}\\!\\Big(
        \\frac{(W_Q^h x + b_Q^h)(W_K^h x + b_K^h)^\\top}{\\sqrt{d}}\\Big) (W_V^h x + b_V^h)

(Vaswani et al. 2017, eq. 1 and section 3.2.2, with the output projection split by head). Its
symmetries are those the permutation spec records (Imfeld et al. 2024, section 4):

* the features inside a head's query/key product: permuting the rows of ``W_Q^h`` and ``W_K^h``
  alike leaves the scores unchanged (one permutation group per head, tied by the product);
* the features inside a head's values: rows of ``W_V^h`` and columns of ``W_O^h`` (another group);
* the heads themselves: the sum over ``h`` does not depend on their order.
  :class:`Heads` marks a list of such exchangeable branches; the traced spec records them in
  :attr:`~bayesfuse.inference.spec.PermutationSpec.heads`, and fusion aligns every client's heads
  before matching their features (:mod:`bayesfuse.inference.heads`).

``1/sqrt(d)`` is a constant of the module, fixed at construction from the clients' head width,
not recomputed from a fused width: the fused function keeps the clients' scale.

:func:`split_heads` turns every ``nn.MultiheadAttention`` of a model into a :class:`HeadAttention`
with the same function, so a model written with PyTorch's module can be fused. It also gives every
``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` the forward of their reference path
(their fused fast path aside, which needs the packed ``nn.MultiheadAttention``), so that the
blocks are traced through rather than refused; :func:`merge_heads` gives them back their own.
:class:`VisionTransformer` is the reference transformer for 28x28 images (Dosovitskiy et al. 2021):
patches of 7x7 pixels embedded by a strided convolution, learned position embeddings, pre-norm
blocks, mean pooling over the tokens and a linear head.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Mapping, cast

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from bayesfuse.nets.images import image_shape
from bayesfuse.nets.state import set_at

__all__ = [
    "Head",
    "Heads",
    "HeadAttention",
    "split_heads",
    "multihead_modules",
    "split_state_dict",
    "merge_heads",
    "merged_where_possible",
    "SPLIT_NOTE",
    "TransformerBlock",
    "VisionTransformer",
    "vit",
]


class Heads(nn.ModuleList):
    """Parallel branches whose outputs are summed: their order does not matter.

    The network's ``forward`` must use them so: every branch reads the same inputs, and their
    outputs are added up. Tracing refuses a list whose branches read each other's outputs (applied
    one after another, where order matters); that the outputs are summed it takes on trust.

    Every branch must have the same entries (names) as the others, each with its own hidden
    groups, and agree in everything a state_dict does not hold (a :class:`Head`'s ``scale``):
    fusion reorders branches by moving their entries. Tracing records the list in the spec's
    ``heads`` so that fusion can align them.
    """


class Head(nn.Module):
    """One attention head: query/key features ``qk_dim`` wide, value features ``v_dim`` wide.

    Parameters
    ----------
    dim : int
        Width of the stream it reads and writes.
    qk_dim, v_dim : int
        Width of its query/key product and of its values.
    scale : float, optional
        The scores' factor; ``1 / sqrt(qk_dim)`` by default (Vaswani et al. 2017, eq. 1).
    """

    def __init__(self, dim: int, qk_dim: int, v_dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.q = nn.Linear(dim, qk_dim)
        self.k = nn.Linear(dim, qk_dim)
        self.v = nn.Linear(dim, v_dim)
        self.o = nn.Linear(v_dim, dim, bias=False)
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(qk_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask=None) -> torch.Tensor:
        scores = self.q(query) @ self.k(key).transpose(-2, -1) * self.scale
        if mask is not None:
            scores = scores + mask
        return self.o(scores.softmax(dim=-1) @ self.v(value))


class HeadAttention(nn.Module):
    """Multi-head attention as a sum of :class:`Head` modules plus one output bias.

    Parameters
    ----------
    dim : int
        Width of the stream.
    heads : int
        Number of heads.
    head_dim : int, optional
        Each head's query/key and value width; ``dim // heads`` by default.
    batch_first : bool
        Inputs ``(batch, tokens, dim)`` (True) or ``(tokens, batch, dim)``, as ``nn.MultiheadAttention``.

    ``forward(query, key=None, value=None, ...)`` takes ``nn.MultiheadAttention``'s arguments
    (self-attention when ``key``/``value`` are omitted; unbatched ``(L, E)`` inputs too) and
    returns ``(output, None)``: the output ``nn.MultiheadAttention`` gives, never the attention
    weights. Masks mean what they mean there: a boolean ``attn_mask`` ``(L, S)`` or
    ``key_padding_mask`` ``(N, S)`` blocks the positions that are True, a float one is added to
    the scores, ``is_causal=True`` without a mask blocks the future; a 3-D per-head ``attn_mask``
    is refused.
    """

    #: No packed input projection: ``nn.TransformerEncoderLayer`` and ``nn.TransformerEncoder`` read
    #: this before their fused fast path and, finding None, call the module as any attention.
    in_proj_bias = None

    def __init__(self, dim: int, heads: int, head_dim: int | None = None, *, batch_first: bool = True) -> None:
        super().__init__()
        if heads < 1 or dim < 1:
            raise ValueError(f"attention needs dim >= 1 and heads >= 1, got dim={dim}, heads={heads}")
        d = head_dim if head_dim is not None else dim // heads
        if d < 1:
            raise ValueError(f"{heads} heads over a stream of {dim}: give head_dim")
        self.heads = Heads(Head(dim, d, d) for _ in range(heads))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.batch_first = batch_first

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask=None,
        need_weights: bool = False,
        attn_mask=None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        key = query if key is None else key
        value = key if value is None else value
        # traced with torch.fx the input is a Proxy without a concrete shape: batched, as any example input
        unbatched = not isinstance(query, torch.fx.Proxy) and query.dim() == 2
        if unbatched:  # (L, E) whatever batch_first says, as nn.MultiheadAttention reads it
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        mask = _score_mask(attn_mask, key_padding_mask, is_causal, query, key)
        out: torch.Tensor = self.bias
        for head in self.heads:
            out = out + head(query, key, value, mask)
        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, None


def _additive(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A mask as numbers to add to the scores: -inf where a boolean mask is True, a float one as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(mask, float("-inf"))
    return mask.to(like.dtype)


def _score_mask(attn_mask, key_padding_mask, is_causal: bool, query: torch.Tensor, key: torch.Tensor):
    """The masks of ``nn.MultiheadAttention`` as one additive mask of the scores ``(N, L, S)``, or None."""
    mask = None
    if attn_mask is None and is_causal:
        L, S = query.shape[1], key.shape[1]
        attn_mask = torch.ones(L, S, dtype=torch.bool, device=query.device).triu(1)
    if attn_mask is not None:
        if attn_mask.dim() != 2:
            raise ValueError(
                "HeadAttention takes a 2-D attn_mask (L, S), the same for every head; got shape "
                f"{tuple(attn_mask.shape)}"
            )
        mask = _additive(attn_mask, query)
    if key_padding_mask is not None:
        padding = _additive(key_padding_mask, query)
        padding = padding.unsqueeze(-2) if padding.dim() == 2 else padding.unsqueeze(0).unsqueeze(0)  # (N, 1, S)
        mask = padding if mask is None else mask + padding
    return mask


class _TracedEncoderLayer(nn.TransformerEncoderLayer):
    """``nn.TransformerEncoderLayer`` as its forward computes it off the fast path (PyTorch's
    ``forward`` with ``why_not_sparsity_fast_path`` set), which ``torch.fx`` can trace: the same
    modules and entries; masks go to the attention as they are (:class:`HeadAttention` reads
    boolean and float masks as ``nn.MultiheadAttention`` does)."""

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False):  # type: ignore[override]
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
        return self.norm2(x + self._ff_block(x))


class _TracedEncoder(nn.TransformerEncoder):
    """``nn.TransformerEncoder`` off its nested-tensor fast path: its layers in turn, then its norm."""

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):  # type: ignore[override]
        out = src
        for layer in self.layers:
            out = layer(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask, is_causal=bool(is_causal))
        return out if self.norm is None else self.norm(out)


#: PyTorch's transformer modules and the traceable forms :func:`split_heads` gives them.
_TRACED = {nn.TransformerEncoderLayer: _TracedEncoderLayer, nn.TransformerEncoder: _TracedEncoder}


def _swap_blocks(model: nn.Module, to_traced: bool) -> None:
    """Give every PyTorch transformer module of ``model`` (in place) its traceable form
    (``to_traced``), or back its own class. Only ``forward`` differs between the two."""
    swaps = _TRACED if to_traced else {v: k for k, v in _TRACED.items()}
    for module in model.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]


def _from_multihead(mha: nn.MultiheadAttention) -> HeadAttention:
    """The :class:`HeadAttention` that computes what ``mha`` computes (self- or cross-attention):
    its entries split by :func:`_split_entries`, in ``mha``'s dtype and device."""
    _check_splittable(mha)
    w = mha.in_proj_weight
    new = HeadAttention(mha.embed_dim, mha.num_heads, batch_first=mha.batch_first).to(device=w.device, dtype=w.dtype)
    new.load_state_dict(_split_entries("", mha.num_heads, mha.state_dict()))
    return new.train(mha.training)


def split_heads(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose ``nn.MultiheadAttention`` modules are :class:`HeadAttention`.

    The copy computes the same function (dropout on the attention weights aside: the heads have
    none) and can be traced and fused; masks mean what they mean to ``nn.MultiheadAttention``
    (:class:`HeadAttention`), but the attention weights are never returned.

    Examples
    --------
    >>> import torch
    >>> mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    >>> x = torch.randn(3, 5, 8)
    >>> bool(torch.allclose(split_heads(mha)(x, x, x)[0], mha(x, x, x)[0], atol=1e-6))
    True
    """
    if isinstance(model, nn.MultiheadAttention):
        return _from_multihead(model)
    new = copy.deepcopy(model)
    for module in [m for m in new.modules() if isinstance(m, nn.MultiheadAttention)]:
        _set_everywhere(new, module, _from_multihead(module))
    _swap_blocks(new, to_traced=True)
    return new


def _set_everywhere(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` in ``root`` under every name ``old`` has there: a module held under two names
    stays one module."""
    for name, module in list(root.named_modules(remove_duplicate=False)):
        if module is old and name:
            set_at(root, name, new)


def multihead_modules(model: nn.Module) -> list[str]:
    """Names of the ``nn.MultiheadAttention`` modules of ``model`` (``""``: the model itself)."""
    return [name for name, module in model.named_modules() if isinstance(module, nn.MultiheadAttention)]


def split_state_dict(like: nn.Module, state: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
    """A state_dict of ``like``'s architecture, at any widths, in the form of ``split_heads(like)``.

    Each ``nn.MultiheadAttention`` of ``like`` (``H`` heads) has, in ``state``, a stream ``E``
    wide: ``in_proj_weight`` (3E, E) holds the heads' query, key and value rows, ``E / H`` each,
    and ``out_proj.weight`` (E, E) their output columns. They become the entries of ``H``
    :class:`Head` modules and one output bias, with the values :func:`split_heads` copies (zero
    biases where the module has none). Other entries are kept as they are.

    Raises
    ------
    ValueError
        Where an attention module's entries are missing, or ``E`` is not a multiple of ``H``.
    """
    names = multihead_modules(like)
    modules = {name + "." if name else "": cast(nn.MultiheadAttention, like.get_submodule(name)) for name in names}
    for mha in modules.values():
        _check_splittable(mha)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    done = set()
    for key, value in state.items():
        prefix = next((p for p in modules if key.startswith(p) and key[len(p) :] in _MHA_ENTRIES), None)
        if prefix is None:
            out[key] = value
        elif prefix not in done:
            done.add(prefix)
            out.update(_split_entries(prefix, modules[prefix].num_heads, state))
    missing = [p or "the model" for p in modules if p not in done]
    if missing:
        raise ValueError(f"the state_dict has no entries of the attention module {missing[0]!r}")
    return out


#: The entries of an nn.MultiheadAttention with kdim = vdim = embed_dim.
_MHA_ENTRIES = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias")


def _check_splittable(mha: nn.MultiheadAttention) -> None:
    if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError(
            "split_heads converts nn.MultiheadAttention with kdim = vdim = embed_dim, no add_bias_kv "
            "and no add_zero_attn"
        )


def _split_entries(prefix: str, h: int, state: Mapping[str, torch.Tensor]) -> "OrderedDict[str, torch.Tensor]":
    """One attention module's entries in ``state`` as :class:`HeadAttention`'s (in its order)."""
    w = state.get(prefix + "in_proj_weight")
    wo = state.get(prefix + "out_proj.weight")
    if w is None or wo is None:
        raise ValueError(f"the state_dict lacks {prefix}in_proj_weight or {prefix}out_proj.weight")
    dim = w.shape[1]
    if w.shape != (3 * dim, dim) or dim % h:
        raise ValueError(
            f"{prefix}in_proj_weight has shape {tuple(w.shape)}: an attention of {h} heads needs (3E, E), "
            f"E a multiple of {h}"
        )
    d = dim // h
    b = state.get(prefix + "in_proj_bias")
    b = torch.zeros(3 * dim, dtype=w.dtype, device=w.device) if b is None else b
    bo = state.get(prefix + "out_proj.bias")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    out[prefix + "bias"] = torch.zeros(dim, dtype=w.dtype, device=w.device) if bo is None else bo.clone()
    for i in range(h):
        rows = slice(i * d, (i + 1) * d)
        for part, name in enumerate("qkv"):
            out[f"{prefix}heads.{i}.{name}.weight"] = w[part * dim :][rows].clone()
            out[f"{prefix}heads.{i}.{name}.bias"] = b[part * dim :][rows].clone()
        out[f"{prefix}heads.{i}.o.weight"] = wo[:, rows].clone()
    return out


def merge_heads(model: nn.Module, like: nn.Module) -> nn.Module:
    """The inverse of :func:`split_heads`: a copy of ``model`` (``split_heads(like)``'s
    architecture, any widths) with an ``nn.MultiheadAttention`` wherever ``like`` has one.

    Possible where every head of such a module is as ``nn.MultiheadAttention`` makes them: query,
    key and value ``E / H`` wide for a stream ``E`` wide, the scale ``1 / sqrt(E / H)``, and zero
    biases where ``like``'s module has none. Fusion that keeps the widths (FedAvg, or matching that
    finds the clients' units) gives such heads; fused heads of other widths stay
    :class:`HeadAttention`, which computes the same function. The new modules take ``like``'s
    settings (``batch_first``, ``dropout``, ``bias``).

    Raises
    ------
    ValueError
        Naming the first module and why it cannot be one ``nn.MultiheadAttention``.
    """
    new = copy.deepcopy(model)
    _swap_blocks(new, to_traced=False)
    for name in multihead_modules(like):
        original = cast(nn.MultiheadAttention, like.get_submodule(name))
        attention = new.get_submodule(name) if name else new
        if not isinstance(attention, HeadAttention):
            raise ValueError(f"{name or 'the model'} is a {type(attention).__name__}, not a HeadAttention")
        mha = _to_multihead(attention, original, name or "the model")
        if not name:
            return mha
        _set_everywhere(new, attention, mha)
    return new


#: How reports say that a network's ``nn.MultiheadAttention`` were fused as :class:`HeadAttention`.
SPLIT_NOTE = "nn.MultiheadAttention split into heads to be fused"


def merged_where_possible(model: nn.Module, like: nn.Module) -> tuple[nn.Module, str | None]:
    """``(merge_heads(model, like), None)``, or ``(model, why)`` where :func:`merge_heads` refuses."""
    try:
        return merge_heads(model, like), None
    except ValueError as err:  # HeadAttention stays, inside PyTorch's own transformer modules
        model = copy.deepcopy(model)
        _swap_blocks(model, to_traced=False)
        return model, str(err)


def _to_multihead(attention: HeadAttention, original: nn.MultiheadAttention, name: str) -> nn.MultiheadAttention:
    heads = cast(list[Head], list(attention.heads))
    dim, h = attention.bias.shape[0], len(heads)
    d = dim // h
    for i, head in enumerate(heads):
        widths = (head.q.out_features, head.k.out_features, head.v.out_features)
        if dim % h or widths != (d, d, d):
            raise ValueError(
                f"{name}: head {i} has query/key/value widths {widths} over a stream of {dim}; "
                f"nn.MultiheadAttention's {h} heads are {dim / h:g} wide each"
            )
        if head.scale != 1.0 / math.sqrt(d):
            raise ValueError(
                f"{name}: head {i} scales its scores by {head.scale:.6g}, the clients' 1/sqrt(width); "
                f"nn.MultiheadAttention's heads {d} wide would use {1.0 / math.sqrt(d):.6g}"
            )
    bias = original.in_proj_bias is not None
    params = [p for head in heads for p in (head.q.bias, head.k.bias, head.v.bias)] + [attention.bias]
    if not bias and any(bool(p.detach().ne(0).any()) for p in params):
        raise ValueError(f"{name}: the fused biases are not zero and the network's attention has none (bias=False)")
    w = attention.bias
    mha = nn.MultiheadAttention(
        dim, h, dropout=original.dropout, bias=bias, batch_first=original.batch_first, device=w.device, dtype=w.dtype
    )
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([getattr(x, p).weight for p in "qkv" for x in heads]))
        mha.out_proj.weight.copy_(torch.cat([x.o.weight for x in heads], dim=1))
        if bias:
            mha.in_proj_bias.copy_(torch.cat([getattr(x, p).bias for p in "qkv" for x in heads]))
            mha.out_proj.bias.copy_(attention.bias)
    return mha.train(attention.training)


class TransformerBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = HeadAttention(dim, heads, head_dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class VisionTransformer(nn.Module):
    """A small vision transformer for flat 28x28 greyscale images (given as ``(N, 784)``).

    Parameters
    ----------
    n_features : int
        Pixels of a flat square image (784 for 28x28).
    n_classes : int
    dim : int
        Width of the residual stream.
    depth : int
        Transformer blocks.
    heads, head_dim : int
        Heads per block and each head's width.
    mlp : int
        Hidden width of each block's MLP.
    patch : int, optional
        Side of the square patches; a quarter of the image's side by default (16 tokens: 7x7
        pixels for 28x28 images, 2x2 for 8x8 digits).
    """

    def __init__(
        self,
        n_features: int = 784,
        n_classes: int = 10,
        *,
        dim: int = 32,
        depth: int = 2,
        heads: int = 4,
        head_dim: int = 8,
        mlp: int = 64,
        patch: int | None = None,
    ) -> None:
        super().__init__()
        self.shape = image_shape(n_features)
        side = self.shape[1]
        patch = patch if patch is not None else max(1, side // 4)
        if side % patch:
            raise ValueError(f"the image side {side} is not a multiple of the patch side {patch}")
        self.embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.randn(1, (side // patch) ** 2, dim) * 0.02)
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads, head_dim, mlp) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def example_input(self) -> torch.Tensor:
        return torch.zeros(2, self.shape[1] * self.shape[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.reshape(-1, *self.shape)).flatten(2).transpose(1, 2) + self.pos
        tokens = self.blocks(tokens)
        return self.head(self.norm(tokens).mean(dim=1))


def vit(
    n_features: int = 784, n_classes: int = 10, width: float = 1.0, *, depth: int = 2, heads: int = 4
) -> VisionTransformer:
    """The reference vision transformer at ``width`` x (stream 32, heads of 8, MLP 64), ``depth``
    blocks of ``heads`` heads."""
    if not width > 0:
        raise ValueError(f"the width multiplier must be positive, got {width}")
    return VisionTransformer(
        n_features,
        n_classes,
        dim=max(1, round(32 * width)),
        depth=depth,
        heads=heads,
        head_dim=max(1, round(8 * width)),
        mlp=max(1, round(64 * width)),
    )
