"""Keeps the repository's bare folder names from shadowing other packages.

The design card's folders (``kernels/``, ``reports/``, ...) are installed under
``kda_*`` names (``pyproject.toml``). When the repository root itself is on
``sys.path`` (``python -m ...`` run from the root), ``import kernels`` would
find our folder before, say, the PyPI package ``kernels``. Each folder's
``__init__`` calls :func:`defer_if_shadowing`, which hands such an import to the
next package of that name on ``sys.path``. When there is none, nothing is
shadowed and the import goes ahead (pytest imports the suite's test files under
the folder's bare name).

It lives in the bottom layer (``kda_cases``) so that every folder can call it
without importing a layer above its own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def defer_if_shadowing(name: str, init_file: str, installed_name: str) -> None:
    """Called from a folder's ``__init__``: if it was imported under its bare name, import the real one."""
    if name == installed_name:
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
