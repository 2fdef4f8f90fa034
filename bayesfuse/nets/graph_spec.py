"""Permutation specs of any module, read off its ``torch.fx`` graph.

:func:`spec_from_graph` traces a module's ``forward`` with :func:`torch.fx.symbolic_trace`,
runs one example input through the graph to learn every intermediate shape
(:class:`torch.fx.passes.shape_prop.ShapeProp`), and follows the *feature axis* of every
activation from the input to the output:

* each hidden ``Linear`` / ``Conv`` / ``Embedding`` opens a new permutation of its outputs;
* a residual ``a + b`` (also ``-``, ``*``, ``torch.cat`` along another axis) ties the
  permutations of ``a`` and ``b`` into one: every layer that writes into one residual stream
  shares one permutation, as git-re-basin's ``PermutationSpec`` of a ResNet does (Ainsworth
  et al. 2023, section 3 and appendix);
* BatchNorm, LayerNorm, GroupNorm and parameters added to the stream (a position embedding, a
  class token) are permuted with the stream they act on; a GroupNorm of ``g`` groups cuts the
  channels into blocks the groups do not cross, one permutation within a group for every group;
* an ``nn.LSTM`` / ``nn.GRU`` opens one permutation per layer, of the rows of each gate's block
  (4 blocks, 3 for a GRU) and of the columns of its own hidden-to-hidden weights; its output
  sequence has the top layer's units, its final state (one layer only) the same;
* a matrix product ``a @ b`` that sums over the units of both operands (a head's queries
  against its keys) ties their permutations, and its result has no units; one that sums over
  another axis (attention weights times values) passes the units of the operand that has them
  through; ``scaled_dot_product_attention(q, k, v)`` does both; softmax passes units through;
* the branches of a :class:`~bayesfuse.nets.attention.Heads` list (attention heads whose outputs
  are summed) are recorded as exchangeable in the spec's ``heads``;
* ``chunk`` / ``split`` / ``glu`` of the units' axis into equal pieces (a gated unit's two
  halves, ``u, g = h.chunk(2, -1)``) makes each piece a block of the layer's units: one
  permutation for every piece, so a global unit is one unit of each;
* ``torch.cat`` on the units' axis (DenseNet's ``cat([x, f1, f2], 1)``, Inception's branches, a
  U-Net's skip, the input beside hidden units): each stream keeps its permutation, side by
  side, and the entries that read them (a layer's weight, a norm's numbers per unit) are held
  in pieces, one per stream (:attr:`~bayesfuse.inference.spec.PermutationSpec.pieces`);
  streams of one permutation already (``cat([a, b, a * b])`` with ``a * b`` tying ``a`` and
  ``b``) are blocks of it;
* a convolution of ``g`` groups keeps them: one permutation within a group for every group,
  the channels it reads cut into blocks the groups do not cross;
* a ``view`` / ``reshape`` that cuts the units' axis into heads (attention written by hand,
  ``q.view(B, N, heads, C // heads)``) makes the units blocks, one per head, so one permutation
  of the features within a head serves every head; a reshape whose target width is read off
  another stream's width (``C``) ties that stream's units to its own, cut into as many blocks,
  so the reshape runs at any fused width;
* where the forward fixes a width (a ``split`` or slice by widths written in the code, heads of
  such a width, a scale computed as a root of a width, ``/ k.size(-1) ** 0.5``, a buffer with a
  number per unit), the spec records the group (``spec.fixed``): methods that keep the widths
  fuse the network, those that change them refuse it;
* a branch, ``assert`` or ``int()`` on a number read off tensors' sizes is taken at the example
  input (:mod:`bayesfuse.nets.decisions`); one that reads the units' width fixes it, one on a
  tensor's values is refused; functions a library wrapped for fx are traced through;
* a number a module holds (an ``int`` attribute of a module of one's own: ``self.hidden_dim``,
  ``self.head_dim``) that a reshape reads as the length of the units' axis, or as the width
  within a head, follows the units: the spec records it (``spec.widths``) and a network rebuilt
  at other widths gets it at theirs;
* element-wise functions, pooling, dropout, ``flatten`` / ``view`` / ``reshape`` (that keep each
  unit's numbers together, recorded as :class:`~bayesfuse.inference.spec.Axis` blocks),
  ``transpose`` and reductions over other axes pass the permutation through;
* the network's input and its output (the classes) are never permuted: a stream added to the
  input, or reaching the output, is left as it is.

Anything else that touches a permuted axis is refused with one line naming the node, the
operation and what to do (:class:`~bayesfuse.nets.tracing.UnsupportedLayerError`). In
particular ``nn.MultiheadAttention`` is refused: its heads' widths are ``embed_dim /
num_heads``, tied to the stream, so a stream fused to another width cannot be rebuilt into one;
:func:`bayesfuse.nets.attention.split_heads` rewrites it, same function, as one module per head
(:func:`bayesfuse.fuse` and ``bayesfuse fuse --model`` do so themselves before tracing).
"""

from __future__ import annotations

import contextlib
import io
import math
import operator
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, NoReturn, TypeGuard, cast

import numpy as np
import torch
from torch import fx, nn

from bayesfuse._layers import torch_layer
from bayesfuse.inference.spec import Axis, PermutationSpec
from bayesfuse.nets.decisions import Decider, NumberProxy, decided, size_read
from bayesfuse.nets.state import RMS_NORMS, floating_like, forward_arguments, forward_error, tied_entries

__all__ = ["spec_from_graph", "example_input_for", "UnsupportedLayerError"]


class UnsupportedLayerError(TypeError):
    """A module whose permutation symmetry bayesfuse does not know."""


_FIXED = 0  # the union-find class of axes no permutation moves (the input, the classes)
_BUFFER_ALONG_UNITS = "buffer {!r} holds a number per unit (a rotary table, a mask), made for that width"

#: Leaf modules that act within each unit of the axis they are given.
_ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.GELU,
    nn.ELU,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Hardtanh,
    nn.ReLU6,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softsign,
    nn.SELU,
    nn.CELU,
    nn.LogSigmoid,
    nn.Tanhshrink,
    nn.Softshrink,
    nn.Hardshrink,
    nn.Threshold,
    nn.AlphaDropout,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.Identity,
)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED_CONVS = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_POOL_MODULES = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool3d,
)
#: Element-wise functions whose other arguments must be numbers (``clamp(h, 0, 6)``, ``h ** 2``):
#: with a tensor among them (``clamp(h, min=self.floor)``) each unit would meet another's number.
_SCALAR_ELEMENTWISE = {
    torch.clamp, torch.clip, torch.pow, operator.pow, torch.sqrt, torch.rsqrt, torch.log, torch.log1p, torch.expm1,
    torch.sin, torch.cos, torch.erf, torch.reciprocal, torch.nn.functional.hardshrink,
    torch.nn.functional.softshrink, torch.nn.functional.tanhshrink, torch.nn.functional.threshold,
}  # fmt: skip
_SCALAR_ELEMENTWISE_METHODS = {
    "clamp", "clip", "clamp_", "pow", "sqrt", "rsqrt", "log", "log1p", "expm1", "sin", "cos", "erf", "reciprocal",
    "square",
}  # fmt: skip
#: Modules that act on the spatial axes of (N, C, ...) maps, the channels left as they are.
_SPATIAL_MODULES = (
    nn.Upsample,
    nn.modules.padding._ConstantPadNd,
    nn.modules.padding._ReflectionPadNd,
    nn.modules.padding._ReplicationPadNd,
)
_ELEMENTWISE_FUNCTIONS = {
    torch.relu,
    torch.sigmoid,
    torch.tanh,
    torch.exp,
    torch.abs,
    torch.nn.functional.relu,
    torch.nn.functional.gelu,
    torch.nn.functional.silu,
    torch.nn.functional.elu,
    torch.nn.functional.leaky_relu,
    torch.nn.functional.dropout,
    torch.nn.functional.softplus,
    torch.nn.functional.mish,
    torch.nn.functional.hardtanh,
    torch.nn.functional.relu6,
    torch.nn.functional.hardswish,
    torch.nn.functional.hardsigmoid,
    torch.nn.functional.softsign,
    torch.nn.functional.selu,
    torch.nn.functional.celu,
    torch.nn.functional.logsigmoid,
    torch.nn.functional.dropout1d,
    torch.nn.functional.dropout2d,
    torch.square,
    operator.neg,
    torch.neg,
    torch.clone,
    torch.nn.functional.sigmoid,
    torch.nn.functional.tanh,
}
_ELEMENTWISE_METHODS = {
    "relu",
    "sigmoid",
    "tanh",
    "exp",
    "abs",
    "neg",
    "clone",
    "contiguous",
    "float",
    "double",
    "to",
    "detach",
    "type_as",
    "relu_",
    "sigmoid_",
    "tanh_",
}
#: Convolutions as functions: ``F.conv2d(x, filt, groups=C)`` with one filter for every channel
#: (a blur before a strided step, timm's ``BlurPool2d``) acts on each channel alike.
_CONV_FUNCTIONS = {torch.nn.functional.conv1d, torch.nn.functional.conv2d, torch.nn.functional.conv3d}
_POOL_FUNCTIONS = {
    torch.nn.functional.max_pool1d,
    torch.nn.functional.max_pool2d,
    torch.nn.functional.avg_pool1d,
    torch.nn.functional.avg_pool2d,
    torch.nn.functional.adaptive_avg_pool1d,
    torch.nn.functional.adaptive_avg_pool2d,
    torch.nn.functional.adaptive_max_pool1d,
    torch.nn.functional.adaptive_max_pool2d,
    torch.nn.functional.max_pool3d,
    torch.nn.functional.avg_pool3d,
    torch.nn.functional.adaptive_avg_pool3d,
    torch.nn.functional.adaptive_max_pool3d,
}
_BINARY = {
    operator.add,
    operator.iadd,
    operator.sub,
    operator.isub,
    operator.mul,
    operator.imul,
    torch.add,
    torch.sub,
    torch.mul,
    operator.truediv,
    torch.div,
    torch.maximum,
    torch.minimum,
    # comparisons: a mask with the operands' units, element by element
    operator.gt, operator.ge, operator.lt, operator.le, operator.eq, operator.ne,
    torch.gt, torch.ge, torch.lt, torch.le, torch.eq, torch.ne,
}  # fmt: skip
_BINARY_METHODS = {
    "add", "sub", "mul", "div", "add_", "mul_", "maximum", "minimum", "gt", "ge", "lt", "le", "eq", "ne",
}  # fmt: skip
#: Element-wise selections among their tensor operands by a mask (``where(mask, h, 0)``,
#: ``h.masked_fill(mask, 0)``): the mask's, the operands' and the result's units are one.
_SELECT = {torch.where}
_SELECT_METHODS = {"masked_fill", "masked_fill_", "where"}
_RESHAPE_FUNCTIONS = {torch.flatten, torch.reshape}
_RESHAPE_METHODS = {"flatten", "view", "reshape"}
#: Symmetric functions of the numbers along the axes ``dim`` names (the second argument): the same
#: whatever the order of those numbers, so a reduction over the units forgets them.
_REDUCTIONS = {torch.mean, torch.sum, torch.amax, torch.amin, torch.logsumexp, torch.std, torch.var}
_REDUCTION_METHODS = {"mean", "sum", "amax", "amin", "logsumexp", "std", "var"}
#: Norms, reductions too, whose ``dim`` is their third argument (after the order of the norm).
_NORMS = {torch.linalg.vector_norm, torch.linalg.norm, torch.norm}
_NORM_METHODS = {"norm"}
#: Functions and methods that cut one axis into pieces: ``(name of the count or sizes, of the
#: dim, default dim)``, by keyword (the tensor first, by place).
_PIECES = {
    torch.chunk: ("chunks", "dim", 0), torch.split: ("split_size_or_sections", "dim", 0),
    torch.tensor_split: ("indices_or_sections", "dim", 0), torch.nn.functional.glu: (None, "dim", -1),
    torch.unbind: (None, "dim", 0),
}  # fmt: skip
_PIECES_METHODS = {
    "chunk": ("chunks", "dim", 0), "split": ("split_size", "dim", 0), "tensor_split": ("indices_or_sections", "dim", 0),
    "unbind": (None, "dim", 0),
}  # fmt: skip
#: The largest (smallest) number along ``dim`` and where it lies, ``(values, indices)``; over every
#: number without a ``dim``; of two tensors, element by element.
_EXTREMA = {torch.max, torch.min, torch.median, torch.nanmedian}
_EXTREMA_METHODS = {"max", "min", "median", "nanmedian"}
#: Order statistics along ``dim``, ``(values, indices)``: name -> (place of ``dim``, its default,
#: whether the axis stays: ``topk`` and ``sort`` keep it, ``kthvalue`` and ``mode`` reduce it).
_ORDERED = {"topk": (2, -1, True), "sort": (1, -1, True), "kthvalue": (2, -1, False), "mode": (1, -1, False)}
_ORDERED_FUNCTIONS = {torch.topk: "topk", torch.sort: "sort", torch.kthvalue: "kthvalue", torch.mode: "mode"}
_ARG_EXTREMA = {torch.argmax, torch.argmin}
_ARG_EXTREMA_METHODS = {"argmax", "argmin"}
_MATMUL = {operator.matmul, torch.matmul, torch.bmm}
#: Functions that only mask or select by a tensor: a parameter given to one is not applied as a weight.
_MASKING = {"masked_fill", "masked_fill_", "where"}
#: Functional norms as a module of one's own calls them (ConvNeXt's ``LayerNorm2d``: the channels
#: moved last, ``F.layer_norm``, moved back), over the last axis or a group norm's channels:
#: their arguments by name.
_FUNCTIONAL_NORMS: dict = {torch.nn.functional.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps")}
if hasattr(torch.nn.functional, "rms_norm"):  # torch >= 2.4
    _FUNCTIONAL_NORMS[torch.nn.functional.rms_norm] = ("input", "normalized_shape", "weight", "eps")
_FUNCTIONAL_NORMS[torch.nn.functional.group_norm] = ("input", "num_groups", "weight", "bias", "eps")
_FUNCTIONAL_NORMS[torch.nn.functional.batch_norm] = (
    "input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"
)  # fmt: skip
#: Functions of other libraries that fx keeps whole (``torch.fx.wrap``) and that leave every unit
#: where it is, by qualified name: torchvision's stochastic depth (EfficientNet, ConvNeXt) drops
#: whole examples, or none in eval mode.
#: Methods that make a tensor of the given shape, reading only the dtype and device of theirs.
_NEW_TENSOR_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
#: Functions that read only their first operand's shape, dtype and device.
_LIKE_FUNCTIONS = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like}
#: Tensors shaped like their operand, of numbers alike on every unit: they keep its units (any order is theirs).
_SHAPED_LIKE = _LIKE_FUNCTIONS | {torch.rand_like, torch.randn_like}
_KEEPING_UNITS = {"torchvision.ops.stochastic_depth.stochastic_depth"}
#: Views and copies of a tensor that leave its values where they are: a parameter seen through them
#: (``self.weight.T``, ``self.weight.t()``) is still that parameter (:meth:`_Walk.weight_of`).
_VIEW_ATTRIBUTES = {"T", "mT", "H", "mH"}
_VIEW_METHODS = {
    "t", "transpose", "permute", "contiguous", "view", "reshape", "flatten", "squeeze", "unsqueeze", "to",
    "float", "double", "half", "bfloat16", "type_as", "clone", "detach",
}  # fmt: skip
_VIEW_FUNCTIONS = {
    torch.t,
    torch.transpose,
    torch.permute,
    torch.reshape,
    torch.flatten,
    torch.squeeze,
    torch.unsqueeze,
}
_MATMUL_METHODS = {"matmul", "bmm"}
_MOVE_METHODS = {"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "unsqueeze", "squeeze"}
_MOVES = {
    torch.transpose,
    torch.swapaxes,
    torch.swapdims,
    torch.permute,
    torch.movedim,
    torch.moveaxis,
    torch.unsqueeze,
    torch.squeeze,
}
#: Normalisations along one axis: equivariant to any permutation of that axis, and of the others.
_SOFTMAX = {
    torch.softmax,
    torch.nn.functional.softmax,
    torch.log_softmax,
    torch.nn.functional.log_softmax,
    torch.nn.functional.normalize,  # x / max(||x||_p, eps) along dim: the norm forgets the order
}
_SOFTMAX_METHODS = {"softmax", "log_softmax"}


@dataclass(frozen=True)
class _Feature:
    """The permuted axis of an activation: dimension ``dim`` holds ``outer x n x inner`` numbers,
    unit ``i`` of union-find class ``var`` in the middle."""

    var: int
    dim: int
    outer: int = 1
    inner: int = 1


@dataclass(frozen=True)
class _Recurrent:
    """What an ``nn.LSTM`` / ``nn.GRU`` returns, ``(output, state)``: the output sequence's units
    (the top layer's), and its final state's (``(h, c)`` for an LSTM, ``h`` for a GRU)."""

    output: _Feature
    state: object  # _Feature or _Unreadable, or _Parts of them (an LSTM's (h, c))


@dataclass(frozen=True)
class _Parts:
    """A tuple of activations' labels (an LSTM's final ``(h, c)``), read by indexing."""

    parts: tuple


@dataclass(frozen=True)
class _Segments:
    """Streams side by side on axis ``dim`` that no one permutation describes (``torch.cat`` of
    streams of different widths, or of a stream and the input): ``parts`` in order, each
    ``(feature, length)``, the feature a stream's permuted units or None for numbers no
    permutation moves, ``length`` its numbers on the axis as traced."""

    dim: int
    parts: tuple


@dataclass(frozen=True)
class _Cat:
    """An entry's axis that holds ``parts`` side by side, ``(var, outer, inner, length)`` each
    (``var`` None: numbers no permutation moves): the spec describes the entry by its pieces."""

    parts: tuple


#: What may read streams side by side (:class:`_Segments`), which the spec describes by pieces.
_SEGMENTS_READERS = (
    "layers (Linear, Conv without groups), BatchNorm, LayerNorm, GroupNorm, InstanceNorm, element-wise "
    "functions, pooling, flatten, and concatenation"
)
#: The modules among them (a convolution with groups aside).
_SEGMENTS_MODULES = (
    _CONVS
    + _TRANSPOSED_CONVS
    + (
        nn.Linear,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.LayerNorm,
        *RMS_NORMS,
        nn.GroupNorm,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.PReLU,
        nn.Flatten,
        nn.Softmax,
        nn.LogSoftmax,
        nn.Softmin,
    )
    + _ELEMENTWISE_MODULES
    + _POOL_MODULES
    + _SPATIAL_MODULES
)


@dataclass(frozen=True)
class _Unreadable:
    """An activation whose units no one permutation describes: refused where it is read."""

    why: str


class _Classes:
    """Union-find over permutation variables; class ``_FIXED`` is 'not permuted'.

    ``ties`` is a second union-find over the same variables that records every tie but those to
    ``_FIXED`` itself, and re-descriptions (:meth:`tie`): the classes as they would be had no
    class been held, which names the entries a class held in place reaches (:attr:`_Walk.pins`)."""

    def __init__(self) -> None:
        self.parent = [_FIXED]
        self.ties = [_FIXED]

    def new(self) -> int:
        self.parent.append(len(self.parent))
        self.ties.append(len(self.ties))
        return len(self.parent) - 1

    def tie(self, a: int, b: int) -> None:
        """Record in :attr:`ties` alone that ``a`` and ``b`` hold the same units."""
        a, b = self.tied_root(a), self.tied_root(b)
        if a != b:
            self.ties[max(a, b)] = min(a, b)

    def tied_root(self, v: int) -> int:
        while self.ties[v] != v:
            v = self.ties[v]
        return v

    def find(self, v: int) -> int:
        while self.parent[v] != v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def union(self, a: int, b: int) -> None:
        if _FIXED not in (a, b):
            self.tie(a, b)
        a, b = self.find(a), self.find(b)
        if a != b:  # the smaller root wins, so _FIXED stays its class's root
            self.parent[max(a, b)] = min(a, b)


class _Tracer(fx.Tracer):
    """fx's tracer, with every module of ``torch.nn`` (``nn.Sequential`` and ``nn.ModuleList`` aside) a leaf.

    Buffers are traced as nodes, as parameters are, so that a forward may index one by a size it
    reads off its input (nanoGPT's causal mask ``self.bias[:, :, :T, :T]``); ``buffers_as_nodes=
    False`` traces them as constants, for a forward that uses a buffer's value in Python.

    Given the forward's ``example`` arguments, a condition or ``int()`` on a number computed from
    sizes alone is taken at its example value (:mod:`bayesfuse.nets.decisions`), and
    ``decisions`` lists those values in order; a retrace given them as ``replay`` takes the same
    branches."""

    def __init__(
        self,
        *,
        buffers_as_nodes: bool = True,
        example: tuple | None = None,
        replay: list | None = None,
        through: bool = False,
    ) -> None:
        super().__init__()
        self.proxy_buffer_attributes = buffers_as_nodes
        self.example, self.replay, self.through = example, replay, through
        self.decisions: list = []
        self.defaults: dict = {}  # the forward's arguments the example leaves at their defaults

    def again(self) -> _Tracer:
        """A tracer that traces as this one did, down the branches it took."""
        again = _Tracer(buffers_as_nodes=self.proxy_buffer_attributes, replay=self.decisions, through=self.through)
        again.defaults = self.defaults
        return again

    def trace(self, root, concrete_args=None):  # type: ignore[override]
        self.decider = Decider(root, self.example, self.replay)
        self.decisions = self.decider.made
        if self.example is not None:
            self.defaults = _left_at_defaults(root, len(self.example))
        with _library_functions_traced() if self.through else contextlib.nullcontext():
            return super().trace(root, concrete_args if concrete_args is not None else self.defaults or None)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return NumberProxy(node, self)

    def to_bool(self, obj: fx.Proxy) -> bool:
        return bool(self.decide(obj, "a condition"))

    def iter(self, obj: fx.Proxy):
        """Iteration over a traced value fx cannot unpack: a tensor's rows (as many as its first
        size, decided), a tuple of tensors' pieces (``f(*h.topk(3))``), or a tuple of sizes (``for d
        in x.shape[2:]``), decided whole."""
        if self.example is None and self.replay is None:
            return super().iter(obj)
        if self.decider.is_tensor(obj.node):
            rows = int(self.decide(obj.size(0), "the rows iterated over"))
            return (obj[i] for i in range(rows))  # type: ignore[index]
        count = self.decider.tensors_in(obj.node)
        if count is not None:
            return (obj[i] for i in range(count))  # type: ignore[index]
        return iter(self.decide(obj, "an iteration"))

    def attribute(self, obj: fx.Proxy, name: str):
        """A tensor's ``dtype`` or ``device`` at the example (``torch.finfo(x.dtype)``): no width."""
        return self.decider.attribute(obj.node, name)

    def decide(self, obj: fx.Proxy, what: str):
        """The example value of the traced number ``obj``, kept in the graph as a :func:`decided` node."""
        value = self.decider.value(obj.node, what)
        self.create_node("call_function", decided, (obj.node,), {})
        return value

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            return False
        # torch's own layers, and one renamed (the control flow inside torch's forward is not the user's)
        return torch_layer(m) or type(m).__name__ == "PositionAware"


def _left_at_defaults(model: nn.Module, given: int) -> dict:
    """The arguments of ``model.forward`` after the ``given`` first that have defaults, at them:
    traced as those values (nanoGPT's ``targets=None``, whose ``if targets is not None:`` a traced
    argument would always take), as the fused network is called."""
    import inspect

    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {  # plain values only: fx unpacks a tuple or list given so into placeholders of its own
        p.name: p.default
        for p in [p for p in parameters if p.kind in positional][given:]
        if p.default is None or type(p.default) in (bool, int, float, str)
    }


@contextlib.contextmanager
def _library_functions_traced():
    """While tracing, the functions a model library wrapped with ``torch.fx.wrap`` (torchvision's
    ``shifted_window_attention``, wrapped for its control flow on sizes, which the tracer now
    decides) are traced through, not recorded as calls; torch's own, and those the walk reads
    whole, stay wrapped."""
    from torch.fx import _symbolic_trace

    table = getattr(_symbolic_trace, "_wrapped_fns_to_patch", None)
    if not isinstance(table, dict):
        yield
        return
    through = {
        key: frame
        for key, frame in table.items()
        if not str(frame.get("__name__", "torch")).split(".")[0] == "torch"
        and f"{frame.get('__name__')}.{key[1]}" not in _KEEPING_UNITS
    }
    for key in through:
        del table[key]
    try:
        yield
    finally:
        table.update(through)


class _HeldWidth(int):
    """An ``int`` attribute of a module while its forward is traced, that knows its path
    (``"attention.head_dim"``): fx keeps the object in the nodes it is an argument of, so a
    reshape can tell a width the module holds from a number written in the code. Where the
    forward computes with it in Python instead (``math.sqrt(self.head_dim)``, ``self.dim // 2``,
    ``if self.dim > 64:``, ``range(self.dim)``), the trace holds only the result, a number that
    a rebuild at another width would not change: it is marked :attr:`computed`."""

    path: str
    computed: bool
    original: int  # the attribute's own value (a retrace stands in another: _retraced_differs)
    factor: int  # this number is the attribute times factor (self.channels * 7 * 7: 49)
    root: _HeldWidth  # the attribute's own stand-in, which a multiple marks computed with

    def __new__(
        cls, value: int, path: str, original: int | None = None, factor: int = 1, root: _HeldWidth | None = None
    ) -> _HeldWidth:
        out = super().__new__(cls, value)
        out.path, out.computed, out.original = path, False, value if original is None else original
        out.factor, out.root = factor, out if root is None else root
        return out

    def __reduce__(self):  # a copy made while tracing is a plain int
        return int, (int(self),)

    def __mul__(self, k):
        """A multiple by a number written in the code (``self.channels * 7 * 7``, a flattened
        width) is still this width, ``factor`` times; anything else computes with it."""
        if type(k) is not int or k < 1:
            self.root.computed = True
            if isinstance(k, _HeldWidth):  # self.h * self.w: both computed with
                k.root.computed = True
            return int.__mul__(self, k) if isinstance(k, int) else int.__int__(self) * k
        # int's own methods: int(self) would count as computing with it
        return _HeldWidth(int.__mul__(self, k), self.path, self.original * k, self.factor * k, self.root)

    __rmul__ = __mul__
    __hash__ = int.__hash__


def _computing(name: str):
    """``int``'s method ``name``, marking the :class:`_HeldWidth` it is called on as computed with."""
    method = getattr(int, name)

    def computed(self, *args):
        self.root.computed = True
        return method(self, *args)

    computed.__name__ = name
    return computed


for _op in (
    "add sub truediv floordiv mod pow divmod lshift rshift and or xor "
    "radd rsub rtruediv rfloordiv rmod rpow rdivmod rlshift rrshift rand ror rxor "
    "neg pos abs invert int float index round trunc floor ceil lt le gt ge eq ne bool"
).split():
    setattr(_HeldWidth, f"__{_op}__", _computing(f"__{_op}__"))


@contextlib.contextmanager
def _widths_held(model: nn.Module, computed: set[str], shifted: frozenset = frozenset()):
    """While tracing, every ``int`` attribute (2 or more, not private) of ``model``'s modules of
    one's own (not torch's) is a :class:`_HeldWidth` (one larger for the paths ``shifted``); each
    is given back as it was, and the paths of those the forward computed with are added to
    ``computed``."""
    made: list[_HeldWidth] = []
    try:
        for name, m in model.named_modules():
            if type(m).__module__.split(".")[0] == "torch":
                continue
            values = vars(m)  # written in place: a __setattr__ of one's own is not run (nor given a chance to refuse)
            for attr, value in list(values.items()):
                if type(value) is int and value >= 2 and not attr.startswith("_"):
                    path = f"{name}.{attr}" if name else attr
                    values[attr] = _HeldWidth(value + (path in shifted), path, value)
                    made.append(values[attr])
        yield
        computed.update(w.path for w in made if w.computed)
    finally:  # every one given back as it was, copies the forward kept (self.cols = self.width) too
        for m in model.modules():
            values = vars(m)
            for attr, value in list(values.items()):
                if isinstance(value, _HeldWidth):
                    values[attr] = value.original


def _checked_widths(model: nn.Module, gm: fx.GraphModule, spec: PermutationSpec, tracer: _Tracer) -> PermutationSpec:
    """``spec`` with the widths its forward computes with otherwise than as their width fixed:
    where the model traced again with them one larger gives a graph that differs anywhere but
    in those numbers (``np.sqrt(self.head_dim)``, ``torch.full((), self.dim)``, a loop over it:
    reads no int operation sees), each is tried alone and those that change it are fixed."""
    from dataclasses import replace

    def differs(paths) -> bool:
        return _retraced_differs(model, gm, frozenset(paths), tracer)

    if not differs(spec.widths):
        return spec
    changed = [p for p in spec.widths if differs([p])] or list(spec.widths)
    fixed = dict(spec.fixed)
    for path in changed:
        fixed.setdefault(
            spec.widths[path].group,
            f"its forward reads {path} as their width and also computes with it (the graph changes with it "
            "elsewhere), which a rebuild at another width would change",
        )
    return replace(spec, fixed=fixed, widths={p: a for p, a in spec.widths.items() if a.group not in fixed})


@contextlib.contextmanager
def _as_traced(model: nn.Module):
    """``model`` in eval mode, the function that is fused (a forward's ``self.training``, as timm's
    ``F.batch_norm`` reads it), and afterwards as it was: every module's mode given back
    (:func:`_restore_modes`), and the attributes tracing left on it taken away (the constants fx
    keeps for a forward that makes one, ``torch.tensor(0.5)``; what a forward sets while traced)."""
    modes = {m: m.training for m in model.modules()}
    own = set(vars(model))
    model.eval()
    try:
        yield
    finally:
        _restore_modes(model, modes)
        for name in set(vars(model)) - own:
            delattr(model, name)


def _retraced_differs(model: nn.Module, gm: fx.GraphModule, shifted: frozenset, tracer: _Tracer) -> bool:
    """Whether ``model`` traced with the held widths ``shifted`` one larger gives another graph
    than ``gm``'s (the numbers shifted aside; its constants are ``gm``'s), traced as ``tracer``
    traced it, down the branches it took."""
    with _as_traced(model):
        try:
            with _widths_held(model, set(), shifted):
                other = tracer.again().trace(model)
        except Exception:  # a forward that cannot run with the other number: it reads it otherwise
            return True
        nodes, others = list(gm.graph.nodes), list(other.nodes)
        if len(nodes) != len(others):
            return True
        stored = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        for a, b in zip(nodes, others):
            if (a.op, a.name) != (b.op, b.name):
                return True
            if a.op == "get_attr" and a.target not in stored:  # the retrace's constants: on the model, until taken
                if not _same(getattr(gm, a.target, None), getattr(model, b.target, None)):
                    return True  # a constant the forward made (torch.full((), self.dim))
            elif not (a.target == b.target and _same(a.args, b.args) and _same(a.kwargs, b.kwargs)):
                return True
        return False


def _same(a, b) -> bool:
    """Whether two node arguments are the same, a held width standing for itself at any value."""
    if isinstance(a, _HeldWidth):
        return isinstance(b, _HeldWidth) and (a.path, a.factor) == (b.path, b.factor)
    if isinstance(a, fx.Node):
        return isinstance(b, fx.Node) and a.name == b.name
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, slice):
        return isinstance(b, slice) and _same((a.start, a.stop, a.step), (b.start, b.stop, b.step))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def _restore_modes(model: nn.Module, modes: dict) -> None:
    """Every module of ``model`` back in its mode of ``modes``: ``model.train(mode)`` first (a
    ``train`` of one's own runs again, undoing what ``eval()`` did), then each module's own flag."""
    model.train(modes[model])
    for m, training in modes.items():
        m.training = training


