"""Messages for people: one plain line, the closest known name for a misspelt one, and warnings
that point at the caller's line.

Imports nothing of bayesfuse and nothing heavy, so that the command line can check its
arguments with it before torch is imported.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import warnings
from types import FrameType
from typing import Iterable

__all__ = ["plain_line", "did_you_mean", "warn_from_caller"]

#: The package's directory: frames of files under it are the package's own.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep

#: Terminal control sequences (colours, bold: ``ESC [ 1 m``) and other C0 control characters.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f]")


def plain_line(text: str) -> str:
    """``text`` without terminal escape codes, its whitespace (newlines too) collapsed to single spaces.

    Examples
    --------
    >>> plain_line("do this \\x1b[1monly if\\x1b[0m you\\n trust it")
    'do this only if you trust it'
    """
    return " ".join(_ESCAPES.sub("", text).split())


def first_line(err: BaseException) -> str:
    """The first line of an error's message, without terminal escape codes (torch colours some);
    the error's type name when it has no message."""
    lines = str(err).strip().splitlines()
    return plain_line(lines[0]) if lines else type(err).__name__


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``word`` (:func:`difflib.get_close_matches`),
    or ``""`` when none is close.

    Examples
    --------
    >>> did_you_mean("noise_vr", ["noise_var", "prior_var"])
    " (did you mean 'noise_var'?)"
    """
    close = difflib.get_close_matches(word, list(dict.fromkeys(choices)), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def warn_from_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the first caller outside the bayesfuse package (the user's
    line, however many of the package's functions lie between), so that the warning shows the
    line that asked for what it is about rather than a line of the package."""
    frame: FrameType | None = sys._getframe(0)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
