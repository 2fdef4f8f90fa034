"""Curvature of a classifier's loss at its weights: the diagonal of the generalized Gauss-Newton.

For a network ``f(x; theta)`` with logits ``f`` and the cross-entropy loss, the generalized
Gauss-Newton (GGN) matrix of the summed loss is

.. math::

    G = \\sum_n J_n^\\top \\Lambda_n J_n, \\qquad
    \\Lambda_n = \\operatorname{diag}(p_n) - p_n p_n^\\top,

with ``J_n`` the Jacobian of the logits of example ``n`` with respect to the weights and
``p_n = softmax(f(x_n))``. For the softmax cross-entropy it equals the Fisher information
(Martens 2020, section 9.2), and ``G + delta I`` is the precision of the Laplace approximation
of the posterior with a Gaussian prior of precision ``delta`` (Daxberger et al., NeurIPS 2021,
eq. 4 with the GGN). Only the diagonal is kept here, one number per weight.

Since ``Lambda_n = sum_c q_nc q_nc^T`` with ``q_nc = sqrt(p_nc) (e_c - p_n)``,

.. math::

    \\operatorname{diag}(G) = \\sum_n \\sum_c (J_n^\\top q_{nc})^{\\odot 2},

one backward pass per class. For ``nn.Linear`` and ``nn.Conv2d`` layers the per-example
gradient is an outer product of the layer's input and the gradient at its output (for a
convolution, summed over positions of the unfolded input), so their diagonal is a product of
squares, as BackPACK computes it (Dangel et al., ICLR 2020), without per-example gradients of
the whole network; other convolutions (1-d, 3-d, transposed, grouped) differentiate the layer
alone, per example, from its input and the gradient at its output. A layer called more than
once (weights shared) sums its calls' gradients, which one call's input and output do not give;
it takes the general path. Every other parameter (batch norms, LSTMs, position encodings, a user's own
``nn.Parameter``) is handled by ``torch.func`` (``vmap`` over examples of ``vjp``), which is
slower but works on any module whose ``forward`` it can trace. Modules with a ``forward``
method and functional calls (``torch.relu``) are fine, where BackPACK's second-order
extensions need ``nn.Sequential`` of layer modules. ``tests/test_curvature.py`` checks the
result against the closed form of a linear-softmax model, the ``torch.func`` path against the
layer path, and both against BackPACK where it is installed.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Iterator, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap

from bayesfuse._layers import torch_layer
from bayesfuse._validation import as_input

__all__ = ["diag_ggn"]


def _factor(logits: torch.Tensor) -> torch.Tensor:
    """``q[n, c] = sqrt(p_nc) (e_c - p_n)``: ``diag(p_n) - p_n p_n^T = sum_c q_nc q_nc^T``, (N, C, C)."""
    p = torch.softmax(logits.detach(), dim=-1)
    eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
    return (eye - p.unsqueeze(-2)) * p.sqrt().unsqueeze(-1)


def _layer_square(module: nn.Module, a: torch.Tensor, g2: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """Sum over the chunk of one class's squared per-example weight gradient of a Linear or Conv2d."""
    if isinstance(module, nn.Linear):  # grad_n = g_n a_n^T: its square is g_n^2 (a_n^2)^T
        assert g2 is not None  # a Linear's outputs are 2-D here (3-D inputs are refused)
        return g2.T @ (a.double() ** 2)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):  # eval mode: y = weight * x_hat + bias
        assert module.running_mean is not None and module.running_var is not None  # _fast_layers: running stats
        shape = (1, -1) + (1,) * (a.dim() - 2)
        x_hat = (a.double() - module.running_mean.double().view(shape)) / (
            module.running_var.double().view(shape) + module.eps
        ).sqrt()
        per_example = (g.double() * x_hat).flatten(2).sum(2) if a.dim() > 2 else g.double() * x_hat
        return (per_example**2).sum(0)
    assert isinstance(module, nn.modules.conv._ConvNd)  # as _fast_layers picks them
    if _unfolds(module):
        conv = cast(nn.Conv2d, module)
        padding = cast(tuple[int, int], conv.padding)  # not "same" / "valid": _unfolds
        cols = F.unfold(a, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride)
        per_example = torch.bmm(g.flatten(2), cols.transpose(1, 2))  # in the model's dtype, squared in float64
        return (per_example.double() ** 2).sum(0).reshape(module.weight.shape)
    weight = module.weight.detach()

    def one(x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:  # the layer alone: its weight's gradient
        pullback = cast(tuple[Any, Callable], vjp(lambda w: functional_call(module, {"weight": w}, (x[None],)), weight))
        return pullback[1](gy.unsqueeze(0))[0]

    return (vmap(one)(a, g).double() ** 2).sum(0)


def _unfolds(m: nn.Module) -> bool:
    """Whether ``m`` is an ungrouped, zero-padded ``nn.Conv2d``, whose per-example gradients
    ``F.unfold`` gives as one product; other convolutions (1-d, 3-d, transposed, grouped) take
    theirs from the layer alone (``torch.func``)."""
    return isinstance(m, nn.Conv2d) and m.groups == 1 and m.padding_mode == "zeros" and not isinstance(m.padding, str)


def _fast_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The Linear layers, the convolutions and the affine batch norms with running statistics
    (used in eval mode) that compute as torch's do (:func:`~bayesfuse._layers.torch_layer`): a
    class of one's own may do more in a method of its own (timm's ``BatchNormAct2d`` applies its
    activation, a ``_conv_forward`` that scales the filters), which the layer's formulas do not know."""
    found = {}
    for name, m in model.named_modules():
        if not torch_layer(m):
            continue
        conv = isinstance(m, nn.modules.conv._ConvNd)
        norm = (
            isinstance(m, nn.modules.batchnorm._BatchNorm)
            and m.affine
            and m.track_running_stats
            and m.running_var is not None
        )
        if isinstance(m, nn.Linear) or conv or norm:
            found[name] = m
    return found


