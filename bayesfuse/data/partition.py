"""Splitting a dataset across clients: homogeneous and Dirichlet-heterogeneous partitions.

The heterogeneous split is the one of PFNM (supplement section 4, "Data partitioning") and
FedMA: for each class k draw p_k ~ Dir_J(alpha) and give client j a share p_{k,j} of the
examples of class k. Small alpha gives skewed clients, some missing whole classes; large alpha
approaches the homogeneous split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

__all__ = ["Partition", "dirichlet_partition", "holdout_partition", "homogeneous_partition"]


@dataclass(frozen=True)
class Partition:
    """Index arrays, one per client, into the array of labels that was split.

    Behaves as a sequence of index arrays (``len``, iteration, indexing).

    Attributes
    ----------
    indices : tuple of ndarray
        ``indices[j]`` holds the (sorted) example indices of client j.
    counts : ndarray of shape (n_clients, n_classes)
        ``counts[j, k]`` is the number of examples of class k held by client j.
    """

    indices: tuple[np.ndarray, ...]
    counts: np.ndarray

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.indices)

    def __getitem__(self, j: int) -> np.ndarray:
        return self.indices[j]

    @property
    def sizes(self) -> np.ndarray:
        """Number of examples per client."""
        return self.counts.sum(axis=1)

    @property
    def proportions(self) -> np.ndarray:
        """Share of each client's examples in each class, shape (n_clients, n_classes)."""
        return self.counts / np.maximum(self.sizes[:, None], 1)

    def summary(self) -> str:
        """A text table of per-client class counts."""
        n_classes = self.counts.shape[1]
        head = "client " + " ".join(f"{k:>5d}" for k in range(n_classes)) + "   total"
        rows = [
            f"{j:>6d} " + " ".join(f"{c:>5d}" for c in row) + f" {row.sum():>7d}" for j, row in enumerate(self.counts)
        ]
        return "\n".join([head, *rows])


def _check_labels(y: np.ndarray, n_clients: int) -> tuple[np.ndarray, int]:
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise TypeError(f"labels must be integers, got dtype {y.dtype}")
    if y.size and y.min() < 0:
        raise ValueError("labels must be non-negative class indices")
    if int(n_clients) != n_clients or n_clients < 1:
        raise ValueError(f"n_clients must be a positive integer, got {n_clients}")
    if n_clients > y.size:
        raise ValueError(f"cannot split {y.size} examples across {n_clients} clients (more clients than examples)")
    return y, int(y.max()) + 1


def _make_partition(parts: list[np.ndarray], y: np.ndarray, n_classes: int) -> Partition:
    indices = tuple(np.sort(p).astype(np.int64) for p in parts)
    counts = np.stack([np.bincount(y[p], minlength=n_classes) for p in indices])
    return Partition(indices, counts)


def homogeneous_partition(y: np.ndarray, n_clients: int, *, seed: int = 0) -> Partition:
    """Split each class into ``n_clients`` near-equal parts (sizes differ by at most one).

    Remainders are dealt to clients in rotation across classes so client sizes stay balanced.
    """
    y, n_classes = _check_labels(y, n_clients)
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    offset = 0
    for k in range(n_classes):
        idx = rng.permutation(np.flatnonzero(y == k))
        for i, chunk in enumerate(np.array_split(idx, n_clients)):
            parts[(i + offset) % n_clients].append(chunk)
        offset += len(idx) % n_clients
    return _make_partition([np.concatenate(p) for p in parts], y, n_classes)


