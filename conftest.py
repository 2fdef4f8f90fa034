"""pytest set-up for the package's doctests (``--doctest-modules``, over ``bayesfuse`` too).

Collecting doctests imports every module of the package. A module that imports an optional
dependency at its top is left out when that dependency is not installed (its tests skip then too).
"""

import importlib.util

#: Module file or package directory -> the optional distribution it imports at its top (the extra that brings it).
OPTIONAL = {
    "bayesfuse/integrations/flower": "flwr",  # bayesfuse[flower] (the package)
}

collect_ignore = [path for path, module in OPTIONAL.items() if importlib.util.find_spec(module) is None]
