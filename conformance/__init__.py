"""The suite itself: judging, running, the checks, and the front ends (the command line and the pytest plugin)."""

from kda_cases.shadowing import defer_if_shadowing

defer_if_shadowing(__name__, __file__, "kda_conformance")