def dirichlet_partition(
    y: np.ndarray,
    n_clients: int,
    alpha: float,
    *,
    seed: int = 0,
    min_size: int = 10,
    max_tries: int = 1000,
) -> Partition:
    """Heterogeneous split: each class shared among clients by proportions ~ Dir_J(alpha).

    For each class k, draw p_k ~ Dir_J(alpha), shuffle the n_k examples of class k and give
    client j the slice between the boundaries round(n_k * sum_{i<j} p_{k,i}) and
    round(n_k * sum_{i<=j} p_{k,i}) (PFNM supplement, section 4). The whole draw is repeated
    until every client holds at least ``min_size`` examples (the rule used by the PFNM and FedMA experiments).

    Parameters
    ----------
    y : ndarray of int, shape (n,)
        Class labels.
    n_clients : int
        Number of clients J.
    alpha : float
        Dirichlet concentration (> 0). 0.5 is the papers' heterogeneous setting.
    seed : int
        Seed; the same seed gives the same partition.
    min_size : int
        Smallest acceptable client size; 0 accepts the first draw (clients may then be empty).
    max_tries : int
        Draws to attempt before giving up.

    Returns
    -------
    Partition
        Covers every index exactly once.

    Raises
    ------
    ValueError
        If ``alpha <= 0``, there are more clients than examples, or ``min_size`` cannot be met.
    RuntimeError
        If no draw in ``max_tries`` satisfies ``min_size``.
    """
    y, n_classes = _check_labels(y, n_clients)
    if not np.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a positive number, got {alpha}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    if min_size * n_clients > y.size:
        raise ValueError(
            f"min_size={min_size} for {n_clients} clients needs {min_size * n_clients} examples, "
            f"only {y.size} available"
        )
    rng = np.random.default_rng(seed)
    by_class = [np.flatnonzero(y == k) for k in range(n_classes)]
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
        for idx in by_class:
            if idx.size == 0:
                continue
            p = rng.dirichlet(np.full(n_clients, float(alpha)))
            cuts = np.rint(np.cumsum(p)[:-1] * idx.size).astype(np.int64)
            for j, chunk in enumerate(np.split(rng.permutation(idx), cuts)):
                parts[j].append(chunk)
        sizes = np.array([sum(c.size for c in part) for part in parts])
        if sizes.min() >= min_size:
            return _make_partition([np.concatenate(p) for p in parts], y, n_classes)
    raise RuntimeError(
        f"no Dirichlet(alpha={alpha}) draw in {max_tries} tries gave every one of {n_clients} "
        f"clients at least {min_size} examples; raise alpha, lower min_size or use fewer clients"
    )


def holdout_partition(part: Partition, y: np.ndarray, fraction: float, *, seed: int = 0) -> tuple[Partition, Partition]:
    """Keep back a share of every client's own examples, never to be trained on.

    A client that will score candidate fusions on its data (the temperature round of
    :func:`bayesfuse.fuse`) needs examples its local model was not fitted to: on its training
    data its own head looks better than it is, and the choice favours over-confident candidates.
    Each client's examples are shuffled (seeded per client) and ``round(fraction * n_j)`` of
    them, at least one, are held out; at least one stays for training.

    Parameters
    ----------
    part : Partition
        The clients' examples, indices into ``y``.
    y : ndarray of int, shape (n,)
        The labels ``part`` indexes (for the class counts of both parts).
    fraction : float
        The share held out, in (0, 1).
    seed : int
        Seed; the same seed gives the same split.

    Returns
    -------
    train, held : Partition
        Disjoint; together they are ``part``.

    Raises
    ------
    ValueError
        If ``fraction`` is not in (0, 1), or a client has fewer than two examples.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the held-out fraction must be in (0, 1), got {fraction}")
    y = np.asarray(y)
    n_classes = part.counts.shape[1]
    train, held = [], []
    for j, idx in enumerate(part):
        if idx.size < 2:
            raise ValueError(f"client {j} has {idx.size} example(s): nothing to hold out and train on")
        m = min(max(int(round(fraction * idx.size)), 1), idx.size - 1)
        shuffled = np.random.default_rng([seed, j]).permutation(idx)
        held.append(shuffled[:m])
        train.append(shuffled[m:])
    return _make_partition(train, y, n_classes), _make_partition(held, y, n_classes)
