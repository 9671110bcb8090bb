"""Fixtures the suite's tests of itself share."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).with_name("plugins")


@pytest.fixture(scope="module")
def planted_zoo() -> dict[str, tuple[str, str]]:
    """The planted-bug backends of tests/plugins/kda_planted_bugs.py, registered: name -> (what it models,
    where the bug was seen)."""
    sys.path.insert(0, str(PLUGINS))
    try:
        import kda_planted_bugs
    finally:
        sys.path.remove(str(PLUGINS))
    return kda_planted_bugs.ZOO
