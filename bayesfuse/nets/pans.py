"""Position-aware neurons (Li et al., CVPR 2022, "Federated Learning with Position-Aware Neurons").

A hidden layer's pre-activations get a fixed, non-learnable encoding of each unit's position
(PANs eqs. 2-5), for unit ``j`` of ``J`` (a neuron, or a channel of a convolution):

.. math::

    \\text{additive:}\\quad h_l = f(W_l h_{l-1} + b_l + e_l), \\qquad e_{l,j} = A \\sin(2\\pi T j / J)

    \\text{multiplicative:}\\quad h_l = f((W_l h_{l-1} + b_l) \\odot e_l), \\qquad e_{l,j} = 1 + A \\sin(2\\pi T j / J)

``T`` is the period and ``A`` the amplitude; ``T = 0`` or ``A = 0`` gives plain neurons (the
encoding is constant, so permutations commute with it). Output layers get none. Shuffling
the units of a network with PANs then changes its outputs, which ties each unit to its
position and pre-aligns clients for coordinate-wise averaging (FedAvg). The transcription of
eqs. 4-5 lost its symbols; the forms above are the ones fixed by the text: additive values lie
in ``[-A, A]``, multiplicative ones in ``[1-A, 1+A]``.

The *shuffle error* (eq. 8) measures how much a random permutation of hidden units changes
the outputs: ``||h_{L,sf} - h_L|| / J_L``, averaged over inputs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from bayesfuse.inference.encodings import position_encoding as _encoding_values
from bayesfuse.inference.spec import Encoding, permute, random_permutations
from bayesfuse.nets.state import numpy_state
from bayesfuse.nets.tracing import spec_from_module

__all__ = ["PANConfig", "PositionAware", "position_encoding", "shuffle_error"]


@dataclass(frozen=True)
class PANConfig:
    """Kind, period ``T`` and amplitude ``A`` of position encodings (PANs eqs. 4-5)."""

    mode: Literal["add", "mul"] = "mul"
    period: float = 1.0
    amplitude: float = 0.1

    def __post_init__(self) -> None:
        if self.mode not in ("add", "mul"):
            raise ValueError(f"PAN mode must be 'add' or 'mul', got {self.mode!r}")
        if not (np.isfinite(self.period) and np.isfinite(self.amplitude)) or self.amplitude < 0:
            raise ValueError(f"PAN period must be finite and amplitude >= 0, got T={self.period}, A={self.amplitude}")

    @property
    def off(self) -> bool:
        """True when the encoding is constant (``T = 0`` or ``A = 0``): plain neurons."""
        return self.period == 0 or self.amplitude == 0

    def encoding(self, after: str | None = None) -> Encoding:
        """The encoding as permutation specs record it (:class:`~bayesfuse.inference.spec.Encoding`)."""
        return Encoding(self.mode, self.period, self.amplitude, after=after)


def position_encoding(n_units: int, config: PANConfig) -> np.ndarray:
    """``e_j`` for ``j = 0..J-1`` (PANs eq. 4 or 5; :func:`bayesfuse.inference.encodings.position_encoding`)."""
    return _encoding_values(n_units, config.encoding())


class PositionAware(nn.Module):
    """Adds or multiplies position encodings into dimension 1 (units or channels).

    Put it between a hidden Linear/Conv layer (or its batch norm) and its activation. The
    encoding depends only on the width, so it is a non-persistent buffer (in torch's default
    dtype): state_dicts are those of the plain network, and permutation specs record the
    encoding instead (:func:`bayesfuse.nets.tracing.spec_from_module`), for fusion to fold it in.
    """

    encoding: torch.Tensor

    def __init__(self, n_units: int, config: PANConfig) -> None:
        super().__init__()
        self.config = config
        self.n_units = int(n_units)
        self.register_buffer(
            "encoding",
            torch.tensor(position_encoding(self.n_units, config), dtype=torch.get_default_dtype()),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.n_units:
            raise ValueError(f"PositionAware layer for {self.n_units} units got input with {x.shape[1]}")
        e = self.encoding.to(x.dtype).reshape(1, -1, *([1] * (x.dim() - 2)))
        return x + e if self.config.mode == "add" else x * e

    def extra_repr(self) -> str:
        c = self.config
        return f"{self.n_units}, mode={c.mode}, T={c.period}, A={c.amplitude}"


def shuffle_error(model: nn.Module, x: torch.Tensor, *, seed: int = 0, n_trials: int = 10, spec=None) -> float:
    """PANs' shuffle test (eq. 8): mean ``||f_shuffled(x) - f(x)||_2 / K`` over inputs and trials.

    Every hidden group of the network is permuted uniformly at random (the paper's
    ``P_sf = 1``), the permuted weights are loaded into a copy, and the outputs compared.
    """
    spec = spec if spec is not None else spec_from_module(model, x[:2])
    rng = np.random.default_rng(seed)
    state = model.state_dict()
    sizes = spec.sizes(numpy_state(state))
    shuffled = copy.deepcopy(model).eval()
    model = model.eval()
    errors = []
    with torch.no_grad():
        reference = model(x)
        for _ in range(n_trials):
            shuffled.load_state_dict(permute(state, spec, random_permutations(sizes, rng)))
            out = shuffled(x)
            errors.append(float((out - reference).norm(dim=1).mean() / reference.shape[1]))
    return float(np.mean(errors))
