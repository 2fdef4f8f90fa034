"""Hyper-parameters as the command line gives them: ``KEY=VALUE`` text, typed and checked.

``bayesfuse fuse --hyper noise_var=2 cost=marginal`` and ``bayesfuse demo --hyper ...`` hand
their items to :func:`parse_assignments` (through :func:`bayesfuse.methods.parse_assignments`,
which finds the method's row by name). Each value is read as its key's constraint says
(:mod:`bayesfuse.constraints`), then checked by it (:func:`bayesfuse.constraints.check`).
"""

from __future__ import annotations

from typing import Any, Iterable

from bayesfuse._text import did_you_mean
from bayesfuse.constraints import Either, InvalidParameterError, check, message

__all__ = ["parse_assignments"]


def parse_assignments(method, items: Iterable[str]) -> dict[str, Any]:
    """``["noise_var=2", "cost=marginal"]`` -> typed values, checked against ``method``'s keys.

    ``method`` is a row of the method table (:class:`bayesfuse.methods.Method`). Keys of any
    kind the method takes are accepted here; :func:`bayesfuse.methods.resolve` later checks them
    against the kind of the inputs.
    """
    known = method.keys()
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"hyper-parameters are given as key=value, got {item!r}")
        if key not in known:
            raise ValueError(
                f"unknown hyper-parameter {key!r} for {method.name}{did_you_mean(key, known)}; known: {_known(method)}"
            )
        if key in out:
            raise ValueError(f"hyper-parameter {key} given twice")
        constraint = method.constraint(key)
        try:
            value = text.strip() if constraint.type_name == "str" else _typed(constraint, text.strip())
        except (TypeError, ValueError):  # the text reads as no value of the constraint's type
            raise InvalidParameterError(message(f"hyper-parameter {key}", constraint, text, wrong_type=True)) from None
        out[key] = check(f"hyper-parameter {key}", constraint, value, shown=text)
    return out


def _known(method) -> str:
    """The method's keys, those every kind of input takes first, then each kind's own:
    ``"noise_var, ..., head; for BNNs also kl_weight, prune_kl, prune_share"``."""
    kinds = method.kinds
    common = [k for k in method.keys() if all(k in method.defaults[kind] for kind in kinds)]
    parts = [", ".join(common) or "none"]
    for kind in kinds:
        own = [k for k in method.keys(kind) if k not in common]
        if own:
            parts.append(f"for {_KIND_NAMES.get(kind, kind)} also {', '.join(own)}")
    return "; ".join(parts)


_KIND_NAMES = {"network": "networks", "bnn": "BNNs"}


def _typed(constraint, text: str) -> Any:
    """``text`` as the constraint's type (no range check)."""
    if isinstance(constraint, Either):
        for c in constraint.choices:
            try:
                value = text if c.type_name == "str" else _typed(c, text)
                return c.check(value)
            except (TypeError, ValueError):
                continue
        return _typed(constraint.choices[0], text)  # its conversion error, or a value the check refuses
    if constraint.type_name == "bool":
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError
    return {"int": int, "float": float}[constraint.type_name](text)