def _layer_ggn(model, layers, xb, total, seen) -> None:
    """Add one chunk's GGN diagonal of the layers' weights and biases to ``total``."""
    record: dict[str, tuple] = {}
    calls: dict[str, int] = {}
    odd: set[str] = set()  # called with keyword arguments, or without its input as a positional one

    def keep(n: str, inp, kwargs, out) -> None:
        if kwargs or not inp or not isinstance(out, torch.Tensor):
            odd.add(n)
        else:  # the versions of its input and output: an in-place operation after it (ReLU(inplace=True)) moves them
            record[n] = (inp[0].detach(), out, out._version, inp[0]._version)
        calls[n] = calls.get(n, 0) + 1

    hooks = [
        m.register_forward_hook(lambda mod, inp, kwargs, out, n=n: keep(n, inp, kwargs, out), with_kwargs=True)
        for n, m in layers.items()
    ]
    try:
        with torch.enable_grad():
            logits = model(xb)
    finally:
        for h in hooks:
            h.remove()
    used = [n for n in layers if n in record and record[n][1].requires_grad]

    def unusable(n: str) -> bool:
        # not on the path to the logits, a Linear on 3-D inputs, a layer called more than once (a
        # siamese encoder's, a block shared in a loop: its gradient sums over its calls) or with
        # keyword arguments (output_size=), its output changed in place after it (the gradient at
        # it would be taken after the change), or a weight the model does not hold as a parameter
        # (computed by weight_norm or a parametrization)
        return (
            n not in used
            or n in odd
            or calls[n] > 1
            or (isinstance(layers[n], nn.Linear) and record[n][0].dim() != 2)
            or record[n][1]._version != record[n][2]
            or record[n][0]._version != record[n][3]
            or any(getattr(layers[n], p, None) is not None and _key(n, p) not in total for p in ("weight", "bias"))
        )

    bad = sorted(n for n in set(record) | odd if unusable(n))
    if bad:
        raise _Unsupported(bad)
    if not used:  # no layer the layer path can take: all to the general path
        return
    q = _factor(logits)
    outs = [record[n][1] for n in used]
    for c in range(q.shape[1]):
        grads = torch.autograd.grad(
            logits, outs, grad_outputs=q[:, c, :], retain_graph=c + 1 < q.shape[1], allow_unused=True
        )
        for n, g in zip(used, grads):
            if g is None:
                continue
            module = layers[n]
            g2 = g.double() ** 2 if g.dim() == 2 else None
            total[_key(n, "weight")] += _layer_square(module, record[n][0], g2, g)
            if module.bias is not None:
                total[_key(n, "bias")] += (g2 if g2 is not None else g.double().flatten(2).sum(2) ** 2).sum(0)
    seen.update(used)


