"""Where the matching's heavy arithmetic runs: NumPy on the host, or torch on the inputs' device.

:func:`~bayesfuse.inference.matching.match_neurons` keeps its combinatorial state (assignments,
counts, per-group precisions) in NumPy and hands the assignment problems to SciPy; the arrays of
size ``atoms x coordinates`` or ``atoms x neurons`` (the atoms' natural parameters ``h``, the cost
products, the posterior means) live in a :class:`Backend`:

* :data:`NUMPY`: NumPy float64 on the host (``xp`` is :mod:`numpy` itself, so the NumPy path is
  the plain NumPy code);
* :class:`TorchBackend`: torch tensors of one device and dtype (float32 or float64), the inputs'.

A backend offers the few operations the hot spots need beyond the operators and methods NumPy
arrays and torch tensors share (``+ - * / @``, ``x[rows]``, ``x.sum(axis=, keepdims=)``):
``xp`` (a namespace with ``einsum``, ``log1p``, ``log``, ``sqrt``, ``broadcast_to``), array
creation, and moves between host and backend. This module imports no torch; a tensor's
backend imports it when a tensor is seen (torch is then loaded already).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from types import ModuleType
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = [
    "Backend",
    "NUMPY",
    "TorchBackend",
    "is_tensor",
    "backend_of",
    "namespace",
    "to_host",
    "to_device",
    "check_device",
    "DTYPES",
    "ieee_float32",
]

#: The dtypes a torch backend computes in.
DTYPES = ("float32", "float64")


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (checked without importing torch)."""
    return type(x).__module__.split(".", 1)[0] == "torch" and hasattr(x, "device") and hasattr(x, "dtype")


def to_host(x: Any, dtype=np.float64) -> np.ndarray:
    """``x`` (NumPy, torch on any device, or anything :func:`numpy.asarray` takes) as a host array."""
    if is_tensor(x):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def to_device(a: np.ndarray, device, dtype: str = "float64"):
    """A host array as a torch tensor on ``device`` (imports torch)."""
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    return torch.as_tensor(np.asarray(a), dtype=getattr(torch, dtype), device=device)


