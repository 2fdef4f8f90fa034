"""Control flow on sizes, decided at the example input while a forward is traced.

``torch.fx`` cannot trace ``if x.shape[-1] < self.size:``, ``assert t <= self.block_size`` or
``int(math.sqrt(n))``: a traced number has no value. Where the number is computed from tensors'
sizes alone (their shapes, never their values), :class:`Decider` computes it on the example
input, running the traced graph up to it, and the trace goes on down the branch that input
takes. The graph keeps a :func:`decided` node holding the number, so that the spec's walk can fix
the width of any units the number reads: a network rebuilt at another width could take the other
branch. A condition on a tensor's values (``if x.sum() > 0:``) is still refused: the branch would
hold for the example alone.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any

import torch
from torch import fx, nn

__all__ = ["Decider", "NumberProxy", "decided", "reads_sizes_only"]

#: Methods whose result is a tensor's size, not its values.
_SIZE_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension"})
#: Attributes of a tensor that are not its values.
_SIZE_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout"})


def decided(value: Any) -> None:
    """Marks, in a traced graph, a number the trace took at its example value (a branch's
    condition, ``int(n)``, ``float(n)``); it computes nothing."""
    return None


def size_read(node: fx.Node) -> bool:
    """Whether ``node`` reads a size of a tensor (``x.size(1)``, ``x.shape``, ``x.ndim``), not its values."""
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    return node.op == "call_function" and node.target is getattr and node.args[1] in _SIZE_ATTRIBUTES


def reads_sizes_only(node: fx.Node, values: dict[fx.Node, Any]) -> fx.Node | None:
    """The first node whose tensor values reach the number ``node`` (a layer's output, an input,
    a parameter), where ``values`` holds what each evaluated node is; None where only sizes do."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if size_read(n):
            continue
        if n.op == "call_module" or (n.op in ("placeholder", "get_attr") and isinstance(values.get(n), torch.Tensor)):
            return n
        stack.extend(a for a in n.all_input_nodes)
    return None


class Decider:
    """The example values of the numbers a trace must decide on, and their record.

    Parameters
    ----------
    root : nn.Module
        The module being traced (its submodules and attributes, which the graph's nodes name).
    example : tuple, optional
        The forward's arguments; without them (or without ``replay``) nothing is decided.
    replay : list, optional
        The values an earlier trace of the same forward decided, in order: a retrace (with
        other held widths) takes the same branches instead of computing them again.
    """

    def __init__(self, root: nn.Module, example: tuple | None = None, replay: list | None = None) -> None:
        self.root, self.example, self.replay = root, example, replay
        self.values: dict[fx.Node, Any] = {}
        self.made: list = []  # the values decided, in order: what a retrace replays

    def value(self, node: fx.Node, what: str) -> Any:
        """The example value of ``node``, a number computed from sizes (``what`` says why it is needed)."""
        if self.replay is not None:
            if len(self.made) >= len(self.replay):
                raise fx.proxy.TraceError(f"{what} that the first trace did not meet")
            self.made.append(self.replay[len(self.made)])
            return self.made[-1]
        if self.example is None:
            raise fx.proxy.TraceError("symbolically traced variables cannot be used as inputs to control flow")
        self._evaluate(node)
        values_of = reads_sizes_only(node, self.values)
        if values_of is not None:
            raise fx.proxy.TraceError(
                f"{what} reads the values of {values_of.name} (not only sizes): the branch would hold for the "
                "example input alone"
            )
        value = self.values[node]
        if isinstance(value, torch.Tensor):  # a 0-d tensor computed from sizes (torch.tensor(n).sqrt())
            value = value.item()
        self.made.append(value)
        return value

    def _evaluate(self, node: fx.Node) -> None:
        """Compute ``node`` and every node it needs that is not computed yet, in graph order."""
        needed, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n not in needed and n not in self.values:
                needed.add(n)
                stack.extend(n.all_input_nodes)
        placeholders = 0
        with torch.no_grad(), _untraced():
            for n in node.graph.nodes:
                if n.op == "placeholder":
                    placeholders += 1
                if n not in needed:
                    continue
                args = fx.node.map_aggregate(fx.node.map_arg(n.args, self.values.__getitem__), _plain)
                kwargs = fx.node.map_aggregate(fx.node.map_arg(n.kwargs, self.values.__getitem__), _plain)
                self.values[n] = self._run(n, args, kwargs, placeholders - 1)

    def _run(self, n: fx.Node, args, kwargs, index: int) -> Any:
        assert self.example is not None
        if n.op == "placeholder":
            if index < len(self.example):
                return self.example[index]
            if n.args:  # an argument left at its default
                return n.args[0]
            raise fx.proxy.TraceError(f"the forward's argument {n.target!r} has no example value")
        if n.op == "get_attr":
            return functools.reduce(getattr, str(n.target).split("."), self.root)
        if n.op == "call_module":
            return self.root.get_submodule(str(n.target))(*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], str(n.target))(*args[1:], **kwargs)
        return n.target(*args, **kwargs)  # type: ignore[operator]


def _untraced():
    """A context in which modules run as themselves while fx traces (its patches of
    ``nn.Module.__call__`` and ``__getattr__`` taken back, and put back after)."""
    from torch.fx import _symbolic_trace

    revert = getattr(_symbolic_trace, "_maybe_revert_all_patches", None)
    return revert() if revert is not None else contextlib.nullcontext()


def _plain(value: Any) -> Any:
    """A number a module holds (``bayesfuse.nets.graph_spec``'s held widths) as the plain ``int``
    it is, marked as computed with: a decision read it."""
    root = getattr(value, "root", None)
    if isinstance(value, int) and root is not None and hasattr(root, "computed"):
        root.computed = True
        return int.__int__(value)
    return value


class NumberProxy(fx.Proxy):
    """fx's proxy, whose ``int()`` and ``float()`` its tracer decides (:meth:`Decider.value`), and
    which records an assignment to its items (``mask[h0:h1, w0:w1] = count``, torchvision's Swin) as
    an ``operator.setitem`` node."""

    def __setitem__(self, key, value) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __int__(self) -> int:
        return int(self.tracer.decide(self, "int() of a traced number"))  # type: ignore[attr-defined]

    def __float__(self) -> float:
        return float(self.tracer.decide(self, "float() of a traced number"))  # type: ignore[attr-defined]
