"""Checks of the inputs of a matching: the clients' neurons, noise variances, assignments and
relative precisions."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from bayesfuse._validation import finite_array, positive_array
from bayesfuse.inference._backend import backend_of, to_host


def check_layers(layers: Sequence) -> list:
    """The clients' neurons, checked: NumPy float64 arrays (float32 ones kept as they are, see
    :func:`widen`), or the torch tensors as given when all are tensors of one device and dtype
    (:func:`~bayesfuse.inference._backend.backend_of`)."""
    if len(layers) == 0:
        raise ValueError("need at least one client's neurons")
    torch_inputs = backend_of(layers).is_torch
    out: list = []
    for j, w in enumerate(layers):
        if torch_inputs:
            a = w.detach()
            if not bool(a.isfinite().all()):
                raise ValueError(f"client {j}'s neurons contains NaN or infinite values")
        elif isinstance(w, np.ndarray) and w.dtype == np.float32:
            a = w
            if not np.isfinite(a).all():
                raise ValueError(f"client {j}'s neurons contains NaN or infinite values")
        else:
            a = finite_array(w, f"client {j}'s neurons")
        if a.ndim != 2:
            raise ValueError(f"client {j}'s neurons must be a 2-D array (L_j, D), got shape {tuple(a.shape)}")
        if a.shape[0] == 0:
            raise ValueError(f"client {j} has no neurons (empty client)")
        if out and a.shape[1] != out[0].shape[1]:
            raise ValueError(f"client {j}'s neurons have dimension {a.shape[1]}, client 0's have {out[0].shape[1]}")
        out.append(a)
    return out


def widen(v):
    """Client neurons for arithmetic: a float32 NumPy array as a float64 copy, anything else as it is.

    NumPy neurons given in float32 stay float32 in the matching (half the memory of a wide
    layer's float64 copies): every float32 value is a float64 value, and every computation on
    the neurons widens them first (here, or by NumPy's promotion in a product with a float64
    operand), so the matching's numbers are those of the float64 copies, bit for bit."""
    if isinstance(v, np.ndarray) and v.dtype == np.float32:
        return v.astype(np.float64)
    return v


def positive(value, name: str, shape_ok: tuple[tuple[int, ...], ...], allow_inf: bool = False) -> np.ndarray:
    a = positive_array(value, name, allow_inf=allow_inf)
    if a.ndim > 0 and a.shape not in shape_ok:
        raise ValueError(f"{name} must be a scalar or have shape {' or '.join(map(str, shape_ok))}, got {a.shape}")
    return a


def client_variances(noise_var, n_clients: int, dim: int) -> np.ndarray:
    """Noise variances ``sigma_j^2``: (J, 1) when isotropic per client, else (J, D).

    An infinite variance (precision 0) says a client carries no information on a coordinate.
    """
    v = positive(noise_var, "noise_var", ((n_clients,), (n_clients, dim)), allow_inf=True)
    if np.isinf(v).all(axis=-1).any() if v.ndim == 2 else np.isinf(v).any():
        raise ValueError("noise_var is infinite on every coordinate of some client")
    if v.ndim == 0:
        v = np.full((n_clients, 1), float(v))
    elif v.ndim == 1:
        v = v[:, None]
    return v


def check_assignments(assignments: Sequence, layers: Sequence[np.ndarray]) -> list[np.ndarray]:
    if len(assignments) != len(layers):
        raise ValueError(f"need one assignment array per client ({len(layers)}), got {len(assignments)}")
    out = [to_host(a, np.int64) for a in assignments]
    shaped = [a.shape == (v.shape[0],) for a, v in zip(out, layers)]
    bad = [j for j, ok in enumerate(shaped) if not ok]
    clients = np.flatnonzero(shaped)
    if len(clients):  # negative or repeated atoms: one sort of (client, atom) keys for all clients
        owner = np.repeat(clients, [len(out[j]) for j in clients])
        flat = np.concatenate([out[j] for j in clients])
        bad += owner[flat < 0].tolist()
        owner, flat = owner[flat >= 0], flat[flat >= 0]
        if len(flat):
            size = int(flat.max()) + 1
            key = np.sort(owner * size + flat)
            bad += (key[1:][key[1:] == key[:-1]] // size).tolist()
    if len(bad):
        j = int(np.min(bad))
        raise ValueError(f"client {j}: assignments must give each of its {layers[j].shape[0]} neurons a distinct atom")
    return out


def relative_weights(relative_precision, J: int, D: int) -> np.ndarray:
    w = finite_array(relative_precision, "relative_precision")
    if w.shape != (J, D) or (w < 0).any():
        raise ValueError(f"relative_precision must be a non-negative ({J}, {D}) array, got shape {w.shape}")
    return w
