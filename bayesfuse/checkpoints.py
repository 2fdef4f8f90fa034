"""Reading and writing model files safely: ``.pt``/``.pth`` state_dicts and ``.safetensors``.

``.pt``/``.pth`` files are read with ``torch.load(weights_only=True)``, which refuses pickled
code; ``.safetensors`` holds nothing but tensors. Writes are atomic and never replace a file
unless asked.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
from collections import OrderedDict
from pathlib import Path

import torch

from bayesfuse._io import atomic_write_bytes
from bayesfuse.inference.spec import entry_order

__all__ = ["load_state_dict", "read_checkpoint", "save_state_dict", "FORMATS"]

FORMATS = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors"}


def load_state_dict(path: str | os.PathLike) -> "OrderedDict[str, torch.Tensor]":
    """The tensors of a checkpoint file, in file order (see :func:`read_checkpoint`)."""
    return read_checkpoint(path)[0]


def read_checkpoint(path: str | os.PathLike) -> "tuple[OrderedDict[str, torch.Tensor], str]":
    """The tensors of a checkpoint file, in file order, and the file's sha256 (one read).

    Raises
    ------
    FileNotFoundError
        The file does not exist.
    ValueError
        Unknown suffix, unreadable or truncated file, a payload ``weights_only`` refuses, or
        something that is not a flat mapping of names to tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"{path}: unknown model file type {path.suffix!r}; expected one of {sorted(FORMATS)}")
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if fmt == "safetensors":
        from safetensors.torch import load

        try:
            sd = load(raw)
        except Exception as err:  # safetensors raises its own error types
            raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
        return OrderedDict((k, sd[k]) for k in _safetensors_order(raw, sd)), digest
    try:
        obj = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{path}: not a plain state_dict checkpoint (torch.load with weights_only=True failed: "
            f"{str(err).splitlines()[0]})"
        ) from None
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path}: expected a state_dict (a mapping of parameter names to tensors)")
    return OrderedDict(obj), digest


ORDER_KEY = "bayesfuse.order"


def _safetensors_order(raw: bytes, sd: dict) -> list[str]:
    """Entry order of a safetensors file: as saved by :func:`save_state_dict` (kept in the
    header's metadata), else numerically-aware name order (the format itself keeps none)."""
    try:
        (size,) = struct.unpack("<Q", raw[:8])
        meta = json.loads(raw[8 : 8 + size]).get("__metadata__") or {}
        order = json.loads(meta[ORDER_KEY]) if ORDER_KEY in meta else None
    except (struct.error, ValueError, TypeError):
        order = None
    if isinstance(order, list) and sorted(order) == sorted(sd):
        return order
    return entry_order(sorted(sd))


def save_state_dict(state_dict: dict, path: str | os.PathLike, *, fmt: str | None = None,
                    overwrite: bool = False) -> Path:
    """Write a state_dict as ``.pt`` (torch.save) or ``.safetensors``, atomically."""
    path = Path(path)
    fmt = fmt or FORMATS.get(path.suffix.lower())
    if fmt not in ("pt", "safetensors"):
        raise ValueError(f"{path}: choose a format, 'pt' or 'safetensors' (got {fmt!r})")
    return atomic_write_bytes(path, state_dict_bytes(state_dict, fmt), overwrite=overwrite)


def state_dict_bytes(state_dict: dict, fmt: str) -> bytes:
    """A state_dict serialised as ``fmt`` (``"pt"``: torch.save; ``"safetensors"``, entry order kept)."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    if fmt == "safetensors":
        from safetensors.torch import save

        return save(tensors, metadata={ORDER_KEY: json.dumps(list(tensors))})
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()
