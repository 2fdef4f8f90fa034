"""The constraints of hyper-parameters: what values a key takes, checked in one place.

As scikit-learn declares its estimators' parameters (``_parameter_constraints``): each
constraint ``check``s a value (returning it converted, raising ``TypeError`` for a value of the
wrong type and ``ValueError`` for one out of range), names its type (``type_name``) and says
in words what it allows (``str``). The method table (:mod:`bayesfuse.methods`) gives every key
of every method one of them. This module imports nothing of bayesfuse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Interval", "Options", "Fixed", "Either", "Param", "Constraint"]


@dataclass(frozen=True)
class Interval:
    """A real (``float``) or integer (``int``) number in an interval; ``None`` bounds are open."""

    type: type
    low: float | None = None
    high: float | None = None
    closed: str = "neither"  # "left", "right", "both" or "neither"
    why: str = ""  # why the bounds are where they are; shown with them

    def check(self, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:  # NumPy scalars
                value = value.item()
            except AttributeError:
                raise TypeError from None
        if self.type is int:
            if isinstance(value, float) and not value.is_integer():
                raise TypeError
            value = int(value)
        else:
            value = float(value)
        if not math.isfinite(value):
            raise ValueError
        left = self.low is None or value > self.low or (self.closed in ("left", "both") and value == self.low)
        right = self.high is None or value < self.high or (self.closed in ("right", "both") and value == self.high)
        if not (left and right):
            raise ValueError
        return value

    @property
    def type_name(self) -> str:
        return self.type.__name__

    def __str__(self) -> str:
        text = self._bounds()
        return f"{text} ({self.why})" if self.why else text

    def _bounds(self) -> str:
        name = "an integer" if self.type is int else "a number"
        low_closed = self.closed in ("left", "both")
        lb = "[" if low_closed else "("
        rb = "]" if self.closed in ("right", "both") else ")"
        if self.low is not None and self.high is not None and self.low >= 0 and self.type is float:
            if self.low == 0 and low_closed:  # [0, high]
                return f"non-negative, at most {self.high:g}" if rb == "]" else f"non-negative, below {self.high:g}"
            return f"positive, in {lb}{self.low:g}, {self.high:g}{rb}"
        if self.high is None and self.low == 0 and not low_closed:
            return "positive"
        if self.high is None and self.low == 0:
            return "a non-negative integer" if self.type is int else "non-negative"
        if self.high is None and self.type is int and self.low == 1 and low_closed:
            return "a positive integer"
        if self.low is not None and self.high is None:
            return f"{name} {'>=' if self.closed in ('left', 'both') else '>'} {self.low:g}"
        if self.high is not None and self.low is None:
            return f"{name} {'<=' if self.closed in ('right', 'both') else '<'} {self.high:g}"
        if self.low is None:
            return name
        return f"{name} in {lb}{self.low:g}, {self.high:g}{rb}"


@dataclass(frozen=True)
class Options:
    """One of a set of strings (or booleans, for flags)."""

    options: tuple

    def check(self, value: Any) -> Any:
        if not isinstance(value, (str, bool)):
            raise TypeError
        if value in self.options and type(value) in {type(o) for o in self.options}:
            return value
        raise ValueError

    @property
    def type_name(self) -> str:
        return "bool" if all(isinstance(o, bool) for o in self.options) else "str"

    def __str__(self) -> str:
        if all(isinstance(o, bool) for o in self.options):
            return "true or false"
        return "one of " + ", ".join(repr(o) for o in self.options)


@dataclass(frozen=True)
class Fixed:
    """A value a method does not let change, with the reason given when someone tries."""

    value: Any
    reason: str

    def check(self, value: Any) -> Any:
        if value != self.value:
            raise ValueError(self.reason)
        return self.value

    @property
    def type_name(self) -> str:
        return type(self.value).__name__

    def __str__(self) -> str:
        return f"fixed at {self.value!r}"


@dataclass(frozen=True)
class Either:
    """A value satisfying one of several constraints (e.g. a positive number or ``"auto"``)."""

    choices: tuple

    def check(self, value: Any) -> Any:
        wrong_type = True
        for c in self.choices:
            try:
                return c.check(value)
            except TypeError:
                continue
            except ValueError:
                wrong_type = False
        raise TypeError if wrong_type else ValueError

    @property
    def type_name(self) -> str:
        return " or ".join(c.type_name for c in self.choices)

    def __str__(self) -> str:
        return " or ".join(str(c) for c in self.choices)


@dataclass(frozen=True)
class Param:
    """A hyper-parameter: its key, constraint and what it does."""

    name: str
    constraint: Interval | Options | Fixed | Either
    help: str


#: Any of the constraints above.
Constraint = Interval | Options | Fixed | Either
