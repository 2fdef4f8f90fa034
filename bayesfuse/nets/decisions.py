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


#: Operations whose result's shape is computed from their operands' values (``x[x > 0]``,
#: ``nonzero``), and those that turn values into numbers (``t.item()``).
_VALUES_SHAPED = frozenset(
    {
        "nonzero",
        "argwhere",
        "unique",
        "unique_consecutive",
        "masked_select",
        "item",
        "tolist",
        "bincount",
        "where",
    }
)


def _holds(value: Any, kind) -> bool:
    """Whether ``value`` is, or holds (a tuple given as one input, an index), a ``kind(v)``."""
    found: list[bool] = []

    def look(v):
        found.append(bool(kind(v)))
        return v

    fx.node.map_aggregate(value, look)
    return any(found)


def _holds_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor or holds one (a tuple given as one input)."""
    return _holds(value, lambda v: isinstance(v, torch.Tensor))


def _in_place_users(n: fx.Node) -> list[fx.Node]:
    """The nodes that write into ``n``'s tensor (``t.add_(...)``, ``t[i] = v``)."""
    return [
        u
        for u in n.users
        if u.args
        and u.args[0] is n
        and (
            (u.op == "call_method" and str(u.target).endswith("_") and not str(u.target).startswith("_"))
            or (u.op == "call_function" and u.target in (operator.setitem, operator.iadd, operator.imul))
        )
    ]


def _values_shaped(n: fx.Node, values: dict[fx.Node, Any]) -> bool:
    """Whether ``n`` computes a shape, or a number, from a tensor's values."""
    name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
    if n.op in ("call_method", "call_function") and name in _VALUES_SHAPED:
        return name != "where" or len(n.args) + len(n.kwargs) == 1  # torch.where(cond): nonzero
    if n.op in ("call_method", "call_function") and name == "repeat_interleave":  # repeats given as a tensor
        repeats = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
        return isinstance(values.get(repeats) if isinstance(repeats, fx.Node) else repeats, torch.Tensor)
    if n.op == "call_function" and n.target is operator.getitem and len(n.args) > 1:  # a mask: x[x > 0]
        return _holds(
            fx.node.map_arg(n.args[1], lambda a: values.get(a)),
            lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.bool,
        )
    return False


def reads_sizes_only(node: fx.Node, values: dict[fx.Node, Any]) -> fx.Node | None:
    """The first node whose tensor values reach the number ``node`` (a layer's output, an input,
    a parameter, a shape computed from values such as ``x[x > 0]``'s), where ``values`` holds what
    each evaluated node is; None where only sizes do. A size read (``x.shape``) reads no values,
    unless ``x``'s shape was itself computed from some (``nonzero``, masks, ``item``)."""
    stack, seen, shaped = [node], set(), set[fx.Node]()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if size_read(n):
            culprit = _shape_from_values(n, values, shaped)
            if culprit is not None:
                return culprit
            continue
        if n.op == "call_module" or (n.op in ("placeholder", "get_attr") and _holds_tensor(values.get(n))):
            return n
        if _values_shaped(n, values):
            return n
        stack.extend(n.all_input_nodes)
        stack.extend(_in_place_users(n))  # a tensor written into after it was made
    return None


def _shape_from_values(node: fx.Node, values: dict[fx.Node, Any], seen: set) -> fx.Node | None:
    """The node, among those ``node`` (a size read) depends on, that computes a shape or a
    number from values (:func:`_values_shaped`), else None."""
    stack = list(node.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _values_shaped(n, values):
            return n
        stack.extend(n.all_input_nodes)
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

        def read(value: Any) -> Any:
            values_of = reads_sizes_only(node, self.values)
            if values_of is not None:
                raise fx.proxy.TraceError(
                    f"{what} reads the values of {values_of.name} (not only sizes): the branch would hold for the "
                    "example input alone"
                )
            _mark_held(node, self.values)
            # a 0-d tensor computed from sizes (torch.tensor(n).sqrt()): its number
            return value.item() if isinstance(value, torch.Tensor) else value

        return self._recorded(
            node, read, what, missing="symbolically traced variables cannot be used as inputs to control flow"
        )

    def is_tensor(self, node: fx.Node) -> bool:
        """Whether ``node`` is a tensor at the example, recorded (a retrace replays it)."""
        return bool(self._recorded(node, lambda v: isinstance(v, torch.Tensor), "an iteration"))

    def tensors_in(self, node: fx.Node) -> int | None:
        """How many tensors ``node`` is at the example where it is a tuple of tensors (``max``'s and
        ``topk``'s ``(values, indices)``), else None; recorded (a retrace replays it)."""

        def count(v: Any) -> int | None:
            return len(v) if isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v) else None

        return self._recorded(node, count, "an iteration")

    def attribute(self, node: fx.Node, name: str) -> Any:
        """``name`` (a dtype, a device: no width) of the tensor ``node`` at the example, recorded."""
        return self._recorded(node, lambda v: getattr(v, name), f"its {name}")

    def _recorded(self, node: fx.Node, read, what: str, *, missing: str | None = None) -> Any:
        """``read`` of ``node``'s example value, recorded in :attr:`made`; in a retrace, the value
        the first trace recorded at this place instead. ``missing``: the refusal without an example."""
        if self.replay is not None:
            if len(self.made) >= len(self.replay):
                raise fx.proxy.TraceError(f"{what} that the first trace did not meet")
            self.made.append(self.replay[len(self.made)])
            return self.made[-1]
        if self.example is None:
            raise fx.proxy.TraceError(missing or f"{what} of a traced value, which has none")
        self._evaluate(node)
        self.made.append(read(self.values[node]))
        return self.made[-1]

    def _evaluate(self, node: fx.Node) -> None:
        """Compute every node of the graph up to ``node`` not computed yet, in order (the forward
        so far, writes into tensors included)."""
        placeholders = 0
        with torch.no_grad(), _untraced():
            for n in node.graph.nodes:
                if n.op == "placeholder":
                    placeholders += 1
                if n not in self.values:
                    args = _plain(fx.node.map_arg(n.args, self.values.__getitem__))
                    kwargs = _plain(fx.node.map_arg(n.kwargs, self.values.__getitem__))
                    self.values[n] = self._run(n, args, kwargs, placeholders - 1)
                if n is node:
                    break

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