def check_device(device, dtype: str = "float64"):
    """The torch device that ``device`` names, checked usable in ``dtype`` before any work.

    Parameters
    ----------
    device : None, str or torch.device
        None: NumPy float64 on the host (``dtype`` must then be ``"float64"``). Else a torch
        device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``...) that this torch build has and
        that can hold a ``dtype`` tensor.
    dtype : {"float32", "float64"}

    Returns
    -------
    torch.device or None

    Raises
    ------
    ValueError
        For another dtype, float32 without a device, a name torch does not know, the ``meta``
        device (no values), or a device this machine or torch build does not have.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    if device is None:
        if dtype != "float64":
            raise ValueError(
                f"dtype={dtype!r} is for the torch path: give a device too (e.g. device='cpu'); "
                "without one the matching runs in NumPy float64"
            )
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise ValueError(
            f"device {device!r} is not a torch device ({_first_sentence(err)}); give one such as "
            "'cpu', 'cuda', 'cuda:1' or 'mps'"
        ) from None
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no values; give a device that computes, such as 'cpu' or 'cuda'")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"device {device!r}: this torch {torch.__version__} has no MPS device here "
            "(torch.backends.mps.is_available() is False); use device='cpu', or no device for NumPy"
        )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r}: no CUDA device is available to this torch {torch.__version__} "
                "(torch.cuda.is_available() is False); use device='cpu', or no device for NumPy"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"numbered 0..{torch.cuda.device_count() - 1}"
            )
    try:  # a backend this build or machine lacks (mps, xpu...), or a dtype the device cannot hold
        torch.zeros(1, dtype=getattr(torch, dtype), device=dev)
    except (RuntimeError, TypeError, AssertionError, ValueError) as err:
        raise ValueError(
            f"device {device!r} cannot hold {dtype} tensors here ({_first_sentence(err)}); use "
            "device='cpu', or no device for NumPy"
        ) from None
    return dev


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """torch's float32 matrix products in full float32 while it lasts (also as a decorator).

    ``torch.set_float32_matmul_precision("high")``, common in training scripts, lets CUDA run
    float32 products in TF32 (a 10-bit mantissa: relative errors near 1e-3 instead of 6e-8),
    and "medium" allows bfloat16 passes, on CPUs that have them too. A cost matrix then misses
    the float32 error bound ``gamma_{D+8}`` of its terms by orders of magnitude, which can change
    assignments that float32 gets right. The user's setting comes back on exit, error or not;
    like torch's setting itself, the change is process-wide while it lasts. Without torch
    loaded (NumPy inputs) nothing changes.
    """
    torch = sys.modules.get("torch")
    before = None if torch is None else torch.get_float32_matmul_precision()
    if before in (None, "highest"):
        yield
        return
    assert torch is not None  # the setting was read from it
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _first_sentence(err: BaseException, limit: int = 160) -> str:
    """The first sentence of an exception's message, on one line and at most ``limit`` characters."""
    text = " ".join(str(err).split()) or type(err).__name__
    text = text.split(". ", 1)[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Backend:
    """NumPy float64 on the host: :meth:`put` and :meth:`host` leave host arrays as they are."""

    name = "numpy"
    xp: ModuleType | _TorchNamespace = np
    is_torch = False

    def put(self, a) -> Any:
        """A host array (or a backend array) as a backend array of the backend's dtype."""
        return a

    def host(self, a) -> np.ndarray:
        """A backend array as a host float64 array (no copy for NumPy float64)."""
        return np.asarray(a, dtype=np.float64)

    def zeros(self, shape: Sequence[int]) -> Any:
        return np.zeros(shape)

    def copy(self, a) -> Any:
        return a.copy()

    def describe(self) -> str:
        return "numpy float64"


#: The host backend.
NUMPY = Backend()


class _TorchNamespace:
    """The NumPy names :mod:`bayesfuse.inference.matching` calls, on torch tensors."""

    def __init__(self, torch):
        self.einsum = torch.einsum
        self.log1p = torch.log1p
        self.log = torch.log
        self.sqrt = torch.sqrt
        self.broadcast_to = torch.broadcast_to


@functools.lru_cache(maxsize=1)
def _torch_namespace() -> _TorchNamespace:
    import torch  # loaded already: a tensor was seen

    return _TorchNamespace(torch)


def namespace(x: Any):
    """The ``xp`` of ``x``: :mod:`numpy` for host arrays, torch's functions for a tensor."""
    return _torch_namespace() if is_tensor(x) else np


class TorchBackend(Backend):
    """torch tensors on ``device`` with ``dtype`` (float32 or float64)."""

    name = "torch"
    is_torch = True

    def __init__(self, device, dtype):
        import torch  # loaded already: a tensor was given

        self.torch = torch
        self.device = torch.device(device)
        self.dtype = dtype
        self.xp = _torch_namespace()

    def put(self, a):
        if is_tensor(a) and a.device == self.device and a.dtype == self.dtype:
            return a
        return self.torch.as_tensor(a, dtype=self.dtype, device=self.device)

    def host(self, a) -> np.ndarray:
        if is_tensor(a):
            a = a.detach().to("cpu", self.torch.float64).numpy()
        return np.asarray(a, dtype=np.float64)

    def zeros(self, shape):
        return self.torch.zeros(tuple(shape), dtype=self.dtype, device=self.device)

    def copy(self, a):
        return a.clone()

    def describe(self) -> str:
        return f"torch {str(self.dtype).removeprefix('torch.')} on {self.device}"


def backend_of(arrays: Sequence[Any]) -> Backend:
    """The backend of the clients' neurons: :data:`NUMPY` for host arrays, a :class:`TorchBackend`
    when every one is a torch tensor of one device and one dtype (float32 or float64).

    Raises
    ------
    TypeError
        For a mix of tensors and other arrays, of devices or of dtypes, or another dtype.
    """
    tensors = [is_tensor(a) for a in arrays]
    if not any(tensors):
        return NUMPY
    if not all(tensors):
        first = tensors.index(False)
        raise TypeError(
            f"client {first}'s neurons are not a torch tensor while client {tensors.index(True)}'s "
            "are: give every client's neurons as torch tensors of one device and dtype, or none"
        )
    import torch

    allowed = (torch.float32, torch.float64)
    for j, a in enumerate(arrays):
        if a.dtype not in allowed:
            raise TypeError(f"client {j}'s neurons are a {a.dtype} tensor; give float32 or float64 tensors")
        if a.device != arrays[0].device or a.dtype != arrays[0].dtype:
            raise TypeError(
                f"client {j}'s neurons are {a.dtype} on {a.device}, client 0's {arrays[0].dtype} on "
                f"{arrays[0].device}: every client's tensors must share one device and dtype"
            )
    return TorchBackend(arrays[0].device, arrays[0].dtype)