def _warn_unread(model: nn.Module, gm: fx.GraphModule) -> None:
    """Warn of parameters the eval-mode forward never reads (a branch run only in training, as an
    auxiliary classifier): no unit of theirs is followed, so fusion leaves them unaligned."""
    read: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            read.add(str(node.target))
        elif node.op == "call_module":
            read.update(f"{node.target}.{k}" for k, _ in gm.get_submodule(str(node.target)).named_parameters())
    unread = [k for k, _ in model.named_parameters() if k not in read]
    if unread:
        listed = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        warnings.warn(
            f"{type(model).__name__}: {listed} are not read by its forward in eval mode (a layer it does not use, "
            "a branch that does not run, or an auxiliary classifier read only in training): their units are not "
            "followed, so fusion leaves them unaligned; remove them before fusing, or give a spec",
            UserWarning,
            stacklevel=3,
        )


def example_input_for(model: nn.Module, example_input=None) -> torch.Tensor:
    """``example_input``, the module's own ``example_input`` (a tensor or a method returning one),
    or zeros for a network whose first layer is ``nn.Linear`` (or an ``nn.Sequential`` that starts
    with ``nn.Unflatten``, or the LSTM classifier); else a ``ValueError`` saying what to give.

    A floating-point input comes in the dtype and on the device of the module's parameters (a
    float64 network gets a float64 input); integer inputs (token ids) stay as they are."""
    x = _example_input(model, example_input)
    like = floating_like(model)

    def cast(t):
        t = torch.as_tensor(t) if isinstance(t, np.ndarray) else t
        if like is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(dtype=like.dtype, device=like.device)
        return t

    return type(x)(cast(t) for t in x) if isinstance(x, (tuple, list)) else cast(x)  # a forward of several inputs


def _example_input(model: nn.Module, example_input=None) -> torch.Tensor:
    if example_input is not None:
        return example_input
    own = getattr(model, "example_input", None)
    if own is not None:
        return own() if callable(own) else own
    steps, features = getattr(model, "steps", None), getattr(model, "step_features", None)
    if isinstance(steps, int) and isinstance(features, int):  # LSTMClassifier: flat images read row by row
        return torch.zeros(2, steps * features)
    first = next(
        (
            m
            for m in model.modules()
            # the first layer that reads an input: only a Linear tells its shape (a recurrent
            # layer's does not tell the steps, a convolution's not the size of its maps)
            if isinstance(
                m, (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding, nn.EmbeddingBag, nn.Unflatten, nn.RNNBase)
            )
        ),
        None,
    )
    if isinstance(first, nn.Linear):
        return torch.zeros(2, first.in_features)
    if isinstance(first, nn.Unflatten) and isinstance(model, nn.Sequential) and model[0] is first:
        return torch.zeros(2, int(np.prod(first.unflattened_size)))
    raise ValueError(
        f"{type(model).__name__}: give an example input (example_input=..., or an example_input "
        "attribute on the module) to trace a network whose first layer is not nn.Linear"
    )


def untraceable(err: Exception, model: nn.Module, example_input=None) -> bool:
    """Whether ``err``, raised while tracing ``model``, says its units cannot be followed (or that
    no input can be made for it without one given), rather than a user's mistake such as a given
    example input that does not run: FedAvg then averages the network entry by entry."""
    return isinstance(err, UnsupportedLayerError) or (
        example_input is None
        and getattr(model, "example_input", None) is None
        and isinstance(err, ValueError)
        and "give an example input" in str(err)
    )


def spec_from_graph(model: nn.Module, example_input=None) -> PermutationSpec:
    """The permutation spec of ``model``, traced from its ``forward`` with ``torch.fx``.

    Parameters
    ----------
    model : nn.Module
        Any module fx can trace (no control flow that depends on tensor values).
    example_input : Tensor, optional
        One batch of inputs (a few rows suffice); see :func:`example_input_for`.

    Returns
    -------
    PermutationSpec
        Groups ``P1, P2, ...`` in forward order, one per hidden layer or residual stream; the
        output layer's entries in ``output``; batch norms that directly follow a Linear/Conv in
        ``folds``.

    Raises
    ------
    UnsupportedLayerError
        One line naming the node and operation that cannot be followed.
    """
    from torch.nn.utils import parametrize

    computed = next((n for n, m in model.named_modules() if parametrize.is_parametrized(m)), None)
    if computed is not None:  # the stored tensors are the parametrization's, not the parameter the units move
        owner = model.get_submodule(computed)
        what = next(iter(cast(nn.ModuleDict, owner.parametrizations)))
        raise UnsupportedLayerError(
            f"{type(model).__name__}: {computed + '.' if computed else ''}{what} is computed from other tensors "
            "(weight_norm, spectral_norm or another parametrization), which the state_dict holds instead and a "
            "permutation of the units does not move as it moves a parameter; remove it before fusing "
            "(torch.nn.utils.parametrize.remove_parametrizations), or give a spec"
        )
    if type(model).__module__.startswith("torch.nn") and not isinstance(model, nn.Sequential):
        raise UnsupportedLayerError(
            f"cannot derive a permutation spec for a bare {type(model).__name__}: wrap it in a module whose forward "
            "bayesfuse can trace, give the module a permutation_spec() method, or build a spec with "
            "bayesfuse.inference.spec.chain(dense(...), conv(...), ...)"
        )
    x = example_input_for(model, example_input)
    computes_with: set[str] = set()  # the paths of int attributes the forward computes with (_HeldWidth)
    arguments = forward_arguments(model, x)
    with _as_traced(model):
        graph, tracer = _traced(model, arguments, computes_with)
        gm = fx.GraphModule(model, graph)  # holds the constants fx left on the model, which _as_traced takes back
        from torch.fx.passes.shape_prop import ShapeProp

        gm.eval()
        try:
            with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):  # ShapeProp prints tracebacks itself
                ShapeProp(gm).propagate(*arguments)  # a forward of several inputs, or of one tuple
        except Exception as err:  # the user's forward failing on the example input
            raise _not_running(model, x, err, guessed=example_input is None) from None
    uses = Counter(w.path for node in graph.nodes for w in _held_in((node.args, node.kwargs)))
    spec = _Walk(model, computed=computes_with, uses=uses).run(gm)
    if spec.widths:
        spec = _checked_widths(model, gm, spec, tracer)
    try:  # every axis the walk described holds whole units of its group, at the network's own widths
        spec.sizes({k: v.detach() for k, v in model.state_dict().items()})
    except ValueError as err:
        raise UnsupportedLayerError(
            f"{type(model).__name__}: its units cannot be followed through the whole network ({err}); give a spec"
        ) from None
    _warn_unread(model, gm)
    return spec


def _traced(model: nn.Module, arguments: tuple, computes_with: set[str]) -> tuple[fx.Graph, _Tracer]:
    """``model``'s graph and the tracer that made it, by the first way that traces: buffers as
    nodes, else as constants (a forward that uses a buffer's value in Python: ``if self.flag:``,
    ``range(int(self.n))``); each through the functions a library wrapped with ``torch.fx.wrap``,
    else with them as calls (one with control flow on values)."""
    first: Exception | None = None
    for buffers_as_nodes, through in ((True, True), (True, False), (False, True), (False, False)):
        tracer = _Tracer(buffers_as_nodes=buffers_as_nodes, example=arguments, through=through)
        try:
            with _widths_held(model, computes_with):
                return tracer.trace(model), tracer
        except Exception as err:  # fx raises many types (TraceError, TypeError, ...) for untraceable code
            first = first or err
            computes_with.clear()  # a failed trace's reads do not count
    assert first is not None
    raise UnsupportedLayerError(
        f"cannot trace {type(model).__name__} with torch.fx ({str(first).splitlines()[0]}); write forward "
        "without control flow on tensor values, or give a spec (bayesfuse.inference.spec.chain(...))"
    ) from None


def check_example_runs(model: nn.Module, example_input=None) -> torch.Tensor:
    """Run ``model`` once (eval mode, no gradients) on its example input
    (:func:`example_input_for`), refusing with the tracer's one line if it fails there; the input.

    A copy of ``model`` at other widths that fails on the returned input fails by its widths, not
    by a wrong guess of the input's shape."""
    x = example_input_for(model, example_input)
    err = forward_error(model, x)
    if err is not None:  # the user's forward failing on the example input
        raise _not_running(model, x, err, guessed=example_input is None)
    return x


def _not_running(model: nn.Module, x: torch.Tensor, err: Exception, *, guessed: bool = False) -> ValueError:
    cause = err.__cause__ or err
    guess = guessed and getattr(model, "example_input", None) is None
    what = f"of shape {tuple(x.shape)}" if hasattr(x, "shape") else f"of type {type(x).__name__}"
    return ValueError(
        f"{type(model).__name__}: the example input {what} does not run through "
        f"the network ({type(cause).__name__}: {str(cause).splitlines()[0]})"
        + (
            "; it was made from the width of the first nn.Linear, which may read steps or tokens: give an "
            "example input (example_input=...: a batch of your data)"
            if guess
            else ""
        )
    )


def _qualified(fn) -> str:
    """``module.name`` of a function (``torchvision.ops.stochastic_depth.stochastic_depth``)."""
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}"


def _shape(node) -> tuple | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _name(target) -> str:
    """A node's function or method by its name (``argmax``, not ``<built-in method argmax ...>``)."""
    return str(getattr(target, "__name__", target))


def _moved(label: _Segments, dim: int, scale: int = 1) -> _Segments:
    """Streams side by side, their axis now ``dim``, each unit's numbers ``scale`` times as many
    (the axes after it flattened into it)."""
    return _Segments(
        dim,
        tuple(
            (None if g is None else _Feature(g.var, dim, g.outer, g.inner * scale), n * scale) for g, n in label.parts
        ),
    )


def _spatial_rank(m: nn.Module) -> int | None:
    """How many trailing axes a padding module pads (None: every axis after the channels, as
    upsampling scales)."""
    return len(cast(tuple, m.padding)) // 2 if hasattr(m, "padding") else None


def _pool_rank(name: str) -> int:
    """How many trailing axes a pooling of this name pools (``max_pool1d``: 1, ``AvgPool2d``: 2)."""
    return next((k for k in (1, 2, 3) if name.lower().endswith(f"{k}d")), 2)


def _adds_nothing(t, dim: int) -> bool:
    """Whether ``torch.cat`` leaves operand ``t`` out: no numbers along ``dim``, or the empty
    1-D tensor torch skips whatever the others' rank (a key/value cache before its first step,
    ``torch.cat([torch.tensor([]), k], -2)``)."""
    shape = _shape(t)
    return shape is not None and (shape == (0,) or (dim < len(shape) and shape[dim] == 0))


def _tensor_shape(node) -> tuple:
    """The shape of a node whose value is one tensor: ShapeProp records one for each."""
    return cast(tuple, _shape(node))


def _axes_order(name: str, args: list, kwargs: dict, rank: int) -> list[int]:
    """Where each axis of the result of ``transpose`` / ``swapaxes`` / ``swapdims`` (two axes),
    ``permute`` (every axis) or ``movedim`` / ``moveaxis`` (axes to places) comes from."""
    if name in ("transpose", "swapaxes", "swapdims"):
        keys = ("axis0", "axis1") if "axis0" in kwargs or "axis1" in kwargs else ("dim0", "dim1")
        pair = [*args[:2], *(kwargs[k] for k in keys[len(args[:2]) :])]
        d0, d1 = (int(d) % rank for d in pair)
        order = list(range(rank))
        order[d0], order[d1] = d1, d0
        return order
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args or kwargs["dims"]
        return [int(d) % rank for d in dims]
    source = args[0] if args else kwargs["source"]
    destination = args[1] if len(args) > 1 else kwargs["destination"]
    source, destination = ([s] if isinstance(s, int) else list(s) for s in (source, destination))
    placed = dict(zip((int(d) % rank for d in destination), (int(s) % rank for s in source)))
    rest = iter(d for d in range(rank) if d not in placed.values())
    return [placed[d] if d in placed else next(rest) for d in range(rank)]


