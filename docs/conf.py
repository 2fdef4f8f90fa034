"""Sphinx configuration of the bayesfuse documentation: ``make docs`` builds it into
``docs/_build/html`` with warnings as errors.

The API reference is generated from the docstrings (autosummary + numpydoc), maths is rendered
by a MathJax bundled with the site (sphinx-mathjax-offline: the pages need no network), the
notebooks are executed at their CI sizes with a cache (myst-nb + jupyter-cache), and the pages
under ``_generated/`` (method table, command-line help, benchmarks) are written at build time
by ``_ext/bayesfuse_docs.py`` from the package and the benchmarks' JSON outputs.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE / "_ext"))

# The notebooks read `smoke_test = "CI" in os.environ`: the site shows them at their CI sizes.
# The kernels that myst-nb starts inherit this environment.
os.environ["CI"] = "1"
os.environ.pop("MPLBACKEND", None)  # the kernels draw inline (the tests set Agg)

import bayesfuse  # noqa: E402

project = "bayesfuse"
author = "the bayesfuse developers"
copyright = "the bayesfuse developers"
release = bayesfuse.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "numpydoc",
    "myst_nb",
    "sphinx-mathjax-offline",
    "bayesfuse_docs",
]

exclude_patterns = [
    "_build",
    "decisions.md",
    "make_figures.py",
    "**.ipynb_checkpoints",
    "_generated/methods.md",
    "_generated/cli.md",
    "benchmark-results",
]
templates_path = ["_templates"]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
root_doc = "index"

# API reference
autosummary_generate = True
autosummary_imported_members = False
autodoc_typehints = "none"
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = False
numpydoc_xref_param_type = False

# Markdown and notebooks
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "cache"
nb_execution_cache_path = str(HERE / "_build" / ".jupyter_cache")
nb_execution_timeout = 900
nb_execution_raise_on_error = True
nb_merge_streams = True

# HTML
html_theme = "pydata_sphinx_theme"
html_title = f"bayesfuse {release}"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_show_sourcelink = False
html_favicon = "favicon.svg"

# numpydoc warns of a section it does not know even where _ext/bayesfuse_docs.py has moved the
# "Choosing ..." sections into the Notes of the rendered page (its summaries re-read the source).
warnings.filterwarnings("ignore", message="Unknown section Choosing", category=UserWarning)
# The theme's colour mode when the reader has chosen none (left empty, its script logs an error).
html_context = {"default_mode": "auto"}
