"""A user's network named on the command line: ``package.module:Class`` or ``path/to/file.py:Class``.

``bayesfuse fuse --model REF`` traces the architecture from the network itself instead of
reading a chain off the files' entry names (:func:`bayesfuse.fuse_files.fuse_files`, ``like``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from torch import nn

__all__ = ["model_from_reference"]


def model_from_reference(ref: str) -> nn.Module:
    """The network ``ref`` names, built by calling it with no arguments.

    Parameters
    ----------
    ref : str
        ``module:attribute`` (``mypackage.nets:ResNet``, imported as Python imports it, the
        current directory first) or ``file.py:attribute``; the attribute is a class or function
        that returns an ``nn.Module`` of the files' architecture when called with no arguments
        (any widths: they are read off the files).

    Raises
    ------
    ValueError
        One line: the reference is malformed, the module cannot be imported, the attribute is
        missing, its call fails, or it returns no ``nn.Module``.
    """
    where, sep, attribute = ref.rpartition(":")
    if not sep or not where or not attribute.isidentifier():
        raise ValueError(f"--model {ref!r}: expected MODULE:NAME or FILE.py:NAME, e.g. mynets:ResNet or nets.py:ResNet")
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
        model = factory()
    except Exception as err:  # a constructor that needs arguments, say
        raise ValueError(
            f"--model {ref!r}: {attribute}() failed ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); name a class or "
            "function that builds the network with no arguments"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {ref!r}: {attribute}() returned a {type(model).__name__}, not an nn.Module")
    return model


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
