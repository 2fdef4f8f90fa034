"""Lazy exports of a package face (PEP 562): names imported from their module on first use; and
:func:`load`, an object named by its dotted path."""

from __future__ import annotations

import importlib
from typing import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` for ``exports`` (name -> module path).

    A name that is itself a submodule (``"expfam": "bayesfuse.inference.expfam"``) gives the
    module. The value is cached in ``namespace`` (the package's ``globals()``).
    """

    def __getattr__(name: str):
        try:
            module = exports[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        imported = importlib.import_module(module)
        value = imported if module == f"{package}.{name}" else getattr(imported, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


def load(path: str):
    """The object ``"package.module:name"`` names, its module imported on first use (the method
    table names routines of modules above it this way, :data:`bayesfuse.methods.METHODS`)."""
    module, sep, name = path.partition(":")
    if not sep or not name:
        raise ValueError(f"expected 'module:name', got {path!r}")
    return getattr(importlib.import_module(module), name)
