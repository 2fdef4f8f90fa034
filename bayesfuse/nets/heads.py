"""A fused network with the clients' own output layers: one fused body, a class-share pool of heads.

After the refit round (:func:`bayesfuse.fuse` with ``rounds=2``) every client has fitted the
output layer on the fused network's features of its own data and sent the fit
(:func:`bayesfuse.summaries.output_fit`). The server multiplies the fits into one output layer
(:class:`~bayesfuse.nets.laplace.LastLayerLaplace`); with ``head="clients"`` it keeps them
instead, as the fused BNN's client heads do (:mod:`bayesfuse.models.bnn_heads`), and predicts
with the class-share pool of the heads' softmaxes:

.. math::

    \\text{linear:}\\quad p(y = k \\mid x) = \\frac{\\sum_j s_{jk}\\, p_j(k \\mid x)}
        {\\sum_{k'} \\sum_j s_{jk'}\\, p_j(k' \\mid x)}, \\qquad
    \\text{log:}\\quad p(y = k \\mid x) \\propto \\prod_j p_j(k \\mid x)^{s_{jk}},

with ``p_j(k | x) = softmax(W_j h(x) + b_j)_k`` on the fused features ``h(x)`` and ``s_jk = n_jk
/ sum_j n_jk`` client j's share of the examples of class k (``1 / J`` for a class no client saw).
The linear pool is a mixture, as an ensemble is: where the heads disagree (inputs unlike any
client's data) its predictive stays spread out, so its entropy tells such inputs apart about as
well as the ensemble's (see the README). The log pool is sharper and better calibrated in
distribution, and gives up most of that.

The heads cost the server nothing more: they are the replies of the refit round. They add
``J K (G + 1)`` numbers to the fused network (G the fused output layer's inputs).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["ClientHeads", "POOLS", "class_shares", "logits_and_features"]

#: How :class:`ClientHeads` pools its heads (module docstring).
POOLS = ("linear", "log")


def logits_and_features(network: nn.Module, output: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``network(x)`` and the input of its layer ``output`` (the features it reads), in one pass."""
    seen = {}
    layer = network.get_submodule(output)
    hook = layer.register_forward_hook(lambda mod, inp, out: seen.__setitem__("features", inp[0]))
    try:
        logits = network(x)
    finally:
        hook.remove()
    return logits, seen["features"]


def _check_pool(pool: str) -> str:
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    return pool


def class_shares(class_counts: np.ndarray) -> np.ndarray:
    """(J, K) shares ``n_jk / sum_j n_jk`` of each class's examples; ``1 / J`` for a class no client saw."""
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 2 or not np.isfinite(counts).all() or (counts < 0).any():
        raise ValueError(f"class counts must be a (clients, classes) array of counts >= 0, got shape {counts.shape}")
    total = counts.sum(0, keepdims=True)
    return np.where(total > 0, counts / np.where(total > 0, total, 1.0), 1.0 / len(counts))


class ClientHeads(nn.Module):
    """The fused ``network`` whose output layer ``output`` is replaced, at prediction, by the class-share
    pool of the clients' heads (module docstring).

    Parameters
    ----------
    network : nn.Module
        The fused network; its output layer (``nn.Linear``) gives the features' width.
    output : str
        The name of the output layer in ``network``.
    weight : (J, K, G) array
        Each client's output weights on the fused features.
    bias : (J, K) array
        Each client's output biases.
    shares : (J, K) array
        Each client's share of each class, >= 0 and summing to 1 over the clients (:func:`class_shares`).
    pool : {"linear", "log"}
        The mixture of the heads' predictive distributions (default), or their geometric pool.

    ``forward`` returns the pooled predictive's log-probabilities, so that
    :func:`~bayesfuse.nets.predict.predict_proba` (a softmax) gives its probabilities.
    """

    def __init__(self, network: nn.Module, output: str, weight, bias, shares, *, pool: str = "linear") -> None:
        super().__init__()
        layer = network.get_submodule(output)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"the output layer {output!r} must be an nn.Linear, got {type(layer).__name__}")
        _check_pool(pool)
        dtype = torch.float64
        weight, bias, shares = (torch.as_tensor(np.array(a), dtype=dtype) for a in (weight, bias, shares))
        J = weight.shape[0] if weight.ndim == 3 else -1
        K, G = layer.out_features, layer.in_features
        if weight.shape != (J, K, G) or bias.shape != (J, K) or shares.shape != (J, K) or J < 1:
            raise ValueError(
                f"heads of shapes {tuple(weight.shape)}, {tuple(bias.shape)}, shares {tuple(shares.shape)} do not fit "
                f"the output layer {tuple(layer.weight.shape)}: need (J, {K}, {G}), (J, {K}) and (J, {K})"
            )
        if not all(torch.isfinite(a).all() for a in (weight, bias, shares)):
            raise ValueError("the heads' weights, biases and shares must be finite")
        if (shares < 0).any() or not torch.allclose(shares.sum(0), torch.ones(K, dtype=dtype), atol=1e-9):
            raise ValueError("shares must be >= 0 and sum to 1 over the clients for every class")
        self.network = network
        self.output = output
        self._pool = pool
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        self.register_buffer("shares", shares)

    @classmethod
    def from_fits(cls, network: nn.Module, output: str, fits, class_counts, *, pool: str = "linear") -> "ClientHeads":
        """The heads of the clients' refit replies (:class:`~bayesfuse.inference.output_fusion.OutputFit`,
        weights ``(G+1, K)`` with the bias as the last row), mixed by the shares of ``class_counts``
        (J, K), in the fits' order; in eval mode."""
        weights = np.stack([f.weight for f in fits])
        return cls(
            network, output, weights[:, :-1].transpose(0, 2, 1), weights[:, -1], class_shares(class_counts), pool=pool
        ).eval()

    @property
    def pool(self) -> str:
        """``"linear"`` (the mixture) or ``"log"`` (the geometric pool); may be set."""
        return self._pool

    @pool.setter
    def pool(self, value: str) -> None:
        self._pool = _check_pool(value)

    @property
    def n_heads(self) -> int:
        return int(self.shares.shape[0])

    def head_log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """(J, N, K): each head's log-probabilities on the fused features of ``x``."""
        _, features = logits_and_features(self.network, self.output, x)
        logits = torch.einsum("jkg,ng->jnk", self.weight, features.to(self.weight.dtype)) + self.bias[:, None, :]
        return torch.log_softmax(logits, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_p = self.head_log_probs(x)
        if self.pool == "linear":
            pooled = torch.logsumexp(log_p + torch.log(self.shares)[:, None, :], dim=0)  # log sum_j s_jk p_jk
        else:
            pooled = torch.einsum("jk,jnk->nk", self.shares, log_p)  # sum_j s_jk log p_jk
        return torch.log_softmax(pooled, -1)
