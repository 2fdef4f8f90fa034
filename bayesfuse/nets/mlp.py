"""Multi-layer perceptrons as plain ``torch.nn.Module``s with predictable state_dict keys."""

from __future__ import annotations

from typing import Sequence, cast

import torch
from torch import nn

from bayesfuse.inference.spec import PermutationSpec, chain, dense
from bayesfuse.nets.pans import PANConfig, PositionAware

__all__ = ["MLP"]


class MLP(nn.Module):
    """Fully connected ReLU network ``in_features -> *hidden -> n_classes``.

    The linear layers live in ``self.layers`` so the state_dict keys are
    ``layers.{i}.weight`` (shape ``[out, in]``) and ``layers.{i}.bias``; ``forward`` returns
    logits. Initialisation follows PFNM supplement Table 1: weights ~ N(0, 0.01), read as
    PyTorch's ``normal_(mean=0, std=0.01)`` (the experiments were run in PyTorch), and biases
    0.1. Small initial weights matter for matching: the random part of a hidden unit that
    training does not remove differs between independently initialised clients.

    Parameters
    ----------
    in_features : int
    hidden : sequence of int
        Widths of the hidden layers; empty for multinomial logistic regression.
    n_classes : int
    pan : PANConfig, optional
        Position-aware neurons in every hidden layer (:mod:`bayesfuse.nets.pans`); they add no
        state_dict entries.
    """

    def __init__(
        self, in_features: int, hidden: Sequence[int], n_classes: int, *, pan: PANConfig | None = None
    ) -> None:
        super().__init__()
        widths = [int(in_features), *(int(h) for h in hidden), int(n_classes)]
        if min(widths) < 1:
            raise ValueError(f"all layer widths must be positive, got {widths}")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.pan = pan
        self.pans = nn.ModuleList(PositionAware(w, pan) for w in widths[1:-1]) if pan is not None else None
        self.reset_parameters()

    def permutation_spec(self) -> PermutationSpec:
        """Hidden layer i is group ``P{i+1}``: ``layers.i.weight`` is ``(P{i+1}, P{i})``."""
        n = len(self.layers)
        groups = [None, *(f"P{i}" for i in range(1, n)), None]
        return chain(
            *(dense(f"layers.{i}", groups[i], groups[i + 1]) for i in range(n)),
            output=(f"layers.{n - 1}.weight", f"layers.{n - 1}.bias"),
        )

    @property
    def widths(self) -> list[int]:
        """Layer widths from input to output."""
        layers = cast(Sequence[nn.Linear], self.layers)
        return [layers[0].in_features, *(layer.out_features for layer in layers)]

    def reset_parameters(self, weight_std: float = 0.01, bias: float = 0.1) -> None:
        with torch.no_grad():
            for layer in cast(Sequence[nn.Linear], self.layers):
                layer.weight.normal_(0.0, weight_std)
                layer.bias.fill_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers[:-1]):
            x = layer(x)
            if self.pans is not None:
                x = self.pans[i](x)
            x = torch.relu(x)
        return self.layers[-1](x)

    @classmethod
    def from_state_dict(cls, state_dict: dict[str, torch.Tensor], *, pan: PANConfig | None = None) -> MLP:
        """Build an MLP whose widths are read off ``state_dict`` and load it."""
        n_layers = len([k for k in state_dict if k.startswith("layers.") and k.endswith(".weight")])
        if n_layers == 0:
            raise ValueError("state_dict has no 'layers.{i}.weight' entries")
        shapes = [tuple(state_dict[f"layers.{i}.weight"].shape) for i in range(n_layers)]
        for (out_prev, _), (_, in_next) in zip(shapes[:-1], shapes[1:]):
            if out_prev != in_next:
                raise ValueError(f"inconsistent layer shapes {shapes}")
        model = cls(shapes[0][1], [s[0] for s in shapes[:-1]], shapes[-1][0], pan=pan)
        model.load_state_dict(state_dict)
        return model