def _key(module: str, param: str) -> str:
    """State_dict name of a module's parameter (the model itself is the module ``""``)."""
    return f"{module}.{param}" if module else param


class _Unsupported(Exception):
    def __init__(self, names):
        super().__init__(names)
        self.names = names


def _func_ggn(model, names, xb, total, buffers, params) -> None:
    """Add one chunk's GGN diagonal of the parameters ``names`` by per-example VJPs (torch.func),
    vmapped over the examples, or looped where an operation has no batching rule (``nn.GRU``)."""
    chosen = {k: params[k] for k in names}
    fixed = {k: v for k, v in params.items() if k not in chosen}

    def per_example(xi):
        def logits_of(p):
            return functional_call(model, ({**fixed, **p}, buffers), (xi.unsqueeze(0),)).squeeze(0)

        f, pullback = cast(tuple[Any, Callable], vjp(logits_of, chosen))  # without has_aux: two values
        grads = vmap(pullback)(_factor(f))[0]
        return {k: (g.double() ** 2).sum(0) for k, g in grads.items()}

    try:
        with warnings.catch_warnings():  # an LSTM's layer has a slow batching rule: correct, said once per chunk
            warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet")
            squares = vmap(per_example)(xb)
    except RuntimeError:  # an operation vmap cannot batch (nn.GRU's): one example at a time
        parts = [per_example(xi) for xi in xb]
        squares = {k: torch.stack([part[k] for part in parts]) for k in names}
    for k in names:
        total[k] += squares[k].sum(0)


def _chunks(x: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, x.shape[0], size):
        yield x[start : start + size]


def diag_ggn(model: nn.Module, x, *, batch_size: int = 1024) -> dict[str, np.ndarray]:
    """Diagonal of the GGN (= Fisher) of the summed cross-entropy of ``model`` on inputs ``x``.

    Parameters
    ----------
    model : nn.Module
        A classifier returning logits ``(N, K)``; evaluated in ``eval`` mode (batch norms use
        their running statistics, as the model is used after training).
    x : (N, ...) array or tensor
        The client's inputs. Labels are not needed: the GGN of the cross-entropy depends on the
        model's own predictive ``p``, not on the labels.
    batch_size : int
        Examples per chunk.

    Returns
    -------
    dict of str to ndarray
        For every floating parameter (by its state_dict name), ``diag(G)`` in float64, of the
        parameter's shape: non-negative, and 0 for a weight no example's logits depend on.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    held = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    if len(set(held)) < len(held):  # a tensor under two names: torch.func would leave its wrapper in the model
        model = copy.deepcopy(model)
    params = {k: p.detach() for k, p in model.named_parameters() if p.is_floating_point()}
    if not params:
        raise ValueError("the model has no floating-point parameters")
    first = next(iter(params.values()))
    x = as_input(x, model, first.dtype, first.device)  # token ids stay integers
    buffers = {k: b.detach() for k, b in model.named_buffers()}
    total = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    layers = _fast_layers(model)
    was_training = model.training
    model.eval()
    try:
        seen: set[str] = set()
        for i, xb in enumerate(_chunks(x, batch_size)):
            if i == 0:
                try:
                    _layer_ggn(model, layers, xb, total, seen)
                except _Unsupported as err:  # e.g. a Linear on 3-D inputs: leave it to torch.func
                    layers = {n: m for n, m in layers.items() if n not in err.names}
                    seen.clear()
                    total = {k: torch.zeros_like(v) for k, v in total.items()}
                    _layer_ggn(model, layers, xb, total, seen)
                fast = {_key(n, p) for n in seen for p in ("weight", "bias") if _key(n, p) in params}
                rest = [k for k in params if k not in fast]
            else:
                _layer_ggn(model, {n: layers[n] for n in seen}, xb, total, set())
            if rest:
                _func_ggn(model, rest, xb, total, buffers, params)
    finally:
        model.train(was_training)
    return {k: v.cpu().numpy() for k, v in total.items()}
