"""A fused BNN with the clients' own output layers: one fused body, a class-share mixture of heads.

A fused BNN (:mod:`bayesfuse.inference.bnn.fusion`) ends in one softmax over the class-share average
of the clients' logits. Averaging logits is not averaging predictive distributions: where the
clients disagree (inputs unlike the training data), averaged logits cancel into a confident
softmax, while averaged probabilities stay spread out. With ``head="clients"`` the fused network
keeps every client's output layer, read off the fused hidden units: client j's head gives
global unit g the outgoing weights of j's unit matched to g (0 where j has no unit in g, which is
what j's own network computes), and j's output bias. The predictive is the class-share mixture
of the heads' predictive distributions,

.. math::

    p(y = k \\mid x) = \\frac{\\sum_j s_{jk}\\, p_j(k \\mid x)}{\\sum_{k'} \\sum_j s_{jk'}\\, p_j(k' \\mid x)},
    \\qquad p_j(k \\mid x) = \\mathbb{E}_{\\theta \\sim q}\\big[\\mathrm{softmax}(W_j h(x; \\theta) + b_j)_k\\big],

with ``s_jk = n_jk / sum_j n_jk`` the clients' shares of class k
(:func:`~bayesfuse.inference.bnn.fusion.output_shares`; ``1 / J`` without class counts): a client
weighs only on the classes it saw. The hidden units ``h`` are the fused ones, shared by all heads.
``predict(x, pool="log")`` pools the same heads geometrically instead,

.. math::

    p(y = k \\mid x) \\propto \\prod_j p_j(k \\mid x)^{s_{jk}},

each class scored by the share-weighted mean of the heads' log-probabilities (the log-linear
opinion pool, with class-share weights): a class scores high only if every head that weighs on
it gives it a fair probability. Identical heads give the mixture; heads that disagree can be
pooled sharper than the mixture, even onto a class none of them ranks first. In the README's
Fashion-MNIST study it trades some of the mixture's OOD AUROC for a higher test likelihood.

:class:`HeadMixtureBNN` is a :class:`~bayesfuse.models.bnn.HorseshoeBNN` (its guide holds the
fused body and the shared output layer, so ``model``/``guide`` and the shared-head predictive
stay available) plus the heads, kept as Gaussians (means and standard deviations) in the
state_dict under ``heads.``. Only :meth:`HeadMixtureBNN.predict` reads the heads.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from bayesfuse.inference.bnn.fusion import client_heads
from bayesfuse.inference.bnn.sites import HEAD_KEYS, body_state, has_heads
from bayesfuse.models.bnn import HorseshoeBNN, forward_hidden

__all__ = ["HeadMixtureBNN", "HEAD_KEYS", "POOLS", "client_heads", "is_head_state", "bnn_from_state"]

#: How :meth:`HeadMixtureBNN.predict` pools the heads' predictive distributions (module docstring).
POOLS = ("linear", "log")


def is_head_state(state: Mapping[str, object]) -> bool:
    """Whether ``state`` is a HorseshoeBNN state_dict plus the :data:`HEAD_KEYS` (a :class:`HeadMixtureBNN`'s)."""
    return set(HEAD_KEYS) <= set(state) and HorseshoeBNN.is_state_dict(body_state(state))


class _Heads(nn.Module):
    loc_w: torch.Tensor
    scale_w: torch.Tensor
    loc_b: torch.Tensor
    scale_b: torch.Tensor
    shares: torch.Tensor

    def __init__(self, n_heads: int, n_classes: int, width: int):
        super().__init__()
        f64: dict[str, Any] = dict(dtype=torch.float64)
        self.register_buffer("loc_w", torch.zeros(n_heads, n_classes, width, **f64))
        self.register_buffer("scale_w", torch.zeros(n_heads, n_classes, width, **f64))
        self.register_buffer("loc_b", torch.zeros(n_heads, n_classes, **f64))
        self.register_buffer("scale_b", torch.zeros(n_heads, n_classes, **f64))
        self.register_buffer("shares", torch.full((n_heads, n_classes), 1.0 / n_heads, **f64))


class HeadMixtureBNN(HorseshoeBNN):
    """A fused horseshoe BNN whose predictive mixes the clients' output layers (module docstring).

    Build one with ``fuse(bnns, method, head="clients")`` or :meth:`from_state_dict`;
    ``bayesfuse.load`` reads its files. ``n_heads`` is the number of clients.
    """

    def __init__(self, in_features: int, hidden, n_classes: int, n_heads: int, **kwargs):
        super().__init__(in_features, hidden, n_classes, **kwargs)
        if n_heads < 1:
            raise ValueError("a HeadMixtureBNN needs at least one head")
        self.heads = _Heads(n_heads, self.n_classes, self.hidden_sizes[-1])

    @property
    def n_heads(self) -> int:
        return int(self.heads.shares.shape[0])

    @staticmethod
    def is_state_dict(state: Mapping[str, object]) -> bool:
        return is_head_state(state)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, object], name: str = "state_dict") -> "HeadMixtureBNN":
        """The network whose state_dict is ``state``: a HorseshoeBNN's entries plus :data:`HEAD_KEYS`.

        Raises ``ValueError`` naming ``name`` for missing head entries, shapes that do not fit the
        body (J heads of K x H_L weights), negative or non-finite standard deviations, and class
        shares that are negative or do not sum to 1 per class.
        """
        missing = [k for k in HEAD_KEYS if k not in state]
        if missing:
            raise ValueError(f"{name}: not a HeadMixtureBNN state_dict (missing {', '.join(missing)})")
        body = HorseshoeBNN.from_state_dict(body_state(state), name)
        heads = {k: torch.as_tensor(np.asarray(state[k], dtype=np.float64)) for k in HEAD_KEYS}
        J, K, H = heads["heads.loc_w"].shape if heads["heads.loc_w"].ndim == 3 else (0, 0, 0)
        want = {
            "heads.loc_w": (J, K, H),
            "heads.scale_w": (J, K, H),
            "heads.loc_b": (J, K),
            "heads.scale_b": (J, K),
            "heads.shares": (J, K),
        }
        if J < 1 or (K, H) != (body.n_classes, body.hidden_sizes[-1]):
            raise ValueError(
                f"{name}: heads.loc_w must be (heads, {body.n_classes}, {body.hidden_sizes[-1]}), "
                f"got {tuple(heads['heads.loc_w'].shape)}"
            )
        for k, shape in want.items():
            if tuple(heads[k].shape) != shape:
                raise ValueError(f"{name}: {k} must be {shape} for {J} heads, got {tuple(heads[k].shape)}")
            if not torch.isfinite(heads[k]).all():
                raise ValueError(f"{name}: {k} contains NaN or infinite values")
        if (heads["heads.scale_w"] < 0).any() or (heads["heads.scale_b"] < 0).any():
            raise ValueError(f"{name}: the heads' standard deviations must be >= 0")
        shares = heads["heads.shares"]
        if (shares < 0).any() or not torch.allclose(shares.sum(0), torch.ones(K, dtype=torch.float64), atol=1e-9):
            raise ValueError(f"{name}: heads.shares must be >= 0 and sum to 1 over the heads for every class")
        model = cls(
            body.in_features,
            body.hidden,
            body.n_classes,
            J,
            global_scale=body.global_scale,
            weight_scale=body.weight_scale,
            prior=body.prior,
        )
        model.load_state_dict({**body.state_dict(), **heads})
        return model

    @torch.no_grad()
    def predict(
        self, x, num_samples: int = 100, *, seed: int = 0, batch_size: int = 4096, pool: str = "linear"
    ) -> np.ndarray:
        """The heads' Monte Carlo predictive distributions, pooled by class share (module docstring).

        Each of the ``num_samples`` draws of the body feeds every head (with its own draw of the
        head's weights). ``pool="linear"``: the class-share mixture ``sum_j s_jk p_j(k|x)``;
        ``pool="log"``: the class-share geometric pool ``prod_j p_j(k|x)^(s_jk)``, with
        ``log p_j`` computed in log space. Both renormalised over the classes. Returns float64
        probabilities (n, K); the same seed gives the same draws.
        """
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {', '.join(map(repr, POOLS))}, got {pool!r}")
        return self._predict(x, num_samples, seed, batch_size, partial(self._predictive, pool=pool))

    def _draws(self, num_samples: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        draws = super()._draws(num_samples, generator)
        h = self.heads
        draws["heads.w"] = h.loc_w + h.scale_w * torch.randn(
            (num_samples, *h.loc_w.shape), dtype=torch.float64, generator=generator
        )
        draws["heads.b"] = h.loc_b + h.scale_b * torch.randn(
            (num_samples, *h.loc_b.shape), dtype=torch.float64, generator=generator
        )
        return draws

    def _rows_per_chunk(self, batch_size: int) -> int:
        return max(1, batch_size // self.n_heads)  # every head's logits are held at once

    def _predictive(self, x: torch.Tensor, draws, pool: str = "linear") -> torch.Tensor:
        hidden = forward_hidden(x, draws, self.depth)  # (S, n, H)
        # (S, J, n, K): every head on every draw of the body
        logits = torch.einsum("snh,sjkh->sjnk", hidden, draws["heads.w"]) + draws["heads.b"].unsqueeze(2)
        if pool == "log":  # log p_j(k|x) = log mean_s softmax, in log space (no underflow), then sum_j s_jk log p_j
            log_per_head = torch.logsumexp(torch.log_softmax(logits, -1), 0) - math.log(logits.shape[0])  # (J, n, K)
            return torch.softmax((self.heads.shares[:, None, :] * log_per_head).sum(0), -1)
        q = (torch.softmax(logits, -1) * self.heads.shares[None, :, None, :]).sum(1).mean(0)  # (n, K)
        return q / q.sum(-1, keepdim=True)


def bnn_from_state(state: Mapping[str, object], name: str = "state_dict") -> HorseshoeBNN:
    """A :class:`HeadMixtureBNN` when ``state`` holds the :data:`HEAD_KEYS`, else a HorseshoeBNN."""
    if has_heads(state):
        return HeadMixtureBNN.from_state_dict(state, name)
    return HorseshoeBNN.from_state_dict(state, name)