def _einsum_subscripts(equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Each operand's letters, one per axis, and the result's, of an einsum ``equation`` on
    operands of ``ranks``; the axes an ellipsis stands for get names of their own (``"...0"``,
    counted from the right, so that broadcast axes share one), and an equation without ``->``
    keeps, in alphabetical order, the letters that occur once (torch's rule)."""
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise ValueError(f"{len(terms)} operands written, {len(ranks)} given")

    def letters(term: str, rank: int | None) -> list[str]:
        head, dots, tail = term.partition("...")
        if not all(c.isalpha() for c in head + tail):
            raise ValueError(f"cannot read {term!r}")
        if not dots:
            return list(head)
        extra = (rank if rank is not None else len(head) + len(tail) + broadcast) - len(head) - len(tail)
        if extra < 0:
            raise ValueError(f"{term!r} names more axes than its operand has")
        return [*head, *(f"...{i}" for i in reversed(range(extra))), *tail]

    broadcast = max((r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t), default=0)
    subscripts = [letters(t, r) for t, r in zip(terms, ranks)]
    if any(len(s) != r for s, r in zip(subscripts, ranks)):
        raise ValueError("an operand has another number of axes than its letters")
    if arrow:
        return subscripts, letters(rhs, None)
    counts = Counter(c for s in subscripts for c in s if not c.startswith("..."))
    dots = [f"...{i}" for i in reversed(range(broadcast))] if "..." in lhs else []
    return subscripts, [*dots, *sorted(c for c, n in counts.items() if n == 1)]


class _Walk:
    """One pass over the graph in forward order, labelling activations with their permuted axis."""

    def __init__(self, model: nn.Module, *, computed: Iterable[str] = (), uses: Counter | None = None) -> None:
        self.model = model
        self.classes = _Classes()
        self.labels: dict = {}  # node -> _Feature (permuted or fixed) | None (no feature axis known)
        self.axes: dict[str, list] = {}  # entry -> per-dimension (var, outer, inner) or None
        self.module_vars: dict[str, tuple] = {}
        self.producer: dict = {}  # node -> name of the Linear/Conv module whose output it is
        self.var_producer: dict[int, str] = {}  # a Linear/Conv module's output variable -> its name
        self.folds: dict[str, str] = {}
        self.normed: set[str] = set()  # batch norms applied so far: one applied twice is folded into neither layer
        self.transposed: list[str] = []  # the weights of transposed convolutions: their units on axis 1
        self.order: list[int] = []
        self.cut: dict[int, tuple[int, int]] = {}  # a class re-described as blocks -> (the new one, blocks)
        self.coarse: set[int] = set()  # classes re-described as runs of units (coarsen)
        self.segmented: set[int] = set()  # classes re-described as runs of new classes (split unequally)
        self.fixed: list[tuple[int, str]] = []  # variables whose width the forward fixes, and why
        self.pins: list[tuple[int, str]] = []  # classes held in place: they met numbers no permutation moves (why)
        # (node, operand): a parameter (or a view or function of it) that node reads as described by the spec
        self.consumed: set[tuple] = set()
        self.bias_pieces: list[tuple] = []  # (node, weight, [(vector, start, length)]): biases put together
        self.hand: set[str] = set()  # 2-D parameters applied by hand as linear layers (hand_layer)
        self.decisions: list = []  # the numbers the trace decided on (decisions.decided), read after the walk
        # numbers modules hold that a reshape reads as an axis of units: (attribute path, var, outer, inner)
        self.held: list[tuple[str, int, int, int, int]] = []  # and the multiple of it read (factor)
        self.computed = set(computed)  # those of them the forward also computes with in Python
        self.uses = uses if uses is not None else Counter()  # how often each is an argument of the graph's nodes
        self.heads: tuple = ()  # the Heads lists' branch prefixes (head_sets), found once per walk
        self.parameters = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.state_keys = set(model.state_dict())
        self.tied = tied_entries(model)  # names of one tensor (a weight tied to another layer's, a module held twice)
        buffers = {n for n, _ in model.named_buffers(remove_duplicate=False)}
        for together in self.tied:
            kinds = {n in buffers for n in together}
            if len(kinds) > 1:
                raise UnsupportedLayerError(
                    f"{type(model).__name__}: {together[0]!r} is a parameter also held as a buffer "
                    f"({', '.join(repr(n) for n in together[1:])}): give a spec, or hold it once"
                )
        self.layer_calls: Counter = (
            Counter()
        )  # how often each Linear/Conv is applied: one applied twice folds no batch norm

    # ----------------------------------------------------------------- helpers
    def fail(self, node, what: str) -> NoReturn:
        raise UnsupportedLayerError(f"{type(self.model).__name__}: {node.op} {node.target!s} ({node.name}): {what}")

    def stored(self, node, m: nn.Module, entries, *, name: str | None = None) -> None:
        """Refuse a module whose parameter ``entries`` (``"weight"``, ...) the state_dict does not
        hold: computed from other tensors (``weight_norm``, ``spectral_norm``, a parametrization),
        which a permutation of the units would have to move in their own way."""
        prefix = node.target if name is None else name
        missing = [p for p in entries if getattr(m, p, None) is not None and f"{prefix}.{p}" not in self.state_keys]
        if missing:
            self.fail(
                node,
                f"its {missing[0]} is computed from other tensors (weight_norm, spectral_norm or another "
                "parametrization), which the state_dict holds instead and a permutation of its units does not "
                "move as it moves a weight; remove it before fusing (torch.nn.utils.parametrize."
                "remove_parametrizations, or the old API's torch.nn.utils.remove_weight_norm), or give a spec",
            )

    def new(self) -> int:
        v = self.classes.new()
        self.order.append(v)
        return v

    def feature(self, node) -> _Feature | None:
        """The activation's units, or None (no units known, or a parameter)."""
        label = self.raw(node)
        if isinstance(label, _Segments):
            widths = [length for _, length in label.parts]
            raise UnsupportedLayerError(
                f"{type(self.model).__name__}: {node.name} holds streams concatenated on their units ({widths} "
                f"wide), read where they cannot be followed: {_SEGMENTS_READERS} can read them"
            )
        if isinstance(label, (_Unreadable, _Recurrent, _Parts)):  # read as one tensor: refused
            why = (
                label.why
                if isinstance(label, _Unreadable)
                else "a recurrent layer's (output, state) read whole"
                if isinstance(label, _Recurrent)
                else "pieces read whole (max's (values, indices), an LSTM's (h, c), a chunk's pieces)"
            )
            raise UnsupportedLayerError(f"{type(self.model).__name__}: {node.name}: {why}")
        return label if isinstance(label, _Feature) else None

    def through(self, node):
        """The label of an element-wise function's result: its operand's units, or its operand's
        streams side by side (:class:`_Segments`), or the parameter it is a function of alone,
        number by number (``self.g.exp()``: read with the parameter's axes where it meets a stream)."""
        label = self.raw(node)
        if isinstance(label, (_Segments, tuple)):
            return label
        return self.feature(node)

    def raw(self, node):
        return self.labels.get(node) if isinstance(node, fx.Node) else None

    def permuted(self, f: _Feature | None) -> TypeGuard[_Feature]:
        return f is not None and self.classes.find(f.var) != _FIXED

    def has_units(self, f) -> TypeGuard[_Feature | _Segments]:
        """Whether ``f`` holds permuted units: a permuted stream's, or streams side by side."""
        return isinstance(f, _Segments) or isinstance(f, _Feature) and self.permuted(f)

    def set_axes(self, entry: str, dims: list) -> None:
        if entry in self.axes:  # a module or parameter used twice: its axes are tied
            for old, new in zip(self.axes[entry], dims):
                if isinstance(old, _Cat) or isinstance(new, _Cat):
                    self.same_cat(entry, old, new)
                    continue
                if (old is None) != (new is None):
                    raise UnsupportedLayerError(
                        f"{type(self.model).__name__}: entry {entry!r} is used with different permuted axes (a "
                        "parameter read both with and without units, or along another axis); give a spec"
                    )
                if old is not None and tuple(old[1:]) != tuple(new[1:]):
                    raise UnsupportedLayerError(
                        f"{type(self.model).__name__}: entry {entry!r} is used with its units in different blocks "
                        f"({old[1]} x n x {old[2]} and "
                        f"{new[1]} x n x {new[2]}); give a spec"
                    )
                if old is not None:
                    self.classes.union(old[0], new[0])
            return
        self.axes[entry] = dims

    def same_cat(self, entry: str, old, new) -> None:
        """Tie the pieces of two uses of one entry's axis of streams side by side, or refuse."""
        shape = [(p[0] is None, p[1:]) for p in old.parts] if isinstance(old, _Cat) else None
        if (
            not isinstance(old, _Cat)
            or not isinstance(new, _Cat)
            or shape != [(p[0] is None, p[1:]) for p in new.parts]
        ):
            raise UnsupportedLayerError(f"entry {entry!r} is used with different streams concatenated on its axis")
        for a, b in zip(old.parts, new.parts):
            if a[0] is not None:
                self.classes.union(a[0], b[0])

    # ----------------------------------------------------------------- the walk
    def run(self, gm: fx.GraphModule) -> PermutationSpec:
        output_node = None
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                shape = _shape(node)
                self.labels[node] = (
                    _Feature(_FIXED, len(shape) - 1 if shape and len(shape) == 2 else 1) if shape else None
                )
            elif node.op == "get_attr":  # the model's parameter or buffer; a constant fx made (torch.tensor(0.1)): none
                known = node.target in self.parameters or node.target in self.buffers
                self.labels[node] = ("param", node.target) if known else None
            elif node.op == "call_module":
                self.call_module(node, gm.get_submodule(node.target))
            elif node.op == "call_function":
                self.call(node, node.target, list(node.args), node.kwargs)
            elif node.op == "call_method":
                self.call_method(node)
            elif node.op == "output":
                output_node = node
        for value in self.decisions:
            self.decided(value)
        self.describe_bias_pieces()
        out = output_node.args[0] if output_node is not None else None
        returned = list(_returned(out))  # a tensor, or a tuple / list / dict of them: the first are the logits
        for node in returned:
            label = self.raw(node)
            if isinstance(label, _Segments):  # streams returned side by side: none is permuted
                for g, _ in label.parts:
                    if g is not None:
                        self.classes.union(g.var, _FIXED)
                continue
            f = self.feature(node)
            if isinstance(f, _Feature):
                self.classes.union(f.var, _FIXED)  # what the network returns is never permuted
        first = returned[0] if returned else None
        f = None if isinstance(self.raw(first), _Segments) else self.feature(first)
        # the output layer: the one whose units the logits are, through what keeps them (log_softmax, a scale)
        output_layer = self.producer.get(first) or (self.var_producer.get(f.var) if f is not None else None)
        if output_layer in self.hand and output_layer in self.transposed:
            raise UnsupportedLayerError(
                f"the output layer {output_layer!r} is a weight applied as it is stored, (features, classes), whose "
                "classes are its axis 1: apply it transposed (x @ self.w.T, F.linear(x, self.w)), write it as "
                "nn.Linear, or give a spec"
            )
        if output_layer is not None and f"{output_layer}.weight" in self.transposed:
            raise UnsupportedLayerError(
                f"the output layer {output_layer!r} is a transposed convolution, whose classes are its weight's "
                "axis 1: end the network with a Linear or Conv layer (a 1x1 convolution), or give a spec"
            )
        self.heads = self.head_sets()
        for heads in self.heads:
            self.check_parallel(gm, heads)
        for names in self.tied:
            self.tie_entries(names)
        self.check_unmoved(gm.graph)
        return self.spec(output_layer)

    def tie_entries(self, names: list[str]) -> None:
        """Entries that are one tensor (``names``) get one description: the units on an axis of
        any of them are the units on that axis of all (an embedding's columns and the output
        layer's tied to it: one residual stream); an axis where one holds none, or the classes,
        is not permuted in any."""
        described = [self.axes[n] for n in names if n in self.axes]
        if not described:
            return
        if any(isinstance(d, _Cat) for dims in described for d in dims):
            raise UnsupportedLayerError(
                f"{type(self.model).__name__}: {names[0]!r} is one tensor with {names[1]!r} and reads streams "
                "concatenated on their units: give a spec, or hold the weight once"
            )
        merged = []
        for dims in zip(*described):
            permuted = [d for d in dims if d is not None and self.classes.find(d[0]) != _FIXED]
            if len(permuted) < len(dims):  # not permuted where one of them is not
                for d in permuted:
                    self.classes.union(d[0], _FIXED)
                merged.append(next((d for d in dims if d is not None), None))
                continue
            if len({tuple(d[1:]) for d in permuted}) > 1:
                raise UnsupportedLayerError(
                    f"{type(self.model).__name__}: {names[0]!r} is one tensor with {names[1]!r}, read with its units "
                    "in different blocks; give a spec"
                )
            for d in permuted[1:]:
                self.classes.union(permuted[0][0], d[0])
            merged.append(permuted[0])
        for n in names:
            self.axes[n] = list(merged)

    def head_sets(self) -> tuple:
        """The module prefixes of every :class:`~bayesfuse.nets.attention.Heads` list (two branches or more)."""
        from bayesfuse.nets.attention import Heads

        return tuple(
            tuple(f"{name}.{i}" for i in range(len(m)))
            for name, m in self.model.named_modules()
            if isinstance(m, Heads) and len(m) > 1
        )

    def check_parallel(self, gm: fx.GraphModule, heads: tuple) -> None:
        """Refuse a Heads list whose branches are not parallel: no computation inside one branch may
        depend on another branch's (a branch applied after another, whose order then matters)."""

        def branch(node) -> int | None:
            paths = list(node.meta.get("nn_module_stack", {}) or {})
            if node.op in ("call_module", "get_attr"):
                paths.append(str(node.target))
            for i, p in enumerate(heads):
                if any(q == p or q.startswith(p + ".") for q in paths):
                    return i
            return None

        depends: dict = {}
        for node in gm.graph.nodes:
            inputs = [a for a in _flat(list(node.args) + list(node.kwargs.values())) if isinstance(a, fx.Node)]
            seen = frozenset().union(*(depends.get(a, frozenset()) for a in inputs))
            i = branch(node)
            if i is not None:
                others = seen - {i}
                if others:
                    calls = Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
                    if any(c > 1 for t, c in calls.items() if str(t).startswith(heads[i] + ".")):
                        self.fail(
                            node,
                            f"the attention whose heads are {heads[0]!r}, ... is applied more than once (called twice, "
                            "or held under two names and called under each): its heads are matched once, for one "
                            "call; use one attention module per call, or give a spec",
                        )
                    self.fail(
                        node,
                        f"branch {heads[i]!r} of a Heads list reads the output of branch {heads[min(others)]!r}: "
                        "heads must run in parallel on the same inputs (their outputs summed), or their order matters",
                    )
                seen = seen | {i}
            depends[node] = seen

    def spec(self, output_layer: str | None) -> PermutationSpec:
        names: dict[int, str] = {}
        for v in self.order:
            r = self.classes.find(v)
            if (
                r != _FIXED
                and r not in names
                and r not in self.cut
                and r not in self.coarse
                and r not in self.segmented
            ):
                names[r] = f"P{len(names) + 1}"

        def axis(d):
            return (
                None
                if d is None or self.classes.find(d[0]) == _FIXED
                else Axis(names[self.classes.find(d[0])], d[1], d[2])
            )

        axes: dict = {}
        pieces: dict = {}
        state = self.model.state_dict()
        for entry in state:
            dims = self.axes.get(entry)
            if dims is None:  # parameters the forward never permutes
                axes[entry] = (None,) * state[entry].dim()
                continue
            cats = [d for d, a in enumerate(dims) if isinstance(a, _Cat)]
            if not cats:
                axes[entry] = tuple(axis(d) for d in dims)
                continue
            if len(cats) > 1:
                raise UnsupportedLayerError(f"entry {entry!r} reads streams concatenated on more than one of its axes")
            at = cats[0]
            parts: list = []
            for var, outer, inner, length in dims[cats[0]].parts:
                a = None if var is None else axis((var, outer, inner))
                if parts and a is None and parts[-1][0] is None:  # unpermuted numbers side by side: one piece
                    parts[-1] = (None, parts[-1][1] + length)
                else:
                    parts.append((a, None if a is not None else length))
            if len(parts) == 1:  # every stream tied to the input or the classes: none permuted
                axes[entry] = tuple(None if d == at else axis(a) for d, a in enumerate(dims))
                continue
            named = []
            for i, (a, length) in enumerate(parts):
                piece = f"{entry}@{i}"
                axes[piece] = tuple(a if d == at else axis(b) for d, b in enumerate(dims))
                named.append((piece, length))
            pieces[entry] = (at, tuple(named))
        output = (
            ()
            if output_layer is None
            else self.hand_output(output_layer, state)
            if output_layer in self.hand
            else tuple(
                p
                for k in (f"{output_layer}.weight", f"{output_layer}.bias")
                if k in state
                for p in ([name for name, _ in pieces[k][1]] if k in pieces else [k])
            )
        )
        # a batch norm folds into the layer before only where that layer's weights are used there
        # alone: a layer applied twice, or whose entries or the batch norm's are one tensor with
        # another's (tied), would take the fold elsewhere too
        shared = {n for together in self.tied for n in together}
        folds = {
            bn: after
            for bn, after in self.folds.items()
            if self.layer_calls[after] == 1
            and not any(k.startswith((f"{bn}.", f"{after}.")) for k in shared)
            and f"{bn}.running_mean" not in pieces  # units split into pieces after it: rows held in pieces
        }
        eps = {bn: float(m.eps) for bn, m in self.model.named_modules() if bn in folds and float(m.eps) != 1e-5}
        widths: dict[str, Axis] = {}
        first: dict[str, int] = {}
        bound = Counter(path for path, *_ in self.held)
        # read where no permutation reaches (an axis tied later to the input or the classes): the number stays
        kept = {path for path, v, *_ in self.held if names.get(self.classes.find(v)) is None}
        for path, v, outer, inner, factor in self.held:
            group = names.get(self.classes.find(v))
            if group is None:
                continue
            # computed with in Python (a scale of it), or an argument of operations other than the
            # reshapes that read it as a width (h / self.width): those would follow it to the fused width
            if path in self.computed or self.uses[path] > bound[path] or path in kept:
                what = (
                    "as the width of an axis no permutation reaches too"
                    if path in kept
                    else "and also computes with it, which a rebuild at another width would change (a scale of it, say)"
                )
                self.fixed.append((v, f"its forward reads {path} as their width {what}"))
                continue
            # the axis is factor times the attribute: outer x n x inner, a factor of it in whole blocks
            if inner % factor == 0:
                outer, inner = outer, inner // factor
            elif outer % factor == 0:
                outer, inner = outer // factor, inner
            else:
                self.fixed.append((v, f"its forward reads {factor} x {path} as their width, not whole blocks of it"))
                continue
            held = Axis(group, outer, inner)
            if widths.setdefault(path, held) != held:  # read as two widths, which fusion would set apart
                why = f"its forward reads {path} as the width of two axes of units"
                self.fixed += [(first[path], why), (v, why)]
            first.setdefault(path, v)
        fixed: dict[str, str] = {}
        for v, why in self.fixed:
            fixed.setdefault(names.get(self.classes.find(v), ""), why)
        fixed.pop("", None)  # a class later tied to the input or the classes: never permuted
        widths = {path: a for path, a in widths.items() if a.group not in fixed}
        tied = {}
        for together in self.tied:  # each alias to the output layer's entry where one of them is, else the first
            stored = [n for n in together if n in state]
            entry = next((n for n in stored if n in output), stored[0] if stored else "")
            tied.update({n: entry for n in stored if n != entry})
        return PermutationSpec(
            axes,
            tuple(names.values()),
            folds,
            output,
            eps,
            heads=self.heads,
            fixed=fixed,
            pieces=pieces,
            transposed=tuple(self.transposed),
            widths=widths,
            tied=tied,
            in_place=self.held_in_place(),
        )

    # ----------------------------------------------------------------- modules
    def call_module(self, node, m: nn.Module) -> None:
        name = node.target
        inp = node.args[0] if node.args else None
        label = self.raw(inp)
        segments = isinstance(label, _Segments)  # streams side by side: read as pieces (in_axis), or refused
        if segments and (not isinstance(m, _SEGMENTS_MODULES) or getattr(m, "groups", 1) != 1):
            self.fail(
                node,
                f"{type(m).__name__} reads streams concatenated on their units (of widths "
                f"{[length for _, length in label.parts]}): {_SEGMENTS_READERS} can read them",
            )
        f = None if segments else self.feature(inp)
        units = label if segments else f  # what the module reads: a stream's units, or streams side by side
        if isinstance(m, nn.Linear):
            self.dense(node, name, m, inp, f, units)
        elif isinstance(m, _CONVS):
            f, units = (f, units) if self.has_units(units) else (None, None)
            if units is not None and units.dim != 1:
                self.fail(node, "a convolution must read channels on axis 1")
            # one group per input channel: depthwise, k filters per channel (a channel multiplier)
            depthwise = m.groups != 1 and m.groups == m.in_channels and m.out_channels % m.in_channels == 0
            if m.groups != 1 and not depthwise:
                self.grouped_conv(node, m, f)
                return
            if depthwise:  # the channels' units as they are, blocks and all; channel c's k filters together
                k = m.out_channels // m.in_channels
                rows = (f.var, f.outer, f.inner * k) if f is not None else (_FIXED, 1, 1)
                self.layer_output(node, m, rows, [None], 1, writes=False)
            else:
                out, cut = self.layer_vars(name, f, node)
                self.layer_output(node, m, (out, cut, 1), [self.in_axis(units)], 1)
        elif isinstance(m, _TRANSPOSED_CONVS):
            f, units = (f, units) if self.has_units(units) else (None, None)
            if units is not None and units.dim != 1:
                self.fail(node, "a transposed convolution must read channels on axis 1")
            if len(node.args) > 1 or node.kwargs:
                self.fail(node, "a transposed convolution given an output_size is not supported; give a spec")
            if m.groups != 1:
                self.grouped_transposed(node, m, f)
                return
            out, cut = self.layer_vars(name, f, node)
            self.layer_output(node, m, (out, cut, 1), [self.in_axis(units)], 1, transposed=True)
        elif isinstance(m, nn.Bilinear):
            self.bilinear(node, m)
        elif isinstance(m, nn.GLU):
            self.pieces(node, [inp, m.dim], {}, (None, "dim", -1), "glu")
        elif isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            self.stored(node, m, ("weight",))
            out, cut = self.layer_vars(name, None, node)
            self.set_axes(f"{name}.weight", [None, (out, cut, 1)])
            self.labels[node] = _Feature(out, len(_tensor_shape(node)) - 1, cut)
        elif isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            self.norm(node, m, units, axis=1, entries=("weight", "bias", "running_mean", "running_var"))
            if m.num_batches_tracked is not None:
                self.set_axes(f"{name}.num_batches_tracked", [])
            # folded into the layer before only with running statistics (without, it normalises by each
            # batch's, in eval mode too: nothing to fold); one without a scale is given 1 and 0 to fold
            # (bayesfuse.inference.bias_free)
            self.fold(name, inp, m.track_running_stats)
        elif isinstance(m, (nn.LayerNorm, *RMS_NORMS)):
            kind = type(m).__name__
            if len(cast(tuple, m.normalized_shape)) != 1:
                self.fail(node, f"{kind} over more than the last axis is not supported")
            if getattr(m, "weight", None) is None and self.has_units(units):  # its width is only normalized_shape
                if not isinstance(units, _Feature):
                    self.fail(node, f"a {kind} without affine parameters over streams side by side; give a spec")
                self.mark_fixed(
                    units.var,
                    f"{kind} {name!r} has no affine parameters, so nothing gives its normalized_shape at another "
                    "width; build it with elementwise_affine=True",
                )
            self.norm(node, m, units, axis=len(_tensor_shape(inp)) - 1, entries=("weight", "bias"))
        elif isinstance(m, nn.GroupNorm):
            if m.num_groups not in (1, m.num_channels) and isinstance(units, _Segments):
                units = self.grouped_segments(node, inp, units, m.num_groups, f"GroupNorm {name!r}")
            elif m.num_groups not in (1, m.num_channels) and self.has_units(units):
                units = self.grouped_units(node, units, m.num_groups, f"GroupNorm with {m.num_groups} groups")
            if (
                m.num_groups == m.num_channels > 1
                and not m.affine
                and isinstance(units, _Feature)
                and self.permuted(units)
            ):
                self.mark_fixed(  # one group per channel, and no entry that gives the rebuild another width
                    units.var,
                    f"GroupNorm {name!r} of one group per channel has no affine parameters, so nothing gives its "
                    "num_groups at another width; build it with affine=True",
                )
            self.norm(node, m, units, axis=1, entries=("weight", "bias"))
        elif isinstance(m, (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)):  # per channel, over positions
            self.norm(node, m, units, axis=1, entries=("weight", "bias", "running_mean", "running_var"))
            if getattr(m, "num_batches_tracked", None) is not None:
                self.set_axes(f"{name}.num_batches_tracked", [])
        elif isinstance(m, nn.PReLU) and m.num_parameters > 1:  # a slope per channel (axis 1)
            self.norm(node, m, units, axis=1, entries=("weight",))
        elif isinstance(m, _ELEMENTWISE_MODULES + (nn.PReLU, nn.Softmax, nn.LogSoftmax, nn.Softmin)):
            self.labels[node] = units
        elif isinstance(m, _POOL_MODULES):
            self.pooled(node, inp, _pool_rank(type(m).__name__))
        elif isinstance(m, _SPATIAL_MODULES):
            self.spatial(node, inp, _spatial_rank(m), type(m).__name__)
        elif isinstance(m, nn.Flatten):
            self.reshape(node, inp)
        elif isinstance(m, (nn.LSTM, nn.GRU, nn.RNN)):
            self.recurrent(node, m, f)
        elif isinstance(m, nn.MultiheadAttention):
            self.fail(
                node,
                "nn.MultiheadAttention's heads are embed_dim / num_heads wide, tied to the stream it "
                "reads, so a stream fused to another width cannot be rebuilt into it: fuse "
                "bayesfuse.nets.attention.split_heads(model), the same function with one module per head",
            )
        elif type(m).__name__ == "PositionAware":
            self.fail(
                node,
                "position-aware layers are traced only in bayesfuse's MLP and in nn.Sequential networks of "
                "Linear, Conv1d/2d, BatchNorm, activation, pooling and Flatten layers",
            )
        elif not any(True for _ in m.parameters(recurse=False)) and not self.permuted(f):
            self.labels[node] = None
        else:
            self.fail(
                node,
                f"{type(m).__name__} is not supported (supported: Linear, Bilinear, Conv1d/2d/3d, "
                "ConvTranspose1d/2d/3d, Embedding(Bag), LSTM, GRU, RNN, BatchNorm, LayerNorm, GroupNorm, "
                "InstanceNorm, activations, pooling, dropout, Flatten)",
            )

    def pooled(self, node, a, k: int) -> None:
        """A ``k``-d pooling of ``a``: it pools the last ``k`` axes (of a batch of maps, or of one
        map without its batch), so units on one of them are refused."""
        units, rank = self.through(a), len(_tensor_shape(a))
        if self.has_units(units) and units.dim >= rank - k:
            self.fail(node, f"a {k}-d pooling of a tensor of rank {rank} pools its axis {units.dim}, the units'")
        self.labels[node] = units

    def channelwise_filter(self, node, args: list, kwargs) -> bool:
        """``F.conv2d(x, filt, groups=C)`` (1-d and 3-d too) with one and the same filter for every
        channel of ``x``: a buffer of equal rows, or one row expanded (timm's ``BlurPool2d``, a
        binomial blur before a strided step). It filters each channel alike, so, as a pooling, it
        is the same whatever the channels' order and they pass through; returns False (not
        handled) otherwise. Where the filter's rows or the groups are not read off the channels'
        width (a buffer of one row per channel, ``groups=self.channels``), the width is fixed."""
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        given = {**dict(zip(names, args)), **kwargs}
        x, w = given.get("input"), given.get("weight")
        if given.get("bias") is not None or not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
            return False
        units = self.through(x)
        if not isinstance(units, _Feature) or not self.permuted(units) or units.dim != 1:
            return False
        expanded = w.op == "call_method" and w.target == "expand" and isinstance(w.args[0], fx.Node)
        base = w.args[0] if expanded else w
        if not isinstance(base, fx.Node) or base.op != "get_attr" or base.target not in self.buffers:
            return False
        value, shape, channels = self.buffers[str(base.target)], _tensor_shape(w), _tensor_shape(x)[1]
        rows_alike = value.shape[0] == 1 if expanded else bool(torch.equal(value, value[:1].expand_as(value)))
        groups = given.get("groups", 1)
        if not rows_alike or self.number(groups) != channels or shape[0] != channels or shape[1] != 1:
            return False

        def follows(size) -> bool:  # read off these channels' width
            return any(self.classes.find(v) == self.classes.find(units.var) for v in self.units_read(size))

        sizes = list(w.args[1:]) if expanded else []
        size = (sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)) else sizes or [None])[0]
        for v in self.units_read(size) + self.units_read(groups):  # another group's width sizes it: kept
            if self.classes.find(v) != self.classes.find(units.var):
                self.mark_fixed(v, f"{node.name} sizes a filter of other channels by their width")
        if not (expanded and follows(size) and follows(groups)):
            self.mark_fixed(units.var, f"{node.name} filters them by {base.target}, one row per channel")
        self.labels[node] = units
        return True

    def dense(self, node, name: str, m: nn.Linear, inp, f, units) -> None:
        """Linear layer ``name`` (module ``m``) applied to ``inp``, whose units are ``f`` (or
        streams side by side, ``units``). One that acts across another axis than the units'
        (MLP-Mixer's and ResMLP's token mixing, ``fc(x.transpose(1, 2))``) reads and writes numbers
        no permutation moves, so its units are kept in place, never matched (its weight's axes
        unpermuted), and the units pass through on their axis."""
        f, units = (f, units) if self.has_units(units) else (None, None)
        if units is not None and units.dim != len(_tensor_shape(inp)) - 1:
            if not isinstance(units, _Feature) or name in self.module_vars:
                self.fail(node, "a Linear layer that acts on an axis other than the units' is not supported")
            self.stored(node, m, ("weight", "bias"), name=name)
            self.set_axes(f"{name}.weight", [None, None])
            if m.bias is not None:
                self.set_axes(f"{name}.bias", [None])
            self.labels[node] = units
            return
        out, cut = self.layer_vars(name, f, node)
        self.layer_output(node, m, (out, cut, 1), [self.in_axis(units)], len(_tensor_shape(node)) - 1, name=name)

    def rolled_elsewhere(self, node, args: list, kwargs) -> bool:
        """``torch.roll`` along axes other than the units' (Swin's shifted windows, ``dims=(1, 2)``
        of channels-last maps): the units pass, and True; else False (refused as opaque)."""
        bound = {**dict(zip(("input", "shifts", "dims"), args)), **kwargs}
        x, dims = bound.get("input"), bound.get("dims")
        dims = [dims] if isinstance(dims, int) else dims
        if not isinstance(x, fx.Node) or not isinstance(dims, (list, tuple)) or not dims:
            return False
        if not all(isinstance(d, int) for d in dims) or isinstance(self.raw(x), _Segments):
            return False
        f, rank = self.feature(x), len(_tensor_shape(x))
        if self.permuted(f) and f.dim in {d % rank for d in dims}:
            return False
        self.labels[node] = f
        return True

    def own_linear(self, node, args: list, kwargs) -> bool:
        """``F.linear(x, self.weight, self.bias)`` in the forward of a subclass of ``nn.Linear``
        (timm's ``Linear``): traced as that layer, and True; else False (a weight applied by hand)."""
        bound = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
        w, b = bound.get("weight"), bound.get("bias")
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and str(w.target).endswith(".weight")):
            return False
        name = str(w.target).rpartition(".")[0]
        m = self.model.get_submodule(name)
        bias_ok = (b is None and m.bias is None) or (
            isinstance(b, fx.Node) and b.op == "get_attr" and b.target == f"{name}.bias" and m.bias is not None
        )
        pieces = None  # a bias put together in the forward: torch.cat((self.q_bias, self.k_bias, self.v_bias))
        if isinstance(m, nn.Linear) and not bias_ok and m.bias is None:
            pieces = self.concatenated_vectors(b, m.out_features)
            bias_ok = pieces is not None
        if not isinstance(m, nn.Linear) or not bias_ok:
            return False
        x = bound.get("input")
        label = self.raw(x)
        segments = isinstance(label, _Segments)
        f = None if segments else self.feature(x)
        self.dense(node, name, m, x, f, label if segments else f)
        self.consume_parameters(node)
        if pieces is not None:
            self.consumed.add((node, b))
            self.bias_pieces.append((node, f"{name}.weight", pieces))
            rows = self.axes[f"{name}.weight"][0]
            unstored = [e for e, _, _ in pieces if e not in self.parameters and e not in self.state_keys]
            if unstored and isinstance(rows, tuple):  # every piece is whole blocks of one permutation: held now
                self.buffer_along(rows[0], unstored[0])
        return True

    def concatenated_vectors(self, b, rows: int) -> list[tuple[str, int, int]] | None:
        """``(entry, start, length)`` of each vector (a parameter or buffer) that ``torch.cat`` of
        them along their one axis, ``b``, holds, where they are ``rows`` numbers in all; else None."""
        if not (isinstance(b, fx.Node) and b.op == "call_function" and b.target is torch.cat and b.args):
            return None
        dim = b.args[1] if len(b.args) > 1 else b.kwargs.get("dim", 0)
        parts, values = b.args[0], {**self.parameters, **self.buffers}
        if dim not in (0, -1) or not isinstance(parts, (list, tuple)):
            return None
        pieces, start = [], 0
        for t in parts:
            if not (isinstance(t, fx.Node) and t.op == "get_attr" and values.get(str(t.target)) is not None):
                return None
            value = values[str(t.target)]
            if value.dim() != 1:
                return None
            pieces.append((str(t.target), start, value.numel()))
            start += value.numel()
        return pieces if start == rows else None

    def describe_bias_pieces(self) -> None:
        """Give each vector of a bias put together in the forward (:meth:`concatenated_vectors`)
        the units of the rows it is added to: whole blocks of the layer's rows, permuted alike
        (``q_bias`` the queries' third of a ``qkv`` layer cut into three); a buffer's fix them, or
        hold them in place where the state_dict does not hold it (:meth:`buffer_along`)."""
        for node, weight, pieces in self.bias_pieces:
            rows = self.axes[weight][0]
            if rows is None or self.classes.find(rows[0]) == _FIXED:
                for entry, _, _ in pieces:  # rows no permutation moves (held in place): nor the vectors
                    self.set_axes(entry, [None])
                continue
            var, outer, inner = rows
            block = sum(length for _, _, length in pieces) // outer
            for entry, start, length in pieces:
                if start % block or length % block:
                    self.fail(node, f"its bias puts {entry!r} beside other vectors across blocks of its units")
                self.set_axes(entry, [(var, length // block, inner)])
                if entry not in self.parameters:  # a stored one: an unstored one held the rows (own_linear)
                    self.buffer_along(var, entry)

    def addmm_layer(self, node, args: list, kwargs) -> bool:
        """``torch.addmm(self.bias, x, self.weight)`` in a module whose weight is stored inputs
        first (Hugging Face's ``Conv1D``: weight ``(in, out)``, GPT-2's layers): traced as a linear
        layer whose units are its weight's axis 1, and True; else False (a weight applied by hand)."""
        bound = {**dict(zip(("input", "mat1", "mat2"), args)), **kwargs}
        b, x, w = bound.get("input"), bound.get("mat1"), bound.get("mat2")
        if bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1:
            return False
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and str(w.target).endswith(".weight")):
            return False
        name = str(w.target).rpartition(".")[0]
        m = self.model.get_submodule(name)
        held = dict(m.named_parameters(recurse=False))
        if set(held) != {"weight", "bias"} or held["weight"].dim() != 2 or next(m.children(), None) is not None:
            return False
        if not (isinstance(b, fx.Node) and b.op == "get_attr" and b.target == f"{name}.bias"):
            return False
        f = self.feature(x)
        if f is not None and f.dim != 1:
            return False
        out, cut = self.layer_vars(name, f, node)
        self.layer_output(node, m, (out, cut, 1), [self.in_axis(f)], 1, transposed=True, name=name)  # type: ignore[arg-type]
        self.consume_parameters(node)
        return True

    def layer_output(
        self,
        node,
        m: nn.Linear | nn.Bilinear | nn.modules.conv._ConvNd,
        rows: tuple,
        inputs: list,
        dim: int,
        *,
        writes: bool = True,
        transposed: bool = False,
        name: str | None = None,
    ) -> None:
        """Module ``m``'s weight: its rows the units ``rows`` (``(var, outer, inner)``), then one
        axis per input (``inputs``, their units or None), then its kernel's; its bias the rows';
        its output those units on axis ``dim``. ``writes``: the units are the layer's own (not a
        depthwise convolution's, which keeps its input's). ``transposed``: a transposed
        convolution, whose weight holds its input's channels first and its rows second. ``name``:
        the layer's, where ``node`` calls no module (``F.linear`` in a subclass's forward)."""
        name = node.target if name is None else name
        self.stored(node, m, ("weight", "bias"), name=name)
        self.layer_calls[name] += 1
        kernel = [None] * (m.weight.dim() - 1 - len(inputs))
        channels = [*inputs, rows] if transposed else [rows, *inputs]
        self.set_axes(f"{name}.weight", [*channels, *kernel])
        if transposed and f"{name}.weight" not in self.transposed:
            self.transposed.append(f"{name}.weight")
        if m.bias is not None:
            self.set_axes(f"{name}.bias", [rows])
        self.labels[node] = _Feature(rows[0], dim, rows[1], rows[2])
        self.producer[node] = name
        if writes:
            self.var_producer.setdefault(rows[0], name)

    def bilinear(self, node, m: nn.Bilinear) -> None:
        """``nn.Bilinear``: ``y_k = x1^T W_k x2 + b_k``; its output units permute the rows of ``W``
        and ``b``, the units of its two inputs (on their last axis) its second and third axes."""
        operands = [*node.args, *node.kwargs.values()]
        if len(operands) != 2:
            self.fail(node, "a Bilinear layer is given two inputs")
        features = []
        for x in operands:
            f = self.feature(x)
            f = f if self.permuted(f) else None
            if f is not None and f.dim != len(_tensor_shape(x)) - 1:
                self.fail(node, "a Bilinear layer that reads units on an axis other than the last is not supported")
            features.append(f)
        out, cut = self.layer_vars(node.target, features[0], node)
        self.layer_output(node, m, (out, cut, 1), [self.in_axis(g) for g in features], len(_tensor_shape(node)) - 1)

    def grouped_units(self, node, units, g: int, what: str) -> _Feature:
        """``units`` (channels on axis 1) cut into blocks that ``g`` equal groups of channels do not
        cross (:meth:`refine`): one permutation of the channels within a group serves every group,
        so that each group keeps its channels and the groups stay equally wide at any width (a
        GroupNorm of ``g`` groups normalises each group's channels together)."""
        if isinstance(units, _Segments):
            self.fail(node, f"a {what} of streams concatenated on their units is not supported; give a spec")
        channels = _tensor_shape(node.args[0])[1]
        n = channels // (units.outer * units.inner)
        cut = g // int(np.gcd(units.outer, g))
        # a unit of several channels (a depthwise convolution's k filters) must lie in one group
        if units.dim != 1 or (channels // g) % units.inner or n % cut:
            self.fail(
                node,
                f"a {what} of {channels} channels held as {units.outer} blocks of {n} units of {units.inner}: its "
                "groups cut through units; give a spec",
            )
        var = self.refine(units.var, cut) if cut > 1 else units.var
        return _Feature(var, 1, units.outer * cut, units.inner)

    def grouped_segments(self, node, inp, seg: _Segments, g: int, what: str) -> _Segments:
        """Streams side by side read by ``g`` equal groups of channels (a diffusion U-Net's
        GroupNorm right after a skip's concatenation): each stream holds whole groups, its units
        cut into blocks the groups do not cross (:meth:`grouped_units`), and its width fixed
        (:attr:`PermutationSpec.fixed`): streams fused apart would not keep the groups equal."""
        size = sum(length for _, length in seg.parts) // g
        done: set[int] = set()
        for i, (_, length) in enumerate(seg.parts):
            if length % size:
                self.fail(node, f"a {what} of {g} groups of {size} channels cuts through a stream of {length}")
            label = self.raw(inp)  # as relabelled by the refinements before
            assert isinstance(label, _Segments)
            part = label.parts[i][0]
            if not (isinstance(part, _Feature) and self.permuted(part)) or self.classes.find(part.var) in done:
                continue  # a stream concatenated twice: cut once
            k = length // size  # the groups this stream holds
            cut = k // int(np.gcd(part.outer, k))
            n = length // (part.outer * part.inner)
            if size % part.inner or n % cut:
                self.fail(node, f"a {what} of {g} groups cuts through the units of a stream of {length}; give a spec")
            var = self.refine(part.var, cut) if cut > 1 else part.var
            done.add(self.classes.find(var))
            self.mark_fixed(var, f"{what} normalises groups across streams side by side, which fusion keeps equal")
        label = self.raw(inp)
        assert isinstance(label, _Segments)
        return label

    def grouped_conv(self, node, m: nn.modules.conv._ConvNd, f: _Feature | None) -> None:
        """A convolution of ``g`` groups (ResNeXt's): each group of output channels reads its own
        group of input channels. One permutation of the channels within a group serves every
        group, for the outputs (``g`` blocks of the rows) and for the inputs (the input's units cut
        into blocks that the groups' boundaries do not cross, :meth:`refine`; a group's slice of
        the weight's second axis holds its blocks), so the fused convolution keeps ``g`` groups
        of equal widths."""
        g, name = m.groups, node.target
        in_axis = None
        if f is not None:
            f = self.grouped_units(node, f, g, f"convolution of {g} groups")
            in_axis = (f.var, f.outer // g, f.inner)
        out, cut = self.layer_vars(name, f, node)
        self.layer_output(node, m, (out, g * cut, 1), [in_axis], 1)

    def grouped_transposed(self, node, m: nn.modules.conv._ConvTransposeNd, f: _Feature | None) -> None:
        """A transposed convolution of ``g`` groups, weight ``(C_in, C_out / g, *kernel)``: output
        channel ``c * C_out / g + j`` of group ``c`` reads that group's input channels through
        ``weight[:, j]``. As for a convolution of groups (:meth:`grouped_conv`), one permutation
        within a group serves every group: the weight's axis 1 holds it once, the bias and the
        output ``g`` times, and the input's units are cut into blocks the groups do not cross,
        all of them on the weight's axis 0. Depthwise (a group per input channel, ``k`` filters
        each), the output's units are the input's, ``k`` numbers each. A batch norm after it is
        not folded into it (its filters are not the rows of one axis)."""
        g, name = m.groups, node.target
        self.stored(node, m, ("weight", "bias"))
        kernel = [None] * (m.weight.dim() - 2)
        if g == m.in_channels:  # depthwise: channel c's k filters together
            k = m.out_channels // m.in_channels
            rows = (f.var, f.outer, f.inner * k) if f is not None else (_FIXED, 1, 1)
            inputs = None if f is None else (f.var, f.outer, f.inner)
            self.set_axes(f"{name}.weight", [inputs, None, *kernel])
        else:
            inputs = None
            if f is not None:
                f = self.grouped_units(node, f, g, f"transposed convolution of {g} groups")
                inputs = (f.var, f.outer, f.inner)
            out, cut = self.layer_vars(name, f, node)
            rows = (out, g * cut, 1)
            self.set_axes(f"{name}.weight", [inputs, (out, cut, 1), *kernel])
            self.var_producer.setdefault(out, name)
        if f"{name}.weight" not in self.transposed:
            self.transposed.append(f"{name}.weight")
        if m.bias is not None:
            self.set_axes(f"{name}.bias", [rows])
        self.labels[node] = _Feature(rows[0], 1, rows[1], rows[2])

    def recurrent(self, node, m: nn.LSTM | nn.GRU | nn.RNN, f: _Feature | None) -> None:
        """``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN``: layer k's units are one permutation of the rows of
        each gate's block of ``weight_ih_lk``, ``weight_hh_lk`` and its biases (4 blocks, 3 for a
        GRU, 1 for an RNN) and of the columns of ``weight_hh_lk`` and of the next layer's
        ``weight_ih``: the gates of a unit read only that unit's past state (``spec.lstm``, FedMA
        section 2.2). A bidirectional layer's two directions (``_reverse``) are permuted by that one
        permutation, so that its output, the two directions' units side by side, holds each
        permuted alike (two blocks): a global unit is a pair of a forward and a backward unit. A
        projected LSTM (``proj_size``) has a second permutation per layer, of its projection's
        units: the rows of ``weight_hr_lk``, the columns of ``weight_hh_lk``, its output and its
        final ``h``; its cells' units are the columns of ``weight_hr_lk`` and its final ``c``."""
        kind = type(m).__name__
        self.stored(node, m, tuple(m._flat_weights_names))
        proj = m.proj_size if isinstance(m, nn.LSTM) else 0
        f = f if self.permuted(f) else None
        if f is not None and f.dim != len(_tensor_shape(node.args[0])) - 1:  # in blocks too (a bidirectional one's)
            self.fail(node, f"an {kind} must read the units on the last axis")
        gates = 4 if isinstance(m, nn.LSTM) else 3 if isinstance(m, nn.GRU) else 1
        directions = ("", "_reverse") if m.bidirectional else ("",)
        name, below, layers, cells = node.target, f, [], []
        if len(node.args) > 1 or node.kwargs:
            self.fail(
                node,
                f"an {kind} given a first state is not supported: its width is the clients', and fusion changes "
                "it; call it without one (zeros are its default), or give a spec",
            )
        for k in range(m.num_layers):
            key = f"{name}#{k}"  # one variable per layer, the same on every call of the module
            # a module called again after its units were cut into blocks (a chunk of its output
            # tied, :meth:`refine`): its gates' rows and its state's columns are read in those blocks
            h, hb = self.recurrent_var(node, key)
            if below is not None:
                old_in = self.module_vars[key][0]
                if old_in is not None:
                    self.classes.union(self.resolve(old_in)[0], below.var)
                self.module_vars[key] = (below.var, h)
            out, ob = h, hb
            if proj:  # the projection's units: a permutation of their own, the same on every call
                out, ob = self.recurrent_var(node, f"{key}p")
            for d in directions:
                self.set_axes(f"{name}.weight_ih_l{k}{d}", [(h, gates * hb, 1), self.in_axis(below)])
                self.set_axes(f"{name}.weight_hh_l{k}{d}", [(h, gates * hb, 1), (out, ob, 1)])
                if m.bias:
                    self.set_axes(f"{name}.bias_ih_l{k}{d}", [(h, gates * hb, 1)])
                    self.set_axes(f"{name}.bias_hh_l{k}{d}", [(h, gates * hb, 1)])
                if proj:
                    self.set_axes(f"{name}.weight_hr_l{k}{d}", [(out, ob, 1), (h, hb, 1)])
            layers.append((out, ob))
            cells.append((h, hb))
            below = _Feature(out, 0, len(directions) * ob)  # the next layer reads both directions' units
        rank = len(_tensor_shape(node.args[0]))
        output = _Feature(layers[-1][0], rank - 1, len(directions) * layers[-1][1])
        state: object = (
            _Feature(layers[0][0], rank - 1, layers[0][1])  # (1, N, H) batched, (1, H) not: the units last
            if m.num_layers == 1
            else _Unreadable(
                f"the final state of the {m.num_layers}-layer {kind} {name!r} holds every layer's units, "
                "each layer a permutation of its own: read the top layer's from the output sequence "
                + (
                    "(its last step holds the forward direction's final state, its first the backward one's)"
                    if m.bidirectional
                    else "(output[:, -1] with batch_first)"
                )
                + ", or give a spec"
            )
        )
        cell = _Feature(cells[0][0], rank - 1, cells[0][1]) if m.num_layers == 1 else state  # an LSTM's c: its cells
        self.labels[node] = _Recurrent(output, _Parts((state, cell)) if gates == 4 else state)

    def recurrent_var(self, node, key: str) -> tuple[int, int]:
        """The variable ``key`` of a recurrent layer (a layer's cells, ``name#k``; its projection's
        units, ``name#kp``), the same on every call of the module, and the blocks its units were cut
        into since its first call (1 if none, :meth:`resolve`)."""
        if key not in self.module_vars:
            self.module_vars[key] = (None, self.new())
        return self.resolve(self.module_vars[key][1])

    def layer_vars(self, name: str, f: _Feature | None, node) -> tuple[int, int]:
        """The output variable of module ``name`` (the same on every call of it) and the blocks its
        units were cut into since its first call (1 if none, :meth:`resolve`)."""
        if name in self.module_vars:
            old_in, out = self.module_vars[name]
            if f is not None and old_in is not None:
                self.classes.union(self.resolve(old_in)[0], f.var)
            return self.resolve(out)
        out = self.new()
        self.module_vars[name] = (f.var if f is not None else None, out)
        return out, 1

    def resolve(self, var: int) -> tuple[int, int]:
        """The class that ``var``'s units are now blocks of, and how many blocks (:meth:`refine`)."""
        root, blocks = self.classes.find(var), 1
        while root in self.cut:
            new, m = self.cut[root]
            root, blocks = self.classes.find(new), blocks * m
        if root in self.segmented:
            raise UnsupportedLayerError(
                f"{type(self.model).__name__}: a layer called again after its units were split into pieces of "
                "different widths; give a spec"
            )
        if root in self.coarse:
            raise UnsupportedLayerError(
                f"{type(self.model).__name__}: a layer called again after its units were taken in runs (beside a "
                "depthwise convolution's filters); give a spec"
            )
        return root, blocks

    def in_axis(self, f: _Feature | _Segments | None):
        """The axis of an entry that reads ``f``'s units: one class's, or streams side by side,
        the spec's pieces (:class:`_Cat`)."""
        if isinstance(f, _Segments):
            return _Cat(tuple((None, 1, 1, n) if g is None else (g.var, g.outer, g.inner, n) for g, n in f.parts))
        return None if f is None else (f.var, f.outer, f.inner)

    def norm(self, node, m: nn.Module, f: _Feature | _Segments | None, *, axis: int, entries: tuple) -> None:
        if not self.has_units(f):
            self.labels[node] = f
            return
        if f.dim != axis:
            self.fail(node, f"{type(m).__name__} must normalise the units' axis")
        self.stored(node, m, entries)
        for p in entries:  # one number per unit, in its blocks (a bidirectional layer's two directions)
            if getattr(m, p, None) is not None:
                self.set_axes(f"{node.target}.{p}", [self.in_axis(f)])
        self.labels[node] = f

    def functional_norm(self, node, fn, args: list, kwargs) -> None:
        """``F.layer_norm(x, normalized_shape, weight, bias)`` (``F.rms_norm``),
        ``F.group_norm(x, num_groups, weight, bias)`` or ``F.batch_norm(x, running_mean,
        running_var, weight, bias)``, as a module of one's own calls it (ConvNeXt's
        ``LayerNorm2d``: the channels moved last, normalised, moved back; timm's ``BatchNormAct2d``:
        a batch norm and its activation): its ``weight`` and ``bias`` are the network's parameters,
        and a batch norm's running statistics its buffers, one number per unit of ``x``'s last
        axis (the channels, axis 1, for a group or batch norm; a group norm's groups cut them as
        :meth:`grouped_units` says). A batch norm is folded into the layer before it, as the
        module is, where its four entries are one module's ``weight``, ``bias``, ``running_mean``
        and ``running_var`` with its ``eps``. A width the forward gives must follow the fused width: read
        off the input (``x.shape[-1:]``) or the module's own (``normalized_shape``, a per-channel
        group norm's ``num_groups``), which the rebuilt module holds at the fused width; a number
        written in the forward fixes the units' width (:attr:`PermutationSpec.fixed`)."""
        self.consume_parameters(node)  # its weight, bias and statistics, described below
        what = _name(fn)
        bound = {**dict(zip(_FUNCTIONAL_NORMS[fn], args)), **kwargs}
        x = bound.get("input")
        label = self.raw(x)
        f = label if isinstance(label, _Segments) else self.feature(x)
        if not self.has_units(f):
            self.labels[node] = f
            return
        grouped, batch = fn is torch.nn.functional.group_norm, fn is torch.nn.functional.batch_norm
        if f.dim != (1 if grouped or batch else len(_tensor_shape(x)) - 1):
            self.fail(node, f"{what} must normalise the units' axis, " + ("axis 1" if grouped or batch else "the last"))
        if grouped:
            groups, channels = bound.get("num_groups"), _tensor_shape(x)[1]
            if not isinstance(groups, int):
                self.fail(node, f"{what} given a number of groups computed in the forward; give a spec")
            if 1 < groups < channels and isinstance(f, _Segments):  # right after a concatenation
                f = self.grouped_segments(node, x, f, groups, what)
            elif 1 < groups < channels:
                f = self.grouped_units(node, f, groups, f"{what} of {groups} groups")
        owners, entries = [], {}
        for key in ("weight", "bias", *(("running_mean", "running_var") if batch else ())):
            p = bound.get(key)
            if p is None:
                continue
            base = _view_base(p)
            target = str(base.target) if base is not None else ""
            values = self.buffers if key.startswith("running") else self.parameters
            if target not in values or values[target].dim() != 1:
                self.fail(node, f"{what} given a {key} that is not the network's own, one number per unit")
            if target not in self.state_keys:
                self.fail(node, f"{what}'s {key} {target!r} is computed from other tensors (a parametrization)")
            self.set_axes(target, [self.in_axis(f)])
            entries[key] = target
            owners.append(self.model.get_submodule(target.rpartition(".")[0]))
        if batch:
            self.functional_fold(node, bound, entries)
            self.labels[node] = f
            return
        if grouped:  # one group per channel: its number is the width
            width, where = groups, "in the module's num_groups"
            kept = groups != channels or any(getattr(m, "num_groups", None) == groups for m in owners)
        else:
            width, kept, where = self.norm_width(x, f, bound.get("normalized_shape"), owners, what, node)
        if not kept:
            if not isinstance(f, _Feature):
                self.fail(node, f"{what} of streams side by side given its width as a number; give a spec")
            self.mark_fixed(
                f.var,
                f"{what} is given their width as {width!r} in the forward, which fusion does not change; keep it "
                + where
                if owners
                else f"{what} has no weight or bias, so nothing gives its width ({width!r}) at another width; "
                "build it with affine parameters",
            )
        self.labels[node] = f

    def functional_fold(self, node, bound: dict, entries: dict) -> None:
        """Fold ``F.batch_norm`` into the layer before it (:attr:`PermutationSpec.folds`), as a
        batch-norm module is, where its running statistics (and scale and shift, if any) are one
        module's entries of the module's names and ``eps``, and its input is that layer's output
        read by nothing else."""
        mean, var = entries.get("running_mean"), entries.get("running_var")
        if mean is None or var is None or bound.get("training", False) is not False:
            return  # batch statistics (training=True normalises by them in eval mode too): nothing to fold
        bn = mean.rpartition(".")[0]
        owner = self.model.get_submodule(bn)
        named = all(target == f"{bn}.{key}" for key, target in entries.items())
        # every scale and shift the module holds applied here (one used after an activation is not the norm's)
        whole = all(getattr(owner, k, None) is None or k in entries for k in ("weight", "bias"))
        eps = bound.get("eps", 1e-5)
        if named and whole and isinstance(eps, float) and eps == getattr(owner, "eps", None):
            if f"{bn}.num_batches_tracked" in self.state_keys:
                self.set_axes(f"{bn}.num_batches_tracked", [])
            # its entries read by this call alone (not scaled again after it, nor applied twice)
            alone = all(
                n.target not in entries.values() or list(n.users) == [node]
                for n in node.graph.nodes
                if n.op == "get_attr"
            )
            self.fold(bn, bound.get("input"), alone)

    def fold(self, bn: str, inp, foldable: bool) -> None:
        """Fold batch norm ``bn`` into the layer whose output ``inp`` is (:attr:`PermutationSpec.folds`)
        where ``foldable`` and nothing else reads that output; a batch norm applied more than once
        (after two layers) is folded into none."""
        if bn in self.normed:
            self.folds.pop(bn, None)
            return
        self.normed.add(bn)
        if foldable and isinstance(inp, fx.Node) and inp in self.producer and len(inp.users) == 1:
            self.folds[bn] = self.producer[inp]

    def norm_width(self, x, f, shape, owners: list, what: str, node) -> tuple:
        """``(width, whether it follows the units, where it should be kept)`` for the
        ``normalized_shape`` given to a functional layer norm of ``x``'s units ``f``: read off a
        tensor's last axis (``x.shape[-1:]``) or a vector's shape (``self.weight.shape``), the
        width follows where that axis holds the units."""
        src = _last_size_of(shape)  # x.shape[-1:]: the width read off a tensor
        whole = _shape_source(shape)  # self.weight.shape (nanoGPT's LayerNorm): a vector's whole shape, its width
        if src is None and whole is not None and len(_shape(whole) or ()) == 1:
            src = whole
        widths = shape if isinstance(shape, (tuple, list)) else [src] if src is not None else None
        if widths is None or len(widths) != 1:
            self.fail(node, f"{what} over more than the last axis, or over a shape computed in the forward")
        width = widths[0]
        if src is not None:  # read off a tensor: it follows the units if that tensor's last axis holds them
            at = self.units_at(src, len(_tensor_shape(src)) - 1)
            kept = src is x or (
                at is not None and isinstance(f, _Feature) and self.classes.find(at[0]) == self.classes.find(f.var)
            )
        else:  # a number computed from the widths, or the module's own, which the rebuild resizes
            kept = isinstance(width, fx.Node) and self.scales(width)
            kept = kept or any(tuple(getattr(m, "normalized_shape", ()) or ()) == (width,) for m in owners)
        return width, kept, "off the input (x.shape[-1:]) or in the module's normalized_shape"

    # ----------------------------------------------------------------- functions
    def call_method(self, node) -> None:
        method = node.target
        args = list(node.args)
        if method in _ELEMENTWISE_METHODS or method in _SOFTMAX_METHODS:
            self.labels[node] = self.through(args[0])
        elif method in _SCALAR_ELEMENTWISE_METHODS:
            self.scalar_elementwise(node, args, node.kwargs)
        elif method in _SELECT_METHODS and len(args) + len(node.kwargs) >= 2:
            self.elementwise_tensors(node, args + list(node.kwargs.values()))
        elif method in _MATMUL_METHODS:
            self.matmul(node, args[0], args[1])
        elif method in _BINARY_METHODS:
            self.binary(node, args[0], args[1])
        elif method in _RESHAPE_METHODS:
            self.reshape(node, args[0])
        elif method in _REDUCTION_METHODS:
            self.reduce_along(node, args, node.kwargs, at=1)
        elif method in _NORM_METHODS:
            self.reduce_along(node, args, node.kwargs, at=2)
        elif method in _EXTREMA_METHODS:
            self.extremum(node, args, node.kwargs)
        elif method in _ARG_EXTREMA_METHODS:
            self.arg_extremum(node, args, node.kwargs)
        elif method in _ORDERED:
            self.ordered(node, args, node.kwargs, str(method))
        elif method in _MOVE_METHODS:
            self.move(node, args[0])
        elif method in _PIECES_METHODS:
            self.pieces(node, args, node.kwargs, _PIECES_METHODS[method], str(method))
        elif method in ("size", "dim"):
            self.labels[node] = None
        elif method in _NEW_TENSOR_METHODS:  # x.new_zeros(shape): x gives its dtype and device alone
            self.opaque(node, args[1:] + list(node.kwargs.values()), str(method))
        elif method == "repeat_interleave":
            self.repeat_interleave(node, args, node.kwargs)
        elif method in ("reshape_as", "view_as") and isinstance(args[1], fx.Node):
            self.reshape_as(node, args[0], args[1])
        elif method in ("expand", "expand_as", "repeat"):  # a class token broadcast over the batch
            label = self.raw(args[0])
            if isinstance(label, _Segments):
                self.feature(args[0])  # refused
            if isinstance(label, _Feature) and self.permuted(label):
                src, dst = _tensor_shape(args[0]), _tensor_shape(node)
                if dst[label.dim + len(dst) - len(src)] != src[label.dim]:
                    self.fail(node, f"{method} along the units' axis copies each unit: cannot be followed; give a spec")
            if isinstance(label, _Feature):
                label = _Feature(
                    label.var,
                    label.dim + len(_tensor_shape(node)) - len(_tensor_shape(args[0])),
                    label.outer,
                    label.inner,
                )
            self.labels[node] = label
        else:
            self.opaque(node, [*args, *node.kwargs.values()], str(method))

    def call(self, node, fn, args: list, kwargs) -> None:
        if not args:  # the tensor given by keyword (torch.sum(input=h, dim=1)): read it first, as by place
            key = next((k for k in ("input", "x", "A") if k in kwargs), None)
            if key is not None:
                args, kwargs = [kwargs[key]], {k: v for k, v in kwargs.items() if k != key}
        if fn is decided:
            self.decision(node, args[0])
        elif fn in _ELEMENTWISE_FUNCTIONS or fn in _SOFTMAX or _qualified(fn) in _KEEPING_UNITS:
            self.labels[node] = self.through(args[0])
        elif fn in _FUNCTIONAL_NORMS:
            self.functional_norm(node, fn, args, kwargs)
        elif fn is torch.nn.functional.linear and (
            self.own_linear(node, args, kwargs) or self.hand_linear(node, args, kwargs)
        ):
            pass
        elif fn is torch.addmm and self.addmm_layer(node, args, kwargs):
            pass
        elif fn is torch.roll and self.rolled_elsewhere(node, args, kwargs):
            pass
        elif fn is torch.addcmul and len(args) == 3 and not kwargs:  # a + b * c (timm's Affine, GRN)
            self.binary(node, args[1], args[2])
            self.binary(node, args[0], node)
        elif fn in _SCALAR_ELEMENTWISE:
            self.scalar_elementwise(node, args, kwargs)
        elif fn in _SHAPED_LIKE:
            self.labels[node] = self.through(args[0])
        elif fn in _SELECT and len(args) + len(kwargs) == 3:
            self.elementwise_tensors(node, list(args) + list(kwargs.values()))
        elif fn in _MATMUL:
            self.matmul(node, args[0], args[1])
        elif fn is torch.einsum:
            self.einsum(node, args)
        elif fn is torch.repeat_interleave:
            self.repeat_interleave(node, args, kwargs)
        elif fn is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = (
                args[i] if len(args) > i else kwargs.get(name) for i, name in enumerate(("query", "key", "value"))
            )
            self.width_scale(node, kwargs.get("scale"), "the attention's scale is")
            self.attention(node, q, k, v, kwargs.get("scale"))
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            f = self.feature(mask) if isinstance(mask, fx.Node) else None
            # a bias per head and position pair (timm's relative positions): the heads keep their order
            if self.permuted(f):
                self.classes.union(f.var, _FIXED)
        elif fn is torch.nn.functional.pad and isinstance(
            args[1] if len(args) > 1 else kwargs.get("pad"), (list, tuple)
        ):
            pad = args[1] if len(args) > 1 else kwargs["pad"]
            self.spatial(node, args[0], len(pad) // 2, "pad", pad=pad)
        elif fn is torch.nn.functional.interpolate:  # the axes after the channels
            self.spatial(node, args[0], None, "interpolate")
        elif fn in _CONV_FUNCTIONS and self.channelwise_filter(node, args, kwargs):
            pass
        elif fn in _POOL_FUNCTIONS:
            self.pooled(node, args[0], _pool_rank(_name(fn)))
        elif fn in _BINARY:
            self.binary(node, args[0], args[1])
        elif fn in _RESHAPE_FUNCTIONS:
            self.reshape(node, args[0])
        elif fn in _REDUCTIONS:
            self.reduce_along(node, args, kwargs, at=1)
        elif fn in _NORMS:
            self.reduce_along(node, args, kwargs, at=2)
        elif fn in _EXTREMA:
            self.extremum(node, args, kwargs)
        elif fn in _ARG_EXTREMA:
            self.arg_extremum(node, args, kwargs)
        elif fn in _ORDERED_FUNCTIONS:
            self.ordered(node, args, kwargs, _ORDERED_FUNCTIONS[fn])
        elif fn in _MOVES:
            self.move(node, args[0])
        elif fn in (torch.cat, torch.concat, torch.concatenate):
            self.concat(
                node, args[0] if args else kwargs.get("tensors"), args[1] if len(args) > 1 else kwargs.get("dim", 0)
            )
        elif fn in _PIECES:
            self.pieces(node, args, kwargs, _PIECES[fn], _name(fn))
        elif fn is torch.stack:
            self.stack(
                node, args[0] if args else kwargs.get("tensors"), args[1] if len(args) > 1 else kwargs.get("dim", 0)
            )
        elif fn is operator.getitem:
            self.getitem(node, args[0])
        elif fn is getattr:
            self.attribute(node, args[0], args[1])
        else:  # its keyword operands too (torch.roll(input=h, ...), torch.cumsum(h, dim=-1, out=...))
            self.opaque(node, [*args, *kwargs.values()], getattr(fn, "__name__", str(fn)))

    def weight_of(self, node) -> str | None:
        """The name of the network's parameter of rank 2 or more that ``node`` is, or a view of
        (``self.weight``, ``self.weight.T``, ``self.weight.t().contiguous()``...), else None."""
        base = _view_base(node)
        target = str(base.target) if base is not None else ""
        return target if target in self.parameters and self.parameters[target].dim() >= 2 else None

    def applied_weight(self, node, operands, what: str) -> None:
        """Refuse a parameter of rank 2+ among ``operands`` (``F.linear(x, self.W)``, ``x @
        self.W.T``, tensordot...): a layer the walk cannot see. A buffer (a mask, a filter) is fine."""
        weights = [w for w in map(self.weight_of, operands) if w is not None]
        if weights:
            self.fail(
                node,
                f"{what} applies the network's own weight {weights[0]!r}, whose units cannot be followed; write "
                "the layer as a module (nn.Linear, nn.Conv2d, ...) or give a spec",
            )

    def opaque(self, node, args, what: str) -> None:
        if any(self.permuted(self.feature(a)) for a in _flat(args)):
            self.fail(node, f"{what} on a permuted axis cannot be followed; give a spec")
        if what in _VIEW_METHODS and args and self.weight_of(args[0]) is not None:
            self.labels[node] = None  # a view of a weight: refused where it is applied
            return
        if what not in _MASKING:
            self.applied_weight(node, list(_flat(args)), what)
        self.labels[node] = None

    def width_scale(self, node, value, what: str) -> None:
        """Mark fixed the widths that ``value``, a root of a permuted width (``d ** -0.5``,
        ``math.sqrt(k.size(-1))``), is computed from where it scales a tensor: fusion would change
        the scale with the width. A width itself (``h.sum(-1) / h.shape[-1]``, a mean written by
        hand) follows the units as ``mean`` does."""
        if _rooted(value):
            self.fix_widths_read(value, f"{what} computed as a root of their width, {value.name}")

    def decision(self, node, value) -> None:
        """A number the trace took at its example value (a branch's condition, ``int(n)``;
        :func:`~bayesfuse.nets.decisions.decided`): read once the whole graph is walked
        (:meth:`decided`), when every parameter whose width it may read has its units."""
        self.decisions.append(value)
        self.labels[node] = None

    def decided(self, value) -> None:
        """Fix the widths of the units the decided number ``value`` reads (:meth:`decision`):
        at another width the forward could take another branch. Only the number's own chain is
        read, up to the sizes it reads: a tensor's dtype or rank, or the widths that shaped a
        tensor whose other size it reads, are none of its."""
        why = f"the forward branches on (or takes int() of) a number read off their width ({value.name})"
        self.fix_widths_read(value, why, whole=True)

    def binary(self, node, a, b) -> None:
        if _shape(node) is not None:  # a tensor: numbers computed from widths that scale it
            for p in (a, b):
                self.width_scale(node, p, "a number that scales a tensor is")
        la, lb = self.raw(a), self.raw(b)
        if isinstance(la, _Segments) or isinstance(lb, _Segments):
            self.segments_binary(node, a, b)
            return
        followed = set()
        for p, other in ((a, b), (b, a)):
            g = self.feature(other)
            if isinstance(self.raw(p), tuple) and g is not None:  # a parameter meets a stream
                self.param_axis(self.raw(p)[1], node, g, _tensor_shape(other))
                self.consumed.add((node, p))
            elif g is not None and self.vector_view(p, g, _tensor_shape(other)):
                followed.add(p)  # a layer scale shaped to the maps: gamma.view(1, -1, 1, 1) * x
                self.consumed.add((node, p))
        fa, fb = self.feature(a), self.feature(b)
        for f, f_node, other in ((fa, a, b), (fb, b, a)):
            if other not in followed:
                self.unknown_operand(node, f, f_node, other)
        for f, f_node, other, g in ((fa, a, b, fb), (fb, b, a, fa)):
            if f is not None and g is not None and self.broadcast(f, f_node, other, g):
                fa, fb = (None, fb) if f is fa else (fa, None)  # one number per position, the stream's
                break
        if fa is not None and fb is not None:
            sa, sb, so = _tensor_shape(a), _tensor_shape(b), _tensor_shape(node)
            if len(so) - len(sa) + fa.dim == len(so) - len(sb) + fb.dim and fa.inner == fb.inner:
                fa, fb = self.same_blocks(fa, fb)
            elif len(so) - len(sa) + fa.dim == len(so) - len(sb) + fb.dim and fa.outer == fb.outer:
                fa, fb = self.same_runs(fa, sa, fb, sb)
            if len(so) - len(sa) + fa.dim != len(so) - len(sb) + fb.dim or (fa.outer, fa.inner) != (fb.outer, fb.inner):
                self.fail(node, "the two operands' units lie on different axes")
            self.classes.union(fa.var, fb.var)
        f = fa or fb
        if f is not None:
            shift = len(_tensor_shape(node)) - len(_tensor_shape(a if fa is not None else b))
            f = _Feature(f.var, f.dim + shift, f.outer, f.inner)
        if f is None and (_param_alone(la, b) or _param_alone(lb, a)):  # 1 + self.weight: the parameter's numbers
            self.labels[node] = la if isinstance(la, tuple) else lb
            return
        self.labels[node] = f

    def segments_binary(self, node, a, b) -> None:
        """``a`` op ``b`` where one holds streams side by side: with a number (``h * 0.5``), or with
        the same streams laid alike (their pieces tied); else refused."""
        la, lb = self.raw(a), self.raw(b)
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
            self.labels[node] = la if isinstance(la, _Segments) else lb
            return
        same = (
            isinstance(la, _Segments)
            and isinstance(lb, _Segments)
            and _tensor_shape(a) == _tensor_shape(b) == _tensor_shape(node)
            and la.dim == lb.dim
            and [(g is None, length, g and (g.outer, g.inner)) for g, length in la.parts]
            == [(g is None, length, g and (g.outer, g.inner)) for g, length in lb.parts]
        )
        if not same:
            self.fail(
                node,
                "an operation of streams concatenated on their units with a tensor that does not hold the same "
                "streams side by side cannot be followed",
            )
        for (g, _), (h, _) in zip(la.parts, lb.parts):
            if g is not None:
                self.classes.union(g.var, h.var)
        self.labels[node] = la

    def same_runs(self, fa: _Feature, sa: tuple, fb: _Feature, sb: tuple) -> tuple[_Feature, _Feature]:
        """``fa`` and ``fb`` in one layout where one's units are runs of ``k`` of the other's numbers
        (a depthwise convolution's ``k`` filters per channel added to a layer's output): the other's
        units taken ``k`` at a time (:meth:`coarsen`). Else they are returned as they are."""
        (lo, s_lo), (hi, _) = sorted(((fa, sa), (fb, sb)), key=lambda p: p[0].inner)
        if not self.permuted(lo) or hi.inner % lo.inner:
            return fa, fb
        k = hi.inner // lo.inner
        if (s_lo[lo.dim] // (lo.outer * lo.inner)) % k:
            return fa, fb
        new = _Feature(self.coarsen(lo.var, k), lo.dim, lo.outer, hi.inner)
        return (new, fb) if lo is fa else (fa, new)

    def same_blocks(self, fa: _Feature, fb: _Feature) -> tuple[_Feature, _Feature]:
        """``fa`` and ``fb`` in one block structure where one holds its units in ``m`` times the
        other's blocks (a layer's output added to a stream cut into pieces before, :meth:`refine`):
        the other's units are cut into ``m`` blocks too. Else they are returned as they are."""
        lo, hi = sorted((fa, fb), key=lambda f: f.outer)
        if not (self.permuted(lo) and self.permuted(hi)):  # the input's features are never cut
            return fa, fb
        if lo.outer == hi.outer or hi.outer % lo.outer or self.classes.find(lo.var) == self.classes.find(hi.var):
            return fa, fb
        m = hi.outer // lo.outer
        new = _Feature(self.refine(lo.var, m), lo.dim, hi.outer, lo.inner)
        return (new, fb) if lo is fa else (fa, new)

    def broadcast(self, f: _Feature, f_node, other, g: _Feature) -> bool:
        """Whether ``f_node``'s axis of units ``f`` holds one number that broadcasts along the other
        operand's units (attention pooling: ``softmax(Linear(H, 1)(out), 1) * out``); if so that
        one unit is never permuted, and keeps its width of 1."""
        if _tensor_shape(f_node)[f.dim] != 1 or f.outer * f.inner != 1:
            return False
        out_f = f.dim - len(_tensor_shape(f_node))
        out_g = g.dim - len(_tensor_shape(other))
        if out_f != out_g or _tensor_shape(other)[g.dim] == 1:  # not on the same axis, or both of one unit
            return False
        self.classes.union(f.var, _FIXED)
        return True

    def vector_view(self, p, g: _Feature, shape: tuple) -> bool:
        """Whether ``p`` is a 1-D parameter or buffer shaped by views (``view``, ``reshape``,
        ``unsqueeze``, ``[:, None, None]``) to hold its numbers on the axis of ``g``'s units in
        a tensor of ``shape`` it broadcasts against; if so, that axis is the parameter's, permuted
        with the units."""
        node = _view_base(p)
        base = str(node.target) if node is not None else ""
        values = {**self.parameters, **self.buffers}
        if base not in values or values[base].dim() != 1 or not isinstance(p, fx.Node):
            return False
        view = _shape(p)
        if view is None:
            return False
        at = len(view) - (len(shape) - g.dim)  # the units' axis, aligned from the end
        n = values[base].numel()
        if not 0 <= at < len(view) or view[at] != n or int(np.prod(view)) != n:
            return False
        if base not in self.parameters and self.permuted(g):
            self.buffer_along(g.var, base)
        self.set_axes(base, [(g.var, g.outer, g.inner)])
        return True

    def unknown_operand(self, node, f: _Feature | None, f_node, other) -> None:
        """Hold in place a permuted stream that meets a tensor of unknown units along its units'
        axis (:meth:`hold_in_place`)."""
        if not self.permuted(f) or not isinstance(other, fx.Node) or self.raw(other) is not None:
            return
        shape, out = _shape(other), _tensor_shape(node)
        dim = f.dim + len(out) - len(_tensor_shape(f_node))  # the units' axis in the result
        at = dim - (len(out) - len(shape)) if shape is not None else -1
        if shape is None or not 0 <= at < len(shape) or shape[at] == 1:
            return
        # numbers no permutation moves (a rotary table computed from sizes): the units are held in
        # place; where they are computed from entries, only if no permutation moves those either
        # (checked once the walk has given every entry its axes: :meth:`check_unmoved`)
        self.hold_in_place(
            f.var, f"{_name(node.target)} with {other.name}, numbers along their units that no permutation moves"
        )

    def hold_in_place(self, var: int, why: str) -> None:
        """No permutation moves ``var``'s units (:attr:`PermutationSpec.in_place`, named by :meth:`held_in_place`)."""
        if self.classes.find(var) != _FIXED:
            self.pins.append((var, why))
        self.classes.union(var, _FIXED)

    def consume_parameters(self, node) -> None:
        """Record that ``node`` reads its parameter operands (and views of them) as the spec
        describes them: a functional layer's or norm's own weights."""
        for operand in node.all_input_nodes:
            base = _view_base(operand)
            if base is not None and base.op == "get_attr":
                self.consumed.add((node, operand))

    def axis_permuted(self, d) -> bool:
        """Whether a permutation moves a recorded axis ``d`` (a piece of it, for :class:`_Cat`)."""
        parts = d.parts if isinstance(d, _Cat) else (d,)
        return any(isinstance(p, tuple) and p[0] is not None and self.classes.find(p[0]) != _FIXED for p in parts)

    def moved(self, entry: str) -> bool:
        """Whether a permutation moves ``entry`` (or a tensor it is tied to) along some axis."""
        names = next((together for together in self.tied if entry in together), [entry])
        return any(self.axis_permuted(d) for name in names for d in self.axes.get(name, ()))

    def check_unmoved(self, graph: fx.Graph) -> None:
        """Refuse a followed activation (one whose units the walk knows, a layer's output, what the
        network returns) computed from numbers it reads as moved by no permutation, where those
        are computed from an entry that a permutation moves: they move with it (``relu(fc(E[ids]))
        @ E.T``: ``E[ids]`` read as the input; ``h * self.g.flip(0)`` with ``g`` permuted with other
        units; ``x @ self.w.abs().T`` beside ``x @ self.w.T``; ``fc(self.p)`` with ``p`` added to a
        stream). A parameter read as the spec describes it (:attr:`consumed`) is not such a read,
        nor a reduction of one over all its numbers (``self.w.norm()``). Checked once the walk is
        done, the returned units fixed and tied entries described alike."""
        entries, known = set(self.parameters) | self.state_keys, {}
        for node in graph.nodes:
            if not (isinstance(self.raw(node), (_Feature, _Segments)) or node.op in ("call_module", "output")):
                continue
            for operand in node.all_input_nodes:
                if (node, operand) in self.consumed or isinstance(self.raw(operand), (_Feature, _Segments)):
                    continue
                if size_read(operand):
                    continue
                if operand not in known:
                    known[operand] = _state_read(operand, entries, lambda n: isinstance(self.raw(n), _Feature))
                moved = next((e for e in known[operand] if self.moved(e)), None)
                if moved is not None:
                    self.fail(
                        node,
                        f"an operand ({operand.name}) whose units cannot be followed, computed from {moved!r}, "
                        "which a permutation moves, is read as numbers no permutation moves; give a spec",
                    )

    def held_in_place(self) -> dict[str, str]:
        """The layers (or parameters) whose units the walk held in place (:attr:`pins`), each with
        why: every entry with an axis that the pinned class reached through ties, now not permuted,
        where that axis is its units' (its rows; a transposed weight's columns) or it has no
        permuted axis at all (a table along the held units): a layer that reads held units and
        writes units of its own, which are matched, is not one, whenever the walk met the hold."""
        held: dict[str, str] = {}
        for var, why in self.pins:
            root = self.classes.tied_root(var)

            def pinned(d, root=root) -> bool:
                return (
                    isinstance(d, tuple) and self.classes.tied_root(d[0]) == root and self.classes.find(d[0]) == _FIXED
                )

            for entry, dims in self.axes.items():
                rows = dims[1 if entry in self.transposed else 0] if dims else None
                if entry in self.state_keys and (
                    pinned(rows) or (any(map(pinned, dims)) and not any(map(self.axis_permuted, dims)))
                ):
                    layer, _, last = entry.rpartition(".")
                    held.setdefault(layer if layer and last in ("weight", "bias") else entry, why)
        return held

    def buffer_along(self, var: int, name: str) -> None:
        """Buffer ``name`` holds a number per unit of ``var``: their width is fixed; and where the
        state_dict does not hold it (``persistent=False``), no permutation can move it with the
        units, so they are not permuted at all."""
        if name in self.state_keys:
            self.mark_fixed(var, _BUFFER_ALONG_UNITS.format(name))
        else:
            self.hold_in_place(var, f"buffer {name}, which the state_dict does not hold, holds a number per unit")

    def param_axis(self, target: str, node, f: _Feature, shape: tuple) -> None:
        """A parameter combined with a stream (a position embedding): its matching axis is permuted too."""
        value = self.parameters[target] if target in self.parameters else self.model.get_buffer(target)
        dim = f.dim - (len(shape) - value.dim())
        if dim < 0 or value.shape[dim] == 1 and shape[f.dim] != 1:
            return  # broadcast along the units: a scalar per position, no permuted axis
        if target not in self.parameters and self.permuted(f):
            self.buffer_along(f.var, target)
        dims: list[tuple[int, int, int] | None] = [None] * value.dim()
        dims[dim] = (f.var, f.outer, f.inner)
        self.set_axes(target, dims)

    def hand_output(self, weight: str, state) -> tuple[str, ...]:
        """The output layer written by hand: its weight, then the vectors added to its units (its bias)."""
        var = self.axes[weight][0][0]
        added = [
            k
            for k, dims in self.axes.items()
            if k != weight and k in state and len(dims) == 1 and isinstance(dims[0], tuple) and dims[0][0] == var
        ]
        return (weight, *added)

    def hand_linear(self, node, args: list, kwargs) -> bool:
        """``F.linear(x, self.w, self.b)`` with ``w`` a 2-D parameter of the network held by no
        ``nn.Linear`` of its own: a layer written by hand (:meth:`hand_layer`), and True; else False."""
        bound = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
        x, w, b = bound.get("input"), bound.get("weight"), bound.get("bias")
        if b is not None and (self.weight_of(b) is not None or not isinstance(self.raw(b), tuple)):
            return False  # a bias computed in the forward
        if not self.hand_layer(node, x, w, transposed_operand=True):
            return False
        if b is not None:
            self.param_axis(self.raw(b)[1], node, self.labels[node], _tensor_shape(node))
            self.consumed.add((node, b))
        return True

    def hand_layer(self, node, x, w, *, transposed_operand: bool = False) -> bool:
        """``x @ w`` (``x @ self.w``, ``x @ self.w.T``; ``F.linear(x, self.w)``, whose operand is
        ``w`` transposed: ``transposed_operand``) with ``w`` a 2-D parameter of the network, viewed
        as it is stored or transposed, summed over ``x``'s last axis where ``x``'s units are, or
        over an axis without units: a linear layer written by hand, whose units are ``w``'s
        other axis, and True (the stored weight's axis 1 where it is applied as it is stored,
        ``(in, out)``: :attr:`PermutationSpec.transposed`). Else False (a weight applied across
        tokens, reshaped, or a parameter of another rank), and the caller refuses it."""
        name = self.weight_of(w)
        swapped = _transposes(w)
        if name is None or self.parameters[name].dim() != 2 or swapped is None or not isinstance(x, fx.Node):
            return False
        label, shape = self.raw(x), _tensor_shape(x)
        if isinstance(label, (_Segments, tuple)) or len(shape) < 1:  # streams side by side; a parameter
            return False
        f = self.feature(x)
        if self.permuted(f) and f.dim != len(shape) - 1:
            return False
        # (in, out) as stored where it is applied as stored: its units on axis 1
        self.hand_weight(node, w, name, f, swapped == transposed_operand, len(_tensor_shape(node)) - 1)
        return True

    def hand_weight(self, node, w, name: str, f: _Feature | None, units_second: bool, dim: int) -> None:
        """Parameter ``name`` (``w``: it, or a transpose of it) applied by hand as a layer reading
        ``f``'s units (or none): its units (new, :meth:`layer_vars`) on its axis 1 where
        ``units_second`` (listed in :attr:`transposed`), else on axis 0; ``node``'s units those, on
        its axis ``dim``. A module's weight so applied is a call of that module too: no batch norm
        after it is folded into it (:attr:`layer_calls`)."""
        self.consumed.add((node, w))  # the weight (or its transpose), described
        module, _, last = name.rpartition(".")
        if last == "weight":
            self.layer_calls[module] += 1
        out, cut = self.layer_vars(name, f if self.permuted(f) else None, node)
        rows, inputs = (out, cut, 1), self.in_axis(f if self.permuted(f) else None)
        self.set_axes(name, [inputs, rows] if units_second else [rows, inputs])
        if units_second and name not in self.transposed:
            self.transposed.append(name)
        self.labels[node] = _Feature(out, dim, cut, 1)
        self.var_producer.setdefault(out, name)
        self.hand.add(name)

    def einsum_layer(self, node, operands: list, subscripts: list, result: list) -> bool:
        """``torch.einsum("bi,oi->bo", x, self.w)`` (two operands, one a 2-D parameter of the
        network, or its transpose): a layer written by hand (:meth:`hand_weight`) where one of the
        weight's letters is summed with ``x``'s units' (or an axis of ``x`` without units) and the
        other is the result's alone, every other letter of ``x`` kept; and True. Else False."""
        at = [i for i, x in enumerate(operands) if self.weight_of(x) is not None]
        if len(operands) != 2 or len(at) != 1:
            return False
        w, x = operands[at[0]], operands[1 - at[0]]
        ws, xs, name, swapped = subscripts[at[0]], subscripts[1 - at[0]], self.weight_of(w), _transposes(w)
        if name is None or self.parameters[name].dim() != 2 or swapped is None or len(set(ws)) != 2:
            return False
        summed, kept = [c for c in ws if c not in result], [c for c in ws if c in result]
        if len(summed) != 1 or len(kept) != 1 or xs.count(summed[0]) != 1 or kept[0] in xs:
            return False
        if any(c not in result for c in xs if c != summed[0]) or isinstance(self.raw(x), _Segments):
            return False
        f = self.feature(x)
        if self.permuted(f) and xs[f.dim] != summed[0]:
            return False
        stored = ws[::-1] if swapped else ws  # the letters of the weight's axes as it is stored
        self.hand_weight(node, w, name, f, stored.index(kept[0]) == 1, result.index(kept[0]))
        return True

    def matmul(self, node, a, b) -> None:
        """``a @ b``: units summed over in both operands are tied (and gone); units on an axis
        that is not summed over pass to the result. ``x @ self.w`` is a layer written by hand
        (:meth:`hand_layer`)."""
        if self.weight_of(b) is not None and self.weight_of(a) is None and self.hand_layer(node, a, b):
            return
        self.applied_weight(node, [a, b], "a matrix product")
        fa, fb = (f if self.permuted(f) else None for f in (self.feature(a), self.feature(b)))
        if fa is None and fb is None:
            self.labels[node] = None
            return
        sa, sb, so = _tensor_shape(a), _tensor_shape(b), _tensor_shape(node)
        if len(sa) < 2 or len(sb) < 2:
            self.fail(
                node, "a matrix product with a vector operand on a permuted stream cannot be followed; give a spec"
            )
        a_summed = fa is not None and fa.dim == len(sa) - 1
        b_summed = fb is not None and fb.dim == len(sb) - 2
        if a_summed or b_summed:
            if not (a_summed and b_summed) or fa is None or fb is None or (fa.outer, fa.inner) != (fb.outer, fb.inner):
                self.fail(
                    node,
                    "a matrix product sums over permuted units that the other operand does not share "
                    "(a weight applied by hand?); use nn.Linear, or give a spec",
                )
            self.classes.union(fa.var, fb.var)  # q k^T: one permutation of a head's query/key features
            self.labels[node] = None
        elif fa is not None and fb is not None:
            self.fail(node, "a matrix product of two permuted streams (an outer product) cannot be followed")
        elif fa is not None and fa.dim == len(sa) - 2:
            self.labels[node] = _Feature(fa.var, len(so) - 2, fa.outer, fa.inner)
        elif fb is not None and fb.dim == len(sb) - 1:
            self.labels[node] = _Feature(fb.var, len(so) - 1, fb.outer, fb.inner)  # weights @ values
        else:
            self.fail(node, "a batched matrix product over permuted units cannot be followed; give a spec")

    def einsum(self, node, args: list) -> None:
        """``torch.einsum(equation, *operands)``, read letter by letter: a permuted axis whose letter
        the result keeps passes to it there; one summed over (in no place of the result) must be
        permuted, alike, in every operand that holds it, and is tied there (``"bhid,bhjd->bhij"``:
        one permutation of a head's query/key features), as in :meth:`matmul`."""
        operands = list(args[1][0] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
        if not isinstance(args[0], str) or not all(isinstance(x, fx.Node) for x in operands):
            self.opaque(node, args, "einsum (with its operands given by sublists)")
            return
        ranks = [len(_tensor_shape(x)) for x in operands]
        try:
            subscripts, result = _einsum_subscripts(args[0], ranks)
        except ValueError as why:
            self.fail(node, f"einsum {args[0]!r}: {why}")
        # a weight summed over is a layer applied by hand; one whose every axis the result keeps
        # scales the numbers one by one (a position's scale, "bnd,nd->bnd")
        if self.einsum_layer(node, operands, subscripts, result):
            return
        summed = [x for x, subs in zip(operands, subscripts) if any(c not in result for c in subs)]
        self.applied_weight(node, summed, "einsum")
        letters: dict[str, _Feature] = {}  # the permuted letters, each with its units
        for x, subs in zip(operands, subscripts):
            f = self.feature(x)
            if not self.permuted(f):
                continue
            letter = subs[f.dim]
            if subs.count(letter) > 1:
                self.fail(node, f"einsum {args[0]!r} takes a diagonal along permuted units; give a spec")
            seen = letters.setdefault(letter, f)
            if (seen.outer, seen.inner) != (f.outer, f.inner):
                self.fail(node, f"einsum {args[0]!r} meets units that lie in different blocks; give a spec")
            self.classes.union(seen.var, f.var)
        for x, subs in zip(operands, subscripts):  # every operand holding a permuted letter holds its units
            f, shape = self.feature(x), _tensor_shape(x)
            raw = self.raw(x)
            if isinstance(raw, tuple) and raw[0] == "param":  # a number per unit (a layer scale): permuted with them
                self.einsum_parameter(raw[1], subs, shape, letters)
                self.consumed.add((node, x))
                continue
            for at, letter in enumerate(subs):
                if letter in letters and shape[at] != 1 and not (self.permuted(f) and f.dim == at):
                    self.fail(
                        node,
                        f"einsum {args[0]!r}: an operand ({x.name}) whose units cannot be followed meets "
                        "permuted units; give a spec",
                    )
        kept = [letter for letter in letters if letter in result]
        if len(kept) > 1:
            self.fail(node, f"einsum {args[0]!r} of two permuted streams (an outer product) cannot be followed")
        if kept:
            f = letters[kept[0]]
            self.labels[node] = _Feature(f.var, result.index(kept[0]), f.outer, f.inner)
        else:
            self.labels[node] = None  # summed over units: the same whatever their order

    def einsum_parameter(self, target: str, subs: list[str], shape: tuple, letters: dict) -> None:
        """A parameter (or buffer) operand of an einsum, ``"btd,d->btd"``'s ``d``: its axes whose
        letters are permuted units hold numbers per unit, moved with them (as :meth:`param_axis`
        moves a parameter combined with a stream); a buffer's fix their width."""
        dims: list[tuple[int, int, int] | None] = [None] * len(subs)
        for at, letter in enumerate(subs):
            if letter in letters and shape[at] != 1:
                g = letters[letter]
                dims[at] = (g.var, g.outer, g.inner)
                if target not in self.parameters:
                    self.buffer_along(g.var, target)
        if any(d is not None for d in dims):
            self.set_axes(target, dims)

    def repeat_interleave(self, node, args: list, kwargs) -> None:
        """``x.repeat_interleave(repeats, dim)`` along another axis than the units' (a global query
        repeated for every window of a batch): the units stay where they are; along theirs, or
        over every number (no ``dim``), each unit's numbers are copied and the units cannot be followed."""
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
        label = self.raw(args[0])
        if isinstance(dim, int) and isinstance(label, _Feature) and dim % len(_tensor_shape(args[0])) != label.dim:
            self.labels[node] = label
            return
        self.opaque(node, [*args, *kwargs.values()], "repeat_interleave")

    def attention(self, node, q, k, v, scale) -> None:
        """``scaled_dot_product_attention(q, k, v)``: q and k's units are tied; the result has v's.

        Its default scale is ``1 / sqrt`` of the queries' width, which fusion may change: with
        permuted queries the scale must be given (``scale=``), a constant of the clients'."""
        fq, fk, fv = (f if self.permuted(f) else None for f in (self.feature(q), self.feature(k), self.feature(v)))
        last = len(_tensor_shape(node)) - 1
        if (fq is None) != (fk is None) or any(f is not None and f.dim != last for f in (fq, fk, fv)):
            self.fail(node, "attention whose queries, keys or values hold their units on another axis; give a spec")
        if fq is not None:
            assert fk is not None  # refused above unless both or neither are permuted
            if (fq.outer, fq.inner) != (fk.outer, fk.inner):
                self.fail(node, "queries and keys whose units lie in different blocks")
            if scale is None:
                self.mark_fixed(fq.var, "scaled_dot_product_attention without scale= scales by the queries' width")
            self.classes.union(fq.var, fk.var)
        self.labels[node] = fv

    def concat(self, node, tensors, dim: int) -> None:
        if not isinstance(tensors, (list, tuple)):
            self.opaque(node, [tensors], "cat of what cannot be read as a list of tensors")
            return
        rank = len(_tensor_shape(node))
        dim = dim % rank
        tensors = [t for t in tensors if not _adds_nothing(t, dim)]
        if any(isinstance(self.raw(t), _Segments) and self.raw(t).dim == dim for t in tensors):
            self.side_by_side(node, tensors, dim)
            return
        self.read_whole(tensors)
        features = [self.raw(t) for t in tensors]
        streams = [f for f in features if isinstance(f, _Feature)]
        if not streams:
            self.labels[node] = None
            return
        f = streams[0]
        if dim == f.dim and any(self.permuted(s) for s in streams):
            self.units_concat(node, tensors, features, f)
            return
        for g, t in zip(features, tensors):
            if g is None and isinstance(t, fx.Node) and self.permuted(f):
                self.fail(
                    node,
                    f"an operand ({t.name}) whose units cannot be followed is concatenated with a "
                    "permuted stream; give a spec",
                )
            if isinstance(g, _Feature):
                self.classes.union(f.var, g.var)
            elif isinstance(g, tuple):  # a class token: its units are the stream's, on the same axis
                self.param_axis(g[1], node, f, _tensor_shape(node))
                self.consumed.add((node, t))
        self.labels[node] = f

    def read_whole(self, tensors: list) -> None:
        """Refuse, where they are read as tensors, operands that are none: indices naming units, an
        LSTM's ``(h, c)``, a chunk's pieces."""
        for t in tensors:
            if isinstance(self.raw(t), (_Unreadable, _Recurrent, _Parts, _Segments)):
                self.feature(t)

    def stack(self, node, tensors, dim) -> None:
        """``torch.stack(tensors, dim)``: a new axis, the operands' units on theirs (one
        permutation for all, as ``a + b`` ties them), moved by one where the new axis is before.
        ``tensors`` may be a list, or one node holding pieces (``torch.stack(h.chunk(2, -1), 1)``)."""
        parts = self.raw(tensors) if isinstance(tensors, fx.Node) else None
        if isinstance(parts, _Parts):
            tensors, features = (
                [tensors] * len(parts.parts),
                [p if isinstance(p, _Feature) else None for p in parts.parts],
            )
        elif isinstance(tensors, (list, tuple)):
            tensors = list(tensors)
            self.read_whole(tensors)
            features = [self.raw(t) if isinstance(self.raw(t), _Feature) else None for t in tensors]
        else:
            self.opaque(node, [tensors], "stack of what cannot be read as a list of tensors")
            return
        if not isinstance(dim, int):
            self.opaque(node, tensors, "stack along a dim computed in the forward")
            return
        permuted = [f for f in features if self.permuted(f)]
        if not permuted:
            self.labels[node] = None
            return
        f = permuted[0]
        for g, t in zip(features, tensors):
            if g is None or g.dim != f.dim or (g.outer, g.inner) != (f.outer, f.inner):
                what = t.name if isinstance(t, fx.Node) else repr(t)
                self.fail(node, f"stacking an operand ({what}) whose units are not the others' (their axis, blocks)")
            self.classes.union(f.var, g.var)
        dim %= len(_tensor_shape(node))
        self.labels[node] = _Feature(f.var, f.dim + (dim <= f.dim), f.outer, f.inner)

    def units_concat(self, node, tensors: list, features: list, f: _Feature) -> None:
        """Streams side by side on their units' axis (``torch.cat([a, b], 1)``). Where they are one
        permutation's units already (``cat([a, b, a * b])``, a layer's pieces put back), each is a
        block of the result; otherwise each keeps its own permutation, side by side
        (:meth:`side_by_side`): streams of one width are not tied, as their units need not match."""
        for g in features:
            if not (
                isinstance(g, _Feature)
                and self.permuted(g)
                and g.dim == f.dim
                and g.inner == f.inner
                and self.classes.find(g.var) == self.classes.find(f.var)
            ):
                self.side_by_side(node, tensors, f.dim)
                return
        self.labels[node] = _Feature(f.var, f.dim, sum(g.outer for g in features), f.inner)

    def side_by_side(self, node, tensors: list, dim: int) -> None:
        """Streams concatenated on their units that one permutation cannot describe: of different
        widths, or beside the input or numbers no permutation moves (DenseNet's ``cat([x, f(x)],
        1)``, Inception's branches). Each keeps its own permutation and the result holds them side
        by side (:class:`_Segments`); a layer reading it has a weight the spec describes by
        pieces, one per stream (:attr:`~bayesfuse.inference.spec.PermutationSpec.pieces`)."""
        parts: list = []
        for t in tensors:
            if not isinstance(t, fx.Node) or _shape(t) is None:
                self.fail(node, f"concatenating on the units' axis {t!r}, which is no tensor of the graph")
            g, length = self.raw(t), _tensor_shape(t)[dim]
            if length == 0:  # nothing on the axis (x[:, :0]): no piece
                continue
            if isinstance(g, _Segments):
                if g.dim != dim:
                    self.fail(node, f"concatenating on one axis streams side by side ({t.name}) on another")
                parts.extend(g.parts)
                continue
            if isinstance(g, (_Unreadable, _Recurrent, _Parts)):
                self.feature(t)  # refused
            if isinstance(g, _Feature) and self.permuted(g):
                if g.dim != dim:
                    self.fail(node, f"concatenating on one axis an operand ({t.name}) whose units lie on another")
                parts.append((g, length))
            else:  # the input, a constant, a sum over units: numbers no permutation moves
                parts.append((None, length))
        self.labels[node] = _Segments(dim, tuple(parts))

    def pieces(self, node, args: list, kwargs, signature: tuple, what: str) -> None:
        """``chunk`` / ``split`` / ``tensor_split`` / ``unbind`` / ``glu`` of ``args[0]``.

        Along another axis than the units' every piece keeps the units. Along the units' axis the
        pieces must be equal (a gated unit's halves, a fused projection's queries, keys and
        values): each is then a run of whole blocks of the layer's units, one permutation for all
        (:meth:`refine` cuts the units into blocks where the pieces cut through them), so a
        global unit is one unit of every piece, and the layers writing the axis are matched so.
        ``glu`` multiplies its two halves unit by unit: its result is one piece. ``unbind`` of
        the units' axis (every unit alone) is refused."""
        count, dim_name, default = signature
        at = 1 if count is None else 2
        dim = args[at] if len(args) > at else kwargs.get(dim_name, default)
        if isinstance(dim, fx.Node) or not isinstance(dim, int):
            self.opaque(node, [*args, *kwargs.values()], f"{what} along a dim computed in the forward")
            return
        a = args[0]
        label, src = self.raw(a), _shape(a)
        f = label if isinstance(label, _Feature) else None
        if src is None or f is None:
            self.opaque(node, [*args, *kwargs.values()], what)
            return
        rank = len(src)
        dim %= rank
        meta = node.meta.get("tensor_meta")  # one TensorMetadata (itself a tuple) per piece; glu's, one tensor
        if what == "glu":
            shapes: list | None = [tuple(_tensor_shape(node))] * 2
        else:
            shapes = [tuple(m.shape) for m in meta] if isinstance(meta, (tuple, list)) else None
        if shapes is None:
            self.opaque(node, [*args, *kwargs.values()], what)
            return
        if what == "unbind":
            if dim == f.dim and self.permuted(f):
                self.fail(node, "unbind of the units' axis takes every unit alone: cannot be followed; give a spec")
            piece: _Feature | None = None if dim == f.dim else _Feature(f.var, f.dim - (dim < f.dim), f.outer, f.inner)
        elif dim != f.dim or not self.permuted(f):
            piece = f
        else:
            sizes = args[1] if len(args) > 1 else kwargs.get(count)
            by_widths = what in ("split", "tensor_split") and not (what == "tensor_split" and isinstance(sizes, int))
            lengths = [s[dim] for s in shapes]
            if what == "split" and len(set(lengths)) > 1:
                self.unequal_split(node, f, lengths, sizes)
                return
            piece = self.equal_pieces(node, f, lengths)
            listed = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes]
            if by_widths and not all(self.scales(w) or isinstance(w, _HeldWidth) for w in listed):
                self.mark_fixed(piece.var, f"its forward cuts them by {what}({sizes}), {_kept(listed)}")
            elif by_widths:  # split(self.n_embd): a piece's width the module holds, set to the fused one
                for w in listed:
                    if isinstance(w, _HeldWidth):
                        self.held.append((w.path, piece.var, piece.outer, piece.inner, w.factor))
        if what == "glu":
            self.labels[node] = piece
        else:
            self.labels[node] = _Parts((piece,) * len(shapes))

    def unequal_split(self, node, f: _Feature, lengths: list, sizes) -> None:
        """``split`` of the units' axis into pieces of different widths (``q, k, v =
        qkv.split([dk, dk, dv], -1)``): each piece is a group of its own, and every axis that held
        the units holds the pieces side by side (:meth:`segment`: the layer making them is
        described by its rows' pieces, as a layer reading streams side by side is by its
        columns'). A piece's width given as a number the module holds (``self.dk``) follows the
        fusion; one read off a tensor's units is theirs; one written in the code is fixed."""
        if (f.outer, f.inner) != (1, 1) or not self.plain(f.var):
            self.fail(
                node,
                f"cutting the units' axis into pieces of widths {lengths}: pieces of different widths are "
                "followed only where the units are one number each everywhere, not blocks (heads, a group norm's "
                "groups, a recurrent layer's gates or directions); give a spec",
            )
        news = self.segment(node, f.var, lengths)
        listed = list(sizes) if isinstance(sizes, (list, tuple)) else []
        for v, w in zip(news, listed + [None] * (len(news) - len(listed))):
            if isinstance(w, _HeldWidth):  # self.dk: the rebuild sets it to the piece's fused width
                self.held.append((w.path, v, 1, 1, w.factor))
                continue
            read = _size_read(w)
            at = self.units_at(*read) if read is not None else None
            if at is not None and at[1:] == (1, 1):  # x.shape[-1]: the width of x's units
                self.classes.union(v, at[0])
            else:
                self.mark_fixed(v, f"its forward cuts them into pieces of widths {lengths}, {_kept([w])}")
        self.labels[node] = _Parts(tuple(_Feature(v, f.dim) for v in news))

    def plain(self, var: int) -> bool:
        """Whether every recorded axis and activation of ``var``'s class holds its units one number
        each (no blocks: ``outer = inner = 1``)."""
        root = self.classes.find(var)

        def ok(d) -> bool:
            if isinstance(d, _Cat):
                return all(p[0] is None or self.classes.find(p[0]) != root or p[1:3] == (1, 1) for p in d.parts)
            return d is None or self.classes.find(d[0]) != root or tuple(d[1:]) == (1, 1)

        def plain_label(label) -> bool:
            if isinstance(label, _Feature):
                return self.classes.find(label.var) != root or (label.outer, label.inner) == (1, 1)
            if isinstance(label, _Parts):
                return all(plain_label(p) for p in label.parts)
            if isinstance(label, _Recurrent):
                return plain_label(label.output) and plain_label(label.state)
            if isinstance(label, _Segments):
                return all(plain_label(g) for g, _ in label.parts)
            return True

        return all(ok(d) for dims in self.axes.values() for d in dims) and all(
            plain_label(label) for label in self.labels.values()
        )

    def segment(self, node, var: int, lengths: list) -> list[int]:
        """Re-describe ``var``'s class as runs of new classes, ``lengths`` units each: every axis
        that held its units holds the new classes' side by side (:class:`_Cat`, the spec's pieces),
        every activation their streams side by side (:class:`_Segments`). Returns the new classes."""
        root = self.classes.find(var)
        if any(self.classes.find(p[1]) == root for p in self.held):
            self.fail(node, "units whose width a module holds, split into pieces of different widths; give a spec")
        news = [self.new() for _ in lengths]
        parts = tuple((v, 1, 1, n) for v, n in zip(news, lengths))  # the units are one number each (plain)
        self.rewrite(
            root,
            news,
            lambda outer, inner: parts,
            lambda f: _Segments(f.dim, tuple((_Feature(v, f.dim), n) for v, n in zip(news, lengths))),
        )
        both = next((e for e, dims in self.axes.items() if sum(isinstance(d, _Cat) for d in dims) > 1), None)
        if both is not None:
            self.fail(
                node,
                f"units split into pieces of different widths that {both!r} also reads: an entry holds pieces on "
                "two of its axes; give a spec",
            )
        self.segmented.add(root)
        return news

    def rewrite(self, root: int, news: list[int], parts_of, label_of) -> None:
        """Re-describe class ``root`` by the classes ``news``, just made (:meth:`redescribe`,
        :meth:`segment`), named where its units first appeared, not where they were re-described:
        the groups keep their forward order, in which layer-wise matching reads them (a layer made
        before a cut that reads them, a squeeze-and-excitation's, is matched after them). Every
        axis of ``root`` becomes ``parts_of(outer, inner)``, ``((var, outer, inner, length or None),
        ...)``: one axis where that is one part of the axis's own length, else the parts side by
        side (:class:`_Cat`); every activation's units ``label_of(feature)``, spliced into the
        streams side by side it was one of; its fixed groups and producers are the new classes'."""
        del self.order[-len(news) :]
        at = next(i for i, v in enumerate(self.order) if self.classes.find(v) == root)
        self.order[at:at] = news

        def mine(v) -> bool:
            return v is not None and self.classes.find(v) == root

        def cut(d):
            if isinstance(d, _Cat):
                return _Cat(
                    tuple(
                        q
                        for p in d.parts
                        for q in (
                            tuple((v, o, i, p[3] if n is None else n) for v, o, i, n in parts_of(p[1], p[2]))
                            if mine(p[0])
                            else (p,)
                        )
                    )
                )
            if d is None or not mine(d[0]):
                return d
            parts = parts_of(d[1], d[2])
            return tuple(parts[0][:3]) if len(parts) == 1 and parts[0][3] is None else _Cat(tuple(parts))

        def relabel(label):
            if isinstance(label, _Feature):
                return label_of(label) if mine(label.var) else label
            if isinstance(label, _Parts):
                return _Parts(tuple(relabel(p) for p in label.parts))
            if isinstance(label, _Recurrent):
                return _Recurrent(relabel(label.output), relabel(label.state))
            if isinstance(label, _Segments):
                spliced: list = []
                for g, n in label.parts:
                    h = relabel(g)
                    spliced.extend(h.parts if isinstance(h, _Segments) else [(h, n)])
                return _Segments(label.dim, tuple(spliced))
            return label

        self.axes = {entry: [cut(d) for d in dims] for entry, dims in self.axes.items()}
        self.labels = {node: relabel(label) for node, label in self.labels.items()}
        self.fixed = [(w, why) for v, why in self.fixed for w in (news if mine(v) else [v])]
        for v, name in list(self.var_producer.items()):
            if mine(v):
                for w in news:
                    self.var_producer.setdefault(w, name)

    def equal_pieces(self, node, f: _Feature, lengths: list) -> _Feature:
        """The units of each of ``len(lengths)`` equal pieces of ``f``'s axis."""
        c, length = len(lengths), sum(lengths)
        n = length // (f.outer * f.inner)
        m = c // np.gcd(f.outer, c)  # blocks per unit run, so that every piece is whole blocks
        if len(set(lengths)) > 1 or n % m:
            self.fail(
                node,
                f"cutting the units' axis into pieces of widths {lengths}: each piece must hold whole units of "
                "one permutation, so equal pieces of a whole number of them; give a spec",
            )
        var = self.refine(f.var, int(m)) if m > 1 else f.var
        return _Feature(var, f.dim, f.outer * int(m) // c, f.inner)

    def coarsen(self, var: int, k: int) -> int:
        """Re-describe the units of ``var``'s class as runs of ``k`` consecutive units of a new
        class: every axis and activation recorded so far, ``outer x n x inner``, becomes ``outer x
        (n / k) x (inner * k)`` (the same numbers in the same place, ``k`` units now one): a
        restriction that moves them together (the converse of :meth:`refine`)."""
        root, new = self.redescribe(var, 1, k, "coarsen")
        self.coarse.add(root)  # a module called again cannot find its units (resolve refuses)
        return new

    def refine(self, var: int, m: int) -> int:
        """Re-describe the units of ``var``'s class as ``m`` blocks of a new class: every axis and
        activation recorded so far, ``outer x n x inner``, becomes ``(outer * m) x (n / m) x
        inner`` (the same numbers in the same place, a unit's ``m`` numbers now one unit)."""
        root, new = self.redescribe(var, m, 1, "refine")
        self.cut[root] = (new, m)  # a module called again finds its units through this (resolve)
        return new

    def redescribe(self, var: int, m: int, k: int, what: str) -> tuple[int, int]:
        """``(root, new)``: every axis and activation of ``var``'s class (``root``), ``outer x n x
        inner``, re-described as a new class's, ``(outer * m) x (n / (m k)) x (inner * k)``
        (:meth:`refine`, :meth:`coarsen`)."""
        root = self.classes.find(var)
        if root == _FIXED:  # the input's and the classes' axes are never permuted, so never cut
            raise AssertionError(f"{what} of the class that is never permuted")
        new = self.new()
        self.classes.tie(root, new)
        self.rewrite(
            root,
            [new],
            lambda outer, inner: ((new, outer * m, inner * k, None),),
            lambda f: _Feature(new, f.dim, f.outer * m, f.inner * k),
        )
        self.held = [
            (path, new, outer * m, inner * k, factor)
            if self.classes.find(v) == root
            else (path, v, outer, inner, factor)
            for path, v, outer, inner, factor in self.held
        ]
        return root, new

    def reduce_along(self, node, args: list, kwargs, *, at: int):
        """:meth:`reduce` of ``args[0]`` along the ``dim`` given at place ``at`` (1; a norm's, after
        its order, 2) or by keyword, ``keepdim`` after it or by keyword; returns the ``dim``."""
        dim = args[at] if len(args) > at else kwargs.get("dim")
        self.reduce(node, args[0], dim, args[at + 1] if len(args) > at + 1 else kwargs.get("keepdim", False))
        return dim

    def reduce(self, node, a, dims, keepdim: bool) -> None:
        label = self.raw(a)
        f = _Feature(_FIXED, label.dim) if isinstance(label, _Segments) else self.feature(a)
        if not isinstance(f, _Feature):
            self.labels[node] = None
            return
        rank = len(_tensor_shape(a))
        if isinstance(dims, bool):  # std(h, True): unbiased, over every number
            dims = None
        if any(isinstance(d, fx.Node) for d in (dims if isinstance(dims, (list, tuple)) else [dims])):
            self.fail(
                node, f"{_name(node.target)} along a dim computed in the forward cannot be read; give it as a number"
            )
        out = _shape(node)  # a keepdim given by place (h.mean(1, True), h.std(1, True, True)) shows in the shape
        keepdim = keepdim if out is None or dims is None else len(out) == rank
        listed = dims if isinstance(dims, (list, tuple)) else [dims]
        dims = range(rank) if dims is None else [d % rank for d in listed]
        if f.dim in dims:  # a sum over units: the same whatever their order
            self.labels[node] = None
            return
        new = f.dim if keepdim else f.dim - sum(d < f.dim for d in dims)
        self.labels[node] = (
            _moved(label, new) if isinstance(label, _Segments) else _Feature(f.var, new, f.outer, f.inner)
        )

    def extremum(self, node, args: list, kwargs) -> None:
        """``max`` / ``min``: of two tensors element by element (as ``torch.maximum``); of every
        number (no ``dim``); or along ``dim``, ``(values, indices)``, whose indices along the units'
        axis name units: refused where they are read."""
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if isinstance(other, fx.Node) and _shape(other) is not None:  # a tensor: element by element
            self.binary(node, args[0], other)
            return
        if self.reduce_along(node, args, kwargs, at=1) is None:  # over every number: a number
            return
        values = self.labels[node]
        self.labels[node] = _Parts((values, self.indices(args[0], values, f"{_name(node.target)} over the units")))

    def arg_extremum(self, node, args: list, kwargs) -> None:
        """``argmax`` / ``argmin`` along ``dim`` (over every number without one): where the largest lies."""
        self.reduce_along(node, args, kwargs, at=1)
        self.labels[node] = self.indices(args[0], self.labels[node], f"{_name(node.target)} over the units")

    def ordered(self, node, args: list, kwargs, name: str) -> None:
        """``topk`` and ``sort`` (the axis kept), ``kthvalue`` and ``mode`` (the axis reduced) along
        ``dim``: ``(values, indices)``. Along the units' axis the values do not depend on the units'
        order (ordered by size, as a max is) and have no units, and the indices name units: refused
        where they are read (as are ``topk(..., sorted=False)``'s values, in no set order). Along
        another axis both keep the units."""
        at, default, keeps = _ORDERED[name]
        dim = args[at] if len(args) > at else kwargs.get("dim", default)
        a = args[0]
        if not keeps:
            keepdim = args[at + 1] if len(args) > at + 1 else kwargs.get("keepdim", False)
            self.reduce(node, a, dim, keepdim)
        else:
            label = self.raw(a)
            f = label if isinstance(label, _Segments) else self.feature(a)  # streams side by side: as one
            if isinstance(dim, fx.Node):
                self.fail(node, f"{name} along a dim computed in the forward cannot be read; give it as a number")
            along = f is not None and f.dim == dim % len(_tensor_shape(a))
            self.labels[node] = None if along else f
            streams = [g for g, _ in f.parts] if isinstance(f, _Segments) else [f]
            permuted = [g.var for g in streams if isinstance(g, _Feature) and self.permuted(g)]
            unsorted = name == "topk" and not (args[4] if len(args) > 4 else kwargs.get("sorted", True))
            if along and unsorted and permuted:
                values = _Unreadable("topk over the units, unsorted, gives them in no set order: cannot be followed")
                self.labels[node] = _Parts((values, values))
                return
            # the values keep as many numbers as there are units (sort; topk of k read off their
            # width): a layer reading them reads the units' width, which fusion may not change
            k = args[1] if len(args) > 1 else kwargs.get("k")
            if along and (name == "sort" or self.widths_read(k, whole=True)):
                for var in permuted:
                    self.mark_fixed(var, f"its forward orders them by {name} and keeps as many numbers as units")
        values = self.labels[node]
        self.labels[node] = _Parts((values, self.indices(a, values, f"{name} over the units")))

    def indices(self, a, values, what: str):
        """The label of the indices of a reduction of ``a`` whose values are labelled ``values``:
        those of ``values`` where the units were kept; where a permuted axis of units was reduced,
        the indices name units, and are refused where they are read."""
        if values is None and self.has_units(self.through(a)):
            return _Unreadable(f"{what} names units by their place, which fusion changes: cannot be followed")
        return values

    def move(self, node, a) -> None:
        label = self.raw(a)
        f = _Feature(_FIXED, label.dim) if isinstance(label, _Segments) else self.feature(a)
        if not isinstance(f, _Feature):
            self.labels[node] = None
            return
        src, dst = _tensor_shape(a), _tensor_shape(node)
        size = src[f.dim]
        matches = [d for d, n in enumerate(dst) if n == size]
        if node.target in ("unsqueeze", "squeeze", torch.unsqueeze, torch.squeeze):
            self.reshape(node, a)
            return
        try:
            new = _axes_order(_name(node.target), list(node.args[1:]), node.kwargs, len(src)).index(f.dim)
        except (TypeError, ValueError, KeyError):  # axes computed in the forward, or given another way
            new = -1
        if new not in matches:
            self.fail(node, "could not follow the units through this transpose")
        self.labels[node] = (
            _moved(label, new) if isinstance(label, _Segments) else _Feature(f.var, new, f.outer, f.inner)
        )

    def spatial(self, node, a, k: int | None, what: str, *, pad=None) -> None:
        """Padding and upsampling of ``a``: they act on the axes after the channels (the last
        ``k``; every axis from 2 where ``k`` is None, as upsampling); units on those are refused,
        unless ``F.pad``'s ``pad`` gives their axis nothing (Swin's ``F.pad(x, (0, 0, 0, r, 0, b))``
        of channels-last windows)."""
        f, rank = self.through(a), len(_tensor_shape(a))
        if self.has_units(f) and f.dim >= rank - (rank - 2 if k is None else k):
            back = rank - 1 - f.dim  # the units' axis, counted from the last, as pad's pairs are
            if pad is None or any(not isinstance(p, int) or p != 0 for p in pad[2 * back : 2 * back + 2]):
                self.fail(node, f"{what} acts on the units' axis")
        self.labels[node] = f

    def scalar_elementwise(self, node, args: list, kwargs) -> None:
        """An element-wise function of the activation and numbers (``h ** 2``, ``clamp(h, 0, 6)``), or
        of tensors too (``clamp(h, max=m)``, :meth:`elementwise_tensors`); else :meth:`opaque`."""
        values = list(args) + list(kwargs.values())
        tensors = [v for v in values if isinstance(v, fx.Node)]
        if tensors and all(v is None or isinstance(v, (int, float, fx.Node)) for v in values):
            self.elementwise_tensors(node, values)  # h ** 2, 2 ** h, clamp(h, 0, 6), clamp(h, max=m)
        else:
            self.opaque(node, args + list(kwargs.values()), getattr(node.target, "__name__", str(node.target)))

    def elementwise_tensors(self, node, values: list) -> None:
        """An element-wise function of tensors (and numbers), broadcast: one tensor's units pass
        (``h ** 2``); several tensors' (``where(mask, a, b)``, ``clamp(h, min=lo, max=hi)``) are
        tied as a sum's (:meth:`binary`), one after another into the result."""
        tensors = [v for v in values if isinstance(v, fx.Node)]
        if len(tensors) == 1:
            self.labels[node] = self.through(tensors[0])
            return
        self.binary(node, tensors[0], tensors[1])
        for t in tensors[2:]:
            self.binary(node, node, t)

    def attribute(self, node, a, name) -> None:
        """``a.T``, ``a.mT`` (``.H``, ``.mH``): the units move with the axes; any other attribute
        of a permuted activation that is a tensor is refused; ``a.shape``, ``a.dtype``... are no tensor;
        ``.values`` and ``.indices`` of a ``max`` / ``min`` along a dim are its parts."""
        parts = self.raw(a)
        if isinstance(parts, _Parts) and name in ("values", "indices"):
            self.labels[node] = parts.parts[name == "indices"]
            return
        if isinstance(parts, _Segments) and (_shape(node) is None or name in ("T", "H", "mT", "mH")):
            rank = len(_tensor_shape(a))  # x.shape, x.dtype: no tensor; x.T, x.mT: their axis moves
            swap = {rank - 1: rank - 2, rank - 2: rank - 1} if name in ("mT", "mH") else {}
            moved = rank - 1 - parts.dim if name in ("T", "H") else swap.get(parts.dim, parts.dim)
            self.labels[node] = None if _shape(node) is None else _moved(parts, moved)
            return
        f = self.feature(a)
        self.labels[node] = None
        if f is None or _shape(node) is None:
            return
        rank = len(_tensor_shape(a))
        if name in ("T", "H"):
            self.labels[node] = _Feature(f.var, rank - 1 - f.dim, f.outer, f.inner)
        elif name in ("mT", "mH"):
            swap = {rank - 1: rank - 2, rank - 2: rank - 1}
            self.labels[node] = _Feature(f.var, swap.get(f.dim, f.dim), f.outer, f.inner)
        elif self.permuted(f):
            self.fail(node, f"the attribute {name!r} of an activation with permuted units cannot be followed")

    def getitem(self, node, a) -> None:
        label = self.raw(a)
        if isinstance(label, (_Recurrent, _Parts)):
            index = node.args[1]
            parts = (label.output, label.state) if isinstance(label, _Recurrent) else label.parts
            if not isinstance(index, int) or not -len(parts) <= index < len(parts):
                self.fail(
                    node,
                    "indexing a recurrent layer's (output, state) other than by 0 or 1"
                    if isinstance(label, _Recurrent)
                    else f"indexing {len(parts)} pieces other than by a number from 0 to {len(parts) - 1}",
                )
            self.labels[node] = parts[index]
            return
        self.index_labels(node, a)
        self.index_read(node)

    def index_labels(self, node, a) -> None:
        """:meth:`getitem`'s labelling of ``a[index]`` where ``a`` is one tensor."""
        f = self.feature(a)
        if not isinstance(f, _Feature):
            self.labels[node] = None
            return
        dst = _shape(node)
        if dst is None:
            self.opaque(node, [a], "indexing")
            return
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        where = _indexed_axis(index, len(_tensor_shape(a)), f.dim, len(dst))
        if where == "into" and self.permuted(f) and f.outer > 1 and f.inner == 1:
            blocks = self.whole_blocks(index, f, _tensor_shape(a), len(dst))
            if blocks is not None:
                self.labels[node] = blocks
                return
        if where == "into" and self.permuted(f):  # units picked by their places: none may move
            self.hold_in_place(f.var, f"its forward indexes into them, {node.name}")
        elif where is None and self.permuted(f):
            self.fail(node, "indexing that moves the units' axis is not supported")
        if where is None or where == "into":
            self.labels[node] = None
            return
        self.labels[node] = _Feature(f.var, int(where), f.outer, f.inner)

    def index_read(self, node) -> None:
        """Refuse the tensors that index (in a tuple or a list of them too) where they name units by
        their place or run along permuted units: ``self.E[h.argmax(-1)]`` picks rows of ``E`` by where
        the largest unit lies, and ``x[:, h.argmax(-1)]`` numbers of the input, which fusion moves."""
        for element in _flat([node.args[1]]):
            if not isinstance(element, fx.Node) or self.raw(element) is None:
                continue
            f = self.feature(element)  # refuses indices that name units (argmax over them)
            if isinstance(f, _Feature) and self.permuted(f):
                self.fail(node, "indexing by a tensor along permuted units is not supported")

    def whole_blocks(self, index: tuple, f: _Feature, shape: tuple, out_rank: int) -> _Feature | None:
        """``f``'s units where ``index`` slices whole blocks of them out of their axis (one
        direction of a bidirectional layer's output, ``out[..., :H]``), else None: every block is
        permuted alike, so the blocks kept are."""
        at = _element_at(index, len(shape), f.dim)
        if at is None:
            return None
        element = index[at]
        if not isinstance(element, slice) or element.step not in (None, 1):
            return None
        bounds = [None if v is None else self.number(v) for v in (element.start, element.stop)]
        if any(b is None and v is not None for b, v in zip(bounds, (element.start, element.stop))):
            return None
        size = shape[f.dim]
        start, stop, _ = slice(*bounds).indices(size)
        n = size // f.outer
        if stop <= start or start % n or stop % n:
            return None
        whole = index[:at] + (slice(None),) + index[at + 1 :]
        where = _indexed_axis(whole, len(shape), f.dim, out_rank)
        if not isinstance(where, int):
            return None
        if any(v is not None and v != 0 and not self.scales(v) for v in (element.start, element.stop)):
            bounds = [v for v in (element.start, element.stop) if v is not None]
            self.mark_fixed(f.var, f"its forward slices them at {element.start}:{element.stop}, {_kept(bounds)}")
        return _Feature(f.var, where, (stop - start) // n, 1)

    def reshape(self, node, a) -> None:
        """Follow the units through a reshape that keeps each unit's numbers in one axis, or that
        cuts the units' axis into heads (:meth:`heads_split`); one to another tensor's whole shape
        (``x.view(y.shape)``) takes its width from that tensor's units (:meth:`width_as`)."""
        self.reshape_units(node, a)
        other = _whole_shape_of(node)
        if other is not None:
            self.width_as(node, other)

    def unmoved_reshaped(self, node, src: tuple) -> None:
        """Fix the widths a reshape of numbers no permutation moves (units held in place) reads off
        permuted units for its target (EVA's attention, ``x.reshape(B, N, C)`` with ``C`` the
        stream's width): the numbers keep their count, so the stream may not grow away from it."""
        shape_args = _target_shape(node)
        if shape_args is None or int(np.prod(src)) == 0:
            return
        for value in shape_args:
            self.fix_widths_read(
                value, f"its forward reshapes numbers no permutation moves to their width, {node.name}"
            )

    def reshape_units(self, node, a) -> None:
        """:meth:`reshape`'s labelling of the result."""
        if isinstance(self.raw(a), _Segments):
            self.segments_reshape(node, a, self.raw(a))
            return
        f = self.feature(a)
        if not isinstance(f, _Feature):
            self.labels[node] = None
            self.unmoved_reshaped(node, _tensor_shape(a))
            return
        src, dst = _tensor_shape(a), _tensor_shape(node)
        placed = _placed(f, src, dst)
        if placed is None and not self.permuted(f):
            self.labels[node] = None
            self.unmoved_reshaped(node, src)
            return
        shape_args = _target_shape(node)
        if shape_args is not None and len(shape_args) != len(dst):
            shape_args = None
        out = self.labels[node] = placed if placed is not None else self.heads_split(node, f, src, dst, shape_args)
        if self.permuted(f) and shape_args is not None:
            width = shape_args[out.dim]
            if isinstance(width, _HeldWidth):  # self.hidden_dim: the rebuild sets it to the fused width
                self.held.append((width.path, out.var, out.outer, out.inner, width.factor))
            for x, axis in self.widths_read(width):
                self.tie_width(node, x, axis, node)

    def reshape_as(self, node, a, other) -> None:
        """``a.reshape_as(other)``: a reshape whose target width is ``other``'s, tied to the units
        ``other`` holds on that axis (as :meth:`tie_width` ties a width read off a tensor); where
        ``other`` holds none there, the width is the clients' and stays."""
        self.reshape(node, a)
        self.width_as(node, other)

    def width_as(self, node, other) -> None:
        """The units of reshape ``node``, whose target shape is ``other``'s whole, at ``other``'s
        width: tied to the units ``other`` holds on that axis; where it holds none, fixed. Units
        ``other`` holds on an axis where ``node`` has none (numbers of the input reshaped to their
        width) keep their width too."""
        out = self.labels.get(node)
        for axis in range(len(_tensor_shape(other))):
            at = self.units_at(other, axis)
            if at is not None and not (isinstance(out, _Feature) and self.permuted(out) and out.dim == axis):
                self.mark_fixed(at[0], f"its forward reshapes {node.args[0].name} to their width, as {other.name}")
        if not isinstance(out, _Feature) or not self.permuted(out):
            return
        if self.units_at(other, out.dim) is None:
            self.mark_fixed(out.var, f"its forward reshapes them as {other.name}, which holds no units on their axis")
        else:
            self.tie_width(node, other, out.dim, node)

    def segments_reshape(self, node, a, label: _Segments) -> None:
        """A reshape of streams side by side that keeps their axis, with the axes before it merged
        or split, or flattens it with axes after it (``torch.flatten(x, 1)`` of concatenated
        channels' maps, ``view(B, -1)``, ``unsqueeze``): each stream's units become blocks of their
        numbers. Anything else is refused."""
        src, dst = _tensor_shape(a), _tensor_shape(node)
        d = label.dim
        for k in (k for k in range(len(dst)) if int(np.prod(dst[:k])) == int(np.prod(src[:d]))):
            for j in range(d + 1, len(src) + 1):
                s = int(np.prod(src[d + 1 : j]))
                if dst[k] == src[d] * s and int(np.prod(dst[k + 1 :])) == int(np.prod(src[j:])):
                    self.labels[node] = _moved(label, k, s)
                    self.segments_width(node, label, k)
                    return
        self.fail(
            node,
            f"this reshape {tuple(src)} -> {tuple(dst)} of streams concatenated on their units cannot be followed "
            "(keep their axis, or flatten it with the ones after it)",
        )

    def segments_width(self, node, label: _Segments, k: int) -> None:
        """Fix the streams side by side of ``label`` where a reshape gives their axis (``k`` in the
        result) a width as a number, written in the code or held by a module (``reshape(-1,
        self.hidden)``): one number is the sum of their widths, which fusion changes one by one."""
        shape_args = _target_shape(node)
        if shape_args is None or len(shape_args) != len(_tensor_shape(node)):
            return
        w = shape_args[k]
        if (type(w) is int and w == -1) or (isinstance(w, fx.Node) and self.scales(w)):
            return
        how = "a number it holds" if isinstance(w, _HeldWidth) else "a number written in the code"
        for g, _ in label.parts:
            if isinstance(g, _Feature) and self.permuted(g):
                self.mark_fixed(g.var, f"its forward reshapes them, beside other streams, to a width given by {how}")

    def heads_split(self, node, f: _Feature, src: tuple, dst: tuple, shape_args: list | None) -> _Feature:
        """A reshape that cuts the units' axis into axes of heads and features within a head
        (``q.view(B, N, heads, C // heads)``, a fused projection's ``reshape(B, N, 3, heads, -1)``):
        the units become blocks, one per head (:meth:`refine`), permuted alike, so one
        permutation of the features within a head serves every head (a restriction of the
        heads' symmetry that keeps their widths equal, as the reshape needs); where the width
        within a head is read off another stream's width (``C // heads``), :meth:`reshape` ties
        that stream to them. Where the number of heads is not written as a number, or the width
        within a head is (``view(B, -1, heads, 8)``: the tokens' axis would take what fusion
        adds), the forward fixes the width (:meth:`mark_fixed`). ``shape_args``: the reshape's
        target shape, an entry per axis (:func:`_target_shape`), or None where it is computed whole."""
        n = src[f.dim] // (f.outer * f.inner)
        prefix = int(np.prod(src[: f.dim]))
        for m in (m for m in range(2, n + 1) if n % m == 0):
            placed = _placed(_Feature(f.var, f.dim, f.outer * m, f.inner), src, dst)
            if placed is None:
                continue
            k0 = next((k for k in range(len(dst) + 1) if int(np.prod(dst[:k])) == prefix), None)
            if k0 is None or k0 > placed.dim:
                break
            out = _Feature(self.refine(f.var, m), placed.dim, placed.outer, placed.inner)
            if shape_args is None:
                self.mark_fixed(out.var, "its forward cuts them into heads by a target shape computed whole")
            elif any(
                isinstance(a, bool) or not isinstance(a, int) or a < 1 for a in shape_args[k0 : placed.dim]
            ) and not (
                # view(B, N, -1, self.head_dim): the heads counted from a width within a head the module holds,
                # which the rebuild sets to the fused one, so that the count stays
                isinstance(shape_args[placed.dim], _HeldWidth)
                and [a for a in shape_args[k0 : placed.dim] if type(a) is not int or a < 1] == [-1]
            ):
                self.mark_fixed(out.var, "its forward counts its heads from a width within a head")
            elif (
                shape_args[placed.dim] != -1
                and not isinstance(shape_args[placed.dim], _HeldWidth)  # self.head_dim: reshape() records it
                and not self.scales(shape_args[placed.dim])
            ):
                width = shape_args[placed.dim]
                self.mark_fixed(out.var, f"its forward cuts them into heads of {dst[placed.dim]}, {_kept([width])}")
            return out
        self.fail(
            node,
            f"this reshape {src} -> {dst} splits the units of one axis in a way that cannot be followed; give a spec",
        )

    def mark_fixed(self, var: int, why: str) -> None:
        """Record that the forward fixes the width of ``var``'s units (:attr:`PermutationSpec.fixed`)."""
        self.fixed.append((var, why))

    def units_read(self, a, *, whole: bool = False) -> list[int]:
        """The variables of the permuted units whose widths the number ``a`` is computed from
        (:meth:`widths_read`, :meth:`units_at`), each once."""
        at = (self.units_at(x, axis) for x, axis in dict.fromkeys(self.widths_read(a, whole=whole)))
        return list(dict.fromkeys(u[0] for u in at if u is not None))

    def fix_widths_read(self, a, why: str, *, whole: bool = False) -> None:
        """Fix the width of every permuted units the number ``a`` is computed from (:meth:`units_read`)."""
        for var in self.units_read(a, whole=whole):
            self.mark_fixed(var, why)

    def widths_read(self, a, *, whole: bool = False) -> list[tuple]:
        """The ``(tensor, axis)`` pairs whose sizes the number ``a`` (no tensor) is computed from
        (``x.shape[-1] // 4``, ``x.size(2)``); with ``whole``, also the axes of shapes read whole
        or sliced (``x.shape``, ``x.numel()``, ``x.shape[:-1]``: :func:`_shape_axes_read`)."""
        if not isinstance(a, fx.Node):
            return []
        if "tensor_meta" in a.meta:  # a number made a tensor (torch.tensor(d).sqrt()): read through
            meta = a.meta["tensor_meta"]
            if not hasattr(meta, "shape") or tuple(meta.shape) != () or isinstance(self.raw(a), _Feature):
                return []
        read = _size_read(a)
        if read is not None:
            return [read]
        axes = _shape_axes_read(a) if whole else None
        if axes is not None:
            return axes
        return [w for b in _flat(list(a.args) + list(a.kwargs.values())) for w in self.widths_read(b, whole=whole)]

    def permuted_axis(self, x, axis: int) -> bool:
        """Whether ``axis`` of ``x`` holds permuted units (an activation's, or a parameter's that
        a layer traced before permutes: ``self.fc.weight.shape[0]``)."""
        return self.units_at(x, axis) is not None

    def units_at(self, x, axis: int) -> tuple[int, int, int] | None:
        """``(var, outer, inner)`` of the permuted units on ``axis`` of ``x``, else None."""
        g, shape = self.raw(x), _shape(x)
        if shape is None or not isinstance(axis, int) or not -len(shape) <= axis < len(shape):
            return None
        if isinstance(g, tuple) and g[0] == "param" and g[1] in self.axes:
            d = self.axes[g[1]][axis % len(shape)]
            if isinstance(d, _Cat):  # a weight whose axis holds streams, or pieces, side by side
                raise UnsupportedLayerError(
                    f"{type(self.model).__name__}: a width read off {g[1]!r}, whose axis {axis} holds several groups' "
                    "units side by side, cannot be followed; give a spec"
                )
            return None if d is None or self.classes.find(d[0]) == _FIXED else tuple(d)
        if isinstance(g, _Feature) and self.permuted(g) and g.dim == axis % len(shape):
            return g.var, g.outer, g.inner
        return None

    def number(self, a, scale: int = 1) -> int | None:
        """The value of ``a``, a number written in the code or computed in the forward from
        tensors' sizes, with every permuted width it reads multiplied by ``scale``; None where it
        cannot be read."""
        if isinstance(a, bool) or not isinstance(a, (int, fx.Node)):
            return None
        if isinstance(a, int):
            return a
        read = _size_read(a)
        if read is not None:
            x, axis = read
            shape = _shape(x)
            if shape is None or not -len(shape) <= axis < len(shape):
                return None
            return shape[axis] * (scale if self.permuted_axis(x, axis) else 1)
        if a.op != "call_function" or a.target not in _ARITHMETIC or a.kwargs:
            return None
        values = [self.number(v, scale) for v in a.args]
        return None if any(v is None for v in values) else int(a.target(*values))

    def scales(self, a) -> bool:
        """Whether the number ``a`` is a fixed multiple of the permuted widths it reads (``C //
        heads``, ``h.shape[-1] // 3``), so that it follows them to any fused width; a number
        written in the code, or ``C - 8``, does not."""
        one = self.number(a)
        return one is not None and one != 0 and all(self.number(a, k) == k * one for k in (2, 3))

    def tie_width(self, node, x, axis: int, y) -> None:
        """Tie the units of reshape ``y`` to those of ``x``'s ``axis``, whose width its target shape
        is read off (``(attn @ v).reshape(B, N, C)`` with ``C`` the stream's): the one with more
        units is cut into blocks of the other's number, and both are one permutation, so that
        the widths the reshape reads agree at any fused width."""
        at = self.units_at(x, axis)
        if at is None:
            return
        (g_var, g_outer, g_inner), f = at, self.raw(y)
        if self.classes.find(g_var) == self.classes.find(f.var):
            return
        n_g = _tensor_shape(x)[axis] // (g_outer * g_inner)
        n_f = _tensor_shape(y)[f.dim] // (f.outer * f.inner)
        lo, hi = sorted(((n_g, g_var), (n_f, f.var)))
        if hi[0] % lo[0]:
            self.fail(
                node,
                f"this reshape reads its width off {x.name}'s {n_g} units, which are no whole number of its {n_f}; "
                "give a spec",
            )
        var = self.refine(hi[1], hi[0] // lo[0]) if hi[0] > lo[0] else hi[1]
        self.classes.union(var, lo[1])


def _placed(f: _Feature, src: tuple, dst: tuple) -> _Feature | None:
    """Where a reshape from ``src`` to ``dst`` puts the units of ``f``, each unit's numbers on one
    axis (as blocks ``outer x n x inner``), or None."""
    n = src[f.dim] // (f.outer * f.inner)
    before = int(np.prod(src[: f.dim])) * f.outer  # numbers before the units' block, in flat order
    after = f.inner * int(np.prod(src[f.dim + 1 :]))
    for e in range(len(dst)):
        lead, trail = int(np.prod(dst[:e])), int(np.prod(dst[e + 1 :]))
        if before % lead == 0 and after % trail == 0 and dst[e] == (before // lead) * n * (after // trail):
            return _Feature(f.var, e, before // lead, after // trail)
    return None


_ROOTS = {operator.pow, torch.sqrt, torch.rsqrt, torch.pow, math.sqrt, math.pow, np.sqrt}
_ROOT_METHODS = {"sqrt", "rsqrt", "pow", "__pow__", "__rpow__"}


def _rooted(value) -> bool:
    """Whether the number or 0-d tensor ``value`` is computed through a power or a square root."""
    if not isinstance(value, fx.Node):
        return False
    if (value.op == "call_function" and value.target in _ROOTS) or (
        value.op == "call_method" and value.target in _ROOT_METHODS
    ):
        return True
    meta = value.meta.get("tensor_meta")
    if meta is not None and not (hasattr(meta, "shape") and tuple(meta.shape) == ()):
        return False
    return any(_rooted(a) for a in _flat(list(value.args) + list(value.kwargs.values())))


def _kept(values: list) -> str:
    """Why widths ``values`` fix the units' width: written in the code, or computed otherwise."""
    written = all(isinstance(v, int) for v in values)
    return "widths written in the code" if written else "widths that do not follow theirs"


_ARITHMETIC = {operator.floordiv, operator.mul, operator.add, operator.sub, operator.neg}


def _size_read(a) -> tuple | None:
    """``(tensor, axis)`` where the node ``a`` reads a size (``x.shape[i]``, ``x.size()[i]``,
    ``x.size(i)``), else None."""
    if not isinstance(a, fx.Node):
        return None
    if a.op == "call_method" and a.target == "size" and len(a.args) + len(a.kwargs) > 1:
        axis = a.args[1] if len(a.args) > 1 else a.kwargs.get("dim")
        return (a.args[0], axis) if isinstance(a.args[0], fx.Node) and isinstance(axis, int) else None
    if a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[0], fx.Node):
        source = _shape_source(a.args[0])
        if source is not None and isinstance(a.args[1], int):
            return source, a.args[1]
    return None


def _shape_axes_read(a: fx.Node) -> list[tuple] | None:
    """``(tensor, axis)`` of every axis a node reads of a shape taken whole (``x.shape``,
    ``x.size()``, ``x.numel()``, ``x.shape.numel()``) or sliced (``x.shape[:-1]``: the axes the
    slice keeps), else None."""
    of: object = None
    if a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[1], slice):
        of = _shape_source(a.args[0])
        if of is not None:
            return [(of, i) for i in range(len(_shape(of) or ()))[a.args[1]]]
    of = _shape_source(a)
    if of is None and a.op == "call_method" and a.target in ("numel", "nelement") and isinstance(a.args[0], fx.Node):
        of = _shape_source(a.args[0]) or a.args[0]
    return None if of is None else [(of, i) for i in range(len(_shape(of) or ()))]


def _shape_source(whole) -> fx.Node | None:
    """The tensor whose whole shape the node ``whole`` is (``x.shape``, ``x.size()``), else None."""
    shape_of = isinstance(whole, fx.Node) and (
        (whole.op == "call_function" and whole.target is getattr and whole.args[1] == "shape")
        or (whole.op == "call_method" and whole.target == "size" and len(whole.args) == 1)
    )
    return whole.args[0] if shape_of and isinstance(whole.args[0], fx.Node) else None


def _shape_arguments(node) -> list | None:
    """What a ``view`` / ``reshape`` is given after its tensor (its sizes, or one shape), else None."""
    reshape = node.op == "call_method" and node.target in ("view", "reshape")
    if not (reshape or node.op == "call_function" and node.target is torch.reshape):
        return None
    return list(node.args[1:]) or [node.kwargs.get("shape")]


def _whole_shape_of(node) -> fx.Node | None:
    """The tensor whose whole shape a ``view`` / ``reshape`` is given (``x.view(y.shape)``,
    ``torch.reshape(x, y.size())``), else None."""
    args = _shape_arguments(node)
    return _shape_source(args[0]) if args is not None and len(args) == 1 else None


def _last_size_of(a) -> fx.Node | None:
    """The tensor whose last size the node ``a`` is (``x.shape[-1:]``, ``x.size()[-1:]``), else None."""
    if not (isinstance(a, fx.Node) and a.op == "call_function" and a.target is operator.getitem):
        return None
    return _shape_source(a.args[0]) if a.args[1] == slice(-1, None, None) else None


def _target_shape(node) -> list | None:
    """The target shape a ``view`` / ``reshape`` was given, an entry per axis (a number, or the
    node that computes it), or None (``flatten``, a shape taken whole from another tensor)."""
    args = _shape_arguments(node)
    if args is None:
        return None
    if len(args) == 1 and isinstance(args[0], fx.Node):  # x.size()[:-1] + (self.nf,): Hugging Face's Conv1D
        args = _added_shape(args[0]) or args
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = list(args[0])
    return None if any(a is None or isinstance(a, fx.Node) and "tensor_meta" in a.meta for a in args) else args


def _added_shape(node: fx.Node) -> list | None:
    """The entries of a shape put together as ``x.size()[:-1] + (width,)``: the sizes the slice
    takes (numbers of the traced shape) and the tuple's, else None."""
    if not (node.op == "call_function" and node.target is operator.add and len(node.args) == 2):
        return None
    entries: list = []
    for part in node.args:
        if isinstance(part, (tuple, list)):
            entries.extend(part)
            continue
        if not (isinstance(part, fx.Node) and part.op == "call_function" and part.target is operator.getitem):
            return None
        whole, taken = part.args[0], part.args[1]
        source = _shape_source(whole) if isinstance(taken, slice) else None
        shape = _shape(source) if source is not None else None
        if shape is None:
            return None
        entries.extend(shape[cast(slice, taken)])
    return entries


def _param_alone(label, other) -> bool:
    """Whether an operation of an operand labelled ``label`` with ``other`` is a function of a
    parameter alone, number by number: ``label`` a parameter's, ``other`` a plain number."""
    return isinstance(label, tuple) and isinstance(other, (int, float, bool))


def _reduces_whole(node: fx.Node) -> bool:
    """Whether ``node`` reduces its operand over every number by a symmetric function (``w.norm()``,
    ``w.pow(2).sum()``, ``b.mean()``: no ``dim``), which no order of those numbers changes."""
    if node.op not in ("call_method", "call_function"):
        return False
    norm = node.target in _NORMS or node.target in _NORM_METHODS
    if not (norm or node.target in _REDUCTIONS or node.target in _REDUCTION_METHODS):
        return False
    at = 2 if norm else 1  # the dim's place, after the operand (and a norm's order), as reduce_along reads it
    dims = node.kwargs.get("dim", node.args[at] if len(node.args) > at else None)
    return dims is None and not node.kwargs.get("keepdim", False)


def _state_read(node: fx.Node, entries: set[str], followed) -> list[str]:
    """Those of ``entries`` (parameters, state_dict buffers) whose values ``node``'s value is
    computed from, through the graph, but through activations the walk follows (``followed(n)``:
    their units move as the spec says, and a function of them that lost them summed them over).
    Sizes, dtypes and devices read off a tensor (``x.shape``, ``x.dtype``; ``torch.zeros_like(x)``,
    ``x.new_zeros(n)``) read none of its values."""
    seen, stack, read = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen or size_read(n) or (n is not node and followed(n)):
            continue
        seen.add(n)
        if _reduces_whole(n):  # the same whatever the order of the numbers it reads
            continue
        if n.op == "get_attr" and str(n.target) in entries:
            read.append(str(n.target))
        if n.op == "call_method" and n.target in _NEW_TENSOR_METHODS or n.target in _LIKE_FUNCTIONS:
            stack.extend(a for a in n.all_input_nodes if a is not n.args[0])  # the tensor gives its dtype alone
            continue
        stack.extend(n.all_input_nodes)
    return read


def _swap_of_two(name: str, dims: list | tuple) -> bool:
    """Whether ``transpose(*dims)`` (two axes) or ``permute(*dims)`` (an order) swaps a matrix's two axes."""
    if len(dims) != 2 or not all(isinstance(d, int) for d in dims):
        return False
    a, b = (d % 2 for d in dims)
    return (a, b) == (1, 0) if name == "permute" else a != b


def _transposes(node) -> bool | None:
    """Whether ``node`` is a 2-D ``get_attr`` transposed (``.T``, ``.t()``, ``.mT``,
    ``transpose(0, 1)``, ``permute(1, 0)``), an odd number of times, through ops that keep its
    numbers (``contiguous``, ``to``, ``detach``...); None where another view (a reshape) is on the way."""
    swaps = 0
    while isinstance(node, fx.Node) and node.op != "get_attr":
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
        rest: list = list(node.args[1:])
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        if node.op == "call_function" and node.target is getattr and rest and rest[0] in ("T", "mT"):
            swaps += 1
        elif name == "t" or name in ("transpose", "swapaxes", "swapdims", "permute") and _swap_of_two(name, dims):
            swaps += 1
        elif name not in ("contiguous", "to", "float", "double", "half", "bfloat16", "type_as", "clone", "detach"):
            return None
        node = node.args[0] if node.args else None
    return swaps % 2 == 1 if isinstance(node, fx.Node) else None


def _view_base(node) -> fx.Node | None:
    """The ``get_attr`` node (a parameter or buffer) that ``node`` is, or a view of through ops that
    leave its numbers as they are (``.T``, ``.t()``, ``view``, ``reshape``, ``unsqueeze``,
    ``[:, None, None]``, ``contiguous``...), else None."""
    while isinstance(node, fx.Node) and node.op != "get_attr":
        view = (
            node.op == "call_method"
            and node.target in _VIEW_METHODS
            or node.op == "call_function"
            and (
                node.target in _VIEW_FUNCTIONS
                or node.target is getattr
                and len(node.args) > 1
                and node.args[1] in _VIEW_ATTRIBUTES
                or node.target is operator.getitem
                and len(node.args) > 1
                and _basic_index(node.args[1])
            )
        )
        if not view or not node.args:
            return None
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _basic_index(index) -> bool:
    """Whether an index holds only slices, None and Ellipsis (it reshapes; it selects nothing)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in items)


def _returned(out):
    """The nodes a ``forward`` returns: ``out``, or those in a tuple, list or dict of them, in order."""
    if isinstance(out, dict):
        for value in out.values():
            yield from _returned(value)
    elif isinstance(out, (tuple, list)):
        for value in out:
            yield from _returned(value)
    elif isinstance(out, fx.Node):
        yield out


def _index_kind(i) -> tuple[str, int]:
    """What one element of an index does: ``("new", 0)`` (None), ``("slice", 1)``, ``("int", 1)``
    (an int, or an int the graph computes), ``("tensor", n)`` (advanced indexing, consuming ``n``
    axes: a boolean mask its rank, anything else one), ``("...", -1)``."""
    if i is None:
        return "new", 0
    if i is Ellipsis:
        return "...", -1
    if isinstance(i, slice):
        return "slice", 1
    if isinstance(i, int) and not isinstance(i, bool):
        return "int", 1
    if isinstance(i, fx.Node):
        meta = i.meta.get("tensor_meta")
        if meta is None or not hasattr(meta, "shape"):
            return "int", 1  # an int the graph computes (x.size(1) - 1)
        return "tensor", len(meta.shape) if meta.dtype == torch.bool else 1
    return "tensor", 1  # a list, a bool, a constant tensor


def _element_at(index: tuple, rank: int, dim: int) -> int | None:
    """The place in ``index`` of the element that indexes axis ``dim`` of a tensor of ``rank``
    axes (None where an Ellipsis or tensor index leaves it unclear, or the index does not name it)."""
    kinds = [_index_kind(i) for i in index]
    if any(kind in ("...", "tensor") for kind, _ in kinds):
        return None
    src = 0
    for at, (_, n) in enumerate(kinds):
        if src <= dim < src + n:
            return at
        src += n
    return None


def _indexed_axis(index: tuple, rank: int, dim: int, out_rank: int) -> int | str | None:
    """Where axis ``dim`` of a tensor of ``rank`` axes lies in ``tensor[index]`` (of ``out_rank``
    axes): its position; ``"into"`` where the index selects within it (anything but a full ``:``);
    None where it cannot be told.

    Basic indexing keeps the order of the axes it leaves. Tensor (advanced) indices give axes of
    their broadcast shape, in place of the indexed ones where they are adjacent, else first
    (PyTorch and NumPy); with an int among them, where they go is not told: None."""
    items = [(i, *_index_kind(i)) for i in index]
    if sum(kind == "..." for _, kind, _ in items) > 1:
        return None
    consumed = sum(n for _, kind, n in items if kind != "...")
    if consumed > rank:
        return None
    whole = [(slice(None), "slice", 1)] * (rank - consumed)  # the axes the index does not name
    if any(kind == "..." for _, kind, _ in items):
        items = [e for item in items for e in (whole if item[1] == "..." else [item])]
    else:
        items += whole
    src, basic, units, tensors = 0, 0, None, []
    for at, (element, kind, n) in enumerate(items):
        if kind == "new":
            basic += 1
            continue
        if src <= dim < src + n:
            if kind != "slice" or element != slice(None):
                return "into"
            units = (at, basic)
        if kind == "slice":
            basic += 1
        elif kind == "tensor":
            tensors.append(at)
        src += n
    if units is None:
        return None
    at, position = units
    if not tensors:
        return position if basic == out_rank else None
    width = out_rank - basic  # the axes of the tensor indices' broadcast shape
    first, last = tensors[0], tensors[-1]
    if width < 0 or any(items[k][1] == "int" for k in range(first, last + 1)):
        return None
    if last - first + 1 == len(tensors):  # adjacent: their axes where they stand
        return position + (width if at > last else 0)
    return position + width  # apart: their axes first


def _held_in(a):
    """The :class:`_HeldWidth` objects in a node's arguments ``a``, through tuples, lists,
    dicts and slices."""
    if isinstance(a, _HeldWidth):
        yield a
    elif isinstance(a, (list, tuple)):
        for b in a:
            yield from _held_in(b)
    elif isinstance(a, dict):
        for b in a.values():
            yield from _held_in(b)
    elif isinstance(a, slice):
        yield from _held_in((a.start, a.stop, a.step))


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a
