"""The suite itself: comparison, the sweep, the pytest plugin and the command line."""

from .layout import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_conformance")
