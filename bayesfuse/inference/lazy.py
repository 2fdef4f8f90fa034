"""Arrays whose rows are computed when they are read: :class:`LazyRows`.

A wide layer's matching returns (G, D) variances that take one value per atom and coordinate
group (:class:`~bayesfuse.inference.matching.model.Groups`), and, where the fused weights are
the matched average, posterior means that are an affine function of that average. Held as
dense float64 arrays next to the fused layer, they double the memory of a fusion whose layer
has a fan-in of 100,000 (a 512-channel convolution feeding a dense layer). :class:`LazyRows`
holds the compact form and computes rows when they are read; everything that reads an array
(NumPy functions and ufuncs, indexing, arithmetic, ``np.asarray``) reads it as one, and gets the
same numbers each time.

>>> import numpy as np
>>> a = LazyRows((3, 4), lambda rows: np.arange(12.0).reshape(3, 4)[rows])
>>> a[1]
array([4., 5., 6., 7.])
>>> float((a * 2).sum()), a[:, 0].tolist(), a.shape
(132.0, [0.0, 4.0, 8.0], (3, 4))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

#: rows(index) -> the rows ``index`` (a slice or a 1-D int array) as a (k, D) float64 array
RowFunction = Callable[[Any], np.ndarray]


class LazyRows(NDArrayOperatorsMixin):
    """A read-only (n, D) float64 array whose rows ``rows(index)`` computes when they are read.

    Parameters
    ----------
    shape : (n, D)
    rows : callable
        ``rows(index)`` with ``index`` a slice or a 1-D int array of row numbers (in range)
        returns those rows, a new (k, D) float64 array (no view of what it reads); the same rows
        must come back on every call. A picklable callable (a module-level function or an instance
        of a module-level class) keeps the array picklable.
    max_elements : int
        :meth:`__array__` computes the whole array in blocks of rows of at most this many
        numbers, so that besides the result no more than one such block is made.

    Notes
    -----
    ``np.asarray(x)`` (and any NumPy function given ``x``, and any ndarray method or attribute
    not defined here: ``x.max()``, ``x.reshape(...)``) makes the dense array, a new one on every
    call: keep it when it is read many times. Indexing whose first index selects rows (an int, a
    slice, a 1-D int or boolean array) computes only those rows. Writing is refused. Where an
    ``ndarray`` is required (``isinstance`` checks, ``safetensors``), give ``np.asarray(x)``.
    """

    __array_priority__ = 20

    def __init__(self, shape: tuple[int, int], rows: RowFunction, *, max_elements: int = 1 << 22):
        self._shape = (int(shape[0]), int(shape[1]))
        self._rows = rows
        self._step = max(1, max_elements // max(self._shape[1], 1))

    # ----------------------------------------------------------------------------- as an array
    shape = property(lambda self: self._shape, doc="(n, D)")
    ndim = property(lambda self: 2, doc="2")
    dtype = property(lambda self: np.dtype(np.float64), doc="float64")
    size = property(lambda self: self._shape[0] * self._shape[1], doc="n * D")
    nbytes = property(lambda self: 8 * self.size, doc="Bytes of the dense array.")

    def __len__(self) -> int:
        return self._shape[0]

    def __iter__(self) -> Iterator[np.ndarray]:
        for start in range(0, self._shape[0], self._step):
            yield from self._block(slice(start, min(start + self._step, self._shape[0])))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if copy is False:
            raise ValueError("a LazyRows array is computed when read: it cannot be viewed without a copy")
        out = np.empty(self._shape)
        for start in range(0, self._shape[0], self._step):
            rows = slice(start, min(start + self._step, self._shape[0]))
            out[rows] = self._block(rows)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method == "at" or any(isinstance(x, LazyRows) for x in kwargs.get("out", ())):
            raise TypeError("a LazyRows array is read-only")
        dense = tuple(np.asarray(x) if isinstance(x, LazyRows) else x for x in inputs)
        return getattr(ufunc, method)(*dense, **kwargs)

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        first, rest = (key[0], key[1:]) if key else (slice(None), ())
        if first is Ellipsis or first is None or len(key) > 2:
            return np.asarray(self)[key]
        if isinstance(first, (int, np.integer)):
            n = self._shape[0]
            if not -n <= first < n:
                raise IndexError(f"index {first} is out of bounds for axis 0 with size {n}")
            return self._block(np.array([int(first) % n]))[0][rest]
        if isinstance(first, slice):
            return self._block(first)[(slice(None), *rest)]
        index = np.asarray(first)
        if index.ndim != 1 or index.dtype.kind not in "iub" or any(np.ndim(k) > 0 for k in rest):
            return np.asarray(self)[key]  # a mask of the whole array, arrays on both axes: read densely
        n = self._shape[0]
        if index.dtype == bool:
            if index.shape != (n,):
                raise IndexError(f"boolean index of shape {index.shape} for {n} rows")
            index = np.flatnonzero(index)
        elif len(index) and (index.min() < -n or index.max() >= n):
            bad = index.min() if index.min() < -n else index.max()
            raise IndexError(f"index {bad} is out of bounds for axis 0 with size {n}")
        return self._block(index % max(n, 1))[(slice(None), *rest)]

    def __getattr__(self, name: str):
        # ndarray methods and attributes not defined here (max, sum, reshape, tolist, flags...),
        # on the dense array
        if name.startswith("_") or not hasattr(np.ndarray, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(np.asarray(self), name)

    def __setitem__(self, key, value) -> None:
        raise TypeError("a LazyRows array is read-only: np.asarray(x) gives a dense copy to write")

    def copy(self) -> np.ndarray:
        """The dense array."""
        return np.asarray(self)

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        """The dense array in ``dtype``."""
        return np.asarray(self).astype(dtype)

    def __repr__(self) -> str:
        return f"LazyRows(shape={self._shape}, computed when read)"

    def _block(self, index) -> np.ndarray:
        return np.asarray(self._rows(index), dtype=np.float64)


class GroupedColumns(LazyRows):
    """A read-only (n, D) array whose columns take one value per group: ``x[i, d] =
    values[i, index[d]]``, held as ``values`` (n, B) and ``index`` (D,).

    The matching's variances are such an array (one value per atom and coordinate group), and so
    are the atoms' total weights in empirical Bayes (one per atom and distinct column of the
    clients' weights). Rows read as :class:`LazyRows` rows; ``x[:, cols]`` reads the columns
    ``cols`` without making the rest, and :meth:`columns` says which groups a set of columns
    holds.

    >>> import numpy as np
    >>> x = GroupedColumns(np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0, 0, 1]))
    >>> np.asarray(x).tolist(), x[:, 1:].tolist(), x.columns(slice(0, 2)).tolist()
    ([[1.0, 1.0, 2.0], [3.0, 3.0, 4.0]], [[1.0, 2.0], [3.0, 4.0]], [0])
    """

    def __init__(self, values: np.ndarray, index: np.ndarray, *, max_elements: int = 1 << 22):
        self.values = values
        self.index = np.asarray(index)
        super().__init__((values.shape[0], len(self.index)), self._gather, max_elements=max_elements)

    def _gather(self, rows) -> np.ndarray:
        return self.values[rows][:, self.index]

    def __getitem__(self, key):
        full = isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], slice) and key[0] == slice(None)
        if full and np.ndim(key[1]) <= 1:
            return self.values[:, self.index[key[1]]]
        return super().__getitem__(key)

    def columns(self, cols) -> np.ndarray:
        """The groups (indices into ``values``' columns) that the columns ``cols`` hold, sorted."""
        return np.unique(self.index[cols])

    def __repr__(self) -> str:
        return f"GroupedColumns(shape={self.shape}, {self.values.shape[1]} groups of columns)"
