"""A user's network named on the command line: ``package.module:Class`` or ``path/to/file.py:Class``,
called with no arguments or with literal ones (``torchvision.models:resnet18(num_classes=10)``).

``bayesfuse fuse --model REF`` traces the architecture from the network itself instead of
reading a chain off the files' entry names (:func:`bayesfuse.fuse_files.fuse_files`, ``like``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
from pathlib import Path

from torch import nn

from bayesfuse._text import first_line

__all__ = ["model_from_reference"]


def model_from_reference(ref: str) -> nn.Module:
    """The network ``ref`` names, built by calling it with no arguments, or with the literal
    arguments ``ref`` gives.

    Parameters
    ----------
    ref : str
        ``module:attribute`` (``mypackage.nets:ResNet``, imported as Python imports it, the
        current directory first) or ``file.py:attribute``; the attribute is a class or function
        that returns an ``nn.Module`` of the files' architecture (any widths: they are read off
        the files). Arguments may follow it in parentheses, Python literals only, read with
        :func:`ast.literal_eval` (no expression in them is evaluated):
        ``torchvision.models:resnet18(num_classes=10)``, ``timm:create_model('convnext_atto',
        num_classes=10)``. The callable named is imported and called with them, so a reference
        is code to trust as the command line it is given on.

    Raises
    ------
    ValueError
        One line: the reference is malformed, an argument is no literal, the module cannot be
        imported, the attribute is missing, its call fails, or it returns no ``nn.Module``.
    """
    found = _REFERENCE.fullmatch(ref)
    if found is None:
        raise ValueError(
            f"--model {ref!r}: expected MODULE:NAME or FILE.py:NAME, with literal arguments if any, e.g. "
            "mynets:ResNet, nets.py:ResNet or torchvision.models:resnet18(num_classes=10)"
        )
    where, attribute, call = found["where"], found["name"], found["call"]
    args, kwargs = _literal_arguments(ref, attribute + call) if call else ((), {})
    try:
        module = _import(where)
    except Exception as err:  # the user's module failing to import, whatever it raises
        raise ValueError(
            f"--model {ref!r}: cannot import {where} ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''})"
        ) from None
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        raise ValueError(f"--model {ref!r}: {where} has no class or function {attribute!r}")
    try:
        model = factory(*args, **kwargs)
    except Exception as err:  # a constructor that needs arguments, say
        raise ValueError(
            f"--model {ref!r}: {attribute}{' '.join((call or '()').split())} failed ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); name a class or "
            "function that builds the network, with its arguments in parentheses if it needs any"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {ref!r}: {attribute}() returned a {type(model).__name__}, not an nn.Module")
    return model


def _literal_arguments(ref: str, call: str) -> tuple[tuple, dict]:
    """The positional and keyword arguments of ``call`` (``name(1, width=0.5)``), literals only."""
    try:
        node = ast.parse(call, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):  # one call: f(1)(2) is two
            raise ValueError("one call of the name, f(...)")
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            raise ValueError("no *arguments or **arguments")
        names = [k.arg for k in node.keywords]
        if len(set(names)) != len(names):
            raise ValueError("an argument given twice")
        return (
            tuple(ast.literal_eval(a) for a in node.args),
            {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None},
        )
    except (SyntaxError, ValueError, TypeError) as err:
        raise ValueError(
            f"--model {ref!r}: its arguments must be Python literals (numbers, strings, tuples, lists, dicts, "
            f"True/False/None), by place or by name ({first_line(err)})"
        ) from None


#: ``WHERE:NAME`` or ``WHERE:NAME(ARGS)``: the name is the last identifier after a colon that
#: ends the reference or opens its arguments (a path may hold parentheses: ``nets (1).py:build``).
_REFERENCE = re.compile(r"(?P<where>.+):(?P<name>[A-Za-z_]\w*)(?P<call>\(.*\))?", re.DOTALL)

#: The name a ``--model FILE.py:NAME`` file is imported under (``_bayesfuse_model_FILE``).
FILE_MODULE_PREFIX = "_bayesfuse_model_"


def _import(where: str):
    path = Path(where)
    if where.endswith(".py"):
        if not path.is_file():
            raise FileNotFoundError(f"no file {where}")
        spec = importlib.util.spec_from_file_location(f"{FILE_MODULE_PREFIX}{path.stem}", path)
        assert spec is not None and spec.loader is not None  # a .py file: read by a source loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` would find the user's own package
    return importlib.import_module(where)
