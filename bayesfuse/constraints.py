"""The constraints of hyper-parameters: what values a key takes, checked in one place.

As scikit-learn declares its estimators' parameters (``_parameter_constraints``) and checks its
functions' with ``validate_params``: each constraint ``check``s a value (returning it converted,
raising a bare ``TypeError`` for a value of the wrong type and ``ValueError`` for one out of
range), names its type (``type_name``) and says in words what it allows (``str``). Only
:func:`check` turns those into the one error of a bad hyper-parameter,
:class:`InvalidParameterError`, with the one message of :func:`message`.

:data:`KEYS` holds the constraint of each hyper-parameter key, shared by the method table
(:mod:`bayesfuse.methods`) and by the algorithms (:mod:`bayesfuse.inference`), which check
their arguments once on entry with :func:`validate_params`. This module imports nothing of
bayesfuse.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, TypeVar, cast

__all__ = [
    "Interval",
    "Options",
    "Fixed",
    "Either",
    "Numbers",
    "OrNone",
    "Param",
    "Constraint",
    "InvalidParameterError",
    "message",
    "check",
    "validate_params",
    "KEYS",
    "POSITIVE",
    "NON_NEGATIVE",
    "POSITIVE_INT",
    "AUTO",
    "GAMMA0",
    "NUMBERS_OR_AUTO",
    "MATCHING",
]


class InvalidParameterError(ValueError, TypeError):
    """A hyper-parameter of the wrong type or out of its constraint.

    Both a ``ValueError`` and a ``TypeError`` (as scikit-learn's ``InvalidParameterError``), so
    that code catching either for a bad setting still catches it.
    """


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
            try:  # NumPy scalars (a bool has no item(): refused below)
                value = cast(Any, value).item()
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
class Numbers:
    """A number or an array-like of numbers (not a string, bool or None): the variances the
    matching takes per client or coordinate. Their shape and values are the data's to check,
    where the shapes are known; ``check`` returns the value as it is."""

    def check(self, value: Any) -> Any:
        if value is None or isinstance(value, (str, bytes, bool)):
            raise TypeError
        return value

    @property
    def type_name(self) -> str:
        return "number or array"

    def __str__(self) -> str:
        return "a number"


@dataclass(frozen=True)
class OrNone:
    """``constraint``, or ``None`` (which passes unchanged)."""

    constraint: Interval | Options | Either

    def check(self, value: Any) -> Any:
        return None if value is None else self.constraint.check(value)

    @property
    def type_name(self) -> str:
        return f"{self.constraint.type_name} or None"

    def __str__(self) -> str:
        return f"{self.constraint} or None"


@dataclass(frozen=True)
class Param:
    """A hyper-parameter: its key, constraint and what it does."""

    name: str
    constraint: Constraint
    help: str


#: Any of the constraints above.
Constraint = Interval | Options | Fixed | Either | Numbers | OrNone


# --------------------------------------------------------------------------- checking


def message(name: str, constraint: Constraint, value: Any, *, wrong_type: bool = False) -> str:
    """The one message of a bad hyper-parameter: ``"{name} must be {constraint}, got {value!r}"``;
    for a value of the wrong type, the type the constraint takes and the value's type too."""
    if wrong_type:
        return f"{name} must be {constraint.type_name} ({constraint}), got {value!r} ({type(value).__name__})"
    return f"{name} must be {constraint}, got {value!r}"


def check(name: str, constraint: Constraint, value: Any, *, shown: Any = None) -> Any:
    """``value`` checked by ``constraint`` and converted as it says; :class:`InvalidParameterError`
    with :func:`message` if it fails (a :class:`Fixed` value's own reason instead). ``shown``:
    what the message quotes as given (the text of a command-line item), ``value`` by default."""
    try:
        return constraint.check(value)
    except TypeError:
        err_type: bool = True
    except ValueError as err:
        if isinstance(constraint, Fixed) and str(err):
            raise InvalidParameterError(str(err)) from None
        err_type = False
    raise InvalidParameterError(
        message(name, constraint, value if shown is None else shown, wrong_type=err_type)
    ) from None


F = TypeVar("F", bound=Callable[..., Any])


def validate_params(**constraints: Constraint) -> Callable[[F], F]:
    """Check the named arguments of every call of the decorated function once, on entry, before
    it runs, as scikit-learn's ``validate_params``: :func:`check` for each argument the call
    gives (defaults are not checked; ``None`` passes where it is the parameter's default). The
    function receives the values converted as the constraints say (``n_iter=10.0`` as ``10``,
    NumPy scalars as Python numbers), as :func:`bayesfuse.methods.resolve` hands them out;
    other arguments are left alone. The constraints are on the wrapper's
    ``parameter_constraints``.

    Examples
    --------
    >>> @validate_params(n_iter=POSITIVE_INT)
    ... def sweeps(x, *, n_iter=10):
    ...     return n_iter
    >>> sweeps(None, n_iter=3.0)
    3
    >>> sweeps(None, n_iter=0)
    Traceback (most recent call last):
    ...
    bayesfuse.constraints.InvalidParameterError: n_iter must be a positive integer, got 0
    """

    def decorate(function: F) -> F:
        signature = inspect.signature(function)
        unknown = set(constraints) - set(signature.parameters)
        if unknown:
            raise TypeError(f"{function.__qualname__} has no parameters {sorted(unknown)}")
        none_passes = {k for k in constraints if signature.parameters[k].default is None}
        items = tuple(constraints.items())

        @functools.wraps(function)
        def checked(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            given = bound.arguments
            for name, constraint in items:
                if name in given and not (given[name] is None and name in none_passes):
                    given[name] = check(name, constraint, given[name])
            return function(*bound.args, **bound.kwargs)

        checked.parameter_constraints = dict(constraints)  # type: ignore[attr-defined]
        return checked  # type: ignore[return-value]

    return decorate


# --------------------------------------------------------------------------- the keys

POSITIVE = Interval(float, 0.0, None, "neither")
NON_NEGATIVE = Interval(float, 0.0, None, "left")
POSITIVE_INT = Interval(int, 1, None, "left")
AUTO = Options(("auto",))

# Bounds the matching's float64 arithmetic supports (the cost of PFNM supplement Prop. 2 and
# NAFI eq. 14 / Lemma 5.1, bayesfuse.inference.matching). Float64 ends near 1.8e308, normal
# numbers near 2.2e-308.
# * noise_var, prior_var (sigma^2, sigma0^2): the cost forms precisions p = 1/sigma^2 and squares
#   them (p^2 |v|^2 in Delta, p^2 / (lambda + p) in NAFI's KL), and the new-atom terms take the
#   ratio p / lambda0 = sigma0^2 / sigma^2. Below sigma^2 ~ 1e-154 the square alone overflows
#   (noise_var=1e-300 did); above ~ 3e307 the data term log(2 pi sigma^2) does (noise_var=1e308
#   gave an objective of -inf); 1 / sigma0^2 overflows for a subnormal prior_var (1e-310). Within
#   [1e-50, 1e50] no precision exceeds 1e50 and no square or ratio 1e100, which leaves a factor
#   1e200 for the products with squared weights, the unit dimension D and the clients J^2.
# * gamma0: enters as log(gamma0 / J) and -gamma0 H_J (the IBP's K log gamma0 - gamma0 H_J). The
#   first needs gamma0 / J > 0 (5e-324 gave "math domain error"), the second gamma0 H_J below the
#   float64 maximum; [1e-300, 1e300] keeps both for any J up to 1e8 clients (H_J < 20).
# * kl_weight: multiplies KL terms that reach sigma0^2 / sigma^2 <= 1e100 per coordinate within
#   the variance bounds; at most 1e50 keeps the product below 1e150 D.
VARIANCE = Interval(float, 1e-50, 1e50, "both", why="beyond, the matching cost's squared precisions overflow float64")
GAMMA0 = Interval(
    float, 1e-300, 1e300, "both", why="log(gamma0 / J) and gamma0 H_J of the IBP prior stay finite in float64"
)
#: The matching's variances as the algorithms take them: per client or coordinate too (their
#: positivity and shapes are checked with the data), or ``"auto"``.
NUMBERS_OR_AUTO = Either((Numbers(), AUTO))

#: The constraint of every hyper-parameter key: the method table's (:data:`bayesfuse.methods.PARAMS`,
#: where a method may replace one) and the algorithms' where they take the key as the table does.
KEYS: dict[str, Constraint] = {
    "noise_var": Either((VARIANCE, AUTO)),
    "prior_var": Either((VARIANCE, AUTO)),
    "gamma0": Either((GAMMA0, AUTO)),
    "kl_weight": Interval(
        float, 0.0, 1e50, "both", why="it multiplies KL terms up to 1e100; beyond, the cost overflows float64"
    ),
    "cost": Options(("auto", "pfnm", "marginal")),
    "global_weights": Options(("auto", "posterior", "average")),
    "n_iter": POSITIVE_INT,
    "tol": NON_NEGATIVE,
    "direction": Options(("bottom-up", "top-down")),
    "average_outputs": Options((True, False)),
    "unit_form": Options(("effective", "raw")),
    "head": Options(("shared", "clients")),
    "prune_kl": Interval(float, 0.0, 1e300, "both", why="a threshold in nats"),
    "prune_share": Interval(float, 0.0, 1.0, "left", why="a share of a layer's output"),
    "reg": POSITIVE,
    "anchor": Either((Interval(int, 0, None, "left"), Options(("widest", "median")))),
    "solver": Options(("auto", "cvxpy", "fast")),
    "passes": POSITIVE_INT,
}

#: The matching's keys as :func:`~bayesfuse.inference.matching.match_neurons` and its layer-wise
#: drivers take them (the variances per client or coordinate too; ``tol=None``: no tolerance).
MATCHING: dict[str, Constraint] = {
    "noise_var": NUMBERS_OR_AUTO,
    "prior_var": NUMBERS_OR_AUTO,
    "gamma0": KEYS["gamma0"],
    "kl_weight": KEYS["kl_weight"],
    "cost": KEYS["cost"],
    "n_iter": KEYS["n_iter"],
    "tol": OrNone(cast(Interval, KEYS["tol"])),
}