def _held(value: Any) -> bool:
    """Whether ``value`` is a number a module holds (``bayesfuse.nets.graph_spec``'s held widths)."""
    return isinstance(value, int) and hasattr(getattr(value, "root", None), "computed")


def _plain(value: Any) -> Any:
    """``value`` (an argument, or a tuple, list, dict or slice of them) with every number a module
    holds as the plain ``int`` it is (``int``'s own method: the held width's would mark it as computed
    with); a ``torch.Size`` as it is."""
    if _held(value):
        return int.__int__(value)
    if isinstance(value, torch.Size):
        return value
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        if hasattr(value, "_fields"):  # a named tuple
            return type(value)(*items)
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_plain(value.start), _plain(value.stop), _plain(value.step))
    return value


def _mark_held(node: fx.Node, values: dict[fx.Node, Any]) -> None:
    """Mark as computed with the numbers a module holds that the number ``node`` is computed
    from (``x.shape[-1] < self.size``): not those that only shaped a tensor it reads the size of."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen or size_read(n) or isinstance(values.get(n), torch.Tensor) and values[n].dim() > 0:
            continue
        seen.add(n)
        fx.node.map_aggregate((n.args, n.kwargs), lambda a: _computed(a) if _held(a) else a)
        stack.extend(n.all_input_nodes)


def _computed(value: Any) -> Any:
    value.root.computed = True
    return value


class NumberProxy(fx.Proxy):
    """fx's proxy, whose ``int()`` and ``float()`` its tracer decides (:meth:`Decider.value`), and
    which records an assignment to its items (``mask[h0:h1, w0:w1] = count``, torchvision's Swin) as
    an ``operator.setitem`` node."""

    def __getattr__(self, name: str):
        """A tensor's ``dtype`` and ``device`` at the example input (``torch.finfo(x.dtype)``,
        ``torch.autocast(x.device.type)`` need them as values; fusion changes neither)."""
        if name in ("dtype", "device") and getattr(self.tracer, "decider", None) is not None:
            try:
                return self.tracer.attribute(self, name)  # type: ignore[attr-defined]
            except fx.proxy.TraceError:
                pass
        return _NumberAttribute(self, name)

    def __len__(self) -> int:
        """``len()`` of a tensor (its first size), of a tuple of tensors (``topk``'s ``(values,
        indices)``, unpacked as ``f(*h.topk(3))``) or of a tuple of sizes, decided."""
        tracer = self.tracer
        if getattr(tracer, "decider", None) is None:
            return super().__len__()
        if tracer.decider.is_tensor(self.node):  # type: ignore[attr-defined]
            return int(tracer.decide(self.size(0), "len() of a traced tensor"))  # type: ignore[attr-defined]
        count = tracer.decider.tensors_in(self.node)  # type: ignore[attr-defined]
        if count is not None:
            return count
        return len(tracer.decide(self, "len() of a traced value"))  # type: ignore[attr-defined]

    def __setitem__(self, key, value) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __int__(self) -> int:
        return int(self.tracer.decide(self, "int() of a traced number"))  # type: ignore[attr-defined]

    def __float__(self) -> float:
        return float(self.tracer.decide(self, "float() of a traced number"))  # type: ignore[attr-defined]


class _NumberAttribute(fx.proxy.Attribute, NumberProxy):
    """An attribute of a traced value (``x.shape``, ``h.T``), made a node where it is used, as fx's
    are, whose ``len()``, ``int()``, ``dtype`` and items are decided as :class:`NumberProxy`'s
    (``len(x.shape)``, ``h.T.dtype``)."""
