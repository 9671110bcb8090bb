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


# The slowest module first: its one detection run (about 3 minutes in one process) then overlaps the rest of
# the suite on the other pytest-xdist workers instead of running alone at the end.
FIRST = ("test_planted_bugs.py",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: every other test keeps its order
