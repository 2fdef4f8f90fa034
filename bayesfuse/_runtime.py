"""Run-time settings shared by the training loops: torch's thread count and progress bars."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch

__all__ = ["torch_threads", "progress"]


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run a block with ``torch.set_num_threads(n)``, restoring the previous value after."""
    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def progress(verbose: bool | None) -> bool:
    """Whether to show a progress bar: ``verbose``, or when it is ``None``, whether stderr is a terminal."""
    return sys.stderr.isatty() if verbose is None else bool(verbose)
