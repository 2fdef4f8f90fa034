"""Reading and writing IDX files, the format of MNIST and Fashion-MNIST.

An IDX file starts with a 4-byte magic number ``0x00 0x00 <type> <ndim>``, then ``ndim``
big-endian uint32 dimension sizes, then the data in row-major order and big-endian byte order.
Files may be gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np

from bayesfuse._io import atomic_write_bytes

__all__ = ["read_idx", "write_idx"]

#: IDX type byte -> big-endian NumPy dtype.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_DTYPE_CODES = {dt.newbyteorder("=").str[1:]: code for code, dt in _IDX_DTYPES.items()}


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (plain or gzipped) into a native-endian array.

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ValueError
        If the header is not an IDX header or the data are truncated or too long.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    opener = gzip.open if _is_gzip(path) else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number {raw[:4]!r})")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: IDX header truncated")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: header announces shape {shape} ({expected} bytes of data) "
            f"but the file holds {len(raw) - header} bytes"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def write_idx(path: str | os.PathLike, array: np.ndarray, *, overwrite: bool = False) -> Path:
    """Write ``array`` as an IDX file, gzip-compressed when ``path`` ends in ``.gz``.

    The write is atomic and refuses to replace an existing file unless ``overwrite``.
    """
    array = np.asarray(array)
    key = array.dtype.newbyteorder("=").str[1:]
    if key not in _DTYPE_CODES:
        raise TypeError(f"IDX cannot store dtype {array.dtype}; use uint8, int8, int16, int32, float32 or float64")
    if array.ndim > 255:
        raise ValueError("IDX supports at most 255 dimensions")
    code = _DTYPE_CODES[key]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes()
    if str(path).endswith(".gz"):
        payload = gzip.compress(payload, mtime=0)
    return atomic_write_bytes(path, payload, overwrite=overwrite)
